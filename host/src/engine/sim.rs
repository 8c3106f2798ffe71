//! The engine driven by a stand-in model: scheduling, admission, budgets, cancellations and
//! policy reloads tested without loading weights. The stand-in checks every page a step reads,
//! as the real forward pass does, and answers with logits that depend only on the sequence's
//! last token and position, so runs are deterministic.

use std::collections::HashMap;
use std::sync::Arc;

use proptest::prelude::*;
use warden_kernels::tag::{TagCheck, check_pages};

use super::request::{FinishReason, GenerateRequest, Outcome, RequestId, Usage};
use super::{Engine, EngineConfig, Event, TenantSettings};
use crate::kv::KvPool;
use crate::model::{Forward, ModelConfig, Scratch, StepError, StepSeq};
use crate::testutil::{IdDetok, tenant};

const VOCAB: usize = 64;
const PAGE: usize = 4;

/// A model with the real one's interface and none of its weights.
struct Stand {
    cfg: ModelConfig,
}

impl Stand {
    fn new() -> Self {
        Self {
            cfg: ModelConfig {
                n_layers: 1,
                dim: 8,
                n_heads: 1,
                n_kv_heads: 1,
                head_dim: 4,
                ffn_dim: 8,
                vocab: VOCAB,
                context_length: 64,
                rope_base: 10_000.0,
                rope_dim: 4,
                norm_eps: 1e-5,
                tied_embeddings: true,
                arch: crate::model::Arch::Llama,
                rope_scale: 1.0,
                rope_neox: false,
                attn_scale: 0.5,
                embed_scale: None,
                ffn_act: crate::model::FfnAct::Silu,
                sliding: None,
            },
        }
    }
}

impl Forward for Stand {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn forward(
        &self,
        pool: &mut KvPool,
        seqs: &[StepSeq<'_>],
        check: TagCheck,
        _: &mut Scratch,
    ) -> Vec<Result<Option<Vec<f32>>, StepError>> {
        seqs.iter()
            .map(|sq| {
                let (owner, table) = pool.table(sq.seq)?;
                let upto = sq.pos0 + sq.tokens.len();
                check_pages(owner, table, upto, PAGE, pool.tags(), check)?;
                Ok(sq.want_logits.then(|| {
                    let last = *sq.tokens.last().unwrap_or(&0) as usize;
                    // Now and then an end-of-generation token (2, as IdDetok has it).
                    let next = if (last + upto).is_multiple_of(11) {
                        2
                    } else {
                        5 + (last * 31 + upto) % (VOCAB - 5)
                    };
                    let mut logits = vec![0.0; VOCAB];
                    logits[next] = 1.0;
                    logits
                }))
            })
            .collect()
    }
}

fn config() -> EngineConfig {
    EngineConfig {
        max_context: 64,
        max_batch_tokens: 32,
        step_target: None,
        max_running: 8,
        max_waiting: 16,
        page_size: PAGE,
        // 40 pages of 4 tokens (one layer, one KV head of 4, f16 K and V: 64 bytes a page).
        kv_memory_bytes: 40 * 64,
        tag_check: TagCheck::Enforce,
        prefix_cache: true,
        max_pinned_pages: 4,
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// Tenant 1 to 3 submits a prompt of this many tokens (from a small alphabet, so prefixes
    /// repeat) for at most this many tokens, or open-ended (up to the rest of the context,
    /// growing its pages as it goes).
    Submit {
        owner: u64,
        prompt: usize,
        max_tokens: usize,
        open_ended: bool,
        salt: u32,
    },
    /// Cancel the n-th request submitted (modulo their number).
    Cancel(usize),
    /// A policy reload: a tenant's weight and floor change.
    Reload {
        owner: u64,
        weight: u32,
        min_pages: usize,
    },
    Step,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1u64..4, 1usize..40, 1usize..24, prop::bool::weighted(0.3), 0u32..4).prop_map(|(owner, prompt, max_tokens, open_ended, salt)| Op::Submit { owner, prompt, max_tokens, open_ended, salt }),
        1 => any::<usize>().prop_map(Op::Cancel),
        1 => (1u64..4, 1u32..4, 0usize..12).prop_map(|(owner, weight, min_pages)| Op::Reload { owner, weight, min_pages }),
        6 => Just(Op::Step),
    ]
}

/// The prompt of [`Op::Submit`].
fn prompt_of(prompt: usize, salt: u32) -> Vec<u32> {
    (0..prompt).map(|i| 5 + ((i as u32 + salt) % 6)).collect()
}

/// Submits [`Op::Submit`]'s request: its id and the most tokens it may generate, if the engine
/// admitted it.
fn submit(e: &mut Engine, owner: u64, prompt: usize, max_tokens: usize, salt: u32) -> Option<RequestId> {
    submit_request(e, owner, prompt, max_tokens, false, salt).map(|(id, _)| id)
}

fn submit_request(
    e: &mut Engine,
    owner: u64,
    prompt: usize,
    max_tokens: usize,
    open_ended: bool,
    salt: u32,
) -> Option<(RequestId, usize)> {
    let mut req = GenerateRequest::greedy(tenant(owner), prompt_of(prompt, salt), max_tokens);
    if open_ended {
        req.open_ended = true;
        req.max_tokens = usize::MAX;
    }
    let valid = req.validate(&e.limits()).ok()?;
    let most = valid.request().max_tokens;
    e.submit(valid).ok().map(|id| (id, most))
}

/// What the stand-in model generates after `prompt`, greedily, until its end-of-generation
/// token or `max_tokens`: a run's tokens must be a prefix of this however often the run was
/// preempted and computed again.
fn expected(prompt: &[u32], max_tokens: usize, ignore_eos: bool) -> Vec<u32> {
    let mut tokens = prompt.to_vec();
    while tokens.len() - prompt.len() < max_tokens {
        let (last, upto) = (*tokens.last().unwrap_or(&0) as usize, tokens.len());
        let next = if (last + upto).is_multiple_of(11) {
            2
        } else {
            5 + (last * 31 + upto) % (VOCAB - 5)
        };
        if next == 2 && !ignore_eos {
            break;
        }
        tokens.push(next as u32);
    }
    tokens.split_off(prompt.len())
}

/// Each tenant's page cap, fixed for a run (a reload changes weights and floors).
const CAPS: [Option<usize>; 3] = [None, Some(16), Some(24)];

fn settings(owner: u64, weight: u32, min_pages: usize) -> TenantSettings {
    TenantSettings {
        weight,
        max_pages: CAPS[(owner - 1) as usize],
        min_pages,
        ..TenantSettings::default()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// Random arrivals (some open-ended, growing their pages as they decode), cancellations,
    /// reloads and steps: every admitted request ends exactly once (and a refused one never
    /// does), no tenant ever holds more pages than its cap, a request never generates past its
    /// max_tokens, what it generates is what it would alone however often it was preempted and
    /// computed again, the engine drains in bounded steps (no request waits forever), and at the
    /// end every page is back.
    #[test]
    fn every_request_ends_exactly_once_within_its_tenants_budget(ops in prop::collection::vec(op(), 1..120)) {
        let mut e = Engine::new(Arc::new(Stand::new()), Arc::new(IdDetok), config()).expect("engine starts");
        for o in 1..=3 {
            e.set_tenant(tenant(o), settings(o, 1, 0));
        }
        let mut admitted: Vec<(RequestId, usize)> = Vec::new();
        let mut prompts: HashMap<RequestId, Vec<u32>> = HashMap::new();
        let mut ended: HashMap<RequestId, (Outcome, Usage)> = HashMap::new();
        let mut output: HashMap<RequestId, Vec<u32>> = HashMap::new();
        let mut record = |events: Vec<Event>, ended: &mut HashMap<RequestId, (Outcome, Usage)>| -> Result<(), TestCaseError> {
            for ev in events {
                match ev {
                    Event::Done { id, outcome, usage, .. } => {
                        prop_assert!(ended.insert(id, (outcome, usage)).is_none(), "{id} ended twice");
                    }
                    Event::Token { id, token, .. } => output.entry(id).or_default().push(token),
                    _ => {}
                }
            }
            Ok(())
        };
        let check_caps = |e: &Engine| -> Result<(), TestCaseError> {
            for o in 1..=3u64 {
                if let Some(cap) = CAPS[(o - 1) as usize] {
                    let held = e.pool().pages_held(tenant(o));
                    prop_assert!(held <= cap, "tenant {o} holds {held} pages, over its cap of {cap}");
                }
            }
            Ok(())
        };
        for op in ops {
            match op {
                Op::Submit { owner, prompt, max_tokens, open_ended, salt } => {
                    if let Some((id, most)) = submit_request(&mut e, owner, prompt, max_tokens, open_ended, salt) {
                        admitted.push((id, most));
                        prompts.insert(id, prompt_of(prompt, salt));
                    }
                }
                Op::Cancel(n) if !admitted.is_empty() => {
                    e.cancel(admitted[n % admitted.len()].0);
                }
                Op::Cancel(_) => {}
                Op::Reload { owner, weight, min_pages } => e.set_tenant(tenant(owner), settings(owner, weight, min_pages)),
                Op::Step => {
                    let events = e.step();
                    record(events, &mut ended)?;
                }
            }
            check_caps(&e)?;
        }
        // Liveness: with no new arrivals, everything ends within a bound of steps (each request
        // needs at most 64 positions, computed at least one a step, and 16 can wait).
        let mut steps = 0;
        while e.has_work() {
            steps += 1;
            prop_assert!(steps <= 2_000, "the engine did not drain");
            let events = e.step();
            record(events, &mut ended)?;
            check_caps(&e)?;
        }
        record(e.abort_all(), &mut ended)?;
        for (id, max_tokens) in &admitted {
            let (_, usage) = ended.get(id).ok_or_else(|| TestCaseError::fail(format!("{id} never ended")))?;
            prop_assert!(usage.completion_tokens <= *max_tokens);
            let got = output.get(id).map_or(&[][..], |t| &t[..]);
            let want = expected(&prompts[id], *max_tokens, false);
            prop_assert!(want.starts_with(got), "{id} generated {got:?}, not a prefix of {want:?}");
            prop_assert_eq!(usage.completion_tokens, got.len());
        }
        prop_assert_eq!(ended.len(), admitted.len(), "only admitted requests end");
        let c = e.kv_counters();
        prop_assert_eq!((c.pages_used, c.pages_reserved, c.tag_mismatches), (0, 0, 0));
    }
}

/// The fairness bound, in virtual tokens (what was computed for a tenant over its weight; the
/// test charges each token one, as a model whose attention costs nothing would be): what one
/// tenant may be served more than another while both have requests waiting. While the less
/// served one waits, the more served one gains only through sequences admitted before (their
/// pages were reserved, so together at most the pool's tokens: 40 pages, see [`config`]) and
/// through one step's batch (`max_batch_tokens`, 32) beyond that; a weight is at least 1. Runs
/// here stay under 100 (400 cases); with admission in arrival order instead of least served
/// first they reach 160, and with neither that order nor slots and pages taken back from the
/// more served (before these), 190.
const FAIRNESS_BOUND: f64 = (40 * PAGE + 32) as f64;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// Random arrivals, cancellations, weight changes and steps, with no page caps or floors
    /// (which hold a tenant back by its own policy or for another's guarantee): over any stretch
    /// in which two tenants both have requests waiting, neither is served more than
    /// [`FAIRNESS_BOUND`] virtual tokens beyond the other (the VTC's bound, "Fairness in Serving
    /// Large Language Models", OSDI 2024). A waiting tenant is never starved while another runs
    /// ahead.
    #[test]
    fn no_waiting_tenant_falls_behind_past_the_fairness_bound(ops in prop::collection::vec(op(), 1..160)) {
        let mut e = Engine::new(Arc::new(Stand::new()), Arc::new(IdDetok), config()).expect("engine starts");
        // The stand-in's steps take no time to measure: a token costs one, whatever it attends.
        e.cost.charge_tokens = true;
        let uncapped = |weight| TenantSettings { weight, ..TenantSettings::default() };
        for o in 1..=3 {
            e.set_tenant(tenant(o), uncapped(1));
        }
        let mut admitted: Vec<RequestId> = Vec::new();
        // For each pair of tenants waiting together since some point: both counters then.
        let mut since: HashMap<(u64, u64), (f64, f64)> = HashMap::new();
        let mut check = |e: &Engine| -> Result<(), TestCaseError> {
            let waits = |o: u64| e.waiting.iter().any(|s| s.owner == tenant(o));
            for (a, b) in [(1, 2), (1, 3), (2, 3)] {
                if !(waits(a) && waits(b)) {
                    since.remove(&(a, b));
                    continue;
                }
                let (sa, sb) = (e.served(tenant(a)), e.served(tenant(b)));
                let &mut (a0, b0) = since.entry((a, b)).or_insert((sa, sb));
                let gap = ((sa - a0) - (sb - b0)).abs();
                prop_assert!(
                    gap <= FAIRNESS_BOUND,
                    "tenants {a} and {b}, both waiting, were served {} and {} virtual tokens: {gap} apart",
                    sa - a0,
                    sb - b0
                );
            }
            Ok(())
        };
        for op in ops {
            match op {
                Op::Submit { owner, prompt, max_tokens, open_ended, salt } => {
                    admitted.extend(submit_request(&mut e, owner, prompt, max_tokens, open_ended, salt).map(|(id, _)| id));
                }
                Op::Cancel(n) if !admitted.is_empty() => {
                    e.cancel(admitted[n % admitted.len()]);
                }
                Op::Cancel(_) => {}
                Op::Reload { owner, weight, .. } => e.set_tenant(tenant(owner), uncapped(weight)),
                Op::Step => {
                    e.step();
                }
            }
            check(&e)?;
        }
        while e.has_work() {
            e.step();
            check(&e)?;
        }
    }
}

/// The VTC's lift: a tenant that was idle starts at the lowest counter of the active ones, so
/// idling banks no credit against tenants that kept the engine busy; on an idle engine, at the
/// highest counter, so what others were served while nobody contended counts against no one.
#[test]
fn an_idle_tenant_arrives_at_the_active_tenants_counter() {
    let mut e = Engine::new(Arc::new(Stand::new()), Arc::new(IdDetok), config()).expect("engine starts");
    // In tokens, so what tenant 1 was served is known.
    e.cost.charge_tokens = true;
    let busy = submit(&mut e, 1, 20, 20, 0).expect("admitted");
    for _ in 0..4 {
        e.step();
    }
    let served = e.served(tenant(1));
    assert!(served > 20.0, "tenant 1 was served its prompt and more: {served}");
    assert_eq!(e.served(tenant(2)), 0.0);
    submit(&mut e, 2, 8, 4, 1).expect("admitted");
    assert_eq!(e.served(tenant(2)), served, "lifted to the active tenant's counter");
    // Everyone done: a third tenant arriving starts at the highest counter.
    e.cancel(busy);
    while e.has_work() {
        e.step();
    }
    let highest = e.served(tenant(1)).max(e.served(tenant(2)));
    submit(&mut e, 3, 8, 4, 2).expect("admitted");
    assert_eq!(e.served(tenant(3)), highest, "on an idle engine, the highest counter");
}

/// Each request's tokens, and how it ended.
type Drained = (HashMap<RequestId, Vec<u32>>, HashMap<RequestId, (Outcome, Usage)>);

/// Runs `e` until it is idle (within a bound of steps): each request's tokens and outcome.
fn drain(e: &mut Engine) -> Drained {
    let (mut tokens, mut ended) = (HashMap::new(), HashMap::new());
    for _ in 0..5_000 {
        if !e.has_work() {
            return (tokens, ended);
        }
        for ev in e.step() {
            match ev {
                Event::Token { id, token, .. } => tokens.entry(id).or_insert_with(Vec::new).push(token),
                Event::Done { id, outcome, usage, .. } => {
                    assert!(ended.insert(id, (outcome, usage)).is_none(), "{id} ended twice");
                }
                _ => {}
            }
        }
    }
    panic!("the engine did not drain");
}

/// An open-ended request of tenant `owner` that ignores end-of-generation tokens.
fn open_ended(e: &mut Engine, owner: u64, prompt: &[u32]) -> RequestId {
    let mut req = GenerateRequest::greedy(tenant(owner), prompt.to_vec(), usize::MAX);
    req.open_ended = true;
    req.ignore_eos = true;
    let valid = req.validate(&e.limits()).expect("valid");
    e.submit(valid).expect("admitted")
}

/// Open-ended requests that together outgrow the pool (six of 16 pages each, in 40): each
/// opens with pages for its prompt and grows them as it decodes; those the scheduler favours
/// least give their pages up and compute their tokens again when readmitted; every one runs to
/// the end of its context with what it would have generated alone, and every page comes back.
#[test]
fn sequences_that_outgrow_the_pool_are_preempted_and_end_as_they_would_alone() {
    let mut e = Engine::new(Arc::new(Stand::new()), Arc::new(IdDetok), config()).expect("engine starts");
    let runs: Vec<(RequestId, Vec<u32>)> = (0..6u32)
        .map(|k| {
            let prompt = prompt_of(8, k);
            (open_ended(&mut e, 1 + u64::from(k % 2), &prompt), prompt)
        })
        .collect();
    let (tokens, ended) = drain(&mut e);
    assert!(e.preemptions() > 0, "96 pages wanted of 40: someone was preempted");
    for (id, prompt) in &runs {
        let (outcome, usage) = &ended[id];
        assert!(
            matches!(outcome, Outcome::Finished(FinishReason::Length)),
            "{id}: {outcome:?}"
        );
        // The rest of a 64-token context.
        assert_eq!(tokens[id], expected(prompt, 56, true), "{id}");
        assert_eq!((usage.prompt_tokens, usage.completion_tokens), (8, 56));
    }
    let c = e.kv_counters();
    assert_eq!((c.pages_used, c.pages_reserved, c.tag_mismatches), (0, 0, 0), "{c:?}");
}

/// An open-ended request grows its pages up to its tenant's cap and ends there with `length`
/// and what it generated; one that names more tokens than the cap holds is refused up front.
#[test]
fn an_open_ended_request_ends_with_length_at_its_tenants_cap() {
    let mut e = Engine::new(Arc::new(Stand::new()), Arc::new(IdDetok), config()).expect("engine starts");
    e.set_tenant(
        tenant(1),
        TenantSettings {
            max_pages: Some(8),
            ..TenantSettings::default()
        },
    );
    let prompt = prompt_of(8, 0);
    let id = open_ended(&mut e, 1, &prompt);
    let (tokens, ended) = drain(&mut e);
    // Eight pages of four hold 32 positions: the token sampled from the last of them is the 25th.
    assert!(
        matches!(ended[&id].0, Outcome::Finished(FinishReason::Length)),
        "{:?}",
        ended[&id].0
    );
    assert_eq!(tokens[&id], expected(&prompt, 25, true));
    assert_eq!(e.preemptions(), 0, "alone under its cap, it preempts nothing");
    let explicit = GenerateRequest::greedy(tenant(1), prompt, 56)
        .validate(&e.limits())
        .expect("valid");
    let refused = e.submit(explicit).expect_err("over its cap");
    assert!(
        matches!(
            refused.reason,
            super::request::RejectReason::OverKvBudget { needed: 16, budget: 8 }
        ),
        "{refused:?}"
    );
}

/// When pages run short, the more served tenant's sequence gives its pages up, not the less
/// served one's (by virtual counter: what it was served over its weight): a tenant that has had more cannot push
/// out one that has had less.
#[test]
fn the_more_served_tenant_is_the_one_preempted() {
    let mut e = Engine::new(Arc::new(Stand::new()), Arc::new(IdDetok), config()).expect("engine starts");
    // Tenant 2's weight keeps its counter below tenant 1's from its arrival on.
    e.set_tenant(
        tenant(2),
        TenantSettings {
            weight: 4,
            ..TenantSettings::default()
        },
    );
    // Tenant 1 runs alone a while (its counter climbs), then tenant 2 arrives.
    let ones: Vec<RequestId> = (0..2u32).map(|k| open_ended(&mut e, 1, &prompt_of(8, k))).collect();
    for _ in 0..12 {
        e.step();
    }
    let twos: Vec<RequestId> = (2..4u32).map(|k| open_ended(&mut e, 2, &prompt_of(8, k))).collect();
    let mut preempted: std::collections::HashSet<RequestId> = std::collections::HashSet::new();
    while e.has_work() {
        e.step();
        preempted.extend(e.waiting.iter().filter(|s| s.preempted > 0).map(|s| s.id));
    }
    assert!(
        !preempted.is_empty(),
        "four sequences of 16 pages in 40: someone was preempted"
    );
    assert!(
        twos.iter().all(|id| !preempted.contains(id)),
        "tenant 2 (less served) lost its pages: {preempted:?}, tenant 1's are {ones:?}"
    );
}

/// A tenant's guaranteed floor holds against preemption: its sequence is not taken when that
/// would leave it below its floor, however much more it has been served.
#[test]
fn a_sequence_its_tenant_needs_for_its_floor_is_not_preempted() {
    let mut e = Engine::new(Arc::new(Stand::new()), Arc::new(IdDetok), config()).expect("engine starts");
    e.set_tenant(
        tenant(1),
        TenantSettings {
            weight: 8,
            ..TenantSettings::default()
        },
    );
    e.set_tenant(
        tenant(2),
        TenantSettings {
            min_pages: 10,
            ..TenantSettings::default()
        },
    );
    // Tenant 2's one sequence runs alone until it holds more than its floor (12 pages).
    let floor = open_ended(&mut e, 2, &prompt_of(8, 0));
    while e.pool().pages_held(tenant(2)) < 12 {
        e.step();
    }
    // Tenant 1 (less served, by its weight) then wants more than the rest of the pool.
    for k in 1..7u32 {
        open_ended(&mut e, 1, &prompt_of(8, k));
    }
    let mut preempted = std::collections::HashSet::new();
    while e.has_work() {
        e.step();
        preempted.extend(e.waiting.iter().filter(|s| s.preempted > 0).map(|s| s.id));
    }
    assert!(
        !preempted.is_empty(),
        "tenant 1's sequences outgrow the pool: some yield"
    );
    assert!(!preempted.contains(&floor), "tenant 2's floor was taken: {preempted:?}");
}

/// Running slots are shared: a tenant that holds every slot gives one back to a tenant that
/// arrives with none (its sequence that lost least is preempted, and ends as it would have),
/// instead of the newcomer waiting until one of them ends.
#[test]
fn a_less_served_tenant_takes_a_slot_back_from_one_holding_them_all() {
    let mut e = Engine::new(Arc::new(Stand::new()), Arc::new(IdDetok), config()).expect("engine starts");
    // Eight slots, all tenant 1's, on short prompts that leave the pool half free.
    let ones: Vec<(RequestId, Vec<u32>)> = (0..8u32)
        .map(|k| {
            let prompt = prompt_of(4, k);
            (open_ended(&mut e, 1, &prompt), prompt)
        })
        .collect();
    let mut early: HashMap<RequestId, Vec<u32>> = HashMap::new();
    let mut step = |e: &mut Engine| {
        for ev in e.step() {
            if let Event::Token { id, token, .. } = ev {
                early.entry(id).or_default().push(token);
            }
        }
    };
    for _ in 0..3 {
        step(&mut e);
    }
    assert_eq!(e.queue_lengths(), (0, 8));
    let two = submit(&mut e, 2, 6, 4, 9).expect("admitted");
    step(&mut e);
    assert!(
        e.running.iter().any(|s| s.id == two),
        "tenant 2 got a slot at the next step"
    );
    assert_eq!(e.preemptions(), 1, "one of tenant 1's gave its slot back");
    let (tokens, ended) = drain(&mut e);
    assert!(matches!(ended[&two].0, Outcome::Finished(_)), "{:?}", ended[&two]);
    for (id, prompt) in &ones {
        let all = [early.get(id).cloned().unwrap_or_default(), tokens[id].clone()].concat();
        assert_eq!(all, expected(prompt, 60, true), "{id} ends as it would alone");
    }
    let c = e.kv_counters();
    assert_eq!((c.pages_used, c.pages_reserved), (0, 0), "{c:?}");
}

/// KV pages are shared: a tenant whose sequences fill the pool gives pages back to a tenant
/// holding none (its sequences preempted as for growth), so the newcomer starts at once.
#[test]
fn a_less_served_tenant_takes_pages_back_from_one_holding_the_pool() {
    let mut cfg = config();
    cfg.max_running = 16;
    let mut e = Engine::new(Arc::new(Stand::new()), Arc::new(IdDetok), cfg).expect("engine starts");
    // Tenant 1's long prompts (eight pages each) take the pool's 40 pages: four run, holding
    // a page of headroom each, and the fifth waits.
    let ones: Vec<(RequestId, Vec<u32>)> = (0..5u32)
        .map(|k| {
            let prompt = prompt_of(30, k);
            (open_ended(&mut e, 1, &prompt), prompt)
        })
        .collect();
    let mut early: HashMap<RequestId, Vec<u32>> = HashMap::new();
    let mut step = |e: &mut Engine| {
        for ev in e.step() {
            if let Event::Token { id, token, .. } = ev {
                early.entry(id).or_default().push(token);
            }
        }
    };
    for _ in 0..6 {
        step(&mut e);
    }
    assert!(
        e.pool().pages_held(tenant(1)) >= 32,
        "{}",
        e.pool().pages_held(tenant(1))
    );
    let before = e.preemptions();
    let two = submit(&mut e, 2, 20, 8, 9).expect("admitted");
    step(&mut e);
    assert!(
        e.running.iter().any(|s| s.id == two),
        "tenant 2 got its pages at the next step"
    );
    assert!(e.preemptions() > before, "tenant 1 gave pages back");
    let (tokens, ended) = drain(&mut e);
    assert!(matches!(ended[&two].0, Outcome::Finished(_)), "{:?}", ended[&two]);
    for (id, prompt) in &ones {
        let all = [early.get(id).cloned().unwrap_or_default(), tokens[id].clone()].concat();
        assert_eq!(all, expected(prompt, 34, true), "{id} ends as it would alone");
    }
    let c = e.kv_counters();
    assert_eq!((c.pages_used, c.pages_reserved, c.tag_mismatches), (0, 0, 0), "{c:?}");
}
