//! Steering from outside the engine: a sequence whose next token waits for a verdict on the
//! last one (its plugin's `on-token`), which may constrain the next token.
//!
//! The engine and the caller share a [`Steer`] per sequence. Each token the engine emits for the
//! sequence is owed a verdict; until the caller [answers](Steer::answer) every token emitted so
//! far, the sequence computes nothing (it keeps its slot and pages, and other sequences step on
//! without it: a slow verdict delays only its own sequence). A verdict may carry a
//! [`TokenConstraint`] for the next token, applied in the sampler with the request's own
//! constraints. The caller checks a constraint before it answers with it; the engine applies
//! only what fits the vocabulary.

use std::sync::{Mutex, OnceLock};

/// What the next token may be: only `allowed` ones (when given), with `bias` added to logits.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TokenConstraint {
    /// Only these ids (`None`: any).
    pub allowed: Option<Vec<u32>>,
    /// Added to these ids' logits.
    pub bias: Vec<(u32, f32)>,
}

impl TokenConstraint {
    /// Applies it to `logits`: tokens outside `allowed` become impossible, biases are added.
    /// Returns whether any token is still possible.
    pub fn apply(&self, logits: &mut [f32]) -> bool {
        if let Some(allowed) = &self.allowed {
            // The allowed logits are kept aside and put back: no vocabulary-sized mask a token.
            let kept: Vec<(usize, f32)> = allowed
                .iter()
                .filter_map(|&id| logits.get(id as usize).map(|&l| (id as usize, l)))
                .collect();
            logits.fill(f32::NEG_INFINITY);
            for (id, l) in kept {
                logits[id] = l;
            }
        }
        for &(id, b) in &self.bias {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += b;
            }
        }
        logits.iter().any(|l| l.is_finite())
    }
}

#[derive(Debug, Default)]
struct State {
    /// Tokens the engine emitted.
    emitted: u64,
    /// Verdicts given.
    answered: u64,
    /// The constraint on the next token, from the latest verdict.
    next: Option<TokenConstraint>,
}

/// One sequence's verdicts (see the module's documentation).
#[derive(Default)]
pub struct Steer {
    /// Each emitted token waits for a verdict (else only the first token is constrained).
    gated: bool,
    state: Mutex<State>,
    /// Tells the engine's driver that a verdict came (it may be waiting for one).
    waker: OnceLock<Box<dyn Fn() + Send + Sync>>,
    /// Where verdicts go instead, when the engine is another process's (see
    /// [`Steer::relay`]).
    relay: OnceLock<Box<dyn Fn(Option<TokenConstraint>) + Send + Sync>>,
}

/// How a sequence is steered, as it crosses to the node whose engine runs it: whether each
/// token waits for a verdict, and the first token's constraint. The node's own [`Steer`]
/// ([`SteerInit::start`]) then takes the verdicts the caller relays ([`Steer::relay`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SteerInit {
    /// Each emitted token waits for a verdict.
    pub gated: bool,
    /// The first token's constraint.
    pub first: Option<TokenConstraint>,
}

impl SteerInit {
    /// The steering it describes.
    pub fn start(self) -> Steer {
        Steer {
            gated: self.gated,
            state: Mutex::new(State {
                next: self.first,
                ..State::default()
            }),
            ..Steer::default()
        }
    }
}

impl std::fmt::Debug for Steer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Steer")
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl Steer {
    /// A sequence's steering, with no token emitted yet, its first token under `first`:
    /// every token it emits waits for a verdict.
    pub fn new(first: Option<TokenConstraint>) -> Self {
        Self {
            gated: true,
            state: Mutex::new(State {
                next: first,
                ..State::default()
            }),
            ..Self::default()
        }
    }

    /// The steering a plugin asks for: every token waits for a verdict when it takes tokens
    /// (`on_token`); else only a `first` token's constraint, if any; else none.
    pub fn for_plugin(on_token: bool, first: Option<TokenConstraint>) -> Option<Self> {
        match (on_token, first) {
            (true, first) => Some(Self::new(first)),
            (false, Some(first)) => Some(Self::first_only(first)),
            (false, None) => None,
        }
    }

    /// A sequence whose first token is under `first`, and no token waits for anything.
    pub fn first_only(first: TokenConstraint) -> Self {
        Self {
            gated: false,
            state: Mutex::new(State {
                next: Some(first),
                ..State::default()
            }),
            ..Self::default()
        }
    }

    /// Hands this steering to another process's engine: returns what that engine's own
    /// [`Steer`] starts from (the first token's constraint is taken from here), and sends every
    /// verdict from now on to `send` instead of keeping it.
    pub fn relay(&self, send: impl Fn(Option<TokenConstraint>) + Send + Sync + 'static) -> SteerInit {
        let _ = self.relay.set(Box::new(send));
        SteerInit {
            gated: self.gated,
            first: self.state().next.take(),
        }
    }

    /// Sets what is called after each verdict (once; later calls are ignored).
    pub fn set_waker(&self, wake: impl Fn() + Send + Sync + 'static) {
        let _ = self.waker.set(Box::new(wake));
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The verdict on the oldest token not answered yet: the next token is sampled under
    /// `constraint` (`None`: as the request alone says).
    pub fn answer(&self, constraint: Option<TokenConstraint>) {
        if let Some(send) = self.relay.get() {
            return send(constraint);
        }
        {
            let mut s = self.state();
            s.answered += 1;
            s.next = constraint;
        }
        if let Some(wake) = self.waker.get() {
            wake();
        }
    }

    /// The engine emitted a token: the next waits for its verdict.
    pub(super) fn emitted(&self) {
        if self.gated {
            self.state().emitted += 1;
        }
    }

    /// Whether a token still waits for its verdict.
    pub(super) fn pending(&self) -> bool {
        let s = self.state();
        s.answered < s.emitted
    }

    /// The constraint for the next token, taken (it holds for that token only).
    pub(super) fn take(&self) -> Option<TokenConstraint> {
        self.state().next.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts_gate_and_constrain_one_token() {
        let first = TokenConstraint {
            allowed: None,
            bias: vec![(0, 1.0)],
        };
        let s = Steer::new(Some(first.clone()));
        assert_eq!(s.take(), Some(first.clone()), "the first token's constraint");
        let woken = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let w = woken.clone();
        s.set_waker(move || {
            w.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        });
        assert!(!s.pending(), "no token yet: nothing to wait for");
        s.emitted();
        s.emitted();
        assert!(s.pending());
        s.answer(None);
        assert!(s.pending(), "one verdict for two tokens");
        let c = TokenConstraint {
            allowed: Some(vec![1, 3]),
            bias: vec![(3, 2.0), (99, 1.0)],
        };
        s.answer(Some(c.clone()));
        assert!(!s.pending());
        assert_eq!(woken.load(std::sync::atomic::Ordering::SeqCst), 2);
        assert_eq!(s.take(), Some(c.clone()));
        assert_eq!(s.take(), None, "a constraint holds for one token");
        let mut logits = vec![0.5f32; 5];
        assert!(c.apply(&mut logits));
        assert_eq!(logits[1], 0.5);
        assert_eq!(logits[3], 2.5);
        assert!([0, 2, 4].iter().all(|&i| logits[i] == f32::NEG_INFINITY));
        let none = TokenConstraint {
            allowed: Some(vec![7]),
            bias: vec![],
        };
        assert!(
            !none.apply(&mut [0.0; 5]),
            "an id outside the vocabulary allows nothing"
        );
    }
}
