//! The disk tier: checkpoints as files under a directory the deployment grants `fs.write` on.
//!
//! Every file access goes through the host services (`open_write`, `open_read`, `rename`,
//! `remove`), so the grant applies. Writes are crash-safe: the file is written under a temporary
//! name (`.<name>.ukv.tmp.<pid>.<n>`), `fsync`ed, renamed over `<name>.ukv`, and the directory is
//! `fsync`ed; a crash at any point leaves the previous checkpoint intact. Reads `mmap` the file,
//! check it completely, and hand its pages to sequences in place (no parse into new buffers, no
//! copy); the kernel pages them in when they are first read.
//!
//! # File format (version 1; integers little-endian)
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 8 | magic `UKVCKPT\0` |
//! | 8 | 4 | format version (1) |
//! | 12 | 4 | tokens per page (64) |
//! | 16 | 4 | layers |
//! | 20 | 4 | kv_heads |
//! | 24 | 4 | head_dim |
//! | 28 | 4 | int8 group size (32) |
//! | 32 | 8 | tokens in the sequence |
//! | 40 | 8 | total file length in bytes |
//! | 48 | 16 | checksum: XXH3-128 (seed 0) of the whole file with these 16 bytes zeroed |
//! | 64 | 16 | reserved, zero |
//! | 80 | 4 | model id length `m` |
//! | 84 | 4 | checkpoint name length `k` |
//! | 88 | 4 | page count `P` (all layers) |
//! | 92 | 4 | reserved, zero |
//! | 96 | m | model id (UTF-8, [`u_sdk::KvLayout::model_id`]) |
//! | 96+m | k | checkpoint name (UTF-8) |
//! | T | 16·P | page table, T = 96+m+k rounded up to 64: per page `kind` u32 (0 = f32, 1 = int8), `tokens` u32, `offset` u64; layer by layer, pages in token order |
//! | … | | pages, each at a 64-byte-aligned offset |
//!
//! A page of `n` tokens and row `r = kv_heads × head_dim` holds, as in memory: f32 — keys
//! `n·r` f32, then values `n·r` f32; int8 — key scales `n·g` f32, value scales `n·g` f32
//! (`g = ⌈r/32⌉`), keys `n·r` i8, values `n·r` i8.

use crate::{
    page::{Counters, Kind, PAGE_TOKENS, Page, Shape, View},
    quant::GROUP,
    store::{Geometry, Lane, Snapshot},
};
use memmap2::Mmap;
use std::{
    fs::File,
    io::{BufWriter, Write},
    os::{fd::FromRawFd, unix::fs::FileExt},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};
use u_sdk::{HostBox, UError, WriteMode};
use xxhash_rust::xxh3::Xxh3;

/// Magic bytes at offset 0.
pub const MAGIC: [u8; 8] = *b"UKVCKPT\0";
/// Format version.
pub const VERSION: u32 = 1;
const HEADER: usize = 96;
const CHECKSUM: std::ops::Range<usize> = 48..64;
const ENTRY: usize = 16;
const ALIGN: usize = 64;
const EXT: &str = ".ukv";

#[cfg(target_endian = "big")]
compile_error!("the checkpoint format is little-endian and mapped in place");

/// Why a checkpoint file was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FormatError {
    /// Shorter than its header or than the length the header records (a torn write).
    #[error("truncated: {found} bytes, the header says {expected} (torn or partial write)")]
    Truncated {
        /// Bytes present.
        found: u64,
        /// Bytes expected.
        expected: u64,
    },
    /// Not a checkpoint file.
    #[error("not a U KV checkpoint (bad magic)")]
    BadMagic,
    /// Another format version.
    #[error("format version {0} is not supported (this build reads version {VERSION})")]
    Version(u32),
    /// Longer than the header says.
    #[error("{found} bytes but the header says {expected} (trailing data)")]
    Trailing {
        /// Bytes present.
        found: u64,
        /// Bytes expected.
        expected: u64,
    },
    /// The checksum does not match (bit rot, a flipped bit, a torn write).
    #[error("checksum mismatch: the file is corrupt")]
    Checksum,
    /// Written by another model.
    #[error("made by model {found:?}, but this cache serves model {expected:?}")]
    ForeignModel {
        /// The file's model id.
        found: String,
        /// This cache's model id.
        expected: String,
    },
    /// Another KV layout (or page size, or group size).
    #[error("layout {found} does not match this cache's {expected}")]
    Layout {
        /// The file's layout.
        found: String,
        /// This cache's layout.
        expected: String,
    },
    /// Inconsistent tables (only possible for a file that passed the checksum by construction).
    #[error("malformed: {0}")]
    Malformed(String),
}

/// One page's entry in the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Storage type.
    pub kind: Kind,
    /// Tokens in the page.
    pub tokens: usize,
    /// Byte offsets of keys, values, key scales, value scales.
    pub offsets: [usize; 4],
}

fn sections(kind: Kind, tokens: usize, shape: Shape, at: usize) -> ([usize; 4], usize) {
    let (r, g) = (tokens * shape.row, tokens * shape.groups);
    match kind {
        Kind::F32 => ([at, at + 4 * r, 0, 0], 8 * r),
        Kind::I8 => {
            let ks = at;
            let vs = ks + 4 * g;
            let k = vs + 4 * g;
            ([k, k + r, ks, vs], 8 * g + 2 * r)
        }
    }
}

fn align(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// XXH3-128 of `bytes` with the checksum field zeroed.
fn checksum(bytes: &[u8]) -> [u8; 16] {
    let mut h = Xxh3::new();
    h.update(&bytes[..CHECKSUM.start]);
    h.update(&[0u8; 16]);
    h.update(&bytes[CHECKSUM.end..]);
    h.digest128().to_le_bytes()
}

fn layout_string(layers: u32, kv_heads: u32, head_dim: u32, page: u32, group: u32) -> String {
    format!(
        "{layers} layers × {kv_heads} kv_heads × {head_dim} head_dim (page {page}, group {group})"
    )
}

/// Checks a whole file against `g` and returns its page table, layer by layer.
pub fn parse(bytes: &[u8], g: &Geometry) -> Result<Vec<Vec<Entry>>, FormatError> {
    let len = bytes.len() as u64;
    if bytes.len() < HEADER {
        return Err(FormatError::Truncated {
            found: len,
            expected: HEADER as u64,
        });
    }
    if bytes[..8] != MAGIC {
        return Err(FormatError::BadMagic);
    }
    let version = u32_at(bytes, 8);
    if version != VERSION {
        return Err(FormatError::Version(version));
    }
    let expected = u64_at(bytes, 40);
    if len < expected {
        return Err(FormatError::Truncated {
            found: len,
            expected,
        });
    }
    if len > expected {
        return Err(FormatError::Trailing {
            found: len,
            expected,
        });
    }
    if bytes[CHECKSUM] != checksum(bytes) {
        return Err(FormatError::Checksum);
    }
    let bad = |m: &str| FormatError::Malformed(m.to_string());
    let (mid_len, name_len) = (u32_at(bytes, 80) as usize, u32_at(bytes, 84) as usize);
    let count = u32_at(bytes, 88) as usize;
    let mid_end = HEADER
        .checked_add(mid_len)
        .filter(|&e| e <= bytes.len())
        .ok_or_else(|| bad("model id past the end"))?;
    let found_model = String::from_utf8_lossy(&bytes[HEADER..mid_end]).into_owned();
    if found_model != g.layout.model_id.as_str() {
        return Err(FormatError::ForeignModel {
            found: found_model,
            expected: g.layout.model_id.to_string(),
        });
    }
    let l = &g.layout;
    let ours = layout_string(
        l.layers,
        l.kv_heads,
        l.head_dim,
        PAGE_TOKENS as u32,
        GROUP as u32,
    );
    let theirs = layout_string(
        u32_at(bytes, 16),
        u32_at(bytes, 20),
        u32_at(bytes, 24),
        u32_at(bytes, 12),
        u32_at(bytes, 28),
    );
    if ours != theirs {
        return Err(FormatError::Layout {
            found: theirs,
            expected: ours,
        });
    }
    let tokens = u64_at(bytes, 32) as usize;
    let per_layer = tokens.div_ceil(PAGE_TOKENS);
    if count != per_layer * g.layers() {
        return Err(bad("page count does not match tokens × layers"));
    }
    let table = align(mid_end + name_len);
    let table_end = count
        .checked_mul(ENTRY)
        .and_then(|n| n.checked_add(table))
        .filter(|&e| e <= bytes.len())
        .ok_or_else(|| bad("page table past the end"))?;
    let mut layers = Vec::with_capacity(g.layers());
    for layer in 0..g.layers() {
        let mut pages = Vec::with_capacity(per_layer);
        for p in 0..per_layer {
            let e = table + (layer * per_layer + p) * ENTRY;
            let kind = match u32_at(bytes, e) {
                0 => Kind::F32,
                1 => Kind::I8,
                k => return Err(FormatError::Malformed(format!("unknown page kind {k}"))),
            };
            let n = u32_at(bytes, e + 4) as usize;
            let want = (tokens - p * PAGE_TOKENS).min(PAGE_TOKENS);
            if n != want {
                return Err(bad("page token count does not match the sequence length"));
            }
            let at = u64_at(bytes, e + 8) as usize;
            let (offsets, size) = sections(kind, n, g.shape, at);
            if !at.is_multiple_of(ALIGN)
                || at < table_end
                || at.checked_add(size).is_none_or(|e| e > bytes.len())
            {
                return Err(bad("page offset misaligned or out of bounds"));
            }
            pages.push(Entry {
                kind,
                tokens: n,
                offsets,
            });
        }
        layers.push(pages);
    }
    Ok(layers)
}

fn bytes_of<T: Copy>(s: &[T]) -> &[u8] {
    // SAFETY: `T` is f32 or i8 here: plain numbers without padding; any byte view is valid.
    unsafe { std::slice::from_raw_parts(s.as_ptr() as *const u8, std::mem::size_of_val(s)) }
}

/// Serializes `snap` (its complete tokens) into `out`; returns the checksum to patch in.
pub fn encode(
    name: &str,
    g: &Geometry,
    snap: &Snapshot,
    out: &mut impl Write,
) -> std::io::Result<([u8; 16], u64)> {
    let tokens = snap.len();
    let snap = snap.truncated(tokens);
    let l = &g.layout;
    let mid = l.model_id.as_bytes();
    let pages: Vec<(&Arc<Page>, usize)> = snap.lanes.iter().flat_map(|l| l.views()).collect();
    let table = align(HEADER + mid.len() + name.len());
    let mut at = align(table + pages.len() * ENTRY);
    let mut entries = Vec::with_capacity(pages.len() * ENTRY);
    for (p, n) in &pages {
        let (_, size) = sections(p.kind(), *n, g.shape, at);
        entries.extend_from_slice(&(if p.kind() == Kind::I8 { 1u32 } else { 0 }).to_le_bytes());
        entries.extend_from_slice(&(*n as u32).to_le_bytes());
        entries.extend_from_slice(&(at as u64).to_le_bytes());
        at = align(at + size);
    }
    let total = at as u64;
    let mut head = Vec::with_capacity(table + entries.len());
    head.extend_from_slice(&MAGIC);
    for v in [
        VERSION,
        PAGE_TOKENS as u32,
        l.layers,
        l.kv_heads,
        l.head_dim,
        GROUP as u32,
    ] {
        head.extend_from_slice(&v.to_le_bytes());
    }
    head.extend_from_slice(&(tokens as u64).to_le_bytes());
    head.extend_from_slice(&total.to_le_bytes());
    head.extend_from_slice(&[0u8; 32]);
    for v in [mid.len() as u32, name.len() as u32, pages.len() as u32, 0] {
        head.extend_from_slice(&v.to_le_bytes());
    }
    head.extend_from_slice(mid);
    head.extend_from_slice(name.as_bytes());
    head.resize(table, 0);
    head.extend_from_slice(&entries);
    head.resize(align(head.len()), 0);
    let mut sink = Sink {
        out,
        hasher: Xxh3::new(),
        written: 0,
    };
    sink.put(&head)?;
    for (p, n) in &pages {
        let start = sink.written;
        match p.view(*n) {
            View::F32 { keys, values } => {
                sink.put(bytes_of(keys))?;
                sink.put(bytes_of(values))?;
            }
            View::I8 {
                keys,
                values,
                key_scales,
                value_scales,
            } => {
                sink.put(bytes_of(key_scales))?;
                sink.put(bytes_of(value_scales))?;
                sink.put(bytes_of(keys))?;
                sink.put(bytes_of(values))?;
            }
        }
        let size = (sink.written - start) as usize;
        sink.put(&vec![0u8; align(size) - size])?;
    }
    debug_assert_eq!(sink.written, total);
    Ok((sink.hasher.digest128().to_le_bytes(), total))
}

struct Sink<'w, W: Write> {
    out: &'w mut W,
    hasher: Xxh3,
    written: u64,
}

impl<W: Write> Sink<'_, W> {
    fn put(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.hasher.update(b);
        self.written += b.len() as u64;
        self.out.write_all(b)
    }
}

/// Builds a snapshot whose pages point into `map` (checked by [`parse`]).
pub fn restore(
    map: Arc<Mmap>,
    g: &Geometry,
    counters: &Arc<Counters>,
) -> Result<Snapshot, FormatError> {
    let table = parse(&map, g)?;
    let tokens = u64_at(&map, 32) as usize;
    let lanes = table
        .into_iter()
        .map(|entries| Lane {
            pages: entries
                .into_iter()
                .map(|e| {
                    Arc::new(Page::mapped(
                        map.clone(),
                        e.kind,
                        e.tokens,
                        e.offsets,
                        g.shape,
                        counters,
                    ))
                })
                .collect(),
            len: tokens,
        })
        .collect();
    Ok(Snapshot { lanes })
}

/// Checks a checkpoint name: 1–128 of `[A-Za-z0-9_.-]`, not starting with a dot.
pub fn check_name(name: &str) -> u_sdk::Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(UError::invalid(format!(
            "cache-kv: checkpoint name {name:?} must be 1–128 characters of [A-Za-z0-9_.-], not \
             starting with '.'"
        )))
    }
}

/// The disk tier of one cache.
pub struct Disk {
    host: HostBox,
    dir: String,
    serial: AtomicU64,
}

fn owned_file(fd: i32, what: &str) -> u_sdk::Result<File> {
    if fd < 0 {
        return Err(UError::new(
            u_sdk::ErrorKind::Internal,
            format!("host returned invalid file descriptor {fd} for {what}"),
        ));
    }
    // SAFETY: the host hands over an open descriptor that this plugin now owns.
    Ok(unsafe { File::from_raw_fd(fd) })
}

impl Disk {
    /// Checkpoints under `dir`, reached through `host`.
    pub fn new(host: HostBox, dir: &str) -> Self {
        Self {
            host,
            dir: dir.trim_end_matches('/').to_string(),
            serial: AtomicU64::new(0),
        }
    }

    /// The path of checkpoint `name`.
    pub fn path(&self, name: &str) -> String {
        format!("{}/{name}{EXT}", self.dir)
    }

    /// Writes checkpoint `name` crash-safely (temporary file, fsync, rename, fsync directory).
    pub fn write(&self, name: &str, g: &Geometry, snap: &Snapshot) -> u_sdk::Result<()> {
        let n = self.serial.fetch_add(1, Ordering::Relaxed);
        let tmp = format!("{}/.{name}{EXT}.tmp.{}.{n}", self.dir, std::process::id());
        let path = self.path(name);
        let result = (|| {
            let fd = self
                .host
                .open_write(tmp.as_str().into(), WriteMode::CreateNew)
                .into_result()?;
            let file = owned_file(fd, &tmp)?;
            let io = |e| UError::io(format!("write {tmp}"), e);
            let mut w = BufWriter::with_capacity(1 << 20, &file);
            let (sum, _) = encode(name, g, snap, &mut w).map_err(io)?;
            w.flush().map_err(io)?;
            drop(w);
            file.write_all_at(&sum, CHECKSUM.start as u64).map_err(io)?;
            file.sync_all().map_err(io)?;
            drop(file);
            self.host
                .rename(tmp.as_str().into(), path.as_str().into())
                .into_result()
        })();
        if let Err(e) = result {
            let _ = self.host.remove(tmp.as_str().into());
            return Err(e);
        }
        // Make the rename durable; a host that cannot open directories only loses durability.
        if let Ok(fd) = self.host.open_read(self.dir.as_str().into()).into_result()
            && let Ok(d) = owned_file(fd, &self.dir)
        {
            let _ = d.sync_all();
        }
        Ok(())
    }

    /// Maps, checks and restores checkpoint `name`.
    pub fn read(
        &self,
        name: &str,
        g: &Geometry,
        counters: &Arc<Counters>,
    ) -> u_sdk::Result<Snapshot> {
        let path = self.path(name);
        let fd = self.host.open_read(path.as_str().into()).into_result()?;
        let file = owned_file(fd, &path)?;
        // SAFETY: a private read-only map; checkpoint files are replaced by rename, never
        // rewritten in place, so the mapped inode does not change under us.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| UError::io(format!("mmap {path}"), e))?;
        restore(Arc::new(map), g, counters)
            .map_err(|e| UError::invalid(format!("checkpoint {path} refused: {e}")))
    }

    /// Removes checkpoint `name`; false if there was none.
    pub fn remove(&self, name: &str) -> u_sdk::Result<bool> {
        match self
            .host
            .remove(self.path(name).as_str().into())
            .into_result()
        {
            Ok(()) => Ok(true),
            Err(e) if e.kind == u_sdk::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Names of the checkpoints in the directory.
    pub fn list(&self) -> u_sdk::Result<Vec<String>> {
        let fd = self
            .host
            .open_read(self.dir.as_str().into())
            .into_result()?;
        if fd < 0 {
            return Err(UError::new(
                u_sdk::ErrorKind::Internal,
                format!(
                    "host returned invalid file descriptor {fd} for {}",
                    self.dir
                ),
            ));
        }
        // SAFETY: `fd` is an open directory descriptor we own; `fdopendir` takes it over and
        // `closedir` closes it; entries are read before the next `readdir` call.
        let names = unsafe {
            let dirp = libc::fdopendir(fd);
            if dirp.is_null() {
                libc::close(fd);
                return Err(UError::io(
                    format!("list {}", self.dir),
                    std::io::Error::last_os_error(),
                ));
            }
            let mut names = Vec::new();
            loop {
                let ent = libc::readdir(dirp);
                if ent.is_null() {
                    break;
                }
                let raw = std::ffi::CStr::from_ptr((*ent).d_name.as_ptr());
                if let Some(n) = raw.to_str().ok().and_then(|s| s.strip_suffix(EXT))
                    && check_name(n).is_ok()
                {
                    names.push(n.to_string());
                }
            }
            libc::closedir(dirp);
            names
        };
        Ok(names)
    }
}
