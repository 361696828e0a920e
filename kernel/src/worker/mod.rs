//! Plugins in worker processes of their own (`isolation = "worker"` in the deployment).
//!
//! Seccomp and Landlock confine a whole process, so plugins in the host's process share the
//! union of their grants. A loader parses untrusted model files; in a worker it does so in a
//! process that holds its own grants alone (typically: read the model, nothing else — no socket,
//! no write, no process), and none of its code is ever mapped into the host's process.
//!
//! The host forks the worker before it locks itself down. The worker loads the plugin from the
//! sealed memfd of its verified bytes, locks itself down to the plugin's grants, instantiates it
//! and answers calls on a `SOCK_SEQPACKET` socket pair, one message ([`wire`]) per call. The host hands
//! its callers a [`LoaderBox`] whose calls cross the socket, so nothing changes for them. An
//! opened weight set crosses once: the worker writes every tensor (64-byte aligned) and then a
//! header (metadata, tensor table) into a memfd, seals it against any further change and
//! passes the descriptor back (`SCM_RIGHTS`); the host checks the seals and the header's bounds
//! and serves tensor views from a read-only mapping of it, with no further calls.

use crate::{
    loading::{instantiate_module, load_sealed},
    sandbox,
};
use abi_stable::{
    sabi_trait::TD_Opaque,
    std_types::{RResult, RSlice, RStr, RString, RVec},
};
use nix::{
    fcntl::{FcntlArg, SealFlag, fcntl},
    sys::{
        memfd::{MFdFlags, memfd_create},
        socket::{
            AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType,
            recvmsg, sendmsg, socketpair,
        },
    },
};
use std::{
    ffi::CString,
    io::{IoSlice, IoSliceMut, Write},
    os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
    sync::{Arc, Mutex},
};
use u_attest::deployment::Grants;
use u_sdk::{
    Loader, LoaderBox, MetaValue, PluginInfo, PluginInstance, TensorInfo, TensorView, UError,
    WeightSet, WeightSetBox,
};
use wire::{Reader, Wire, Writer};

mod wire;

/// Where tensors start in a shared weight set: cache-line (and SIMD) alignment.
const TENSOR_ALIGN: u64 = 64;
/// The largest message either side sends (a request carries at most 4 KiB of a file's head).
const MAX_MESSAGE: usize = 256 * 1024;

/// A call the host makes to a worker's loader.
enum Call {
    Formats,
    CanOpen { path: String, head: Vec<u8> },
    Open { path: String },
}

/// A worker's answer.
enum Reply {
    /// The worker is locked down and its plugin instantiated.
    Ready {
        summary: String,
        details: Vec<String>,
    },
    Formats(Vec<String>),
    CanOpen(bool),
    /// A weight set in the attached memfd: tensors first, then the [`Header`] at `header_at`.
    Opened {
        header_at: u64,
    },
    Failed(UError),
}

/// What a shared weight set holds besides its tensors' bytes.
struct Header {
    format: String,
    architecture: Option<String>,
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<Placed>,
}

/// A tensor and where its bytes start in the memfd.
struct Placed {
    info: TensorInfo,
    offset: u64,
}

impl Wire for Call {
    fn put(&self, w: &mut Writer) {
        match self {
            Call::Formats => w.u8(0),
            Call::CanOpen { path, head } => {
                w.u8(1);
                w.str(path);
                w.bytes(head);
            }
            Call::Open { path } => {
                w.u8(2);
                w.str(path);
            }
        }
    }

    fn get(r: &mut Reader<'_>) -> Result<Self, String> {
        Ok(match r.u8()? {
            0 => Call::Formats,
            1 => Call::CanOpen {
                path: r.str()?,
                head: r.bytes()?.to_vec(),
            },
            2 => Call::Open { path: r.str()? },
            tag => return Err(format!("unknown call {tag}")),
        })
    }
}

impl Wire for Reply {
    fn put(&self, w: &mut Writer) {
        match self {
            Reply::Ready { summary, details } => {
                w.u8(0);
                w.str(summary);
                w.list(details, |w, d| w.str(d));
            }
            Reply::Formats(formats) => {
                w.u8(1);
                w.list(formats, |w, f| w.str(f));
            }
            Reply::CanOpen(yes) => {
                w.u8(2);
                w.u8(*yes as u8);
            }
            Reply::Opened { header_at } => {
                w.u8(3);
                w.u64(*header_at);
            }
            Reply::Failed(e) => {
                w.u8(4);
                e.put(w);
            }
        }
    }

    fn get(r: &mut Reader<'_>) -> Result<Self, String> {
        Ok(match r.u8()? {
            0 => Reply::Ready {
                summary: r.str()?,
                details: r.list(8, Reader::str)?,
            },
            1 => Reply::Formats(r.list(8, Reader::str)?),
            2 => Reply::CanOpen(r.u8()? != 0),
            3 => Reply::Opened {
                header_at: r.u64()?,
            },
            4 => Reply::Failed(UError::get(r)?),
            tag => return Err(format!("unknown reply {tag}")),
        })
    }
}

impl Wire for Header {
    fn put(&self, w: &mut Writer) {
        w.str(&self.format);
        w.list(self.architecture.as_slice(), |w, a| w.str(a));
        w.list(&self.metadata, |w, (k, v)| {
            w.str(k);
            v.put(w);
        });
        w.list(&self.tensors, |w, t| {
            t.info.put(w);
            w.u64(t.offset);
        });
    }

    fn get(r: &mut Reader<'_>) -> Result<Self, String> {
        Ok(Header {
            format: r.str()?,
            architecture: r.list(8, Reader::str)?.pop(),
            metadata: r.list(9, |r| Ok((r.str()?, MetaValue::get(r)?)))?,
            tensors: r.list(33, |r| {
                Ok(Placed {
                    info: TensorInfo::get(r)?,
                    offset: r.u64()?,
                })
            })?,
        })
    }
}

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

/// A read-only mapping of a sealed memfd.
struct Mapping {
    ptr: *const u8,
    len: usize,
}

// SAFETY: the mapping is read-only and its memfd is sealed against writes, so the bytes never
// change while it is shared.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` maps `len` readable bytes until `drop`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `SharedWeights::map` mapped.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

/// A weight set a worker shared: tensor views into the mapped memfd, metadata from its header.
#[derive(Clone)]
struct SharedWeights {
    map: Arc<Mapping>,
    header: Arc<Header>,
}

impl SharedWeights {
    /// Maps `memfd` after checking that it is sealed against change and that its header
    /// describes tensors inside it, each once.
    fn map(memfd: OwnedFd, header_at: u64) -> Result<SharedWeights, UError> {
        let bad = |why: String| UError::invalid(format!("weights from the worker: {why}"));
        let needed = SealFlag::F_SEAL_WRITE | SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW;
        let seals = fcntl(&memfd, FcntlArg::F_GET_SEALS).map_err(|e| bad(e.to_string()))?;
        if !SealFlag::from_bits_truncate(seals).contains(needed) {
            return Err(bad("the memfd is not sealed against writes".into()));
        }
        let len = std::fs::File::from(memfd.try_clone().map_err(|e| bad(e.to_string()))?)
            .metadata()
            .map_err(|e| bad(e.to_string()))?
            .len();
        if header_at >= len {
            return Err(bad(format!("header at {header_at} of {len} bytes")));
        }
        // SAFETY: maps the whole sealed memfd read-only; it cannot shrink under the mapping.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ,
                libc::MAP_SHARED,
                memfd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(bad(format!("mmap: {}", std::io::Error::last_os_error())));
        }
        let map = Mapping {
            ptr: ptr as *const u8,
            len: len as usize,
        };
        let header: Header = wire::decode(&map.bytes()[header_at as usize..])
            .map_err(|e| bad(format!("header: {e}")))?;
        check_placement(&header.tensors, header_at).map_err(bad)?;
        Ok(SharedWeights {
            map: Arc::new(map),
            header: Arc::new(header),
        })
    }
}

/// Every tensor aligned, inside `[0, end)`, and named once.
fn check_placement(tensors: &[Placed], end: u64) -> Result<(), String> {
    let mut names = std::collections::BTreeSet::new();
    for t in tensors {
        let name = t.info.name.as_str();
        let inside = t
            .offset
            .checked_add(t.info.byte_len)
            .is_some_and(|e| e <= end);
        if !inside || t.offset % TENSOR_ALIGN != 0 {
            return Err(format!(
                "tensor `{name}` at {} ({} bytes) is misplaced",
                t.offset, t.info.byte_len
            ));
        }
        if !names.insert(name) {
            return Err(format!("tensor `{name}` is listed twice"));
        }
    }
    Ok(())
}

impl WeightSet for SharedWeights {
    fn format(&self) -> RResult<RString, UError> {
        RResult::ROk(self.header.format.as_str().into())
    }

    fn architecture(&self) -> RResult<abi_stable::std_types::ROption<RString>, UError> {
        RResult::ROk(self.header.architecture.clone().map(RString::from).into())
    }

    fn metadata_keys(&self) -> RResult<RVec<RString>, UError> {
        let keys = self.header.metadata.iter();
        RResult::ROk(keys.map(|(k, _)| RString::from(k.as_str())).collect())
    }

    fn metadata(
        &self,
        key: RStr<'_>,
    ) -> RResult<abi_stable::std_types::ROption<MetaValue>, UError> {
        let found = self.header.metadata.iter().find(|(k, _)| k == key.as_str());
        RResult::ROk(found.map(|(_, v)| v.clone()).into())
    }

    fn tensors(&self) -> RResult<RVec<TensorInfo>, UError> {
        RResult::ROk(self.header.tensors.iter().map(|t| t.info.clone()).collect())
    }

    fn tensor<'a>(&'a self, name: RStr<'_>) -> RResult<TensorView<'a>, UError> {
        let Some(t) = self.header.tensors.iter().find(|t| t.info.name == name) else {
            return RResult::RErr(UError::not_found(format!("no tensor `{name}`")));
        };
        let start = t.offset as usize;
        let data = &self.map.bytes()[start..start + t.info.byte_len as usize];
        RResult::ROk(TensorView {
            dtype: t.info.dtype,
            shape: t.info.shape.clone(),
            data: data.into(),
        })
    }
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

/// Writes `weights` into a sealed memfd: tensors, aligned, then the header. Returns the memfd
/// and where the header starts.
fn share(name: &str, weights: &WeightSetBox) -> Result<(OwnedFd, u64), UError> {
    let io = |e: std::io::Error| UError::io("sharing the weights", e);
    let mut metadata = Vec::new();
    for key in weights.metadata_keys().into_result()? {
        if let Some(value) = weights.metadata(key.as_rstr()).into_result()?.into_option() {
            metadata.push((key.into_string(), value));
        }
    }
    let cname = CString::new(format!("u-weights:{name}"))
        .map_err(std::io::Error::other)
        .map_err(io)?;
    let memfd = memfd_create(
        cname.as_c_str(),
        MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
    )
    .map_err(|e| io(e.into()))?;
    let mut file = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::from(memfd));
    let mut at = 0u64;
    let mut tensors = Vec::new();
    for info in weights.tensors().into_result()? {
        let view = weights.tensor(info.name.as_rstr()).into_result()?;
        let pad = at.next_multiple_of(TENSOR_ALIGN) - at;
        file.write_all(&[0; TENSOR_ALIGN as usize][..pad as usize])
            .map_err(io)?;
        at += pad;
        tensors.push(Placed {
            info: TensorInfo {
                name: info.name,
                dtype: view.dtype,
                shape: view.shape.clone(),
                byte_len: view.data.len() as u64,
            },
            offset: at,
        });
        file.write_all(&view.data).map_err(io)?;
        at += view.data.len() as u64;
    }
    let header = Header {
        format: weights.format().into_result()?.into_string(),
        architecture: weights
            .architecture()
            .into_result()?
            .into_option()
            .map(RString::into_string),
        metadata,
        tensors,
    };
    file.write_all(&wire::encode(&header)).map_err(io)?;
    let file = file.into_inner().map_err(|e| io(e.into_error()))?;
    let seals = SealFlag::F_SEAL_SEAL
        | SealFlag::F_SEAL_SHRINK
        | SealFlag::F_SEAL_GROW
        | SealFlag::F_SEAL_WRITE;
    fcntl(&file, FcntlArg::F_ADD_SEALS(seals)).map_err(|e| io(e.into()))?;
    Ok((file.into(), at))
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

/// Sends `message` as one packet, with `fd` attached.
fn send(
    socket: BorrowedFd<'_>,
    message: &impl Wire,
    fd: Option<BorrowedFd<'_>>,
) -> std::io::Result<()> {
    let bytes = wire::encode(message);
    if bytes.len() > MAX_MESSAGE {
        return Err(std::io::Error::other("message too large"));
    }
    let fds = fd.map(|f| [f.as_raw_fd()]);
    let cmsg: Vec<ControlMessage<'_>> = fds.iter().map(|f| ControlMessage::ScmRights(f)).collect();
    sendmsg::<()>(
        socket.as_raw_fd(),
        &[IoSlice::new(&bytes)],
        &cmsg,
        MsgFlags::MSG_NOSIGNAL,
        None,
    )?;
    Ok(())
}

/// Receives one packet and the descriptor attached to it; `None` when the peer closed.
fn receive<T: Wire>(socket: BorrowedFd<'_>) -> std::io::Result<Option<(T, Option<OwnedFd>)>> {
    let mut buf = vec![0u8; MAX_MESSAGE];
    let mut cmsg = nix::cmsg_space!([std::os::fd::RawFd; 1]);
    let mut iov = [IoSliceMut::new(&mut buf)];
    let msg = recvmsg::<()>(
        socket.as_raw_fd(),
        &mut iov,
        Some(&mut cmsg),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )?;
    let mut fd = None;
    for c in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(fds) = c {
            for raw in fds {
                // SAFETY: the kernel just installed this descriptor for us.
                let owned = unsafe { OwnedFd::from_raw_fd(raw) };
                fd.get_or_insert(owned);
            }
        }
    }
    let (len, truncated) = (msg.bytes, msg.flags.contains(MsgFlags::MSG_TRUNC));
    if len == 0 {
        return Ok(None);
    }
    if truncated {
        return Err(std::io::Error::other("message too large"));
    }
    let message = wire::decode(&buf[..len]).map_err(std::io::Error::other)?;
    Ok(Some((message, fd)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use u_sdk::DType;

    fn placed(name: &str, offset: u64, byte_len: u64) -> Placed {
        Placed {
            info: TensorInfo {
                name: name.into(),
                dtype: DType::F32,
                shape: vec![byte_len / 4].into(),
                byte_len,
            },
            offset,
        }
    }

    #[test]
    fn tensors_must_lie_aligned_inside_the_data_and_be_named_once() {
        let good = [placed("a", 0, 64), placed("b", 64, 8)];
        assert_eq!(check_placement(&good, 72), Ok(()));
        let past_end = [placed("a", 0, 64), placed("b", 64, 16)];
        assert!(check_placement(&past_end, 72).unwrap_err().contains("`b`"));
        let overflow = [placed("a", u64::MAX - 3, 8)];
        assert!(check_placement(&overflow, 72).is_err());
        let unaligned = [placed("a", 4, 8)];
        assert!(check_placement(&unaligned, 72).is_err());
        let twice = [placed("a", 0, 8), placed("a", 64, 8)];
        assert!(check_placement(&twice, 72).unwrap_err().contains("twice"));
    }
}
