//! Fair scheduling under a flood: tenant B's time to first token while tenant A keeps the
//! engine full of long requests, against B's time to first token on an idle engine, in one run.
//!
//! The engine runs on this thread as the server's engine thread does; B's requests arrive from
//! another thread at random moments (so a request may land mid-step), and the engine takes them
//! between steps. Prints one JSON object: p50 and p99 for both, and their ratios.
//!
//! `cargo run --release -p warden --example fairness_bench [-- --max-batch-tokens N]`

use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use warden::engine::request::{GenerateRequest, RequestId};
use warden::engine::{Engine, EngineConfig, Event, TenantSettings};
use warden::loaded::LoadedModel;

const SAMPLES: usize = 40;
const A_BACKLOG: usize = 24;

fn root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

/// Runs `SAMPLES` of B's requests through `e` (with A flooding it if `flood`); B's TTFTs in ms.
fn run(e: &mut Engine, flood: bool, seed: u64) -> Vec<f64> {
    let (tx, rx) = mpsc::channel::<Instant>();
    // B: one short request at a time, after a random pause of 50 to 250 ms.
    let producer = std::thread::spawn(move || {
        let mut x = seed | 1;
        for _ in 0..SAMPLES {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            std::thread::sleep(Duration::from_millis(50 + x % 200));
            if tx.send(Instant::now()).is_err() {
                return;
            }
        }
    });
    let mut a_salt = 0u32;
    let mut a_live = 0usize;
    let mut a_ids: Vec<RequestId> = Vec::new();
    let mut b_waiting: Vec<(RequestId, Instant)> = Vec::new();
    let mut ttft = Vec::new();
    let mut b_n = 0u32;
    while ttft.len() < SAMPLES {
        // A keeps its backlog full: long prompts, long outputs.
        while flood && a_live < A_BACKLOG {
            a_salt += 1;
            let prompt: Vec<u32> = (0..384u32)
                .map(|j| 100 + (a_salt * 7919 + j * 104_729) % 20_000)
                .collect();
            let mut r = GenerateRequest::greedy(1, prompt, 128);
            r.ignore_eos = true;
            a_ids.push(e.submit(r).expect("A's request fits"));
            a_live += 1;
        }
        for sent in rx.try_iter() {
            b_n += 1;
            // A distinct 40-token prompt each time: nothing comes from the prefix cache.
            let prompt: Vec<u32> = (0..40u32).map(|j| 200 + (b_n * 40 + j) % 20_000).collect();
            let mut r = GenerateRequest::greedy(2, prompt, 4);
            r.ignore_eos = true;
            b_waiting.push((e.submit(r).expect("B's request fits"), sent));
        }
        if !e.has_work() {
            std::thread::sleep(Duration::from_millis(1));
            continue;
        }
        for ev in e.step() {
            match ev {
                Event::Token { id, .. } => {
                    if let Some(i) = b_waiting.iter().position(|(b, _)| *b == id) {
                        let (_, sent) = b_waiting.swap_remove(i);
                        ttft.push(sent.elapsed().as_secs_f64() * 1e3);
                    }
                }
                Event::Done { id, .. } => {
                    if a_ids.contains(&id) {
                        a_live -= 1;
                    }
                }
            }
        }
    }
    let _ = producer.join();
    e.abort_all();
    ttft
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let max_batch_tokens = args
        .iter()
        .position(|a| a == "--max-batch-tokens")
        .and_then(|i| args.get(i + 1))
        .map(|v| v.parse())
        .transpose()?
        .unwrap_or(512);
    let l = LoadedModel::open(&root().join(warden::DEFAULT_MODEL))?;
    let mut cfg = EngineConfig::for_model(&l.model);
    cfg.max_batch_tokens = max_batch_tokens;
    cfg.prefix_cache = false;
    let mut e = Engine::new(l.model.clone(), Arc::new(NoText), cfg)?;
    for owner in [1, 2] {
        e.set_tenant(
            owner,
            TenantSettings {
                prefix_cache: false,
                ..Default::default()
            },
        );
    }
    // Warm up the weights and the thread pool.
    run(&mut e, false, 7);
    let mut idle = run(&mut e, false, 11);
    let mut loaded = run(&mut e, true, 13);
    let (i50, i99) = (pct(&mut idle, 0.5), pct(&mut idle, 0.99));
    let (l50, l99) = (pct(&mut loaded, 0.5), pct(&mut loaded, 0.99));
    println!(
        "{}",
        serde_json::to_string_pretty(&serde_json::json!({
            "max_batch_tokens": max_batch_tokens,
            "a_backlog_requests": A_BACKLOG,
            "samples": SAMPLES,
            "b_ttft_idle_ms": {"p50": i50, "p99": i99},
            "b_ttft_under_flood_ms": {"p50": l50, "p99": l99},
            "ratio_p50": l50 / i50,
            "ratio_p99": l99 / i99,
        }))?
    );
    Ok(())
}

/// The bench reads token ids only.
struct NoText;

impl warden::engine::text::Detokenizer for NoText {
    fn token_bytes(&self, _token: u32) -> Vec<u8> {
        Vec::new()
    }
    fn is_eog(&self, _token: u32) -> bool {
        false
    }
}
