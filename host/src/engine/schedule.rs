//! Step planning, apart from the model and the pool: given what each running sequence has left
//! to compute, its tenant's virtual counter and the step's limits, which sequences compute how
//! many tokens in the next step. Pure, so fairness and chunking are tested here without a model.
//!
//! Normally (as Sarathi-Serve) a step is one token for every decoding sequence, then prefill
//! chunks, the least served tenant's first (then in admission order), while the step fits its
//! limits ([`Planner::max_batch_tokens`], and the step target as the cost model predicts it),
//! and at least [`MIN_PREFILL_TOKENS`] so decodes never stall prefills entirely.
//!
//! A first-token step: when the least served tenant has nothing decoding (its requests are all
//! waiting for their first token) and the other tenants' decodes do not fit in the step beside
//! its prefill, the step is its prefill alone, and the decodes wait one step. Its time to first
//! token is then the step in flight plus its own prefill, as on an idle engine, however many
//! streams others keep open. Serving it raises its counter above theirs, so the next step is
//! theirs: a tenant's decodes wait only while the VTC lets less served tenants catch up.

use std::collections::HashMap;
use std::time::Duration;

use super::cost::{CostModel, Work};
use crate::tenant::TenantId;

/// Prefill tokens a step carries even when its decodes take the whole budget.
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
}

impl SeqView {
    /// One token left, ending in a sample: a decode.
    fn decodes(&self) -> bool {
        self.samples && self.target - self.computed == 1
    }

    /// The work of its next `n` tokens.
    fn chunk(&self, n: usize) -> Work {
        Work::chunk(self.computed, n, self.samples && self.computed + n == self.target)
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
    /// A tenant's virtual counter: tokens computed for it over its weight.
    pub served: &'a dyn Fn(TenantId) -> f64,
}

impl Planner<'_> {
    /// Plans a step over `running` (every sequence in it has at least one position left).
    /// Returns (index into `running`, new tokens), each index at most once.
    pub fn plan(&self, running: &[SeqView]) -> Vec<(usize, usize)> {
        let mut per_owner: HashMap<TenantId, usize> = HashMap::new();
        for s in running {
            *per_owner.entry(s.owner).or_insert(0) += 1;
        }
        let tenant_key = |o: TenantId| (OrdF64((self.served)(o)), per_owner[&o]);
        let (decodes, mut prefills): (Vec<usize>, Vec<usize>) = (0..running.len()).partition(|&i| running[i].decodes());
        // Least served first; on a tie (a tenant just lifted to the others' counter), the tenant
        // with fewer sequences.
        prefills.sort_by_key(|&i| (tenant_key(running[i].owner), i));
        let cap = self.max_batch_tokens;
        let mut plan = Vec::new();
        let mut work = Work::default();
        let lead = prefills.first().map(|&i| running[i].owner);
        let first_token = lead.filter(|&l| decodes.iter().all(|&i| tenant_key(l) < tenant_key(running[i].owner)));
        // Prefill tokens the step still owes the floor.
        let mut floor = MIN_PREFILL_TOKENS;
        if let Some(lead) = first_token {
            let own = prefills.iter().copied().filter(|&i| running[i].owner == lead);
            self.add_prefills(running, own, &mut plan, &mut work, &mut floor);
            let with_decodes = decodes.iter().fold(work, |w, &i| w.plus(running[i].chunk(1)));
            if !decodes.is_empty() && !self.fits(with_decodes) {
                return plan;
            }
            prefills.retain(|&i| running[i].owner != lead);
        }
        for &i in decodes.iter().take(cap - work.tokens) {
            plan.push((i, 1));
            work = work.plus(running[i].chunk(1));
        }
        self.add_prefills(running, prefills, &mut plan, &mut work, &mut floor);
        plan
    }

    /// Adds the prefill chunks of `order`'s sequences to `plan` while they fit beside `work`,
    /// until one gets nothing; each counts against the `floor` the step still owes.
    fn add_prefills(
        &self,
        running: &[SeqView],
        order: impl IntoIterator<Item = usize>,
        plan: &mut Vec<(usize, usize)>,
        work: &mut Work,
        floor: &mut usize,
    ) {
        for i in order {
            let n = self.prefill_chunk(&running[i], *work, *floor);
            if n == 0 {
                break;
            }
            plan.push((i, n));
            *work = work.plus(running[i].chunk(n));
            *floor = floor.saturating_sub(n);
        }
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

    /// The next prefill chunk of `s` beside `work`: the largest that fits, or `floor` tokens if
    /// that is more (within `max_batch_tokens` and what it has left).
    fn prefill_chunk(&self, s: &SeqView, work: Work, floor: usize) -> usize {
        let most = (s.target - s.computed).min(self.max_batch_tokens - work.tokens);
        let (mut lo, mut hi) = (0, most);
        // The cost only grows with the chunk: binary search for the last size that fits.
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if self.fits(work.plus(s.chunk(mid))) {
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
/// `counter` (tokens computed for it over its weight, as in "Fairness in Serving Large Language
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
        }
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
            cost.observe(Work::chunk(0, 8 + i, true), Duration::from_secs(1));
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
