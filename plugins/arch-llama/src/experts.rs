//! The expert cache of a mixture-of-experts model (the seed's): which experts stay in memory
//! and which are asked for before they are needed.
//!
//! Experts are read straight from the mapped weight file, so "in memory" means the OS holds
//! their pages. The cache keeps a ledger of what it believes is resident and acts through page
//! advice: a routed expert not resident is asked for (`MADV_WILLNEED`); with a byte budget, the
//! least recently routed experts beyond it are given back (`MADV_PAGEOUT`), except the hot set —
//! experts routed well above their fair share, which stay pinned (and `mlock`ed where the
//! memlock limit allows); and router lookahead applies the next MoE layer's router to this
//! layer's input, asking for the experts it predicts while this layer computes. Nothing here
//! changes a value the model computes: advice only moves pages.

use std::sync::{Arc, Mutex};
use u_sdk::{ModelCounter, Result, WeightSetBox, nn::Tensor, pages};

/// What the cache does; the plugin's `[plugins.config]` sets it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ExpertPolicy {
    /// Ask for a routed expert's pages before its FFN runs when the ledger says they are out.
    pub prefetch: bool,
    /// Predict the next MoE layer's experts with its router on this layer's input, and ask for
    /// them ahead.
    pub lookahead: bool,
    /// Bytes of experts to keep in memory at most (`None`: no limit, the OS decides).
    pub budget: Option<u64>,
    /// An expert routed at least this many times its fair share (`used / experts` of a layer's
    /// routings) is pinned; 0 (the default) pins nothing. Off by default because it did not
    /// pay where measured (tests/bench/moe_vs_llamacpp.py: under a budget, decode's routing
    /// is local enough that LRU alone keeps the hot experts, and the pinned half of the budget
    /// cost a third more misses).
    pub pin_share: f64,
}

impl Default for ExpertPolicy {
    fn default() -> Self {
        Self {
            prefetch: true,
            lookahead: true,
            budget: None,
            pin_share: 0.0,
        }
    }
}

impl ExpertPolicy {
    /// The policy as it acts: prefetch and lookahead only under a budget. Without one the OS
    /// pages experts in with its read-ahead, which decoded 1.7× faster from a cold page cache
    /// than asking for the routed experts alone (tests/bench/moe_vs_llamacpp.py), and in
    /// memory there is nothing to ask for.
    pub fn effective(self) -> ExpertPolicy {
        match self.budget {
            Some(_) => self,
            None => ExpertPolicy {
                prefetch: false,
                lookahead: false,
                ..self
            },
        }
    }
}

/// Routings a layer must have seen before its experts are pinned by share.
const PIN_WARMUP: f64 = 64.0;
/// Routings after which a layer's usage counts are halved, so the hot set follows the traffic.
const USAGE_WINDOW: f64 = 4096.0;

/// What to do to an expert's pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Act {
    /// Read them in.
    Fetch,
    /// Give them back.
    Evict,
    /// Keep them in memory.
    Pin,
    /// Let them go again.
    Unpin,
}

/// What the ledger asks to be done to one expert's pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Advice {
    /// What to do.
    pub act: Act,
    /// The expert's layer.
    pub layer: usize,
    /// The expert's index in its layer.
    pub expert: usize,
}

impl Advice {
    fn new(act: Act, layer: usize, expert: usize) -> Advice {
        Advice { act, layer, expert }
    }
}

/// One expert's entry.
#[derive(Clone, Debug, Default)]
struct Slot {
    bytes: u64,
    last_use: u64,
    uses: f64,
    resident: bool,
    pinned: bool,
    predicted: bool,
}

/// Running totals, reported as the model's counters.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ExpertStats {
    /// Experts routed to (per layer and pass, each counted once however many tokens chose it).
    pub routed: u64,
    /// Routed experts the ledger did not hold: read in on the critical path.
    pub misses: u64,
    /// Bytes asked for (misses and lookahead).
    pub fetched_bytes: u64,
    /// Experts given back to stay within the budget.
    pub evictions: u64,
    /// Experts lookahead predicted.
    pub predicted: u64,
    /// Routed experts lookahead had predicted.
    pub predicted_hits: u64,
    /// Experts pinned now.
    pub pinned: u64,
    /// Pinned experts whose pages are also locked (`mlock`).
    pub locked: u64,
    /// Bytes of experts the ledger holds resident.
    pub resident_bytes: u64,
}

/// The bookkeeping, apart from the pages it advises on: what is resident, how recently and how
/// often each expert was routed, and what to fetch, evict, pin and unpin.
#[derive(Debug)]
pub struct Ledger {
    policy: ExpertPolicy,
    layers: Vec<Vec<Slot>>,
    routings: Vec<f64>,
    clock: u64,
    stats: ExpertStats,
}

impl Ledger {
    /// A ledger for layers of experts of `sizes[layer][expert]` bytes (empty for dense
    /// layers). Nothing is believed resident at first.
    pub fn new(policy: ExpertPolicy, sizes: &[Vec<u64>]) -> Ledger {
        let layers = sizes
            .iter()
            .map(|l| {
                l.iter()
                    .map(|&bytes| Slot {
                        bytes,
                        ..Slot::default()
                    })
                    .collect()
            })
            .collect();
        Ledger {
            policy,
            layers,
            routings: vec![0.0; sizes.len()],
            clock: 0,
            stats: ExpertStats::default(),
        }
    }

    /// The totals so far.
    pub fn stats(&self) -> ExpertStats {
        self.stats.clone()
    }

    /// The policy it keeps.
    pub fn policy(&self) -> ExpertPolicy {
        self.policy
    }

    /// Records that `layer` routed `tokens` tokens to each `(expert, tokens)` of `routed`, and
    /// says what to do before they run.
    pub fn route(&mut self, layer: usize, routed: &[(usize, usize)]) -> Vec<Advice> {
        self.clock += 1;
        let mut advice = Vec::new();
        for &(expert, tokens) in routed {
            let slot = &mut self.layers[layer][expert];
            slot.last_use = self.clock;
            slot.uses += tokens as f64;
            self.stats.routed += 1;
            if slot.predicted {
                self.stats.predicted_hits += 1;
            }
            if !slot.resident {
                self.stats.misses += 1;
                slot.resident = true;
                self.stats.resident_bytes += slot.bytes;
                if self.policy.prefetch {
                    self.stats.fetched_bytes += slot.bytes;
                    advice.push(Advice::new(Act::Fetch, layer, expert));
                }
            }
        }
        self.layers[layer]
            .iter_mut()
            .for_each(|s| s.predicted = false);
        self.routings[layer] += routed.iter().map(|&(_, t)| t as f64).sum::<f64>();
        if self.routings[layer] > USAGE_WINDOW {
            self.routings[layer] /= 2.0;
            self.layers[layer].iter_mut().for_each(|s| s.uses /= 2.0);
        }
        self.repin(layer, &mut advice);
        self.evict(&mut advice);
        advice
    }

    /// Records lookahead's prediction of `layer`'s experts and says which to read in now: those
    /// not resident that fit the budget's free room. A guess never evicts — under a tight
    /// budget a wrong one would cost a read and push out an expert that is needed — but it
    /// counts as a use, so the predicted experts held are the last the budget evicts.
    pub fn predict(&mut self, layer: usize, experts: &[usize]) -> Vec<Advice> {
        let mut advice = Vec::new();
        for &expert in experts {
            let slot = &mut self.layers[layer][expert];
            if slot.predicted {
                continue;
            }
            slot.predicted = true;
            slot.last_use = self.clock;
            self.stats.predicted += 1;
            let room = self
                .policy
                .budget
                .is_none_or(|b| self.stats.resident_bytes + slot.bytes <= b);
            if !slot.resident && room {
                slot.resident = true;
                self.stats.resident_bytes += slot.bytes;
                self.stats.fetched_bytes += slot.bytes;
                advice.push(Advice::new(Act::Fetch, layer, expert));
            }
        }
        advice
    }

    /// Pins `layer`'s experts routed at `pin_share` × their fair share or more (after a
    /// warm-up), hottest first while the pinned bytes stay within half the budget; unpins the
    /// rest.
    fn repin(&mut self, layer: usize, advice: &mut Vec<Advice>) {
        let total = self.routings[layer];
        if self.policy.pin_share <= 0.0 || total < PIN_WARMUP {
            return;
        }
        let slots = &self.layers[layer];
        let fair = total / slots.len() as f64;
        let mut hot: Vec<usize> = (0..slots.len())
            .filter(|&e| slots[e].uses >= self.policy.pin_share * fair)
            .collect();
        hot.sort_by(|&a, &b| slots[b].uses.total_cmp(&slots[a].uses));
        let others: u64 = self
            .layers
            .iter()
            .enumerate()
            .filter(|&(l, _)| l != layer)
            .flat_map(|(_, s)| s.iter().filter(|s| s.pinned).map(|s| s.bytes))
            .sum();
        let room = self.policy.budget.map_or(u64::MAX, |b| b / 2);
        let mut pinned_bytes = others;
        let mut keep = vec![false; slots.len()];
        for e in hot {
            if pinned_bytes + slots[e].bytes <= room {
                pinned_bytes += slots[e].bytes;
                keep[e] = true;
            }
        }
        for (expert, (slot, keep)) in self.layers[layer].iter_mut().zip(keep).enumerate() {
            match (slot.pinned, keep) {
                (false, true) => {
                    slot.pinned = true;
                    self.stats.pinned += 1;
                    if !slot.resident {
                        slot.resident = true;
                        self.stats.resident_bytes += slot.bytes;
                        self.stats.fetched_bytes += slot.bytes;
                        advice.push(Advice::new(Act::Fetch, layer, expert));
                    }
                    advice.push(Advice::new(Act::Pin, layer, expert));
                }
                (true, false) => {
                    slot.pinned = false;
                    self.stats.pinned -= 1;
                    advice.push(Advice::new(Act::Unpin, layer, expert));
                }
                _ => {}
            }
        }
    }

    /// Evicts the least recently used unpinned experts, never one of this step (routed or
    /// predicted now), until the resident bytes fit the budget or nothing more may go.
    fn evict(&mut self, advice: &mut Vec<Advice>) {
        let Some(budget) = self.policy.budget else {
            return;
        };
        while self.stats.resident_bytes > budget {
            let victim = self
                .layers
                .iter()
                .enumerate()
                .flat_map(|(l, s)| s.iter().enumerate().map(move |(e, s)| (l, e, s)))
                .filter(|(_, _, s)| s.resident && !s.pinned && s.last_use < self.clock)
                .min_by_key(|(_, _, s)| s.last_use)
                .map(|(l, e, _)| (l, e));
            let Some((layer, expert)) = victim else {
                return;
            };
            let slot = &mut self.layers[layer][expert];
            slot.resident = false;
            self.stats.resident_bytes -= slot.bytes;
            self.stats.evictions += 1;
            advice.push(Advice::new(Act::Evict, layer, expert));
        }
    }
}

/// One MoE layer as the cache sees it: its router (for lookahead) and each expert's weights.
pub struct ExpertLayer {
    /// The router's weight, `[experts, hidden]` (routers have no bias or scale).
    pub router: Tensor,
    /// Each expert's weight tensors (gate, up, down).
    pub experts: Vec<Vec<Tensor>>,
}

/// The cache: a ledger behind a lock, and the weights it advises on.
pub struct ExpertCache {
    ledger: Mutex<Ledger>,
    layers: Vec<Option<ExpertLayer>>,
    used: usize,
}

impl ExpertCache {
    /// A cache over `layers` (`None` for dense ones), `used` experts routed per token, acting
    /// as [`ExpertPolicy::effective`] says.
    pub fn new(policy: ExpertPolicy, used: usize, layers: Vec<Option<ExpertLayer>>) -> Arc<Self> {
        let policy = policy.effective();
        let sizes: Vec<Vec<u64>> = layers
            .iter()
            .map(|l| {
                l.as_ref().map_or_else(Vec::new, |l| {
                    l.experts
                        .iter()
                        .map(|w| w.iter().map(|t| t.desc().byte_len().unwrap_or(0)).sum())
                        .collect()
                })
            })
            .collect();
        Arc::new(ExpertCache {
            ledger: Mutex::new(Ledger::new(policy, &sizes)),
            layers,
            used,
        })
    }

    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Before `layer`'s experts run on `x` (its normed input, `[tokens, hidden]`): records the
    /// routing, acts on the ledger's advice, and — with lookahead — asks for the next MoE
    /// layer's predicted experts.
    pub fn before_experts(
        &self,
        layer: usize,
        routed: &[(usize, usize)],
        x: &Tensor,
    ) -> Result<()> {
        let advice = self.ledger().route(layer, routed);
        self.apply(&advice);
        if !self.ledger().policy().lookahead {
            return Ok(());
        }
        let Some((next, l)) = self
            .layers
            .iter()
            .enumerate()
            .skip(layer + 1)
            .find_map(|(i, l)| l.as_ref().map(|l| (i, l)))
        else {
            return Ok(());
        };
        let top = x.matmul_t(&l.router)?.top_k(self.used)?.to_vec_i32()?;
        let mut predicted: Vec<usize> = top.iter().map(|&e| e as usize).collect();
        predicted.sort_unstable();
        predicted.dedup();
        let advice = self.ledger().predict(next, &predicted);
        self.apply(&advice);
        Ok(())
    }

    /// Carries the ledger's advice out on the pages.
    fn apply(&self, advice: &[Advice]) {
        for a in advice {
            let Some(weights) = self.layers[a.layer].as_ref().map(|l| &l.experts[a.expert]) else {
                continue;
            };
            match a.act {
                Act::Fetch => weights.iter().for_each(Tensor::will_need),
                Act::Evict => weights.iter().for_each(Tensor::page_out),
                Act::Pin => {
                    if weights.iter().all(|t| t.lock_pages().is_ok()) {
                        self.ledger().stats.locked += 1;
                    } else {
                        weights.iter().for_each(Tensor::unlock_pages);
                    }
                }
                Act::Unpin => {
                    weights.iter().for_each(Tensor::unlock_pages);
                    let mut ledger = self.ledger();
                    ledger.stats.locked = ledger.stats.locked.saturating_sub(1);
                }
            }
        }
    }

    /// The totals so far.
    pub fn stats(&self) -> ExpertStats {
        self.ledger().stats()
    }

    /// Asks for the tensors of the mapped weight file `set` that every token reads — all but
    /// the experts and `sparse` (the embedding table); for a file marked random-access before
    /// the model read any of it ([`random_access`]).
    pub fn will_need_dense(&self, set: &WeightSetBox, sparse: &[&Tensor]) -> Result<()> {
        let skip: Vec<(usize, usize)> = self
            .layers
            .iter()
            .flatten()
            .flat_map(|l| l.experts.iter().flatten())
            .chain(sparse.iter().copied())
            .filter_map(Tensor::host_range)
            .collect();
        for_each_view(set, |addr, len| {
            if !skip.iter().any(|&(a, l)| a < addr + len && addr < a + l) {
                pages::will_need(addr, len);
            }
        })
    }

    /// The totals as the model's counters (`u_model_expert_*` in `/metrics`).
    pub fn counters(&self) -> Vec<ModelCounter> {
        let s = self.stats();
        let counter = |name: &str, help: &str, value: u64, gauge: bool| ModelCounter {
            name: name.into(),
            help: help.into(),
            value: value as f64,
            gauge,
        };
        vec![
            counter(
                "expert_routed_total",
                "MoE experts routed to (per layer and pass).",
                s.routed,
                false,
            ),
            counter(
                "expert_misses_total",
                "Routed experts not resident: read in before they ran.",
                s.misses,
                false,
            ),
            counter(
                "expert_fetched_bytes_total",
                "Bytes of experts asked for ahead (misses and lookahead).",
                s.fetched_bytes,
                false,
            ),
            counter(
                "expert_evictions_total",
                "Experts given back to stay within the budget.",
                s.evictions,
                false,
            ),
            counter(
                "expert_predicted_total",
                "Experts router lookahead predicted.",
                s.predicted,
                false,
            ),
            counter(
                "expert_predicted_hits_total",
                "Routed experts that lookahead had predicted.",
                s.predicted_hits,
                false,
            ),
            counter(
                "expert_pinned",
                "Hot experts pinned in memory.",
                s.pinned,
                true,
            ),
            counter(
                "expert_locked",
                "Pinned experts whose pages are locked (mlock).",
                s.locked,
                true,
            ),
            counter(
                "expert_resident_bytes",
                "Bytes of experts held in memory.",
                s.resident_bytes,
                true,
            ),
        ]
    }
}

/// Marks every page of the mapped weight file `set` random-access, before a model whose expert
/// cache prefetches under a budget reads any of it: the cache then reads exactly the experts it
/// asks for, where the OS's read-ahead around a fault — 8 MiB on the disks here, centred on the
/// fault — would pull in neighbouring experts no token was routed to.
pub fn random_access(set: &WeightSetBox) -> Result<()> {
    for_each_view(set, pages::random_access)
}

/// `f(address, length)` of each tensor's bytes in `set`.
fn for_each_view(set: &WeightSetBox, mut f: impl FnMut(usize, usize)) -> Result<()> {
    for info in set.tensors().into_result()? {
        let view = set.tensor(info.name.as_str().into()).into_result()?;
        if !view.data.is_empty() {
            f(view.data.as_ptr() as usize, view.data.len());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: u64 = 1 << 20;

    fn ledger(policy: ExpertPolicy) -> Ledger {
        Ledger::new(policy, &[vec![MB; 4], vec![], vec![MB; 4]])
    }

    fn acted(advice: &[Advice], act: Act) -> Vec<(usize, usize)> {
        advice
            .iter()
            .filter(|a| a.act == act)
            .map(|a| (a.layer, a.expert))
            .collect()
    }

    fn fetched(advice: &[Advice]) -> Vec<(usize, usize)> {
        acted(advice, Act::Fetch)
    }

    fn evicted(advice: &[Advice]) -> Vec<(usize, usize)> {
        acted(advice, Act::Evict)
    }

    #[test]
    fn a_routed_expert_is_fetched_once_and_then_held() {
        let mut l = ledger(ExpertPolicy::default());
        assert_eq!(fetched(&l.route(0, &[(1, 1), (3, 1)])), [(0, 1), (0, 3)]);
        assert!(l.route(0, &[(1, 1), (3, 1)]).is_empty());
        let s = l.stats();
        assert_eq!((s.routed, s.misses, s.resident_bytes), (4, 2, 2 * MB));
        let off = ExpertPolicy {
            prefetch: false,
            ..ExpertPolicy::default()
        };
        let mut l = ledger(off);
        assert!(l.route(0, &[(1, 1)]).is_empty());
        assert_eq!(l.stats().misses, 1);
    }

    #[test]
    fn beyond_the_budget_the_least_recently_routed_go_first_never_the_current_ones() {
        let mut l = ledger(ExpertPolicy {
            budget: Some(3 * MB),
            pin_share: 0.0,
            ..ExpertPolicy::default()
        });
        l.route(0, &[(0, 1), (1, 1)]);
        l.route(2, &[(2, 1)]);
        assert!(evicted(&l.route(0, &[(1, 1)])).is_empty());
        // (0,0) is the oldest; (2,2) was routed after it.
        let a = l.route(2, &[(0, 1), (1, 1)]);
        assert_eq!(evicted(&a), [(0, 0), (2, 2)]);
        assert_eq!(fetched(&a), [(2, 0), (2, 1)]);
        assert_eq!(l.stats().resident_bytes, 3 * MB);
        // A routing larger than the budget keeps what it needs now.
        let a = l.route(0, &[(0, 1), (1, 1), (2, 1), (3, 1)]);
        assert_eq!(evicted(&a), [(2, 0), (2, 1)]);
        assert_eq!(l.stats().resident_bytes, 4 * MB);
        assert_eq!(l.stats().evictions, 4);
    }

    #[test]
    fn hot_experts_are_pinned_and_outlive_colder_ones() {
        let mut l = ledger(ExpertPolicy {
            budget: Some(4 * MB),
            pin_share: 1.5,
            ..ExpertPolicy::default()
        });
        // Expert 0 gets most of layer 0's traffic.
        let mut pins = Vec::new();
        for step in 0..80 {
            let other = 1 + step % 3;
            pins.extend(acted(&l.route(0, &[(0, 1), (other, 1)]), Act::Pin));
        }
        assert_eq!(pins, [(0, 0)]);
        assert_eq!(l.stats().pinned, 1);
        // Layer 2 pushes everything else out, but not the pinned expert.
        let a = l.route(2, &[(0, 1), (1, 1), (2, 1)]);
        assert!(!evicted(&a).contains(&(0, 0)), "{a:?}");
        assert_eq!(l.stats().resident_bytes, 4 * MB);
        // When the traffic moves away, the pin is released.
        let mut unpinned = false;
        for _ in 0..4000 {
            unpinned |= acted(&l.route(0, &[(1, 1), (2, 1)]), Act::Unpin).contains(&(0, 0));
        }
        assert!(unpinned);
        assert_eq!(l.stats().pinned, 2);
    }

    #[test]
    fn lookahead_fetches_predictions_and_counts_its_hits() {
        let mut l = ledger(ExpertPolicy::default());
        assert_eq!(fetched(&l.predict(2, &[1, 3])), [(2, 1), (2, 3)]);
        assert_eq!(fetched(&l.route(2, &[(1, 1), (2, 1)])), [(2, 2)]);
        let s = l.stats();
        assert_eq!((s.predicted, s.predicted_hits, s.misses), (2, 1, 1));
        // A prediction is scored once, against the next routing only.
        l.route(2, &[(3, 1)]);
        assert_eq!(l.stats().predicted_hits, 1);
    }

    #[test]
    fn a_guess_fills_free_room_and_never_evicts() {
        let mut l = ledger(ExpertPolicy {
            budget: Some(3 * MB),
            pin_share: 0.0,
            ..ExpertPolicy::default()
        });
        l.route(0, &[(0, 1), (1, 1)]);
        assert_eq!(fetched(&l.predict(2, &[0, 1])), [(2, 0)]);
        assert_eq!(l.stats().resident_bytes, 3 * MB);
        assert!(l.predict(2, &[2, 3]).is_empty());
        assert_eq!(l.stats().evictions, 0);
    }
}
