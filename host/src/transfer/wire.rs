//! The transfer protocol's frames and their byte encoding.
//!
//! A frame is a little-endian `u32` body length, then the body: a kind byte and the kind's
//! fields. Every length inside is checked against what the body holds, and a body longer than
//! the receiver's limit is refused before it is read, so no frame makes the receiver allocate
//! more than its limit.

use half::f16;

use crate::kv::PageData;
use crate::tenant::TenantId;

/// One page of a batch: its index in the sequence, the position of its first token, and its
/// content.
#[derive(Debug, Clone, PartialEq)]
pub struct PageFrame {
    /// Index of the page in the sequence's table.
    pub index: u32,
    /// Position of its first token (`index × page_size`).
    pub first: u32,
    /// Its written slots' K and V, and their checksum.
    pub data: PageData,
}

/// A frame of the transfer protocol.
#[derive(Debug, Clone, PartialEq)]
pub enum Frame {
    /// The prefill node opens a transfer of sequence `seq` of tenant `owner`, covering the
    /// prompt's `tokens` positions.
    Begin {
        /// The sequence, as the prefill node names it.
        seq: u64,
        /// Its tenant (the owner every page carries).
        owner: TenantId,
        /// Prompt tokens the transfer covers.
        tokens: u32,
    },
    /// A bounded batch of pages.
    Batch {
        /// The sequence.
        seq: u64,
        /// Its tenant: the tag of every page in the batch.
        owner: TenantId,
        /// Batches are numbered from 0 and must arrive in order.
        number: u32,
        /// The pages.
        pages: Vec<PageFrame>,
    },
    /// Every batch is sent: `batches` of them, covering `tokens` positions.
    End {
        /// The sequence.
        seq: u64,
        /// Batches sent.
        batches: u32,
        /// Positions covered.
        tokens: u32,
    },
    /// The receiver verified batch `number` (or, after `End`, the whole transfer: `number` is
    /// then the batch count).
    Ack {
        /// The sequence.
        seq: u64,
        /// The batch.
        number: u32,
    },
    /// Either side gives up on the transfer, saying why.
    Abort {
        /// The sequence.
        seq: u64,
        /// Why.
        reason: String,
    },
}

/// Why bytes are not a frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// More bytes are needed for a whole frame (not an error on a stream: read more).
    #[error("incomplete frame: {have} of {need} bytes")]
    Incomplete {
        /// Bytes there.
        have: usize,
        /// Bytes the frame needs.
        need: usize,
    },
    /// The frame is larger than the receiver accepts.
    #[error("frame of {len} bytes, more than the limit of {limit}")]
    TooLarge {
        /// Its length.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// The body ended inside a field, or has bytes after its last field.
    #[error("malformed frame: {0}")]
    Malformed(&'static str),
    /// An unknown kind byte.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
}

const BEGIN: u8 = 1;
const BATCH: u8 = 2;
const END: u8 = 3;
const ACK: u8 = 4;
const ABORT: u8 = 5;

impl Frame {
    /// The frame's bytes, length prefix included.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(self.encoded_len());
        self.encode_into(&mut b);
        b
    }

    /// How many bytes [`encode`](Self::encode) makes, without encoding.
    pub fn encoded_len(&self) -> usize {
        let body = match self {
            Frame::Begin { .. } => 8 + 8 + 4,
            Frame::Batch { pages, .. } => {
                8 + 8
                    + 4
                    + 4
                    + pages
                        .iter()
                        .map(|p| 4 + 4 + 4 + 8 + 4 + 2 * (p.data.k.len() + p.data.v.len()))
                        .sum::<usize>()
            }
            Frame::End { .. } => 8 + 4 + 4,
            Frame::Ack { .. } => 8 + 4,
            Frame::Abort { reason, .. } => 8 + 4 + reason.len(),
        };
        4 + 1 + body
    }

    /// Appends the frame's bytes, length prefix included, to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        let start = out.len();
        let mut b = std::mem::take(out);
        b.extend_from_slice(&[0u8; 4]);
        match self {
            Frame::Begin { seq, owner, tokens } => {
                b.push(BEGIN);
                put_u64(&mut b, *seq);
                put_u64(&mut b, owner.get());
                put_u32(&mut b, *tokens);
            }
            Frame::Batch {
                seq,
                owner,
                number,
                pages,
            } => {
                b.push(BATCH);
                put_u64(&mut b, *seq);
                put_u64(&mut b, owner.get());
                put_u32(&mut b, *number);
                put_u32(&mut b, pages.len() as u32);
                for p in pages {
                    put_u32(&mut b, p.index);
                    put_u32(&mut b, p.first);
                    put_u32(&mut b, p.data.written);
                    put_u64(&mut b, p.data.checksum);
                    put_u32(&mut b, p.data.k.len() as u32);
                    for x in p.data.k.iter().chain(&p.data.v) {
                        b.extend_from_slice(&x.to_bits().to_le_bytes());
                    }
                }
            }
            Frame::End { seq, batches, tokens } => {
                b.push(END);
                put_u64(&mut b, *seq);
                put_u32(&mut b, *batches);
                put_u32(&mut b, *tokens);
            }
            Frame::Ack { seq, number } => {
                b.push(ACK);
                put_u64(&mut b, *seq);
                put_u32(&mut b, *number);
            }
            Frame::Abort { seq, reason } => {
                b.push(ABORT);
                put_u64(&mut b, *seq);
                put_u32(&mut b, reason.len() as u32);
                b.extend_from_slice(reason.as_bytes());
            }
        }
        let len = (b.len() - start - 4) as u32;
        b[start..start + 4].copy_from_slice(&len.to_le_bytes());
        *out = b;
    }

    /// The frame at the start of `bytes`, and how many bytes it took. A body over `limit` bytes
    /// is refused from its length prefix alone.
    pub fn decode(bytes: &[u8], limit: usize) -> Result<(Frame, usize), WireError> {
        let Some(prefix) = bytes.get(..4) else {
            return Err(WireError::Incomplete {
                have: bytes.len(),
                need: 4,
            });
        };
        let len = u32::from_le_bytes(prefix.try_into().expect("4 bytes")) as usize;
        if len > limit {
            return Err(WireError::TooLarge { len, limit });
        }
        let Some(body) = bytes.get(4..4 + len) else {
            return Err(WireError::Incomplete {
                have: bytes.len(),
                need: 4 + len,
            });
        };
        let mut r = Reader(body);
        let frame = match r.u8()? {
            BEGIN => Frame::Begin {
                seq: r.u64()?,
                owner: r.tenant()?,
                tokens: r.u32()?,
            },
            BATCH => {
                let (seq, owner, number, n) = (r.u64()?, r.tenant()?, r.u32()?, r.u32()? as usize);
                // Each page takes at least its 24-byte header: a count the body cannot hold is
                // refused before anything is allocated for it.
                if n > r.0.len() / 24 {
                    return Err(WireError::Malformed("more pages than the frame holds"));
                }
                let mut pages = Vec::with_capacity(n);
                for _ in 0..n {
                    let (index, first, written, checksum) = (r.u32()?, r.u32()?, r.u32()?, r.u64()?);
                    let values = r.u32()? as usize;
                    if values > r.0.len() / 4 {
                        return Err(WireError::Malformed("more values than the frame holds"));
                    }
                    let k = r.f16s(values)?;
                    let v = r.f16s(values)?;
                    pages.push(PageFrame {
                        index,
                        first,
                        data: PageData {
                            written,
                            k,
                            v,
                            checksum,
                        },
                    });
                }
                Frame::Batch {
                    seq,
                    owner,
                    number,
                    pages,
                }
            }
            END => Frame::End {
                seq: r.u64()?,
                batches: r.u32()?,
                tokens: r.u32()?,
            },
            ACK => Frame::Ack {
                seq: r.u64()?,
                number: r.u32()?,
            },
            ABORT => {
                let seq = r.u64()?;
                let n = r.u32()? as usize;
                let text = r.take(n)?;
                Frame::Abort {
                    seq,
                    reason: String::from_utf8_lossy(text).into_owned(),
                }
            }
            k => return Err(WireError::UnknownKind(k)),
        };
        if !r.0.is_empty() {
            return Err(WireError::Malformed("bytes after the last field"));
        }
        Ok((frame, 4 + len))
    }
}

fn put_u32(b: &mut Vec<u8>, x: u32) {
    b.extend_from_slice(&x.to_le_bytes());
}

fn put_u64(b: &mut Vec<u8>, x: u64) {
    b.extend_from_slice(&x.to_le_bytes());
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.0.len() < n {
            return Err(WireError::Malformed("the body ends inside a field"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }

    fn tenant(&mut self) -> Result<TenantId, WireError> {
        TenantId::new(self.u64()?).ok_or(WireError::Malformed(
            "a tenant id that is no tenant's (0 or the largest)",
        ))
    }

    fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }

    fn f16s(&mut self, n: usize) -> Result<Vec<f16>, WireError> {
        let bytes = self.take(n.checked_mul(2).ok_or(WireError::Malformed("value count overflows"))?)?;
        Ok(bytes
            .chunks_exact(2)
            .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames() -> Vec<Frame> {
        let data = PageData {
            written: 2,
            k: (0..8).map(|i| f16::from_f32(i as f32 * 0.5)).collect(),
            v: (0..8).map(|i| f16::from_f32(-(i as f32))).collect(),
            checksum: 0xdead_beef_0123_4567,
        };
        vec![
            Frame::Begin {
                seq: 7,
                owner: crate::testutil::tenant(3),
                tokens: 37,
            },
            Frame::Batch {
                seq: 7,
                owner: crate::testutil::tenant(3),
                number: 0,
                pages: vec![
                    PageFrame {
                        index: 0,
                        first: 0,
                        data: data.clone(),
                    },
                    PageFrame {
                        index: 1,
                        first: 4,
                        data,
                    },
                ],
            },
            Frame::End {
                seq: 7,
                batches: 1,
                tokens: 37,
            },
            Frame::Ack { seq: 7, number: 0 },
            Frame::Abort {
                seq: 7,
                reason: "client went away".into(),
            },
        ]
    }

    #[test]
    fn every_frame_round_trips_and_a_stream_splits_into_frames() {
        let mut stream = Vec::new();
        for f in frames() {
            let b = f.encode();
            assert_eq!(f.encoded_len(), b.len(), "{f:?}");
            assert_eq!(Frame::decode(&b, 1 << 20).unwrap(), (f.clone(), b.len()));
            stream.extend(b);
        }
        let mut at = 0;
        let mut got = Vec::new();
        while at < stream.len() {
            let (f, n) = Frame::decode(&stream[at..], 1 << 20).unwrap();
            got.push(f);
            at += n;
        }
        assert_eq!(got, frames());
    }

    #[test]
    fn truncated_oversized_and_malformed_bytes_are_refused() {
        let b = frames()[1].encode();
        for cut in [0, 3, 4, 10, b.len() - 1] {
            assert!(
                matches!(Frame::decode(&b[..cut], 1 << 20), Err(WireError::Incomplete { .. })),
                "cut at {cut}"
            );
        }
        assert!(matches!(Frame::decode(&b, 16), Err(WireError::TooLarge { .. })));
        // A length prefix that shortens the body: the fields run past it.
        let mut short = b.clone();
        short[..4].copy_from_slice(&((b.len() - 4 - 2) as u32).to_le_bytes());
        assert!(matches!(Frame::decode(&short, 1 << 20), Err(WireError::Malformed(_))));
        // Trailing bytes inside the body.
        let mut long = frames()[3].encode();
        long.push(0);
        let n = (long.len() - 4) as u32;
        long[..4].copy_from_slice(&n.to_le_bytes());
        assert!(matches!(Frame::decode(&long, 1 << 20), Err(WireError::Malformed(_))));
        // A page count the body cannot hold allocates nothing.
        let mut lie = frames()[1].encode();
        lie[25..29].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(Frame::decode(&lie, 1 << 20), Err(WireError::Malformed(_))));
        let mut kind = frames()[3].encode();
        kind[4] = 99;
        assert_eq!(Frame::decode(&kind, 1 << 20), Err(WireError::UnknownKind(99)));
    }
}
