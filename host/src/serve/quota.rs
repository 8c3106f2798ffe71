//! Enforcing tenants' policies, each limit before the work it limits.
//!
//! * Static limits (allowed models and plugins, `max_tokens`, context) are refused with 400 or
//!   403 and a code naming the limit.
//! * Requests per minute and concurrent requests are checked when a request arrives, before its
//!   plugin runs or its prompt is tokenized ([`Quotas::admit`]): one GCRA limiter per tenant, and
//!   a count of requests in flight.
//! * Tokens are checked once the prompt is known, before anything is queued
//!   ([`Grant::reserve`]): the request reserves its prompt plus `max_tokens` for each choice
//!   against the tenant's tokens per minute, day and month; when it ends, what it did not use
//!   goes back and what it used is recorded ([`UsageBook`]).
//! * Rates and usage are refused with 429 and `Retry-After`.
//!
//! Policies are swapped whole ([`Quotas::reload`]): a request reads one set and keeps it.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime};

use super::store::Tenant;
use super::usage::{UsageBook, Used, periods};
use crate::engine::request::Usage;
use crate::policy::rate::{Denied, Gcra};
use crate::policy::{Bounds, Policy, PolicyError, PolicySet};
use crate::runner::UsageMeter;
use crate::tenant::TenantId;

/// A tenant's live limiters.
#[derive(Default)]
struct Live {
    /// Requests per minute: the limit it was built for, and the limiter.
    rpm: Option<(u64, Gcra)>,
    /// Tokens per minute.
    tpm: Option<(u64, Gcra)>,
    /// Requests in flight.
    in_flight: u64,
    /// Tokens reserved by requests in flight (not yet in the usage book).
    reserved: u64,
}

/// A tenant's per-minute limits as they stand ([`Quotas::rates`]); `None` where its policy sets
/// none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rates {
    /// Requests per minute.
    pub requests: Option<RateWindow>,
    /// Tokens per minute.
    pub tokens: Option<RateWindow>,
}

/// One per-minute limit as it stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateWindow {
    /// Its limit per minute.
    pub limit: u64,
    /// What could be taken now.
    pub remaining: u64,
    /// Until every unit taken is back.
    pub reset: Duration,
}

/// A tenant's limits and what is left of each ([`Quotas::standing`]).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Standing {
    /// Requests per minute.
    pub requests_per_minute: Option<MinuteLeft>,
    /// Tokens per minute.
    pub tokens_per_minute: Option<MinuteLeft>,
    /// Tokens this UTC day.
    pub tokens_per_day: Option<QuotaLeft>,
    /// Tokens this UTC month.
    pub tokens_per_month: Option<QuotaLeft>,
    /// Sequences in flight (each choice of a request is one).
    pub concurrent_requests: Option<InFlight>,
}

/// A per-minute limit as it stands.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MinuteLeft {
    /// Per minute.
    pub limit: u64,
    /// What could be taken now.
    pub remaining: u64,
    /// Seconds until every unit taken is back.
    pub reset_s: f64,
}

/// A day's or month's token quota as it stands.
#[derive(Debug, Clone, serde::Serialize)]
pub struct QuotaLeft {
    /// The quota.
    pub limit: u64,
    /// Used in the period.
    pub used: u64,
    /// Reserved by requests in flight.
    pub reserved: u64,
    /// What a new request could still reserve.
    pub remaining: u64,
}

/// The concurrency limit as it stands.
#[derive(Debug, Clone, serde::Serialize)]
pub struct InFlight {
    /// The limit.
    pub limit: u64,
    /// Sequences in flight now.
    pub in_flight: u64,
}

/// Limiter for `limit` per minute, rebuilt if the limit changed.
fn limiter(slot: &mut Option<(u64, Gcra)>, limit: Option<u64>, now: Instant) -> Option<&mut Gcra> {
    match limit {
        None => {
            *slot = None;
            None
        }
        Some(l) => {
            match slot {
                Some((had, g)) if *had != l => {
                    // A new limit keeps what was taken: a reload hands out no fresh burst.
                    *g = g.with_limit(l);
                    *had = l;
                }
                Some(_) => {}
                None => *slot = Some((l, Gcra::per_minute(l, now))),
            }
            slot.as_mut().map(|(_, g)| g)
        }
    }
}

/// Why a tenant's quotas refused a request: it would fit later (a retry time), or it never
/// fits its policy (no retry time).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum QuotaError {
    /// The tenant's sequences in flight (each choice of a request is one) and this request's
    /// would be more than `concurrent_requests`.
    #[error(
        "tenant {tenant:?} has {in_flight} sequences in flight (each choice of a request is one) and this request needs {n}; its policy's concurrent_requests is {max}; retry when one ends"
    )]
    Concurrency {
        /// The tenant.
        tenant: String,
        /// Its limit.
        max: u64,
        /// Its sequences in flight.
        in_flight: u64,
        /// This request's choices.
        n: u64,
    },
    /// The request alone has more choices than `concurrent_requests` allows in flight.
    #[error("the request asks for {n} choices, more than tenant {tenant:?}'s concurrent_requests of {max}")]
    ChoicesOverConcurrency {
        /// The tenant.
        tenant: String,
        /// Its limit.
        max: u64,
        /// This request's choices.
        n: u64,
    },
    /// Over `requests_per_minute`.
    #[error("tenant {tenant:?} is over its policy's requests_per_minute of {max}")]
    RequestRate {
        /// The tenant.
        tenant: String,
        /// Its limit.
        max: u64,
        /// When a request would be let in.
        retry: Duration,
    },
    /// Over `tokens_per_day` or `tokens_per_month` (`period` names which).
    #[error(
        "tenant {tenant:?} has used {used} of its {period} of {max} tokens ({reserved} more reserved by requests in flight); this request needs up to {tokens}"
    )]
    TokenQuota {
        /// The tenant.
        tenant: String,
        /// The policy key.
        period: &'static str,
        /// Its limit.
        max: u64,
        /// Used in the period.
        used: u64,
        /// Reserved by requests in flight.
        reserved: u64,
        /// What this request reserves.
        tokens: u64,
        /// When it would fit: a second if only requests in flight stand in the way, else the
        /// period's end.
        retry: Duration,
    },
    /// Over `tokens_per_minute`.
    #[error(
        "tenant {tenant:?} is over its policy's tokens_per_minute of {max}; this request reserves {tokens} (its prompt plus max_tokens for each choice)"
    )]
    TokenRate {
        /// The tenant.
        tenant: String,
        /// Its limit.
        max: u64,
        /// What this request reserves.
        tokens: u64,
        /// When it would fit.
        retry: Duration,
    },
    /// The request alone reserves more than a limit (`key`) can ever allow.
    #[error(
        "this request reserves {tokens} tokens (its prompt plus max_tokens for each choice), more than tenant {tenant:?}'s {key} of {max}; lower max_tokens"
    )]
    RequestOverLimit {
        /// The tenant.
        tenant: String,
        /// The policy key (`tokens_per_day`, `tokens_per_month` or `tokens_per_minute`).
        key: &'static str,
        /// Its limit.
        max: u64,
        /// What this request reserves.
        tokens: u64,
    },
}

impl QuotaError {
    /// The stable code a client sees.
    pub fn code(&self) -> &'static str {
        match self {
            QuotaError::Concurrency { .. } => "concurrency_limit",
            QuotaError::ChoicesOverConcurrency { .. } => "n_over_concurrency",
            QuotaError::RequestRate { .. } => "rate_limit_requests",
            QuotaError::TokenQuota {
                period: "tokens_per_day",
                ..
            } => "quota_tokens_day",
            QuotaError::TokenQuota { .. } => "quota_tokens_month",
            QuotaError::TokenRate { .. } => "rate_limit_tokens",
            QuotaError::RequestOverLimit {
                key: "tokens_per_minute",
                ..
            } => "request_over_token_rate",
            QuotaError::RequestOverLimit { .. } => "request_over_token_quota",
        }
    }

    /// When the request would fit; `None` if it never will.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            QuotaError::Concurrency { .. } => Some(Duration::from_secs(1)),
            QuotaError::RequestRate { retry, .. }
            | QuotaError::TokenQuota { retry, .. }
            | QuotaError::TokenRate { retry, .. } => Some(*retry),
            QuotaError::RequestOverLimit { .. } | QuotaError::ChoicesOverConcurrency { .. } => None,
        }
    }
}

/// Turns a public prefix's text into the tokens a prompt that begins with it begins with, one
/// list for each served model, in the server's order.
pub type Tokenize = Arc<dyn Fn(&str) -> Vec<Vec<u32>> + Send + Sync>;

/// The policies in force and every tenant's limiters.
pub struct Quotas {
    dir: PathBuf,
    bounds: Bounds,
    /// How public prefixes' text becomes tokens.
    tokenize: Tokenize,
    set: RwLock<Arc<PolicySet>>,
    live: Mutex<HashMap<TenantId, Live>>,
    /// Usage counters, persisted.
    pub usage: UsageBook,
    reload_failures: AtomicU64,
    last_failure: Mutex<String>,
}

impl Quotas {
    /// Loads the policies in `dir`; a bad file refuses to start.
    pub fn new(dir: PathBuf, bounds: Bounds, tokenize: Tokenize, usage: UsageBook) -> Result<Self, PolicyError> {
        let set = PolicySet::load(&dir, bounds, &*tokenize)?;
        Ok(Self {
            dir,
            bounds,
            tokenize,
            set: RwLock::new(Arc::new(set)),
            live: Mutex::new(HashMap::new()),
            usage,
            reload_failures: AtomicU64::new(0),
            last_failure: Mutex::new(String::new()),
        })
    }

    /// The set in force.
    pub fn set(&self) -> Arc<PolicySet> {
        self.set.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Re-reads the directory. A good set replaces the one in force at once (true if it
    /// differs); a bad one is refused and named, and the set in force stays. Each distinct
    /// failure is counted once, however often it is read again.
    pub fn reload(&self) -> Result<bool, PolicyError> {
        let mut last = self.last_failure.lock().unwrap_or_else(|p| p.into_inner());
        match PolicySet::load(&self.dir, self.bounds, &*self.tokenize) {
            Ok(mut new) => {
                last.clear();
                let mut cur = self.set.write().unwrap_or_else(|p| p.into_inner());
                let changed = cur.version != new.version;
                if changed {
                    new.generation = cur.generation + 1;
                    *cur = Arc::new(new);
                }
                Ok(changed)
            }
            Err(e) => {
                let msg = e.to_string();
                if *last != msg {
                    self.reload_failures.fetch_add(1, Ordering::Relaxed);
                    *last = msg;
                }
                Err(e)
            }
        }
    }

    /// Reloads refused since start.
    pub fn reload_failures(&self) -> u64 {
        self.reload_failures.load(Ordering::Relaxed)
    }

    fn live(&self) -> std::sync::MutexGuard<'_, HashMap<TenantId, Live>> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Tenant `id`'s per-minute limits under `policy` as they stand now: what each allows, what
    /// is left of it, and how long until it is whole again (OpenAI's `x-ratelimit-*`). Tokens
    /// reserved by requests in flight count as spent.
    pub fn rates(&self, id: TenantId, policy: &Policy) -> Rates {
        let now = Instant::now();
        let live = self.live();
        let l = live.get(&id);
        let window = |limit: Option<u64>, g: Option<&(u64, Gcra)>| {
            limit.map(|limit| match g {
                Some((had, g)) if *had == limit => RateWindow {
                    limit,
                    remaining: g.available(now).min(limit),
                    reset: g.until_full(now),
                },
                // Not used yet under this limit: whole.
                _ => RateWindow {
                    limit,
                    remaining: limit,
                    reset: Duration::ZERO,
                },
            })
        };
        Rates {
            requests: window(policy.requests_per_minute.get(), l.and_then(|l| l.rpm.as_ref())),
            tokens: window(policy.tokens_per_minute.get(), l.and_then(|l| l.tpm.as_ref())),
        }
    }

    /// Tenant `id`'s limits under `policy` and what is left of each (`GET /v1/usage`'s
    /// `limits`; a limit the policy does not set is `null`).
    pub fn standing(&self, id: TenantId, policy: &Policy) -> Standing {
        let rates = self.rates(id, policy);
        let (day_used, month_used) = self.usage.period_tokens(id, SystemTime::now());
        let (in_flight, reserved) = self.live().get(&id).map_or((0, 0), |l| (l.in_flight, l.reserved));
        let quota = |limit: Option<u64>, used: u64| {
            limit.map(|limit| QuotaLeft {
                limit,
                used,
                reserved,
                remaining: limit.saturating_sub(used + reserved),
            })
        };
        let per_minute = |w: Option<RateWindow>| {
            w.map(|w| MinuteLeft {
                limit: w.limit,
                remaining: w.remaining,
                reset_s: w.reset.as_secs_f64(),
            })
        };
        Standing {
            requests_per_minute: per_minute(rates.requests),
            tokens_per_minute: per_minute(rates.tokens),
            tokens_per_day: quota(policy.tokens_per_day.get(), day_used),
            tokens_per_month: quota(policy.tokens_per_month.get(), month_used),
            concurrent_requests: policy
                .concurrent_requests
                .get()
                .map(|limit| InFlight { limit, in_flight }),
        }
    }

    /// Admits a request of tenant `t` with `n` choices under `policy`, or refuses it (429) on
    /// its concurrency (each choice is a sequence in flight) or its requests per minute. Nothing
    /// of the request has run yet.
    pub fn admit(self: &Arc<Self>, t: &Tenant, policy: &Policy, n: u64) -> Result<Grant, QuotaError> {
        let now = Instant::now();
        let n = n.max(1);
        let mut live = self.live();
        let l = live.entry(t.id).or_default();
        if let Some(max) = policy.concurrent_requests.get() {
            if n > max {
                return Err(QuotaError::ChoicesOverConcurrency {
                    tenant: t.name.clone(),
                    max,
                    n,
                });
            }
            if l.in_flight + n > max {
                return Err(QuotaError::Concurrency {
                    tenant: t.name.clone(),
                    max,
                    in_flight: l.in_flight,
                    n,
                });
            }
        }
        if let Some(g) = limiter(&mut l.rpm, policy.requests_per_minute.get(), now)
            && let Err(Denied::RetryAfter(d)) = g.take(1, now)
        {
            return Err(QuotaError::RequestRate {
                tenant: t.name.clone(),
                max: policy.requests_per_minute.get().unwrap_or(0),
                retry: d,
            });
        }
        l.in_flight += n;
        Ok(Grant {
            quotas: self.clone(),
            tenant: t.clone(),
            sequences: n,
            reserved: AtomicU64::new(0),
            used: Mutex::new(None),
        })
    }
}

/// An admitted request's hold on its tenant's quotas: one slot of its concurrency, and the
/// tokens it reserved. Choices report what they used ([`Grant::record`]); when the last holder
/// lets go, the slot is freed, unused tokens go back, and the usage is booked.
pub struct Grant {
    quotas: Arc<Quotas>,
    tenant: Tenant,
    /// Its sequences in flight: one per choice.
    sequences: u64,
    reserved: AtomicU64,
    /// What its choices used, once one has ended (a request refused before it ran used none).
    used: Mutex<Option<Used>>,
}

impl Grant {
    /// Reserves `tokens` (the prompt plus `max_tokens` for each choice) against the tenant's
    /// tokens per minute, day and month, or refuses: 429 with `Retry-After` when they would
    /// fit later, 400 when the request alone is over a per-minute limit.
    pub fn reserve(&self, tokens: u64, policy: &Policy) -> Result<(), QuotaError> {
        self.reserve_with(policy, |_| tokens).map(|_| ())
    }

    /// Reserves the prompt's `prompt` tokens and, for each of `n` choices, as many completion
    /// tokens as the tenant's quotas have room for now, at most `at_most` (an open-ended
    /// request's): returns that many. Refuses as [`reserve`](Self::reserve) does when not even
    /// one token per choice fits.
    pub fn reserve_up_to(&self, prompt: u64, n: u64, at_most: u64, policy: &Policy) -> Result<u64, QuotaError> {
        let n = n.max(1);
        let per_choice = |room: u64| (room.saturating_sub(prompt) / n).clamp(1, at_most.max(1));
        let tokens = self.reserve_with(policy, |room| prompt + n * per_choice(room))?;
        Ok((tokens - prompt) / n)
    }

    /// Reserves the tokens `pick` chooses given the room the quotas have now (the least any of
    /// them has left; `u64::MAX` with none set), or refuses; returns what it reserved.
    fn reserve_with(&self, policy: &Policy, pick: impl FnOnce(u64) -> u64) -> Result<u64, QuotaError> {
        let now = Instant::now();
        let wall = SystemTime::now();
        let (day_used, month_used) = self.quotas.usage.period_tokens(self.tenant.id, wall);
        let (_, _, day_left, month_left) = periods(wall);
        let mut live = self.quotas.live();
        let l = live.entry(self.tenant.id).or_default();
        let name = &self.tenant.name;
        let tpm = policy.tokens_per_minute.get();
        let mut room = u64::MAX;
        for (limit, used) in [(policy.tokens_per_day, day_used), (policy.tokens_per_month, month_used)] {
            if let Some(max) = limit.get() {
                room = room.min(max.saturating_sub(used + l.reserved));
            }
        }
        if let Some(g) = limiter(&mut l.tpm, tpm, now) {
            room = room.min(g.available(now));
        }
        let tokens = pick(room);
        for (limit, used, left, key) in [
            (policy.tokens_per_day, day_used, day_left, "tokens_per_day"),
            (policy.tokens_per_month, month_used, month_left, "tokens_per_month"),
        ] {
            let Some(max) = limit.get() else { continue };
            if tokens > max {
                return Err(QuotaError::RequestOverLimit {
                    tenant: name.clone(),
                    key,
                    max,
                    tokens,
                });
            }
            if used + l.reserved + tokens > max {
                // If only requests in flight stand in the way, their refunds may make room soon;
                // otherwise the period must end.
                let wait = if used + tokens <= max {
                    Duration::from_secs(1)
                } else {
                    Duration::from_secs(left)
                };
                return Err(QuotaError::TokenQuota {
                    tenant: name.clone(),
                    period: key,
                    max,
                    used,
                    reserved: l.reserved,
                    tokens,
                    retry: wait,
                });
            }
        }
        if let Some(g) = limiter(&mut l.tpm, tpm, now) {
            match g.take(tokens, now) {
                Ok(()) => {}
                Err(Denied::RetryAfter(d)) => {
                    return Err(QuotaError::TokenRate {
                        tenant: name.clone(),
                        max: tpm.unwrap_or(0),
                        tokens,
                        retry: d,
                    });
                }
                Err(Denied::TooLarge { burst }) => {
                    return Err(QuotaError::RequestOverLimit {
                        tenant: name.clone(),
                        key: "tokens_per_minute",
                        max: burst,
                        tokens,
                    });
                }
            }
        }
        l.reserved += tokens;
        self.reserved.fetch_add(tokens, Ordering::Relaxed);
        Ok(tokens)
    }

    /// Adds fuel the request's plugin burned.
    pub fn add_fuel(&self, fuel: u64) {
        self.used
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert_default()
            .plugin_fuel += fuel;
    }
}

/// Each choice records what it used.
impl UsageMeter for Grant {
    fn record(&self, u: &Usage) {
        let mut used = self.used.lock().unwrap_or_else(|p| p.into_inner());
        let used = used.get_or_insert_default();
        used.prompt_tokens = used.prompt_tokens.max(u.prompt_tokens as u64);
        used.completion_tokens += u.completion_tokens as u64;
        used.cached_tokens = used.cached_tokens.max(u.cached_tokens as u64);
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        let used = *self.used.get_mut().unwrap_or_else(|p| p.into_inner());
        let reserved = *self.reserved.get_mut();
        let q = &self.quotas;
        let now = Instant::now();
        let mut live = q.live();
        // Booked under the lock that guards the reservations, so a concurrent reserve sees
        // either the reservation or the usage, never neither.
        if let Some(used) = used {
            q.usage.record(self.tenant.id, &self.tenant.name, used);
        }
        if let Some(l) = live.get_mut(&self.tenant.id) {
            l.in_flight = l.in_flight.saturating_sub(self.sequences);
            l.reserved = l.reserved.saturating_sub(reserved);
            if let Some((_, g)) = &mut l.tpm {
                let spent = used.map_or(0, |u| u.tokens());
                g.refund(reserved.saturating_sub(spent), now);
            }
        }
    }
}
