//! Compiling a component outside the server's process (invariant 8: compiling is work a tenant
//! causes, so it is bounded and charged to that tenant's upload).
//!
//! [`compile_isolated`] runs the server's own binary as `warden compile-plugin` in a child
//! process: the component's bytes go in on stdin, the compiled artefact comes back on stdout.
//! The child runs at a lower priority, on one compiler thread, under an address-space limit
//! (`RLIMIT_AS`) and a CPU-time limit (`RLIMIT_CPU`), and the parent kills it at its wall-time
//! limit. A component that is slow or large to compile costs at most those; a compiler that
//! crashes on it takes down only the child. The parent then loads the artefact into its own
//! runtime, which checks the component's imports and its per-component pool limits as for any
//! compile.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{Plugin, PluginFailure, Runtime};

/// The bounds of one compilation.
#[derive(Debug, Clone, Copy)]
pub struct CompileLimits {
    /// Wall time.
    pub timeout: Duration,
    /// Address space of the compiling process, bytes.
    pub memory_bytes: u64,
}

/// The subcommand of the server's binary that compiles (see [`precompile_main`]).
pub const SUBCOMMAND: &str = "compile-plugin";

/// The most artefact bytes the parent reads back per component byte (plus a fixed 64 MiB):
/// machine code is a few times the size of the wasm it came from.
const ARTEFACT_RATIO: usize = 16;

/// Exit status of a child that refused the component (its message on stderr).
const INVALID: i32 = 2;

/// The child's side: compiles `bytes` and returns the artefact ([`Runtime::load_artefact`]
/// loads it).
pub fn precompile(bytes: &[u8]) -> Result<Vec<u8>, PluginFailure> {
    let engine = wasmtime::Engine::new(&Runtime::config())
        .map_err(|e| PluginFailure::Invalid(format!("the compiler's engine: {e:#}")))?;
    engine.precompile_component(bytes).map_err(super::invalid)
}

/// The whole of `warden compile-plugin`: component on stdin, artefact on stdout. Returns the
/// process's exit status: 0, 1 when it could not read or write, 2 when it refused the component
/// (saying why on stderr).
pub fn precompile_main() -> i32 {
    use std::io::{Read, Write};
    let mut bytes = Vec::new();
    if let Err(e) = std::io::stdin().read_to_end(&mut bytes) {
        eprintln!("reading the component: {e}");
        return 1;
    }
    match precompile(&bytes) {
        Ok(artefact) => match std::io::stdout()
            .write_all(&artefact)
            .and_then(|()| std::io::stdout().flush())
        {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("writing the artefact: {e}");
                1
            }
        },
        Err(PluginFailure::Invalid(why)) => {
            eprint!("{why}");
            INVALID
        }
        Err(e) => {
            eprint!("{e}");
            INVALID
        }
    }
}

/// Sets the child's limits before it runs the compiler.
fn confine(cmd: &mut tokio::process::Command, limits: CompileLimits) {
    let cpu = limits.timeout.as_secs() + 1;
    let memory = limits.memory_bytes;
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
            set(libc::RLIMIT_AS, memory)?;
            set(libc::RLIMIT_CPU, cpu)?;
            set(libc::RLIMIT_CORE, 0)?;
            // Below the server's own threads: compiling waits while serving has work.
            libc::setpriority(libc::PRIO_PROCESS, 0, 10);
            Ok(())
        });
    }
}

/// Compiles `bytes` in a child process of `exe` (the server's binary) under `limits`, and
/// loads the artefact into `runtime`.
pub async fn compile_isolated(
    exe: &Path,
    runtime: &Runtime,
    bytes: &[u8],
    limits: CompileLimits,
) -> Result<Plugin, PluginFailure> {
    let failed = |what: &str, e: std::io::Error| PluginFailure::Invalid(format!("the compiler process: {what}: {e}"));
    let mut cmd = tokio::process::Command::new(exe);
    cmd.arg(SUBCOMMAND)
        .env_clear()
        .env("RAYON_NUM_THREADS", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    confine(&mut cmd, limits);
    let mut child = cmd.spawn().map_err(|e| failed("starting", e))?;
    let (Some(mut stdin), Some(stdout), Some(stderr)) = (child.stdin.take(), child.stdout.take(), child.stderr.take())
    else {
        return Err(PluginFailure::Invalid("the compiler process has no pipes".into()));
    };
    let cap = (bytes.len().saturating_mul(ARTEFACT_RATIO) + (64 << 20)) as u64;
    let input = bytes.to_vec();
    let run = async move {
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
        r.map_err(|e| failed("reading its output", e))?;
        if out.len() as u64 > cap {
            // More machine code than the component could justify: stop the child now (it
            // would block on the full pipe) and hold none of it.
            let _ = child.kill().await;
            return Err(PluginFailure::CompileMemory(limits.memory_bytes));
        }
        let status = child.wait().await.map_err(|e| failed("waiting", e))?;
        Ok::<_, PluginFailure>((status, out, err))
    };
    let (status, out, err) = match tokio::time::timeout(limits.timeout, run).await {
        Ok(r) => r?,
        // Dropping the future kills the child (kill_on_drop).
        Err(_) => return Err(PluginFailure::CompileTimeout(limits.timeout)),
    };
    let err = String::from_utf8_lossy(&err);
    if !status.success() {
        use std::os::unix::process::ExitStatusExt;
        return Err(match (status.code(), status.signal()) {
            (Some(INVALID), _) => PluginFailure::Invalid(err.trim().to_string()),
            (_, Some(libc::SIGXCPU)) => PluginFailure::CompileTimeout(limits.timeout),
            _ if err.contains("memory allocation of") || status.signal() == Some(libc::SIGABRT) => {
                PluginFailure::CompileMemory(limits.memory_bytes)
            }
            _ => PluginFailure::Invalid(format!("the compiler process failed ({status}): {}", err.trim())),
        });
    }
    // SAFETY: `out` is what `precompile` returned in a child running this same binary with this
    // runtime's configuration, read from a pipe only that child writes; wasmtime checks the
    // version and settings it records as well.
    unsafe { runtime.load_artefact(&out) }
}

/// The server's compiler: [`compile_isolated`] in child processes of `exe`, at most `turns` at
/// once (more wait their turn), each under `limits`, loading into `runtime`.
pub struct Compiler {
    exe: std::path::PathBuf,
    runtime: std::sync::Arc<Runtime>,
    turns: tokio::sync::Semaphore,
    limits: CompileLimits,
}

impl Compiler {
    /// Compiles with `exe` (the server's binary), `turns` compilations at once.
    pub fn new(exe: &Path, runtime: std::sync::Arc<Runtime>, turns: usize, limits: CompileLimits) -> Self {
        Self {
            exe: exe.to_path_buf(),
            runtime,
            turns: tokio::sync::Semaphore::new(turns),
            limits,
        }
    }

    /// The runtime compiled plugins load into.
    pub fn runtime(&self) -> &Runtime {
        &self.runtime
    }

    /// Compiles `bytes` in a child process, once its turn comes: seconds of CPU for a large
    /// component, which no component can stretch past its bounds.
    pub async fn compile(&self, bytes: &[u8]) -> Result<Plugin, PluginFailure> {
        let _turn = self
            .turns
            .acquire()
            .await
            .map_err(|e| PluginFailure::Invalid(format!("compiling: {e}")))?;
        compile_isolated(&self.exe, &self.runtime, bytes, self.limits).await
    }
}
