//! Whether a tenant's format compiles within its bounds, found out where the work can be
//! stopped: in a child process of the server's binary (`warden check-grammar`), confined as
//! [`crate::child`] says and killed when its time runs out, its memory going back with it.
//!
//! The child compiles the format exactly as the server does but over a vocabulary of the 256
//! single bytes. What a compile costs beyond llguidance's own fuel limits is the grammar and its
//! lexer's regular expressions (a `multipleOf` automaton, say), which do not depend on the
//! vocabulary; what does (walking the model's token trie) runs under those fuel limits. A
//! format the child compiled within its time and memory therefore compiles within about as much
//! in the server, which then does it once more against the model's vocabulary.

use std::path::Path;
use std::time::Duration;

use llguidance::ParserFactory;
use llguidance::toktrie::{ApproximateTokEnv, InferenceCapabilities};

use super::error::GrammarError;
use super::format::{Format, GrammarLimits, parser_limits, top_level};
use crate::child::{self, ChildError, Confined, Limit, Memory};

/// The subcommand of the server's binary that checks a format (see [`check_main`]).
pub const SUBCOMMAND: &str = "check-grammar";

/// Exit status of a child that refused the format (its message on stderr).
const INVALID: i32 = 2;

/// What the parent sends.
#[derive(serde::Serialize, serde::Deserialize)]
struct Ask {
    format: Format,
    max_schema_bytes: usize,
}

/// What the child answers on success.
#[derive(serde::Serialize, serde::Deserialize)]
struct Answer {
    /// How much the compile grew its peak resident memory, bytes.
    grew: u64,
}

/// Peak resident memory of this process, bytes.
fn peak_rss() -> u64 {
    // SAFETY: getrusage writes into the zeroed struct it is given and nothing else.
    let usage = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut u);
        u
    };
    (usage.ru_maxrss.max(0) as u64) << 10
}

/// The whole of `warden check-grammar`: a format on stdin (JSON), compiled over a byte-level
/// vocabulary; exits 0 (with how much memory it took on stdout), 2 when the format is refused
/// (saying why on stderr), 1 when it could not read or write.
pub fn check_main() -> i32 {
    use std::io::Read;
    let mut bytes = Vec::new();
    if let Err(e) = std::io::stdin().read_to_end(&mut bytes) {
        eprintln!("reading the format: {e}");
        return 1;
    }
    let ask: Ask = match serde_json::from_slice(&bytes) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("reading the format: {e}");
            return 1;
        }
    };
    drop(bytes);
    let env = ApproximateTokEnv::single_byte_env();
    let mut factory = match ParserFactory::new(&env, InferenceCapabilities::default(), &[]) {
        Ok(f) => f,
        Err(e) => {
            eprint!("{e}");
            return 1;
        }
    };
    factory.quiet();
    *factory.limits_mut() = parser_limits();
    let before = peak_rss();
    let grammar = match top_level(&ask.format, ask.max_schema_bytes) {
        Ok(Some(g)) => g,
        Ok(None) => return 0,
        Err(e) => {
            eprint!("{e}");
            return INVALID;
        }
    };
    if let Err(e) = factory.create_parser(grammar) {
        eprint!("{e}");
        return INVALID;
    }
    let answer = Answer {
        grew: peak_rss().saturating_sub(before),
    };
    match serde_json::to_string(&answer) {
        Ok(s) => {
            println!("{s}");
            0
        }
        Err(_) => 1,
    }
}

/// Checks `format` in a child of `exe` (the server's binary) under `limits`: how much memory
/// its compile took, or why it cannot be compiled.
pub async fn in_child(exe: &Path, format: &Format, limits: GrammarLimits) -> Result<u64, GrammarError> {
    let ask = Ask {
        format: format.clone(),
        max_schema_bytes: limits.max_schema_bytes,
    };
    let input = serde_json::to_vec(&ask).map_err(|e| GrammarError::Unavailable(e.to_string()))?;
    let confined = Confined {
        memory: Memory::Data(limits.memory_bytes),
        timeout: Duration::from_millis(limits.compile_ms),
        stdout_cap: 4096,
    };
    let unavailable = |e: String| GrammarError::Unavailable(format!("checking the format in a child process: {e}"));
    let done = match child::run(exe, &[SUBCOMMAND], &[("RAYON_NUM_THREADS", "1")], &input, confined).await {
        Ok(d) => d,
        Err(ChildError::TimedOut(_)) => return Err(GrammarError::TimedOut { ms: limits.compile_ms }),
        Err(e) => return Err(unavailable(e.to_string())),
    };
    if done.status.success() {
        let answer: Answer = serde_json::from_slice(&done.stdout).map_err(|e| unavailable(e.to_string()))?;
        return Ok(answer.grew);
    }
    Err(match (done.status.code(), done.over_limits()) {
        (Some(INVALID), _) => GrammarError::Invalid(done.stderr.trim().to_string()),
        (_, Some(Limit::Time)) => GrammarError::TimedOut { ms: limits.compile_ms },
        (_, Some(Limit::Memory)) => GrammarError::TooMuchMemory {
            mib: limits.memory_bytes >> 20,
        },
        _ => unavailable(format!("it failed ({}): {}", done.status, done.stderr.trim())),
    })
}
