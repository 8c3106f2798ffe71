//! The engine thread's ends of KV transfers (invariant 7): on a prefill node, the senders of
//! prefilled prompts waiting for their acknowledgements; on a decode node, the receivers of
//! opened requests waiting for their batches.
//!
//! Everything here runs on the engine thread, between steps, so a page is exported, imported or
//! released only there: no page goes back to the pool while a transfer reads or writes it. A
//! connection task hands frames in and takes frames out through channels; when it goes away,
//! [`Ends::sweep`] ends its request through the engine's retirement path.

use std::collections::HashMap;
use std::time::Instant;

use tokio::sync::{mpsc, oneshot};

use super::error::EngineCallError;
use crate::engine::Engine;
use crate::engine::request::RequestId;
use crate::tenant::TenantId;
use crate::transfer::wire::Frame;
use crate::transfer::{Inbound, Limits, Outbound, TransferError};

/// A prefill-only request's sending end.
struct Sending {
    /// Frames for the decode node, written by the connection task.
    frames: mpsc::UnboundedSender<Frame>,
    owner: TenantId,
    limits: Limits,
    /// Set once its prompt is computed, with the time its `Begin` went.
    out: Option<(Outbound, Instant)>,
}

/// An opened request's receiving end.
struct Receiving {
    owner: TenantId,
    /// Told when its pages open (the transfer may begin).
    ready: Option<oneshot::Sender<()>>,
    /// Set by `Begin`.
    inbound: Option<Inbound>,
}

/// What a received frame asks to send back.
#[derive(Debug)]
pub struct Received {
    /// The acknowledgement.
    pub ack: Frame,
    /// It acknowledges the whole transfer: the request now decodes.
    pub complete: bool,
}

/// The transfers of one engine.
#[derive(Default)]
pub struct Ends {
    sending: HashMap<RequestId, Sending>,
    receiving: HashMap<RequestId, Receiving>,
    finished: Vec<Finished>,
}

/// A sending end's outcome, for the metrics.
#[derive(Debug, Clone, Copy)]
pub struct Finished {
    /// `acknowledged`, `failed` (an error on either side) or `abandoned` (the decode node went
    /// away, or the request ended before its prompt was computed).
    pub outcome: &'static str,
    /// Pages the transfer carries.
    pub pages: usize,
    /// Encoded bytes sent.
    pub bytes: usize,
    /// Seconds from `Begin` to now.
    pub seconds: f64,
}

impl Ends {
    /// Prefill-only request `id` of tenant `owner` sends its KV through `frames` once computed.
    pub fn add_sender(&mut self, id: RequestId, owner: TenantId, limits: Limits, frames: mpsc::UnboundedSender<Frame>) {
        self.sending.insert(
            id,
            Sending {
                frames,
                owner,
                limits,
                out: None,
            },
        );
    }

    /// Admitted request `id` of tenant `owner` receives its prompt's KV once its pages open;
    /// `ready` is told then.
    pub fn add_receiver(&mut self, id: RequestId, owner: TenantId, ready: oneshot::Sender<()>) {
        self.receiving.insert(
            id,
            Receiving {
                owner,
                ready: Some(ready),
                inbound: None,
            },
        );
    }

    /// Request `id`'s pages opened ([`crate::engine::Event::Opened`]): its transfer may begin.
    pub fn opened(&mut self, id: RequestId) {
        if let Some(ready) = self.receiving.get_mut(&id).and_then(|r| r.ready.take()) {
            let _ = ready.send(());
        }
    }

    /// Request `id` computed its prompt's first `tokens` positions: its transfer begins.
    pub fn prefilled(&mut self, engine: &mut Engine, id: RequestId, tokens: usize) {
        let Some(s) = self.sending.get_mut(&id) else {
            engine.release_prefilled(id);
            return;
        };
        let out = Outbound::new(engine.pool(), id.seq(), s.owner, tokens, s.limits);
        let _ = s.frames.send(out.begin());
        s.out = Some((out, Instant::now()));
        self.pump(engine, id);
    }

    /// Sends what the window allows.
    fn pump(&mut self, engine: &mut Engine, id: RequestId) {
        let Some(s) = self.sending.get_mut(&id) else {
            return;
        };
        let Some((out, _)) = s.out.as_mut() else {
            return;
        };
        loop {
            match out.next_frame(engine.pool()) {
                Ok(Some(f)) => {
                    let _ = s.frames.send(f);
                }
                Ok(None) => return,
                Err(e) => return self.fail_sending(engine, id, e.to_string()),
            }
        }
    }

    /// Gives up on sending `id`: tells the decode node why, and lets the pages go.
    fn fail_sending(&mut self, engine: &mut Engine, id: RequestId, why: String) {
        if let Some(s) = self.sending.remove(&id) {
            self.finish("failed", &s);
            let _ = s.frames.send(Frame::Abort { seq: id.0, reason: why });
        }
        engine.cancel(id);
    }

    fn finish(&mut self, outcome: &'static str, s: &Sending) {
        let (pages, bytes, seconds) = match &s.out {
            Some((out, began)) => {
                let (pages, bytes) = out.sent();
                (pages, bytes, began.elapsed().as_secs_f64())
            }
            None => (0, 0, 0.0),
        };
        self.finished.push(Finished {
            outcome,
            pages,
            bytes,
            seconds,
        });
    }

    /// The sending ends that finished since the last call.
    pub fn take_finished(&mut self) -> Vec<Finished> {
        std::mem::take(&mut self.finished)
    }

    /// The decode node's answer on `id`'s transfer: the next batches go, or, on the final
    /// acknowledgement, the pages do.
    pub fn answer(&mut self, engine: &mut Engine, id: RequestId, frame: Frame) {
        let Some(s) = self.sending.get_mut(&id) else {
            return;
        };
        let Some((out, _)) = s.out.as_mut() else {
            let why = "the decode node answered before the transfer began".to_string();
            return self.fail_sending(engine, id, why);
        };
        match out.receive(frame) {
            Ok(()) if out.done() => {
                if let Some(s) = self.sending.remove(&id) {
                    self.finish("acknowledged", &s);
                }
                engine.release_prefilled(id);
            }
            Ok(()) => self.pump(engine, id),
            Err(e) => self.fail_sending(engine, id, e.to_string()),
        }
    }

    /// Request `id` ended (a `Done` event): a sender whose prompt never finished tells the
    /// decode node why; a receiver is forgotten.
    pub fn ended(&mut self, id: RequestId, why: &str) {
        if let Some(s) = self.sending.remove(&id) {
            self.finish("abandoned", &s);
            let _ = s.frames.send(Frame::Abort {
                seq: id.0,
                reason: format!("the prefill node ended the request: {why}"),
            });
        }
        self.receiving.remove(&id);
    }

    /// A frame of `id`'s incoming transfer: verified and written, answering what to send back
    /// (`Begin` needs no answer). An error has failed the request, and says what to tell the
    /// prefill node.
    pub fn receive(
        &mut self,
        engine: &mut Engine,
        id: RequestId,
        frame: Frame,
    ) -> Result<Option<Received>, EngineCallError> {
        let Some(r) = self.receiving.get_mut(&id) else {
            return Err(EngineCallError::Ended);
        };
        let step = match (&mut r.inbound, frame) {
            (_, Frame::Abort { reason, .. }) => Err(TransferError::Aborted(reason)),
            (None, f @ Frame::Begin { .. }) => Inbound::begin(engine.pool_mut(), id.seq(), r.owner, f).map(|i| {
                r.inbound = Some(i);
                None
            }),
            (None, _) => Err(TransferError::Unexpected("a frame before Begin")),
            (Some(i), f) => {
                let end = matches!(f, Frame::End { .. });
                i.receive(engine.pool_mut(), f).map(|ack| Some((ack, end, i.tokens())))
            }
        };
        match step {
            Ok(None) => Ok(None),
            Ok(Some((ack, false, _))) => Ok(Some(Received { ack, complete: false })),
            Ok(Some((ack, true, tokens))) => {
                self.receiving.remove(&id);
                engine.finish_transfer(id, tokens);
                Ok(Some(Received { ack, complete: true }))
            }
            Err(e) => {
                self.fail_receiving(engine, id, e.to_string());
                Err(e.into())
            }
        }
    }

    /// `id`'s transfer cannot complete (its connection failed): the request ends with `why`.
    pub fn fail_receiving(&mut self, engine: &mut Engine, id: RequestId, why: String) {
        if self.receiving.remove(&id).is_some() {
            engine.fail_transfer(id, why);
        }
    }

    /// Senders whose connection is gone: their requests end, and their pages go.
    pub fn sweep(&mut self, engine: &mut Engine) {
        let gone: Vec<RequestId> = self
            .sending
            .iter()
            .filter(|(_, s)| s.frames.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            if let Some(s) = self.sending.remove(&id) {
                self.finish("abandoned", &s);
            }
            engine.cancel(id);
        }
    }
}
