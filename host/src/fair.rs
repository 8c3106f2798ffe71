//! Capacity every tenant shares, taken fairly (invariant 8): [`Turns`], a fixed number of turns
//! at some costly work (compiling a schema, a plugin, a snapshot) that tenants take in turn,
//! and [`FairCache`], a bounded cache whose eviction falls on the tenant that holds the most.
//!
//! Neither is first come, first served. A tenant that asks for many turns at once waits behind
//! its own requests, not in front of other tenants': a free turn goes to the waiting tenant that
//! holds the fewest, then to the one served longest ago, and no tenant holds more than its cap
//! at once. A tenant that fills the cache evicts its own entries, never another's, while it
//! holds more than they do.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

use crate::tenant::TenantId;

/// A fixed number of turns at some work, shared fairly across tenants.
///
/// - At most `capacity` turns are held at once, and at most `per_tenant` by one tenant.
/// - A tenant's requests are granted in the order it made them.
/// - When a turn frees up, it goes to the tenant with waiters that holds the fewest turns (under
///   its cap), then to the one granted a turn longest ago: every tenant with waiters gets one
///   before any gets a second.
/// - A request given up before its turn came (its future dropped) is skipped; a turn is given
///   back when its [`Turn`] drops.
#[derive(Clone)]
pub struct Turns {
    state: Arc<Mutex<State>>,
}

struct State {
    capacity: usize,
    per_tenant: usize,
    free: usize,
    held: HashMap<TenantId, usize>,
    waiting: HashMap<TenantId, VecDeque<oneshot::Sender<Turn>>>,
    /// When each tenant was last granted a turn (a counter, not a clock).
    last: HashMap<TenantId, u64>,
    clock: u64,
}

/// A held turn; dropping it gives the turn back (to the next tenant in line).
#[must_use = "the turn is given back when this is dropped"]
pub struct Turn {
    state: Arc<Mutex<State>>,
    tenant: TenantId,
    /// False for a turn that never reached its holder (its `Drop` does nothing).
    armed: bool,
}

impl Turn {
    /// The tenant holding it.
    pub fn tenant(&self) -> TenantId {
        self.tenant
    }
}

impl std::fmt::Debug for Turn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Turn").field("tenant", &self.tenant).finish()
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mut s = lock(&self.state);
        if let Some(h) = s.held.get_mut(&self.tenant) {
            *h -= 1;
            if *h == 0 {
                s.held.remove(&self.tenant);
            }
        }
        s.free += 1;
        s.grant(&self.state);
    }
}

fn lock(state: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|p| p.into_inner())
}

impl State {
    fn held(&self, t: TenantId) -> usize {
        self.held.get(&t).copied().unwrap_or(0)
    }

    /// Records a grant to `t`.
    fn take(&mut self, t: TenantId) {
        self.free -= 1;
        *self.held.entry(t).or_insert(0) += 1;
        self.clock += 1;
        self.last.insert(t, self.clock);
    }

    /// Gives free turns to waiters, fairly, while there are both.
    fn grant(&mut self, me: &Arc<Mutex<State>>) {
        while self.free > 0 {
            let next = self
                .waiting
                .keys()
                .copied()
                .filter(|&t| self.held(t) < self.per_tenant)
                .min_by_key(|&t| (self.held(t), self.last.get(&t).copied().unwrap_or(0), t));
            let Some(t) = next else { return };
            let Some(queue) = self.waiting.get_mut(&t) else { return };
            let Some(tx) = queue.pop_front() else {
                self.waiting.remove(&t);
                continue;
            };
            if queue.is_empty() {
                self.waiting.remove(&t);
            }
            self.take(t);
            let turn = Turn {
                state: me.clone(),
                tenant: t,
                armed: true,
            };
            if let Err(mut unclaimed) = tx.send(turn) {
                // Its waiter gave up: the turn was never held. Undo the grant here (dropping it
                // armed would lock the state again).
                unclaimed.armed = false;
                self.free += 1;
                if let Some(h) = self.held.get_mut(&t) {
                    *h -= 1;
                    if *h == 0 {
                        self.held.remove(&t);
                    }
                }
            }
        }
    }
}

impl Turns {
    /// `capacity` turns (at least 1), at most `per_tenant` (at least 1) held by one tenant.
    pub fn new(capacity: usize, per_tenant: usize) -> Self {
        let capacity = capacity.max(1);
        Self {
            state: Arc::new(Mutex::new(State {
                capacity,
                per_tenant: per_tenant.clamp(1, capacity),
                free: capacity,
                held: HashMap::new(),
                waiting: HashMap::new(),
                last: HashMap::new(),
                clock: 0,
            })),
        }
    }

    /// A turn for `tenant`, once its turn comes (see [`Turns`] for the order).
    pub async fn take(&self, tenant: TenantId) -> Turn {
        let rx = {
            let mut s = lock(&self.state);
            if s.free > 0 && s.held(tenant) < s.per_tenant && !s.waiting.contains_key(&tenant) {
                s.take(tenant);
                return Turn {
                    state: self.state.clone(),
                    tenant,
                    armed: true,
                };
            }
            let (tx, rx) = oneshot::channel();
            s.waiting.entry(tenant).or_default().push_back(tx);
            rx
        };
        match rx.await {
            Ok(turn) => turn,
            // The state drops a sender only by sending on it.
            Err(_) => unreachable!("a waiter's sender is dropped only after sending"),
        }
    }

    /// Requests `tenant` has waiting for a turn.
    pub fn waiting(&self, tenant: TenantId) -> usize {
        lock(&self.state)
            .waiting
            .get(&tenant)
            .map_or(0, |q| q.iter().filter(|tx| !tx.is_closed()).count())
    }

    /// Turns `tenant` holds now.
    pub fn held(&self, tenant: TenantId) -> usize {
        lock(&self.state).held(tenant)
    }

    /// Turns in all.
    pub fn capacity(&self) -> usize {
        lock(&self.state).capacity
    }
}

/// A cache of values per tenant within a total weight (bytes, or entries), whose eviction is
/// fair: when an entry does not fit, the least recently used entry of the tenant holding the
/// most weight goes first, so one tenant filling the cache evicts its own entries before
/// anyone else's.
pub struct FairCache<K, V> {
    budget: usize,
    used: usize,
    clock: u64,
    entries: HashMap<(TenantId, K), Entry<V>>,
    per_tenant: HashMap<TenantId, usize>,
}

struct Entry<V> {
    value: V,
    weight: usize,
    used: u64,
}

impl<K: Eq + Hash + Clone, V: Clone> FairCache<K, V> {
    /// A cache holding at most `budget` weight in all.
    pub fn new(budget: usize) -> Self {
        Self {
            budget,
            used: 0,
            clock: 0,
            entries: HashMap::new(),
            per_tenant: HashMap::new(),
        }
    }

    /// `tenant`'s value under `key`, marked as used now.
    pub fn get(&mut self, tenant: TenantId, key: &K) -> Option<V> {
        self.clock += 1;
        let now = self.clock;
        let e = self.entries.get_mut(&(tenant, key.clone()))?;
        e.used = now;
        Some(e.value.clone())
    }

    /// Keeps `value` (of `weight`) for `tenant` under `key`, evicting as [`FairCache`] says; a
    /// value heavier than the whole budget is not kept.
    pub fn insert(&mut self, tenant: TenantId, key: K, value: V, weight: usize) {
        self.remove(tenant, &key);
        if weight > self.budget {
            return;
        }
        while self.used + weight > self.budget {
            // The heaviest tenant, counting the new entry as already its own.
            let Some(victim) = self
                .per_tenant
                .iter()
                .map(|(&t, &w)| (t, if t == tenant { w + weight } else { w }))
                .max_by_key(|&(t, w)| (w, t))
                .map(|(t, _)| t)
            else {
                break;
            };
            let Some(oldest) = self
                .entries
                .iter()
                .filter(|((t, _), _)| *t == victim)
                .min_by_key(|(_, e)| e.used)
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            self.remove(oldest.0, &oldest.1);
        }
        self.clock += 1;
        self.used += weight;
        *self.per_tenant.entry(tenant).or_insert(0) += weight;
        self.entries.insert(
            (tenant, key),
            Entry {
                value,
                weight,
                used: self.clock,
            },
        );
    }

    /// Drops `tenant`'s value under `key`, if any.
    pub fn remove(&mut self, tenant: TenantId, key: &K) -> Option<V> {
        let e = self.entries.remove(&(tenant, key.clone()))?;
        self.used -= e.weight;
        if let Some(w) = self.per_tenant.get_mut(&tenant) {
            *w -= e.weight;
            if *w == 0 {
                self.per_tenant.remove(&tenant);
            }
        }
        Some(e.value)
    }

    /// Drops everything of `tenant`'s.
    pub fn forget(&mut self, tenant: TenantId) {
        let keys: Vec<K> = self
            .entries
            .keys()
            .filter(|(t, _)| *t == tenant)
            .map(|(_, k)| k.clone())
            .collect();
        for k in keys {
            self.remove(tenant, &k);
        }
    }

    /// Weight `tenant` holds.
    pub fn weight_of(&self, tenant: TenantId) -> usize {
        self.per_tenant.get(&tenant).copied().unwrap_or(0)
    }

    /// Weight held in all.
    pub fn used(&self) -> usize {
        self.used
    }

    /// Entries in all.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn t(n: u64) -> TenantId {
        crate::testutil::tenant(n)
    }

    #[tokio::test]
    async fn a_tenant_with_many_waiting_does_not_go_before_another() {
        let turns = Turns::new(1, 1);
        let first = turns.take(t(1)).await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        // Tenant 1 queues five more, then tenant 2 one.
        for (i, who) in [1, 1, 1, 1, 1, 2].into_iter().enumerate() {
            let (turns, order) = (turns.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let turn = turns.take(t(who)).await;
                order.lock().unwrap().push((who, i));
                tokio::time::sleep(Duration::from_millis(2)).await;
                drop(turn);
            }));
            tokio::task::yield_now().await;
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(turns.waiting(t(1)), 5);
        drop(first);
        for task in tasks {
            task.await.unwrap();
        }
        let order = order.lock().unwrap().clone();
        // Tenant 1 held the turn when all of them asked: the next went to tenant 2, which had
        // none, not to tenant 1's five waiting before it.
        assert_eq!(order[0], (2, 5), "{order:?}");
        // Tenant 1's own requests kept their order.
        let own: Vec<usize> = order.iter().filter(|(w, _)| *w == 1).map(|&(_, i)| i).collect();
        assert_eq!(own, vec![0, 1, 2, 3, 4], "{order:?}");
        assert_eq!(turns.held(t(1)) + turns.held(t(2)), 0);
    }

    #[tokio::test]
    async fn a_tenant_holds_at_most_its_cap_and_given_up_requests_are_skipped() {
        let turns = Turns::new(3, 1);
        let a = turns.take(t(1)).await;
        // Tenant 1's second request waits though two turns are free...
        let waiter = {
            let turns = turns.clone();
            tokio::spawn(async move { turns.take(t(1)).await })
        };
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert_eq!(turns.held(t(1)), 1);
        assert_eq!(turns.waiting(t(1)), 1);
        // ...while another tenant takes one at once.
        let b = turns.take(t(2)).await;
        // A request given up before its turn is skipped, and holds nothing.
        waiter.abort();
        let _ = waiter.await;
        drop(a);
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert_eq!(turns.held(t(1)), 0);
        assert_eq!(turns.waiting(t(1)), 0);
        drop(b);
        // All three are free again.
        let all = [turns.take(t(1)).await, turns.take(t(2)).await, turns.take(t(3)).await];
        assert_eq!(all.len(), 3);
    }

    #[test]
    fn a_tenant_filling_the_cache_evicts_its_own_entries() {
        let mut c: FairCache<u32, u32> = FairCache::new(10);
        c.insert(t(2), 0, 100, 2);
        c.insert(t(3), 0, 300, 2);
        for k in 0..50 {
            c.insert(t(1), k, k, 1);
        }
        assert!(c.used() <= 10);
        assert_eq!(c.get(t(2), &0), Some(100));
        assert_eq!(c.get(t(3), &0), Some(300));
        // Tenant 1 keeps its most recent entries.
        assert_eq!(c.weight_of(t(1)), 6);
        assert_eq!(c.get(t(1), &49), Some(49));
        assert_eq!(c.get(t(1), &0), None);
        // A heavier newcomer evicts the heaviest tenant's least recently used entries.
        c.get(t(1), &44);
        c.insert(t(4), 0, 400, 4);
        assert_eq!(c.get(t(1), &44), Some(44));
        assert_eq!(c.get(t(2), &0), Some(100));
        assert!(c.used() <= 10);
        // Too heavy for the whole budget: not kept.
        c.insert(t(5), 0, 500, 11);
        assert_eq!(c.get(t(5), &0), None);
        c.forget(t(1));
        assert_eq!(c.weight_of(t(1)), 0);
    }
}
