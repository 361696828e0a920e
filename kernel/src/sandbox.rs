//! Locking the process down to the union of what the deployment granted.
//!
//! Two kernel mechanisms, applied once, after the plugins are loaded and the listeners opened,
//! before any thread exists:
//!
//! - **Landlock** confines the file system to the granted paths (read, or read-write) plus the
//!   few the runtime itself reads ([`RUNTIME_READ_PATHS`]), and TCP connects to granted ports.
//! - **seccomp** (installed on every thread with TSYNC) makes `socket`, `connect`, `bind` and
//!   `listen` fail with `EPERM` unless an outbound connection was granted, and `fork`, `vfork`,
//!   `execve` and process-creating `clone` fail unless `process.fork` was granted; `io_uring_setup`
//!   always fails, since io_uring would bypass the filter. `clone3` gets
//!   `ENOSYS` so the C library falls back to `clone`, whose flags seccomp can inspect.
//!
//! Where the kernel lacks either, [`lock_down`] reports it so the caller can say so loudly.

use landlock::{
    ABI, Access, AccessFs, AccessNet, NetPort, Ruleset, RulesetAttr, RulesetCreatedAttr,
    RulesetStatus, path_beneath_rules,
};
use nix::errno::Errno;
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};
use serde::Serialize;
use std::{collections::BTreeMap, path::PathBuf};
use u_attest::deployment::{Grants, NetAddress, PathGrant};

/// Paths the runtime reads after lock-down (CPU topology and cgroup limits for thread pools).
pub const RUNTIME_READ_PATHS: [&str; 3] =
    ["/proc/self", "/sys/devices/system/cpu", "/sys/fs/cgroup"];

/// How well one mechanism is enforced.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "state", content = "detail", rename_all = "snake_case")]
pub enum Enforcement {
    /// Fully in force.
    Enforced(String),
    /// In force for some rules only (an older kernel).
    Partial(String),
    /// Not in force.
    Unavailable(String),
}

impl Enforcement {
    /// Whether fully in force.
    pub fn is_enforced(&self) -> bool {
        matches!(self, Enforcement::Enforced(_))
    }
}

impl std::fmt::Display for Enforcement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Enforcement::Enforced(d) => write!(f, "enforced ({d})"),
            Enforcement::Partial(d) => write!(f, "PARTIAL ({d})"),
            Enforcement::Unavailable(d) => write!(f, "NOT ENFORCED ({d})"),
        }
    }
}

/// What the kernel offers, probed without restricting anything.
#[derive(Debug, Clone, Serialize)]
pub struct Support {
    /// Landlock ABI version, if available.
    pub landlock_abi: Option<i64>,
    /// Whether seccomp filters are available.
    pub seccomp: bool,
}

/// Probes kernel support for Landlock and seccomp filters.
pub fn probe_support() -> Support {
    const LANDLOCK_CREATE_RULESET_VERSION: libc::c_long = 1;
    // SAFETY: the documented version query: null attributes, size 0, version flag.
    let abi = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<libc::c_void>(),
            0usize,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    // SAFETY: with a null filter pointer the kernel answers EFAULT if filter mode exists and
    // EINVAL if not; nothing is installed either way.
    let seccomp = unsafe {
        libc::prctl(
            libc::PR_SET_SECCOMP,
            libc::SECCOMP_MODE_FILTER,
            std::ptr::null::<libc::c_void>(),
        ) == -1
            && Errno::last() == Errno::EFAULT
    };
    Support {
        landlock_abi: (abi > 0).then_some(abi),
        seccomp,
    }
}

/// What the `gpu` grant opens to reading: the Vulkan loader's driver manifests and the driver
/// libraries it loads, the dynamic linker's cache, and the PCI topology drivers read.
pub const GPU_READ_PATHS: [&str; 13] = [
    "/usr/share/vulkan",
    "/usr/local/share/vulkan",
    "/etc/vulkan",
    "/usr/share/glvnd",
    "/usr/share/drirc.d",
    "/etc/ld.so.cache",
    "/usr/lib",
    "/usr/lib64",
    "/lib",
    "/lib64",
    "/sys/devices",
    "/sys/bus/pci",
    "/sys/dev/char",
];

/// What the `gpu` grant opens to reading and writing: the GPU device nodes.
pub const GPU_DEVICE_PATHS: [&str; 5] = [
    "/dev/dri",
    "/dev/nvidiactl",
    "/dev/nvidia0",
    "/dev/nvidia-uvm",
    "/dev/kfd",
];

/// The union of all grants, as the sandbox enforces it.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    /// Readable paths.
    pub read: Vec<PathGrant>,
    /// Writable paths.
    pub write: Vec<PathGrant>,
    /// Granted outbound addresses.
    pub connect: Vec<NetAddress>,
    /// Whether processes may be created.
    pub fork: bool,
    /// Whether a GPU may be used ([`GPU_READ_PATHS`], [`GPU_DEVICE_PATHS`]).
    pub gpu: bool,
}

impl Plan {
    /// Adds one plugin's effective grants.
    pub fn add(&mut self, g: &Grants) {
        self.read.extend(g.fs_read.iter().cloned());
        self.write.extend(g.fs_write.iter().cloned());
        self.connect.extend(g.net_connect.iter().cloned());
        self.fork |= g.process_fork;
        self.gpu |= g.gpu;
    }
}

/// What lock-down achieved.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    /// File-system and TCP confinement.
    pub landlock: Enforcement,
    /// System-call filter.
    pub seccomp: Enforcement,
    /// Things worth knowing (missing granted paths, extra threads).
    pub notes: Vec<String>,
}

/// Applies the sandbox for `plan` to the whole process. Call before starting any thread.
pub fn lock_down(plan: &Plan) -> Status {
    let mut notes = Vec::new();
    let threads = thread_count();
    if threads > 1 {
        notes.push(format!(
            "{threads} threads exist at lock-down; Landlock covers only threads created from now on"
        ));
    }
    let landlock = apply_landlock(plan, &mut notes);
    let seccomp = apply_seccomp(plan);
    for (what, e) in [("Landlock", &landlock), ("seccomp", &seccomp)] {
        if e.is_enforced() {
            tracing::info!("{what}: {e}");
        } else {
            tracing::error!(
                "SANDBOX WEAKENED: {what} is {e}; only host-service checks confine plugins"
            );
        }
    }
    for n in &notes {
        tracing::warn!("sandbox: {n}");
    }
    Status {
        landlock,
        seccomp,
        notes,
    }
}

fn thread_count() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Threads:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(1)
}

fn existing(paths: impl Iterator<Item = PathBuf>, notes: &mut Vec<String>) -> Vec<PathBuf> {
    paths
        .filter(|p| {
            let ok = p.exists();
            if !ok {
                notes.push(format!(
                    "granted path {} does not exist; no rule added",
                    p.display()
                ));
            }
            ok
        })
        .collect()
}

fn apply_landlock(plan: &Plan, notes: &mut Vec<String>) -> Enforcement {
    let abi = ABI::V5;
    let mut read = existing(
        plan.read
            .iter()
            .map(|g| g.path.clone())
            .chain(RUNTIME_READ_PATHS.iter().map(PathBuf::from)),
        notes,
    );
    let mut write = existing(plan.write.iter().map(|g| g.path.clone()), notes);
    if plan.gpu {
        let present = |paths: &[&str]| -> Vec<PathBuf> {
            paths
                .iter()
                .map(PathBuf::from)
                .filter(|p| p.exists())
                .collect()
        };
        read.extend(present(&GPU_READ_PATHS));
        write.extend(present(&GPU_DEVICE_PATHS));
    }
    let ports: Vec<u16> = plan
        .connect
        .iter()
        .filter_map(|a| match a {
            NetAddress::Tcp { port, .. } => Some(*port),
            NetAddress::Unix(_) => None,
        })
        .collect();
    let result = (|| -> Result<RulesetStatus, landlock::RulesetError> {
        let mut ruleset = Ruleset::default()
            .handle_access(AccessFs::from_all(abi))?
            .handle_access(AccessNet::from_all(abi))?
            .create()?
            .add_rules(path_beneath_rules(&read, AccessFs::from_read(abi)))?
            .add_rules(path_beneath_rules(&write, AccessFs::from_all(abi)))?;
        for port in ports {
            ruleset = ruleset.add_rule(NetPort::new(port, AccessNet::ConnectTcp))?;
        }
        Ok(ruleset.restrict_self()?.ruleset)
    })();
    let kernel = probe_support()
        .landlock_abi
        .map(|v| format!("kernel Landlock ABI {v}"))
        .unwrap_or_else(|| "kernel has no Landlock".into());
    match result {
        Ok(RulesetStatus::FullyEnforced) => Enforcement::Enforced(kernel),
        Ok(RulesetStatus::PartiallyEnforced) => Enforcement::Partial(format!(
            "{kernel}; some access rights are unknown to this kernel"
        )),
        Ok(RulesetStatus::NotEnforced) => Enforcement::Unavailable(kernel),
        Err(e) => Enforcement::Unavailable(format!("{kernel}; {e}")),
    }
}

/// The rules that deny creating processes: `fork`, `vfork`, `execve`, `execveat`, and `clone`
/// without `CLONE_THREAD` (threads stay allowed).
type DenyRule = (libc::c_long, &'static str, Vec<SeccompRule>);
fn process_rules() -> Result<Vec<DenyRule>, String> {
    let no_thread_flag = SeccompCondition::new(
        0,
        SeccompCmpArgLen::Qword,
        SeccompCmpOp::MaskedEq(libc::CLONE_THREAD as u64),
        0,
    )
    .map_err(|e| e.to_string())?;
    Ok(vec![
        #[cfg(target_arch = "x86_64")]
        (libc::SYS_fork, "fork", vec![]),
        #[cfg(target_arch = "x86_64")]
        (libc::SYS_vfork, "vfork", vec![]),
        (libc::SYS_execve, "execve", vec![]),
        (libc::SYS_execveat, "execveat", vec![]),
        (
            libc::SYS_clone,
            "clone(without CLONE_THREAD)",
            vec![SeccompRule::new(vec![no_thread_flag]).map_err(|e| e.to_string())?],
        ),
    ])
}

/// Stacks a filter that denies creating processes (`EPERM`; `clone3` `ENOSYS`, so libc falls
/// back to `clone`) on whatever the process already runs under, for every thread: a forked
/// session process calls it before it runs anything a client sent.
pub fn forbid_processes() -> Result<(), String> {
    let arch = TargetArch::try_from(std::env::consts::ARCH).map_err(|e| e.to_string())?;
    let program = |rules, action| -> Result<BpfProgram, String> {
        SeccompFilter::new(rules, SeccompAction::Allow, action, arch)
            .map_err(|e| e.to_string())?
            .try_into()
            .map_err(|e: seccompiler::BackendError| e.to_string())
    };
    let rules = process_rules()?
        .into_iter()
        .map(|(nr, _, r)| (nr, r))
        .collect();
    let eperm = program(rules, SeccompAction::Errno(libc::EPERM as u32))?;
    seccompiler::apply_filter_all_threads(&eperm).map_err(|e| e.to_string())?;
    let enosys = BTreeMap::from([(libc::SYS_clone3, vec![])]);
    let p = program(enosys, SeccompAction::Errno(libc::ENOSYS as u32))?;
    seccompiler::apply_filter_all_threads(&p).map_err(|e| e.to_string())
}

fn apply_seccomp(plan: &Plan) -> Enforcement {
    let arch = match TargetArch::try_from(std::env::consts::ARCH) {
        Ok(a) => a,
        Err(e) => return Enforcement::Unavailable(format!("unsupported architecture: {e}")),
    };
    let result = (|| -> Result<Vec<&'static str>, String> {
        let mut denied: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
        let mut names = Vec::new();
        let mut deny = |nr: libc::c_long, name: &'static str, rules: Vec<SeccompRule>| {
            denied.insert(nr, rules);
            names.push(name);
        };
        deny(libc::SYS_bind, "bind", vec![]);
        deny(libc::SYS_listen, "listen", vec![]);
        // io_uring can open sockets and files without the system calls filtered here.
        deny(libc::SYS_io_uring_setup, "io_uring_setup", vec![]);
        if plan.connect.is_empty() {
            deny(libc::SYS_socket, "socket", vec![]);
            deny(libc::SYS_connect, "connect", vec![]);
        }
        let mut enosys: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
        if !plan.fork {
            for (nr, name, rules) in process_rules()? {
                deny(nr, name, rules);
            }
            enosys.insert(libc::SYS_clone3, vec![]);
        }
        let program = |rules, action| -> Result<BpfProgram, String> {
            SeccompFilter::new(rules, SeccompAction::Allow, action, arch)
                .map_err(|e| e.to_string())?
                .try_into()
                .map_err(|e: seccompiler::BackendError| e.to_string())
        };
        let eperm = program(denied, SeccompAction::Errno(libc::EPERM as u32))?;
        seccompiler::apply_filter_all_threads(&eperm).map_err(|e| e.to_string())?;
        if !enosys.is_empty() {
            let p = program(enosys, SeccompAction::Errno(libc::ENOSYS as u32))?;
            seccompiler::apply_filter_all_threads(&p).map_err(|e| e.to_string())?;
        }
        Ok(names)
    })();
    match result {
        Ok(names) => Enforcement::Enforced(format!("EPERM for {}", names.join(", "))),
        Err(e) => Enforcement::Unavailable(e),
    }
}
