//! The messages between the host and a worker, and how one travels: one `SOCK_SEQPACKET`
//! packet per message, laid out by [`wire`], with at most one descriptor attached
//! (`SCM_RIGHTS`).

use super::wire::{self, Reader, Wire, Writer};
use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use std::{
    io::{IoSlice, IoSliceMut},
    os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
};
use u_sdk::{MetaValue, TensorInfo, UError};

/// The largest message either side sends (a request carries at most 4 KiB of a file's head).
const MAX_MESSAGE: usize = 256 * 1024;

/// A call the host makes to a worker's loader.
pub(super) enum Call {
    /// [`u_sdk::Loader::formats`].
    Formats,
    /// [`u_sdk::Loader::can_open`].
    CanOpen { path: String, head: Vec<u8> },
    /// [`u_sdk::Loader::open`].
    Open { path: String },
}

/// A worker's answer.
pub(super) enum Reply {
    /// The worker is locked down and its plugin instantiated.
    Ready {
        summary: String,
        details: Vec<String>,
    },
    /// The formats the loader reads.
    Formats(Vec<String>),
    /// Whether the loader recognises the file.
    CanOpen(bool),
    /// A weight set in the attached memfd: tensors first, then the [`Header`] at `header_at`.
    Opened { header_at: u64 },
    /// The call failed, and why.
    Failed(UError),
}

/// What a shared weight set holds besides its tensors' bytes.
pub(super) struct Header {
    pub format: String,
    pub architecture: Option<String>,
    pub metadata: Vec<(String, MetaValue)>,
    pub tensors: Vec<Placed>,
}

/// A tensor and where its bytes start in the memfd.
pub(super) struct Placed {
    pub info: TensorInfo,
    pub offset: u64,
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

/// Sends `message` as one packet, with `fd` attached.
pub(super) fn send(
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
pub(super) fn receive<T: Wire>(
    socket: BorrowedFd<'_>,
) -> std::io::Result<Option<(T, Option<OwnedFd>)>> {
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
