//! The cache engine behind the ABI: sequences of pages, the prefix tree, checkpoints, the budget.
//!
//! Locks: the sequence table, then one sequence; the prefix tree and the checkpoint table are
//! never taken while a sequence is locked, so no two locks are ever waited for in opposite order.
//!
//! # The prefix tree on disk
//!
//! With a directory configured (and `persist_prefixes`, on by default), the prefix tree is
//! **written through** to disk: [`Store::insert_prefix`] writes the new part of the path as a
//! segment file (format in [`crate::disk`]) before it returns, then the tree node holds that
//! file's *mapped* pages instead of the inserting sequence's heap pages. A segment starts at the
//! page holding the first token not yet on disk (found by walking the tree) and leaves earlier
//! pages to the segments already there, so a 2,000-token system prompt is written once however
//! many conversations extend it; the cost is one page per layer written again at each branch
//! point.
//!
//! - Cost: an insert that adds tokens writes their KV and waits for two `fsync`s (file and
//!   directory), outside the tree's lock, so lookups are not held up; re-inserting a path already
//!   on disk writes nothing. Write-through, rather than write-behind or write-on-eviction, means a
//!   prefix survives `kill -9` as soon as its insert returns, and the tree never holds heap pages.
//!   A write that fails is logged and the node keeps its heap pages (memory only).
//! - Memory: mapped pages are not heap. They are counted apart ([`Store::mapped_bytes`]) and
//!   not in [`u_sdk::KvStats::bytes`] or the `max_bytes` budget: the kernel's page cache holds
//!   them, reads them on first use and drops them under memory pressure. So the budget evicts
//!   only nodes that hold heap pages; nodes on disk stay in the tree (a token path and a map each)
//!   until the disk budget deletes their file.
//! - Restart: when the layout is configured, every segment file of the directory is mapped and
//!   checked completely (checksum, model identity, layout) — startup reads the tier once; later
//!   reads come from the page cache or the disk on demand. Segments are then added in the order
//!   they were written (by start), each on top of the tree's pages for its first `f` pages. A
//!   refused file, or one whose earlier pages no other segment provides, is logged through the
//!   host and skipped; startup does not fail. A segment whose base comes later in that order
//!   (possible once segments were deleted, below) is tried again after the others.
//! - Disk budget ([`Config::disk_budget`]: `max_disk_bytes`, by default 4 × `max_bytes`): the
//!   tree keeps a table of its segment files (those it wrote and those it restored) with their
//!   sizes and, for each, the segment its earlier pages come from (see [`crate::radix`]). Before
//!   a segment is written, its size is reserved and least recently used segments are deleted
//!   until it fits — only those no other segment (or write in progress) builds on, so leaves
//!   first and an ancestor after its descendants, and never one whose tree node is pinned by a
//!   live lookup. The deletion goes through the host's `remove`, under the tree's lock (so no
//!   write of the same path races it), then the tree stops claiming the file: nodes holding its
//!   pages take over a child's, or are removed. Sequences holding its pages keep them (an
//!   unlinked file's map stays valid). A segment that cannot fit (larger than the budget, or
//!   everything else pinned or needed) is not written: the prefix stays in memory only, counted
//!   in [`SegmentStats::not_written`] and logged once. A budget lowered since the files were
//!   written applies when the directory is opened. Checkpoints are not counted nor deleted.
//!   Counts: [`Store::segment_stats`]. Choosing a victim scans the tree (linear in nodes and
//!   segments, per deleted file). An unlink that a crash undoes leaves a file that the restart
//!   restores, or skips with a warning if its ancestor's unlink was kept.
//! - Not yet: each live segment holds one memory map, so a tier of very many segments (a large
//!   disk budget of short prefixes) approaches the kernel's `vm.max_map_count`; the budget counts
//!   only this cache's own segment files (another model's, or refused ones, in the same
//!   directory are neither counted nor deleted), not the free space of the disk.

use crate::{
    disk::{self, Disk, FileKind},
    page::{Alloc, Counters, Kind, PAGE_TOKENS, Page, Shape},
    radix::{Base, Radix},
};
use std::{
    collections::{BTreeMap, HashMap},
    sync::{
        Arc, Mutex, MutexGuard, RwLock,
        atomic::{AtomicU64, Ordering},
    },
};
use u_sdk::{DType, ErrorKind, KvLayout, KvStats, SeqId, UError};

/// Cache settings, from the plugin's `[plugins.config]` table.
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Byte budget: past it, least recently used prefix-tree entries are evicted. Default: a
    /// quarter of the machine's physical memory, so a server that caches every prompt stays
    /// bounded.
    #[serde(default = "default_max_bytes")]
    pub max_bytes: Option<u64>,
    /// Directory (under an `fs.write` grant) where checkpoints persist.
    #[serde(default)]
    pub dir: Option<String>,
    /// Most named checkpoints kept in memory.
    #[serde(default = "default_max_checkpoints")]
    pub max_checkpoints: usize,
    /// Whether the prefix tree persists under `dir` too (when `dir` is set).
    #[serde(default = "default_persist_prefixes")]
    pub persist_prefixes: bool,
    /// Disk budget of the prefix tree's segment files under `dir`, in bytes (see
    /// [`Config::disk_budget`] for the default). Before a segment is written, least recently
    /// used segments that no other segment builds on and that no live lookup holds are deleted
    /// until it fits; a segment that cannot fit is not written (the prefix stays in memory
    /// only). Checkpoints are not counted and never deleted by it.
    #[serde(default)]
    pub max_disk_bytes: Option<u64>,
    /// How new sequences store their KV: `"f32"` (the default, exact) or `"int8"` (a quarter of
    /// the memory and disk: one scale per 32 values of a token's row; attention reads the int8
    /// pages in place). A sequence may still switch later ([`Store::set_dtype`]).
    #[serde(default)]
    pub kv_dtype: KvDtype,
}

/// The storage of new sequences' KV pages (see [`Config::kv_dtype`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    /// Exact f32 keys and values.
    #[default]
    F32,
    /// int8 keys and values with per-group scales.
    Int8,
}

fn default_max_bytes() -> Option<u64> {
    // SAFETY: sysconf has no preconditions.
    let (pages, size) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    (pages > 0 && size > 0).then(|| pages as u64 * size as u64 / 4)
}

fn default_max_checkpoints() -> usize {
    4096
}

fn default_persist_prefixes() -> bool {
    true
}

impl Default for Config {
    fn default() -> Self {
        Self {
            max_bytes: default_max_bytes(),
            dir: None,
            max_checkpoints: default_max_checkpoints(),
            persist_prefixes: default_persist_prefixes(),
            max_disk_bytes: None,
            kv_dtype: KvDtype::F32,
        }
    }
}

/// The disk budget's default, as a multiple of `max_bytes`.
pub const DEFAULT_DISK_BUDGET_MULTIPLE: u64 = 4;

impl Config {
    /// Parses the config TOML (empty means defaults).
    pub fn parse(text: &str) -> u_sdk::Result<Self> {
        toml::from_str(text).map_err(|e| UError::invalid(format!("cache-kv config: {e}")))
    }

    /// The disk budget of the prefix segments: `max_disk_bytes`, or by default
    /// [`DEFAULT_DISK_BUDGET_MULTIPLE`] (4) × `max_bytes`, which with the default `max_bytes`
    /// (a quarter of physical memory) is about the machine's physical memory. Why: it is
    /// bounded and scales with the machine like the heap budget, without a guess at the disk's
    /// size; mapped pages are served through the page cache, which on that machine holds at
    /// most about that much, so a larger tier is read back from the disk itself (still cheaper
    /// than a prefill: a deployment with a dedicated cache disk should raise it); and it keeps
    /// four times the KV the heap budget would (the tree on disk holds no heap). `None` (no
    /// budget) only when `max_bytes` is `None` too, which only a [`Config`] built in code says.
    pub fn disk_budget(&self) -> Option<u64> {
        self.max_disk_bytes.or_else(|| {
            self.max_bytes
                .map(|b| b.saturating_mul(DEFAULT_DISK_BUDGET_MULTIPLE))
        })
    }
}

/// The disk tier of the prefix tree, as [`Store::segment_stats`] reports it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SegmentStats {
    /// Segment files counted: written by this cache or restored when it opened the directory.
    pub segments: u64,
    /// Their bytes, with writes in progress.
    pub bytes: u64,
    /// The budget ([`Config::disk_budget`]).
    pub budget: Option<u64>,
    /// Segment files deleted to stay within it.
    pub deleted: u64,
    /// Prefixes kept in memory only because their segment did not fit in the budget.
    pub not_written: u64,
}

/// The configured layout.
#[derive(Clone, Debug)]
pub struct Geometry {
    /// The layout as declared.
    pub layout: KvLayout,
    /// Per-token row shape.
    pub shape: Shape,
    /// Page kind new sequences write.
    pub kind: Kind,
    /// Where new pages' memory comes from.
    pub alloc: Alloc,
}

impl std::fmt::Debug for Alloc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Alloc::Backend(_) => "backend buffers",
            Alloc::Heap => "heap",
        })
    }
}

impl Geometry {
    pub(crate) fn new(layout: KvLayout, alloc: Alloc) -> u_sdk::Result<Self> {
        let kind = kind_of(layout.dtype)?;
        if layout.layers == 0 || layout.kv_heads == 0 || layout.head_dim == 0 {
            return Err(UError::invalid(format!(
                "cache-kv: layout needs layers, kv_heads and head_dim > 0 (got {} × {} × {})",
                layout.layers, layout.kv_heads, layout.head_dim
            )));
        }
        let shape = Shape::new(layout.kv_heads as usize * layout.head_dim as usize);
        Ok(Self {
            layout,
            shape,
            kind,
            alloc,
        })
    }

    /// Number of layers.
    pub fn layers(&self) -> usize {
        self.layout.layers as usize
    }
}

fn kind_of(dtype: DType) -> u_sdk::Result<Kind> {
    match dtype {
        DType::F32 => Ok(Kind::F32),
        DType::I8 => Ok(Kind::I8),
        other => Err(UError::unsupported(format!(
            "cache-kv stores F32 or I8 KV, not {other:?}"
        ))),
    }
}

/// One layer's pages of a sequence: `pages.len() == ⌈len / PAGE_TOKENS⌉`.
#[derive(Clone, Default)]
pub struct Lane {
    /// Pages in token order.
    pub pages: Vec<Arc<Page>>,
    /// Tokens stored.
    pub len: usize,
}

impl Lane {
    fn truncate(&mut self, n: usize) {
        if n < self.len {
            self.len = n;
            self.pages.truncate(n.div_ceil(PAGE_TOKENS));
        }
    }

    /// `(page, tokens of it in this lane)` in order.
    pub fn views(&self) -> impl Iterator<Item = (&Arc<Page>, usize)> {
        let len = self.len;
        self.pages
            .iter()
            .enumerate()
            .map(move |(i, p)| (p, (len - i * PAGE_TOKENS).min(PAGE_TOKENS)))
    }

    /// Appends f32 rows, in place where this lane owns the page's frontier, else copying only
    /// the last page (copy on write). New pages are of `kind`.
    fn append(
        &mut self,
        keys: &[f32],
        values: &[f32],
        kind: Kind,
        g: &Geometry,
        counters: &Arc<Counters>,
    ) -> u_sdk::Result<()> {
        let shape = g.shape;
        let row = shape.row;
        let n = keys.len() / row;
        let mut done = 0;
        while done < n {
            let slot = self.len % PAGE_TOKENS;
            let take = (PAGE_TOKENS - slot).min(n - done);
            let (k, v) = (
                &keys[done * row..(done + take) * row],
                &values[done * row..(done + take) * row],
            );
            if slot == 0 {
                let mut p = Page::new(kind, shape, counters, &g.alloc)?;
                p.rewind_and_claim(0, take);
                // SAFETY: a fresh page, claimed above, not yet shared.
                unsafe { p.write(0, k, v) };
                self.pages.push(Arc::new(p));
            } else {
                let last = self.pages.last_mut().expect("a partly filled page");
                if last.claim(slot, take) {
                    // SAFETY: the CAS gave this writer slots slot..slot+take; nobody reads them
                    // before this lane publishes its new length.
                    unsafe { last.write(slot, k, v) };
                } else if let Some(p) = Arc::get_mut(last).filter(|p| !p.is_mapped()) {
                    p.rewind_and_claim(slot, take);
                    // SAFETY: `&mut`: nobody else references this page.
                    unsafe { p.write(slot, k, v) };
                } else {
                    let mut p = Page::new(last.kind(), shape, counters, &g.alloc)?;
                    p.copy_prefix_from(last, slot);
                    p.rewind_and_claim(slot, take);
                    // SAFETY: a fresh page, claimed above, not yet shared.
                    unsafe { p.write(slot, k, v) };
                    *last = Arc::new(p);
                }
            }
            self.len += take;
            done += take;
        }
        Ok(())
    }
}

/// A sequence's KV by reference: forking is cloning this (page references, no data).
#[derive(Clone, Default)]
pub struct Snapshot {
    /// One lane per layer.
    pub lanes: Vec<Lane>,
}

impl Snapshot {
    /// `layers` empty lanes.
    pub fn empty(layers: usize) -> Self {
        Self {
            lanes: vec![Lane::default(); layers],
        }
    }

    /// Complete tokens: the shortest layer.
    pub fn len(&self) -> usize {
        self.lanes.iter().map(|l| l.len).min().unwrap_or(0)
    }

    /// Whether no token is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first `n` tokens of every layer.
    pub fn truncated(&self, n: usize) -> Snapshot {
        let mut s = self.clone();
        for l in &mut s.lanes {
            l.truncate(n);
        }
        s
    }
}

struct Seq {
    data: Snapshot,
    kind: Kind,
    /// Prefix-tree node this sequence was forked from (pinned until release).
    pin: Option<usize>,
}

/// The cache.
pub struct Store {
    config: Config,
    geometry: RwLock<Option<Arc<Geometry>>>,
    seqs: Mutex<HashMap<SeqId, Arc<Mutex<Seq>>>>,
    next: AtomicU64,
    radix: Mutex<Radix>,
    checkpoints: Mutex<BTreeMap<String, Snapshot>>,
    counters: Arc<Counters>,
    disk: Option<Disk>,
    /// Prefixes not written because they did not fit in the disk budget.
    not_written: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Store {
    /// A cache with `config`; `disk` is the disk tier (if `config.dir` is set).
    pub fn new(config: Config, disk: Option<Disk>) -> Self {
        Self {
            config,
            geometry: RwLock::new(None),
            seqs: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
            radix: Mutex::new(Radix::new()),
            checkpoints: Mutex::new(BTreeMap::new()),
            counters: Arc::new(Counters::default()),
            disk,
            not_written: AtomicU64::new(0),
        }
    }

    /// Declares the layout (once; the same layout again is accepted) and where pages' memory
    /// comes from.
    pub fn configure(&self, mut layout: KvLayout, alloc: Alloc) -> u_sdk::Result<()> {
        if self.config.kv_dtype == KvDtype::Int8 {
            layout.dtype = DType::I8;
        }
        let mut g = self.geometry.write().unwrap_or_else(|p| p.into_inner());
        match &*g {
            Some(old) if old.layout == layout => Ok(()),
            Some(old) => Err(UError::invalid(format!(
                "cache-kv is already configured with {:?}; cannot switch to {:?}",
                old.layout, layout
            ))),
            None => {
                let geometry = Arc::new(Geometry::new(layout, alloc)?);
                *g = Some(geometry.clone());
                drop(g);
                self.load_segments(&geometry);
                Ok(())
            }
        }
    }

    /// The disk tier, if the prefix tree persists.
    fn prefix_disk(&self) -> Option<&Disk> {
        self.disk.as_ref().filter(|_| self.config.persist_prefixes)
    }

    /// Rebuilds the prefix tree from the directory's segment files (see the module
    /// documentation); refused or orphaned files are logged and skipped.
    fn load_segments(&self, g: &Geometry) {
        let Some(d) = self.prefix_disk() else { return };
        let stems = match d.stems(FileKind::Prefix) {
            Ok(s) => s,
            Err(e) => {
                d.warn(&format!(
                    "cache-kv: prefix tree not restored, cannot list the directory: {}",
                    e.message
                ));
                return;
            }
        };
        let mut segments = Vec::with_capacity(stems.len());
        for stem in stems {
            match d.map(&stem, FileKind::Prefix, g, &self.counters) {
                Ok(m) => segments.push((stem, m)),
                Err(e) => d.warn(&format!("cache-kv: skipping {}", e.message)),
            }
        }
        // A segment's earlier pages mostly come from segments written before it, whose start is
        // lower; one whose segment comes later in this order (possible once segments were
        // deleted and nodes took over a child's pages) is tried again after the others.
        segments.sort_by_key(|(_, m)| (m.start, m.tokens));
        let mut r = lock(&self.radix);
        loop {
            let before = segments.len();
            let mut left = Vec::new();
            for (stem, m) in segments {
                let path = m.token_path();
                let keep = m.first_page * PAGE_TOKENS;
                let (base, parent) = match r.disk_cover(&path[..keep]) {
                    (n, Some(s), parent) if n == keep && keep > 0 => (s, parent),
                    _ if keep == 0 => (Snapshot::empty(g.layers()), None),
                    (n, ..) => {
                        left.push((stem, m, n));
                        continue;
                    }
                };
                let seg = r.register(&stem, m.bytes, parent);
                r.insert(&path, &m.onto(&base), Some(seg));
            }
            if left.is_empty() || left.len() == before {
                for (stem, m, n) in left {
                    d.warn(&format!(
                        "cache-kv: skipping {}: its first {} tokens are on no other prefix \
                         segment (found {n})",
                        d.path(&stem, FileKind::Prefix),
                        m.first_page * PAGE_TOKENS
                    ));
                }
                break;
            }
            segments = left.into_iter().map(|(stem, m, _)| (stem, m)).collect();
        }
        // A budget lowered since the files were written applies now.
        if let Some(max) = self.config.disk_budget() {
            r.make_room(max, 0, &mut |stem| Self::remove_segment(d, stem));
        }
    }

    /// Deletes segment file `stem` for the disk budget; false (logged) if it could not.
    fn remove_segment(d: &Disk, stem: &str) -> bool {
        match d.remove_file(stem, FileKind::Prefix) {
            Ok(_) => true,
            Err(e) => {
                d.warn(&format!(
                    "cache-kv: cannot delete prefix segment {} for the disk budget, kept: {}",
                    d.path(stem, FileKind::Prefix),
                    e.message
                ));
                false
            }
        }
    }

    /// The layout, or an error if [`Store::configure`] was not called.
    pub fn geometry(&self) -> u_sdk::Result<Arc<Geometry>> {
        self.geometry
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| UError::invalid("cache-kv: configure() must be called first"))
    }

    fn seq(&self, id: SeqId) -> u_sdk::Result<Arc<Mutex<Seq>>> {
        lock(&self.seqs)
            .get(&id)
            .cloned()
            .ok_or_else(|| UError::not_found(format!("cache-kv: no sequence {id}")))
    }

    fn insert_seq(&self, data: Snapshot, kind: Kind, pin: Option<usize>) -> SeqId {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let seq = Seq { data, kind, pin };
        lock(&self.seqs).insert(id, Arc::new(Mutex::new(seq)));
        id
    }

    /// A copy of `id`'s page references.
    pub(crate) fn snapshot(&self, id: SeqId) -> u_sdk::Result<Snapshot> {
        Ok(lock(&*self.seq(id)?).data.clone())
    }

    /// A new empty sequence.
    pub fn create(&self) -> u_sdk::Result<SeqId> {
        let g = self.geometry()?;
        Ok(self.insert_seq(Snapshot::empty(g.layers()), g.kind, None))
    }

    /// A new sequence sharing every page of `id`.
    pub fn fork(&self, id: SeqId) -> u_sdk::Result<SeqId> {
        let (data, kind) = {
            let s = self.seq(id)?;
            let s = lock(&s);
            (s.data.clone(), s.kind)
        };
        Ok(self.insert_seq(data, kind, None))
    }

    /// Drops a sequence (and its prefix-tree pin).
    pub fn release(&self, id: SeqId) -> u_sdk::Result<()> {
        let s = lock(&self.seqs)
            .remove(&id)
            .ok_or_else(|| UError::not_found(format!("cache-kv: no sequence {id}")))?;
        let pin = lock(&s).pin.take();
        drop(s);
        if let Some(node) = pin {
            lock(&self.radix).unpin(node);
        }
        self.enforce_budget();
        Ok(())
    }

    /// Complete tokens of `id` (the shortest layer).
    pub fn len(&self, id: SeqId) -> u_sdk::Result<u64> {
        Ok(lock(&*self.seq(id)?).data.len() as u64)
    }

    /// Drops tokens past `n` in every layer.
    pub fn truncate(&self, id: SeqId, n: u64) -> u_sdk::Result<()> {
        let s = self.seq(id)?;
        let mut s = lock(&s);
        for l in &mut s.data.lanes {
            l.truncate(n as usize);
        }
        Ok(())
    }

    /// Sets the kind of the pages `id` starts from now on.
    pub fn set_dtype(&self, id: SeqId, dtype: DType) -> u_sdk::Result<()> {
        let kind = kind_of(dtype)?;
        lock(&*self.seq(id)?).kind = kind;
        Ok(())
    }

    /// Appends `layer`'s keys and values (tokens × kv_heads × head_dim each).
    pub fn append(&self, id: SeqId, layer: u32, keys: &[f32], values: &[f32]) -> u_sdk::Result<()> {
        let g = self.geometry()?;
        let row = g.shape.row;
        if layer as usize >= g.layers() {
            return Err(UError::invalid(format!(
                "cache-kv: layer {layer} out of range (model has {} layers)",
                g.layers()
            )));
        }
        if keys.len() != values.len() || !keys.len().is_multiple_of(row) {
            return Err(UError::invalid(format!(
                "cache-kv: append of {} keys and {} values is not a whole number of tokens of \
                 kv_heads × head_dim = {row}",
                keys.len(),
                values.len()
            )));
        }
        {
            let s = self.seq(id)?;
            let mut s = lock(&s);
            let kind = s.kind;
            s.data.lanes[layer as usize].append(keys, values, kind, &g, &self.counters)?;
        }
        self.enforce_budget();
        Ok(())
    }

    /// `layer`'s pages of `id` with the number of tokens of each.
    pub(crate) fn pages(&self, id: SeqId, layer: u32) -> u_sdk::Result<Vec<(Arc<Page>, usize)>> {
        let s = self.seq(id)?;
        let s = lock(&s);
        let lane = s
            .data
            .lanes
            .get(layer as usize)
            .ok_or_else(|| UError::invalid(format!("cache-kv: layer {layer} out of range")))?;
        Ok(lane.views().map(|(p, n)| (p.clone(), n)).collect())
    }

    /// Records that `id` holds the KV of `tokens`.
    pub fn insert_prefix(&self, tokens: &[u32], id: SeqId) -> u_sdk::Result<()> {
        let snap = self.snapshot(id)?;
        if snap.len() < tokens.len() {
            return Err(UError::invalid(format!(
                "cache-kv: sequence {id} holds {} tokens, fewer than the {} of the prefix",
                snap.len(),
                tokens.len()
            )));
        }
        if tokens.is_empty() {
            return Ok(());
        }
        match self.prefix_disk() {
            Some(d) => self.insert_on_disk(d, tokens, &snap)?,
            None => lock(&self.radix).insert(tokens, &snap, None),
        }
        self.enforce_budget();
        Ok(())
    }

    /// Writes the part of `tokens` not yet on disk as a segment (within the disk budget) and
    /// puts its mapped pages in the tree; heap pages (`snap`'s) where it is not written.
    fn insert_on_disk(&self, d: &Disk, tokens: &[u32], snap: &Snapshot) -> u_sdk::Result<()> {
        let g = self.geometry()?;
        let stem = disk::segment_stem(&g, tokens);
        let (covered, base, reserved) = {
            let mut r = lock(&self.radix);
            let Base::Partial {
                covered,
                snap: base,
                parent,
            } = r.segment_base(tokens, &stem)
            else {
                // All on disk already: nothing to write (this touches the path).
                r.insert(tokens, snap, None);
                return Ok(());
            };
            // Only a segment that keeps earlier pages builds on another.
            let parent = parent.filter(|_| covered >= PAGE_TOKENS);
            let need = Disk::segment_len(tokens, covered, &g, snap);
            let budget = self.config.disk_budget();
            let mut remove = |stem: &str| Self::remove_segment(d, stem);
            match r.reserve(&stem, need, parent, budget, &mut remove) {
                Some(res) => (covered, base, res),
                None => {
                    r.insert(tokens, snap, None);
                    drop(r);
                    if self.not_written.fetch_add(1, Ordering::Relaxed) == 0 {
                        d.warn(&format!(
                            "cache-kv: prefix of {} tokens kept in memory only: its segment of \
                             {need} bytes does not fit in the disk budget of {} bytes beside \
                             the segments in use (logged once; see not_written)",
                            tokens.len(),
                            budget.unwrap_or(u64::MAX)
                        ));
                    }
                    return Ok(());
                }
            }
        };
        // Written and mapped (which checks the whole file) outside the lock; the reservation
        // keeps the stem and its parent from being deleted meanwhile.
        let written = d
            .write_segment(tokens, covered, &g, snap)
            .map(|(stem, bytes)| (bytes, d.map(&stem, FileKind::Prefix, &g, &self.counters)));
        let mut r = lock(&self.radix);
        let failed = match written {
            Ok((bytes, Ok(m))) => {
                let seg = r.commit(reserved, bytes);
                let base = base.unwrap_or_else(|| Snapshot::empty(g.layers()));
                r.insert(tokens, &m.onto(&base), Some(seg));
                return Ok(());
            }
            Ok((bytes, Err(e))) => {
                // The file stays counted (and deletable); the tree keeps heap pages.
                r.commit(reserved, bytes);
                e
            }
            Err(e) => {
                r.abandon(reserved);
                e
            }
        };
        r.insert(tokens, snap, None);
        drop(r);
        d.warn(&format!(
            "cache-kv: prefix of {} tokens kept in memory only: {}",
            tokens.len(),
            failed.message
        ));
        Ok(())
    }

    /// A new sequence holding the deepest cached prefix of `tokens`, and its length.
    pub fn lookup_prefix(&self, tokens: &[u32]) -> u_sdk::Result<(SeqId, u64)> {
        let g = self.geometry()?;
        let found = lock(&self.radix).lookup(tokens);
        Ok(match found {
            Some((node, matched, snap)) => {
                (self.insert_seq(snap, g.kind, Some(node)), matched as u64)
            }
            None => (
                self.insert_seq(Snapshot::empty(g.layers()), g.kind, None),
                0,
            ),
        })
    }

    /// Evicts prefix-tree entries while the bytes held exceed the budget.
    pub fn enforce_budget(&self) {
        let Some(max) = self.config.max_bytes else {
            return;
        };
        if self.counters.bytes.load(Ordering::Relaxed) <= max {
            return;
        }
        let mut r = lock(&self.radix);
        while self.counters.bytes.load(Ordering::Relaxed) > max && r.evict_one(true) {}
    }

    /// Evicts every unpinned prefix-tree leaf, repeatedly, those on disk too (for tests and
    /// shutdown; their files stay, and stay counted in the disk budget).
    pub fn evict_all(&self) {
        let mut r = lock(&self.radix);
        while r.evict_one(false) {}
    }

    /// Drops every prefix-tree entry no sequence pins ([`u_sdk::KvCache::flush_prefixes`]);
    /// returns how many went. Their segment files stay on disk (and counted), as evicted ones
    /// do.
    pub fn flush_prefixes(&self) -> u64 {
        let mut r = lock(&self.radix);
        let before = r.node_count();
        while r.evict_one(false) {}
        before.saturating_sub(r.node_count()) as u64
    }

    /// Bytes of live pages mapped from disk files (not counted in [`KvStats::bytes`]).
    pub fn mapped_bytes(&self) -> u64 {
        self.counters.mapped_bytes.load(Ordering::Relaxed)
    }

    /// The prefix tree's disk tier: segment files, their bytes, the budget, deletions.
    pub fn segment_stats(&self) -> SegmentStats {
        let r = lock(&self.radix);
        SegmentStats {
            segments: r.segment_count() as u64,
            bytes: r.disk_bytes(),
            budget: self.prefix_disk().and_then(|_| self.config.disk_budget()),
            deleted: r.deleted,
            not_written: self.not_written.load(Ordering::Relaxed),
        }
    }

    /// Counters.
    pub fn stats(&self) -> KvStats {
        let names = self.checkpoints().unwrap_or_default();
        let (prefix_nodes, evictions) = {
            let r = lock(&self.radix);
            (r.node_count() as u64, r.evictions)
        };
        let sequences = lock(&self.seqs).len() as u64;
        KvStats {
            page_tokens: PAGE_TOKENS as u32,
            bytes: self.counters.bytes.load(Ordering::Relaxed),
            pages: self.counters.pages.load(Ordering::Relaxed),
            sequences,
            prefix_nodes,
            checkpoints: names.len() as u64,
            evictions,
            capacity_bytes: self.config.max_bytes.unwrap_or(0),
        }
    }

    /// Number of edges on the prefix tree's path for `tokens`.
    pub fn prefix_edges(&self, tokens: &[u32]) -> usize {
        lock(&self.radix).path_edges(tokens)
    }

    /// Saves `id` as checkpoint `name` (in memory, and on disk when a directory is configured).
    pub fn save_checkpoint(&self, name: &str, id: SeqId) -> u_sdk::Result<()> {
        disk::check_name(name)?;
        let snap = self.snapshot(id)?;
        {
            let c = lock(&self.checkpoints);
            if !c.contains_key(name) && c.len() >= self.config.max_checkpoints {
                return Err(UError::new(
                    ErrorKind::ResourceExhausted,
                    format!(
                        "cache-kv: {} checkpoints already (max_checkpoints); delete one first",
                        c.len()
                    ),
                ));
            }
        }
        if let Some(d) = &self.disk {
            d.write(name, &*self.geometry()?, &snap)?;
        }
        lock(&self.checkpoints).insert(name.to_string(), snap);
        Ok(())
    }

    /// A new sequence forked from checkpoint `name` (read from disk if not in memory).
    pub fn load_checkpoint(&self, name: &str) -> u_sdk::Result<SeqId> {
        disk::check_name(name)?;
        let g = self.geometry()?;
        let cached = lock(&self.checkpoints).get(name).cloned();
        let snap = match (cached, &self.disk) {
            (Some(s), _) => s,
            (None, Some(d)) => {
                let s = d.read(name, &g, &self.counters)?;
                lock(&self.checkpoints).insert(name.to_string(), s.clone());
                s
            }
            (None, None) => {
                return Err(UError::not_found(format!(
                    "cache-kv: no checkpoint named {name:?}"
                )));
            }
        };
        Ok(self.insert_seq(snap, g.kind, None))
    }

    /// Drops checkpoint `name` from memory (only), so the next load reads the disk tier.
    pub fn forget_checkpoint(&self, name: &str) {
        lock(&self.checkpoints).remove(name);
    }

    /// All checkpoints, in memory or on disk, sorted by name, with the tokens each holds.
    pub fn checkpoints(&self) -> u_sdk::Result<Vec<(String, u64)>> {
        let mut all: BTreeMap<String, u64> = lock(&self.checkpoints)
            .iter()
            .map(|(name, snap)| (name.clone(), snap.len() as u64))
            .collect();
        if let Some(d) = &self.disk {
            for (name, tokens) in d.list()? {
                all.entry(name).or_insert(tokens);
            }
        }
        Ok(all.into_iter().collect())
    }

    /// Deletes checkpoint `name` from memory and disk.
    pub fn delete_checkpoint(&self, name: &str) -> u_sdk::Result<()> {
        disk::check_name(name)?;
        let in_memory = lock(&self.checkpoints).remove(name).is_some();
        let on_disk = match &self.disk {
            Some(d) => d.remove(name)?,
            None => false,
        };
        if in_memory || on_disk {
            Ok(())
        } else {
            Err(UError::not_found(format!(
                "cache-kv: no checkpoint named {name:?}"
            )))
        }
    }
}
