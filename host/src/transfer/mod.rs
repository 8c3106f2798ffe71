//! Moving a prompt's KV from a prefill node to a decode node (invariant 7).
//!
//! The sender ([`Outbound`]) exports its sequence's pages, tag-checked, in bounded batches: at
//! most [`Limits::pages_per_batch`] pages a batch, and at most [`Limits::batches_in_flight`]
//! batches and [`Limits::bytes_in_flight`] bytes sent and not yet acknowledged. It keeps its
//! sequence (so its pages) until the receiver acknowledges the whole transfer.
//!
//! The receiver ([`Inbound`]) has opened a sequence for the request with its own admission; it
//! allocates exactly the pages the prompt needs, and for every batch checks the sequence, the
//! tenant, the batch number (in order, once each), each page's index and token range, the
//! page's shape and its checksum, before it writes the page. Nothing it writes is marked written
//! until `End` shows every page arrived and the positions received equal the prompt's length;
//! only then may decode read them. Any mismatch is a [`TransferError`] that fails the request,
//! whose retirement then returns the pages.
//!
//! Frames and their encoding are in [`wire`].

pub mod wire;

use warden_kernels::tag::IsolationViolation;

use crate::kv::{KvError, KvPool, SeqId};
use crate::tenant::TenantId;
use wire::{Frame, PageFrame};

/// Most pages one transfer batch may carry (`cluster.pages_per_batch`).
pub const MAX_PAGES_PER_BATCH: usize = 256;

/// Bounds on a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Limits {
    /// Pages per batch.
    pub pages_per_batch: usize,
    /// Batches sent and not yet acknowledged.
    pub batches_in_flight: usize,
    /// Bytes (of encoded batches) sent and not yet acknowledged. A batch is sent whenever
    /// nothing else is in flight, so one batch larger than this still goes through alone.
    pub bytes_in_flight: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            pages_per_batch: 8,
            batches_in_flight: 4,
            bytes_in_flight: 64 << 20,
        }
    }
}

/// Why a transfer failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TransferError {
    /// A frame for another sequence.
    #[error("a transfer frame for sequence {got} arrived on the transfer of sequence {expected}")]
    WrongSequence {
        /// This transfer's sequence.
        expected: u64,
        /// The frame's.
        got: u64,
    },
    /// A batch naming another tenant than the transfer's.
    #[error("a batch tagged for tenant {got} arrived on tenant {expected}'s transfer")]
    WrongOwner {
        /// This transfer's tenant.
        expected: TenantId,
        /// The batch's.
        got: TenantId,
    },
    /// A batch out of order: one was lost or reordered, or it came twice.
    #[error("batch {got} arrived where batch {expected} was due (a batch was lost, reordered or repeated)")]
    OutOfOrder {
        /// The batch due.
        expected: u32,
        /// The batch that came.
        got: u32,
    },
    /// A page that is not one of the prompt's, or that came before.
    #[error("page {index} is outside the prompt's {pages} pages or arrived twice")]
    BadPage {
        /// Its index.
        index: u32,
        /// Pages the prompt needs.
        pages: usize,
    },
    /// A page whose token range is not the one its index implies.
    #[error("page {index} carries positions {first}..{end}, where the prompt needs {want_first}..{want_end}")]
    BadRange {
        /// Its index.
        index: u32,
        /// First position it carries.
        first: u32,
        /// End of what it carries.
        end: u32,
        /// First position due.
        want_first: u32,
        /// End due.
        want_end: u32,
    },
    /// `End` came before every page, or its counts differ from what arrived.
    #[error(
        "the transfer ended with {pages_received} of {pages} pages, {batches} batches of {batches_sent} sent, and {tokens} positions said where the prompt has {prompt}"
    )]
    Incomplete {
        /// Pages received.
        pages_received: usize,
        /// Pages needed.
        pages: usize,
        /// Batches received.
        batches: u32,
        /// Batches the sender says it sent.
        batches_sent: u32,
        /// Positions the sender says it covered.
        tokens: u32,
        /// The prompt's positions.
        prompt: u32,
    },
    /// A frame that has no place at this point of the protocol.
    #[error("unexpected {0} frame")]
    Unexpected(&'static str),
    /// The other side aborted.
    #[error("the other node aborted the transfer: {0}")]
    Aborted(String),
    /// The pool refused (tag, shape or checksum of a page, or the sequence's pages).
    #[error(transparent)]
    Kv(#[from] KvError),
}

/// The sending side of one sequence's transfer.
#[derive(Debug)]
pub struct Outbound {
    seq: SeqId,
    owner: TenantId,
    tokens: usize,
    pages: usize,
    page_size: usize,
    limits: Limits,
    /// The next page to send.
    next_page: usize,
    /// Batches sent: numbers `0..sent`.
    sent: u32,
    /// Sent and unacknowledged batches: (number, encoded bytes), oldest first.
    in_flight: std::collections::VecDeque<(u32, usize)>,
    /// Encoded bytes of every batch sent.
    bytes_sent: usize,
    ended: bool,
    acked_end: bool,
}

impl Outbound {
    /// A transfer of the first `tokens` positions of pool sequence `seq` of tenant `owner`.
    pub fn new(pool: &KvPool, seq: SeqId, owner: TenantId, tokens: usize, limits: Limits) -> Self {
        let page_size = pool.shape().page_size;
        Self {
            seq,
            owner,
            tokens,
            pages: tokens.div_ceil(page_size),
            page_size,
            limits: Limits {
                pages_per_batch: limits.pages_per_batch.max(1),
                batches_in_flight: limits.batches_in_flight.max(1),
                ..limits
            },
            next_page: 0,
            sent: 0,
            in_flight: Default::default(),
            bytes_sent: 0,
            ended: false,
            acked_end: false,
        }
    }

    /// The frame that opens the transfer.
    pub fn begin(&self) -> Frame {
        Frame::Begin {
            seq: self.seq.0,
            owner: self.owner,
            tokens: self.tokens as u32,
        }
    }

    /// The next frame to send, if the window allows one: a batch of pages exported from `pool`
    /// (tag-checked), then `End`. `None` while the window is full, and once `End` is sent.
    pub fn next_frame(&mut self, pool: &KvPool) -> Result<Option<Frame>, TransferError> {
        if self.ended {
            return Ok(None);
        }
        if self.next_page == self.pages {
            self.ended = true;
            return Ok(Some(Frame::End {
                seq: self.seq.0,
                batches: self.sent,
                tokens: self.tokens as u32,
            }));
        }
        let bytes: usize = self.in_flight.iter().map(|&(_, b)| b).sum();
        if self.in_flight.len() >= self.limits.batches_in_flight
            || (!self.in_flight.is_empty() && bytes >= self.limits.bytes_in_flight)
        {
            return Ok(None);
        }
        let (_, table) = pool.table(self.seq)?;
        let end = (self.next_page + self.limits.pages_per_batch).min(self.pages);
        let mut pages = Vec::with_capacity(end - self.next_page);
        for index in self.next_page..end {
            let e = *table
                .get(index)
                .ok_or(KvError::Isolation(IsolationViolation::ShortPageTable {
                    have: table.len(),
                    positions: self.tokens,
                }))?;
            let data = pool.export_page(self.owner, e)?;
            pages.push(PageFrame {
                index: index as u32,
                first: (index * self.page_size) as u32,
                data,
            });
        }
        let frame = Frame::Batch {
            seq: self.seq.0,
            owner: self.owner,
            number: self.sent,
            pages,
        };
        let size = frame.encoded_len();
        self.in_flight.push_back((self.sent, size));
        self.bytes_sent += size;
        self.sent += 1;
        self.next_page = end;
        Ok(Some(frame))
    }

    /// Takes the receiver's answer: an `Ack` of the oldest batch in flight (or, after `End`, of
    /// the whole transfer), or an `Abort`.
    pub fn receive(&mut self, frame: Frame) -> Result<(), TransferError> {
        match frame {
            Frame::Ack { seq, .. } | Frame::Abort { seq, .. } if seq != self.seq.0 => {
                Err(TransferError::WrongSequence {
                    expected: self.seq.0,
                    got: seq,
                })
            }
            Frame::Ack { number, .. } => match self.in_flight.front() {
                Some(&(oldest, _)) if oldest == number => {
                    self.in_flight.pop_front();
                    Ok(())
                }
                None if self.ended && number == self.sent => {
                    self.acked_end = true;
                    Ok(())
                }
                Some(&(oldest, _)) => Err(TransferError::OutOfOrder {
                    expected: oldest,
                    got: number,
                }),
                None => Err(TransferError::Unexpected("Ack")),
            },
            Frame::Abort { reason, .. } => Err(TransferError::Aborted(reason)),
            Frame::Begin { .. } => Err(TransferError::Unexpected("Begin")),
            Frame::Batch { .. } => Err(TransferError::Unexpected("Batch")),
            Frame::End { .. } => Err(TransferError::Unexpected("End")),
        }
    }

    /// Batches sent and not yet acknowledged, and their bytes.
    pub fn in_flight(&self) -> (usize, usize) {
        (self.in_flight.len(), self.in_flight.iter().map(|&(_, b)| b).sum())
    }

    /// Pages the transfer carries, and the encoded bytes of the batches sent so far.
    pub fn sent(&self) -> (usize, usize) {
        (self.pages, self.bytes_sent)
    }

    /// Whether the receiver acknowledged the whole transfer: only then may the sender close its
    /// sequence.
    pub fn done(&self) -> bool {
        self.acked_end
    }
}

/// The receiving side of one sequence's transfer.
#[derive(Debug)]
pub struct Inbound {
    /// The sender's name for the sequence.
    remote: u64,
    /// The receiver's pool sequence.
    seq: SeqId,
    owner: TenantId,
    tokens: usize,
    page_size: usize,
    received: Vec<bool>,
    next_batch: u32,
}

impl Inbound {
    /// Takes the sender's `Begin` for pool sequence `seq`, which the receiver opened for tenant
    /// `owner` with room for at least `tokens` positions; allocates exactly the pages the prompt
    /// needs.
    pub fn begin(pool: &mut KvPool, seq: SeqId, owner: TenantId, begin: Frame) -> Result<Self, TransferError> {
        let Frame::Begin {
            seq: remote,
            owner: theirs,
            tokens,
        } = begin
        else {
            return Err(TransferError::Unexpected("non-Begin"));
        };
        if theirs != owner {
            return Err(TransferError::WrongOwner {
                expected: owner,
                got: theirs,
            });
        }
        let tokens = tokens as usize;
        pool.ensure(seq, tokens)?;
        let page_size = pool.shape().page_size;
        Ok(Self {
            remote,
            seq,
            owner,
            tokens,
            page_size,
            received: vec![false; tokens.div_ceil(page_size)],
            next_batch: 0,
        })
    }

    /// Prompt positions the transfer covers.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Takes the next frame: verifies and writes a batch (answering its `Ack`), or on `End`
    /// checks coverage and marks the prompt written (answering the final `Ack`; the sequence
    /// may then decode). An error fails the transfer; nothing of it was marked written.
    pub fn receive(&mut self, pool: &mut KvPool, frame: Frame) -> Result<Frame, TransferError> {
        match frame {
            Frame::Batch { seq, .. } | Frame::End { seq, .. } | Frame::Abort { seq, .. } if seq != self.remote => {
                Err(TransferError::WrongSequence {
                    expected: self.remote,
                    got: seq,
                })
            }
            Frame::Batch {
                owner, number, pages, ..
            } => {
                if owner != self.owner {
                    return Err(TransferError::WrongOwner {
                        expected: self.owner,
                        got: owner,
                    });
                }
                if number != self.next_batch {
                    return Err(TransferError::OutOfOrder {
                        expected: self.next_batch,
                        got: number,
                    });
                }
                for p in &pages {
                    let i = p.index as usize;
                    if self.received.get(i) != Some(&false) {
                        return Err(TransferError::BadPage {
                            index: p.index,
                            pages: self.received.len(),
                        });
                    }
                    let want_first = i * self.page_size;
                    let want_end = (want_first + self.page_size).min(self.tokens);
                    let end = p.first as usize + p.data.written as usize;
                    if p.first as usize != want_first || end != want_end {
                        return Err(TransferError::BadRange {
                            index: p.index,
                            first: p.first,
                            end: end as u32,
                            want_first: want_first as u32,
                            want_end: want_end as u32,
                        });
                    }
                    pool.import_page(self.seq, i, &p.data)?;
                    self.received[i] = true;
                }
                self.next_batch += 1;
                Ok(Frame::Ack {
                    seq: self.remote,
                    number,
                })
            }
            Frame::End { batches, tokens, .. } => {
                let got = self.received.iter().filter(|&&r| r).count();
                if got != self.received.len() || batches != self.next_batch || tokens as usize != self.tokens {
                    return Err(TransferError::Incomplete {
                        pages_received: got,
                        pages: self.received.len(),
                        batches: self.next_batch,
                        batches_sent: batches,
                        tokens,
                        prompt: self.tokens as u32,
                    });
                }
                pool.commit_slots(self.seq, self.tokens)?;
                Ok(Frame::Ack {
                    seq: self.remote,
                    number: batches,
                })
            }
            Frame::Abort { reason, .. } => Err(TransferError::Aborted(reason)),
            Frame::Begin { .. } => Err(TransferError::Unexpected("second Begin")),
            Frame::Ack { .. } => Err(TransferError::Unexpected("Ack")),
        }
    }
}

#[cfg(test)]
mod tests;
