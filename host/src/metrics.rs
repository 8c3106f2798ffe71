//! Server metrics, rendered as Prometheus text on `GET /metrics`.
//!
//! Per tenant: requests by outcome, prompt and completion tokens, rejections by reason. Global:
//! isolation violations (tag mismatches), KV pages used/free/cached, queue depth and
//! running sequences, and histograms of time to first token and inter-token latency. Labels are
//! tenant names (validated at creation) and fixed codes: never request content.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::time::Duration;

use crate::kv::KvCounters;

/// Histogram bucket bounds, seconds.
const BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

#[derive(Debug, Default, Clone)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, d: Duration) {
        let s = d.as_secs_f64();
        for (c, &b) in self.counts.iter_mut().zip(&BUCKETS) {
            if s <= b {
                *c += 1;
            }
        }
        self.count += 1;
        self.sum += s;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (c, b) in self.counts.iter().zip(&BUCKETS) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", self.sum, self.count);
    }
}

#[derive(Debug, Default)]
struct Inner {
    requests: BTreeMap<(String, &'static str), u64>,
    prompt_tokens: BTreeMap<String, u64>,
    completion_tokens: BTreeMap<String, u64>,
    rejections: BTreeMap<(String, &'static str), u64>,
    http_errors: BTreeMap<&'static str, u64>,
    plugin_requests: BTreeMap<String, u64>,
    plugin_failures: BTreeMap<(String, &'static str), u64>,
    ttft: Histogram,
    itl: Histogram,
    kv: KvCounters,
    waiting: usize,
    running: usize,
    policy_version: String,
    policy_reload_failures: u64,
    transfers: BTreeMap<&'static str, u64>,
    transfer_pages: u64,
    transfer_bytes: u64,
    transfer_seconds: f64,
    /// A router's nodes, by role and address: up or not.
    nodes: BTreeMap<(String, String), bool>,
}

/// The metrics registry.
#[derive(Debug, Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

fn escape(label: &str) -> String {
    label.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

impl Metrics {
    fn with<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut g)
    }

    /// A request of `tenant` ended with `outcome` (`stop`, `length`, `rejected`, `cancelled`,
    /// `failed`), with its token counts.
    pub fn request_done(&self, tenant: &str, outcome: &'static str, prompt: usize, completion: usize) {
        self.with(|m| {
            *m.requests.entry((tenant.into(), outcome)).or_default() += 1;
            *m.prompt_tokens.entry(tenant.into()).or_default() += prompt as u64;
            *m.completion_tokens.entry(tenant.into()).or_default() += completion as u64;
        })
    }

    /// A request of `tenant` was rejected for `reason` (a stable error code).
    pub fn rejected(&self, tenant: &str, reason: &'static str) {
        self.with(|m| {
            *m.rejections.entry((tenant.into(), reason)).or_default() += 1;
            *m.requests.entry((tenant.into(), "rejected")).or_default() += 1;
        })
    }

    /// A request failed before it reached a tenant (bad key, bad route, bad body...).
    pub fn http_error(&self, code: &'static str) {
        self.with(|m| *m.http_errors.entry(code).or_default() += 1)
    }

    /// A request of `tenant` runs a plugin.
    pub fn plugin_request(&self, tenant: &str) {
        self.with(|m| *m.plugin_requests.entry(tenant.into()).or_default() += 1)
    }

    /// A plugin of `tenant` failed a request with `code` (`plugin_trap`, `plugin_timeout`...).
    pub fn plugin_failure(&self, tenant: &str, code: &'static str) {
        self.with(|m| *m.plugin_failures.entry((tenant.into(), code)).or_default() += 1)
    }

    /// Time from submission to the first token.
    pub fn first_token(&self, d: Duration) {
        self.with(|m| m.ttft.observe(d))
    }

    /// Time between two tokens of one request.
    pub fn inter_token(&self, d: Duration) {
        self.with(|m| m.itl.observe(d))
    }

    /// The policy set in force, and reloads refused since start.
    pub fn policy(&self, version: &str, reload_failures: u64) {
        self.with(|m| {
            m.policy_version = version.to_string();
            m.policy_reload_failures = reload_failures;
        });
    }

    /// A router's node (`role`, `addr`) is up or down.
    pub fn node_up(&self, role: crate::config::Role, addr: std::net::SocketAddr, up: bool) {
        self.with(|m| {
            m.nodes.insert((role.to_string(), addr.to_string()), up);
        })
    }

    /// A prefill node's transfer ended: `outcome` (`acknowledged`, `failed`, `abandoned`); an
    /// acknowledged one sent `pages` pages in `bytes` encoded bytes over `seconds` from its
    /// `Begin` to its final acknowledgement.
    pub fn transfer_done(&self, outcome: &'static str, pages: usize, bytes: usize, seconds: f64) {
        self.with(|m| {
            *m.transfers.entry(outcome).or_default() += 1;
            if outcome == "acknowledged" {
                m.transfer_pages += pages as u64;
                m.transfer_bytes += bytes as u64;
                m.transfer_seconds += seconds;
            }
        })
    }

    /// The engine's current pool counters and queue.
    pub fn engine_state(&self, kv: KvCounters, waiting: usize, running: usize) {
        self.with(|m| {
            m.kv = kv;
            m.waiting = waiting;
            m.running = running;
        })
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        self.with(|m| {
            let mut o = String::new();
            let _ = writeln!(
                o,
                "# HELP warden_requests_total Requests by tenant and outcome.\n# TYPE warden_requests_total counter"
            );
            for ((t, outcome), n) in &m.requests {
                let _ = writeln!(o, "warden_requests_total{{tenant=\"{}\",outcome=\"{outcome}\"}} {n}", escape(t));
            }
            for (name, map, help) in [
                ("warden_prompt_tokens_total", &m.prompt_tokens, "Prompt tokens by tenant."),
                ("warden_completion_tokens_total", &m.completion_tokens, "Generated tokens by tenant."),
            ] {
                let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter");
                for (t, n) in map {
                    let _ = writeln!(o, "{name}{{tenant=\"{}\"}} {n}", escape(t));
                }
            }
            let _ = writeln!(
                o,
                "# HELP warden_rejections_total Requests refused at admission, by tenant and reason.\n# TYPE warden_rejections_total counter"
            );
            for ((t, reason), n) in &m.rejections {
                let _ = writeln!(o, "warden_rejections_total{{tenant=\"{}\",reason=\"{reason}\"}} {n}", escape(t));
            }
            let _ = writeln!(
                o,
                "# HELP warden_http_errors_total Requests refused before reaching a tenant, by error code.\n# TYPE warden_http_errors_total counter"
            );
            for (code, n) in &m.http_errors {
                let _ = writeln!(o, "warden_http_errors_total{{code=\"{code}\"}} {n}");
            }
            let _ = writeln!(
                o,
                "# HELP warden_plugin_requests_total Requests that ran a plugin, by tenant.\n# TYPE warden_plugin_requests_total counter"
            );
            for (t, n) in &m.plugin_requests {
                let _ = writeln!(o, "warden_plugin_requests_total{{tenant=\"{}\"}} {n}", escape(t));
            }
            let _ = writeln!(
                o,
                "# HELP warden_plugin_failures_total Requests a plugin failed, by tenant and error code.\n# TYPE warden_plugin_failures_total counter"
            );
            for ((t, code), n) in &m.plugin_failures {
                let _ = writeln!(o, "warden_plugin_failures_total{{tenant=\"{}\",code=\"{code}\"}} {n}", escape(t));
            }
            let _ = writeln!(
                o,
                "# HELP warden_isolation_violations_total KV reads or writes refused by a tag check.\n# TYPE warden_isolation_violations_total counter\nwarden_isolation_violations_total {}",
                m.kv.tag_mismatches
            );
            let _ = writeln!(
                o,
                "# HELP warden_kv_pages KV pages by state (used, free and cached add up to the total; reserved pages are free pages promised to running sequences).\n# TYPE warden_kv_pages gauge"
            );
            for (state, n) in [
                ("used", m.kv.pages_used),
                ("free", m.kv.pages_free),
                ("cached", m.kv.pages_cached),
                ("reserved", m.kv.pages_reserved),
            ] {
                let _ = writeln!(o, "warden_kv_pages{{state=\"{state}\"}} {n}");
            }
            let _ = writeln!(
                o,
                "# HELP warden_kv_pinned_pages KV pages in tenants' pinned prefixes.\n# TYPE warden_kv_pinned_pages gauge\nwarden_kv_pinned_pages {}",
                m.kv.pages_pinned
            );
            let _ = writeln!(
                o,
                "# HELP warden_prefix_cache_hit_tokens_total Prompt tokens served from tenants' prefix caches.\n# TYPE warden_prefix_cache_hit_tokens_total counter\nwarden_prefix_cache_hit_tokens_total {}",
                m.kv.prefix_hit_tokens
            );
            let _ = writeln!(
                o,
                "# HELP warden_prefix_cache_evictions_total Cached KV pages evicted to make room.\n# TYPE warden_prefix_cache_evictions_total counter\nwarden_prefix_cache_evictions_total {}",
                m.kv.prefix_evictions
            );
            let _ = writeln!(
                o,
                "# HELP warden_kv_pages_total KV pages in the pool.\n# TYPE warden_kv_pages_total gauge\nwarden_kv_pages_total {}",
                m.kv.pages_total
            );
            let _ = writeln!(
                o,
                "# HELP warden_queue_depth Requests waiting for a slot.\n# TYPE warden_queue_depth gauge\nwarden_queue_depth {}",
                m.waiting
            );
            let _ = writeln!(
                o,
                "# HELP warden_running_sequences Sequences being prefilled or decoded.\n# TYPE warden_running_sequences gauge\nwarden_running_sequences {}",
                m.running
            );
            let _ = writeln!(
                o,
                "# HELP warden_policy_info The tenant policy set in force (its version: a digest of the files).\n# TYPE warden_policy_info gauge\nwarden_policy_info{{version=\"{}\"}} 1",
                escape(&m.policy_version)
            );
            let _ = writeln!(
                o,
                "# HELP warden_policy_reload_failures_total Policy reloads refused (a bad file; the previous set stayed in force).\n# TYPE warden_policy_reload_failures_total counter\nwarden_policy_reload_failures_total {}",
                m.policy_reload_failures
            );
            if !m.nodes.is_empty() {
                let _ = writeln!(
                    o,
                    "# HELP warden_cluster_node_up Whether the router sends work to a node (it answers its probe and agrees with the cluster).\n# TYPE warden_cluster_node_up gauge"
                );
                for ((role, node), up) in &m.nodes {
                    let _ = writeln!(o, "warden_cluster_node_up{{role=\"{role}\",node=\"{node}\"}} {}", u8::from(*up));
                }
            }
            if !m.transfers.is_empty() {
                let _ = writeln!(
                    o,
                    "# HELP warden_transfers_total KV transfers a prefill node sent, by outcome.\n# TYPE warden_transfers_total counter"
                );
                for (outcome, n) in &m.transfers {
                    let _ = writeln!(o, "warden_transfers_total{{outcome=\"{outcome}\"}} {n}");
                }
                let _ = writeln!(
                    o,
                    "# HELP warden_transfer_pages_total KV pages of acknowledged transfers.\n# TYPE warden_transfer_pages_total counter\nwarden_transfer_pages_total {}",
                    m.transfer_pages
                );
                let _ = writeln!(
                    o,
                    "# HELP warden_transfer_bytes_total Encoded bytes of acknowledged transfers.\n# TYPE warden_transfer_bytes_total counter\nwarden_transfer_bytes_total {}",
                    m.transfer_bytes
                );
                let _ = writeln!(
                    o,
                    "# HELP warden_transfer_seconds_total Time acknowledged transfers took, from Begin to the final Ack, summed.\n# TYPE warden_transfer_seconds_total counter\nwarden_transfer_seconds_total {}",
                    m.transfer_seconds
                );
            }
            m.ttft.render(
                &mut o,
                "warden_time_to_first_token_seconds",
                "Time from a request's submission to its first token.",
            );
            m.itl.render(
                &mut o,
                "warden_inter_token_latency_seconds",
                "Time between consecutive tokens of a request.",
            );
            o
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_gauges_and_histograms() {
        let m = Metrics::default();
        m.request_done("acme", "stop", 10, 5);
        m.request_done("acme", "stop", 1, 2);
        m.rejected("beta", "context_length_exceeded");
        m.plugin_failure("beta", "plugin_trap");
        m.first_token(Duration::from_millis(30));
        m.engine_state(
            KvCounters {
                pages_total: 8,
                pages_free: 6,
                pages_used: 2,
                tag_mismatches: 1,
                ..Default::default()
            },
            3,
            1,
        );
        let t = m.render();
        for line in [
            "warden_requests_total{tenant=\"acme\",outcome=\"stop\"} 2",
            "warden_requests_total{tenant=\"beta\",outcome=\"rejected\"} 1",
            "warden_prompt_tokens_total{tenant=\"acme\"} 11",
            "warden_completion_tokens_total{tenant=\"acme\"} 7",
            "warden_rejections_total{tenant=\"beta\",reason=\"context_length_exceeded\"} 1",
            "warden_isolation_violations_total 1",
            "warden_plugin_failures_total{tenant=\"beta\",code=\"plugin_trap\"} 1",
            "warden_kv_pages{state=\"free\"} 6",
            "warden_queue_depth 3",
            "warden_time_to_first_token_seconds_bucket{le=\"0.025\"} 0",
            "warden_time_to_first_token_seconds_bucket{le=\"0.05\"} 1",
            "warden_time_to_first_token_seconds_count 1",
        ] {
            assert!(t.lines().any(|l| l == line), "missing {line:?} in\n{t}");
        }
    }
}
