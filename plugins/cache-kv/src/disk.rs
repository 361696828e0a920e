//! The disk tier: checkpoints and prefix-tree segments as files under a directory the
//! deployment grants `fs.write` on.
//!
//! Every file access goes through the host services (`open_write`, `open_read`, `rename`,
//! `remove`), so the grant applies. Writes are crash-safe: the file is written under a temporary
//! name (`.<name><ext>.tmp.<pid>.<n>`), `fsync`ed, renamed over `<name><ext>`, and the directory
//! is `fsync`ed; a crash at any point leaves the previous file intact. Reads `mmap` the file,
//! check it completely, and hand its pages to sequences in place (no parse into new buffers, no
//! copy); the kernel pages them in when they are first read.
//!
//! A writer holds an exclusive `flock` on its temporary file from creation to rename, so a
//! crashed writer's lock is gone with it. Opening a directory ([`Disk::open`]) removes the
//! temporary files of crashed writers: those nobody holds locked whose `<pid>` is not a live
//! process (`kill(pid, 0)` fails with `ESRCH`), is this process's own (a process of the same pid
//! before a restart — containers reuse pids — that died mid-save), or that were last written over
//! ten seconds ago (a pid reused by an unrelated process). A locked one is a save in progress
//! (another cache on the same directory) and is left alone. Where the file system cannot lock,
//! only files of dead pids are removed. Directories are meant to be shared only by processes of
//! one pid namespace (otherwise a writer of another namespace looks dead, and its save fails at
//! the rename — an error, never a torn file).
//!
//! # File format (version 1; integers little-endian)
//!
//! Two kinds of file share one layout: checkpoints (`<name>.ukv`, magic `UKVCKPT\0`) and
//! prefix-tree segments (`p-<hash>.ukvp`, magic `UKVPREF\0`; see [`crate::store`] for when they
//! are written and how the tree is rebuilt from them).
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 8 | magic `UKVCKPT\0` or `UKVPREF\0` |
//! | 8 | 4 | format version (1) |
//! | 12 | 4 | tokens per page (64) |
//! | 16 | 4 | layers |
//! | 20 | 4 | kv_heads |
//! | 24 | 4 | head_dim |
//! | 28 | 4 | int8 group size (32) |
//! | 32 | 8 | tokens in the sequence |
//! | 40 | 8 | total file length in bytes |
//! | 48 | 16 | checksum: XXH3-128 (seed 0) of the whole file with these 16 bytes zeroed |
//! | 64 | 8 | first page `f` stored per layer (checkpoint: 0) |
//! | 72 | 8 | segment start `s`: tokens `0..s` were already on disk when it was written (checkpoint: 0) |
//! | 80 | 4 | model id length `m` |
//! | 84 | 4 | label length `k` |
//! | 88 | 4 | page count `P` (all layers) |
//! | 92 | 4 | reserved, zero |
//! | 96 | m | model id (UTF-8, [`u_sdk::KvLayout::model_id`]) |
//! | 96+m | k | label: checkpoint name (UTF-8), or a segment's whole token path (`u32` each, `k = 4 × tokens`) |
//! | T | 16·P | page table, T = 96+m+k rounded up to 64: per page `kind` u32 (0 = f32, 1 = int8), `tokens` u32, `offset` u64; layer by layer, pages `f..` in token order |
//! | … | | pages, each at a 64-byte-aligned offset |
//!
//! A page of `n` tokens and row `r = kv_heads × head_dim` holds, as in memory: f32 — keys
//! `n·r` f32, then values `n·r` f32; int8 — key scales `n·g` f32, value scales `n·g` f32
//! (`g = ⌈r/32⌉`), keys `n·r` i8, values `n·r` i8.
//!
//! A segment stores pages `f = ⌊s/64⌋..` of each layer: pages before `f` are whole pages of
//! shorter segments on the same token path (shared, as in memory), and the page holding token
//! `s` is stored again so that every page of a restored sequence maps one file region as is.

use crate::{
    page::{Counters, HostBytes, Kind, PAGE_TOKENS, Page, Shape, View},
    quant::GROUP,
    store::{Geometry, Snapshot},
};
use memmap2::Mmap;
use std::{
    fs::File,
    io::{BufWriter, Write},
    ops::Range,
    os::{
        fd::{AsRawFd, FromRawFd},
        unix::fs::FileExt,
    },
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};
use u_sdk::{BufferBox, HostBox, UError, WriteMode};
use xxhash_rust::xxh3::Xxh3;

/// Magic bytes at offset 0 of a checkpoint file.
pub const MAGIC: [u8; 8] = *b"UKVCKPT\0";
/// Magic bytes at offset 0 of a prefix-tree segment file.
pub const PREFIX_MAGIC: [u8; 8] = *b"UKVPREF\0";
/// Format version.
pub const VERSION: u32 = 1;
const HEADER: usize = 96;
const CHECKSUM: Range<usize> = 48..64;
const ENTRY: usize = 16;
const ALIGN: usize = 64;

#[cfg(target_endian = "big")]
compile_error!("the checkpoint format is little-endian and mapped in place");

/// What a file holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileKind {
    /// A named checkpoint: a whole sequence.
    Checkpoint,
    /// A prefix-tree segment: a token path and its pages from page `f` on.
    Prefix,
}

impl FileKind {
    fn magic(self) -> [u8; 8] {
        match self {
            Self::Checkpoint => MAGIC,
            Self::Prefix => PREFIX_MAGIC,
        }
    }

    /// The file name extension.
    pub fn ext(self) -> &'static str {
        match self {
            Self::Checkpoint => ".ukv",
            Self::Prefix => ".ukvp",
        }
    }

    fn what(self) -> &'static str {
        match self {
            Self::Checkpoint => "checkpoint",
            Self::Prefix => "prefix-tree segment",
        }
    }
}

/// Why a checkpoint or segment file was refused.
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
    /// Not a file of the expected kind.
    #[error("not a U KV {0} (bad magic)")]
    BadMagic(&'static str),
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

/// A checked file: its page table and header fields.
#[derive(Debug)]
pub struct Parsed {
    /// Entries of pages `first_page..`, layer by layer.
    pub layers: Vec<Vec<Entry>>,
    /// Tokens in the sequence.
    pub tokens: usize,
    /// First page stored per layer.
    pub first_page: usize,
    /// Segment start (tokens already on disk when it was written).
    pub start: usize,
    /// Byte range of the label.
    pub label: Range<usize>,
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

fn our_layout(g: &Geometry) -> String {
    let l = &g.layout;
    layout_string(
        l.layers,
        l.kv_heads,
        l.head_dim,
        PAGE_TOKENS as u32,
        GROUP as u32,
    )
}

/// Checks a whole file of `kind` against `g` and returns its page table and header fields.
pub fn parse(bytes: &[u8], kind: FileKind, g: &Geometry) -> Result<Parsed, FormatError> {
    check_integrity(bytes, kind)?;
    let bad = |m: &str| FormatError::Malformed(m.to_string());
    let (mid_len, label_len) = (u32_at(bytes, 80) as usize, u32_at(bytes, 84) as usize);
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
    let ours = our_layout(g);
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
    let (first_page, start) = (u64_at(bytes, 64) as usize, u64_at(bytes, 72) as usize);
    let per_layer = tokens.div_ceil(PAGE_TOKENS);
    let label_end = mid_end
        .checked_add(label_len)
        .filter(|&e| e <= bytes.len())
        .ok_or_else(|| bad("label past the end"))?;
    match kind {
        FileKind::Checkpoint if first_page != 0 || start != 0 => {
            return Err(bad("a checkpoint stores every page"));
        }
        FileKind::Prefix
            if start >= tokens
                || first_page != start / PAGE_TOKENS
                || tokens.checked_mul(4) != Some(label_len) =>
        {
            return Err(bad("segment start, first page and token path disagree"));
        }
        _ => {}
    }
    if (per_layer - first_page.min(per_layer)).checked_mul(g.layers()) != Some(count) {
        return Err(bad("page count does not match tokens × layers"));
    }
    let table = align(label_end);
    let table_end = count
        .checked_mul(ENTRY)
        .and_then(|n| n.checked_add(table))
        .filter(|&e| e <= bytes.len())
        .ok_or_else(|| bad("page table past the end"))?;
    let stored = per_layer.saturating_sub(first_page);
    let mut layers = Vec::with_capacity(g.layers());
    for layer in 0..g.layers() {
        let mut pages = Vec::with_capacity(stored);
        for p in first_page..per_layer {
            let e = table + (layer * stored + p - first_page) * ENTRY;
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
            let misplaced = !at.is_multiple_of(ALIGN) || at < table_end || at > bytes.len();
            // `at` is within the file, so the sections' offsets cannot overflow.
            let (offsets, size) = if misplaced {
                ([0; 4], usize::MAX)
            } else {
                sections(kind, n, g.shape, at)
            };
            if size > bytes.len() - at.min(bytes.len()) {
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
    Ok(Parsed {
        layers,
        tokens,
        first_page,
        start,
        label: mid_end..label_end,
    })
}

fn bytes_of<T: Copy>(s: &[T]) -> &[u8] {
    // SAFETY: `T` is f32, i8 or u32 here: plain numbers without padding; any byte view is valid.
    unsafe { std::slice::from_raw_parts(s.as_ptr() as *const u8, std::mem::size_of_val(s)) }
}

/// What [`encode`] writes besides the pages.
pub struct Header<'a> {
    /// The kind of file.
    pub kind: FileKind,
    /// Checkpoint name, or the segment's token path as bytes.
    pub label: &'a [u8],
    /// Segment start (0 for a checkpoint); pages from `start / PAGE_TOKENS` on are written.
    pub start: usize,
}

/// The length of the file [`encode`] writes for `h` and `snap`.
pub fn encoded_len(h: &Header<'_>, g: &Geometry, snap: &Snapshot) -> u64 {
    let snap = snap.truncated(snap.len());
    let first_page = h.start / PAGE_TOKENS;
    let pages: Vec<(Kind, usize)> = snap
        .lanes
        .iter()
        .flat_map(|l| l.views().skip(first_page))
        .map(|(p, n)| (p.kind(), n))
        .collect();
    let table = align(HEADER + g.layout.model_id.len() + h.label.len());
    let mut at = align(table + pages.len() * ENTRY);
    for (kind, n) in pages {
        at = align(at + sections(kind, n, g.shape, at).1);
    }
    at as u64
}

/// Serializes `snap` (its complete tokens) into `out`; returns the checksum to patch in.
pub fn encode(
    h: &Header<'_>,
    g: &Geometry,
    snap: &Snapshot,
    out: &mut impl Write,
) -> std::io::Result<([u8; 16], u64)> {
    let tokens = snap.len();
    let snap = snap.truncated(tokens);
    let first_page = h.start / PAGE_TOKENS;
    let l = &g.layout;
    let mid = l.model_id.as_bytes();
    let pages: Vec<(&Arc<Page>, usize)> = snap
        .lanes
        .iter()
        .flat_map(|l| l.views().skip(first_page))
        .collect();
    let table = align(HEADER + mid.len() + h.label.len());
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
    head.extend_from_slice(&h.kind.magic());
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
    for v in [
        tokens as u64,
        total,
        0,
        0,
        first_page as u64,
        h.start as u64,
    ] {
        head.extend_from_slice(&v.to_le_bytes());
    }
    for v in [
        mid.len() as u32,
        h.label.len() as u32,
        pages.len() as u32,
        0,
    ] {
        head.extend_from_slice(&v.to_le_bytes());
    }
    head.extend_from_slice(mid);
    head.extend_from_slice(h.label);
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

/// A file's pages, pointing into its map, with its header fields.
pub struct Mapped {
    /// Pages `first_page..` of each layer, in token order.
    pub pages: Vec<Vec<Arc<Page>>>,
    /// Tokens in the sequence.
    pub tokens: usize,
    /// First page stored per layer.
    pub first_page: usize,
    /// Segment start.
    pub start: usize,
    /// The label's bytes (a copy: names and token ids, not KV).
    pub label: Vec<u8>,
    /// Length of the file.
    pub bytes: u64,
}

/// Checks what a file of `kind` says of itself, whatever model it is for: the header's magic
/// and version, its length against the header's (a torn or partial write), and the checksum
/// over every byte (bit rot). Returns the tokens it holds.
pub fn check_integrity(bytes: &[u8], kind: FileKind) -> Result<u64, FormatError> {
    let len = bytes.len() as u64;
    if bytes.len() < HEADER {
        return Err(FormatError::Truncated {
            found: len,
            expected: HEADER as u64,
        });
    }
    if bytes[..8] != kind.magic() {
        return Err(FormatError::BadMagic(kind.what()));
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
    Ok(u64_at(bytes, 32))
}

/// Reads `bytes` as a file of `kind` for a cache of `layout` as restoring one does — integrity,
/// header, page table, then every page mapped in place and read — and returns the tokens it
/// holds and its label. For tools that check files, and the fuzz target of this format.
pub fn check_file(
    bytes: &[u8],
    kind: FileKind,
    layout: u_sdk::KvLayout,
) -> Result<(u64, Vec<u8>), FormatError> {
    check_integrity(bytes, kind)?;
    let g = Geometry::new(layout, crate::page::Alloc::Heap)
        .map_err(|e| FormatError::Malformed(e.to_string()))?;
    let mut anon = memmap2::MmapMut::map_anon(bytes.len())
        .map_err(|e| FormatError::Malformed(format!("cannot map {} bytes: {e}", bytes.len())))?;
    anon.copy_from_slice(bytes);
    let map = anon
        .make_read_only()
        .map_err(|e| FormatError::Malformed(e.to_string()))?;
    let mapped = restore(Arc::new(map), kind, &g, &Arc::default())?;
    for (p, page) in mapped
        .pages
        .iter()
        .flat_map(|l| (mapped.first_page..).zip(l))
    {
        match page.view((mapped.tokens - p * PAGE_TOKENS).min(PAGE_TOKENS)) {
            View::F32 { keys, values } => {
                std::hint::black_box((keys.iter().sum::<f32>(), values.iter().sum::<f32>()));
            }
            View::I8 {
                keys, key_scales, ..
            } => {
                std::hint::black_box((
                    keys.iter().map(|&k| i32::from(k)).sum::<i32>(),
                    key_scales.len(),
                ));
            }
        }
    }
    if kind == FileKind::Prefix {
        std::hint::black_box(mapped.token_path());
    }
    Ok((mapped.tokens as u64, mapped.label))
}

/// Builds pages that point into `map` (checked by [`parse`]).
pub fn restore(
    map: Arc<Mmap>,
    kind: FileKind,
    g: &Geometry,
    counters: &Arc<Counters>,
) -> Result<Mapped, FormatError> {
    let parsed = parse(&map, kind, g)?;
    let buffer = BufferBox::new(HostBytes::map(map.clone()));
    let pages = parsed
        .layers
        .into_iter()
        .map(|entries| {
            entries
                .into_iter()
                .map(|e| {
                    Arc::new(Page::mapped(
                        &buffer, e.kind, e.tokens, e.offsets, g.shape, counters,
                    ))
                })
                .collect()
        })
        .collect();
    Ok(Mapped {
        pages,
        tokens: parsed.tokens,
        first_page: parsed.first_page,
        start: parsed.start,
        label: map[parsed.label].to_vec(),
        bytes: map.len() as u64,
    })
}

impl Mapped {
    /// The sequence these pages continue: `base` (at least `first_page` whole pages long)
    /// truncated to those pages, then this file's pages.
    pub fn onto(self, base: &Snapshot) -> Snapshot {
        let keep = self.first_page * PAGE_TOKENS;
        let mut snap = base.truncated(keep);
        for (lane, pages) in snap.lanes.iter_mut().zip(self.pages) {
            debug_assert_eq!(lane.len, keep);
            lane.pages.extend(pages);
            lane.len = self.tokens;
        }
        snap
    }

    /// The label as token ids (a segment's token path).
    pub fn token_path(&self) -> Vec<u32> {
        self.label
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect()
    }
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

/// The file stem of the segment for `tokens` under layout `g`: `p-` and 32 hex digits of an
/// XXH3-128 of the model id, the layout and the token ids, so models sharing a directory never
/// collide.
pub fn segment_stem(g: &Geometry, tokens: &[u32]) -> String {
    let mut h = Xxh3::new();
    h.update(g.layout.model_id.as_bytes());
    h.update(&[0]);
    h.update(our_layout(g).as_bytes());
    h.update(&[0]);
    h.update(bytes_of(tokens));
    format!("p-{:032x}", h.digest128())
}

/// The writer's pid if `name` is a temporary file of this format.
fn temp_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix('.')?;
    let (rest, _serial) = rest
        .rsplit_once('.')
        .filter(|(_, n)| n.parse::<u64>().is_ok())?;
    let (rest, pid) = rest.rsplit_once('.')?;
    let pid: u32 = pid.parse().ok()?;
    let tmp = [FileKind::Checkpoint, FileKind::Prefix]
        .iter()
        .any(|k| rest.ends_with(&format!("{}.tmp", k.ext())));
    tmp.then_some(pid)
}

fn lock_checked<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether process `pid` is gone.
fn dead(pid: u32) -> bool {
    i32::try_from(pid).is_ok_and(|p| {
        // SAFETY: signal 0 sends nothing; it only asks whether `p` exists.
        let r = unsafe { libc::kill(p, 0) };
        r != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
    })
}

/// Takes an exclusive `flock` on `file` (blocking unless `wait` is false): `Some(true)` taken,
/// `Some(false)` another open file holds it, `None` the file system cannot lock.
fn lock(file: &File, wait: bool) -> Option<bool> {
    let op = if wait {
        libc::LOCK_EX
    } else {
        libc::LOCK_EX | libc::LOCK_NB
    };
    // SAFETY: `flock` on a descriptor `file` owns; it touches no memory.
    if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
        return Some(true);
    }
    match std::io::Error::last_os_error().raw_os_error() {
        Some(libc::EWOULDBLOCK) => Some(false),
        _ => None,
    }
}

/// How long an unlocked temporary file of a live pid must have been left before it counts as
/// abandoned (far longer than a writer takes between creating and locking it).
const ABANDONED_AFTER: std::time::Duration = std::time::Duration::from_secs(10);

/// The disk tier of one cache.
pub struct Disk {
    host: HostBox,
    dir: String,
    serial: AtomicU64,
    /// Checkpoints known whole (checked by [`check_integrity`] or written here): their tokens.
    checked: std::sync::Mutex<std::collections::HashMap<String, u64>>,
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
    /// The disk tier under `dir`, reached through `host`; removes the temporary files that
    /// crashed writers left there (see the module documentation), logging each.
    pub fn open(host: HostBox, dir: &str) -> Self {
        let disk = Self {
            host,
            dir: dir.trim_end_matches('/').to_string(),
            serial: AtomicU64::new(0),
            checked: Default::default(),
        };
        disk.remove_stale_temps();
        disk
    }

    fn remove_stale_temps(&self) {
        let Ok(names) = self.entries() else { return };
        let ours = std::process::id();
        for name in names {
            let Some(pid) = temp_pid(&name) else {
                continue;
            };
            let path = format!("{}/{name}", self.dir);
            if !self.abandoned(&path, pid, ours) {
                continue;
            }
            match self.host.remove(path.as_str().into()).into_result() {
                Ok(()) => self.host.info(&format!(
                    "cache-kv: removed {path}, left by a writer (pid {pid}) that is gone"
                )),
                Err(e) => self.host.warn(&format!(
                    "cache-kv: cannot remove stale temporary file {path}: {}",
                    e.message
                )),
            }
        }
    }

    /// Whether the temporary file `path` of writer `pid` was left by a writer that is gone (see
    /// the module documentation); `ours` is this process's pid.
    fn abandoned(&self, path: &str, pid: u32, ours: u32) -> bool {
        let file = self
            .host
            .open_read(path.into())
            .into_result()
            .and_then(|fd| owned_file(fd, path));
        let Ok(file) = file else {
            return false;
        };
        match lock(&file, false) {
            Some(false) => false,
            Some(true) => {
                let old = file
                    .metadata()
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| t.elapsed().ok())
                    .is_some_and(|age| age > ABANDONED_AFTER);
                pid == ours || old || dead(pid)
            }
            None => pid != ours && dead(pid),
        }
    }

    /// Logs a warning through the host.
    pub fn warn(&self, message: &str) {
        self.host.warn(message);
    }

    /// The path of the file `stem` of `kind`.
    pub fn path(&self, stem: &str, kind: FileKind) -> String {
        format!("{}/{stem}{}", self.dir, kind.ext())
    }

    /// Writes checkpoint `name` crash-safely.
    pub fn write(&self, name: &str, g: &Geometry, snap: &Snapshot) -> u_sdk::Result<()> {
        let h = Header {
            kind: FileKind::Checkpoint,
            label: name.as_bytes(),
            start: 0,
        };
        self.write_file(name, &h, g, snap)?;
        lock_checked(&self.checked).insert(name.to_string(), snap.len() as u64);
        Ok(())
    }

    /// The length of the file [`Disk::write_segment`] writes for the same arguments.
    pub fn segment_len(tokens: &[u32], start: usize, g: &Geometry, snap: &Snapshot) -> u64 {
        let h = Header {
            kind: FileKind::Prefix,
            label: bytes_of(tokens),
            start,
        };
        encoded_len(&h, g, &snap.truncated(tokens.len()))
    }

    /// Writes the segment of `tokens` (held by `snap`) from token `start` on, crash-safely;
    /// returns its stem and length.
    pub fn write_segment(
        &self,
        tokens: &[u32],
        start: usize,
        g: &Geometry,
        snap: &Snapshot,
    ) -> u_sdk::Result<(String, u64)> {
        let stem = segment_stem(g, tokens);
        let h = Header {
            kind: FileKind::Prefix,
            label: bytes_of(tokens),
            start,
        };
        let bytes = self.write_file(&stem, &h, g, &snap.truncated(tokens.len()))?;
        Ok((stem, bytes))
    }

    /// Writes `stem` (temporary file, fsync, rename, fsync directory); returns its length.
    fn write_file(
        &self,
        stem: &str,
        h: &Header<'_>,
        g: &Geometry,
        snap: &Snapshot,
    ) -> u_sdk::Result<u64> {
        let n = self.serial.fetch_add(1, Ordering::Relaxed);
        let ext = h.kind.ext();
        let tmp = format!("{}/.{stem}{ext}.tmp.{}.{n}", self.dir, std::process::id());
        let path = self.path(stem, h.kind);
        let result = (|| {
            let fd = self
                .host
                .open_write(tmp.as_str().into(), WriteMode::CreateNew)
                .into_result()?;
            let file = owned_file(fd, &tmp)?;
            // Held until the file is closed after the rename: a crash drops it, which tells a
            // later open that this file is abandoned.
            lock(&file, true);
            let io = |e| UError::io(format!("write {tmp}"), e);
            let mut w = BufWriter::with_capacity(1 << 20, &file);
            let (sum, total) = encode(h, g, snap, &mut w).map_err(io)?;
            w.flush().map_err(io)?;
            drop(w);
            file.write_all_at(&sum, CHECKSUM.start as u64).map_err(io)?;
            file.sync_all().map_err(io)?;
            self.host
                .rename(tmp.as_str().into(), path.as_str().into())
                .into_result()?;
            drop(file);
            Ok(total)
        })();
        let total = match result {
            Ok(t) => t,
            Err(e) => {
                let _ = self.host.remove(tmp.as_str().into());
                return Err(e);
            }
        };
        // Make the rename durable; a host that cannot open directories only loses durability.
        if let Ok(fd) = self.host.open_read(self.dir.as_str().into()).into_result()
            && let Ok(d) = owned_file(fd, &self.dir)
        {
            let _ = d.sync_all();
        }
        Ok(total)
    }

    /// Maps, checks and restores checkpoint `name`.
    pub fn read(
        &self,
        name: &str,
        g: &Geometry,
        counters: &Arc<Counters>,
    ) -> u_sdk::Result<Snapshot> {
        let m = self.map(name, FileKind::Checkpoint, g, counters)?;
        Ok(m.onto(&Snapshot::empty(g.layers())))
    }

    /// Maps and checks the file `stem` of `kind`; the error names the file and why.
    pub fn map(
        &self,
        stem: &str,
        kind: FileKind,
        g: &Geometry,
        counters: &Arc<Counters>,
    ) -> u_sdk::Result<Mapped> {
        let path = self.path(stem, kind);
        let fd = self.host.open_read(path.as_str().into()).into_result()?;
        let file = owned_file(fd, &path)?;
        // SAFETY: a private read-only map; these files are replaced by rename, never rewritten
        // in place, so the mapped inode does not change under us.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| UError::io(format!("mmap {path}"), e))?;
        restore(Arc::new(map), kind, g, counters)
            .map_err(|e| UError::invalid(format!("{} {path} refused: {e}", kind.what())))
    }

    /// Removes checkpoint `name`; false if there was none.
    pub fn remove(&self, name: &str) -> u_sdk::Result<bool> {
        lock_checked(&self.checked).remove(name);
        self.remove_file(name, FileKind::Checkpoint)
    }

    /// Removes the file `stem` of `kind` (through the host, as every access); false if there
    /// was none. Pages mapped from it stay valid: the map keeps the unlinked inode.
    pub fn remove_file(&self, stem: &str, kind: FileKind) -> u_sdk::Result<bool> {
        match self
            .host
            .remove(self.path(stem, kind).as_str().into())
            .into_result()
        {
            Ok(()) => Ok(true),
            Err(e) if e.kind == u_sdk::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// The checkpoints in the directory with their tokens. A file seen for the first time is
    /// checked whole ([`check_integrity`]); one that fails (torn, truncated, bit rot, not a
    /// checkpoint) is not listed: it is renamed to `<name>.ukv.corrupt`, out of every listing
    /// and lookup, and reported once in the log.
    pub fn list(&self) -> u_sdk::Result<Vec<(String, u64)>> {
        let mut out = Vec::new();
        for name in self.stems(FileKind::Checkpoint)? {
            let known = lock_checked(&self.checked).get(&name).copied();
            let tokens = match known {
                Some(t) => Some(t),
                None => self.check_file(&name),
            };
            if let Some(t) = tokens {
                out.push((name, t));
            }
        }
        Ok(out)
    }

    /// Checks checkpoint file `name` whole: its tokens, or `None` when it is unusable (then it
    /// is moved aside and reported) or cannot be read now.
    fn check_file(&self, name: &str) -> Option<u64> {
        let path = self.path(name, FileKind::Checkpoint);
        let fd = self
            .host
            .open_read(path.as_str().into())
            .into_result()
            .ok()?;
        let file = owned_file(fd, &path).ok()?;
        // SAFETY: a private read-only map; files are replaced by rename, never rewritten.
        let map = unsafe { Mmap::map(&file) }.ok()?;
        match check_integrity(&map, FileKind::Checkpoint) {
            Ok(tokens) => {
                lock_checked(&self.checked).insert(name.to_string(), tokens);
                Some(tokens)
            }
            Err(e) => {
                let aside = format!("{path}.corrupt");
                let moved = self
                    .host
                    .rename(path.as_str().into(), aside.as_str().into())
                    .into_result();
                self.host.warn(&match moved {
                    Ok(()) => format!(
                        "cache-kv: checkpoint {name:?} is unusable ({e}); moved aside to {aside}"
                    ),
                    Err(m) => format!(
                        "cache-kv: checkpoint {name:?} is unusable ({e}) and could not be moved \
                         aside: {}",
                        m.message
                    ),
                });
                None
            }
        }
    }

    /// Stems of the files of `kind` in the directory.
    pub fn stems(&self, kind: FileKind) -> u_sdk::Result<Vec<String>> {
        Ok(self
            .entries()?
            .into_iter()
            .filter_map(|n| {
                n.strip_suffix(kind.ext())
                    .filter(|s| check_name(s).is_ok())
                    .map(str::to_string)
            })
            .collect())
    }

    /// Every name in the directory.
    fn entries(&self) -> u_sdk::Result<Vec<String>> {
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
                if let Ok(n) = raw.to_str() {
                    names.push(n.to_string());
                }
            }
            libc::closedir(dirp);
            names
        };
        Ok(names)
    }
}
