//! Chat templates: the Jinja template a model ships in `tokenizer.chat_template`, rendered with
//! minijinja the way Hugging Face's `apply_chat_template` renders it.
//!
//! The template sees `messages` (a list of `{role, content}` maps), `add_generation_prompt`,
//! `bos_token` and `eos_token`, and can call `raise_exception(message)`. The environment matches
//! Hugging Face's: `trim_blocks` and `lstrip_blocks` on, `{% break %}`/`{% continue %}`, `tojson`,
//! and Python string, list and dict methods (`.strip()`, `.startswith()`, `.items()`, ...).
//!
//! A template comes from a model file, so rendering is bounded: every render gets a fixed amount
//! of fuel (minijinja instructions), recursion is capped, and output past a size limit is an
//! error ([`ChatLimits`]). Those bound time spent in loops and the size of the prompt; they do not
//! bound memory a template allocates in single operations (a string doubled by `~` in a macro
//! recursion grows exponentially on little fuel), so a file from an untrusted source should be
//! rendered where its memory is capped too.
//!
//! ```no_run
//! use warden::chat::{ChatMessage, ChatTemplate};
//! let gguf = warden::gguf::Gguf::open("models/SmolLM2-135M-Instruct.Q4_1.gguf").unwrap();
//! let template = ChatTemplate::from_gguf(&gguf).unwrap().expect("SmolLM2 ships a template");
//! let prompt = template.render(&[ChatMessage::new("user", "Hi")], true).unwrap();
//! assert!(prompt.ends_with("<|im_start|>assistant\n"));
//! ```

use std::io;

use minijinja::{Environment, Error, ErrorKind, context};
use serde::{Deserialize, Serialize};

use crate::gguf::{Gguf, Value};

const KEY_TEMPLATE: &str = "tokenizer.chat_template";
const TEMPLATE_NAME: &str = "chat_template";

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// Who speaks: `system`, `user`, `assistant`, `tool`, or whatever roles the template knows.
    pub role: String,
    /// What they say.
    pub content: String,
    /// An assistant's calls of the request's tools, as templates that render tools expect them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
    /// A `tool` message's answer is to this call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    /// A message from `role` saying `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
        }
    }
}

/// One call of a function, as a template sees it: `{id, type: "function", function: {name,
/// arguments}}` with the arguments as a JSON value (as vLLM and Hugging Face pass them), not the
/// string the wire carries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The call's id.
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: String,
    /// What is called, with what.
    pub function: FunctionCall,
}

/// A called function's name and arguments.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FunctionCall {
    /// The function's name.
    pub name: String,
    /// Its arguments (usually an object).
    pub arguments: serde_json::Value,
}

/// What went wrong reading or rendering a chat template.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ChatError {
    /// `tokenizer.chat_template` is not a string.
    #[error("metadata key \"tokenizer.chat_template\" should be a string, found {0}")]
    WrongType(&'static str),
    /// A template source longer than [`ChatLimits::max_template_bytes`].
    #[error("chat template is {len} bytes, more than the {limit} accepted")]
    TemplateTooLarge {
        /// Its length.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// The template does not parse.
    #[error("chat template does not compile: {0}")]
    Syntax(String),
    /// The template failed while rendering (minijinja's message).
    #[error("chat template failed: {0}")]
    Render(String),
    /// The template called `raise_exception(message)`.
    #[error("chat template raised an exception: {0}")]
    Raised(String),
    /// The render used more than [`ChatLimits::fuel`] instructions.
    #[error("chat template ran out of fuel ({0} instructions)")]
    OutOfFuel(u64),
    /// The rendered prompt grew past [`ChatLimits::max_output_bytes`].
    #[error("rendered chat prompt is longer than {0} bytes")]
    OutputTooLarge(usize),
}

/// Bounds on a template and on one render.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChatLimits {
    /// Largest template source accepted, in bytes. Default 1 MiB (real templates are under 20 KiB).
    pub max_template_bytes: usize,
    /// minijinja instructions one render may run. Default 5,000,000: a few hundred per message
    /// for the most elaborate templates, so thousands of messages fit.
    pub fuel: u64,
    /// Largest rendered prompt, in bytes. Default 16 MiB.
    pub max_output_bytes: usize,
    /// Deepest nesting of macro calls, includes and blocks. Default 100.
    pub recursion: usize,
}

impl Default for ChatLimits {
    fn default() -> Self {
        Self {
            max_template_bytes: 1 << 20,
            fuel: 5_000_000,
            max_output_bytes: 16 << 20,
            recursion: 100,
        }
    }
}

/// The error `raise_exception` returns, recognised again when the render fails.
#[derive(Debug)]
struct RaisedException(String);

impl std::fmt::Display for RaisedException {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedException {}

/// A compiled chat template with the BOS and EOS texts it is rendered with.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The source mentions `tools`: it renders a request's tools itself.
    renders_tools: bool,
    bos: String,
    eos: String,
    limits: ChatLimits,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

/// The text of token `key` names in the vocabulary, or "" when the id or vocabulary is absent or
/// malformed (the tokenizer reports those; a template only needs the text).
fn token_text(gguf: &Gguf, key: &str) -> String {
    let Some(id) = gguf.get(key).and_then(Value::as_u64) else {
        return String::new();
    };
    let Ok(tokens) = gguf.get_array("tokenizer.ggml.tokens") else {
        return String::new();
    };
    match usize::try_from(id).ok().and_then(|i| tokens.get(i)) {
        Some(Value::String(s)) => s.clone(),
        _ => String::new(),
    }
}

impl ChatTemplate {
    /// The template in `tokenizer.chat_template`, with the texts of `tokenizer.ggml.bos_token_id`
    /// and `eos_token_id` as `bos_token` and `eos_token`; `None` when the file has no template.
    pub fn from_gguf(gguf: &Gguf) -> Result<Option<Self>, ChatError> {
        let source = match gguf.get(KEY_TEMPLATE) {
            None => return Ok(None),
            Some(Value::String(s)) => s,
            Some(v) => return Err(ChatError::WrongType(v.type_name())),
        };
        let bos = token_text(gguf, "tokenizer.ggml.bos_token_id");
        let eos = token_text(gguf, "tokenizer.ggml.eos_token_id");
        Self::new(source, bos, eos).map(Some)
    }

    /// Compiles `source` with the default [`ChatLimits`].
    pub fn new(source: &str, bos: String, eos: String) -> Result<Self, ChatError> {
        Self::with_limits(source, bos, eos, ChatLimits::default())
    }

    /// Compiles `source`, to be rendered within `limits`.
    pub fn with_limits(source: &str, bos: String, eos: String, limits: ChatLimits) -> Result<Self, ChatError> {
        if source.len() > limits.max_template_bytes {
            return Err(ChatError::TemplateTooLarge {
                len: source.len(),
                limit: limits.max_template_bytes,
            });
        }
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(limits.fuel));
        env.set_recursion_limit(limits.recursion);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        // Its output is capped like the whole render's: it is built before the render's own cap
        // sees it, and an indent multiplies what a request's JSON (tools, arguments) makes.
        let cap = limits.max_output_bytes;
        env.add_filter(
            "tojson",
            move |value: minijinja::Value, kwargs: minijinja::value::Kwargs| tojson(value, kwargs, cap),
        );
        env.add_function(
            "raise_exception",
            |message: String| -> Result<minijinja::Value, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, "raise_exception called")
                    .with_source(RaisedException(message)))
            },
        );
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| ChatError::Syntax(e.to_string()))?;
        Ok(Self {
            env,
            renders_tools: source.contains("tools"),
            bos,
            eos,
            limits,
        })
    }

    /// The `bos_token` the template sees.
    pub fn bos_token(&self) -> &str {
        &self.bos
    }

    /// The `eos_token` the template sees.
    pub fn eos_token(&self) -> &str {
        &self.eos
    }

    /// Whether the template renders tools (its source uses `tools`, as the templates of models
    /// trained to call functions do); one that does not is given them as text by the caller.
    pub fn renders_tools(&self) -> bool {
        self.renders_tools
    }

    /// The prompt for `messages`; with `add_generation_prompt`, followed by whatever the template
    /// writes to start the assistant's reply.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, ChatError> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// [`render`](Self::render), with `tools` (OpenAI's list of `{type: "function", function}`
    /// objects, as Hugging Face passes it) for a template that [renders tools](Self::renders_tools).
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| ChatError::Render(e.to_string()))?;
        let ctx = context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos,
            eos_token => &self.eos,
        };
        let mut out = Capped {
            buf: Vec::new(),
            limit: self.limits.max_output_bytes,
            overflow: false,
        };
        let result = template.render_captured_to(ctx, &mut out).map(|_| ());
        match result {
            Ok(()) => Ok(String::from_utf8_lossy(&out.buf).into_owned()),
            Err(e) => Err(self.classify(e, out.overflow)),
        }
    }

    fn classify(&self, e: Error, overflow: bool) -> ChatError {
        if overflow {
            return ChatError::OutputTooLarge(self.limits.max_output_bytes);
        }
        if e.kind() == ErrorKind::OutOfFuel {
            return ChatError::OutOfFuel(self.limits.fuel);
        }
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            if let Some(RaisedException(message)) = s.downcast_ref::<RaisedException>() {
                return ChatError::Raised(message.clone());
            }
            source = s.source();
        }
        ChatError::Render(e.to_string())
    }
}

/// `tojson` as Hugging Face defines it for chat templates: Python's `json.dumps` (`", "` and
/// `": "` between items, or `","` with an `indent`; non-ASCII kept unless `ensure_ascii`), with
/// its `indent`, `separators`, `sort_keys` and `ensure_ascii` arguments, and no HTML escaping
/// (minijinja's own escapes `<`, which would change how tools are shown to the model).
/// What it writes is at most `cap` bytes (more is an error, as the render's own cap makes it).
fn tojson(value: minijinja::Value, kwargs: minijinja::value::Kwargs, cap: usize) -> Result<minijinja::Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let (item, key) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair of strings",
            ));
        }
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let v = serde_json::to_value(&value).map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let style = PyJson {
        indent,
        item,
        key,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
        cap,
    };
    let mut out = String::new();
    style.write(&v, 0, &mut out).map_err(|TooLong| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: the JSON is longer than {cap} bytes"),
        )
    })?;
    Ok(minijinja::Value::from_safe_string(out))
}

/// How Python's `json.dumps` lays JSON out, within `cap` bytes.
struct PyJson {
    indent: Option<usize>,
    item: String,
    key: String,
    sort_keys: bool,
    ensure_ascii: bool,
    cap: usize,
}

/// The JSON would pass its cap.
struct TooLong;

impl PyJson {
    fn write(&self, v: &serde_json::Value, depth: usize, out: &mut String) -> Result<(), TooLong> {
        use serde_json::Value as J;
        if out.len() > self.cap {
            return Err(TooLong);
        }
        match v {
            J::Array(items) if !items.is_empty() => {
                out.push('[');
                for (i, x) in items.iter().enumerate() {
                    self.separate(i, depth + 1, out)?;
                    self.write(x, depth + 1, out)?;
                }
                self.close(depth, out)?;
                out.push(']');
            }
            J::Object(map) if !map.is_empty() => {
                let mut entries: Vec<(&String, &serde_json::Value)> = map.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, x)) in entries.into_iter().enumerate() {
                    self.separate(i, depth + 1, out)?;
                    self.string(k, out);
                    out.push_str(&self.key);
                    self.write(x, depth + 1, out)?;
                }
                self.close(depth, out)?;
                out.push('}');
            }
            J::String(s) => self.string(s, out),
            other => out.push_str(&other.to_string()),
        }
        if out.len() > self.cap { Err(TooLong) } else { Ok(()) }
    }

    fn separate(&self, i: usize, depth: usize, out: &mut String) -> Result<(), TooLong> {
        if i > 0 {
            out.push_str(&self.item);
        }
        self.close(depth, out)
    }

    /// A new line and the indent of `depth`, when indenting.
    fn close(&self, depth: usize, out: &mut String) -> Result<(), TooLong> {
        if let Some(n) = self.indent {
            let width = n
                .checked_mul(depth)
                .filter(|w| out.len().saturating_add(*w) < self.cap)
                .ok_or(TooLong)?;
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', width));
        }
        Ok(())
    }

    fn string(&self, s: &str, out: &mut String) {
        let quoted = serde_json::Value::String(s.to_string()).to_string();
        if !self.ensure_ascii {
            out.push_str(&quoted);
            return;
        }
        for c in quoted.chars() {
            if c.is_ascii() {
                out.push(c);
            } else {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
        }
    }
}

/// An output buffer that refuses to grow past `limit`.
struct Capped {
    buf: Vec<u8>,
    limit: usize,
    overflow: bool,
}

impl io::Write for Capped {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if self.buf.len().saturating_add(data.len()) > self.limit {
            self.overflow = true;
            return Err(io::Error::other("rendered prompt too large"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::writer::GgufWriter;
    use std::path::PathBuf;

    fn smollm_gguf() -> Gguf {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
        assert!(
            path.exists(),
            "model missing: run scripts/fetch-model.sh ({})",
            path.display()
        );
        Gguf::open(&path).unwrap()
    }

    fn msgs(v: &[(&str, &str)]) -> Vec<ChatMessage> {
        v.iter().map(|(r, c)| ChatMessage::new(*r, *c)).collect()
    }

    #[test]
    fn chat_template_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<ChatTemplate>();
        check::<ChatMessage>();
    }

    #[test]
    fn smollm_template_adds_the_default_system_prompt() {
        let t = ChatTemplate::from_gguf(&smollm_gguf()).unwrap().unwrap();
        assert_eq!(t.bos_token(), "<|im_start|>");
        assert_eq!(t.eos_token(), "<|im_end|>");
        assert_eq!(
            t.render(&msgs(&[("user", "Hi")]), true).unwrap(),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            t.render(&msgs(&[("user", "Hi")]), false).unwrap(),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nHi<|im_end|>\n"
        );
    }

    #[test]
    fn smollm_template_keeps_a_given_system_prompt() {
        let t = ChatTemplate::from_gguf(&smollm_gguf()).unwrap().unwrap();
        let conv = msgs(&[
            ("system", "Be brief."),
            ("user", "2+2?"),
            ("assistant", "4"),
            ("user", "  and {{ 3+3 }}?\n"),
        ]);
        assert_eq!(
            t.render(&conv, true).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n\
             <|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\n  and {{ 3+3 }}?\n<|im_end|>\n\
             <|im_start|>assistant\n"
        );
        assert_eq!(t.render(&[], true).unwrap(), "<|im_start|>assistant\n");
    }

    #[test]
    fn smollm_prompt_tokenizes_with_its_control_tokens() {
        let g = smollm_gguf();
        let t = ChatTemplate::from_gguf(&g).unwrap().unwrap();
        let tok = crate::tokenizer::Tokenizer::from_gguf(&g).unwrap();
        let ids = tok.encode(&t.render(&msgs(&[("user", "Hi")]), true).unwrap(), true);
        assert_eq!(ids.iter().filter(|&&i| i == 1).count(), 3); // <|im_start|>
        assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 2); // <|im_end|>
        assert_eq!(ids.first(), Some(&1));
    }

    #[test]
    fn absent_or_mistyped_template_key() {
        let g = Gguf::from_bytes(GgufWriter::default().build()).unwrap();
        assert!(ChatTemplate::from_gguf(&g).unwrap().is_none());
        let g = Gguf::from_bytes(GgufWriter::default().kv(KEY_TEMPLATE, Value::U32(3)).build()).unwrap();
        assert_eq!(ChatTemplate::from_gguf(&g).unwrap_err(), ChatError::WrongType("u32"));
        // Without a vocabulary the special texts are empty, not an error.
        let g = Gguf::from_bytes(
            GgufWriter::default()
                .kv(KEY_TEMPLATE, Value::String("{{ bos_token }}|{{ eos_token }}".into()))
                .kv("tokenizer.ggml.bos_token_id", Value::U32(99))
                .build(),
        )
        .unwrap();
        assert_eq!(
            ChatTemplate::from_gguf(&g)
                .unwrap()
                .unwrap()
                .render(&[], false)
                .unwrap(),
            "|"
        );
    }

    #[test]
    fn templates_see_bos_eos_and_python_methods() {
        let src = "{{ bos_token }}{% for m in messages %}{% if m.role.startswith('us') %}\
                   [{{ m['content'].strip().upper() }}]{% else %}{{ m.content | tojson }}{% endif %}\
                   {% if loop.last %}{% break %}{% endif %}{% endfor %}{{ eos_token }}";
        let t = ChatTemplate::new(src, "<s>".into(), "</s>".into()).unwrap();
        let out = t
            .render(&msgs(&[("user", "  hi "), ("assistant", "a\"b")]), false)
            .unwrap();
        assert_eq!(out, "<s>[HI]\"a\\\"b\"</s>");
    }

    #[test]
    fn block_whitespace_is_trimmed_like_hugging_face() {
        let src = "{% for m in messages %}\n    {{ m.content }}\n{% endfor %}\n";
        let t = ChatTemplate::new(src, String::new(), String::new()).unwrap();
        assert_eq!(
            t.render(&msgs(&[("user", "a"), ("user", "b")]), false).unwrap(),
            "    a\n    b\n"
        );
    }

    /// A template that renders tools gets the request's list and each message's calls and
    /// call id, as Hugging Face's `apply_chat_template` passes them.
    #[test]
    fn templates_that_render_tools_see_them() {
        let src = "{% if tools %}[{% for t in tools %}{{ t.function.name }};{% endfor %}]{% endif %}\
                   {% for m in messages %}{{ m.role }}:{{ m.content }}\
                   {% if m.tool_calls %}{% for c in m.tool_calls %}<{{ c.function.name }} {{ c.function.arguments | tojson }} {{ c.id }}>{% endfor %}{% endif %}\
                   {% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}|{% endfor %}";
        let t = ChatTemplate::new(src, String::new(), String::new()).unwrap();
        assert!(t.renders_tools());
        let mut call = ChatMessage::new("assistant", "");
        call.tool_calls = Some(vec![ToolCall {
            id: "c1".into(),
            kind: "function".into(),
            function: FunctionCall {
                name: "f".into(),
                arguments: serde_json::json!({"a": 1}),
            },
        }]);
        let mut result = ChatMessage::new("tool", "ok");
        result.tool_call_id = Some("c1".into());
        let tools = serde_json::json!([{"type": "function", "function": {"name": "f"}}]);
        let out = t
            .render_with_tools(&[ChatMessage::new("user", "go"), call, result], Some(&tools), false)
            .unwrap();
        assert_eq!(out, "[f;]user:go|assistant:<f {\"a\": 1} c1>|tool:ok(c1)|");
    }

    /// `tojson` writes what Python's `json.dumps` writes, as Hugging Face's templates expect.
    #[test]
    fn tojson_is_pythons() {
        let render = |src: &str| {
            ChatTemplate::new(src, String::new(), String::new())
                .unwrap()
                .render(&[], false)
                .unwrap()
        };
        let v = "{% set v = {'b': [1, 2.5, 'é<&>'], 'a': {}, 'c': [], 'd': none, 'e': true} %}";
        assert_eq!(
            render(&format!("{v}{{{{ v | tojson }}}}")),
            r#"{"b": [1, 2.5, "é<&>"], "a": {}, "c": [], "d": null, "e": true}"#
        );
        assert_eq!(
            render(&format!("{v}{{{{ v | tojson(indent=2, sort_keys=true) }}}}")),
            "{\n  \"a\": {},\n  \"b\": [\n    1,\n    2.5,\n    \"é<&>\"\n  ],\n  \"c\": [],\n  \"d\": null,\n  \"e\": true\n}"
        );
        assert_eq!(
            render(&format!(
                "{v}{{{{ v.b | tojson(separators=[',', ':'], ensure_ascii=true) }}}}"
            )),
            r#"[1,2.5,"\u00e9<&>"]"#
        );
        let t = ChatTemplate::new("{{ 1 | tojson(colour=1) }}", String::new(), String::new()).unwrap();
        assert!(t.render(&[], false).is_err());
        // What it writes is capped like the render: a deep indent fails, it does not grow.
        let limits = ChatLimits {
            max_output_bytes: 1000,
            ..ChatLimits::default()
        };
        let deep = "{% set v = [[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]] %}{{ v | tojson(indent=40) }}";
        let t = ChatTemplate::with_limits(deep, String::new(), String::new(), limits).unwrap();
        assert!(matches!(t.render(&[], false), Err(ChatError::Render(m)) if m.contains("longer than 1000")));
        let t = ChatTemplate::new(
            "{{ [1] | tojson(indent=18446744073709551615) }}",
            String::new(),
            String::new(),
        )
        .unwrap();
        assert!(t.render(&[], false).is_err(), "an indent past usize fails, never wraps");
        assert!(
            !ChatTemplate::new("{{ messages }}", String::new(), String::new())
                .unwrap()
                .renders_tools()
        );
    }

    #[test]
    fn raise_exception_becomes_an_error() {
        let src =
            "{% if messages[0].role != 'system' %}{{ raise_exception('first message must be system') }}{% endif %}ok";
        let t = ChatTemplate::new(src, String::new(), String::new()).unwrap();
        assert_eq!(
            t.render(&msgs(&[("user", "x")]), false).unwrap_err(),
            ChatError::Raised("first message must be system".into())
        );
        assert_eq!(t.render(&msgs(&[("system", "x")]), false).unwrap(), "ok");
    }

    #[test]
    fn template_errors_carry_minijinja_messages() {
        let e = ChatTemplate::new("{% for %}", String::new(), String::new()).unwrap_err();
        assert!(matches!(&e, ChatError::Syntax(m) if m.contains("syntax error")), "{e}");
        let t = ChatTemplate::new("{{ messages[0].content + 1 }}", String::new(), String::new()).unwrap();
        let e = t.render(&msgs(&[("user", "x")]), false).unwrap_err();
        assert!(
            matches!(&e, ChatError::Render(m) if m.contains("invalid operation")),
            "{e}"
        );
        let t = ChatTemplate::new("{{ 'a'.no_such_method() }}", String::new(), String::new()).unwrap();
        assert!(matches!(t.render(&[], false), Err(ChatError::Render(m)) if m.contains("unknown method")));
    }

    #[test]
    fn runaway_templates_are_stopped() {
        let none = || (String::new(), String::new());
        // A loop that would run 10^15 iterations runs out of fuel.
        let (b, e) = none();
        let spin = "{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}\
                    {% endfor %}{% endfor %}{% endfor %}";
        let t = ChatTemplate::new(spin, b, e).unwrap();
        let started = std::time::Instant::now();
        assert_eq!(t.render(&[], false).unwrap_err(), ChatError::OutOfFuel(5_000_000));
        assert!(started.elapsed() < std::time::Duration::from_secs(30));
        // Unbounded recursion hits the recursion limit.
        let (b, e) = none();
        let t = ChatTemplate::new("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", b, e).unwrap();
        assert!(matches!(t.render(&[], false), Err(ChatError::Render(_))));
        // Huge output is cut off at the limit.
        let limits = ChatLimits {
            max_output_bytes: 1000,
            ..ChatLimits::default()
        };
        let (b, e) = none();
        let t = ChatTemplate::with_limits("{% for i in range(2000) %}x{% endfor %}", b, e, limits).unwrap();
        assert_eq!(t.render(&[], false).unwrap_err(), ChatError::OutputTooLarge(1000));
        let (b, e) = none();
        let t = ChatTemplate::with_limits("{{ 'x' * 5000 }}", b, e, limits).unwrap();
        assert_eq!(t.render(&[], false).unwrap_err(), ChatError::OutputTooLarge(1000));
        let (b, e) = none();
        let t = ChatTemplate::with_limits("{{ 'x' * 1000 }}", b, e, limits).unwrap();
        assert_eq!(t.render(&[], false).unwrap().len(), 1000);
        // And an oversized template is refused before compiling.
        let big = "x".repeat(2 << 20);
        assert!(matches!(
            ChatTemplate::new(&big, String::new(), String::new()),
            Err(ChatError::TemplateTooLarge { .. })
        ));
    }

    #[test]
    fn messages_deserialize_from_openai_style_json() {
        let m: Vec<ChatMessage> =
            serde_json::from_str(r#"[{"role":"user","content":"Hi"},{"role":"assistant","content":"Yo"}]"#).unwrap();
        assert_eq!(m, msgs(&[("user", "Hi"), ("assistant", "Yo")]));
        assert!(serde_json::from_str::<ChatMessage>(r#"{"role":"user"}"#).is_err());
    }
}
