//! Who is asking: a tenant's API key, the admin token or the metrics token, as
//! `Authorization: Bearer`.

use hyper::StatusCode;
use hyper::header::AUTHORIZATION;

use super::body::Req;
use crate::serve::error::ApiError;
use crate::serve::state::State;
use crate::serve::store::Tenant;

fn bearer(req: &Req) -> Option<&str> {
    let v = req.headers().get(AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = v.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

pub(super) fn tenant(state: &State, req: &Req) -> Result<Tenant, ApiError> {
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
        Err(e) => Err(e.into()),
    }
}

pub(super) fn admin(state: &State, req: &Req) -> Result<(), ApiError> {
    let ok = bearer(req).map(|t| state.store.is_admin(t)).transpose()?;
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

/// The admin token or the metrics token: who may read `GET /metrics`.
pub(super) fn metrics_reader(state: &State, req: &Req) -> Result<(), ApiError> {
    match bearer(req) {
        Some(t) if state.store.is_metrics_reader(t)? => Ok(()),
        Some(_) => admin(state, req).map_err(|_| {
            ApiError::new(
                StatusCode::UNAUTHORIZED,
                "invalid_metrics_token",
                "the token is neither the metrics token nor the admin token",
            )
        }),
        None => Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "missing_metrics_token",
            "this endpoint needs the metrics token or the admin token: send Authorization: Bearer <token>",
        )),
    }
}
