//! How long a step of some work takes on this machine, fitted from the steps the engine has run.
//! The planner uses it to keep steps near their target duration (see `EngineConfig::step_target`).
//!
//! A step's duration is modelled as `c + a·tokens + b·attended + d·logits`: `attended` counts the
//! key positions all its tokens attend (attention grows with context; the matmuls do not) and
//! `logits` the sequences whose last row goes through the vocabulary projection. The
//! coefficients are a least-squares fit, with a small ridge term, over the last [`WINDOW`] steps,
//! so they follow the machine's load; none is below zero.
//!
//! The same fit prices work for the fair scheduler ([`CostModel::charge`]): a token costs one,
//! plus the positions it attends over [`CostModel::attend_per_token`], the number of positions
//! whose attention costs as much as a token's other work. A token at position 5,000 is charged
//! what it costs, not what one at position 50 does.

use std::collections::VecDeque;
use std::time::Duration;

/// Steps the fit looks back over.
pub const WINDOW: usize = 64;

/// Steps observed before the model predicts anything.
const MIN_SAMPLES: usize = 8;

/// [`CostModel::attend_per_token`] before the fit says: about what a small model on a CPU
/// measures (attending 1,000 positions costs about as much as a token's matmuls).
const DEFAULT_ATTEND_PER_TOKEN: f64 = 1000.0;

/// The range [`CostModel::attend_per_token`] is held to, whatever a noisy fit says: a token
/// costs at most one more for every 64 positions it attends.
pub const ATTEND_PER_TOKEN_RANGE: (f64, f64) = (64.0, 1e6);

/// Ridge term, relative to the observations' scale: keeps a coefficient the window says little
/// about near zero instead of letting it swing.
const RIDGE: f64 = 1e-3;

/// The work of a step, or of part of one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Work {
    /// Tokens computed.
    pub tokens: usize,
    /// Key positions attended, over all those tokens.
    pub attended: usize,
    /// Sequences whose logits are computed.
    pub logits: usize,
}

impl Work {
    /// `n` tokens of one sequence from position `pos0`, with logits for its last token or not.
    pub fn chunk(pos0: usize, n: usize, logits: bool) -> Self {
        Self {
            tokens: n,
            // Token j (0-based) attends pos0 + j + 1 positions.
            attended: n * pos0 + n * (n + 1) / 2,
            logits: usize::from(logits),
        }
    }

    /// This work plus `other`.
    pub fn plus(self, other: Work) -> Self {
        Self {
            tokens: self.tokens + other.tokens,
            attended: self.attended + other.attended,
            logits: self.logits + other.logits,
        }
    }

    /// The regression's features, scaled so the coefficients are of a similar size (ms per
    /// unit): a step, a hundred tokens, a hundred thousand attended positions, ten logit rows.
    fn features(&self) -> [f64; 4] {
        [
            1.0,
            self.tokens as f64 / 100.0,
            self.attended as f64 / 1e5,
            self.logits as f64 / 10.0,
        ]
    }
}

/// The fitted model.
#[derive(Debug, Default)]
pub struct CostModel {
    /// Recent steps: features and milliseconds.
    seen: VecDeque<([f64; 4], f64)>,
    /// Milliseconds per unit of each feature, once fitted.
    coef: Option<[f64; 4]>,
    /// [`attend_per_token`](CostModel::attend_per_token) fixed, whatever the fit (tests whose
    /// stand-in model's steps take no time to measure).
    #[cfg(test)]
    pub(super) fixed_attend_per_token: Option<f64>,
}

impl CostModel {
    /// Records that a step doing `work` took `took`, and refits.
    pub fn observe(&mut self, work: Work, took: Duration) {
        if self.seen.len() == WINDOW {
            self.seen.pop_front();
        }
        self.seen.push_back((work.features(), took.as_secs_f64() * 1e3));
        if self.seen.len() >= MIN_SAMPLES {
            self.coef = fit(&self.seen);
        }
    }

    /// Attended positions that cost as much as one token's other work, as fitted (the default
    /// until then).
    pub fn attend_per_token(&self) -> f64 {
        #[cfg(test)]
        if let Some(k) = self.fixed_attend_per_token {
            return k;
        }
        let Some(c) = self.coef else {
            return DEFAULT_ATTEND_PER_TOKEN;
        };
        // ms a token (features scale tokens by 100) over ms a position (by 100,000).
        let (per_token, per_position) = (c[1] / 100.0, c[2] / 1e5);
        let (lo, hi) = ATTEND_PER_TOKEN_RANGE;
        if per_position <= 0.0 {
            return hi;
        }
        (per_token / per_position).clamp(lo, hi)
    }

    /// What `work` costs, in tokens: one each, plus the positions they attend over
    /// [`attend_per_token`](Self::attend_per_token). The fair scheduler charges tenants this.
    pub fn charge(&self, work: Work) -> f64 {
        work.tokens as f64 + work.attended as f64 / self.attend_per_token()
    }

    /// How long a step doing `work` should take; `None` until enough steps have been seen.
    pub fn predict(&self, work: Work) -> Option<Duration> {
        let coef = self.coef?;
        let ms: f64 = coef.iter().zip(work.features()).map(|(c, x)| c * x).sum();
        Some(Duration::from_secs_f64(ms.max(0.0) / 1e3))
    }
}

/// Ridge least squares over `seen`, coefficients clamped at zero; `None` if the system is
/// singular even with the ridge term (it is not for positive observations).
fn fit(seen: &VecDeque<([f64; 4], f64)>) -> Option<[f64; 4]> {
    // Normal equations (XᵀX + λI) β = Xᵀy, as a 4×5 augmented matrix.
    let mut m = [[0.0f64; 5]; 4];
    for (x, y) in seen {
        for i in 0..4 {
            for j in 0..4 {
                m[i][j] += x[i] * x[j];
            }
            m[i][4] += x[i] * y;
        }
    }
    let scale = (0..4).map(|i| m[i][i]).fold(0.0, f64::max).max(1.0);
    for (i, row) in m.iter_mut().enumerate() {
        row[i] += RIDGE * scale;
    }
    // Gaussian elimination with partial pivoting.
    for col in 0..4 {
        let pivot = (col..4).max_by(|&a, &b| m[a][col].abs().total_cmp(&m[b][col].abs()))?;
        if m[pivot][col].abs() < 1e-12 {
            return None;
        }
        m.swap(col, pivot);
        let p = m[col];
        for (r, row) in m.iter_mut().enumerate() {
            if r != col {
                let f = row[col] / p[col];
                for (v, pv) in row.iter_mut().zip(p).skip(col) {
                    *v -= f * pv;
                }
            }
        }
    }
    let mut coef = [0.0; 4];
    for (i, c) in coef.iter_mut().enumerate() {
        *c = (m[i][4] / m[i][i]).max(0.0);
    }
    Some(coef)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_counts_attended_positions() {
        // Tokens at positions 10, 11, 12 attend 11, 12 and 13 positions.
        assert_eq!(
            Work::chunk(10, 3, true),
            Work {
                tokens: 3,
                attended: 36,
                logits: 1
            }
        );
        assert_eq!(Work::chunk(0, 1, false).attended, 1);
    }

    #[test]
    fn recovers_a_linear_cost_and_predicts_from_it() {
        // 4 ms a step, 0.5 ms a token, 2 µs an attended position, 0.2 ms a logit row.
        let truth = |w: Work| 4.0 + 0.5 * w.tokens as f64 + 0.002 * w.attended as f64 + 0.2 * w.logits as f64;
        let mut m = CostModel::default();
        let mut x = 12345u64;
        for _ in 0..WINDOW {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let pos = (x >> 33) as usize % 1500;
            let n = 1 + (x >> 20) as usize % 200;
            let w = Work::chunk(pos, n, x & 1 == 1).plus(Work::chunk(pos / 2, 1, true));
            assert_eq!(m.predict(w).is_some(), m.seen.len() >= MIN_SAMPLES);
            m.observe(w, Duration::from_secs_f64(truth(w) / 1e3));
        }
        for w in [
            Work::chunk(0, 40, true),
            Work::chunk(300, 37, false),
            Work::chunk(900, 1, true),
        ] {
            let got = m.predict(w).expect("fitted").as_secs_f64() * 1e3;
            let want = truth(w);
            assert!(
                (got - want).abs() < 0.05 * want,
                "{w:?}: predicted {got} ms, truth {want} ms"
            );
        }
    }

    #[test]
    fn a_token_is_charged_by_the_context_it_attends() {
        let mut m = CostModel::default();
        // Before any fit: the default exchange rate.
        assert_eq!(m.charge(Work::chunk(0, 1, false)), 1.0 + 1.0 / DEFAULT_ATTEND_PER_TOKEN);
        // 0.5 ms a token and 2 µs an attended position: 250 positions cost a token.
        let truth = |w: Work| 4.0 + 0.5 * w.tokens as f64 + 0.002 * w.attended as f64;
        let mut x = 99u64;
        for _ in 0..WINDOW {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let w = Work::chunk((x >> 33) as usize % 4000, 1 + (x >> 20) as usize % 200, false);
            m.observe(w, Duration::from_secs_f64(truth(w) / 1e3));
        }
        assert!((m.attend_per_token() - 250.0).abs() < 25.0, "{}", m.attend_per_token());
        // A decode at position 5,000 costs about 21 tokens; one at 50, about 1.2.
        let far = m.charge(Work::chunk(5000, 1, true));
        let near = m.charge(Work::chunk(50, 1, true));
        assert!((far / near - 21.0 / 1.2).abs() < 2.0, "{far} vs {near}");
    }

    #[test]
    fn the_window_forgets_old_steps() {
        let mut m = CostModel::default();
        let w = Work::chunk(100, 50, true);
        for _ in 0..WINDOW {
            m.observe(w, Duration::from_millis(100));
        }
        for _ in 0..WINDOW {
            m.observe(w, Duration::from_millis(20));
        }
        let got = m.predict(w).expect("fitted").as_secs_f64() * 1e3;
        assert!(
            (got - 20.0).abs() < 1.0,
            "predicted {got} ms after the machine got faster"
        );
    }
}
