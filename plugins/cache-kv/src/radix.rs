//! The prefix tree: a radix tree over token ids with compressed edges.
//!
//! Each node covers the tokens of its edge and holds a [`Snapshot`] of the KV of the whole
//! prefix up to its end — page references only, so a node shares its pages with its ancestors
//! and with the sequences that were forked from it. A 2,000-token system prompt is one edge.
//! Lookups pin the node they fork from until that sequence is released; eviction removes the
//! least recently used unpinned leaf. Nodes whose pages are mapped from the disk tier name their
//! segment file (`seg`): evicting them frees no heap, so the budget passes them over.
//!
//! # Segment files
//!
//! The tree also keeps the table of the segment files it was built from (see [`crate::store`]),
//! with their sizes, for the disk budget. A segment's pages before its first stored page come
//! from its *parent*: the segment of the deepest node on disk that the new path continued when
//! it was written (and, through the parent's own parent, from shorter segments still). A node's
//! snapshot refers to its segment's file and that segment's ancestors only, so:
//!
//! - a segment is deleted only when no segment has it as parent (leaves of that forest first),
//!   no write in progress builds on it or replaces it, and no node holding its pages is pinned;
//! - then every node naming it is fixed first: a node with children takes over a child's
//!   snapshot (truncated to its depth, so it names that child's segment, or none if the child
//!   holds heap pages), a leaf is removed, deepest first. After that no node claims the file,
//!   and its pages live on only in the sequences that still hold them (a deleted file's map stays
//!   valid).

use crate::store::Snapshot;
use std::collections::HashMap;

struct Node {
    edge: Vec<u32>,
    children: HashMap<u32, usize>,
    parent: usize,
    kv: Option<Snapshot>,
    last_use: u64,
    pins: u32,
    /// The segment file whose pages (with its ancestors') `kv` maps; `None`: heap pages.
    seg: Option<usize>,
}

/// A segment file of the disk tier, as the budget sees it.
struct Seg {
    stem: String,
    /// Length of the file; 0 while its first write is in progress.
    bytes: u64,
    /// The segment this one's earlier pages come from (it must outlive this one).
    parent: Option<usize>,
    /// Segments with this one as parent, counting writes in progress.
    dependents: u32,
    /// Writes of this stem in progress.
    writing: u32,
    last_use: u64,
    /// Its removal failed: kept (and counted), never tried again.
    stuck: bool,
}

/// A segment write allowed by [`Radix::reserve`]: finish it with [`Radix::commit`] or
/// [`Radix::abandon`].
#[must_use]
pub struct Reservation {
    seg: usize,
    need: u64,
    parent: Option<usize>,
}

/// Where a new segment for a path starts: [`Radix::segment_base`].
pub enum Base {
    /// The whole path is on disk already.
    Covered,
    /// Tokens `..covered` are on disk; `snap` holds them (at least), mapped from `parent` and
    /// its ancestors.
    Partial {
        /// Tokens already on disk.
        covered: usize,
        /// Their KV.
        snap: Option<Snapshot>,
        /// The segment providing it.
        parent: Option<usize>,
    },
}

/// The tree (an arena; index 0 is the root, which holds no KV).
pub struct Radix {
    nodes: Vec<Option<Node>>,
    free: Vec<usize>,
    tick: u64,
    /// Nodes evicted so far.
    pub evictions: u64,
    segs: Vec<Option<Seg>>,
    free_segs: Vec<usize>,
    by_stem: HashMap<String, usize>,
    /// Bytes of the segment files in the table, plus writes reserved.
    disk_bytes: u64,
    /// Segment files deleted for the disk budget.
    pub deleted: u64,
}

impl Default for Radix {
    fn default() -> Self {
        Self::new()
    }
}

impl Radix {
    /// An empty tree.
    pub fn new() -> Self {
        let root = Node {
            edge: Vec::new(),
            children: HashMap::new(),
            parent: 0,
            kv: None,
            last_use: 0,
            pins: 0,
            seg: None,
        };
        Self {
            nodes: vec![Some(root)],
            free: Vec::new(),
            tick: 0,
            evictions: 0,
            segs: Vec::new(),
            free_segs: Vec::new(),
            by_stem: HashMap::new(),
            disk_bytes: 0,
            deleted: 0,
        }
    }

    fn node(&self, i: usize) -> &Node {
        self.nodes[i].as_ref().expect("live radix node")
    }

    fn node_mut(&mut self, i: usize) -> &mut Node {
        self.nodes[i].as_mut().expect("live radix node")
    }

    fn seg(&self, i: usize) -> &Seg {
        self.segs[i].as_ref().expect("live segment")
    }

    fn seg_mut(&mut self, i: usize) -> &mut Seg {
        self.segs[i].as_mut().expect("live segment")
    }

    fn alloc(&mut self, n: Node) -> usize {
        match self.free.pop() {
            Some(i) => {
                self.nodes[i] = Some(n);
                i
            }
            None => {
                self.nodes.push(Some(n));
                self.nodes.len() - 1
            }
        }
    }

    fn touch(&mut self, i: usize) {
        self.tick += 1;
        let t = self.tick;
        let n = self.node_mut(i);
        n.last_use = t;
        if let Some(s) = n.seg {
            self.seg_mut(s).last_use = t;
        }
    }

    /// Nodes besides the root.
    pub fn node_count(&self) -> usize {
        self.nodes.iter().filter(|n| n.is_some()).count() - 1
    }

    /// Number of edges on the path of `tokens` (for tests: a long shared prefix is one edge).
    pub fn path_edges(&self, tokens: &[u32]) -> usize {
        let (mut node, mut i, mut edges) = (0, 0, 0);
        while i < tokens.len() {
            match self.node(node).children.get(&tokens[i]) {
                Some(&c) => {
                    edges += 1;
                    i += self.node(c).edge.len();
                    node = c;
                }
                None => break,
            }
        }
        edges
    }

    /// Records that `snap` (at least `tokens.len()` long) holds the KV of `tokens`; `seg` is the
    /// segment file its pages are mapped from (`None`: heap pages). Nodes already on the path
    /// are kept, but a node holding heap pages takes `snap`'s when they are on disk.
    pub fn insert(&mut self, tokens: &[u32], snap: &Snapshot, seg: Option<usize>) {
        let (mut node, mut i) = (0usize, 0usize);
        while i < tokens.len() {
            let Some(&c) = self.node(node).children.get(&tokens[i]) else {
                let child = Node {
                    edge: tokens[i..].to_vec(),
                    children: HashMap::new(),
                    parent: node,
                    kv: Some(snap.truncated(tokens.len())),
                    last_use: 0,
                    pins: 0,
                    seg,
                };
                let idx = self.alloc(child);
                self.node_mut(node).children.insert(tokens[i], idx);
                self.touch(idx);
                return;
            };
            let common = lcp(&self.node(c).edge, &tokens[i..]);
            if common < self.node(c).edge.len() {
                // Split c's edge at `common`: a new middle node takes the shared part.
                let depth = i + common;
                let (head, kv, cseg) = {
                    let cn = self.node(c);
                    let kv = cn.kv.as_ref().map(|s| s.truncated(depth));
                    (cn.edge[..common].to_vec(), kv, cn.seg)
                };
                let mid = self.alloc(Node {
                    edge: head,
                    children: HashMap::new(),
                    parent: node,
                    kv,
                    last_use: self.node(c).last_use,
                    pins: 0,
                    seg: cseg,
                });
                let cn = self.node_mut(c);
                cn.edge.drain(..common);
                cn.parent = mid;
                let first = cn.edge[0];
                self.node_mut(mid).children.insert(first, c);
                self.node_mut(node).children.insert(tokens[i], mid);
                node = mid;
            } else {
                node = c;
            }
            if seg.is_some() && self.node(node).seg.is_none() {
                let n = self.node_mut(node);
                n.kv = Some(snap.truncated(i + common));
                n.seg = seg;
            }
            self.touch(node);
            i += common;
        }
    }

    /// The deepest cached prefix of `tokens`: `(node, matched, snapshot)`, with `node` pinned.
    pub fn lookup(&mut self, tokens: &[u32]) -> Option<(usize, usize, Snapshot)> {
        let (mut node, mut i) = (0usize, 0usize);
        let mut best = None;
        while i < tokens.len() {
            let Some(&c) = self.node(node).children.get(&tokens[i]) else {
                break;
            };
            let common = lcp(&self.node(c).edge, &tokens[i..]);
            self.touch(c);
            best = Some((c, i + common));
            if common < self.node(c).edge.len() {
                break;
            }
            node = c;
            i += common;
        }
        let (n, matched) = best?;
        let snap = self.node(n).kv.as_ref()?.truncated(matched);
        self.node_mut(n).pins += 1;
        Some((n, matched, snap))
    }

    /// The nodes on disk along `tokens`, shallowest first: `(tokens covered, node)`.
    fn disk_path(&self, tokens: &[u32]) -> Vec<(usize, usize)> {
        let (mut node, mut i) = (0usize, 0usize);
        let mut found = Vec::new();
        while i < tokens.len() {
            let Some(&c) = self.node(node).children.get(&tokens[i]) else {
                break;
            };
            let cn = self.node(c);
            let common = lcp(&cn.edge, &tokens[i..]);
            if cn.seg.is_some() {
                found.push((i + common, c));
            }
            if common < cn.edge.len() {
                break;
            }
            node = c;
            i += common;
        }
        found
    }

    /// How deep the nodes on disk cover `tokens`, their snapshot of that prefix (at least that
    /// long) and its segment; nothing is pinned or touched.
    pub fn disk_cover(&self, tokens: &[u32]) -> (usize, Option<Snapshot>, Option<usize>) {
        match self.disk_path(tokens).last() {
            Some(&(n, c)) => (n, self.node(c).kv.clone(), self.node(c).seg),
            None => (0, None, None),
        }
    }

    /// Where the segment `stem` of `tokens` would start: the deepest node on disk along the
    /// path whose segment does not come from `stem` itself (a path rewritten after its nodes
    /// were evicted must not build on its own old file, which the write replaces).
    pub fn segment_base(&self, tokens: &[u32], stem: &str) -> Base {
        let path = self.disk_path(tokens);
        if path.last().is_some_and(|&(n, _)| n == tokens.len()) {
            return Base::Covered;
        }
        let own = self.by_stem.get(stem).copied();
        let from_own = |mut s: Option<usize>| {
            while let Some(i) = s {
                if Some(i) == own {
                    return true;
                }
                s = self.seg(i).parent;
            }
            false
        };
        for &(covered, c) in path.iter().rev() {
            let n = self.node(c);
            if !from_own(n.seg) {
                return Base::Partial {
                    covered,
                    snap: n.kv.clone(),
                    parent: n.seg,
                };
            }
        }
        Base::Partial {
            covered: 0,
            snap: None,
            parent: None,
        }
    }

    /// Releases a pin taken by [`Radix::lookup`].
    pub fn unpin(&mut self, i: usize) {
        if let Some(Some(n)) = self.nodes.get_mut(i) {
            n.pins = n.pins.saturating_sub(1);
        }
    }

    /// Evicts the least recently used unpinned leaf (only among those holding heap pages if
    /// `heap_only`); false if there is none. A segment file stays (and counted) when its nodes
    /// go.
    pub fn evict_one(&mut self, heap_only: bool) -> bool {
        let victim = self
            .nodes
            .iter()
            .enumerate()
            .skip(1)
            .filter_map(|(i, n)| n.as_ref().map(|n| (i, n)))
            .filter(|(_, n)| {
                n.children.is_empty() && n.pins == 0 && !(heap_only && n.seg.is_some())
            })
            .min_by_key(|(_, n)| n.last_use)
            .map(|(i, _)| i);
        let Some(v) = victim else { return false };
        self.remove_leaf(v);
        true
    }

    fn remove_leaf(&mut self, v: usize) {
        let n = self.nodes[v].take().expect("live leaf");
        self.node_mut(n.parent).children.remove(&n.edge[0]);
        self.free.push(v);
        self.evictions += 1;
        self.merge_with_child(n.parent);
    }

    /// Keeps edges compressed: an unpinned inner node left with one child is folded into it
    /// (the child's snapshot already covers the whole prefix).
    fn merge_with_child(&mut self, p: usize) {
        let pn = self.node(p);
        if p == 0 || pn.children.len() != 1 || pn.pins != 0 {
            return;
        }
        let c = *pn.children.values().next().expect("one child");
        let pn = self.nodes[p].take().expect("live parent");
        let cn = self.node_mut(c);
        let mut edge = pn.edge;
        edge.append(&mut cn.edge);
        cn.edge = edge;
        cn.parent = pn.parent;
        cn.last_use = cn.last_use.max(pn.last_use);
        let first = cn.edge[0];
        self.node_mut(pn.parent).children.insert(first, c);
        self.free.push(p);
    }

    // ---- The segment table and the disk budget ----

    /// Bytes of the segment files counted, with the writes reserved.
    pub fn disk_bytes(&self) -> u64 {
        self.disk_bytes
    }

    /// Segment files counted.
    pub fn segment_count(&self) -> usize {
        self.segs.iter().filter(|s| s.is_some()).count()
    }

    /// The table entry of `stem`, created (empty, no file yet) if there is none.
    fn entry(&mut self, stem: &str) -> usize {
        if let Some(&i) = self.by_stem.get(stem) {
            return i;
        }
        let s = Seg {
            stem: stem.to_string(),
            bytes: 0,
            parent: None,
            dependents: 0,
            writing: 0,
            last_use: 0,
            stuck: false,
        };
        let i = match self.free_segs.pop() {
            Some(i) => {
                self.segs[i] = Some(s);
                i
            }
            None => {
                self.segs.push(Some(s));
                self.segs.len() - 1
            }
        };
        self.by_stem.insert(stem.to_string(), i);
        i
    }

    /// Counts a segment file found on disk (`bytes` long, building on `parent`); returns its id
    /// for [`Radix::insert`].
    pub fn register(&mut self, stem: &str, bytes: u64, parent: Option<usize>) -> usize {
        let r = Reservation {
            seg: self.entry(stem),
            need: 0,
            parent,
        };
        self.seg_mut(r.seg).writing += 1;
        if let Some(p) = parent {
            self.seg_mut(p).dependents += 1;
        }
        self.commit(r, bytes)
    }

    /// Allows a write of `need` bytes as segment `stem` on top of `parent`: deletes segments
    /// (least recently used first, as [`Radix`] describes; `remove` deletes a file and says
    /// whether it is gone) until the tier fits in `budget`. `None` if it cannot fit; nothing is
    /// then reserved.
    pub fn reserve(
        &mut self,
        stem: &str,
        need: u64,
        parent: Option<usize>,
        budget: Option<u64>,
        remove: &mut dyn FnMut(&str) -> bool,
    ) -> Option<Reservation> {
        let r = Reservation {
            seg: self.entry(stem),
            need,
            parent,
        };
        // Claimed before making room, so that neither is deleted to make room for this write.
        self.seg_mut(r.seg).writing += 1;
        if let Some(p) = parent {
            self.seg_mut(p).dependents += 1;
        }
        if let Some(max) = budget
            && !self.make_room(max, need, remove)
        {
            self.abandon(r);
            return None;
        }
        self.disk_bytes += need;
        Some(r)
    }

    /// Deletes segments until `need` more bytes fit in `max`; false if they cannot.
    pub fn make_room(&mut self, max: u64, need: u64, remove: &mut dyn FnMut(&str) -> bool) -> bool {
        while self.disk_bytes.saturating_add(need) > max {
            let Some(v) = self.victim() else { return false };
            if remove(&self.seg(v).stem) {
                self.delete(v);
            } else {
                self.seg_mut(v).stuck = true;
            }
        }
        true
    }

    /// A written segment: counts its file, which replaces any earlier file of that stem;
    /// returns its id for [`Radix::insert`].
    pub fn commit(&mut self, r: Reservation, bytes: u64) -> usize {
        self.tick += 1;
        let tick = self.tick;
        let s = self.seg_mut(r.seg);
        s.writing -= 1;
        s.last_use = tick;
        let (old_bytes, old_parent) = (s.bytes, s.parent.take());
        s.bytes = bytes;
        s.parent = r.parent;
        self.disk_bytes = self.disk_bytes + bytes - r.need - old_bytes;
        if let Some(p) = old_parent {
            self.seg_mut(p).dependents -= 1;
        }
        r.seg
    }

    /// A reserved write that did not happen (any earlier file of the stem is intact).
    pub fn abandon(&mut self, r: Reservation) {
        if let Some(p) = r.parent {
            self.seg_mut(p).dependents -= 1;
        }
        self.disk_bytes -= r.need.min(self.disk_bytes);
        let s = self.seg_mut(r.seg);
        s.writing -= 1;
        if s.bytes == 0 && s.writing == 0 {
            let s = self.segs[r.seg].take().expect("live segment");
            self.by_stem.remove(&s.stem);
            self.free_segs.push(r.seg);
        }
    }

    /// The least recently used segment that may be deleted, if any.
    fn victim(&self) -> Option<usize> {
        let mut pinned = vec![false; self.segs.len()];
        for n in self.nodes.iter().flatten() {
            if let (Some(s), true) = (n.seg, n.pins > 0) {
                pinned[s] = true;
            }
        }
        self.segs
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|s| (i, s)))
            .filter(|(i, s)| {
                s.bytes > 0 && s.writing == 0 && s.dependents == 0 && !s.stuck && !pinned[*i]
            })
            .min_by_key(|(_, s)| s.last_use)
            .map(|(i, _)| i)
    }

    /// Forgets segment `v`, whose file is gone: fixes the nodes naming it (see [`Radix`]).
    fn delete(&mut self, v: usize) {
        loop {
            let deepest = self
                .nodes
                .iter()
                .enumerate()
                .skip(1)
                .filter_map(|(i, n)| n.as_ref().map(|n| (i, n)))
                .filter(|(_, n)| n.seg == Some(v))
                .max_by_key(|(_, n)| n.kv.as_ref().map_or(0, Snapshot::len))
                .map(|(i, _)| i);
            let Some(n) = deepest else { break };
            debug_assert_eq!(self.node(n).pins, 0, "deleting a pinned node's segment");
            // Its children are deeper, so none names `v`; prefer one on disk, recently used.
            let child = self
                .node(n)
                .children
                .values()
                .map(|&c| (c, self.node(c)))
                .max_by_key(|(_, c)| (c.seg.is_some(), c.last_use))
                .map(|(c, _)| c);
            match child {
                None => self.remove_leaf(n),
                Some(c) => {
                    let depth = self.node(n).kv.as_ref().map_or(0, Snapshot::len);
                    let (kv, seg) = {
                        let cn = self.node(c);
                        (cn.kv.as_ref().map(|s| s.truncated(depth)), cn.seg)
                    };
                    let node = self.node_mut(n);
                    node.kv = kv;
                    node.seg = seg;
                }
            }
        }
        let s = self.segs[v].take().expect("live segment");
        self.by_stem.remove(&s.stem);
        self.free_segs.push(v);
        self.disk_bytes -= s.bytes;
        if let Some(p) = s.parent {
            self.seg_mut(p).dependents -= 1;
        }
        self.deleted += 1;
    }
}

fn lcp(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
