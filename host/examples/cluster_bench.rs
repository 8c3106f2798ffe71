//! Disaggregated serving against one process, on this machine, in one run: starts `warden serve`
//! as a prefill node, a decode node and a router (on loopback), and as `--role all`, then sends
//! each the same kind of requests, alternating between them so noise hits both alike:
//!
//! - time to first token of a streamed completion, one request at a time, for prompts of each
//!   length (distinct token ids every time, so no prefix cache helps);
//! - the KV transfers the prefill node measured: pages and MB per second of a transfer (from its
//!   `Begin` to the decode node's final acknowledgement), and pages per transfer.
//!
//! ```sh
//! cargo build --release && cargo run --release --example cluster_bench -- --repeats 5 --lengths 128,512,1536
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use http_body_util::BodyExt;
use hyper::Method;
use warden::cluster::link::{Msg, Transport};
use warden::serve::client::{Client, Proto};

mod common;
use common::{Proc, metric, server, start};

#[derive(Parser)]
struct Args {
    /// Prompt lengths, in tokens.
    #[arg(long, value_delimiter = ',', default_value = "128,512,1536")]
    lengths: Vec<usize>,
    /// Requests per length and mode.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// The model.
    #[arg(long, default_value = warden::DEFAULT_MODEL)]
    model: PathBuf,
}

fn node(bin: &Path, dir: &Path, role: &str, model: &Path) -> anyhow::Result<(Proc, SocketAddr)> {
    let config = dir.join(format!("{role}.toml"));
    std::fs::write(
        &config,
        format!("model = {model:?}\n[cluster]\nlisten = \"127.0.0.1:0\"\n"),
    )?;
    let (p, addr) = start(bin, role, &config, |l| {
        l.contains(" node serving ")
            .then(|| l.split(" on ").nth(1)?.split(' ').next().map(str::to_string))
            .flatten()
    })?;
    Ok((p, addr.parse()?))
}

/// Time to the first streamed token of a completion of `prompt`.
async fn ttft(client: &Client, key: &str, model: &str, prompt: Vec<u32>) -> anyhow::Result<Duration> {
    let body = serde_json::json!({
        "model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": true,
    });
    let t0 = Instant::now();
    let r = client
        .send(
            Proto::Http1,
            Method::POST,
            "/v1/completions",
            Some(key),
            Some(body.to_string().into_bytes()),
        )
        .await?;
    if r.status() != 200 {
        let text = r.into_body().collect().await?.to_bytes();
        bail!("status: {}", String::from_utf8_lossy(&text));
    }
    let mut b = r.into_body();
    let mut seen = Vec::new();
    let mut first = None;
    while let Some(f) = b.frame().await {
        if let Some(d) = f?.data_ref() {
            seen.extend_from_slice(d);
            if first.is_none() && String::from_utf8_lossy(&seen).contains("\"text\"") {
                first = Some(t0.elapsed());
            }
        }
    }
    first.context("no token arrived")
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let bin = common::warden_bin()?;
    let (model, id) = common::model(&args.model)?;
    let dir = std::env::temp_dir().join(format!("warden-cluster-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let (_prefill, p_addr) = node(&bin, &dir, "prefill", &model)?;
    let (_decode, d_addr) = node(&bin, &dir, "decode", &model)?;
    let cluster = format!("[cluster]\nprefill = [\"{p_addr}\"]\ndecode = [\"{d_addr}\"]\n");
    let (_router, rc, rkey) = server(&bin, &dir, "router", &model, &cluster)?;
    let (_all, ac, akey) = server(&bin, &dir, "all", &model, "")?;
    let rt = common::runtime()?;
    let mut next_id = 1000u32;
    let mut prompt = |n: usize| {
        (0..n)
            .map(|_| {
                next_id = 1000 + (next_id - 1000 + 7919) % 40000;
                next_id
            })
            .collect::<Vec<u32>>()
    };
    println!(
        "time to first token, median of {} (ms); one machine, both modes in this run, alternating:",
        args.repeats
    );
    println!("{:>8} {:>10} {:>14} {:>8}", "prompt", "all", "disaggregated", "ratio");
    rt.block_on(async {
        // Warm both (first requests pay page faults of the mapped weights).
        ttft(&ac, &akey, &id, prompt(32)).await?;
        ttft(&rc, &rkey, &id, prompt(32)).await?;
        for &n in &args.lengths {
            let (mut a, mut d) = (Vec::new(), Vec::new());
            for _ in 0..args.repeats {
                a.push(ttft(&ac, &akey, &id, prompt(n)).await?.as_secs_f64() * 1e3);
                d.push(ttft(&rc, &rkey, &id, prompt(n)).await?.as_secs_f64() * 1e3);
            }
            let (a, d) = (median(&mut a), median(&mut d));
            println!("{n:>8} {a:>10.1} {d:>14.1} {:>7.2}x", d / a);
        }
        let m = match Transport::plain().call(&p_addr.into(), &Msg::Metrics).await {
            Ok(Msg::MetricsText { text }) => text,
            other => bail!("the prefill node answered {other:?}"),
        };
        let n = metric(&m, "warden_transfers_total{outcome=\"acknowledged\"}");
        let pages = metric(&m, "warden_transfer_pages_total");
        let bytes = metric(&m, "warden_transfer_bytes_total");
        let secs = metric(&m, "warden_transfer_seconds_total");
        println!(
            "KV transfers (prefill node, Begin to final Ack): {n} transfers, {pages} pages, {:.1} MB; {:.1} pages/transfer, {:.2} ms/transfer; {:.0} pages/s, {:.0} MB/s per transfer",
            bytes / 1e6,
            pages / n.max(1.0),
            secs / n.max(1.0) * 1e3,
            pages / secs.max(1e-9),
            bytes / 1e6 / secs.max(1e-9)
        );
        Ok::<_, anyhow::Error>(())
    })?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
