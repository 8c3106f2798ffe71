//! The HTTP service: routing, authentication, body limits, the OpenAI endpoints, health,
//! metrics and the admin API. Every failure leaves through [`ApiError`]'s JSON.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{AUTHORIZATION, CONTENT_LENGTH, CONTENT_TYPE, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::openai::{ApiError, Asked, ChatRequest, CompletionRequest, Plan, RequestLimits, Shape, parse_body};
use super::plugins::pipeline::{Hooks, Reporter};
use super::quota::Grant;
use super::state::State;
use super::store::{StoreError, Tenant};
use super::stream::{Api, Responder, SseBody};
use crate::engine::request::ValidRequest;
use crate::plugin::KvAccess;
use crate::policy::Policy;
use crate::runner::{Busy, EndFlag, EngineKv, Job, SeqSlot, Update};

/// Response bodies: whole or streamed.
pub type Body = BoxBody<Bytes, std::convert::Infallible>;

fn full(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Response<Body> {
    let mut r = Response::new(Full::new(body.into()).boxed());
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

fn json_response(status: StatusCode, v: &Value) -> Response<Body> {
    full(status, "application/json", v.to_string())
}

fn error_response(e: &ApiError) -> Response<Body> {
    let mut r = json_response(e.status, &e.body());
    match e.retry_after {
        Some(s) => {
            r.headers_mut().insert("retry-after", HeaderValue::from(s));
        }
        None if e.status == StatusCode::SERVICE_UNAVAILABLE => {
            r.headers_mut().insert("retry-after", HeaderValue::from_static("1"));
        }
        None => {}
    }
    r
}

fn store_error(e: StoreError) -> ApiError {
    match e {
        StoreError::BadName(_) => ApiError::field("name", e.to_string()),
        StoreError::TenantExists(_) => ApiError::new(StatusCode::CONFLICT, "tenant_exists", e.to_string()),
        StoreError::NoTenant(_) => ApiError::new(StatusCode::NOT_FOUND, "tenant_not_found", e.to_string()),
        StoreError::NoKey(_) => ApiError::new(StatusCode::NOT_FOUND, "key_not_found", e.to_string()),
        _ => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "store_error", e.to_string()),
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn bearer(req: &Request<Incoming>) -> Option<&str> {
    let v = req.headers().get(AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = v.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// Handles one request.
pub async fn handle(state: Arc<State>, req: Request<Incoming>) -> Result<Response<Body>, std::convert::Infallible> {
    let r = match route(&state, req).await {
        Ok(r) => r,
        Err(e) => {
            state.metrics.http_error(e.code);
            error_response(&e)
        }
    };
    Ok(r)
}

async fn route(state: &Arc<State>, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let header_bytes: usize = req.headers().iter().map(|(k, v)| k.as_str().len() + v.len() + 4).sum();
    if header_bytes > state.cfg.limits.header_bytes {
        return Err(ApiError::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "headers_too_large",
            format!(
                "the request's headers are {header_bytes} bytes, more than the limit of {}",
                state.cfg.limits.header_bytes
            ),
        ));
    }
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    let segments: Vec<&str> = path.trim_end_matches('/').split('/').skip(1).collect();
    let allow = |methods: &[Method]| -> Result<(), ApiError> {
        if methods.contains(&method) {
            Ok(())
        } else {
            Err(method_not_allowed(&method, &path))
        }
    };
    match segments.as_slice() {
        ["healthz"] => {
            allow(&[Method::GET])?;
            Ok(full(StatusCode::OK, "text/plain", "ok\n"))
        }
        ["readyz"] => {
            allow(&[Method::GET])?;
            if state.engine.is_alive() && !state.shutting_down.load(Ordering::SeqCst) {
                Ok(full(StatusCode::OK, "text/plain", "ready\n"))
            } else {
                Err(ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "not_ready",
                    "the server is not ready",
                ))
            }
        }
        ["metrics"] => {
            allow(&[Method::GET])?;
            admin(state, &req)?;
            Ok(full(
                StatusCode::OK,
                "text/plain; version=0.0.4",
                state.metrics.render(),
            ))
        }
        ["v1", "models"] => {
            allow(&[Method::GET])?;
            tenant(state, &req)?;
            Ok(json_response(
                StatusCode::OK,
                &json!({"object": "list", "data": [model_card(state)]}),
            ))
        }
        ["v1", "models", id] => {
            allow(&[Method::GET])?;
            tenant(state, &req)?;
            if *id != state.model_id {
                return Err(model_not_found(id));
            }
            Ok(json_response(StatusCode::OK, &model_card(state)))
        }
        ["v1", "chat", "completions"] => {
            allow(&[Method::POST])?;
            let t = tenant(state, &req)?;
            let body = read_body(state, req).await?;
            counted(state, &t, chat(state, t.clone(), &body).await)
        }
        ["v1", "completions"] => {
            allow(&[Method::POST])?;
            let t = tenant(state, &req)?;
            let body = read_body(state, req).await?;
            counted(state, &t, completions(state, t.clone(), &body).await)
        }
        ["v1", "usage"] => {
            allow(&[Method::GET])?;
            let t = tenant(state, &req)?;
            Ok(json_response(
                StatusCode::OK,
                &json!(state.quotas.usage.of(t.id, &t.name)),
            ))
        }
        ["v1", "plugins", rest @ ..] => {
            let t = tenant(state, &req)?;
            plugin_api(state, &t, req, &method, rest).await
        }
        ["admin", "v1", rest @ ..] => admin_api(state, req, &method, rest).await,
        _ => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no route for {method} {path}"),
        )),
    }
}

/// Counts a refused request in its tenant's usage, by error code.
fn counted(state: &State, t: &Tenant, r: Result<Response<Body>, ApiError>) -> Result<Response<Body>, ApiError> {
    if let Err(e) = &r {
        state.quotas.usage.reject(t.id, &t.name, e.code);
        if e.status == StatusCode::TOO_MANY_REQUESTS || e.status == StatusCode::FORBIDDEN {
            state.metrics.rejected(&t.name, e.code);
        }
    }
    r
}

fn method_not_allowed(method: &Method, path: &str) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!("{method} is not allowed on {path}"),
    )
}

fn model_card(state: &State) -> Value {
    json!({"id": state.model_id, "object": "model", "created": state.started, "owned_by": "warden"})
}

fn model_not_found(id: &str) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        code: "model_not_found",
        message: format!("the model {id:?} does not exist"),
        param: Some("model".into()),
        retry_after: None,
    }
}

fn tenant(state: &State, req: &Request<Incoming>) -> Result<Tenant, ApiError> {
    let key = bearer(req).ok_or_else(|| {
        ApiError::new(
            StatusCode::UNAUTHORIZED,
            "missing_api_key",
            "this endpoint needs an API key: send Authorization: Bearer <key>",
        )
    })?;
    match state.store.authenticate(key) {
        Ok(Some(t)) => Ok(t),
        Ok(None) => Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "invalid_api_key",
            "the API key is not valid",
        )),
        Err(e) => Err(store_error(e)),
    }
}

fn admin(state: &State, req: &Request<Incoming>) -> Result<(), ApiError> {
    let ok = bearer(req)
        .map(|t| state.store.is_admin(t))
        .transpose()
        .map_err(store_error)?;
    match ok {
        Some(true) => Ok(()),
        Some(false) => Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "invalid_admin_token",
            "the admin token is not valid",
        )),
        None => Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "missing_admin_token",
            "this endpoint needs the admin token: send Authorization: Bearer <token>",
        )),
    }
}

async fn read_body(state: &State, req: Request<Incoming>) -> Result<Bytes, ApiError> {
    read_body_up_to(state, req, state.cfg.limits.body_bytes, "body_too_large").await
}

/// Reads a body of at most `limit` bytes (checked against Content-Length before reading, and
/// while reading); beyond, 413 with `code`.
async fn read_body_up_to(
    state: &State,
    req: Request<Incoming>,
    limit: usize,
    code: &'static str,
) -> Result<Bytes, ApiError> {
    let too_large = |n: String| {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            code,
            format!("the request body is {n} bytes, more than the limit of {limit}"),
        )
    };
    if let Some(len) = req
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
        && len > limit as u64
    {
        return Err(too_large(len.to_string()));
    }
    let timeout = Duration::from_secs(state.cfg.timeouts.body_read_s);
    match tokio::time::timeout(timeout, Limited::new(req.into_body(), limit).collect()).await {
        Err(_) => Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "body_timeout",
            format!("the request body did not arrive within {} s", timeout.as_secs()),
        )),
        Ok(Err(e)) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => Err(too_large("more".into())),
        Ok(Err(e)) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad_body",
            format!("reading the body: {e}"),
        )),
        Ok(Ok(c)) => Ok(c.to_bytes()),
    }
}

/// Runs CPU-heavy request preparation (template rendering, tokenizing up to a whole body) on
/// the blocking pool, so it never stalls the connections the runtime serves.
async fn off_runtime<T: Send + 'static>(
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

fn request_id(prefix: &str) -> String {
    use rand::RngCore;
    let mut b = [0u8; 12];
    rand::rng().fill_bytes(&mut b);
    format!("{prefix}-{}", b.iter().map(|x| format!("{x:02x}")).collect::<String>())
}

/// A request its tenant's policy let in.
struct Admitted {
    /// The tenant's policy, from the set in force when the request arrived.
    policy: Policy,
    /// That set's generation.
    generation: u64,
    /// The request's hold on the tenant's quotas.
    grant: Arc<Grant>,
    /// Request limits under the policy.
    lim: RequestLimits,
}

/// What the tenant's policy allows a request before anything of it runs: the model (403), its
/// concurrency and requests per minute (429).
fn admit(state: &Arc<State>, t: &Tenant, model: &str) -> Result<Admitted, ApiError> {
    if model != state.model_id {
        return Err(model_not_found(model));
    }
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
    let grant = Arc::new(state.quotas.admit(t, &policy)?);
    let mut lim = state.request_limits;
    if let Some(m) = policy.max_tokens.get() {
        // A request that names no max_tokens gets the policy's, if that is lower.
        lim.default_max_tokens = lim.default_max_tokens.min(m as usize);
    }
    Ok(Admitted {
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
    let (prompt_len, max_tokens) = (prompt.len() as u64, plan.params.max_tokens() as u64);
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
    a.grant.reserve(prompt_len + max_tokens * plan.shape.n as u64, policy)?;
    plan.params
        .with_prompt(t.id, prompt, &state.admission)
        .map_err(|reason| {
            state.metrics.rejected(&t.name, reason.code());
            reason.into()
        })
}

async fn chat(state: &Arc<State>, t: Tenant, body: &[u8]) -> Result<Response<Body>, ApiError> {
    let r = ChatRequest::parse(body, state.cfg.limits.json_depth)?;
    let a = admit(state, &t, &r.common.model)?;
    let asked = Asked::Chat(r.chat_messages()?);
    let plan = r.common.plan(&a.lim, r.logprobs()?)?;
    let id = request_id("chatcmpl");
    let (prompt, plan, hooks) = prepare(state, &t, &a, asked, plan, r.common.plugin.as_deref(), &id).await?;
    let shape = plan.shape;
    let req = limit(state, &t, &a, plan, prompt)?;
    generate(state, &t, req, shape, Api::Chat, id, hooks, a).await
}

async fn completions(state: &Arc<State>, t: Tenant, body: &[u8]) -> Result<Response<Body>, ApiError> {
    let r = CompletionRequest::parse(body, state.cfg.limits.json_depth)?;
    let a = admit(state, &t, &r.common.model)?;
    let asked = r.asked()?;
    let plan = r.common.plan(&a.lim, None)?;
    let id = request_id("cmpl");
    let (prompt, plan, hooks) = prepare(state, &t, &a, asked, plan, r.common.plugin.as_deref(), &id).await?;
    let shape = plan.shape;
    let req = limit(state, &t, &a, plan, prompt)?;
    generate(state, &t, req, shape, Api::Completion, id, hooks, a).await
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
    id: &str,
) -> Result<(Vec<u32>, Plan, Option<Hooks>), ApiError> {
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
        Some(name) => Some(state.plugins.resolve(t, name).await?),
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
            state.tokenizer.clone(),
            seed,
            reporter,
            state.cfg.limits.body_bytes,
        )
        .await?;
        let metadata = vec![
            ("tenant".to_string(), t.name.clone()),
            ("request-id".into(), id.to_string()),
            ("model".into(), state.model_id.clone()),
        ];
        (asked, plan.params) = h.preprocess(asked, plan.params, metadata).await?;
        hooks = Some(h);
    }
    let prompt = match asked {
        Asked::Tokens(ids) => ids,
        Asked::Text(text) => {
            let tk = state.tokenizer.clone();
            off_runtime(move || Ok(tk.encode(&text, true))).await?
        }
        Asked::Chat(messages) => {
            let template = state.chat.as_ref().ok_or_else(|| {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "no_chat_template",
                    "this model has no chat template; use /v1/completions",
                )
            })?;
            let (template, tk) = (template.clone(), state.tokenizer.clone());
            off_runtime(move || {
                let text = template
                    .render(&messages, true)
                    .map_err(|e| ApiError::field("messages", format!("rendering the chat template: {e}")))?;
                Ok(tk.encode(&text, true))
            })
            .await?
        }
    };
    Ok((prompt, plan, hooks))
}

/// Submits and answers a validated request in its `shape`: a JSON body, or an SSE stream that
/// starts once every choice is admitted (so a rejection is an error status, never a 200).
#[allow(clippy::too_many_arguments)]
async fn generate(
    state: &Arc<State>,
    t: &Tenant,
    req: ValidRequest,
    shape: Shape,
    api: Api,
    id: String,
    hooks: Option<Hooks>,
    a: Admitted,
) -> Result<Response<Body>, ApiError> {
    let (settings, policy_generation, grant) = (a.policy.tenant_settings(), a.generation, a.grant);
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
                    let kv: Arc<dyn KvAccess> = Arc::new(EngineKv::new(state.engine.clone(), t.id, slot.clone()));
                    (stop.clone(), kv)
                })
                .collect();
            Some(h.output(choices).await?)
        }
        None => None,
    };
    let (tx, rx) = mpsc::unbounded_channel::<(usize, Update)>();
    for (i, (stop, slot)) in stops.iter().zip(&slots).enumerate() {
        let job = Job {
            req: req.choice(i),
            tenant: t.name.clone(),
            index: i,
            tx: tx.clone(),
            stop: stop.clone(),
            slot: slot.clone(),
            settings,
            policy_generation,
            grant: Some(grant.clone()),
        };
        if let Err(Busy) = state.engine.submit(job) {
            // The choices already queued end before they get a slot, and book nothing.
            for stop in &stops[..i] {
                stop.cancel();
            }
            state.metrics.rejected(&t.name, "queue_full");
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "queue_full",
                format!(
                    "the request queue is full ({} waiting); retry later",
                    state.cfg.limits.queue
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
        &state.model_id,
        shape.n,
        shape.stream,
        shape.include_usage,
        state.tokenizer.clone(),
        id,
        now(),
    );
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
        return Err(super::stream::abort_error(
            &crate::engine::request::AbortReason::Shutdown,
        ));
    }
    Ok(json_response(StatusCode::OK, &responder.body()))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Activate {
    version: String,
}

/// Whether the query string says `activate=false`.
fn no_activate(req: &Request<Incoming>) -> bool {
    req.uri()
        .query()
        .is_some_and(|q| q.split('&').any(|kv| kv == "activate=false" || kv == "activate=0"))
}

/// `/v1/plugins/...` for tenant `t` (also reached by the admin API as
/// `/admin/v1/tenants/{t}/plugins/...`).
async fn plugin_api(
    state: &Arc<State>,
    t: &Tenant,
    req: Request<Incoming>,
    method: &Method,
    rest: &[&str],
) -> Result<Response<Body>, ApiError> {
    let p = &state.plugins;
    let path = req.uri().path().to_string();
    let not_allowed = || method_not_allowed(method, &path);
    let ok = |v: Value| Ok(json_response(StatusCode::OK, &v));
    match (rest, method) {
        ([], &Method::GET) => ok(p.list(t)?),
        ([], _) => Err(not_allowed()),
        ([name], &Method::GET) => ok(p.get(t, name)?),
        ([name], &Method::PUT) => {
            let activate = !no_activate(&req);
            let name = name.to_string();
            // The tenant's policy may allow less than the server; checked before reading.
            let policy = state.quotas.set().of(&t.name).clone();
            let max = match policy.plugin_max_component_mib {
                Some(mib) => p.max_component_bytes().min((mib as usize) << 20),
                None => p.max_component_bytes(),
            };
            let bytes = read_body_up_to(state, req, max, "component_too_large").await?;
            let v = p.upload(t, &policy, &name, bytes.to_vec(), activate).await?;
            let status = if v["new"].as_bool() == Some(true) {
                StatusCode::CREATED
            } else {
                StatusCode::OK
            };
            Ok(json_response(status, &v))
        }
        ([name], &Method::DELETE) => ok(p.delete(t, name)?),
        ([name, "logs"], &Method::GET) => {
            p.get(t, name)?;
            ok(json!({"data": p.logs().tail(t.id, name, 200)}))
        }
        ([_], _) => Err(not_allowed()),
        ([name, "activate"], &Method::POST) => {
            let name = name.to_string();
            let body = read_body(state, req).await?;
            let a: Activate = parse_body(&body, 4, &["version"])?;
            ok(p.activate(t, &name, &a.version)?)
        }
        ([name, "rollback"], &Method::POST) => ok(p.rollback(t, name)?),
        ([name, "config"], &Method::PUT) => {
            let name = name.to_string();
            let body = read_body_up_to(state, req, p.max_config_bytes(), "config_too_large").await?;
            ok(p.set_config(t, &name, &body)?)
        }
        ([name, "default"], &Method::PUT) => ok(p.set_default(t, name)?),
        ([name, "default"], &Method::DELETE) => ok(p.clear_default(t, name)?),
        ([name, "versions", v], &Method::DELETE) => ok(p.delete_version(t, name, v)?),
        ([_, "activate" | "rollback" | "config" | "default" | "logs"], _) | ([_, "versions", _], _) => {
            Err(not_allowed())
        }
        _ => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no plugin route {path}"),
        )),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NewTenant {
    name: String,
}

async fn admin_api(
    state: &Arc<State>,
    req: Request<Incoming>,
    method: &Method,
    rest: &[&str],
) -> Result<Response<Body>, ApiError> {
    admin(state, &req)?;
    let path = req.uri().path().to_string();
    let not_allowed = || method_not_allowed(method, &path);
    let ok = |v: Value| Ok(json_response(StatusCode::OK, &v));
    match (rest, method) {
        (["usage"], &Method::GET) => ok(json!({"data": state.quotas.usage.all()})),
        (["usage"], _) => Err(not_allowed()),
        (["policies"], &Method::GET) => ok(json!({"version": state.quotas.set().version})),
        (["policies"], _) => Err(not_allowed()),
        (["tenants"], &Method::GET) => ok(json!({"data": state.store.tenants().map_err(store_error)?})),
        (["tenants"], &Method::POST) => {
            let body = read_body(state, req).await?;
            let n: NewTenant = parse_body(&body, 4, &["name"])?;
            let t = state.store.create_tenant(&n.name).map_err(store_error)?;
            Ok(json_response(StatusCode::CREATED, &json!(t)))
        }
        (["tenants"], _) => Err(not_allowed()),
        (["tenants", name], &Method::DELETE) => {
            let id = state.store.delete_tenant(name).map_err(store_error)?;
            state.quotas.usage.forget(id).map_err(store_error)?;
            // Its prefix cache goes too (its ids are never reused, so this frees memory; it is
            // not what keeps tenants apart).
            state.engine.forget_tenant(id).await;
            ok(json!({"deleted": name}))
        }
        (["tenants", _], _) => Err(not_allowed()),
        (["tenants", name, "keys"], &Method::POST) => {
            let (info, key) = state.store.create_key(name).map_err(store_error)?;
            Ok(json_response(StatusCode::CREATED, &json!({"key": key, "info": info})))
        }
        (["tenants", name, "keys"], &Method::GET) => {
            ok(json!({"data": state.store.keys(Some(name)).map_err(store_error)?}))
        }
        (["tenants", _, "keys"], _) => Err(not_allowed()),
        (["tenants", name, "plugins", rest @ ..], _) => {
            let t = state
                .store
                .tenant(name)
                .map_err(store_error)?
                .ok_or_else(|| store_error(StoreError::NoTenant(name.to_string())))?;
            plugin_api(state, &t, req, method, rest).await
        }
        (["keys"], &Method::GET) => ok(json!({"data": state.store.keys(None).map_err(store_error)?})),
        (["keys"], _) => Err(not_allowed()),
        (["keys", id], &Method::DELETE) => ok(json!(state.store.revoke_key(id).map_err(store_error)?)),
        (["keys", _], _) => Err(not_allowed()),
        _ => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no admin route {path}"),
        )),
    }
}
