//! Confinement to the filesystem root.
//!
//! Every path is opened relative to a descriptor of the root with `openat2(RESOLVE_BENEATH |
//! RESOLVE_NO_MAGICLINKS)`: the kernel resolves the whole path (`..`, symlinks) and refuses any
//! step that leaves the root, in the same call that opens the file, so there is no window
//! between a check and its use for a swapped symlink to slip through. Where `openat2` does not
//! exist (kernels before 5.6, some sandboxes) the file is opened without following a final
//! symlink and the opened descriptor's real path is checked before anything is read or
//! written. Either way the real path of what was opened is then checked against the harness's
//! own data directory and configuration, which stay unreachable even under the root.

use std::ffi::OsStr;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use rustix::fs::{FileType, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

use crate::error::{Result, ToolError};
use crate::scope::FsScope;

/// Set once `openat2` turned out to be missing, so later calls go straight to the fallback.
static NO_OPENAT2: AtomicBool = AtomicBool::new(false);

/// Paths no call may reach: the data directory (and everything under it) and configuration
/// files. Kept as real paths, so a symlink or a second spelling leads to the same refusal.
#[derive(Clone, Debug, Default)]
pub struct Protected {
    paths: Vec<PathBuf>,
}

impl Protected {
    pub fn new(paths: impl IntoIterator<Item = PathBuf>) -> Protected {
        let paths = paths
            .into_iter()
            .filter(|p| p.is_absolute())
            .map(|p| std::fs::canonicalize(&p).unwrap_or(p))
            .collect();
        Protected { paths }
    }

    /// Whether `real` is a protected path or lies under one.
    pub fn covers(&self, real: &Path) -> bool {
        self.paths.iter().any(|p| real.starts_with(p))
    }

    /// Whether `real` is a directory that holds a protected path (listing it shows the name
    /// only, never the contents).
    pub fn paths(&self) -> &[PathBuf] {
        &self.paths
    }
}

/// One directory paths are resolved from: the root, or a grant.
struct Base {
    fd: OwnedFd,
    /// Its real path (what `/proc/self/fd` says of `fd`).
    real: PathBuf,
    /// As the scope spelled it (absolute paths the model copies from it are accepted).
    given: PathBuf,
}

/// An open root (and the session's grants): the descriptors every path is resolved from.
/// Relative paths are resolved from the root; an absolute path from the root or the grant it
/// names, and each is confined to the base it was resolved from.
pub struct Jail {
    /// The root first, then the grants that could be opened.
    bases: Vec<Base>,
    protected: Protected,
}

/// Which of a jail's bases a path is resolved from (0: the root).
pub type BaseId = usize;

/// The real path of an open descriptor, from the kernel.
pub fn real_path(fd: impl AsFd) -> std::io::Result<PathBuf> {
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_fd().as_raw_fd()))
}

fn io_err(field: &'static str, path: &str, e: impl std::fmt::Display) -> ToolError {
    ToolError::Io {
        field,
        path: path.to_string(),
        why: e.to_string(),
    }
}

impl Jail {
    pub fn open(scope: Option<&FsScope>, protected: &Protected) -> Result<Jail> {
        let scope = scope.ok_or(ToolError::NoRoot)?;
        let given = scope.root.clone();
        if !given.is_absolute() {
            return Err(ToolError::invalid(
                "fs_scope.root",
                format!("'{}' is not an absolute path", given.display()),
            ));
        }
        let shown = given.display().to_string();
        let root_fd = rustix::fs::open(
            &given,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| match e {
            Errno::NOENT => ToolError::NotFound {
                field: "fs_scope.root",
                path: shown.clone(),
            },
            e => io_err("fs_scope.root", &shown, e),
        })?;
        let root = real_path(&root_fd).map_err(|e| io_err("fs_scope.root", &shown, e))?;
        if protected.covers(&root) {
            return Err(ToolError::Protected {
                field: "fs_scope.root",
                path: shown,
            });
        }
        let mut bases = vec![Base {
            fd: root_fd,
            real: root,
            given,
        }];
        for grant in &scope.grants {
            match open_grant(grant, protected) {
                Ok(base) => bases.push(base),
                // A grant is extra room: one that is gone (or was never valid) is left out.
                Err(why) => {
                    tracing::warn!(grant = %grant.display(), "filesystem grant left out: {why}")
                }
            }
        }
        Ok(Jail {
            bases,
            protected: protected.clone(),
        })
    }

    /// The granted directories that could be opened: descriptor and real path.
    pub fn grants(&self) -> impl Iterator<Item = (std::os::fd::BorrowedFd<'_>, &Path)> {
        self.bases[1..]
            .iter()
            .map(|b| (b.fd.as_fd(), b.real.as_path()))
    }

    /// The descriptor of the root (the sandbox of `shell::exec` grants it, not its path, so a
    /// root swapped after the jail was opened changes nothing).
    pub fn root_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.bases[0].fd.as_fd()
    }

    pub fn root(&self) -> &Path {
        &self.bases[0].real
    }

    pub fn protected(&self) -> &Protected {
        &self.protected
    }

    /// A model's path as a base and a path relative to it. Relative paths are relative to the
    /// root; absolute paths are accepted only when they name something under the root or a
    /// grant; `..` is left to the kernel, which refuses it only when it really leaves the base.
    pub fn relative(&self, field: &'static str, path: &str) -> Result<(BaseId, PathBuf)> {
        if path.contains('\0') {
            return Err(ToolError::invalid(field, "contains a NUL byte"));
        }
        let p = Path::new(path);
        if p.is_absolute() {
            for (id, base) in self.bases.iter().enumerate() {
                for prefix in [&base.real, &base.given] {
                    if let Ok(rest) = p.strip_prefix(prefix) {
                        return Ok((id, dot_if_empty(rest)));
                    }
                }
            }
            return Err(ToolError::OutsideRoot {
                field,
                path: path.to_string(),
            });
        }
        Ok((0, dot_if_empty(p)))
    }

    /// Opens `path` (`rel` to the base `id`) with `flags`, confined to that base; refuses the
    /// protected paths. Returns the descriptor and its real path.
    pub fn open_at(
        &self,
        field: &'static str,
        path: &str,
        (id, rel): (BaseId, &Path),
        flags: OFlags,
    ) -> Result<(OwnedFd, PathBuf)> {
        let base = &self.bases[id];
        // NONBLOCK: opening a FIFO must not hang the call (callers refuse anything but a
        // regular file or a directory afterwards).
        let flags = flags | OFlags::CLOEXEC | OFlags::NONBLOCK;
        let outside = || ToolError::OutsideRoot {
            field,
            path: path.to_string(),
        };
        let map = |e: Errno| match e {
            Errno::XDEV | Errno::LOOP => outside(),
            Errno::NOENT => ToolError::NotFound {
                field,
                path: path.to_string(),
            },
            e => io_err(field, path, e),
        };
        let fd = if NO_OPENAT2.load(Ordering::Relaxed) {
            open_fallback(&base.fd, rel, flags).map_err(map)?
        } else {
            match openat2_beneath(&base.fd, rel, flags) {
                Ok(fd) => fd,
                Err(Errno::NOSYS) | Err(Errno::PERM) if !NO_OPENAT2.load(Ordering::Relaxed) => {
                    tracing::warn!("openat2 is not available: paths are confined by re-checking what was opened");
                    NO_OPENAT2.store(true, Ordering::Relaxed);
                    open_fallback(&base.fd, rel, flags).map_err(map)?
                }
                Err(e) => return Err(map(e)),
            }
        };
        let real = real_path(&fd).map_err(|e| io_err(field, path, e))?;
        // Holds for both ways of opening; for the fallback it is the check itself.
        if !real.starts_with(&base.real) {
            return Err(outside());
        }
        if self.protected.covers(&real) {
            return Err(ToolError::Protected {
                field,
                path: path.to_string(),
            });
        }
        Ok((fd, real))
    }

    /// Opens an existing regular file.
    pub fn open_file(
        &self,
        field: &'static str,
        path: &str,
        write: bool,
    ) -> Result<(File, PathBuf)> {
        let (id, rel) = self.relative(field, path)?;
        let flags = if write { OFlags::RDWR } else { OFlags::RDONLY };
        let (fd, real) = self.open_at(field, path, (id, &rel), flags)?;
        Ok((regular_file(fd, field, path)?, real))
    }

    /// Opens an existing directory.
    pub fn open_dir(&self, field: &'static str, path: &str) -> Result<(OwnedFd, PathBuf)> {
        let (id, rel) = self.relative(field, path)?;
        self.open_at(field, path, (id, &rel), OFlags::RDONLY | OFlags::DIRECTORY)
    }

    /// Opens `path` for writing: an existing regular file (emptied only after every check
    /// passed), or a new one created in its directory without following any symlink at its
    /// name. `create_dirs` makes the missing parent directories, each one confined too.
    pub fn create_file(
        &self,
        field: &'static str,
        path: &str,
        create_dirs: bool,
    ) -> Result<(File, PathBuf, bool)> {
        let (id, rel) = self.relative(field, path)?;
        let name = match rel.components().next_back() {
            Some(Component::Normal(name)) => name.to_os_string(),
            _ => return Err(ToolError::invalid(field, "must name a file")),
        };
        match self.open_at(field, path, (id, &rel), OFlags::WRONLY) {
            Ok((fd, real)) => return Ok((regular_file(fd, field, path)?, real, false)),
            Err(ToolError::NotFound { .. }) => {}
            Err(e) => return Err(e),
        }
        let parent = rel.parent().map(dot_if_empty).unwrap_or_else(|| ".".into());
        let (dir, dir_real) = if create_dirs {
            self.make_dirs(field, path, (id, &parent))?
        } else {
            self.open_at(
                field,
                path,
                (id, &parent),
                OFlags::RDONLY | OFlags::DIRECTORY,
            )?
        };
        let real = dir_real.join(&name);
        if self.protected.covers(&real) {
            return Err(ToolError::Protected {
                field,
                path: path.to_string(),
            });
        }
        let fd = rustix::fs::openat(
            &dir,
            name.as_os_str(),
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o644),
        )
        .map_err(|e| match e {
            // Something appeared at the name since it was found missing (or it is a dangling
            // symlink): never write through it.
            Errno::EXIST => io_err(
                field,
                path,
                "appeared while it was being created, or is a symlink to a missing file",
            ),
            e => io_err(field, path, e),
        })?;
        Ok((File::from(fd), real, true))
    }

    /// `mkdir -p` of `rel` under its base: every level is opened through [`Jail::open_at`], so
    /// a symlink met on the way is followed only while it stays under the base.
    fn make_dirs(
        &self,
        field: &'static str,
        path: &str,
        (id, rel): (BaseId, &Path),
    ) -> Result<(OwnedFd, PathBuf)> {
        let dir_flags = OFlags::RDONLY | OFlags::DIRECTORY;
        let mut current = self.open_at(field, path, (id, Path::new(".")), dir_flags)?;
        let mut prefix = PathBuf::new();
        for comp in rel.components() {
            prefix.push(comp.as_os_str());
            current = match self.open_at(field, path, (id, &prefix), dir_flags) {
                Ok(next) => next,
                Err(ToolError::NotFound { .. }) => {
                    let Component::Normal(name) = comp else {
                        return Err(io_err(field, path, "cannot create this directory"));
                    };
                    match rustix::fs::mkdirat(&current.0, name, Mode::from_raw_mode(0o755)) {
                        Ok(()) | Err(Errno::EXIST) => {}
                        Err(e) => return Err(io_err(field, path, e)),
                    }
                    self.open_at(field, path, (id, &prefix), dir_flags)?
                }
                Err(e) => return Err(e),
            };
        }
        Ok(current)
    }

    /// The path of `real` relative to the root, as the model should write it (absolute when
    /// it lies in a grant).
    pub fn shown(&self, real: &Path) -> String {
        real.strip_prefix(self.root())
            .map(|p| dot_if_empty(p).display().to_string())
            .unwrap_or_else(|_| real.display().to_string())
    }
}

/// How often `openat2` is asked again after it could not rule out a `..` escape.
const OPENAT2_RETRIES: usize = 32;

/// `openat2` confined beneath `base`. It fails with `EAGAIN` when a rename or mount anywhere on
/// the system raced its resolution of a `..` (it cannot then prove the path stayed beneath):
/// the kernel's advice is to ask again, which is what a busy machine needs.
fn openat2_beneath(base: &OwnedFd, rel: &Path, flags: OFlags) -> rustix::io::Result<OwnedFd> {
    let mut tries = 0;
    loop {
        match rustix::fs::openat2(
            base,
            rel,
            flags,
            Mode::empty(),
            ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS,
        ) {
            Err(Errno::AGAIN) if tries < OPENAT2_RETRIES => tries += 1,
            other => return other,
        }
    }
}

/// Without `openat2`: open without following a final symlink; the caller checks the real path
/// of what was opened before using it.
fn open_fallback(base: &OwnedFd, rel: &Path, flags: OFlags) -> rustix::io::Result<OwnedFd> {
    rustix::fs::openat(base, rel, flags | OFlags::NOFOLLOW, Mode::empty())
}

/// Opens a granted directory: absolute, a directory, not protected (nor the filesystem's root,
/// which would hold every protected path).
fn open_grant(given: &Path, protected: &Protected) -> std::result::Result<Base, String> {
    if !given.is_absolute() {
        return Err("not an absolute path".into());
    }
    let fd = rustix::fs::open(
        given,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| e.to_string())?;
    let real = real_path(&fd).map_err(|e| e.to_string())?;
    if protected.covers(&real) || protected.paths().iter().any(|p| p.starts_with(&real)) {
        return Err("is or holds a protected path".into());
    }
    Ok(Base {
        fd,
        real,
        given: given.to_path_buf(),
    })
}

fn dot_if_empty(p: &Path) -> PathBuf {
    if p.as_os_str().is_empty() {
        PathBuf::from(".")
    } else {
        p.to_path_buf()
    }
}

pub fn file_type(fd: impl AsFd) -> rustix::io::Result<FileType> {
    Ok(FileType::from_raw_mode(rustix::fs::fstat(fd)?.st_mode))
}

/// An opened `path` as a blocking `File`; anything but a regular file is refused.
fn regular_file(fd: OwnedFd, field: &'static str, path: &str) -> Result<File> {
    let kind = file_type(&fd).map_err(|e| io_err(field, path, e))?;
    if kind != FileType::RegularFile {
        return Err(io_err(
            field,
            path,
            format!("is not a regular file ({kind:?})"),
        ));
    }
    clear_nonblock(&fd).map_err(|e| io_err(field, path, e))?;
    Ok(File::from(fd))
}

fn clear_nonblock(fd: impl AsFd) -> rustix::io::Result<()> {
    let flags = rustix::fs::fcntl_getfl(&fd)?;
    rustix::fs::fcntl_setfl(&fd, flags - OFlags::NONBLOCK)
}

/// Whether a directory entry's name is one a listing shows.
pub fn visible_name(name: &OsStr) -> bool {
    name != "." && name != ".."
}
