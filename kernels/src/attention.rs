//! Paged attention that checks a tag on every page before it reads it (invariant 2).
//!
//! K and V for one layer live in pages of `page_size` token slots; a sequence names its pages
//! through a page table of [`PageEntry`]s, each carrying the allocation epoch the sequence expects.
//! Before any byte of a page is read, [`check_pages`] (in [`crate::tag`]) must find its [`PageTag`]
//! showing the reader's owner, the expected epoch, and at least as many written slots as the read
//! covers; otherwise the sequence fails with an [`IsolationViolation`] and its output rows are
//! zeroed, so no data from the page reaches it.

use half::f16;
use rayon::prelude::*;

use crate::ops::{axpy, exp_in_place};
use crate::tag::{IsolationViolation, Owner, PageEntry, PageTag, TagCheck, check_page_range};

/// Shape of the KV cache and of the attention heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnShape {
    /// Query heads.
    pub n_heads: usize,
    /// KV heads (GQA: `n_heads` is a multiple).
    pub n_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Token slots per page.
    pub page_size: usize,
}

impl AttnShape {
    /// Elements of K (or V) per token slot.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Elements of K (or V) per page.
    pub fn page_elems(&self) -> usize {
        self.page_size * self.kv_dim()
    }
}

/// One layer's K and V storage: `pages × page_size × n_kv_heads × head_dim` f16 each.
#[derive(Debug, Clone, Copy)]
pub struct KvLayer<'a> {
    /// Keys.
    pub k: &'a [f16],
    /// Values.
    pub v: &'a [f16],
}

/// What one layer's attention computes beyond the shape: the score scale, and the window of
/// earlier positions a query sees.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnKind {
    /// Multiplies every query·key score (commonly `1/√head_dim`).
    pub scale: f32,
    /// A query at position `p` sees keys at `p − window < position ≤ p` (llama.cpp's standard
    /// sliding window); `None` sees every earlier position.
    pub window: Option<usize>,
}

impl AttnKind {
    /// Full causal attention scaled by `1/√head_dim`.
    pub fn causal(head_dim: usize) -> Self {
        Self {
            scale: 1.0 / (head_dim as f32).sqrt(),
            window: None,
        }
    }

    /// The first position a query at `pos` sees.
    pub fn first_visible(&self, pos: usize) -> usize {
        self.window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }
}

/// One sequence's part of an attention batch.
#[derive(Debug, Clone, Copy)]
pub struct AttnSeq<'a> {
    /// The reader: its tenant, or the public prefixes while the server computes one.
    pub owner: Owner,
    /// Its page table.
    pub pages: &'a [PageEntry],
    /// Position of its first new token (tokens before it are already in the cache).
    pub pos0: usize,
    /// New tokens this step: its rows of `q` and `out`.
    pub n_new: usize,
    /// Whether its new tokens are prompt tokens, which take llama.cpp's prefill attention
    /// (`ggml_compute_forward_flash_attn_ext_tiled`): queries in f32, scores scaled after the dot
    /// product, an online softmax over tiles of [`KV_TILE`] keys aligned by position, an f32
    /// running output. Output tokens take its one-query decode attention: queries rounded to f16
    /// and pre-scaled, the maximum followed key by key, the running output kept in f16. The
    /// choice is the token's, never the step's: a row's attention is the same however its
    /// prompt was chunked, batched with others or found in the prefix cache. The prefill form is
    /// also the more exact (no f16 rounding) and the faster (no conversions in its inner loop).
    pub tiled: bool,
}

/// Causal attention for a batch of sequences over their pages.
///
/// `q` holds every sequence's new tokens' queries, in batch order (`Σ n_new` rows of
/// `n_heads · head_dim`), already rotated; `out` receives the attention output in the same layout.
/// Each sequence's new tokens attend to all its earlier positions (or those in `kind`'s window)
/// and to themselves causally, reading `first..pos0+n_new` from its pages, where `first` is the
/// first position its first new token sees: pages wholly before it are neither read nor checked. Returns one result per sequence; a sequence whose tags
/// fail gets zeroed output rows and its violation.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    kv: KvLayer<'_>,
    tags: &[PageTag],
    shape: &AttnShape,
    kind: &AttnKind,
    seqs: &[AttnSeq<'_>],
    q: &[f32],
    out: &mut [f32],
    check: TagCheck,
) -> Vec<Result<(), IsolationViolation>> {
    let qdim = shape.n_heads * shape.head_dim;
    let total: usize = seqs.iter().map(|s| s.n_new).sum();
    assert!(q.len() == total * qdim && out.len() == q.len(), "attention q/out shape");
    assert!(shape.n_kv_heads > 0 && shape.n_heads.is_multiple_of(shape.n_kv_heads));
    let results: Vec<_> = seqs
        .iter()
        .map(|s| {
            let from = kind.first_visible(s.pos0);
            check_page_range(s.owner, s.pages, from, s.pos0 + s.n_new, shape.page_size, tags, check)
        })
        .collect();
    // Tasks: (sequence, kv head, query range) for sequences whose pages passed. Each sequence's
    // queries are split into parts of equal causal work, as many as the pool needs to balance
    // (a single long prefill has only `n_kv_heads` heads to share out).
    let live = results.iter().filter(|r| r.is_ok()).count();
    let parts = (4 * rayon::current_num_threads()).div_ceil((live * shape.n_kv_heads).max(1));
    let mut tasks = Vec::new();
    let mut row0 = 0;
    for (si, s) in seqs.iter().enumerate() {
        if results[si].is_ok() {
            let bounds = causal_split(s.pos0, s.n_new, parts.min(s.n_new.div_ceil(QCHUNK)));
            for h in 0..shape.n_kv_heads {
                for w in bounds.windows(2) {
                    tasks.push((si, row0, h, w[0], w[1]));
                }
            }
        }
        row0 += s.n_new;
    }
    let outputs: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|&(si, row0, h, a, b)| attend_one(kv, shape, kind, &seqs[si], &q[row0 * qdim..], h, a, b))
        .collect();
    out.fill(0.0);
    let group = shape.n_heads / shape.n_kv_heads;
    let hd = shape.head_dim;
    for (&(_, row0, h, a, b), o) in tasks.iter().zip(&outputs) {
        for i in a..b {
            for g in 0..group {
                let hq = h * group + g;
                let src = &o[((i - a) * group + g) * hd..][..hd];
                out[(row0 + i) * qdim + hq * hd..][..hd].copy_from_slice(src);
            }
        }
    }
    results
}

/// Queries scored together: bounds the score buffer to `QCHUNK · group` rows.
pub const QCHUNK: usize = 32;

/// Keys per tile of the prefill path ([`AttnSeq::tiled`]), aligned to multiples of it by position.
const KV_TILE: usize = 64;

/// Splits queries `0..n` (query `i` sees `pos0 + i + 1` keys) into at most `parts` ranges of about
/// equal work; returns the range bounds, from 0 to `n`.
fn causal_split(pos0: usize, n: usize, parts: usize) -> Vec<usize> {
    let parts = parts.clamp(1, n.max(1));
    let work = |k: usize| k * pos0 + k * (k + 1) / 2;
    let total = work(n);
    let mut bounds = vec![0];
    let mut k = 0;
    for p in 1..parts {
        let target = total * p / parts;
        while k < n && work(k) < target {
            k += 1;
        }
        if k > *bounds.last().unwrap_or(&0) && k < n {
            bounds.push(k);
        }
    }
    bounds.push(n);
    bounds
}

/// One KV head's query group for queries `a..b` of one sequence; returns
/// `(b−a) × group × head_dim` outputs.
#[allow(clippy::too_many_arguments)]
fn attend_one(
    kv: KvLayer<'_>,
    shape: &AttnShape,
    kind: &AttnKind,
    s: &AttnSeq<'_>,
    q: &[f32],
    h: usize,
    a: usize,
    b: usize,
) -> Vec<f32> {
    thread_local! {
        /// Per-thread buffers (K transposed, V, queries, scores), reused across calls.
        static BUFS: std::cell::RefCell<Buffers> = std::cell::RefCell::new(Buffers::default());
    }
    BUFS.with_borrow_mut(|bufs| attend_gathered(kv, shape, kind, s, q, h, a, b, bufs))
}

#[derive(Default)]
struct Buffers {
    kt: Vec<f32>,
    vals: Vec<f32>,
    qs: Vec<f32>,
    scores: Vec<f32>,
    rise_at: Vec<usize>,
    rise_by: Vec<f32>,
    row: Vec<f32>,
    /// The tiled path's tile ends, factors per row and tile, and sums per row.
    ends: Vec<usize>,
    by: Vec<f32>,
    sums: Vec<f32>,
}

/// Rows whose tiled weighted sums are computed together (sixteen accumulator registers of
/// AVX-512 at four per row).
const TILED_ROWS: usize = 4;

/// Query rows per task up to which keys are kept in rows rather than transposed.
const ROW_MAJOR_ROWS: usize = 4;

/// Key columns are padded to a multiple of this, for the SIMD score loop.
const KEY_BLOCK: usize = 16;

/// Which SIMD path the score and weighted-sum loops take. Every path computes each output lane
/// with the same operations in the same order, so all of them equal the scalar reference bit for
/// bit; the tests check each one this CPU has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Isa {
    Scalar,
    /// AVX2 with FMA and F16C: eight lanes.
    Avx2,
    /// AVX-512F: sixteen lanes.
    Avx512,
}

impl Isa {
    /// The widest path this CPU supports.
    fn best() -> Isa {
        if crate::ops::has_avx512() {
            Isa::Avx512
        } else if crate::ops::has_avx2() {
            Isa::Avx2
        } else {
            Isa::Scalar
        }
    }

    /// Every path this CPU supports, the reference first.
    #[cfg(test)]
    fn available() -> Vec<Isa> {
        let mut v = vec![Isa::Scalar];
        if crate::ops::has_avx2() {
            v.push(Isa::Avx2);
        }
        if crate::ops::has_avx512() {
            v.push(Isa::Avx512);
        }
        v
    }
}

/// [`attend_one`] with its buffers. The visible K/V are gathered into f32 once for the whole
/// range (K transposed, so scores for many keys come out of one pass with no horizontal sums),
/// growing chunk by chunk; then each query row's scores, softmax and weighted sum of V.
#[allow(clippy::too_many_arguments)]
fn attend_gathered(
    kv: KvLayer<'_>,
    shape: &AttnShape,
    kind: &AttnKind,
    s: &AttnSeq<'_>,
    q: &[f32],
    h: usize,
    a: usize,
    b: usize,
    bufs: &mut Buffers,
) -> Vec<f32> {
    let hd = shape.head_dim;
    let kvd = shape.kv_dim();
    let ps = shape.page_size;
    let group = shape.n_heads / shape.n_kv_heads;
    let qdim = shape.n_heads * hd;
    let scale = kind.scale;
    let isa = Isa::best();
    let tiled = s.tiled;
    // Keys are gathered from the first position the range's first query sees (`base`, 0 without
    // a window) to the last one its last query sees; buffers are indexed from `base`.
    let base = kind.first_visible(s.pos0 + a);
    let ld = (s.pos0 + b - base).div_ceil(KEY_BLOCK) * KEY_BLOCK;
    // Decode (a query or two per head group): transposing K costs more than the scores it
    // speeds up, so keys stay in rows and each score is one dot product.
    let by_rows = !tiled && (b - a) * group <= ROW_MAJOR_ROWS;
    if by_rows {
        bufs.kt.resize((s.pos0 + b - base) * hd, 0.0);
    } else {
        bufs.kt.clear();
        bufs.kt.resize(hd * ld, 0.0);
    }
    bufs.vals.resize((s.pos0 + b - base) * hd, 0.0);
    bufs.row.resize(hd, 0.0);
    let mut out = vec![0f32; (b - a) * group * hd];
    let mut gathered = base;
    for c0 in (a..b).step_by(QCHUNK) {
        let c1 = (c0 + QCHUNK).min(b);
        let ctx = s.pos0 + c1;
        for pos in gathered..ctx {
            let e = s.pages[pos / ps];
            let at = (e.page as usize * ps + pos % ps) * kvd + h * hd;
            let j = pos - base;
            if by_rows {
                half::slice::HalfFloatSliceExt::convert_to_f32_slice(
                    &kv.k[at..at + hd],
                    &mut bufs.kt[j * hd..(j + 1) * hd],
                );
            } else {
                half::slice::HalfFloatSliceExt::convert_to_f32_slice(&kv.k[at..at + hd], &mut bufs.row);
                for (d, &k) in bufs.row.iter().enumerate() {
                    bufs.kt[d * ld + j] = k;
                }
            }
            half::slice::HalfFloatSliceExt::convert_to_f32_slice(
                &kv.v[at..at + hd],
                &mut bufs.vals[j * hd..(j + 1) * hd],
            );
        }
        gathered = ctx;
        // The chunk's query rows (query i, head g of the group). Off the tiled path they are
        // pre-scaled and rounded to f16 first, as llama.cpp does before its f16 K·Q dot products:
        // the model's logits are sensitive enough that this keeps them within 0.3 of llama.cpp's
        // rather than 0.6.
        bufs.qs.clear();
        for i in c0..c1 {
            for g in 0..group {
                let hq = h * group + g;
                let qr = &q[i * qdim + hq * hd..][..hd];
                if tiled {
                    bufs.qs.extend_from_slice(qr);
                } else {
                    round_to_f16_scaled(qr, scale, &mut bufs.qs);
                }
            }
        }
        let rows = (c1 - c0) * group;
        let cols = (ctx - base).div_ceil(KEY_BLOCK) * KEY_BLOCK;
        bufs.scores.resize(rows * cols, 0.0);
        if by_rows {
            for (qr, out) in bufs.qs.chunks_exact(hd).zip(bufs.scores.chunks_exact_mut(cols)) {
                for (o, k) in out.iter_mut().zip(bufs.kt[..(ctx - base) * hd].chunks_exact(hd)) {
                    *o = score_dot(qr, k);
                }
            }
        } else {
            scores(isa, &bufs.qs, hd, &bufs.kt, ld, cols, &mut bufs.scores[..rows * cols]);
        }
        if tiled {
            // A query's rows (its group's heads) see the same keys in the same tiles: their
            // weighted sums go together, each value row read once for up to four of them.
            for i in 0..c1 - c0 {
                let p = s.pos0 + c0 + i;
                let first = kind.first_visible(p) - base;
                let n = p + 1 - base - first;
                tile_ends(base + first, n, &mut bufs.ends);
                let nt = bufs.ends.len();
                let r0 = i * group;
                bufs.by.clear();
                bufs.sums.clear();
                for g in 0..group {
                    let sc = &mut bufs.scores[(r0 + g) * cols + first..][..n];
                    let sum = tiled_weights(
                        sc,
                        &bufs.ends,
                        scale,
                        &mut bufs.rise_at,
                        &mut bufs.rise_by,
                        &mut bufs.by,
                    );
                    bufs.sums.push(sum);
                }
                let o = &mut out[((c0 - a) * group + r0) * hd..][..group * hd];
                for g0 in (0..group).step_by(TILED_ROWS) {
                    let g1 = (g0 + TILED_ROWS).min(group);
                    weighted_sum_tiled(
                        isa,
                        &bufs.scores[(r0 + g0) * cols + first..],
                        cols,
                        &bufs.ends,
                        &bufs.by[g0 * nt..g1 * nt],
                        &bufs.vals[first * hd..],
                        &mut o[g0 * hd..g1 * hd],
                    );
                }
                for (row, &sum) in o.chunks_exact_mut(hd).zip(&bufs.sums) {
                    let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
                    row.iter_mut().for_each(|v| *v *= inv);
                }
            }
        } else {
            for r in 0..rows {
                // Query `c0 + r/group` at position `p` sees `first..=p`.
                let p = s.pos0 + c0 + r / group;
                let first = kind.first_visible(p) - base;
                let sc = &mut bufs.scores[r * cols + first..r * cols + p + 1 - base];
                let o = &mut out[((c0 - a) * group + r) * hd..][..hd];
                softmax_v_f16(
                    isa,
                    sc,
                    &mut bufs.rise_at,
                    &mut bufs.rise_by,
                    &bufs.vals[first * hd..],
                    o,
                );
            }
        }
    }
    out
}

/// Appends `round_f16(x) · scale` for each `x` of `src` to `dst`.
fn round_to_f16_scaled(src: &[f32], scale: f32, dst: &mut Vec<f32>) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if crate::ops::has_avx2() {
        // SAFETY: avx2, fma and f16c were detected at run time.
        done = unsafe { simd::round_to_f16_scaled(src, scale, dst) };
    }
    dst.extend(src[done..].iter().map(|v| f16::from_f32(*v).to_f32() * scale));
}

/// One query-key score as llama.cpp's decode computes it (`ggml_vec_dot_f16`): four 8-lane
/// accumulators over 32-element steps, reduced pairwise in its order. Greedy decoding is
/// sensitive to the summation order of near-tied scores.
fn score_dot(q: &[f32], k: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if crate::ops::has_avx2() && q.len().is_multiple_of(32) {
        // SAFETY: avx2 and fma were detected at run time; the lengths are checked inside.
        return unsafe { simd::score_dot(q, k) };
    }
    crate::ops::dot(q, k)
}

/// `out[r·cols + j] = q_r · k_j` for every query row `r` of `qs` (rows of `hd`) and every key
/// column `j < cols` of `kt` (`hd × ld`, transposed keys).
fn scores(isa: Isa, qs: &[f32], hd: usize, kt: &[f32], ld: usize, cols: usize, out: &mut [f32]) {
    let rows = qs.len() / hd;
    assert!(
        qs.len() == rows * hd
            && kt.len() == hd * ld
            && out.len() == rows * cols
            && cols <= ld
            && cols.is_multiple_of(KEY_BLOCK)
    );
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx512` is only chosen where avx512f was detected at run time; the
        // shapes were asserted above.
        Isa::Avx512 => return unsafe { simd::scores_avx512(qs, hd, kt, ld, cols, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx2` is only chosen where avx2 and fma were detected at run time; the
        // shapes were asserted above.
        Isa::Avx2 => return unsafe { simd::scores(qs, hd, kt, ld, cols, out) },
        _ => {}
    }
    for r in 0..rows {
        let o = &mut out[r * cols..(r + 1) * cols];
        o.fill(0.0);
        for d in 0..hd {
            axpy(qs[r * hd + d], &kt[d * ld..d * ld + cols], o);
        }
    }
}

/// `out = softmax(sc) · V` the way llama.cpp's CPU flash attention computes it with an f16 KV
/// cache: an online softmax whose running output is kept in f16 — rescaled whenever a new maximum
/// appears, and rounded to f16 after every added value row — then divided by the f32 sum. (Our
/// logits then stay within 0.5 of llama.cpp's, as its reference outputs demand; an f32 running
/// output drifts further.) `sc` holds the raw scores and is overwritten; `rise_at` and `rise_by`
/// are scratch.
fn softmax_v_f16(
    isa: Isa,
    sc: &mut [f32],
    rise_at: &mut Vec<usize>,
    rise_by: &mut Vec<f32>,
    vals: &[f32],
    out: &mut [f32],
) {
    let hd = out.len();
    assert!(vals.len() >= sc.len() * hd);
    // Running maxima: key j is weighed by e^(s_j − m_j), and where the maximum rises (key
    // `rise_at[k]`) the output so far is first rescaled by `rise_by[k]` = e^(m_{j−1} − m_j).
    subtract_running_max(sc, rise_at, rise_by);
    exp_in_place(sc);
    exp_in_place(rise_by);
    let mut sum = 0f32;
    for (k, &start) in rise_at.iter().enumerate() {
        let end = rise_at.get(k + 1).copied().unwrap_or(sc.len());
        sum *= rise_by[k];
        for &w in &sc[start..end] {
            sum += w;
        }
    }
    weighted_sum(isa, sc, rise_at, rise_by, vals, sum, out);
}

/// The weighted sum of [`softmax_v_f16`] (the running output rounded to f16 after every
/// operation, then divided by `sum`) on path `isa`. Every element of the output is computed on
/// its own, so the SIMD paths take heads of any multiple of 64 a slice of columns at a time
/// (eight registers of sums), and others go element by element; each lane makes the scalar
/// loop's operations, so each path gives its bits.
fn weighted_sum(isa: Isa, w: &[f32], rise_at: &[usize], rise_by: &[f32], vals: &[f32], sum: f32, out: &mut [f32]) {
    let hd = out.len();
    // SAFETY (each call below): the path's CPU features were detected at run time (`Isa::best`);
    // `vals[c..]` holds `w.len()` rows `hd` apart with the slice's columns in each.
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if hd.is_multiple_of(128) => {
            for c in (0..hd).step_by(128) {
                let o = &mut out[c..c + 128];
                unsafe { simd::accumulate_avx512::<8>(w, rise_at, rise_by, &vals[c..], hd, sum, o) };
            }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if hd.is_multiple_of(64) => {
            for c in (0..hd).step_by(64) {
                let o = &mut out[c..c + 64];
                unsafe { simd::accumulate_avx512::<4>(w, rise_at, rise_by, &vals[c..], hd, sum, o) };
            }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 if hd.is_multiple_of(64) => {
            for c in (0..hd).step_by(64) {
                let o = &mut out[c..c + 64];
                unsafe { simd::accumulate_avx2::<8>(w, rise_at, rise_by, &vals[c..], hd, sum, o) };
            }
        }
        _ => accumulate_f16(w, rise_at, rise_by, vals, sum, out),
    }
}

/// The weighted sum of [`softmax_v_f16`] with its running output in f16, element by element (the
/// reference its SIMD path is tested against).
fn accumulate_f16(w: &[f32], rise_at: &[usize], rise_by: &[f32], vals: &[f32], sum: f32, out: &mut [f32]) {
    let hd = out.len();
    let mut acc = vec![f16::ZERO; hd];
    for (k, &start) in rise_at.iter().enumerate() {
        let end = rise_at.get(k + 1).copied().unwrap_or(w.len());
        for a in acc.iter_mut() {
            *a = f16::from_f32(a.to_f32() * rise_by[k]);
        }
        for j in start..end {
            for (a, &x) in acc.iter_mut().zip(&vals[j * hd..(j + 1) * hd]) {
                *a = f16::from_f32(a.to_f32() + x * w[j]);
            }
        }
    }
    for (o, a) in out.iter_mut().zip(&acc) {
        *o = a.to_f32() / sum;
    }
}

/// The ends of the tiles of `n` keys, the first at position `pos`: tiles of [`KV_TILE`]
/// positions aligned by position, so a key's tile does not depend on where its row's step began.
fn tile_ends(pos: usize, n: usize, ends: &mut Vec<usize>) {
    ends.clear();
    let mut end = 0;
    while end < n {
        end = (((pos + end) / KV_TILE + 1) * KV_TILE - pos).min(n);
        ends.push(end);
    }
}

/// The softmax weights of one prompt row as llama.cpp's tiled flash attention computes them:
/// the scores scaled after the dot product; at each tile (ends `ends`) whose maximum raises the
/// running maximum, the output and the sum so far rescaled by `e^(m_old − m_new)`; each key
/// weighed by `e^(s − m)` with the maximum after its tile; each tile's weights summed in f64 into
/// the f32 sum, which is returned. `sc` holds the raw dot products and becomes the weights; one
/// factor per tile is appended to `by` (1, which multiplies exactly, where the maximum did not
/// rise); `rose` and `rise_by` are scratch.
fn tiled_weights(
    sc: &mut [f32],
    ends: &[usize],
    scale: f32,
    rose: &mut Vec<usize>,
    rise_by: &mut Vec<f32>,
    by: &mut Vec<f32>,
) -> f32 {
    assert_eq!(ends.last(), Some(&sc.len()));
    rose.clear();
    rise_by.clear();
    sc.iter_mut().for_each(|v| *v *= scale);
    let mut m = f32::NEG_INFINITY;
    let mut j = 0;
    for (t, &end) in ends.iter().enumerate() {
        let tile_max = sc[j..end].iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        if tile_max > m {
            rose.push(t);
            rise_by.push(m - tile_max);
            m = tile_max;
        }
        sc[j..end].iter_mut().for_each(|v| *v -= m);
        j = end;
    }
    exp_in_place(sc);
    exp_in_place(rise_by);
    let at = by.len();
    by.resize(at + ends.len(), 1.0);
    for (&t, &f) in rose.iter().zip(rise_by.iter()) {
        by[at + t] = f;
    }
    let mut sum = 0f32;
    let mut j = 0;
    for (&f, &end) in by[at..].iter().zip(ends) {
        sum *= f;
        sum = (sum as f64 + sc[j..end].iter().map(|&w| w as f64).sum::<f64>()) as f32;
        j = end;
    }
    sum
}

/// The tiled path's weighted sums of up to [`TILED_ROWS`] rows sharing their keys and tiles,
/// left unscaled: row `r`'s weights are `w[r·wstride..]`, its factors `by[r·nt..(r+1)·nt]` for
/// `nt = ends.len()` tiles, its output `out[r·hd..(r+1)·hd]`; `vals` holds the value rows `hd`
/// apart. Each output element is computed on its own, as [`accumulate_tiled`] does, so every
/// path gives its bits.
fn weighted_sum_tiled(isa: Isa, w: &[f32], wstride: usize, ends: &[usize], by: &[f32], vals: &[f32], out: &mut [f32]) {
    let (nt, n) = (ends.len(), ends.last().copied().unwrap_or(0));
    let rows = by.len() / nt.max(1);
    let hd = out.len() / rows.max(1);
    assert!(
        (1..=TILED_ROWS).contains(&rows)
            && by.len() == rows * nt
            && out.len() == rows * hd
            && (rows - 1) * wstride + n <= w.len()
            && n * hd <= vals.len()
            && ends.windows(2).all(|e| e[0] < e[1])
    );
    /// Calls `simd::$f::<R>` for `rows` = R.
    #[cfg(target_arch = "x86_64")]
    macro_rules! by_rows {
        ($f:ident) => {
            match rows {
                1 => simd::$f::<1>(w, wstride, ends, by, vals, out),
                2 => simd::$f::<2>(w, wstride, ends, by, vals, out),
                3 => simd::$f::<3>(w, wstride, ends, by, vals, out),
                _ => simd::$f::<4>(w, wstride, ends, by, vals, out),
            }
        };
    }
    // SAFETY (each call below): the path's CPU features were detected at run time (`Isa::best`);
    // the shapes were asserted above and the head width is the kernel's multiple.
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if hd.is_multiple_of(64) => unsafe { by_rows!(accumulate_tiled_avx512) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 if hd.is_multiple_of(16) => unsafe { by_rows!(accumulate_tiled_avx2) },
        _ => accumulate_tiled(w, wstride, ends, by, vals, out),
    }
}

/// The scalar reference of [`weighted_sum_tiled`]: per row, `acc = 0`; at each tile `t`,
/// `acc ·= by[t]`; then `acc = fma(w_j, v_j, acc)` key by key.
fn accumulate_tiled(w: &[f32], wstride: usize, ends: &[usize], by: &[f32], vals: &[f32], out: &mut [f32]) {
    let nt = ends.len();
    let hd = out.len() / (by.len() / nt);
    out.fill(0.0);
    for (r, o) in out.chunks_exact_mut(hd).enumerate() {
        let mut j = 0;
        for (&f, &end) in by[r * nt..(r + 1) * nt].iter().zip(ends) {
            o.iter_mut().for_each(|a| *a *= f);
            for k in j..end {
                let wk = w[r * wstride + k];
                for (a, &v) in o.iter_mut().zip(&vals[k * hd..(k + 1) * hd]) {
                    *a = wk.mul_add(v, *a);
                }
            }
            j = end;
        }
    }
}

/// `sc[j] −= max(sc[..=j])`; records each `j` where that maximum rises, with the rise's
/// exponent `m_{j−1} − m_j` (−∞ for the first key).
fn subtract_running_max(sc: &mut [f32], rise_at: &mut Vec<usize>, rise_by: &mut Vec<f32>) {
    rise_at.clear();
    rise_by.clear();
    let mut m = f32::NEG_INFINITY;
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if crate::ops::has_avx2() {
        // SAFETY: avx2 was detected at run time.
        done = unsafe { simd::subtract_running_max(sc, &mut m, rise_at, rise_by) };
    }
    for (j, v) in sc.iter_mut().enumerate().skip(done) {
        if *v > m {
            rise_at.push(j);
            rise_by.push(m - *v);
            m = *v;
        }
        *v -= m;
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    /// As [`super::scores`], four query rows by sixteen keys per register tile.
    ///
    /// # Safety
    /// The CPU must support avx2 and fma; shapes as `super::scores` asserts.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn scores(qs: &[f32], hd: usize, kt: &[f32], ld: usize, cols: usize, out: &mut [f32]) {
        let rows = qs.len() / hd;
        let (qp, kp, op) = (qs.as_ptr(), kt.as_ptr(), out.as_mut_ptr());
        let mut r = 0;
        // SAFETY (pointer accesses): r + k < rows, d < hd, j + 16 ≤ cols ≤ ld: inside each buffer.
        unsafe {
            while r < rows {
                let nr = (rows - r).min(4);
                for j in (0..cols).step_by(16) {
                    let mut acc = [[_mm256_setzero_ps(); 2]; 4];
                    for d in 0..hd {
                        let k0 = _mm256_loadu_ps(kp.add(d * ld + j));
                        let k1 = _mm256_loadu_ps(kp.add(d * ld + j + 8));
                        for (k, a) in acc.iter_mut().enumerate().take(nr) {
                            let qv = _mm256_broadcast_ss(&*qp.add((r + k) * hd + d));
                            a[0] = _mm256_fmadd_ps(qv, k0, a[0]);
                            a[1] = _mm256_fmadd_ps(qv, k1, a[1]);
                        }
                    }
                    for (k, a) in acc.iter().enumerate().take(nr) {
                        _mm256_storeu_ps(op.add((r + k) * cols + j), a[0]);
                        _mm256_storeu_ps(op.add((r + k) * cols + j + 8), a[1]);
                    }
                }
                r += nr;
            }
        }
    }

    /// As [`super::score_dot`] for lengths that are multiples of 32.
    ///
    /// # Safety
    /// The CPU must support avx2 and fma.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn score_dot(q: &[f32], k: &[f32]) -> f32 {
        assert!(q.len() == k.len() && q.len().is_multiple_of(32));
        let mut acc = [_mm256_setzero_ps(); 4];
        for i in (0..q.len()).step_by(32) {
            for (j, a) in acc.iter_mut().enumerate() {
                // SAFETY: i + 8j + 8 ≤ len of both slices.
                unsafe {
                    *a = _mm256_fmadd_ps(
                        _mm256_loadu_ps(k.as_ptr().add(i + 8 * j)),
                        _mm256_loadu_ps(q.as_ptr().add(i + 8 * j)),
                        *a,
                    );
                }
            }
        }
        let s02 = _mm256_add_ps(acc[0], acc[2]);
        let s13 = _mm256_add_ps(acc[1], acc[3]);
        let s = _mm256_add_ps(s02, s13);
        let t0 = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
        let t1 = _mm_hadd_ps(t0, t0);
        _mm_cvtss_f32(_mm_hadd_ps(t1, t1))
    }

    /// [`super::subtract_running_max`] over the multiple-of-eight prefix of `sc`, with the running
    /// maximum in `m`; returns the prefix length. Eight scores at a time when none of them raises
    /// the maximum (the common case once a few keys are in), one at a time otherwise.
    ///
    /// # Safety
    /// The CPU must support avx2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn subtract_running_max(
        sc: &mut [f32],
        m: &mut f32,
        rise_at: &mut Vec<usize>,
        rise_by: &mut Vec<f32>,
    ) -> usize {
        let n = sc.len() / 8 * 8;
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 ≤ n ≤ sc.len().
            let v = unsafe { _mm256_loadu_ps(sc.as_ptr().add(i)) };
            let h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            let block_max = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps::<1>(h, h)));
            if block_max > *m {
                for (j, s) in sc[i..i + 8].iter_mut().enumerate() {
                    if *s > *m {
                        rise_at.push(i + j);
                        rise_by.push(*m - *s);
                        *m = *s;
                    }
                    *s -= *m;
                }
            } else {
                // SAFETY: as above.
                unsafe { _mm256_storeu_ps(sc.as_mut_ptr().add(i), _mm256_sub_ps(v, _mm256_set1_ps(*m))) };
            }
        }
        n
    }

    /// As [`super::round_to_f16_scaled`] over the multiple-of-eight prefix of `src`; returns its
    /// length.
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn round_to_f16_scaled(src: &[f32], scale: f32, dst: &mut Vec<f32>) -> usize {
        let n = src.len() / 8 * 8;
        let sv = _mm256_set1_ps(scale);
        dst.reserve(n);
        let at = dst.len();
        // SAFETY: i + 8 ≤ n ≤ src.len(); `dst` has room for `n` more floats, all written before
        // its length grows.
        unsafe {
            let d = dst.as_mut_ptr().add(at);
            for i in (0..n).step_by(8) {
                let v = _mm256_loadu_ps(src.as_ptr().add(i));
                let r = _mm256_cvtph_ps(_mm256_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT }>(v));
                _mm256_storeu_ps(d.add(i), _mm256_mul_ps(r, sv));
            }
            dst.set_len(at + n);
        }
        n
    }

    /// The two weighted-sum kernels of one instruction set, `$lanes` f32 lanes to a register
    /// `$v` with its intrinsics (`$zero`, `$splat`, ...; `$round` rounds a register to f16 and
    /// back). Each lane makes the scalar reference's operations in its order, so every
    /// instruction set gives the reference's bits.
    macro_rules! weighted_sum_kernels {
        (
            $feature:literal, $v:ty, $lanes:literal, $tiled_regs:literal,
            $accumulate:ident, $tiled:ident,
            zero: $zero:ident, splat: $splat:ident, load: $load:ident, store: $store:ident,
            add: $add:ident, mul: $mul:ident, div: $div:ident, fmadd: $fmadd:ident,
            round: $round:expr $(,)?
        ) => {
            /// [`super::weighted_sum`] for `head_dim == LANES·NV`: the running output lives in
            /// registers as f32 values rounded to f16 after every operation, which is exactly
            /// an f16 accumulator.
            ///
            /// # Safety
            #[doc = concat!("The CPU must support ", $feature, "; `vals` holds `w.len()` rows `stride` apart, each")]
            /// at least `LANES·NV` long, and `out` is `LANES·NV` long.
            #[allow(clippy::too_many_arguments)]
            #[target_feature(enable = $feature)]
            pub(super) unsafe fn $accumulate<const NV: usize>(
                w: &[f32],
                rise_at: &[usize],
                rise_by: &[f32],
                vals: &[f32],
                stride: usize,
                sum: f32,
                out: &mut [f32],
            ) {
                assert!(out.len() == $lanes * NV && (w.is_empty() || (w.len() - 1) * stride + $lanes * NV <= vals.len()));
                let round = $round;
                let mut acc = [$zero(); NV];
                for (k, (&start, &by)) in rise_at.iter().zip(rise_by).enumerate() {
                    let end = rise_at.get(k + 1).copied().unwrap_or(w.len());
                    let rv = $splat(by);
                    for a in acc.iter_mut() {
                        *a = round($mul(*a, rv));
                    }
                    for (j, &wj) in w.iter().enumerate().take(end).skip(start) {
                        let wv = $splat(wj);
                        // SAFETY: j < w.len(), so row j (LANES·NV values from `j·stride`) is
                        // inside `vals`.
                        let row = unsafe { vals.as_ptr().add(j * stride) };
                        for (i, a) in acc.iter_mut().enumerate() {
                            // SAFETY: as above.
                            let v = unsafe { $load(row.add($lanes * i)) };
                            // Multiply, then add (two roundings), as llama.cpp's f16 multiply-add does.
                            *a = round($add(*a, $mul(wv, v)));
                        }
                    }
                }
                let sv = $splat(sum);
                for (i, a) in acc.iter().enumerate() {
                    // SAFETY: `out` is LANES·NV long.
                    unsafe { $store(out.as_mut_ptr().add($lanes * i), $div(*a, sv)) };
                }
            }

            /// [`super::weighted_sum_tiled`] for `R` rows, `$tiled_regs` registers of columns per
            /// row at a time: each value row's slice is loaded once for all `R` rows.
            ///
            /// # Safety
            #[doc = concat!("The CPU must support ", $feature, "; shapes as `super::weighted_sum_tiled` asserts, for `R`")]
            /// rows, with the head width a multiple of the columns taken at a time.
            #[target_feature(enable = $feature)]
            pub(super) unsafe fn $tiled<const R: usize>(
                w: &[f32],
                wstride: usize,
                ends: &[usize],
                by: &[f32],
                vals: &[f32],
                out: &mut [f32],
            ) {
                const COLS: usize = $lanes * $tiled_regs;
                let nt = ends.len();
                let hd = out.len() / R;
                let (wp, vp, op) = (w.as_ptr(), vals.as_ptr(), out.as_mut_ptr());
                // SAFETY (pointer accesses): r < R, k < ends[nt−1], c + COLS ≤ hd: inside `w`,
                // `vals` and `out` by the caller's shapes.
                unsafe {
                    for c in (0..hd).step_by(COLS) {
                        let mut acc: [[$v; $tiled_regs]; R] = [[$zero(); $tiled_regs]; R];
                        let mut k = 0;
                        for (t, &end) in ends.iter().enumerate() {
                            for (r, a) in acc.iter_mut().enumerate() {
                                let f = $splat(*by.get_unchecked(r * nt + t));
                                for x in a.iter_mut() {
                                    *x = $mul(*x, f);
                                }
                            }
                            while k < end {
                                let row = vp.add(k * hd + c);
                                let v: [$v; $tiled_regs] = std::array::from_fn(|i| $load(row.add($lanes * i)));
                                for (r, a) in acc.iter_mut().enumerate() {
                                    let wv = $splat(*wp.add(r * wstride + k));
                                    for (x, &vi) in a.iter_mut().zip(&v) {
                                        *x = $fmadd(wv, vi, *x);
                                    }
                                }
                                k += 1;
                            }
                        }
                        for (r, a) in acc.iter().enumerate() {
                            for (i, x) in a.iter().enumerate() {
                                $store(op.add(r * hd + c + $lanes * i), *x);
                            }
                        }
                    }
                }
            }
        };
    }

    weighted_sum_kernels!(
        "avx2,fma,f16c", __m256, 8, 2,
        accumulate_avx2, accumulate_tiled_avx2,
        zero: _mm256_setzero_ps, splat: _mm256_set1_ps, load: _mm256_loadu_ps, store: _mm256_storeu_ps,
        add: _mm256_add_ps, mul: _mm256_mul_ps, div: _mm256_div_ps, fmadd: _mm256_fmadd_ps,
        round: |v: __m256| _mm256_cvtph_ps(_mm256_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT }>(v)),
    );

    weighted_sum_kernels!(
        "avx512f", __m512, 16, 4,
        accumulate_avx512, accumulate_tiled_avx512,
        zero: _mm512_setzero_ps, splat: _mm512_set1_ps, load: _mm512_loadu_ps, store: _mm512_storeu_ps,
        add: _mm512_add_ps, mul: _mm512_mul_ps, div: _mm512_div_ps, fmadd: _mm512_fmadd_ps,
        round: |v: __m512| _mm512_cvtph_ps(_mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v)),
    );

    /// As [`scores`], four query rows by 32 keys (16 at the end of an odd row) per register
    /// tile.
    ///
    /// # Safety
    /// The CPU must support avx512f; shapes as `super::scores` asserts.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scores_avx512(qs: &[f32], hd: usize, kt: &[f32], ld: usize, cols: usize, out: &mut [f32]) {
        let rows = qs.len() / hd;
        let (qp, kp, op) = (qs.as_ptr(), kt.as_ptr(), out.as_mut_ptr());
        let mut r = 0;
        // SAFETY (pointer accesses): r + k < rows, d < hd, j + 16·NK ≤ cols ≤ ld: inside each
        // buffer.
        unsafe {
            while r < rows {
                let nr = (rows - r).min(4);
                let mut j = 0;
                while j < cols {
                    if j + 32 <= cols {
                        score_tile::<2>(qp, hd, kp, ld, op, cols, r, nr, j);
                        j += 32;
                    } else {
                        score_tile::<1>(qp, hd, kp, ld, op, cols, r, nr, j);
                        j += 16;
                    }
                }
                r += nr;
            }
        }
    }

    /// Query rows `r..r + nr` against keys `j..j + 16·NK` for [`scores_avx512`].
    ///
    /// # Safety
    /// As [`scores_avx512`], with every access named there inside its buffer.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    unsafe fn score_tile<const NK: usize>(
        qp: *const f32,
        hd: usize,
        kp: *const f32,
        ld: usize,
        op: *mut f32,
        cols: usize,
        r: usize,
        nr: usize,
        j: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); NK]; 4];
        // SAFETY: the caller's contract.
        unsafe {
            for d in 0..hd {
                let mut k = [_mm512_setzero_ps(); NK];
                for (c, kc) in k.iter_mut().enumerate() {
                    *kc = _mm512_loadu_ps(kp.add(d * ld + j + 16 * c));
                }
                for (i, a) in acc.iter_mut().enumerate().take(nr) {
                    let qv = _mm512_set1_ps(*qp.add((r + i) * hd + d));
                    for (c, ac) in a.iter_mut().enumerate() {
                        *ac = _mm512_fmadd_ps(qv, k[c], *ac);
                    }
                }
            }
            for (i, a) in acc.iter().enumerate().take(nr) {
                for (c, ac) in a.iter().enumerate() {
                    _mm512_storeu_ps(op.add((r + i) * cols + j + 16 * c), *ac);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tag::TenantId;
    use proptest::prelude::*;

    /// Tenant `n`'s owner.
    fn o(n: u64) -> Owner {
        TenantId::new(n).expect("a tenant id").into()
    }

    struct Fixture {
        shape: AttnShape,
        k: Vec<f16>,
        v: Vec<f16>,
        tags: Vec<PageTag>,
    }

    fn val(i: usize, salt: usize) -> f32 {
        (((i * 2654435761 + salt * 40503) % 2001) as f32 / 1000.0) - 1.0
    }

    impl Fixture {
        fn new(shape: AttnShape, n_pages: usize) -> Self {
            let n = n_pages * shape.page_elems();
            Fixture {
                shape,
                k: (0..n).map(|i| f16::from_f32(val(i, 1))).collect(),
                v: (0..n).map(|i| f16::from_f32(val(i, 2))).collect(),
                tags: vec![PageTag::default(); n_pages],
            }
        }
        fn give(&mut self, pages: &[u32], owner: u64, positions: usize) -> Vec<PageEntry> {
            let ps = self.shape.page_size;
            pages
                .iter()
                .enumerate()
                .map(|(j, &p)| {
                    let t = &mut self.tags[p as usize];
                    t.owner = o(owner);
                    t.written = positions.saturating_sub(j * ps).min(ps) as u32;
                    PageEntry::own(p, t.epoch)
                })
                .collect()
        }
    }

    /// Dense causal attention over the positions gathered in order through the page table, each
    /// query seeing the `window` positions up to its own (all of them without one).
    fn dense(
        f: &Fixture,
        pages: &[PageEntry],
        pos0: usize,
        n_new: usize,
        q: &[f32],
        window: Option<usize>,
    ) -> Vec<f32> {
        let AttnShape {
            n_heads,
            n_kv_heads,
            head_dim: hd,
            page_size: ps,
        } = f.shape;
        let kvd = n_kv_heads * hd;
        let row = |store: &[f16], pos: usize, h: usize| -> Vec<f32> {
            let e = pages[pos / ps];
            let at = (e.page as usize * ps + pos % ps) * kvd + h * hd;
            store[at..at + hd].iter().map(|x| x.to_f32()).collect()
        };
        let mut out = vec![0f32; n_new * n_heads * hd];
        for i in 0..n_new {
            for hq in 0..n_heads {
                let h = hq / (n_heads / n_kv_heads);
                let qr = &q[(i * n_heads + hq) * hd..][..hd];
                let vis = pos0 + i + 1;
                let first = window.map_or(0, |w| vis.saturating_sub(w));
                let mut s: Vec<f64> = (first..vis)
                    .map(|j| {
                        row(&f.k, j, h)
                            .iter()
                            .zip(qr)
                            .map(|(a, b)| (*a as f64) * (*b as f64))
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s
                    .iter_mut()
                    .map(|x| {
                        *x = (*x - m).exp();
                        *x
                    })
                    .sum();
                for (j, p) in (first..vis).zip(&s) {
                    for (d, v) in row(&f.v, j, h).iter().enumerate() {
                        out[(i * n_heads + hq) * hd + d] += (p / z * *v as f64) as f32;
                    }
                }
            }
        }
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(40))]
        #[test]
        fn paged_equals_dense(
            kv_heads in 1usize..4, group in 1usize..4, hd in prop::sample::select(vec![4usize, 8, 12, 16, 64, 128]), ps in 1usize..9,
            pos0 in 0usize..40, n_new in 1usize..100, perm_seed in 0u64..1000,
            window in prop::option::of(1usize..50), tiled in any::<bool>(),
        ) {
            let shape = AttnShape { n_heads: kv_heads * group, n_kv_heads: kv_heads, head_dim: hd, page_size: ps };
            let positions = pos0 + n_new;
            let n_pages = positions.div_ceil(ps) + 3;
            let mut f = Fixture::new(shape, n_pages);
            // A shuffled page layout: the table names pages in a random order.
            let mut order: Vec<u32> = (0..n_pages as u32).collect();
            let mut s = perm_seed;
            for i in (1..order.len()).rev() {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1);
                order.swap(i, (s >> 33) as usize % (i + 1));
            }
            let table = f.give(&order[..positions.div_ceil(ps)], 7, positions);
            let q: Vec<f32> = (0..n_new * shape.n_heads * shape.head_dim).map(|i| val(i, 3)).collect();
            let mut out = vec![0f32; q.len()];
            let seqs = [AttnSeq { owner: o(7), pages: &table, pos0, n_new, tiled }];
            let kind = AttnKind { window, ..AttnKind::causal(hd) };
            let r = paged_attention(KvLayer { k: &f.k, v: &f.v }, &f.tags, &shape, &kind, &seqs, &q, &mut out, TagCheck::Enforce);
            prop_assert!(r[0].is_ok());
            let want = dense(&f, &table, pos0, n_new, &q, window);
            // The running output is kept in f16 (as llama.cpp keeps it) and rounded at every
            // position it takes in: its error grows like the square root of the positions (9 f16
            // ulps at 117, a case proptest found); reading a wrong page or slot is off by O(1).
            let tol = 1e-3 * (1.0 + (positions as f32).sqrt());
            for (a, b) in out.iter().zip(&want) {
                prop_assert!((a - b).abs() < tol, "{} vs {} (tolerance {})", a, b, tol);
            }
        }
    }

    const SHAPE: AttnShape = AttnShape {
        n_heads: 2,
        n_kv_heads: 1,
        head_dim: 8,
        page_size: 4,
    };

    #[test]
    fn causal_split_balances_work_and_covers_every_query() {
        assert_eq!(causal_split(0, 0, 4), vec![0, 0]);
        assert_eq!(causal_split(5, 1, 4), vec![0, 1]);
        for (pos0, n, parts) in [(0, 512, 3), (100, 64, 2), (0, 10, 10), (7, 33, 5)] {
            let b = causal_split(pos0, n, parts);
            assert_eq!((b[0], *b.last().unwrap()), (0, n));
            assert!(b.windows(2).all(|w| w[0] < w[1]) && b.len() <= parts + 1, "{b:?}");
        }
        // A 512-token prefill in three parts: each part's work within 2% of a third.
        let b = causal_split(0, 512, 3);
        let work = |a: usize, z: usize| (a..z).map(|i| i + 1).sum::<usize>() as f64;
        let third = work(0, 512) / 3.0;
        for w in b.windows(2) {
            assert!((work(w[0], w[1]) / third - 1.0).abs() < 0.02, "{b:?}");
        }
    }

    fn run(
        f: &Fixture,
        owner: u64,
        table: &[PageEntry],
        pos0: usize,
        n_new: usize,
    ) -> (Result<(), IsolationViolation>, Vec<f32>) {
        let q = vec![0.5f32; n_new * 16];
        let mut out = vec![1f32; q.len()];
        let seqs = [AttnSeq {
            owner: o(owner),
            pages: table,
            pos0,
            n_new,
            tiled: false,
        }];
        let mut r = paged_attention(
            KvLayer { k: &f.k, v: &f.v },
            &f.tags,
            &SHAPE,
            &AttnKind::causal(SHAPE.head_dim),
            &seqs,
            &q,
            &mut out,
            TagCheck::Enforce,
        );
        (r.remove(0), out)
    }

    /// Every SIMD weighted sum this CPU has equals the element-by-element one bit for bit, for
    /// heads of 64, 128, 192 and 256 (Gemma's), with the running maximum rising several times.
    #[test]
    fn simd_weighted_sum_equals_scalar() {
        println!("paths: {:?}", Isa::available());
        for (hd, isa) in [64, 128, 192, 256]
            .into_iter()
            .flat_map(|hd| Isa::available().into_iter().map(move |i| (hd, i)))
        {
            let n = 37;
            let scores: Vec<f32> = (0..n).map(|j| val(j, hd) * 6.0 + j as f32 * 0.2).collect();
            let vals: Vec<f32> = (0..n * hd).map(|i| val(i, 7)).collect();
            let (mut rise_at, mut rise_by) = (Vec::new(), Vec::new());
            let mut a = vec![0f32; hd];
            softmax_v_f16(isa, &mut scores.clone(), &mut rise_at, &mut rise_by, &vals, &mut a);
            let mut w = scores.clone();
            subtract_running_max(&mut w, &mut rise_at, &mut rise_by);
            assert!(rise_at.len() > 2, "the maximum rises");
            exp_in_place(&mut w);
            exp_in_place(&mut rise_by);
            let mut sum = 0f32;
            for (k, &start) in rise_at.iter().enumerate() {
                let end = rise_at.get(k + 1).copied().unwrap_or(n);
                sum *= rise_by[k];
                for &x in &w[start..end] {
                    sum += x;
                }
            }
            let mut b = vec![0f32; hd];
            accumulate_f16(&w, &rise_at, &rise_by, &vals, sum, &mut b);
            assert_eq!(a, b, "head width {hd}, {isa:?}");
        }
    }

    /// Every SIMD tiled weighted sum this CPU has equals the scalar one bit for bit, for one to
    /// four rows together, heads of 64, 128, 192 and 256, tiles cut mid-way by the row's start,
    /// and each row's maximum rising at different tiles.
    #[test]
    fn simd_tiled_weighted_sum_equals_scalar() {
        let n = 150usize;
        let mut ends = Vec::new();
        tile_ends(40, n, &mut ends);
        assert_eq!(ends, [24, 88, 150]);
        for (hd, rows) in [64, 128, 192, 256]
            .into_iter()
            .flat_map(|hd| (1..=4).map(move |r| (hd, r)))
        {
            let wstride = n + 10;
            let w: Vec<f32> = (0..rows * wstride).map(|j| (val(j, hd) + 1.0) * 0.5).collect();
            let vals: Vec<f32> = (0..n * hd).map(|i| val(i, 5)).collect();
            let by: Vec<f32> = (0..rows * ends.len())
                .map(|i| [0.0, 1.0, 0.25, 0.7, 1.0, 0.01][i % 6])
                .collect();
            let mut want = vec![0f32; rows * hd];
            accumulate_tiled(&w, wstride, &ends, &by, &vals, &mut want);
            assert!(want.iter().all(|v| v.is_finite()) && want.iter().any(|&v| v != 0.0));
            for isa in Isa::available() {
                let mut got = vec![f32::NAN; rows * hd];
                weighted_sum_tiled(isa, &w, wstride, &ends, &by, &vals, &mut got);
                assert_eq!(got, want, "head width {hd}, {rows} rows, {isa:?}");
            }
        }
    }

    /// Prompt rows (`tiled`) take the f32 prefill path: without f16 rounding of queries or of
    /// the running output it is within 2e-5 of attention computed in f64 (the decode path is
    /// about 3e-3 off on the same rows), over several 64-key tiles, after earlier positions, with
    /// and without a window, on heads of 64 and 256.
    #[test]
    fn the_prefill_path_is_f32_exact() {
        for (hd, window) in [(64, None), (256, None), (64, Some(70)), (256, Some(100))] {
            let (out, want) = prefill_against_dense(hd, window, true);
            let worst = out.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst < 2e-5, "head width {hd}, window {window:?}: off by {worst}");
        }
        // The decode path on the same rows: its f16 running output is what the bound excludes.
        let (out, want) = prefill_against_dense(64, None, false);
        let worst = out.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst > 1e-4, "the decode path is off by only {worst}");
    }

    /// 120 new rows after 30 cached positions, in one call, on either path; and attention computed
    /// in f64 on the same rows.
    fn prefill_against_dense(hd: usize, window: Option<usize>, tiled: bool) -> (Vec<f32>, Vec<f32>) {
        let shape = AttnShape {
            n_heads: 4,
            n_kv_heads: 1,
            head_dim: hd,
            page_size: 16,
        };
        let (pos0, n_new) = (30usize, 120usize);
        let positions = pos0 + n_new;
        let mut f = Fixture::new(shape, positions.div_ceil(16));
        let pages: Vec<u32> = (0..positions.div_ceil(16) as u32).rev().collect();
        let table = f.give(&pages, 3, positions);
        let q: Vec<f32> = (0..n_new * shape.n_heads * hd).map(|i| val(i, 9) * 3.0).collect();
        let mut out = vec![0f32; q.len()];
        let seqs = [AttnSeq {
            owner: o(3),
            pages: &table,
            pos0,
            n_new,
            tiled,
        }];
        let kind = AttnKind {
            window,
            ..AttnKind::causal(hd)
        };
        let r = paged_attention(
            KvLayer { k: &f.k, v: &f.v },
            &f.tags,
            &shape,
            &kind,
            &seqs,
            &q,
            &mut out,
            TagCheck::Enforce,
        );
        assert!(r[0].is_ok());
        (out, dense(&f, &table, pos0, n_new, &q, window))
    }

    /// A prompt row's attention is the same bits however the prompt is cut into steps (and so
    /// whatever else shares them, and whether its start came from the prefix cache): 150 rows in
    /// one call equal the same rows in calls of 40, 1, 63 and 46. (Output rows are computed one
    /// per step, so the decode path needs no such property.)
    #[test]
    fn a_prompt_rows_attention_does_not_depend_on_its_chunk() {
        for hd in [64, 256] {
            let shape = AttnShape {
                n_heads: 4,
                n_kv_heads: 1,
                head_dim: hd,
                page_size: 16,
            };
            let n = 150usize;
            let mut f = Fixture::new(shape, n.div_ceil(16));
            let pages: Vec<u32> = (0..n.div_ceil(16) as u32).collect();
            let table = f.give(&pages, 5, n);
            let qdim = shape.n_heads * hd;
            let q: Vec<f32> = (0..n * qdim).map(|i| val(i, 11) * 2.0).collect();
            let kind = AttnKind::causal(hd);
            let attend = |pos0: usize, n_new: usize| {
                let mut out = vec![0f32; n_new * qdim];
                let seqs = [AttnSeq {
                    owner: o(5),
                    pages: &table,
                    pos0,
                    n_new,
                    tiled: true,
                }];
                let qs = &q[pos0 * qdim..(pos0 + n_new) * qdim];
                let r = paged_attention(
                    KvLayer { k: &f.k, v: &f.v },
                    &f.tags,
                    &shape,
                    &kind,
                    &seqs,
                    qs,
                    &mut out,
                    TagCheck::Enforce,
                );
                assert!(r[0].is_ok());
                out
            };
            let whole = attend(0, n);
            let mut pieces = Vec::new();
            let mut at = 0;
            for len in [40, 1, 63, 46] {
                pieces.extend(attend(at, len));
                at += len;
            }
            assert_eq!(at, n);
            assert!(whole == pieces, "head width {hd}");
        }
    }

    /// Every SIMD score loop this CPU has equals the scalar one bit for bit (each score sums its
    /// products in the same order), for row counts that leave partial row tiles and key counts
    /// that leave a half tile.
    #[test]
    fn simd_scores_equal_scalar() {
        for (rows, cols, hd) in [(1, 16, 64), (5, 48, 64), (7, 64, 256), (12, 80, 128)] {
            let ld = cols + 16;
            let qs: Vec<f32> = (0..rows * hd).map(|i| val(i, 3)).collect();
            let kt: Vec<f32> = (0..hd * ld).map(|i| val(i, 4)).collect();
            let mut want = vec![0f32; rows * cols];
            scores(Isa::Scalar, &qs, hd, &kt, ld, cols, &mut want);
            assert!(want.iter().any(|&x| x != 0.0));
            for isa in Isa::available() {
                let mut got = vec![f32::NAN; rows * cols];
                scores(isa, &qs, hd, &kt, ld, cols, &mut got);
                assert_eq!(got, want, "{rows}x{cols}, head width {hd}, {isa:?}");
            }
        }
    }

    #[test]
    fn foreign_page_fails_with_no_data() {
        let mut f = Fixture::new(SHAPE, 4);
        let mine = f.give(&[0], 1, 4);
        f.give(&[1], 2, 4);
        let table = [mine[0], PageEntry::own(1, 0)];
        let (r, out) = run(&f, 1, &table, 7, 1);
        assert_eq!(
            r,
            Err(IsolationViolation::ForeignOwner {
                page: 1,
                expected: o(1),
                found: o(2)
            })
        );
        assert!(out.iter().all(|&x| x == 0.0));
    }

    /// A sliding window reads no page wholly before its first query's window, and checks none:
    /// a foreign page there fails full attention but not windowed attention, whose output
    /// depends only on the pages in the window.
    #[test]
    fn a_window_neither_reads_nor_checks_pages_before_it() {
        let mut f = Fixture::new(SHAPE, 4);
        f.give(&[0], 2, 4); // another tenant's page where positions 0..4 would be
        let mine = f.give(&[1, 2], 1, 8);
        let table = [PageEntry::own(0, 0), mine[0], mine[1]];
        let q = vec![0.5f32; 16];
        let attend = |kind: AttnKind, f: &Fixture| {
            let seqs = [AttnSeq {
                owner: o(1),
                pages: &table,
                pos0: 11,
                n_new: 1,
                tiled: false,
            }];
            let mut out = vec![0f32; 16];
            let r = paged_attention(
                KvLayer { k: &f.k, v: &f.v },
                &f.tags,
                &SHAPE,
                &kind,
                &seqs,
                &q,
                &mut out,
                TagCheck::Enforce,
            );
            (r[0].clone(), out)
        };
        let (full, _) = attend(AttnKind::causal(SHAPE.head_dim), &f);
        assert!(matches!(full, Err(IsolationViolation::ForeignOwner { page: 0, .. })));
        // Position 11 with a window of 8 sees 4..=11: pages 1 and 2 only.
        let windowed = AttnKind {
            window: Some(8),
            ..AttnKind::causal(SHAPE.head_dim)
        };
        let (r, out) = attend(windowed, &f);
        assert_eq!(r, Ok(()));
        // Changing the page before the window changes nothing.
        f.k[..SHAPE.page_elems()].fill(f16::from_f32(9.0));
        assert_eq!(attend(windowed, &f).1, out);
        // A window of 9 reaches position 3, on page 0: refused.
        let (r, _) = attend(
            AttnKind {
                window: Some(9),
                ..windowed
            },
            &f,
        );
        assert!(matches!(r, Err(IsolationViolation::ForeignOwner { page: 0, .. })));
    }

    #[test]
    fn stale_epoch_fails() {
        let mut f = Fixture::new(SHAPE, 2);
        let table = f.give(&[0], 1, 4);
        f.tags[0].epoch += 1; // freed and reallocated to the same owner
        let (r, _) = run(&f, 1, &table, 3, 1);
        assert_eq!(
            r,
            Err(IsolationViolation::StaleEpoch {
                page: 0,
                expected: 0,
                found: 1
            })
        );
    }

    #[test]
    fn the_2026_shape_reserve_8_fill_1_attend_8_is_refused() {
        let shape = AttnShape { page_size: 16, ..SHAPE };
        let mut f = Fixture::new(shape, 8);
        let table = f.give(&[0, 1, 2, 3, 4, 5, 6, 7], 9, 16); // only page 0 written
        let q = vec![0.5f32; 16];
        let mut out = vec![1f32; 16];
        let seqs = [AttnSeq {
            owner: o(9),
            pages: &table,
            pos0: 127,
            n_new: 1,
            tiled: false,
        }];
        let r = paged_attention(
            KvLayer { k: &f.k, v: &f.v },
            &f.tags,
            &shape,
            &AttnKind::causal(shape.head_dim),
            &seqs,
            &q,
            &mut out,
            TagCheck::Enforce,
        );
        assert_eq!(
            r[0],
            Err(IsolationViolation::UnwrittenSlots {
                page: 1,
                needed: 16,
                written: 0
            })
        );
        assert!(out.iter().all(|&x| x == 0.0));
    }

    #[test]
    fn one_bad_sequence_does_not_fail_its_batch_neighbours() {
        let mut f = Fixture::new(SHAPE, 4);
        let a = f.give(&[0], 1, 4);
        let b = f.give(&[1], 2, 4);
        let q = vec![0.5f32; 2 * 16];
        let mut out = vec![0f32; q.len()];
        let seqs = [
            AttnSeq {
                owner: o(1),
                pages: &b,
                pos0: 3,
                n_new: 1,
                tiled: false,
            },
            AttnSeq {
                owner: o(1),
                pages: &a,
                pos0: 3,
                n_new: 1,
                tiled: false,
            },
        ];
        let r = paged_attention(
            KvLayer { k: &f.k, v: &f.v },
            &f.tags,
            &SHAPE,
            &AttnKind::causal(SHAPE.head_dim),
            &seqs,
            &q,
            &mut out,
            TagCheck::Enforce,
        );
        assert!(r[0].is_err() && r[1].is_ok());
        assert!(out[..16].iter().all(|&x| x == 0.0) && out[16..].iter().any(|&x| x != 0.0));
    }

    #[cfg(feature = "bench-tags-off")]
    #[test]
    fn short_table_and_bad_index_are_errors_even_unchecked() {
        let f = Fixture::new(SHAPE, 2);
        let r = crate::tag::check_pages(o(1), &[PageEntry::own(9, 0)], 2, 4, &f.tags, TagCheck::SkipForBenchmark);
        assert_eq!(r, Err(IsolationViolation::NoSuchPage { page: 9, pages: 2 }));
        let r = crate::tag::check_pages(o(1), &[], 2, 4, &f.tags, TagCheck::SkipForBenchmark);
        assert!(matches!(r, Err(IsolationViolation::ShortPageTable { .. })));
    }
}
