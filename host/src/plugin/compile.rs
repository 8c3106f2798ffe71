//! Compiling a component outside the server's process (invariant 8: compiling is work a tenant
//! causes, so it is bounded and charged to that tenant's upload).
//!
//! [`compile_isolated`] runs the server's own binary as `warden compile-plugin` in a child
//! process confined as [`crate::child`] says (a lower priority, an address-space and a CPU-time
//! limit, killed at its wall-time limit), on one compiler thread: the component's bytes go in
//! on stdin, the compiled artefact comes back on stdout. A component that is slow or large to
//! compile costs at most those; a compiler that crashes on it takes down only the child. The
//! parent then loads the artefact into its own runtime, which checks the component's imports
//! and its per-component pool limits as for any compile.

use std::path::Path;
use std::time::Duration;

use super::{Plugin, PluginFailure, Runtime};
use crate::child::{self, ChildError, Confined, Limit, Memory};
use crate::fair::{Turn, Turns};
use crate::tenant::TenantId;

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

/// Compiles `bytes` in a child process of `exe` (the server's binary) under `limits`, and
/// loads the artefact into `runtime`.
pub async fn compile_isolated(
    exe: &Path,
    runtime: &Runtime,
    bytes: &[u8],
    limits: CompileLimits,
) -> Result<Plugin, PluginFailure> {
    let confined = Confined {
        memory: Memory::AddressSpace(limits.memory_bytes),
        timeout: limits.timeout,
        stdout_cap: (bytes.len().saturating_mul(ARTEFACT_RATIO) + (64 << 20)) as u64,
    };
    let done = match child::run(exe, &[SUBCOMMAND], &[("RAYON_NUM_THREADS", "1")], bytes, confined).await {
        Ok(d) => d,
        Err(ChildError::TimedOut(_)) => return Err(PluginFailure::CompileTimeout(limits.timeout)),
        // More machine code than the component could justify.
        Err(ChildError::TooMuchOutput(_)) => return Err(PluginFailure::CompileMemory(limits.memory_bytes)),
        Err(e) => return Err(PluginFailure::Invalid(format!("the compiler process: {e}"))),
    };
    if !done.status.success() {
        return Err(match (done.status.code(), done.over_limits()) {
            (Some(INVALID), _) => PluginFailure::Invalid(done.stderr.trim().to_string()),
            (_, Some(Limit::Time)) => PluginFailure::CompileTimeout(limits.timeout),
            (_, Some(Limit::Memory)) => PluginFailure::CompileMemory(limits.memory_bytes),
            _ => PluginFailure::Invalid(format!(
                "the compiler process failed ({}): {}",
                done.status,
                done.stderr.trim()
            )),
        });
    }
    // SAFETY: `stdout` is what `precompile` returned in a child running this same binary with
    // this runtime's configuration, read from a pipe only that child writes; wasmtime checks the
    // version and settings it records as well.
    unsafe { runtime.load_artefact(&done.stdout) }
}

/// The server's compiler: [`compile_isolated`] in child processes of `exe`, each under
/// `limits`, loading into `runtime`. Compiling is shared capacity: at most `turns` compile at
/// once, taken fairly across tenants ([`Turns`]), one at a time per tenant, so a tenant's
/// uploads wait behind each other, never in front of another tenant's.
pub struct Compiler {
    exe: std::path::PathBuf,
    runtime: std::sync::Arc<Runtime>,
    turns: Turns,
    limits: CompileLimits,
}

impl Compiler {
    /// Compiles with `exe` (the server's binary), `turns` compilations at once.
    pub fn new(exe: &Path, runtime: std::sync::Arc<Runtime>, turns: usize, limits: CompileLimits) -> Self {
        Self {
            exe: exe.to_path_buf(),
            runtime,
            turns: Turns::new(turns, 1),
            limits,
        }
    }

    /// The runtime compiled plugins load into.
    pub fn runtime(&self) -> &Runtime {
        &self.runtime
    }

    /// The limits each compilation runs under.
    pub fn limits(&self) -> CompileLimits {
        self.limits
    }

    /// A turn at the compiler for `tenant`, once its turn comes.
    pub async fn turn(&self, tenant: TenantId) -> Turn {
        self.turns.take(tenant).await
    }

    /// Compiles `bytes` in a child process in `turn` (the tenant's turn at the compiler): seconds
    /// of CPU for a large component, which no component can stretch past its bounds.
    pub async fn compile(&self, _turn: &Turn, bytes: &[u8]) -> Result<Plugin, PluginFailure> {
        compile_isolated(&self.exe, &self.runtime, bytes, self.limits).await
    }
}
