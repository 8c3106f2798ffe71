//! Per-tenant quota policies: the files in `policies/` and what they resolve to.
//!
//! * `policies/default.toml` applies to every tenant; `policies/tenants/<tenant>.toml` overrides
//!   any of its keys for that tenant. Every key is optional; a key set in neither takes the
//!   built-in default (unlimited for rates and quotas, the server's own limits otherwise).
//! * A file is checked whole before anything takes effect: unknown keys, wrong types and
//!   impossible values are errors naming the file, the line and the key. A set with any bad file
//!   is refused as a whole, so the previous set stays in force ([`PolicySet::load`]).
//! * A loaded set has a version (a digest of every file's name and bytes), which the metrics show.
//!
//! Enforcement lives with the server (`serve::quota`); this module only says what the limits are.

pub mod rate;

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use sha2::Digest;

/// A limit that may be absent: a number, or `"unlimited"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// No limit.
    Unlimited,
    /// At most this many.
    At(u64),
}

impl Limit {
    /// The number, if limited.
    pub fn get(self) -> Option<u64> {
        match self {
            Limit::Unlimited => None,
            Limit::At(n) => Some(n),
        }
    }
}

impl<'de> Deserialize<'de> for Limit {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Limit;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a non-negative integer or \"unlimited\"")
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Limit, E> {
                u64::try_from(v)
                    .map(Limit::At)
                    .map_err(|_| E::custom(format!("{v} is negative; use a non-negative integer or \"unlimited\"")))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Limit, E> {
                Ok(Limit::At(v))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Limit, E> {
                if v == "unlimited" {
                    Ok(Limit::Unlimited)
                } else {
                    Err(E::custom(format!(
                        "\"{v}\" is not a limit; use a non-negative integer or \"unlimited\""
                    )))
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// Whether a tenant's KV may be reused across its requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PrefixSharing {
    /// The tenant's own prefix cache: its requests reuse its own pages, never another tenant's
    /// (invariant 5).
    Private,
    /// No prefix cache: every request computes its whole prompt.
    Off,
    /// The tenant's own prefix cache, and the `public_prefixes` of `default.toml`: KV the server
    /// computes from text the operator marks public, which every tenant with this setting reads
    /// (the only KV invariant 5 lets tenants share).
    Public,
}

/// One policy file as written: every key optional.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    requests_per_minute: Option<Limit>,
    tokens_per_minute: Option<Limit>,
    tokens_per_day: Option<Limit>,
    tokens_per_month: Option<Limit>,
    concurrent_requests: Option<Limit>,
    max_context: Option<Limit>,
    max_tokens: Option<Limit>,
    allowed_models: Option<Vec<String>>,
    allowed_plugins: Option<Vec<String>>,
    weight: Option<u32>,
    kv: Option<KvFile>,
    plugins: Option<PluginsFile>,
    public_prefixes: Option<BTreeMap<String, String>>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct KvFile {
    max_pages: Option<Limit>,
    min_pages: Option<u64>,
    prefix_cache: Option<PrefixSharing>,
    max_pinned_pages: Option<u64>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PluginsFile {
    fuel_per_call: Option<u64>,
    memory_mib: Option<u64>,
    call_timeout_ms: Option<u64>,
    request_time_ms: Option<u64>,
    instances: Option<u64>,
    uploads_per_minute: Option<u64>,
    compile_seconds_per_minute: Option<u64>,
    max_component_mib: Option<u64>,
}

/// A tenant's policy, resolved: what the server enforces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// Requests admitted per minute (a token bucket holding one minute's worth).
    pub requests_per_minute: Limit,
    /// Prompt plus completion tokens per minute; a request reserves its prompt plus
    /// `max_tokens` (times `n`) at admission and gets back what it did not use.
    pub tokens_per_minute: Limit,
    /// Tokens per UTC day.
    pub tokens_per_day: Limit,
    /// Tokens per UTC calendar month.
    pub tokens_per_month: Limit,
    /// Sequences in flight at once: each choice (`n`) of a request counts as one.
    pub concurrent_requests: Limit,
    /// Prompt plus completion tokens of one request (the server's own limit applies too).
    pub max_context: Limit,
    /// The largest `max_tokens` a request may ask for.
    pub max_tokens: Limit,
    /// Models the tenant may use (`"*"`: any).
    pub allowed_models: Vec<String>,
    /// Plugins the tenant may run, by name (`"*"`: any).
    pub allowed_plugins: Vec<String>,
    /// The tenant's share when tenants contend for the engine (default 1).
    pub weight: u32,
    /// KV pages the tenant's running requests may hold at once.
    pub kv_max_pages: Limit,
    /// KV pages kept available for the tenant whatever others do (its guaranteed floor).
    pub kv_min_pages: u64,
    /// Prefix-cache reuse.
    pub prefix_cache: PrefixSharing,
    /// KV pages its plugins may pin in its prefix cache.
    pub kv_max_pinned_pages: u64,
    /// Plugin limits; `None` takes the server's `[plugins]` value.
    pub plugin_fuel_per_call: Option<u64>,
    /// Plugin linear memory, MiB.
    pub plugin_memory_mib: Option<u64>,
    /// Plugin wall time per call, milliseconds.
    pub plugin_call_timeout_ms: Option<u64>,
    /// Plugin wall time of all of one request's calls together, milliseconds.
    pub plugin_request_time_ms: Option<u64>,
    /// Plugin instances the tenant's requests may hold at once (its share of the server's).
    pub plugin_instances: Option<u64>,
    /// Plugin uploads (of new versions) per minute.
    pub plugin_uploads_per_minute: Option<u64>,
    /// Seconds of plugin compilation (uploads and pre-initialisations) per minute.
    pub plugin_compile_seconds_per_minute: Option<u64>,
    /// Largest plugin component, MiB.
    pub plugin_max_component_mib: Option<u64>,
}

/// The default `concurrent_requests`: what one tenant may hold in flight, running or waiting,
/// unless its policy says otherwise (twice the engine's default running slots, so a tenant alone
/// keeps every slot busy, and a sixteenth of its default queue's worth of waiting).
pub const DEFAULT_CONCURRENT_SEQUENCES: u64 = 128;

impl Default for Policy {
    fn default() -> Self {
        Self {
            requests_per_minute: Limit::Unlimited,
            tokens_per_minute: Limit::Unlimited,
            tokens_per_day: Limit::Unlimited,
            tokens_per_month: Limit::Unlimited,
            concurrent_requests: Limit::At(DEFAULT_CONCURRENT_SEQUENCES),
            max_context: Limit::Unlimited,
            max_tokens: Limit::Unlimited,
            allowed_models: vec!["*".into()],
            allowed_plugins: vec!["*".into()],
            weight: 1,
            kv_max_pages: Limit::Unlimited,
            kv_min_pages: 0,
            prefix_cache: PrefixSharing::Private,
            kv_max_pinned_pages: 64,
            plugin_fuel_per_call: None,
            plugin_memory_mib: None,
            plugin_call_timeout_ms: None,
            plugin_request_time_ms: None,
            plugin_instances: None,
            plugin_uploads_per_minute: None,
            plugin_compile_seconds_per_minute: None,
            plugin_max_component_mib: None,
        }
    }
}

impl Policy {
    /// Whether `model` is allowed.
    pub fn allows_model(&self, model: &str) -> bool {
        self.allowed_models.iter().any(|m| m == "*" || m == model)
    }

    /// Whether plugin `name` is allowed.
    pub fn allows_plugin(&self, name: &str) -> bool {
        self.allowed_plugins.iter().any(|p| p == "*" || p == name)
    }

    /// What the engine enforces: the weight and the KV settings.
    pub fn tenant_settings(&self) -> crate::engine::TenantSettings {
        crate::engine::TenantSettings {
            weight: self.weight,
            max_pages: self.kv_max_pages.get().map(|p| p as usize),
            min_pages: self.kv_min_pages as usize,
            prefix_cache: self.prefix_cache != PrefixSharing::Off,
            public_prefixes: self.prefix_cache == PrefixSharing::Public,
            max_pinned_pages: self.kv_max_pinned_pages as usize,
        }
    }

    /// This policy with `f`'s keys laid over it.
    fn overlay(mut self, f: &PolicyFile) -> Self {
        macro_rules! set {
            ($($field:ident),*) => { $( if let Some(v) = &f.$field { self.$field = v.clone(); } )* };
        }
        set!(
            requests_per_minute,
            tokens_per_minute,
            tokens_per_day,
            tokens_per_month,
            concurrent_requests,
            max_context,
            max_tokens,
            allowed_models,
            allowed_plugins,
            weight
        );
        if let Some(kv) = &f.kv {
            if let Some(v) = kv.max_pages {
                self.kv_max_pages = v;
            }
            if let Some(v) = kv.min_pages {
                self.kv_min_pages = v;
            }
            if let Some(v) = kv.prefix_cache {
                self.prefix_cache = v;
            }
            if let Some(v) = kv.max_pinned_pages {
                self.kv_max_pinned_pages = v;
            }
        }
        if let Some(p) = &f.plugins {
            self.plugin_fuel_per_call = p.fuel_per_call.or(self.plugin_fuel_per_call);
            self.plugin_memory_mib = p.memory_mib.or(self.plugin_memory_mib);
            self.plugin_call_timeout_ms = p.call_timeout_ms.or(self.plugin_call_timeout_ms);
            self.plugin_request_time_ms = p.request_time_ms.or(self.plugin_request_time_ms);
            self.plugin_instances = p.instances.or(self.plugin_instances);
            self.plugin_uploads_per_minute = p.uploads_per_minute.or(self.plugin_uploads_per_minute);
            self.plugin_compile_seconds_per_minute =
                p.compile_seconds_per_minute.or(self.plugin_compile_seconds_per_minute);
            self.plugin_max_component_mib = p.max_component_mib.or(self.plugin_max_component_mib);
        }
        self
    }
}

/// A policy file that cannot take effect.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}{}: {message}", file.display(), line.map(|l| format!(":{l}")).unwrap_or_default())]
pub struct PolicyError {
    /// The file.
    pub file: PathBuf,
    /// The line, when the error has one.
    pub line: Option<usize>,
    /// What is wrong, naming the key.
    pub message: String,
}

/// What the server knows of itself, to refuse impossible policies. A tenant's KV policy
/// applies in each served model's pool, so a server of several models gives its smallest pool's
/// figures.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// KV pages in the (smallest) pool.
    pub kv_pages: u64,
    /// Token slots per KV page.
    pub page_size: usize,
    /// KV pages that may be pinned at all (what the (smallest) pool keeps beyond one request of
    /// the maximum context); public prefixes are pinned.
    pub pin_pages: u64,
}

impl Bounds {
    /// The bounds a tenant's KV policy has across pools of (pages, pinnable pages) with pages of
    /// `page_size` tokens: a policy applies in every model's pool, so the smallest bounds it.
    pub fn of_pools(pools: &[(usize, usize)], page_size: usize) -> Self {
        Self {
            kv_pages: pools.iter().map(|p| p.0).min().unwrap_or(0) as u64,
            page_size,
            pin_pages: pools.iter().map(|p| p.1).min().unwrap_or(0) as u64,
        }
    }
}

/// A public prefix: its name, and its tokens for each served model (in the server's order).
type PublicPrefix = (String, Vec<Vec<u32>>);

/// Longest text of one public prefix, in bytes.
pub const MAX_PUBLIC_PREFIX_BYTES: usize = 64 << 10;

/// Every tenant's policy, as loaded from one directory at one moment.
#[derive(Debug, Clone, Default)]
pub struct PolicySet {
    /// A digest of the files (name and bytes): the version in force.
    pub version: String,
    /// How many sets were in force before this one since start (orders settings in flight).
    pub generation: u64,
    default: Policy,
    tenants: HashMap<String, Policy>,
    /// The public prefixes, by name, tokenized for each served model (in the server's order).
    public: Vec<PublicPrefix>,
}

impl PolicySet {
    /// The policies of `dir`: `default.toml` (absent: the built-in defaults) and
    /// `tenants/*.toml`, at least one of them. Any bad file refuses the whole set, and so does a
    /// directory that is not there or holds no policy. `tokenize` turns a public prefix's
    /// text into the tokens prompts begin with, one list for each served model.
    pub fn load(dir: &Path, bounds: Bounds, tokenize: &dyn Fn(&str) -> Vec<Vec<u32>>) -> Result<Self, PolicyError> {
        // A directory that is not there, or holds no policy, is a mistake (a path mistyped, a
        // volume not mounted), never a silent "no limits": running on the built-in defaults
        // takes a default.toml, empty or not.
        if !dir.is_dir() {
            return Err(PolicyError {
                file: dir.into(),
                line: None,
                message: "no such directory: the tenants' policies (default.toml, tenants/*.toml) live here; \
                          create it (an empty default.toml means the built-in defaults)"
                    .into(),
            });
        }
        let mut files: BTreeMap<String, (PathBuf, String)> = BTreeMap::new();
        let read = |p: &Path| {
            std::fs::read_to_string(p).map_err(|e| PolicyError {
                file: p.into(),
                line: None,
                message: format!("cannot read it: {e}"),
            })
        };
        let default_path = dir.join("default.toml");
        if default_path.exists() {
            files.insert("default.toml".into(), (default_path.clone(), read(&default_path)?));
        }
        let tenants_dir = dir.join("tenants");
        if tenants_dir.exists() {
            let entries = std::fs::read_dir(&tenants_dir).map_err(|e| PolicyError {
                file: tenants_dir.clone(),
                line: None,
                message: format!("cannot list it: {e}"),
            })?;
            for entry in entries {
                let p = entry
                    .map_err(|e| PolicyError {
                        file: tenants_dir.clone(),
                        line: None,
                        message: format!("cannot list it: {e}"),
                    })?
                    .path();
                let Some(name) = p.file_name().and_then(|n| n.to_str()) else {
                    continue;
                };
                // Editors' swap and backup files are not policies.
                if name.starts_with('.') || !name.ends_with(".toml") {
                    continue;
                }
                files.insert(format!("tenants/{name}"), (p.clone(), read(&p)?));
            }
        }
        if files.is_empty() {
            return Err(PolicyError {
                file: dir.into(),
                line: None,
                message: "holds no policy (no default.toml, no tenants/*.toml), so every tenant would run \
                          without limits; add a default.toml (an empty one means the built-in defaults)"
                    .into(),
            });
        }
        Self::from_files(&files, bounds, tokenize)
    }

    /// The policies of `files` (name under the policy directory, like `default.toml` or
    /// `tenants/acme.toml` → the path it names in errors and its text), checked as
    /// [`PolicySet::load`] checks a directory's.
    pub fn from_files(
        files: &BTreeMap<String, (PathBuf, String)>,
        bounds: Bounds,
        tokenize: &dyn Fn(&str) -> Vec<Vec<u32>>,
    ) -> Result<Self, PolicyError> {
        let mut digest = sha2::Sha256::new();
        for (name, (_, text)) in files {
            digest.update((name.len() as u64).to_le_bytes());
            digest.update(name.as_bytes());
            digest.update((text.len() as u64).to_le_bytes());
            digest.update(text.as_bytes());
        }
        let version: String = digest.finalize()[..6].iter().map(|b| format!("{b:02x}")).collect();
        let mut set = PolicySet {
            generation: 0,
            version,
            default: Policy::default(),
            tenants: HashMap::new(),
            public: Vec::new(),
        };
        if let Some((path, text)) = files.get("default.toml") {
            let f = parse(path, text)?;
            set.default = Policy::default().overlay(&f);
            check(path, text, &set.default, bounds, true)?;
            set.public = public_prefixes(path, text, &f, bounds, tokenize)?;
        }
        let mut floors = 0u64;
        for (name, (path, text)) in files.range("tenants/".to_string()..) {
            let tenant = name.trim_start_matches("tenants/").trim_end_matches(".toml");
            if !crate::tenant::valid_tenant_name(tenant) {
                return Err(PolicyError {
                    file: path.clone(),
                    line: None,
                    message: format!("\"{tenant}\" is not a tenant name (the file is tenants/<tenant>.toml)"),
                });
            }
            let f = parse(path, text)?;
            if f.public_prefixes.is_some() {
                return Err(PolicyError {
                    file: path.clone(),
                    line: line_of(text, None, "public_prefixes"),
                    message: "public_prefixes are shared by every tenant allowed them; set them in default.toml, not for one tenant".into(),
                });
            }
            let p = set.default.clone().overlay(&f);
            check(path, text, &p, bounds, false)?;
            floors += p.kv_min_pages;
            if floors > bounds.kv_pages {
                return Err(PolicyError {
                    file: path.clone(),
                    line: line_of(text, Some("kv"), "min_pages"),
                    message: format!(
                        "kv.min_pages: the tenants' guaranteed KV pages add up to {floors}, more than the pool's {} pages",
                        bounds.kv_pages
                    ),
                });
            }
            set.tenants.insert(tenant.to_string(), p);
        }
        Ok(set)
    }

    /// The policy of tenant `name`.
    pub fn of(&self, name: &str) -> &Policy {
        self.tenants.get(name).unwrap_or(&self.default)
    }

    /// Tenants with a file of their own.
    pub fn tenants(&self) -> impl Iterator<Item = (&str, &Policy)> {
        self.tenants.iter().map(|(n, p)| (n.as_str(), p))
    }

    /// The public prefixes' tokens for the `model`th served model, in the order of their names.
    pub fn public_prefixes(&self, model: usize) -> Vec<Vec<u32>> {
        self.public.iter().filter_map(|(_, t)| t.get(model).cloned()).collect()
    }
}

/// The `[public_prefixes]` of `default.toml` (`f`), tokenized and checked: names of letters,
/// digits, `-` and `_`; texts of at most [`MAX_PUBLIC_PREFIX_BYTES`] and at least one KV page of
/// tokens; all of them within the pages that may be pinned. With several models, each model's
/// tokens are checked.
fn public_prefixes(
    path: &Path,
    text: &str,
    f: &PolicyFile,
    bounds: Bounds,
    tokenize: &dyn Fn(&str) -> Vec<Vec<u32>>,
) -> Result<Vec<PublicPrefix>, PolicyError> {
    let mut out = Vec::new();
    let mut pages: Vec<u64> = Vec::new();
    for (name, prefix) in f.public_prefixes.iter().flatten() {
        let err = |message: String| PolicyError {
            file: path.into(),
            line: line_of(text, Some("public_prefixes"), name),
            message: format!("public_prefixes.{name}: {message}"),
        };
        let name_ok = !name.is_empty()
            && name.len() <= 64
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !name_ok {
            return Err(err("a name is 1 to 64 letters, digits, '-' or '_'".into()));
        }
        if prefix.len() > MAX_PUBLIC_PREFIX_BYTES {
            return Err(err(format!(
                "{} bytes, more than {MAX_PUBLIC_PREFIX_BYTES}",
                prefix.len()
            )));
        }
        let tokens = tokenize(prefix);
        pages.resize(tokens.len(), 0);
        for (t, pages) in tokens.iter().zip(&mut pages) {
            if t.len() < bounds.page_size {
                return Err(err(format!(
                    "{} tokens, less than one KV page ({} tokens): nothing of it could be shared",
                    t.len(),
                    bounds.page_size
                )));
            }
            *pages += (t.len() / bounds.page_size) as u64;
            if *pages > bounds.pin_pages {
                return Err(err(format!(
                    "the public prefixes need {pages} KV pages kept cached, more than the {} the pool can pin",
                    bounds.pin_pages
                )));
            }
        }
        out.push((name.clone(), tokens));
    }
    Ok(out)
}

fn parse(path: &Path, text: &str) -> Result<PolicyFile, PolicyError> {
    toml::from_str(text).map_err(|e| {
        let line = e.span().map(|s| line_at(text, s.start));
        PolicyError {
            file: path.into(),
            line,
            message: e.message().trim_end().to_string(),
        }
    })
}

/// The line where `key` is set in `[table]` (or at the top, with `None`), from the parser's
/// spans: whichever TOML form sets it (`[kv]` then `min_pages = …`, a dotted `kv.min_pages = …`,
/// an inline `kv = { min_pages = … }`).
fn line_of(text: &str, table: Option<&str>, key: &str) -> Option<usize> {
    use toml::de::{DeTable, DeValue};
    fn find<'t, 'i>(t: &'t DeTable<'i>, name: &str) -> Option<(usize, &'t DeValue<'i>)> {
        t.iter()
            .find(|(k, _)| k.get_ref().as_ref() == name)
            .map(|(k, v)| (k.span().start, v.get_ref()))
    }
    let doc = DeTable::parse(text).ok()?;
    let at = match table {
        None => find(doc.get_ref(), key)?.0,
        Some(t) => match find(doc.get_ref(), t)?.1 {
            DeValue::Table(inner) => find(inner, key)?.0,
            _ => return None,
        },
    };
    Some(line_at(text, at))
}

/// The line (from 1) of byte `at` in `text`.
fn line_at(text: &str, at: usize) -> usize {
    text.as_bytes()[..at.min(text.len())]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

/// Values no type can rule out.
fn check(path: &Path, text: &str, p: &Policy, bounds: Bounds, is_default: bool) -> Result<(), PolicyError> {
    let err = |table: Option<&str>, key: &str, message: String| PolicyError {
        file: path.into(),
        line: line_of(text, table, key),
        message,
    };
    for (key, l) in [
        ("requests_per_minute", p.requests_per_minute),
        ("tokens_per_minute", p.tokens_per_minute),
        ("concurrent_requests", p.concurrent_requests),
        ("max_context", p.max_context),
        ("max_tokens", p.max_tokens),
    ] {
        if l == Limit::At(0) {
            return Err(err(
                None,
                key,
                format!(
                    "{key} = 0 would refuse every request; remove the tenant's key, or set allowed_models = [] to lock it out"
                ),
            ));
        }
    }
    if p.weight == 0 || p.weight > 1000 {
        return Err(err(None, "weight", format!("weight = {}: must be 1 to 1000", p.weight)));
    }
    if let (Some(day), Some(month)) = (p.tokens_per_day.get(), p.tokens_per_month.get())
        && day > month
    {
        return Err(err(
            None,
            "tokens_per_day",
            format!("tokens_per_day = {day} is more than tokens_per_month = {month}"),
        ));
    }
    if let Some(max) = p.kv_max_pages.get() {
        if max == 0 || max > bounds.kv_pages {
            return Err(err(
                Some("kv"),
                "max_pages",
                format!(
                    "kv.max_pages = {max}: must be 1 to the pool's {} pages",
                    bounds.kv_pages
                ),
            ));
        }
        if p.kv_min_pages > max {
            return Err(err(
                Some("kv"),
                "min_pages",
                format!("kv.min_pages = {} is more than kv.max_pages = {max}", p.kv_min_pages),
            ));
        }
    }
    if is_default && p.kv_min_pages > 0 {
        return Err(err(
            Some("kv"),
            "min_pages",
            "kv.min_pages guarantees pages to one tenant; set it in tenants/<tenant>.toml, not for every tenant".into(),
        ));
    }
    if p.kv_max_pinned_pages > bounds.kv_pages {
        return Err(err(
            Some("kv"),
            "max_pinned_pages",
            format!(
                "kv.max_pinned_pages = {}: more than the pool's {} pages",
                p.kv_max_pinned_pages, bounds.kv_pages
            ),
        ));
    }
    for (key, v, max) in [
        ("fuel_per_call", p.plugin_fuel_per_call, u64::MAX),
        ("memory_mib", p.plugin_memory_mib, 4096),
        ("call_timeout_ms", p.plugin_call_timeout_ms, 600_000),
        ("request_time_ms", p.plugin_request_time_ms, 3_600_000),
        ("instances", p.plugin_instances, 1_000_000),
        ("uploads_per_minute", p.plugin_uploads_per_minute, 1_000_000),
        ("compile_seconds_per_minute", p.plugin_compile_seconds_per_minute, 3600),
        ("max_component_mib", p.plugin_max_component_mib, 1024),
    ] {
        if let Some(v) = v
            && (v == 0 || v > max)
        {
            return Err(err(
                Some("plugins"),
                key,
                format!("plugins.{key} = {v}: must be 1 to {max}"),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUNDS: Bounds = Bounds {
        kv_pages: 1000,
        page_size: 16,
        pin_pages: 40,
    };

    /// Loads `d` with a tokenizer that makes every byte a token.
    fn load(d: &Path) -> Result<PolicySet, PolicyError> {
        PolicySet::load(d, BOUNDS, &|t: &str| vec![t.bytes().map(u32::from).collect()])
    }

    fn dir(tag: &str, files: &[(&str, &str)]) -> PathBuf {
        let d = std::env::temp_dir().join(format!("warden-policy-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(d.join("tenants")).unwrap();
        for (name, text) in files {
            std::fs::write(d.join(name), text).unwrap();
        }
        d
    }

    #[test]
    fn tenant_files_override_the_default_key_by_key() {
        let d = dir(
            "overlay",
            &[
                (
                    "default.toml",
                    "requests_per_minute = 60\ntokens_per_day = 1000\n[kv]\nmax_pages = 100\n",
                ),
                (
                    "tenants/acme.toml",
                    "requests_per_minute = \"unlimited\"\n[kv]\nmin_pages = 10\nprefix_cache = \"off\"\n",
                ),
            ],
        );
        let s = load(&d).unwrap();
        let acme = s.of("acme");
        assert_eq!(acme.requests_per_minute, Limit::Unlimited);
        assert_eq!(acme.tokens_per_day, Limit::At(1000), "inherited");
        assert_eq!((acme.kv_max_pages, acme.kv_min_pages), (Limit::At(100), 10));
        assert_eq!(acme.prefix_cache, PrefixSharing::Off);
        let other = s.of("other");
        assert_eq!(other.requests_per_minute, Limit::At(60));
        assert_eq!(other.prefix_cache, PrefixSharing::Private, "private by default");
        assert_eq!(s.version.len(), 12);
    }

    #[test]
    fn bad_files_name_file_line_and_key() {
        let cases: [(&str, &str, &str); 10] = [
            // Every TOML form of a table names the line its key is on.
            (
                "tenants/a.toml",
                "weight = 2\nkv = { max_pages = 5,\n  min_pages = 6 }\n",
                ":3: kv.min_pages = 6 is more than kv.max_pages = 5",
            ),
            (
                "tenants/a.toml",
                "weight = 2\n\nkv.max_pages = 5000\n",
                ":3: kv.max_pages = 5000: must be 1 to the pool's 1000 pages",
            ),
            (
                "tenants/a.toml",
                "plugins = {\n memory_mib = 0 }\n",
                ":2: plugins.memory_mib = 0: must be 1 to 4096",
            ),
            (
                "tenants/a.toml",
                "weight = 2\ntokens_per_minut = 5\n",
                ":2: unknown field `tokens_per_minut`",
            ),
            (
                "tenants/a.toml",
                "\n\nrequests_per_minute = \"lots\"\n",
                ":3: \"lots\" is not a limit",
            ),
            ("tenants/a.toml", "concurrent_requests = -1\n", ":1: -1 is negative"),
            (
                "tenants/a.toml",
                "[kv]\nmax_pages = 5\nmin_pages = 6\n",
                ":3: kv.min_pages = 6 is more than kv.max_pages = 5",
            ),
            (
                "tenants/a.toml",
                "[kv]\nmax_pages = 5000\n",
                ":2: kv.max_pages = 5000: must be 1 to the pool's 1000 pages",
            ),
            (
                "default.toml",
                "tokens_per_day = 10\ntokens_per_month = 5\n",
                ":1: tokens_per_day = 10 is more than",
            ),
            (
                "tenants/a.toml",
                "[plugins]\nmemory_mib = 0\n",
                ":2: plugins.memory_mib = 0: must be 1 to 4096",
            ),
        ];
        for (i, (name, text, want)) in cases.iter().enumerate() {
            let d = dir(&format!("bad{i}"), &[(name, text)]);
            let e = load(&d).unwrap_err().to_string();
            assert!(e.contains(name) && e.contains(want), "case {i}: {e}");
        }
    }

    #[test]
    fn floors_cannot_promise_more_than_the_pool() {
        let d = dir(
            "floors",
            &[
                ("tenants/a.toml", "[kv]\nmin_pages = 600\n"),
                ("tenants/b.toml", "[kv]\nmin_pages = 600\n"),
            ],
        );
        let e = load(&d).unwrap_err().to_string();
        assert!(e.contains("add up to 1200") && e.contains("tenants/b.toml:2"), "{e}");
        let d = dir("floordefault", &[("default.toml", "[kv]\nmin_pages = 1\n")]);
        assert!(load(&d).unwrap_err().to_string().contains("tenants/<tenant>.toml"));
    }

    #[test]
    fn public_prefixes_are_the_operators_tokenized_and_bounded() {
        let long = "x".repeat(16 * 30);
        let d = dir(
            "public",
            &[
                (
                    "default.toml",
                    &format!(
                        "[public_prefixes]\nsupport = \"{long}\"\nfaq = \"{}\"\n",
                        "y".repeat(40)
                    ),
                ),
                ("tenants/a.toml", "[kv]\nprefix_cache = \"public\"\n"),
            ],
        );
        let s = load(&d).unwrap();
        // In name order, tokenized (a byte a token here).
        let p = s.public_prefixes(0);
        assert_eq!((p.len(), p[0].len(), p[1].len()), (2, 40, 480));
        let a = s.of("a").tenant_settings();
        assert!(a.prefix_cache && a.public_prefixes);
        let other = s.of("other").tenant_settings();
        assert!(other.prefix_cache && !other.public_prefixes, "private by default");
        let cases: [(&str, &str, &str); 4] = [
            (
                "default.toml",
                "[public_prefixes]\nshort = \"hello\"\n",
                ":2: public_prefixes.short: 5 tokens, less than one KV page",
            ),
            (
                "default.toml",
                &format!("[public_prefixes]\na = \"{long}\"\nb = \"{long}\"\n"),
                ":3: public_prefixes.b: the public prefixes need 60 KV pages kept cached, more than the 40",
            ),
            (
                "default.toml",
                "[public_prefixes]\n\"no spaces\" = \"0123456789abcdefg\"\n",
                "public_prefixes.no spaces: a name is 1 to 64 letters",
            ),
            (
                "tenants/a.toml",
                "[public_prefixes]\nmine = \"0123456789abcdefg\"\n",
                ":1: public_prefixes are shared by every tenant allowed them; set them in default.toml",
            ),
        ];
        for (i, (name, text, want)) in cases.iter().enumerate() {
            let d = dir(&format!("publicbad{i}"), &[(name, text)]);
            let e = load(&d).unwrap_err().to_string();
            assert!(e.contains(name) && e.contains(want), "case {i}: {e}");
        }
    }

    #[test]
    fn the_shipped_default_is_the_built_in_default() {
        let d = Path::new(env!("CARGO_MANIFEST_DIR")).join("../policies");
        let s = load(&d).unwrap();
        assert_eq!(s.of("anyone"), &Policy::default());
    }

    #[test]
    fn an_empty_default_means_the_built_in_defaults_and_no_policy_at_all_is_refused() {
        let d = dir("empty-default", &[("default.toml", "")]);
        let s = load(&d).unwrap();
        assert_eq!(s.of("anyone"), &Policy::default());
        assert!(s.of("anyone").allows_model("m") && s.of("anyone").allows_plugin("p"));
        // A directory with nothing in it, or none at all: refused, naming it.
        let empty = dir("empty", &[]);
        let e = load(&empty).unwrap_err();
        assert!(e.file == empty && e.message.contains("holds no policy"), "{e:?}");
        let missing = empty.join("not-there");
        let e = load(&missing).unwrap_err();
        assert!(e.file == missing && e.message.contains("no such directory"), "{e:?}");
    }
}
