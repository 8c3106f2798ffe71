//! Responses: whole bodies, JSON, and an [`ApiError`] as its status, JSON and `Retry-After`.

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::{Method, Response, StatusCode};
use serde::Serialize;
use serde_json::Value;

use crate::serve::error::ApiError;

/// Response bodies: whole or streamed.
pub type Body = BoxBody<Bytes, std::convert::Infallible>;

pub(super) fn full(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Response<Body> {
    let mut r = Response::new(Full::new(body.into()).boxed());
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

pub(super) fn json_response(status: StatusCode, v: &Value) -> Response<Body> {
    full(status, "application/json", v.to_string())
}

/// `v` (a domain type that serializes as its API shape) as a JSON response.
pub(super) fn serialized<T: Serialize>(status: StatusCode, v: &T) -> Response<Body> {
    match serde_json::to_string(v) {
        Ok(body) => full(status, "application/json", body),
        Err(e) => error_response(&ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            format!("the reply could not be written as JSON: {e}"),
        )),
    }
}

pub(super) fn error_response(e: &ApiError) -> Response<Body> {
    let mut r = json_response(e.status, &e.body());
    match e.retry_after {
        Some(s) => {
            r.headers_mut().insert("retry-after", HeaderValue::from(s));
        }
        None if e.status == StatusCode::SERVICE_UNAVAILABLE => {
            r.headers_mut().insert("retry-after", HeaderValue::from_static("1"));
        }
        None => {}
    }
    r
}

pub(super) fn method_not_allowed(method: &Method, path: &str) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!("{method} is not allowed on {path}"),
    )
}

pub(super) fn model_not_found(id: &str) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        code: "model_not_found",
        message: format!("the model {id:?} does not exist"),
        param: Some("model".into()),
        retry_after: None,
    }
}
