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
    /// The GGUF model file of a server that serves one model; its file stem is the model's id
    /// in the API. Default (when `models` is empty too)
    /// `models/SmolLM2-135M-Instruct.Q4_1.gguf`.
    pub model: Option<PathBuf>,
    /// The id clients name the one model by (`model`, or the default). Default: its file's
    /// stem. Several models are named in `[[models]]`.
    pub served_model_name: Option<String>,
    /// Threads of the compute pool the models' forward passes share. Default 0: one per CPU
    /// the process may use.
    pub threads: usize,
    /// The models of a server that serves several (`[[models]]`), each with its own engine
    /// thread, KV pool (its share of `kv.memory_mib`) and limits. Set this or `model`, not both.
    pub models: Vec<ModelSpec>,
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
    /// Who may read `GET /metrics`.
    pub metrics: MetricsConfig,
    /// What browsers and proxies in front of the API get.
    pub http: HttpConfig,
}

/// The configuration's top-level keys, as `WARDEN_` variables name them (lowercased).
pub const TOP_LEVEL_KEYS: &[&str] = &[
    "listen",
    "data_dir",
    "model",
    "served_model_name",
    "threads",
    "models",
    "tls",
    "kv",
    "limits",
    "timeouts",
    "plugins",
    "policies",
    "cluster",
    "metrics",
    "http",
];

/// `WARDEN_` variables that are not configuration: the log's format, and the leak-canary suite's
/// transfer faults.
pub const NOT_CONFIG: &[&str] = &["LOG_FORMAT", "TRANSFER_FAULTS"];

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8443)),
            data_dir: PathBuf::from("data"),
            model: None,
            served_model_name: None,
            threads: 0,
            models: Vec::new(),
            tls: TlsConfig::default(),
            kv: KvConfig::default(),
            limits: LimitsConfig::default(),
            timeouts: TimeoutsConfig::default(),
            plugins: PluginsConfig::default(),
            policies: PathBuf::from("policies"),
            cluster: ClusterConfig::default(),
            metrics: MetricsConfig::default(),
            http: HttpConfig::default(),
        }
    }
}

/// One entry of `[[models]]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// The GGUF file.
    pub path: PathBuf,
    /// The id clients name in `model` (letters, digits and `-_.:/`, at most 128). Default: the
    /// file's stem.
    #[serde(default)]
    pub name: Option<String>,
    /// Its share of `kv.memory_mib`, in (0, 1]. Default: an equal part of what the models that
    /// set one leave.
    #[serde(default)]
    pub kv_share: Option<f64>,
    /// Its own engine limits; each one unset is `[limits]`'s.
    #[serde(default)]
    pub limits: ModelLimits,
}

/// The `[limits]` a model may set for itself (`[models.limits]`): those of its engine. The
/// others (bodies, headers, connections, `n`) are the server's.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelLimits {
    /// See [`LimitsConfig::max_context`].
    pub max_context: Option<usize>,
    /// See [`LimitsConfig::default_max_tokens`].
    pub default_max_tokens: Option<usize>,
    /// See [`LimitsConfig::max_batch_tokens`].
    pub max_batch_tokens: Option<usize>,
    /// See [`LimitsConfig::step_target_ms`].
    pub step_target_ms: Option<u64>,
    /// See [`LimitsConfig::max_running`].
    pub max_running: Option<usize>,
    /// See [`LimitsConfig::queue`].
    pub queue: Option<usize>,
}

/// A model as the server serves it, whichever way the configuration named it.
#[derive(Debug, Clone)]
pub struct ServedModel {
    /// The id clients name.
    pub name: String,
    /// The GGUF file.
    pub path: PathBuf,
    /// Bytes of its KV pool.
    pub kv_memory_bytes: usize,
    /// `[limits]` with the model's own in place.
    pub limits: LimitsConfig,
}

/// Most threads `threads` may ask for.
pub const MAX_THREADS: usize = 4096;

/// Longest model id.
pub const MAX_MODEL_NAME: usize = 128;

/// Whether `name` may be a model's id: it appears in URLs, metrics labels and logs.
pub fn valid_model_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_MODEL_NAME
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.:/".contains(&b))
        && !name.starts_with('/')
        && !name.ends_with('/')
}

/// A node's address as a configuration names it: `host:port`, the host an IP address or a DNS
/// name. A name is resolved at each connection, so a node that comes back at another address
/// (a Kubernetes pod restarted) is found there.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct NodeAddr {
    host: String,
    port: u16,
}

/// A node address that is not `host:port`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not host:port (an IP address or a DNS name, and a port)")]
pub struct BadNodeAddr(String);

impl NodeAddr {
    /// Parses `host:port` (`[v6]:port` for an IPv6 address).
    pub fn parse(s: &str) -> Result<Self, BadNodeAddr> {
        if let Ok(a) = s.parse::<SocketAddr>() {
            return Ok(a.into());
        }
        let bad = || BadNodeAddr(s.chars().take(300).collect());
        let (host, port) = s.rsplit_once(':').ok_or_else(bad)?;
        let port: u16 = port.parse().ok().filter(|&p| p != 0).ok_or_else(bad)?;
        let label_ok = |l: &str| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        };
        // A fully qualified name may end with one dot (it skips the resolver's search list).
        let labels = host.strip_suffix('.').unwrap_or(host);
        if labels.len() > 253 || !labels.split('.').all(label_ok) {
            return Err(bad());
        }
        Ok(Self {
            host: host.to_ascii_lowercase(),
            port,
        })
    }

    /// The host: an IP address or a DNS name.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Whether it is loopback whatever it resolves to: a loopback IP address, or `localhost`.
    pub fn is_loopback(&self) -> bool {
        match self.host.parse::<std::net::IpAddr>() {
            Ok(ip) => ip.is_loopback(),
            Err(_) => self.host == "localhost",
        }
    }
}

impl From<SocketAddr> for NodeAddr {
    fn from(a: SocketAddr) -> Self {
        Self {
            host: a.ip().to_string(),
            port: a.port(),
        }
    }
}

impl TryFrom<String> for NodeAddr {
    type Error = BadNodeAddr;
    fn try_from(s: String) -> Result<Self, BadNodeAddr> {
        Self::parse(&s)
    }
}

impl From<NodeAddr> for String {
    fn from(a: NodeAddr) -> String {
        a.to_string()
    }
}

impl std::fmt::Display for NodeAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// Disaggregated serving: where a prefill or decode node listens, which nodes a router
/// dispatches to, the bounds of a KV transfer, and the cluster's mutual TLS. Without `ca`,
/// `cert` and `key`, nodes speak to each other over loopback only (every address here must be
/// one); with them, every connection is mutual TLS under the cluster's CA, on any address.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterConfig {
    /// Where a prefill or decode node listens, for the router and for other nodes. Default
    /// `127.0.0.1:9100`.
    pub listen: SocketAddr,
    /// Where a prefill or decode node answers `GET /healthz`, `/readyz` and `/metrics` (the
    /// metrics token) over plain HTTP, for an orchestrator's probes and a scraper. Default:
    /// none (off).
    pub ops_listen: Option<SocketAddr>,
    /// The prefill nodes a router dispatches to (`host:port`; a DNS name is resolved at each
    /// connection). Default: none.
    pub prefill: Vec<NodeAddr>,
    /// The decode nodes a router dispatches to. Default: none.
    pub decode: Vec<NodeAddr>,
    /// How long a router waits at start for every node to answer, in seconds. Default 120.
    pub connect_timeout_s: u64,
    /// Pages per transfer batch. Default 8.
    pub pages_per_batch: usize,
    /// Batches a prefill node sends ahead of the decode node's acknowledgements. Default 4.
    pub batches_in_flight: usize,
    /// Bytes of batches sent ahead of acknowledgements, in MiB. Default 64.
    pub bytes_in_flight_mib: usize,
    /// The cluster CA's certificate (PEM): a peer's certificate must chain to it. Default: none
    /// (loopback only, plain TCP).
    pub ca: Option<PathBuf>,
    /// This process's certificate chain (PEM), signed by the CA and valid for the name
    /// `warden-cluster` (`warden cluster certs` makes such). Default: none.
    pub cert: Option<PathBuf>,
    /// This process's private key (PEM). Default: none.
    pub key: Option<PathBuf>,
    /// Seconds a peer may leave sent data unacknowledged, or fail to answer keep-alive probes
    /// on an idle connection, before the connection is dropped as dead (a cut link fails its
    /// requests instead of stalling them); also the longest a connection and its handshake may
    /// take. Default 10.
    pub peer_timeout_s: u64,
}

impl ClusterConfig {
    /// Whether every connection is mutual TLS (`ca`, `cert` and `key` set).
    pub fn mutual_tls(&self) -> bool {
        self.ca.is_some() && self.cert.is_some() && self.key.is_some()
    }
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 9100)),
            ops_listen: None,
            prefill: Vec::new(),
            decode: Vec::new(),
            connect_timeout_s: 120,
            pages_per_batch: 8,
            batches_in_flight: 4,
            bytes_in_flight_mib: 64,
            ca: None,
            cert: None,
            key: None,
            peer_timeout_s: 10,
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

/// `GET /metrics` answers the admin token and the metrics token, which can read the metrics and
/// nothing else (a scraper holds it, never the admin token).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// A file holding the metrics token (a mounted secret, say): at least
    /// [`MIN_METRICS_TOKEN`] printable characters, no spaces. Default: none, and the server
    /// keeps one it made in `data_dir/metrics-token` (mode 0600).
    pub token_file: Option<PathBuf>,
}

/// `[http]`: browsers calling the API from a web page (CORS), and the reverse proxies in front
/// of it.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    /// Web origins (`https://app.example.com`, scheme and host and port as a browser sends
    /// them) whose pages may call the API, or `"*"` for any. Their preflight requests are
    /// answered and their responses carry the CORS headers. Default: none (no CORS).
    pub allowed_origins: Vec<String>,
    /// Reverse proxies (addresses or blocks: `10.0.0.0/8`) whose `X-Forwarded-For` names the
    /// client in the access line. Default: none (the connection's address is the client's).
    pub trusted_proxies: Vec<crate::net::IpBlock>,
}

/// Longest origin `[http] allowed_origins` takes.
pub const MAX_ORIGIN: usize = 256;

/// Whether `origin` is one a browser sends: `"*"`, or `http(s)://host[:port]` with nothing
/// after (no path, no trailing `/`), in printable ASCII.
pub fn valid_origin(origin: &str) -> bool {
    if origin == "*" {
        return true;
    }
    let Some(rest) = origin
        .strip_prefix("https://")
        .or_else(|| origin.strip_prefix("http://"))
    else {
        return false;
    };
    origin.len() <= MAX_ORIGIN
        && !rest.is_empty()
        && rest.bytes().all(|b| b.is_ascii_graphic() && !b"/?#@".contains(&b))
}

/// The shortest metrics token a `[metrics] token_file` may hold.
pub const MIN_METRICS_TOKEN: usize = 24;

impl MetricsConfig {
    /// The token `token_file` holds (surrounding whitespace trimmed), if one is set: an error
    /// where the file cannot be read or its token is too short or not plain.
    pub fn token(&self) -> Result<Option<String>, ConfigError> {
        let Some(path) = &self.token_file else {
            return Ok(None);
        };
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.clone(),
            source,
        })?;
        let token = text.trim();
        if token.len() < MIN_METRICS_TOKEN || !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ConfigError::Invalid {
                path: path.clone(),
                key: "metrics.token_file",
                value: format!("({} bytes)", token.len()),
                why: "the file must hold one token of at least 24 printable ASCII characters, without spaces",
            });
        }
        Ok(Some(token.to_string()))
    }
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
    /// Most completion tokens when a request names none. Unset (the default), such a request
    /// runs to the end of its context (or to what its tenant's policy, quotas and KV budget
    /// allow), as OpenAI's and llama.cpp's servers do.
    pub default_max_tokens: Option<usize>,
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
    /// What a generation request's fields the server does not know get (at the top level and in
    /// each message): ignored (counted by name in `warden_ignored_fields_total` and named in the
    /// response's `x-warden-ignored-fields` header) or refused with a 400 naming the first.
    /// Default `ignore`, as SDKs and proxies add fields of their own.
    pub unknown_fields: UnknownFields,
    /// Largest `response_format` JSON schema, in bytes; larger gets 400 before compiling.
    /// Default 64 KiB.
    pub max_schema_bytes: usize,
    /// Longest a `response_format` (or the grammar of `tools`) may take to compile, in
    /// milliseconds: the compile is checked in a child process that is stopped at this limit,
    /// and the request gets 400. Default 2000.
    pub schema_compile_ms: u64,
    /// Most memory one compile may take, in MiB (the checking child's heap); more gets 400.
    /// Default 256.
    pub schema_compile_mib: u64,
    /// Compiles running at once over all tenants. More wait their turn, taken fairly: one at a
    /// time per tenant, so a tenant's compiles wait behind each other, never in front of
    /// another tenant's. Default 2.
    pub schema_compiles: usize,
    /// Memory kept for compiled formats, in MiB, so a tenant's repeated format compiles once;
    /// when full, the tenant holding the most gives up its least recently used. Default 64.
    pub schema_cache_mib: usize,
}

/// What [`LimitsConfig::unknown_fields`] does with a field the server does not know.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnknownFields {
    /// Serve the request without it.
    #[default]
    Ignore,
    /// Refuse the request (400).
    Refuse,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            max_context: None,
            default_max_tokens: None,
            max_batch_tokens: 512,
            step_target_ms: 40,
            max_running: 64,
            queue: 256,
            body_bytes: 1 << 20,
            json_depth: 32,
            header_bytes: 16 << 10,
            max_n: 8,
            max_connections: 4096,
            unknown_fields: UnknownFields::Ignore,
            max_schema_bytes: 64 << 10,
            schema_compile_ms: 2000,
            schema_compile_mib: 256,
            schema_compiles: 2,
            schema_cache_mib: 64,
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
    /// Instances running a plugin's `init` at once when it runs per request (a plugin that
    /// cannot be pre-initialised), over all tenants: more wait their turn, taken fairly, one at a
    /// time per tenant. Default 1.
    pub init_runs: usize,
    /// Fuel for a plugin's `init` (its set-up: reading the vocabulary, compiling rules), which
    /// runs once per (version, configuration) where the plugin can be pre-initialised, else
    /// before each request (then within the request's time). A tenant whose policy sets its
    /// fuel per call gets at most ten calls' worth. Default 500,000,000.
    pub init_fuel: u64,
    /// Wall time for a plugin's `init`, in milliseconds (at most ten calls' worth under a
    /// policy's call time). Default 1,000.
    pub init_timeout_ms: u64,
    /// Instances one tenant's requests may hold at once (a tenant's policy may set its own).
    /// Past it the tenant's request gets 429 `plugin_instances_limit`, so no tenant can take the
    /// instances others need. Default 64.
    pub tenant_instances: u32,
    /// New plugin versions one tenant may upload per minute (each is compiled; a tenant's
    /// policy may set its own). Default 10.
    pub uploads_per_minute: u64,
    /// Compilations running at once, over all tenants. More wait their turn, taken fairly: a
    /// tenant compiles one component at a time, and a free turn goes to the tenant that waited
    /// since longest ago, so one tenant's uploads wait behind each other, never in front of
    /// another tenant's. Default 1.
    pub compiles: usize,
    /// Seconds of compilation one tenant may use per minute, uploads and pre-initialisations
    /// together (a tenant's policy may set its own), with a burst of one minute's worth. A
    /// compile is charged its wall time, a timed-out one the whole timeout; a tenant in debt gets
    /// 429 `compile_budget_exceeded` with the time until it is paid back. Default 30.
    pub compile_seconds_per_minute: u64,
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
            init_runs: 1,
            init_fuel: 500_000_000,
            init_timeout_ms: 1000,
            tenant_instances: 64,
            uploads_per_minute: 10,
            compiles: 1,
            compile_seconds_per_minute: 30,
            compile_timeout_s: 30,
            compile_memory_mib: 2048,
        }
    }
}

/// Errors reading a configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A `WARDEN_` environment variable (or a command-line flag) that cannot be applied.
    #[error("{var}: {message}")]
    Env {
        /// The variable.
        var: String,
        /// What is wrong.
        message: String,
    },
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
    /// The `[[models]]` list as a whole cannot be served.
    #[error("{path}: [[models]]: {message}")]
    Models {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A `[[models]]` entry (or `model`) that cannot be served as written.
    #[error("{path}: models[{index}] ({name}): {message}")]
    Model {
        /// The file.
        path: PathBuf,
        /// Its place in `[[models]]`, from 0.
        index: usize,
        /// Its id, or its path when the id is the problem.
        name: String,
        /// What is wrong.
        message: String,
    },
}

/// The keys that hold paths, as `[table, key]` (or `[key]`); each `[[models]]` entry's `path`
/// too.
const PATH_KEYS: &[&[&str]] = &[
    &["data_dir"],
    &["model"],
    &["policies"],
    &["tls", "cert"],
    &["tls", "key"],
    &["cluster", "ca"],
    &["cluster", "cert"],
    &["cluster", "key"],
    &["metrics", "token_file"],
];

/// Joins each relative path in `table` (a configuration file's) to `dir`, the file's
/// directory. A value that is not a string is left for the parser to refuse by name.
fn rebase_paths(table: &mut toml::Table, dir: &Path) {
    fn rebase(value: Option<&mut toml::Value>, dir: &Path) {
        if let Some(toml::Value::String(s)) = value
            && Path::new(s.as_str()).is_relative()
        {
            *s = dir.join(s.as_str()).to_string_lossy().into_owned();
        }
    }
    if dir.as_os_str().is_empty() {
        return;
    }
    for keys in PATH_KEYS {
        let (last, tables) = keys.split_last().expect("a key path is never empty");
        let mut at = Some(&mut *table);
        for k in tables {
            at = at.and_then(|t| t.get_mut(*k)).and_then(toml::Value::as_table_mut);
        }
        rebase(at.and_then(|t| t.get_mut(*last)), dir);
    }
    if let Some(toml::Value::Array(models)) = table.get_mut("models") {
        for m in models.iter_mut().filter_map(toml::Value::as_table_mut) {
            rebase(m.get_mut("path"), dir);
        }
    }
}

/// A model's default id in the API: its file's stem.
pub fn model_id(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into())
}

impl ServeConfig {
    /// The configuration a server starts with: the file at `path` (none: the defaults), then
    /// environment variables `WARDEN_<KEY>` over it (nested keys joined by `__`, as
    /// `WARDEN_KV__MEMORY_MIB=512`; a value is read as TOML, else taken as a string), then
    /// `flags` (key, TOML value) over both; checked as a file is. A `WARDEN_` variable that names
    /// no configuration key is an error, but for the few the process reads for itself
    /// ([`NOT_CONFIG`]).
    pub fn load_layered(
        path: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
        flags: &[(&str, toml::Value)],
    ) -> Result<Self, ConfigError> {
        let shown = path.unwrap_or(Path::new("(no configuration file)"));
        let text = match path {
            Some(p) => std::fs::read_to_string(p).map_err(|source| ConfigError::Read { path: p.into(), source })?,
            None => String::new(),
        };
        // The file alone first: its own mistakes are named with their lines.
        let from_file = Self::parse(&text, shown);
        let mut layers: Vec<(String, Vec<String>, toml::Value)> = Vec::new();
        for (var, raw) in env {
            let Some(key) = var.strip_prefix("WARDEN_") else {
                continue;
            };
            if NOT_CONFIG.contains(&key) {
                continue;
            }
            let keys: Vec<String> = key.split("__").map(str::to_ascii_lowercase).collect();
            // Others set WARDEN_ variables too (a Kubernetes Service named warden sets
            // WARDEN_PORT; clients keep WARDEN_KEY): one that names no top-level key is left
            // alone, and said so. Under a key, an unknown name is an error (a typo).
            if !TOP_LEVEL_KEYS.contains(&keys[0].as_str()) {
                tracing::warn!(
                    "{var} names no configuration key (the top-level keys: {}; nested ones joined by __): ignored",
                    TOP_LEVEL_KEYS.join(", ")
                );
                continue;
            }
            if keys.iter().any(String::is_empty) {
                return Err(ConfigError::Env {
                    var,
                    message: "an empty key between __".into(),
                });
            }
            let value = toml::from_str::<toml::Table>(&format!("v = {raw}"))
                .ok()
                .and_then(|mut t| t.remove("v"))
                .unwrap_or(toml::Value::String(raw));
            layers.push((var, keys, value));
        }
        // A whole table first, then the keys under it, whatever the environment's order.
        layers.sort_by_key(|(_, keys, _)| keys.len());
        for (key, value) in flags {
            layers.push((
                format!("--{}", key.replace('_', "-")),
                vec![key.to_string()],
                value.clone(),
            ));
        }
        from_file?;
        let mut table: toml::Table = toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: shown.into(),
            message: e.to_string().trim_end().to_string(),
        })?;
        // The file's relative paths are the file's: read against its directory, wherever the
        // server starts. Flags' and variables' stay the working directory's.
        if let Some(dir) = path.and_then(Path::parent) {
            rebase_paths(&mut table, dir);
        }
        let names: Vec<String> = layers.iter().map(|(n, _, _)| n.clone()).collect();
        for (name, keys, value) in layers {
            let mut at = &mut table;
            for k in &keys[..keys.len() - 1] {
                let next = at
                    .entry(k.clone())
                    .or_insert_with(|| toml::Value::Table(toml::Table::new()));
                at = match next {
                    toml::Value::Table(t) => t,
                    _ => {
                        return Err(ConfigError::Env {
                            var: name,
                            message: format!("{k} is not a table"),
                        });
                    }
                };
            }
            // One model named over the file replaces the file's list of them.
            if keys == ["model"] {
                at.remove("models");
            }
            at.insert(keys[keys.len() - 1].clone(), value);
        }
        let cfg = ServeConfig::deserialize(toml::Value::Table(table)).map_err(|e| ConfigError::Parse {
            path: shown.into(),
            message: format!("{} (with {})", e.to_string().trim_end(), names.join(", ")),
        })?;
        cfg.check(shown)?;
        Ok(cfg)
    }

    /// Parses and checks TOML text (`path` names it in errors; its paths are left as written).
    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let cfg: ServeConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.into(),
            message: e.to_string().trim_end().to_string(),
        })?;
        cfg.check(path)?;
        Ok(cfg)
    }

    /// The models served, in order: `[[models]]`, or the one `model` (or the default) names,
    /// each with its KV bytes and limits resolved. [`check`](Self::check) has refused what
    /// would make this list wrong.
    pub fn served(&self) -> Vec<ServedModel> {
        let total = self.kv.memory_mib << 20;
        if self.models.is_empty() {
            let path = self
                .model
                .clone()
                .unwrap_or_else(|| PathBuf::from(crate::DEFAULT_MODEL));
            return vec![ServedModel {
                name: self.served_model_name.clone().unwrap_or_else(|| model_id(&path)),
                path,
                kv_memory_bytes: total,
                limits: self.limits.clone(),
            }];
        }
        let rest = self.unshared_kv();
        self.models
            .iter()
            .map(|m| {
                let share = m.kv_share.unwrap_or(rest);
                let (own, all) = (&m.limits, &self.limits);
                ServedModel {
                    name: m.name.clone().unwrap_or_else(|| model_id(&m.path)),
                    path: m.path.clone(),
                    kv_memory_bytes: (total as f64 * share) as usize,
                    limits: LimitsConfig {
                        max_context: own.max_context.or(all.max_context),
                        default_max_tokens: own.default_max_tokens.or(all.default_max_tokens),
                        max_batch_tokens: own.max_batch_tokens.unwrap_or(all.max_batch_tokens),
                        step_target_ms: own.step_target_ms.unwrap_or(all.step_target_ms),
                        max_running: own.max_running.unwrap_or(all.max_running),
                        queue: own.queue.unwrap_or(all.queue),
                        ..all.clone()
                    },
                }
            })
            .collect()
    }

    /// The share of the KV budget each model without a `kv_share` gets.
    fn unshared_kv(&self) -> f64 {
        let set: f64 = self.models.iter().filter_map(|m| m.kv_share).sum();
        let unset = self.models.iter().filter(|m| m.kv_share.is_none()).count();
        if unset == 0 {
            0.0
        } else {
            (1.0 - set).max(0.0) / unset as f64
        }
    }

    /// `model` or `[[models]]`: one of them, valid and distinct ids, KV shares that fit the
    /// budget, limits of at least 1.
    fn check_models(&self, path: &Path) -> Result<(), ConfigError> {
        if self.model.is_some() && !self.models.is_empty() {
            return Err(ConfigError::Invalid {
                path: path.into(),
                key: "model",
                value: "(set)".into(),
                why: "set model (one model) or [[models]] (several), not both",
            });
        }
        if self.served_model_name.is_some() && !self.models.is_empty() {
            return Err(ConfigError::Invalid {
                path: path.into(),
                key: "served_model_name",
                value: "(set)".into(),
                why: "names the one model (model); each of [[models]] has its own name",
            });
        }
        let bad = |index: usize, name: &str, message: String| ConfigError::Model {
            path: path.into(),
            index,
            name: name.to_string(),
            message,
        };
        let served = self.served();
        let mut seen = std::collections::HashSet::new();
        for (i, m) in served.iter().enumerate() {
            if !valid_model_name(&m.name) {
                return Err(bad(
                    i,
                    &m.path.display().to_string(),
                    format!(
                        "{:?} is not a model id: use letters, digits and -_.:/ (at most {MAX_MODEL_NAME}); {}",
                        m.name,
                        if self.models.is_empty() {
                            "set served_model_name (--served-model-name)"
                        } else {
                            "set name = \"...\" in [[models]]"
                        }
                    ),
                ));
            }
            if !seen.insert(m.name.clone()) {
                return Err(bad(i, &m.name, "two models have this id; give one a name".into()));
            }
        }
        for (i, (m, resolved)) in self.models.iter().zip(&served).enumerate() {
            let name = &resolved.name;
            if let Some(s) = m.kv_share
                && !(s > 0.0 && s <= 1.0)
            {
                return Err(bad(
                    i,
                    name,
                    format!("kv_share = {s}: must be more than 0 and at most 1"),
                ));
            }
            let own = &m.limits;
            for (key, v) in [
                ("max_context", own.max_context),
                ("default_max_tokens", own.default_max_tokens),
                ("max_batch_tokens", own.max_batch_tokens),
                ("max_running", own.max_running),
                ("queue", own.queue),
            ] {
                if v == Some(0) {
                    return Err(bad(i, name, format!("limits.{key} = 0: must be at least 1")));
                }
            }
        }
        let set: f64 = self.models.iter().filter_map(|m| m.kv_share).sum();
        if set > 1.0 + 1e-9 {
            return Err(ConfigError::Models {
                path: path.into(),
                message: format!(
                    "the kv_share values add up to {}, more than the whole KV budget (1)",
                    (set * 1000.0).round() / 1000.0
                ),
            });
        }
        if let Some(i) = self.models.iter().position(|m| m.kv_share.is_none())
            && self.unshared_kv() <= 0.0
        {
            return Err(bad(
                i,
                &served[i].name,
                "it has no kv_share and the others' take the whole budget: give it one".into(),
            ));
        }
        Ok(())
    }

    /// Range checks that types cannot express.
    pub fn check(&self, path: &Path) -> Result<(), ConfigError> {
        self.check_models(path)?;
        if self.threads > MAX_THREADS {
            return Err(ConfigError::Invalid {
                path: path.into(),
                key: "threads",
                value: self.threads.to_string(),
                why: "at most 4096 (0: one per CPU)",
            });
        }
        if let Some(o) = self.http.allowed_origins.iter().find(|o| !valid_origin(o)) {
            return Err(ConfigError::Invalid {
                path: path.into(),
                key: "http.allowed_origins",
                value: format!("{o:?}"),
                why: "an origin is \"*\" or scheme://host[:port] as a browser sends it (http or https, no path, no trailing /)",
            });
        }
        let bad = |key, value: usize, why| ConfigError::Invalid {
            path: path.into(),
            key,
            value: value.to_string(),
            why,
        };
        let positive: [(&'static str, usize); 31] = [
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
            ("plugins.init_timeout_ms", self.plugins.init_timeout_ms as usize),
            ("plugins.init_runs", self.plugins.init_runs),
            ("plugins.tenant_instances", self.plugins.tenant_instances as usize),
            ("plugins.uploads_per_minute", self.plugins.uploads_per_minute as usize),
            ("plugins.compiles", self.plugins.compiles),
            (
                "plugins.compile_seconds_per_minute",
                self.plugins.compile_seconds_per_minute as usize,
            ),
            ("plugins.compile_timeout_s", self.plugins.compile_timeout_s as usize),
            ("plugins.compile_memory_mib", self.plugins.compile_memory_mib as usize),
            ("kv.memory_mib", self.kv.memory_mib),
            ("kv.page_size", self.kv.page_size),
            ("limits.default_max_tokens", self.limits.default_max_tokens.unwrap_or(1)),
            ("limits.max_batch_tokens", self.limits.max_batch_tokens),
            ("limits.max_running", self.limits.max_running),
            ("limits.queue", self.limits.queue),
            ("limits.body_bytes", self.limits.body_bytes),
            ("limits.json_depth", self.limits.json_depth),
            ("limits.max_n", self.limits.max_n),
            ("limits.schema_compile_mib", self.limits.schema_compile_mib as usize),
            ("limits.schema_compiles", self.limits.schema_compiles),
            ("limits.schema_cache_mib", self.limits.schema_cache_mib),
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
            ("cluster.listen", &[NodeAddr::from(self.cluster.listen)][..]),
            ("cluster.prefill", &self.cluster.prefill),
            ("cluster.decode", &self.cluster.decode),
        ];
        let tls = [
            ("cluster.ca", self.cluster.ca.is_some()),
            ("cluster.cert", self.cluster.cert.is_some()),
            ("cluster.key", self.cluster.key.is_some()),
        ];
        if let Some((key, _)) = tls.iter().find(|(_, set)| !set)
            && tls.iter().any(|(_, set)| *set)
        {
            return Err(ConfigError::Invalid {
                path: path.into(),
                key,
                value: "(missing)".into(),
                why: "cluster.ca, cluster.cert and cluster.key are set together (mutual TLS) or not at all",
            });
        }
        if !self.cluster.mutual_tls() {
            for (key, addrs) in nodes {
                if let Some(a) = addrs.iter().find(|a| !a.is_loopback()) {
                    return Err(ConfigError::Invalid {
                        path: path.into(),
                        key,
                        value: a.to_string(),
                        why: "without mutual TLS (cluster.ca, cluster.cert, cluster.key) nodes talk over loopback only: use a 127.0.0.0/8 or ::1 address or localhost, or set them",
                    });
                }
            }
        }
        if self.cluster.peer_timeout_s == 0 {
            return Err(bad("cluster.peer_timeout_s", 0, "must be at least 1"));
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
    fn a_files_relative_paths_are_its_directorys_and_a_flags_the_working_directorys() {
        let dir = std::env::temp_dir().join(format!("warden-rebase-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("w.toml");
        std::fs::write(
            &file,
            "data_dir = \"state\"\npolicies = \"/etc/p\"\n[[models]]\npath = \"m/a.gguf\"\n[[models]]\npath = \"b.gguf\"\n[tls]\ncert = \"c.pem\"\nkey = \"/k.pem\"\n[metrics]\ntoken_file = \"../t\"\n[cluster]\nca = \"ca.pem\"\ncert = \"n.pem\"\nkey = \"n.key\"\n",
        )
        .unwrap();
        let c = ServeConfig::load_layered(Some(&file), Vec::new(), &[]).unwrap();
        assert_eq!(c.data_dir, dir.join("state"));
        assert_eq!(c.policies, PathBuf::from("/etc/p"), "an absolute path stays");
        let models: Vec<PathBuf> = c.models.iter().map(|m| m.path.clone()).collect();
        assert_eq!(models, [dir.join("m/a.gguf"), dir.join("b.gguf")]);
        assert_eq!(c.tls.cert, Some(dir.join("c.pem")));
        assert_eq!(c.metrics.token_file, Some(dir.join("../t")));
        assert_eq!(c.cluster.ca, Some(dir.join("ca.pem")));
        // The ids stay the files' stems.
        assert_eq!(c.served()[0].name, "a");
        // A flag's path and a variable's are the working directory's; a default stays as it is.
        let c = ServeConfig::load_layered(
            Some(&file),
            vec![("WARDEN_POLICIES".to_string(), "pol".to_string())],
            &[("data_dir", toml::Value::String("here".into()))],
        )
        .unwrap();
        assert_eq!((c.data_dir, c.policies), (PathBuf::from("here"), PathBuf::from("pol")));
        let c = ServeConfig::load_layered(None, Vec::new(), &[]).unwrap();
        assert_eq!(c.data_dir, PathBuf::from("data"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_environment_then_flags_override_the_file_and_a_stray_variable_is_named() {
        let dir = std::env::temp_dir().join(format!("warden-layered-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("w.toml");
        std::fs::write(&file, "listen = \"127.0.0.1:9000\"\n[kv]\nmemory_mib = 64\n").unwrap();
        let env = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
        };
        let c = ServeConfig::load_layered(
            Some(&file),
            env(&[
                ("WARDEN_KV__MEMORY_MIB", "128"),
                ("WARDEN_LISTEN", "0.0.0.0:9100"),
                ("WARDEN_DATA_DIR", "/var/lib/warden"),
                ("WARDEN_LIMITS__MAX_CONTEXT", "4096"),
                ("WARDEN_LOG_FORMAT", "json"),
                ("HOME", "/root"),
            ]),
            &[("listen", toml::Value::String("0.0.0.0:9200".into()))],
        )
        .unwrap();
        assert_eq!(c.kv.memory_mib, 128, "the environment over the file");
        assert_eq!(c.listen.to_string(), "0.0.0.0:9200", "a flag over the environment");
        assert_eq!(
            c.data_dir,
            PathBuf::from("/var/lib/warden"),
            "a string that is not TOML"
        );
        assert_eq!(c.limits.max_context, Some(4096));
        // No file: the defaults under the environment.
        let c = ServeConfig::load_layered(None, env(&[("WARDEN_KV__PAGE_SIZE", "32")]), &[]).unwrap();
        assert_eq!((c.kv.page_size, c.listen.port()), (32, 8443));
        // A variable that names no key, a nested key that does not exist, a value out of range.
        // A variable that names no top-level key is someone else's: left alone.
        let c = ServeConfig::load_layered(
            Some(&file),
            env(&[("WARDEN_LISTN", "x"), ("WARDEN_PORT", "tcp://10.0.0.1:8443")]),
            &[],
        )
        .unwrap();
        assert_eq!(c.listen.port(), 9000);
        // A whole table, then a key under it, whatever their order; one model over a list.
        let c = ServeConfig::load_layered(
            Some(&file),
            env(&[
                ("WARDEN_KV__MEMORY_MIB", "256"),
                ("WARDEN_KV", "{ memory_mib = 32, page_size = 32 }"),
            ]),
            &[],
        )
        .unwrap();
        assert_eq!((c.kv.memory_mib, c.kv.page_size), (256, 32));
        let e = ServeConfig::load_layered(Some(&file), env(&[("WARDEN_KV__MEMORY_MB", "1")]), &[]).unwrap_err();
        assert!(
            e.to_string().contains("memory_mb") && e.to_string().contains("WARDEN_KV__MEMORY_MB"),
            "{e}"
        );
        let e = ServeConfig::load_layered(Some(&file), env(&[("WARDEN_KV__PAGE_SIZE", "0")]), &[]).unwrap_err();
        assert!(e.to_string().contains("kv.page_size = 0"), "{e}");
        // The file's own mistakes keep their line.
        std::fs::write(&file, "listen = \"127.0.0.1:9000\"\n[kv]\nmemory_mb = 64\n").unwrap();
        let e = ServeConfig::load_layered(Some(&file), env(&[("WARDEN_LISTEN", "0.0.0.0:1")]), &[]).unwrap_err();
        assert!(
            e.to_string().contains("memory_mb") && e.to_string().contains("line 3"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
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
        for origin in [
            "https://app.example/",
            "app.example",
            "ftp://x",
            "https://a b",
            "https://",
        ] {
            let e = parse(&format!("[http]\nallowed_origins = [{origin:?}]\n"))
                .unwrap_err()
                .to_string();
            assert!(e.contains("http.allowed_origins"), "{origin}: {e}");
        }
        let e = parse("served_model_name = \"a\"\n[[models]]\npath = \"m.gguf\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("served_model_name"), "{e}");
        let e = parse("threads = 5000\n").unwrap_err().to_string();
        assert!(e.contains("threads = 5000"), "{e}");
        let c = parse("model = \"m/x.gguf\"\nserved_model_name = \"org/x\"\n").unwrap();
        assert_eq!(c.served()[0].name, "org/x");
        let c = parse("[http]\nallowed_origins = [\"*\", \"http://localhost:3000\"]\ntrusted_proxies = [\"10.0.0.0/8\", \"::1\"]\n").unwrap();
        assert_eq!(c.http.trusted_proxies.len(), 2);
        let e = parse("[http]\ntrusted_proxies = [\"10.0.0.0/40\"]\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("10.0.0.0/40") && e.contains("line 2"), "{e}");
        let e = parse("[tls]\ncert = \"c.pem\"\n").unwrap_err().to_string();
        assert!(e.contains("tls.key"), "{e}");
        let e = parse("[cluster]\ndecode = [\"10.0.0.2:9100\"]\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cluster.decode = 10.0.0.2:9100") && e.contains("loopback"),
            "{e}"
        );
        // With mutual TLS, any address; its three files go together.
        let tls = "[cluster]\nca = \"ca.pem\"\ncert = \"n.pem\"\nkey = \"n.key\"\n";
        let c = parse(&format!(
            "{tls}decode = [\"10.0.0.2:9100\"]\nlisten = \"0.0.0.0:9100\"\n"
        ))
        .unwrap();
        assert!(c.cluster.mutual_tls());
        // Nodes by name (resolved at each connection), IPv4 and IPv6; not anything else.
        let c = parse(&format!(
            "{tls}prefill = [\"warden-prefill-0.warden-prefill.ns.svc.cluster.local:9100\", \"[::1]:9\"]\n"
        ))
        .unwrap();
        let shown: Vec<String> = c.cluster.prefill.iter().map(|a| a.to_string()).collect();
        assert_eq!(
            shown,
            ["warden-prefill-0.warden-prefill.ns.svc.cluster.local:9100", "[::1]:9"]
        );
        assert!(NodeAddr::parse("warden-decode-0.warden-decode.ns.svc.cluster.local.:9100").is_ok());
        for bad in ["nohost", "a b:9", "x:port", "-x:9", "x:70000", "a..b:9", "x:0", "x..:9"] {
            let e = parse(&format!("{tls}decode = [{bad:?}]\n")).unwrap_err().to_string();
            assert!(e.contains("host:port"), "{bad}: {e}");
        }
        // Without mutual TLS a name must be localhost.
        assert!(parse("[cluster]\ndecode = [\"localhost:9\"]\n").is_ok());
        let e = parse("[cluster]\ndecode = [\"node.example:9\"]\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("loopback"), "{e}");
        let e = parse("[cluster]\nca = \"ca.pem\"\ncert = \"n.pem\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("cluster.key") && e.contains("together"), "{e}");
        let e = parse("[cluster]\npages_per_batch = 0\n").unwrap_err().to_string();
        assert!(e.contains("cluster.pages_per_batch = 0"), "{e}");
    }

    #[test]
    fn one_model_is_served_by_default_or_as_model_names_it() {
        let s = parse("").unwrap().served();
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].name, "SmolLM2-135M-Instruct.Q4_1");
        assert_eq!(s[0].kv_memory_bytes, 512 << 20);
        let s = parse("model = \"m/other.Q8_0.gguf\"\n[limits]\nqueue = 7\n")
            .unwrap()
            .served();
        assert_eq!((s[0].name.as_str(), s[0].limits.queue), ("other.Q8_0", 7));
    }

    #[test]
    fn several_models_get_their_share_of_the_kv_budget_and_their_own_limits() {
        let c = parse(
            "[kv]\nmemory_mib = 100\n[limits]\nqueue = 9\nmax_running = 5\n\
             [[models]]\npath = \"a/small.gguf\"\nkv_share = 0.5\n[models.limits]\nmax_context = 2048\nqueue = 3\n\
             [[models]]\npath = \"b/large.gguf\"\nname = \"org/large:v1\"\n\
             [[models]]\npath = \"c/third.gguf\"\n",
        )
        .unwrap();
        let s = c.served();
        let names: Vec<&str> = s.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["small", "org/large:v1", "third"]);
        // The share set, then an equal part of the rest each.
        let mib = |m: &ServedModel| m.kv_memory_bytes as f64 / (1 << 20) as f64;
        assert_eq!((mib(&s[0]), mib(&s[1]), mib(&s[2])), (50.0, 25.0, 25.0));
        // Its own limits, and [limits]' for the rest.
        assert_eq!(
            (s[0].limits.max_context, s[0].limits.queue, s[0].limits.max_running),
            (Some(2048), 3, 5)
        );
        assert_eq!((s[1].limits.max_context, s[1].limits.queue), (None, 9));
    }

    #[test]
    fn model_lists_that_cannot_be_served_are_refused_by_name() {
        let two = |a: &str, b: &str| {
            parse(&format!(
                "[[models]]\npath = \"a.gguf\"\n{a}\n[[models]]\npath = \"b.gguf\"\n{b}\n"
            ))
            .unwrap_err()
            .to_string()
        };
        let e = parse("model = \"x.gguf\"\n[[models]]\npath = \"a.gguf\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("model") && e.contains("not both"), "{e}");
        let e = two("name = \"same\"", "name = \"same\"");
        assert!(
            e.contains("models[1] (same)") && e.contains("two models have this id"),
            "{e}"
        );
        let e = two("kv_share = 0.7", "kv_share = 0.6");
        assert!(e.contains("add up to 1.3"), "{e}");
        let e = two("kv_share = 0", "");
        assert!(e.contains("models[0] (a)") && e.contains("kv_share = 0"), "{e}");
        let e = two("kv_share = 1.0", "");
        assert!(e.contains("models[1] (b)") && e.contains("give it one"), "{e}");
        let e = two("name = \"has space\"", "");
        assert!(e.contains("models[0] (a.gguf)") && e.contains("not a model id"), "{e}");
        let e = two("[models.limits]\nqueue = 0", "");
        assert!(e.contains("models[0] (a)") && e.contains("limits.queue = 0"), "{e}");
        // What a model cannot set for itself is the server's, and named.
        let e = two("[models.limits]\nbody_bytes = 10", "");
        assert!(e.contains("body_bytes") && e.contains("line 4"), "{e}");
        let e = parse("[[models]]\nname = \"x\"\n").unwrap_err().to_string();
        assert!(e.contains("path"), "{e}");
    }

    #[test]
    fn the_docs_two_model_config_parses() {
        let readme = include_str!("../../docs/operating.md");
        let section = &readme[readme.find("## Several models on one server").expect("the section")..];
        let start = section.find("```toml\n").expect("a toml block") + 8;
        let block = &section[start..start + section[start..].find("```").expect("its end")];
        let s = parse(block).unwrap().served();
        let got: Vec<(&str, usize, Option<usize>)> = s
            .iter()
            .map(|m| (m.name.as_str(), m.kv_memory_bytes >> 20, m.limits.max_context))
            .collect();
        assert_eq!(got, [("smollm2", 256, None), ("gemma-3-270m", 768, Some(8192))]);
    }

    #[test]
    fn model_ids_are_what_urls_and_metrics_labels_can_carry() {
        for ok in ["a", "SmolLM2-135M-Instruct.Q4_1", "org/name:tag_1"] {
            assert!(valid_model_name(ok), "{ok}");
        }
        for bad in ["", "a b", "a\"b", "/a", "a/", "é", &"x".repeat(MAX_MODEL_NAME + 1)] {
            assert!(!valid_model_name(bad), "{bad}");
        }
    }
}
