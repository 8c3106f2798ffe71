//! Step planning, apart from the model and the pool: given what each running sequence has left
//! to compute, its tenant's virtual counter and the step's limits, which sequences compute how
//! many tokens in the next step. Pure, so fairness and chunking are tested here without a model.
//!
//! Tenants take the step in turn by their virtual counters (the VTC of "Fairness in Serving
//! Large Language Models", OSDI 2024, charging not tokens but the machine time each tenant's
//! work took: see [`CostModel::shares`]). The least served tenant *leads* the step: its
//! decodes (every one when it runs alone; under contention as many as fit the step target, at
//! least one, those that waited longest first), then its prefill chunks, cut to what fits the step target
//! (Sarathi-Serve's token budget from a latency target), never below [`MIN_PREFILL_TOKENS`].
//! The other tenants' work joins in their order while the step's predicted duration stays
//! within twice the lead's own: decodes first (those that waited longest first), then prefill
//! chunks cut to fit. So what others add to a step costs the lead at most as much again as its
//! own work. And the steps another tenant leads are charged to that tenant (a share of a step
//! never more than the sharer's work would have taken alone), so, served in turn, a tenant
//! decodes at no less than about half its idle speed beside any other, however long the
//! other's contexts or however many its streams. A tenant arriving with its first prompt
//! starts at the lowest counter of the active ones and, with fewer sequences, leads the next
//! step: its time to first token is the step in flight plus its own prefill steps. Serving a
//! tenant raises its counter, so the lead moves on.

use std::collections::HashMap;
use std::time::Duration;

use super::cost::{Attention, CostModel, Work};
use crate::tenant::TenantId;

/// Prefill tokens the lead's prefill gets in a step even when nothing more fits its target.
pub const MIN_PREFILL_TOKENS: usize = 16;

/// What the planner sees of a running sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqView {
    /// Its tenant.
    pub owner: TenantId,
    /// Positions computed.
    pub computed: usize,
    /// Positions to compute before it next samples (or, prefill-only, before its transfer).
    pub target: usize,
    /// Whether reaching `target` ends in a token to sample (false for a prefill node's half).
    pub samples: bool,
    /// The attention its next tokens take (a chunk never mixes prompt and output).
    pub attention: Attention,
    /// The step it last computed in (0: never); of a tenant's decodes, those that waited
    /// longest go first.
    pub last: u64,
}

impl SeqView {
    /// One token left, ending in a sample: a decode.
    fn decodes(&self) -> bool {
        self.samples && self.target - self.computed == 1
    }

    /// The work of its next `n` tokens.
    fn chunk(&self, n: usize) -> Work {
        Work::chunk(
            self.computed,
            n,
            self.attention,
            self.samples && self.computed + n == self.target,
        )
    }
}

/// A step's limits and the tenants' virtual counters.
pub struct Planner<'a> {
    /// Most tokens a step computes.
    pub max_batch_tokens: usize,
    /// How long a step should take, if bounded.
    pub step_target: Option<Duration>,
    /// How long steps take, as fitted.
    pub cost: &'a CostModel,
    /// A tenant's virtual counter: the machine time its work took (its shares of steps, see
    /// [`CostModel::shares`]) over its weight.
    pub served: &'a dyn Fn(TenantId) -> f64,
}

/// A step being planned: what it holds and what it would do.
struct Step {
    plan: Vec<(usize, usize)>,
    work: Work,
}

impl Planner<'_> {
    /// Plans a step over `running` (every sequence in it has at least one position left).
    /// Returns (index into `running`, new tokens), each index at most once.
    pub fn plan(&self, running: &[SeqView]) -> Vec<(usize, usize)> {
        let mut per_owner: HashMap<TenantId, usize> = HashMap::new();
        for s in running {
            *per_owner.entry(s.owner).or_insert(0) += 1;
        }
        // Least served first; on a tie (a tenant just lifted to the others' counter), the tenant
        // with fewer sequences, then the lower id.
        let mut tenants: Vec<TenantId> = per_owner.keys().copied().collect();
        tenants.sort_by_key(|&o| (OrdF64((self.served)(o)), per_owner[&o], o));
        let Some(&lead) = tenants.first() else {
            return Vec::new();
        };
        let alone = tenants.len() == 1;
        // Each tenant's decodes, those that waited longest first; its prefills in order.
        let decodes_of = |o: TenantId| {
            let mut d: Vec<usize> = (0..running.len())
                .filter(|&i| running[i].owner == o && running[i].decodes())
                .collect();
            d.sort_by_key(|&i| (running[i].last, i));
            d
        };
        let prefills_of =
            |o: TenantId| (0..running.len()).filter(move |&i| running[i].owner == o && !running[i].decodes());
        let mut step = Step {
            plan: Vec::new(),
            work: Work::default(),
        };
        // The lead's decodes: all of them alone, else those that fit the target (one at least).
        for i in decodes_of(lead) {
            let with = step.work.plus(running[i].chunk(1));
            if with.tokens > self.max_batch_tokens || (!alone && !step.plan.is_empty() && !self.fits(with)) {
                break;
            }
            step.plan.push((i, 1));
            step.work = with;
        }
        // The lead's prefills, within the target, owed the floor.
        let mut floor = MIN_PREFILL_TOKENS;
        for i in prefills_of(lead) {
            let n = self.prefill_chunk(&running[i], step.work, floor, &|w| self.fits(w));
            if n == 0 {
                break;
            }
            step.plan.push((i, n));
            step.work = step.work.plus(running[i].chunk(n));
            floor = floor.saturating_sub(n);
        }
        if alone {
            return step.plan;
        }
        // The others' work, within twice the lead's.
        let bound = self.cost.predict(step.work).map(|t| t * 2);
        let within = |w: Work| {
            w.tokens <= self.max_batch_tokens
                && match (bound, self.cost.predict(w)) {
                    (Some(b), Some(t)) => t <= b,
                    _ => true,
                }
        };
        let others = &tenants[1..];
        for &o in others {
            for i in decodes_of(o) {
                let with = step.work.plus(running[i].chunk(1));
                if within(with) {
                    step.plan.push((i, 1));
                    step.work = with;
                }
            }
        }
        for &o in others {
            for i in prefills_of(o) {
                let n = self.prefill_chunk(&running[i], step.work, 0, &within);
                if n == 0 {
                    break;
                }
                step.plan.push((i, n));
                step.work = step.work.plus(running[i].chunk(n));
            }
        }
        step.plan
    }

    /// Whether a step doing `work` stays within the step's limits: `max_batch_tokens`, and the
    /// step target as the cost model predicts it (once it has seen enough steps).
    fn fits(&self, work: Work) -> bool {
        work.tokens <= self.max_batch_tokens
            && match (self.step_target, self.cost.predict(work)) {
                (Some(target), Some(took)) => took <= target,
                _ => true,
            }
    }

    /// The next prefill chunk of `s` beside `work`: the largest that `fits`, or `floor` tokens
    /// if that is more (within `max_batch_tokens` and what it has left).
    fn prefill_chunk(&self, s: &SeqView, work: Work, floor: usize, fits: &dyn Fn(Work) -> bool) -> usize {
        let most = (s.target - s.computed).min(self.max_batch_tokens.saturating_sub(work.tokens));
        let (mut lo, mut hi) = (0, most);
        // The cost only grows with the chunk: binary search for the last size that fits.
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if fits(work.plus(s.chunk(mid))) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo.max(floor.min(most))
    }
}

/// Which waiting request to admit next: of `waiting` (in arrival order, each its tenant, or
/// `None` when it is passed over this time), the one whose tenant has the lowest virtual
/// `counter` (what was served to it over its weight, as in "Fairness in Serving Large Language
/// Models", OSDI 2024), then the fewest `running` sequences, then the oldest.
pub fn next_to_admit(
    waiting: impl Iterator<Item = Option<TenantId>>,
    counter: &dyn Fn(TenantId) -> f64,
    running: &dyn Fn(TenantId) -> usize,
) -> Option<usize> {
    waiting
        .enumerate()
        .filter_map(|(i, o)| o.map(|o| (i, o)))
        .min_by_key(|&(i, o)| (OrdF64(counter(o)), running(o), i))
        .map(|(i, _)| i)
}

/// An `f64` ordered by `total_cmp`, for sort keys.
#[derive(PartialEq)]
pub(super) struct OrdF64(pub(super) f64);

impl Eq for OrdF64 {}

impl PartialOrd for OrdF64 {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for OrdF64 {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::tenant;
    use proptest::prelude::*;

    fn seq(owner: u64, computed: usize, target: usize) -> SeqView {
        SeqView {
            owner: tenant(owner),
            computed,
            target,
            samples: true,
            attention: if target - computed > 1 {
                Attention::Prompt
            } else {
                Attention::Output
            },
            last: 0,
        }
    }

    /// A cost model fitted to steps of `truth` (milliseconds for a step's work).
    fn fitted(truth: impl Fn(Work) -> f64) -> CostModel {
        let mut cost = CostModel::default();
        let mut x = 7u64;
        for _ in 0..super::super::cost::WINDOW {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let (pos, n) = ((x >> 33) as usize % 8000, 1 + (x >> 20) as usize % 64);
            // A prompt chunk (the last, or not) beside one to four decodes.
            let decodes = (0..1 + (x >> 50) as usize % 4).fold(Work::default(), |w, k| {
                w.plus(Work::chunk(pos / (k + 2), 1, Attention::Output, true))
            });
            let w = Work::chunk(pos, n, Attention::Prompt, x & 1 == 1).plus(decodes);
            cost.observe(w, Duration::from_secs_f64(truth(w) / 1e3));
        }
        cost
    }

    /// 5 ms a step, 0.05 ms a token, 0.25 µs a prompt token's attended position, 1 µs a
    /// position read, 0.1 ms a logit row: a small model whose long contexts cost more than its
    /// matmuls.
    fn small_model(w: Work) -> f64 {
        5.0 + 0.05 * w.tokens as f64
            + 0.00025 * w.prompt_attended as f64
            + 0.001 * w.read as f64
            + 0.1 * w.logits as f64
    }

    fn plan(running: &[SeqView], cap: usize, served: &dyn Fn(TenantId) -> f64) -> Vec<(usize, usize)> {
        let cost = CostModel::default();
        Planner {
            max_batch_tokens: cap,
            step_target: None,
            cost: &cost,
            served,
        }
        .plan(running)
    }

    #[test]
    fn decodes_first_then_prefill_chunks_within_the_budget() {
        let running = [seq(1, 10, 11), seq(1, 20, 21), seq(1, 0, 1000), seq(1, 30, 31)];
        let p = plan(&running, 64, &|_| 0.0);
        assert_eq!(p, vec![(0, 1), (1, 1), (3, 1), (2, 61)]);
    }

    #[test]
    fn the_least_served_tenants_prefill_goes_first() {
        let running = [seq(1, 0, 80), seq(2, 0, 80)];
        let served = |t: TenantId| if t == tenant(1) { 50.0 } else { 10.0 };
        assert_eq!(plan(&running, 100, &served), vec![(1, 80), (0, 20)]);
    }

    #[test]
    fn a_light_tenant_decodes_at_no_less_than_half_its_speed_beside_long_contexts() {
        let cost = fitted(small_model);
        // Tenant 1 decodes one sequence at position 700; tenant 2 sixteen at 4,000 and more.
        let mut running = vec![seq(1, 700, 701)];
        running.extend((0..16).map(|i| seq(2, 4000 + i, 4001 + i)));
        let plan_with = |served: &dyn Fn(TenantId) -> f64| {
            Planner {
                max_batch_tokens: 512,
                step_target: Some(Duration::from_millis(40)),
                cost: &cost,
                served,
            }
            .plan(&running)
        };
        let work = |p: &[(usize, usize)]| p.iter().fold(Work::default(), |w, &(i, n)| w.plus(running[i].chunk(n)));
        let alone = cost.predict(running[0].chunk(1)).unwrap();
        // Leading (the counters tie, and it runs fewer sequences): its step takes at most twice
        // its own decode, and the other tenant's decodes join as far as that allows.
        let p = plan_with(&|_| 0.0);
        assert_eq!(p[0], (0, 1), "{p:?}");
        assert!(p.len() > 1, "{p:?}");
        let took = cost.predict(work(&p)).unwrap();
        assert!(took <= alone * 2, "{took:?} for a {alone:?} decode: {p:?}");
        // Led by the other tenant (tenant 1 the more served), whose decodes fill the target:
        // tenant 1's decode still joins.
        let p = plan_with(&|t| if t == tenant(1) { 100.0 } else { 0.0 });
        assert!(p.contains(&(0, 1)), "{p:?}");
        assert!((2..8).all(|k| p.iter().any(|&(i, _)| i == k)), "{p:?}");
    }

    #[test]
    fn a_tenants_decodes_take_turns_when_not_all_fit() {
        let cost = fitted(small_model);
        // Tenant 1 leads every step (the counters tie, and it runs fewer sequences); about four
        // of tenant 2's sixteen fit beside it.
        let mut running = vec![seq(1, 10, 11)];
        running.extend((0..16).map(|i| seq(2, 1000 + i, 1001 + i)));
        let mut served_steps = vec![0u64; running.len()];
        for step in 1..=40u64 {
            let p = Planner {
                max_batch_tokens: 512,
                step_target: Some(Duration::from_millis(40)),
                cost: &cost,
                served: &|_| 0.0,
            }
            .plan(&running);
            for &(i, _) in &p {
                running[i].last = step;
                served_steps[i] += 1;
            }
        }
        // Every one of tenant 2's streams moved, none far more than another.
        assert_eq!(served_steps[0], 40);
        let twos = &served_steps[1..];
        let (lo, hi) = (*twos.iter().min().unwrap(), *twos.iter().max().unwrap());
        assert!(lo > 0 && hi - lo <= 1 && hi < 40, "{served_steps:?}");
    }

    #[test]
    fn a_first_token_step_when_others_decodes_would_not_fit_beside_it() {
        // Tenant 2 (least served) waits for its first token; tenant 1 has 60 streams decoding.
        let mut running: Vec<SeqView> = (0..60).map(|i| seq(1, 100 + i, 101 + i)).collect();
        running.push(seq(2, 0, 200));
        let served = |t: TenantId| if t == tenant(1) { 500.0 } else { 0.0 };
        assert_eq!(plan(&running, 64, &served), vec![(60, 64)], "its prefill alone");
        // Once it is the more served, the decodes go first again.
        let served = |t: TenantId| if t == tenant(1) { 0.0 } else { 500.0 };
        let p = plan(&running, 64, &served);
        assert_eq!(p.len(), 61);
        assert_eq!(p[60], (60, 4));
    }

    #[test]
    fn a_slow_step_still_carries_the_prefill_floor() {
        // Every step took a second: nothing fits a 1 ms target, yet prefills move.
        let mut cost = CostModel::default();
        for i in 0..16 {
            cost.observe(Work::chunk(0, 8 + i, Attention::Prompt, true), Duration::from_secs(1));
        }
        let running = [seq(1, 5, 6), seq(1, 0, 500)];
        let p = Planner {
            max_batch_tokens: 512,
            step_target: Some(Duration::from_millis(1)),
            cost: &cost,
            served: &|_| 0.0,
        }
        .plan(&running);
        assert_eq!(p, vec![(0, 1), (1, MIN_PREFILL_TOKENS)]);
    }

    #[test]
    fn a_prefill_nodes_half_never_counts_as_a_decode() {
        // One position left before its transfer: a prefill chunk, not a decode.
        let half = SeqView {
            samples: false,
            ..seq(1, 9, 10)
        };
        assert_eq!(plan(&[half], 64, &|_| 0.0), vec![(0, 1)]);
        assert!(!half.decodes());
        assert_eq!(half.chunk(1).logits, 0, "no logits for a position that is not sampled");
    }

    #[test]
    fn admission_takes_the_least_served_then_the_least_running_then_the_oldest() {
        let counters = |t: TenantId| [0.0, 30.0, 10.0, 10.0][(t.get() - 1) as usize];
        let running = |t: TenantId| if t == tenant(3) { 2 } else { 0 };
        let w = |v: &[Option<u64>]| v.iter().map(|o| o.map(tenant)).collect::<Vec<_>>();
        // Tenant 1 is the least served.
        let q = w(&[Some(2), Some(3), Some(1), Some(1)]);
        assert_eq!(next_to_admit(q.into_iter(), &counters, &running), Some(2));
        // Tenants 3 and 4 tie on their counters; 4 runs less.
        let q = w(&[Some(2), Some(3), Some(4)]);
        assert_eq!(next_to_admit(q.into_iter(), &counters, &running), Some(2));
        // Passed over: the next best; nothing left: none.
        let q = w(&[Some(2), None]);
        assert_eq!(next_to_admit(q.into_iter(), &counters, &running), Some(0));
        assert_eq!(next_to_admit(w(&[None]).into_iter(), &counters, &running), None);
    }

    proptest! {
        /// Over random running sets and counters: the step stays within its budget, touches each
        /// sequence at most once and never past what it has left, always does something, and
        /// the strictly least served tenant computes in it whenever the decodes fit.
        #[test]
        fn plans_stay_in_budget_make_progress_and_serve_the_least_served(
            seqs in prop::collection::vec((1u64..5, 0usize..300, 1usize..300, any::<bool>(), prop::bool::weighted(0.6)), 1..24),
            counters in prop::collection::vec(0u32..1000, 4),
            cap in 1usize..600,
        ) {
            let running: Vec<SeqView> = seqs
                .iter()
                .map(|&(o, computed, left, samples, decoding)| SeqView {
                    owner: tenant(o),
                    computed,
                    target: computed + if decoding { 1 } else { left },
                    samples,
                    attention: if decoding { Attention::Output } else { Attention::Prompt },
                    last: 0,
                })
                .collect();
            let served = |t: TenantId| f64::from(counters[(t.get() - 1) as usize]);
            let p = plan(&running, cap, &served);
            prop_assert!(!p.is_empty(), "a step always does something");
            prop_assert!(p.iter().map(|&(_, n)| n).sum::<usize>() <= cap);
            let mut seen = std::collections::HashSet::new();
            for &(i, n) in &p {
                prop_assert!(seen.insert(i), "sequence {i} twice");
                prop_assert!(n >= 1 && n <= running[i].target - running[i].computed);
            }
            let owners: std::collections::BTreeSet<TenantId> = running.iter().map(|s| s.owner).collect();
            let low = owners.iter().map(|&o| served(o)).fold(f64::INFINITY, f64::min);
            let lowest: Vec<TenantId> = owners.iter().copied().filter(|&o| served(o) == low).collect();
            let decodes = running.iter().filter(|s| s.decodes()).count();
            if let [least] = lowest[..]
                && decodes <= cap
            {
                prop_assert!(
                    p.iter().any(|&(i, _)| running[i].owner == least),
                    "the least served tenant {least} got nothing: {p:?}"
                );
            }
        }
    }
}
