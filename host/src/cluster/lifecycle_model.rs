//! A model of a disaggregated request's lifecycle and its KV transfer, checked exhaustively with
//! `stateright` for small bounds (test builds only).
//!
//! It follows the code's shape: the router admits or rejects; the decode node queues the request
//! until its pool has the pages, then asks the prefill node; the prefill node allocates, computes
//! (writes) and sends batches in order on a FIFO connection, keeping its pages until the final
//! acknowledgement; the decode node verifies each batch (number, tenant, checksum) before it
//! writes the page, checks coverage at `End`, and only then decodes, reading its pages. A
//! connection may drop, corrupt, duplicate or reorder one batch; the client may cancel at any
//! point; the decode node may die. Pages carry an owner and an epoch that changes when they are
//! freed, as in the pool.
//!
//! Checked for every reachable state:
//! - no read of an unwritten or foreign page (a decode reads only pages its request owns, with
//!   the epoch it was given, written);
//! - every rejected request ends with its own error, never holds a page, never transfers;
//! - no page is freed while referenced (every page a live request's table names is still its
//!   own, at the epoch it got);
//! - no faulted transfer ends as a success;
//! - at quiescence (nothing left to do) no page is held.

use stateright::{Checker, Model, Property};

/// Requests in the model.
const REQUESTS: usize = 2;
/// Pages per pool.
const POOL: usize = 3;

/// A page of a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
struct Page {
    /// The request holding it.
    owner: Option<u8>,
    epoch: u8,
    written: bool,
}

/// A message from the prefill node to the decode node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Wire {
    Batch {
        number: u8,
        owner: u8,
        intact: bool,
    },
    End {
        batches: u8,
    },
    /// The prefill node refused or gave up.
    Abort,
}

/// Where a request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Phase {
    /// At the router.
    Submitted,
    /// Admitted on the decode node, waiting for pages.
    Queued,
    /// Pages open on the decode node; the prefill node is asked.
    Receiving,
    /// The prompt's KV arrived whole: decoding.
    Decoding,
    Finished,
    Rejected,
    /// Ended with an error (transfer, node).
    Failed,
    Cancelled,
}

impl Phase {
    fn ended(self) -> bool {
        matches!(
            self,
            Phase::Finished | Phase::Rejected | Phase::Failed | Phase::Cancelled
        )
    }
}

/// The prefill node's side of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Prefill {
    Idle,
    /// Pages held, prompt not yet computed.
    Computing,
    /// Computed; `sent` batches sent.
    Sending {
        sent: u8,
    },
    /// All sent (End too); waiting for the final acknowledgement.
    AwaitingAck,
    /// Pages released.
    Done,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Req {
    phase: Phase,
    prefill: Prefill,
    /// Decode pages (index, epoch given) and prefill pages.
    decode_pages: Vec<(u8, u8)>,
    prefill_pages: Vec<(u8, u8)>,
    /// Prefill → decode, in order; `None` once the connection is closed.
    wire: Option<Vec<Wire>>,
    /// Batches the decode node verified and wrote.
    received: u8,
    /// Acknowledgements on their way back (the final one included).
    acks: u8,
    /// A fault hit this request's transfer.
    faulted: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct State {
    decode: [Page; POOL],
    prefill: [Page; POOL],
    reqs: Vec<Req>,
    /// A fault left to inject (one per run bounds the space).
    faults_left: u8,
    decode_alive: bool,
    /// Set when a decode read a page it must not have.
    bad_read: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Fault {
    Drop,
    Corrupt,
    Duplicate,
    Reorder,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Action {
    Admit(u8),
    Reject(u8),
    OpenDecode(u8),
    PrefillAlloc(u8),
    /// The prefill node refuses the request (its own admission): an `Abort` goes back.
    PrefillRefuse(u8),
    PrefillCompute(u8),
    PrefillSend(u8),
    Deliver(u8),
    Inject(u8, Fault),
    PrefillAck(u8),
    DecodeStep(u8),
    Cancel(u8),
    KillDecode,
}

/// Request `i`: its prompt's pages (each is one batch), and whether it is over-length.
#[derive(Clone)]
struct Lifecycle {
    pages: [u8; REQUESTS],
    over_length: [bool; REQUESTS],
}

fn alloc(pool: &mut [Page; POOL], owner: u8, n: u8) -> Option<Vec<(u8, u8)>> {
    let free: Vec<usize> = (0..POOL)
        .filter(|&i| pool[i].owner.is_none())
        .take(n as usize)
        .collect();
    if free.len() < n as usize {
        return None;
    }
    Some(
        free.into_iter()
            .map(|i| {
                pool[i].owner = Some(owner);
                pool[i].written = false;
                (i as u8, pool[i].epoch)
            })
            .collect(),
    )
}

/// Returns pages to the pool: the epoch changes, so any stale reference fails its check.
fn release(pool: &mut [Page; POOL], pages: &mut Vec<(u8, u8)>) {
    for (i, _) in pages.drain(..) {
        let p = &mut pool[i as usize];
        p.owner = None;
        p.written = false;
        p.epoch = p.epoch.wrapping_add(1) % 4;
    }
}

impl Lifecycle {
    fn fail(&self, s: &mut State, r: usize, phase: Phase) {
        let req = &mut s.reqs[r];
        req.phase = phase;
        release(&mut s.decode, &mut req.decode_pages);
        // The decode node's end of the transfer goes with the request: the prefill node sees
        // its connection close.
        if req.wire.is_some() {
            req.wire = None;
        }
    }
}

impl Model for Lifecycle {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let req = Req {
            phase: Phase::Submitted,
            prefill: Prefill::Idle,
            decode_pages: vec![],
            prefill_pages: vec![],
            wire: Some(vec![]),
            received: 0,
            acks: 0,
            faulted: false,
        };
        vec![State {
            decode: [Page::default(); POOL],
            prefill: [Page::default(); POOL],
            reqs: vec![req; REQUESTS],
            faults_left: 1,
            decode_alive: true,
            bad_read: false,
        }]
    }

    fn actions(&self, s: &State, out: &mut Vec<Action>) {
        if s.decode_alive
            && s.reqs
                .iter()
                .any(|r| matches!(r.phase, Phase::Queued | Phase::Receiving | Phase::Decoding))
        {
            out.push(Action::KillDecode);
        }
        for (i, r) in s.reqs.iter().enumerate() {
            let i8 = i as u8;
            match r.phase {
                Phase::Submitted if self.over_length[i] => out.push(Action::Reject(i8)),
                Phase::Submitted => out.push(Action::Admit(i8)),
                Phase::Queued => out.push(Action::OpenDecode(i8)),
                Phase::Decoding => out.push(Action::DecodeStep(i8)),
                _ => {}
            }
            if matches!(r.phase, Phase::Queued | Phase::Receiving | Phase::Decoding) {
                out.push(Action::Cancel(i8));
            }
            // The prefill node works while its connection is open, and lets go when it closes.
            match r.prefill {
                Prefill::Idle if r.phase == Phase::Receiving && r.wire.is_some() => {
                    out.push(Action::PrefillAlloc(i8));
                    out.push(Action::PrefillRefuse(i8));
                }
                Prefill::Computing => out.push(Action::PrefillCompute(i8)),
                Prefill::Sending { .. } => out.push(Action::PrefillSend(i8)),
                _ => {}
            }
            if r.acks > 0
                || (r.wire.is_none()
                    && matches!(
                        r.prefill,
                        Prefill::Computing | Prefill::Sending { .. } | Prefill::AwaitingAck
                    ))
            {
                out.push(Action::PrefillAck(i8));
            }
            if let Some(w) = &r.wire
                && !w.is_empty()
                && s.decode_alive
            {
                out.push(Action::Deliver(i8));
                if s.faults_left > 0 && matches!(w[0], Wire::Batch { .. }) {
                    out.push(Action::Inject(i8, Fault::Drop));
                    out.push(Action::Inject(i8, Fault::Corrupt));
                    out.push(Action::Inject(i8, Fault::Duplicate));
                    if w.len() > 1 {
                        out.push(Action::Inject(i8, Fault::Reorder));
                    }
                }
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Reject(r) => s.reqs[r as usize].phase = Phase::Rejected,
            // A router whose decode node is gone answers with the node's failure.
            Action::Admit(r) => {
                s.reqs[r as usize].phase = if s.decode_alive { Phase::Queued } else { Phase::Failed };
            }
            Action::OpenDecode(r) => {
                let r = r as usize;
                // The decode half needs the prompt's pages (the decode reads them all).
                let pages = alloc(&mut s.decode, r as u8, self.pages[r])?;
                s.reqs[r].decode_pages = pages;
                s.reqs[r].phase = Phase::Receiving;
            }
            Action::PrefillAlloc(r) => {
                let r = r as usize;
                let pages = alloc(&mut s.prefill, r as u8, self.pages[r])?;
                s.reqs[r].prefill_pages = pages;
                s.reqs[r].prefill = Prefill::Computing;
            }
            Action::PrefillRefuse(r) => {
                let r = r as usize;
                s.reqs[r].prefill = Prefill::Done;
                s.reqs[r].wire.as_mut()?.push(Wire::Abort);
            }
            Action::PrefillCompute(r) => {
                let r = r as usize;
                for &(p, _) in &s.reqs[r].prefill_pages {
                    s.prefill[p as usize].written = true;
                }
                s.reqs[r].prefill = Prefill::Sending { sent: 0 };
            }
            Action::PrefillSend(r) => {
                let r = r as usize;
                let Prefill::Sending { sent } = s.reqs[r].prefill else {
                    return None;
                };
                let msg = if sent < self.pages[r] {
                    // Export checks the tag: the page is this request's, at its epoch, written.
                    let (p, epoch) = s.reqs[r].prefill_pages[sent as usize];
                    let page = s.prefill[p as usize];
                    let intact = page.owner == Some(r as u8) && page.epoch == epoch && page.written;
                    s.reqs[r].prefill = Prefill::Sending { sent: sent + 1 };
                    Wire::Batch {
                        number: sent,
                        owner: r as u8,
                        intact,
                    }
                } else {
                    s.reqs[r].prefill = Prefill::AwaitingAck;
                    Wire::End { batches: sent }
                };
                if let Some(w) = &mut s.reqs[r].wire {
                    w.push(msg);
                }
            }
            Action::Inject(r, f) => {
                let r = r as usize;
                s.faults_left -= 1;
                s.reqs[r].faulted = true;
                let w = s.reqs[r].wire.as_mut()?;
                match f {
                    Fault::Drop => {
                        w.remove(0);
                    }
                    Fault::Corrupt => {
                        if let Wire::Batch { intact, .. } = &mut w[0] {
                            *intact = false;
                        }
                    }
                    Fault::Duplicate => {
                        let m = w[0];
                        w.insert(0, m);
                    }
                    Fault::Reorder => w.swap(0, 1),
                }
            }
            Action::Deliver(r) => {
                let r = r as usize;
                let m = s.reqs[r].wire.as_mut()?.remove(0);
                if s.reqs[r].phase != Phase::Receiving {
                    // The request ended: the frame is refused, and the connection closes.
                    s.reqs[r].wire = None;
                    return Some(s);
                }
                match m {
                    Wire::Batch { number, owner, intact } => {
                        let req = &s.reqs[r];
                        let ok = intact
                            && owner == r as u8
                            && number == req.received
                            && (number as usize) < req.decode_pages.len();
                        if !ok {
                            self.fail(&mut s, r, Phase::Failed);
                        } else {
                            let (p, _) = s.reqs[r].decode_pages[number as usize];
                            s.decode[p as usize].written = true;
                            s.reqs[r].received += 1;
                            s.reqs[r].acks += 1;
                        }
                    }
                    Wire::End { batches } => {
                        let req = &s.reqs[r];
                        if batches == req.received && req.received == self.pages[r] {
                            // Committed: the final acknowledgement goes back, and the decode
                            // node closes its end of the connection.
                            s.reqs[r].phase = Phase::Decoding;
                            s.reqs[r].acks += 1;
                            s.reqs[r].wire = None;
                        } else {
                            self.fail(&mut s, r, Phase::Failed);
                        }
                    }
                    Wire::Abort => self.fail(&mut s, r, Phase::Failed),
                }
            }
            Action::PrefillAck(r) => {
                let r = r as usize;
                let req = &mut s.reqs[r];
                if req.acks > 0 {
                    req.acks -= 1;
                }
                // The final acknowledgement (every batch and End), or the connection's end,
                // lets the pages go.
                let final_ack = req.prefill == Prefill::AwaitingAck && req.acks == 0 && req.phase != Phase::Receiving;
                let closed = req.wire.is_none();
                if final_ack || closed {
                    release(&mut s.prefill, &mut req.prefill_pages);
                    req.prefill = Prefill::Done;
                }
            }
            Action::DecodeStep(r) => {
                let r = r as usize;
                for &(p, epoch) in &s.reqs[r].decode_pages {
                    let page = s.decode[p as usize];
                    if page.owner != Some(r as u8) || page.epoch != epoch || !page.written {
                        s.bad_read = true;
                    }
                }
                s.reqs[r].phase = Phase::Finished;
                release(&mut s.decode, &mut s.reqs[r].decode_pages);
            }
            Action::Cancel(r) => self.fail(&mut s, r as usize, Phase::Cancelled),
            Action::KillDecode => {
                s.decode_alive = false;
                // Requests it holds fail; those still at the router are answered there.
                for r in 0..REQUESTS {
                    if matches!(s.reqs[r].phase, Phase::Queued | Phase::Receiving | Phase::Decoding) {
                        self.fail(&mut s, r, Phase::Failed);
                    }
                }
                // The process is gone: its whole pool with it.
                s.decode = [Page::default(); POOL];
                for r in &mut s.reqs {
                    r.acks = 0;
                    r.wire = None;
                }
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("no read of an unwritten or foreign page", |_, s: &State| !s.bad_read),
            Property::always(
                "a rejected request holds nothing and transfers nothing",
                |_, s: &State| {
                    s.reqs.iter().enumerate().all(|(i, r)| {
                        r.phase != Phase::Rejected
                            || (r.decode_pages.is_empty()
                                && r.prefill == Prefill::Idle
                                && r.wire.as_ref().is_none_or(|w| w.is_empty())
                                && s.decode.iter().chain(&s.prefill).all(|p| p.owner != Some(i as u8)))
                    })
                },
            ),
            Property::always(
                "only an over-length request is rejected, and always",
                |m: &Lifecycle, s: &State| {
                    s.reqs
                        .iter()
                        .enumerate()
                        .all(|(i, r)| (r.phase == Phase::Rejected) == m.over_length[i] || r.phase == Phase::Submitted)
                },
            ),
            Property::always("no page freed while referenced", |_, s: &State| {
                s.reqs.iter().enumerate().all(|(i, r)| {
                    r.decode_pages.iter().all(|&(p, e)| {
                        let page = s.decode[p as usize];
                        page.owner == Some(i as u8) && page.epoch == e
                    }) && r.prefill_pages.iter().all(|&(p, e)| {
                        let page = s.prefill[p as usize];
                        page.owner == Some(i as u8) && page.epoch == e
                    })
                })
            }),
            Property::always("no faulted transfer succeeds", |_, s: &State| {
                s.reqs.iter().all(|r| !(r.faulted && r.phase == Phase::Finished))
            }),
            Property::always("no page held at quiescence", |m: &Lifecycle, s: &State| {
                let mut next = Vec::new();
                m.actions(s, &mut next);
                let quiet =
                    next.iter().all(|a| matches!(a, Action::KillDecode)) && s.reqs.iter().all(|r| r.phase.ended());
                !quiet || s.decode.iter().chain(&s.prefill).all(|p| p.owner.is_none())
            }),
            Property::sometimes("a request finishes", |_, s: &State| {
                s.reqs.iter().any(|r| r.phase == Phase::Finished)
            }),
            Property::sometimes("a faulted transfer fails", |_, s: &State| {
                s.reqs.iter().any(|r| r.faulted && r.phase == Phase::Failed)
            }),
        ]
    }
}

#[test]
fn the_request_lifecycle_keeps_its_invariants_in_every_reachable_state() {
    for (pages, over_length) in [
        ([1, 1], [false, false]),
        ([1, 2], [false, false]),
        ([2, 1], [true, false]),
        ([2, 2], [false, false]),
    ] {
        let checker = Lifecycle { pages, over_length }.checker().spawn_bfs().join();
        checker.assert_properties();
        println!(
            "{pages:?} pages, over-length {over_length:?}: {} states",
            checker.unique_state_count()
        );
        assert!(checker.unique_state_count() > 100, "{}", checker.unique_state_count());
    }
}
