//! Hostile plugins against a release server with its default limits, while another tenant
//! measures its own service. For each attack (the SDK's `adversary` example, configured to it):
//! how the attacker's calls ended and how long they took, the server's resident memory before
//! and after, and the victim's latency during the attack (a short chat completion through its
//! own plugin, and `/healthz`) against the same measured idle, in one run. Then the upload
//! attacks (a component with 512 memories, one slow to compile) and what `page-info` shows.
//!
//! ```sh
//! cargo build --release && cargo build --manifest-path guest-sdk/Cargo.toml --target wasm32-wasip2 --release --examples
//! cargo run --release --example hostile_bench [-- --seconds 6]
//! ```

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use hyper::Method;
use serde_json::{Value, json};
use warden::serve::client::{Client, Reply};

mod common;
use common::{example, rss_mib};

#[derive(Parser)]
struct Args {
    /// Seconds each attack runs while the victim measures.
    #[arg(long, default_value_t = 6)]
    seconds: u64,
    /// The model.
    #[arg(long, default_value = warden::DEFAULT_MODEL)]
    model: PathBuf,
}

fn pct(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn code(r: &Reply) -> String {
    match r
        .json()
        .ok()
        .and_then(|v| v["error"]["code"].as_str().map(str::to_string))
    {
        Some(c) => c,
        None => r.status.to_string(),
    }
}

fn chat_body(model: &str, plugin: &str, max_tokens: usize) -> Vec<u8> {
    json!({
        "model": model, "plugin": plugin, "temperature": 0, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "Write a poem about the sea."}],
    })
    .to_string()
    .into_bytes()
}

/// The victim's service until `end`: chat latencies and health-check latencies (ms), and the
/// requests that did not succeed, by code.
async fn victim(c: &Client, key: &str, model: &str, end: Instant) -> (Vec<f64>, Vec<f64>, BTreeMap<String, usize>) {
    let (mut chat, mut health, mut failed) = (Vec::new(), Vec::new(), BTreeMap::new());
    while Instant::now() < end {
        let t0 = Instant::now();
        match c
            .request(
                Method::POST,
                "/v1/chat/completions",
                Some(key),
                Some(chat_body(model, "vp", 4)),
            )
            .await
        {
            Ok(r) if r.status == 200 => chat.push(t0.elapsed().as_secs_f64() * 1e3),
            Ok(r) => *failed.entry(code(&r)).or_default() += 1,
            Err(e) => *failed.entry(format!("transport: {e}")).or_default() += 1,
        }
        let t0 = Instant::now();
        match c.request(Method::GET, "/healthz", None, None).await {
            Ok(r) if r.status == 200 => health.push(t0.elapsed().as_secs_f64() * 1e3),
            Ok(r) => *failed.entry(format!("healthz {}", r.status)).or_default() += 1,
            Err(e) => *failed.entry(format!("healthz transport: {e}")).or_default() += 1,
        }
    }
    (chat, health, failed)
}

/// `workers` loops of the attacker's request until `end`: each call's duration (ms) and how
/// each ended.
async fn attacker(
    c: &Client,
    key: &str,
    body: Vec<u8>,
    workers: usize,
    end: Instant,
) -> (Vec<f64>, BTreeMap<String, usize>) {
    let tasks: Vec<_> = (0..workers)
        .map(|_| {
            let (c, key, body) = (c.clone(), key.to_string(), body.clone());
            tokio::spawn(async move {
                let mut out = Vec::new();
                loop {
                    let t0 = Instant::now();
                    let r = c
                        .request(Method::POST, "/v1/chat/completions", Some(&key), Some(body.clone()))
                        .await;
                    let ended = match r {
                        Ok(r) if r.status == 200 => "200".to_string(),
                        Ok(r) => code(&r),
                        Err(e) => format!("transport: {e}"),
                    };
                    out.push((t0.elapsed().as_secs_f64() * 1e3, ended));
                    if Instant::now() >= end {
                        return out;
                    }
                }
            })
        })
        .collect();
    let (mut times, mut codes) = (Vec::new(), BTreeMap::new());
    for t in tasks {
        for (ms, c) in t.await.unwrap_or_default() {
            times.push(ms);
            *codes.entry(c).or_default() += 1;
        }
    }
    (times, codes)
}

async fn put(c: &Client, path: &str, key: &str, body: &[u8]) -> anyhow::Result<Reply> {
    Ok(c.request(Method::PUT, path, Some(key), Some(body.to_vec())).await?)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let bin = common::warden_bin()?;
    let (model, id) = common::model(&args.model)?;
    let dir = std::env::temp_dir().join(format!("warden-hostile-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let (server, c, victim_key) = common::server(&bin, &dir, "all", &model, "")?;
    let pid = server.0.id();
    let admin = common::admin_token(&dir, "all")?;
    let rt = common::runtime()?;
    let span = Duration::from_secs(args.seconds);
    rt.block_on(async {
        let r = c.request(Method::POST, "/admin/v1/tenants", Some(&admin), Some(br#"{"name":"mallory"}"#.to_vec())).await?;
        anyhow::ensure!(r.status == 201, "creating mallory: {}", r.text());
        let r = c.request(Method::POST, "/admin/v1/tenants/mallory/keys", Some(&admin), None).await?;
        let mallory = r.json()?["key"].as_str().context("mallory's key")?.to_string();
        let r = put(&c, "/v1/plugins/adv", &mallory, &example("adversary")?).await?;
        anyhow::ensure!(r.status == 201, "uploading the adversary: {}", r.text());
        let r = put(&c, "/v1/plugins/vp", &victim_key, &example("system_prompt")?).await?;
        anyhow::ensure!(r.status == 201, "uploading the victim's plugin: {}", r.text());
        put(&c, "/v1/plugins/vp/config", &victim_key, b"You are brief.").await?;
        // Warm up, then the victim's service idle.
        victim(&c, &victim_key, &id, Instant::now() + Duration::from_secs(2)).await;
        let (chat0, health0, failed0) = victim(&c, &victim_key, &id, Instant::now() + span).await;
        let (c50, c99, h99) = (pct(&chat0, 0.5), pct(&chat0, 0.99), pct(&health0, 0.99));
        println!(
            "{}",
            json!({"idle": {"victim_chat_p50_ms": c50, "victim_chat_p99_ms": c99, "victim_healthz_p99_ms": h99, "victim_failed": failed0, "server_rss_mib": rss_mib(pid)}})
        );
        // (attack, the adversary's config, concurrent attacker requests, max_tokens)
        let attacks: [(&str, &str, usize, usize); 12] = [
            ("sleep in a host call (20 s, then forever)", "sleep-forever", 4, 8),
            ("tokenizer.encode of 16 MiB", "encode-huge", 2, 8),
            ("tokenizer.encode of 64 KiB in a loop", "encode-loop", 2, 8),
            ("tokenizer.decode of 64 Ki tokens in a loop", "decode-loop", 2, 8),
            ("log lines in a loop", "log-loop", 2, 8),
            ("preprocess returns a 40 MiB prompt", "big40", 2, 8),
            ("preprocess returns 100,000 messages", "many", 2, 8),
            ("postprocess returns 2 MiB per chunk", "flood", 2, 32),
            ("a spinning guest", "loop", 2, 8),
            ("a memory bomb", "bomb", 2, 8),
            ("many instances held at once", "pass", 300, 64),
            ("kv pages and their epochs", "kv", 2, 8),
        ];
        for (what, config, workers, max_tokens) in attacks {
            let r = put(&c, "/v1/plugins/adv/config", &mallory, config.as_bytes()).await?;
            anyhow::ensure!(r.status == 200, "{}", r.text());
            let before = rss_mib(pid);
            let end = Instant::now() + span;
            let bad = attacker(&c, &mallory, chat_body(&id, "adv", max_tokens), workers, end);
            let good = victim(&c, &victim_key, &id, end);
            let ((times, codes), (chat, health, failed)) = tokio::join!(bad, good);
            println!(
                "{}",
                json!({
                    "attack": what, "config": config, "attacker_requests": times.len(), "attacker_outcomes": codes,
                    "attacker_call_p50_ms": pct(&times, 0.5), "attacker_call_max_ms": pct(&times, 1.0),
                    "server_rss_mib_before": before, "server_rss_mib_after": rss_mib(pid),
                    "victim_chat_p50_ms": pct(&chat, 0.5), "victim_chat_p99_ms": pct(&chat, 0.99),
                    "victim_chat_p99_ratio": pct(&chat, 0.99) / c99.max(1e-9),
                    "victim_healthz_p99_ms": pct(&health, 0.99), "victim_failed": failed,
                })
            );
        }
        // What page-info shows after all that churn.
        let r = c.request(Method::POST, "/v1/chat/completions", Some(&mallory), Some(chat_body(&id, "adv", 8))).await?;
        let text = r.json().map(|v| v["choices"][0]["message"]["content"].clone()).unwrap_or(Value::Null);
        println!("{}", json!({"page_info_as_the_guest_sees_it": text}));
        // Upload attacks, the victim measuring meanwhile.
        // 512 memories: 8 instances of a module of 64 (a module may declare at most 100).
        let greedy = format!(
            "(component (core module $m {}) {})",
            "(memory 1) ".repeat(64),
            "(core instance (instantiate $m)) ".repeat(8)
        );
        let mut slow = String::new();
        // Quadratic in n: about 45 s of Cranelift here, past the default 30 s limit.
        let n = 30_000;
        for i in 2..n {
            slow.push_str(&format!("(local.set {i} (i64.mul (local.get {}) (local.get {})))", i - 1, i - 2));
        }
        slow.push_str("(loop $l ");
        for i in 0..n {
            slow.push_str(&format!("(local.set 0 (i64.add (local.get 0) (local.get {i})))"));
        }
        slow.push_str("(br_if $l (i64.eqz (local.get 0))))");
        let slow = format!(
            "(component (core module (func (param i64 i64) (result i64) (local {}) {slow} (local.get 0))))",
            "i64 ".repeat(n)
        );
        let uploads = [
            ("512 linear memories", greedy, span),
            ("slow to compile (about 45 s of Cranelift)", slow, Duration::from_secs(32)),
        ];
        for (what, wat, measured) in uploads {
            let bytes = wat::parse_str(&wat)?;
            let before = rss_mib(pid);
            let path = format!("/v1/plugins/up{}", bytes.len() % 1000);
            let upload = async {
                let t0 = Instant::now();
                let r = put(&c, &path, &mallory, &bytes).await;
                (r, t0.elapsed())
            };
            let good = victim(&c, &victim_key, &id, Instant::now() + measured);
            let ((r, took), (chat, health, failed)) = tokio::join!(upload, good);
            let r = r?;
            println!(
                "{}",
                json!({
                    "upload": what, "bytes": bytes.len(), "status": r.status, "code": code(&r),
                    "upload_ms": took.as_secs_f64() * 1e3,
                    "server_rss_mib_before": before, "server_rss_mib_after": rss_mib(pid),
                    "victim_chat_p99_ms": pct(&chat, 0.99), "victim_chat_p99_ratio": pct(&chat, 0.99) / c99.max(1e-9),
                    "victim_healthz_p99_ms": pct(&health, 0.99), "victim_failed": failed,
                })
            );
        }
        Ok::<_, anyhow::Error>(())
    })?;
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
