//! Load generator for `warden serve`: concurrent streaming chat clients, plus idle connections
//! held open the whole time. Prints one JSON object: total generated tok/s, time to first token
//! and inter-token latency percentiles, and how many idle connections were accepted and still
//! open at the end.
//!
//! `scripts/bench-serve.sh` starts a server and runs this against it; by hand:
//! `cargo run --release -p warden --example serve_load -- URL CERT KEY [CLIENTS] [REQUESTS] [MAX_TOKENS] [IDLE]`

use std::sync::Arc;
use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use hyper::Method;
use warden::serve::client::{Client, Proto};

const TOPICS: [&str; 8] = [
    "a dragon who learns to paint",
    "the history of bread",
    "a lighthouse keeper and a storm",
    "how rivers shape valleys",
    "a robot that plants trees",
    "the first voyage around the world",
    "a city built under the sea",
    "why the sky changes colour at dusk",
];

struct Sample {
    ttft: Duration,
    gaps: Vec<Duration>,
    tokens: u64,
}

async fn one_request(c: &Client, key: &str, model: &str, topic: &str, max_tokens: usize) -> anyhow::Result<Sample> {
    let body = serde_json::json!({
        "model": model, "max_tokens": max_tokens, "temperature": 0.7, "stream": true,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": format!("Write a long story about {topic}.")}],
    });
    let t0 = Instant::now();
    let r = c
        .send(
            Proto::Http1,
            Method::POST,
            "/v1/chat/completions",
            Some(key),
            Some(body.to_string().into_bytes()),
        )
        .await?;
    anyhow::ensure!(r.status() == 200, "status {}", r.status());
    let mut b = r.into_body();
    let (mut first, mut last, mut gaps, mut tokens) = (None, None, Vec::new(), 0);
    let mut buf = String::new();
    while let Some(frame) = b.frame().await {
        let Ok(data) = frame?.into_data() else { continue };
        buf.push_str(&String::from_utf8_lossy(&data));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let Some(d) = event.trim().strip_prefix("data: ") else {
                continue;
            };
            if d == "[DONE]" {
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(d)?;
            if let Some(u) = v["usage"]["completion_tokens"].as_u64() {
                tokens = u;
            }
            if v["choices"][0]["delta"]["content"].is_string() {
                let now = Instant::now();
                first.get_or_insert(now - t0);
                if let Some(l) = last {
                    gaps.push(now - l);
                }
                last = Some(now);
            }
        }
    }
    Ok(Sample {
        ttft: first.unwrap_or_default(),
        gaps,
        tokens,
    })
}

fn pct(v: &mut [Duration], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i].as_secs_f64() * 1e3
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    anyhow::ensure!(
        args.len() >= 3,
        "usage: serve_load URL CERT KEY [CLIENTS] [REQUESTS] [MAX_TOKENS] [IDLE]"
    );
    let arg = |i: usize, d: usize| args.get(i).and_then(|a| a.parse().ok()).unwrap_or(d);
    let (clients, requests, max_tokens, idle) = (arg(3, 16), arg(4, 4), arg(5, 128), arg(6, 1000));
    let client = Client::new(&args[0], Some(std::path::Path::new(&args[1])))?;
    let key = Arc::new(args[2].clone());
    let models = client
        .request(Method::GET, "/v1/models", Some(&key), None)
        .await?
        .json()?;
    let model = Arc::new(models["data"][0]["id"].as_str().unwrap_or_default().to_string());

    // Idle connections: TLS handshakes done, no request sent, held to the end.
    let mut held = Vec::new();
    for _ in 0..idle {
        match client.connect_idle().await {
            Ok(c) => held.push(c),
            Err(e) => {
                eprintln!("idle connection {}: {e}", held.len());
                break;
            }
        }
    }
    let accepted = held.len();

    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..clients {
        let (c, key, model) = (client.clone(), key.clone(), model.clone());
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            for r in 0..requests {
                out.push(one_request(&c, &key, &model, TOPICS[(i + r) % TOPICS.len()], max_tokens).await);
            }
            out
        }));
    }
    let mut samples = Vec::new();
    let mut failed = 0;
    for t in tasks {
        for s in t.await? {
            match s {
                Ok(s) => samples.push(s),
                Err(e) => {
                    failed += 1;
                    eprintln!("request failed: {e}");
                }
            }
        }
    }
    let wall = t0.elapsed().as_secs_f64();
    let still_open = held.iter_mut().map(|c| c.is_open()).filter(|o| *o).count();
    let tokens: u64 = samples.iter().map(|s| s.tokens).sum();
    let mut ttft: Vec<Duration> = samples.iter().map(|s| s.ttft).collect();
    let mut itl: Vec<Duration> = samples.iter().flat_map(|s| s.gaps.iter().copied()).collect();
    let report = serde_json::json!({
        "clients": clients, "requests": samples.len(), "failed": failed, "max_tokens": max_tokens,
        "wall_s": wall, "completion_tokens": tokens, "tok_s": tokens as f64 / wall,
        "ttft_ms": {"p50": pct(&mut ttft, 0.5), "p99": pct(&mut ttft, 0.99)},
        "itl_ms": {"p50": pct(&mut itl, 0.5), "p99": pct(&mut itl, 0.99)},
        "idle_connections": {"requested": idle, "accepted": accepted, "open_at_end": still_open},
    });
    println!("{}", serde_json::to_string_pretty(&report)?);
    drop(held);
    Ok(())
}
