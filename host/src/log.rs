//! The process's log: the library reports through `tracing` events and [`init`] installs the
//! subscriber that writes them, one line each on stderr, as text or as JSON objects, filtered by
//! `RUST_LOG` (`info` when unset). Lines are handed to a writer thread through a bounded queue:
//! a stderr that blocks (a full pipe, a slow collector) never stalls the thread that logged; past
//! [`QUEUED_LINES`] waiting lines, new ones are dropped (and counted, [`dropped_lines`]) rather
//! than waited for. Events name requests by id and tenants by name; none carries a prompt, a
//! completion, a key or a plugin's output (those go to the tenant's own plugin log).
//!
//! Targets an operator filters on: `warden::access` (one line per HTTP request, see
//! `serve::access`), `warden::isolation` (a refused KV read or write, at ERROR), `warden::plugin`
//! (a plugin's failure, at WARN), and each module's own.

use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// `2026-12-07T04:36:53.123456Z  INFO target: message key=value ...`.
    #[default]
    Text,
    /// One JSON object per line: `timestamp`, `level`, `target`, `message` and the fields.
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = LogError;

    fn from_str(s: &str) -> Result<Self, LogError> {
        match s {
            "text" => Ok(Self::Text),
            "json" => Ok(Self::Json),
            other => Err(LogError::Format(other.to_string())),
        }
    }
}

/// Why the log could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// `--log-format` named neither format.
    #[error("log format {0:?}: expected text or json")]
    Format(String),
    /// `RUST_LOG` does not parse.
    #[error("RUST_LOG={0:?}: {1}")]
    Filter(String, String),
    /// A subscriber was installed already.
    #[error("installing the log: {0}")]
    Install(String),
}

/// Days since 1970-01-01 as (year, month, day), proleptic Gregorian (Howard Hinnant's
/// `civil_from_days`).
pub fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// `secs` after the Unix epoch as RFC 3339 in UTC (`2026-12-07T04:36:53Z`), as every time the
/// project prints for people reads.
pub fn rfc3339(secs: u64) -> String {
    let (year, month, day) = civil_from_days((secs / 86_400) as i64);
    let rem = secs % 86_400;
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Lines the writer thread may have waiting before new ones are dropped.
pub const QUEUED_LINES: usize = 65_536;

static DROPPED: std::sync::OnceLock<tracing_appender::non_blocking::ErrorCounter> = std::sync::OnceLock::new();

/// Lines dropped because the queue was full (0 before [`init`]).
pub fn dropped_lines() -> usize {
    DROPPED.get().map_or(0, |c| c.dropped_lines())
}

/// Keeps the writer thread: dropping it writes what is queued and ends the thread.
pub type LogGuard = tracing_appender::non_blocking::WorkerGuard;

/// Installs the process's subscriber: `format` lines on stderr, filtered by `RUST_LOG` (`info`
/// when it is unset or empty; a directive that does not parse is an error naming it). Keep the
/// guard until the process ends: dropping it flushes the queue.
pub fn init(format: LogFormat) -> Result<LogGuard, LogError> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(s) if !s.trim().is_empty() => {
            EnvFilter::try_new(&s).map_err(|e| LogError::Filter(s.clone(), e.to_string()))?
        }
        _ => EnvFilter::new("info"),
    };
    // wasmtime-wasi traces each host call with its arguments: a plugin's strings (a name it
    // looks up, say) would reach the operator's log. Off, whatever RUST_LOG says.
    let filter = ["wasmtime_wasi=off", "wasmtime_wasi_io=off"]
        .into_iter()
        .fold(filter, |f, d| f.add_directive(d.parse().expect("a valid directive")));
    let (writer, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .buffered_lines_limit(QUEUED_LINES)
        .lossy(true)
        .thread_name("warden-log")
        .finish(std::io::stderr());
    let _ = DROPPED.set(writer.error_counter());
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_ansi(false);
    match format {
        LogFormat::Text => fmt.try_init(),
        LogFormat::Json => fmt.json().flatten_event(true).try_init(),
    }
    .map_err(|e| LogError::Install(e.to_string()))?;
    Ok(guard)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_read_as_rfc_3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_796_619_413), "2026-12-07T04:56:53Z");
        assert_eq!(rfc3339(4_107_542_399), "2100-02-28T23:59:59Z");
    }
}
