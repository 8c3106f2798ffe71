//! A request's plugin hooks: `preprocess` before tokenizing, and an output stage between the
//! engine and the response that runs `on-token` and `postprocess` for each choice.
//!
//! One fresh instance per request runs `preprocess` and then choice 0's output; each further
//! choice (`n` > 1) gets its own fresh instance, so held-back text never mixes across choices.
//! The output stage is a task between the engine's channel and the responder's: it forwards
//! each update with its text postprocessed, and when `on-token` says stop it ends the choice
//! (finish reason `stop`, the stopping token included) and raises the choice's end flag, which
//! the engine thread turns into the sequence's retirement (as cancelled, when the plugin
//! failed instead). Guest calls are futures that yield
//! every epoch tick, so a slow plugin delays only its own request.

use std::sync::Arc;

use tokio::sync::mpsc;

use super::logs::{Source, TenantLogs};
use super::{Resolved, Share};
use crate::chat::ChatMessage;
use crate::engine::request::{FinishReason, MAX_STOP_BYTES, MAX_STOP_STRINGS, MaxTokens, Outcome, Params, Usage};
use crate::engine::steer::{Steer, TokenConstraint};
use crate::metrics::Metrics;
use crate::plugin::{
    Finish, GuestConstraint, Input, Instance, KvAccess, Message, PluginFailure, PluginLimits, Request, RequestTime,
    Sampling, Token, TokenAction,
};
use crate::runner::{EndFlag, Update};
use crate::serve::error::ApiError;
use crate::serve::openai::Asked;
use crate::serve::quota::Grant;
use crate::tenant::TenantId;
use crate::tokenizer::Tokenizer;

/// Where a request's plugin reports: failures to the tenant's metrics, log lines to the
/// tenant's plugin log, fuel to the request's usage.
#[derive(Clone)]
pub struct Reporter {
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// The tenant's name.
    pub tenant: String,
    /// The tenant's id.
    pub tenant_id: TenantId,
    /// The request's id.
    pub request: String,
    /// The tenants' plugin logs.
    pub logs: Arc<TenantLogs>,
    /// The request's hold on its tenant's quotas, which books the fuel (and is held until the
    /// output stage ends, so none is lost).
    pub grant: Arc<Grant>,
}

impl Reporter {
    fn error(&self, f: &PluginFailure) -> ApiError {
        ApiError::from(&self.failed(f.clone()))
    }

    /// Counts `f` in the tenant's metrics and logs its code at WARN (its message, which may
    /// carry what the plugin said, goes only to the tenant).
    fn failed(&self, f: PluginFailure) -> PluginFailure {
        self.metrics.plugin_failure(&self.tenant, f.code());
        tracing::warn!(
            target: "warden::plugin",
            tenant = %self.tenant,
            request_id = %self.request,
            code = f.code(),
            "the request's plugin failed"
        );
        f
    }

    fn flush_logs(&self, resolved: &Resolved, instance: &mut Instance) {
        let src = Source {
            tenant: self.tenant_id,
            plugin: &resolved.name,
            version: &resolved.version,
            request: &self.request,
        };
        self.logs.write(&src, instance.take_logs());
        self.grant.add_fuel(instance.take_fuel());
    }
}

/// A request's plugin, instantiated.
pub struct Hooks {
    first: Instance,
    resolved: Resolved,
    limits: PluginLimits,
    time: Arc<RequestTime>,
    share: Share,
    tokenizer: Arc<Tokenizer>,
    seed: u64,
    reporter: Reporter,
    max_request_bytes: usize,
    /// What `preprocess` set the first generated token's constraint to.
    first_token: Option<TokenConstraint>,
}

/// The smallest JSON a chat message takes in a request body (`{"role":"","content":""}`):
/// a rewritten request may hold no more messages than a client's body could.
const MIN_MESSAGE_JSON: usize = 24;

impl Hooks {
    /// A fresh instance of `resolved` for one request, which holds `share` of its tenant's
    /// instances. What `preprocess` returns may be no larger than a client's body of
    /// `max_request_bytes`.
    pub async fn new(
        resolved: Resolved,
        limits: PluginLimits,
        share: Share,
        tokenizer: Arc<Tokenizer>,
        seed: u64,
        reporter: Reporter,
        max_request_bytes: usize,
    ) -> Result<Self, ApiError> {
        reporter.metrics.plugin_request(&reporter.tenant);
        let time = RequestTime::new(limits.request_time);
        let first = resolved
            .instantiate(limits, tokenizer.clone(), seed, time.clone())
            .await
            .map_err(|f| reporter.error(&f))?;
        Ok(Self {
            first,
            resolved,
            limits,
            time,
            share,
            tokenizer,
            seed,
            reporter,
            max_request_bytes,
            first_token: None,
        })
    }

    /// Runs `preprocess` on what the request asks and its parameters, as the plugin's WIT types,
    /// and checks what it returns as a client's request is checked (see [`Rewrite`]).
    /// `metadata` follows the endpoint's entry.
    pub async fn preprocess(
        &mut self,
        asked: Asked,
        params: Params,
        metadata: Vec<(String, String)>,
    ) -> Result<(Asked, Params), ApiError> {
        let call = Rewrite::new(asked, params, self.resolved.config.clone(), metadata, &self.tokenizer);
        let out = self.first.preprocess(&call.request).await;
        self.reporter.flush_logs(&self.resolved, &mut self.first);
        let out = out
            .and_then(|out| check_rewritten(&out, self.max_request_bytes).map(|()| out))
            .map_err(|f| self.reporter.error(&f))?;
        let (asked, params, first) = call.finish(out)?;
        self.first_token = first
            .map(|c| engine_constraint(c, self.tokenizer.vocab_size()))
            .transpose()
            .map_err(|f| self.reporter.error(&f))?;
        Ok((asked, params))
    }

    /// The output stage for `n` choices, each with its stop flag and its access to its own KV.
    /// A choice whose plugin takes tokens is steered: each token waits for `on-token`'s verdict
    /// before the next is computed (see [`Output::steer`]; through a cluster's router, the
    /// verdicts cross to the decode node), so a stop is exact and a constraint holds for the very
    /// next token.
    pub async fn output(self, choices_in: Vec<(Arc<EndFlag>, Arc<dyn KvAccess>)>) -> Result<Output, ApiError> {
        let Hooks {
            first,
            resolved,
            limits,
            time,
            share,
            tokenizer,
            seed,
            reporter,
            first_token,
            ..
        } = self;
        let mut choices = Vec::with_capacity(choices_in.len());
        let mut next = Some(first);
        for (i, (stop, kv)) in choices_in.into_iter().enumerate() {
            let mut instance = match next.take() {
                Some(first) => first,
                None => resolved
                    .instantiate(limits, tokenizer.clone(), seed.wrapping_add(i as u64), time.clone())
                    .await
                    .map_err(|f| reporter.error(&f))?,
            };
            instance.attach_kv(kv);
            let on_token = instance.capabilities().await.map_err(|f| reporter.error(&f))?.on_token;
            choices.push(ChoiceStage {
                instance,
                on_token,
                steer: Steer::for_plugin(on_token, first_token.clone()).map(Arc::new),
                stop,
                tokens: 0,
                stopping: false,
                done: false,
            });
        }
        Ok(Output {
            choices,
            vocab: tokenizer.vocab_size(),
            reporter,
            resolved,
            _share: share,
        })
    }
}

/// One `preprocess` call: the request as the plugin's WIT types, and what it returns turned
/// back into the server's, checked as a client's request is ([`Params::new`]'s ranges; the
/// caller checks sizes first with [`check_rewritten`]). A token prompt reaches the plugin as its
/// text and keeps its exact ids if the plugin leaves that text alone; a chat's tool calls and
/// results' ids stay with their messages when the plugin keeps the conversation's roles (it
/// sees and may rewrite every message's text).
pub struct Rewrite {
    /// What the plugin is given.
    pub request: Request,
    params: Params,
    tokens: Option<Vec<u32>>,
    history: Vec<ChatMessage>,
}

impl Rewrite {
    /// The call for `asked` with `params`, the plugin's `config` and `metadata` (after the
    /// endpoint's entry).
    pub fn new(
        asked: Asked,
        params: Params,
        config: String,
        metadata: Vec<(String, String)>,
        tokenizer: &Tokenizer,
    ) -> Self {
        let mut history = Vec::new();
        let (input, tokens) = match asked {
            Asked::Chat(messages) => (
                Input::Chat(
                    messages
                        .into_iter()
                        .map(|m| {
                            let message = Message {
                                role: m.role.clone(),
                                content: m.content.clone(),
                            };
                            history.push(m);
                            message
                        })
                        .collect(),
                ),
                None,
            ),
            Asked::Text(text) => (Input::Prompt(text), None),
            Asked::Tokens(ids) => (Input::Prompt(tokenizer.decode(&ids)), Some(ids)),
        };
        let endpoint = match input {
            Input::Chat(_) => "chat.completions",
            Input::Prompt(_) => "completions",
        };
        let s = params.sampling();
        let sampling = Sampling {
            temperature: s.temperature,
            top_p: s.top_p,
            top_k: u32::try_from(s.top_k).unwrap_or(u32::MAX),
            min_p: s.min_p,
            repetition_penalty: s.repetition_penalty,
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
            max_tokens: params.max_tokens().min(u32::MAX as usize) as u32,
            seed: s.seed,
            stop: params.stop().to_vec(),
            logit_bias: s.logit_bias.clone(),
        };
        let request = Request {
            input,
            sampling,
            config,
            metadata: std::iter::once(("endpoint".to_string(), endpoint.to_string()))
                .chain(metadata)
                .collect(),
            first_token: None,
        };
        Self {
            request,
            params,
            tokens,
            history,
        }
    }

    /// What the plugin returned (`out`), as the request the server goes on with, and the
    /// constraint it set on the first token, if any (checked by the caller, which knows the
    /// vocabulary).
    pub fn finish(self, out: Request) -> Result<(Asked, Params, Option<GuestConstraint>), ApiError> {
        let Self {
            request,
            params,
            tokens,
            mut history,
        } = self;
        let first_token = out.first_token;
        let mut sampling = params.sampling().clone();
        let o = out.sampling;
        sampling.temperature = o.temperature;
        sampling.top_p = o.top_p;
        sampling.top_k = o.top_k as usize;
        sampling.min_p = o.min_p;
        sampling.repetition_penalty = o.repetition_penalty;
        sampling.presence_penalty = o.presence_penalty;
        sampling.frequency_penalty = o.frequency_penalty;
        sampling.seed = o.seed;
        sampling.logit_bias = o.logit_bias;
        sampling.logit_bias.sort_by_key(|&(id, _)| id);
        // A max_tokens the plugin left as it was shown stays open-ended.
        let max_tokens = match o.max_tokens as usize {
            n if params.open_ended() && n == params.max_tokens() => MaxTokens::AtMost(n),
            n => MaxTokens::Given(n),
        };
        let params =
            Params::new(sampling, max_tokens, o.stop, params.ignore_eos(), params.logprobs()).map_err(|e| {
                let mut e = ApiError::from(e);
                e.message = format!("after the plugin's preprocess: {}", e.message);
                e
            })?;
        let asked = match (out.input, tokens, request.input) {
            // A token prompt the plugin left alone keeps its exact ids.
            (Input::Prompt(p), Some(ids), Input::Prompt(before)) if p == before => Asked::Tokens(ids),
            (Input::Prompt(p), _, _) => Asked::Text(p),
            (Input::Chat(messages), _, _) => {
                let same_roles =
                    messages.len() == history.len() && messages.iter().zip(&history).all(|(m, h)| m.role == h.role);
                Asked::Chat(
                    messages
                        .into_iter()
                        .enumerate()
                        .map(|(i, m)| {
                            let mut out = ChatMessage::new(m.role, m.content);
                            if same_roles {
                                out.tool_calls = history[i].tool_calls.take();
                                out.tool_call_id = history[i].tool_call_id.take();
                            }
                            out
                        })
                        .collect(),
                )
            }
        };
        Ok((asked, params, first_token))
    }
}

/// Whether a request `preprocess` returned is one a client could have sent: its text no larger
/// than a client's body, no more messages than such a body holds, and the engine's limits on
/// stop strings. Checked before the host renders or tokenizes any of it.
pub fn check_rewritten(req: &Request, max_bytes: usize) -> Result<(), PluginFailure> {
    let too_large = |what: String| Err(PluginFailure::OutputTooLarge(format!("preprocess returned {what}")));
    let text = match &req.input {
        Input::Prompt(p) => p.len(),
        Input::Chat(messages) => {
            if messages.len() > max_bytes / MIN_MESSAGE_JSON {
                return too_large(format!(
                    "{} messages, more than a request body of {max_bytes} bytes can hold ({})",
                    messages.len(),
                    max_bytes / MIN_MESSAGE_JSON
                ));
            }
            messages.iter().map(|m| m.role.len() + m.content.len()).sum()
        }
    };
    let stops = &req.sampling.stop;
    let bytes = text + stops.iter().map(String::len).sum::<usize>();
    if bytes > max_bytes {
        return too_large(format!(
            "{bytes} bytes of text, more than a client's request body may carry ({max_bytes})"
        ));
    }
    if stops.len() > MAX_STOP_STRINGS || stops.iter().any(|s| s.len() > MAX_STOP_BYTES) {
        return too_large(format!(
            "{} stop strings; at most {MAX_STOP_STRINGS} of at most {MAX_STOP_BYTES} bytes each",
            stops.len()
        ));
    }
    Ok(())
}

struct ChoiceStage {
    instance: Instance,
    on_token: bool,
    /// Where its verdicts go, when the engine waits for them.
    steer: Option<Arc<Steer>>,
    stop: Arc<EndFlag>,
    tokens: u32,
    /// Its plugin said stop: tokens already in flight are dropped, and the engine's `Done`
    /// (with the sequence's real usage) ends the choice as `stop`.
    stopping: bool,
    done: bool,
}

/// The output stage of a request.
pub struct Output {
    choices: Vec<ChoiceStage>,
    /// The model's vocabulary size (token constraints are checked against it).
    vocab: usize,
    reporter: Reporter,
    resolved: Resolved,
    /// The request's instances count against its tenant's share until the stage ends.
    _share: Share,
}

impl Output {
    /// Choice `index`'s steering, for its job: the engine waits for each of its verdicts.
    pub fn steer(&self, index: usize) -> Option<Arc<Steer>> {
        self.choices.get(index).and_then(|c| c.steer.clone())
    }

    /// Starts the stage over the engine's channel `rx`; the responder reads the returned one.
    /// When the responder's side goes away (the client left), the stage ends and drops `rx`,
    /// which cancels the request in the engine.
    pub fn spawn(self, mut rx: mpsc::UnboundedReceiver<(usize, Update)>) -> mpsc::UnboundedReceiver<(usize, Update)> {
        let (tx, out) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut stage = self;
            'run: loop {
                let msg = tokio::select! {
                    m = rx.recv() => m,
                    _ = tx.closed() => None,
                };
                let Some((i, u)) = msg else { break };
                let updates = stage.apply(i, u).await;
                if stage.choices.iter().all(|c| c.done) {
                    // The fuel is booked and the grant let go before the last answer leaves.
                    stage.finish();
                    for u in updates {
                        let _ = tx.send((i, u));
                    }
                    return;
                }
                for u in updates {
                    if tx.send((i, u)).is_err() {
                        break 'run;
                    }
                }
            }
            stage.finish();
        });
        out
    }

    /// Writes the instances' logs, books their fuel and drops the stage's hold on the grant.
    fn finish(mut self) {
        for c in &mut self.choices {
            self.reporter.flush_logs(&self.resolved, &mut c.instance);
        }
    }

    async fn apply(&mut self, i: usize, u: Update) -> Vec<Update> {
        let Some(c) = self.choices.get_mut(i) else {
            return vec![];
        };
        if c.done {
            return vec![];
        }
        let r = &self.reporter;
        match u {
            Update::Token { .. } if c.stopping => vec![],
            Update::Token { text, token, logprobs } => {
                c.tokens += 1;
                let mut stop = false;
                if c.on_token {
                    let t = Token {
                        id: token,
                        text: text.clone(),
                        index: c.tokens,
                    };
                    let mut next = None;
                    match c.instance.on_token(&t).await {
                        Ok(TokenAction::Stop) => stop = true,
                        Ok(TokenAction::Continue) => {}
                        Ok(TokenAction::Constrain(k)) => match engine_constraint(k, self.vocab) {
                            Ok(k) => next = Some(k),
                            Err(f) => return c.fail(r.failed(f)),
                        },
                        Err(f) => return c.fail(r.failed(f)),
                    }
                    // The engine computes the next token once it has the verdict (a stop ends
                    // the sequence first: its flag is raised before the engine can look).
                    if let Some(s) = &c.steer {
                        if stop {
                            c.stop.stop();
                        }
                        s.answer(next);
                    }
                }
                let text = match c.instance.postprocess(&text, None).await {
                    Ok(t) => t,
                    Err(f) => return c.fail(r.failed(f)),
                };
                if stop {
                    // The engine ends the sequence between steps and answers with its `Done`.
                    c.stop.stop();
                    c.stopping = true;
                }
                vec![Update::Token { text, token, logprobs }]
            }
            Update::Done {
                outcome: Outcome::Finished(_),
                usage,
                ..
            } if c.stopping => {
                // What the engine generated after the plugin's stop was never shown: neither its
                // text nor its tokens count.
                c.done = true;
                let usage = Usage {
                    completion_tokens: c.tokens as usize,
                    ..usage
                };
                let end = finish(FinishReason::Stop, &usage);
                match c.instance.postprocess("", Some(&end)).await {
                    Ok(text) => vec![Update::Done {
                        outcome: Outcome::Finished(FinishReason::Stop),
                        text,
                        usage,
                    }],
                    Err(f) => vec![Update::Failed(r.failed(f))],
                }
            }
            Update::Done {
                outcome: outcome @ Outcome::Finished(reason),
                text,
                usage,
            } => {
                c.done = true;
                let end = finish(reason, &usage);
                match c.instance.postprocess(&text, Some(&end)).await {
                    Ok(text) => vec![Update::Done { outcome, text, usage }],
                    Err(f) => vec![Update::Failed(r.failed(f))],
                }
            }
            other => {
                // Aborted, rejected, shutting down, failed: nothing of the output remains to
                // release, the error replaces it.
                c.done = true;
                vec![other]
            }
        }
    }
}

/// How a choice ended, as `postprocess` sees it.
pub fn finish(reason: FinishReason, usage: &Usage) -> Finish {
    Finish {
        reason: reason.as_str().into(),
        prompt_tokens: u32::try_from(usage.prompt_tokens).unwrap_or(u32::MAX),
        completion_tokens: u32::try_from(usage.completion_tokens).unwrap_or(u32::MAX),
    }
}

/// Most a token constraint's bias may move a logit (as a client's `logit_bias`).
const MAX_CONSTRAINT_BIAS: f32 = 100.0;

/// A plugin's constraint on the next token as the engine takes it, checked: at most `vocab`
/// ids in each part, each within the vocabulary, biases finite within ±100.
pub fn engine_constraint(c: GuestConstraint, vocab: usize) -> Result<TokenConstraint, PluginFailure> {
    let bad = |m: String| Err(PluginFailure::BadConstraint(m));
    let allowed_len = c.allowed.as_ref().map_or(0, Vec::len);
    if allowed_len > vocab || c.bias.len() > vocab {
        return bad(format!("more ids than the vocabulary's {vocab}"));
    }
    let ids = c.allowed.iter().flatten().chain(c.bias.iter().map(|(id, _)| id));
    if let Some(id) = ids.into_iter().find(|&&id| id as usize >= vocab) {
        return bad(format!("token id {id} is outside the vocabulary of {vocab}"));
    }
    if let Some((id, b)) = c
        .bias
        .iter()
        .find(|(_, b)| !b.is_finite() || b.abs() > MAX_CONSTRAINT_BIAS)
    {
        return bad(format!("the bias {b} on token {id} is outside -100 to 100"));
    }
    Ok(TokenConstraint {
        allowed: c.allowed,
        bias: c.bias,
    })
}

impl ChoiceStage {
    fn fail(&mut self, e: PluginFailure) -> Vec<Update> {
        self.done = true;
        self.stop.cancel();
        vec![Update::Failed(e)]
    }
}
