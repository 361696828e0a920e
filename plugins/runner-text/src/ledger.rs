//! Which low-rank adapters the engine holds and for whom: the deployment's (pinned, loaded
//! before the engine started) and those loaded at run time, with their bytes, when each was
//! last asked for and how many requests run under it now — so that loading one past the
//! byte budget unloads the least recently used run-time adapter no request is using.

use std::{
    collections::{HashMap, HashSet},
    sync::Mutex,
    time::Instant,
};

/// An adapter loaded at run time.
struct Loaded {
    bytes: u64,
    last_used: Instant,
    /// Which load of the engine it was: another load under the same name has another.
    generation: u64,
}

#[derive(Default)]
struct State {
    pinned: HashSet<String>,
    loaded: HashMap<String, Loaded>,
    in_use: HashMap<String, usize>,
    /// Loads so far; each run-time adapter's is its generation.
    loads: u64,
}

/// The engine's adapter book-keeping.
#[derive(Default)]
pub(crate) struct Ledger {
    state: Mutex<State>,
}

/// Requests running under adapters: dropping it releases them.
pub(crate) struct Using<'a> {
    ledger: &'a Ledger,
    names: Vec<String>,
}

impl Drop for Using<'_> {
    fn drop(&mut self) {
        let mut s = self.ledger.lock();
        for n in &self.names {
            if let Some(c) = s.in_use.get_mut(n) {
                *c = c.saturating_sub(1);
            }
        }
    }
}

impl Ledger {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Pins the adapters the model held when the engine started.
    pub(crate) fn pin(&self, names: impl IntoIterator<Item = String>) {
        self.lock().pinned.extend(names);
    }

    /// Whether `name` is pinned or loaded at run time.
    pub(crate) fn holds(&self, name: &str) -> bool {
        let s = self.lock();
        s.pinned.contains(name) || s.loaded.contains_key(name)
    }

    /// Whether `name` is one of the deployment's.
    pub(crate) fn is_pinned(&self, name: &str) -> bool {
        self.lock().pinned.contains(name)
    }

    /// Marks `names` in use (and just used) until the guard drops.
    pub(crate) fn using<'a>(&'a self, names: &[String]) -> Using<'a> {
        let mut s = self.lock();
        let now = Instant::now();
        for n in names {
            *s.in_use.entry(n.clone()).or_default() += 1;
            if let Some(l) = s.loaded.get_mut(n) {
                l.last_used = now;
            }
        }
        Using {
            ledger: self,
            names: names.to_vec(),
        }
    }

    /// Requests running under `name` now.
    pub(crate) fn users(&self, name: &str) -> usize {
        self.lock().in_use.get(name).copied().unwrap_or(0)
    }

    /// Records `name` (of `bytes`) loaded at run time and returns the run-time adapters to
    /// unload, least recently used first, so that they all fit in `budget` bytes (0: no
    /// limit); `Err` with the bytes still needed when the unused ones are not enough.
    pub(crate) fn add(&self, name: &str, bytes: u64, budget: u64) -> Result<Vec<String>, u64> {
        let mut s = self.lock();
        s.loads += 1;
        let generation = s.loads;
        s.loaded.insert(
            name.to_string(),
            Loaded {
                bytes,
                last_used: Instant::now(),
                generation,
            },
        );
        let total: u64 = s.loaded.values().map(|l| l.bytes).sum();
        if budget == 0 || total <= budget {
            return Ok(Vec::new());
        }
        let mut idle: Vec<(&String, &Loaded)> = s
            .loaded
            .iter()
            .filter(|(n, _)| n.as_str() != name && s.in_use.get(*n).copied().unwrap_or(0) == 0)
            .collect();
        idle.sort_by_key(|(_, l)| l.last_used);
        let mut over = total - budget;
        let mut evict = Vec::new();
        for (n, l) in idle {
            if over == 0 {
                break;
            }
            over = over.saturating_sub(l.bytes);
            evict.push(n.clone());
        }
        if over > 0 {
            s.loaded.remove(name);
            return Err(over);
        }
        for n in &evict {
            s.loaded.remove(n);
        }
        Ok(evict)
    }

    /// Which load `name` is (0 for the deployment's adapters): part of the prefix-cache key,
    /// so that KV computed under an unloaded adapter is never found under a new one of its name.
    pub(crate) fn generation(&self, name: &str) -> u64 {
        self.lock().loaded.get(name).map_or(0, |l| l.generation)
    }

    /// Forgets run-time adapter `name`; whether it was one.
    pub(crate) fn remove(&self, name: &str) -> bool {
        self.lock().loaded.remove(name).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_recently_used_idle_adapter_makes_room() {
        let l = Ledger::default();
        l.pin(["base".to_string()]);
        assert_eq!(l.add("a", 40, 100), Ok(vec![]));
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert_eq!(l.add("b", 40, 100), Ok(vec![]));
        // `a` is used again: `b` is now the least recently used.
        drop(l.using(&["a".to_string()]));
        assert_eq!(l.add("c", 40, 100), Ok(vec!["b".to_string()]));
        // With `a` and `c` in use, a fourth does not fit: refused, nothing unloaded.
        let _busy = l.using(&["a".to_string(), "c".to_string()]);
        assert_eq!(l.add("d", 40, 100), Err(20));
        assert!(l.holds("a") && l.holds("c") && !l.holds("d") && l.holds("base"));
        assert_eq!(l.users("a"), 1);
        // A name loaded again is another generation.
        let first = l.generation("c");
        drop(_busy);
        assert!(l.remove("c"));
        assert_eq!(l.add("c", 10, 100), Ok(vec![]));
        assert!(l.generation("c") > first && l.generation("base") == 0);
    }
}
