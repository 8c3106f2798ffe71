//! The serve layer's one error type: [`ApiError`], what every failure reaches a client as
//! (`{"error": {"message", "type", "code", "param"}}` with its HTTP status), lifted with `From`
//! from each domain's own error: validation ([`InvalidParam`]), admission ([`RejectReason`]),
//! an aborted request ([`AbortReason`]), a plugin ([`PluginFailure`]), the plugin registry
//! ([`PluginError`]), the quotas ([`QuotaError`]) and the store ([`StoreError`]). Each mapping to a status is written here once.

use std::time::Duration;

use hyper::StatusCode;
use serde_json::{Value, json};

use super::plugins::registry::PluginError;
use super::quota::QuotaError;
use super::store::StoreError;
use crate::engine::request::{AbortReason, InvalidParam, RejectReason};
use crate::plugin::PluginFailure;

/// An error as the client sees it: `{"error": {"message", "type", "code", "param"}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Stable machine-readable code.
    pub code: &'static str,
    /// Human message: names the field, the limit and the value.
    pub message: String,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// Seconds after which a retry may succeed (`Retry-After`), for rate and usage limits.
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// An error with no particular field.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            param: None,
            retry_after: None,
        }
    }

    /// 400 for a field.
    pub fn field(field: &str, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            code: "invalid_parameter",
            message: message.into(),
            param: Some(field.into()),
            retry_after: None,
        }
    }

    /// OpenAI's `type` for this status.
    pub fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::FORBIDDEN => "permission_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind(), "code": self.code, "param": self.param}})
    }
}

impl From<RejectReason> for ApiError {
    fn from(r: RejectReason) -> Self {
        let status = match r {
            RejectReason::QueueFull { .. } => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::BAD_REQUEST,
        };
        let param = match &r {
            RejectReason::InvalidParameter { field, .. } => Some(field.as_str().into()),
            RejectReason::ContextLengthExceeded { .. } => Some("messages".into()),
            RejectReason::EmptyPrompt | RejectReason::InvalidToken { .. } => Some("prompt".into()),
            _ => None,
        };
        Self {
            status,
            code: r.code(),
            message: r.to_string(),
            param,
            retry_after: None,
        }
    }
}

impl From<InvalidParam> for ApiError {
    fn from(e: InvalidParam) -> Self {
        ApiError::field(e.field.as_str(), e.to_string())
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        let code = match e {
            StoreError::BadName(_) => return ApiError::field("name", e.to_string()),
            StoreError::TenantExists(_) => (StatusCode::CONFLICT, "tenant_exists"),
            StoreError::NoTenant(_) => (StatusCode::NOT_FOUND, "tenant_not_found"),
            StoreError::NoKey(_) => (StatusCode::NOT_FOUND, "key_not_found"),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "store_error"),
        };
        ApiError::new(code.0, code.1, e.to_string())
    }
}

/// The error an aborted request ends with.
impl From<&AbortReason> for ApiError {
    fn from(r: &AbortReason) -> Self {
        let status = match r {
            AbortReason::Cancelled => StatusCode::BAD_REQUEST,
            AbortReason::Isolation(_) => StatusCode::INTERNAL_SERVER_ERROR,
            AbortReason::Shutdown | AbortReason::Kv(_) => StatusCode::SERVICE_UNAVAILABLE,
            AbortReason::Transfer(_) => StatusCode::BAD_GATEWAY,
            // The request's own format left the model no way on.
            // The plugin's constraint, not the client's request, left nothing.
            AbortReason::Constraint(crate::engine::constraint::ConstraintError::SteeredToNothing) => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
            AbortReason::Constraint(_) => StatusCode::BAD_REQUEST,
            // A node's own ending, passed on by a router, keeps its status.
            AbortReason::Node { code, .. } => match *code {
                "cancelled" => StatusCode::BAD_REQUEST,
                "isolation_violation" => StatusCode::INTERNAL_SERVER_ERROR,
                "shutting_down" | "kv_unavailable" => StatusCode::SERVICE_UNAVAILABLE,
                _ => StatusCode::BAD_GATEWAY,
            },
        };
        ApiError::new(status, r.code(), r.client_message())
    }
}

/// The error a client gets for a plugin failure.
impl From<&PluginFailure> for ApiError {
    fn from(f: &PluginFailure) -> Self {
        let status = match f {
            PluginFailure::Refused { .. } | PluginFailure::Invalid(_) | PluginFailure::OverLimits(_) => {
                StatusCode::BAD_REQUEST
            }
            PluginFailure::Busy => StatusCode::SERVICE_UNAVAILABLE,
            PluginFailure::CompileBudget(_) => StatusCode::TOO_MANY_REQUESTS,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError::new(status, f.code(), f.to_string())
    }
}

/// 429 with `Retry-After` for what fits later, 400 for a request that never fits.
impl From<QuotaError> for ApiError {
    fn from(e: QuotaError) -> Self {
        let status = match e.retry_after() {
            Some(_) => StatusCode::TOO_MANY_REQUESTS,
            None => StatusCode::BAD_REQUEST,
        };
        let mut a = ApiError::new(status, e.code(), e.to_string());
        a.retry_after = e
            .retry_after()
            .map(|d: Duration| d.as_secs_f64().ceil().max(1.0) as u64);
        a
    }
}

/// The registry's refusals. A store failure here is the server's (500), whatever its kind.
impl From<PluginError> for ApiError {
    fn from(e: PluginError) -> Self {
        let message = e.to_string();
        let (status, code, param, retry_after) = match e {
            PluginError::Store(_) => (StatusCode::INTERNAL_SERVER_ERROR, "store_error", None, None),
            PluginError::NotFound(_) => (StatusCode::NOT_FOUND, "plugin_not_found", Some("plugin"), None),
            PluginError::Inactive(_) => (StatusCode::CONFLICT, "plugin_inactive", Some("plugin"), None),
            PluginError::VersionNotFound { .. } => (StatusCode::NOT_FOUND, "version_not_found", None, None),
            PluginError::BadName(_) => return ApiError::field("name", message),
            PluginError::ConfigNotText(_) => return ApiError::field("config", message),
            PluginError::ComponentTooLarge { .. } => (StatusCode::PAYLOAD_TOO_LARGE, "component_too_large", None, None),
            PluginError::ConfigTooLarge { .. } => (StatusCode::PAYLOAD_TOO_LARGE, "config_too_large", None, None),
            PluginError::TooMany { .. } => (StatusCode::CONFLICT, "too_many_plugins", None, None),
            PluginError::UploadRate { retry_after, .. } => (
                StatusCode::TOO_MANY_REQUESTS,
                "upload_rate_limit",
                None,
                Some(retry_after),
            ),
            PluginError::CompileBudget { retry_after, .. } => (
                StatusCode::TOO_MANY_REQUESTS,
                "compile_budget_exceeded",
                None,
                Some(retry_after),
            ),
            PluginError::Instances { .. } => (StatusCode::TOO_MANY_REQUESTS, "plugin_instances_limit", None, Some(1)),
            PluginError::NothingToRollBack(_) => (StatusCode::CONFLICT, "nothing_to_roll_back", None, None),
            PluginError::VersionActive { .. } => (StatusCode::CONFLICT, "version_active", None, None),
            PluginError::Rejected(f) => (StatusCode::BAD_REQUEST, f.code(), None, None),
            PluginError::Changed(_) => (StatusCode::CONFLICT, "plugin_changed", None, None),
            PluginError::ConfigRejected { .. } => {
                (StatusCode::BAD_REQUEST, "plugin_config_rejected", Some("config"), None)
            }
            PluginError::Failed(f) => return ApiError::from(&f),
        };
        ApiError {
            status,
            code,
            message,
            param: param.map(Into::into),
            retry_after,
        }
    }
}
