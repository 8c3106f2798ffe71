//! Tenant and key management from the command line (`warden tenant ...`, `warden key ...`).
//!
//! sled admits one process at a time: when no server holds the store, the commands open it
//! directly; while `warden serve` runs, they go through its admin API, found through
//! `data_dir/server.json` and authenticated with `data_dir/admin-token`.

use std::path::{Path, PathBuf};

use hyper::Method;
use serde::Serialize;
use serde_json::{Value, json};

use super::client::{Client, ClientError};
use super::error::ApiError;
use super::plugins::SetupError;
use super::plugins::registry::PluginError;
use super::store::{Store, StoreError};
use super::{ServerInfo, admin_token_path, server_info_path};
use crate::gguf::GgufError;
use crate::tokenizer::TokenizerError;

/// Why a management command failed.
#[derive(Debug, thiserror::Error)]
pub enum ManageError {
    /// The store refused.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The plugin registry refused: its message and code, as the API would say them.
    #[error("{message} ({code})")]
    Plugin {
        /// The API's error code.
        code: &'static str,
        /// What was wrong.
        message: String,
    },
    /// The running server refused: its message.
    #[error("{0}")]
    Server(String),
    /// A server holds the store but left no `server.json` to reach it by.
    #[error("the store is in use, but {} is missing", .0.display())]
    NoServer(PathBuf, #[source] std::io::Error),
    /// A file could not be read.
    #[error("reading {}", .0.display())]
    Read(PathBuf, #[source] std::io::Error),
    /// `server.json` is not what a server writes.
    #[error("reading {}", .0.display())]
    ServerInfo(PathBuf, #[source] serde_json::Error),
    /// The model file (whose tokenizer plugins import) could not be read.
    #[error("reading {}", .0.display())]
    Model(PathBuf, #[source] GgufError),
    /// The model's tokenizer could not be built.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// The plugin service could not start.
    #[error(transparent)]
    Setup(#[from] SetupError),
    /// The call to the running server failed.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// No runtime for the call.
    #[error("starting a runtime")]
    Runtime(#[source] std::io::Error),
    /// The answer could not be written as JSON.
    #[error("writing the answer as JSON")]
    Json(#[from] serde_json::Error),
}

impl From<PluginError> for ManageError {
    fn from(e: PluginError) -> Self {
        let a = ApiError::from(e);
        ManageError::Plugin {
            code: a.code,
            message: a.message,
        }
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, ManageError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(ManageError::Runtime)
}

/// One management operation.
#[derive(Debug, Clone)]
pub enum Op {
    /// Create a tenant.
    TenantCreate(String),
    /// List tenants (as JSON with `true`).
    TenantList(bool),
    /// Delete a tenant and its keys.
    TenantDelete(String),
    /// Create a key for a tenant (printed once).
    KeyCreate(String),
    /// Revoke a key by id.
    KeyRevoke(String),
    /// List keys, of one tenant or all (as JSON with `true`).
    KeyList(Option<String>, bool),
}

/// The store a server made in `data_dir`: never a new one (a command run from the wrong
/// directory would make an empty store and say that the tenant it names does not exist).
fn open_existing(data_dir: &Path) -> Result<Store, StoreError> {
    if !data_dir.join("state").exists() {
        return Err(StoreError::NoStore(data_dir.to_path_buf()));
    }
    Store::open(data_dir)
}

/// Runs `op` against the store in `data_dir`; returns what to print.
pub fn run(data_dir: &Path, op: Op) -> Result<String, ManageError> {
    match open_existing(data_dir) {
        Ok(store) => direct(&store, op),
        Err(StoreError::Locked(_)) => via_server(data_dir, op),
        Err(e) => Err(e.into()),
    }
}

fn direct(s: &Store, op: Op) -> Result<String, ManageError> {
    Ok(match op {
        Op::TenantCreate(n) => {
            let t = s.create_tenant(&n)?;
            format!("created tenant {:?} (id {})", t.name, t.id)
        }
        Op::TenantList(json) => tenant_lines(&serde_json::to_value(s.tenants()?)?, json)?,
        Op::TenantDelete(n) => {
            s.delete_tenant(&n)?;
            format!("deleted tenant {n:?} and its keys")
        }
        Op::KeyCreate(t) => {
            let (info, key) = s.create_key(&t)?;
            key_created(&t, &info.id, &key)
        }
        Op::KeyRevoke(id) => {
            let info = s.revoke_key(&id)?;
            format!("revoked key {} of tenant {:?}", info.id, info.tenant)
        }
        Op::KeyList(t, json) => key_lines(&serde_json::to_value(s.keys(t.as_deref())?)?, json)?,
    })
}

fn key_created(tenant: &str, id: &str, key: &str) -> String {
    format!("created key {id} for tenant {tenant:?}; the key (shown only now):\n{key}")
}

/// A record's `created` (seconds since the epoch) as RFC 3339.
fn created(v: &Value) -> String {
    v["created"].as_u64().map_or_else(|| "?".into(), crate::log::rfc3339)
}

fn tenant_lines(v: &Value, json: bool) -> Result<String, ManageError> {
    if json {
        return Ok(serde_json::to_string_pretty(v)?);
    }
    let mut out = String::new();
    for t in v.as_array().into_iter().flatten() {
        out.push_str(&format!(
            "{}\tid {}\tcreated {}\n",
            t["name"].as_str().unwrap_or("?"),
            t["id"],
            created(t)
        ));
    }
    Ok(out.trim_end().to_string())
}

fn key_lines(v: &Value, json: bool) -> Result<String, ManageError> {
    if json {
        return Ok(serde_json::to_string_pretty(v)?);
    }
    let mut out = String::new();
    for k in v.as_array().into_iter().flatten() {
        out.push_str(&format!(
            "{}\ttenant {}\tcreated {}{}\n",
            k["id"].as_str().unwrap_or("?"),
            k["tenant"].as_str().unwrap_or("?"),
            created(k),
            if k["revoked"].as_bool() == Some(true) {
                "\trevoked"
            } else {
                ""
            }
        ));
    }
    Ok(out.trim_end().to_string())
}

/// One call to a running server's admin API; the reply's JSON, or its error message.
fn admin_call(data_dir: &Path, method: Method, path: &str, body: Option<Vec<u8>>) -> Result<Value, ManageError> {
    let info_path = server_info_path(data_dir);
    let bytes = std::fs::read(&info_path).map_err(|e| ManageError::NoServer(info_path.clone(), e))?;
    let info: ServerInfo = serde_json::from_slice(&bytes).map_err(|e| ManageError::ServerInfo(info_path, e))?;
    let token_path = admin_token_path(data_dir);
    let token = std::fs::read_to_string(&token_path).map_err(|e| ManageError::Read(token_path, e))?;
    let client = match &info.cert {
        Some(cert) => Client::pinned(&info.url, cert)?,
        None => Client::new(&info.url, None)?,
    };
    let reply = runtime()?.block_on(client.request(method, path, Some(token.trim()), body))?;
    let v = reply.json()?;
    if reply.status >= 400 {
        let text = reply.text();
        return Err(ManageError::Server(
            v["error"]["message"].as_str().unwrap_or(&text).to_string(),
        ));
    }
    Ok(v)
}

fn via_server(data_dir: &Path, op: Op) -> Result<String, ManageError> {
    let (method, path, body) = match &op {
        Op::TenantCreate(n) => (Method::POST, "/admin/v1/tenants".to_string(), Some(json!({"name": n}))),
        Op::TenantList(_) => (Method::GET, "/admin/v1/tenants".into(), None),
        Op::TenantDelete(n) => (Method::DELETE, format!("/admin/v1/tenants/{n}"), None),
        Op::KeyCreate(t) => (Method::POST, format!("/admin/v1/tenants/{t}/keys"), None),
        Op::KeyRevoke(id) => (Method::DELETE, format!("/admin/v1/keys/{id}"), None),
        Op::KeyList(Some(t), _) => (Method::GET, format!("/admin/v1/tenants/{t}/keys"), None),
        Op::KeyList(None, _) => (Method::GET, "/admin/v1/keys".into(), None),
    };
    let v = admin_call(data_dir, method, &path, body.map(|b| b.to_string().into_bytes()))?;
    Ok(match op {
        Op::TenantCreate(_) => format!(
            "created tenant {:?} (id {})",
            v["name"].as_str().unwrap_or("?"),
            v["id"]
        ),
        Op::TenantList(json) => tenant_lines(&v["data"], json)?,
        Op::TenantDelete(n) => format!("deleted tenant {n:?} and its keys"),
        Op::KeyCreate(t) => key_created(
            &t,
            v["info"]["id"].as_str().unwrap_or("?"),
            v["key"].as_str().unwrap_or("?"),
        ),
        Op::KeyRevoke(_) => format!(
            "revoked key {} of tenant {:?}",
            v["id"].as_str().unwrap_or("?"),
            v["tenant"].as_str().unwrap_or("?")
        ),
        Op::KeyList(_, json) => key_lines(&v["data"], json)?,
    })
}

/// A plugin operation, for one tenant (`warden plugin ...`).
#[derive(Debug, Clone)]
pub enum PluginOp {
    /// Upload a component as a new version (active unless `activate` is false).
    Upload {
        /// Plugin name.
        name: String,
        /// The component file.
        file: std::path::PathBuf,
        /// Make it the active version.
        activate: bool,
    },
    /// List the tenant's plugins.
    List,
    /// Show one plugin.
    Show(String),
    /// Activate a version.
    Activate {
        /// Plugin name.
        name: String,
        /// SHA-256 (or an unambiguous prefix of at least 8 digits).
        version: String,
    },
    /// Return to the previously active version.
    Rollback(String),
    /// Delete a plugin and all its versions.
    Delete(String),
    /// Delete one inactive version.
    DeleteVersion {
        /// Plugin name.
        name: String,
        /// The version.
        version: String,
    },
    /// Set the plugin's configuration from a file.
    Config {
        /// Plugin name.
        name: String,
        /// The file whose text becomes the configuration.
        file: std::path::PathBuf,
    },
    /// Make the plugin the tenant's default.
    Default(String),
    /// Stop the plugin being the tenant's default.
    ClearDefault(String),
}

/// The last lines (at most 200) plugin `name` of `tenant` wrote to its tenant's log, from the
/// store in `data_dir`, or through the running server that holds it.
pub fn plugin_logs(data_dir: &Path, tenant: &str, name: &str) -> Result<Vec<String>, ManageError> {
    match open_existing(data_dir) {
        Ok(store) => {
            let t = store
                .tenant(tenant)?
                .ok_or_else(|| StoreError::NoTenant(tenant.into()))?;
            let logs = super::plugins::logs::TenantLogs::new(&data_dir.join("plugin-logs"));
            Ok(logs.tail(t.id, name, 200))
        }
        Err(StoreError::Locked(_)) => {
            let v = admin_call(
                data_dir,
                Method::GET,
                &format!("/admin/v1/tenants/{tenant}/plugins/{name}/logs"),
                None,
            )?;
            Ok(v["data"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|l| l.as_str().map(str::to_string))
                .collect())
        }
        Err(e) => Err(e.into()),
    }
}

/// `plugin list`'s lines: each plugin's name, active version, versions and whether it is the
/// default.
pub fn plugin_lines(v: &Value) -> String {
    let mut out = String::new();
    for p in v["data"].as_array().into_iter().flatten() {
        let versions = p["versions"].as_array().map_or(0, Vec::len);
        let active = p["active"].as_str().map_or("none", |a| a.get(..12).unwrap_or(a));
        let uploaded = p["versions"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|v| v["active"].as_bool() == Some(true))
            .and_then(|v| v["uploaded"].as_u64())
            .map_or_else(|| "-".into(), crate::log::rfc3339);
        out.push_str(&format!(
            "{}\tactive {active} (uploaded {uploaded})\t{versions} version{}{}\n",
            p["name"].as_str().unwrap_or("?"),
            if versions == 1 { "" } else { "s" },
            if p["default"].as_bool() == Some(true) {
                "\tdefault"
            } else {
                ""
            }
        ));
    }
    out.trim_end().to_string()
}

/// Runs a plugin operation for `tenant` against the store of `cfg`; returns the resulting JSON.
pub fn plugin(
    cfg: &crate::config::ServeConfig,
    data_dir: &Path,
    tenant: &str,
    op: PluginOp,
) -> Result<Value, ManageError> {
    let read = |f: &Path| std::fs::read(f).map_err(|e| ManageError::Read(f.to_path_buf(), e));
    fn answer<T: Serialize>(r: Result<T, PluginError>) -> Result<Value, ManageError> {
        Ok(serde_json::to_value(r?)?)
    }
    let v = match open_existing(data_dir) {
        Ok(store) => {
            let t = store
                .tenant(tenant)?
                .ok_or_else(|| StoreError::NoTenant(tenant.into()))?;
            // The smoke call of an upload runs against the first model's tokenizer, as the
            // server's does.
            let first = cfg.served().remove(0).path;
            let g = crate::gguf::Gguf::open(&first).map_err(|e| ManageError::Model(first.clone(), e))?;
            let tokenizer = std::sync::Arc::new(crate::tokenizer::Tokenizer::from_gguf(&g)?);
            let compiler = super::plugins::compiler()?;
            let p = super::plugins::Plugins::new(store.clone(), cfg.plugins.clone(), data_dir, tokenizer, &compiler)?;
            let r = match op {
                PluginOp::Upload { name, file, activate } => {
                    let bytes = read(&file)?;
                    // The operator's own upload: the default policy's rate, in a fresh process.
                    answer(runtime()?.block_on(p.upload(&t, &crate::policy::Policy::default(), &name, bytes, activate)))
                }
                PluginOp::List => answer(p.list(&t)),
                PluginOp::Show(n) => answer(p.get(&t, &n)),
                PluginOp::Activate { name, version } => answer(p.activate(&t, &name, &version)),
                PluginOp::Rollback(n) => answer(p.rollback(&t, &n)),
                PluginOp::Delete(n) => answer(p.delete(&t, &n)),
                PluginOp::DeleteVersion { name, version } => answer(p.delete_version(&t, &name, &version)),
                PluginOp::Config { name, file } => answer(runtime()?.block_on(p.set_config(
                    &t,
                    &crate::policy::Policy::default(),
                    &name,
                    &read(&file)?,
                ))),
                PluginOp::Default(n) => answer(p.set_default(&t, &n)),
                PluginOp::ClearDefault(n) => answer(p.clear_default(&t, &n)),
            };
            store.flush()?;
            r?
        }
        Err(StoreError::Locked(_)) => {
            let base = format!("/admin/v1/tenants/{tenant}/plugins");
            let (method, path, body) = match op {
                PluginOp::Upload { name, file, activate } => (
                    Method::PUT,
                    format!("{base}/{name}{}", if activate { "" } else { "?activate=false" }),
                    Some(read(&file)?),
                ),
                PluginOp::List => (Method::GET, base, None),
                PluginOp::Show(n) => (Method::GET, format!("{base}/{n}"), None),
                PluginOp::Activate { name, version } => (
                    Method::POST,
                    format!("{base}/{name}/activate"),
                    Some(json!({ "version": version }).to_string().into_bytes()),
                ),
                PluginOp::Rollback(n) => (Method::POST, format!("{base}/{n}/rollback"), None),
                PluginOp::Delete(n) => (Method::DELETE, format!("{base}/{n}"), None),
                PluginOp::DeleteVersion { name, version } => {
                    (Method::DELETE, format!("{base}/{name}/versions/{version}"), None)
                }
                PluginOp::Config { name, file } => (Method::PUT, format!("{base}/{name}/config"), Some(read(&file)?)),
                PluginOp::Default(n) => (Method::PUT, format!("{base}/{n}/default"), None),
                PluginOp::ClearDefault(n) => (Method::DELETE, format!("{base}/{n}/default"), None),
            };
            admin_call(data_dir, method, &path, body)?
        }
        Err(e) => return Err(e.into()),
    };
    Ok(v)
}
