//! Token sampling: an output constraint, logit bias, repetition, presence and frequency
//! penalties, top-k, top-p, min-p, temperature, and a seeded RNG.
//!
//! The constraint goes first: a token it does not allow is −∞ whatever its bias. Then the order
//! is llama.cpp's: the bias and the penalties on raw logits, then the truncations
//! (top-k, top-p, min-p) on the softmax of the temperature-scaled logits, then a draw.
//! Temperature 0 is greedy argmax (of the biased, penalized logits).
//! Each sequence owns its RNG (ChaCha8), seeded from the request's seed when given, so the same
//! request with the same seed yields the same tokens whatever else is in the batch.

use std::collections::HashMap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::constraint::{Constraint, ConstraintError};
use super::field::{Field, InvalidParam};
use super::steer::TokenConstraint;

/// Sampling parameters, validated at admission (see [`SamplingParams::validate`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplingParams {
    /// 0 for greedy; otherwise logits are divided by it. Default 0.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 disables. Default 0.
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches `top_p`; 1 disables. Default 1.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely; 0 disables. Default 0.
    pub min_p: f32,
    /// Divide positive (multiply negative) logits of tokens already seen; 1 disables. Default 1.
    pub repetition_penalty: f32,
    /// How many recent tokens (prompt and output) the penalty looks at. Default 64.
    pub repeat_last_n: usize,
    /// RNG seed; a random one when absent.
    pub seed: Option<u64>,
    /// Subtracted once from the logit of every token the output already holds (OpenAI's
    /// `presence_penalty`); in [−2, 2]. Default 0.
    #[serde(default)]
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once for each time the output holds it (OpenAI's
    /// `frequency_penalty`); in [−2, 2]. Default 0.
    #[serde(default)]
    pub frequency_penalty: f32,
    /// Added to these tokens' logits before anything else (OpenAI's `logit_bias`): ids in
    /// increasing order, each once, at most [`MAX_LOGIT_BIAS`]; biases in [−100, 100]. The ids
    /// are checked against the vocabulary with the prompt.
    #[serde(default)]
    pub logit_bias: Vec<(u32, f32)>,
}

/// Most entries a request's `logit_bias` may hold.
pub const MAX_LOGIT_BIAS: usize = 1024;

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            repeat_last_n: 64,
            seed: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// Checks every field's range; the error names the field and the value.
    pub fn validate(&self) -> Result<(), InvalidParam> {
        let t = self.temperature;
        if !(t.is_finite() && (0.0..=2.0).contains(&t)) {
            return Err(InvalidParam::new(Field::Temperature, "between 0 and 2", t));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(InvalidParam::new(Field::TopP, "in (0, 1]", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(InvalidParam::new(Field::MinP, "in [0, 1]", self.min_p));
        }
        let rp = self.repetition_penalty;
        if !(rp.is_finite() && rp > 0.0 && rp <= 10.0) {
            return Err(InvalidParam::new(Field::RepetitionPenalty, "in (0, 10]", rp));
        }
        for (f, v) in [
            (Field::PresencePenalty, self.presence_penalty),
            (Field::FrequencyPenalty, self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(InvalidParam::new(f, "between -2 and 2", v));
            }
        }
        if self.logit_bias.len() > MAX_LOGIT_BIAS {
            return Err(InvalidParam::new(
                Field::LogitBias,
                format!("at most {MAX_LOGIT_BIAS} tokens"),
                format!("{} tokens", self.logit_bias.len()),
            ));
        }
        if self.logit_bias.windows(2).any(|w| w[0].0 >= w[1].0) {
            return Err(InvalidParam::new(Field::LogitBias, "each token once", "a token twice"));
        }
        if let Some(&(id, b)) = self.logit_bias.iter().find(|(_, b)| !(-100.0..=100.0).contains(b)) {
            return Err(InvalidParam::new(
                Field::LogitBias,
                "biases between -100 and 100",
                format!("{b} for token {id}"),
            ));
        }
        Ok(())
    }

    /// Checks `logit_bias`'s ids against a vocabulary of `vocab` tokens.
    pub fn check_vocab(&self, vocab: usize) -> Result<(), InvalidParam> {
        match self.logit_bias.iter().find(|(id, _)| *id as usize >= vocab) {
            Some((id, _)) => Err(InvalidParam::new(
                Field::LogitBias,
                format!("token ids below the vocabulary size {vocab}"),
                id,
            )),
            None => Ok(()),
        }
    }
}

/// One sequence's sampler.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    probs: Vec<(u32, f32)>,
    weights: Vec<f32>,
    /// How often each token occurs in the first `counted` output tokens (for the presence and
    /// frequency penalties), kept as the output grows.
    counts: HashMap<u32, u32>,
    counted: usize,
    constraint: Option<Constraint>,
    /// A constraint on the next token only (a steering verdict's).
    next: Option<TokenConstraint>,
}

impl Sampler {
    /// A sampler for validated `params`, under `constraint` if there is one.
    pub fn new(params: SamplingParams, constraint: Option<Constraint>) -> Self {
        let seed = params.seed.unwrap_or_else(|| rand::rng().random());
        Self {
            rng: ChaCha8Rng::seed_from_u64(seed),
            params,
            probs: Vec::new(),
            weights: Vec::new(),
            counts: HashMap::new(),
            counted: 0,
            constraint,
            next: None,
        }
    }

    /// Takes its constraint out (to compute the next mask alongside the forward pass); give it
    /// back with [`put_constraint`](Self::put_constraint) before sampling.
    pub fn take_constraint(&mut self) -> Option<Constraint> {
        self.constraint.take()
    }

    /// Gives back what [`take_constraint`](Self::take_constraint) took.
    pub fn put_constraint(&mut self, c: Constraint) {
        self.constraint = Some(c);
    }

    /// Puts the next token (only) under `c` as well as under the request's own constraint.
    pub fn steer_next(&mut self, c: TokenConstraint) {
        self.next = Some(c);
    }

    /// Picks the next token from `logits` given the sequence's tokens so far, `history`, whose
    /// output starts at `output_from`: the repetition penalty looks at both prompt and output (as
    /// llama.cpp's does), the presence and frequency penalties at the output only (as OpenAI
    /// defines them).
    /// Fails only under a constraint that allows no token here or fails.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32], output_from: usize) -> Result<u32, ConstraintError> {
        if let Some(c) = &mut self.constraint {
            c.apply(logits)?;
        }
        if let Some(c) = self.next.take()
            && !c.apply(logits)
        {
            return Err(ConstraintError::SteeredToNothing);
        }
        let tok = self.draw(logits, history, output_from);
        if let Some(c) = &mut self.constraint {
            c.accept(tok)?;
        }
        Ok(tok)
    }

    fn draw(&mut self, logits: &mut [f32], history: &[u32], output_from: usize) -> u32 {
        for &(id, bias) in &self.params.logit_bias {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += bias;
            }
        }
        self.penalize_output(logits, history.get(output_from..).unwrap_or(&[]));
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            let start = history.len().saturating_sub(p.repeat_last_n);
            let mut seen: Vec<u32> = history[start..].to_vec();
            seen.sort_unstable();
            seen.dedup();
            for &t in &seen {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 {
                        *l / p.repetition_penalty
                    } else {
                        *l * p.repetition_penalty
                    };
                }
            }
        }
        if p.temperature == 0.0 {
            return argmax(logits);
        }
        let inv_t = 1.0 / p.temperature;
        let max = logits.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
        // Unnormalised probabilities; min-p filters against the maximum (probability 1 here).
        self.weights.clear();
        self.weights.extend(logits.iter().map(|&l| (l - max) * inv_t));
        warden_kernels::ops::exp_in_place(&mut self.weights);
        self.probs.clear();
        for (i, &w) in self.weights.iter().enumerate() {
            // Weights that underflowed to 0 could never be drawn.
            if w >= p.min_p && w > 0.0 {
                self.probs.push((i as u32, w));
            }
        }
        let by_weight = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < self.probs.len() {
            self.probs.select_nth_unstable_by(p.top_k - 1, by_weight);
            self.probs.truncate(p.top_k);
        }
        if p.top_p < 1.0 {
            let total: f32 = self.probs.iter().map(|x| x.1).sum();
            // Sort only as much of the head as the mass needs: grow k until it covers top_p.
            let mut k = 256.min(self.probs.len());
            loop {
                if k < self.probs.len() {
                    self.probs.select_nth_unstable_by(k - 1, by_weight);
                }
                self.probs[..k].sort_unstable_by(by_weight);
                let mut acc = 0.0;
                let cut = self.probs[..k].iter().position(|x| {
                    acc += x.1;
                    acc >= p.top_p * total
                });
                match cut {
                    Some(c) => {
                        self.probs.truncate(c + 1);
                        break;
                    }
                    None if k == self.probs.len() => break,
                    None => k = (k * 4).min(self.probs.len()),
                }
            }
        }
        let total: f32 = self.probs.iter().map(|x| x.1).sum();
        let mut r = self.rng.random::<f32>() * total;
        for &(id, w) in &self.probs {
            r -= w;
            if r <= 0.0 {
                return id;
            }
        }
        self.probs.last().map(|x| x.0).unwrap_or_else(|| argmax(logits))
    }
}

impl Sampler {
    /// Applies the presence and frequency penalties for `output`, counting only the tokens it
    /// gained since the last call.
    fn penalize_output(&mut self, logits: &mut [f32], output: &[u32]) {
        let (presence, frequency) = (self.params.presence_penalty, self.params.frequency_penalty);
        if presence == 0.0 && frequency == 0.0 {
            return;
        }
        if output.len() < self.counted {
            self.counts.clear();
            self.counted = 0;
        }
        for &t in &output[self.counted..] {
            *self.counts.entry(t).or_insert(0) += 1;
        }
        self.counted = output.len();
        for (&t, &n) in &self.counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= n as f32 * frequency + presence;
            }
        }
    }
}

/// Index of the largest logit (lowest index on ties, as llama.cpp's greedy sampler).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(p: SamplingParams) -> Sampler {
        Sampler::new(p, None)
    }

    fn logits() -> Vec<f32> {
        (0..1000).map(|i| ((i * 37) % 101) as f32 / 10.0).collect()
    }

    #[test]
    fn greedy_is_argmax() {
        let mut s = Sampler::new(SamplingParams::default(), None);
        let mut l = logits();
        let want = argmax(&l);
        assert_eq!(s.sample(&mut l, &[], 0).unwrap(), want);
    }

    #[test]
    fn same_seed_same_tokens() {
        let p = SamplingParams {
            temperature: 1.0,
            top_p: 0.9,
            seed: Some(42),
            ..Default::default()
        };
        let draw = |p: &SamplingParams| {
            let mut s = Sampler::new(p.clone(), None);
            (0..20)
                .map(|_| s.sample(&mut logits(), &[], 0).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(&p), draw(&p));
        assert_ne!(
            draw(&p),
            draw(&SamplingParams {
                seed: Some(43),
                ..p.clone()
            })
        );
    }

    #[test]
    fn top_k_one_is_greedy_and_top_k_limits_the_set() {
        let mut l = logits();
        let want = argmax(&l);
        let mut s = sampler(SamplingParams {
            temperature: 1.5,
            top_k: 1,
            seed: Some(1),
            ..Default::default()
        });
        assert_eq!(s.sample(&mut l, &[], 0).unwrap(), want);
        let mut s = sampler(SamplingParams {
            temperature: 2.0,
            top_k: 3,
            seed: Some(1),
            ..Default::default()
        });
        let mut sorted: Vec<usize> = (0..1000).collect();
        let l = logits();
        sorted.sort_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
        for _ in 0..50 {
            let t = s.sample(&mut logits(), &[], 0).unwrap() as usize;
            assert!(sorted[..3].contains(&t));
        }
    }

    #[test]
    fn min_p_and_top_p_cut_the_tail() {
        // One dominant token: top_p 0.5 and min_p 0.5 both leave only it.
        let mut l = vec![0.0f32; 500];
        l[7] = 10.0;
        for p in [
            SamplingParams {
                temperature: 1.0,
                top_p: 0.5,
                seed: Some(3),
                ..Default::default()
            },
            SamplingParams {
                temperature: 1.0,
                min_p: 0.5,
                seed: Some(3),
                ..Default::default()
            },
        ] {
            let mut s = Sampler::new(p, None);
            for _ in 0..20 {
                assert_eq!(s.sample(&mut l.clone(), &[], 0).unwrap(), 7);
            }
        }
    }

    #[test]
    fn repetition_penalty_demotes_seen_tokens() {
        let mut l = vec![1.0f32, 0.9, 0.1];
        let mut s = sampler(SamplingParams {
            repetition_penalty: 2.0,
            ..Default::default()
        });
        assert_eq!(s.sample(&mut l, &[0], 0).unwrap(), 1);
    }

    #[test]
    fn logit_bias_moves_greedy_both_ways() {
        let l = logits();
        let top = argmax(&l);
        let sample = |bias: Vec<(u32, f32)>| {
            let mut s = sampler(SamplingParams {
                logit_bias: bias,
                ..Default::default()
            });
            s.sample(&mut l.clone(), &[], 0).unwrap()
        };
        assert_ne!(sample(vec![(top, -100.0)]), top, "-100 on the greedy token removes it");
        assert_eq!(sample(vec![(3, 100.0)]), 3, "+100 forces a token");
        assert_eq!(sample(vec![(3, 0.0)]), top);
    }

    #[test]
    fn presence_and_frequency_penalize_the_output_only() {
        // Token 0 leads by 1.5; it is in the prompt (ignored) and twice in the output.
        let base = vec![2.5f32, 1.0, 0.0];
        let run = |presence: f32, frequency: f32, history: &[u32], output_from: usize| {
            let mut s = sampler(SamplingParams {
                presence_penalty: presence,
                frequency_penalty: frequency,
                ..Default::default()
            });
            s.sample(&mut base.clone(), history, output_from).unwrap()
        };
        let h = [0, 2, 0, 0];
        assert_eq!(run(1.0, 0.0, &h, 1), 0, "presence alone: 2.5 - 1 still leads");
        assert_eq!(run(2.0, 0.0, &h, 1), 1, "presence 2: 0.5 < 1");
        assert_eq!(run(0.0, 1.0, &h, 1), 1, "frequency counts both: 2.5 - 2 < 1");
        assert_eq!(run(0.0, 1.0, &h, 4), 0, "nothing in the output, nothing penalized");
        assert_eq!(run(0.0, -2.0, &[1], 0), 1, "a negative penalty promotes");
        // Counting is incremental, and starts over if the output shrinks.
        let mut s = sampler(SamplingParams {
            frequency_penalty: 1.0,
            ..Default::default()
        });
        assert_eq!(s.sample(&mut base.clone(), &[0], 0).unwrap(), 0);
        assert_eq!(s.sample(&mut base.clone(), &[0, 0], 0).unwrap(), 1);
        assert_eq!(s.sample(&mut base.clone(), &[2], 0).unwrap(), 0);
    }

    #[test]
    fn validation_names_the_field() {
        let e = SamplingParams {
            temperature: -1.0,
            ..Default::default()
        }
        .validate()
        .unwrap_err();
        assert_eq!(e.field, Field::Temperature);
        assert!(
            e.to_string().contains("temperature must be between 0 and 2, got -1"),
            "{e}"
        );
        let e = SamplingParams {
            top_p: 0.0,
            ..Default::default()
        }
        .validate()
        .unwrap_err();
        assert_eq!(e.field, Field::TopP);
        for (p, field, says) in [
            (
                SamplingParams {
                    presence_penalty: 2.5,
                    ..Default::default()
                },
                Field::PresencePenalty,
                "presence_penalty must be between -2 and 2, got 2.5",
            ),
            (
                SamplingParams {
                    frequency_penalty: -3.0,
                    ..Default::default()
                },
                Field::FrequencyPenalty,
                "frequency_penalty must be between -2 and 2, got -3",
            ),
            (
                SamplingParams {
                    logit_bias: vec![(5, 101.0)],
                    ..Default::default()
                },
                Field::LogitBias,
                "logit_bias must be biases between -100 and 100, got 101 for token 5",
            ),
            (
                SamplingParams {
                    logit_bias: vec![(5, 1.0), (5, 2.0)],
                    ..Default::default()
                },
                Field::LogitBias,
                "each token once",
            ),
        ] {
            let e = p.validate().unwrap_err();
            assert_eq!(e.field, field);
            assert!(e.to_string().contains(says), "{e}");
        }
        let p = SamplingParams {
            logit_bias: vec![(3, 1.0), (49152, 1.0)],
            ..Default::default()
        };
        assert!(p.validate().is_ok());
        let e = p.check_vocab(49152).unwrap_err();
        assert!(e.to_string().contains("got 49152"), "{e}");
        assert!(p.check_vocab(49153).is_ok());
    }
}
