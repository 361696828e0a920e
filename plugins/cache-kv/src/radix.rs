//! The prefix tree: a radix tree over token ids with compressed edges.
//!
//! Each node covers the tokens of its edge and holds a [`Snapshot`] of the KV of the whole
//! prefix up to its end — page references only, so a node shares its pages with its ancestors
//! and with the sequences that were forked from it. A 2,000-token system prompt is one edge.
//! Lookups pin the node they fork from until that sequence is released; eviction removes the
//! least recently used unpinned leaf. Nodes whose pages are mapped from the disk tier are marked
//! `on_disk`: evicting them frees no heap, so the budget passes them over.

use crate::store::Snapshot;
use std::collections::HashMap;

struct Node {
    edge: Vec<u32>,
    children: HashMap<u32, usize>,
    parent: usize,
    kv: Option<Snapshot>,
    last_use: u64,
    pins: u32,
    on_disk: bool,
}

/// The tree (an arena; index 0 is the root, which holds no KV).
pub struct Radix {
    nodes: Vec<Option<Node>>,
    free: Vec<usize>,
    tick: u64,
    /// Nodes evicted so far.
    pub evictions: u64,
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
            on_disk: false,
        };
        Self {
            nodes: vec![Some(root)],
            free: Vec::new(),
            tick: 0,
            evictions: 0,
        }
    }

    fn node(&self, i: usize) -> &Node {
        self.nodes[i].as_ref().expect("live radix node")
    }

    fn node_mut(&mut self, i: usize) -> &mut Node {
        self.nodes[i].as_mut().expect("live radix node")
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
        self.node_mut(i).last_use = t;
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

    /// Records that `snap` (at least `tokens.len()` long) holds the KV of `tokens`; `on_disk`
    /// says its pages are mapped from the disk tier. Nodes already on the path are kept.
    pub fn insert(&mut self, tokens: &[u32], snap: &Snapshot, on_disk: bool) {
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
                    on_disk,
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
                let (head, kv, on_disk) = {
                    let cn = self.node(c);
                    let kv = cn.kv.as_ref().map(|s| s.truncated(depth));
                    (cn.edge[..common].to_vec(), kv, cn.on_disk)
                };
                let mid = self.alloc(Node {
                    edge: head,
                    children: HashMap::new(),
                    parent: node,
                    kv,
                    last_use: self.node(c).last_use,
                    pins: 0,
                    on_disk,
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

    /// How deep the nodes on disk cover `tokens`, and their snapshot of that prefix (at least
    /// that long); nothing is pinned or touched.
    pub fn disk_cover(&self, tokens: &[u32]) -> (usize, Option<Snapshot>) {
        let (mut node, mut i) = (0usize, 0usize);
        let mut best = (0, None);
        while i < tokens.len() {
            let Some(&c) = self.node(node).children.get(&tokens[i]) else {
                break;
            };
            let cn = self.node(c);
            let common = lcp(&cn.edge, &tokens[i..]);
            if cn.on_disk {
                best = (i + common, cn.kv.clone());
            }
            if common < cn.edge.len() {
                break;
            }
            node = c;
            i += common;
        }
        best
    }

    /// Releases a pin taken by [`Radix::lookup`].
    pub fn unpin(&mut self, i: usize) {
        if let Some(Some(n)) = self.nodes.get_mut(i) {
            n.pins = n.pins.saturating_sub(1);
        }
    }

    /// Evicts the least recently used unpinned leaf (only among those holding heap pages if
    /// `heap_only`); false if there is none.
    pub fn evict_one(&mut self, heap_only: bool) -> bool {
        let victim = self
            .nodes
            .iter()
            .enumerate()
            .skip(1)
            .filter_map(|(i, n)| n.as_ref().map(|n| (i, n)))
            .filter(|(_, n)| n.children.is_empty() && n.pins == 0 && !(heap_only && n.on_disk))
            .min_by_key(|(_, n)| n.last_use)
            .map(|(i, _)| i);
        let Some(v) = victim else { return false };
        let n = self.nodes[v].take().expect("live victim");
        self.node_mut(n.parent).children.remove(&n.edge[0]);
        self.free.push(v);
        self.evictions += 1;
        self.merge_with_child(n.parent);
        true
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
}

fn lcp(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
