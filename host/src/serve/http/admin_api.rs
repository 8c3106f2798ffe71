//! `/admin/v1/...`: tenants, keys, usage and the policy version, for the admin token only.

use std::sync::Arc;

use hyper::{Method, Response, StatusCode};
use serde::Deserialize;
use serde_json::{Value, json};

use super::auth::admin;
use super::body::{Req, read_body};
use super::plugin_api;
use super::reply::{Body, json_response, method_not_allowed};
use crate::serve::error::ApiError;
use crate::serve::openai::parse_body;
use crate::serve::state::State;
use crate::serve::store::StoreError;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NewTenant {
    name: String,
}

pub(super) async fn route(
    state: &Arc<State>,
    req: Req,
    method: &Method,
    rest: &[&str],
) -> Result<Response<Body>, ApiError> {
    admin(state, &req)?;
    let path = req.uri().path().to_string();
    let not_allowed = || method_not_allowed(method, &path);
    let ok = |v: Value| Ok(json_response(StatusCode::OK, &v));
    match (rest, method) {
        (["usage"], &Method::GET) => ok(json!({"data": state.quotas.usage.all()})),
        (["usage"], _) => Err(not_allowed()),
        (["policies"], &Method::GET) => ok(json!({"version": state.quotas.set().version})),
        (["policies"], _) => Err(not_allowed()),
        (["tenants"], &Method::GET) => ok(json!({"data": state.store.tenants()?})),
        (["tenants"], &Method::POST) => {
            let body = read_body(state, req).await?;
            let n: NewTenant = parse_body(&body, 4, &["name"])?;
            let t = state.store.create_tenant(&n.name)?;
            Ok(json_response(StatusCode::CREATED, &json!(t)))
        }
        (["tenants"], _) => Err(not_allowed()),
        (["tenants", name], &Method::DELETE) => {
            let id = state.store.delete_tenant(name)?;
            state.quotas.usage.forget(id)?;
            state.plugins.forget_tenant(id);
            // Its prefix cache goes too (its ids are never reused, so this frees memory; it is
            // not what keeps tenants apart).
            for e in state.engines() {
                e.forget_tenant(id).await;
            }
            for m in &state.models {
                m.grammars.forget(id);
            }
            ok(json!({"deleted": name}))
        }
        (["tenants", _], _) => Err(not_allowed()),
        (["tenants", name, "keys"], &Method::POST) => {
            let (info, key) = state.store.create_key(name)?;
            Ok(json_response(StatusCode::CREATED, &json!({"key": key, "info": info})))
        }
        (["tenants", name, "keys"], &Method::GET) => ok(json!({"data": state.store.keys(Some(name))?})),
        (["tenants", _, "keys"], _) => Err(not_allowed()),
        (["tenants", name, "plugins", rest @ ..], _) => {
            let t = state
                .store
                .tenant(name)?
                .ok_or_else(|| ApiError::from(StoreError::NoTenant(name.to_string())))?;
            plugin_api::route(state, &t, req, method, rest).await
        }
        (["keys"], &Method::GET) => ok(json!({"data": state.store.keys(None)?})),
        (["keys"], _) => Err(not_allowed()),
        (["keys", id], &Method::DELETE) => ok(json!(state.store.revoke_key(id)?)),
        (["keys", _], _) => Err(not_allowed()),
        _ => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no admin route {path}"),
        )),
    }
}
