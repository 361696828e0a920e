//! A fork-join team for small parallel loops (decode-sized ops): the calling thread works
//! alongside `threads − 1` helper threads that claim tasks from a shared counter.
//!
//! Why not rayon's `install`: it parks the caller while the pool runs the op, so every op costs
//! two thread wake-ups (pool, then caller), and a decode step runs a few hundred ops of tens of
//! microseconds each. Here the caller computes, helpers that are already awake join in, and the
//! caller never waits for a helper that has not started: it closes the job when the tasks run
//! out and waits only for helpers inside it. On a loaded machine a descheduled helper so costs
//! nothing but its share of the parallelism. Idle helpers spin briefly, then park.
//!
//! Protocol (all atomics sequentially consistent): the caller stores the job, makes `epoch` odd
//! (open), works, makes it even (closed) and waits for `active == 0`. A helper that sees an odd
//! epoch `e` increments `active`, then runs the job only if `epoch` is still `e`: either it
//! re-checked before the close (so the caller sees it active and waits), or it sees the close
//! and leaves the job alone.

use std::cell::UnsafeCell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// Spin iterations before an idle helper yields, and yields before it parks.
const SPINS: u32 = 1000;
const YIELDS: u32 = 8;

/// The open job, type-erased with its lifetime: valid only while its epoch is open.
type Job = *const (dyn Fn() + Sync);

struct Shared {
    epoch: AtomicU64,
    active: AtomicUsize,
    job: UnsafeCell<Job>,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    stop: AtomicBool,
    panicked: AtomicBool,
}

// SAFETY: `job` is written only by the one caller holding `Team::busy`, before the epoch that
// publishes it, and read only by helpers inside that open epoch (see the module docs).
unsafe impl Sync for Shared {}
// SAFETY: as above; the pointer is only dereferenced under the protocol.
unsafe impl Send for Shared {}

/// The team: helper threads and the state they share with the caller.
pub struct Team {
    shared: Arc<Shared>,
    /// Held by the thread running a job; a second caller (or a nested call) runs serially.
    busy: Mutex<()>,
    /// The helper threads; empty while stopped for a fork ([`Team::stop`]).
    helpers: Mutex<Vec<JoinHandle<()>>>,
    /// Helpers the team runs with when started.
    wanted: usize,
}

impl Team {
    /// A team of the caller plus `threads − 1` helpers.
    pub fn new(threads: usize) -> std::io::Result<Team> {
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            active: AtomicUsize::new(0),
            job: UnsafeCell::new(std::ptr::null::<fn()>() as Job),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
        });
        let team = Team {
            shared,
            busy: Mutex::new(()),
            helpers: Mutex::new(Vec::new()),
            wanted: threads.max(1) - 1,
        };
        team.start()?;
        Ok(team)
    }

    /// Starts the helpers if they are not running (at creation, and after a fork).
    pub fn start(&self) -> std::io::Result<()> {
        let mut helpers = lock(&self.helpers);
        if !helpers.is_empty() {
            return Ok(());
        }
        self.shared.stop.store(false, SeqCst);
        for i in 1..=self.wanted {
            let s = self.shared.clone();
            helpers.push(
                std::thread::Builder::new()
                    .name(format!("u-kernels-cpu-team-{i}"))
                    .spawn(move || helper(&s))?,
            );
        }
        Ok(())
    }

    /// Waits for the running job, then stops and joins the helpers (before a fork: the child
    /// would not have them). [`Team::run`] runs on the caller alone until [`Team::start`].
    pub fn stop(&self) {
        let _running = lock(&self.busy);
        let s = &*self.shared;
        s.stop.store(true, SeqCst);
        {
            let _l = lock(&s.lock);
            s.wake.notify_all();
        }
        for h in lock(&self.helpers).drain(..) {
            let _ = h.join();
        }
    }

    /// Runs `f(t)` for every `t < tasks`, on the caller and whichever helpers join in.
    pub fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        let guard = match self.busy.try_lock() {
            Ok(g) if !self.shared.stop.load(SeqCst) && self.wanted > 0 && tasks > 1 => g,
            _ => {
                (0..tasks).for_each(f);
                return;
            }
        };
        let s = &*self.shared;
        let next = AtomicUsize::new(0);
        let work = || {
            loop {
                let t = next.fetch_add(1, SeqCst);
                if t >= tasks {
                    break;
                }
                f(t);
            }
        };
        let job: &(dyn Fn() + Sync) = &work;
        // SAFETY: erases the lifetime of `work`; helpers call it only while the epoch opened
        // below is open, and this function closes it and waits for them before returning.
        unsafe { *s.job.get() = std::mem::transmute::<&(dyn Fn() + Sync), Job>(job) };
        s.epoch.fetch_add(1, SeqCst);
        if s.sleepers.load(SeqCst) > 0 {
            let _l = s
                .lock
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            s.wake.notify_all();
        }
        // A panic here must not unwind past the helpers still running `work`: close first.
        let mine = catch_unwind(AssertUnwindSafe(work));
        s.epoch.fetch_add(1, SeqCst);
        // A helper inside the job holds at most one task; yield if it was descheduled.
        let mut spins = 0u32;
        while s.active.load(SeqCst) != 0 {
            if spins < SPINS {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        let helper_panicked = s.panicked.swap(false, SeqCst);
        drop(guard);
        if let Err(p) = mine {
            std::panic::resume_unwind(p);
        }
        if helper_panicked {
            panic!("kernels-cpu: a team task panicked");
        }
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Locks `m`, ignoring poison (the team's locks guard no data a panic could leave half-made).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A helper's loop: wait for an open epoch, join its job, repeat.
fn helper(s: &Shared) {
    let mut seen = s.epoch.load(SeqCst);
    loop {
        let Some(e) = wait_for_job(s, seen) else {
            return;
        };
        seen = e;
        s.active.fetch_add(1, SeqCst);
        if s.epoch.load(SeqCst) == e {
            // SAFETY: the epoch is still open, so the caller is inside `run` and will not
            // return before `active` drops back (see the module docs).
            let job = unsafe { &**s.job.get() };
            if catch_unwind(AssertUnwindSafe(job)).is_err() {
                s.panicked.store(true, SeqCst);
            }
        }
        s.active.fetch_sub(1, SeqCst);
    }
}

/// Spins, yields, then parks until the epoch moves past `seen` to an open one; `None` on stop.
fn wait_for_job(s: &Shared, seen: u64) -> Option<u64> {
    let open = |e: u64| e != seen && e % 2 == 1;
    for i in 0..SPINS + YIELDS {
        if s.stop.load(SeqCst) {
            return None;
        }
        let e = s.epoch.load(SeqCst);
        if open(e) {
            return Some(e);
        }
        if i < SPINS {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
    let mut l = s
        .lock
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    loop {
        s.sleepers.fetch_add(1, SeqCst);
        let e = s.epoch.load(SeqCst);
        if s.stop.load(SeqCst) {
            s.sleepers.fetch_sub(1, SeqCst);
            return None;
        }
        if open(e) {
            s.sleepers.fetch_sub(1, SeqCst);
            return Some(e);
        }
        l = s
            .wake
            .wait(l)
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        s.sleepers.fetch_sub(1, SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `tasks` tasks that count their runs, checking each ran exactly once.
    fn once_each(team: &Team, tasks: usize, nested: Option<&Team>) {
        let runs: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
        team.run(tasks, &|t| {
            runs[t].fetch_add(1, SeqCst);
            if let Some(inner) = nested {
                inner.run(3, &|_| {});
            }
        });
        assert!(runs.iter().all(|r| r.load(SeqCst) == 1));
    }

    /// Before a fork the team stops: its helpers are joined and it runs on the caller alone;
    /// started again (in the parent, or in a child that has none of them), it has helpers.
    #[test]
    fn a_stopped_team_runs_on_the_caller_and_starts_again() {
        let team = Team::new(3).expect("team");
        let ran_on = |team: &Team| {
            let ids = Mutex::new(std::collections::HashSet::new());
            team.run(256, &|_| {
                ids.lock().unwrap().insert(std::thread::current().id());
                std::thread::sleep(std::time::Duration::from_micros(50));
            });
            ids.into_inner().unwrap()
        };
        team.stop();
        assert!(lock(&team.helpers).is_empty());
        assert_eq!(
            ran_on(&team),
            [std::thread::current().id()].into_iter().collect()
        );
        team.start().expect("start");
        assert_eq!(lock(&team.helpers).len(), 2);
        // A helper that starts while a job is open waits for the next one.
        assert!(
            (0..50).any(|_| ran_on(&team).len() > 1),
            "no helper joined after the restart"
        );
        once_each(&team, 1000, None);
    }

    #[test]
    fn every_task_runs_exactly_once() {
        for threads in [1, 2, 4] {
            let team = Team::new(threads).expect("team");
            for tasks in [0, 1, 2, 7, 1000] {
                for _ in 0..50 {
                    once_each(&team, tasks, None);
                }
            }
        }
    }

    #[test]
    fn nested_and_concurrent_calls_run_serially_and_finish() {
        let team = Team::new(3).expect("team");
        once_each(&team, 64, Some(&team));
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| {
                    for _ in 0..200 {
                        once_each(&team, 16, None);
                    }
                });
            }
        });
    }

    #[test]
    fn a_panicking_task_panics_the_caller_and_the_team_survives() {
        let team = Team::new(2).expect("team");
        for _ in 0..20 {
            let r = catch_unwind(AssertUnwindSafe(|| {
                team.run(64, &|t| assert!(t != 5, "task 5"));
            }));
            assert!(r.is_err());
            once_each(&team, 64, None);
        }
    }
}
