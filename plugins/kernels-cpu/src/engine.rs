//! The kernels object: the ISA chosen once, its own threads (a [`Team`] and a rayon pool), and
//! the [`Kernels`] interface.

use crate::isa::{self, Isa};
use crate::team::Team;
use crate::vecops::VecOps;
use crate::{attention, matmul, ops};
use abi_stable::{
    sabi_trait::TD_Opaque,
    std_types::{RResult, RSlice, RSliceMut, RString},
};
use std::sync::Arc;
use u_sdk::{
    Activation, AttentionParams, BackendInfo, DType, Kernels, Kernels_TO, KernelsBox, KvSpan, Op,
    Result, RopeParams, TensorView, UError, guard,
};

/// Everything a kernel needs: ISA, pool and the vector helpers for that ISA.
pub struct Engine {
    /// The instruction-set path every kernel uses.
    pub isa: Isa,
    /// This plugin's own thread pool (each cdylib has its own; never the global one).
    pub pool: rayon::ThreadPool,
    /// Threads in `pool`.
    pub threads: usize,
    /// The caller plus `threads − 1` helpers, for decode-sized ops ([`Engine::split`]).
    pub team: Team,
    /// f32 helpers for `isa`.
    pub vec: VecOps,
}

impl Engine {
    /// Runs `f(t)` for every `t < tasks` on the calling thread and the team's helpers
    /// ([`Team`]), so even a decode-sized op costs no round trip through a pool.
    pub fn split(&self, tasks: usize, f: impl Fn(usize) + Sync) {
        self.team.run(tasks, &f);
    }
}

/// The CPU kernels backend. Cheap to clone (shared engine).
#[derive(Clone)]
pub struct CpuKernels {
    eng: Arc<Engine>,
}

impl CpuKernels {
    /// A backend on the best ISA of this CPU with `threads` compute threads.
    pub fn new(threads: usize) -> Result<CpuKernels> {
        CpuKernels::with_isa(Isa::detect(), threads)
    }

    /// A backend forced onto `isa` (for tests and benchmarks); fails if the CPU lacks it.
    pub fn with_isa(isa: Isa, threads: usize) -> Result<CpuKernels> {
        if !isa.is_available() {
            return Err(UError::unsupported(format!(
                "kernels-cpu: ISA {} is not available on this CPU (features: {})",
                isa.name(),
                isa::features().join(",")
            )));
        }
        let threads = threads.max(1);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("u-kernels-cpu-{i}"))
            .build()
            .map_err(|e| {
                UError::new(
                    u_sdk::ErrorKind::ResourceExhausted,
                    format!("kernels-cpu: cannot build a {threads}-thread pool: {e}"),
                )
            })?;
        let team = Team::new(threads).map_err(|e| {
            UError::new(
                u_sdk::ErrorKind::ResourceExhausted,
                format!("kernels-cpu: cannot start the team helper threads: {e}"),
            )
        })?;
        Ok(CpuKernels {
            eng: Arc::new(Engine {
                isa,
                pool,
                threads,
                team,
                vec: VecOps::new(isa),
            }),
        })
    }

    /// The ISA in use.
    pub fn isa(&self) -> Isa {
        self.eng.isa
    }

    /// Wraps this backend as the ABI object.
    pub fn into_box(self) -> KernelsBox {
        Kernels_TO::from_value(self, TD_Opaque)
    }

    /// What the backend is (see [`Kernels::info`]).
    pub fn backend_info(&self) -> BackendInfo {
        BackendInfo {
            name: "cpu".into(),
            isa: self.eng.isa.name().into(),
            features: isa::features().into_iter().map(RString::from).collect(),
            threads: self.eng.threads as u32,
        }
    }

    /// Whether `op` is implemented for `dtype` (see [`Kernels::supports`]).
    pub fn supports_op(&self, op: Op, dtype: DType) -> bool {
        match op {
            // Every dtype: dedicated kernels, or per-row dequantization for the rest.
            Op::MatMul | Op::Embedding => true,
            Op::Attention => matches!(dtype, DType::F32 | DType::F16),
            Op::RmsNorm | Op::LayerNorm | Op::Rope | Op::Activation | Op::Softmax => {
                dtype == DType::F32
            }
            Op::TopK => false,
        }
    }

    /// `y[m × n] = x[m × k] · Wᵀ`.
    pub fn matmul(&self, w: &TensorView<'_>, x: &[f32], m: usize, y: &mut [f32]) -> Result<()> {
        matmul::matmul(&self.eng, w, x, m, y)
    }

    /// Flash attention (see [`Kernels::attention`]).
    pub fn attention(
        &self,
        q: &[f32],
        kv: &[KvSpan<'_>],
        p: &AttentionParams,
        out: &mut [f32],
    ) -> Result<()> {
        attention::attention(&self.eng, q, kv, p, out)
    }

    /// RMS normalisation (see [`Kernels::rms_norm`]).
    pub fn rms_norm(&self, x: &[f32], w: &[f32], eps: f32, y: &mut [f32]) -> Result<()> {
        ops::rms_norm(&self.eng, x, w, eps, y)
    }

    /// Layer normalisation (see [`Kernels::layer_norm`]).
    pub fn layer_norm(
        &self,
        x: &[f32],
        w: &[f32],
        b: &[f32],
        eps: f32,
        y: &mut [f32],
    ) -> Result<()> {
        ops::layer_norm(&self.eng, x, w, b, eps, y)
    }

    /// Rotary embedding in place (see [`Kernels::rope`]).
    pub fn rope(&self, x: &mut [f32], positions: &[u32], p: &RopeParams) -> Result<()> {
        ops::rope(x, positions, p)
    }

    /// Activation in place.
    pub fn activation(&self, x: &mut [f32], act: Activation) -> Result<()> {
        ops::activation(&self.eng, x, act);
        Ok(())
    }

    /// Row-wise softmax in place.
    pub fn softmax(&self, x: &mut [f32], row_len: usize) -> Result<()> {
        ops::softmax(x, row_len)
    }

    /// Embedding rows (see [`Kernels::embedding`]).
    pub fn embedding(&self, table: &TensorView<'_>, ids: &[u32], out: &mut [f32]) -> Result<()> {
        ops::embedding(&self.eng, table, ids, out)
    }
}

impl Kernels for CpuKernels {
    fn info(&self) -> BackendInfo {
        self.backend_info()
    }

    fn supports(&self, op: Op, dtype: DType) -> bool {
        self.supports_op(op, dtype)
    }

    fn matmul(
        &self,
        weight: &TensorView<'_>,
        x: RSlice<'_, f32>,
        m: u32,
        mut y: RSliceMut<'_, f32>,
    ) -> RResult<(), UError> {
        guard("kernels.matmul", || {
            CpuKernels::matmul(self, weight, x.as_slice(), m as usize, y.as_mut_slice())
        })
    }

    fn rms_norm(
        &self,
        x: RSlice<'_, f32>,
        weight: RSlice<'_, f32>,
        eps: f32,
        mut y: RSliceMut<'_, f32>,
    ) -> RResult<(), UError> {
        guard("kernels.rms_norm", || {
            CpuKernels::rms_norm(self, x.as_slice(), weight.as_slice(), eps, y.as_mut_slice())
        })
    }

    fn layer_norm(
        &self,
        x: RSlice<'_, f32>,
        weight: RSlice<'_, f32>,
        bias: RSlice<'_, f32>,
        eps: f32,
        mut y: RSliceMut<'_, f32>,
    ) -> RResult<(), UError> {
        guard("kernels.layer_norm", || {
            CpuKernels::layer_norm(
                self,
                x.as_slice(),
                weight.as_slice(),
                bias.as_slice(),
                eps,
                y.as_mut_slice(),
            )
        })
    }

    fn rope(
        &self,
        mut x: RSliceMut<'_, f32>,
        positions: RSlice<'_, u32>,
        params: &RopeParams,
    ) -> RResult<(), UError> {
        guard("kernels.rope", || {
            CpuKernels::rope(self, x.as_mut_slice(), positions.as_slice(), params)
        })
    }

    fn attention(
        &self,
        q: RSlice<'_, f32>,
        kv: RSlice<'_, KvSpan<'_>>,
        params: &AttentionParams,
        mut out: RSliceMut<'_, f32>,
    ) -> RResult<(), UError> {
        guard("kernels.attention", || {
            CpuKernels::attention(
                self,
                q.as_slice(),
                kv.as_slice(),
                params,
                out.as_mut_slice(),
            )
        })
    }

    fn activation(&self, mut x: RSliceMut<'_, f32>, act: Activation) -> RResult<(), UError> {
        guard("kernels.activation", || {
            CpuKernels::activation(self, x.as_mut_slice(), act)
        })
    }

    fn softmax(&self, mut x: RSliceMut<'_, f32>, row_len: u32) -> RResult<(), UError> {
        guard("kernels.softmax", || {
            CpuKernels::softmax(self, x.as_mut_slice(), row_len as usize)
        })
    }

    fn embedding(
        &self,
        table: &TensorView<'_>,
        ids: RSlice<'_, u32>,
        mut out: RSliceMut<'_, f32>,
    ) -> RResult<(), UError> {
        guard("kernels.embedding", || {
            CpuKernels::embedding(self, table, ids.as_slice(), out.as_mut_slice())
        })
    }
}
