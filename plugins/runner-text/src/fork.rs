//! Fork isolation: every request runs in a process of its own, forked from a warmed parent.
//!
//! The engine is built as usual and, when the deployment gives a warm-up prompt, prefills it,
//! so its KV sits in the prompt cache. Then every plugin stops its threads
//! ([`Host::prepare_fork`](u_sdk::Host)) and the runner forks a **zygote**: a copy of the
//! process with a single thread, which only ever forks session processes on request, so no
//! fork happens while another thread might hold a lock. A session process starts with the
//! weights, the caches and the warm KV shared copy-on-write with the parent; it forbids itself
//! every further process (a seccomp filter stacked on the deployment's), takes its limits
//! (`RLIMIT_AS` above what it maps at start, `RLIMIT_CPU`), restarts the plugins' threads, and
//! waits for one request on a socket pair. The parent keeps a few sessions forked ahead
//! (`fork_pool`), hands each request to one as a JSON line, and relays the JSON lines it sends
//! back — tokens, then the summary or the error — to the caller's sink. A session that dies
//! before its summary (a crash, `RLIMIT_AS`, `RLIMIT_CPU`) costs only its own request an
//! internal error (a 5xx); the zygote logs how it ended, and the next request gets a fresh
//! process.
//!
//! Limits are rlimits: cgroup v2 limits would need a delegated cgroup this process could write,
//! which a sandboxed plugin does not have (the log says so when limits are set).

use abi_stable::std_types::{ROption, RResult, RSlice, RStr, RString, RVec};
use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use nix::unistd::{ForkResult, Pid, fork};
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use u_sdk::{
    AdapterInfo, CheckpointInfo, CheckpointRequest, Engine, EngineBox, EngineStats, ErrorKind,
    GenerateRequest, GenerateSummary, GeneratedToken, HostBox, TokenLogprob, TokenSink,
    TokenSinkBox, TokenizeRequest, TranscribeRequest, Transcript, UError,
};

/// The deployment's choices for fork isolation (`[plugins.config]` of runner-text).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ForkSettings {
    /// Session processes kept forked ahead of requests (`fork_pool`, default 2).
    pub pool: usize,
    /// Text prefilled once in the parent, so every session finds its KV cached
    /// (`warm_prompt`; typically the system prompt's rendering).
    pub warm_prompt: String,
    /// Address space a session may add to what it maps when forked, in MiB
    /// (`session_memory_mb`; 0: no limit).
    pub memory_mb: u64,
    /// CPU seconds a session may use (`session_cpu_seconds`; 0: no limit).
    pub cpu_seconds: u64,
    /// Sessions that run at once (`[model] max_running`); more requests wait.
    pub max_running: usize,
    /// Requests that may wait for a session (`[model] max_queued`); past that, `Busy` (429).
    pub max_queued: usize,
    /// The parent's address space when it forked the zygote, in bytes (read from its
    /// `/proc/self/status`: a session's own `/proc` entry lies outside the sandbox's rules).
    pub mapped_at_fork: Option<u64>,
}

/// Set in the environment (to `1`) by tests: a prompt holding [`ABORT_TRIGGER`] makes its
/// session abort, one holding [`MEMORY_TRIGGER`] makes it allocate until its limit stops it,
/// one holding [`STALL_TRIGGER`] holds its session a while.
pub const TEST_TRIGGERS_ENV: &str = "U_FORK_TEST_TRIGGERS";
/// See [`TEST_TRIGGERS_ENV`].
pub const ABORT_TRIGGER: &str = "<<u-test:abort>>";
/// See [`TEST_TRIGGERS_ENV`].
pub const MEMORY_TRIGGER: &str = "<<u-test:exhaust-memory>>";
/// See [`TEST_TRIGGERS_ENV`]: the session waits two seconds before it generates.
pub const STALL_TRIGGER: &str = "<<u-test:stall>>";

/// What a session process sends back, one JSON line each.
#[derive(Serialize, Deserialize)]
enum Frame {
    /// A generated token (the fields of [`GeneratedToken`], owned).
    Token {
        id: u32,
        text: String,
        logprob: Option<TokenLogprob>,
        top: Vec<TokenLogprob>,
    },
    /// The request finished.
    Done(GenerateSummary),
    /// The request failed.
    Failed(UError),
}

/// Starts fork isolation over `engine` (already built): warms it, stops the threads, forks the
/// zygote and the first sessions. Returns the engine transports call.
pub fn start(
    engine: EngineBox,
    host: HostBox,
    settings: ForkSettings,
) -> Result<EngineBox, UError> {
    if !settings.warm_prompt.is_empty() {
        let s = warm(&engine, &settings.warm_prompt)?;
        host.info(&format!(
            "runner-text: fork isolation: warm-up of {} prompt tokens, {} of them from the cache",
            s.prompt_tokens, s.cached_tokens
        ));
    }
    let (ours, theirs) = UnixStream::pair()
        .map_err(|e| UError::io("fork isolation: socket pair for the zygote", e))?;
    host.prepare_fork().into_result()?;
    let settings = ForkSettings {
        mapped_at_fork: mapped_bytes(),
        ..settings
    };
    // SAFETY: every plugin has stopped its threads (prepare_fork), so the only other threads
    // are the host's, blocked in calls that touch no lock the child uses; the child runs the
    // zygote loop, which forks sessions and exits, never returning here.
    let forked = unsafe { fork() };
    match forked {
        Ok(ForkResult::Child) => {
            drop(ours);
            zygote(theirs, &engine, &host, &settings)
        }
        Ok(ForkResult::Parent { child }) => {
            drop(theirs);
            host.after_fork(false);
            host.info(&format!(
                "runner-text: fork isolation: zygote {child}, {} sessions forked ahead{}",
                settings.pool,
                limits_note(&settings)
            ));
            let sessions = Sessions {
                inner: engine,
                zygote: Mutex::new(ours),
                idle: Mutex::new(Vec::new()),
                pool: settings.pool,
                slots: Slots {
                    taken: Mutex::new((0, 0)),
                    freed: std::sync::Condvar::new(),
                    max_running: settings.max_running.max(1),
                    max_queued: settings.max_queued,
                },
                running: AtomicU32::new(0),
                counts: Counts::default(),
            };
            for _ in 0..settings.pool {
                let s = sessions.spawn()?;
                lock(&sessions.idle).push(s);
            }
            Ok(EngineBox::new(ForkEngine(std::sync::Arc::new(sessions))))
        }
        Err(e) => {
            host.after_fork(false);
            Err(UError::new(
                ErrorKind::PermissionDenied,
                format!(
                    "fork isolation: cannot fork the zygote: {e} (is `process.fork` granted to runner-text?)"
                ),
            ))
        }
    }
}

fn limits_note(s: &ForkSettings) -> String {
    if s.memory_mb == 0 && s.cpu_seconds == 0 {
        return "; no per-session limits".into();
    }
    format!(
        "; per-session limits as rlimits (RLIMIT_AS +{} MiB, RLIMIT_CPU {} s; 0 = none), not cgroup v2: no delegated cgroup is writable from the sandbox",
        s.memory_mb, s.cpu_seconds
    )
}

/// Prefills `prompt` once (one token generated and dropped), so its KV is cached. A KV cache
/// that persists its prefix tree (cache-kv's `dir`) has it from the last run: a warm restart
/// maps it back instead of prefilling (the summary's cached tokens say how much).
fn warm(engine: &EngineBox, prompt: &str) -> Result<GenerateSummary, UError> {
    let model = engine
        .models()
        .into_result()?
        .into_iter()
        .next()
        .ok_or_else(|| internal("fork isolation: the engine serves no model"))?;
    let request = GenerateRequest::new(&model, prompt, 1, crate::sampler::greedy());
    engine
        .generate(
            &request,
            TokenSinkBox::from_value(Discard, abi_stable::sabi_trait::TD_Opaque),
        )
        .into_result()
}

/// A sink that keeps nothing.
struct Discard;

impl TokenSink for Discard {
    fn token(&mut self, _: &GeneratedToken<'_>) -> bool {
        true
    }
}

/// The zygote: forks one session per byte read from `control` and sends the parent its end of
/// the session's socket pair; reaps sessions and logs how they ended; exits when the parent
/// closes `control`.
fn zygote(control: UnixStream, engine: &EngineBox, host: &HostBox, settings: &ForkSettings) -> ! {
    let mut control = control;
    let _ = control.set_read_timeout(Some(std::time::Duration::from_millis(500)));
    loop {
        reap(host);
        let mut byte = [0u8; 1];
        match control.read(&mut byte) {
            Ok(0) => std::process::exit(0),
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                continue;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => std::process::exit(0),
        }
        let Ok((parent_end, session_end)) = UnixStream::pair() else {
            std::process::exit(1);
        };
        // SAFETY: the zygote has one thread (fork copies only the caller, and it started none).
        match unsafe { fork() } {
            Ok(ForkResult::Child) => {
                drop(parent_end);
                drop(control);
                session(session_end, engine, host, settings)
            }
            Ok(ForkResult::Parent { child }) => {
                drop(session_end);
                let pid = child.as_raw().to_le_bytes();
                let fds = [parent_end.as_raw_fd()];
                let sent = sendmsg::<()>(
                    control.as_raw_fd(),
                    &[IoSlice::new(&pid)],
                    &[ControlMessage::ScmRights(&fds)],
                    MsgFlags::empty(),
                    None,
                );
                if sent.is_err() {
                    std::process::exit(0);
                }
            }
            Err(e) => {
                host.warn(&format!("runner-text: zygote: fork failed: {e}"));
                let _ = control.write_all(&0i32.to_le_bytes());
            }
        }
    }
}

/// Collects the sessions that ended and logs those that did not end cleanly.
fn reap(host: &HostBox) {
    use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
    while let Ok(status) = waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
        match status {
            WaitStatus::Exited(_, 0) => {}
            WaitStatus::Exited(pid, code) => host.warn(&format!(
                "runner-text: session {pid} exited with status {code}"
            )),
            WaitStatus::Signaled(pid, signal, _) => host.warn(&format!(
                "runner-text: session {pid} was killed by {signal}"
            )),
            WaitStatus::StillAlive => return,
            _ => {}
        }
    }
}

/// A session process: locks itself in, restarts the threads, serves one request, exits.
fn session(socket: UnixStream, engine: &EngineBox, host: &HostBox, settings: &ForkSettings) -> ! {
    if let Err(e) = host.forbid_processes().into_result() {
        host.warn(&format!(
            "runner-text: session cannot forbid processes: {e}"
        ));
    }
    host.after_fork(true);
    set_limits(host, settings);
    let mut reader = BufReader::new(&socket);
    let mut line = String::new();
    if reader.read_line(&mut line).unwrap_or(0) == 0 {
        std::process::exit(0);
    }
    let mut out = &socket;
    let frame = match serde_json::from_str::<GenerateRequest>(&line) {
        Ok(request) => {
            test_triggers(&request, settings);
            match socket.try_clone() {
                Ok(out) => {
                    let sink =
                        TokenSinkBox::from_value(Relay { out }, abi_stable::sabi_trait::TD_Opaque);
                    match engine.generate(&request, sink).into_result() {
                        Ok(summary) => Frame::Done(summary),
                        Err(e) => Frame::Failed(e),
                    }
                }
                Err(e) => Frame::Failed(UError::io("fork isolation: session socket", e)),
            }
        }
        Err(e) => Frame::Failed(UError::invalid(format!("fork isolation: bad request: {e}"))),
    };
    let _ = write_frame(&mut out, &frame);
    std::process::exit(0)
}

/// Sets the session's rlimits (see [`ForkSettings`]); the threads the plugins restarted count
/// within the memory limit.
fn set_limits(host: &HostBox, settings: &ForkSettings) {
    use nix::sys::resource::{Resource, setrlimit};
    if settings.memory_mb > 0 {
        let limit = settings
            .mapped_at_fork
            .map(|m| m.saturating_add(settings.memory_mb << 20));
        match limit.map(|l| setrlimit(Resource::RLIMIT_AS, l, l)) {
            Some(Ok(())) => {}
            Some(Err(e)) => host.warn(&format!("runner-text: session memory limit not set: {e}")),
            None => host.warn(
                "runner-text: session memory limit not set: the parent's /proc/self/status was unreadable",
            ),
        }
    }
    if settings.cpu_seconds > 0 {
        let s = settings.cpu_seconds;
        if let Err(e) = setrlimit(Resource::RLIMIT_CPU, s, s) {
            host.warn(&format!("runner-text: session CPU limit not set: {e}"));
        }
    }
}

/// The process's mapped address space (`VmSize` of `/proc/self/status`), in bytes.
fn mapped_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmSize:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib << 10)
}

/// The test-only faults ([`TEST_TRIGGERS_ENV`]).
fn test_triggers(request: &GenerateRequest, settings: &ForkSettings) {
    if std::env::var(TEST_TRIGGERS_ENV).as_deref() != Ok("1") {
        return;
    }
    let text = std::iter::once(request.prompt.as_str())
        .chain(request.messages.iter().map(|m| m.content.as_str()))
        .collect::<String>();
    if text.contains(ABORT_TRIGGER) {
        std::process::abort();
    }
    if text.contains(STALL_TRIGGER) {
        std::thread::sleep(std::time::Duration::from_secs(2));
    }
    if text.contains(MEMORY_TRIGGER) {
        // Past twice the limit, the limit did not work: exit rather than eat the machine.
        let mut hoard: Vec<Vec<u8>> = Vec::new();
        for _ in 0..(2 * settings.memory_mb.max(1)).div_ceil(64) {
            hoard.push(vec![1u8; 64 << 20]);
            std::hint::black_box(&hoard);
        }
        std::process::exit(3);
    }
}

/// The session's sink: each token as a [`Frame::Token`] line; a failed write (the parent
/// closed the socket: its client went away) cancels the request.
struct Relay {
    out: UnixStream,
}

impl TokenSink for Relay {
    fn token(&mut self, t: &GeneratedToken<'_>) -> bool {
        let frame = Frame::Token {
            id: t.id,
            text: t.text.to_string(),
            logprob: t.logprob.clone().into_option(),
            top: t.top_logprobs.to_vec(),
        };
        write_frame(&mut self.out, &frame).is_ok()
    }
}

fn write_frame(out: &mut impl Write, frame: &Frame) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(frame).map_err(std::io::Error::other)?;
    line.push(b'\n');
    out.write_all(&line)
}

fn internal(message: &str) -> UError {
    UError::new(ErrorKind::Internal, message)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Totals over the sessions, for `/metrics`.
#[derive(Default)]
struct Counts {
    requests: AtomicU64,
    prompt_tokens: AtomicU64,
    cached_tokens: AtomicU64,
    generated_tokens: AtomicU64,
    failed_sessions: AtomicU64,
}

/// The engine transports call under fork isolation: requests go to session processes; the
/// rest (names, tokenizer, checkpoints) to the parent's engine.
#[derive(Clone)]
struct ForkEngine(std::sync::Arc<Sessions>);

impl std::ops::Deref for ForkEngine {
    type Target = Sessions;
    fn deref(&self) -> &Sessions {
        &self.0
    }
}

/// The session pool behind a [`ForkEngine`].
struct Sessions {
    inner: EngineBox,
    zygote: Mutex<UnixStream>,
    idle: Mutex<Vec<UnixStream>>,
    pool: usize,
    slots: Slots,
    running: AtomicU32,
    counts: Counts,
}

/// The bound on sessions alive at once: `max_running` run, `max_queued` more wait for one of
/// them to end, and a request past both is refused as `Busy` — the same bounds as thread
/// mode's scheduler, so a burst cannot fork a process per request without limit.
struct Slots {
    /// (running, waiting).
    taken: Mutex<(usize, usize)>,
    freed: std::sync::Condvar,
    max_running: usize,
    max_queued: usize,
}

impl Slots {
    /// Waits for a running slot; `Busy` when the wait list is full.
    fn acquire(&self) -> Result<SlotGuard<'_>, UError> {
        let mut t = lock(&self.taken);
        if t.0 >= self.max_running {
            if t.1 >= self.max_queued {
                return Err(UError::new(
                    ErrorKind::Busy,
                    format!(
                        "the engine is at capacity ({} running and {} queued requests); retry later",
                        self.max_running, self.max_queued
                    ),
                ));
            }
            t.1 += 1;
            while t.0 >= self.max_running {
                t = self
                    .freed
                    .wait(t)
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
            }
            t.1 -= 1;
        }
        t.0 += 1;
        Ok(SlotGuard(self))
    }
}

/// A running slot, given back when dropped.
struct SlotGuard<'a>(&'a Slots);

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        lock(&self.0.taken).0 -= 1;
        self.0.freed.notify_one();
    }
}

impl Sessions {
    /// Asks the zygote for a new session; returns the parent's end of its socket.
    fn spawn(&self) -> Result<UnixStream, UError> {
        let died = || internal("fork isolation: the zygote is gone");
        let z = lock(&self.zygote);
        (&*z).write_all(&[1]).map_err(|_| died())?;
        let mut pid = [0u8; 4];
        let mut cmsg = nix::cmsg_space!([std::os::fd::RawFd; 1]);
        let mut iov = [IoSliceMut::new(&mut pid)];
        let msg = recvmsg::<()>(z.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::empty())
            .map_err(|_| died())?;
        for c in msg.cmsgs().map_err(|_| died())? {
            if let ControlMessageOwned::ScmRights(fds) = c
                && let Some(&fd) = fds.first()
            {
                // SAFETY: the kernel just installed `fd` in this process for us alone.
                return Ok(UnixStream::from(unsafe { OwnedFd::from_raw_fd(fd) }));
            }
        }
        Err(internal(
            "fork isolation: the zygote could not fork a session",
        ))
    }

    /// Runs `request` in session `s`, relaying its frames to `sink`.
    fn relay(
        &self,
        s: UnixStream,
        request: &GenerateRequest,
        sink: &mut TokenSinkBox,
    ) -> Result<GenerateSummary, UError> {
        let gone = || {
            self.counts.failed_sessions.fetch_add(1, Ordering::Relaxed);
            internal(
                "the session process ended before finishing the request (it crashed or \
                 exceeded a limit; the server log says how it ended)",
            )
        };
        let mut line = serde_json::to_vec(request)
            .map_err(|e| UError::invalid(format!("fork isolation: request: {e}")))?;
        line.push(b'\n');
        (&s).write_all(&line).map_err(|_| gone())?;
        let mut reader = BufReader::new(&s);
        let mut line = String::new();
        let mut relayed = 0u32;
        loop {
            line.clear();
            if reader.read_line(&mut line).map_err(|_| gone())? == 0 {
                return Err(gone());
            }
            let frame: Frame = serde_json::from_str(&line).map_err(|_| gone())?;
            match frame {
                Frame::Token {
                    id,
                    text,
                    logprob,
                    top,
                } => {
                    relayed += 1;
                    let t = GeneratedToken {
                        id,
                        text: RStr::from_str(&text),
                        logprob: logprob.into(),
                        top_logprobs: RSlice::from_slice(&top),
                    };
                    if !sink.token(&t) {
                        // Closing the socket makes the session's next write fail: it cancels.
                        drop(reader);
                        drop(s);
                        return Ok(GenerateSummary {
                            prompt_tokens: 0,
                            cached_tokens: 0,
                            cache_written_tokens: 0,
                            generated_tokens: relayed,
                            tokens: RVec::new(),
                            finish: u_sdk::FinishReason::Cancelled,
                            stop_sequence: ROption::RNone,
                            prompt_ms: 0.0,
                            generate_ms: 0.0,
                            draft_tokens: 0,
                            accepted_tokens: 0,
                        });
                    }
                }
                Frame::Done(summary) => return Ok(summary),
                Frame::Failed(e) => return Err(e),
            }
        }
    }
}

impl ForkEngine {
    /// Forks a session to replace the one just taken, on a thread of its own: a fork copies
    /// the page tables of the whole model, which the request being served should not wait for.
    fn refill(&self) {
        if lock(&self.idle).len() >= self.pool {
            return;
        }
        let this = self.clone();
        let forked = std::thread::Builder::new()
            .name("u-fork-refill".into())
            .spawn(move || {
                if let Ok(next) = this.spawn() {
                    lock(&this.idle).push(next);
                }
            });
        // Without a thread the next request forks its own session.
        drop(forked);
    }
}

impl Engine for ForkEngine {
    fn models(&self) -> RResult<RVec<RString>, UError> {
        self.inner.models()
    }

    fn generate(
        &self,
        request: &GenerateRequest,
        mut sink: TokenSinkBox,
    ) -> RResult<GenerateSummary, UError> {
        let _slot = match self.slots.acquire() {
            Ok(slot) => slot,
            Err(e) => return RResult::RErr(e),
        };
        let taken = lock(&self.idle).pop();
        let session = match taken {
            Some(s) => Ok(s),
            None => self.spawn(),
        };
        let result = session.and_then(|s| {
            self.running.fetch_add(1, Ordering::Relaxed);
            self.counts.requests.fetch_add(1, Ordering::Relaxed);
            self.refill();
            let r = self.relay(s, request, &mut sink);
            self.running.fetch_sub(1, Ordering::Relaxed);
            r
        });
        if let Ok(summary) = &result {
            let c = &self.counts;
            c.prompt_tokens
                .fetch_add(summary.prompt_tokens.into(), Ordering::Relaxed);
            c.cached_tokens
                .fetch_add(summary.cached_tokens.into(), Ordering::Relaxed);
            c.generated_tokens
                .fetch_add(summary.generated_tokens.into(), Ordering::Relaxed);
        }
        result.into()
    }

    fn stats(&self) -> RResult<EngineStats, UError> {
        self.inner
            .stats()
            .into_result()
            .map(|mut s| {
                let c = &self.counts;
                s.requests += c.requests.load(Ordering::Relaxed);
                s.running = self.running.load(Ordering::Relaxed);
                s.queued = lock(&self.slots.taken).1 as u32;
                s.prompt_tokens += c.prompt_tokens.load(Ordering::Relaxed);
                s.cached_tokens += c.cached_tokens.load(Ordering::Relaxed);
                s.generated_tokens += c.generated_tokens.load(Ordering::Relaxed);
                s.model_counters.push(u_sdk::ModelCounter {
                    name: "fork_failed_sessions".into(),
                    help: "Session processes that ended before finishing their request".into(),
                    value: c.failed_sessions.load(Ordering::Relaxed) as f64,
                    gauge: false,
                });
                s
            })
            .into()
    }

    fn flush_cache(&self, model: RStr<'_>) -> RResult<u64, UError> {
        self.inner.flush_cache(model)
    }

    fn checkpoint(&self, request: &CheckpointRequest) -> RResult<RVec<CheckpointInfo>, UError> {
        self.inner.checkpoint(request)
    }

    fn embed(&self, model: RStr<'_>, input: RStr<'_>) -> RResult<RVec<f32>, UError> {
        self.inner.embed(model, input)
    }

    fn tokenize(&self, request: &TokenizeRequest) -> RResult<RVec<u32>, UError> {
        self.inner.tokenize(request)
    }

    fn detokenize(&self, model: RStr<'_>, tokens: RSlice<'_, u32>) -> RResult<RVec<u8>, UError> {
        self.inner.detokenize(model, tokens)
    }

    fn embed_tokens(&self, model: RStr<'_>, tokens: RSlice<'_, u32>) -> RResult<RVec<f32>, UError> {
        self.inner.embed_tokens(model, tokens)
    }

    fn embed_image(&self, model: RStr<'_>, image: RSlice<'_, u8>) -> RResult<RVec<f32>, UError> {
        self.inner.embed_image(model, image)
    }

    fn load_adapter(&self, name: RStr<'_>, _path: RStr<'_>) -> RResult<AdapterInfo, UError> {
        RResult::RErr(UError::unsupported(format!(
            "adapter `{name}`: loading adapters at run time is not available under fork isolation (sessions are forked from the state at start)"
        )))
    }

    fn unload_adapter(&self, name: RStr<'_>) -> RResult<bool, UError> {
        self.inner.unload_adapter(name)
    }

    fn transcribe(&self, request: &TranscribeRequest) -> RResult<Transcript, UError> {
        self.inner.transcribe(request)
    }
}
