//! Request bodies, read within their size limit (checked against `Content-Length` first) and
//! their read timeout; and what an answer leaves unread, drained until the answer is sent.
//!
//! A route may answer before it reads the body, or without reading it all (a bad key, an
//! unknown path, a body over its limit). Dropping the rest then would reset an HTTP/2 stream,
//! and a client that sees the reset before the answer loses the answer (curl: "stream error in
//! the HTTP/2 framing layer"). So a route sees the body through [`ReqBody`], which leaves it
//! with [`handle`](super::handle); whatever is left goes on being read and dropped, at most
//! the body limit more and within the body timeout, and is let go only once the answer is sent
//! (or the timeout passes): the client that sent a body within its limit sees its stream end
//! cleanly, and one that sends more sees the reset after its answer.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use hyper::header::CONTENT_LENGTH;
use hyper::{Request, Response, StatusCode};

use super::reply::Body;
use crate::serve::error::ApiError;
use crate::serve::state::State;

/// A request as the routes see it.
pub(super) type Req = Request<ReqBody>;

/// A request's body, shared with the [`Unread`] that [`hold`] returns: what a route leaves
/// unread stays there.
pub struct ReqBody(Arc<Mutex<Option<Incoming>>>);

impl HttpBody for ReqBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let mut body = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        match body.as_mut() {
            Some(b) => Pin::new(b).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        let body = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        body.as_ref().is_none_or(HttpBody::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        let body = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        body.as_ref().map(HttpBody::size_hint).unwrap_or_default()
    }
}

/// What of a request's body its route has not read.
pub(super) struct Unread(Arc<Mutex<Option<Incoming>>>);

/// `req` for its route, and a hold on what the route will leave of its body.
pub(super) fn hold(req: Request<Incoming>) -> (Req, Unread) {
    let (parts, body) = req.into_parts();
    let shared = Arc::new(Mutex::new(Some(body)));
    (Request::from_parts(parts, ReqBody(shared.clone())), Unread(shared))
}

impl Unread {
    /// `answer`, with what is left of the body read and dropped (at most `limit` bytes more,
    /// within `timeout`) and let go only once `answer` has been sent.
    pub(super) fn until_sent(self, answer: Response<Body>, limit: usize, timeout: Duration) -> Response<Body> {
        let left = self.0.lock().unwrap_or_else(PoisonError::into_inner).take();
        let Some(mut body) = left.filter(|b| !b.is_end_stream()) else {
            return answer;
        };
        let (sent, on_sent) = tokio::sync::oneshot::channel::<()>();
        let answer = answer.map(|b| Sending { body: b, _sent: sent }.boxed());
        tokio::spawn(async move {
            let drain = async {
                let mut read = 0usize;
                while read <= limit {
                    match body.frame().await {
                        Some(Ok(f)) => read += f.data_ref().map_or(0, Bytes::len),
                        _ => break,
                    }
                }
                // Resolves when the answer's body is dropped: sent, or its connection gone.
                let _ = on_sent.await;
            };
            let _ = tokio::time::timeout(timeout, drain).await;
            drop(body);
        });
        answer
    }
}

/// An answer's body that tells, by being dropped, that it was sent.
struct Sending {
    body: Body,
    _sent: tokio::sync::oneshot::Sender<()>,
}

impl HttpBody for Sending {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

pub(super) async fn read_body(state: &State, req: Req) -> Result<Bytes, ApiError> {
    read_body_up_to(state, req, state.cfg.limits.body_bytes, "body_too_large").await
}

/// Reads a body of at most `limit` bytes (checked against Content-Length before reading, and
/// while reading); beyond, 413 with `code`.
pub(super) async fn read_body_up_to(
    state: &State,
    req: Req,
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
