//! Device buffers as [`u_sdk::Buffer`]s: storage buffers the host reads and writes by copies.
//!
//! Writes go through the queue after the recorded work is submitted (so they cannot overtake
//! it); reads copy into a mappable buffer and block on the device's fence. Both work at any
//! byte offset: an unaligned write reads back the words around it first.

use crate::gpu::Gpu;
use abi_stable::std_types::{RResult, RSlice, RSliceMut};
use std::sync::Arc;
use u_sdk::{Result, UError};

/// What a device buffer may be used for: bound to shaders, copied from and into.
pub const USAGE: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE
    .union(wgpu::BufferUsages::COPY_SRC)
    .union(wgpu::BufferUsages::COPY_DST);

/// One device buffer. Cloning shares it.
#[derive(Clone)]
pub struct GpuBuffer(Arc<Inner>);

struct Inner {
    gpu: Arc<Gpu>,
    buffer: wgpu::Buffer,
    /// The caller's length (the device buffer is rounded up to whole words).
    len: u64,
    read_only: bool,
}

/// `bytes` rounded up to whole 4-byte words, at least one.
pub fn words(bytes: u64) -> u64 {
    bytes.max(1).next_multiple_of(4)
}

impl GpuBuffer {
    /// A new zeroed buffer of `len` bytes.
    pub fn alloc(gpu: &Arc<Gpu>, len: u64) -> Result<GpuBuffer> {
        gpu.reserve(words(len))?;
        let buffer = gpu.scoped(&format!("allocating {len} bytes"), || {
            gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: None,
                size: words(len),
                usage: USAGE,
                mapped_at_creation: false,
            })
        });
        Ok(GpuBuffer(Arc::new(Inner {
            gpu: gpu.clone(),
            buffer: buffer.inspect_err(|_| gpu.release(words(len)))?,
            len,
            read_only: false,
        })))
    }

    /// A read-only buffer holding a copy of `bytes` (weights: uploaded once, then resident).
    pub fn upload(gpu: &Arc<Gpu>, bytes: &[u8]) -> Result<GpuBuffer> {
        let len = bytes.len() as u64;
        gpu.reserve(words(len))?;
        let buffer = gpu
            .scoped(&format!("uploading {len} bytes"), || {
                let buffer = gpu.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("weights"),
                    size: words(len),
                    usage: USAGE,
                    mapped_at_creation: true,
                });
                buffer
                    .slice(..)
                    .get_mapped_range_mut()
                    .map(|mut view| view.slice(..bytes.len()).copy_from_slice(bytes))
                    .map(|()| buffer)
            })
            .and_then(|mapped| {
                mapped.map_err(|e| UError::invalid(format!("kernels-wgpu: mapping an upload: {e}")))
            })
            .inspect_err(|_| gpu.release(words(len)))?;
        buffer.unmap();
        Ok(GpuBuffer(Arc::new(Inner {
            gpu: gpu.clone(),
            buffer,
            len,
            read_only: true,
        })))
    }

    /// The device buffer.
    pub fn raw(&self) -> &wgpu::Buffer {
        &self.0.buffer
    }

    /// Whether `self` and `other` are the same device buffer.
    pub fn same(&self, other: &GpuBuffer) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    fn range(&self, offset: u64, n: usize) -> Result<(u64, u64)> {
        match offset.checked_add(n as u64) {
            Some(end) if end <= self.0.len => Ok((offset & !3, end.next_multiple_of(4))),
            _ => Err(UError::invalid(format!(
                "kernels-wgpu: bytes {offset}..{offset}+{n} of a buffer of {}",
                self.0.len
            ))),
        }
    }

    fn write_bytes(&self, offset: u64, bytes: &[u8]) -> Result<()> {
        if self.0.read_only {
            return Err(UError::denied(
                "kernels-wgpu: imported weights are read-only",
            ));
        }
        let (start, end) = self.range(offset, bytes.len())?;
        if bytes.is_empty() {
            return Ok(());
        }
        let gpu = &self.0.gpu;
        if start == offset && end == offset + bytes.len() as u64 {
            gpu.flush();
            gpu.queue.write_buffer(&self.0.buffer, offset, bytes);
            return gpu.check();
        }
        let mut words = gpu.read(&self.0.buffer, start, end - start)?;
        let at = (offset - start) as usize;
        words[at..at + bytes.len()].copy_from_slice(bytes);
        gpu.queue.write_buffer(&self.0.buffer, start, &words);
        gpu.check()
    }

    fn read_bytes(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        let (start, end) = self.range(offset, out.len())?;
        if out.is_empty() {
            return Ok(());
        }
        let words = self.0.gpu.read(&self.0.buffer, start, end - start)?;
        let at = (offset - start) as usize;
        out.copy_from_slice(&words[at..at + out.len()]);
        Ok(())
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.gpu.release(words(self.len));
    }
}

impl u_sdk::Buffer for GpuBuffer {
    fn byte_len(&self) -> u64 {
        self.0.len
    }

    fn host_address(&self) -> usize {
        0
    }

    fn read_only(&self) -> bool {
        self.0.read_only
    }

    fn write(&self, offset: u64, bytes: RSlice<'_, u8>) -> RResult<(), UError> {
        self.write_bytes(offset, bytes.as_slice()).into()
    }

    fn read(&self, offset: u64, mut out: RSliceMut<'_, u8>) -> RResult<(), UError> {
        self.read_bytes(offset, out.as_mut_slice()).into()
    }
}
