//! The HTTP service: the routing table here; the endpoints by group in `generate` (the OpenAI
//! generation endpoints), `tokens` (`/tokenize`, `/detokenize`), `plugin_api` (a tenant's
//! plugins) and `admin_api` (tenants, keys, usage); beneath them `auth` (keys and the admin
//! token), `body` (bodies within their limits), `cors` (browser clients) and `reply`
//! (responses, and every failure as [`ApiError`]'s JSON).

mod admin_api;
mod auth;
mod body;
mod cors;
mod generate;
mod plugin_api;
mod reply;
mod tokens;

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use hyper::body::Incoming;
use hyper::header::HeaderValue;
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{Value, json};

use self::auth::{metrics_reader, tenant};
use self::body::{Req, hold, read_body};
pub use self::reply::Body;
use self::reply::{error_response, full, json_response, method_not_allowed, model_not_found};
use super::access::{Access, request_id};
use super::error::ApiError;
use super::quota::Rates;
use super::state::{Served, State};

/// Handles one request: its id (the client's `x-request-id`, or a new one) in every response,
/// its access line when it ends (see [`Access`]), and what its route left of its body read
/// until the response is sent (see [`body`]).
pub async fn handle(
    state: Arc<State>,
    peer: IpAddr,
    req: Request<Incoming>,
) -> Result<Response<Body>, std::convert::Infallible> {
    let headers = req.headers();
    let id = request_id(headers.get("x-request-id").map(|v| v.as_bytes()));
    let forwarded: Vec<&str> = headers
        .get_all("x-forwarded-for")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect();
    let client = crate::net::client_addr(peer, &forwarded, &state.cfg.http.trusted_proxies);
    let user_agent = headers.get(hyper::header::USER_AGENT).map(|v| v.as_bytes());
    let access = Access::new(id, req.method().as_str(), req.uri().path(), client, user_agent);
    let origin = cors::allowed(&state.cfg.http, headers);
    let preflight = cors::preflight(&state.cfg.http, req.method(), headers);
    let (req, unread) = hold(req);
    let answer = match preflight {
        Some(answer) => answer,
        None => route(&state, req, &access).await,
    };
    let r = match answer {
        Ok(r) => {
            access.status(r.status().as_u16(), None);
            r
        }
        Err(e) => {
            state.metrics.http_error(e.code);
            access.status(e.status.as_u16(), Some(e.code));
            error_response(&e)
        }
    };
    let body_read = std::time::Duration::from_secs(state.cfg.timeouts.body_read_s);
    let mut r = unread.until_sent(r, state.cfg.limits.body_bytes, body_read);
    // Plain ASCII by construction.
    if let Ok(v) = HeaderValue::from_str(access.id()) {
        r.headers_mut().insert("x-request-id", v);
    }
    if let Some(origin) = origin {
        cors::expose(&mut r, origin);
    }
    if let Some((id, name)) = access.tenant_of() {
        let rates = state.quotas.rates(id, state.quotas.set().of(&name));
        rate_headers(&rates, r.headers_mut());
    }
    Ok(r)
}

/// OpenAI's `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`, from the tenant's
/// per-minute limits (none for a limit its policy does not set).
fn rate_headers(rates: &Rates, headers: &mut hyper::HeaderMap) {
    for (kind, w) in [("requests", rates.requests), ("tokens", rates.tokens)] {
        let Some(w) = w else { continue };
        for (what, value) in [
            ("limit", w.limit.to_string()),
            ("remaining", w.remaining.to_string()),
            ("reset", go_duration(w.reset)),
        ] {
            if let (Ok(name), Ok(v)) = (
                hyper::header::HeaderName::try_from(format!("x-ratelimit-{what}-{kind}")),
                HeaderValue::from_str(&value),
            ) {
                headers.insert(name, v);
            }
        }
    }
}

/// A duration as OpenAI's headers write it: `250ms`, `1.5s`, `6m0s`.
fn go_duration(d: std::time::Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let (m, rest) = (ms / 60_000, ms % 60_000);
    let secs = format!("{}.{:03}", rest / 1000, rest % 1000);
    let secs = secs.trim_end_matches('0').trim_end_matches('.');
    if m > 0 {
        format!("{m}m{secs}s")
    } else {
        format!("{secs}s")
    }
}

/// The tenant whose key `req` carries, named in its access line.
fn tenant_of(state: &State, req: &Req, access: &Access) -> Result<crate::serve::store::Tenant, ApiError> {
    let t = tenant(state, req)?;
    access.tenant(t.id, &t.name);
    Ok(t)
}

async fn route(state: &Arc<State>, req: Req, access: &Arc<Access>) -> Result<Response<Body>, ApiError> {
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
        // The names other servers answer (vLLM, TGI, llama-server): `/health` is 200 while
        // every engine runs (503 once one has stopped), `/version` the server's version.
        ["health"] => {
            allow(&[Method::GET])?;
            if state.engines().all(|e| e.is_alive()) {
                Ok(json_response(StatusCode::OK, &json!({"status": "ok"})))
            } else {
                Err(ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "engine_stopped",
                    "a model's engine has stopped",
                ))
            }
        }
        ["version"] => {
            allow(&[Method::GET])?;
            Ok(json_response(
                StatusCode::OK,
                &json!({"version": env!("CARGO_PKG_VERSION")}),
            ))
        }
        ["readyz"] => {
            allow(&[Method::GET])?;
            if state.engines().all(|e| e.is_alive()) && !state.shutting_down.load(Ordering::SeqCst) {
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
            metrics_reader(state, &req)?;
            Ok(full(
                StatusCode::OK,
                "text/plain; version=0.0.4",
                state.metrics.render(),
            ))
        }
        ["v1", "models"] => {
            allow(&[Method::GET])?;
            let t = tenant_of(state, &req, access)?;
            let policy = state.quotas.set().of(&t.name).clone();
            let cards: Vec<Value> = state
                .models
                .iter()
                .filter(|m| policy.allows_model(&m.id))
                .map(|m| model_card(state, m))
                .collect();
            Ok(json_response(StatusCode::OK, &json!({"object": "list", "data": cards})))
        }
        ["v1", "models", id @ ..] if !id.is_empty() => {
            allow(&[Method::GET])?;
            let t = tenant_of(state, &req, access)?;
            // A model id may hold '/' (`org/name`).
            let id = id.join("/");
            let policy = state.quotas.set().of(&t.name).clone();
            match state.model(&id) {
                Some(m) if policy.allows_model(&m.id) => Ok(json_response(StatusCode::OK, &model_card(state, m))),
                _ => Err(model_not_found(&id)),
            }
        }
        ["v1", "chat", "completions"] => {
            allow(&[Method::POST])?;
            let t = tenant_of(state, &req, access)?;
            let body = read_body(state, req).await?;
            generate::chat(state, t, &body, access).await
        }
        ["v1", "completions"] => {
            allow(&[Method::POST])?;
            let t = tenant_of(state, &req, access)?;
            let body = read_body(state, req).await?;
            generate::completions(state, t, &body, access).await
        }
        // vLLM's paths (no `/v1`).
        ["tokenize"] => {
            allow(&[Method::POST])?;
            let t = tenant_of(state, &req, access)?;
            let body = read_body(state, req).await?;
            tokens::tokenize(state, t, &body, access).await
        }
        ["detokenize"] => {
            allow(&[Method::POST])?;
            let t = tenant_of(state, &req, access)?;
            let body = read_body(state, req).await?;
            tokens::detokenize(state, t, &body, access).await
        }
        ["v1", "usage"] => {
            allow(&[Method::GET])?;
            let t = tenant_of(state, &req, access)?;
            let mut usage = json!(state.quotas.usage.of(t.id, &t.name));
            let standing = state.quotas.standing(t.id, state.quotas.set().of(&t.name));
            usage["limits"] = json!(standing);
            Ok(json_response(StatusCode::OK, &usage))
        }
        ["v1", "plugins", rest @ ..] => {
            let t = tenant_of(state, &req, access)?;
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

fn model_card(state: &State, m: &Served) -> Value {
    json!({"id": m.id, "object": "model", "created": state.started, "owned_by": "warden", "max_model_len": m.admission.max_context})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_openais_headers_write_them() {
        let d = std::time::Duration::from_millis;
        assert_eq!(go_duration(d(0)), "0ms");
        assert_eq!(go_duration(d(250)), "250ms");
        assert_eq!(go_duration(d(1500)), "1.5s");
        assert_eq!(go_duration(d(2000)), "2s");
        assert_eq!(go_duration(d(360_000)), "6m0s");
        assert_eq!(go_duration(d(61_250)), "1m1.25s");
    }
}
