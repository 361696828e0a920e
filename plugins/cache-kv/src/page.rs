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
use memmap2::Mmap;
use std::{
    cell::UnsafeCell,
    sync::{
        Arc,
        atomic::{AtomicU32, AtomicU64, Ordering},
    },
};

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

type Cells<T> = Box<[UnsafeCell<T>]>;

fn cells<T: Default>(n: usize) -> Cells<T> {
    (0..n).map(|_| UnsafeCell::new(T::default())).collect()
}

enum Storage {
    F32 {
        keys: Cells<f32>,
        values: Cells<f32>,
    },
    I8 {
        keys: Cells<i8>,
        values: Cells<i8>,
        key_scales: Cells<f32>,
        value_scales: Cells<f32>,
    },
    /// Read-only page inside a memory-mapped checkpoint file (offsets in bytes).
    Mapped {
        map: Arc<Mmap>,
        kind: Kind,
        keys: usize,
        values: usize,
        key_scales: usize,
        value_scales: usize,
    },
}

/// One page. See the module documentation for the append-only protocol.
pub struct Page {
    claimed: AtomicU32,
    shape: Shape,
    storage: Storage,
    bytes: u64,
    counters: Arc<Counters>,
}

// SAFETY: the cells are written only in slots claimed exclusively by one writer (CAS on
// `claimed`, or `&mut Page`) and never read before the writer publishes them through a lock;
// published slots are never written again while shared.
unsafe impl Sync for Page {}
// SAFETY: as above; the page owns its buffers (or an `Arc<Mmap>`).
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
    /// A new empty page.
    pub fn new(kind: Kind, shape: Shape, counters: &Arc<Counters>) -> Self {
        let n = PAGE_TOKENS * shape.row;
        let g = PAGE_TOKENS * shape.groups;
        let storage = match kind {
            Kind::F32 => Storage::F32 {
                keys: cells(n),
                values: cells(n),
            },
            Kind::I8 => Storage::I8 {
                keys: cells(n),
                values: cells(n),
                key_scales: cells(g),
                value_scales: cells(g),
            },
        };
        Self::with(storage, 0, shape, shape.page_bytes(kind) as u64, counters)
    }

    /// A read-only page of `tokens` slots inside `map`, at the given byte offsets (checked by
    /// the caller to be in bounds and aligned).
    pub fn mapped(
        map: Arc<Mmap>,
        kind: Kind,
        tokens: usize,
        offsets: [usize; 4],
        shape: Shape,
        counters: &Arc<Counters>,
    ) -> Self {
        let [keys, values, key_scales, value_scales] = offsets;
        let bytes = match kind {
            Kind::F32 => 2 * tokens * shape.row * 4,
            Kind::I8 => 2 * tokens * (shape.row + 4 * shape.groups),
        } as u64;
        let storage = Storage::Mapped {
            map,
            kind,
            keys,
            values,
            key_scales,
            value_scales,
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
        counters.count(matches!(storage, Storage::Mapped { .. }), bytes, true);
        Self {
            claimed: AtomicU32::new(claimed),
            shape,
            storage,
            bytes,
            counters: counters.clone(),
        }
    }

    /// The storage type.
    pub fn kind(&self) -> Kind {
        match &self.storage {
            Storage::F32 { .. } => Kind::F32,
            Storage::I8 { .. } => Kind::I8,
            Storage::Mapped { kind, .. } => *kind,
        }
    }

    /// Whether this page lives in a read-only file map.
    pub fn is_mapped(&self) -> bool {
        matches!(self.storage, Storage::Mapped { .. })
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
        match &self.storage {
            Storage::F32 { keys: k, values: v } => {
                // SAFETY: claimed slots, exclusive to this writer (see the function contract).
                unsafe {
                    write_cells(k, at * row, keys);
                    write_cells(v, at * row, values);
                }
            }
            Storage::I8 {
                keys: k,
                values: v,
                key_scales: ks,
                value_scales: vs,
            } => {
                let g = self.shape.groups;
                let mut q = vec![0i8; row];
                let mut s = vec![0f32; g];
                for t in 0..n {
                    for (src, dst, scales) in [(keys, k, ks), (values, v, vs)] {
                        quant::quantize_row(&src[t * row..(t + 1) * row], &mut q, &mut s);
                        // SAFETY: as above.
                        unsafe {
                            write_cells(dst, (at + t) * row, &q);
                            write_cells(scales, (at + t) * g, &s);
                        }
                    }
                }
            }
            Storage::Mapped { .. } => unreachable!("mapped pages are never claimed"),
        }
    }

    /// Copies raw slots `0..n` of `src` (same kind and shape) into slots `0..n` of this page,
    /// bit for bit, and claims them.
    pub fn copy_prefix_from(&mut self, src: &Page, n: usize) {
        *self.claimed.get_mut() = n as u32;
        match (&mut self.storage, src.view(n)) {
            (Storage::F32 { keys, values }, View::F32 { keys: k, values: v }) => {
                copy_into(keys, k);
                copy_into(values, v);
            }
            (
                Storage::I8 {
                    keys,
                    values,
                    key_scales,
                    value_scales,
                },
                View::I8 {
                    keys: k,
                    values: v,
                    key_scales: ks,
                    value_scales: vs,
                },
            ) => {
                copy_into(keys, k);
                copy_into(values, v);
                copy_into(key_scales, ks);
                copy_into(value_scales, vs);
            }
            _ => unreachable!("copy between pages of different kinds"),
        }
    }

    /// Slots `0..n`, which must have been written and published.
    pub fn view(&self, n: usize) -> View<'_> {
        let (row, g) = (self.shape.row, self.shape.groups);
        match &self.storage {
            Storage::F32 { keys, values } => View::F32 {
                keys: read_cells(keys, n * row),
                values: read_cells(values, n * row),
            },
            Storage::I8 {
                keys,
                values,
                key_scales,
                value_scales,
            } => View::I8 {
                keys: read_cells(keys, n * row),
                values: read_cells(values, n * row),
                key_scales: read_cells(key_scales, n * g),
                value_scales: read_cells(value_scales, n * g),
            },
            Storage::Mapped {
                map,
                kind,
                keys,
                values,
                key_scales,
                value_scales,
            } => match kind {
                Kind::F32 => View::F32 {
                    keys: map_slice(map, *keys, n * row),
                    values: map_slice(map, *values, n * row),
                },
                Kind::I8 => View::I8 {
                    keys: map_slice(map, *keys, n * row),
                    values: map_slice(map, *values, n * row),
                    key_scales: map_slice(map, *key_scales, n * g),
                    value_scales: map_slice(map, *value_scales, n * g),
                },
            },
        }
    }

    /// Slots `0..n` as f32 rows (dequantized for an int8 page).
    pub fn read_f32(&self, n: usize, keys: &mut Vec<f32>, values: &mut Vec<f32>) {
        match self.view(n) {
            View::F32 { keys: k, values: v } => {
                keys.extend_from_slice(k);
                values.extend_from_slice(v);
            }
            View::I8 {
                keys: k,
                values: v,
                key_scales: ks,
                value_scales: vs,
            } => {
                keys.extend(u_sdk::dequantize_i8(k, ks, n as u32));
                values.extend(u_sdk::dequantize_i8(v, vs, n as u32));
            }
        }
    }
}

impl Drop for Page {
    fn drop(&mut self) {
        self.counters.count(self.is_mapped(), self.bytes, false);
    }
}

/// # Safety
/// `at..at + src.len()` is in bounds and exclusively owned by the caller.
unsafe fn write_cells<T: Copy>(cells: &[UnsafeCell<T>], at: usize, src: &[T]) {
    assert!(at + src.len() <= cells.len(), "page write out of bounds");
    // SAFETY: in bounds (asserted); `UnsafeCell<T>` has `T`'s layout and permits writes through
    // a shared reference; the slots are exclusively the caller's.
    unsafe {
        let dst = UnsafeCell::raw_get(cells.as_ptr().add(at));
        std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len());
    }
}

fn read_cells<T>(cells: &[UnsafeCell<T>], n: usize) -> &[T] {
    assert!(n <= cells.len(), "page read out of bounds");
    // SAFETY: `UnsafeCell<T>` has `T`'s layout; slots `0..n` are published and no longer
    // written while this page can be reached by anyone else (module protocol).
    unsafe { std::slice::from_raw_parts(UnsafeCell::raw_get(cells.as_ptr()), n) }
}

fn copy_into<T: Copy>(cells: &mut [UnsafeCell<T>], src: &[T]) {
    for (c, &v) in cells.iter_mut().zip(src) {
        *c.get_mut() = v;
    }
}

fn map_slice<T: Copy>(map: &Mmap, offset: usize, n: usize) -> &[T] {
    let size = std::mem::size_of::<T>();
    assert!(
        offset + n * size <= map.len() && offset.is_multiple_of(std::mem::align_of::<T>()),
        "mapped page slice out of bounds or misaligned"
    );
    // SAFETY: in bounds and aligned (asserted; the map base is page-aligned); `T` is a plain
    // number type valid for any bit pattern; the map is read-only and private.
    unsafe { std::slice::from_raw_parts(map.as_ptr().add(offset) as *const T, n) }
}
