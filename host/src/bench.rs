//! `warden bench`: engine throughput on the loaded model, with and without tag checks.
//!
//! In a build with the `bench-tags-off` feature (`scripts/bench.sh` makes one in its own target
//! folder; release builds never have it), every figure is measured twice in the same process,
//! once with the tag checks of invariant 2 on and once with them off, alternating so drift on a
//! shared machine hits both alike; the ratio of the two is the price of isolation. Other builds
//! report the tags-on figures and leave the tags-off ones out. Each configuration runs
//! [`BenchConfig::repeats`] times and reports its best run, as throughput benchmarks usually do:
//! noise only ever slows a run down. These engines run without the prefix cache, so every run
//! computes what it times; the prefix cache has its own figure, the same prompt's time to first
//! token computed and then adopted from the cache.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use warden_kernels::tag::{PageEntry, PageTag, TagCheck, check_pages};

use crate::engine::constraint::Constraint;
use crate::engine::request::{GenerateRequest, Outcome};
use crate::engine::text::Detokenizer;
use crate::engine::{Engine, EngineConfig, EngineError, Event};
use crate::model::Model;
use crate::tenant::TenantId;

/// The tags-off switch, in builds that have it.
#[cfg(feature = "bench-tags-off")]
const TAGS_OFF: Option<TagCheck> = Some(TagCheck::SkipForBenchmark);
#[cfg(not(feature = "bench-tags-off"))]
const TAGS_OFF: Option<TagCheck> = None;

/// What to measure.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// The prefill prompt (512 tokens in `warden bench`).
    pub prefill_prompt: Vec<u32>,
    /// Concurrent sequences for the decode figures (1, 4 and 16 in `warden bench`).
    pub decode_batches: Vec<usize>,
    /// Tokens each decode sequence generates (128 in `warden bench`).
    pub decode_tokens: usize,
    /// Runs of each configuration; the best counts. Default 3.
    pub repeats: usize,
    /// A compiled output constraint: each decode figure is also timed with every sequence
    /// under it ([`BenchReport::constrained_decode`]).
    pub constraint: Option<Constraint>,
}

/// One figure: tokens per second with tag checks on and off.
#[derive(Debug, Clone, Serialize)]
pub struct Figure {
    /// Concurrent sequences.
    pub sequences: usize,
    /// Tokens per second with tag checks (the product as it runs).
    pub tok_s: f64,
    /// Tokens per second with tag checks off (`bench-tags-off` builds only).
    pub tok_s_tags_off: Option<f64>,
    /// `tok_s / tok_s_tags_off`: 1.0 means isolation is free.
    pub ratio: Option<f64>,
}

/// The bench's result, printed as one JSON object.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// The model file.
    pub model: String,
    /// The compute backend.
    pub backend: String,
    /// Worker threads.
    pub threads: usize,
    /// Prompt tokens of the prefill figure.
    pub prefill_tokens: usize,
    /// Prefill throughput (one sequence).
    pub prefill: Figure,
    /// Tokens generated per sequence in the decode figures.
    pub decode_tokens: usize,
    /// Total decode throughput at each batch size.
    pub decode: Vec<Figure>,
    /// The tag checks timed on their own, against the step time of the largest decode batch.
    pub tag_checks: TagCheckCost,
    /// The prefill prompt's time to first token, computed and from the prefix cache.
    pub prefix_cache: PrefixCacheFigure,
    /// With [`BenchConfig::constraint`]: each decode figure with every sequence constrained,
    /// against the same decode unconstrained, the two alternated.
    pub constrained_decode: Vec<ConstrainedFigure>,
}

/// Decode throughput with every sequence under an output constraint, and without.
#[derive(Debug, Clone, Serialize)]
pub struct ConstrainedFigure {
    /// Concurrent sequences.
    pub sequences: usize,
    /// Tokens per second, constrained.
    pub tok_s: f64,
    /// Tokens per second, the same decode unconstrained.
    pub tok_s_unconstrained: f64,
    /// `tok_s / tok_s_unconstrained`: 1.0 means the constraint is free.
    pub ratio: f64,
}

/// What the tenant-private prefix cache saves: the prefill prompt's time to first token when the
/// engine computes it all, and when the same tenant sends it again and its whole pages come from
/// the cache (the last, partial page and the last token are computed either way).
#[derive(Debug, Clone, Serialize)]
pub struct PrefixCacheFigure {
    /// Prompt tokens the cache served on the warm runs.
    pub cached_tokens: usize,
    /// Milliseconds to first token, computing the whole prompt (best run).
    pub cold_ms: f64,
    /// Milliseconds to first token, with the cached prefix (best run).
    pub warm_ms: f64,
    /// `cold_ms / warm_ms`.
    pub speedup: f64,
}

/// What the tag checks of one decode step cost, timed in isolation: the throughput ratios above
/// are the end-to-end price, but on a shared machine their noise (a few percent) hides a cost this
/// small, so the checks themselves are also timed.
#[derive(Debug, Clone, Serialize)]
pub struct TagCheckCost {
    /// Sequences in the step.
    pub sequences: usize,
    /// Tokens of context each sequence's checks cover (its longest, at the last decode step).
    pub context: usize,
    /// Page tags compared per step: every page of every sequence in each layer's attention,
    /// plus the page each layer's K/V write goes to.
    pub pages_checked: usize,
    /// Nanoseconds those checks take per step.
    pub ns_per_step: f64,
    /// Nanoseconds per decode step with checks on, from the decode figure.
    pub step_ns: f64,
    /// `ns_per_step / step_ns`.
    pub share: f64,
}

/// Runs the bench.
pub fn run(
    model: Arc<Model>,
    detok: Arc<dyn Detokenizer>,
    model_name: &str,
    cfg: &BenchConfig,
) -> Result<BenchReport, EngineError> {
    let engine = |check: TagCheck, prefix_cache: bool| {
        let mut ec = EngineConfig::for_model(&model);
        ec.tag_check = check;
        ec.prefix_cache = prefix_cache;
        ec.max_batch_tokens = ec.max_batch_tokens.max(cfg.prefill_prompt.len());
        // The longest sequence the bench runs, not the model's whole trained context, sizes the
        // context limit (the pool keeps its memory budget).
        let longest = (cfg.prefill_prompt.len() + 1).max(DECODE_PROMPT + cfg.decode_tokens);
        ec.max_context = ec.max_context.min(longest.next_multiple_of(ec.page_size));
        // Throughput, not latency: steps are bounded by tokens alone, so how the step-cost
        // model happens to fit on a busy machine neither cuts the prompt into chunks nor
        // spreads the decode batch's prompts over several steps.
        ec.step_target = None;
        Engine::new(model.clone(), detok.clone(), ec)
    };
    let mut on = engine(TagCheck::Enforce, false)?;
    let mut off = TAGS_OFF.map(|c| engine(c, false)).transpose()?;
    // Warm caches, page in the weights and start the thread pool before anything is timed.
    prefill(&mut on, &cfg.prefill_prompt);
    if let Some(off) = off.as_mut() {
        prefill(off, &cfg.prefill_prompt);
    }

    let n = cfg.prefill_prompt.len();
    let (a, b) = best_of(
        cfg.repeats,
        || prefill(&mut on, &cfg.prefill_prompt),
        || off.as_mut().map(|e| prefill(e, &cfg.prefill_prompt)),
    );
    let prefill_fig = figure(1, n as f64, a, b);

    let mut cached = engine(TagCheck::Enforce, true)?;
    let (mut cold, mut warm) = (Duration::MAX, Duration::MAX);
    for _ in 0..cfg.repeats.max(1) {
        cached.forget_owner(bench_tenant(1));
        cold = cold.min(prefill(&mut cached, &cfg.prefill_prompt));
        warm = warm.min(prefill(&mut cached, &cfg.prefill_prompt));
    }
    let ps = cached.config().page_size;
    let prefix_cache = PrefixCacheFigure {
        cached_tokens: n.saturating_sub(1) / ps * ps,
        cold_ms: cold.as_secs_f64() * 1e3,
        warm_ms: warm.as_secs_f64() * 1e3,
        speedup: cold.as_secs_f64() / warm.as_secs_f64(),
    };

    let mut decode_figs = Vec::new();
    for &k in &cfg.decode_batches {
        let (a, b) = best_of(
            cfg.repeats,
            || decode(&mut on, k, cfg.decode_tokens, None),
            || off.as_mut().map(|e| decode(e, k, cfg.decode_tokens, None)),
        );
        decode_figs.push(figure(k, (k * (cfg.decode_tokens - 1)) as f64, a, b));
    }
    let mut constrained_decode = Vec::new();
    if let Some(c) = &cfg.constraint {
        for &k in &cfg.decode_batches {
            let (mut with, mut without) = (Duration::MAX, Duration::MAX);
            for _ in 0..cfg.repeats.max(1) {
                with = with.min(decode(&mut on, k, cfg.decode_tokens, Some(c)));
                without = without.min(decode(&mut on, k, cfg.decode_tokens, None));
            }
            let tokens = (k * (cfg.decode_tokens - 1)) as f64;
            let (tok_s, tok_s_unconstrained) = (tokens / with.as_secs_f64(), tokens / without.as_secs_f64());
            constrained_decode.push(ConstrainedFigure {
                sequences: k,
                tok_s,
                tok_s_unconstrained,
                ratio: tok_s / tok_s_unconstrained,
            });
        }
    }
    let (k, fig) = cfg
        .decode_batches
        .iter()
        .zip(&decode_figs)
        .max_by_key(|(k, _)| **k)
        .map(|(k, f)| (*k, f.tok_s))
        .unwrap_or((1, f64::NAN));
    let tag_checks = tag_check_cost(
        model.config().n_layers,
        EngineConfig::for_model(&model).page_size,
        k,
        DECODE_PROMPT + cfg.decode_tokens,
        k as f64 / fig * 1e9,
    );
    Ok(BenchReport {
        model: model_name.to_string(),
        backend: model.backend_name(),
        threads: rayon::current_num_threads(),
        prefill_tokens: n,
        prefill: prefill_fig,
        decode_tokens: cfg.decode_tokens,
        decode: decode_figs,
        tag_checks,
        prefix_cache,
        constrained_decode,
    })
}

/// Times the checks one decode step of `sequences` sequences at `context` tokens runs, on tags and
/// page tables laid out as the pool lays them out (each sequence's pages scattered over the pool).
fn tag_check_cost(layers: usize, page_size: usize, sequences: usize, context: usize, step_ns: f64) -> TagCheckCost {
    let per_seq = context.div_ceil(page_size);
    let n_pages = sequences * per_seq;
    let tags: Vec<PageTag> = (0..n_pages)
        .map(|p| PageTag {
            owner: bench_tenant(1 + (p % sequences) as u64).into(),
            epoch: 3,
            written: if p / sequences + 1 == per_seq {
                (context - (per_seq - 1) * page_size) as u32
            } else {
                page_size as u32
            },
        })
        .collect();
    let tables: Vec<Vec<PageEntry>> = (0..sequences)
        .map(|s| {
            (0..per_seq)
                .map(|j| PageEntry::own((j * sequences + s) as u32, 3))
                .collect()
        })
        .collect();
    let step = || {
        for _ in 0..layers {
            for (s, table) in tables.iter().enumerate() {
                let owner = bench_tenant(1 + s as u64).into();
                let last = table[per_seq - 1];
                let w = tags[last.page as usize].check_holder(owner, last);
                let r = check_pages(owner, table, context, page_size, &tags, TagCheck::Enforce);
                assert!(std::hint::black_box(w.and(r)).is_ok(), "the bench's own tags pass");
            }
        }
    };
    let reps = 2000;
    let mut best = Duration::MAX;
    for _ in 0..5 {
        let t0 = Instant::now();
        for _ in 0..reps {
            step();
        }
        best = best.min(t0.elapsed());
    }
    let ns_per_step = best.as_secs_f64() * 1e9 / reps as f64;
    TagCheckCost {
        sequences,
        context,
        pages_checked: layers * sequences * (per_seq + 1),
        ns_per_step,
        step_ns,
        share: ns_per_step / step_ns,
    }
}

fn figure(sequences: usize, tokens: f64, on: Duration, off: Option<Duration>) -> Figure {
    let tok_s = tokens / on.as_secs_f64();
    let tok_s_tags_off = off.map(|off| tokens / off.as_secs_f64());
    Figure {
        sequences,
        tok_s,
        tok_s_tags_off,
        ratio: tok_s_tags_off.map(|t| tok_s / t),
    }
}

/// Alternates the two runs `repeats` times and keeps each one's best (the second runs only in
/// `bench-tags-off` builds: `None` elsewhere).
fn best_of(
    repeats: usize,
    mut a: impl FnMut() -> Duration,
    mut b: impl FnMut() -> Option<Duration>,
) -> (Duration, Option<Duration>) {
    let (mut best_a, mut best_b) = (Duration::MAX, None::<Duration>);
    for _ in 0..repeats.max(1) {
        best_a = best_a.min(a());
        if let Some(t) = b() {
            best_b = Some(best_b.map_or(t, |best| best.min(t)));
        }
    }
    (best_a, best_b)
}

/// The bench's tenant `n` (they count from 1).
fn bench_tenant(n: u64) -> TenantId {
    match TenantId::new(n) {
        Some(t) => t,
        None => unreachable!("bench tenants count from 1, far below u64::MAX"),
    }
}

/// Time from submitting `prompt` to its first token: the whole prompt in one step.
fn prefill(e: &mut Engine, prompt: &[u32]) -> Duration {
    let mut req = GenerateRequest::greedy(bench_tenant(1), prompt.to_vec(), 1);
    req.ignore_eos = true;
    let t0 = Instant::now();
    let req = req.validate(&e.limits()).expect("the bench prompt fits the engine");
    e.submit(req).expect("the bench prompt fits the engine");
    finish(e);
    t0.elapsed()
}

/// Time for `k` sequences to generate their tokens after the first (the decode steps alone).
/// Tokens of each decode figure's prompt.
const DECODE_PROMPT: usize = 16;

fn decode(e: &mut Engine, k: usize, tokens: usize, constraint: Option<&Constraint>) -> Duration {
    for i in 0..k {
        // Short, distinct prompts: the figure is about decode, not prefill.
        let prompt: Vec<u32> = (0..DECODE_PROMPT)
            .map(|j| 1000 + (i * DECODE_PROMPT + j) as u32)
            .collect();
        let mut req = GenerateRequest::greedy(bench_tenant(1 + i as u64), prompt, tokens);
        req.ignore_eos = true;
        let req = req.validate(&e.limits()).expect("the bench request fits the engine");
        e.submit(req.with_constraint(constraint.cloned()))
            .expect("the bench request fits the engine");
    }
    // Untimed: the steps that prefill every prompt and sample each first token (one step
    // unless the batch's prompts pass `max_batch_tokens`).
    let mut started = 0;
    while started < k && e.has_work() {
        started += e.step().iter().filter(|ev| matches!(ev, Event::Token { .. })).count();
    }
    let t0 = Instant::now();
    finish(e);
    t0.elapsed()
}

fn finish(e: &mut Engine) {
    while e.has_work() {
        for ev in e.step() {
            if let Event::Done { outcome, .. } = ev {
                assert!(
                    matches!(outcome, Outcome::Finished(_)),
                    "bench request ended with {outcome:?}"
                );
            }
        }
    }
}
