//! Opening the sockets a deployment grants, before lock-down.
//!
//! Transports never create sockets: after lock-down `socket`, `bind` and `listen` fail. The host
//! opens each granted `net.listen` address here and hands the descriptors to the transport.

use nix::sys::stat::{Mode, umask};
use std::{
    os::{
        fd::IntoRawFd,
        unix::fs::{FileTypeExt, PermissionsExt},
    },
    path::Path,
};
use u_attest::deployment::NetAddress;
use u_sdk::Listener;

/// Opens a listening socket for `address`. Unix sockets are created with mode 0600 (bound under
/// umask 0177, so no other user can connect in the moment before the mode is set); a stale
/// socket file at the path is replaced, any other file is left alone and reported.
pub fn open(address: &NetAddress) -> std::io::Result<Listener> {
    let fd = match address {
        NetAddress::Unix(path) => {
            remove_stale_socket(path)?;
            // umask swaps the process's file-creation mask; the host binds its sockets before
            // any plugin runs, so no other thread creates files meanwhile.
            let previous = umask(Mode::from_bits_truncate(0o177));
            let bound = std::os::unix::net::UnixListener::bind(path);
            umask(previous);
            let l = bound?;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
            l.into_raw_fd()
        }
        NetAddress::Tcp { host, port } => {
            let host = host.trim_start_matches('[').trim_end_matches(']');
            std::net::TcpListener::bind((host, *port))?.into_raw_fd()
        }
    };
    Ok(Listener {
        address: address.to_string().into(),
        fd,
    })
}

fn remove_stale_socket(path: &Path) -> std::io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path),
        Ok(_) => Err(std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            format!("{} exists and is not a socket", path.display()),
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}
