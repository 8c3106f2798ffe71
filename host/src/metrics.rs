//! Server metrics, rendered as Prometheus text on `GET /metrics`.
//!
//! Per tenant and model: requests by outcome, prompt and completion tokens, and histograms of
//! time in the queue, time to first token, inter-token latency and end-to-end duration, and of
//! each request's prompt and completion tokens. Per
//! tenant: rejections by reason. Request fields the server ignored, by name (a bounded set). Per
//! model (each has its own engine and pool): isolation violations (tag mismatches), KV pages
//! used/free/cached and the share in use, queue depth and running sequences. Labels are tenant
//! names (validated at creation), the served models' ids (from the configuration) and fixed
//! codes: never request content. Every family's `# TYPE` line is always written, series or
//! not, so a dashboard's queries can be checked against one scrape. The build
//! (`warden_build_info`) and the process as the kernel counts it (`process_*`, the names every
//! Prometheus client library uses) too.
//!
//! `deploy/prometheus/vllm-names.rules.yml` records vLLM's names (`vllm:…`) from these, and
//! `deploy/grafana/warden.json` is a dashboard over them.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::kv::KvCounters;

/// Histogram bucket bounds, seconds.
const BUCKETS: [f64; 16] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// Token-count histogram bucket bounds (a request's prompt or completion tokens).
const TOKEN_BUCKETS: [f64; 16] = [
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0, 50000.0, 100000.0,
];

/// A histogram over `BOUNDS` (one of [`BUCKETS`] and [`TOKEN_BUCKETS`]).
#[derive(Debug, Default, Clone)]
struct Histogram<const TOKENS: bool = false> {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl<const TOKENS: bool> Histogram<TOKENS> {
    const BOUNDS: &'static [f64; 16] = if TOKENS { &TOKEN_BUCKETS } else { &BUCKETS };

    fn observe_value(&mut self, v: f64) {
        for (c, &b) in self.counts.iter_mut().zip(Self::BOUNDS) {
            if v <= b {
                *c += 1;
            }
        }
        self.count += 1;
        self.sum += v;
    }

    /// Its series, each with `labels` (`k="v",…`, values escaped) before `le`.
    fn render(&self, out: &mut String, name: &str, labels: &str) {
        for (c, b) in self.counts.iter().zip(Self::BOUNDS) {
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(
            out,
            "{name}_sum{{{labels}}} {}\n{name}_count{{{labels}}} {}",
            self.sum, self.count
        );
    }
}

impl Histogram {
    fn observe(&mut self, d: Duration) {
        self.observe_value(d.as_secs_f64());
    }
}

/// One tenant's requests on one model: their latencies and sizes.
#[derive(Debug, Default, Clone)]
struct Latencies {
    /// Each request's prompt tokens.
    prompt: Histogram<true>,
    /// Each request's completion tokens (all its choices').
    completion: Histogram<true>,
    /// Submission to admission (the request's pages given).
    queue: Histogram,
    /// Submission to the first token.
    ttft: Histogram,
    /// Between consecutive tokens.
    itl: Histogram,
    /// Submission to the end.
    e2e: Histogram,
}

/// Which of a tenant's [`Latencies`] a family renders.
type Pick = fn(&Latencies) -> &Histogram;

/// The latency histograms: (name, what it measures, which of [`Latencies`]).
const LATENCY_FAMILIES: [(&str, &str, Pick); 4] = [
    (
        "warden_queue_time_seconds",
        "Time from a request's submission to its admission (its KV pages given), by tenant and model.",
        |l| &l.queue,
    ),
    (
        "warden_time_to_first_token_seconds",
        "Time from a request's submission to its first token, by tenant and model.",
        |l| &l.ttft,
    ),
    (
        "warden_inter_token_latency_seconds",
        "Time between consecutive tokens of a request, by tenant and model.",
        |l| &l.itl,
    ),
    (
        "warden_request_duration_seconds",
        "Time from a request's submission to its end (each choice of n counts once), by tenant and model.",
        |l| &l.e2e,
    ),
];

/// One model's engine: its pool, its queue, its latencies.
#[derive(Debug, Default, Clone)]
struct EngineStats {
    /// Whether an engine of this process reported its pool and queue (a router's models have
    /// none here: their nodes' are theirs, and the router shows no zeros for them).
    reported: bool,
    kv: KvCounters,
    waiting: usize,
    running: usize,
    preemptions: u64,
    /// By tenant.
    latency: BTreeMap<String, Latencies>,
}

#[derive(Debug, Default, Clone)]
struct Inner {
    /// By tenant, model (empty when the request named none served) and outcome.
    requests: BTreeMap<(String, String, &'static str), u64>,
    /// By tenant and model.
    prompt_tokens: BTreeMap<(String, String), u64>,
    completion_tokens: BTreeMap<(String, String), u64>,
    rejections: BTreeMap<(String, &'static str), u64>,
    http_errors: BTreeMap<&'static str, u64>,
    plugin_requests: BTreeMap<String, u64>,
    plugin_failures: BTreeMap<(String, &'static str), u64>,
    /// Ignored request fields, by label (see [`Metrics::ignored_fields`]).
    ignored_fields: BTreeMap<&'static str, u64>,
    /// By model.
    engines: BTreeMap<String, EngineStats>,
    policy_version: String,
    policy_reload_failures: u64,
    transfers: BTreeMap<&'static str, u64>,
    transfer_pages: u64,
    transfer_bytes: u64,
    transfer_seconds: f64,
    /// A router's nodes, by role and address: up or not.
    nodes: BTreeMap<(String, String), bool>,
    /// Cluster connections a node refused (no certificate the CA issued for the cluster, not
    /// loopback, too many handshakes).
    refused_connections: u64,
}

/// The ignored fields [`Metrics::ignored_fields`] counts by name: those OpenAI's and vLLM's
/// request bodies define that Warden does not act on (SDKs and proxies send them). Any other
/// name is counted as `_other`: a label's value comes from this fixed list, never from a
/// client's text, so no tenant can fill the registry or take labels from another.
pub const IGNORED_FIELD_LABELS: &[&str] = &[
    "audio",
    "best_of",
    "function_call",
    "functions",
    "metadata",
    "modalities",
    "prediction",
    "prompt_cache_key",
    "prompt_cache_retention",
    "reasoning_effort",
    "safety_identifier",
    "service_tier",
    "store",
    "suffix",
    "verbosity",
    "web_search_options",
    "messages[].annotations",
    "messages[].audio",
    "messages[].function_call",
    "messages[].refusal",
];

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

    /// A request of `tenant` was refused for `reason` (a stable error code); `model` is the
    /// served model it named, if it named one.
    pub fn rejected(&self, tenant: &str, model: Option<&str>, reason: &'static str) {
        self.with(|m| {
            *m.rejections.entry((tenant.into(), reason)).or_default() += 1;
            *m.requests
                .entry((tenant.into(), model.unwrap_or_default().into(), "rejected"))
                .or_default() += 1;
        })
    }

    /// What one model's engine reports into this registry.
    pub fn model(self: &Arc<Self>, model: &str) -> ModelMetrics {
        self.with(|m| {
            m.engines.entry(model.into()).or_default();
        });
        ModelMetrics {
            metrics: self.clone(),
            model: model.into(),
        }
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

    /// A request's fields the server does not know were ignored: their paths, with message
    /// indices dropped (`messages[].refusal`). Each is counted under its name when it is one of
    /// [`IGNORED_FIELD_LABELS`], else as `_other`.
    pub fn ignored_fields(&self, paths: &[String]) {
        self.with(|m| {
            for p in paths {
                let label = IGNORED_FIELD_LABELS
                    .iter()
                    .find(|&&l| l == p)
                    .copied()
                    .unwrap_or("_other");
                *m.ignored_fields.entry(label).or_default() += 1;
            }
        })
    }

    /// The policy set in force, and reloads refused since start.
    pub fn policy(&self, version: &str, reload_failures: u64) {
        self.with(|m| {
            m.policy_version = version.to_string();
            m.policy_reload_failures = reload_failures;
        });
    }

    /// A router's node (`role`, `addr`) is up or down.
    pub fn node_up(&self, role: crate::config::Role, addr: &crate::config::NodeAddr, up: bool) {
        self.with(|m| {
            m.nodes.insert((role.to_string(), addr.to_string()), up);
        })
    }

    /// A node refused a cluster connection.
    pub fn cluster_refused(&self) {
        self.with(|m| m.refused_connections += 1)
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        // Copied under the lock and written outside it: the engine threads, which report every
        // token, never wait for a scrape to be formatted.
        let snapshot = self.with(|m| m.clone());
        let m = &snapshot;
        {
            let mut o = String::new();
            let help = |o: &mut String, name: &str, kind: &str, text: &str| {
                let _ = writeln!(o, "# HELP {name} {text}\n# TYPE {name} {kind}");
            };
            help(
                &mut o,
                "warden_requests_total",
                "counter",
                "Requests by tenant, model and outcome.",
            );
            for ((t, model, outcome), n) in &m.requests {
                let _ = writeln!(
                    o,
                    "warden_requests_total{{tenant=\"{}\",model=\"{}\",outcome=\"{outcome}\"}} {n}",
                    escape(t),
                    escape(model)
                );
            }
            for (name, map, text) in [
                (
                    "warden_prompt_tokens_total",
                    &m.prompt_tokens,
                    "Prompt tokens by tenant and model.",
                ),
                (
                    "warden_completion_tokens_total",
                    &m.completion_tokens,
                    "Generated tokens by tenant and model.",
                ),
            ] {
                help(&mut o, name, "counter", text);
                for ((t, model), n) in map {
                    let _ = writeln!(o, "{name}{{tenant=\"{}\",model=\"{}\"}} {n}", escape(t), escape(model));
                }
            }
            help(
                &mut o,
                "warden_rejections_total",
                "counter",
                "Requests refused at admission, by tenant and reason.",
            );
            for ((t, reason), n) in &m.rejections {
                let _ = writeln!(
                    o,
                    "warden_rejections_total{{tenant=\"{}\",reason=\"{reason}\"}} {n}",
                    escape(t)
                );
            }
            help(
                &mut o,
                "warden_http_errors_total",
                "counter",
                "Requests refused before reaching a tenant, by error code.",
            );
            for (code, n) in &m.http_errors {
                let _ = writeln!(o, "warden_http_errors_total{{code=\"{code}\"}} {n}");
            }
            help(
                &mut o,
                "warden_plugin_requests_total",
                "counter",
                "Requests that ran a plugin, by tenant.",
            );
            for (t, n) in &m.plugin_requests {
                let _ = writeln!(o, "warden_plugin_requests_total{{tenant=\"{}\"}} {n}", escape(t));
            }
            help(
                &mut o,
                "warden_plugin_failures_total",
                "counter",
                "Requests a plugin failed, by tenant and error code.",
            );
            for ((t, code), n) in &m.plugin_failures {
                let _ = writeln!(
                    o,
                    "warden_plugin_failures_total{{tenant=\"{}\",code=\"{code}\"}} {n}",
                    escape(t)
                );
            }
            help(
                &mut o,
                "warden_ignored_fields_total",
                "counter",
                "Request fields the server does not know, ignored: by name for the fields of OpenAI's API it does not act on, the rest as _other.",
            );
            for (f, n) in &m.ignored_fields {
                let _ = writeln!(o, "warden_ignored_fields_total{{field=\"{}\"}} {n}", escape(f));
            }
            // Each model's engine: one series per model of each.
            let engines: Vec<(String, &EngineStats)> = m.engines.iter().map(|(k, e)| (escape(k), e)).collect();
            let local: Vec<&(String, &EngineStats)> = engines.iter().filter(|(_, e)| e.reported).collect();
            let per_model =
                |o: &mut String, name: &str, kind: &str, text: &str, value: &dyn Fn(&EngineStats) -> String| {
                    help(o, name, kind, text);
                    for (model, e) in &local {
                        let _ = writeln!(o, "{name}{{model=\"{model}\"}} {}", value(e));
                    }
                };
            per_model(
                &mut o,
                "warden_isolation_violations_total",
                "counter",
                "KV reads or writes refused by a tag check, by model.",
                &|e| e.kv.tag_mismatches.to_string(),
            );
            help(
                &mut o,
                "warden_kv_pages",
                "gauge",
                "KV pages by model and state (used, free and cached add up to the total; reserved pages are free pages promised to running sequences).",
            );
            for (model, e) in &local {
                for (state, n) in [
                    ("used", e.kv.pages_used),
                    ("free", e.kv.pages_free),
                    ("cached", e.kv.pages_cached),
                    ("reserved", e.kv.pages_reserved),
                ] {
                    let _ = writeln!(o, "warden_kv_pages{{model=\"{model}\",state=\"{state}\"}} {n}");
                }
            }
            per_model(
                &mut o,
                "warden_kv_pinned_pages",
                "gauge",
                "KV pages in tenants' pinned prefixes, by model.",
                &|e| e.kv.pages_pinned.to_string(),
            );
            per_model(
                &mut o,
                "warden_prefix_cache_hit_tokens_total",
                "counter",
                "Prompt tokens served from tenants' prefix caches, by model.",
                &|e| e.kv.prefix_hit_tokens.to_string(),
            );
            per_model(
                &mut o,
                "warden_prefix_cache_evictions_total",
                "counter",
                "Cached KV pages evicted to make room, by model.",
                &|e| e.kv.prefix_evictions.to_string(),
            );
            per_model(
                &mut o,
                "warden_kv_pool_pages",
                "gauge",
                "KV pages in the model's pool.",
                &|e| e.kv.pages_total.to_string(),
            );
            per_model(
                &mut o,
                "warden_kv_usage_ratio",
                "gauge",
                "Share of the model's KV pages held by sequences (0 to 1; idle cached pages count as free).",
                &|e| (e.kv.pages_used as f64 / e.kv.pages_total.max(1) as f64).to_string(),
            );
            per_model(
                &mut o,
                "warden_queue_depth",
                "gauge",
                "Requests waiting for a slot, by model.",
                &|e| e.waiting.to_string(),
            );
            per_model(
                &mut o,
                "warden_running_sequences",
                "gauge",
                "Sequences being prefilled or decoded, by model.",
                &|e| e.running.to_string(),
            );
            per_model(
                &mut o,
                "warden_preemptions_total",
                "counter",
                "Sequences that gave their KV pages up for others to grow into (they compute their tokens again when readmitted), by model.",
                &|e| e.preemptions.to_string(),
            );
            help(
                &mut o,
                "warden_log_dropped_lines_total",
                "counter",
                "Log lines dropped because the log's queue was full (a reader of stderr fell behind).",
            );
            let _ = writeln!(o, "warden_log_dropped_lines_total {}", crate::log::dropped_lines());
            help(
                &mut o,
                "warden_policy_info",
                "gauge",
                "The tenant policy set in force (its version: a digest of the files).",
            );
            let _ = writeln!(o, "warden_policy_info{{version=\"{}\"}} 1", escape(&m.policy_version));
            help(
                &mut o,
                "warden_policy_reload_failures_total",
                "counter",
                "Policy reloads refused (a bad file; the previous set stayed in force).",
            );
            let _ = writeln!(o, "warden_policy_reload_failures_total {}", m.policy_reload_failures);
            // A router's and a prefill node's families: declared everywhere, their series where
            // they apply.
            help(
                &mut o,
                "warden_cluster_node_up",
                "gauge",
                "Whether the router sends work to a node (it answers its probe and agrees with the cluster).",
            );
            for ((role, node), up) in &m.nodes {
                let _ = writeln!(
                    o,
                    "warden_cluster_node_up{{role=\"{role}\",node=\"{}\"}} {}",
                    escape(node),
                    u8::from(*up)
                );
            }
            help(
                &mut o,
                "warden_cluster_refused_connections_total",
                "counter",
                "Cluster connections a node refused (a peer without a certificate the cluster's CA issued for the cluster, a plain peer not on loopback, or past the handshakes in progress).",
            );
            let _ = writeln!(o, "warden_cluster_refused_connections_total {}", m.refused_connections);
            help(
                &mut o,
                "warden_transfers_total",
                "counter",
                "KV transfers a prefill node sent, by outcome.",
            );
            for (outcome, n) in &m.transfers {
                let _ = writeln!(o, "warden_transfers_total{{outcome=\"{outcome}\"}} {n}");
            }
            help(
                &mut o,
                "warden_transfer_pages_total",
                "counter",
                "KV pages of acknowledged transfers.",
            );
            let _ = writeln!(o, "warden_transfer_pages_total {}", m.transfer_pages);
            help(
                &mut o,
                "warden_transfer_bytes_total",
                "counter",
                "Encoded bytes of acknowledged transfers.",
            );
            let _ = writeln!(o, "warden_transfer_bytes_total {}", m.transfer_bytes);
            help(
                &mut o,
                "warden_transfer_seconds_total",
                "counter",
                "Time acknowledged transfers took, from Begin to the final Ack, summed.",
            );
            let _ = writeln!(o, "warden_transfer_seconds_total {}", m.transfer_seconds);
            for (name, text, tokens) in [
                (
                    "warden_request_prompt_tokens",
                    "Prompt tokens of each request, by tenant and model.",
                    true,
                ),
                (
                    "warden_request_completion_tokens",
                    "Completion tokens of each request (all its choices), by tenant and model.",
                    false,
                ),
            ] {
                help(&mut o, name, "histogram", text);
                for (model, e) in &engines {
                    for (t, l) in &e.latency {
                        let h = if tokens { &l.prompt } else { &l.completion };
                        h.render(&mut o, name, &format!("tenant=\"{}\",model=\"{model}\"", escape(t)));
                    }
                }
            }
            help(
                &mut o,
                "warden_build_info",
                "gauge",
                "This build: its version and the CPU architecture it was built for.",
            );
            let _ = writeln!(
                o,
                "warden_build_info{{version=\"{}\",arch=\"{}\"}} 1",
                env!("CARGO_PKG_VERSION"),
                std::env::consts::ARCH
            );
            if let Some(p) = crate::procstat::read() {
                for (name, kind, text, value) in [
                    (
                        "process_cpu_seconds_total",
                        "counter",
                        "User and system CPU time spent, in seconds.",
                        p.cpu_seconds,
                    ),
                    (
                        "process_resident_memory_bytes",
                        "gauge",
                        "Resident memory size in bytes.",
                        p.resident_bytes as f64,
                    ),
                    (
                        "process_virtual_memory_bytes",
                        "gauge",
                        "Virtual memory size in bytes.",
                        p.virtual_bytes as f64,
                    ),
                    ("process_open_fds", "gauge", "Open file descriptors.", p.open_fds as f64),
                    (
                        "process_max_fds",
                        "gauge",
                        "The most file descriptors the process may open.",
                        p.max_fds as f64,
                    ),
                    (
                        "process_start_time_seconds",
                        "gauge",
                        "When the process started, in seconds since the Unix epoch.",
                        p.start_time_seconds,
                    ),
                    ("process_threads", "gauge", "Threads.", p.threads as f64),
                ] {
                    help(&mut o, name, kind, text);
                    let _ = writeln!(o, "{name} {value}");
                }
            }
            for (name, text, which) in LATENCY_FAMILIES {
                help(&mut o, name, "histogram", text);
                for (model, e) in &engines {
                    for (t, l) in &e.latency {
                        // Where observed only: never an empty series.
                        if which(l).count > 0 {
                            which(l).render(&mut o, name, &format!("tenant=\"{}\",model=\"{model}\"", escape(t)));
                        }
                    }
                }
            }
            o
        }
    }
}

/// One model's engine's view of the registry: what it reports carries the model's label.
#[derive(Debug, Clone)]
pub struct ModelMetrics {
    metrics: Arc<Metrics>,
    model: Arc<str>,
}

impl ModelMetrics {
    /// The registry it reports into.
    pub fn registry(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// A request of `tenant` ended with `outcome` (`stop`, `length`, `rejected`, `cancelled`,
    /// `failed`), with its token counts.
    pub fn request_done(&self, tenant: &str, outcome: &'static str, prompt: usize, completion: usize) {
        self.latency(tenant, |l| {
            l.prompt.observe_value(prompt as f64);
            l.completion.observe_value(completion as f64);
        });
        self.metrics.with(|m| {
            let key = (tenant.to_string(), self.model.to_string());
            *m.requests.entry((key.0.clone(), key.1.clone(), outcome)).or_default() += 1;
            *m.prompt_tokens.entry(key.clone()).or_default() += prompt as u64;
            *m.completion_tokens.entry(key).or_default() += completion as u64;
        })
    }

    /// The engine refused a request of `tenant` for `reason`.
    pub fn rejected(&self, tenant: &str, reason: &'static str) {
        self.metrics.rejected(tenant, Some(&self.model), reason)
    }

    /// A request of `tenant` waited `d` from submission to admission.
    pub fn queued(&self, tenant: &str, d: Duration) {
        self.latency(tenant, |l| l.queue.observe(d))
    }

    /// A request of `tenant` had its first token `d` after its submission.
    pub fn first_token(&self, tenant: &str, d: Duration) {
        self.latency(tenant, |l| l.ttft.observe(d))
    }

    /// A request of `tenant` had a token `d` after its previous one.
    pub fn inter_token(&self, tenant: &str, d: Duration) {
        self.latency(tenant, |l| l.itl.observe(d))
    }

    /// A request of `tenant` (one choice) ended `d` after its submission.
    pub fn ended(&self, tenant: &str, d: Duration) {
        self.latency(tenant, |l| l.e2e.observe(d))
    }

    fn latency(&self, tenant: &str, f: impl FnOnce(&mut Latencies)) {
        self.engine(|e| match e.latency.get_mut(tenant) {
            Some(l) => f(l),
            None => f(e.latency.entry(tenant.to_string()).or_default()),
        })
    }

    /// The engine's current pool counters and queue.
    pub fn engine_state(&self, kv: KvCounters, waiting: usize, running: usize, preemptions: u64) {
        self.engine(|e| {
            e.reported = true;
            e.kv = kv;
            e.waiting = waiting;
            e.running = running;
            e.preemptions = preemptions;
        })
    }

    /// A prefill node's transfer ended: `outcome` (`acknowledged`, `failed`, `abandoned`); an
    /// acknowledged one sent `pages` pages in `bytes` encoded bytes over `seconds` from its
    /// `Begin` to its final acknowledgement.
    pub fn transfer_done(&self, outcome: &'static str, pages: usize, bytes: usize, seconds: f64) {
        self.metrics.with(|m| {
            *m.transfers.entry(outcome).or_default() += 1;
            if outcome == "acknowledged" {
                m.transfer_pages += pages as u64;
                m.transfer_bytes += bytes as u64;
                m.transfer_seconds += seconds;
            }
        })
    }

    fn engine(&self, f: impl FnOnce(&mut EngineStats)) {
        self.metrics.with(|m| match m.engines.get_mut(&*self.model) {
            Some(e) => f(e),
            None => f(m.engines.entry(self.model.to_string()).or_default()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_gauges_and_histograms() {
        let m = Arc::new(Metrics::default());
        let (a, b) = (m.model("small"), m.model("large"));
        a.request_done("acme", "stop", 10, 5);
        a.request_done("acme", "stop", 1, 2);
        b.request_done("acme", "length", 4, 4);
        b.rejected("beta", "context_length_exceeded");
        m.rejected("beta", None, "model_not_found");
        m.plugin_failure("beta", "plugin_trap");
        a.first_token("acme", Duration::from_millis(30));
        a.queued("acme", Duration::from_millis(3));
        a.inter_token("beta", Duration::from_millis(7));
        a.ended("acme", Duration::from_secs(50));
        a.engine_state(
            KvCounters {
                pages_total: 8,
                pages_free: 6,
                pages_used: 2,
                tag_mismatches: 1,
                ..Default::default()
            },
            3,
            1,
            4,
        );
        let t = m.render();
        for line in [
            "warden_requests_total{tenant=\"acme\",model=\"small\",outcome=\"stop\"} 2",
            "warden_requests_total{tenant=\"acme\",model=\"large\",outcome=\"length\"} 1",
            "warden_requests_total{tenant=\"beta\",model=\"large\",outcome=\"rejected\"} 1",
            "warden_requests_total{tenant=\"beta\",model=\"\",outcome=\"rejected\"} 1",
            "warden_prompt_tokens_total{tenant=\"acme\",model=\"small\"} 11",
            "warden_completion_tokens_total{tenant=\"acme\",model=\"small\"} 7",
            "warden_completion_tokens_total{tenant=\"acme\",model=\"large\"} 4",
            "warden_rejections_total{tenant=\"beta\",reason=\"context_length_exceeded\"} 1",
            "warden_isolation_violations_total{model=\"small\"} 1",
            "warden_plugin_failures_total{tenant=\"beta\",code=\"plugin_trap\"} 1",
            "warden_kv_pages{model=\"small\",state=\"free\"} 6",
            "warden_queue_depth{model=\"small\"} 3",
            "warden_preemptions_total{model=\"small\"} 4",
            "warden_kv_usage_ratio{model=\"small\"} 0.25",
            "warden_time_to_first_token_seconds_bucket{tenant=\"acme\",model=\"small\",le=\"0.025\"} 0",
            "warden_time_to_first_token_seconds_bucket{tenant=\"acme\",model=\"small\",le=\"0.05\"} 1",
            "warden_time_to_first_token_seconds_count{tenant=\"acme\",model=\"small\"} 1",
            "warden_queue_time_seconds_bucket{tenant=\"acme\",model=\"small\",le=\"0.0025\"} 0",
            "warden_queue_time_seconds_bucket{tenant=\"acme\",model=\"small\",le=\"0.005\"} 1",
            "warden_inter_token_latency_seconds_count{tenant=\"beta\",model=\"small\"} 1",
            "warden_request_duration_seconds_bucket{tenant=\"acme\",model=\"small\",le=\"30\"} 0",
            "warden_request_duration_seconds_bucket{tenant=\"acme\",model=\"small\",le=\"60\"} 1",
            "warden_request_duration_seconds_sum{tenant=\"acme\",model=\"small\"} 50",
            "warden_request_prompt_tokens_bucket{tenant=\"acme\",model=\"small\",le=\"1\"} 1",
            "warden_request_prompt_tokens_bucket{tenant=\"acme\",model=\"small\",le=\"10\"} 2",
            "warden_request_prompt_tokens_sum{tenant=\"acme\",model=\"small\"} 11",
            "warden_request_completion_tokens_bucket{tenant=\"acme\",model=\"small\",le=\"2\"} 1",
            "warden_request_completion_tokens_count{tenant=\"acme\",model=\"small\"} 2",
            "warden_kv_pool_pages{model=\"small\"} 8",
        ] {
            assert!(t.lines().any(|l| l == line), "missing {line:?} in\n{t}");
        }
        let build = format!(
            "warden_build_info{{version=\"{}\",arch=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION"),
            std::env::consts::ARCH
        );
        assert!(t.lines().any(|l| l == build), "{t}");
        // A model whose engine is not this process's (a router's) shows no pool or queue.
        assert!(!t.contains("model=\"large\",state="), "{t}");
        assert!(!t.contains("warden_queue_depth{model=\"large\"}"), "{t}");
        // Latencies exist per tenant and model where observed, never as empty series.
        assert!(
            !t.contains("warden_time_to_first_token_seconds_count{tenant=\"acme\",model=\"large\"}"),
            "{t}"
        );
        // Every family is declared, with series or not.
        for family in [
            "process_resident_memory_bytes",
            "process_cpu_seconds_total",
            "process_open_fds",
            "process_start_time_seconds",
            "warden_cluster_node_up",
            "warden_transfers_total",
            "warden_queue_time_seconds",
        ] {
            assert!(t.contains(&format!("# TYPE {family} ")), "{family} undeclared in\n{t}");
        }
    }

    #[test]
    fn ignored_fields_are_counted_under_fixed_labels_only() {
        let m = Metrics::default();
        // One client floods the registry with names of its own...
        let names: Vec<String> = (0..500).map(|i| format!("x{i}")).collect();
        m.ignored_fields(&names);
        // ...and another's known fields are still counted by name.
        m.ignored_fields(&["store".into(), "messages[].refusal".into()]);
        m.ignored_fields(&["store".into()]);
        let t = m.render();
        assert!(t.contains("warden_ignored_fields_total{field=\"store\"} 2"), "{t}");
        assert!(
            t.contains("warden_ignored_fields_total{field=\"messages[].refusal\"} 1"),
            "{t}"
        );
        assert!(t.contains("warden_ignored_fields_total{field=\"_other\"} 500"), "{t}");
        assert_eq!(t.matches("warden_ignored_fields_total{").count(), 3, "{t}");
        assert!(!t.contains("x42"), "a client's text became a label:\n{t}");
    }
}
