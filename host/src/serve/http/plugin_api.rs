//! `/v1/plugins/...`: a tenant's plugins (upload, versions, activation, config, default, logs),
//! also reached by the admin API for any tenant.

use std::sync::Arc;

use hyper::{Method, Response, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::body::{Req, read_body, read_body_up_to};
use super::reply::{Body, json_response, method_not_allowed, serialized};
use crate::serve::error::ApiError;
use crate::serve::openai::parse_body;
use crate::serve::state::State;
use crate::serve::store::Tenant;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Activate {
    version: String,
}

/// Whether the query string says `activate=false`.
fn no_activate(req: &Req) -> bool {
    req.uri()
        .query()
        .is_some_and(|q| q.split('&').any(|kv| kv == "activate=false" || kv == "activate=0"))
}

/// `/v1/plugins/...` for tenant `t` (also reached by the admin API as
/// `/admin/v1/tenants/{t}/plugins/...`).
pub(super) async fn route(
    state: &Arc<State>,
    t: &Tenant,
    req: Req,
    method: &Method,
    rest: &[&str],
) -> Result<Response<Body>, ApiError> {
    let p = &state.plugins;
    let path = req.uri().path().to_string();
    let not_allowed = || method_not_allowed(method, &path);
    fn ok<T: Serialize, E: Into<ApiError>>(r: Result<T, E>) -> Result<Response<Body>, ApiError> {
        Ok(serialized(StatusCode::OK, &r.map_err(Into::into)?))
    }
    match (rest, method) {
        ([], &Method::GET) => ok(p.list(t)),
        ([], _) => Err(not_allowed()),
        ([name], &Method::GET) => ok(p.get(t, name)),
        ([name], &Method::PUT) => {
            let activate = !no_activate(&req);
            let name = name.to_string();
            // The tenant's policy may allow less than the server; checked before reading.
            let policy = state.quotas.set().of(&t.name).clone();
            let max = match policy.plugin_max_component_mib {
                Some(mib) => p.max_component_bytes().min((mib as usize) << 20),
                None => p.max_component_bytes(),
            };
            let bytes = read_body_up_to(state, req, max, "component_too_large").await?;
            let v = p.upload(t, &policy, &name, bytes.to_vec(), activate).await?;
            let status = if v.new { StatusCode::CREATED } else { StatusCode::OK };
            Ok(serialized(status, &v))
        }
        ([name], &Method::DELETE) => ok(p.delete(t, name)),
        ([name, "logs"], &Method::GET) => {
            p.get(t, name)?;
            Ok(json_response(
                StatusCode::OK,
                &json!({"data": p.logs().tail(t.id, name, 200)}),
            ))
        }
        ([_], _) => Err(not_allowed()),
        ([name, "activate"], &Method::POST) => {
            let name = name.to_string();
            let body = read_body(state, req).await?;
            let a: Activate = parse_body(&body, 4, &["version"])?;
            ok(p.activate(t, &name, &a.version))
        }
        ([name, "rollback"], &Method::POST) => ok(p.rollback(t, name)),
        ([name, "config"], &Method::PUT) => {
            let name = name.to_string();
            let body = read_body_up_to(state, req, p.max_config_bytes(), "config_too_large").await?;
            let policy = state.quotas.set().of(&t.name).clone();
            ok(p.set_config(t, &policy, &name, &body).await)
        }
        ([name, "default"], &Method::PUT) => ok(p.set_default(t, name)),
        ([name, "default"], &Method::DELETE) => ok(p.clear_default(t, name)),
        ([name, "versions", v], &Method::DELETE) => ok(p.delete_version(t, name, v)),
        ([_, "activate" | "rollback" | "config" | "default" | "logs"], _) | ([_, "versions", _], _) => {
            Err(not_allowed())
        }
        _ => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no plugin route {path}"),
        )),
    }
}
