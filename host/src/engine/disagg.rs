//! The disaggregated halves of a request: on a prefill node, a request that computes its prompt
//! and keeps its pages for the transfer; on a decode node, one that opens its pages, waits for
//! its prompt's KV to arrive, then decodes. Both are scheduled like any other request; the
//! transfers themselves are [`crate::transfer`]'s, driven by [`crate::runner`].

use super::request::{AbortReason, Outcome, Rejected, RequestId, ValidRequest};
use super::{Engine, Event, Role};

impl Engine {
    /// Submits the prefill half of a disaggregated request: it is admitted and scheduled like
    /// any other, computes its prompt but the last token, and ends with [`Event::Prefilled`],
    /// keeping its pages (readable through [`Engine::pool`] and its id) until
    /// [`Engine::release_prefilled`].
    pub fn submit_prefill(&mut self, req: ValidRequest) -> Result<RequestId, Rejected> {
        self.admit(&req)?;
        self.enqueue(req, Role::PrefillOnly)
    }

    /// Lets a prefill-only request's pages go once its transfer was acknowledged, or abandoned.
    /// Returns whether it was held.
    pub fn release_prefilled(&mut self, id: RequestId) -> bool {
        match self.held.remove(&id) {
            Some(_) => {
                let _ = self.pool.close(id.seq());
                true
            }
            None => false,
        }
    }

    /// Opens the decode half of a disaggregated request: admitted like [`submit`](Self::submit)
    /// and queued with the others; when its turn comes and the pool has its pages, they open
    /// (no prefill runs) and [`Event::Opened`] says its prompt's KV may arrive (through
    /// [`Engine::pool_mut`] and its id, with [`crate::transfer::Inbound`]). It is scheduled once
    /// [`finish_transfer`](Self::finish_transfer) says the KV arrived whole, or ends with
    /// [`fail_transfer`](Self::fail_transfer)'s error.
    pub fn open_transfer(&mut self, req: ValidRequest) -> Result<RequestId, Rejected> {
        self.admit(&req)?;
        self.enqueue(req, Role::DecodeOnly)
    }

    /// The prompt's KV of transferred request `id` arrived and was verified up to `tokens`
    /// positions (the prompt but its last token): it joins the queue, computes its last prompt
    /// token and decodes. A count that is not that ends it with its error instead.
    pub fn finish_transfer(&mut self, id: RequestId, tokens: usize) -> bool {
        let Some(mut s) = self.receiving.remove(&id) else {
            return false;
        };
        if tokens + 1 != s.prompt_len {
            let why = format!("{tokens} positions arrived for a prompt of {}", s.prompt_len);
            self.retire(s, Outcome::Aborted(AbortReason::Transfer(why)));
            return true;
        }
        s.computed = tokens;
        self.waiting.push_front(s);
        true
    }

    /// Transferred request `id`'s KV did not arrive whole: it ends with `why`, and its pages go
    /// back.
    pub fn fail_transfer(&mut self, id: RequestId, why: String) -> bool {
        match self.receiving.remove(&id) {
            Some(s) => {
                self.retire(s, Outcome::Aborted(AbortReason::Transfer(why)));
                true
            }
            None => false,
        }
    }

    /// Moves prefill-only sequences that computed their part out of the running set: their
    /// pages stay open for the transfer, and [`Event::Prefilled`] says so.
    pub(super) fn hold_prefilled(&mut self) {
        for i in (0..self.running.len()).rev() {
            let s = &self.running[i];
            if s.role == Role::PrefillOnly && s.computed >= s.target() {
                let seq = self.running.swap_remove(i);
                self.events.push(Event::Prefilled {
                    id: seq.id,
                    tokens: seq.computed,
                });
                self.held.insert(seq.id, seq);
            }
        }
    }
}
