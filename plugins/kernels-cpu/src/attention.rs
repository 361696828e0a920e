//! Flash attention on the CPU (FlashAttention-2 shape): never the full score matrix.
//!
//! One task owns a key/value head, a block of up to [`Q_BLOCK`] queries ([`Q_BLOCK_WIDE`] for
//! bidirectional attention) — every query head of that KV group (grouped-query attention) for
//! those queries, so each key/value tile loaded serves `Q_BLOCK × group` rows — and a span of keys (all of them, unless there are too few
//! tasks to occupy the threads: decode then splits the keys and merges the partial results).
//! It walks its keys in tiles of [`K_TILE`], reading f32 K/V in place or converting each tile
//! to f32 once (f16 KV), transposes the key tile, and runs the rows through the SIMD block step
//! (`block`: four rows at a time, scores, online softmax, `p·v`). Per row it keeps a running
//! maximum `m`, normaliser `l` and unnormalised output `o` (online softmax): for a tile with
//! scores `s`, `m' = max(m, max s)`, `l' = l·e^(m−m') + Σ e^(s−m')`,
//! `o' = o·e^(m−m') + Σ e^(s−m')·v`; the result is `o/l`. Exponentials are base 2 with the
//! queries pre-scaled by `scale·log2 e` (`exp`: a polynomial within 1.2 ulp).
//!
//! Masking: query `i` (absolute position `p = first_query_pos + i`) sees keys
//! `[max(0, p + 1 − window), min(p + 1, kv_len))` (`window` 0 = unlimited). Positions past
//! `kv_len` are clamped, so `first_query_pos ≥ kv_len − 1` gives bidirectional attention. A query
//! that sees no key gets zeros.
//!
//! The keys and values come as spans (KV-cache pages, read where they lie): a tile inside one
//! f32 span is read in place, one that straddles two is copied row by row into the tile buffer.
//! The cache's pages hold [`K_TILE`] positions, so unwindowed f32 attention never copies; int8
//! spans are dequantized tile by tile (`q × scale`, the cache's own formula).
//!
//! Scratch is per thread (one thread-local lookup per task, reused across calls), so a call
//! allocates only when a thread first sees a larger shape.

mod block;

use crate::engine::Engine;
use crate::vecops::VecOps;
use block::{Block, Kernel};
use std::cell::{Cell, RefCell};
use u_sdk::{DType, KV_INT8_GROUP, Result, UError};

/// The shape of one attention call, as the kernel takes it.
#[derive(Clone, Debug, PartialEq)]
pub struct Params {
    /// Query heads.
    pub heads: u32,
    /// Key/value heads (grouped-query attention when fewer than `heads`).
    pub kv_heads: u32,
    /// Dimension of each head.
    pub head_dim: u32,
    /// Number of query tokens.
    pub queries: u32,
    /// Number of key/value tokens.
    pub kv_len: u32,
    /// Absolute position of the first query (for the causal mask): query `i` sees keys
    /// `0..=first_query_pos + i`; `kv_len − 1` or more makes it bidirectional.
    pub first_query_pos: u32,
    /// Sliding window (0 = none): a query sees only the last `window` keys.
    pub window: u32,
    /// Score scale, usually `1/sqrt(head_dim)`.
    pub scale: f32,
    /// Soft cap of the scaled scores, `s ← softcap · tanh(s / softcap)` (0 = none).
    pub softcap: f32,
    /// Element type of the key/value spans (`F32`, `F16`, or `I8` with scales).
    pub kv_dtype: DType,
}

/// One run of consecutive cached positions: `tokens` keys and values, each
/// `tokens × kv_heads × head_dim` elements of [`Params::kv_dtype`], in position order after the
/// spans before it. Int8 spans carry one `f32` scale per group of [`KV_INT8_GROUP`] values of a
/// token's row (`value = q × scale`); the scales are empty otherwise.
#[derive(Clone, Copy, Debug)]
pub struct KvSpan<'a> {
    /// Positions held.
    pub tokens: u32,
    /// Keys, as bytes.
    pub keys: &'a [u8],
    /// Values, as bytes.
    pub values: &'a [u8],
    /// Int8 keys' scales: tokens × ⌈kv_heads × head_dim / `KV_INT8_GROUP`⌉.
    pub key_scales: &'a [f32],
    /// Int8 values' scales, laid out like `key_scales`.
    pub value_scales: &'a [f32],
}

impl<'a> KvSpan<'a> {
    /// A span of `tokens` f32 (or, by `kv_dtype`, f16) keys and values given as bytes.
    pub fn bytes(tokens: u32, keys: &'a [u8], values: &'a [u8]) -> Self {
        Self {
            tokens,
            keys,
            values,
            key_scales: &[],
            value_scales: &[],
        }
    }

    /// A span of `tokens` f32 keys and values.
    pub fn f32(tokens: u32, keys: &'a [f32], values: &'a [f32]) -> Self {
        fn bytes(x: &[f32]) -> &[u8] {
            // SAFETY: any f32 is 4 plain bytes; alignment 1 and the same length in bytes.
            unsafe { std::slice::from_raw_parts(x.as_ptr() as *const u8, std::mem::size_of_val(x)) }
        }
        Self::bytes(tokens, bytes(keys), bytes(values))
    }

    /// A span of `tokens` int8 keys and values with their group scales.
    pub fn i8(
        tokens: u32,
        (keys, key_scales): (&'a [i8], &'a [f32]),
        (values, value_scales): (&'a [i8], &'a [f32]),
    ) -> Self {
        fn bytes(x: &[i8]) -> &[u8] {
            // SAFETY: i8 and u8 have the same size, alignment and (all) bit patterns.
            unsafe { std::slice::from_raw_parts(x.as_ptr() as *const u8, x.len()) }
        }
        Self {
            tokens,
            keys: bytes(keys),
            values: bytes(values),
            key_scales,
            value_scales,
        }
    }
}

/// Queries per task.
pub const Q_BLOCK: usize = 16;
/// Queries per task of bidirectional attention (encoders, diffusion's spatial attention): no
/// causal triangle to balance, so larger blocks share each key tile's transpose and copy among
/// more rows (a quarter less time for 4096 queries of 8 heads of 40; a row's result is the same
/// whatever its block, every row walking the same key tiles).
pub const Q_BLOCK_WIDE: usize = 64;
/// Keys per tile (a multiple of the widest block step's score run, 64).
pub const K_TILE: usize = 64;

thread_local! {
    /// Per-task scratch (see [`Scratch`]).
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// The caller's buffer of per-task partial results when keys are split.
    static PARTIAL: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// A pointer into a buffer that tasks write in disjoint parts.
#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);
// SAFETY: tasks write disjoint ranges (output rows of their (query block, KV head), or their
// own partial slot), see `attention`.
unsafe impl Send for SyncPtr {}
// SAFETY: as above.
unsafe impl Sync for SyncPtr {}

impl SyncPtr {
    /// The pointer (a method, so closures capture the whole `Sync` wrapper, not the field).
    fn ptr(self) -> *mut f32 {
        self.0
    }
}

/// Key/value storage of a span: f32 in place, or bytes (f16, or f32 that is not aligned)
/// converted tile by tile, or int8 with per-group scales (`groups` a token).
enum Kv<'a> {
    F32(&'a [f32]),
    Bytes(&'a [u8], DType),
    I8 {
        q: &'a [u8],
        scales: &'a [f32],
        groups: usize,
    },
}

impl<'a> Kv<'a> {
    fn new(bytes: &'a [u8], dtype: DType) -> Kv<'a> {
        if dtype == DType::F32
            && (bytes.as_ptr() as usize).is_multiple_of(4)
            && cfg!(target_endian = "little")
        {
            // SAFETY: aligned, length rounded down to whole f32s, lifetime tied to `bytes`, and
            // every bit pattern is a valid f32.
            let f = unsafe {
                std::slice::from_raw_parts(bytes.as_ptr() as *const f32, bytes.len() / 4)
            };
            Kv::F32(f)
        } else {
            Kv::Bytes(bytes, dtype)
        }
    }
}

/// The cached positions: where each span starts (and, last, where the final one ends), with
/// its keys and values.
struct Spans<'a> {
    starts: Vec<usize>,
    k: Vec<Kv<'a>>,
    v: Vec<Kv<'a>>,
}

/// Validates and runs attention.
pub fn attention<'a>(
    eng: &Engine,
    q: &[f32],
    kv: &[KvSpan<'a>],
    p: &Params,
    out: &mut [f32],
) -> Result<()> {
    let (h, kvh, d) = (p.heads as usize, p.kv_heads as usize, p.head_dim as usize);
    let (nq, nk) = (p.queries as usize, p.kv_len as usize);
    let bad = |why: String| {
        UError::invalid(format!(
            "attention: heads {h}, kv_heads {kvh}, head_dim {d}, queries {nq}, kv_len {nk}, \
             kv {:?} in {} spans; q {} values, out {} values: {why}",
            p.kv_dtype,
            kv.len(),
            q.len(),
            out.len()
        ))
    };
    let esize = match p.kv_dtype {
        DType::F32 => 4,
        DType::F16 => 2,
        DType::I8 => 1,
        other => {
            return Err(UError::unsupported(format!(
                "attention: KV dtype {other} is not supported (F32, F16, I8)"
            )));
        }
    };
    if h == 0 || kvh == 0 || d == 0 || h % kvh != 0 {
        return Err(bad(
            "heads must be a positive multiple of kv_heads, head_dim > 0".into(),
        ));
    }
    let qlen = nq.checked_mul(h).and_then(|v| v.checked_mul(d));
    if qlen != Some(q.len()) || qlen != Some(out.len()) {
        return Err(bad(
            "q and out must hold queries·heads·head_dim values".into()
        ));
    }
    let mut spans = Spans {
        starts: vec![0],
        k: Vec::new(),
        v: Vec::new(),
    };
    let mut held = 0usize;
    for (i, sp) in kv.iter().enumerate() {
        let n = sp.tokens as usize;
        let len = n
            .checked_mul(kvh)
            .and_then(|v| v.checked_mul(d))
            .and_then(|v| v.checked_mul(esize));
        if len != Some(sp.keys.len()) || len != Some(sp.values.len()) {
            return Err(bad(format!(
                "span {i} of {n} tokens must hold tokens·kv_heads·head_dim elements in keys \
                 and values (has {} and {} bytes)",
                sp.keys.len(),
                sp.values.len()
            )));
        }
        let groups = (kvh * d).div_ceil(KV_INT8_GROUP as usize);
        let scales = if p.kv_dtype == DType::I8 {
            n * groups
        } else {
            0
        };
        if sp.key_scales.len() != scales || sp.value_scales.len() != scales {
            return Err(bad(format!(
                "span {i} of {n} tokens must hold {scales} key and value scales (has {} and {})",
                sp.key_scales.len(),
                sp.value_scales.len()
            )));
        }
        if n > 0 {
            held += n;
            spans.starts.push(held);
            let kv = |q: &'a [u8], s: &'a [f32]| match p.kv_dtype {
                DType::I8 => Kv::I8 {
                    q,
                    scales: s,
                    groups,
                },
                dtype => Kv::new(q, dtype),
            };
            spans.k.push(kv(sp.keys, sp.key_scales));
            spans.v.push(kv(sp.values, sp.value_scales));
        }
    }
    if held != nk {
        return Err(bad(format!("the spans hold {held} positions, not kv_len")));
    }
    if nq == 0 {
        return Ok(());
    }
    let group = h / kvh;
    let kern = Kernel::new(eng.isa);
    let dp = d.next_multiple_of(kern.pad);
    let span = Span {
        first: p.first_query_pos as usize,
        window: p.window as usize,
        nk,
    };
    // Every query sees every key (no window, the first query already past the last key).
    let q_block = match span.window == 0 && span.range(0).1 == nk {
        true => Q_BLOCK_WIDE,
        false => Q_BLOCK,
    };
    let blocks = nq.div_ceil(q_block);
    // Keys any query sees, split into `chunks` spans of whole tiles when the (KV head, query
    // block) tasks alone are too few to keep every thread busy.
    let (klo, khi) = (span.range(0).0, span.range(nq - 1).1);
    let keys = khi.saturating_sub(klo);
    let base = kvh * blocks;
    let mut chunks = 1;
    if eng.threads > 1 && base < 4 * eng.threads && keys >= 2 * K_TILE {
        chunks = (4 * eng.threads).div_ceil(base);
        while !(base * chunks).is_multiple_of(eng.threads) {
            chunks += 1;
        }
        chunks = chunks.min(keys / K_TILE);
    }
    let chunk_len = keys.div_ceil(chunks).next_multiple_of(K_TILE).max(K_TILE);
    let chunks = keys.div_ceil(chunk_len).max(1);
    let job = Job {
        q,
        kv: spans,
        kern,
        vec: eng.vec,
        h,
        kvh,
        d,
        dp,
        group,
        nq,
        q_block,
        span,
        qscale: p.scale * std::f32::consts::LOG2_E,
        // Scores are in base 2 (`s·log2 e`): the cap scales the same way.
        softcap: p.softcap * std::f32::consts::LOG2_E,
    };
    let prow = (q_block.min(nq) * group).next_multiple_of(block::R);
    let per_kv = kvh * chunks;
    let outp = SyncPtr(out.as_mut_ptr());
    if chunks == 1 {
        eng.split(blocks * kvh, |t| {
            // Largest (latest, most keys) query blocks first, for balance under the causal mask.
            let (qb, g) = (blocks - 1 - t / kvh, t % kvh);
            job.with_scratch(qb, g, (klo, khi), |rows, sc| {
                let q0 = qb * q_block;
                for r in 0..rows {
                    let (qi, head) = (q0 + r / group, g * group + r % group);
                    let l = sc.l[r];
                    let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
                    let src = &sc.o[r * dp..][..d];
                    // SAFETY: qi < queries, head < heads, so the row is inside `out`; this task
                    // alone owns KV group g's heads for its queries.
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut(outp.ptr().add((qi * h + head) * d), d)
                    };
                    for (y, &x) in dst.iter_mut().zip(src) {
                        *y = x * inv;
                    }
                }
            });
        });
        return Ok(());
    }
    // Split keys: each task leaves (o, m, l) for its rows in its slot; then merge per row.
    let slot = prow * (dp + 2);
    let mut partial = PARTIAL.take();
    if partial.len() < blocks * per_kv * slot {
        partial.resize(blocks * per_kv * slot, 0.0);
    }
    let pp = SyncPtr(partial.as_mut_ptr());
    eng.split(blocks * per_kv, |t| {
        let qb = blocks - 1 - t / per_kv;
        let (g, c) = ((t % per_kv) / chunks, t % chunks);
        let lo = klo + c * chunk_len;
        let idx = (qb * kvh + g) * chunks + c;
        job.with_scratch(qb, g, (lo, (lo + chunk_len).min(khi)), |rows, sc| {
            // SAFETY: slot `idx` < blocks·kvh·chunks lies inside `partial`, and is this task's.
            let dst = unsafe { std::slice::from_raw_parts_mut(pp.ptr().add(idx * slot), slot) };
            let (o, ml) = dst.split_at_mut(prow * dp);
            o[..rows * dp].copy_from_slice(&sc.o[..rows * dp]);
            ml[..rows].copy_from_slice(&sc.m[..rows]);
            ml[prow..prow + rows].copy_from_slice(&sc.l[..rows]);
        });
    });
    for qb in 0..blocks {
        let q0 = qb * q_block;
        let rows = (q_block.min(nq - q0)) * group;
        for g in 0..kvh {
            let slots = &partial[(qb * kvh + g) * chunks * slot..][..chunks * slot];
            for r in 0..rows {
                let (qi, head) = (q0 + r / group, g * group + r % group);
                let dst = &mut out[(qi * h + head) * d..][..d];
                let part = |c: usize| {
                    let s = &slots[c * slot..][..slot];
                    (&s[r * dp..][..d], s[prow * dp + r], s[prow * dp + prow + r])
                };
                let m = (0..chunks).fold(f32::NEG_INFINITY, |m, c| m.max(part(c).1));
                dst.fill(0.0);
                if m == f32::NEG_INFINITY {
                    continue;
                }
                let mut l = 0.0;
                for c in 0..chunks {
                    let (o, mc, lc) = part(c);
                    let w = crate::exp::exp2(mc - m);
                    l += w * lc;
                    for (y, &x) in dst.iter_mut().zip(o) {
                        *y += w * x;
                    }
                }
                let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
                dst.iter_mut().for_each(|y| *y *= inv);
            }
        }
    }
    PARTIAL.set(partial);
    Ok(())
}

/// The causal/window mask: which keys a query sees.
#[derive(Clone, Copy)]
struct Span {
    first: usize,
    window: usize,
    nk: usize,
}

impl Span {
    /// Keys `[start, end)` visible to query `qi` (empty when `start == end`).
    #[inline]
    fn range(self, qi: usize) -> (usize, usize) {
        let end = (self.first + qi + 1).min(self.nk);
        let start = if self.window > 0 {
            (self.first + qi + 1).saturating_sub(self.window)
        } else {
            0
        };
        (start.min(end), end)
    }
}

/// A task's scratch, carved from the thread's buffer.
struct Scratch<'a> {
    /// Query rows, pre-scaled (`prow × d`, padding rows zero).
    q: &'a mut [f32],
    /// Unnormalised outputs (`prow × dp`).
    o: &'a mut [f32],
    /// Running maxima (base 2).
    m: &'a mut [f32],
    /// Running normalisers.
    l: &'a mut [f32],
    /// Transposed key tile (`d × K_TILE`).
    kt: &'a mut [f32],
    /// Key rows converted to f32 (`K_TILE × d`).
    krow: &'a mut [f32],
    /// Value rows converted to f32 (`K_TILE × dp`).
    vrow: &'a mut [f32],
}

/// Everything a task reads.
struct Job<'a> {
    q: &'a [f32],
    kv: Spans<'a>,
    kern: Kernel,
    vec: VecOps,
    h: usize,
    kvh: usize,
    d: usize,
    dp: usize,
    group: usize,
    nq: usize,
    /// Queries per task.
    q_block: usize,
    span: Span,
    qscale: f32,
    softcap: f32,
}

impl Job<'_> {
    /// Runs query block `qb` of KV head `g` over keys `[keys.0, keys.1)` on this thread's
    /// scratch, then hands `finish` the row count and the scratch holding `o`, `m`, `l`.
    fn with_scratch(
        &self,
        qb: usize,
        g: usize,
        keys: (usize, usize),
        finish: impl FnOnce(usize, &Scratch<'_>),
    ) {
        let (d, dp) = (self.d, self.dp);
        let q0 = qb * self.q_block;
        let q1 = (q0 + self.q_block).min(self.nq);
        let rows = (q1 - q0) * self.group;
        let prow = rows.next_multiple_of(block::R);
        let need = prow * (d + dp + 2) + K_TILE * (2 * d + dp);
        SCRATCH.with(|cell| {
            let mut own = Vec::new();
            let mut guard = cell.try_borrow_mut().ok();
            let buf: &mut Vec<f32> = match guard.as_deref_mut() {
                Some(b) => b,
                None => &mut own,
            };
            if buf.len() < need {
                buf.resize(need, 0.0);
            }
            let (qs, rest) = buf.split_at_mut(prow * d);
            let (o, rest) = rest.split_at_mut(prow * dp);
            let (m, rest) = rest.split_at_mut(prow);
            let (l, rest) = rest.split_at_mut(prow);
            let (kt, rest) = rest.split_at_mut(K_TILE * d);
            let (krow, rest) = rest.split_at_mut(K_TILE * d);
            let vrow = &mut rest[..K_TILE * dp];
            let mut sc = Scratch {
                q: qs,
                o,
                m,
                l,
                kt,
                krow,
                vrow,
            };
            self.run(q0, q1, g, keys, &mut sc);
            finish(rows, &sc);
        });
    }

    /// The task body (see the module docs).
    fn run(&self, q0: usize, q1: usize, g: usize, keys: (usize, usize), sc: &mut Scratch<'_>) {
        let (d, dp, group) = (self.d, self.dp, self.group);
        let rows = (q1 - q0) * group;
        for (r, dst) in sc.q.chunks_exact_mut(d).enumerate() {
            if r < rows {
                let (qi, head) = (q0 + r / group, g * group + r % group);
                let src = &self.q[(qi * self.h + head) * d..][..d];
                for (y, &x) in dst.iter_mut().zip(src) {
                    *y = x * self.qscale;
                }
            } else {
                dst.fill(0.0);
            }
        }
        sc.o.fill(0.0);
        sc.m.fill(f32::NEG_INFINITY);
        sc.l.fill(0.0);
        let lo = self.span.range(q0).0.max(keys.0);
        let hi = self.span.range(q1 - 1).1.min(keys.1);
        let mut t0 = lo;
        while t0 < hi {
            let t1 = (t0 + K_TILE).min(hi);
            let n = t1 - t0;
            let kv = &self.kv;
            let (krows, kstride) = tile(
                (&kv.k, &kv.starts),
                (t0, t1, g, self.kvh, d, d),
                sc.krow,
                &self.vec,
            );
            self.kern.transpose(krows, kstride, n, d, sc.kt);
            let (vdata, vstride) = tile(
                (&kv.v, &kv.starts),
                (t0, t1, g, self.kvh, d, dp),
                sc.vrow,
                &self.vec,
            );
            for mb in (0..rows).step_by(block::R) {
                let mut ranges = [(0, 0); block::R];
                for (i, rg) in ranges.iter_mut().enumerate() {
                    if mb + i < rows {
                        let (s, e) = self.span.range(q0 + (mb + i) / group);
                        let (s, e) = (s.max(t0), e.min(t1));
                        if s < e {
                            *rg = (s - t0, e - t0);
                        }
                    }
                }
                if ranges.iter().all(|&(a, b)| a >= b) {
                    continue;
                }
                self.kern.run(&mut Block {
                    q: &sc.q[mb * d..(mb + block::R) * d],
                    d,
                    kt: sc.kt,
                    v: vdata,
                    v_stride: vstride,
                    dp,
                    ranges,
                    softcap: self.softcap,
                    m: &mut sc.m[mb..mb + block::R],
                    l: &mut sc.l[mb..mb + block::R],
                    o: &mut sc.o[mb * dp..(mb + block::R) * dp],
                });
            }
            t0 = t1;
        }
    }
}

/// Makes positions `t0..t1` of KV head `g` readable as f32 rows: returns the rows (position
/// `t0 + j` at `j·stride`) and their stride. Aligned f32 inside one span with `stride == d` is
/// read in place; otherwise the rows are converted or copied into `buf` at `stride` (a padded
/// stride leaves the columns past `d` as they are: the block step reads them, but they only
/// reach output columns that are dropped).
fn tile<'a>(
    (side, starts): (&'a [Kv<'_>], &[usize]),
    (t0, t1, g, kvh, d, stride): (usize, usize, usize, usize, usize, usize),
    buf: &'a mut [f32],
    vec: &VecOps,
) -> (&'a [f32], usize) {
    let mut i = starts.partition_point(|&s| s <= t0) - 1;
    if let Kv::F32(f) = &side[i]
        && stride == d
        && t1 <= starts[i + 1]
    {
        return (&f[((t0 - starts[i]) * kvh + g) * d..], kvh * d);
    }
    for t in t0..t1 {
        while t >= starts[i + 1] {
            i += 1;
        }
        let row = (t - starts[i]) * kvh + g;
        let dst = &mut buf[(t - t0) * stride..][..d];
        match &side[i] {
            Kv::F32(f) => dst.copy_from_slice(&f[row * d..][..d]),
            Kv::Bytes(b, DType::F16) => vec.f16_to_f32(&b[row * d * 2..][..d * 2], dst),
            Kv::Bytes(b, _) => {
                for (x, c) in dst
                    .iter_mut()
                    .zip(b[row * d * 4..][..d * 4].chunks_exact(4))
                {
                    *x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            Kv::I8 { q, scales, groups } => {
                // Head g's values are elements g·d.. of the token's row; scale groups run
                // along the whole row.
                let token = t - starts[i];
                let (first, group) = (g * d, KV_INT8_GROUP as usize);
                let codes = &q[row * d..][..d];
                for (j, (x, &c)) in dst.iter_mut().zip(codes).enumerate() {
                    *x = f32::from(c as i8) * scales[token * groups + (first + j) / group];
                }
            }
        }
    }
    (buf, stride)
}
