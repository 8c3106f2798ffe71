//! Hostile plugins against a release server with its default limits, while another tenant
//! measures its own service. For each attack (the SDK's `adversary` example, configured to it):
//! how the attacker's calls ended and how long they took, the server's resident memory before
//! and after, and the victim's latency during the attack (a short chat completion through its
//! own plugin, and `/healthz`) against the same measured idle, in one run. Then the upload
//! attacks (a component with 512 memories, one slow to compile) and what `page-info` shows.
//!
//! Then round two, the attacks on capacity every tenant shares, each followed by a pause
//! (`--settle`, 60 s) and the server's resident memory again: schema compiles (a 1.6 KB schema of
//! forty four-digit `multipleOf`s, new each request, and the 38-byte `multipleOf: 999983`;
//! `tools` with `tool_choice: "required"` the same way), running slots (streams of `n: 8`
//! with no `max_tokens` and the end of text biased away), KV pages (open-ended long prompts,
//! the victim's long request timed against its idle figure), a plugin whose `init` cannot be
//! captured and spins on every request, a flood of unknown fields (is the victim's still
//! counted by name?), the plugin compiler (six uploads that each run into the compile timeout,
//! the victim's upload timed), and slow connections from 64 loopback addresses against a
//! decode node's operations endpoint.
//!
//! ```sh
//! cargo build --release && cargo build --manifest-path guest-sdk/Cargo.toml --target wasm32-wasip2 --release --examples
//! cargo run --release --example hostile_bench [-- --seconds 6 --settle 60 --only slots,pages]
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
    /// Seconds after each round-two attack before the server's memory is read again.
    #[arg(long, default_value_t = 60)]
    settle: u64,
    /// Run only the attacks whose name contains one of these (round one's by their names; round
    /// two's are `schema`, `slots`, `pages`, `init`, `fields`, `compiler` and `connections`).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
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
        let wanted = |name: &str| args.only.is_empty() || args.only.iter().any(|o| name.contains(o.as_str()));
        for (what, config, workers, max_tokens) in attacks {
            if !wanted(what) {
                continue;
            }
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
        if wanted("page-info") {
            let r = c.request(Method::POST, "/v1/chat/completions", Some(&mallory), Some(chat_body(&id, "adv", 8))).await?;
            let text = r.json().map(|v| v["choices"][0]["message"]["content"].clone()).unwrap_or(Value::Null);
            println!("{}", json!({"page_info_as_the_guest_sees_it": text}));
        }
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
            if !wanted(what) {
                continue;
            }
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
        round_two(&args, &bin, &dir, &model, &c, pid, &admin, &victim_key, &mallory, &id, c99, h99).await
    })?;
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// What round two's attacks share: the server, its tenants and the victim's idle figures.
struct Arena<'a> {
    args: &'a Args,
    c: &'a Client,
    pid: u32,
    victim: &'a str,
    model: &'a str,
    idle_chat_p99: f64,
}

impl Arena<'_> {
    /// Runs `attack` (returning how the attacker's requests ended) beside the victim's service
    /// for `span`, sampling the server's memory; then waits `--settle` and reads it again.
    async fn measure<F>(&self, name: &str, attack: F, extra: impl FnOnce() -> Value) -> anyhow::Result<()>
    where
        F: std::future::Future<Output = BTreeMap<String, usize>>,
    {
        let span = Duration::from_secs(self.args.seconds);
        let before = rss_mib(self.pid);
        let end = Instant::now() + span;
        let pid = self.pid;
        let sample = async move {
            let mut most = 0f64;
            while Instant::now() < end {
                most = most.max(rss_mib(pid));
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            most
        };
        let good = victim(self.c, self.victim, self.model, end);
        let (codes, (chat, health, failed), during) = tokio::join!(attack, good, sample);
        tokio::time::sleep(Duration::from_secs(self.args.settle)).await;
        let mut out = json!({
            "attack": name, "attacker_outcomes": codes,
            "victim_chat_p50_ms": pct(&chat, 0.5), "victim_chat_p99_ms": pct(&chat, 0.99),
            "victim_chat_p99_ratio": pct(&chat, 0.99) / self.idle_chat_p99.max(1e-9),
            "victim_healthz_p99_ms": pct(&health, 0.99), "victim_failed": failed,
            "server_rss_mib_before": before, "server_rss_mib_during_max": during.max(rss_mib(pid)),
            "server_rss_mib_after_settle": rss_mib(pid), "settle_s": self.args.settle,
        });
        if let (Value::Object(o), Value::Object(e)) = (&mut out, extra()) {
            o.extend(e);
        }
        println!("{out}");
        Ok(())
    }
}

/// `workers` loops of the attacker's requests to `path` (a `/v1/` endpoint), each body made by
/// `body(n)` for the n-th request (counted over all workers), until `end`; a request still open
/// at `end` is given up (its connection closed). How they ended, by code.
async fn flood(
    c: &Client,
    key: &str,
    path: &'static str,
    workers: usize,
    end: Instant,
    body: impl Fn(usize) -> Vec<u8> + Send + Sync + 'static,
) -> BTreeMap<String, usize> {
    let body = std::sync::Arc::new(body);
    let count = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let tasks: Vec<_> = (0..workers)
        .map(|_| {
            let (c, key, body, count) = (c.clone(), key.to_string(), body.clone(), count.clone());
            tokio::spawn(async move {
                let mut out = Vec::new();
                while Instant::now() < end {
                    let n = count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let req = c.request(Method::POST, path, Some(&key), Some(body(n)));
                    let ended = match tokio::time::timeout_at(end.into(), req).await {
                        Ok(Ok(r)) if r.status == 200 => "200".to_string(),
                        Ok(Ok(r)) => code(&r),
                        Ok(Err(e)) => format!("transport: {e}"),
                        Err(_) => "still running at the end (cancelled)".to_string(),
                    };
                    out.push(ended);
                }
                out
            })
        })
        .collect();
    let mut codes = BTreeMap::new();
    for t in tasks {
        for c in t.await.unwrap_or_default() {
            *codes.entry(c).or_default() += 1;
        }
    }
    codes
}

const CHAT: &str = "/v1/chat/completions";

/// Forty integer properties, each a four-digit `multipleOf` (about 1.7 s of compile in all), new
/// for each `salt`.
fn slow_schema(salt: usize) -> Value {
    let props: serde_json::Map<String, Value> = (0..40)
        .map(|i| {
            let d = 9973 - 2 * i - 7 * (salt % 300);
            (format!("p{i}"), json!({"type": "integer", "multipleOf": d}))
        })
        .collect();
    json!({"type": "object", "properties": props, "required": ["p0"]})
}

fn structured(model: &str, schema: Value) -> Vec<u8> {
    json!({
        "model": model, "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "Numbers, please."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    })
    .to_string()
    .into_bytes()
}

/// The victim's long request (`prompt` words, then 256 tokens), timed: seconds, completion
/// tokens.
async fn long_request(c: &Client, key: &str, model: &str, prompt: &str) -> anyhow::Result<(f64, u64)> {
    let body = json!({
        "model": model, "prompt": prompt, "max_tokens": 256, "temperature": 0,
        "logit_bias": {"0": -100, "2": -100},
    });
    let t0 = Instant::now();
    let r = c
        .request(
            Method::POST,
            "/v1/completions",
            Some(key),
            Some(body.to_string().into_bytes()),
        )
        .await?;
    anyhow::ensure!(r.status == 200, "the victim's long request: {}", r.text());
    let tokens = r.json()?["usage"]["completion_tokens"].as_u64().unwrap_or(0);
    Ok((t0.elapsed().as_secs_f64(), tokens))
}

/// The victim's streamed 8-token chats until `end`: each one's time to its first token and to
/// its end (ms).
async fn streamed(c: &Client, key: &str, model: &str, end: Instant) -> (Vec<f64>, Vec<f64>) {
    use http_body_util::BodyExt;
    let body = json!({
        "model": model, "max_tokens": 8, "temperature": 0, "stream": true,
        "messages": [{"role": "user", "content": "Write a poem about the sea."}],
    })
    .to_string();
    let (mut first, mut whole) = (Vec::new(), Vec::new());
    while Instant::now() < end {
        let t0 = Instant::now();
        let Ok(r) = c
            .send(
                warden::serve::client::Proto::Http1,
                Method::POST,
                CHAT,
                Some(key),
                Some(body.clone().into_bytes()),
            )
            .await
        else {
            continue;
        };
        let mut b = r.into_body();
        let (mut seen, mut at) = (Vec::new(), None);
        while let Some(Ok(f)) = b.frame().await {
            if let Some(d) = f.data_ref() {
                seen.extend_from_slice(d);
                // A delta with text (the first chunk may carry the role and empty content).
                let text = String::from_utf8_lossy(&seen);
                let has_text = text
                    .match_indices("\"content\":\"")
                    .any(|(i, m)| text[i + m.len()..].chars().next().is_some_and(|ch| ch != '"'));
                if at.is_none() && has_text {
                    at = Some(t0.elapsed().as_secs_f64() * 1e3);
                }
            }
        }
        if let Some(at) = at {
            first.push(at);
            whole.push(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    (first, whole)
}

/// A free loopback port.
fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

#[allow(clippy::too_many_arguments)]
async fn round_two(
    args: &Args,
    bin: &std::path::Path,
    dir: &std::path::Path,
    model_path: &std::path::Path,
    c: &Client,
    pid: u32,
    admin: &str,
    victim_key: &str,
    mallory: &str,
    model: &str,
    idle_chat_p99: f64,
    idle_healthz_p99: f64,
) -> anyhow::Result<()> {
    let a = Arena {
        args,
        c,
        pid,
        victim: victim_key,
        model,
        idle_chat_p99,
    };
    let wanted = |name: &str| args.only.is_empty() || args.only.iter().any(|o| name.contains(o.as_str()));
    let span = Duration::from_secs(args.seconds);
    let m = model.to_string();
    if wanted("schema") {
        let body = {
            let m = m.clone();
            move |n: usize| structured(&m, slow_schema(n))
        };
        let attack = flood(c, mallory, CHAT, 8, Instant::now() + span, body);
        a.measure(
            "schema compiles: forty four-digit multipleOf, new each request, 8 at a time",
            attack,
            || json!({}),
        )
        .await?;
        let tiny = structured(&m, json!({"type": "integer", "multipleOf": 999983}));
        let attack = flood(c, mallory, CHAT, 8, Instant::now() + span, move |_| tiny.clone());
        a.measure(
            "schema compiles: the 38-byte multipleOf 999983, 8 at a time",
            attack,
            || json!({}),
        )
        .await?;
        let body = {
            let m = m.clone();
            move |n: usize| {
                json!({
                    "model": m, "max_tokens": 8, "temperature": 0,
                    "messages": [{"role": "user", "content": "Call it."}],
                    "tools": [{"type": "function", "function": {"name": "f", "parameters": slow_schema(n)}}],
                    "tool_choice": "required",
                })
                .to_string()
                .into_bytes()
            }
        };
        let attack = flood(c, mallory, CHAT, 8, Instant::now() + span, body);
        a.measure(
            "schema compiles: tools required with the same schemas, 8 at a time",
            attack,
            || json!({}),
        )
        .await?;
    }
    if wanted("slots") {
        let body = json!({
            "model": m, "stream": true, "n": 8, "temperature": 1,
            "messages": [{"role": "user", "content": "Write a very long story."}],
            "logit_bias": {"0": -100, "2": -100},
        })
        .to_string()
        .into_bytes();
        // The victim's streamed 8-token chats too: time to first token and to the end, idle
        // first, then beside its plain chats while the attack runs.
        let (idle_first, idle_whole) = streamed(c, victim_key, model, Instant::now() + span).await;
        let end = Instant::now() + span;
        let seen = std::sync::Arc::new(std::sync::Mutex::new((Vec::new(), Vec::new())));
        let attack = {
            let seen = seen.clone();
            async move {
                let (codes, got) = tokio::join!(
                    flood(c, mallory, CHAT, 8, end, move |_| body.clone()),
                    streamed(c, victim_key, model, end)
                );
                *seen.lock().unwrap_or_else(|p| p.into_inner()) = got;
                codes
            }
        };
        let extra = || {
            let (first, whole) = &*seen.lock().unwrap_or_else(|p| p.into_inner());
            json!({
                "victim_ttft_idle_p50_ms": pct(&idle_first, 0.5), "victim_ttft_idle_p99_ms": pct(&idle_first, 0.99),
                "victim_ttft_p50_ms": pct(first, 0.5), "victim_ttft_p99_ms": pct(first, 0.99),
                "victim_8_token_chat_idle_max_ms": pct(&idle_whole, 1.0), "victim_8_token_chat_max_ms": pct(whole, 1.0),
            })
        };
        a.measure(
            "running slots: 8 streams of n=8, no max_tokens, end of text biased away",
            attack,
            extra,
        )
        .await?;
    }
    if wanted("pages") {
        let prompt = "The history of the river and the town beside it. ".repeat(68);
        let (idle_s, idle_tokens) = long_request(c, victim_key, model, &prompt).await?;
        let long_prompt = "A long record of every ship that ever came into the harbour. ".repeat(300);
        let body = json!({
            "model": m, "prompt": long_prompt, "temperature": 1,
            "logit_bias": {"0": -100, "2": -100},
        })
        .to_string()
        .into_bytes();
        // The attacker's requests run on, and the victim's long request is timed among them.
        let until = Instant::now() + span.max(Duration::from_secs(30));
        let attack = flood(c, mallory, "/v1/completions", 4, until, move |_| body.clone());
        let victim_long = async {
            tokio::time::sleep(Duration::from_secs(3)).await;
            long_request(c, victim_key, model, &prompt).await
        };
        let before = rss_mib(pid);
        let (codes, long) = tokio::join!(attack, victim_long);
        let (under_s, under_tokens) = long?;
        tokio::time::sleep(Duration::from_secs(args.settle)).await;
        println!(
            "{}",
            json!({
                "attack": "KV pages: 4 open-ended requests of about 3,600 prompt tokens, end of text biased away",
                "attacker_outcomes": codes,
                "victim_long_request": "about 750 prompt tokens + 256",
                "victim_long_idle_s": idle_s, "victim_long_idle_tokens": idle_tokens,
                "victim_long_under_attack_s": under_s, "victim_long_under_attack_tokens": under_tokens,
                "victim_long_speed_ratio": (under_tokens as f64 / under_s) / (idle_tokens as f64 / idle_s).max(1e-9),
                "server_rss_mib_before": before, "server_rss_mib_after_settle": rss_mib(pid),
            })
        );
    }
    if wanted("init") {
        let r = put(c, "/v1/plugins/adv/config", mallory, b"print-and-spin:20").await?;
        anyhow::ensure!(r.status == 200, "{}", r.text());
        let body = chat_body(model, "adv", 8);
        let attack = flood(c, mallory, CHAT, 64, Instant::now() + span, move |_| body.clone());
        a.measure(
            "per-request init: an init that prints (so it cannot be captured) and spins, 64 at a time",
            attack,
            || json!({}),
        )
        .await?;
        put(c, "/v1/plugins/adv/config", mallory, b"pass").await?;
    }
    if wanted("fields") {
        let body = {
            let m = m.clone();
            move |n: usize| {
                let mut v = json!({"model": m, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]});
                for k in 0..16 {
                    v[format!("x_{n}_{k}")] = json!(1);
                }
                v.to_string().into_bytes()
            }
        };
        let attack = flood(c, mallory, CHAT, 4, Instant::now() + span, body);
        a.measure("registries: 16 unknown fields of new names per request", attack, || {
            json!({})
        })
        .await?;
        let metrics = |c: Client, admin: String| async move {
            let r = c.request(Method::GET, "/metrics", Some(&admin), None).await?;
            Ok::<_, anyhow::Error>(r.text())
        };
        let before = metrics(c.clone(), admin.to_string()).await?;
        for _ in 0..5 {
            let body =
                json!({"model": m, "max_tokens": 1, "store": true, "messages": [{"role": "user", "content": "hi"}]});
            c.request(
                Method::POST,
                "/v1/chat/completions",
                Some(victim_key),
                Some(body.to_string().into_bytes()),
            )
            .await?;
        }
        let after = metrics(c.clone(), admin.to_string()).await?;
        let store = |t: &str| common::metric(t, "warden_ignored_fields_total{field=\"store\"}");
        println!(
            "{}",
            json!({
                "registries": "after the flood",
                "ignored_field_series": after.lines().filter(|l| l.starts_with("warden_ignored_fields_total{")).count(),
                "victims_store_counted_by_name": store(&after) - store(&before),
            })
        );
    }
    if wanted("compiler") {
        let filter = example("regex_filter")?;
        let t0 = Instant::now();
        let r = put(c, "/v1/plugins/idle-upload", victim_key, &filter).await?;
        let idle = t0.elapsed().as_secs_f64();
        anyhow::ensure!(r.status == 201, "{}", r.text());
        let n = 30_000;
        let slow: Vec<Vec<u8>> = (0..6).map(|k| slow_component(n + k)).collect::<anyhow::Result<_>>()?;
        let before = rss_mib(pid);
        let uploads: Vec<_> = slow
            .into_iter()
            .enumerate()
            .map(|(k, bytes)| {
                let (c, key) = (c.clone(), mallory.to_string());
                tokio::spawn(async move {
                    let r = put(&c, &format!("/v1/plugins/slow{k}"), &key, &bytes).await;
                    r.map(|r| code(&r)).unwrap_or_else(|e| format!("transport: {e}"))
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_secs(1)).await;
        let t0 = Instant::now();
        let r = put(c, "/v1/plugins/attack-upload", victim_key, &filter).await?;
        let under = t0.elapsed().as_secs_f64();
        let mut codes: BTreeMap<String, usize> = BTreeMap::new();
        for u in uploads {
            *codes.entry(u.await.unwrap_or_default()).or_default() += 1;
        }
        tokio::time::sleep(Duration::from_secs(args.settle)).await;
        println!(
            "{}",
            json!({
                "attack": "plugin compiler: six uploads that each run into the compile timeout",
                "attacker_outcomes": codes, "victim_upload_status": r.status,
                "victim_upload_bytes": filter.len(), "victim_upload_idle_s": idle, "victim_upload_under_attack_s": under,
                "server_rss_mib_before": before, "server_rss_mib_after_settle": rss_mib(pid),
            })
        );
    }
    if wanted("connections") {
        slow_peers(bin, dir, model_path, idle_healthz_p99, span).await?;
    }
    Ok(())
}

/// A component whose one function keeps `n` values live at once: seconds of register
/// allocation (quadratic in `n`; 30,000 is about 45 s, past the default 30 s limit).
fn slow_component(n: usize) -> anyhow::Result<Vec<u8>> {
    let mut body = String::new();
    for i in 2..n {
        body.push_str(&format!(
            "(local.set {i} (i64.mul (local.get {}) (local.get {})))",
            i - 1,
            i - 2
        ));
    }
    body.push_str("(loop $l ");
    for i in 0..n {
        body.push_str(&format!("(local.set 0 (i64.add (local.get 0) (local.get {i})))"));
    }
    body.push_str("(br_if $l (i64.eqz (local.get 0))))");
    let wat = format!(
        "(component (core module (func (param i64 i64) (result i64) (local {}) {body} (local.get 0))))",
        "i64 ".repeat(n)
    );
    Ok(wat::parse_str(&wat)?)
}

/// A decode node's `/healthz` on its operations endpoint, idle and while 64 loopback addresses
/// hold as many connections as it lets them and send nothing.
async fn slow_peers(
    bin: &std::path::Path,
    dir: &std::path::Path,
    model: &std::path::Path,
    _: f64,
    span: Duration,
) -> anyhow::Result<()> {
    let ops = free_port()?;
    let config = dir.join("decode.toml");
    let data = dir.join("decode-data");
    std::fs::write(
        &config,
        format!(
            "data_dir = {data:?}\nmodel = {model:?}\n[cluster]\nlisten = \"127.0.0.1:0\"\nops_listen = \"127.0.0.1:{ops}\"\n"
        ),
    )?;
    let (_node, _) = common::start(bin, "decode", &config, |l| {
        l.contains(" node serving ").then(|| "ready".to_string())
    })?;
    let probe = Client::new(&format!("http://127.0.0.1:{ops}"), None)?;
    let health = |end: Instant| {
        let probe = probe.clone();
        async move {
            let mut times = Vec::new();
            let mut failed = 0;
            while Instant::now() < end {
                let t0 = Instant::now();
                match tokio::time::timeout(
                    Duration::from_secs(10),
                    probe.request(Method::GET, "/healthz", None, None),
                )
                .await
                {
                    Ok(Ok(r)) if r.status == 200 => times.push(t0.elapsed().as_secs_f64() * 1e3),
                    _ => failed += 1,
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            (times, failed)
        }
    };
    let (idle, _) = health(Instant::now() + Duration::from_secs(2)).await;
    let end = Instant::now() + span;
    let holders: Vec<_> = (2..66u8)
        .map(|host| {
            tokio::spawn(async move {
                let mut held = Vec::new();
                let mut opened = 0usize;
                while Instant::now() < end {
                    // Those the node closed (read as the end of the stream) are opened again.
                    held.retain(|s: &tokio::net::TcpStream| {
                        let mut b = [0u8; 1];
                        matches!(s.try_read(&mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
                    });
                    while held.len() < 8 {
                        let Ok(sock) = tokio::net::TcpSocket::new_v4() else {
                            break;
                        };
                        if sock.bind(std::net::SocketAddr::from(([127, 0, 0, host], 0))).is_err() {
                            break;
                        }
                        match tokio::time::timeout(
                            Duration::from_millis(500),
                            sock.connect(([127, 0, 0, 1], ops).into()),
                        )
                        .await
                        {
                            Ok(Ok(s)) => {
                                opened += 1;
                                held.push(s);
                            }
                            _ => break,
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                opened
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (under, failed) = health(end).await;
    let mut opened = 0;
    for h in holders {
        opened += h.await.unwrap_or(0);
    }
    println!(
        "{}",
        json!({
            "attack": "slow connections from 64 loopback addresses against a decode node's ops endpoint",
            "connections_opened": opened,
            "node_healthz_idle_p99_ms": pct(&idle, 0.99),
            "node_healthz_under_attack_p50_ms": pct(&under, 0.5), "node_healthz_under_attack_p99_ms": pct(&under, 0.99),
            "node_healthz_failed": failed,
        })
    );
    Ok(())
}
