//! Pages: fixed blocks of [`PAGE_TOKENS`] tokens of one layer's keys and values.
//!
//! A page is shared through an `Arc` (its atomic strong count is the page's refcount) and is
//! **append-only**: slots are claimed with a compare-and-swap on [`Page::claimed`] by exactly one
//! writer and never written again while anyone else can see the page. A sequence whose view of a
//! page ends at the page's frontier appends in place; any other writer (a fork whose sibling
//! already claimed the next slot, or a sequence that truncated into the page) copies the page
//! first. So slices handed out for slots `0..n` stay valid and unchanged as long as the page
//! lives. Only a page nobody else references (`Arc::get_mut`) may be rewound and overwritten.

use crate::quant;
use abi_stable::std_types::{RResult, RSlice, RSliceMut};
use memmap2::Mmap;
use std::{
    cell::UnsafeCell,
    sync::{
        Arc,
        atomic::{AtomicU32, AtomicU64, Ordering},
    },
};
use u_sdk::{BackendBox, BufferBox, UError};

/// Tokens per page.
pub const PAGE_TOKENS: usize = 64;

/// Storage type of a page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `f32` keys and values.
    F32,
    /// `i8` keys and values with one `f32` scale per group of [`quant::GROUP`] values.
    I8,
}

/// Per-token shape: `row` values per token, `groups` int8 scale groups per row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// kv_heads × head_dim.
    pub row: usize,
    /// ⌈row / group⌉.
    pub groups: usize,
}

impl Shape {
    /// The shape of rows of `row` values.
    pub fn new(row: usize) -> Self {
        Self {
            row,
            groups: row.div_ceil(quant::GROUP),
        }
    }

    /// Bytes of one page of `kind` (keys and values, scales included).
    pub fn page_bytes(&self, kind: Kind) -> usize {
        match kind {
            Kind::F32 => 2 * PAGE_TOKENS * self.row * 4,
            Kind::I8 => 2 * PAGE_TOKENS * (self.row + 4 * self.groups),
        }
    }
}

/// Live pages and their bytes, shared by every page of one cache. Heap pages and pages mapped
/// from disk files are counted apart: only heap pages are memory this cache holds (and what the
/// budget limits); mapped pages live in the kernel's page cache, which reads them on demand and
/// drops them under memory pressure.
#[derive(Default, Debug)]
pub struct Counters {
    /// Bytes of live heap pages.
    pub bytes: AtomicU64,
    /// Live heap pages.
    pub pages: AtomicU64,
    /// Bytes of live pages mapped from files.
    pub mapped_bytes: AtomicU64,
}

impl Counters {
    /// Counts a page of `bytes` in (`live`) or out.
    fn count(&self, mapped: bool, bytes: u64, live: bool) {
        let change = |c: &AtomicU64, n: u64| match live {
            true => c.fetch_add(n, Ordering::Relaxed),
            false => c.fetch_sub(n, Ordering::Relaxed),
        };
        if mapped {
            change(&self.mapped_bytes, bytes);
        } else {
            change(&self.bytes, bytes);
            change(&self.pages, 1);
        }
    }
}

/// Where page memory comes from: a host backend's buffers (the model's, so attention reads them
/// in place), or, for a cache used on its own or beside a device backend, the cache's own heap
/// buffers.
#[derive(Clone)]
pub enum Alloc {
    /// [`u_sdk::Backend::alloc`] of this (host-memory) backend.
    Backend(BackendBox),
    /// Plain heap memory of this plugin.
    Heap,
}

impl Alloc {
    /// A writable host buffer of `bytes` bytes.
    pub fn buffer(&self, bytes: usize) -> u_sdk::Result<BufferBox> {
        match self {
            Alloc::Backend(b) => b.alloc(bytes as u64).into_result(),
            Alloc::Heap => Ok(BufferBox::new(HostBytes::heap(bytes))),
        }
    }
}

/// Host memory as a [`u_sdk::Buffer`]: the cache's own heap pages, or a mapped file.
#[derive(Clone)]
pub struct HostBytes(Arc<Bytes>);

enum Bytes {
    Heap(Box<[UnsafeCell<u64>]>),
    Map(Arc<Mmap>),
}

// SAFETY: heap cells are written only under the page protocol (claimed slots); maps are
// read-only.
unsafe impl Sync for Bytes {}
// SAFETY: as above; the memory is owned.
unsafe impl Send for Bytes {}

impl HostBytes {
    /// `bytes` zeroed heap bytes (8-byte aligned).
    pub fn heap(bytes: usize) -> HostBytes {
        let words = (0..bytes.div_ceil(8)).map(|_| UnsafeCell::new(0)).collect();
        HostBytes(Arc::new(Bytes::Heap(words)))
    }

    /// A read-only file map.
    pub fn map(map: Arc<Mmap>) -> HostBytes {
        HostBytes(Arc::new(Bytes::Map(map)))
    }

    fn ptr_len(&self) -> (*mut u8, usize) {
        match &*self.0 {
            Bytes::Heap(w) => (UnsafeCell::raw_get(w.as_ptr()) as *mut u8, w.len() * 8),
            Bytes::Map(m) => (m.as_ptr() as *mut u8, m.len()),
        }
    }
}

impl u_sdk::Buffer for HostBytes {
    fn byte_len(&self) -> u64 {
        self.ptr_len().1 as u64
    }

    fn host_address(&self) -> usize {
        self.ptr_len().0 as usize
    }

    fn read_only(&self) -> bool {
        matches!(&*self.0, Bytes::Map(_))
    }

    fn write(&self, offset: u64, bytes: RSlice<'_, u8>) -> RResult<(), UError> {
        let (ptr, len) = self.ptr_len();
        if self.read_only() || offset as usize + bytes.len() > len {
            return RResult::RErr(UError::invalid("cache-kv: write outside a writable page"));
        }
        // SAFETY: in bounds (checked), heap memory; the caller owns the slots it writes.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr.add(offset as usize), bytes.len())
        };
        RResult::ROk(())
    }

    fn read(&self, offset: u64, mut out: RSliceMut<'_, u8>) -> RResult<(), UError> {
        let (ptr, len) = self.ptr_len();
        if offset as usize + out.len() > len {
            return RResult::RErr(UError::invalid("cache-kv: read past a page"));
        }
        // SAFETY: in bounds (checked); `out` is exclusively borrowed.
        unsafe {
            std::ptr::copy_nonoverlapping(ptr.add(offset as usize), out.as_mut_ptr(), out.len())
        };
        RResult::ROk(())
    }
}

/// A page's memory: a host buffer and where its keys, values and (int8) scales start in it.
struct Storage {
    buffer: BufferBox,
    base: *mut u8,
    kind: Kind,
    /// Byte offsets of keys, values, key scales, value scales.
    offsets: [usize; 4],
    /// Read-only: inside a mapped file.
    mapped: bool,
}

impl Storage {
    /// A new writable page of `kind` from `alloc`.
    fn new(kind: Kind, shape: Shape, alloc: &Alloc) -> u_sdk::Result<Storage> {
        let (n, g) = (PAGE_TOKENS * shape.row, PAGE_TOKENS * shape.groups);
        let offsets = match kind {
            Kind::F32 => [0, 4 * n, 8 * n, 8 * n],
            Kind::I8 => {
                let scales = (2 * n).next_multiple_of(4);
                [0, n, scales, scales + 4 * g]
            }
        };
        let bytes = match kind {
            Kind::F32 => 8 * n,
            Kind::I8 => offsets[3] + 4 * g,
        };
        let buffer = alloc.buffer(bytes)?;
        let base = buffer.host_address() as *mut u8;
        if base.is_null() || buffer.read_only() || (buffer.byte_len() as usize) < bytes {
            return Err(UError::unsupported(
                "cache-kv keeps pages in writable host memory; this backend's buffers are not",
            ));
        }
        Ok(Storage {
            buffer,
            base,
            kind,
            offsets,
            mapped: false,
        })
    }

    /// Element `at` of region `r` (0 keys, 1 values, 2 key scales, 3 value scales).
    fn slice<T>(&self, r: usize, at: usize) -> *mut T {
        // SAFETY: offsets and slot counts stay inside the page's buffer (computed in `new`, or
        // checked by the file parser for mapped pages).
        unsafe { (self.base.add(self.offsets[r]) as *mut T).add(at) }
    }
}

/// One page. See the module documentation for the append-only protocol.
pub struct Page {
    claimed: AtomicU32,
    shape: Shape,
    storage: Storage,
    bytes: u64,
    counters: Arc<Counters>,
}

// SAFETY: the buffer is written only in slots claimed exclusively by one writer (CAS on
// `claimed`, or `&mut Page`) and never read before the writer publishes them through a lock;
// published slots are never written again while shared.
unsafe impl Sync for Page {}
// SAFETY: as above; the page holds its buffer.
unsafe impl Send for Page {}

/// A borrowed view of slots `0..tokens` of a page.
pub enum View<'a> {
    /// f32 keys and values.
    F32 { keys: &'a [f32], values: &'a [f32] },
    /// int8 keys and values with their scales.
    I8 {
        keys: &'a [i8],
        values: &'a [i8],
        key_scales: &'a [f32],
        value_scales: &'a [f32],
    },
}

impl Page {
    /// A new empty page, its memory from `alloc`.
    pub fn new(
        kind: Kind,
        shape: Shape,
        counters: &Arc<Counters>,
        alloc: &Alloc,
    ) -> u_sdk::Result<Self> {
        let storage = Storage::new(kind, shape, alloc)?;
        Ok(Self::with(
            storage,
            0,
            shape,
            shape.page_bytes(kind) as u64,
            counters,
        ))
    }

    /// A read-only page of `tokens` slots inside `map` (shared as `buffer`), at the given byte
    /// offsets (checked by the caller to be in bounds and aligned).
    pub fn mapped(
        buffer: &BufferBox,
        kind: Kind,
        tokens: usize,
        offsets: [usize; 4],
        shape: Shape,
        counters: &Arc<Counters>,
    ) -> Self {
        let bytes = match kind {
            Kind::F32 => 2 * tokens * shape.row * 4,
            Kind::I8 => 2 * tokens * (shape.row + 4 * shape.groups),
        } as u64;
        let storage = Storage {
            buffer: buffer.clone(),
            base: buffer.host_address() as *mut u8,
            kind,
            offsets,
            mapped: true,
        };
        Self::with(storage, tokens as u32, shape, bytes, counters)
    }

    fn with(
        storage: Storage,
        claimed: u32,
        shape: Shape,
        bytes: u64,
        counters: &Arc<Counters>,
    ) -> Self {
        counters.count(storage.mapped, bytes, true);
        Self {
            claimed: AtomicU32::new(claimed),
            shape,
            storage,
            bytes,
            counters: counters.clone(),
        }
    }

    /// The page's buffer and the byte offsets of its keys, values, key and value scales.
    pub fn buffer(&self) -> (&BufferBox, [usize; 4]) {
        (&self.storage.buffer, self.storage.offsets)
    }

    /// The storage type.
    pub fn kind(&self) -> Kind {
        self.storage.kind
    }

    /// Whether this page lives in a read-only file map.
    pub fn is_mapped(&self) -> bool {
        self.storage.mapped
    }

    /// Tries to claim slots `at..at + n` for an in-place append: succeeds only if `at` is the
    /// page's frontier (nobody wrote past it) and the page is writable.
    pub fn claim(&self, at: usize, n: usize) -> bool {
        !self.is_mapped()
            && at + n <= PAGE_TOKENS
            && self
                .claimed
                .compare_exchange(
                    at as u32,
                    (at + n) as u32,
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                )
                .is_ok()
    }

    /// Rewinds the frontier of a page nobody else references, then claims `at..at + n`.
    pub fn rewind_and_claim(&mut self, at: usize, n: usize) -> bool {
        if self.is_mapped() || at + n > PAGE_TOKENS {
            return false;
        }
        *self.claimed.get_mut() = (at + n) as u32;
        true
    }

    /// Writes f32 rows into slots `at..` (quantizing for an int8 page).
    ///
    /// # Safety
    /// The caller claimed these slots ([`Page::claim`] or [`Page::rewind_and_claim`]) and
    /// nobody reads them before the caller publishes them.
    pub unsafe fn write(&self, at: usize, keys: &[f32], values: &[f32]) {
        let row = self.shape.row;
        let n = keys.len() / row;
        debug_assert!(at + n <= self.claimed.load(Ordering::Relaxed) as usize);
        debug_assert!(!self.storage.mapped, "mapped pages are never claimed");
        assert!(at + n <= PAGE_TOKENS, "page write out of bounds");
        let st = &self.storage;
        match st.kind {
            Kind::F32 => {
                // SAFETY: claimed slots in bounds (asserted), exclusive to this writer.
                unsafe {
                    std::ptr::copy_nonoverlapping(keys.as_ptr(), st.slice(0, at * row), n * row);
                    std::ptr::copy_nonoverlapping(values.as_ptr(), st.slice(1, at * row), n * row);
                }
            }
            Kind::I8 => {
                let g = self.shape.groups;
                let mut q = vec![0i8; row];
                let mut sc = vec![0f32; g];
                for t in 0..n {
                    for (src, r) in [(keys, 0), (values, 1)] {
                        quant::quantize_row(&src[t * row..(t + 1) * row], &mut q, &mut sc);
                        // SAFETY: as above.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                q.as_ptr(),
                                st.slice(r, (at + t) * row),
                                row,
                            );
                            std::ptr::copy_nonoverlapping(
                                sc.as_ptr(),
                                st.slice(r + 2, (at + t) * g),
                                g,
                            );
                        }
                    }
                }
            }
        }
    }

    /// Copies raw slots `0..n` of `src` (same kind and shape) into slots `0..n` of this page,
    /// bit for bit, and claims them.
    pub fn copy_prefix_from(&mut self, src: &Page, n: usize) {
        *self.claimed.get_mut() = n as u32;
        debug_assert_eq!(
            self.kind(),
            src.kind(),
            "copy between pages of different kinds"
        );
        let (row, g) = (self.shape.row, self.shape.groups);
        let st = &self.storage;
        let sizes = match st.kind {
            Kind::F32 => [4 * n * row, 4 * n * row, 0, 0],
            Kind::I8 => [n * row, n * row, 4 * n * g, 4 * n * g],
        };
        for (r, size) in sizes.into_iter().enumerate() {
            // SAFETY: `&mut self`: nobody else sees this page; both regions hold these bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    src.storage.slice::<u8>(r, 0),
                    st.slice::<u8>(r, 0),
                    size,
                )
            };
        }
    }

    /// Slots `0..n`, which must have been written and published.
    pub fn view(&self, n: usize) -> View<'_> {
        let (row, g) = (self.shape.row, self.shape.groups);
        assert!(n <= PAGE_TOKENS, "page read out of bounds");
        let st = &self.storage;
        // SAFETY: slots `0..n` are in bounds, published and no longer written while this page
        // can be reached by anyone else (module protocol); plain number types.
        unsafe {
            match st.kind {
                Kind::F32 => View::F32 {
                    keys: std::slice::from_raw_parts(st.slice(0, 0), n * row),
                    values: std::slice::from_raw_parts(st.slice(1, 0), n * row),
                },
                Kind::I8 => View::I8 {
                    keys: std::slice::from_raw_parts(st.slice(0, 0), n * row),
                    values: std::slice::from_raw_parts(st.slice(1, 0), n * row),
                    key_scales: std::slice::from_raw_parts(st.slice(2, 0), n * g),
                    value_scales: std::slice::from_raw_parts(st.slice(3, 0), n * g),
                },
            }
        }
    }
}

impl Drop for Page {
    fn drop(&mut self) {
        self.counters.count(self.is_mapped(), self.bytes, false);
    }
}
