//! `warden plugin test`: a plugin run on this machine, as the server would run it on one
//! request, with every stage printed: its capabilities, the request `preprocess` is given and the
//! one it returns, the prompt, each generated token with `on-token`'s action, each piece of
//! output with what `postprocess` made of it, the log lines (its `log` calls and what it printed)
//! after each call, and the finish. The model is a real one (the served model's file), so the
//! tokens are the ones the server would generate; the limits are the server's (`[plugins]`).

use serde_json::{Value, json};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use super::limits_of;
use super::pipeline::{Rewrite, check_rewritten, engine_constraint, finish};
use crate::config::{PluginsConfig, UnknownFields};
use crate::engine::request::Outcome;
use crate::engine::steer::Steer;
use crate::engine::{Engine, EngineConfig, Event};
use crate::grammar::{Format, GrammarLimits, Grammars};
use crate::loaded::{LoadError, LoadedModel};
use crate::plugin::snapshot::{Snapshot, pre_initialise};
use crate::plugin::{Input, Instance, PluginFailure, Request, RequestTime, Runtime, Token, TokenAction};
use crate::serve::error::ApiError;
use crate::serve::openai::{Asked, ChatRequest, CompletionRequest, RequestLimits};
use crate::serve::tools::{Tools, render};
use crate::tenant::TenantId;
use crate::tokenizer::Tokenizer;

/// What to run.
#[derive(Debug, Clone)]
pub struct LocalRun {
    /// The component (.wasm).
    pub component: PathBuf,
    /// The configuration it is given.
    pub config: String,
    /// A request body for `/v1/chat/completions` (it has `messages`) or `/v1/completions`.
    pub request: PathBuf,
    /// The model file.
    pub model: PathBuf,
    /// The server's plugin limits.
    pub plugins: PluginsConfig,
}

/// Why a local run stopped.
#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    /// A file could not be read.
    #[error("reading {0}: {1}")]
    Read(PathBuf, std::io::Error),
    /// The model did not load.
    #[error("loading the model: {0}")]
    Model(LoadError),
    /// The request (or the plugin's rewrite of it) is one the server would refuse.
    #[error("the server would refuse the request ({}): {}", .0.code, .0.message)]
    Request(ApiError),
    /// The plugin failed (or refused the request) in `stage`.
    #[error("the plugin failed in {stage} ({}): {failure}", failure.code())]
    Plugin {
        /// Which call.
        stage: &'static str,
        /// What happened.
        failure: PluginFailure,
    },
    /// The engine refused or ended the request.
    #[error("generation failed: {0}")]
    Engine(String),
    /// The report could not be written.
    #[error("writing the report: {0}")]
    Write(std::io::Error),
}

// By hand, not `#[from]`: a source would print its message a second time after ours.
impl From<LoadError> for LocalError {
    fn from(e: LoadError) -> Self {
        Self::Model(e)
    }
}

impl From<std::io::Error> for LocalError {
    fn from(e: std::io::Error) -> Self {
        Self::Write(e)
    }
}

impl From<ApiError> for LocalError {
    fn from(e: ApiError) -> Self {
        Self::Request(e)
    }
}

/// The tenant a local run's request belongs to: its engine has no other.
const LOCAL_TENANT: TenantId = match TenantId::new(1) {
    Some(t) => t,
    None => panic!("1 is a tenant id"),
};

/// Runs `run`, printing each stage to `out`.
pub fn run(run: &LocalRun, out: &mut dyn Write) -> Result<(), LocalError> {
    let read = |p: &PathBuf| std::fs::read(p).map_err(|e| LocalError::Read(p.clone(), e));
    let component = read(&run.component)?;
    let body = read(&run.request)?;
    let model = LoadedModel::open(&run.model)?;
    let limits = limits_of(&run.plugins);
    let plugin_failed = |stage| move |failure| LocalError::Plugin { stage, failure };
    let runtime = Runtime::new(1, limits.memory_bytes).map_err(plugin_failed("setup"))?;
    let plugin = runtime.compile(&component).map_err(plugin_failed("compile"))?;
    let (asked, plan) = parse(&body)?;
    let tokio = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(LocalError::Write)?;
    tokio.block_on(async {
        let seed = plan.params.sampling().seed.unwrap_or(0);
        let time = RequestTime::new(limits.request_time);
        let tk = model.tokenizer.clone();
        writeln!(out, "world: warden:plugin@{}", plugin.world())?;
        // As the server does: init once, and the request starts from its state where it can.
        let mut plugin = plugin;
        if plugin.world() != "0.1.0" {
            let (snapshot, init_logs) = pre_initialise(
                &component,
                &run.config,
                limits,
                tk.clone(),
                run.plugins.max_component_bytes,
                |b: Vec<u8>| std::future::ready(runtime.compile(&b)),
                std::future::ready(Some(())),
            )
            .await
            .map_err(plugin_failed("init"))?;
            for l in init_logs {
                writeln!(out, "log: {l}")?;
            }
            match snapshot {
                Snapshot::Taken(p) => {
                    writeln!(out, "init: pre-initialised: requests start from its state")?;
                    plugin = p;
                }
                Snapshot::Kept(why) => writeln!(out, "init: runs on every request: {why}")?,
            }
        }
        let mut i = plugin
            .instantiate(limits, tk.clone(), seed, time, &run.config)
            .await
            .map_err(plugin_failed("init"))?;
        let caps = i.capabilities().await;
        logs(&mut i, out)?;
        let caps = caps.map_err(plugin_failed("capabilities"))?;
        writeln!(out, "capabilities: on-token={}", caps.on_token)?;
        let metadata = vec![
            ("tenant".to_string(), "local".to_string()),
            ("request-id".into(), "local".into()),
            ("model".into(), model_id(run)),
        ];
        let call = Rewrite::new(asked, plan.params, run.config.clone(), metadata, &tk);
        writeln!(out, "preprocess <- {}", request_json(&call.request))?;
        let rewritten = i.preprocess(&call.request).await;
        logs(&mut i, out)?;
        let rewritten = rewritten.map_err(plugin_failed("preprocess"))?;
        writeln!(out, "preprocess -> {}", request_json(&rewritten))?;
        check_rewritten(&rewritten, 1 << 20).map_err(plugin_failed("preprocess"))?;
        let (asked, params, first) = call.finish(rewritten)?;
        let first = first
            .map(|c| engine_constraint(c, tk.vocab_size()))
            .transpose()
            .map_err(plugin_failed("preprocess"))?;
        if let Some(c) = &first {
            let allowed = c.allowed.as_ref().map_or("any".to_string(), |a| a.len().to_string());
            writeln!(
                out,
                "first token: constrain (allowed: {allowed}, biased: {})",
                c.bias.len()
            )?;
        }
        let prompt = match asked {
            Asked::Tokens(ids) => ids,
            Asked::Text(text) => tk.encode(&text, true),
            Asked::Chat(messages) => {
                let template = model.chat.as_ref().ok_or_else(|| {
                    LocalError::Engine("the model has no chat template; send a completions request".into())
                })?;
                let tools = plan.tools.as_ref().and_then(Tools::shown);
                let text = render(template, messages, tools.as_ref(), true)
                    .map_err(|e| ApiError::field("messages", format!("rendering the chat template: {e}")))?;
                tk.encode_chat(&text)
            }
        };
        writeln!(out, "prompt: {} tokens", prompt.len())?;
        // One request: the pool need only hold it.
        let mut cfg = EngineConfig::for_model(&model.model);
        let need = (prompt.len() + params.max_tokens()).next_multiple_of(cfg.page_size);
        cfg.max_context = cfg.max_context.min(need.max(cfg.page_size));
        let mut engine =
            Engine::new(model.model.clone(), tk.clone(), cfg).map_err(|e| LocalError::Engine(e.to_string()))?;
        let mut req = params
            .with_prompt(LOCAL_TENANT, prompt, &engine.limits())
            .map_err(ApiError::from)?;
        if plan.format != Format::Text {
            let grammars = Grammars::new(
                tk.clone(),
                GrammarLimits {
                    max_schema_bytes: usize::MAX,
                    compile_ms: u64::MAX,
                    memory_bytes: u64::MAX,
                },
            );
            let field = if matches!(plan.format, Format::Grammar(_)) {
                "tools"
            } else {
                "response_format"
            };
            let c = grammars
                .compile(&plan.format)
                .map_err(|e| ApiError::field(field, format!("{field}: {e}")))?;
            req = req.with_constraint(c);
        }
        // As the server does: each token waits for on-token's verdict.
        let steer = Steer::for_plugin(caps.on_token, first).map(Arc::new);
        if let Some(s) = &steer {
            req = req.with_steer(s.clone());
        }
        let id = engine
            .submit(req)
            .map_err(|r| LocalError::Engine(format!("{} ({})", r.reason, r.reason.code())))?;
        let steer = steer.filter(|_| caps.on_token);
        generate(&mut engine, &tk, id, steer, &mut i, out).await
    })
}

/// Steps the engine until request `id` ends, running the plugin's output calls on each token.
async fn generate(
    engine: &mut Engine,
    tk: &Tokenizer,
    id: crate::engine::request::RequestId,
    steer: Option<Arc<Steer>>,
    i: &mut Instance,
    out: &mut dyn Write,
) -> Result<(), LocalError> {
    let failed = |stage| move |failure| LocalError::Plugin { stage, failure };
    let mut index = 0u32;
    let mut output = String::new();
    loop {
        for ev in engine.step() {
            match ev {
                Event::Token { token, text, .. } => {
                    index += 1;
                    let shown = String::from_utf8_lossy(&tk.token_bytes(token)).into_owned();
                    if let Some(steer) = &steer {
                        // As the server gives it: the text the token makes safe to show (empty
                        // while a character or a possible stop string is incomplete).
                        let action = i
                            .on_token(&Token {
                                id: token,
                                text: text.clone(),
                                index,
                            })
                            .await;
                        logs(i, out)?;
                        let (said, next) = match action.map_err(failed("on-token"))? {
                            TokenAction::Continue => ("continue".to_string(), None),
                            TokenAction::Stop => {
                                engine.stop(id);
                                ("stop".to_string(), None)
                            }
                            TokenAction::Constrain(c) => {
                                let c = engine_constraint(c, tk.vocab_size()).map_err(failed("on-token"))?;
                                let allowed = c.allowed.as_ref().map_or("any".to_string(), |a| a.len().to_string());
                                let said = format!("constrain (allowed: {allowed}, biased: {})", c.bias.len());
                                (said, Some(c))
                            }
                        };
                        writeln!(out, "token {index}: {token} {shown:?} -> {said}")?;
                        steer.answer(next);
                    } else {
                        writeln!(out, "token {index}: {token} {shown:?}")?;
                    }
                    // Every token, as the server calls it (its text may be empty).
                    let post = i.postprocess(&text, None).await;
                    logs(i, out)?;
                    let post = post.map_err(failed("postprocess"))?;
                    writeln!(out, "postprocess {text:?} -> {post:?}")?;
                    output.push_str(&post);
                }
                Event::Done {
                    outcome, text, usage, ..
                } => {
                    let reason = match outcome {
                        Outcome::Finished(f) => f,
                        Outcome::Aborted(why) => return Err(LocalError::Engine(why.to_string())),
                    };
                    let post = i.postprocess(&text, Some(&finish(reason, &usage))).await;
                    logs(i, out)?;
                    let post = post.map_err(failed("postprocess"))?;
                    writeln!(out, "postprocess (final) {text:?} -> {post:?}")?;
                    output.push_str(&post);
                    let finish = reason.as_str();
                    writeln!(
                        out,
                        "finish: {finish}, {} prompt + {} completion tokens",
                        usage.prompt_tokens, usage.completion_tokens
                    )?;
                    writeln!(out, "output: {output:?}")?;
                    return Ok(());
                }
                Event::Prefilled { .. } | Event::Opened { .. } => {
                    return Err(LocalError::Engine(
                        "the request ended as half of a disaggregated one".into(),
                    ));
                }
            }
        }
    }
}

/// The model's id as the server names it: its file name without `.gguf`.
fn model_id(run: &LocalRun) -> String {
    run.model
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Prints the log lines of the call that just ran.
fn logs(i: &mut Instance, out: &mut dyn Write) -> std::io::Result<()> {
    for line in i.take_logs() {
        writeln!(out, "log: {line}")?;
    }
    Ok(())
}

/// The request body as the server checks it (one choice), as what it asks and its plan.
fn parse(body: &[u8]) -> Result<(Asked, crate::serve::openai::Plan), LocalError> {
    // A request that names no max_tokens runs to at most 256 tokens here (the server gives it the
    // rest of its context).
    let lim = RequestLimits {
        default_max_tokens: 256,
        max_n: 1,
    };
    let is_chat = serde_json::from_slice::<Value>(body)
        .ok()
        .is_some_and(|v| v.get("messages").is_some());
    if is_chat {
        let r = ChatRequest::parse(body, 64, UnknownFields::Ignore)?;
        Ok((Asked::Chat(r.chat_messages()?), r.plan(&lim)?))
    } else {
        let r = CompletionRequest::parse(body, 64, UnknownFields::Ignore)?;
        let plan = r.common.plan(&lim, r.logprobs()?)?;
        Ok((r.asked()?, plan))
    }
}

/// A WIT request as JSON, for the report.
fn request_json(r: &Request) -> Value {
    let input = match &r.input {
        Input::Chat(messages) => json!({"chat": messages
            .iter()
            .map(|m| json!({"role": m.role, "content": m.content}))
            .collect::<Vec<_>>()}),
        Input::Prompt(p) => json!({"prompt": p}),
    };
    let s = &r.sampling;
    json!({
        "input": input,
        "sampling": {
            "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "min_p": s.min_p,
            "repetition_penalty": s.repetition_penalty, "presence_penalty": s.presence_penalty,
            "frequency_penalty": s.frequency_penalty, "max_tokens": s.max_tokens, "seed": s.seed,
            "stop": s.stop, "logit_bias": s.logit_bias,
        },
        "config": r.config,
        "metadata": r.metadata,
        "first_token": r.first_token.as_ref().map(|c| json!({
            "allowed": c.allowed.as_ref().map(Vec::len), "bias": c.bias.len(),
        })),
    })
}
