//! The kernels object: the ISA chosen once, its own threads (a [`Team`] and a rayon pool), and
//! each kernel on plain slices (the [`crate::CpuBackend`] runs them on tensors).

use crate::attention::{KvSpan, Params};
use crate::isa::{self, Isa};
use crate::team::Team;
use crate::vecops::VecOps;
use crate::{attention, matmul, ops};
use abi_stable::std_types::RString;
use std::sync::{Arc, Condvar, Mutex, RwLock, Weak};
use u_sdk::{Activation, BackendInfo, Result, RopeParams, TensorView, UError};

/// A rayon pool that can be stopped before a fork and built again after it (the child has
/// none of the parent's threads); while stopped, [`Pool::install`] runs on the caller.
pub struct Pool {
    pool: RwLock<Option<rayon::ThreadPool>>,
    threads: usize,
    /// Pool threads alive, so [`Pool::stop`] can wait for the last to exit.
    alive: Arc<(Mutex<usize>, Condvar)>,
}

impl Pool {
    /// A pool of `threads` threads.
    pub fn new(threads: usize) -> Result<Pool> {
        let pool = Pool {
            pool: RwLock::new(None),
            threads,
            alive: Arc::new((Mutex::new(0), Condvar::new())),
        };
        pool.start()?;
        Ok(pool)
    }

    /// Runs `f` inside the pool (or on the caller while the pool is stopped).
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match &*self
            .pool
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
        {
            Some(pool) => pool.install(f),
            None => f(),
        }
    }

    /// Builds the pool's threads if they are not running.
    pub fn start(&self) -> Result<()> {
        let mut slot = self
            .pool
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if slot.is_some() {
            return Ok(());
        }
        let (up, down) = (self.alive.clone(), self.alive.clone());
        let count = |a: &(Mutex<usize>, Condvar), d: isize| {
            let mut n =
                a.0.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
            *n = n.saturating_add_signed(d);
            a.1.notify_all();
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(self.threads)
            .thread_name(|i| format!("u-kernels-cpu-{i}"))
            .start_handler(move |_| count(&up, 1))
            .exit_handler(move |_| count(&down, -1))
            .build()
            .map_err(|e| {
                UError::new(
                    u_sdk::ErrorKind::ResourceExhausted,
                    format!(
                        "kernels-cpu: cannot build a {}-thread pool: {e}",
                        self.threads
                    ),
                )
            })?;
        *slot = Some(pool);
        Ok(())
    }

    /// Waits for the running jobs, drops the pool and waits until its last thread has exited.
    pub fn stop(&self) {
        let pool = self
            .pool
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        drop(pool);
        let (n, exited) = &*self.alive;
        let mut n = n.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        while *n > 0 {
            n = exited
                .wait(n)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }
}

/// Every live engine of this plugin, for the fork hooks.
static ENGINES: Mutex<Vec<Weak<Engine>>> = Mutex::new(Vec::new());

fn live_engines() -> Vec<Arc<Engine>> {
    let mut all = ENGINES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    all.retain(|e| e.strong_count() > 0);
    all.iter().filter_map(Weak::upgrade).collect()
}

/// The plugin's `before_fork` hook: stops every engine's team helpers and pool threads.
pub fn stop_threads() {
    for e in live_engines() {
        e.team.stop();
        e.pool.stop();
    }
}

/// The plugin's `after_fork` hook: starts every engine's threads again (in the parent, or in a
/// forked child, which has none of them). A thread that cannot start leaves that engine on
/// the caller alone, slower but correct.
pub fn start_threads(_in_child: bool) {
    for e in live_engines() {
        let _ = e.team.start();
        let _ = e.pool.start();
    }
}

/// Everything a kernel needs: ISA, pool and the vector helpers for that ISA.
pub struct Engine {
    /// The instruction-set path every kernel uses.
    pub isa: Isa,
    /// This plugin's own thread pool (each cdylib has its own; never the global one).
    pub pool: Pool,
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
        let pool = Pool::new(threads)?;
        let team = Team::new(threads).map_err(|e| {
            UError::new(
                u_sdk::ErrorKind::ResourceExhausted,
                format!("kernels-cpu: cannot start the team helper threads: {e}"),
            )
        })?;
        let eng = Arc::new(Engine {
            isa,
            pool,
            threads,
            team,
            vec: VecOps::new(isa),
        });
        ENGINES
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(Arc::downgrade(&eng));
        Ok(CpuKernels { eng })
    }

    /// The ISA in use.
    pub fn isa(&self) -> Isa {
        self.eng.isa
    }

    /// The ISA, pool and team every kernel runs with.
    pub fn engine(&self) -> &Engine {
        &self.eng
    }

    /// As the ABI's backend (with its own buffer pool).
    pub fn into_box(self) -> u_sdk::BackendBox {
        crate::CpuBackend::new(self).into_box()
    }

    /// What the backend is (see [`u_sdk::Backend::info`]).
    pub fn backend_info(&self) -> BackendInfo {
        BackendInfo {
            name: "cpu".into(),
            device: format!("cpu ({} threads)", self.eng.threads).into(),
            isa: self.eng.isa.name().into(),
            features: isa::features().into_iter().map(RString::from).collect(),
            threads: self.eng.threads as u32,
        }
    }

    /// `y[m × n] = x[m × k] · Wᵀ`.
    pub fn matmul(&self, w: &TensorView<'_>, x: &[f32], m: usize, y: &mut [f32]) -> Result<()> {
        matmul::matmul(&self.eng, w, x, m, y)
    }

    /// Flash attention (see [`crate::attention`]).
    pub fn attention(
        &self,
        q: &[f32],
        kv: &[KvSpan<'_>],
        p: &Params,
        out: &mut [f32],
    ) -> Result<()> {
        attention::attention(&self.eng, q, kv, p, out)
    }

    /// RMS normalisation.
    pub fn rms_norm(&self, x: &[f32], w: &[f32], eps: f32, y: &mut [f32]) -> Result<()> {
        ops::rms_norm(&self.eng, x, w, eps, y)
    }

    /// Layer normalisation.
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

    /// Rotary embedding in place.
    pub fn rope(&self, x: &mut [f32], positions: &[u32], p: &RopeParams) -> Result<()> {
        let positions: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
        ops::rope(x, &positions, p)
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

    /// Embedding rows.
    pub fn embedding(&self, table: &TensorView<'_>, ids: &[u32], out: &mut [f32]) -> Result<()> {
        ops::embedding(&self.eng, table, ids, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fork hooks leave no pool thread behind, the kernels work meanwhile (on the caller),
    /// and the restarted pool runs work on its threads again. (The hooks act on every engine
    /// of the process, so other tests' engines run on their callers for a moment: slower,
    /// never wrong.)
    #[test]
    fn the_fork_hooks_stop_and_restart_every_thread() {
        let k = CpuKernels::new(2).expect("kernels");
        let pool = &k.engine().pool;
        let on_pool = || pool.install(|| rayon::current_thread_index().is_some());
        assert!(on_pool());
        stop_threads();
        assert_eq!(
            *pool.alive.0.lock().unwrap(),
            0,
            "a pool thread outlived the stop"
        );
        assert!(!on_pool());
        let (w, x) = (vec![0u8; 4 * 64 * 8], vec![1f32; 64]);
        let mut y = vec![0f32; 8];
        let weight = matmul::Weight {
            dtype: u_sdk::DType::F32,
            rows: 8,
            row_len: 64,
            data: &w,
        };
        matmul::matmul_weight(k.engine(), weight, &x, 1, &mut y).expect("matmul while stopped");
        start_threads(true);
        assert!(on_pool());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while *pool.alive.0.lock().unwrap() < 2 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(
            *pool.alive.0.lock().unwrap(),
            2,
            "the pool restarted short of threads"
        );
    }
}
