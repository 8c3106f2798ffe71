//! Fair scheduling under a flood: tenant B's time to first token while tenant A keeps the
//! engine full of long requests, against B's time to first token on an idle engine, in one run.
//!
//! The engine runs on this thread as the server's engine thread does; B's requests arrive from
//! another thread at random moments (so a request may land mid-step), and the engine takes them
//! between steps. Runs the engine's default step target and then no step target (steps of
//! `max_batch_tokens`), and prints one JSON object per run: B's p50 and p99 idle and under the
//! flood, their ratios, and A's tokens computed per second under the flood (what the shorter
//! steps cost the flooding tenant).
//!
//! `cargo run --release -p warden --example fairness_bench [-- --max-batch-tokens N]
//! [--step-target-ms MS,MS,...]` (0: no target)

use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use warden::engine::request::{GenerateRequest, RequestId};
use warden::engine::{Engine, EngineConfig, Event, TenantSettings};
use warden::loaded::LoadedModel;
use warden::tenant::TenantId;

const SAMPLES: usize = 80;
const A_BACKLOG: usize = 24;
const A_PROMPT: usize = 384;

fn root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

/// Runs `SAMPLES` of B's requests through `e` (with A flooding it if `flood`); B's TTFTs in ms,
/// and A's tokens computed per second.
fn run(e: &mut Engine, flood: bool, seed: u64) -> (Vec<f64>, f64) {
    let (tx, rx) = mpsc::channel::<Instant>();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    // B, an interactive tenant: one short request at a time, each a random 50 to 250 ms after
    // the previous one's answer.
    let producer = std::thread::spawn(move || {
        let mut x = seed | 1;
        for _ in 0..SAMPLES {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            std::thread::sleep(Duration::from_millis(50 + x % 200));
            if tx.send(Instant::now()).is_err() || done_rx.recv().is_err() {
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
    let mut b_ids: Vec<RequestId> = Vec::new();
    let mut b_tokens = 0u64;
    let mut flood_started: Option<(Instant, u64)> = None;
    while ttft.len() < SAMPLES {
        // A keeps its backlog full: long prompts, long outputs.
        while flood && a_live < A_BACKLOG {
            flood_started.get_or_insert_with(|| (Instant::now(), e.tokens_computed()));
            a_salt += 1;
            let prompt: Vec<u32> = (0..A_PROMPT as u32)
                .map(|j| 100 + (a_salt * 7919 + j * 104_729) % 20_000)
                .collect();
            let mut r = GenerateRequest::greedy(tenant(1), prompt, 128);
            r.ignore_eos = true;
            let r = r.validate(&e.limits()).expect("A's request is valid");
            a_ids.push(e.submit(r).expect("A's request fits"));
            a_live += 1;
        }
        for sent in rx.try_iter() {
            b_n += 1;
            // A distinct 40-token prompt each time: nothing comes from the prefix cache.
            let prompt: Vec<u32> = (0..40u32).map(|j| 200 + (b_n * 40 + j) % 20_000).collect();
            let mut r = GenerateRequest::greedy(tenant(2), prompt, 4);
            r.ignore_eos = true;
            let r = r.validate(&e.limits()).expect("B's request is valid");
            let id = e.submit(r).expect("B's request fits");
            b_ids.push(id);
            b_waiting.push((id, sent));
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
                Event::Done { id, usage, .. } => {
                    if a_ids.contains(&id) {
                        a_live -= 1;
                    } else if b_ids.contains(&id) {
                        // Its prompt, and every output token but the last.
                        b_tokens += (usage.prompt_tokens + usage.completion_tokens - 1) as u64;
                        let _ = done_tx.send(());
                    }
                }
                // The bench submits whole requests only.
                Event::Prefilled { .. } | Event::Opened { .. } => {}
            }
        }
    }
    // Every token the engine computed while the flood ran, minus B's.
    let a_rate = flood_started.map_or(0.0, |(t0, c0)| {
        (e.tokens_computed() - c0 - b_tokens) as f64 / t0.elapsed().as_secs_f64()
    });
    // The producer may be waiting for the last answer.
    drop(done_tx);
    let _ = producer.join();
    e.abort_all();
    (ttft, a_rate)
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1));
    let max_batch_tokens = arg("--max-batch-tokens").map(|v| v.parse()).transpose()?.unwrap_or(512);
    let l = LoadedModel::open(&root().join(warden::DEFAULT_MODEL))?;
    // Step targets to compare, in ms (0: none): by default the engine's and none.
    let targets: Vec<Option<Duration>> = match arg("--step-target-ms") {
        Some(list) => list
            .split(',')
            .map(|v| Ok(Some(Duration::from_millis(v.parse()?)).filter(|d| !d.is_zero())))
            .collect::<anyhow::Result<_>>()?,
        None => vec![EngineConfig::for_model(&l.model).step_target, None],
    };
    let mut runs = Vec::new();
    for step_target in targets {
        let mut cfg = EngineConfig::for_model(&l.model);
        cfg.max_batch_tokens = max_batch_tokens;
        cfg.step_target = step_target;
        cfg.prefix_cache = false;
        let mut e = Engine::new(l.model.clone(), Arc::new(NoText), cfg)?;
        for owner in [1, 2] {
            e.set_tenant(
                tenant(owner),
                TenantSettings {
                    prefix_cache: false,
                    ..Default::default()
                },
            );
        }
        // Warm up the weights, the thread pool and the step's cost estimate.
        run(&mut e, false, 7);
        let (mut idle, _) = run(&mut e, false, 11);
        let (mut loaded, a_rate) = run(&mut e, true, 13);
        let (i50, i99) = (pct(&mut idle, 0.5), pct(&mut idle, 0.99));
        let (l50, l99) = (pct(&mut loaded, 0.5), pct(&mut loaded, 0.99));
        runs.push(serde_json::json!({
            "step_target_ms": step_target.map(|t| t.as_millis()),
            "max_batch_tokens": max_batch_tokens,
            "a_backlog_requests": A_BACKLOG,
            "samples": SAMPLES,
            "b_ttft_idle_ms": {"p50": i50, "p99": i99},
            "b_ttft_under_flood_ms": {"p50": l50, "p99": l99},
            "ratio_p50": l50 / i50,
            "ratio_p99": l99 / i99,
            "a_tokens_per_s": a_rate,
        }));
    }
    println!("{}", serde_json::to_string_pretty(&runs)?);
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

/// The bench's tenant `n` (1 is A, 2 is B).
fn tenant(n: u64) -> TenantId {
    TenantId::new(n).expect("the bench's tenants are 1 and 2")
}
