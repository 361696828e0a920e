//! Continuous batching: one thread runs every admitted request in shared forward passes.
//!
//! Callers [`Scheduler::submit`] a tokenized request into a bounded queue (full: refused at
//! once with [`Error::Busy`]). Before each pass the scheduler thread admits waiting requests
//! into free running slots — fairly: each free slot goes to the waiting request of the client
//! with the fewest requests running, the oldest first among equals ([`pick_fair`]) — (prefix-
//! cache lookup or checkpoint load), drops cancelled ones, runs
//! one [`Batch`] step, and sends each request's streamed pieces and final outcome to that
//! request's channel. It never calls a client's sink: the caller's own thread forwards the
//! events, so a slow client delays nobody else, and marks its ticket cancelled when the client
//! is gone.

use crate::{
    Error, Generator, Result,
    batch::Batch,
    sequence::{Origin, Outcome, Piece, Sequence, Spec},
};
use abi_stable::std_types::{RString, RVec};
use std::{
    collections::{HashMap, VecDeque},
    sync::{
        Arc, Condvar, Mutex, MutexGuard, Weak,
        atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering},
        mpsc::{self, Receiver, Sender},
    },
    thread::JoinHandle,
};
use u_sdk::EngineStats;

/// How much work an engine takes on at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Requests decoding or prefilling together (one forward pass carries all of them).
    pub max_running: usize,
    /// Requests that may wait for a running slot; past that, new ones fail with `Busy`.
    pub max_queued: usize,
    /// Tokens per pass, roughly: each decoding request takes one, prefills share the rest.
    pub step_tokens: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_running: 16,
            max_queued: 64,
            step_tokens: crate::DEFAULT_PREFILL_CHUNK,
        }
    }
}

/// What the scheduler sends a request's caller.
pub(crate) enum Event {
    /// Text for one generated token (or the final flush).
    Piece(Piece),
    /// The request ended (its sequence is released).
    Done(Result<Outcome>),
}

/// A submitted request: its events, and the switch that cancels it.
pub(crate) struct Ticket {
    /// Pieces, then exactly one [`Event::Done`].
    pub events: Receiver<Event>,
    cancel: Arc<AtomicBool>,
}

impl Ticket {
    /// Asks the scheduler to drop the request before its next pass.
    pub(crate) fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}

struct Job {
    spec: Spec,
    /// The fair-queueing key (see `GenerateRequest::client`).
    client: String,
    events: Sender<Event>,
    cancel: Arc<AtomicBool>,
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    rejected: AtomicU64,
    running: AtomicU32,
    prompt_tokens: AtomicU64,
    cached_tokens: AtomicU64,
    generated_tokens: AtomicU64,
    forward_passes: AtomicU64,
    draft_tokens: AtomicU64,
    accepted_tokens: AtomicU64,
}

struct Queue {
    pending: VecDeque<Job>,
    /// Which clients were admitted when, for fair admission.
    served: Served,
    /// Submitted requests not yet done (waiting or running).
    in_flight: usize,
    stop: bool,
    /// Set before a fork: the thread returns once it has nothing to do ([`stop_threads`]).
    pause: bool,
}

struct Shared {
    generator: Arc<Generator>,
    limits: Limits,
    queue: Mutex<Queue>,
    wake: Condvar,
    counters: Counters,
    checkpoints: Mutex<HashMap<String, Vec<u32>>>,
    /// The adapters the running requests use, as of the last pass.
    running_adapters: Mutex<Vec<String>>,
    /// The scheduler thread, while it runs.
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// Every live scheduler of this plugin, for the fork hooks.
static SCHEDULERS: Mutex<Vec<Weak<Shared>>> = Mutex::new(Vec::new());

fn live_schedulers() -> Vec<Arc<Shared>> {
    let mut all = lock(&SCHEDULERS);
    all.retain(|s| s.strong_count() > 0);
    all.iter().filter_map(Weak::upgrade).collect()
}

/// The plugin's `before_fork` hook: every scheduler finishes the work it has, and its thread
/// exits (requests submitted meanwhile wait for [`start_threads`]).
pub fn stop_threads() {
    for s in live_schedulers() {
        lock(&s.queue).pause = true;
        s.wake.notify_all();
        if let Some(t) = lock(&s.thread).take() {
            let _ = t.join();
        }
    }
}

/// The plugin's `after_fork` hook: restarts the scheduler threads (in the parent, or in the
/// forked child, which has none).
pub fn start_threads(_in_child: bool) {
    for s in live_schedulers() {
        lock(&s.queue).pause = false;
        spawn(&s);
    }
}

/// Starts `shared`'s scheduler thread unless it runs; if it cannot start, the scheduler stops
/// (requests are refused with [`Error::Stopped`]).
fn spawn(shared: &Arc<Shared>) {
    let mut thread = lock(&shared.thread);
    if thread.is_some() {
        return;
    }
    let worker = shared.clone();
    *thread = std::thread::Builder::new()
        .name("u-engine-scheduler".into())
        .spawn(move || {
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(&worker)));
            if ran.is_err() {
                // A bug: refuse new work; dropping the waiting jobs (and, while unwinding,
                // the running ones) closes their channels, which their callers report.
                let mut q = lock(&worker.queue);
                q.stop = true;
                q.pending.clear();
            }
        })
        .ok();
    if thread.is_none() {
        lock(&shared.queue).stop = true;
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The scheduler thread and its queue; dropping it stops the thread once its work is done.
pub(crate) struct Scheduler {
    shared: Arc<Shared>,
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        lock(&self.shared.queue).stop = true;
        self.shared.wake.notify_all();
        if let Some(t) = lock(&self.shared.thread).take() {
            // A panicked scheduler has nothing left to clean up.
            let _ = t.join();
        }
    }
}

impl Scheduler {
    /// Starts the scheduler thread for `generator`.
    pub(crate) fn start(generator: Arc<Generator>, limits: Limits) -> Self {
        let limits = Limits {
            max_running: limits.max_running.max(1),
            ..limits
        };
        let shared = Arc::new(Shared {
            generator,
            limits,
            queue: Mutex::new(Queue {
                pending: VecDeque::new(),
                served: Served::default(),
                in_flight: 0,
                stop: false,
                pause: false,
            }),
            wake: Condvar::new(),
            counters: Counters::default(),
            checkpoints: Mutex::new(HashMap::new()),
            running_adapters: Mutex::new(Vec::new()),
            thread: Mutex::new(None),
        });
        lock(&SCHEDULERS).push(Arc::downgrade(&shared));
        spawn(&shared);
        Self { shared }
    }

    /// The generator requests run on.
    pub(crate) fn generator(&self) -> &Arc<Generator> {
        &self.shared.generator
    }

    /// The limits in force.
    pub(crate) fn limits(&self) -> Limits {
        self.shared.limits
    }

    /// Token ids of the checkpoints this engine saved (by name).
    pub(crate) fn checkpoints(&self) -> MutexGuard<'_, HashMap<String, Vec<u32>>> {
        lock(&self.shared.checkpoints)
    }

    /// Queues a request, or refuses it with [`Error::Busy`] when every running slot and every
    /// queue place is taken.
    pub(crate) fn submit(&self, spec: Spec, client: &str) -> Result<Ticket> {
        let (tx, rx) = mpsc::channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let l = self.shared.limits;
        {
            let mut q = lock(&self.shared.queue);
            if q.stop {
                return Err(Error::Stopped);
            }
            if q.in_flight >= l.max_running + l.max_queued {
                self.shared
                    .counters
                    .rejected
                    .fetch_add(1, Ordering::Relaxed);
                return Err(Error::Busy {
                    running: l.max_running,
                    queued: l.max_queued,
                });
            }
            q.in_flight += 1;
            q.pending.push_back(Job {
                spec,
                client: client.to_string(),
                events: tx,
                cancel: cancel.clone(),
            });
        }
        self.shared
            .counters
            .requests
            .fetch_add(1, Ordering::Relaxed);
        self.shared.wake.notify_one();
        Ok(Ticket { events: rx, cancel })
    }

    /// Counters (all but `kv_bytes`, which the cache knows).
    pub(crate) fn stats(&self) -> EngineStats {
        let c = &self.shared.counters;
        let (queued, waiting) = {
            let q = lock(&self.shared.queue);
            let names = q
                .pending
                .iter()
                .flat_map(|j| j.spec.adapters.iter().map(|(n, _)| n.as_str()));
            (q.pending.len(), distinct(names))
        };
        let running = distinct(
            lock(&self.shared.running_adapters)
                .iter()
                .map(String::as_str),
        );
        EngineStats {
            requests: c.requests.load(Ordering::Relaxed),
            rejected: c.rejected.load(Ordering::Relaxed),
            running: c.running.load(Ordering::Relaxed),
            queued: queued as u32,
            queue_capacity: self.shared.limits.max_queued as u32,
            prompt_tokens: c.prompt_tokens.load(Ordering::Relaxed),
            cached_tokens: c.cached_tokens.load(Ordering::Relaxed),
            generated_tokens: c.generated_tokens.load(Ordering::Relaxed),
            forward_passes: c.forward_passes.load(Ordering::Relaxed),
            kv_bytes: 0,
            draft_tokens: c.draft_tokens.load(Ordering::Relaxed),
            accepted_tokens: c.accepted_tokens.load(Ordering::Relaxed),
            running_adapters: running,
            waiting_adapters: waiting,
            ..EngineStats::default()
        }
    }
}

/// The distinct `names`, sorted.
fn distinct<'a>(names: impl Iterator<Item = &'a str>) -> RVec<RString> {
    let set: std::collections::BTreeSet<&str> = names.collect();
    set.into_iter().map(RString::from).collect()
}

/// Where a running request's output goes, and whose it is.
struct Tag {
    client: String,
    events: Sender<Event>,
    cancel: Arc<AtomicBool>,
}

/// The scheduler thread: admit, step, stream, retire — until stopped with nothing left.
fn run(shared: &Shared) {
    let g = &*shared.generator;
    let mut batch: Batch<Tag> = Batch::new(shared.limits.step_tokens);
    loop {
        let admitted: Vec<Job> = {
            let mut q = lock(&shared.queue);
            while batch.is_empty() && q.pending.is_empty() && !q.stop && !q.pause {
                q = shared
                    .wake
                    .wait(q)
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
            }
            if batch.is_empty() && q.pending.is_empty() {
                return;
            }
            let room = shared.limits.max_running.saturating_sub(batch.len());
            let mut running: HashMap<String, usize> = HashMap::new();
            for (_, tag) in batch.slots_mut() {
                *running.entry(tag.client.clone()).or_default() += 1;
            }
            let q = &mut *q;
            pick_fair(&mut q.pending, &mut running, &mut q.served, room, |j| {
                j.client.as_str()
            })
        };
        for job in admitted {
            admit(shared, &mut batch, job);
        }
        for (seq, tag) in batch.slots_mut() {
            if tag.cancel.load(Ordering::Relaxed) {
                seq.cancel();
            }
        }
        publish_running(shared, &mut batch);
        match batch.step(g) {
            Ok(true) => {
                shared
                    .counters
                    .forward_passes
                    .fetch_add(1, Ordering::Relaxed);
            }
            Ok(false) => {}
            Err(e) => {
                for (seq, _) in batch.slots_mut() {
                    seq.fail(e.clone());
                }
            }
        }
        for (seq, tag) in batch.slots_mut() {
            for piece in seq.take_pieces() {
                if tag.events.send(Event::Piece(piece)).is_err() {
                    seq.cancel();
                }
            }
        }
        let done = batch.take_done();
        publish_running(shared, &mut batch);
        for (seq, tag) in done {
            retire(shared, seq.close(), &tag.events);
        }
    }
}

/// Records how many requests run and which adapters they use, for [`Scheduler::stats`].
fn publish_running(shared: &Shared, batch: &mut Batch<Tag>) {
    shared
        .counters
        .running
        .store(batch.len() as u32, Ordering::Relaxed);
    *lock(&shared.running_adapters) = batch
        .slots_mut()
        .flat_map(|(seq, _)| seq.adapter_names())
        .collect();
}

/// Takes a cache sequence for `job` and adds it to the batch (or reports why not).
fn admit(shared: &Shared, batch: &mut Batch<Tag>, mut job: Job) {
    if let Origin::Checkpoint { name, tokens } = &mut job.spec.origin {
        *tokens = lock(&shared.checkpoints).get(name).cloned();
    }
    match Sequence::admit(&shared.generator, job.spec) {
        Ok(seq) => batch.push(
            seq,
            Tag {
                client: job.client,
                events: job.events,
                cancel: job.cancel,
            },
        ),
        Err(e) => retire(shared, Err(e), &job.events),
    }
}

/// Per-client admission record for [`pick_fair`]: when each client last got a running slot.
#[derive(Default)]
struct Served {
    /// Admissions so far (the clock).
    count: u64,
    /// Client → the clock at its latest admission (only clients with work waiting or running).
    last: HashMap<String, u64>,
}

/// Takes up to `room` items out of `pending` for free running slots, each slot going to the
/// oldest waiting item of the client with the fewest running (`running`, updated as items are
/// taken) and, among those, the one served least recently (`served`): clients take turns, so a
/// burst queued by one shares the slots with a client that asks once. With a single client
/// this is first come, first served.
fn pick_fair<T>(
    pending: &mut VecDeque<T>,
    running: &mut HashMap<String, usize>,
    served: &mut Served,
    room: usize,
    client: impl Fn(&T) -> &str,
) -> Vec<T> {
    let mut taken = Vec::new();
    while taken.len() < room && !pending.is_empty() {
        // The first waiting item of each client is that client's oldest.
        let mut best: Option<((usize, u64), usize)> = None;
        let mut seen: Vec<&str> = Vec::new();
        for (i, item) in pending.iter().enumerate() {
            let c = client(item);
            if seen.contains(&c) {
                continue;
            }
            seen.push(c);
            let rank = (
                running.get(c).copied().unwrap_or(0),
                served.last.get(c).copied().unwrap_or(0),
            );
            if best.is_none_or(|(b, _)| rank < b) {
                best = Some((rank, i));
            }
        }
        let Some((_, i)) = best else { break };
        let Some(item) = pending.remove(i) else { break };
        served.count += 1;
        served.last.insert(client(&item).to_string(), served.count);
        *running.entry(client(&item).to_string()).or_default() += 1;
        taken.push(item);
    }
    // Forget clients with nothing left here, so the record stays as small as the work.
    served
        .last
        .retain(|c, _| running.contains_key(c) || pending.iter().any(|j| client(j) == c));
    taken
}

/// Counts a finished request and sends its outcome.
fn retire(shared: &Shared, outcome: Result<Outcome>, events: &Sender<Event>) {
    if let Ok(o) = &outcome {
        let c = &shared.counters;
        c.prompt_tokens
            .fetch_add(o.prompt_tokens as u64, Ordering::Relaxed);
        c.cached_tokens
            .fetch_add(o.cached_tokens as u64, Ordering::Relaxed);
        c.generated_tokens
            .fetch_add(o.tokens.len() as u64, Ordering::Relaxed);
        c.draft_tokens
            .fetch_add(o.drafted as u64, Ordering::Relaxed);
        c.accepted_tokens
            .fetch_add(o.accepted as u64, Ordering::Relaxed);
        if let Some((name, ids)) = &o.saved {
            let mut known = lock(&shared.checkpoints);
            match ids {
                Some(ids) => known.insert(name.clone(), ids.clone()),
                None => known.remove(name),
            };
        }
    }
    lock(&shared.queue).in_flight -= 1;
    // The caller may be gone; its request is finished either way.
    let _ = events.send(Event::Done(outcome));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn take(
        pending: &[&str],
        running: &[(&str, usize)],
        last: &[&str],
        room: usize,
    ) -> Vec<String> {
        let mut q: VecDeque<String> = pending.iter().map(|s| s.to_string()).collect();
        let mut r: HashMap<String, usize> =
            running.iter().map(|&(c, n)| (c.to_string(), n)).collect();
        let mut served = Served::default();
        for c in last {
            served.count += 1;
            served.last.insert(c.to_string(), served.count);
        }
        pick_fair(&mut q, &mut r, &mut served, room, |s| {
            s.split('#').next().unwrap_or("")
        })
    }

    #[test]
    fn one_client_is_first_come_first_served() {
        assert_eq!(take(&["a#1", "a#2", "a#3"], &[], &[], 2), ["a#1", "a#2"]);
    }

    #[test]
    fn a_burst_does_not_starve_a_client_that_asks_once() {
        // a holds the running slot and four queued; b's single request goes next.
        let got = take(&["a#2", "a#3", "a#4", "a#5", "b#1"], &[("a", 1)], &["a"], 1);
        assert_eq!(got, ["b#1"]);
        // With room for three: the idle clients first (oldest first), then a.
        let got = take(&["a#2", "a#3", "c#1", "a#4", "b#1"], &[("a", 1)], &["a"], 3);
        assert_eq!(got, ["c#1", "b#1", "a#2"]);
    }

    #[test]
    fn clients_take_turns_when_nothing_runs() {
        // One slot, nothing running: a was served last, so b goes first, then a, then b.
        let mut q: VecDeque<String> = ["a#2", "a#3", "b#1", "b#2"].map(String::from).into();
        let mut served = Served {
            count: 1,
            last: HashMap::from([("a".to_string(), 1)]),
        };
        let key = |s: &String| s.split('#').next().unwrap_or("").to_string();
        let mut order = Vec::new();
        while !q.is_empty() {
            let mut running = HashMap::new();
            let got = pick_fair(&mut q, &mut running, &mut served, 1, |s| {
                s.split('#').next().unwrap_or("")
            });
            order.extend(got.iter().map(key));
        }
        assert_eq!(order, ["b", "a", "b", "a"]);
    }
}
