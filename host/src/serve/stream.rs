//! Turning engine updates into OpenAI responses: SSE chunks for streams, one JSON body otherwise.
//!
//! [`Responder`] is pure: it takes each choice's updates in order and produces the bytes to send,
//! so the chunk shapes are tested without a server. [`SseBody`] drives it from the request's
//! channel as hyper polls for data; dropping it (the client went away) drops the receiver, which is
//! how the engine learns to cancel.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::{Body, Frame};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::access::Access;
use super::error::ApiError;
use crate::engine::TokenLogprobs;
use crate::engine::request::{AbortReason, Outcome};
use crate::runner::Update;
use crate::serve::tools::{CallReader, Piece};
use crate::tokenizer::Tokenizer;

/// Which endpoint's shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `chat.completion` / `chat.completion.chunk`.
    Chat,
    /// `text_completion`.
    Completion,
}

#[derive(Debug, Default, Clone)]
struct Choice {
    text: String,
    /// Per token: for chat, OpenAI's `logprobs.content` entries; for completions, the
    /// `[token, logprob, top_logprobs, text_offset]` of the legacy shape ([`legacy_logprobs`]).
    logprobs: Vec<Value>,
    /// Characters of the tokens' text so far (completions' `text_offset`).
    offset: usize,
    finish: Option<&'static str>,
    started: bool,
    completion_tokens: usize,
    /// With tools: reads the output for calls as it comes.
    reader: Option<CallReader>,
    /// The calls read, as `tool_calls` entries (streams also send each as it is read).
    calls: Vec<Value>,
}

/// Builds a response from the updates of `n` choices.
pub struct Responder {
    api: Api,
    id: String,
    created: u64,
    model: String,
    stream: bool,
    include_usage: bool,
    tokenizer: Arc<Tokenizer>,
    choices: Vec<Choice>,
    prompt_tokens: usize,
    cached_tokens: usize,
    done: usize,
    error: Option<ApiError>,
    /// Completions' `echo`: the prompt, returned before each choice's text.
    echo: Option<String>,
    /// The request's access line, told of each update (and written when the responder goes).
    access: Option<Arc<Access>>,
}

fn token_value(tok: &Tokenizer, id: u32, logprob: f32) -> Value {
    let bytes = tok.token_bytes(id);
    json!({"token": String::from_utf8_lossy(&bytes), "logprob": logprob, "bytes": bytes})
}

impl Responder {
    /// A responder for `n` choices.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        api: Api,
        model: &str,
        n: usize,
        stream: bool,
        include_usage: bool,
        tokenizer: Arc<Tokenizer>,
        id: String,
        created: u64,
    ) -> Self {
        Self {
            api,
            id,
            created,
            model: model.into(),
            stream,
            include_usage,
            tokenizer,
            choices: vec![Choice::default(); n],
            prompt_tokens: 0,
            cached_tokens: 0,
            done: 0,
            error: None,
            echo: None,
            access: None,
        }
    }

    /// Tells `access` of each update: the request's line is written once the responder, and
    /// every other holder, lets it go (a stream's, when its body ends).
    pub fn with_access(mut self, access: Arc<Access>) -> Self {
        self.access = Some(access);
        self
    }

    /// Reads each choice's output for tool calls with `reader` (chat only): the calls become
    /// `tool_calls` (streamed as deltas when they complete) and the finish reason `tool_calls`.
    pub fn with_calls(mut self, reader: CallReader) -> Self {
        if self.api == Api::Chat {
            for c in &mut self.choices {
                c.reader = Some(reader.clone());
            }
        }
        self
    }

    /// Returns `prompt` before each choice's text (completions' `echo`).
    pub fn with_echo(mut self, prompt: String) -> Self {
        self.echo = Some(prompt);
        self
    }

    /// Whether every choice has ended (or the request failed).
    pub fn finished(&self) -> bool {
        self.done == self.choices.len() || self.error.is_some()
    }

    /// The error the request failed with, if it did.
    pub fn error(&self) -> Option<&ApiError> {
        self.error.as_ref()
    }

    fn object(&self) -> &'static str {
        match (self.api, self.stream) {
            (Api::Chat, true) => "chat.completion.chunk",
            (Api::Chat, false) => "chat.completion",
            (Api::Completion, _) => "text_completion",
        }
    }

    fn chunk(&self, choices: Value, usage: Value) -> Bytes {
        let mut v = json!({
            "id": self.id, "object": self.object(), "created": self.created, "model": self.model,
            "system_fingerprint": null, "choices": choices,
        });
        if self.include_usage {
            v["usage"] = usage;
        }
        Bytes::from(format!("data: {v}\n\n"))
    }

    #[allow(clippy::too_many_arguments)]
    fn stream_choice(
        &self,
        index: usize,
        text: &str,
        call: Option<Value>,
        logprobs: Option<Value>,
        finish: Option<&str>,
        first: bool,
    ) -> Value {
        match self.api {
            Api::Chat => {
                let mut delta = json!({});
                if first {
                    delta["role"] = json!("assistant");
                }
                match call {
                    Some(c) => delta["tool_calls"] = json!([c]),
                    None if !text.is_empty() || (first && finish.is_none()) => delta["content"] = json!(text),
                    None => {}
                }
                json!({"index": index, "delta": delta, "logprobs": logprobs.map(|c| json!({"content": c})), "finish_reason": finish})
            }
            Api::Completion => {
                let echoed;
                let text = match (&self.echo, first) {
                    (Some(e), true) => {
                        echoed = format!("{e}{text}");
                        &echoed
                    }
                    _ => text,
                };
                let lp = logprobs.map(|c| legacy_logprobs(c.as_array().map_or(&[][..], |a| &a[..])));
                json!({"index": index, "text": text, "logprobs": lp, "finish_reason": finish})
            }
        }
    }

    fn usage(&self) -> Value {
        let completion: usize = self.choices.iter().map(|c| c.completion_tokens).sum();
        json!({
            "prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }

    /// Takes choice `index`'s next update; appends any SSE bytes it produces to `out`.
    pub fn push(&mut self, index: usize, u: Update, out: &mut VecDeque<Bytes>) {
        if self.finished() || self.choices.get(index).is_none_or(|c| c.finish.is_some()) {
            return;
        }
        if let Some(a) = &self.access {
            a.update(&u);
        }
        match u {
            Update::Token { text, token, logprobs } => {
                let lp = logprobs.map(|l| self.logprob_value(index, token, &l));
                let c = &mut self.choices[index];
                c.completion_tokens += 1;
                if self.stream {
                    let pieces = c.read(&text, false);
                    self.send(index, pieces, lp, None, out);
                } else {
                    c.text.push_str(&text);
                    c.logprobs.extend(lp);
                }
            }
            Update::Done { outcome, text, usage } => {
                self.prompt_tokens = usage.prompt_tokens;
                self.cached_tokens = self.cached_tokens.max(usage.cached_tokens);
                let finish = match outcome {
                    Outcome::Finished(f) => f.as_str(),
                    Outcome::Aborted(r) => {
                        self.fail(ApiError::from(&r), out);
                        return;
                    }
                };
                let c = &mut self.choices[index];
                c.completion_tokens = usage.completion_tokens;
                self.done += 1;
                if self.stream {
                    let pieces = c.read(&text, true);
                    // Calls the last pieces complete count too (a bare JSON call is only read
                    // at the end).
                    let more = pieces.iter().any(|p| matches!(p, Piece::Call(_)));
                    let finish = c.finish_reason(finish, more);
                    self.send(index, pieces, None, Some(finish), out);
                    if self.finished() {
                        if self.include_usage {
                            out.push_back(self.chunk(json!([]), self.usage()));
                        }
                        out.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
                    }
                } else {
                    c.text.push_str(&text);
                    if c.reader.is_some() {
                        let whole = std::mem::take(&mut c.text);
                        for p in c.read(&whole, true) {
                            match p {
                                Piece::Text(t) => c.text.push_str(&t),
                                Piece::Call(call) => c.calls.push(call.to_json(c.calls.len())),
                            }
                        }
                    }
                    c.finish_reason(finish, false);
                }
            }
            Update::Rejected(r) => self.fail(r.reason.into(), out),
            Update::Failed(f) => self.fail(ApiError::from(&f), out),
            Update::ShuttingDown => self.fail(ApiError::from(&AbortReason::Shutdown), out),
        }
    }

    /// Streams choice `index`'s `pieces` of output, the first with the token's `lp`; with
    /// `finish`, the last chunk carries it. A token that completes nothing still sends its
    /// log-probabilities, and a choice's first chunk its role.
    fn send(
        &mut self,
        index: usize,
        pieces: Vec<Piece>,
        mut lp: Option<Value>,
        finish: Option<&'static str>,
        out: &mut VecDeque<Bytes>,
    ) {
        let n = pieces.len();
        if n == 0 {
            let first = !self.choices[index].started;
            if first || lp.is_some() || finish.is_some() {
                self.choices[index].started = true;
                let ch = self.stream_choice(index, "", None, lp.map(|v| json!([v])), finish, first);
                out.push_back(self.chunk(json!([ch]), Value::Null));
            }
            return;
        }
        for (k, p) in pieces.into_iter().enumerate() {
            let c = &mut self.choices[index];
            let first = !c.started;
            c.started = true;
            let (text, call) = match p {
                Piece::Text(t) => (t, None),
                Piece::Call(call) => {
                    let v = call.to_json(c.calls.len());
                    c.calls.push(v.clone());
                    (String::new(), Some(v))
                }
            };
            let last = if k + 1 == n { finish } else { None };
            let ch = self.stream_choice(index, &text, call, lp.take().map(|v| json!([v])), last, first);
            out.push_back(self.chunk(json!([ch]), Value::Null));
        }
    }

    fn fail(&mut self, e: ApiError, out: &mut VecDeque<Bytes>) {
        if self.stream {
            out.push_back(Bytes::from(format!("data: {}\n\n", e.body())));
        }
        self.error = Some(e);
    }

    /// Choice `index`'s next token's log-probabilities, in its endpoint's per-token form.
    fn logprob_value(&mut self, index: usize, token: u32, l: &TokenLogprobs) -> Value {
        match self.api {
            Api::Chat => {
                let mut v = token_value(&self.tokenizer, token, l.logprob);
                v["top_logprobs"] =
                    Value::Array(l.top.iter().map(|&(t, p)| token_value(&self.tokenizer, t, p)).collect());
                v
            }
            Api::Completion => {
                let text = |t: u32| String::from_utf8_lossy(&self.tokenizer.token_bytes(t)).into_owned();
                let own = text(token);
                let top: serde_json::Map<String, Value> = l.top.iter().map(|&(t, p)| (text(t), json!(p))).collect();
                let c = &mut self.choices[index];
                let v = json!([own, l.logprob, top, c.offset]);
                c.offset += own.chars().count();
                v
            }
        }
    }

    /// The whole (non-streamed) response body.
    pub fn body(&self) -> Value {
        let choices: Vec<Value> = self
            .choices
            .iter()
            .enumerate()
            .map(|(i, c)| match self.api {
                Api::Chat => json!({
                    "index": i, "message": c.message(),
                    "logprobs": if c.logprobs.is_empty() { Value::Null } else { json!({"content": c.logprobs}) },
                    "finish_reason": c.finish,
                }),
                Api::Completion => json!({
                    "index": i, "text": format!("{}{}", self.echo.as_deref().unwrap_or(""), c.text),
                    "logprobs": if c.logprobs.is_empty() { Value::Null } else { legacy_logprobs(&c.logprobs) },
                    "finish_reason": c.finish,
                }),
            })
            .collect();
        json!({
            "id": self.id, "object": self.object(), "created": self.created, "model": self.model,
            "system_fingerprint": null, "choices": choices, "usage": self.usage(),
        })
    }
}

impl Choice {
    /// The choice's next `text` (the last, with `end`) as pieces of output: itself, or what its
    /// reader makes of it.
    fn read(&mut self, text: &str, end: bool) -> Vec<Piece> {
        let Some(r) = &mut self.reader else {
            return if text.is_empty() {
                Vec::new()
            } else {
                vec![Piece::Text(text.to_string())]
            };
        };
        let mut out = Vec::new();
        r.push(text, &mut out);
        if end {
            r.finish(&mut out);
        }
        out
    }

    /// Records the choice's end: `tool_calls` where a finished output made calls (`more`: calls
    /// not yet counted in `calls`).
    fn finish_reason(&mut self, finish: &'static str, more: bool) -> &'static str {
        let f = if finish == "stop" && (more || !self.calls.is_empty()) {
            "tool_calls"
        } else {
            finish
        };
        self.finish = Some(f);
        f
    }

    /// A whole chat response's message: its text, and its calls (with none, `content` is
    /// `null` when there is no text, as OpenAI's).
    fn message(&self) -> Value {
        if self.calls.is_empty() {
            return json!({"role": "assistant", "content": self.text});
        }
        let content = if self.text.is_empty() {
            Value::Null
        } else {
            json!(self.text)
        };
        json!({"role": "assistant", "content": content, "tool_calls": self.calls})
    }
}

/// The legacy completions' `logprobs` object from per-token `[token, logprob, top_logprobs,
/// text_offset]` entries: four parallel lists.
fn legacy_logprobs(tokens: &[Value]) -> Value {
    let column = |k: usize| Value::Array(tokens.iter().map(|t| t[k].clone()).collect());
    json!({"tokens": column(0), "token_logprobs": column(1), "top_logprobs": column(2), "text_offset": column(3)})
}

/// A streamed response body: SSE bytes as the engine produces them.
pub struct SseBody {
    rx: mpsc::UnboundedReceiver<(usize, Update)>,
    responder: Responder,
    pending: VecDeque<Bytes>,
    ended: bool,
}

impl SseBody {
    /// A body over `rx`, starting with what `responder` already produced (`pending`).
    pub fn new(rx: mpsc::UnboundedReceiver<(usize, Update)>, responder: Responder, pending: VecDeque<Bytes>) -> Self {
        let ended = responder.finished();
        Self {
            rx,
            responder,
            pending,
            ended,
        }
    }
}

impl Body for SseBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        loop {
            if !this.pending.is_empty() {
                // Coalesce what is ready into one frame.
                let mut buf = Vec::new();
                while let Some(b) = this.pending.pop_front() {
                    buf.extend_from_slice(&b);
                }
                return Poll::Ready(Some(Ok(Frame::data(Bytes::from(buf)))));
            }
            if this.ended {
                return Poll::Ready(None);
            }
            match this.rx.poll_recv(cx) {
                Poll::Ready(Some((i, u))) => {
                    this.responder.push(i, u, &mut this.pending);
                    while let Ok((i, u)) = this.rx.try_recv() {
                        this.responder.push(i, u, &mut this.pending);
                    }
                    this.ended = this.responder.finished();
                }
                Poll::Ready(None) => {
                    // The engine dropped the request without a last update: say so, once.
                    if !this.responder.finished() {
                        let e = ApiError::from(&AbortReason::Shutdown);
                        this.pending.push_back(Bytes::from(format!("data: {}\n\n", e.body())));
                    }
                    this.ended = true;
                }
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::request::{FinishReason, RejectReason, Rejected, Usage};

    fn events(out: &VecDeque<Bytes>) -> Vec<Value> {
        out.iter()
            .map(|b| {
                let s = std::str::from_utf8(b).unwrap();
                let d = s.strip_prefix("data: ").unwrap().trim_end();
                if d == "[DONE]" {
                    json!("[DONE]")
                } else {
                    serde_json::from_str(d).unwrap()
                }
            })
            .collect()
    }

    fn tok(text: &str) -> Update {
        Update::Token {
            text: text.into(),
            token: 7,
            logprobs: None,
        }
    }

    fn done(f: FinishReason, completion: usize) -> Update {
        Update::Done {
            outcome: Outcome::Finished(f),
            text: String::new(),
            usage: Usage {
                prompt_tokens: 5,
                completion_tokens: completion,
                cached_tokens: 0,
            },
        }
    }

    #[test]
    fn chat_stream_chunks_roles_finishes_usage_and_done() {
        let tk = crate::testutil::tokenizer();
        let mut r = Responder::new(Api::Chat, "m", 2, true, true, tk, "id".into(), 1);
        let mut out = VecDeque::new();
        r.push(0, tok("Hel"), &mut out);
        r.push(1, tok("Yo"), &mut out);
        r.push(0, tok("lo"), &mut out);
        r.push(0, done(FinishReason::Stop, 2), &mut out);
        assert!(!r.finished());
        r.push(1, done(FinishReason::Length, 1), &mut out);
        assert!(r.finished() && r.error().is_none());
        let ev = events(&out);
        assert_eq!(
            ev[0]["choices"][0]["delta"],
            json!({"role": "assistant", "content": "Hel"})
        );
        assert_eq!(ev[0]["object"], "chat.completion.chunk");
        assert_eq!(ev[1]["choices"][0]["index"], 1);
        assert_eq!(ev[2]["choices"][0]["delta"], json!({"content": "lo"}));
        assert_eq!(ev[3]["choices"][0]["finish_reason"], "stop");
        assert_eq!(ev[4]["choices"][0]["finish_reason"], "length");
        assert_eq!(ev[5]["choices"], json!([]));
        assert_eq!(ev[5]["usage"]["completion_tokens"], 3);
        assert_eq!(ev[5]["usage"]["prompt_tokens"], 5);
        assert_eq!(ev[6], "[DONE]");
        assert!(ev[..5].iter().all(|e| e["usage"].is_null()));
    }

    #[test]
    fn whole_bodies_carry_text_logprobs_and_usage() {
        let tk = crate::testutil::tokenizer();
        let mut r = Responder::new(Api::Chat, "m", 1, false, false, tk.clone(), "id".into(), 1);
        let mut out = VecDeque::new();
        let lp = TokenLogprobs {
            logprob: -0.5,
            top: vec![(7, -0.5), (8, -1.5)],
        };
        r.push(
            0,
            Update::Token {
                text: "a".into(),
                token: 7,
                logprobs: Some(lp),
            },
            &mut out,
        );
        r.push(0, done(FinishReason::Stop, 1), &mut out);
        assert!(out.is_empty());
        let b = r.body();
        assert_eq!(b["object"], "chat.completion");
        assert_eq!(b["choices"][0]["message"]["content"], "a");
        assert_eq!(b["choices"][0]["finish_reason"], "stop");
        let c = &b["choices"][0]["logprobs"]["content"][0];
        assert_eq!(c["logprob"], -0.5);
        assert_eq!(
            c["top_logprobs"][1]["token"],
            String::from_utf8_lossy(&tk.token_bytes(8)).as_ref()
        );
        assert_eq!(b["usage"]["total_tokens"], 6);
        let mut r = Responder::new(Api::Completion, "m", 1, false, false, tk, "id".into(), 1);
        r.push(0, tok("x"), &mut out);
        r.push(0, done(FinishReason::Length, 1), &mut out);
        assert_eq!(r.body()["choices"][0]["text"], "x");
        assert_eq!(r.body()["object"], "text_completion");
    }

    /// Completions' legacy logprobs (four parallel lists, offsets by characters) and `echo`,
    /// whole and streamed.
    #[test]
    fn completions_carry_legacy_logprobs_and_echo() {
        let tk = crate::testutil::tokenizer();
        let text = |id: u32| String::from_utf8_lossy(&tk.token_bytes(id)).into_owned();
        let lp = |id: u32| Update::Token {
            text: text(id),
            token: id,
            logprobs: Some(TokenLogprobs {
                logprob: -0.25,
                top: vec![(id, -0.25), (9, -2.0)],
            }),
        };
        for stream in [false, true] {
            let mut r = Responder::new(Api::Completion, "m", 1, stream, false, tk.clone(), "id".into(), 1)
                .with_echo("Q:".into());
            let mut out = VecDeque::new();
            r.push(0, lp(7), &mut out);
            r.push(0, lp(8), &mut out);
            r.push(0, done(FinishReason::Length, 2), &mut out);
            let (full, lps) = if stream {
                let ev = events(&out);
                let chunks: Vec<&Value> = ev.iter().filter(|e| e.is_object()).collect();
                let full: String = chunks
                    .iter()
                    .map(|c| c["choices"][0]["text"].as_str().unwrap())
                    .collect();
                let lps: Vec<Value> = chunks.iter().map(|c| c["choices"][0]["logprobs"].clone()).collect();
                assert!(lps[2].is_null(), "the finish chunk has no token");
                (full, lps[..2].to_vec())
            } else {
                let b = r.body();
                (
                    b["choices"][0]["text"].as_str().unwrap().to_string(),
                    vec![b["choices"][0]["logprobs"].clone()],
                )
            };
            assert_eq!(full, format!("Q:{}{}", text(7), text(8)), "stream: {stream}");
            let tokens: Vec<Value> = lps
                .iter()
                .flat_map(|l| l["tokens"].as_array().unwrap().clone())
                .collect();
            let offsets: Vec<Value> = lps
                .iter()
                .flat_map(|l| l["text_offset"].as_array().unwrap().clone())
                .collect();
            assert_eq!(tokens, [json!(text(7)), json!(text(8))]);
            assert_eq!(offsets, [json!(0), json!(text(7).chars().count())]);
            assert_eq!(lps[0]["token_logprobs"][0], -0.25);
            assert_eq!(lps[0]["top_logprobs"][0][text(9)], -2.0);
        }
    }

    /// With tools, calls in the output become `tool_calls` with finish reason `tool_calls`:
    /// whole, and streamed as one delta per call after the text before it.
    #[test]
    fn tool_calls_whole_and_streamed() {
        let tk = crate::testutil::tokenizer();
        let defs = serde_json::from_value(json!([{"type": "function", "function": {"name": "f"}}])).unwrap();
        let tools = crate::serve::tools::Tools::new(Some(defs), None, None)
            .unwrap()
            .unwrap();
        let out_text = [
            "One moment.\n<tool_",
            "call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>",
            "\n",
        ];
        let mut r = Responder::new(Api::Chat, "m", 1, false, false, tk.clone(), "id".into(), 1)
            .with_calls(tools.reader().unwrap());
        let mut out = VecDeque::new();
        for t in out_text {
            r.push(0, tok(t), &mut out);
        }
        r.push(0, done(FinishReason::Stop, 3), &mut out);
        let b = r.body();
        let m = &b["choices"][0]["message"];
        assert_eq!(m["content"], "One moment.");
        assert_eq!(
            m["tool_calls"][0]["function"],
            json!({"name": "f", "arguments": "{\"x\":1}"})
        );
        assert_eq!(m["tool_calls"][0]["type"], "function");
        assert_eq!(b["choices"][0]["finish_reason"], "tool_calls");
        let mut r = Responder::new(Api::Chat, "m", 1, true, false, tk.clone(), "id".into(), 1)
            .with_calls(tools.reader().unwrap());
        let mut out = VecDeque::new();
        for t in out_text {
            r.push(0, tok(t), &mut out);
        }
        r.push(0, done(FinishReason::Stop, 3), &mut out);
        let ev = events(&out);
        let deltas: Vec<&Value> = ev
            .iter()
            .filter(|e| e.is_object())
            .map(|e| &e["choices"][0]["delta"])
            .collect();
        assert_eq!(deltas[0], &json!({"role": "assistant", "content": "One moment."}));
        let call = &deltas[1]["tool_calls"][0];
        assert_eq!(
            (call["index"].as_u64(), call["function"]["arguments"].as_str()),
            (Some(0), Some("{\"x\":1}"))
        );
        assert!(call["id"].as_str().unwrap().starts_with("call_"));
        assert!(deltas[1].get("content").is_none());
        assert_eq!(
            ev.iter().rfind(|e| e.is_object()).unwrap()["choices"][0]["finish_reason"],
            "tool_calls"
        );
        // A bare JSON call, read only at the end, streams as a call and finishes as one.
        let mut r = Responder::new(Api::Chat, "m", 1, true, false, tk.clone(), "id".into(), 1)
            .with_calls(tools.reader().unwrap());
        let mut out = VecDeque::new();
        r.push(0, tok("{\"name\": \"f\","), &mut out);
        r.push(0, tok(" \"arguments\": {}}"), &mut out);
        r.push(0, done(FinishReason::Stop, 2), &mut out);
        let ev = events(&out);
        let last = ev.iter().rfind(|e| e.is_object()).unwrap();
        assert_eq!(last["choices"][0]["finish_reason"], "tool_calls", "{ev:?}");
        assert_eq!(last["choices"][0]["delta"]["tool_calls"][0]["function"]["name"], "f");
        // Output that makes no call stays text, finished as it finished; with no text at all,
        // a whole message's content is "" (and null only beside calls).
        let mut r =
            Responder::new(Api::Chat, "m", 1, false, false, tk, "id".into(), 1).with_calls(tools.reader().unwrap());
        r.push(0, tok("{\"name\": \"g\"}"), &mut out);
        r.push(0, done(FinishReason::Length, 1), &mut out);
        let b = r.body();
        assert_eq!(
            b["choices"][0]["message"],
            json!({"role": "assistant", "content": "{\"name\": \"g\"}"})
        );
        assert_eq!(b["choices"][0]["finish_reason"], "length");
    }

    #[test]
    fn rejections_and_aborts_become_errors() {
        let tk = crate::testutil::tokenizer();
        let mut r = Responder::new(Api::Chat, "m", 1, true, false, tk.clone(), "id".into(), 1);
        let mut out = VecDeque::new();
        r.push(
            0,
            Update::Rejected(Rejected {
                reason: RejectReason::QueueFull { limit: 3 },
            }),
            &mut out,
        );
        assert!(r.finished());
        assert_eq!(r.error().unwrap().status, hyper::StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(events(&out)[0]["error"]["code"], "queue_full");
        let mut r = Responder::new(Api::Chat, "m", 1, false, false, tk, "id".into(), 1);
        r.push(
            0,
            Update::Done {
                outcome: Outcome::Aborted(AbortReason::Isolation(
                    warden_kernels::tag::IsolationViolation::ForeignOwner {
                        page: 1,
                        expected: crate::testutil::tenant(3).into(),
                        found: crate::testutil::tenant(2).into(),
                    },
                )),
                text: String::new(),
                usage: Usage::default(),
            },
            &mut out,
        );
        let e = r.error().unwrap();
        assert_eq!(e.code, "isolation_violation");
        assert!(!e.message.contains("owner 2"), "the error names no other tenant");
    }
}
