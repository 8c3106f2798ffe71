//! This process as the kernel counts it (Linux's `/proc`): CPU time, memory, open files, start
//! time, threads. `GET /metrics` renders them under the names every Prometheus client library
//! uses (`process_cpu_seconds_total`, `process_resident_memory_bytes`, …), so the usual
//! dashboards and alerts work unchanged.

/// What [`read`] found.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ProcStat {
    /// User and system CPU time, seconds.
    pub cpu_seconds: f64,
    /// Resident memory, bytes.
    pub resident_bytes: u64,
    /// Virtual memory, bytes.
    pub virtual_bytes: u64,
    /// Open file descriptors.
    pub open_fds: u64,
    /// The descriptor limit (soft `RLIMIT_NOFILE`).
    pub max_fds: u64,
    /// When the process started, seconds since the Unix epoch.
    pub start_time_seconds: f64,
    /// Threads.
    pub threads: u64,
}

/// `sysconf(name)`, or `fallback` where the system does not say.
fn sysconf(name: libc::c_int, fallback: u64) -> u64 {
    // SAFETY: sysconf reads a configuration value; it takes no pointers.
    let v = unsafe { libc::sysconf(name) };
    if v > 0 { v as u64 } else { fallback }
}

/// This process's figures, or `None` where `/proc` cannot be read (not Linux, or hidden).
pub fn read() -> Option<ProcStat> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: the fields after it
    // start at the state (field 3).
    let after = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = after.split_whitespace().collect();
    let field = |n: usize| f.get(n - 3).and_then(|v| v.parse::<u64>().ok());
    let ticks = sysconf(libc::_SC_CLK_TCK, 100) as f64;
    let page = sysconf(libc::_SC_PAGESIZE, 4096);
    let boot = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime ")?.trim().parse::<u64>().ok())?;
    let open_fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64);
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the struct we own.
    let max_fds = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0 {
        limit.rlim_cur
    } else {
        0
    };
    Some(ProcStat {
        cpu_seconds: (field(14)? + field(15)?) as f64 / ticks,
        resident_bytes: field(24)? * page,
        virtual_bytes: field(23)?,
        open_fds,
        max_fds,
        start_time_seconds: boot as f64 + field(22)? as f64 / ticks,
        threads: field(20)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_read_as_the_kernel_counts_it() {
        let before = read().expect("/proc/self");
        // Some CPU time, a file held open, and memory touched.
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        let file = std::fs::File::open("/proc/self/stat").unwrap();
        let after = read().unwrap();
        drop(file);
        assert!(after.cpu_seconds >= before.cpu_seconds);
        assert!(after.open_fds > 2 && after.max_fds >= after.open_fds, "{after:?}");
        assert!(after.resident_bytes > 1 << 20 && after.virtual_bytes >= after.resident_bytes);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        // This test process started in the last hour, and not in the future.
        assert!(
            after.start_time_seconds <= now + 1.0 && after.start_time_seconds > now - 3600.0,
            "{after:?} at {now}"
        );
        assert!(after.threads >= 1);
    }
}
