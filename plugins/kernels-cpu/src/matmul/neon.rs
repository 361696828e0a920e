//! AArch64 NEON dot-product kernels: int8 dots through `sdot` where the CPU has the dot-product
//! extension ([`Isa::NeonDot`]), through `smull`/`smlal2` + `sadalp` otherwise ([`Isa::Neon`]),
//! and float rows with `fmla`.
//!
//! The integer kernels are written once (`int_kernels!`) and stamped out per ISA with a
//! different `i8 × i8 → i32` primitive, as the x86 kernels are. Unsigned weight codes (Q4_0,
//! Q4_1, Q5_0, k-quants, TQ2_0; all ≤ 63, so they fit the signed operand) are dotted as they are;
//! offsets (`q − 8`, `q − 32`, …) and minimums are applied afterwards with the activation sums,
//! as the scalar reference does. The k-quant and TQ2_0 integer sums are exact and the f32
//! operations per super-block are the scalar kernel's, so those results equal the scalar path
//! bit for bit.
//!
//! `sdot` is reached through `asm!` (its intrinsic `vdotq_s32` is not stable) and f16 → f32
//! through `fcvtl` (the `float16x4_t` intrinsics are not stable either; `fcvtl` is base ARMv8).
//!
//! # Safety
//! Every `unsafe fn` here requires the CPU features in its `#[target_feature]` attribute and
//! slices of whole blocks (`w.len() == x.len() · block_bytes`); [`select`] hands out only
//! kernels of an available ISA, and [`super::matmul`] checks the lengths.

#![allow(clippy::missing_safety_doc)]

use super::{Multi, RowDot};
use crate::act::{Q8Block, Q8KBlock};
use crate::isa::Isa;
use crate::matmul::scalar::{self, half_to_f32, k_min_sum, k_scale_min};
use core::arch::aarch64::*;
use core::arch::asm;
use u_sdk::DType;

/// The NEON kernel for `dtype` on `isa`, or `None` where the scalar kernel is used.
pub fn select(isa: Isa, dtype: DType) -> Option<RowDot> {
    use DType::*;
    macro_rules! q8 {
        ($m:ident :: $f:ident, $rows:ident) => {
            RowDot::Q8(Multi {
                one: $m::$f::<1>,
                four: $m::$f::<4>,
                rows: Some($m::$rows),
            })
        };
    }
    macro_rules! q8k {
        ($m:ident :: $f:ident) => {
            RowDot::Q8K(Multi {
                one: $m::$f::<1>,
                four: $m::$f::<4>,
                rows: None,
            })
        };
    }
    let neon = matches!(isa, Isa::Neon | Isa::NeonDot);
    let k = match dtype {
        F32 if neon => RowDot::Float(float::f32_row),
        F16 if neon => RowDot::Float(float::f16_row),
        BF16 if neon => RowDot::Float(float::bf16_row),
        Q8_0 if isa == Isa::NeonDot => q8!(dotprod::q8_0, q8_0_rows),
        Q4_0 if isa == Isa::NeonDot => q8!(dotprod::q4_0, q4_0_rows),
        Q4_1 if isa == Isa::NeonDot => q8!(dotprod::q4_1, q4_1_rows),
        Q5_0 if isa == Isa::NeonDot => q8!(dotprod::q5_0, q5_0_rows),
        Q4_K if isa == Isa::NeonDot => q8k!(dotprod::q4_k),
        Q5_K if isa == Isa::NeonDot => q8k!(dotprod::q5_k),
        Q6_K if isa == Isa::NeonDot => q8k!(dotprod::q6_k),
        TQ2_0 if isa == Isa::NeonDot => q8k!(dotprod::tq2_0),
        Q8_0 if neon => q8!(base::q8_0, q8_0_rows),
        Q4_0 if neon => q8!(base::q4_0, q4_0_rows),
        Q4_1 if neon => q8!(base::q4_1, q4_1_rows),
        Q5_0 if neon => q8!(base::q5_0, q5_0_rows),
        Q4_K if neon => q8k!(base::q4_k),
        Q5_K if neon => q8k!(base::q5_k),
        Q6_K if neon => q8k!(base::q6_k),
        TQ2_0 if neon => q8k!(base::tq2_0),
        _ => return None,
    };
    Some(k)
}

/// The f16 at `p` as f32, converted in general-purpose registers ([`half_to_f32`]).
#[inline(always)]
unsafe fn f16_at(p: *const u8) -> f32 {
    // SAFETY: the caller passes a pointer to two readable bytes.
    half_to_f32(unsafe { (p as *const u16).read_unaligned() })
}

/// 16 bytes at `p` as signed lanes.
#[inline(always)]
unsafe fn ld_s8(p: *const u8) -> int8x16_t {
    // SAFETY: the caller passes a pointer to 16 readable bytes (`ld1` has no alignment needs).
    unsafe { vreinterpretq_s8_u8(vld1q_u8(p)) }
}

/// 16 activation codes at `p`.
#[inline(always)]
unsafe fn ld_x(p: *const i8) -> int8x16_t {
    // SAFETY: the caller passes a pointer to 16 readable bytes.
    unsafe { vld1q_s8(p) }
}

/// `acc + Σ quads(a·b)` in base NEON: `smull`/`smlal2` put two products in each i16 lane (each
/// `|a·b| ≤ 128·127`, so the pair fits), `sadalp` adds pairs of lanes into the i32 lanes. The
/// lane grouping differs from `sdot`'s, the lane total does not.
#[inline]
#[target_feature(enable = "neon")]
fn dot_base(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let p = vmlal_high_s8(vmull_s8(vget_low_s8(a), vget_low_s8(b)), a, b);
    vpadalq_s16(acc, p)
}

/// `acc + Σ quads(a·b)` through the dot-product extension's `sdot`.
#[inline]
#[target_feature(enable = "neon,dotprod")]
fn dot_sdot(mut acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    // SAFETY: `sdot` reads and writes only the named registers, and this function requires the
    // dot-product extension.
    unsafe {
        asm!(
            "sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    acc
}

/// Byte `i` of each half = 16 where bit `i` of `bits` (bits 0–15 for the first vector, 16–31
/// for the second) is set: the fifth bit of Q5_0's codes.
#[inline]
#[target_feature(enable = "neon")]
fn fifth_bits(bits: u32) -> (uint8x16_t, uint8x16_t) {
    // Bytes 1, 2, 4, …, 128 twice: one bit per lane.
    let mask = vreinterpretq_u8_u64(vdupq_n_u64(0x8040_2010_0804_0201));
    let b = bits.to_le_bytes();
    let spread = |lo: u8, hi: u8| {
        let v = vcombine_u8(vdup_n_u8(lo), vdup_n_u8(hi));
        vandq_u8(vtstq_u8(v, mask), vdupq_n_u8(16))
    };
    (spread(b[0], b[1]), spread(b[2], b[3]))
}

/// The 32 nibbles of 16 bytes at `p`: low nibbles → values 0–15, high → 16–31.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn nibbles(p: *const u8) -> (uint8x16_t, uint8x16_t) {
    // SAFETY: the caller passes a pointer to 16 readable bytes.
    let raw = unsafe { vld1q_u8(p) };
    (vandq_u8(raw, vdupq_n_u8(0x0f)), vshrq_n_u8::<4>(raw))
}

/// The integer kernels, generic over `R` activation rows: each weight block is decoded once and
/// dotted with the same block of every row (prefill reuses the decode work; decode uses `R = 1`).
/// Per row the operations are those of the one-row kernel, so results do not depend on `R`.
macro_rules! int_kernels {
    ($feat:literal, $dot:ident) => {
        use super::*;

        /// `Σ q·x` over one 32-value block: `q` the two 16-code halves, `xq` the activations.
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn dot32(q: (int8x16_t, int8x16_t), xq: *const i8) -> int32x4_t {
            // SAFETY: `xq` points to a 32-value activation block; the callers enable $feat.
            unsafe {
                let s = $dot(vdupq_n_s32(0), q.0, ld_x(xq));
                $dot(s, q.1, ld_x(xq.add(16)))
            }
        }

        /// Shared loop of the 32-value formats: `Σ d_w·d_x·Σq·x` over blocks in f32 lanes, plus
        /// (when `OFF`) `Σ off(b)·offset_sum(x_b)` in scalars.
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn q32<const R: usize, const OFF: bool>(
            w: &[u8],
            xs: &[&[Q8Block]; R],
            bb: usize,
            codes: impl Fn(*const u8) -> (int8x16_t, int8x16_t),
            off: impl Fn(*const u8) -> f32,
            offset_sum: fn(&Q8Block) -> f32,
        ) -> [f32; R] {
            // SAFETY: see the module docs; `codes`/`off` read inside the block, and each
            // activation row holds one block per weight block.
            unsafe {
                let mut acc = [[vdupq_n_f32(0.0); 2]; R];
                let mut corr = [[0f32; 2]; R];
                let nb = w.len() / bb;
                // Two blocks per step into two accumulator sets (constant indices once the `h`
                // loop unrolls, so everything stays in registers).
                let mut bi = 0;
                while bi < nb {
                    for h in 0..2 {
                        if bi + h < nb {
                            let p = w.as_ptr().add((bi + h) * bb);
                            let q = codes(p);
                            let d = f16_at(p);
                            let o = if OFF { off(p) } else { 0.0 };
                            for r in 0..R {
                                let xb = xs[r].get_unchecked(bi + h);
                                let s = dot32(q, xb.qs.as_ptr());
                                acc[r][h] = vfmaq_n_f32(acc[r][h], vcvtq_f32_s32(s), d * xb.d);
                                if OFF {
                                    corr[r][h] += o * offset_sum(xb);
                                }
                            }
                        }
                    }
                    bi += 2;
                }
                core::array::from_fn(|r| {
                    let s = vaddvq_f32(vaddq_f32(acc[r][0], acc[r][1]));
                    if OFF {
                        s + (corr[r][0] + corr[r][1])
                    } else {
                        s
                    }
                })
            }
        }

        /// Four weight rows (`stride` bytes apart from `w`) against one activation row: per
        /// row the operations of [`q32`] with `R = 1` (so the same result bit for bit), with the
        /// activation block loaded once for the four rows.
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn q32_rows<const OFF: bool>(
            w: &[u8],
            stride: usize,
            x: &[Q8Block],
            bb: usize,
            codes: impl Fn(*const u8) -> (int8x16_t, int8x16_t),
            off: impl Fn(*const u8) -> f32,
            offset_sum: fn(&Q8Block) -> f32,
        ) -> [f32; 4] {
            // SAFETY: see the module docs; `w` holds four rows of `stride` bytes, each a whole
            // number of `bb`-byte blocks, and `x` one block per weight block.
            unsafe {
                let mut acc = [[vdupq_n_f32(0.0); 2]; 4];
                let mut corr = [[0f32; 2]; 4];
                let nb = stride / bb;
                let mut bi = 0;
                while bi < nb {
                    for h in 0..2 {
                        if bi + h < nb {
                            let xb = x.get_unchecked(bi + h);
                            let xq = (ld_x(xb.qs.as_ptr()), ld_x(xb.qs.as_ptr().add(16)));
                            let os = if OFF { offset_sum(xb) } else { 0.0 };
                            for r in 0..4 {
                                let p = w.as_ptr().add(r * stride + (bi + h) * bb);
                                let q = codes(p);
                                let s = $dot($dot(vdupq_n_s32(0), q.0, xq.0), q.1, xq.1);
                                let dd = f16_at(p) * xb.d;
                                acc[r][h] = vfmaq_n_f32(acc[r][h], vcvtq_f32_s32(s), dd);
                                if OFF {
                                    corr[r][h] += off(p) * os;
                                }
                            }
                        }
                    }
                    bi += 2;
                }
                core::array::from_fn(|r| {
                    let s = vaddvq_f32(vaddq_f32(acc[r][0], acc[r][1]));
                    if OFF {
                        s + (corr[r][0] + corr[r][1])
                    } else {
                        s
                    }
                })
            }
        }

        /// Codes of a Q8_0 block (d at 0, 32 signed values at 2..34).
        #[inline(always)]
        unsafe fn q8_0_codes(p: *const u8) -> (int8x16_t, int8x16_t) {
            // SAFETY: the caller passes a pointer to a 34-byte block.
            unsafe { (ld_s8(p.add(2)), ld_s8(p.add(18))) }
        }

        /// Codes of a Q4_0 (nibbles at 2..18) or Q4_1 (nibbles at 4..20) block.
        #[inline(always)]
        unsafe fn q4_codes<const AT: usize>(p: *const u8) -> (int8x16_t, int8x16_t) {
            // SAFETY: the caller passes a pointer to a whole block with nibbles at `AT`.
            unsafe {
                let (lo, hi) = nibbles(p.add(AT));
                (vreinterpretq_s8_u8(lo), vreinterpretq_s8_u8(hi))
            }
        }

        /// Codes of a Q5_0 block (d at 0, qh at 2..6, nibbles at 6..22).
        #[inline(always)]
        unsafe fn q5_0_codes(p: *const u8) -> (int8x16_t, int8x16_t) {
            // SAFETY: the caller passes a pointer to a 22-byte block.
            unsafe {
                let (lo, hi) = nibbles(p.add(6));
                let (b0, b1) = fifth_bits((p.add(2) as *const u32).read_unaligned());
                (
                    vreinterpretq_s8_u8(vorrq_u8(lo, b0)),
                    vreinterpretq_s8_u8(vorrq_u8(hi, b1)),
                )
            }
        }

        /// Q8_0 weights.
        #[target_feature(enable = $feat)]
        pub unsafe fn q8_0<const R: usize>(w: &[u8], xs: &[&[Q8Block]; R]) -> [f32; R] {
            // SAFETY: 34-byte blocks; no offset term.
            unsafe { q32::<R, false>(w, xs, 34, |p| q8_0_codes(p), |_| 0.0, |_| 0.0) }
        }

        /// Q4_0 weights.
        #[target_feature(enable = $feat)]
        pub unsafe fn q4_0<const R: usize>(w: &[u8], xs: &[&[Q8Block]; R]) -> [f32; R] {
            // SAFETY: 18-byte blocks: d at 0, nibbles at 2..18.
            unsafe {
                q32::<R, true>(
                    w,
                    xs,
                    18,
                    |p| q4_codes::<2>(p),
                    |p| -8.0 * f16_at(p),
                    |b| b.s,
                )
            }
        }

        /// Q4_1 weights.
        #[target_feature(enable = $feat)]
        pub unsafe fn q4_1<const R: usize>(w: &[u8], xs: &[&[Q8Block]; R]) -> [f32; R] {
            // SAFETY: 20-byte blocks: d at 0, m at 2, nibbles at 4..20.
            unsafe {
                q32::<R, true>(
                    w,
                    xs,
                    20,
                    |p| q4_codes::<4>(p),
                    |p| f16_at(p.add(2)),
                    |b| b.s1,
                )
            }
        }

        /// Q5_0 weights.
        #[target_feature(enable = $feat)]
        pub unsafe fn q5_0<const R: usize>(w: &[u8], xs: &[&[Q8Block]; R]) -> [f32; R] {
            // SAFETY: 22-byte blocks: d at 0, qh at 2..6, nibbles at 6..22.
            unsafe { q32::<R, true>(w, xs, 22, |p| q5_0_codes(p), |p| -16.0 * f16_at(p), |b| b.s) }
        }

        /// Q8_0, four weight rows `stride` bytes apart against one activation row (per row
        /// the operations of [`q8_0`] with `R = 1`, so the same result bit for bit).
        #[target_feature(enable = $feat)]
        pub unsafe fn q8_0_rows(w: &[u8], stride: usize, x: &[Q8Block]) -> [f32; 4] {
            // SAFETY: as `q8_0`.
            unsafe { q32_rows::<false>(w, stride, x, 34, |p| q8_0_codes(p), |_| 0.0, |_| 0.0) }
        }

        /// Q4_0, four weight rows `stride` bytes apart against one activation row (per row
        /// the operations of [`q4_0`] with `R = 1`, so the same result bit for bit).
        #[target_feature(enable = $feat)]
        pub unsafe fn q4_0_rows(w: &[u8], stride: usize, x: &[Q8Block]) -> [f32; 4] {
            // SAFETY: as `q4_0`.
            unsafe {
                q32_rows::<true>(
                    w,
                    stride,
                    x,
                    18,
                    |p| q4_codes::<2>(p),
                    |p| -8.0 * f16_at(p),
                    |b| b.s,
                )
            }
        }

        /// Q4_1, four weight rows `stride` bytes apart against one activation row (per row
        /// the operations of [`q4_1`] with `R = 1`, so the same result bit for bit).
        #[target_feature(enable = $feat)]
        pub unsafe fn q4_1_rows(w: &[u8], stride: usize, x: &[Q8Block]) -> [f32; 4] {
            // SAFETY: as `q4_1`.
            unsafe {
                q32_rows::<true>(
                    w,
                    stride,
                    x,
                    20,
                    |p| q4_codes::<4>(p),
                    |p| f16_at(p.add(2)),
                    |b| b.s1,
                )
            }
        }

        /// Q5_0, four weight rows `stride` bytes apart against one activation row (per row
        /// the operations of [`q5_0`] with `R = 1`, so the same result bit for bit).
        #[target_feature(enable = $feat)]
        pub unsafe fn q5_0_rows(w: &[u8], stride: usize, x: &[Q8Block]) -> [f32; 4] {
            // SAFETY: as `q5_0`.
            unsafe {
                q32_rows::<true>(
                    w,
                    stride,
                    x,
                    22,
                    |p| q5_0_codes(p),
                    |p| -16.0 * f16_at(p),
                    |b| b.s,
                )
            }
        }

        /// Q4_K weights (integer sums exact, so equal to the scalar kernel bit for bit).
        #[target_feature(enable = $feat)]
        pub unsafe fn q4_k<const R: usize>(w: &[u8], xs: &[&[Q8KBlock]; R]) -> [f32; R] {
            // SAFETY: 144-byte blocks: d, dmin, scales[12], qs[128].
            unsafe {
                let mut acc = [0f32; R];
                for (bi, b) in w.chunks_exact(144).enumerate() {
                    let p = b.as_ptr();
                    let (sc, mn) = k_scale_min(&b[4..16]);
                    let mut sumi = [vdupq_n_s32(0); R];
                    for j in 0..4 {
                        let (l0, h0) = nibbles(p.add(16 + 32 * j));
                        let (l1, h1) = nibbles(p.add(32 + 32 * j));
                        // Low nibbles of the 32 bytes are values 64j + 0..32, high nibbles
                        // values 64j + 32..64.
                        let lo = (vreinterpretq_s8_u8(l0), vreinterpretq_s8_u8(l1));
                        let hi = (vreinterpretq_s8_u8(h0), vreinterpretq_s8_u8(h1));
                        let (s0, s1) = (i32::from(sc[2 * j]), i32::from(sc[2 * j + 1]));
                        for r in 0..R {
                            let xq = xs[r].get_unchecked(bi).qs.as_ptr().add(64 * j);
                            sumi[r] = vmlaq_n_s32(sumi[r], dot32(lo, xq), s0);
                            sumi[r] = vmlaq_n_s32(sumi[r], dot32(hi, xq.add(32)), s1);
                        }
                    }
                    let (d, dmin) = (f16_at(p), f16_at(p.add(2)));
                    for r in 0..R {
                        let xb = xs[r].get_unchecked(bi);
                        let summ = k_min_sum(&mn, &xb.bsums);
                        acc[r] += xb.d * (d * vaddvq_s32(sumi[r]) as f32 - dmin * summ as f32);
                    }
                }
                acc
            }
        }

        /// Q5_K weights (bit-exact with the scalar kernel).
        #[target_feature(enable = $feat)]
        pub unsafe fn q5_k<const R: usize>(w: &[u8], xs: &[&[Q8KBlock]; R]) -> [f32; R] {
            // SAFETY: 176-byte blocks: d, dmin, scales[12], qh[32], qs[128].
            unsafe {
                let one = vdupq_n_u8(1);
                let mut acc = [0f32; R];
                for (bi, b) in w.chunks_exact(176).enumerate() {
                    let p = b.as_ptr();
                    let (sc, mn) = k_scale_min(&b[4..16]);
                    let mut qh = [vld1q_u8(p.add(16)), vld1q_u8(p.add(32))];
                    let mut sumi = [vdupq_n_s32(0); R];
                    for j in 0..4 {
                        // Bit 2j of qh[l] is the fifth bit of value l of sub-block 2j, bit
                        // 2j + 1 that of sub-block 2j + 1.
                        let mut fifth = || {
                            let f = qh.map(|v| vshlq_n_u8::<4>(vandq_u8(v, one)));
                            qh = qh.map(|v| vshrq_n_u8::<1>(v));
                            f
                        };
                        let (f0, f1) = (fifth(), fifth());
                        let (l0, h0) = nibbles(p.add(48 + 32 * j));
                        let (l1, h1) = nibbles(p.add(64 + 32 * j));
                        let lo = (
                            vreinterpretq_s8_u8(vorrq_u8(l0, f0[0])),
                            vreinterpretq_s8_u8(vorrq_u8(l1, f0[1])),
                        );
                        let hi = (
                            vreinterpretq_s8_u8(vorrq_u8(h0, f1[0])),
                            vreinterpretq_s8_u8(vorrq_u8(h1, f1[1])),
                        );
                        let (s0, s1) = (i32::from(sc[2 * j]), i32::from(sc[2 * j + 1]));
                        for r in 0..R {
                            let xq = xs[r].get_unchecked(bi).qs.as_ptr().add(64 * j);
                            sumi[r] = vmlaq_n_s32(sumi[r], dot32(lo, xq), s0);
                            sumi[r] = vmlaq_n_s32(sumi[r], dot32(hi, xq.add(32)), s1);
                        }
                    }
                    let (d, dmin) = (f16_at(p), f16_at(p.add(2)));
                    for r in 0..R {
                        let xb = xs[r].get_unchecked(bi);
                        let summ = k_min_sum(&mn, &xb.bsums);
                        acc[r] += xb.d * (d * vaddvq_s32(sumi[r]) as f32 - dmin * summ as f32);
                    }
                }
                acc
            }
        }

        /// Q6_K weights (bit-exact with the scalar kernel).
        #[target_feature(enable = $feat)]
        pub unsafe fn q6_k<const R: usize>(w: &[u8], xs: &[&[Q8KBlock]; R]) -> [f32; R] {
            // SAFETY: 210-byte blocks: ql[128], qh[64], scales[16], d.
            unsafe {
                let m4 = vdupq_n_u8(0x0f);
                let m2 = vdupq_n_u8(3);
                let mut acc = [0f32; R];
                for (bi, b) in w.chunks_exact(210).enumerate() {
                    let p = b.as_ptr();
                    let sc = &b[192..208];
                    let s = |g: usize| i32::from(sc[g] as i8);
                    let mut sumi = [vdupq_n_s32(0); R];
                    for j in 0..2 {
                        for half in 0..2 {
                            // Values 128j + 32g + 16·half + (0..16), g = 0..4.
                            let ql0 = vld1q_u8(p.add(64 * j + 16 * half));
                            let ql1 = vld1q_u8(p.add(64 * j + 32 + 16 * half));
                            let qh = vld1q_u8(p.add(128 + 32 * j + 16 * half));
                            let lows = [
                                vandq_u8(ql0, m4),
                                vandq_u8(ql1, m4),
                                vshrq_n_u8::<4>(ql0),
                                vshrq_n_u8::<4>(ql1),
                            ];
                            let highs = [
                                vandq_u8(qh, m2),
                                vandq_u8(vshrq_n_u8::<2>(qh), m2),
                                vandq_u8(vshrq_n_u8::<4>(qh), m2),
                                vshrq_n_u8::<6>(qh),
                            ];
                            for g in 0..4 {
                                let q = vorrq_u8(lows[g], vshlq_n_u8::<4>(highs[g]));
                                let q = vreinterpretq_s8_u8(q);
                                let at = 128 * j + 32 * g + 16 * half;
                                let k = at / 16;
                                for r in 0..R {
                                    let xq = xs[r].get_unchecked(bi).qs.as_ptr().add(at);
                                    let v = $dot(vdupq_n_s32(0), q, ld_x(xq));
                                    sumi[r] = vmlaq_n_s32(sumi[r], v, s(k));
                                }
                            }
                        }
                    }
                    let d = f16_at(p.add(208));
                    for r in 0..R {
                        let xb = xs[r].get_unchecked(bi);
                        let sumb: i32 = (0..16).map(|g| s(g) * i32::from(xb.bsums[g])).sum();
                        let total = vaddvq_s32(sumi[r]) - 32 * sumb;
                        acc[r] += (d * xb.d) * total as f32;
                    }
                }
                acc
            }
        }

        /// TQ2_0 weights (bit-exact with the scalar kernel).
        #[target_feature(enable = $feat)]
        pub unsafe fn tq2_0<const R: usize>(w: &[u8], xs: &[&[Q8KBlock]; R]) -> [f32; R] {
            // SAFETY: 66-byte blocks: qs[64], d.
            unsafe {
                let m2 = vdupq_n_u8(3);
                let mut acc = [0f32; R];
                for (bi, b) in w.chunks_exact(66).enumerate() {
                    let p = b.as_ptr();
                    let mut sumi = [vdupq_n_s32(0); R];
                    for j in 0..2 {
                        let raw = [vld1q_u8(p.add(32 * j)), vld1q_u8(p.add(32 * j + 16))];
                        let fields = |s: usize| {
                            raw.map(|v| {
                                let f = match s {
                                    0 => v,
                                    1 => vshrq_n_u8::<2>(v),
                                    2 => vshrq_n_u8::<4>(v),
                                    _ => vshrq_n_u8::<6>(v),
                                };
                                vreinterpretq_s8_u8(vandq_u8(f, m2))
                            })
                        };
                        for s in 0..4 {
                            let [q0, q1] = fields(s);
                            for r in 0..R {
                                let xq = xs[r].get_unchecked(bi).qs.as_ptr();
                                let xq = xq.add(128 * j + 32 * s);
                                sumi[r] = $dot($dot(sumi[r], q0, ld_x(xq)), q1, ld_x(xq.add(16)));
                            }
                        }
                    }
                    let d = f16_at(p.add(64));
                    for r in 0..R {
                        let xb = xs[r].get_unchecked(bi);
                        let sumx: i32 = xb.bsums.iter().map(|&v| i32::from(v)).sum();
                        acc[r] += (d * xb.d) * (vaddvq_s32(sumi[r]) - sumx) as f32;
                    }
                }
                acc
            }
        }
    };
}

/// Base NEON integer kernels (`smull`/`smlal2` + `sadalp`).
pub mod base {
    int_kernels!("neon", dot_base);
}

/// Integer kernels with the dot-product extension (`sdot`).
pub mod dotprod {
    int_kernels!("neon,dotprod", dot_sdot);
}

/// Float-weight rows against f32 activations (`fmla` into four 4-lane accumulators).
pub mod float {
    use super::*;

    /// f32 weights.
    #[target_feature(enable = "neon")]
    pub unsafe fn f32_row(w: &[u8], x: &[f32]) -> f32 {
        // SAFETY: `w` holds `x.len()` f32 values; `ld1` needs no alignment.
        unsafe {
            float_row(
                w,
                x,
                4,
                |p| vreinterpretq_f32_u8(vld1q_u8(p)),
                scalar::f32_row,
            )
        }
    }

    /// f16 weights (exact `fcvtl` conversion).
    #[target_feature(enable = "neon")]
    pub unsafe fn f16_row(w: &[u8], x: &[f32]) -> f32 {
        // SAFETY: as `f32_row`, two bytes per value.
        unsafe {
            float_row(
                w,
                x,
                2,
                |p| half4(vreinterpret_u16_u8(vld1_u8(p))),
                scalar::f16_row,
            )
        }
    }

    /// Four f16 values as f32 through `fcvtl` (base ARMv8; exact, so equal to [`half_to_f32`]).
    #[inline]
    #[target_feature(enable = "neon")]
    fn half4(h: uint16x4_t) -> float32x4_t {
        let f: float32x4_t;
        // SAFETY: `fcvtl` reads and writes only the named registers.
        unsafe {
            asm!(
                "fcvtl {f:v}.4s, {h:v}.4h",
                h = in(vreg) h,
                f = lateout(vreg) f,
                options(pure, nomem, nostack, preserves_flags)
            );
        }
        f
    }

    /// Converts little-endian f16 values (`2·out.len()` bytes of `src`) to f32: the NEON entry
    /// of [`crate::vecops::VecOps`] (f16 KV rows, f16 embedding rows).
    #[target_feature(enable = "neon")]
    pub unsafe fn f16_to_f32(src: &[u8], out: &mut [f32]) {
        let n = out.len().min(src.len() / 2);
        let mut i = 0;
        while i + 4 <= n {
            // SAFETY: 8 bytes at 2·i are inside `src`, 4 floats at i inside `out`.
            unsafe {
                let h = vreinterpret_u16_u8(vld1_u8(src.as_ptr().add(2 * i)));
                vst1q_f32(out.as_mut_ptr().add(i), half4(h));
            }
            i += 4;
        }
        for (o, b) in out[i..n].iter_mut().zip(src[2 * i..].chunks_exact(2)) {
            *o = half_to_f32(u16::from_le_bytes([b[0], b[1]]));
        }
    }

    /// bf16 weights (the upper half of an f32, so `shll #16` converts exactly).
    #[target_feature(enable = "neon")]
    pub unsafe fn bf16_row(w: &[u8], x: &[f32]) -> f32 {
        // SAFETY: as `f32_row`, two bytes per value.
        unsafe {
            float_row(
                w,
                x,
                2,
                |p| vreinterpretq_f32_u32(vshll_n_u16::<16>(vreinterpret_u16_u8(vld1_u8(p)))),
                scalar::bf16_row,
            )
        }
    }

    /// `Σ w·x` with `ld` loading four weights (`esize` bytes each) as f32, four accumulators
    /// of four lanes, and the scalar `tail` for the last `k mod 4` values.
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn float_row(
        w: &[u8],
        x: &[f32],
        esize: usize,
        ld: impl Fn(*const u8) -> float32x4_t,
        tail: fn(&[u8], &[f32]) -> f32,
    ) -> f32 {
        // SAFETY: `w.len() == x.len() · esize`; vector loads only for full groups of 4.
        unsafe {
            let k = x.len();
            let wp = w.as_ptr();
            let xp = x.as_ptr();
            let mut a = [vdupq_n_f32(0.0); 4];
            let mut i = 0;
            while i + 16 <= k {
                for (u, acc) in a.iter_mut().enumerate() {
                    let o = i + 4 * u;
                    *acc = vfmaq_f32(*acc, ld(wp.add(o * esize)), vld1q_f32(xp.add(o)));
                }
                i += 16;
            }
            while i + 4 <= k {
                a[0] = vfmaq_f32(a[0], ld(wp.add(i * esize)), vld1q_f32(xp.add(i)));
                i += 4;
            }
            let s = vaddq_f32(vaddq_f32(a[0], a[1]), vaddq_f32(a[2], a[3]));
            vaddvq_f32(s) + tail(&w[i * esize..], &x[i..])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isa;

    const DIRECT: [DType; 11] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
        DType::TQ2_0,
    ];

    #[test]
    fn the_isa_report_names_neon_and_the_dot_product_extension() {
        let dotprod = isa::features().iter().any(|f| f == "dotprod");
        assert!(Isa::Neon.is_available());
        assert_eq!(Isa::NeonDot.is_available(), dotprod);
        let want = if dotprod { "neon+dotprod" } else { "neon" };
        assert_eq!(Isa::detect().name(), want);
    }

    #[test]
    fn every_direct_dtype_has_a_neon_kernel() {
        for isa in [Isa::Neon, Isa::NeonDot] {
            for dtype in DIRECT {
                assert!(select(isa, dtype).is_some(), "{} {dtype:?}", isa.name());
            }
            assert!(select(isa, DType::Q2_K).is_none());
        }
        assert!(select(Isa::Scalar, DType::Q4_0).is_none());
    }

    /// `fcvtl` and `shll #16` convert every f16/bf16 value exactly (subnormals, infinities, NaN).
    #[test]
    fn half_and_bf16_rows_convert_every_value_exactly() {
        let all: Vec<u8> = (0..=u16::MAX).flat_map(u16::to_le_bytes).collect();
        // One value short of a multiple of 4, so the scalar tail runs too.
        let mut out = vec![f32::NAN; 65535];
        // SAFETY: NEON is part of the aarch64 baseline.
        unsafe { float::f16_to_f32(&all, &mut out) };
        for (h, &got) in (0..=u16::MAX).zip(&out) {
            // `fcvtl` quiets signalling NaNs; NaN is all that matters there.
            let want = half_to_f32(h);
            let same = got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan());
            assert!(same, "{h:#06x}: {got} vs {want}");
        }
        let x = [1.0f32, 0.0, 0.0, 0.0];
        for h in 0..=u16::MAX {
            let mut w = [0u8; 8];
            w[..2].copy_from_slice(&h.to_le_bytes());
            // SAFETY: NEON is part of the aarch64 baseline; 4 values of 2 bytes.
            let (a, b) = unsafe { (float::f16_row(&w, &x), float::bf16_row(&w, &x)) };
            let (wa, wb) = (half_to_f32(h), u_sdk::quant::bf16_to_f32(h));
            assert!(
                a == wa || (a.is_nan() && wa.is_nan()),
                "f16 {h:#06x}: {a} vs {wa}"
            );
            assert!(
                b == wb || (b.is_nan() && wb.is_nan()),
                "bf16 {h:#06x}: {b} vs {wb}"
            );
        }
    }

    /// The two int8 dot primitives give the same lane total, extremes included.
    #[test]
    fn sdot_and_the_base_dot_agree() {
        if !Isa::NeonDot.is_available() {
            return;
        }
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8 as i8
        };
        for round in 0..1000 {
            let mut a = [0i8; 16];
            let mut b = [0i8; 16];
            for i in 0..16 {
                (a[i], b[i]) = match round {
                    0 => (-128, 127),
                    1 => (-128, -127),
                    _ => (next(), next().max(-127)),
                };
            }
            let want: i32 = a
                .iter()
                .zip(&b)
                .map(|(&u, &v)| i32::from(u) * i32::from(v))
                .sum();
            // SAFETY: the dot-product extension was detected above; 16 bytes each.
            let (s, t) = unsafe {
                let (va, vb) = (vld1q_s8(a.as_ptr()), vld1q_s8(b.as_ptr()));
                let z = vdupq_n_s32(7);
                (
                    vaddvq_s32(dot_sdot(z, va, vb)),
                    vaddvq_s32(dot_base(z, va, vb)),
                )
            };
            assert_eq!((s, t), (want + 28, want + 28), "round {round}");
        }
    }
}
