//! What keeps a `shell::exec` command away from every other process: its own PID namespace and
//! mount namespace with a fresh `/proc`, no capabilities, `NO_NEW_PRIVS`, then Landlock.
//!
//! A command reads other processes through `/proc`: the harness's `environ` holds provider keys
//! and `HARNESS_TOKEN`, and any process's `cmdline` may hold a `--token`. The mechanisms weighed:
//!
//! - `hidepid=2` on `/proc` hides processes of other uids only: a command of the harness's own
//!   uid (and root) still reads the harness, and remounting the host's `/proc` is not ours to do.
//! - Dropping to another uid when root needs a spare uid the host grants, does nothing for a
//!   harness that is not root, and leaves `cmdline` of every process world-readable.
//! - Making the harness non-dumpable guards its own `environ` and `mem`, but not other
//!   processes, and not a root command holding `CAP_SYS_PTRACE`.
//!
//! A private PID namespace answers all of it the same way as root and not: the fresh `/proc`
//! mounted in it lists only the command's own processes, and no pid the command can name (for
//! `kill`, `ptrace`, `pidfd_open`, `process_vm_readv`) belongs to anything outside. Without
//! root, a user namespace (own uid and gid mapped to themselves, `setgroups` denied) comes
//! first, so the namespaces can be made; the mapped uid is not 0, so the command has no
//! capability after `exec`. As root, every capability is dropped (bounding, ambient,
//! effective, permitted, inheritable), so the command cannot unmount its `/proc` to uncover the
//! host's, mount another, or `setns` out; Landlock also forbids every mount change.
//!
//! `unshare(CLONE_NEWPID)` moves only the caller's next child, so the forked child (C) makes
//! the namespaces with a raw `clone` (no `atfork` handlers, no libc locks), its child (G) is
//! pid 1 of the new namespace and goes on to `exec` the command. C closes every descriptor it
//! holds (so the pipes and the exec-status pipe of `std` belong to G alone), waits for G and
//! ends the way G ended (same exit code, same signal). G dies with C (`PDEATHSIG`), and every
//! process of the namespace dies with G, so a kill of C's process group on a timeout ends all
//! of it, even a process that called `setsid`.
//!
//! The command itself is pid 1, not an init of ours that forks it: a forked copy of the harness
//! inside the namespace would carry the harness's memory, and its `/proc/1/cmdline` (readable
//! by anyone) the harness's arguments, `--token` included. The price is pid 1's rule that it
//! ignores signals it has no handler for when they come from inside: `kill $$` in the top-level
//! shell does not end it (its children, and a timeout, still do).
//!
//! Everything between `fork` and `exec` is system calls on buffers prepared before the fork:
//! the parent has other threads, whose locks a child must never wait on.

use std::io::{self, Write};
use std::sync::OnceLock;

/// How the namespaces are made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// The harness may make them itself (root, `CAP_SYS_ADMIN`).
    Privileged,
    /// Through a user namespace of its own first (any uid).
    User,
}

/// The steps of the child, to name the one that failed.
#[derive(Clone, Copy, Debug)]
#[repr(u8)]
enum Step {
    UserNs = 1,
    SetGroups,
    UidMap,
    GidMap,
    Clone,
    PrivateMounts,
    MountProc,
    ProcSelf,
    ProcRule,
    Capabilities,
    NoNewPrivs,
    Landlock,
}

impl Step {
    fn from_u8(n: u8) -> &'static str {
        match n {
            1 => "unshare(CLONE_NEWUSER)",
            2 => "writing /proc/self/setgroups",
            3 => "writing /proc/self/uid_map",
            4 => "writing /proc/self/gid_map",
            5 => "clone(CLONE_NEWPID | CLONE_NEWNS)",
            6 => "making the mounts private",
            7 => "mounting a fresh /proc",
            8 => "reading /proc/self in the new namespace",
            9 => "granting the fresh /proc to Landlock",
            10 => "dropping capabilities",
            11 => "prctl(PR_SET_NO_NEW_PRIVS)",
            12 => "landlock_restrict_self",
            _ => "an unknown step",
        }
    }
}

type Res = Result<(), (Step, i32)>;

/// A `uid_map`/`gid_map` line, formatted before the fork.
#[derive(Clone, Copy)]
struct Line {
    buf: [u8; 40],
    len: usize,
}

impl Line {
    fn identity(id: u32) -> Line {
        let mut buf = [0u8; 40];
        let len = {
            let mut w: &mut [u8] = &mut buf;
            let before = w.len();
            // 2 * 10 digits + 2 spaces + "1\n" always fits in 40 bytes.
            let _ = writeln!(w, "{id} {id} 1");
            before - w.len()
        };
        Line { buf, len }
    }

    fn bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

/// Everything the child does, prepared in the parent (the child only reads it).
#[derive(Clone, Copy)]
pub struct Plan {
    ns: Option<Mode>,
    maps: (Line, Line),
    /// The Landlock rule set to apply, and the read rights for the fresh `/proc`.
    landlock: Option<(i32, u64)>,
    /// The harness is root: every capability must be gone before `exec`.
    root: bool,
}

impl Plan {
    /// `landlock`: the rule set's descriptor (open in the parent until the spawn returns) and
    /// the rights `/proc` gets in it.
    pub fn new(ns: Option<Mode>, landlock: Option<(i32, u64)>) -> Plan {
        // SAFETY: getuid/getgid/geteuid only return numbers.
        let (uid, gid, euid) = unsafe { (libc::getuid(), libc::getgid(), libc::geteuid()) };
        Plan {
            ns,
            maps: (Line::identity(uid), Line::identity(gid)),
            landlock,
            root: euid == 0,
        }
    }

    /// Whether the command will hold no capability (verified in the child before `exec`).
    pub fn drops_capabilities(&self) -> bool {
        self.ns.is_some() || self.root
    }
}

/// How the namespaces can be made on this machine, asked once (a probe child tries them).
pub fn available() -> Result<Mode, String> {
    static PROBE: OnceLock<Result<Mode, String>> = OnceLock::new();
    PROBE.get_or_init(probe).clone()
}

fn probe() -> Result<Mode, String> {
    let mut why = Vec::new();
    // SAFETY: geteuid only returns a number.
    if unsafe { libc::geteuid() } == 0 {
        match try_mode(Mode::Privileged) {
            Ok(()) => return Ok(Mode::Privileged),
            Err(e) => why.push(format!("as root: {e}")),
        }
    }
    match try_mode(Mode::User) {
        Ok(()) => Ok(Mode::User),
        Err(e) => {
            why.push(format!("in a user namespace: {e}"));
            Err(why.join("; "))
        }
    }
}

/// Makes the namespaces in a throwaway child and reports the step that failed.
fn try_mode(mode: Mode) -> Result<(), String> {
    let plan = Plan::new(Some(mode), None);
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 fills the two descriptors.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(format!("pipe2: {}", io::Error::last_os_error()));
    }
    // SAFETY: the child makes system calls only and ends with _exit.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        let e = io::Error::last_os_error();
        // SAFETY: closing our own descriptors.
        unsafe {
            libc::close(fds[0]);
            libc::close(fds[1]);
        }
        return Err(format!("fork: {e}"));
    }
    if pid == 0 {
        // SAFETY: only system calls until _exit.
        unsafe {
            libc::close(fds[0]);
            let res = enter(&plan).and_then(|()| seal(&plan)).and_then(|()| {
                // The fresh /proc must show this process as pid 1.
                let mut link = [0u8; 16];
                let n =
                    libc::readlink(c"/proc/self".as_ptr(), link.as_mut_ptr().cast(), link.len());
                if n == 1 && link[0] == b'1' {
                    Ok(())
                } else {
                    Err((Step::ProcSelf, if n < 0 { errno() } else { libc::EINVAL }))
                }
            });
            match res {
                Ok(()) => libc::_exit(0),
                Err((step, e)) => {
                    let mut report = [0u8; 5];
                    report[0] = step as u8;
                    report[1..].copy_from_slice(&e.to_ne_bytes());
                    libc::write(fds[1], report.as_ptr().cast(), report.len());
                    libc::_exit(1)
                }
            }
        }
    }
    // SAFETY: our own descriptors and child.
    unsafe {
        libc::close(fds[1]);
        let mut report = [0u8; 5];
        let mut got = 0usize;
        while got < report.len() {
            let n = libc::read(
                fds[0],
                report[got..].as_mut_ptr().cast(),
                report.len() - got,
            );
            if n > 0 {
                got += n as usize;
            } else if n == 0 || errno() != libc::EINTR {
                break;
            }
        }
        libc::close(fds[0]);
        let mut status = 0;
        while libc::waitpid(pid, &mut status, 0) < 0 && errno() == libc::EINTR {}
        if got == report.len() {
            let e = i32::from_ne_bytes([report[1], report[2], report[3], report[4]]);
            return Err(format!(
                "{} failed: {}",
                Step::from_u8(report[0]),
                io::Error::from_raw_os_error(e)
            ));
        }
        if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0 {
            Ok(())
        } else {
            Err(format!("the probe child ended with status {status:#x}"))
        }
    }
}

fn errno() -> i32 {
    io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// Runs in the child between fork and exec: the namespaces (when planned), then the seal.
/// Returns in the process that goes on to `exec` the command.
///
/// # Safety
/// Only from a `pre_exec` closure (or a child of `fork`), with the plan's Landlock descriptor
/// open.
pub unsafe fn child(plan: &Plan) -> io::Result<()> {
    enter(plan)
        .and_then(|()| seal(plan))
        .map_err(|(_, e)| io::Error::from_raw_os_error(e))
}

unsafe fn write_file(path: &std::ffi::CStr, data: &[u8]) -> Result<(), i32> {
    let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
    if fd < 0 {
        return Err(errno());
    }
    let n = libc::write(fd, data.as_ptr().cast(), data.len());
    let e = errno();
    libc::close(fd);
    if n == data.len() as isize {
        Ok(())
    } else if n < 0 {
        Err(e)
    } else {
        Err(libc::EIO)
    }
}

/// Makes the namespaces; returns in G, pid 1 of the new PID namespace, with its own `/proc`.
/// The caller (C) stays behind to relay G's end and never returns.
unsafe fn enter(plan: &Plan) -> Res {
    let Some(mode) = plan.ns else {
        return Ok(());
    };
    if mode == Mode::User {
        if libc::unshare(libc::CLONE_NEWUSER) != 0 {
            return Err((Step::UserNs, errno()));
        }
        write_file(c"/proc/self/setgroups", b"deny").map_err(|e| (Step::SetGroups, e))?;
        write_file(c"/proc/self/uid_map", plan.maps.0.bytes()).map_err(|e| (Step::UidMap, e))?;
        write_file(c"/proc/self/gid_map", plan.maps.1.bytes()).map_err(|e| (Step::GidMap, e))?;
    }
    let flags = (libc::CLONE_NEWPID | libc::CLONE_NEWNS | libc::SIGCHLD) as libc::c_ulong;
    // A raw clone with no new stack is a fork without libc's fork handlers.
    let pid = libc::syscall(libc::SYS_clone, flags, 0usize, 0usize, 0usize, 0usize);
    if pid < 0 {
        return Err((Step::Clone, errno()));
    }
    if pid > 0 {
        relay(pid as libc::pid_t);
    }
    // G. If C is killed (a timeout's group kill), G and with it the namespace go too.
    libc::prctl(
        libc::PR_SET_PDEATHSIG,
        libc::SIGKILL as libc::c_ulong,
        0,
        0,
        0,
    );
    // Private first: a shared root would carry the new /proc into the host's mounts.
    if libc::mount(
        std::ptr::null(),
        c"/".as_ptr(),
        std::ptr::null(),
        libc::MS_REC | libc::MS_PRIVATE,
        std::ptr::null(),
    ) != 0
    {
        return Err((Step::PrivateMounts, errno()));
    }
    if libc::mount(
        c"proc".as_ptr(),
        c"/proc".as_ptr(),
        c"proc".as_ptr(),
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        std::ptr::null(),
    ) != 0
    {
        return Err((Step::MountProc, errno()));
    }
    Ok(())
}

/// C: holds nothing of the command's, waits for G and ends as G ended.
unsafe fn relay(pid: libc::pid_t) -> ! {
    // The stdio pipes and the exec-status pipe of `std` are G's alone from here: the harness
    // learns of a successful exec, and of the end of output, from G.
    if libc::syscall(libc::SYS_close_range, 0u32, u32::MAX, 0u32) != 0 {
        for fd in 0..1024 {
            libc::close(fd);
        }
    }
    let mut status = 0;
    loop {
        let r = libc::waitpid(pid, &mut status, 0);
        if r == pid {
            break;
        }
        if r < 0 && errno() != libc::EINTR {
            libc::_exit(127);
        }
    }
    if libc::WIFEXITED(status) {
        libc::_exit(libc::WEXITSTATUS(status));
    }
    if libc::WIFSIGNALED(status) {
        let sig = libc::WTERMSIG(status);
        // Die of the same signal, without leaving a core file of C.
        let none = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        libc::setrlimit(libc::RLIMIT_CORE, &none);
        libc::signal(sig, libc::SIG_DFL);
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, sig);
        libc::sigprocmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
        libc::kill(libc::getpid(), sig);
        libc::_exit(128 + sig);
    }
    libc::_exit(127)
}

/// `struct landlock_path_beneath_attr`.
#[repr(C, packed)]
struct PathBeneath {
    allowed_access: u64,
    parent_fd: i32,
}

/// In G: the fresh `/proc` granted to Landlock, capabilities dropped, no new privileges, the
/// Landlock rule set applied.
unsafe fn seal(plan: &Plan) -> Res {
    if let (Some(_), Some((ruleset, access))) = (plan.ns, plan.landlock) {
        // The rule set's /proc rule (if any) names the host's /proc; the fresh one is another
        // filesystem and needs its own rule.
        let fd = libc::open(
            c"/proc".as_ptr(),
            libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
        );
        if fd < 0 {
            return Err((Step::ProcRule, errno()));
        }
        let attr = PathBeneath {
            allowed_access: access,
            parent_fd: fd,
        };
        const LANDLOCK_RULE_PATH_BENEATH: libc::c_int = 1;
        let r = libc::syscall(
            libc::SYS_landlock_add_rule,
            ruleset,
            LANDLOCK_RULE_PATH_BENEATH,
            &attr as *const PathBeneath,
            0u32,
        );
        let e = errno();
        libc::close(fd);
        if r != 0 {
            return Err((Step::ProcRule, e));
        }
    }
    if plan.drops_capabilities() {
        drop_capabilities()?;
    }
    if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
        return Err((Step::NoNewPrivs, errno()));
    }
    if let Some((ruleset, _)) = plan.landlock {
        if libc::syscall(libc::SYS_landlock_restrict_self, ruleset, 0u32) != 0 {
            return Err((Step::Landlock, errno()));
        }
    }
    Ok(())
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// Bounding set first (it needs `CAP_SETPCAP`, which the capset below removes), then ambient,
/// then the three sets of the process. The bounding set is read back: a root command that
/// kept one capability would get it again at `exec`.
unsafe fn drop_capabilities() -> Res {
    let mut cap: libc::c_ulong = 0;
    // PR_CAPBSET_READ answers EINVAL past the kernel's last capability.
    while libc::prctl(libc::PR_CAPBSET_READ, cap, 0, 0, 0) >= 0 {
        libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0);
        cap += 1;
    }
    libc::prctl(
        libc::PR_CAP_AMBIENT,
        libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
        0,
        0,
        0,
    );
    const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;
    let header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let data = [CapData {
        effective: 0,
        permitted: 0,
        inheritable: 0,
    }; 2];
    if libc::syscall(libc::SYS_capset, &header as *const CapHeader, data.as_ptr()) != 0 {
        return Err((Step::Capabilities, errno()));
    }
    let mut cap: libc::c_ulong = 0;
    loop {
        match libc::prctl(libc::PR_CAPBSET_READ, cap, 0, 0, 0) {
            0 => cap += 1,
            r if r < 0 => return Ok(()),
            _ => return Err((Step::Capabilities, libc::EPERM)),
        }
    }
}
