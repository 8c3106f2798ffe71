//! CORS for browser clients (`[http] allowed_origins`; off when empty): a preflight from an
//! allowed origin is answered here, before any key is asked for, and every response to an
//! allowed origin says so and exposes the headers a client reads (the request id, rate limits,
//! `Retry-After`). A preflight from another origin is refused by name; without the list, an
//! `OPTIONS` request is routed as any other method (405).

use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::{Method, Response, StatusCode};

use super::reply::{Body, full};
use crate::config::HttpConfig;
use crate::serve::error::ApiError;

/// The headers a page's script may read from a response.
const EXPOSED: &str = "x-request-id, x-warden-ignored-fields, retry-after, x-ratelimit-limit-requests, \
x-ratelimit-remaining-requests, x-ratelimit-reset-requests, x-ratelimit-limit-tokens, \
x-ratelimit-remaining-tokens, x-ratelimit-reset-tokens";

/// The methods the API answers.
const METHODS: &str = "GET, POST, PUT, DELETE, OPTIONS";

/// How long a browser may keep a preflight's answer, in seconds.
const MAX_AGE: &str = "600";

/// What `Access-Control-Allow-Origin` says to a request from an allowed origin: `*` where the
/// list allows any, else the origin itself. `None`: CORS off, no `Origin`, or not allowed.
pub(super) fn allowed(cfg: &HttpConfig, headers: &HeaderMap) -> Option<HeaderValue> {
    let origin = headers.get(header::ORIGIN)?;
    let text = origin.to_str().ok()?;
    if cfg.allowed_origins.iter().any(|o| o == "*") {
        Some(HeaderValue::from_static("*"))
    } else if cfg.allowed_origins.iter().any(|o| o.eq_ignore_ascii_case(text)) {
        Some(origin.clone())
    } else {
        None
    }
}

/// The answer to a CORS preflight (`OPTIONS` with `Access-Control-Request-Method`), when CORS
/// is on: 204 with what the origin may do, or 403 `origin_not_allowed`. `None`: not a preflight,
/// or CORS off.
pub(super) fn preflight(
    cfg: &HttpConfig,
    method: &Method,
    headers: &HeaderMap,
) -> Option<Result<Response<Body>, ApiError>> {
    if cfg.allowed_origins.is_empty()
        || method != Method::OPTIONS
        || !headers.contains_key(header::ACCESS_CONTROL_REQUEST_METHOD)
    {
        return None;
    }
    let Some(origin) = allowed(cfg, headers) else {
        return Some(Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "origin_not_allowed",
            "this origin is not in the server's [http] allowed_origins",
        )));
    };
    let mut r = full(StatusCode::NO_CONTENT, "text/plain", "");
    let h = r.headers_mut();
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    h.insert(header::ACCESS_CONTROL_ALLOW_METHODS, HeaderValue::from_static(METHODS));
    // The headers the page asks to send (a valid header value already, bounded by the header
    // limit): its client's own `x-stainless-*` and the like among them.
    let asked = headers
        .get(header::ACCESS_CONTROL_REQUEST_HEADERS)
        .cloned()
        .unwrap_or_else(|| HeaderValue::from_static("authorization, content-type"));
    h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, asked);
    h.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static(MAX_AGE));
    // `Vary: origin` comes with the other CORS headers, in [`expose`].
    Some(Ok(r))
}

/// Marks a response to an allowed origin.
pub(super) fn expose(r: &mut Response<Body>, origin: HeaderValue) {
    let h = r.headers_mut();
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    h.insert(header::ACCESS_CONTROL_EXPOSE_HEADERS, HeaderValue::from_static(EXPOSED));
    h.append(header::VARY, HeaderValue::from_static("origin"));
}
