//! The tenants' plugin logs: what plugins write through the world's `log` import, one file per
//! tenant (`data_dir/plugin-logs/<tenant id>.log`; ids are never reused, names can be), a line
//! each: its time (RFC 3339), `plugin@version`, the request id, the text.
//!
//! Limits, so a plugin cannot fill the disk or drown the server: an instance writes at most 64
//! lines (the runtime's cap), each at most 1 KiB with control characters escaped; a tenant
//! writes at most 50 lines a second (bursts of 500), and lines beyond are counted and reported
//! as one line; a file past 16 MiB is moved aside to `.log.1` (replacing the older one).

use crate::tenant::TenantId;
use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

const RATE_PER_S: f64 = 50.0;
const BURST: f64 = 500.0;
const MAX_FILE: u64 = 16 << 20;
/// How much of a file's end `tail` reads.
const TAIL_BYTES: u64 = 256 << 10;

struct Bucket {
    tokens: f64,
    at: Instant,
    dropped: u64,
}

/// The log files.
pub struct TenantLogs {
    dir: PathBuf,
    buckets: Mutex<HashMap<TenantId, Bucket>>,
    /// Tenants deleted: a request of theirs still running writes nothing (ids are never
    /// reused).
    gone: Mutex<HashSet<TenantId>>,
}

/// Where one batch of lines came from.
pub struct Source<'a> {
    /// The tenant's id.
    pub tenant: TenantId,
    /// The plugin's name.
    pub plugin: &'a str,
    /// Its version (SHA-256).
    pub version: &'a str,
    /// The request.
    pub request: &'a str,
}

impl TenantLogs {
    /// Logs under `dir` (created when first written).
    pub fn new(dir: &Path) -> Self {
        Self {
            dir: dir.into(),
            buckets: Mutex::new(HashMap::new()),
            gone: Mutex::new(HashSet::new()),
        }
    }

    /// Deletes tenant `tenant`'s log files, and writes none for it again (it was deleted).
    pub fn forget(&self, tenant: TenantId) {
        self.gone.lock().unwrap_or_else(|p| p.into_inner()).insert(tenant);
        self.buckets.lock().unwrap_or_else(|p| p.into_inner()).remove(&tenant);
        let path = self.path(tenant);
        let _ = std::fs::remove_file(path.with_extension("log.1"));
        let _ = std::fs::remove_file(&path);
    }

    fn path(&self, tenant: TenantId) -> PathBuf {
        self.dir.join(format!("{tenant}.log"))
    }

    /// Appends `lines` (from one instance) to the tenant's log, within its rate.
    pub fn write(&self, src: &Source<'_>, lines: Vec<String>) {
        if lines.is_empty()
            || self
                .gone
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains(&src.tenant)
        {
            return;
        }
        let (admitted, dropped) = {
            let mut g = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
            let b = g.entry(src.tenant).or_insert(Bucket {
                tokens: BURST,
                at: Instant::now(),
                dropped: 0,
            });
            let now = Instant::now();
            b.tokens = (b.tokens + now.duration_since(b.at).as_secs_f64() * RATE_PER_S).min(BURST);
            b.at = now;
            let n = (b.tokens.floor() as usize).min(lines.len());
            b.tokens -= n as f64;
            // Earlier drops are reported with the next lines that get through.
            let dropped = if n > 0 { std::mem::take(&mut b.dropped) } else { 0 };
            b.dropped += (lines.len() - n) as u64;
            (n, dropped)
        };
        if admitted == 0 {
            return;
        }
        let at = crate::log::rfc3339(crate::serve::store::error::now());
        let short = src.version.get(..12).unwrap_or(src.version);
        let mut out = String::new();
        if dropped > 0 {
            out.push_str(&format!(
                "{at} {}@{short} {} warn: ({dropped} earlier lines dropped by the rate limit of {RATE_PER_S} lines/s)\n",
                src.plugin, src.request
            ));
        }
        for l in lines.into_iter().take(admitted) {
            out.push_str(&format!("{at} {}@{short} {} {l}\n", src.plugin, src.request));
        }
        let path = self.path(src.tenant);
        if std::fs::metadata(&path).is_ok_and(|m| m.len() > MAX_FILE) {
            let _ = std::fs::rename(&path, path.with_extension("log.1"));
        }
        let _ = std::fs::create_dir_all(&self.dir);
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(&path) {
            let _ = f.write_all(out.as_bytes());
        }
    }

    /// The last `n` lines plugin `plugin` of `tenant` wrote (from the end of the current file).
    pub fn tail(&self, tenant: TenantId, plugin: &str, n: usize) -> Vec<String> {
        use std::io::{Read, Seek, SeekFrom};
        let Ok(mut f) = std::fs::File::open(self.path(tenant)) else {
            return vec![];
        };
        let len = f.metadata().map(|m| m.len()).unwrap_or(0);
        let start = len.saturating_sub(TAIL_BYTES);
        let mut buf = Vec::new();
        if f.seek(SeekFrom::Start(start)).is_err() || f.read_to_end(&mut buf).is_err() {
            return vec![];
        }
        let text = String::from_utf8_lossy(&buf);
        let mut lines: Vec<String> = text
            .lines()
            .skip(usize::from(start > 0))
            .filter(|l| l.split(' ').nth(1).is_some_and(|p| p.split('@').next() == Some(plugin)))
            .map(str::to_string)
            .collect();
        let keep = lines.len().saturating_sub(n);
        lines.drain(..keep);
        lines
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::tenant;

    #[test]
    fn lines_are_rate_limited_per_tenant_and_tailed_per_plugin() {
        let dir = std::env::temp_dir().join(format!("warden-logs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let logs = TenantLogs::new(&dir);
        let src = |tenant, plugin| Source {
            tenant,
            plugin,
            version: "0123456789abcdef",
            request: "req-1",
        };
        let many: Vec<String> = (0..600).map(|i| format!("info: line {i}")).collect();
        logs.write(&src(tenant(1), "a"), many);
        logs.write(&src(tenant(1), "b"), vec!["info: from b".into()]);
        logs.write(&src(tenant(2), "a"), vec!["info: other tenant".into()]);
        let a = logs.tail(tenant(1), "a", 1000);
        assert_eq!(
            a.len(),
            BURST as usize,
            "the burst is the most one tenant writes at once"
        );
        assert!(a[0].ends_with("a@0123456789ab req-1 info: line 0"), "{}", a[0]);
        assert_eq!(logs.tail(tenant(1), "b", 10).len(), 0, "b was over the tenant's rate");
        let other = logs.tail(tenant(2), "a", 10);
        assert_eq!(other.len(), 1);
        assert!(
            other[0].ends_with(" a@0123456789ab req-1 info: other tenant"),
            "{other:?}"
        );
        // A deleted tenant's files go, and a request of its still running writes no new one.
        let kept = logs.path(tenant(1));
        std::fs::copy(&kept, kept.with_extension("log.1")).unwrap();
        logs.forget(tenant(1));
        logs.write(&src(tenant(1), "a"), vec!["info: after".into()]);
        assert!(!kept.exists() && !kept.with_extension("log.1").exists());
        assert_eq!(logs.tail(tenant(2), "a", 10).len(), 1, "another tenant's log stays");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
