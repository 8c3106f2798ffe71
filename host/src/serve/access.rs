//! One access line per request, as operators read web servers' logs: the request's id, its
//! tenant, model, route, status and error code, its prompt, completion and cached tokens, its
//! time to first token and duration, its finish reason and plugin, the client's address and
//! (bounded, plain ASCII) user agent. The line is written when
//! the request ends: for a stream, when its last byte is sent or its client goes away (the
//! [`Access`] lives in the response body). It names the tenant and the plugin, never the text.
//!
//! The request id is the client's `x-request-id` when it is a plain one (at most
//! [`MAX_REQUEST_ID`] characters of letters, digits and `-_.:`), else one made here; every
//! response returns it in `x-request-id`, and it goes with the request to the engine (a cluster's
//! nodes log it too) and to its plugin's log lines.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::engine::request::Outcome;
use crate::runner::Update;

/// Longest request id taken from a client.
pub const MAX_REQUEST_ID: usize = 128;

/// Most characters of a client's `user-agent` the line keeps.
pub const MAX_USER_AGENT: usize = 128;

/// A `user-agent` as the line shows it: its first [`MAX_USER_AGENT`] bytes, anything but
/// printable ASCII and the space as `?`, `-` when there is none.
pub fn user_agent(given: Option<&[u8]>) -> String {
    match given {
        Some(g) if !g.is_empty() => g
            .iter()
            .take(MAX_USER_AGENT)
            .map(|&b| {
                if b.is_ascii_graphic() || b == b' ' {
                    b as char
                } else {
                    '?'
                }
            })
            .collect(),
        _ => "-".into(),
    }
}

/// The request id for a request whose `x-request-id` header is `given`: that, if it is plain
/// enough to log and echo, else a new one (`req_` and 24 hex digits).
pub fn request_id(given: Option<&[u8]>) -> String {
    if let Some(g) = given
        && !g.is_empty()
        && g.len() <= MAX_REQUEST_ID
        && g.iter().all(|&b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b))
    {
        // Checked ASCII above.
        return String::from_utf8_lossy(g).into_owned();
    }
    random_id("req_")
}

/// `prefix` and 24 random hex digits: a request's id, or its response's (`chatcmpl-…`).
pub fn random_id(prefix: &str) -> String {
    use rand::RngCore;
    let mut b = [0u8; 12];
    rand::rng().fill_bytes(&mut b);
    format!("{prefix}{}", b.iter().map(|x| format!("{x:02x}")).collect::<String>())
}

/// What the line says, filled in as the request goes.
#[derive(Debug, Default)]
struct Line {
    response_id: Option<String>,
    tenant: Option<(crate::tenant::TenantId, String)>,
    model: Option<String>,
    plugin: Option<String>,
    status: u16,
    code: Option<&'static str>,
    prompt_tokens: usize,
    completion_tokens: usize,
    /// Tokens sent, counted as they go (a choice that never ended reports no usage).
    tokens_sent: usize,
    cached_tokens: usize,
    first_token: Option<Duration>,
    finish: Option<&'static str>,
}

/// A request's access line; written when the last holder lets go.
#[derive(Debug)]
pub struct Access {
    id: String,
    method: String,
    route: String,
    client: std::net::IpAddr,
    user_agent: String,
    started: Instant,
    line: Mutex<Line>,
}

impl Access {
    /// The line of request `id`, a `method` on `path`, begun now. The route is the path cut to
    /// 256 bytes, anything but printable ASCII shown as `?`, and a segment that is an API key
    /// (`DELETE /admin/v1/keys/{key}` takes a whole one) shown as `wdn-…`. `client` is the
    /// client's address (see [`crate::net::client_addr`]), `user_agent` its header's value.
    pub fn new(id: String, method: &str, path: &str, client: std::net::IpAddr, user_agent: Option<&[u8]>) -> Arc<Self> {
        let route: String = path
            .split('/')
            .map(|seg| if seg.starts_with("wdn-") { "wdn-…" } else { seg })
            .collect::<Vec<_>>()
            .join("/")
            .chars()
            .take(256)
            .map(|c| if c.is_ascii_graphic() || c == '…' { c } else { '?' })
            .collect();
        Arc::new(Self {
            id,
            method: method.to_string(),
            route,
            client,
            user_agent: self::user_agent(user_agent),
            started: Instant::now(),
            line: Mutex::new(Line::default()),
        })
    }

    /// The request id.
    pub fn id(&self) -> &str {
        &self.id
    }

    fn line(&self) -> std::sync::MutexGuard<'_, Line> {
        self.line.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The id its response body carries (`chatcmpl-…`, `cmpl-…`).
    pub fn response_id(&self, id: &str) {
        self.line().response_id = Some(id.to_string());
    }

    /// The tenant whose key it carried.
    pub fn tenant(&self, id: crate::tenant::TenantId, name: &str) {
        self.line().tenant = Some((id, name.to_string()));
    }

    /// The tenant whose key it carried, once known.
    pub fn tenant_of(&self) -> Option<(crate::tenant::TenantId, String)> {
        self.line().tenant.clone()
    }

    /// The served model it named.
    pub fn model(&self, id: &str) {
        self.line().model = Some(id.to_string());
    }

    /// The plugin its tenant's request ran.
    pub fn plugin(&self, name: &str) {
        self.line().plugin = Some(name.to_string());
    }

    /// The response's status, and its error code if it is an error.
    pub fn status(&self, status: u16, code: Option<&'static str>) {
        let mut l = self.line();
        l.status = status;
        l.code = code;
    }

    /// A choice's update: the first token's time; at its end, its tokens and finish reason (a
    /// request's choices add up; the finish is the last choice's).
    pub fn update(&self, u: &Update) {
        let mut l = self.line();
        match u {
            Update::Token { .. } => {
                l.tokens_sent += 1;
                if l.first_token.is_none() {
                    l.first_token = Some(self.started.elapsed());
                }
            }
            Update::Rejected(r) => l.code = Some(r.reason.code()),
            Update::Failed(e) => l.code = Some(e.code()),
            Update::ShuttingDown => l.code = Some("shutting_down"),
            Update::Done { outcome, usage, .. } => {
                if let Outcome::Aborted(r) = outcome {
                    l.code = Some(r.code());
                }
                l.prompt_tokens = l.prompt_tokens.max(usage.prompt_tokens);
                l.cached_tokens = l.cached_tokens.max(usage.cached_tokens);
                l.completion_tokens += usage.completion_tokens;
                l.finish = Some(match outcome {
                    Outcome::Finished(f) => f.as_str(),
                    Outcome::Aborted(r) => r.code(),
                });
            }
        }
    }
}

impl Drop for Access {
    fn drop(&mut self) {
        let l = self.line.get_mut().unwrap_or_else(|p| p.into_inner());
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        // A stream whose client left before its end: what was sent, and why it ended.
        let completion = l.completion_tokens.max(l.tokens_sent);
        let finish = match (l.finish, l.status) {
            (Some(f), _) => f,
            (None, 200) if l.response_id.is_some() => "client_closed",
            (None, _) => "-",
        };
        // A request whose client left before its response was made.
        let status = if l.status == 0 { 499 } else { l.status };
        tracing::info!(
            target: "warden::access",
            request_id = %self.id,
            response_id = l.response_id.as_deref().unwrap_or("-"),
            method = %self.method,
            route = %self.route,
            tenant = l.tenant.as_ref().map_or("-", |(_, name)| name.as_str()),
            model = l.model.as_deref().unwrap_or("-"),
            status,
            code = l.code.unwrap_or("-"),
            prompt_tokens = l.prompt_tokens,
            completion_tokens = completion,
            cached_tokens = l.cached_tokens,
            ttft_ms = l.first_token.map_or(-1.0, ms),
            duration_ms = ms(self.started.elapsed()),
            finish_reason = finish,
            plugin = l.plugin.as_deref().unwrap_or("-"),
            client = %self.client,
            user_agent = %self.user_agent,
            "request"
        );
    }
}
