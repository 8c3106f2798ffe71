//! Plugin overhead, against the same request without a plugin, in one run. Prints one JSON
//! object:
//!
//! - `per_request`: for each example plugin, instantiate + `preprocess` + one final
//!   `postprocess` of a small chat request, p50 and p99 in µs (with each part's p50, and the
//!   teardown that follows the response); and as the baseline, what the host does for the same
//!   request without a plugin before it reaches the engine (render the chat template,
//!   tokenize).
//! - `on_token`: `on-token` per generated token (the JSON guard), and a streaming `postprocess`
//!   per token (the PII redactor), µs.
//! - `upload`: validating and storing a ~1 MB component (the regex filter) through the upload
//!   path the server runs: compile, check the world, smoke call under fuel, write to sled.
//!
//! `cargo run --release -p warden --example plugin_bench` (build the guest examples first, as
//! the test command does).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use warden::chat::{ChatMessage, ChatTemplate};
use warden::config::PluginsConfig;
use warden::plugin::snapshot::{Snapshot, pre_initialise};
use warden::plugin::{Input, Message, PluginLimits, Request, RequestTime, Runtime, Sampling, Token, neutral_sampling};
use warden::serve::plugins::Plugins;
use warden::serve::store::Store;
use warden::tokenizer::Tokenizer;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn example(name: &str) -> Vec<u8> {
    let p = root()
        .join("guest-sdk/target/wasm32-wasip2/release/examples")
        .join(format!("{name}.wasm"));
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}; build the guest examples first", p.display()))
}

fn percentiles(mut v: Vec<Duration>) -> serde_json::Value {
    v.sort();
    let at = |q: f64| v[((v.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e6;
    json!({"p50_us": (at(0.5) * 10.0).round() / 10.0, "p99_us": (at(0.99) * 10.0).round() / 10.0})
}

const USER: &str = "Please summarise the attached meeting notes in three bullet points.";
const OUTPUT: &str = "- The launch moves to May.\n- Budget is approved.\n- Alice owns the rollout.";

fn request(config: &str) -> Request {
    Request {
        input: Input::Chat(vec![Message {
            role: "user".into(),
            content: USER.into(),
        }]),
        sampling: Sampling {
            temperature: 0.7,
            seed: Some(1),
            ..neutral_sampling(128)
        },
        config: config.into(),
        metadata: vec![("endpoint".into(), "chat.completions".into())],
        first_token: None,
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let model = root().join(warden::DEFAULT_MODEL);
    let g = warden::gguf::Gguf::open(&model)?;
    let tokenizer = Arc::new(Tokenizer::from_gguf(&g)?);
    let template = ChatTemplate::from_gguf(&g)?.expect("the default model has a chat template");
    let runtime = Runtime::new(64, 64 << 20)?;
    let limits = PluginLimits::default();
    let iters = 2000;
    let end = warden::plugin::Finish {
        reason: "stop".into(),
        prompt_tokens: 20,
        completion_tokens: 30,
    };

    // Baseline: the host's own work on the same request, no plugin.
    let mut base = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        let text = template.render(&[ChatMessage::new("user", USER)], true)?;
        std::hint::black_box(tokenizer.encode(&text, true));
        base.push(t.elapsed());
    }
    let mut per_request = serde_json::Map::new();
    per_request.insert("baseline_no_plugin".into(), percentiles(base.clone()));
    for (name, config) in [
        ("system_prompt", "You are a concise assistant."),
        ("pii_redactor", ""),
        ("json_guard", ""),
        (
            "regex_filter",
            "deny: (?i)\\bpassword\\b\nreplace: \\bAlice\\b => [name]",
        ),
        ("ban_words", "delve\ntapestry"),
        ("regex_guard", "- [A-Z][a-z ,.]{0,200}"),
        ("prefix_pin", "You are a concise assistant."),
        ("legacy_v0_1", "You are a concise assistant."),
    ] {
        // As the server runs it: initialised once for its configuration where it can be.
        let bytes = example(name);
        let plugin = match pre_initialise(
            &bytes,
            config,
            limits,
            tokenizer.clone(),
            PluginsConfig::default().max_component_bytes,
            |b: Vec<u8>| std::future::ready(runtime.compile(&b)),
            std::future::ready(Some(())),
        )
        .await?
        .0
        {
            Snapshot::Taken(p) => p,
            Snapshot::Kept(_) => runtime.compile(&bytes)?,
        };
        let req = request(config);
        let (mut times, mut inst_t, mut pre_t, mut post_t, mut drop_t) = (vec![], vec![], vec![], vec![], vec![]);
        for i in 0..iters {
            let t = Instant::now();
            let mut inst = plugin
                .instantiate(
                    limits,
                    tokenizer.clone(),
                    i as u64,
                    RequestTime::new(limits.request_time),
                    config,
                )
                .await?;
            let t1 = Instant::now();
            std::hint::black_box(inst.preprocess(&req).await?);
            let t2 = Instant::now();
            std::hint::black_box(inst.postprocess(OUTPUT, Some(&end)).await?);
            let t3 = Instant::now();
            drop(inst);
            drop_t.push(t3.elapsed());
            times.push(t3 - t);
            inst_t.push(t1 - t);
            pre_t.push(t2 - t1);
            post_t.push(t3 - t2);
        }
        let mut v = percentiles(times);
        v["pre_initialised"] = plugin.pre_initialised().into();
        v["instantiate_p50_us"] = percentiles(inst_t)["p50_us"].clone();
        v["preprocess_p50_us"] = percentiles(pre_t)["p50_us"].clone();
        v["postprocess_p50_us"] = percentiles(post_t)["p50_us"].clone();
        // Dropping the instance (resetting its slot) happens after the response is sent.
        v["teardown_p50_us"] = percentiles(drop_t)["p50_us"].clone();
        per_request.insert(name.into(), v);
    }

    // Per token: on-token (JSON guard) and streaming postprocess (redactor).
    let tokens: Vec<String> = [
        "{\"", "summary", "\": [\"", "The", " launch", " moves", " to", " May", "\", \"",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let n_tokens = 20_000;
    let guard = runtime.compile(&example("json_guard"))?;
    let redactor = runtime.compile(&example("pii_redactor"))?;
    let mut on_token = Vec::new();
    let mut post_token = Vec::new();
    let mut sent = 0;
    while sent < n_tokens {
        let mut g = guard
            .instantiate(limits, tokenizer.clone(), 0, RequestTime::new(limits.request_time), "")
            .await?;
        let mut r = redactor
            .instantiate(limits, tokenizer.clone(), 0, RequestTime::new(limits.request_time), "")
            .await?;
        // Keep each stream open-ended JSON (a long string), so the guard keeps saying continue.
        for (i, text) in std::iter::once("{\"notes\": \"".to_string())
            .chain(tokens.iter().skip(3).cycle().take(500).cloned())
            .enumerate()
        {
            // The guard reads a token's bytes by its id: the piece's first token.
            let tok = Token {
                id: tokenizer.encode(&text, false).first().copied().unwrap_or(0),
                text: text.clone(),
                index: i as u32 + 1,
            };
            let t = Instant::now();
            std::hint::black_box(g.on_token(&tok).await?);
            on_token.push(t.elapsed());
            let t = Instant::now();
            std::hint::black_box(r.postprocess(&text, None).await?);
            post_token.push(t.elapsed());
            sent += 1;
        }
    }

    // Upload validation of a ~1 MB component, through the server's upload path.
    let big = example("regex_filter");
    let dir = std::env::temp_dir().join(format!("warden-plugin-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let store = Store::open(&dir)?;
    let tenant = store.create_tenant("bench")?;
    // Uploads compile in a child `warden compile-plugin`, as in the server: the binary built
    // beside this example (`cargo build --release` first).
    let compiler = std::env::current_exe()?
        .parent()
        .and_then(|examples| examples.parent())
        .map(|profile| profile.join("warden"))
        .filter(|w| w.exists())
        .ok_or_else(|| anyhow::anyhow!("build the warden binary first: cargo build --release"))?;
    let plugins = Plugins::new(
        store,
        PluginsConfig::default(),
        &dir.join("plugin-cache"),
        tokenizer.clone(),
        &compiler,
    )?;
    let mut uploads = Vec::new();
    for i in 0..5 {
        let t = Instant::now();
        // Not activated: activating starts pre-initialising it in the background, whose
        // compiles would take the next upload's turn at the compiler.
        plugins
            .upload(&tenant, &Default::default(), &format!("filter{i}"), big.clone(), false)
            .await?;
        uploads.push(t.elapsed());
    }
    let _ = std::fs::remove_dir_all(&dir);
    uploads.sort();
    let base_p50 = {
        let mut b = base;
        b.sort();
        b[b.len() / 2]
    };
    let report = json!({
        "per_request": per_request,
        "baseline_p50_us_for_ratio": base_p50.as_secs_f64() * 1e6,
        "on_token": {
            "json_guard_on_token": percentiles(on_token),
            "pii_redactor_postprocess_per_token": percentiles(post_token),
            "tokens": sent,
        },
        "upload": {
            "component_bytes": big.len(),
            "median_ms": uploads[uploads.len() / 2].as_secs_f64() * 1e3,
            "max_ms": uploads[uploads.len() - 1].as_secs_f64() * 1e3,
            "runs": uploads.len(),
        },
    });
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}
