//! Shared test helpers: a deterministic RNG, a test host with a write grant, cache builders.
#![allow(dead_code)]

use abi_stable::{
    sabi_trait::TD_Opaque,
    std_types::{RResult, RStr, RString},
};
use std::{
    os::{fd::IntoRawFd, unix::fs::OpenOptionsExt},
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};
use u_cache_kv::{Alloc, Config, KvCachePlugin};
use u_sdk::{
    DType, Host, Host_TO, HostBox, KvLayout, KvPage, LogLevel, TensorDesc, UError, WriteMode,
};

/// splitmix64.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    pub fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f32()).collect()
    }
}

pub fn layout(layers: u32, kv_heads: u32, head_dim: u32, model: &str) -> KvLayout {
    KvLayout {
        layers,
        kv_heads,
        head_dim,
        dtype: DType::F32,
        model_id: model.into(),
    }
}

/// A cache with `config`, no disk tier unless `host` is given, configured with `layout`.
pub fn cache(config: Config, host: Option<HostBox>, layout: KvLayout) -> KvCachePlugin {
    let c = KvCachePlugin::new(config, host);
    c.store().configure(layout, Alloc::Heap).unwrap();
    c
}

/// Grants reads and writes under `root` only, like the real host; keeps what is logged.
#[derive(Clone)]
pub struct TestHost {
    pub root: PathBuf,
    pub config: String,
    pub logs: Arc<Mutex<Vec<String>>>,
}

impl TestHost {
    fn check(&self, p: &str) -> Result<PathBuf, UError> {
        let p = PathBuf::from(p);
        if p.starts_with(&self.root) && !p.components().any(|c| c.as_os_str() == "..") {
            Ok(p)
        } else {
            Err(UError::denied(format!(
                "{} is outside the fs.write grant",
                p.display()
            )))
        }
    }
}

fn r<T>(x: Result<T, UError>) -> RResult<T, UError> {
    x.into()
}

impl Host for TestHost {
    fn plugin_name(&self) -> RString {
        "cache-kv".into()
    }
    fn log(&self, level: LogLevel, message: RStr<'_>) {
        let line = format!("{level:?}: {message}");
        self.logs.lock().unwrap().push(line);
    }
    fn open_read(&self, path: RStr<'_>) -> RResult<i32, UError> {
        r(self.check(path.as_str()).and_then(|p| {
            std::fs::File::open(&p)
                .map(|f| f.into_raw_fd())
                .map_err(|e| UError::io(p.display(), e))
        }))
    }
    fn open_write(&self, path: RStr<'_>, mode: WriteMode) -> RResult<i32, UError> {
        r(self.check(path.as_str()).and_then(|p| {
            let mut o = std::fs::OpenOptions::new();
            o.write(true).mode(0o600);
            match mode {
                WriteMode::CreateNew => o.create_new(true),
                WriteMode::Truncate => o.create(true).truncate(true),
                WriteMode::Append => o.create(true).append(true),
            };
            o.open(&p)
                .map(|f| f.into_raw_fd())
                .map_err(|e| UError::io(p.display(), e))
        }))
    }
    fn rename(&self, from: RStr<'_>, to: RStr<'_>) -> RResult<(), UError> {
        r((|| {
            let (f, t) = (self.check(from.as_str())?, self.check(to.as_str())?);
            std::fs::rename(&f, &t).map_err(|e| UError::io("rename", e))
        })())
    }
    fn remove(&self, path: RStr<'_>) -> RResult<(), UError> {
        r(self
            .check(path.as_str())
            .and_then(|p| std::fs::remove_file(&p).map_err(|e| UError::io(p.display(), e))))
    }
    fn threads(&self) -> u32 {
        1
    }
    fn config(&self) -> RString {
        self.config.as_str().into()
    }
}

pub fn host(root: &Path, config: &str) -> HostBox {
    host_logged(root, config).0
}

/// A host as [`host`], and the lines it logs.
pub fn host_logged(root: &Path, config: &str) -> (HostBox, Arc<Mutex<Vec<String>>>) {
    let logs = Arc::new(Mutex::new(Vec::new()));
    let h = TestHost {
        root: root.to_path_buf(),
        config: config.to_string(),
        logs: logs.clone(),
    };
    (Host_TO::from_value(h, TD_Opaque), logs)
}

/// All of `layer`'s keys and values of `seq`, as f32 (dequantizing int8 pages).
pub fn contents(c: &KvCachePlugin, seq: u64, layer: u32) -> (Vec<f32>, Vec<f32>) {
    // A fresh handle, dropped on return, so these reads leave no leases behind.
    let h = c.clone();
    let (mut k, mut v) = (Vec::new(), Vec::new());
    for p in h.pages_of(seq, layer).unwrap() {
        let (pk, pv) = page_f32(&p);
        k.extend(pk);
        v.extend(pv);
    }
    (k, v)
}

/// A host tensor's bytes.
pub fn bytes(t: &TensorDesc) -> &[u8] {
    let len = t.byte_len().unwrap() as usize;
    // SAFETY: cache pages are host memory kept alive by the descriptor's buffer, in bounds.
    unsafe {
        std::slice::from_raw_parts(
            (t.buffer.host_address() + t.offset as usize) as *const u8,
            len,
        )
    }
}

/// A host tensor's f32 values.
pub fn f32s(t: &TensorDesc) -> Vec<f32> {
    bytes(t)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// A page's keys and values as f32 (dequantized for an int8 page).
pub fn page_f32(p: &KvPage) -> (Vec<f32>, Vec<f32>) {
    match (&p.key_scales, &p.value_scales) {
        (abi_stable::std_types::ROption::RSome(ks), abi_stable::std_types::ROption::RSome(vs)) => {
            let q = |t: &TensorDesc| bytes(t).iter().map(|&b| b as i8).collect::<Vec<i8>>();
            (
                u_sdk::dequantize_i8(&q(&p.keys), &f32s(ks), p.tokens),
                u_sdk::dequantize_i8(&q(&p.values), &f32s(vs), p.tokens),
            )
        }
        _ => (f32s(&p.keys), f32s(&p.values)),
    }
}

/// The CPU backend (as an rlib), for caches configured through the ABI.
pub fn backend() -> u_sdk::BackendBox {
    u_kernels_cpu::CpuKernels::new(1).unwrap().into_box()
}

/// `data` as an `F32` tensor of rows of `row` values in a buffer of `backend`.
pub fn tensor(backend: &u_sdk::BackendBox, data: &[f32], row: usize) -> TensorDesc {
    u_sdk::nn::Device::new(backend.clone())
        .unwrap()
        .from_f32(data, &[(data.len() / row) as u64, row as u64])
        .unwrap()
        .desc()
        .clone()
}

/// Where a host tensor's first byte lies (to tell shared pages from copies).
pub fn addr(t: &TensorDesc) -> usize {
    t.buffer.host_address() + t.offset as usize
}
