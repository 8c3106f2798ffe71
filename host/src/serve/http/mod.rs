//! The HTTP service: the routing table here; the endpoints by group in `generate` (the OpenAI
//! generation endpoints), `plugin_api` (a tenant's plugins) and `admin_api` (tenants, keys,
//! usage); beneath them `auth` (keys and the admin token), `body` (bodies within their
//! limits) and `reply` (responses, and every failure as [`ApiError`]'s JSON).

mod admin_api;
mod auth;
mod body;
mod generate;
mod plugin_api;
mod reply;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{Value, json};

use self::auth::{admin, tenant};
use self::body::read_body;
pub use self::reply::Body;
use self::reply::{error_response, full, json_response, method_not_allowed, model_not_found};
use super::error::ApiError;
use super::state::State;
use super::store::Tenant;

/// Handles one request.
pub async fn handle(state: Arc<State>, req: Request<Incoming>) -> Result<Response<Body>, std::convert::Infallible> {
    let r = match route(&state, req).await {
        Ok(r) => r,
        Err(e) => {
            state.metrics.http_error(e.code);
            error_response(&e)
        }
    };
    Ok(r)
}

async fn route(state: &Arc<State>, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let header_bytes: usize = req.headers().iter().map(|(k, v)| k.as_str().len() + v.len() + 4).sum();
    if header_bytes > state.cfg.limits.header_bytes {
        return Err(ApiError::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "headers_too_large",
            format!(
                "the request's headers are {header_bytes} bytes, more than the limit of {}",
                state.cfg.limits.header_bytes
            ),
        ));
    }
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    let segments: Vec<&str> = path.trim_end_matches('/').split('/').skip(1).collect();
    let allow = |methods: &[Method]| -> Result<(), ApiError> {
        if methods.contains(&method) {
            Ok(())
        } else {
            Err(method_not_allowed(&method, &path))
        }
    };
    match segments.as_slice() {
        ["healthz"] => {
            allow(&[Method::GET])?;
            Ok(full(StatusCode::OK, "text/plain", "ok\n"))
        }
        ["readyz"] => {
            allow(&[Method::GET])?;
            if state.engine.is_alive() && !state.shutting_down.load(Ordering::SeqCst) {
                Ok(full(StatusCode::OK, "text/plain", "ready\n"))
            } else {
                Err(ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "not_ready",
                    "the server is not ready",
                ))
            }
        }
        ["metrics"] => {
            allow(&[Method::GET])?;
            admin(state, &req)?;
            Ok(full(
                StatusCode::OK,
                "text/plain; version=0.0.4",
                state.metrics.render(),
            ))
        }
        ["v1", "models"] => {
            allow(&[Method::GET])?;
            tenant(state, &req)?;
            Ok(json_response(
                StatusCode::OK,
                &json!({"object": "list", "data": [model_card(state)]}),
            ))
        }
        ["v1", "models", id] => {
            allow(&[Method::GET])?;
            tenant(state, &req)?;
            if *id != state.model_id {
                return Err(model_not_found(id));
            }
            Ok(json_response(StatusCode::OK, &model_card(state)))
        }
        ["v1", "chat", "completions"] => {
            allow(&[Method::POST])?;
            let t = tenant(state, &req)?;
            let body = read_body(state, req).await?;
            counted(state, &t, generate::chat(state, t.clone(), &body).await)
        }
        ["v1", "completions"] => {
            allow(&[Method::POST])?;
            let t = tenant(state, &req)?;
            let body = read_body(state, req).await?;
            counted(state, &t, generate::completions(state, t.clone(), &body).await)
        }
        ["v1", "usage"] => {
            allow(&[Method::GET])?;
            let t = tenant(state, &req)?;
            Ok(json_response(
                StatusCode::OK,
                &json!(state.quotas.usage.of(t.id, &t.name)),
            ))
        }
        ["v1", "plugins", rest @ ..] => {
            let t = tenant(state, &req)?;
            plugin_api::route(state, &t, req, &method, rest).await
        }
        ["admin", "v1", rest @ ..] => admin_api::route(state, req, &method, rest).await,
        _ => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no route for {method} {path}"),
        )),
    }
}

/// Counts a refused request in its tenant's usage, by error code.
fn counted(state: &State, t: &Tenant, r: Result<Response<Body>, ApiError>) -> Result<Response<Body>, ApiError> {
    if let Err(e) = &r {
        state.quotas.usage.reject(t.id, &t.name, e.code);
        if e.status == StatusCode::TOO_MANY_REQUESTS || e.status == StatusCode::FORBIDDEN {
            state.metrics.rejected(&t.name, e.code);
        }
    }
    r
}

fn model_card(state: &State) -> Value {
    json!({"id": state.model_id, "object": "model", "created": state.started, "owned_by": "warden"})
}
