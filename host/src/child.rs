//! Work a tenant's input controls, run in a child process of the server's own binary (compiling
//! a plugin, checking that a schema compiles): the only way such work can be stopped when its
//! time runs out, with its memory given back.
//!
//! [`run`] starts the child confined before it runs anything of the tenant's: a memory limit
//! (`RLIMIT_AS` or `RLIMIT_DATA`), a CPU-time limit (`RLIMIT_CPU`), no core dumps and a lower priority
//! than the server's own threads. The input goes in on stdin; stdout (up to a cap) and stderr
//! come back. The child is killed at its wall-time limit, when its output passes the cap, and
//! when the caller stops waiting (the future is dropped). A child that crashes takes down only
//! itself.

use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Which of a child's memory its bound holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Memory {
    /// Its whole address space, bytes (`RLIMIT_AS`): for a child whose threads and mappings are
    /// part of what it may use.
    AddressSpace(u64),
    /// Its data: heap and private writable mappings, bytes (`RLIMIT_DATA`): what a
    /// single-threaded child allocates, not the binary it runs.
    Data(u64),
}

/// The bounds of one child.
#[derive(Debug, Clone, Copy)]
pub struct Confined {
    /// Memory.
    pub memory: Memory,
    /// Wall time; the CPU-time limit is this rounded up to seconds, plus one.
    pub timeout: Duration,
    /// Most stdout bytes read back; past it the child is killed.
    pub stdout_cap: u64,
}

/// What a child that ran to its end gave.
#[derive(Debug)]
pub struct Finished {
    /// How it ended.
    pub status: ExitStatus,
    /// What it wrote to stdout.
    pub stdout: Vec<u8>,
    /// What it wrote to stderr (the first 64 KiB), as text.
    pub stderr: String,
}

impl Finished {
    /// The signal that ended it, if one did.
    pub fn signal(&self) -> Option<i32> {
        use std::os::unix::process::ExitStatusExt;
        self.status.signal()
    }

    /// Whether it ran out of CPU time (`RLIMIT_CPU`'s `SIGXCPU`) or memory (an allocation
    /// refused under `RLIMIT_AS`: Rust aborts, saying so on stderr).
    pub fn over_limits(&self) -> Option<Limit> {
        match self.signal() {
            Some(libc::SIGXCPU) => Some(Limit::Time),
            Some(libc::SIGABRT) => Some(Limit::Memory),
            _ if self.stderr.contains("memory allocation of") => Some(Limit::Memory),
            _ => None,
        }
    }
}

/// Which bound a child ran into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// Its time.
    Time,
    /// Its memory.
    Memory,
}

/// Why a child gave nothing.
#[derive(Debug, thiserror::Error)]
pub enum ChildError {
    /// Starting it, or talking to it, failed.
    #[error("the child process: {what}: {cause}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The error.
        cause: std::io::Error,
    },
    /// It ran past its wall time, and was killed.
    #[error("the child process ran past its time limit of {0:?}")]
    TimedOut(Duration),
    /// It wrote more than the cap to stdout, and was killed.
    #[error("the child process wrote more than {0} bytes")]
    TooMuchOutput(u64),
}

/// Sets the child's limits before it runs.
fn confine(cmd: &mut tokio::process::Command, limits: Confined) {
    let cpu = limits.timeout.as_secs() + 1;
    let (which, memory) = match limits.memory {
        Memory::AddressSpace(b) => (libc::RLIMIT_AS, b),
        Memory::Data(b) => (libc::RLIMIT_DATA, b),
    };
    // SAFETY: the closure runs in the forked child before exec and calls only async-signal-safe
    // functions (setrlimit, setpriority) on values copied in; it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            let set = |resource, value: u64| {
                let lim = libc::rlimit {
                    rlim_cur: value as libc::rlim_t,
                    rlim_max: value as libc::rlim_t,
                };
                if libc::setrlimit(resource, &lim) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            };
            set(which, memory)?;
            set(libc::RLIMIT_CPU, cpu)?;
            set(libc::RLIMIT_CORE, 0)?;
            // Below the server's own threads: the child's work waits while serving has work.
            libc::setpriority(libc::PRIO_PROCESS, 0, 10);
            Ok(())
        });
    }
}

/// Runs `exe args` confined by `limits`, with an empty environment but `env`, `input` on stdin.
pub async fn run(
    exe: &Path,
    args: &[&str],
    env: &[(&str, &str)],
    input: &[u8],
    limits: Confined,
) -> Result<Finished, ChildError> {
    let io = |what: &'static str| move |cause| ChildError::Io { what, cause };
    let mut cmd = tokio::process::Command::new(exe);
    cmd.args(args)
        .env_clear()
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    confine(&mut cmd, limits);
    let mut child = cmd.spawn().map_err(io("starting"))?;
    let (Some(mut stdin), Some(stdout), Some(stderr)) = (child.stdin.take(), child.stdout.take(), child.stderr.take())
    else {
        return Err(ChildError::Io {
            what: "its pipes",
            cause: std::io::Error::other("missing"),
        });
    };
    let cap = limits.stdout_cap;
    let input = input.to_vec();
    let work = async move {
        let write = async move {
            // A child that exits early closes its end; its status says why.
            let _ = stdin.write_all(&input).await;
            drop(stdin);
        };
        let mut out = Vec::new();
        let mut err = Vec::new();
        let (mut stdout, mut stderr) = (stdout.take(cap + 1), stderr.take(64 << 10));
        let read = stdout.read_to_end(&mut out);
        let read_err = stderr.read_to_end(&mut err);
        let ((), r, _) = tokio::join!(write, read, read_err);
        r.map_err(io("reading its output"))?;
        if out.len() as u64 > cap {
            // It would block on the full pipe: stop it now, and hold none of it.
            let _ = child.kill().await;
            return Err(ChildError::TooMuchOutput(cap));
        }
        let status = child.wait().await.map_err(io("waiting"))?;
        Ok(Finished {
            status,
            stdout: out,
            stderr: String::from_utf8_lossy(&err).into_owned(),
        })
    };
    match tokio::time::timeout(limits.timeout, work).await {
        Ok(r) => r,
        // Dropping the future kills the child (kill_on_drop).
        Err(_) => Err(ChildError::TimedOut(limits.timeout)),
    }
}
