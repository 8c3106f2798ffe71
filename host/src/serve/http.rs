//! The HTTP service: routing, authentication, body limits, the OpenAI endpoints, health,
//! metrics and the admin API. Every failure leaves through [`ApiError`]'s JSON.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{AUTHORIZATION, CONTENT_LENGTH, CONTENT_TYPE, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::State;
use super::openai::{ApiError, ChatRequest, CompletionRequest, Plan, Prompt, parse_body};
use super::store::{StoreError, Tenant};
use super::stream::{Api, Responder, SseBody};
use super::worker::{Busy, Job, Update};

/// Response bodies: whole or streamed.
pub type Body = BoxBody<Bytes, std::convert::Infallible>;

fn full(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Response<Body> {
    let mut r = Response::new(Full::new(body.into()).boxed());
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

fn json_response(status: StatusCode, v: &Value) -> Response<Body> {
    full(status, "application/json", v.to_string())
}

fn error_response(e: &ApiError) -> Response<Body> {
    let mut r = json_response(e.status, &e.body());
    if e.status == StatusCode::SERVICE_UNAVAILABLE {
        r.headers_mut().insert("retry-after", HeaderValue::from_static("1"));
    }
    r
}

fn store_error(e: StoreError) -> ApiError {
    match e {
        StoreError::BadName(_) => ApiError::field("name", e.to_string()),
        StoreError::TenantExists(_) => ApiError::new(StatusCode::CONFLICT, "tenant_exists", e.to_string()),
        StoreError::NoTenant(_) => ApiError::new(StatusCode::NOT_FOUND, "tenant_not_found", e.to_string()),
        StoreError::NoKey(_) => ApiError::new(StatusCode::NOT_FOUND, "key_not_found", e.to_string()),
        _ => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "store_error", e.to_string()),
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn bearer(req: &Request<Incoming>) -> Option<&str> {
    let v = req.headers().get(AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = v.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

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
            Err(ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                format!("{method} is not allowed on {path}"),
            ))
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
            chat(state, t, &body).await
        }
        ["v1", "completions"] => {
            allow(&[Method::POST])?;
            let t = tenant(state, &req)?;
            let body = read_body(state, req).await?;
            completions(state, t, &body).await
        }
        ["admin", "v1", rest @ ..] => admin_api(state, req, &method, rest).await,
        _ => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no route for {method} {path}"),
        )),
    }
}

fn model_card(state: &State) -> Value {
    json!({"id": state.model_id, "object": "model", "created": state.started, "owned_by": "warden"})
}

fn model_not_found(id: &str) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        code: "model_not_found",
        message: format!("the model {id:?} does not exist"),
        param: Some("model".into()),
    }
}

fn tenant(state: &State, req: &Request<Incoming>) -> Result<Tenant, ApiError> {
    let key = bearer(req).ok_or_else(|| {
        ApiError::new(
            StatusCode::UNAUTHORIZED,
            "missing_api_key",
            "this endpoint needs an API key: send Authorization: Bearer <key>",
        )
    })?;
    match state.store.authenticate(key) {
        Ok(Some(t)) => Ok(t),
        Ok(None) => Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "invalid_api_key",
            "the API key is not valid",
        )),
        Err(e) => Err(store_error(e)),
    }
}

fn admin(state: &State, req: &Request<Incoming>) -> Result<(), ApiError> {
    let ok = bearer(req)
        .map(|t| state.store.is_admin(t))
        .transpose()
        .map_err(store_error)?;
    match ok {
        Some(true) => Ok(()),
        Some(false) => Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "invalid_admin_token",
            "the admin token is not valid",
        )),
        None => Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "missing_admin_token",
            "this endpoint needs the admin token: send Authorization: Bearer <token>",
        )),
    }
}

async fn read_body(state: &State, req: Request<Incoming>) -> Result<Bytes, ApiError> {
    let limit = state.cfg.limits.body_bytes;
    let too_large = |n: String| {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            format!("the request body is {n} bytes, more than the limit of {limit}"),
        )
    };
    if let Some(len) = req
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
        && len > limit as u64
    {
        return Err(too_large(len.to_string()));
    }
    let timeout = Duration::from_secs(state.cfg.timeouts.body_read_s);
    match tokio::time::timeout(timeout, Limited::new(req.into_body(), limit).collect()).await {
        Err(_) => Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "body_timeout",
            format!("the request body did not arrive within {} s", timeout.as_secs()),
        )),
        Ok(Err(e)) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => Err(too_large("more".into())),
        Ok(Err(e)) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad_body",
            format!("reading the body: {e}"),
        )),
        Ok(Ok(c)) => Ok(c.to_bytes()),
    }
}

/// Runs CPU-heavy request preparation (template rendering, tokenizing up to a whole body) on
/// the blocking pool, so it never stalls the connections the runtime serves.
async fn off_runtime<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.unwrap_or_else(|e| {
        Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            format!("preparing the request failed: {e}"),
        ))
    })
}

fn request_id(prefix: &str) -> String {
    use rand::RngCore;
    let mut b = [0u8; 12];
    rand::rng().fill_bytes(&mut b);
    format!("{prefix}-{}", b.iter().map(|x| format!("{x:02x}")).collect::<String>())
}

async fn chat(state: &Arc<State>, t: Tenant, body: &[u8]) -> Result<Response<Body>, ApiError> {
    let r = ChatRequest::parse(body, state.cfg.limits.json_depth)?;
    if r.common.model != state.model_id {
        return Err(model_not_found(&r.common.model));
    }
    let messages = r.chat_messages()?;
    let logprobs = r.logprobs()?;
    let template = state.chat.as_ref().ok_or_else(|| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "no_chat_template",
            "this model has no chat template; use /v1/completions",
        )
    })?;
    let (template, tk) = (template.clone(), state.tokenizer.clone());
    let prompt = off_runtime(move || {
        let text = template
            .render(&messages, true)
            .map_err(|e| ApiError::field("messages", format!("rendering the chat template: {e}")))?;
        Ok(tk.encode(&text, true))
    })
    .await?;
    let mut plan = r.common.plan(t.id, prompt, &state.request_limits)?;
    plan.req.logprobs = logprobs;
    generate(state, &t, plan, Api::Chat, request_id("chatcmpl")).await
}

async fn completions(state: &Arc<State>, t: Tenant, body: &[u8]) -> Result<Response<Body>, ApiError> {
    let r = CompletionRequest::parse(body, state.cfg.limits.json_depth)?;
    if r.common.model != state.model_id {
        return Err(model_not_found(&r.common.model));
    }
    let one = |what: usize| {
        ApiError::field(
            "prompt",
            format!("prompt lists must hold exactly one prompt (got {what}); send one request per prompt"),
        )
    };
    let tk = state.tokenizer.clone();
    let encode = |s: String| off_runtime(move || Ok(tk.encode(&s, true)));
    let prompt = match r.prompt {
        Prompt::Text(s) => encode(s).await?,
        Prompt::Tokens(ids) => ids,
        Prompt::TextList(v) if v.len() == 1 => encode(v.into_iter().next().unwrap_or_default()).await?,
        Prompt::TokensList(v) if v.len() == 1 => v.into_iter().next().unwrap_or_default(),
        Prompt::TextList(v) => return Err(one(v.len())),
        Prompt::TokensList(v) => return Err(one(v.len())),
    };
    let plan = r.common.plan(t.id, prompt, &state.request_limits)?;
    generate(state, &t, plan, Api::Completion, request_id("cmpl")).await
}

/// Admits, submits and answers a planned request: a JSON body, or an SSE stream that starts once
/// every choice is admitted (so a rejection is an error status, never a 200).
async fn generate(
    state: &Arc<State>,
    t: &Tenant,
    plan: Plan,
    api: Api,
    id: String,
) -> Result<Response<Body>, ApiError> {
    if state.shutting_down.load(Ordering::SeqCst) {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "shutting_down",
            "the server is shutting down",
        ));
    }
    // Admission up front, so an over-length request is refused before anything is queued. The
    // engine checks again (it alone knows the tenant's KV budget and the queue).
    if let Err(rej) = plan.req.clone().validate(&state.admission) {
        state.metrics.rejected(&t.name, rej.reason.code());
        return Err(rej.reason.into());
    }
    let (tx, mut rx) = mpsc::unbounded_channel::<(usize, Update)>();
    for i in 0..plan.n {
        let mut req = plan.req.clone();
        req.sampling.seed = req.sampling.seed.map(|s| s.wrapping_add(i as u64));
        let job = Job {
            req,
            tenant: t.name.clone(),
            index: i,
            tx: tx.clone(),
        };
        if let Err(Busy) = state.engine.submit(job) {
            state.metrics.rejected(&t.name, "queue_full");
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "queue_full",
                format!(
                    "the request queue is full ({} waiting); retry later",
                    state.cfg.limits.queue
                ),
            ));
        }
    }
    drop(tx);
    let mut responder = Responder::new(
        api,
        &state.model_id,
        plan.n,
        plan.stream,
        plan.include_usage,
        state.tokenizer.clone(),
        id,
        now(),
    );
    let mut pending = VecDeque::new();
    if plan.stream {
        // Wait for each choice's first update: a rejection then becomes an error status.
        let mut started = vec![false; plan.n];
        while started.iter().any(|s| !s) && !responder.finished() {
            match rx.recv().await {
                Some((i, u)) => {
                    started[i] = true;
                    responder.push(i, u, &mut pending);
                }
                None => break,
            }
        }
        if let Some(e) = responder.error() {
            return Err(e.clone());
        }
        let mut r = Response::new(SseBody::new(rx, responder, pending).boxed());
        let h = r.headers_mut();
        h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        h.insert("cache-control", HeaderValue::from_static("no-cache"));
        return Ok(r);
    }
    while !responder.finished() {
        match rx.recv().await {
            Some((i, u)) => responder.push(i, u, &mut pending),
            None => break,
        }
    }
    if let Some(e) = responder.error() {
        return Err(e.clone());
    }
    if !responder.finished() {
        return Err(super::stream::abort_error(
            &crate::engine::request::AbortReason::Shutdown,
        ));
    }
    Ok(json_response(StatusCode::OK, &responder.body()))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NewTenant {
    name: String,
}

async fn admin_api(
    state: &Arc<State>,
    req: Request<Incoming>,
    method: &Method,
    rest: &[&str],
) -> Result<Response<Body>, ApiError> {
    admin(state, &req)?;
    let not_allowed = || {
        ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            format!("{method} is not allowed on {}", req.uri().path()),
        )
    };
    let ok = |v: Value| Ok(json_response(StatusCode::OK, &v));
    match (rest, method) {
        (["tenants"], &Method::GET) => ok(json!({"data": state.store.tenants().map_err(store_error)?})),
        (["tenants"], &Method::POST) => {
            let body = read_body(state, req).await?;
            let n: NewTenant = parse_body(&body, 4, &["name"])?;
            let t = state.store.create_tenant(&n.name).map_err(store_error)?;
            Ok(json_response(StatusCode::CREATED, &json!(t)))
        }
        (["tenants"], _) => Err(not_allowed()),
        (["tenants", name], &Method::DELETE) => {
            state.store.delete_tenant(name).map_err(store_error)?;
            ok(json!({"deleted": name}))
        }
        (["tenants", _], _) => Err(not_allowed()),
        (["tenants", name, "keys"], &Method::POST) => {
            let (info, key) = state.store.create_key(name).map_err(store_error)?;
            Ok(json_response(StatusCode::CREATED, &json!({"key": key, "info": info})))
        }
        (["tenants", name, "keys"], &Method::GET) => {
            ok(json!({"data": state.store.keys(Some(name)).map_err(store_error)?}))
        }
        (["tenants", _, "keys"], _) => Err(not_allowed()),
        (["keys"], &Method::GET) => ok(json!({"data": state.store.keys(None).map_err(store_error)?})),
        (["keys"], _) => Err(not_allowed()),
        (["keys", id], &Method::DELETE) => ok(json!(state.store.revoke_key(id).map_err(store_error)?)),
        (["keys", _], _) => Err(not_allowed()),
        _ => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no admin route {}", req.uri().path()),
        )),
    }
}
