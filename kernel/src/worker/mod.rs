//! Plugins in worker processes of their own (`isolation = "worker"` in the deployment).
//!
//! Seccomp and Landlock confine a whole process, so plugins in the host's process share the
//! union of their grants. A loader parses untrusted model files; in a worker it does so in a
//! process that holds its own grants alone (typically: read the model, nothing else — no socket,
//! no write, no process), and none of its code is ever mapped into the host's process.
//!
//! The host forks the worker before it locks itself down. The worker loads the plugin from the
//! sealed memfd of its verified bytes, locks itself down to the plugin's grants, instantiates it
//! and answers calls (`messages`) on a socket pair. The host hands its callers a
//! [`LoaderBox`] whose calls cross the socket, so nothing changes for them. An opened weight set
//! crosses once, as a sealed memfd the host maps (`weights`).

use crate::{
    loading::{instantiate_module, load_sealed},
    sandbox,
};
use abi_stable::{
    sabi_trait::TD_Opaque,
    std_types::{RResult, RSlice, RStr, RString, RVec},
};
use messages::{Call, Reply, receive, send};
use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
use std::{
    os::fd::{AsFd, AsRawFd, OwnedFd},
    sync::{Arc, Mutex},
};
use u_attest::deployment::Grants;
use u_sdk::{Loader, LoaderBox, PluginInfo, PluginInstance, UError, WeightSetBox};
use weights::{SharedWeights, share};

mod messages;
mod weights;
mod wire;

/// The host's end of a worker.
struct Channel {
    plugin: String,
    pid: libc::pid_t,
    socket: Mutex<OwnedFd>,
}

/// A running worker process with its plugin instantiated.
pub struct Worker {
    channel: Arc<Channel>,
    info: PluginInfo,
}

impl Worker {
    /// Forks a worker for loader plugin `name`: it loads the root module `symbol` from `memfd`,
    /// locks itself down to `grants` and instantiates the plugin with `config` and `threads`.
    /// Returns once the worker says it is ready, or why it is not.
    pub fn start(
        name: &str,
        memfd: OwnedFd,
        symbol: &str,
        grants: &Grants,
        config: &str,
        threads: u32,
    ) -> Result<Worker, String> {
        let (host_end, worker_end) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .map_err(|e| format!("socketpair: {e}"))?;
        // SAFETY: the host forks before it starts any thread (before lock-down), so the child
        // inherits no lock another thread holds; the child leaves through `_exit` only.
        match unsafe { libc::fork() } {
            -1 => Err(format!("fork: {}", std::io::Error::last_os_error())),
            0 => {
                drop(host_end);
                let code = run_worker(name, worker_end, memfd, symbol, grants, config, threads);
                // SAFETY: ends the child without running the host's exit handlers.
                unsafe { libc::_exit(code) }
            }
            pid => {
                drop(worker_end);
                let channel = Arc::new(Channel {
                    plugin: name.to_string(),
                    pid,
                    socket: Mutex::new(host_end),
                });
                let socket = channel.socket.lock().unwrap_or_else(|p| p.into_inner());
                let ready = receive::<Reply>(socket.as_fd()).map_err(|e| e.to_string())?;
                drop(socket);
                match ready {
                    Some((Reply::Ready { summary, details }, _)) => {
                        tracing::info!(plugin = name, pid, "runs in a worker process");
                        Ok(Worker {
                            info: PluginInfo {
                                summary: summary.into(),
                                details: details.into_iter().map(RString::from).collect(),
                            },
                            channel,
                        })
                    }
                    Some((Reply::Failed(e), _)) => Err(e.to_string()),
                    Some(_) => Err("the worker's first message was not `ready`".into()),
                    None => Err(channel.ended()),
                }
            }
        }
    }

    /// The plugin's self-description and its entry object, whose calls go to the worker.
    pub fn into_instance(self) -> (PluginInfo, PluginInstance) {
        let loader = RemoteLoader {
            channel: self.channel,
        };
        let instance = PluginInstance::Loader(LoaderBox::from_value(loader, TD_Opaque));
        (self.info, instance)
    }
}

impl Channel {
    /// Sends `call` and waits for the answer (calls from several threads take turns).
    fn call(&self, call: &Call) -> Result<(Reply, Option<OwnedFd>), UError> {
        let socket = self.socket.lock().unwrap_or_else(|p| p.into_inner());
        let worker = |e: std::io::Error| match e.kind() {
            std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe => {
                UError::new(u_sdk::ErrorKind::Internal, self.ended())
            }
            _ => UError::io(format!("worker of {}", self.plugin), e),
        };
        send(socket.as_fd(), call, None).map_err(worker)?;
        match receive::<Reply>(socket.as_fd()).map_err(worker)? {
            Some((Reply::Failed(e), _)) => Err(e),
            Some(answer) => Ok(answer),
            None => Err(UError::new(u_sdk::ErrorKind::Internal, self.ended())),
        }
    }

    /// Why the worker stopped answering, as its exit status says.
    fn ended(&self) -> String {
        let mut status = 0;
        // SAFETY: waits for this channel's own child process.
        let how = match unsafe { libc::waitpid(self.pid, &mut status, 0) } {
            pid if pid == self.pid && libc::WIFSIGNALED(status) => {
                format!("was killed by signal {}", libc::WTERMSIG(status))
            }
            pid if pid == self.pid => format!("exited with status {}", libc::WEXITSTATUS(status)),
            _ => "ended".to_string(),
        };
        format!(
            "the worker process of {} (pid {}) {how}",
            self.plugin, self.pid
        )
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        // Shutting the socket down ends the worker's loop; reap it so it leaves no zombie.
        let socket = self.socket.get_mut().unwrap_or_else(|p| p.into_inner());
        // SAFETY: shuts down a socket this channel owns; it is closed when dropped.
        unsafe { libc::shutdown(socket.as_raw_fd(), libc::SHUT_RDWR) };
        // SAFETY: waits for this channel's own child process.
        unsafe { libc::waitpid(self.pid, std::ptr::null_mut(), 0) };
    }
}

/// The host's [`Loader`] for a plugin in a worker: every call crosses the socket.
#[derive(Clone)]
struct RemoteLoader {
    channel: Arc<Channel>,
}

impl Loader for RemoteLoader {
    fn formats(&self) -> RResult<RVec<RString>, UError> {
        self.channel
            .call(&Call::Formats)
            .and_then(|answer| match answer {
                (Reply::Formats(f), _) => Ok(f.into_iter().map(RString::from).collect()),
                _ => Err(unexpected()),
            })
            .into()
    }

    fn can_open(&self, path: RStr<'_>, head: RSlice<'_, u8>) -> RResult<bool, UError> {
        let call = Call::CanOpen {
            path: path.to_string(),
            head: head.to_vec(),
        };
        self.channel
            .call(&call)
            .and_then(|answer| match answer {
                (Reply::CanOpen(yes), _) => Ok(yes),
                _ => Err(unexpected()),
            })
            .into()
    }

    fn open(&self, path: RStr<'_>) -> RResult<WeightSetBox, UError> {
        let call = Call::Open {
            path: path.to_string(),
        };
        self.channel
            .call(&call)
            .and_then(|answer| match answer {
                (Reply::Opened { header_at }, Some(memfd)) => SharedWeights::map(memfd, header_at),
                _ => Err(unexpected()),
            })
            .map(|w| WeightSetBox::from_value(w, TD_Opaque))
            .into()
    }
}

fn unexpected() -> UError {
    UError::new(
        u_sdk::ErrorKind::Internal,
        "the worker answered a different call",
    )
}

/// The worker process: loads, locks down, instantiates, then answers calls until the host
/// closes the socket. Returns the exit status.
fn run_worker(
    name: &str,
    socket: OwnedFd,
    memfd: OwnedFd,
    symbol: &str,
    grants: &Grants,
    config: &str,
    threads: u32,
) -> i32 {
    // SAFETY: asks the kernel to kill this process when the host dies.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    close_other_fds(&[socket.as_raw_fd(), memfd.as_raw_fd()]);
    let started = load_sealed(memfd, symbol).and_then(|module| {
        let mut plan = sandbox::Plan::default();
        plan.add(grants);
        sandbox::lock_down(&plan);
        match instantiate_module(module, name, grants, config, threads)? {
            (info, PluginInstance::Loader(loader)) => Ok((info, loader)),
            (_, other) => Err(format!(
                "a {} plugin cannot run in a worker",
                other.kind_name()
            )),
        }
    });
    tracing::info!(
        plugin = name,
        pid = std::process::id(),
        "worker locked down to its own grants"
    );
    let (info, loader) = match started {
        Ok(started) => started,
        Err(e) => {
            let _ = send(socket.as_fd(), &Reply::Failed(UError::invalid(e)), None);
            return 1;
        }
    };
    let ready = Reply::Ready {
        summary: info.summary.into_string(),
        details: info.details.into_iter().map(RString::into_string).collect(),
    };
    if send(socket.as_fd(), &ready, None).is_err() {
        return 1;
    }
    while let Ok(Some((call, _))) = receive::<Call>(socket.as_fd()) {
        let (reply, memfd) = answer(name, &loader, call);
        let sent = send(socket.as_fd(), &reply, memfd.as_ref().map(|fd| fd.as_fd()));
        if sent.is_err() {
            return 1;
        }
    }
    0
}

fn answer(name: &str, loader: &LoaderBox, call: Call) -> (Reply, Option<OwnedFd>) {
    let answered = match call {
        Call::Formats => loader.formats().into_result().map(|f| {
            (
                Reply::Formats(f.into_iter().map(RString::into_string).collect()),
                None,
            )
        }),
        Call::CanOpen { path, head } => loader
            .can_open(path.as_str().into(), head.as_slice().into())
            .into_result()
            .map(|yes| (Reply::CanOpen(yes), None)),
        Call::Open { path } => loader
            .open(path.as_str().into())
            .into_result()
            .and_then(|weights| share(name, &weights))
            .map(|(memfd, header_at)| (Reply::Opened { header_at }, Some(memfd))),
    };
    answered.unwrap_or_else(|e| (Reply::Failed(e), None))
}

/// Closes every descriptor but standard input, output, error and `keep` (what the host had open
/// is not the worker's business).
fn close_other_fds(keep: &[i32]) {
    let open: Vec<i32> = std::fs::read_dir("/proc/self/fd")
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    for fd in open.into_iter().filter(|fd| *fd > 2 && !keep.contains(fd)) {
        // SAFETY: the worker owns no object that uses these descriptors.
        unsafe { libc::close(fd) };
    }
}
