//! Element-wise arithmetic between tensors: residual adds, gating products, scaling, and the
//! gated activations (SwiGLU, GeGLU) fused into one pass.
//!
//! Every function here takes raw pointers because its destination may be one of its sources
//! (in place: `x += y`); each reads an element before writing the same index, never another.

use crate::{engine::Engine, ops::with_activation};
use rayon::prelude::*;
use u_sdk::{Activation, Result, UError};

/// Elements below which an op runs on the calling thread.
const PAR_MIN: usize = 1 << 16;

/// A binary operation's operands: `a` of `n` values, `b` of `n` or (broadcast) `row` values,
/// `out` of `n`; `out` may equal `a` or `b`.
#[derive(Clone, Copy)]
pub struct Binary {
    /// First operand.
    pub a: *const f32,
    /// Second operand.
    pub b: *const f32,
    /// Destination.
    pub out: *mut f32,
    /// Elements of `a` and `out`.
    pub n: usize,
    /// Elements of `b`: `n`, or one row that repeats.
    pub b_len: usize,
}

// SAFETY: the pointers are only dereferenced at disjoint indices per task (see `run`).
unsafe impl Send for Binary {}
// SAFETY: as above.
unsafe impl Sync for Binary {}

impl Binary {
    /// Checks the lengths: `b` is `n` values or whole rows' worth of one row.
    pub fn check(&self, op: &str) -> Result<()> {
        if self.b_len == 0 || !(self.b_len == self.n || self.n.is_multiple_of(self.b_len)) {
            return Err(UError::invalid(format!(
                "{op}: the second operand has {} values for {} in the first (same count, or one \
                 row that divides it)",
                self.b_len, self.n
            )));
        }
        Ok(())
    }

    /// Runs `f(a[i], b[i mod b_len])` into `out[i]` for every `i`, split over the pool when
    /// large.
    ///
    /// # Safety
    /// `a` and `out` hold `n` values, `b` holds `b_len`; `out` overlaps `a` or `b` only exactly
    /// (same start and length).
    pub unsafe fn run(&self, eng: &Engine, f: impl Fn(f32, f32) -> f32 + Sync) {
        if self.b_len == self.n && self.n >= PAR_MIN {
            // Operands of one length: runs of PAR_MIN elements split over the pool.
            let span = |lo: usize| {
                for i in lo..(lo + PAR_MIN).min(self.n) {
                    // SAFETY: `i < n` for `a`, `b` and `out`; each index is read before it is
                    // written, by one task only (function contract).
                    unsafe { *self.out.add(i) = f(*self.a.add(i), *self.b.add(i)) };
                }
            };
            eng.pool.install(|| {
                (0..self.n.div_ceil(PAR_MIN))
                    .into_par_iter()
                    .for_each(|c| span(c * PAR_MIN))
            });
            return;
        }
        // Rows of `b_len` (the whole tensor when `b` is as long as `a`): `b` is read whole per
        // row, so the inner loop has no index arithmetic and vectorizes.
        let row = self.b_len;
        let body = |rows: std::ops::Range<usize>| {
            for r in rows {
                for j in 0..row {
                    let i = r * row + j;
                    // SAFETY: `i < n` and `j < b_len`; reads of index `i` precede the write of
                    // index `i`, and no other index of an aliased operand is touched (function
                    // contract).
                    unsafe {
                        let v = f(*self.a.add(i), *self.b.add(j));
                        *self.out.add(i) = v;
                    }
                }
            }
        };
        let rows = self.n / row.max(1);
        if self.n >= PAR_MIN && rows > 1 {
            let per = (PAR_MIN / row).max(1);
            eng.pool.install(|| {
                (0..rows.div_ceil(per))
                    .into_par_iter()
                    .for_each(|c| body(c * per..((c + 1) * per).min(rows)))
            });
        } else {
            body(0..rows);
        }
    }
}

/// `out = a + b`.
///
/// # Safety
/// As [`Binary::run`].
pub unsafe fn add(eng: &Engine, op: Binary) -> Result<()> {
    op.check("add")?;
    // SAFETY: forwarded contract.
    unsafe { op.run(eng, |a, b| a + b) };
    Ok(())
}

/// `out = a ⊙ b`.
///
/// # Safety
/// As [`Binary::run`].
pub unsafe fn mul(eng: &Engine, op: Binary) -> Result<()> {
    op.check("mul")?;
    // SAFETY: forwarded contract.
    unsafe { op.run(eng, |a, b| a * b) };
    Ok(())
}

/// `out = a + factor · b`.
///
/// # Safety
/// As [`Binary::run`].
pub unsafe fn add_scaled(eng: &Engine, op: Binary, factor: f32) -> Result<()> {
    op.check("add_scaled")?;
    // SAFETY: forwarded contract.
    unsafe { op.run(eng, |a, b| a + factor * b) };
    Ok(())
}

/// `out = clamp(a, min, max)` (`b` unused: pass `a`).
///
/// # Safety
/// As [`Binary::run`].
pub unsafe fn clamp(eng: &Engine, op: Binary, min: f32, max: f32) -> Result<()> {
    // SAFETY: forwarded contract.
    unsafe { op.run(eng, |a, _| a.clamp(min, max)) };
    Ok(())
}

/// `out = act(a) ⊙ b` in one pass (`b` as long as `a`).
///
/// # Safety
/// As [`Binary::run`].
pub unsafe fn gated(eng: &Engine, op: Binary, act: Activation) -> Result<()> {
    if op.b_len != op.n {
        return Err(UError::invalid(format!(
            "gated: the gate has {} values but the up projection {}",
            op.n, op.b_len
        )));
    }
    // SAFETY: forwarded contract.
    with_activation!(act, |f| unsafe { op.run(eng, |a, b| f(a) * b) });
    Ok(())
}

/// `out = a · factor` (`b` unused: pass `a`).
///
/// # Safety
/// As [`Binary::run`].
pub unsafe fn scale(eng: &Engine, op: Binary, factor: f32) -> Result<()> {
    // SAFETY: forwarded contract.
    unsafe { op.run(eng, |a, _| a * factor) };
    Ok(())
}
