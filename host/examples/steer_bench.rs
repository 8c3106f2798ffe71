//! Plugin steering against unconstrained decode, same engine and prompts, in one run: `k`
//! sequences each decode `--tokens` tokens, once as they are and once with a plugin's `on-token`
//! answering every token (its constraint applied to the next one, which waits for it, as the
//! server runs it). Prints one JSON object with tok/s of both and their ratio, for 1 and 16
//! sequences, the best of `--repeats` alternated runs each.
//!
//! `cargo run --release -p warden --example steer_bench -- [--plugin ban_words] [--config TEXT]
//! [--tokens 128] [--repeats 3] [--model PATH]` (build the guest examples first, as the test
//! command does). `ban_words` biases a few tokens at every step (the cost of steering itself);
//! `json_guard` checks the whole vocabulary at every step (a plugin's own work on top).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use warden::engine::request::{GenerateRequest, Outcome, RequestId};
use warden::engine::steer::Steer;
use warden::engine::{Engine, EngineConfig, Event};
use warden::loaded::LoadedModel;
use warden::plugin::{
    Input, Instance, Message, PluginLimits, Request, RequestTime, Runtime, Sampling, Token, neutral_sampling,
};
use warden::serve::plugins::pipeline::engine_constraint;
use warden::tenant::TenantId;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn arg(name: &str, default: &str) -> String {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
        .unwrap_or_else(|| default.to_string())
}

fn tenant(n: u64) -> TenantId {
    TenantId::new(n).expect("nonzero")
}

/// A preprocess request, for the plugin's first-token constraint.
fn request(config: &str) -> Request {
    Request {
        input: Input::Chat(vec![Message {
            role: "user".into(),
            content: "Go on.".into(),
        }]),
        sampling: Sampling {
            temperature: 0.0,
            ..neutral_sampling(1024)
        },
        config: config.into(),
        metadata: vec![],
        first_token: None,
    }
}

struct Steered {
    instance: Instance,
    steer: Arc<Steer>,
    index: u32,
}

/// Decodes `tokens` tokens for each of `k` sequences; with `plugin`, each is steered by its own
/// instance. Returns the time of the decode steps alone (after every first token).
async fn run(
    model: &LoadedModel,
    plugin: Option<(&warden::plugin::Plugin, &str)>,
    k: usize,
    tokens: usize,
) -> anyhow::Result<Duration> {
    let cfg = EngineConfig::for_model(&model.model);
    let mut e = Engine::new(model.model.clone(), model.tokenizer.clone(), cfg)?;
    let limits = PluginLimits {
        call_timeout: Duration::from_secs(5),
        request_time: Duration::from_secs(600),
        ..PluginLimits::default()
    };
    let vocab = model.tokenizer.vocab_size();
    let mut steered: std::collections::HashMap<RequestId, Steered> = Default::default();
    for i in 0..k {
        let prompt: Vec<u32> = (0..16).map(|j| 1000 + (i * 16 + j) as u32).collect();
        let mut req = GenerateRequest::greedy(tenant(1 + i as u64), prompt, tokens);
        req.ignore_eos = true;
        let mut valid = req.validate(&e.limits()).map_err(|r| anyhow::anyhow!("{}", r.reason))?;
        let mut held = None;
        if let Some((p, config)) = plugin {
            let time = RequestTime::new(limits.request_time);
            let mut instance = p.instantiate(limits, model.tokenizer.clone(), 1, time, config).await?;
            let out = instance.preprocess(&request(config)).await?;
            let first = out.first_token.map(|c| engine_constraint(c, vocab)).transpose()?;
            let steer = Arc::new(Steer::new(first));
            valid = valid.with_steer(steer.clone());
            held = Some(Steered {
                instance,
                steer,
                index: 0,
            });
        }
        let id = e.submit(valid).map_err(|r| anyhow::anyhow!("{}", r.reason))?;
        if let Some(s) = held {
            steered.insert(id, s);
        }
    }
    let mut started = 0;
    let mut t0 = None;
    while e.has_work() {
        if started >= k && t0.is_none() {
            t0 = Some(Instant::now());
        }
        for ev in e.step() {
            match ev {
                Event::Token { id, token, text, .. } => {
                    started += 1;
                    if let Some(s) = steered.get_mut(&id) {
                        s.index += 1;
                        let t = Token {
                            id: token,
                            text,
                            index: s.index,
                        };
                        let next = match s.instance.on_token(&t).await? {
                            warden::plugin::TokenAction::Constrain(c) => Some(engine_constraint(c, vocab)?),
                            _ => None,
                        };
                        s.steer.answer(next);
                    }
                }
                Event::Done { outcome, .. } => {
                    anyhow::ensure!(matches!(outcome, Outcome::Finished(_)), "ended with {outcome:?}");
                }
                _ => {}
            }
        }
    }
    Ok(t0.map(|t| t.elapsed()).unwrap_or_default())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let name = arg("--plugin", "ban_words");
    let config = arg("--config", "Paris\nLondon\nthe\nThe");
    let tokens: usize = arg("--tokens", "128").parse()?;
    let repeats: usize = arg("--repeats", "3").parse()?;
    let model_path = PathBuf::from(arg("--model", &root().join(warden::DEFAULT_MODEL).to_string_lossy()));
    let model = LoadedModel::open(&model_path)?;
    let wasm = root()
        .join("guest-sdk/target/wasm32-wasip2/release/examples")
        .join(format!("{name}.wasm"));
    let bytes = std::fs::read(&wasm).map_err(|e| anyhow::anyhow!("{}: {e}", wasm.display()))?;
    let runtime = Runtime::new(32, 64 << 20)?;
    let plugin = runtime.compile(&bytes)?;
    let mut figures = Vec::new();
    for k in [1usize, 16] {
        let (mut plain, mut steered) = (Duration::MAX, Duration::MAX);
        for _ in 0..repeats {
            plain = plain.min(run(&model, None, k, tokens).await?);
            steered = steered.min(run(&model, Some((&plugin, &config)), k, tokens).await?);
        }
        // Every sequence decodes `tokens - 1` tokens after its first.
        let decoded = (k * (tokens - 1)) as f64;
        let (a, b) = (decoded / plain.as_secs_f64(), decoded / steered.as_secs_f64());
        figures.push(json!({
            "sequences": k,
            "tok_s_unconstrained": (a * 10.0).round() / 10.0,
            "tok_s_steered": (b * 10.0).round() / 10.0,
            "ratio": (b / a * 1000.0).round() / 1000.0,
        }));
    }
    let report = json!({
        "plugin": name,
        "model": model_path.file_name().map(|f| f.to_string_lossy().into_owned()),
        "tokens": tokens,
        "repeats": repeats,
        "figures": figures,
    });
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}
