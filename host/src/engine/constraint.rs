//! A sequence's token constraint: which tokens it may sample next, from a compiled grammar
//! (llguidance's matcher; see `crate::grammar`). The mask for the next token depends only on
//! the tokens already accepted, so the engine computes it while the forward pass that yields
//! the logits runs ([`Constraint::prepare`]), and the sampler applies it
//! ([`Constraint::apply`]) before anything else sees the logits.

use llguidance::Matcher;
use llguidance::toktrie::SimpleVob;

/// Why a constrained sequence cannot go on.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConstraintError {
    /// The grammar allows no token at all here.
    #[error("the output constraint allows no next token")]
    NoToken,
    /// The grammar failed (a limit of its work per token was hit).
    #[error("the output constraint failed: {0}")]
    Failed(String),
    /// The plugin's constraint on the next token, with the request's own, allows no token.
    #[error("the plugin's token constraint allows no next token")]
    SteeredToNothing,
}

/// A compiled constraint and the mask for the next token, once computed.
pub struct Constraint {
    matcher: Matcher,
    mask: Option<Result<SimpleVob, ConstraintError>>,
}

impl Clone for Constraint {
    /// An independent copy (another choice of the same request), in the same state.
    fn clone(&self) -> Self {
        Self {
            matcher: self.matcher.deep_clone(),
            mask: None,
        }
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl Constraint {
    /// A constraint at the start of the output.
    pub fn new(matcher: Matcher) -> Self {
        Self { matcher, mask: None }
    }

    /// Computes the next token's mask, if it is not computed yet: only end-of-generation once
    /// the grammar is complete. Bounded by the grammar's per-token limits.
    pub fn prepare(&mut self) {
        if self.mask.is_none() {
            let m = self
                .matcher
                .compute_mask_or_eos()
                .map_err(|e| ConstraintError::Failed(e.to_string()));
            self.mask = Some(m.and_then(|m| {
                if m.is_zero() {
                    Err(ConstraintError::NoToken)
                } else {
                    Ok(m)
                }
            }));
        }
    }

    /// Sets every token the grammar does not allow next to −∞ in `logits`.
    pub fn apply(&mut self, logits: &mut [f32]) -> Result<(), ConstraintError> {
        self.prepare();
        let mask = match &self.mask {
            Some(Ok(m)) => m,
            Some(Err(e)) => return Err(e.clone()),
            None => unreachable!("prepare computed it"),
        };
        // `prepare` refused an empty mask, and the mask covers the vocabulary: a token stays.
        for (id, l) in logits.iter_mut().enumerate() {
            if !mask.is_allowed(id as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    /// Moves past `token`, the one sampled.
    pub fn accept(&mut self, token: u32) -> Result<(), ConstraintError> {
        self.mask = None;
        if self.matcher.is_stopped() {
            // Complete: its mask allowed only the end of generation, which ends the sequence.
            return Ok(());
        }
        self.matcher
            .consume_token(token)
            .map_err(|e| ConstraintError::Failed(e.to_string()))
    }
}
