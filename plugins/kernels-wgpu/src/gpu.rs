//! The device: adapter choice, one queue, the command encoder ops are recorded into, compiled
//! pipelines, and read-back that blocks on the device's fence instead of spinning.
//!
//! Ops are recorded into one pending encoder and submitted together when someone needs their
//! results (a read, [`Gpu::wait`]), before a host write could overtake them
//! ([`Gpu::flush`]), or every [`FLUSH_EVERY`] dispatches so the device starts early on long
//! lists. wgpu keeps a buffer alive while a submitted command uses it, so buffers dropped by the
//! caller mid-list are safe.

use crate::shaders::{self, Kernel};
use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
        mpsc,
    },
};
use u_sdk::{ErrorKind, Result, UError};

/// Dispatches recorded before the pending encoder is submitted on its own.
pub const FLUSH_EVERY: usize = 64;

/// One opened device and its queue.
pub struct Gpu {
    /// The logical device.
    pub device: wgpu::Device,
    /// Its queue.
    pub queue: wgpu::Queue,
    /// The adapter it runs on (name, driver, backend).
    pub adapter: wgpu::AdapterInfo,
    /// The limits the device was opened with (the adapter's own).
    pub limits: wgpu::Limits,
    pending: Mutex<Pending>,
    pipelines: Mutex<HashMap<Kernel, Arc<wgpu::ComputePipeline>>>,
    /// The first error the device reported outside an error scope, or its loss.
    fault: Arc<Mutex<Option<String>>>,
    /// Bytes of buffers the deployment lets this plugin hold (`memory_limit_mb`), if limited.
    budget: Option<u64>,
    /// Bytes of buffers held now.
    held: AtomicU64,
}

#[derive(Default)]
struct Pending {
    encoder: Option<wgpu::CommandEncoder>,
    dispatches: usize,
}

fn gpu_error(what: impl std::fmt::Display) -> UError {
    UError::new(ErrorKind::Internal, format!("kernels-wgpu: {what}"))
}

impl Gpu {
    /// Opens the first adapter whose name contains `adapter` (case-insensitive), or the
    /// high-performance one when `adapter` is `None`; software adapters (llvmpipe, SwiftShader)
    /// count, so CI without a GPU runs the same shaders. Buffers past `budget` bytes in all are
    /// refused as out of memory.
    pub fn open(adapter: Option<&str>, budget: Option<u64>) -> Result<Gpu> {
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
        desc.backends = wgpu::Backends::PRIMARY;
        let instance = wgpu::Instance::new(desc);
        let chosen = match adapter {
            Some(want) => {
                let adapters =
                    pollster::block_on(instance.enumerate_adapters(wgpu::Backends::PRIMARY));
                let names: Vec<String> = adapters.iter().map(|a| a.get_info().name).collect();
                adapters
                    .into_iter()
                    .find(|a| {
                        a.get_info()
                            .name
                            .to_lowercase()
                            .contains(&want.to_lowercase())
                    })
                    .ok_or_else(|| {
                        UError::new(
                            ErrorKind::NotFound,
                            format!(
                                "kernels-wgpu: no GPU adapter named like {want:?} (found {names:?})"
                            ),
                        )
                    })?
            }
            None => pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
                power_preference: wgpu::PowerPreference::HighPerformance,
                force_fallback_adapter: false,
                compatible_surface: None,
                apply_limit_buckets: false,
            }))
            .map_err(|e| {
                UError::new(
                    ErrorKind::NotFound,
                    format!("kernels-wgpu: no GPU adapter ({e}); is a Vulkan driver installed?"),
                )
            })?,
        };
        let limits = chosen.limits();
        let (device, queue) = pollster::block_on(chosen.request_device(&wgpu::DeviceDescriptor {
            label: Some("u-kernels-wgpu"),
            required_features: wgpu::Features::empty(),
            required_limits: limits.clone(),
            experimental_features: wgpu::ExperimentalFeatures::disabled(),
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        }))
        .map_err(|e| gpu_error(format!("opening the device: {e}")))?;
        let fault = Arc::new(Mutex::new(None));
        let on_error = fault.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            on_error
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert_with(|| e.to_string());
        }));
        let on_lost = fault.clone();
        device.set_device_lost_callback(move |reason, message| {
            on_lost
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert_with(|| format!("device lost ({reason:?}): {message}"));
        });
        Ok(Gpu {
            device,
            queue,
            adapter: chosen.get_info(),
            limits,
            pending: Mutex::default(),
            pipelines: Mutex::default(),
            fault,
            budget,
            held: AtomicU64::new(0),
        })
    }

    /// Counts `bytes` more of buffers held; refused past the budget (or the device's largest
    /// buffer) as out of device memory.
    pub fn reserve(&self, bytes: u64) -> Result<()> {
        if bytes > self.limits.max_buffer_size {
            return Err(UError::new(
                ErrorKind::ResourceExhausted,
                format!(
                    "kernels-wgpu: a buffer of {bytes} bytes is larger than the device's largest \
                     ({} bytes, {})",
                    self.limits.max_buffer_size, self.adapter.name
                ),
            ));
        }
        let before = self.held.fetch_add(bytes, Ordering::Relaxed);
        match self.budget {
            Some(budget) if before + bytes > budget => {
                self.held.fetch_sub(bytes, Ordering::Relaxed);
                Err(UError::new(
                    ErrorKind::ResourceExhausted,
                    format!(
                        "kernels-wgpu: out of device memory: {bytes} bytes more would pass the \
                         deployment's memory_limit_mb ({before} of {budget} bytes held)"
                    ),
                ))
            }
            _ => Ok(()),
        }
    }

    /// Counts `bytes` of buffers released.
    pub fn release(&self, bytes: u64) {
        self.held.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// The device's first reported fault (a lost device, an error outside any scope).
    pub fn check(&self) -> Result<()> {
        match &*self.fault.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(fault) => Err(gpu_error(fault)),
            None => Ok(()),
        }
    }

    /// Records work into the pending encoder (`dispatches` compute dispatches of it).
    pub fn record(&self, dispatches: usize, work: impl FnOnce(&mut wgpu::CommandEncoder)) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let encoder = pending.encoder.get_or_insert_with(|| {
            self.device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None })
        });
        work(encoder);
        pending.dispatches += dispatches;
        if pending.dispatches >= FLUSH_EVERY {
            self.submit(&mut pending);
        }
    }

    fn submit(&self, pending: &mut Pending) {
        if let Some(encoder) = pending.encoder.take() {
            self.queue.submit([encoder.finish()]);
        }
        pending.dispatches = 0;
    }

    /// Submits everything recorded so far (before a host write, which the queue would
    /// otherwise run ahead of the recorded work).
    pub fn flush(&self) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        self.submit(&mut pending);
    }

    /// Submits the pending work and blocks until the device finished all of it.
    pub fn wait(&self) -> Result<()> {
        self.flush();
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| gpu_error(format!("waiting for the device: {e}")))?;
        self.check()
    }

    /// Bytes `offset..offset + len` of `buffer`, after all recorded work (offset and length
    /// multiples of 4).
    pub fn read(&self, buffer: &wgpu::Buffer, offset: u64, len: u64) -> Result<Vec<u8>> {
        if len == 0 {
            return Ok(Vec::new());
        }
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("read-back"),
            size: len,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.record(0, |encoder| {
            encoder.copy_buffer_to_buffer(buffer, offset, &staging, 0, len);
        });
        self.flush();
        let (done, mapped) = mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = done.send(r);
        });
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| gpu_error(format!("waiting for a read-back: {e}")))?;
        self.check()?;
        mapped
            .recv()
            .map_err(|_| gpu_error("a read-back was never mapped"))?
            .map_err(|e| gpu_error(format!("mapping a read-back: {e}")))?;
        let bytes = staging
            .slice(..)
            .get_mapped_range()
            .map_err(|e| gpu_error(format!("reading a mapped read-back: {e}")))?
            .to_vec();
        staging.unmap();
        Ok(bytes)
    }

    /// Runs `make` under out-of-memory and validation error scopes: a failed allocation becomes
    /// a clear error rather than a fault of the device.
    pub fn scoped<T>(&self, what: &str, make: impl FnOnce() -> T) -> Result<T> {
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let invalid = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let value = make();
        let validation = pollster::block_on(invalid.pop());
        let memory = pollster::block_on(oom.pop());
        if let Some(e) = memory {
            return Err(UError::new(
                ErrorKind::ResourceExhausted,
                format!("kernels-wgpu: out of device memory {what}: {e}"),
            ));
        }
        if let Some(e) = validation {
            return Err(UError::invalid(format!("kernels-wgpu: {what}: {e}")));
        }
        Ok(value)
    }

    /// The compiled pipeline of `kernel` (compiled on first use).
    pub fn pipeline(&self, kernel: Kernel) -> Result<Arc<wgpu::ComputePipeline>> {
        let mut cache = self.pipelines.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = cache.get(&kernel) {
            return Ok(p.clone());
        }
        let source = shaders::source(kernel);
        let pipeline = self.scoped(&format!("compiling the {kernel:?} shader"), || {
            let module = self
                .device
                .create_shader_module(wgpu::ShaderModuleDescriptor {
                    label: Some(&format!("{kernel:?}")),
                    source: wgpu::ShaderSource::Wgsl(source.into()),
                });
            self.device
                .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(&format!("{kernel:?}")),
                    layout: None,
                    module: &module,
                    entry_point: Some("main"),
                    compilation_options: Default::default(),
                    cache: None,
                })
        })?;
        let pipeline = Arc::new(pipeline);
        cache.insert(kernel, pipeline.clone());
        Ok(pipeline)
    }
}
