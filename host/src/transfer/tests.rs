//! The transfer protocol between two real pools, whole and under every fault the wire can
//! suffer: each fault fails the transfer with its error, leaves nothing marked written on the
//! receiver, and every page returns once both sides close.

use crate::kv::SeqId;
use warden_kernels::attention::AttnShape;

use super::wire::{Frame, WireError};
use super::{Inbound, Limits, Outbound, TransferError};
use crate::kv::KvPool;
use crate::tenant::TenantId;

const SHAPE: AttnShape = AttnShape {
    n_heads: 2,
    n_kv_heads: 1,
    head_dim: 4,
    page_size: 4,
};
const LAYERS: usize = 2;
const OWNER: TenantId = match TenantId::new(5) {
    Some(t) => t,
    None => panic!("5 is a tenant id"),
};
const TOKENS: usize = 37;
const SRC_SEQ: u64 = 1;
const DST_SEQ: u64 = 100;

fn pool(pages: usize) -> KvPool {
    KvPool::new(SHAPE, LAYERS, pages * KvPool::page_bytes(&SHAPE, LAYERS)).unwrap()
}

/// A sender pool whose sequence holds `TOKENS` positions of distinct K and V.
fn prefilled() -> KvPool {
    let mut p = pool(16);
    p.open(SeqId(SRC_SEQ), OWNER, TOKENS.div_ceil(4), &[]).unwrap();
    p.ensure(SeqId(SRC_SEQ), TOKENS).unwrap();
    p.commit_slots(SeqId(SRC_SEQ), TOKENS).unwrap();
    let table = p.table(SeqId(SRC_SEQ)).unwrap().1.to_vec();
    for layer in 0..LAYERS {
        for pos in 0..TOKENS {
            let k: Vec<f32> = (0..4).map(|j| (layer * 1000 + pos * 10 + j) as f32 / 64.0).collect();
            let v: Vec<f32> = k.iter().map(|x| -x).collect();
            p.write(layer, OWNER.into(), &table, pos, &k, &v).unwrap();
        }
    }
    p
}

/// What happens to the `n`th batch on the wire.
#[derive(Debug, Clone, Copy)]
enum Fault {
    None,
    Drop(u32),
    Truncate(u32),
    Corrupt(u32),
    Duplicate(u32),
    Reorder(u32),
    Retag(u32),
}

#[derive(Debug)]
enum Failed {
    Wire(WireError),
    Transfer(TransferError),
}

/// Runs a transfer from `src` to `dst` through encoded frames, with `fault` on the way; checks
/// the window on every send.
fn transfer(src: &KvPool, dst: &mut KvPool, limits: Limits, fault: Fault) -> Result<(), Failed> {
    let mut out = Outbound::new(src, SeqId(SRC_SEQ), OWNER, TOKENS, limits);
    let begin = Frame::decode(&out.begin().encode(), 1 << 20).map_err(Failed::Wire)?.0;
    let mut inb = Inbound::begin(dst, SeqId(DST_SEQ), OWNER, begin).map_err(Failed::Transfer)?;
    let mut held: Option<Vec<u8>> = None;
    while !out.done() {
        let mut wire: Vec<Vec<u8>> = Vec::new();
        while let Some(f) = out.next_frame(src).map_err(Failed::Transfer)? {
            let (n, bytes) = out.in_flight();
            assert!(n <= limits.batches_in_flight, "{n} batches in flight");
            assert!(
                n <= 1 || bytes <= limits.bytes_in_flight + 4096,
                "{bytes} bytes in flight"
            );
            let number = match &f {
                Frame::Batch { number, .. } => Some(*number),
                _ => None,
            };
            let mut f = f;
            if let (Fault::Retag(x), Some(n)) = (fault, number)
                && x == n
                && let Frame::Batch { owner, .. } = &mut f
            {
                *owner = crate::testutil::tenant(6);
            }
            let mut b = f.encode();
            match (fault, number) {
                (Fault::Drop(x), Some(n)) if x == n => continue,
                (Fault::Truncate(x), Some(n)) if x == n => {
                    // Cut the body short but keep a consistent prefix: the fields run out.
                    let cut = b.len() - 7;
                    b.truncate(cut);
                    let len = (cut - 4) as u32;
                    b[..4].copy_from_slice(&len.to_le_bytes());
                }
                (Fault::Corrupt(x), Some(n)) if x == n => {
                    let last = b.len() - 1;
                    b[last] ^= 0x40;
                }
                (Fault::Duplicate(x), Some(n)) if x == n => wire.push(b.clone()),
                (Fault::Reorder(x), Some(n)) if x == n => {
                    held = Some(b);
                    continue;
                }
                _ => {}
            }
            wire.push(b);
            if let Some(h) = held.take_if(|_| matches!(fault, Fault::Reorder(x) if number == Some(x + 1))) {
                wire.push(h);
            }
        }
        if wire.is_empty() {
            // Everything in flight was lost: the sender sends End when it runs out of pages,
            // so a drop shows at End; reaching here means nothing more can move.
            panic!("the transfer stalled");
        }
        for b in wire {
            let f = Frame::decode(&b, 1 << 20).map_err(Failed::Wire)?.0;
            let ack = inb.receive(dst, f).map_err(Failed::Transfer)?;
            out.receive(ack).map_err(Failed::Transfer)?;
        }
    }
    Ok(())
}

fn limits() -> Limits {
    Limits {
        pages_per_batch: 3,
        batches_in_flight: 2,
        bytes_in_flight: 1 << 20,
    }
}

/// The receiver's pool with its sequence opened by its own admission.
fn receiver() -> KvPool {
    let mut p = pool(16);
    p.open(SeqId(DST_SEQ), OWNER, TOKENS.div_ceil(4) + 2, &[]).unwrap();
    p
}

fn assert_all_free(p: &mut KvPool, seq: u64) {
    p.close(SeqId(seq)).unwrap();
    let c = p.counters();
    assert_eq!(
        (c.pages_free, c.pages_used, c.pages_reserved),
        (c.pages_total, 0, 0),
        "{c:?}"
    );
}

#[test]
fn a_transfer_moves_every_page_exactly_and_marks_it_written_only_at_the_end() {
    let mut src = prefilled();
    for lim in [
        limits(),
        Limits {
            pages_per_batch: 1,
            batches_in_flight: 1,
            bytes_in_flight: 1,
        },
        Limits::default(),
    ] {
        let mut dst = receiver();
        transfer(&src, &mut dst, lim, Fault::None).unwrap_or_else(|e| panic!("{lim:?}: {e:?}"));
        let theirs = src.handles(SeqId(SRC_SEQ)).unwrap().1;
        let ours = dst.handles(SeqId(DST_SEQ)).unwrap().1;
        assert_eq!(ours.len(), TOKENS.div_ceil(4), "exactly the pages the prompt needs");
        for (a, b) in theirs.iter().zip(&ours) {
            let (x, y) = (src.inspect(OWNER, *a).unwrap(), dst.inspect(OWNER, *b).unwrap());
            assert_eq!((x.written, x.checksum), (y.written, y.checksum));
        }
        assert_eq!(dst.counters().tag_mismatches, 0);
        assert_all_free(&mut dst, DST_SEQ);
    }
    assert_all_free(&mut src, SRC_SEQ);
}

#[test]
fn every_wire_fault_fails_the_transfer_and_leaves_nothing_written() {
    let src = prefilled();
    use TransferError as T;
    type Expect = fn(&Failed) -> bool;
    let cases: [(Fault, Expect); 6] = [
        (Fault::Drop(1), |e| {
            matches!(e, Failed::Transfer(T::OutOfOrder { expected: 1, got: 2 }))
        }),
        (Fault::Truncate(2), |e| {
            matches!(e, Failed::Wire(WireError::Malformed(_)))
        }),
        (Fault::Corrupt(0), |e| {
            matches!(e, Failed::Transfer(T::Kv(crate::kv::KvError::PageChecksum { .. })))
        }),
        (Fault::Duplicate(1), |e| {
            matches!(e, Failed::Transfer(T::OutOfOrder { expected: 2, got: 1 }))
        }),
        (Fault::Reorder(1), |e| {
            matches!(e, Failed::Transfer(T::OutOfOrder { expected: 1, got: 2 }))
        }),
        (Fault::Retag(2), |e| {
            matches!(
                e,
                Failed::Transfer(T::WrongOwner { expected, got })
                    if *expected == OWNER && got.get() == 6
            )
        }),
    ];
    for (fault, want) in cases {
        let mut dst = receiver();
        let e = transfer(&src, &mut dst, limits(), fault).expect_err("the fault must fail the transfer");
        assert!(want(&e), "{fault:?}: {e:?}");
        let table = dst.table(SeqId(DST_SEQ)).unwrap().1.to_vec();
        for e in table {
            assert_eq!(
                dst.tags()[e.page as usize].written,
                0,
                "{fault:?}: a page was marked written"
            );
        }
        assert_all_free(&mut dst, DST_SEQ);
    }
}

#[test]
fn the_last_batch_lost_shows_at_end_as_incomplete() {
    let src = prefilled();
    let mut dst = receiver();
    // 37 tokens are 10 pages: batches 0..=3 of 3 pages; losing batch 3 leaves End to tell.
    let e = transfer(&src, &mut dst, limits(), Fault::Drop(3)).expect_err("incomplete");
    assert!(
        matches!(
            e,
            Failed::Transfer(TransferError::Incomplete {
                pages_received: 9,
                pages: 10,
                ..
            })
        ),
        "{e:?}"
    );
    assert_all_free(&mut dst, DST_SEQ);
}

#[test]
fn a_transfer_for_another_tenant_or_sequence_is_refused() {
    let src = prefilled();
    let mut dst = receiver();
    let out = Outbound::new(&src, SeqId(SRC_SEQ), OWNER, TOKENS, limits());
    let e = Inbound::begin(
        &mut dst,
        SeqId(DST_SEQ),
        crate::testutil::tenant(OWNER.get() + 1),
        out.begin(),
    )
    .unwrap_err();
    assert!(matches!(e, TransferError::WrongOwner { .. }), "{e:?}");
    let mut inb = Inbound::begin(&mut dst, SeqId(DST_SEQ), OWNER, out.begin()).unwrap();
    let stray = Frame::End {
        seq: SRC_SEQ + 1,
        batches: 0,
        tokens: TOKENS as u32,
    };
    assert!(matches!(
        inb.receive(&mut dst, stray),
        Err(TransferError::WrongSequence { .. })
    ));
    assert!(matches!(
        inb.receive(
            &mut dst,
            Frame::Abort {
                seq: SRC_SEQ,
                reason: "client went away".into()
            }
        ),
        Err(TransferError::Aborted(_))
    ));
    assert_all_free(&mut dst, DST_SEQ);
}
