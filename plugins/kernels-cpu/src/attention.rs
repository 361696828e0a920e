//! Flash attention on the CPU (FlashAttention-2 shape): never the full score matrix.
//!
//! One task owns a key/value head and a block of up to [`Q_BLOCK`] queries, i.e. every query
//! head of that KV group (grouped-query attention) for those queries. It walks the visible keys
//! in tiles of [`K_TILE`], converting each K/V tile to f32 once (f16 KV) or reading it in place
//! (f32 KV), and keeps per row a running maximum `m`, normaliser `l` and unnormalised output `o`
//! (online softmax): for a tile with scores `s`, `m' = max(m, max s)`,
//! `l' = l·e^(m−m') + Σ e^(s−m')`, `o' = o·e^(m−m') + Σ e^(s−m')·v`; the result is `o/l`.
//!
//! Masking: query `i` (absolute position `p = first_query_pos + i`) sees keys
//! `[max(0, p + 1 − window), min(p + 1, kv_len))` (`window` 0 = unlimited). Positions past
//! `kv_len` are clamped, so `first_query_pos ≥ kv_len − 1` gives bidirectional attention. A query
//! that sees no key gets zeros.

use crate::engine::Engine;
use rayon::prelude::*;
use std::cell::RefCell;
use u_sdk::{AttentionParams, DType, Result, UError};

/// Queries per task.
pub const Q_BLOCK: usize = 16;
/// Keys per tile.
pub const K_TILE: usize = 64;

thread_local! {
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint (query, head) rows of the output, see `attention`.
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The pointer (a method, so closures capture the whole `Sync` wrapper, not the field).
    fn ptr(self) -> *mut f32 {
        self.0
    }
}

/// Key/value storage for one head: f32 in place, or bytes converted tile by tile.
enum Kv<'a> {
    F32(&'a [f32]),
    Bytes(&'a [u8], DType),
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

/// Validates and runs attention.
pub fn attention(
    eng: &Engine,
    q: &[f32],
    k: &[u8],
    v: &[u8],
    p: &AttentionParams,
    out: &mut [f32],
) -> Result<()> {
    let (h, kvh, d) = (p.heads as usize, p.kv_heads as usize, p.head_dim as usize);
    let (nq, nk) = (p.queries as usize, p.kv_len as usize);
    let bad = |why: &str| {
        UError::invalid(format!(
            "attention: heads {h}, kv_heads {kvh}, head_dim {d}, queries {nq}, kv_len {nk}, \
             kv {:?}; q {} values, k {} bytes, v {} bytes, out {} values: {why}",
            p.kv_dtype,
            q.len(),
            k.len(),
            v.len(),
            out.len()
        ))
    };
    let esize = match p.kv_dtype {
        DType::F32 => 4,
        DType::F16 => 2,
        other => {
            return Err(UError::unsupported(format!(
                "attention: KV dtype {other} is not supported (F32, F16)"
            )));
        }
    };
    if h == 0 || kvh == 0 || d == 0 || h % kvh != 0 {
        return Err(bad(
            "heads must be a positive multiple of kv_heads, head_dim > 0",
        ));
    }
    let qlen = nq.checked_mul(h).and_then(|v| v.checked_mul(d));
    if qlen != Some(q.len()) || qlen != Some(out.len()) {
        return Err(bad("q and out must hold queries·heads·head_dim values"));
    }
    let kvlen = nk
        .checked_mul(kvh)
        .and_then(|v| v.checked_mul(d))
        .and_then(|v| v.checked_mul(esize));
    if kvlen != Some(k.len()) || kvlen != Some(v.len()) {
        return Err(bad("k and v must hold kv_len·kv_heads·head_dim elements"));
    }
    if nq == 0 {
        return Ok(());
    }
    let group = h / kvh;
    let (kk, vv) = (Kv::new(k, p.kv_dtype), Kv::new(v, p.kv_dtype));
    let blocks = nq.div_ceil(Q_BLOCK);
    let outp = OutPtr(out.as_mut_ptr());
    let first = p.first_query_pos as usize;
    let window = p.window as usize;
    let range = |qi: usize| {
        let end = (first + qi + 1).min(nk);
        let start = if window > 0 {
            (first + qi + 1).saturating_sub(window)
        } else {
            0
        };
        (start.min(end), end)
    };
    let vec = eng.vec;
    eng.pool.install(|| {
        (0..kvh * blocks).into_par_iter().for_each(|task| {
            let (g, qb) = (task / blocks, task % blocks);
            let (q0, q1) = (qb * Q_BLOCK, ((qb + 1) * Q_BLOCK).min(nq));
            let rows = (q1 - q0) * group;
            let need = rows * (d + 2) + K_TILE * (1 + 2 * d);
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
                let (o, rest) = buf.split_at_mut(rows * d);
                let (ms, rest) = rest.split_at_mut(rows);
                let (ls, rest) = rest.split_at_mut(rows);
                let (sc, rest) = rest.split_at_mut(K_TILE);
                let (kt, rest) = rest.split_at_mut(K_TILE * d);
                let vt = &mut rest[..K_TILE * d];
                o.fill(0.0);
                ms.fill(f32::NEG_INFINITY);
                ls.fill(0.0);
                let lo = range(q0).0;
                let hi = range(q1 - 1).1;
                let mut t0 = lo;
                while t0 < hi {
                    let t1 = (t0 + K_TILE).min(hi);
                    let krows = tile(&kk, t0, t1, g, kvh, d, kt, &vec);
                    let vrows = tile(&vv, t0, t1, g, kvh, d, vt, &vec);
                    for qi in q0..q1 {
                        let (s, e) = range(qi);
                        let (s, e) = (s.max(t0), e.min(t1));
                        if s >= e {
                            continue;
                        }
                        for hh in 0..group {
                            let head = g * group + hh;
                            let r = (qi - q0) * group + hh;
                            let qrow = &q[(qi * h + head) * d..][..d];
                            let scores = &mut sc[..e - s];
                            let mut mt = f32::NEG_INFINITY;
                            for (j, sv) in scores.iter_mut().enumerate() {
                                *sv = p.scale * vec.dot(qrow, krows.row(s + j - t0));
                                mt = mt.max(*sv);
                            }
                            let m_new = ms[r].max(mt);
                            let orow = &mut o[r * d..(r + 1) * d];
                            if ms[r] != f32::NEG_INFINITY && ms[r] != m_new {
                                let c = (ms[r] - m_new).exp();
                                ls[r] *= c;
                                orow.iter_mut().for_each(|x| *x *= c);
                            }
                            ms[r] = m_new;
                            for (j, &sv) in scores.iter().enumerate() {
                                let pj = (sv - m_new).exp();
                                ls[r] += pj;
                                vec.axpy(orow, pj, vrows.row(s + j - t0));
                            }
                        }
                    }
                    t0 = t1;
                }
                for qi in q0..q1 {
                    for hh in 0..group {
                        let head = g * group + hh;
                        let r = (qi - q0) * group + hh;
                        let inv = if ls[r] > 0.0 { 1.0 / ls[r] } else { 0.0 };
                        for (c, &x) in o[r * d..(r + 1) * d].iter().enumerate() {
                            // SAFETY: (qi, head) < (queries, heads); this task alone owns
                            // KV group g's heads for queries q0..q1.
                            unsafe { *outp.ptr().add((qi * h + head) * d + c) = x * inv };
                        }
                    }
                }
            });
        });
    });
    Ok(())
}

/// Rows of a K or V tile: `row(j)` is key `t0 + j` of the task's head.
struct Rows<'a> {
    data: &'a [f32],
    base: usize,
    stride: usize,
    d: usize,
}

impl Rows<'_> {
    #[inline]
    fn row(&self, j: usize) -> &[f32] {
        &self.data[self.base + j * self.stride..][..self.d]
    }
}

/// Makes keys `t0..t1` of KV head `g` readable as f32 rows (in place for aligned f32).
#[allow(clippy::too_many_arguments)]
fn tile<'a>(
    kv: &'a Kv<'_>,
    t0: usize,
    t1: usize,
    g: usize,
    kvh: usize,
    d: usize,
    buf: &'a mut [f32],
    vec: &crate::vecops::VecOps,
) -> Rows<'a> {
    match kv {
        Kv::F32(f) => Rows {
            data: f,
            base: (t0 * kvh + g) * d,
            stride: kvh * d,
            d,
        },
        Kv::Bytes(b, dtype) => {
            let es = if *dtype == DType::F16 { 2 } else { 4 };
            for t in t0..t1 {
                let src = &b[(t * kvh + g) * d * es..][..d * es];
                let dst = &mut buf[(t - t0) * d..][..d];
                if es == 2 {
                    vec.f16_to_f32(src, dst);
                } else {
                    for (x, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
                        *x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                    }
                }
            }
            Rows {
                data: buf,
                base: 0,
                stride: d,
                d,
            }
        }
    }
}
