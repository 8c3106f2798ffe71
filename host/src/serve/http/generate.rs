//! `POST /v1/chat/completions` and `POST /v1/completions`: a body checked once into a plan,
//! the tenant's policy and quotas, the plugin's preprocess, the prompt tokenized and checked
//! against the model, then the engine's answer as JSON or SSE.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{SystemTime, UNIX_EPOCH};

use http_body_util::BodyExt;
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::{Response, StatusCode};
use tokio::sync::mpsc;

use super::reply::{Body, error_response, json_response, model_not_found};
use crate::engine::request::ValidRequest;
use crate::grammar::{Format, GrammarError};
use crate::plugin::KvAccess;
use crate::policy::Policy;
use crate::runner::{Busy, EndFlag, EngineKv, Job, SeqSlot, Update};
use crate::serve::access::{Access, random_id};
use crate::serve::error::ApiError;
use crate::serve::openai::{Asked, ChatRequest, CompletionRequest, Plan, RequestLimits, Shape, field_label};
use crate::serve::plugins::pipeline::{Hooks, Reporter};
use crate::serve::quota::Grant;
use crate::serve::state::{Served, State};
use crate::serve::store::Tenant;
use crate::serve::stream::{Api, Responder, SseBody};
use crate::serve::tools::{CallReader, Tools, render};
use crate::tenant::TenantId;

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Runs CPU-heavy request preparation (template rendering, tokenizing up to a whole body) on
/// the blocking pool, so it never stalls the connections the runtime serves.
pub(super) async fn off_runtime<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.unwrap_or_else(|e| {
        Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            format!("preparing the request failed: {e}"),
        ))
    })
}

/// A request its tenant's policy let in.
pub(super) struct Admitted {
    /// The model it named.
    model: Arc<Served>,
    /// The tenant's policy, from the set in force when the request arrived.
    policy: Policy,
    /// That set's generation.
    generation: u64,
    /// The request's hold on the tenant's quotas.
    grant: Arc<Grant>,
    /// Request limits under the policy.
    lim: RequestLimits,
}

/// What the tenant's policy allows a request of `n` choices (as asked: a bad `n` is refused
/// with the rest of the request's fields) before anything of it runs: the model (403), its
/// concurrency, where each choice counts, and requests per minute (429).
pub(super) fn admit(state: &Arc<State>, t: &Tenant, served: Arc<Served>, n: Option<i64>) -> Result<Admitted, ApiError> {
    let model = served.id.as_str();
    let set = state.quotas.set();
    let policy = set.of(&t.name).clone();
    if !policy.allows_model(model) {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "model_not_allowed",
            format!(
                "tenant {:?} may not use model {model:?} (its policy's allowed_models)",
                t.name
            ),
        ));
    }
    let n = n.map_or(1, |n| n.clamp(1, served.request_limits.max_n as i64) as u64);
    let grant = Arc::new(state.quotas.admit(t, &policy, n)?);
    let mut lim = served.request_limits;
    if let Some(m) = policy.max_tokens.get() {
        // A request that names no max_tokens gets the policy's, if that is lower.
        lim.default_max_tokens = lim.default_max_tokens.min(m as usize);
    }
    Ok(Admitted {
        model: served,
        policy,
        generation: set.generation,
        grant,
        lim,
    })
}

/// The policy's limits on a request of `prompt` tokens (400), then its tokens against the
/// tenant's rates and quotas (429), then the prompt against the model (400): all before anything
/// is queued. What passes is the request the engine takes, checked this once.
fn limit(state: &State, t: &Tenant, a: &Admitted, plan: Plan, prompt: Vec<u32>) -> Result<ValidRequest, ApiError> {
    let policy = &a.policy;
    let prompt_len = prompt.len() as u64;
    // A request that names no max_tokens gets what its context leaves, its policy's too.
    let mut params = plan
        .params
        .at_most(a.model.admission.context().saturating_sub(prompt.len()));
    if let Some(m) = policy.max_context.get() {
        params = params.at_most(m.saturating_sub(prompt_len) as usize);
    }
    let max_tokens = params.max_tokens() as u64;
    if let Some(m) = policy.max_tokens.get()
        && max_tokens > m
    {
        return Err(ApiError {
            status: StatusCode::BAD_REQUEST,
            code: "max_tokens_over_policy",
            message: format!(
                "max_tokens is {max_tokens}, more than tenant {:?}'s policy allows ({m})",
                t.name
            ),
            param: Some("max_tokens".into()),
            retry_after: None,
        });
    }
    if let Some(m) = policy.max_context.get()
        && prompt_len + max_tokens > m
    {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "context_over_policy",
            format!(
                "the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) is {} tokens, more than tenant {:?}'s policy allows ({m})",
                prompt_len + max_tokens,
                t.name
            ),
        ));
    }
    let n = plan.shape.n as u64;
    if params.open_ended() {
        // As many tokens as the tenant's quotas have room for now.
        let room = a.grant.reserve_up_to(prompt_len, n, max_tokens, policy)?;
        params = params.at_most(room as usize);
    } else {
        a.grant.reserve(prompt_len + max_tokens * n, policy)?;
    }
    params.with_prompt(t.id, prompt, &a.model.admission).map_err(|reason| {
        state.metrics.rejected(&t.name, Some(&a.model.id), reason.code());
        reason.into()
    })
}

/// Counts a refused request in its tenant's usage, by error code, and in the metrics when its
/// tenant's policy or quotas refused it; `model` is the served model it named, once known.
pub(super) fn counted(
    state: &State,
    t: &Tenant,
    model: Option<&str>,
    r: Result<Response<Body>, ApiError>,
) -> Result<Response<Body>, ApiError> {
    if let Err(e) = &r {
        state.quotas.usage.reject(t.id, &t.name, e.code);
        if e.status == StatusCode::TOO_MANY_REQUESTS || e.status == StatusCode::FORBIDDEN {
            state.metrics.rejected(&t.name, model, e.code);
        }
    }
    r
}

/// Counts the fields a request's body held that the server ignored, and names them in the
/// response (an error's too) in `x-warden-ignored-fields`.
fn name_ignored(
    state: &State,
    ignored: &[String],
    r: Result<Response<Body>, ApiError>,
) -> Result<Response<Body>, ApiError> {
    if ignored.is_empty() {
        return r;
    }
    let paths: Vec<String> = ignored
        .iter()
        .map(|p| match (p.find('['), p.find(']')) {
            // Indices dropped: `messages[].refusal` is counted as one field.
            (Some(a), Some(b)) if a < b => format!("{}{}", &p[..=a], &p[b..]),
            _ => p.clone(),
        })
        .collect();
    state.metrics.ignored_fields(&paths);
    let mut resp = r.unwrap_or_else(|e| {
        state.metrics.http_error(e.code);
        error_response(&e)
    });
    let listed: Vec<String> = ignored.iter().map(|p| field_label(p)).collect();
    if let Ok(v) = HeaderValue::from_str(&listed.join(", ")) {
        resp.headers_mut().insert("x-warden-ignored-fields", v);
    }
    Ok(resp)
}

pub(super) async fn chat(
    state: &Arc<State>,
    t: Tenant,
    body: &[u8],
    access: &Arc<Access>,
) -> Result<Response<Body>, ApiError> {
    let mut model = None;
    let mut ignored = Vec::new();
    let r = async {
        let r = ChatRequest::parse(body, state.cfg.limits.json_depth, state.cfg.limits.unknown_fields)?;
        ignored.clone_from(&r.ignored);
        let served = state
            .model(&r.common.model)
            .ok_or_else(|| model_not_found(&r.common.model))?;
        model = Some(served.id.clone());
        access.model(&served.id);
        let a = admit(state, &t, served.clone(), r.common.n)?;
        let asked = Asked::Chat(r.chat_messages()?);
        let plan = r.plan(&a.lim)?;
        let id = random_id("chatcmpl-");
        access.response_id(&id);
        let (prompt, plan, hooks) = prepare(state, &t, &a, asked, plan, r.common.plugin.as_deref(), access).await?;
        let (shape, format) = (plan.shape, plan.format.clone());
        let reply = Reply {
            calls: plan.tools.as_ref().and_then(Tools::reader),
            echo: None,
        };
        let req = limit(state, &t, &a, plan, prompt)?.with_request_id(access.id());
        let req = constrain(&a, t.id, &format, req).await?;
        generate(state, &t, req, format, shape, Api::Chat, reply, id, hooks, a, access).await
    }
    .await;
    name_ignored(state, &ignored, counted(state, &t, model.as_deref(), r))
}

pub(super) async fn completions(
    state: &Arc<State>,
    t: Tenant,
    body: &[u8],
    access: &Arc<Access>,
) -> Result<Response<Body>, ApiError> {
    let mut model = None;
    let mut ignored = Vec::new();
    let r = async {
        let r = CompletionRequest::parse(body, state.cfg.limits.json_depth, state.cfg.limits.unknown_fields)?;
        ignored.clone_from(&r.ignored);
        let served = state
            .model(&r.common.model)
            .ok_or_else(|| model_not_found(&r.common.model))?;
        model = Some(served.id.clone());
        access.model(&served.id);
        let a = admit(state, &t, served.clone(), r.common.n)?;
        let asked = r.asked()?;
        let plan = r.common.plan(&a.lim, r.logprobs()?)?;
        // The prompt as the client sent it (a plugin may rewrite what the model sees).
        let echo = match (r.echo()?, &asked) {
            (false, _) => None,
            (true, Asked::Text(text)) => Some(text.clone()),
            (true, Asked::Tokens(ids)) => Some(a.model.tokenizer.decode(ids)),
            (true, Asked::Chat(_)) => None,
        };
        let id = random_id("cmpl-");
        access.response_id(&id);
        let (prompt, plan, hooks) = prepare(state, &t, &a, asked, plan, r.common.plugin.as_deref(), access).await?;
        let (shape, format) = (plan.shape, plan.format.clone());
        let req = limit(state, &t, &a, plan, prompt)?.with_request_id(access.id());
        let req = constrain(&a, t.id, &format, req).await?;
        let reply = Reply { calls: None, echo };
        generate(
            state,
            &t,
            req,
            format,
            shape,
            Api::Completion,
            reply,
            id,
            hooks,
            a,
            access,
        )
        .await
    }
    .await;
    name_ignored(state, &ignored, counted(state, &t, model.as_deref(), r))
}

/// Puts `req`'s output under its `format`, compiled for its tenant against the model's
/// vocabulary (see [`crate::grammar::TenantGrammars`]: in the tenant's turn, checked in a child
/// process stopped at the time and memory limits, kept for the tenant's next request): a format
/// the compiler refuses, or that runs past a limit, is a 400 naming `response_format` (or
/// `tools`, whose schemas make the grammar of required calls). Every choice gets its own copy
/// (see [`ValidRequest::choice`]).
async fn constrain(
    a: &Admitted,
    tenant: TenantId,
    format: &Format,
    req: ValidRequest,
) -> Result<ValidRequest, ApiError> {
    let field = match format {
        Format::Text => return Ok(req),
        Format::Grammar(_) => "tools",
        Format::JsonObject | Format::JsonSchema(_) => "response_format",
    };
    let grammars = a.model.grammars.clone();
    // The vocabulary's trie (built once, at start) is not the request's to wait for.
    let warm = grammars.grammars().clone();
    off_runtime(move || {
        warm.warm();
        Ok(())
    })
    .await?;
    match grammars.compile(tenant, format).await {
        Ok(c) => Ok(req.with_constraint(c)),
        Err(e @ GrammarError::Unavailable(_)) => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "structured_output_unavailable",
            format!("{field}: {e}"),
        )),
        Err(e) => Err(ApiError::field(field, format!("{field}: {e}"))),
    }
}

/// Runs the request's plugin (`plugin`, or the tenant's default), if it has one, on what it asks
/// and its parameters, then renders and tokenizes what it asks (off the runtime). Returns the
/// prompt, the plan as the plugin left it, and the plugin's hooks for the output.
async fn prepare(
    state: &Arc<State>,
    t: &Tenant,
    a: &Admitted,
    mut asked: Asked,
    mut plan: Plan,
    plugin: Option<&str>,
    access: &Access,
) -> Result<(Vec<u32>, Plan, Option<Hooks>), ApiError> {
    let id = access.id();
    let resolved = match state.plugins.chosen(t, plugin)? {
        Some(name) if !a.policy.allows_plugin(&name) => {
            return Err(ApiError {
                status: StatusCode::FORBIDDEN,
                code: "plugin_not_allowed",
                message: format!(
                    "tenant {:?} may not run plugin {name:?} (its policy's allowed_plugins)",
                    t.name
                ),
                param: Some("plugin".into()),
                retry_after: None,
            });
        }
        Some(name) => {
            let resolved = state.plugins.resolve(t, &a.policy, name).await?;
            // A name the registry knows: never the client's text as such.
            access.plugin(&resolved.name);
            Some(resolved)
        }
        None => None,
    };
    let mut hooks = None;
    if let Some(resolved) = resolved {
        let share = state.plugins.take_instances(t, &a.policy, plan.shape.n)?;
        let seed = plan.params.sampling().seed.unwrap_or_else(rand::random);
        let reporter = Reporter {
            metrics: state.metrics.clone(),
            tenant: t.name.clone(),
            tenant_id: t.id,
            request: id.to_string(),
            logs: state.plugins.logs().clone(),
            grant: a.grant.clone(),
        };
        let mut h = Hooks::new(
            resolved,
            state.plugins.limits_for(&a.policy),
            share,
            a.model.tokenizer.clone(),
            seed,
            reporter,
            state.cfg.limits.body_bytes,
        )
        .await?;
        let metadata = vec![
            ("tenant".to_string(), t.name.clone()),
            ("request-id".into(), id.to_string()),
            ("model".into(), a.model.id.clone()),
        ];
        (asked, plan.params) = h.preprocess(asked, plan.params, metadata).await?;
        hooks = Some(h);
    }
    let prompt = match asked {
        Asked::Tokens(ids) => ids,
        Asked::Text(text) => {
            let tk = a.model.tokenizer.clone();
            off_runtime(move || Ok(tk.encode(&text, true))).await?
        }
        Asked::Chat(messages) => {
            let template = a.model.chat.as_ref().ok_or_else(|| {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "no_chat_template",
                    "this model has no chat template; use /v1/completions",
                )
            })?;
            let (template, tk) = (template.clone(), a.model.tokenizer.clone());
            let tools = plan.tools.as_ref().and_then(Tools::shown);
            off_runtime(move || {
                let text = render(&template, messages, tools.as_ref(), true)
                    .map_err(|e| ApiError::field("messages", format!("rendering the chat template: {e}")))?;
                Ok(tk.encode_chat(&text))
            })
            .await?
        }
    };
    Ok((prompt, plan, hooks))
}

/// How the output is answered beyond its text.
struct Reply {
    /// A chat's tools: each choice's output is read for calls.
    calls: Option<CallReader>,
    /// Completions' `echo`: the prompt before each choice's text.
    echo: Option<String>,
}

/// Submits and answers a validated request in its `shape`: a JSON body, or an SSE stream that
/// starts once every choice is admitted (so a rejection is an error status, never a 200).
#[allow(clippy::too_many_arguments)]
async fn generate(
    state: &Arc<State>,
    t: &Tenant,
    req: ValidRequest,
    format: Format,
    shape: Shape,
    api: Api,
    reply: Reply,
    id: String,
    hooks: Option<Hooks>,
    a: Admitted,
    access: &Arc<Access>,
) -> Result<Response<Body>, ApiError> {
    let (settings, policy_generation, grant, model) = (a.policy.tenant_settings(), a.generation, a.grant, a.model);
    if state.shutting_down.load(Ordering::SeqCst) {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "shutting_down",
            "the server is shutting down",
        ));
    }
    let stops: Vec<Arc<EndFlag>> = (0..shape.n).map(|_| Arc::new(EndFlag::default())).collect();
    let slots: Vec<Arc<SeqSlot>> = (0..shape.n).map(|_| Arc::new(SeqSlot::default())).collect();
    // Every choice's plugin instance exists before anything is queued.
    let output = match hooks {
        Some(h) => {
            let choices = stops
                .iter()
                .zip(&slots)
                .map(|(stop, slot)| {
                    let kv: Arc<dyn KvAccess> = Arc::new(EngineKv::new(model.engine.clone(), t.id, slot.clone()));
                    (stop.clone(), kv)
                })
                .collect();
            Some(h.output(choices).await?)
        }
        None => None,
    };
    let (tx, rx) = mpsc::unbounded_channel::<(usize, Update)>();
    for (i, (stop, slot)) in stops.iter().zip(&slots).enumerate() {
        let mut choice = req.choice(i);
        if let Some(steer) = output.as_ref().and_then(|o| o.steer(i)) {
            choice = choice.with_steer(steer);
        }
        let job = Job {
            req: choice,
            format: format.clone(),
            tenant: t.name.clone(),
            index: i,
            tx: tx.clone(),
            stop: stop.clone(),
            slot: slot.clone(),
            settings,
            policy_generation,
            grant: Some(grant.clone()),
        };
        if let Err(Busy) = model.engine.submit(job) {
            // The choices already queued end before they get a slot, and book nothing.
            for stop in &stops[..i] {
                stop.cancel();
            }
            state.metrics.rejected(&t.name, Some(&model.id), "queue_full");
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "queue_full",
                format!(
                    "the request queue of model {} is full ({} waiting); retry later",
                    model.id, model.queue
                ),
            ));
        }
    }
    drop(tx);
    let mut rx = match output {
        Some(o) => o.spawn(rx),
        None => rx,
    };
    let mut responder = Responder::new(
        api,
        &model.id,
        shape.n,
        shape.stream,
        shape.include_usage,
        model.tokenizer.clone(),
        id,
        now(),
    );
    if let Some(e) = reply.echo {
        responder = responder.with_echo(e);
    }
    if let Some(reader) = reply.calls {
        responder = responder.with_calls(reader);
    }
    // A stream's access line is written when its body ends.
    responder = responder.with_access(access.clone());
    let mut pending = VecDeque::new();
    if shape.stream {
        // Wait for each choice's first update: a rejection then becomes an error status.
        let mut started = vec![false; shape.n];
        while started.iter().any(|s| !s) && !responder.finished() {
            match rx.recv().await {
                Some((i, u)) => {
                    started[i] = true;
                    responder.push(i, u, &mut pending);
                }
                None => break,
            }
        }
        if let Some(e) = responder.error() {
            return Err(e.clone());
        }
        let mut r = Response::new(SseBody::new(rx, responder, pending).boxed());
        let h = r.headers_mut();
        h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        h.insert("cache-control", HeaderValue::from_static("no-cache"));
        return Ok(r);
    }
    while !responder.finished() {
        match rx.recv().await {
            Some((i, u)) => responder.push(i, u, &mut pending),
            None => break,
        }
    }
    if let Some(e) = responder.error() {
        return Err(e.clone());
    }
    if !responder.finished() {
        return Err(ApiError::from(&crate::engine::request::AbortReason::Shutdown));
    }
    Ok(json_response(StatusCode::OK, &responder.body()))
}
