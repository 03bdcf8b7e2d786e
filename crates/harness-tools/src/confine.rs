//! The kernel sandbox of a `shell::exec` child (Landlock).
//!
//! The rule set is built in the harness (it opens files and allocates), and the child only
//! applies it between fork and exec ([`crate::isolate`]), so the harness itself is never
//! confined. What the child may do:
//!
//! - read and execute the system trees ([`SYSTEM_READ`]) and the operator's extra read paths;
//! - read, write, create and remove anything beneath the filesystem root and a private temporary
//!   directory (its `TMPDIR` and `HOME`);
//! - read and write a few character devices (`/dev/null`, `/dev/zero`, ...), without ioctls;
//! - TCP connect/bind only when the operator allows the network;
//! - signal and reach abstract sockets only inside its own sandbox (where the ABI has scopes).
//!
//! Landlock can only allow, never carve out, so a protected path (the data directory, a
//! configuration file) that lies beneath an allowed tree is excluded by walking from the tree
//! down to it: every sibling on the way gets the tree's rights, the directories on the way get
//! only `ReadDir` (their names can be listed, nothing created or removed in them), and the
//! protected path itself gets nothing. The walk opens one component at a time without following
//! symlinks, so a link planted in the root cannot smuggle the protected path into a rule.

use std::ffi::OsStr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use landlock::{
    Access, AccessFs, AccessNet, BitFlags, CompatLevel, Compatible, PathBeneath, Ruleset,
    RulesetAttr, RulesetCreated, RulesetCreatedAttr, Scope, ABI,
};
use rustix::fs::{FileType, Mode, OFlags};

use crate::error::{Result, ToolError};
use crate::jail::{real_path, Jail, Protected};

/// Trees every command may read and execute from (missing ones are skipped).
pub const SYSTEM_READ: &[&str] = &[
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt", "/run",
    "/proc", "/sys",
];

/// `/proc` in [`SYSTEM_READ`]: a command in its own PID namespace gets a fresh `/proc`, another
/// filesystem, granted in the child once it is mounted; the host's is never granted then.
const PROC: &str = "/proc";

/// Character devices a shell needs, readable and writable (never ioctl'd). `/dev/tty` is left
/// out on purpose: it is the operator's terminal during `harness chat`, where a command could
/// print a fake prompt or push keystrokes.
pub const DEVICES: &[&str] = &[
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
];

/// The lowest Landlock ABI that confines writes soundly (ABI 3 adds `truncate`; below it a
/// command could empty any file it can read).
const MIN_FS_ABI: i32 = 3;
/// The lowest ABI that can deny TCP.
const MIN_NET_ABI: i32 = 4;

/// What the operator configured for `shell::exec` (read on every call).
#[derive(Clone, Debug, Default)]
pub struct ShellPolicy {
    /// Run commands unconfined when the kernel cannot enforce the sandbox (instead of refusing).
    pub unconfined: bool,
    /// Let commands open TCP connections and listen (off: both denied).
    pub allow_network: bool,
    /// Extra trees commands may read and execute from (toolchains, a shared cache).
    pub read_paths: Vec<PathBuf>,
    /// Names (or `*`/`?` globs) of variables never passed to a command, beyond those that
    /// look like credentials.
    pub scrub_env: Vec<String>,
}

/// The Landlock ABI of the running kernel (0 when it has none or it is disabled).
pub fn kernel_abi() -> i32 {
    const LANDLOCK_CREATE_RULESET_VERSION: libc::c_uint = 1;
    // SAFETY: the version query reads no memory (null attribute, size 0) and returns a number.
    let v = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<libc::c_void>(),
            0usize,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    v.max(0) as i32
}

/// A rule set ready to be applied in a child, and the temporary directory it grants.
pub struct Sandbox {
    ruleset: OwnedFd,
    pub tmp: tempfile::TempDir,
    pub abi: i32,
}

impl Sandbox {
    /// The descriptor `restrict_self` takes; it must stay open until the child has been spawned.
    pub fn raw_fd(&self) -> i32 {
        self.ruleset.as_raw_fd()
    }

    /// The rights a fresh `/proc` gets (those of the system trees).
    pub fn proc_access(&self) -> u64 {
        AccessFs::from_read(ABI::from(self.abi)).bits()
    }
}

/// Why a sandbox could not be had.
pub enum Unavailable {
    /// The kernel (or the configured ceiling) lacks what the policy needs.
    Kernel(String),
}

/// Builds the rule set for a command in `jail`. `ceiling` caps the ABI used (tests take the
/// refusal path with 0; `None` = what the kernel has). `fresh_proc`: the command mounts its
/// own `/proc` (granted then in the child), so the host's is left out.
pub fn prepare(
    jail: &Jail,
    policy: &ShellPolicy,
    ceiling: Option<i32>,
    fresh_proc: bool,
) -> Result<std::result::Result<Sandbox, Unavailable>> {
    let kernel = kernel_abi();
    let abi_n = ceiling.map_or(kernel, |c| c.min(kernel));
    let need = if policy.allow_network {
        MIN_FS_ABI
    } else {
        MIN_NET_ABI
    };
    if abi_n < need {
        let what = if abi_n < MIN_FS_ABI {
            "filesystem confinement"
        } else {
            "denying TCP (shell_exec_allow_network: false)"
        };
        return Ok(Err(Unavailable::Kernel(format!(
            "Landlock ABI {abi_n} is available (kernel {kernel}), {what} needs ABI {need}"
        ))));
    }
    let abi = ABI::from(abi_n);
    let tmp = tempfile::Builder::new()
        .prefix("harness-shell-")
        .tempdir()
        .map_err(|e| ToolError::Internal(format!("cannot create a private TMPDIR: {e}")))?;
    let ruleset = build(jail, policy, abi, tmp.path(), fresh_proc)
        .map_err(|e| ToolError::Internal(format!("cannot build the Landlock rule set: {e}")))?;
    let fd: Option<OwnedFd> = ruleset.into();
    let ruleset = fd.ok_or_else(|| {
        ToolError::Internal("the kernel returned no Landlock rule set".to_string())
    })?;
    Ok(Ok(Sandbox {
        ruleset,
        tmp,
        abi: abi_n,
    }))
}

type BuildResult<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

fn build(
    jail: &Jail,
    policy: &ShellPolicy,
    abi: ABI,
    tmp: &Path,
    fresh_proc: bool,
) -> BuildResult<RulesetCreated> {
    let all = AccessFs::from_all(abi);
    let read = AccessFs::from_read(abi);
    let mut ruleset = Ruleset::default()
        .set_compatibility(CompatLevel::HardRequirement)
        .handle_access(all)?;
    if !policy.allow_network {
        ruleset = ruleset.handle_access(AccessNet::from_all(abi))?;
    }
    let scopes = Scope::from_all(abi);
    if !scopes.is_empty() {
        ruleset = ruleset.scope(scopes)?;
    }
    let mut rules = Rules {
        ruleset: Some(ruleset.create()?),
        protected: jail.protected(),
        abi,
    };
    for tree in SYSTEM_READ
        .iter()
        .filter(|t| !(fresh_proc && **t == PROC))
        .map(Path::new)
        .chain(policy.read_paths.iter().map(PathBuf::as_path))
    {
        rules.grant_path(tree, read)?;
    }
    rules.grant_path(tmp, all)?;
    let root = jail.root_fd().try_clone_to_owned()?;
    rules.grant_tree(root, jail.root(), all)?;
    // The session's grants, from the descriptors the jail opened (minus protected paths).
    for (fd, real) in jail.grants() {
        rules.grant_tree(fd.try_clone_to_owned()?, real, all)?;
    }
    for dev in DEVICES {
        let access = AccessFs::ReadFile | AccessFs::WriteFile;
        rules.grant_path(Path::new(dev), access & all)?;
    }
    // Listing /dev shows names only; what can be opened is the devices above.
    rules.grant_path(Path::new("/dev"), BitFlags::from(AccessFs::ReadDir))?;
    Ok(rules
        .ruleset
        .ok_or("the rule set was lost to an earlier error")?)
}

struct Rules<'a> {
    ruleset: Option<RulesetCreated>,
    protected: &'a Protected,
    abi: ABI,
}

impl Rules<'_> {
    fn add(&mut self, fd: OwnedFd, access: BitFlags<AccessFs>) -> BuildResult<()> {
        let is_dir = rustix::fs::fstat(&fd)
            .map(|st| FileType::from_raw_mode(st.st_mode) == FileType::Directory)
            .unwrap_or(false);
        let access = if is_dir {
            access
        } else {
            access & AccessFs::from_file(self.abi)
        };
        if access.is_empty() {
            return Ok(());
        }
        let ruleset = self
            .ruleset
            .take()
            .ok_or("the rule set was lost to an earlier error")?;
        self.ruleset = Some(ruleset.add_rule(PathBeneath::new(fd, access))?);
        Ok(())
    }

    /// An operator or system path (symlinks followed: `/bin` may be a link to `/usr/bin`).
    /// Missing paths are skipped.
    fn grant_path(&mut self, path: &Path, access: BitFlags<AccessFs>) -> BuildResult<()> {
        let fd = match rustix::fs::open(path, OFlags::PATH | OFlags::CLOEXEC, Mode::empty()) {
            Ok(fd) => fd,
            Err(_) => return Ok(()),
        };
        let real = real_path(&fd)?;
        let is_dir = rustix::fs::fstat(&fd)
            .map(|st| FileType::from_raw_mode(st.st_mode) == FileType::Directory)
            .unwrap_or(false);
        if !is_dir {
            if !self.protected.covers(&real) {
                self.add(fd, access)?;
            }
            return Ok(());
        }
        self.grant_tree(readable_dir(&fd)?, &real, access)
    }

    /// Grants `access` beneath the directory `dir` (whose real path is `real`), minus every
    /// protected path under it.
    fn grant_tree(
        &mut self,
        dir: OwnedFd,
        real: &Path,
        access: BitFlags<AccessFs>,
    ) -> BuildResult<()> {
        if self.protected.covers(real) {
            return Ok(());
        }
        let inside: Vec<&PathBuf> = self
            .protected
            .paths()
            .iter()
            .filter(|p| p.starts_with(real))
            .collect();
        if inside.is_empty() {
            return self.add(dir, access);
        }
        // A directory on the way to a protected path: its names may be listed, nothing more
        // (any other right would be inherited by the protected path beneath it).
        if access.contains(AccessFs::ReadDir) {
            self.add(dir.try_clone()?, BitFlags::from(AccessFs::ReadDir))?;
        }
        let entries = rustix::fs::Dir::read_from(&dir)?;
        for entry in entries {
            let entry = entry?;
            let name = entry.file_name().to_bytes();
            if name == b"." || name == b".." {
                continue;
            }
            let child = real.join(OsStr::from_bytes(name));
            if self.protected.paths().contains(&child) {
                continue;
            }
            // One component, not followed: a symlink here is left without a rule (what it
            // points at is judged by its own place in the tree).
            let fd = match rustix::fs::openat(
                &dir,
                entry.file_name(),
                OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            ) {
                Ok(fd) => fd,
                Err(_) => continue,
            };
            let kind = match rustix::fs::fstat(&fd) {
                Ok(st) => FileType::from_raw_mode(st.st_mode),
                Err(_) => continue,
            };
            match kind {
                FileType::Symlink => continue,
                FileType::Directory if inside.iter().any(|p| p.starts_with(&child)) => {
                    self.grant_tree(readable_dir(&fd)?, &child, access)?;
                }
                _ => self.add(fd, access)?,
            }
        }
        Ok(())
    }
}

/// The directory an `O_PATH` descriptor names, opened again for reading its entries.
fn readable_dir(fd: &OwnedFd) -> rustix::io::Result<OwnedFd> {
    rustix::fs::openat(
        fd,
        ".",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
}
