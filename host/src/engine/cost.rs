//! How long a step of some work takes on this machine, fitted from the steps the engine has run.
//! The planner uses it to keep steps near their target duration (see `EngineConfig::step_target`)
//! and to bound what other tenants' work adds to the leading tenant's step.
//!
//! A step's duration is modelled as `c + a·tokens + b·prompt_attended + e·read + d·logits`.
//! Attention costs in two ways: arithmetic, for every position each token attends, and reading
//! the context's keys and values from memory, once per pass over them. An output token takes
//! the one-query decode attention, a pass of its own, so reading is nearly all its attention
//! costs; a prompt chunk takes the tiled prefill attention, which scores up to
//! [`QCHUNK`] queries in one pass, so a long chunk's attention is arithmetic and a short chunk
//! at a long context (a few prompt tokens after 4,000) costs about what a decode there does.
//! So `prompt_attended` counts the positions prompt tokens attend and `read` the positions
//! read, over all passes; `logits` counts the sequences whose last row goes through the
//! vocabulary projection and a sampler. The coefficients are a least-squares fit, with a small
//! ridge term, none below zero (a feature whose coefficient would be is left out and the rest
//! fitted again).
//!
//! The fit sees the last [`WINDOW`] steps, so it follows the machine's load, and besides them,
//! at a quarter of the weight, the latest step of each *kind* it has seen (steps of like size:
//! see [`Work::kind`]), up to [`KINDS`] kinds. Without those, a window of steps all alike (one
//! tenant's long-context decodes, step after step) says nothing about what any other step
//! costs, and a fit over it alone puts the whole step in its constant: it would then predict a
//! short step to take as long as the long ones, and a prefill chunk of a size it has not seen
//! for a while to take almost nothing.
//!
//! The same fit prices work for the fair scheduler ([`CostModel::shares`]): a step's measured
//! time is shared among the sequences in it in proportion to what each adds to it by the fit
//! (its tokens, the positions they attend, its logits), the step's fixed cost split the same
//! way. A tenant is charged the machine time its work took: a token at position 5,000 what it
//! costs, not what one at position 50 does; and a sequence no more than its step would have
//! taken alone, however much else shared it.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use warden_kernels::attention::QCHUNK;

/// Recent steps the fit looks back over.
pub const WINDOW: usize = 256;

/// Kinds of step whose latest the fit keeps besides the window (the oldest forgotten first).
pub const KINDS: usize = 128;

/// What a kind's latest step weighs in the fit beside a step in the window: enough to tell the
/// features apart, not so much that old steps outweigh how the machine runs now.
const KIND_WEIGHT: f64 = 0.25;

/// Steps observed before the model predicts anything.
const MIN_SAMPLES: usize = 8;

/// The coefficients charges use before the fit says (in [`Work::features`]' units): about what
/// a small model on a CPU measures, 5 ms a step, 0.5 ms a token, 1 µs a prompt token's attended
/// position, 3 µs a position read, 0.2 ms a logit row.
const DEFAULT_COEF: [f64; F] = [5.0, 50.0, 100.0, 300.0, 2.0];

/// Ridge term, relative to each feature's scale in the samples: keeps a coefficient the samples
/// say little about near zero instead of letting it swing.
const RIDGE: f64 = 1e-5;

/// Features of the fit.
const F: usize = 5;

/// Which attention a token takes (see the module comment).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attention {
    /// A prompt token's: tiled.
    Prompt,
    /// An output token's: one query at a time.
    Output,
}

/// The work of a step, or of part of one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Work {
    /// Tokens computed.
    pub tokens: usize,
    /// Key positions attended, over all the prompt tokens.
    pub prompt_attended: usize,
    /// Key positions read from the cache, over all passes (see the module comment).
    pub read: usize,
    /// Sequences whose logits are computed.
    pub logits: usize,
}

impl Work {
    /// `n` tokens of one sequence from position `pos0`, all taking attention `kind`, with
    /// logits for its last token or not.
    pub fn chunk(pos0: usize, n: usize, kind: Attention, logits: bool) -> Self {
        // Token j (0-based) attends pos0 + j + 1 positions.
        let attended = n * pos0 + n * (n + 1) / 2;
        let (prompt_attended, read) = match kind {
            // A pass per QCHUNK queries, each over the chunk's whole context (an upper bound:
            // the earlier queries' passes stop sooner).
            Attention::Prompt => (attended, n.div_ceil(QCHUNK) * (pos0 + n)),
            Attention::Output => (0, attended),
        };
        Self {
            tokens: n,
            prompt_attended,
            read,
            logits: usize::from(logits),
        }
    }

    /// This work plus `other`.
    pub fn plus(self, other: Work) -> Self {
        Self {
            tokens: self.tokens + other.tokens,
            prompt_attended: self.prompt_attended + other.prompt_attended,
            read: self.read + other.read,
            logits: self.logits + other.logits,
        }
    }

    /// The regression's features, scaled so the coefficients are of a similar size (ms per
    /// unit): a step, a hundred tokens, a hundred thousand positions attended or read, ten logit
    /// rows.
    fn features(&self) -> [f64; F] {
        [
            1.0,
            self.tokens as f64 / 100.0,
            self.prompt_attended as f64 / 1e5,
            self.read as f64 / 1e5,
            self.logits as f64 / 10.0,
        ]
    }

    /// Its kind: each count to within a factor of two (0 for none), so steps of one kind cost
    /// about the same and steps of different kinds tell the fit apart what each feature costs.
    fn kind(&self) -> [u8; 4] {
        let log = |x: usize| (usize::BITS - x.leading_zeros()) as u8;
        [
            log(self.tokens),
            log(self.prompt_attended),
            log(self.read),
            log(self.logits),
        ]
    }
}

/// One observed step: its features and milliseconds.
type Sample = ([f64; F], f64);

/// The fitted model.
#[derive(Debug, Default)]
pub struct CostModel {
    /// Recent steps.
    seen: VecDeque<Sample>,
    /// The latest step of each kind, with the step's number (see [`CostModel::observe`]).
    kinds: HashMap<[u8; 4], (u64, Sample)>,
    /// Steps observed.
    steps: u64,
    /// Milliseconds per unit of each feature, once fitted.
    coef: Option<[f64; F]>,
    /// Charge a token one, whatever it attends and however long its step took (tests whose
    /// stand-in model's steps take no time to measure).
    #[cfg(test)]
    pub(super) charge_tokens: bool,
}

impl CostModel {
    /// Records that a step doing `work` took `took`, and refits.
    pub fn observe(&mut self, work: Work, took: Duration) {
        let sample = (work.features(), took.as_secs_f64() * 1e3);
        self.steps += 1;
        if self.seen.len() == WINDOW {
            self.seen.pop_front();
        }
        self.seen.push_back(sample);
        self.kinds.insert(work.kind(), (self.steps, sample));
        if self.kinds.len() > KINDS
            && let Some(oldest) = self.kinds.iter().min_by_key(|(_, (n, _))| *n).map(|(k, _)| *k)
        {
            self.kinds.remove(&oldest);
        }
        if self.seen.len() >= MIN_SAMPLES {
            // The window, and each kind's latest step from before it (those in it are in it).
            let before = self.steps.saturating_sub(self.seen.len() as u64);
            let older = self
                .kinds
                .values()
                .filter(|(n, _)| *n <= before)
                .map(|(_, s)| (s, KIND_WEIGHT));
            self.coef = fit(self.seen.iter().map(|s| (s, 1.0)).chain(older));
        }
    }

    /// What `work` adds to a step, in milliseconds by the fit (by [`DEFAULT_COEF`] before it).
    fn marginal(&self, work: Work) -> f64 {
        let coef = self.coef.unwrap_or(DEFAULT_COEF);
        coef.iter().zip(work.features()).skip(1).map(|(c, x)| c * x).sum()
    }

    /// What `work` will cost its tenant, in milliseconds, before it runs: what it adds to the
    /// steps it runs in.
    pub fn estimate(&self, work: Work) -> f64 {
        #[cfg(test)]
        if self.charge_tokens {
            return work.tokens as f64;
        }
        self.marginal(work)
    }

    /// A step of `parts` that took `took`, shared among them: each part's milliseconds, in
    /// proportion to what it adds to the step (so the step's fixed cost is split the same way
    /// and the shares add up to `took`). The fair scheduler charges each part's tenant its share.
    pub fn shares(&self, parts: &[Work], took: Duration) -> Vec<f64> {
        #[cfg(test)]
        if self.charge_tokens {
            return parts.iter().map(|w| w.tokens as f64).collect();
        }
        let adds: Vec<f64> = parts.iter().map(|&w| self.marginal(w)).collect();
        let total: f64 = adds.iter().sum();
        let ms = took.as_secs_f64() * 1e3;
        if total <= 0.0 {
            return vec![ms / parts.len().max(1) as f64; parts.len()];
        }
        adds.iter().map(|a| ms * a / total).collect()
    }

    /// How long a step doing `work` should take; `None` until enough steps have been seen.
    pub fn predict(&self, work: Work) -> Option<Duration> {
        let coef = self.coef?;
        let ms: f64 = coef.iter().zip(work.features()).map(|(c, x)| c * x).sum();
        Some(Duration::from_secs_f64(ms.max(0.0) / 1e3))
    }
}

/// Weighted ridge least squares over `samples` with no coefficient below zero; `None` if the
/// system is singular even with the ridge term (it is not for positive observations).
fn fit<'a>(samples: impl Iterator<Item = (&'a Sample, f64)>) -> Option<[f64; F]> {
    // Normal equations (XᵀWX + λI) β = XᵀWy, as an augmented matrix.
    let mut m = [[0.0f64; F + 1]; F];
    for ((x, y), w) in samples {
        for i in 0..F {
            for j in 0..F {
                m[i][j] += w * x[i] * x[j];
            }
            m[i][F] += w * x[i] * y;
        }
    }
    // Each coefficient damped relative to its own feature's scale (the features' magnitudes
    // differ by orders: a step's decodes attend little beside a long prompt chunk), and a
    // feature no sample has is held at zero.
    let scale = (0..F).map(|i| m[i][i]).fold(0.0, f64::max).max(1.0);
    for (i, row) in m.iter_mut().enumerate() {
        row[i] += RIDGE * row[i] + 1e-9 * scale;
    }
    // No cost is negative: a feature whose coefficient comes out below zero (the others
    // making up for it, over samples that barely tell them apart) is fixed at zero and the
    // rest fitted again without it, the most negative first. Zeroing it after the fit instead
    // would leave the others' compensation in and the predictions off by as much.
    let mut active = [true; F];
    loop {
        let coef = solve(&m, &active)?;
        match (0..F)
            .filter(|&i| coef[i] < 0.0)
            .min_by(|&a, &b| coef[a].total_cmp(&coef[b]))
        {
            Some(i) => active[i] = false,
            None => return Some(coef),
        }
    }
}

/// Solves the normal equations `m` over the `active` features (the others held at zero), by
/// Gaussian elimination with partial pivoting.
fn solve(m: &[[f64; F + 1]; F], active: &[bool; F]) -> Option<[f64; F]> {
    let idx: Vec<usize> = (0..F).filter(|&i| active[i]).collect();
    let k = idx.len();
    let mut a: Vec<Vec<f64>> = idx
        .iter()
        .map(|&i| idx.iter().map(|&j| m[i][j]).chain([m[i][F]]).collect())
        .collect();
    for col in 0..k {
        let pivot = (col..k).max_by(|&x, &y| a[x][col].abs().total_cmp(&a[y][col].abs()))?;
        if a[pivot][col].abs() < 1e-12 {
            return None;
        }
        a.swap(col, pivot);
        let p = a[col].clone();
        for (r, row) in a.iter_mut().enumerate() {
            if r != col {
                let f = row[col] / p[col];
                for (v, pv) in row.iter_mut().zip(&p).skip(col) {
                    *v -= f * pv;
                }
            }
        }
    }
    let mut coef = [0.0; F];
    for (r, &i) in idx.iter().enumerate() {
        coef[i] = a[r][k] / a[r][r];
    }
    Some(coef)
}

#[cfg(test)]
mod tests {
    use super::*;
    use Attention::{Output, Prompt};

    /// A step time, in ms: 4 a step, 0.5 a token, 0.5 µs a prompt token's attended position,
    /// 2 µs a position read, 0.2 a logit row.
    fn truth(w: Work) -> f64 {
        4.0 + 0.5 * w.tokens as f64 + 0.0005 * w.prompt_attended as f64 + 0.002 * w.read as f64 + 0.2 * w.logits as f64
    }

    /// A pseudo-random step: a prompt chunk (or none) beside up to four decodes.
    fn random_step(x: &mut u64) -> Work {
        let mut next = |m: usize| {
            *x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (*x >> 33) as usize % m
        };
        let decodes = (0..next(5)).fold(Work::default(), |w, _| w.plus(Work::chunk(next(3000), 1, Output, true)));
        match next(3) {
            0 if decodes.tokens > 0 => decodes,
            _ => decodes.plus(Work::chunk(next(3000), 1 + next(200), Prompt, next(2) == 1)),
        }
    }

    fn assert_predicts(m: &CostModel, w: Work, within: f64) {
        let got = m.predict(w).expect("fitted").as_secs_f64() * 1e3;
        let want = truth(w);
        assert!(
            (got - want).abs() < within * want,
            "{w:?}: predicted {got} ms, truth {want} ms"
        );
    }

    #[test]
    fn chunk_counts_positions_attended_and_read() {
        // Prompt tokens at positions 10, 11, 12 attend 11, 12 and 13 positions, in one pass
        // over the 13.
        assert_eq!(
            Work::chunk(10, 3, Prompt, true),
            Work {
                tokens: 3,
                prompt_attended: 36,
                read: 13,
                logits: 1
            }
        );
        // 100 prompt tokens after 4,000: four passes.
        assert_eq!(Work::chunk(4000, 100, Prompt, false).read, 4 * 4100);
        // Output tokens: a pass each.
        let decodes = Work::chunk(10, 3, Output, false);
        assert_eq!((decodes.prompt_attended, decodes.read), (0, 36));
    }

    #[test]
    fn recovers_a_linear_cost_and_predicts_from_it() {
        let mut m = CostModel::default();
        let mut x = 12345u64;
        for _ in 0..WINDOW {
            let w = random_step(&mut x);
            assert_eq!(m.predict(w).is_some(), m.seen.len() >= MIN_SAMPLES);
            m.observe(w, Duration::from_secs_f64(truth(w) / 1e3));
        }
        for w in [
            Work::chunk(0, 40, Prompt, true),
            Work::chunk(300, 37, Prompt, false),
            Work::chunk(900, 1, Output, true),
        ] {
            assert_predicts(&m, w, 0.05);
        }
    }

    #[test]
    fn a_window_of_like_steps_forgets_nothing_of_what_other_steps_cost() {
        // Varied steps, then many more of one tenant's four decodes at 4,000 positions beside
        // another's at 700: what a short step or a long prefill chunk costs is still known.
        let mut m = CostModel::default();
        let mut x = 777u64;
        for _ in 0..WINDOW {
            let w = random_step(&mut x);
            m.observe(w, Duration::from_secs_f64(truth(w) / 1e3));
        }
        let crowd = (0..4).fold(Work::chunk(700, 1, Output, true), |w, i| {
            w.plus(Work::chunk(4000 + i, 1, Output, true))
        });
        for _ in 0..5 * WINDOW {
            m.observe(crowd, Duration::from_secs_f64(truth(crowd) / 1e3));
        }
        assert_predicts(&m, crowd, 0.02);
        assert_predicts(&m, Work::chunk(700, 1, Output, true), 0.1);
        assert_predicts(&m, Work::chunk(0, 200, Prompt, true), 0.1);
    }

    #[test]
    fn a_step_is_shared_by_what_each_part_adds_to_it() {
        let mut m = CostModel::default();
        let (far, near) = (Work::chunk(5000, 1, Output, true), Work::chunk(50, 1, Output, true));
        let took = |w: Work| Duration::from_secs_f64(truth(w) / 1e3);
        // Before any fit the defaults share it; the shares add up to the step's time.
        let shares = m.shares(&[far, near], Duration::from_millis(30));
        assert!(
            (shares.iter().sum::<f64>() - 30.0).abs() < 1e-9 && shares[0] > shares[1],
            "{shares:?}"
        );
        let mut x = 99u64;
        for _ in 0..WINDOW {
            let w = random_step(&mut x);
            m.observe(w, took(w));
        }
        // A decode at position 5,000 adds 0.5 + 10 + 0.2 ms, one at 50 0.5 + 0.1 + 0.2: the
        // step's 4 ms are split the same way.
        let step = far.plus(near);
        let shares = m.shares(&[far, near], took(step));
        let ms = truth(step);
        let (want_far, want_near) = (10.702 / 11.504 * ms, 0.802 / 11.504 * ms);
        assert!((shares[0] - want_far).abs() < 0.05 * want_far, "{shares:?}");
        assert!((shares[1] - want_near).abs() < 0.05 * want_near, "{shares:?}");
        // Neither is charged more than its step alone would take.
        let alone = |w: Work| m.predict(w).expect("fitted").as_secs_f64() * 1e3;
        let shares = m.shares(&[far, near], m.predict(step).expect("fitted"));
        assert!(shares[0] <= alone(far) && shares[1] <= alone(near), "{shares:?}");
        // Charged before it runs: what it adds.
        assert!((m.estimate(far) - 10.702).abs() < 0.5, "{}", m.estimate(far));
    }

    #[test]
    fn the_window_follows_the_machine() {
        let mut m = CostModel::default();
        let w = Work::chunk(100, 50, Prompt, true);
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

    #[test]
    fn kinds_kept_are_bounded() {
        let mut m = CostModel::default();
        for n in 0..4 * KINDS {
            let w = Work::chunk(0, n % 3000 + 1, Prompt, false).plus(Work::chunk(1 << (n % 40), 1, Output, true));
            m.observe(w, Duration::from_millis(1));
        }
        assert!(m.kinds.len() <= KINDS, "{}", m.kinds.len());
    }
}
