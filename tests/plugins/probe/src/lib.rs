//! A test transport that tries to escape its declaration.
//!
//! Its manifest asks only for `fs.read`, yet its code opens sockets, connects out, reads files
//! outside its grant and starts a process. `u-attest inspect` must flag the imports; at run time
//! the host's Landlock and seccomp layers must make every attempt fail with an OS error while the
//! host keeps running. Each attempt is reported through the host log as
//! `probe: <attempt>: ok` or `probe: <attempt>: denied (<OS error>)`. With
//! `panic_on_instantiate = true` in its config it panics, to prove panics stay on its side of the
//! ABI.

use abi_stable::std_types::{RResult, RString, RVec};
use std::{io::Read, os::fd::FromRawFd};
use u_sdk::{
    HostBox, PluginInfo, PluginInstance, Result, Transport, TransportBox, TransportContext, UError,
};

u_sdk::export_plugin! {
    manifest: "plugin.toml",
    describe: describe,
    instantiate: instantiate,
}

fn describe() -> PluginInfo {
    PluginInfo {
        summary: "sandbox probe transport".into(),
        details: RVec::from(vec![RString::from(format!("pid={}", std::process::id()))]),
    }
}

fn instantiate(host: HostBox) -> Result<PluginInstance> {
    let config: toml::Table = toml::from_str(host.config().as_str())
        .map_err(|e| UError::invalid(format!("probe config: {e}")))?;
    if config.get("panic_on_instantiate").and_then(|v| v.as_bool()) == Some(true) {
        panic!("probe was configured to panic during instantiation");
    }
    let text = |key: &str| config.get(key).and_then(|v| v.as_str()).map(str::to_string);
    let probe = Probe {
        host,
        read_allowed: text("read_allowed"),
        read_denied: text("read_denied"),
        connect: text("connect"),
    };
    // A thread started while the plugin is being created (as a compute pool would be) must be
    // as confined as everything else.
    if let Some(path) = probe.read_denied.clone() {
        let outcome =
            std::thread::spawn(move || std::fs::read(path).map(|b| format!("{} bytes", b.len())))
                .join()
                .unwrap_or_else(|_| Err(std::io::Error::other("thread panicked")));
        probe.report("instantiate-thread-read-denied", outcome);
    }
    Ok(PluginInstance::Transport(TransportBox::from_value(
        probe,
        abi_stable::sabi_trait::TD_Opaque,
    )))
}

struct Probe {
    host: HostBox,
    read_allowed: Option<String>,
    read_denied: Option<String>,
    connect: Option<String>,
}

impl Probe {
    fn report(&self, attempt: &str, outcome: std::io::Result<String>) {
        let line = match outcome {
            Ok(detail) => format!("probe: {attempt}: ok ({detail})"),
            Err(e) => format!("probe: {attempt}: denied ({e})"),
        };
        self.host.info(&line);
    }

    fn host_read(&self, path: &str) -> std::io::Result<String> {
        match self.host.open_read(path.into()) {
            RResult::ROk(fd) => {
                // SAFETY: the host hands over ownership of a freshly opened descriptor.
                let mut file = unsafe { std::fs::File::from_raw_fd(fd) };
                let mut s = String::new();
                file.read_to_string(&mut s)?;
                Ok(format!("{} bytes", s.len()))
            }
            RResult::RErr(e) => Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                e.message.to_string(),
            )),
        }
    }

    fn run(&self) {
        if let Some(p) = &self.read_allowed {
            self.report("host-read-allowed", self.host_read(p));
            self.report(
                "direct-read-allowed",
                std::fs::read(p).map(|b| format!("{} bytes", b.len())),
            );
        }
        if let Some(p) = &self.read_denied {
            self.report("host-read-denied", self.host_read(p));
            self.report(
                "direct-read-denied",
                std::fs::read(p).map(|b| format!("{} bytes", b.len())),
            );
        }
        // SAFETY: plain libc call with constant arguments; the descriptor is closed if created.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
        self.report(
            "socket",
            if fd >= 0 {
                // SAFETY: `fd` was just created by this function.
                unsafe { libc::close(fd) };
                Ok("created".into())
            } else {
                Err(std::io::Error::last_os_error())
            },
        );
        // io_uring would reach sockets and files around the system-call filter.
        let mut params = [0u8; 120];
        // SAFETY: io_uring_setup with one entry and a zeroed, correctly sized params struct.
        let ring = unsafe { libc::syscall(libc::SYS_io_uring_setup, 1u32, params.as_mut_ptr()) };
        self.report(
            "io-uring",
            if ring >= 0 {
                // SAFETY: `ring` is a descriptor this function just created.
                unsafe { libc::close(ring as i32) };
                Ok("ring created".into())
            } else {
                Err(std::io::Error::last_os_error())
            },
        );
        if let Some(addr) = &self.connect {
            self.report(
                "connect",
                std::net::TcpStream::connect(addr.as_str()).map(|_| "connected".into()),
            );
        }
        self.report(
            "spawn-process",
            std::process::Command::new("/bin/true")
                .status()
                .map(|s| format!("exit {s}")),
        );
        self.report(
            "spawn-thread",
            std::thread::spawn(|| 6 * 7)
                .join()
                .map(|v| format!("thread returned {v}"))
                .map_err(|_| std::io::Error::other("thread panicked")),
        );
    }
}

impl Transport for Probe {
    fn serve(&self, _context: TransportContext) -> RResult<(), UError> {
        u_sdk::guard("probe.serve", || {
            self.run();
            Ok(())
        })
    }
}
