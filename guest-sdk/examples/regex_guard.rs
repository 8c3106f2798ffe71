//! Keeps the output inside a tenant-configured regular expression. The config is the pattern,
//! which the whole output must match from its start (end it with `.*` to leave the rest free).
//! `init` compiles it into a DFA (regex-automata) and reads the vocabulary; then, before every
//! token (the first in `preprocess`), only the tokens whose bytes keep the DFA alive from where
//! the output is are allowed, and the tokens with no bytes (the end of text among them) only
//! once what is written matches. It stops the choice once the output matches and nothing more
//! could.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};

use regex_automata::Anchored;
use regex_automata::dfa::{Automaton, StartKind, dense};
use regex_automata::util::primitives::StateID;
use regex_automata::util::start;
use warden_guest::{Capabilities, Plugin, PluginError, Request, Token, TokenAction, TokenConstraint};

thread_local! {
    static DFA: RefCell<Option<dense::DFA<Vec<u32>>>> = const { RefCell::new(None) };
    /// The states from which the output can still end in a match.
    static LIVE: RefCell<HashSet<StateID>> = RefCell::new(HashSet::new());
    static VOCAB: RefCell<Vec<Vec<u8>>> = const { RefCell::new(Vec::new()) };
    static STATE: Cell<Option<StateID>> = const { Cell::new(None) };
    /// The tokens the output may start with, worked out once in `init`.
    static FIRST: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

/// Most memory the DFA may take, bytes (the guest's own memory is capped by the server too).
const DFA_BYTES: usize = 8 << 20;

/// Most DFA states the liveness pass follows.
const MAX_STATES: usize = 20_000;

/// The states reachable from `start` from which some input ends in a match: a state that is
/// not dead may still only report a match that ended before its last byte (the DFA's matches
/// come one byte late), so "not dead" is not enough to say more output can match.
fn live_states(dfa: &dense::DFA<Vec<u32>>, start: StateID) -> Option<HashSet<StateID>> {
    let mut index: HashMap<StateID, usize> = HashMap::from([(start, 0)]);
    let mut order = vec![start];
    let mut back: Vec<Vec<usize>> = vec![Vec::new()];
    let mut i = 0;
    while i < order.len() {
        let s = order[i];
        for b in 0..=255u8 {
            let t = dfa.next_state(s, b);
            if dfa.is_dead_state(t) || dfa.is_quit_state(t) {
                continue;
            }
            let j = match index.get(&t) {
                Some(&j) => j,
                None => {
                    if order.len() == MAX_STATES {
                        return None;
                    }
                    order.push(t);
                    back.push(Vec::new());
                    index.insert(t, order.len() - 1);
                    order.len() - 1
                }
            };
            back[j].push(i);
        }
        i += 1;
    }
    let mut live = vec![false; order.len()];
    let mut todo: Vec<usize> = (0..order.len())
        .filter(|&k| dfa.is_match_state(dfa.next_eoi_state(order[k])))
        .collect();
    for &k in &todo {
        live[k] = true;
    }
    while let Some(k) = todo.pop() {
        for &p in &back[k] {
            if !live[p] {
                live[p] = true;
                todo.push(p);
            }
        }
    }
    Some((0..order.len()).filter(|&k| live[k]).map(|k| order[k]).collect())
}

fn config_error(message: String) -> PluginError {
    PluginError {
        code: "plugin_config".into(),
        message,
    }
}

/// Where the DFA is after `bytes` from `state` (`None`: dead, no match can follow).
fn walk(dfa: &dense::DFA<Vec<u32>>, mut state: StateID, bytes: &[u8]) -> Option<StateID> {
    for &b in bytes {
        state = dfa.next_state(state, b);
        if dfa.is_dead_state(state) {
            return None;
        }
    }
    Some(state)
}

/// The tokens allowed next from `state` (those that keep it among the `live` states), and
/// whether any of them writes something.
fn allowed(dfa: &dense::DFA<Vec<u32>>, live: &HashSet<StateID>, state: StateID, vocab: &[Vec<u8>]) -> (Vec<u32>, bool) {
    let matched = dfa.is_match_state(dfa.next_eoi_state(state));
    let mut ids = Vec::new();
    let mut grows = false;
    for (id, bytes) in vocab.iter().enumerate() {
        if bytes.is_empty() {
            if matched {
                ids.push(id as u32);
            }
        } else if walk(dfa, state, bytes).is_some_and(|s| live.contains(&s)) {
            ids.push(id as u32);
            grows = true;
        }
    }
    (ids, grows)
}

fn start_state(dfa: &dense::DFA<Vec<u32>>) -> Option<StateID> {
    dfa.start_state(&start::Config::new().anchored(Anchored::Yes)).ok()
}

struct RegexGuard;

impl Plugin for RegexGuard {
    fn init(config: String) -> Result<(), PluginError> {
        let pattern = config.trim();
        if pattern.is_empty() {
            return Err(config_error(
                "regex_guard needs the pattern the output must match as its config".into(),
            ));
        }
        let dfa = dense::Builder::new()
            .configure(
                dense::Config::new()
                    .start_kind(StartKind::Anchored)
                    .dfa_size_limit(Some(DFA_BYTES))
                    .determinize_size_limit(Some(DFA_BYTES)),
            )
            .build(pattern)
            .map_err(|e| config_error(format!("regex_guard: {e}")))?;
        let vocab = warden_guest::read_vocabulary();
        let start =
            start_state(&dfa).ok_or_else(|| config_error("regex_guard: the pattern has no anchored start".into()))?;
        let live = live_states(&dfa, start)
            .ok_or_else(|| config_error(format!("regex_guard: the pattern needs more than {MAX_STATES} states")))?;
        let (first, _) = allowed(&dfa, &live, start, &vocab);
        FIRST.with_borrow_mut(|f| *f = first);
        LIVE.with_borrow_mut(|l| *l = live);
        DFA.with_borrow_mut(|d| *d = Some(dfa));
        VOCAB.with_borrow_mut(|v| *v = vocab);
        Ok(())
    }

    fn capabilities() -> Capabilities {
        Capabilities { on_token: true }
    }

    fn preprocess(mut req: Request) -> Result<Request, PluginError> {
        DFA.with_borrow(|dfa| {
            let Some(start) = dfa.as_ref().and_then(start_state) else {
                return;
            };
            STATE.set(Some(start));
            req.first_token = Some(TokenConstraint {
                allowed: Some(FIRST.with_borrow(Vec::clone)),
                bias: vec![],
            });
        });
        Ok(req)
    }

    fn on_token(token: Token) -> TokenAction {
        DFA.with_borrow(|dfa| {
            // A choice after the first has its own instance, which saw no `preprocess`.
            let Some(dfa) = dfa else {
                return TokenAction::Continue;
            };
            let Some(state) = STATE.get().or_else(|| start_state(dfa)) else {
                return TokenAction::Continue;
            };
            VOCAB.with_borrow(|v| {
                let bytes = v.get(token.id as usize).map(Vec::as_slice).unwrap_or(&[]);
                let Some(next) = walk(dfa, state, bytes) else {
                    return TokenAction::Stop;
                };
                STATE.set(Some(next));
                let (ids, grows) = LIVE.with_borrow(|live| allowed(dfa, live, next, v));
                if !grows {
                    // It matches and cannot go on: done.
                    return TokenAction::Stop;
                }
                TokenAction::Constrain(TokenConstraint {
                    allowed: Some(ids),
                    bias: vec![],
                })
            })
        })
    }
}

warden_guest::plugin!(RegexGuard);
