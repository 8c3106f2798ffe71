//! Per-tenant usage: requests, tokens, rejections by reason and plugin fuel, in memory and in
//! sled.
//!
//! Counters change in memory under one lock; [`UsageBook::flush`] writes the tenants that changed
//! and flushes sled to disk. The server calls it every [`FLUSH_EVERY`] (and at shutdown), so a
//! crash — `kill -9` included — loses at most that much, documented as a loss window of at most
//! 1 s. The day and month token counts that quotas read are UTC calendar periods.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::store::{Store, StoreError};
use crate::tenant::TenantId;

/// How often changed counters reach the disk.
pub const FLUSH_EVERY: Duration = Duration::from_millis(500);

/// Tokens in one calendar period.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Period {
    /// The period: `2026-12-04` or `2026-12`.
    pub period: String,
    /// Prompt plus completion tokens in it.
    pub tokens: u64,
}

/// One tenant's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantUsage {
    /// The tenant's name.
    pub tenant: String,
    /// Requests served (admitted and ended, however they ended).
    pub requests: u64,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Completion tokens.
    pub completion_tokens: u64,
    /// Prompt tokens the prefix cache served.
    pub cached_tokens: u64,
    /// Requests refused, by error code.
    pub rejections: BTreeMap<String, u64>,
    /// Fuel its plugins burned.
    pub plugin_fuel: u64,
    /// Tokens this UTC day.
    pub day: Period,
    /// Tokens this UTC month.
    pub month: Period,
}

/// What one request used.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Used {
    /// Prompt tokens (once per request, whatever `n`).
    pub prompt_tokens: u64,
    /// Completion tokens of all its choices.
    pub completion_tokens: u64,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u64,
    /// Fuel its plugin burned.
    pub plugin_fuel: u64,
}

impl Used {
    /// Tokens that count against quotas.
    pub fn tokens(&self) -> u64 {
        self.prompt_tokens + self.completion_tokens
    }
}

/// The book.
pub struct UsageBook {
    tree: sled::Tree,
    store: Store,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    by_tenant: HashMap<TenantId, TenantUsage>,
    dirty: HashSet<TenantId>,
    /// Deleted tenants (ids are never reused): a request of theirs still in flight books nothing.
    forgotten: HashSet<TenantId>,
}

/// The UTC day and month of `t`, and the seconds left in each.
pub fn periods(t: SystemTime) -> (String, String, u64, u64) {
    let secs = t.duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0) as i64;
    let days = secs.div_euclid(86_400);
    let (y, m, d) = crate::log::civil_from_days(days);
    let day_left = (days + 1) * 86_400 - secs;
    // The first day of next month.
    let (ny, nm) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
    let mut next = days + 1;
    while crate::log::civil_from_days(next) != (ny, nm, 1) {
        next += 1;
    }
    let month_left = next * 86_400 - secs;
    (
        format!("{y:04}-{m:02}-{d:02}"),
        format!("{y:04}-{m:02}"),
        day_left as u64,
        month_left as u64,
    )
}

impl UsageBook {
    /// The book in `store`, with every tenant's persisted counters.
    pub fn open(store: &Store) -> Result<Self, StoreError> {
        let tree = store.tree("usage")?;
        let mut inner = Inner::default();
        for kv in tree.iter() {
            let (k, v) = kv?;
            let id = <[u8; 8]>::try_from(k.as_ref())
                .ok()
                .map(u64::from_be_bytes)
                .and_then(TenantId::new)
                .ok_or_else(|| StoreError::Corrupt("usage key".into()))?;
            let u: TenantUsage =
                serde_json::from_slice(&v).map_err(|_| StoreError::Corrupt(format!("usage of tenant {id}")))?;
            inner.by_tenant.insert(id, u);
        }
        Ok(Self {
            tree,
            store: store.clone(),
            inner: Mutex::new(inner),
        })
    }

    fn with(&self, id: TenantId, name: &str, f: impl FnOnce(&mut TenantUsage)) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if inner.forgotten.contains(&id) {
            return;
        }
        inner.dirty.insert(id);
        let u = inner.by_tenant.entry(id).or_default();
        if u.tenant.is_empty() {
            u.tenant = name.to_string();
        }
        f(u)
    }

    /// Records a request that ended, with what it used.
    pub fn record(&self, id: TenantId, name: &str, used: Used) {
        let (day, month, _, _) = periods(SystemTime::now());
        self.with(id, name, |u| {
            u.requests += 1;
            u.prompt_tokens += used.prompt_tokens;
            u.completion_tokens += used.completion_tokens;
            u.cached_tokens += used.cached_tokens;
            u.plugin_fuel += used.plugin_fuel;
            for (p, key) in [(&mut u.day, day), (&mut u.month, month)] {
                if p.period != key {
                    *p = Period { period: key, tokens: 0 };
                }
                p.tokens += used.tokens();
            }
        });
    }

    /// Records a refused request.
    pub fn reject(&self, id: TenantId, name: &str, code: &str) {
        self.with(id, name, |u| *u.rejections.entry(code.to_string()).or_insert(0) += 1);
    }

    /// Tokens tenant `id` used this UTC day and this UTC month.
    pub fn period_tokens(&self, id: TenantId, now: SystemTime) -> (u64, u64) {
        let (day, month, _, _) = periods(now);
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.by_tenant.get(&id).map_or((0, 0), |u| {
            (
                if u.day.period == day { u.day.tokens } else { 0 },
                if u.month.period == month { u.month.tokens } else { 0 },
            )
        })
    }

    /// One tenant's counters.
    pub fn of(&self, id: TenantId, name: &str) -> TenantUsage {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let mut u = inner.by_tenant.get(&id).cloned().unwrap_or_default();
        u.tenant = name.to_string();
        u
    }

    /// Every tenant's counters, by tenant name.
    pub fn all(&self) -> BTreeMap<String, TenantUsage> {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner
            .by_tenant
            .values()
            .map(|u| (u.tenant.clone(), u.clone()))
            .collect()
    }

    /// Forgets a deleted tenant's counters.
    pub fn forget(&self, id: TenantId) -> Result<(), StoreError> {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.by_tenant.remove(&id);
        inner.dirty.remove(&id);
        inner.forgotten.insert(id);
        // Under the lock, so a flush cannot write the entry back.
        self.tree.remove(id.get().to_be_bytes())?;
        Ok(())
    }

    /// Writes the counters that changed and flushes them to disk.
    pub fn flush(&self) -> Result<(), StoreError> {
        {
            // The batch is applied under the lock (sled applies it in memory; the disk write
            // below is outside), so a tenant forgotten meanwhile is not written back.
            let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            let dirty: Vec<TenantId> = inner.dirty.drain().collect();
            let mut batch = sled::Batch::default();
            for id in dirty {
                if let Some(u) = inner.by_tenant.get(&id) {
                    let v = serde_json::to_vec(u).map_err(|e| StoreError::Corrupt(e.to_string()))?;
                    batch.insert(&id.get().to_be_bytes(), v);
                }
            }
            self.tree.apply_batch(batch)?;
        }
        self.store.flush()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::tenant;

    #[test]
    fn counters_persist_and_a_forgotten_tenant_books_nothing_more() {
        let dir = std::env::temp_dir().join(format!("warden-usage-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let used = Used {
            prompt_tokens: 10,
            completion_tokens: 5,
            cached_tokens: 8,
            plugin_fuel: 7,
        };
        {
            let store = Store::open(&dir).unwrap();
            let book = UsageBook::open(&store).unwrap();
            book.record(tenant(1), "a", used);
            book.record(tenant(2), "b", used);
            book.reject(tenant(1), "a", "rate_limit_requests");
            book.flush().unwrap();
            book.forget(tenant(2)).unwrap();
            book.record(tenant(2), "b", used);
            book.flush().unwrap();
            assert_eq!(book.period_tokens(tenant(1), SystemTime::now()), (15, 15));
        }
        let store = crate::testutil::reopen_store(&dir);
        let book = UsageBook::open(&store).unwrap();
        let a = book.of(tenant(1), "a");
        assert_eq!(
            (a.requests, a.prompt_tokens, a.cached_tokens, a.plugin_fuel),
            (1, 10, 8, 7)
        );
        assert_eq!(a.rejections["rate_limit_requests"], 1);
        assert_eq!(
            book.all().keys().collect::<Vec<_>>(),
            ["a"],
            "the forgotten tenant stays gone"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn calendar_periods_in_utc() {
        // 2026-12-04T15:00:00Z
        let t = UNIX_EPOCH + Duration::from_secs(1_796_396_400);
        let (d, m, dl, ml) = periods(t);
        assert_eq!((d.as_str(), m.as_str()), ("2026-12-04", "2026-12"));
        assert_eq!(dl, 9 * 3600);
        assert_eq!(ml, 27 * 86_400 + 9 * 3600);
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29T00:00:00Z
        assert_eq!(periods(leap).0, "2000-02-29");
    }
}
