//! Deterministic random weights and activations for tests and benchmarks, and a backend with
//! operations replaced for other crates' tests (not part of the API).

use abi_stable::std_types::{RResult, RSlice};
use std::sync::Arc;
use u_sdk::{
    Backend, BackendBox, BackendInfo, BufferBox, BufferType, DType, KeepaliveBox, OpCall, OpKind,
    UError,
};

/// A small deterministic generator (SplitMix64).
pub struct Rng(u64);

impl Rng {
    /// Seeded generator.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[-1, 1)`.
    pub fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// Uniform in `[0, n)`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// `n` values uniform in `[-scale, scale)`.
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }
}

/// f32 → f16 bits, round to nearest even (normal range; enough for test data).
pub fn f32_to_f16(v: f32) -> u16 {
    let b = v.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
    if v == 0.0 || exp <= 0 {
        return sign;
    }
    if exp >= 31 {
        return sign | 0x7c00;
    }
    let man = b & 0x7f_ffff;
    let mut h = ((exp as u32) << 10) | (man >> 13);
    let rest = man & 0x1fff;
    if rest > 0x1000 || (rest == 0x1000 && (h & 1) == 1) {
        h += 1;
    }
    sign | h as u16
}

/// Random rows of `dtype` for an `[n, k]` weight: random codes (every bit pattern), with each
/// block's f16 scales replaced by sane values in `±[0.5, 1.5)·2⁻⁶` so nothing is NaN or huge.
pub fn random_weight(rng: &mut Rng, dtype: DType, n: usize, k: usize) -> Vec<u8> {
    let bytes = dtype.bytes_for((n * k) as u64).expect("whole blocks") as usize;
    let mut out: Vec<u8> = (0..bytes).map(|_| rng.next_u64() as u8).collect();
    let scale = |rng: &mut Rng, signed: bool| {
        let mag = (0.5 + (rng.uniform() + 1.0) * 0.5) / 64.0;
        let v = if signed && rng.next_u64() & 1 == 1 {
            -mag
        } else {
            mag
        };
        f32_to_f16(v).to_le_bytes()
    };
    match dtype {
        DType::F32 => {
            for c in out.chunks_exact_mut(4) {
                c.copy_from_slice(&rng.uniform().to_le_bytes());
            }
        }
        DType::F16 => {
            for c in out.chunks_exact_mut(2) {
                c.copy_from_slice(&f32_to_f16(rng.uniform()).to_le_bytes());
            }
        }
        DType::BF16 => {
            for c in out.chunks_exact_mut(2) {
                c.copy_from_slice(&((rng.uniform().to_bits() >> 16) as u16).to_le_bytes());
            }
        }
        _ => {
            // Offsets of the f16 fields in each block: (offset, signed).
            let fields: &[(usize, bool)] = match dtype {
                DType::Q4_0 | DType::Q5_0 | DType::Q8_0 | DType::Q8_1 => &[(0, true)],
                DType::Q4_1 | DType::Q5_1 => &[(0, true), (2, true)],
                DType::Q4_K | DType::Q5_K => &[(0, false), (2, false)],
                DType::Q2_K => &[(80, false), (82, false)],
                DType::Q3_K => &[(108, true)],
                DType::Q6_K => &[(208, true)],
                DType::TQ1_0 => &[(52, true)],
                DType::TQ2_0 => &[(64, true)],
                DType::Q8_K => &[],
                _ => &[],
            };
            for b in out.chunks_exact_mut(dtype.block_bytes()) {
                for &(at, signed) in fields {
                    b[at..at + 2].copy_from_slice(&scale(rng, signed));
                }
                if dtype == DType::Q8_K {
                    b[0..4].copy_from_slice(&(1.0f32 / 64.0).to_le_bytes());
                }
            }
        }
    }
    out
}

/// A replacement for one kind of op: `(inner, call)`; it may run the op itself or change it and
/// hand it on to `inner`.
pub type OpFn = dyn Fn(&BackendBox, &OpCall<'_>) -> RResult<(), UError> + Send + Sync;

/// A backend with some kinds of op replaced by a test's own (a reference matmul, recorded
/// calls, moved positions); every other op, and every buffer, goes to `inner`.
#[derive(Clone)]
pub struct BackendWith {
    inner: BackendBox,
    replaced: Vec<(OpKind, Arc<OpFn>)>,
}

impl BackendWith {
    /// `inner`, nothing replaced yet.
    pub fn new(inner: BackendBox) -> Self {
        Self {
            inner,
            replaced: Vec::new(),
        }
    }

    /// Replaces ops of `kind`.
    pub fn replace(
        mut self,
        kind: OpKind,
        f: impl Fn(&BackendBox, &OpCall<'_>) -> RResult<(), UError> + Send + Sync + 'static,
    ) -> Self {
        self.replaced.push((kind, Arc::new(f)));
        self
    }

    /// As an ABI object.
    pub fn into_box(self) -> BackendBox {
        BackendBox::new(self)
    }
}

impl Backend for BackendWith {
    fn info(&self) -> RResult<BackendInfo, UError> {
        self.inner.info()
    }

    fn buffer_type(&self) -> RResult<BufferType, UError> {
        self.inner.buffer_type()
    }

    fn supports(&self, op: OpKind, dtype: DType) -> RResult<bool, UError> {
        self.inner.supports(op, dtype)
    }

    fn alloc(&self, bytes: u64) -> RResult<BufferBox, UError> {
        self.inner.alloc(bytes)
    }

    fn import(&self, bytes: RSlice<'_, u8>, owner: KeepaliveBox) -> RResult<BufferBox, UError> {
        self.inner.import(bytes, owner)
    }

    fn compute(&self, ops: RSlice<'_, OpCall<'_>>) -> RResult<(), UError> {
        for call in ops.iter() {
            let kind = call.op.kind();
            let result = match self.replaced.iter().find(|(k, _)| *k == kind) {
                Some((_, f)) => f(&self.inner, call),
                None => self
                    .inner
                    .compute(RSlice::from_slice(std::slice::from_ref(call))),
            };
            if result.is_err() {
                return result;
            }
        }
        RResult::ROk(())
    }

    fn synchronize(&self) -> RResult<(), UError> {
        self.inner.synchronize()
    }
}
