//! `y = x · Wᵀ` on weights as stored: f32/f16/bf16 rows against f32 activations, quantized rows
//! in their compressed blocks against activations quantized on the fly ([`crate::act`]).
//!
//! Work split: the product is parallel across output rows (weight rows), in tasks that the
//! calling thread and the team's helpers claim ([`Engine::split`]). On x86 the 32-value block
//! formats run as tiles of eight weight rows against up to eight activation rows
//! ([`x86::tile`]): each task takes a run of eight-row groups and, for prefill and batched
//! decode, sweeps the activation rows in chunks so a chunk stays in L2 while the group's weights
//! stay in L1. Elsewhere, for one activation row (decode) each task walks a contiguous run of
//! weight rows, four at a time where the dtype has a four-row kernel; for several, each task
//! takes a run of weight rows and sweeps the activation rows in tiles. Quantized activations
//! live in a thread-local scratch buffer that grows once and is reused on every call.

#[cfg(target_arch = "aarch64")]
pub mod neon;
pub mod scalar;
#[cfg(target_arch = "x86_64")]
pub mod x86;

use crate::act::{Q8Block, Q8KBlock, quantize_q8, quantize_q8k};
use crate::engine::Engine;
use crate::isa::Isa;
use std::cell::RefCell;
use u_sdk::{DType, Result, TensorView, UError};

/// Four consecutive weight rows (in the slice; the `usize` is the row length in bytes) against
/// one activation row.
pub type RowsFn<B> = unsafe fn(&[u8], usize, &[B]) -> [f32; 4];

/// One weight row against 1 or 4 activation rows (the weight blocks decoded once for all), and
/// optionally four weight rows against one activation row.
#[derive(Clone, Copy, Debug)]
pub struct Multi<B: 'static> {
    /// One activation row (decode).
    pub one: unsafe fn(&[u8], &[&[B]; 1]) -> [f32; 1],
    /// Four activation rows (prefill).
    pub four: unsafe fn(&[u8], &[&[B]; 4]) -> [f32; 4],
    /// Four consecutive weight rows against one activation row ([`RowsFn`]), equal bit for bit
    /// to `one` on each row (decode: the activation block is loaded once for four rows, and more
    /// loads are in flight).
    pub rows: Option<RowsFn<B>>,
}

/// A tile kernel: `w` holds `rows` (1 to the kernel's tile height) weight rows of `stride`
/// bytes; for each of the `m` activation rows `x[c·len..(c + 1)·len]` (`len` blocks or values
/// per row) it writes `y[c·ldy + r]`, r < rows. A row's result does not depend on `rows`, `m` or
/// the other rows.
pub type TileFn<X> = unsafe fn(&[u8], usize, usize, &[X], usize, *mut f32, usize);

/// A dot product of one stored weight row with activation rows.
#[derive(Clone, Copy, Debug)]
pub enum RowDot {
    /// Float weights against f32 activations.
    Float(unsafe fn(&[u8], &[f32]) -> f32),
    /// 32-value blocks against [`Q8Block`] activations.
    Q8(Multi<Q8Block>),
    /// 256-value blocks against [`Q8KBlock`] activations.
    Q8K(Multi<Q8KBlock>),
    /// Up to `.1` (8 or 16) weight rows against any number of [`Q8Block`] activation rows
    /// ([`TileFn`]).
    Tile(TileFn<Q8Block>, usize),
    /// Up to `.1` (8 or 16) weight rows against any number of [`Q8KBlock`] activation rows
    /// ([`TileFn`]).
    TileK(TileFn<Q8KBlock>, usize),
    /// Up to `.1` float weight rows against any number of f32 activation rows ([`TileFn`]).
    FloatTile(TileFn<f32>, usize),
    /// Any other dtype: each row is dequantized (with [`u_sdk::quant`]) into a scratch row and
    /// dotted in f32. Correct but not fast; for formats without a dedicated kernel.
    Dequant,
}

macro_rules! multi {
    ($v:ident, $($f:tt)*) => {
        RowDot::$v(Multi { one: $($f)*::<1>, four: $($f)*::<4>, rows: None })
    };
}

/// The kernel for `dtype` weights on `isa` (which must be available on this CPU).
pub fn select(isa: Isa, dtype: DType) -> RowDot {
    use DType::*;
    #[cfg(target_arch = "x86_64")]
    {
        use x86::{avx2, float, row, tile, tile16, vnni};
        let int = matches!(isa, Isa::Avx2 | Isa::Avx512 | Isa::Avx512Vnni);
        let wide = matches!(isa, Isa::Avx512 | Isa::Avx512Vnni);
        let v = isa == Isa::Avx512Vnni;
        let k = match dtype {
            F32 if wide => Some(RowDot::FloatTile(float::avx512::f32, float::HEIGHT)),
            F16 if wide => Some(RowDot::FloatTile(float::avx512::f16, float::HEIGHT)),
            BF16 if wide => Some(RowDot::FloatTile(float::avx512::bf16, float::HEIGHT)),
            F32 if int => Some(RowDot::FloatTile(float::avx2::f32, float::HEIGHT)),
            F16 if int => Some(RowDot::FloatTile(float::avx2::f16, float::HEIGHT)),
            BF16 if int => Some(RowDot::FloatTile(float::avx2::bf16, float::HEIGHT)),
            Q8_0 if v => Some(RowDot::Tile(tile16::q8_0, tile16::HEIGHT)),
            Q4_0 if v => Some(RowDot::Tile(tile16::q4_0, tile16::HEIGHT)),
            Q4_1 if v => Some(RowDot::Tile(tile16::q4_1, tile16::HEIGHT)),
            Q5_0 if v => Some(RowDot::Tile(tile16::q5_0, tile16::HEIGHT)),
            Q4_K if v => Some(RowDot::TileK(row::q4_k, tile16::HEIGHT)),
            Q5_K if v => Some(multi!(Q8K, vnni::q5_k)),
            Q6_K if v => Some(RowDot::TileK(row::q6_k, tile16::HEIGHT)),
            TQ2_0 if v => Some(multi!(Q8K, vnni::tq2_0)),
            Q8_0 if int => Some(RowDot::Tile(tile::avx2::q8_0, 8)),
            Q4_0 if int => Some(RowDot::Tile(tile::avx2::q4_0, 8)),
            Q4_1 if int => Some(RowDot::Tile(tile::avx2::q4_1, 8)),
            Q5_0 if int => Some(RowDot::Tile(tile::avx2::q5_0, 8)),
            Q4_K if int => Some(RowDot::TileK(tile::avx2::q4_k, 8)),
            Q5_K if int => Some(multi!(Q8K, avx2::q5_k)),
            Q6_K if int => Some(RowDot::TileK(tile::avx2::q6_k, 8)),
            TQ2_0 if int => Some(multi!(Q8K, avx2::tq2_0)),
            _ => None,
        };
        if let Some(k) = k {
            return k;
        }
    }
    #[cfg(target_arch = "aarch64")]
    if let Some(k) = neon::select(isa, dtype) {
        return k;
    }
    let _ = isa;
    match dtype {
        F32 => RowDot::Float(scalar::f32_row),
        F16 => RowDot::Float(scalar::f16_row),
        BF16 => RowDot::Float(scalar::bf16_row),
        Q8_0 => multi!(Q8, scalar::q8_0_n),
        Q4_0 => multi!(Q8, scalar::q4_0_n),
        Q4_1 => multi!(Q8, scalar::q4_1_n),
        Q5_0 => multi!(Q8, scalar::q5_0_n),
        Q4_K => multi!(Q8K, scalar::q4_k_n),
        Q5_K => multi!(Q8K, scalar::q5_k_n),
        Q6_K => multi!(Q8K, scalar::q6_k_n),
        TQ1_0 => multi!(Q8K, scalar::tq1_0_n),
        TQ2_0 => multi!(Q8K, scalar::tq2_0_n),
        _ => RowDot::Dequant,
    }
}

/// Whether `dtype` has a dedicated kernel (no per-row dequantization).
pub fn has_direct_kernel(dtype: DType) -> bool {
    !matches!(select(Isa::Scalar, dtype), RowDot::Dequant)
}

thread_local! {
    static Q8_SCRATCH: RefCell<Vec<Q8Block>> = const { RefCell::new(Vec::new()) };
    static Q8K_SCRATCH: RefCell<Vec<Q8KBlock>> = const { RefCell::new(Vec::new()) };
    static ROW_SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with a thread-local scratch vector of at least `len` elements (a fresh one if the
/// thread's buffer is already borrowed).
fn with_scratch<T: Default + Clone, R>(
    key: &'static std::thread::LocalKey<RefCell<Vec<T>>>,
    len: usize,
    f: impl FnOnce(&mut [T]) -> R,
) -> R {
    key.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => {
            if buf.len() < len {
                buf.resize(len, T::default());
            }
            f(&mut buf[..len])
        }
        Err(_) => f(&mut vec![T::default(); len]),
    })
}

/// A weight matrix as the kernels read it: `rows` rows of `row_len` values of `dtype`, stored
/// row after row in `data`.
#[derive(Clone, Copy)]
pub struct Weight<'a> {
    /// Storage type (float or block-quantized).
    pub dtype: DType,
    /// Output features (`n`).
    pub rows: u64,
    /// Input features (`k`).
    pub row_len: u64,
    /// The rows' bytes.
    pub data: &'a [u8],
}

/// Shape-checks and runs `y[m × n] = x[m × k] · Wᵀ` for a weight view (`[.., n, k]`).
pub fn matmul(eng: &Engine, w: &TensorView<'_>, x: &[f32], m: usize, y: &mut [f32]) -> Result<()> {
    if w.shape.len() < 2 {
        return Err(UError::invalid(format!(
            "matmul: weight {:?} {:?}: weight must have at least 2 dimensions [n, k]",
            w.dtype,
            w.shape.as_slice()
        )));
    }
    let weight = Weight {
        dtype: w.dtype,
        rows: w.rows(),
        row_len: w.row_len(),
        data: w.data.as_slice(),
    };
    matmul_weight(eng, weight, x, m, y)
}

/// Shape-checks and runs `y[m × n] = x[m × k] · Wᵀ`.
pub fn matmul_weight(
    eng: &Engine,
    w: Weight<'_>,
    x: &[f32],
    m: usize,
    y: &mut [f32],
) -> Result<()> {
    let bad = |why: String| {
        UError::invalid(format!(
            "matmul: weight {:?} [{}, {}], x {} values, m {m}, y {} values: {why}",
            w.dtype,
            w.rows,
            w.row_len,
            x.len(),
            y.len()
        ))
    };
    let k = usize::try_from(w.row_len).map_err(|_| bad("row length overflows".into()))?;
    let n = usize::try_from(w.rows).map_err(|_| bad("row count overflows".into()))?;
    let bs = w.dtype.block_size();
    if k == 0 || !k.is_multiple_of(bs) {
        return Err(bad(format!(
            "k = {k} is not a positive multiple of the {bs}-value block"
        )));
    }
    let need = n
        .checked_mul(k)
        .and_then(|e| w.dtype.bytes_for(e as u64))
        .ok_or_else(|| bad("size overflows".into()))?;
    if need != w.data.len() as u64 {
        return Err(bad(format!(
            "weight needs {need} bytes, has {}",
            w.data.len()
        )));
    }
    if m.checked_mul(k) != Some(x.len()) {
        return Err(bad(format!("x must hold m·k = {m}·{k} values")));
    }
    if m.checked_mul(n) != Some(y.len()) {
        return Err(bad(format!("y must hold m·n = {m}·{n} values")));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    let data = w.data;
    let rb = k / bs * w.dtype.block_bytes();
    let row = |r: usize| &data[r * rb..(r + 1) * rb];
    let dtype = w.dtype;
    match select(eng.isa, dtype) {
        RowDot::Float(f) => {
            // SAFETY: `select` returned a kernel for an available ISA; row and x lengths match.
            let one = |r: usize, i: usize| unsafe { f(row(r), &x[i * k..(i + 1) * k]) };
            run(
                eng,
                n,
                m,
                y,
                one,
                |r, i| core::array::from_fn(|j| one(r, i + j)),
                NO_ROWS,
            )
        }
        RowDot::Q8(f) => {
            let nb = k / 32;
            with_scratch(&Q8_SCRATCH, m * nb, |qx| {
                quantize_rows(eng, x, k, qx, nb, quantize_q8);
                run_blocks(eng, n, m, y, (data, rb), qx, nb, f)
            })
        }
        RowDot::Tile(f, h) => {
            let nb = k / 32;
            with_scratch(&Q8_SCRATCH, m * nb, |qx| {
                quantize_rows(eng, x, k, qx, nb, quantize_q8);
                run_tiles(eng, (n, h), m, y, (data, rb), qx, nb, f)
            })
        }
        RowDot::TileK(f, h) => {
            let nb = k / 256;
            with_scratch(&Q8K_SCRATCH, m * nb, |qx| {
                quantize_rows(eng, x, k, qx, nb, quantize_q8k);
                run_tiles(eng, (n, h), m, y, (data, rb), qx, nb, f)
            })
        }
        RowDot::FloatTile(f, h) => run_tiles(eng, (n, h), m, y, (data, rb), x, k, f),
        RowDot::Q8K(f) => {
            let nb = k / 256;
            with_scratch(&Q8K_SCRATCH, m * nb, |qx| {
                quantize_rows(eng, x, k, qx, nb, quantize_q8k);
                run_blocks(eng, n, m, y, (data, rb), qx, nb, f)
            })
        }
        RowDot::Dequant => {
            let vec = eng.vec;
            let one = |r: usize, i: usize| {
                with_scratch(&ROW_SCRATCH, k, |buf| {
                    // Lengths were checked above, so this cannot fail; NaN marks a bug.
                    match u_sdk::quant::dequantize(dtype, row(r), buf) {
                        Ok(()) => vec.dot(buf, &x[i * k..(i + 1) * k]),
                        Err(_) => f32::NAN,
                    }
                })
            };
            run(
                eng,
                n,
                m,
                y,
                one,
                |r, i| core::array::from_fn(|j| one(r, i + j)),
                NO_ROWS,
            )
        }
    }
    Ok(())
}

/// [`run`] for block kernels over quantized activations `qx` (`nb` blocks per row).
#[allow(clippy::too_many_arguments)]
fn run_blocks<B: Sync>(
    eng: &Engine,
    n: usize,
    m: usize,
    y: &mut [f32],
    (data, rb): (&[u8], usize),
    qx: &[B],
    nb: usize,
    f: Multi<B>,
) {
    let row = |r: usize| &data[r * rb..(r + 1) * rb];
    let xr = |i: usize| &qx[i * nb..(i + 1) * nb];
    // SAFETY: `select` returned kernels for an available ISA; each activation row holds one
    // block per weight block.
    let one = |r: usize, i: usize| unsafe { (f.one)(row(r), &[xr(i)])[0] };
    let four =
        |r: usize, i: usize| unsafe { (f.four)(row(r), &[xr(i), xr(i + 1), xr(i + 2), xr(i + 3)]) };
    // SAFETY: as above; rows `r..r + 4` exist and are consecutive, `rb` bytes each.
    let rows = f
        .rows
        .map(|g| move |r: usize| unsafe { g(&data[r * rb..(r + 4) * rb], rb, xr(0)) });
    run(eng, n, m, y, one, four, rows)
}

/// Activation rows per chunk of a tile sweep: 64 rows of a 4096-wide layer's int8 blocks are
/// about 384 KiB, which stays in L2 while a task's eight-row weight groups pass over it.
pub(crate) const M_CHUNK: usize = 64;

/// Fills `y` through tile kernel `f` ([`TileFn`]) of height `h`, in parallel over runs of
/// `h`-row groups; each task sweeps the activation rows (`len` elements each) in chunks of
/// [`M_CHUNK`].
#[allow(clippy::too_many_arguments)]
fn run_tiles<X: Sync>(
    eng: &Engine,
    (n, h): (usize, usize),
    m: usize,
    y: &mut [f32],
    (data, rb): (&[u8], usize),
    x: &[X],
    len: usize,
    f: TileFn<X>,
) {
    let groups = n.div_ceil(h);
    let threads = eng.threads.max(1);
    let per = (groups / (threads * if m == 1 { 16 } else { 8 })).clamp(1, 256 / h);
    let out = OutPtr(y.as_mut_ptr());
    eng.split(groups.div_ceil(per), |t| {
        let (g0, g1) = (t * per, ((t + 1) * per).min(groups));
        for c0 in (0..m).step_by(M_CHUNK) {
            let cw = (m - c0).min(M_CHUNK);
            for g in g0..g1 {
                let r0 = h * g;
                let rows = (n - r0).min(h);
                // SAFETY: `select` chose `f` for an available ISA; the slice holds `rows` whole
                // rows, the chunk `cw` activation rows of `len` elements, and the task writes
                // only elements c·n + r of its own rows r0..r0 + rows (c < m), inside y (m·n).
                unsafe {
                    f(
                        &data[r0 * rb..(r0 + rows) * rb],
                        rb,
                        rows,
                        &x[c0 * len..(c0 + cw) * len],
                        cw,
                        out.ptr().add(c0 * n + r0),
                        n,
                    )
                };
            }
        }
    });
}

/// Quantizes `m` activation rows of `k` values into `nb` blocks each, split over the team for
/// prefill.
fn quantize_rows<B: Send>(
    eng: &Engine,
    x: &[f32],
    k: usize,
    qx: &mut [B],
    nb: usize,
    q: fn(&[f32], &mut [B]),
) {
    let m = x.len() / k;
    if m <= 1 {
        q(x, qx);
        return;
    }
    let per = m.div_ceil(4 * eng.threads.max(1));
    let out = OutPtr(qx.as_mut_ptr());
    eng.split(m.div_ceil(per), |t| {
        let (i0, i1) = (t * per, ((t + 1) * per).min(m));
        // SAFETY: tasks cover disjoint row ranges i0..i1 of `qx` (m·nb blocks).
        let o = unsafe { std::slice::from_raw_parts_mut(out.ptr().add(i0 * nb), (i1 - i0) * nb) };
        q(&x[i0 * k..i1 * k], o);
    });
}

/// A pointer to an output that tasks share; each task writes only its own elements.
struct OutPtr<T>(*mut T);
impl<T> Clone for OutPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for OutPtr<T> {}
// SAFETY: tasks write disjoint elements (see each use).
unsafe impl<T: Send> Send for OutPtr<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for OutPtr<T> {}

impl<T> OutPtr<T> {
    /// The pointer (a method, so closures capture the whole `Sync` wrapper, not the field).
    fn ptr(self) -> *mut T {
        self.0
    }
}

/// The `rows` argument of [`run`] for kernels without a four-weight-row form.
const NO_ROWS: Option<fn(usize) -> [f32; 4]> = None;

/// Activation rows per tile in prefill.
const M_TILE: usize = 16;

/// Fills `y[i·n + r] = one(r, i)` in parallel over runs of weight rows `r`; for several
/// activation rows, `four(r, i)` computes rows `i..i + 4` at once; for one, `rows(r)` (when
/// given) computes weight rows `r..r + 4`.
fn run(
    eng: &Engine,
    n: usize,
    m: usize,
    y: &mut [f32],
    one: impl Fn(usize, usize) -> f32 + Sync,
    four: impl Fn(usize, usize) -> [f32; 4] + Sync,
    rows: Option<impl Fn(usize) -> [f32; 4] + Sync>,
) {
    let threads = eng.threads.max(1);
    let out = OutPtr(y.as_mut_ptr());
    if m == 1 {
        // Whole groups of four rows per task, for `rows`.
        let chunk = (n / (threads * 16)).clamp(4, 256).next_multiple_of(4);
        eng.split(n.div_ceil(chunk), |c| {
            let (r0, r1) = (c * chunk, ((c + 1) * chunk).min(n));
            // SAFETY: tasks cover disjoint row ranges `r0..r1` of `y` (n values).
            let ys = unsafe { std::slice::from_raw_parts_mut(out.ptr().add(r0), r1 - r0) };
            let mut j = 0;
            if let Some(rows) = &rows {
                while j + 4 <= ys.len() {
                    ys[j..j + 4].copy_from_slice(&rows(r0 + j));
                    j += 4;
                }
            }
            for (j, v) in ys.iter_mut().enumerate().skip(j) {
                *v = one(r0 + j, 0);
            }
        });
        return;
    }
    let chunk = (n / (threads * 8)).clamp(1, 64);
    eng.split(n.div_ceil(chunk), |t| {
        let (r0, r1) = (t * chunk, ((t + 1) * chunk).min(n));
        for i0 in (0..m).step_by(M_TILE) {
            let i1 = (i0 + M_TILE).min(m);
            for r in r0..r1 {
                let mut i = i0;
                while i + 4 <= i1 {
                    let v = four(r, i);
                    for (j, &vj) in v.iter().enumerate() {
                        // SAFETY: i + j < m, r < n, so the index is inside y; only this task
                        // writes column r.
                        unsafe { *out.ptr().add((i + j) * n + r) = vj };
                    }
                    i += 4;
                }
                while i < i1 {
                    let v = one(r, i);
                    // SAFETY: as above.
                    unsafe { *out.ptr().add(i * n + r) = v };
                    i += 1;
                }
            }
        }
    });
}
