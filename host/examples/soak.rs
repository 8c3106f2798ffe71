//! A soak: mixed traffic from 8 tenants, each with its own plugin, for `--minutes` against a
//! release server, with clients that cancel mid-response, plugins that misbehave now and then,
//! and a policy reload every 30 s. Every 10 s it samples the server's resident memory and open
//! files; at the end it waits for the server to go idle and reads its pool. Prints the samples
//! and one summary line: memory and open files after warm-up against the end, requests by
//! outcome, and the KV pages still in use (0 when every page came back).
//!
//! ```sh
//! cargo build --release && cargo build --manifest-path guest-sdk/Cargo.toml --target wasm32-wasip2 --release --examples
//! cargo run --release --example soak -- --minutes 30
//! ```

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use http_body_util::BodyExt;
use hyper::Method;
use serde_json::json;
use warden::serve::client::{Client, Proto};

mod common;
use common::{example, metric, open_files, rss_mib};

#[derive(Parser)]
struct Args {
    /// How long the traffic runs.
    #[arg(long, default_value_t = 30)]
    minutes: u64,
    /// When the warm-up ends and the memory baseline is taken.
    #[arg(long, default_value_t = 2)]
    warmup_minutes: u64,
    /// The model.
    #[arg(long, default_value = warden::DEFAULT_MODEL)]
    model: PathBuf,
}

/// Each tenant's plugin and its configuration.
const PLUGINS: [(&str, &str); 8] = [
    ("system_prompt", "You are brief."),
    ("pii_redactor", ""),
    ("json_guard", ""),
    (
        "regex_filter",
        "deny: (?i)\\bpassword\\b\nreplace: \\bAlice\\b => [name]",
    ),
    (
        "prefix_pin",
        "You are the support assistant of Example Corp. Answer in one sentence.",
    ),
    ("adversary", "pass"),
    ("system_prompt", "Answer in French."),
    ("adversary", "kv"),
];

/// Attacks the adversary tenants switch to now and then.
const MISCHIEF: [&str; 5] = ["loop", "flood", "encode-loop", "sleep-forever", "pass"];

/// One request of tenant `i`, the `n`th: its outcome (status, or "cancelled").
async fn one(c: &Client, key: &str, model: &str, i: usize, n: u64) -> String {
    let stream = n.is_multiple_of(2);
    let body = if n.is_multiple_of(3) {
        json!({"model": model, "prompt": format!("Item {n}: once upon a time"), "max_tokens": 24, "stream": stream})
    } else {
        json!({
            "model": model, "stream": stream, "max_tokens": 8 + (n % 24), "n": 1 + n.is_multiple_of(5) as u64,
            "temperature": 0.7, "seed": n,
            "messages": [{"role": "user", "content": format!("Tenant {i}, question {n}: tell me about Alice's trip.")}],
        })
    };
    let path = if n.is_multiple_of(3) {
        "/v1/completions"
    } else {
        "/v1/chat/completions"
    };
    let r = match c
        .send(
            Proto::Http1,
            Method::POST,
            path,
            Some(key),
            Some(body.to_string().into_bytes()),
        )
        .await
    {
        Ok(r) => r,
        Err(e) => return format!("transport: {e}"),
    };
    let status = r.status().as_u16().to_string();
    let mut b = r.into_body();
    // One request in seven is abandoned mid-response.
    let cancel_after = (n % 7 == 3).then(|| Duration::from_millis(5 + n % 60));
    let t0 = tokio::time::Instant::now();
    loop {
        let frame = match cancel_after {
            Some(d) => match tokio::time::timeout_at(t0 + d, b.frame()).await {
                Ok(f) => f,
                Err(_) => return "cancelled".into(),
            },
            None => b.frame().await,
        };
        match frame {
            Some(Ok(_)) => {}
            Some(Err(e)) => return format!("body: {e}"),
            None => return status,
        }
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let bin = common::warden_bin()?;
    let (model, id) = common::model(&args.model)?;
    let dir = std::env::temp_dir().join(format!("warden-soak-{}", std::process::id()));
    let policies = dir.join("policies");
    std::fs::create_dir_all(policies.join("tenants"))?;
    std::fs::write(policies.join("default.toml"), "# The built-in defaults.\n")?;
    let (server, c, _) = common::server(&bin, &dir, "all", &model, &format!("policies = {policies:?}"))?;
    let pid = server.0.id();
    let admin = common::admin_token(&dir, "all")?;
    let rt = common::runtime()?;
    rt.block_on(async {
        let mut keys = Vec::new();
        for (i, (plugin, config)) in PLUGINS.iter().enumerate() {
            let name = format!("t{i}");
            let r = c
                .request(
                    Method::POST,
                    "/admin/v1/tenants",
                    Some(&admin),
                    Some(json!({"name": name}).to_string().into_bytes()),
                )
                .await?;
            anyhow::ensure!(r.status == 201, "{}", r.text());
            let r = c
                .request(
                    Method::POST,
                    &format!("/admin/v1/tenants/{name}/keys"),
                    Some(&admin),
                    None,
                )
                .await?;
            let key = r.json()?["key"].as_str().context("key")?.to_string();
            for (path, body) in [
                ("/v1/plugins/p", example(plugin)?),
                ("/v1/plugins/p/config", config.as_bytes().to_vec()),
                ("/v1/plugins/p/default", Vec::new()),
            ] {
                let r = c.request(Method::PUT, path, Some(&key), Some(body)).await?;
                anyhow::ensure!(r.status < 300, "{path}: {}", r.text());
            }
            keys.push(key);
        }
        let end = Instant::now() + Duration::from_secs(args.minutes * 60);
        let outcomes: Arc<Mutex<BTreeMap<String, u64>>> = Arc::default();
        let mut tasks = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            let (c, key, id, outcomes) = (c.clone(), key.clone(), id.clone(), outcomes.clone());
            tasks.push(tokio::spawn(async move {
                let mut n = 0u64;
                while Instant::now() < end {
                    n += 1;
                    // The adversary tenants misbehave for a while every so often.
                    if PLUGINS[i].0 == "adversary" && n.is_multiple_of(50) {
                        let cfg = MISCHIEF[(n / 50) as usize % MISCHIEF.len()];
                        let _ = c
                            .request(
                                Method::PUT,
                                "/v1/plugins/p/config",
                                Some(&key),
                                Some(cfg.as_bytes().to_vec()),
                            )
                            .await;
                    }
                    let o = one(&c, &key, &id, i, n).await;
                    *outcomes.lock().unwrap_or_else(|p| p.into_inner()).entry(o).or_default() += 1;
                }
            }));
        }
        // Policy reloads, and the samples.
        let started = Instant::now();
        let mut samples = Vec::new();
        let mut tick = 0u64;
        while Instant::now() < end {
            tokio::time::sleep(Duration::from_secs(10)).await;
            tick += 1;
            if tick.is_multiple_of(3) {
                let tpm = if tick.is_multiple_of(2) {
                    "unlimited".to_string()
                } else {
                    "200000".to_string()
                };
                let text = format!(
                    "tokens_per_minute = {}\nweight = {}\n",
                    if tpm == "unlimited" {
                        "\"unlimited\"".into()
                    } else {
                        tpm
                    },
                    1 + tick % 4
                );
                std::fs::write(policies.join("tenants").join(format!("t{}.toml", tick % 8)), text)?;
            }
            let (rss, fds) = (rss_mib(pid), open_files(pid));
            let s = json!({"s": started.elapsed().as_secs(), "rss_mib": rss, "open_files": fds});
            println!("{s}");
            samples.push((started.elapsed(), rss, fds));
        }
        for t in tasks {
            let _ = t.await;
        }
        // Idle: every page should come back.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let m = c.request(Method::GET, "/metrics", Some(&admin), None).await?.text();
        let warm = samples
            .iter()
            .find(|(t, _, _)| *t >= Duration::from_secs(args.warmup_minutes * 60))
            .or(samples.first())
            .copied()
            .unwrap_or_default();
        let last = samples.last().copied().unwrap_or_default();
        let (rss, fds) = (rss_mib(pid), open_files(pid));
        println!(
            "{}",
            json!({
                "minutes": args.minutes, "tenants": keys.len(),
                "outcomes": *outcomes.lock().unwrap_or_else(|p| p.into_inner()),
                "rss_mib_after_warmup": warm.1, "rss_mib_at_end": last.1, "rss_mib_idle": rss,
                "open_files_after_warmup": warm.2, "open_files_at_end": last.2, "open_files_idle": fds,
                "kv_pages_used_idle": metric(&m, "warden_kv_pages{state=\"used\"}"),
                "running_sequences_idle": metric(&m, "warden_running_sequences"),
                "isolation_violations": metric(&m, "warden_isolation_violations_total"),
                "policy_reload_failures": metric(&m, "warden_policy_reload_failures_total"),
            })
        );
        Ok::<_, anyhow::Error>(())
    })?;
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
