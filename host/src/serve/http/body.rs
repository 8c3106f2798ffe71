//! Request bodies, read within their size limit (checked against `Content-Length` first) and
//! their read timeout.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::header::CONTENT_LENGTH;
use hyper::{Request, StatusCode};

use crate::serve::error::ApiError;
use crate::serve::state::State;

pub(super) async fn read_body(state: &State, req: Request<Incoming>) -> Result<Bytes, ApiError> {
    read_body_up_to(state, req, state.cfg.limits.body_bytes, "body_too_large").await
}

/// Reads a body of at most `limit` bytes (checked against Content-Length before reading, and
/// while reading); beyond, 413 with `code`.
pub(super) async fn read_body_up_to(
    state: &State,
    req: Request<Incoming>,
    limit: usize,
    code: &'static str,
) -> Result<Bytes, ApiError> {
    let too_large = |n: String| {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            code,
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
