//! `warden serve`'s configuration: one TOML file (documented in `warden.example.toml`), every
//! field optional with the default it states. Unknown keys and wrong types are errors naming the
//! key, its line and the file.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The whole configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServeConfig {
    /// Address to listen on. Default `127.0.0.1:8443`.
    pub listen: SocketAddr,
    /// Directory for the state store, the generated certificate and the admin token. Default
    /// `data`.
    pub data_dir: PathBuf,
    /// GGUF model file; its file stem is the model's id in the API. Default
    /// `models/SmolLM2-135M-Instruct.Q4_1.gguf`.
    pub model: PathBuf,
    /// TLS certificate and key.
    pub tls: TlsConfig,
    /// KV pool.
    pub kv: KvConfig,
    /// Engine and request limits.
    pub limits: LimitsConfig,
    /// Timeouts.
    pub timeouts: TimeoutsConfig,
    /// Tenant plugins.
    pub plugins: PluginsConfig,
    /// The per-tenant policy directory (`default.toml`, `tenants/<tenant>.toml`), reloaded on
    /// change and on SIGHUP. Default `policies`.
    pub policies: PathBuf,
    /// Disaggregated prefill and decode (`warden serve --role ...`).
    pub cluster: ClusterConfig,
}

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8443)),
            data_dir: PathBuf::from("data"),
            model: PathBuf::from(crate::DEFAULT_MODEL),
            tls: TlsConfig::default(),
            kv: KvConfig::default(),
            limits: LimitsConfig::default(),
            timeouts: TimeoutsConfig::default(),
            plugins: PluginsConfig::default(),
            policies: PathBuf::from("policies"),
            cluster: ClusterConfig::default(),
        }
    }
}

/// Disaggregated serving: where a prefill or decode node listens, which nodes a router
/// dispatches to, and the bounds of a KV transfer. Nodes speak to each other over loopback only
/// (every address here must be one).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterConfig {
    /// Where a prefill or decode node listens, for the router and for other nodes. Default
    /// `127.0.0.1:9100`.
    pub listen: SocketAddr,
    /// The prefill nodes a router dispatches to. Default: none.
    pub prefill: Vec<SocketAddr>,
    /// The decode nodes a router dispatches to. Default: none.
    pub decode: Vec<SocketAddr>,
    /// How long a router waits at start for every node to answer, in seconds. Default 120.
    pub connect_timeout_s: u64,
    /// Pages per transfer batch. Default 8.
    pub pages_per_batch: usize,
    /// Batches a prefill node sends ahead of the decode node's acknowledgements. Default 4.
    pub batches_in_flight: usize,
    /// Bytes of batches sent ahead of acknowledgements, in MiB. Default 64.
    pub bytes_in_flight_mib: usize,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 9100)),
            prefill: Vec::new(),
            decode: Vec::new(),
            connect_timeout_s: 120,
            pages_per_batch: 8,
            batches_in_flight: 4,
            bytes_in_flight_mib: 64,
        }
    }
}

impl ClusterConfig {
    /// The transfer bounds.
    pub fn transfer_limits(&self) -> crate::transfer::Limits {
        crate::transfer::Limits {
            pages_per_batch: self.pages_per_batch,
            batches_in_flight: self.batches_in_flight,
            bytes_in_flight: self.bytes_in_flight_mib << 20,
        }
    }
}

/// Certificate and key, PEM files. With neither set, the first start generates a self-signed
/// certificate for `localhost` in the data dir and reuses it afterwards.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TlsConfig {
    /// Certificate chain (PEM). Default: none (generated).
    pub cert: Option<PathBuf>,
    /// Private key (PEM). Default: none (generated).
    pub key: Option<PathBuf>,
}

/// The KV pool.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvConfig {
    /// Memory for K and V, in MiB. Default 512.
    pub memory_mib: usize,
    /// Token slots per page. Default 16.
    pub page_size: usize,
    /// The tenant-private prefix cache: a request reuses the KV of an earlier request of the same
    /// tenant that began with the same tokens, whole pages at a time. Default true.
    pub prefix_cache: bool,
    /// KV pages each tenant's plugins may pin in its prefix cache. Default 64.
    pub max_pinned_pages_per_tenant: usize,
}

impl Default for KvConfig {
    fn default() -> Self {
        Self {
            memory_mib: 512,
            page_size: 16,
            prefix_cache: true,
            max_pinned_pages_per_tenant: 64,
        }
    }
}

/// Engine and request limits.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Most prompt plus completion tokens per request. Default: the model's context length. The
    /// server refuses to start when the KV pool cannot hold this many (invariant 4).
    pub max_context: Option<usize>,
    /// Completion tokens when a request names none. Default 256.
    pub default_max_tokens: usize,
    /// Tokens per engine step (decode tokens plus prefill chunks). Default 512.
    pub max_batch_tokens: usize,
    /// How long an engine step should take, in milliseconds: prefill chunks shrink to what fits,
    /// which bounds both a new request's wait for the step in flight and the time between a
    /// stream's tokens. 0: `max_batch_tokens` alone. Default 40.
    pub step_target_ms: u64,
    /// Sequences decoding at once. Default 64.
    pub max_running: usize,
    /// Requests waiting for a slot; beyond it requests get 503. Default 256.
    pub queue: usize,
    /// Largest request body, in bytes; larger gets 413. Default 1 MiB.
    pub body_bytes: usize,
    /// Deepest JSON nesting of a request body. Default 32.
    pub json_depth: usize,
    /// Largest total size of a request's headers, in bytes. Default 16 KiB.
    pub header_bytes: usize,
    /// Most choices (`n`) per request. Default 8.
    pub max_n: usize,
    /// Most open connections; more wait to be accepted. Default 4096.
    pub max_connections: usize,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            max_context: None,
            default_max_tokens: 256,
            max_batch_tokens: 512,
            step_target_ms: 40,
            max_running: 64,
            queue: 256,
            body_bytes: 1 << 20,
            json_depth: 32,
            header_bytes: 16 << 10,
            max_n: 8,
            max_connections: 4096,
        }
    }
}

/// Timeouts, in seconds.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TimeoutsConfig {
    /// TLS handshake. Default 10.
    pub handshake_s: u64,
    /// Reading a request's headers, including an idle keep-alive connection waiting for its next
    /// request. Default 30.
    pub header_read_s: u64,
    /// Reading a request's body. Default 30.
    pub body_read_s: u64,
    /// HTTP/2 keep-alive: a connection whose pings go unanswered this long is closed. Default 60.
    pub idle_s: u64,
    /// On SIGTERM/SIGINT, how long in-flight requests may run before they are cancelled. Default 30.
    pub shutdown_s: u64,
}

impl Default for TimeoutsConfig {
    fn default() -> Self {
        Self {
            handshake_s: 10,
            header_read_s: 30,
            body_read_s: 30,
            idle_s: 60,
            shutdown_s: 30,
        }
    }
}

/// Tenant plugins: upload limits and what each instance may use.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PluginsConfig {
    /// Largest component an upload may carry, in bytes. Default 8 MiB.
    pub max_component_bytes: usize,
    /// Largest plugin configuration, in bytes. Default 64 KiB.
    pub max_config_bytes: usize,
    /// Plugins per tenant. Default 16.
    pub max_per_tenant: usize,
    /// Versions kept per plugin; an upload beyond it drops the oldest inactive one. Default 8.
    pub max_versions: usize,
    /// Plugin instances alive at once, over all tenants (each running request holds one per
    /// choice). Default 256.
    pub instances: u32,
    /// Linear memory per instance, in MiB. Default 64.
    pub memory_mib: usize,
    /// Fuel (about one unit per wasm instruction) per call. Default 50,000,000.
    pub fuel_per_call: u64,
    /// Wall time per call, in milliseconds. Default 100.
    pub call_timeout_ms: u64,
    /// Wall time of all of one request's calls together (every choice's instance), in
    /// milliseconds. Default 10,000.
    pub request_time_ms: u64,
    /// Instances one tenant's requests may hold at once (a tenant's policy may set its own).
    /// Past it the tenant's request gets 429 `plugin_instances_limit`, so no tenant can take the
    /// instances others need. Default 64.
    pub tenant_instances: u32,
    /// New plugin versions one tenant may upload per minute (each is compiled; a tenant's
    /// policy may set its own). Default 10.
    pub uploads_per_minute: u64,
    /// Compilations running at once, over all tenants; more wait their turn. Default 1.
    pub compiles: usize,
    /// Wall time one compilation may take, in seconds; past it the upload is refused with
    /// `component_compile_timeout`. Default 30.
    pub compile_timeout_s: u64,
    /// Memory one compilation may use, in MiB (the compiler runs in a child process under this
    /// limit); past it the upload is refused with `component_compile_memory`. Default 2048.
    pub compile_memory_mib: u64,
}

impl Default for PluginsConfig {
    fn default() -> Self {
        Self {
            max_component_bytes: 8 << 20,
            max_config_bytes: 64 << 10,
            max_per_tenant: 16,
            max_versions: 8,
            instances: 256,
            memory_mib: 64,
            fuel_per_call: 50_000_000,
            call_timeout_ms: 100,
            request_time_ms: 10_000,
            tenant_instances: 64,
            uploads_per_minute: 10,
            compiles: 1,
            compile_timeout_s: 30,
            compile_memory_mib: 2048,
        }
    }
}

/// Errors reading a configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The TOML is malformed, has an unknown key or a wrong type.
    #[error("{path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message: the key, its line and column.
        message: String,
    },
    /// A value out of range.
    #[error("{path}: {key} = {value}: {why}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// The key.
        key: &'static str,
        /// The value given.
        value: String,
        /// What is allowed.
        why: &'static str,
    },
}

impl ServeConfig {
    /// Reads and checks `path`.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.into(),
            source,
        })?;
        Self::parse(&text, path)
    }

    /// Parses and checks TOML text (`path` names it in errors).
    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let cfg: ServeConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.into(),
            message: e.to_string().trim_end().to_string(),
        })?;
        cfg.check(path)?;
        Ok(cfg)
    }

    /// Range checks that types cannot express.
    pub fn check(&self, path: &Path) -> Result<(), ConfigError> {
        let bad = |key, value: usize, why| ConfigError::Invalid {
            path: path.into(),
            key,
            value: value.to_string(),
            why,
        };
        let positive: [(&'static str, usize); 25] = [
            ("cluster.pages_per_batch", self.cluster.pages_per_batch),
            ("cluster.batches_in_flight", self.cluster.batches_in_flight),
            ("cluster.bytes_in_flight_mib", self.cluster.bytes_in_flight_mib),
            ("plugins.max_component_bytes", self.plugins.max_component_bytes),
            ("plugins.max_config_bytes", self.plugins.max_config_bytes),
            ("plugins.max_per_tenant", self.plugins.max_per_tenant),
            ("plugins.max_versions", self.plugins.max_versions),
            ("plugins.instances", self.plugins.instances as usize),
            ("plugins.memory_mib", self.plugins.memory_mib),
            ("plugins.call_timeout_ms", self.plugins.call_timeout_ms as usize),
            ("plugins.request_time_ms", self.plugins.request_time_ms as usize),
            ("plugins.tenant_instances", self.plugins.tenant_instances as usize),
            ("plugins.uploads_per_minute", self.plugins.uploads_per_minute as usize),
            ("plugins.compiles", self.plugins.compiles),
            ("plugins.compile_timeout_s", self.plugins.compile_timeout_s as usize),
            ("plugins.compile_memory_mib", self.plugins.compile_memory_mib as usize),
            ("kv.memory_mib", self.kv.memory_mib),
            ("kv.page_size", self.kv.page_size),
            ("limits.default_max_tokens", self.limits.default_max_tokens),
            ("limits.max_batch_tokens", self.limits.max_batch_tokens),
            ("limits.max_running", self.limits.max_running),
            ("limits.queue", self.limits.queue),
            ("limits.body_bytes", self.limits.body_bytes),
            ("limits.json_depth", self.limits.json_depth),
            ("limits.max_n", self.limits.max_n),
        ];
        for (key, v) in positive {
            if v == 0 {
                return Err(bad(key, v, "must be at least 1"));
            }
        }
        if self.plugins.fuel_per_call == 0 {
            return Err(bad("plugins.fuel_per_call", 0, "must be at least 1"));
        }
        if self.plugins.memory_mib > 4096 {
            return Err(bad(
                "plugins.memory_mib",
                self.plugins.memory_mib,
                "must be at most 4096",
            ));
        }
        if self.plugins.instances > 10_000 {
            return Err(bad(
                "plugins.instances",
                self.plugins.instances as usize,
                "must be at most 10000",
            ));
        }
        if self.kv.page_size > 1024 {
            return Err(bad("kv.page_size", self.kv.page_size, "must be at most 1024"));
        }
        if self.limits.header_bytes < 1024 {
            return Err(bad(
                "limits.header_bytes",
                self.limits.header_bytes,
                "must be at least 1024",
            ));
        }
        if self.limits.max_connections == 0 {
            return Err(bad("limits.max_connections", 0, "must be at least 1"));
        }
        if self.limits.max_context == Some(0) {
            return Err(bad("limits.max_context", 0, "must be at least 1"));
        }
        if self.cluster.pages_per_batch > crate::transfer::MAX_PAGES_PER_BATCH {
            return Err(bad(
                "cluster.pages_per_batch",
                self.cluster.pages_per_batch,
                "must be at most 256",
            ));
        }
        let nodes = [
            ("cluster.listen", &[self.cluster.listen][..]),
            ("cluster.prefill", &self.cluster.prefill),
            ("cluster.decode", &self.cluster.decode),
        ];
        for (key, addrs) in nodes {
            if let Some(a) = addrs.iter().find(|a| !a.ip().is_loopback()) {
                return Err(ConfigError::Invalid {
                    path: path.into(),
                    key,
                    value: a.to_string(),
                    why: "nodes talk over loopback only: use a 127.0.0.0/8 or ::1 address",
                });
            }
        }
        if self.tls.cert.is_some() != self.tls.key.is_some() {
            return Err(ConfigError::Invalid {
                path: path.into(),
                key: if self.tls.cert.is_some() { "tls.key" } else { "tls.cert" },
                value: "(missing)".into(),
                why: "tls.cert and tls.key are set together or not at all",
            });
        }
        Ok(())
    }
}

/// What a `warden serve` process is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Everything in one process: API, engine, pool.
    #[default]
    All,
    /// Computes prompts and sends their KV to decode nodes.
    Prefill,
    /// Receives prompts' KV and generates.
    Decode,
    /// The API, keys, policies and plugins; dispatches to prefill and decode nodes.
    Router,
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Role::All => "all",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Router => "router",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<ServeConfig, ConfigError> {
        ServeConfig::parse(text, Path::new("w.toml"))
    }

    #[test]
    fn empty_file_gives_the_defaults() {
        let c = parse("").unwrap();
        assert_eq!(c.listen.port(), 8443);
        assert_eq!(c.kv.page_size, 16);
        assert_eq!(c.limits.queue, 256);
    }

    #[test]
    fn the_example_file_parses() {
        let text = include_str!("../../warden.example.toml");
        let c = parse(text).unwrap();
        assert_eq!(c.limits.body_bytes, 1 << 20);
    }

    #[test]
    fn unknown_keys_and_wrong_types_name_the_key_and_line() {
        let e = parse("listen = \"127.0.0.1:1\"\n[kv]\npage_sise = 16\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("page_sise") && e.contains("line 3") && e.contains("w.toml"),
            "{e}"
        );
        let e = parse("[limits]\nqueue = \"many\"\n").unwrap_err().to_string();
        assert!(e.contains("queue") && e.contains("line 2"), "{e}");
        let e = parse("listen = \"nowhere\"\n").unwrap_err().to_string();
        assert!(e.contains("listen"), "{e}");
    }

    #[test]
    fn impossible_values_are_refused_by_name() {
        let e = parse("[kv]\npage_size = 0\n").unwrap_err().to_string();
        assert!(e.contains("kv.page_size = 0"), "{e}");
        let e = parse("[tls]\ncert = \"c.pem\"\n").unwrap_err().to_string();
        assert!(e.contains("tls.key"), "{e}");
        let e = parse("[cluster]\ndecode = [\"10.0.0.2:9100\"]\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cluster.decode = 10.0.0.2:9100") && e.contains("loopback"),
            "{e}"
        );
        let e = parse("[cluster]\npages_per_batch = 0\n").unwrap_err().to_string();
        assert!(e.contains("cluster.pages_per_batch = 0"), "{e}");
    }
}
