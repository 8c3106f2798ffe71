//! A weighted GCRA limiter (the generic cell rate algorithm, as token buckets are usually
//! built): `per_minute` units per minute, with a burst of one minute's worth.
//!
//! It keeps one instant, the theoretical arrival time (TAT): a request of `cost` units fits if
//! the TAT after it, `max(tat, now) + cost × interval`, is at most one minute ahead of now.
//! Unused units can be given back ([`Gcra::refund`]), which moves the TAT back.

use std::time::{Duration, Instant};

/// One limiter.
#[derive(Debug, Clone)]
pub struct Gcra {
    /// Time one unit takes to replenish.
    interval: Duration,
    /// How far ahead of now the TAT may run: the burst.
    window: Duration,
    tat: Instant,
}

/// The request does not fit now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Denied {
    /// It fits after this long.
    RetryAfter(Duration),
    /// It never fits: it costs more than the whole burst.
    TooLarge {
        /// The burst, in units.
        burst: u64,
    },
}

impl Gcra {
    /// A limiter of `per_minute` units per minute (at least 1), full at `now`.
    pub fn per_minute(per_minute: u64, now: Instant) -> Self {
        let window = Duration::from_secs(60);
        Self {
            interval: window / per_minute.clamp(1, u32::MAX as u64) as u32,
            window,
            tat: now,
        }
    }

    /// The same limiter at `per_minute` units per minute, keeping how far ahead it runs: what
    /// was taken under the old limit still counts.
    pub fn with_limit(&self, per_minute: u64) -> Self {
        Self {
            interval: self.window / per_minute.clamp(1, u32::MAX as u64) as u32,
            window: self.window,
            tat: self.tat,
        }
    }

    /// Takes `cost` units at `now`, or says when they would fit.
    pub fn take(&mut self, cost: u64, now: Instant) -> Result<(), Denied> {
        let need = self.interval.saturating_mul(cost.min(u32::MAX as u64) as u32);
        if need > self.window {
            return Err(Denied::TooLarge {
                burst: (self.window.as_nanos() / self.interval.as_nanos().max(1)) as u64,
            });
        }
        let start = self.tat.max(now);
        let new_tat = start + need;
        let ahead = new_tat - now;
        if ahead > self.window {
            return Err(Denied::RetryAfter(ahead - self.window));
        }
        self.tat = new_tat;
        Ok(())
    }

    /// Units that fit at `now`: what [`take`](Self::take) would grant.
    pub fn available(&self, now: Instant) -> u64 {
        let ahead = self.tat.saturating_duration_since(now);
        let left = self.window.saturating_sub(ahead);
        (left.as_nanos() / self.interval.as_nanos().max(1)) as u64
    }

    /// Charges `cost` units used at `now` whether or not they fit: work already done is paid
    /// for, and the limiter stays in debt (refusing [`take`](Self::take) and answering
    /// [`ready_in`](Self::ready_in)) until time has paid it back. The debt is bounded: at most
    /// `cost` past a full burst.
    pub fn charge(&mut self, cost: u64, now: Instant) {
        let need = self.interval.saturating_mul(cost.min(u32::MAX as u64) as u32);
        self.tat = self.tat.max(now) + need;
    }

    /// How long until the limiter is full again (every unit taken replenished), at `now`.
    pub fn until_full(&self, now: Instant) -> Duration {
        self.tat.saturating_duration_since(now)
    }

    /// How long until a unit fits (`None`: one fits now).
    pub fn ready_in(&self, now: Instant) -> Option<Duration> {
        let ahead = self.tat.saturating_duration_since(now);
        let past = (ahead + self.interval).checked_sub(self.window)?;
        (!past.is_zero()).then_some(past)
    }

    /// Gives back `units` taken earlier and not used.
    pub fn refund(&mut self, units: u64, now: Instant) {
        let back = self.interval.saturating_mul(units.min(u32::MAX as u64) as u32);
        self.tat = self.tat.checked_sub(back).unwrap_or(now).max(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_minutes_worth_then_one_per_interval() {
        let t0 = Instant::now();
        let mut g = Gcra::per_minute(60, t0);
        for _ in 0..60 {
            g.take(1, t0).unwrap();
        }
        match g.take(1, t0) {
            Err(Denied::RetryAfter(d)) => assert_eq!(d, Duration::from_secs(1)),
            other => panic!("{other:?}"),
        }
        g.take(1, t0 + Duration::from_secs(1)).unwrap();
        assert!(g.take(1, t0 + Duration::from_secs(1)).is_err());
    }

    #[test]
    fn charges_run_into_debt_and_time_pays_it_back() {
        let t0 = Instant::now();
        // 60 units a minute: one a second.
        let mut g = Gcra::per_minute(60, t0);
        assert_eq!(g.ready_in(t0), None);
        g.charge(50, t0);
        assert_eq!(g.ready_in(t0), None);
        // 90 used of a 60-unit burst: in debt for 30 s, then one unit more.
        g.charge(40, t0);
        assert_eq!(g.ready_in(t0), Some(Duration::from_secs(31)));
        assert!(g.take(1, t0 + Duration::from_secs(30)).is_err());
        assert_eq!(g.ready_in(t0 + Duration::from_secs(31)), None);
        g.take(1, t0 + Duration::from_secs(31)).unwrap();
    }

    #[test]
    fn weighted_costs_refunds_and_impossible_requests() {
        let t0 = Instant::now();
        let mut g = Gcra::per_minute(1000, t0);
        g.take(800, t0).unwrap();
        assert!(matches!(g.take(300, t0), Err(Denied::RetryAfter(_))));
        g.refund(500, t0);
        g.take(300, t0).unwrap();
        assert_eq!(g.take(1001, t0), Err(Denied::TooLarge { burst: 1000 }));
        // What is available is exactly what a take grants.
        assert_eq!(g.available(t0), 400);
        assert!(g.take(401, t0).is_err());
        g.take(400, t0).unwrap();
        assert_eq!(g.available(t0), 0);
        assert_eq!(g.available(t0 + Duration::from_secs(3)), 50);
        assert_eq!(g.until_full(t0), Duration::from_secs(60));
        assert_eq!(g.until_full(t0 + Duration::from_secs(61)), Duration::ZERO);
        // A refund never banks more than a full bucket.
        let mut g = Gcra::per_minute(10, t0);
        g.refund(100, t0);
        for _ in 0..10 {
            g.take(1, t0).unwrap();
        }
        assert!(g.take(1, t0).is_err());
    }
}
