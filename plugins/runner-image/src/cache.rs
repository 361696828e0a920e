//! The exact diffusion caches: what does not change between requests or steps is computed once
//! and reused bit for bit.
//!
//! - **Prompts**: the text encoder's rows for a prompt, keyed by the prompt itself (hashed and
//!   compared whole), so a repeated prompt — and the empty negative prompt of every guided
//!   request — skips the text encoder.
//! - **Trajectories**: the latents after the last step a request completed, keyed by everything
//!   that determines them (prompts, seed, size, steps, guidance, scheduler, initial image and
//!   strength). A request that was cancelled resumes where it stopped; one that finished
//!   decodes its final latents again without a step. Each step's noise is drawn from the seed
//!   by its index, so a resumed trajectory is the uninterrupted one. Every step's latents are
//!   kept, so an edited prompt can take over another prompt's trajectory at a step of its
//!   choice (a handoff: approximate, and said to be).
//!
//! - **Cross-attention keys and values**: each request's two contexts (the prompt's rows and
//!   the negative prompt's) get sequence ids of their own ([`Caches::contexts`]), under which
//!   the denoiser keeps the keys and values its cross-attentions read, so every step after the
//!   first reuses them.
//!
//! Both maps are bounded and forget their least recently used entries.

use crate::text::Embedded;
use std::collections::{HashMap, VecDeque};
use std::hash::Hash;
use std::sync::Arc;

/// A bounded map that forgets its least recently used entry.
struct Lru<K, V> {
    map: HashMap<K, V>,
    order: VecDeque<K>,
    capacity: usize,
}

impl<K: Hash + Eq + Clone, V: Clone> Lru<K, V> {
    fn new(capacity: usize) -> Self {
        Self {
            map: HashMap::new(),
            order: VecDeque::new(),
            capacity,
        }
    }

    fn touch(&mut self, key: &K) {
        if let Some(i) = self.order.iter().position(|k| k == key) {
            let k = self.order.remove(i).expect("position is in range");
            self.order.push_back(k);
        }
    }

    fn get(&mut self, key: &K) -> Option<V> {
        let v = self.map.get(key).cloned()?;
        self.touch(key);
        Some(v)
    }

    fn put(&mut self, key: K, value: V) {
        if self.capacity == 0 {
            return;
        }
        if self.map.insert(key.clone(), value).is_some() {
            self.touch(&key);
            return;
        }
        self.order.push_back(key);
        while self.order.len() > self.capacity {
            if let Some(old) = self.order.pop_front() {
                self.map.remove(&old);
            }
        }
    }

    fn len(&self) -> usize {
        self.map.len()
    }

    fn clear(&mut self) -> usize {
        let n = self.map.len();
        self.map.clear();
        self.order.clear();
        n
    }
}

/// Everything that determines a trajectory.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TrajectoryKey {
    /// The prompt.
    pub prompt: String,
    /// The negative prompt (empty: none).
    pub negative: String,
    /// The conditioning values' bits (a class-conditioned pipeline's label).
    pub conditioning: Vec<u32>,
    /// The seed.
    pub seed: u64,
    /// Latent height and width.
    pub size: (u32, u32),
    /// Steps of the schedule.
    pub steps: u32,
    /// The guidance scale's bits.
    pub guidance: u32,
    /// The scheduler's configuration.
    pub scheduler: Arc<str>,
    /// The initial image's file, if any.
    pub init_image: Arc<[u8]>,
    /// The strength's bits (0 without an initial image).
    pub strength: u32,
}

/// Where a trajectory stands: the latents after each step it ran, from step `first + 1` on
/// (an image-to-image run starts at `first`).
#[derive(Clone, Debug)]
pub struct Progress {
    /// The step the trajectory started after.
    pub first: u32,
    /// The latents after steps `first + 1`, `first + 2`, ….
    pub history: Vec<Arc<Vec<f32>>>,
}

impl Progress {
    /// Steps completed.
    pub fn step(&self) -> u32 {
        self.first + self.history.len() as u32
    }

    /// The latents after step `step`, if the trajectory passed it.
    pub fn after(&self, step: u32) -> Option<&Arc<Vec<f32>>> {
        let i = step.checked_sub(self.first + 1)? as usize;
        self.history.get(i)
    }
}

/// Entries each cache keeps.
pub const PROMPTS: usize = 64;
/// Trajectories kept.
pub const TRAJECTORIES: usize = 16;

/// The caches of an engine.
pub struct Caches {
    prompts: Lru<String, Arc<Embedded>>,
    trajectories: Lru<TrajectoryKey, Progress>,
    enabled: bool,
    next_context: u64,
}

impl Caches {
    /// Caches of the default sizes, or none at all (`enabled` false: every request computes
    /// everything, for comparison).
    pub fn new(enabled: bool) -> Self {
        let n = |c| if enabled { c } else { 0 };
        Self {
            prompts: Lru::new(n(PROMPTS)),
            trajectories: Lru::new(n(TRAJECTORIES)),
            enabled,
            next_context: 0,
        }
    }

    /// Fresh sequence ids for a request's two contexts (prompt, negative prompt).
    pub fn contexts(&mut self) -> [u64; 2] {
        let n = self.next_context;
        self.next_context = n.wrapping_add(2);
        [n, n.wrapping_add(1)]
    }

    /// Whether the denoiser may keep a context's keys and values across steps (off: every
    /// step gets fresh ids, so each projects its context again).
    pub fn keeps_contexts(&self) -> bool {
        self.enabled
    }

    /// What `prompt` embeds to (the encoder rows), if cached.
    pub fn prompt(&mut self, prompt: &str) -> Option<Arc<Embedded>> {
        self.prompts.get(&prompt.to_string())
    }

    /// Keeps what `prompt` embeds to.
    pub fn keep_prompt(&mut self, prompt: &str, rows: Arc<Embedded>) {
        self.prompts.put(prompt.to_string(), rows);
    }

    /// How far the trajectory `key` got, if it is cached.
    pub fn trajectory(&mut self, key: &TrajectoryKey) -> Option<Progress> {
        self.trajectories.get(key)
    }

    /// Keeps where trajectory `key` stands.
    pub fn keep_trajectory(&mut self, key: TrajectoryKey, progress: Progress) {
        self.trajectories.put(key, progress);
    }

    /// Entries held: prompts and trajectories.
    pub fn len(&self) -> (usize, usize) {
        (self.prompts.len(), self.trajectories.len())
    }

    /// Forgets everything; returns how many entries went.
    pub fn clear(&mut self) -> u64 {
        (self.prompts.clear() + self.trajectories.clear()) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_recently_used_entry_goes_first() {
        let mut lru = Lru::new(2);
        lru.put("a", 1);
        lru.put("b", 2);
        assert_eq!(lru.get(&"a"), Some(1));
        lru.put("c", 3);
        assert_eq!(lru.get(&"b"), None, "b was the least recently used");
        assert_eq!((lru.get(&"a"), lru.get(&"c")), (Some(1), Some(3)));
        lru.put("a", 4);
        assert_eq!((lru.get(&"a"), lru.len()), (Some(4), 2));
        assert_eq!(lru.clear(), 2);
        let mut off = Lru::new(0);
        off.put("a", 1);
        assert_eq!(off.get(&"a"), None, "a disabled cache keeps nothing");
    }
}
