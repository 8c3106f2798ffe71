//! Tools: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` checked into [`Tools`]; the
//! conversation a template that does not render tools is given instead ([`conversation`]); the
//! grammar that makes `required` and a named function hold ([`Tools::format`]); and the model's
//! output read back into calls ([`CallReader`]).
//!
//! Calls are written in the convention Hermes and Qwen templates use: each a JSON object
//! `{"name": ..., "arguments": {...}}` between a `<tool_call>` line and a `</tool_call>` line. A
//! model whose template renders tools sees them as that template shows them. Any other model is
//! told about them, and about this convention, in its system message, and sees earlier calls and
//! their results written the same way (results as `<tool_response>` in a user turn). With
//! `tool_choice` `auto`, output is read for calls in tags and for a bare JSON object (or a list of
//! them) naming a tool, the other convention models follow; `required` and a named function
//! constrain decoding to calls in tags, so the output is always calls.

use serde::Deserialize;
use serde_json::{Value, json};

use super::error::ApiError;
use crate::chat::{ChatError, ChatMessage, ChatTemplate};
use crate::grammar::Format;

/// Most tools a request may declare (OpenAI's limit).
pub const MAX_TOOLS: usize = 128;

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// One entry of `tools`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolDef {
    /// Must be `function`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The function.
    pub function: FunctionDef,
}

/// A declared function.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionDef {
    /// Its name: 1 to 64 letters, digits, `_` or `-`.
    pub name: String,
    /// What it does, for the model.
    #[serde(default)]
    pub description: Option<String>,
    /// A JSON schema of its arguments object; absent, no arguments.
    #[serde(default)]
    pub parameters: Option<Value>,
    /// Follow the schema exactly: constrained calls always do, and `auto` calls are read as written.
    #[serde(default)]
    pub strict: Option<bool>,
}

/// `tool_choice` as the wire carries it.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum ToolChoiceWire {
    /// `none`, `auto` or `required`.
    Mode(String),
    /// `{"type": "function", "function": {"name": ...}}`.
    Named(NamedChoice),
}

/// A named function as `tool_choice`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamedChoice {
    /// Must be `function`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Which.
    pub function: ChoiceName,
}

/// The name of the function `tool_choice` names.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChoiceName {
    /// Its name.
    pub name: String,
}

/// What the model may do with the tools.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// Answer in text; the tools are not shown.
    None,
    /// Answer in text or call tools, as it chooses.
    Auto,
    /// Call at least one tool.
    Required,
    /// Call this function.
    Function(String),
}

/// A request's tools, checked.
#[derive(Debug, Clone)]
pub struct Tools {
    functions: Vec<FunctionDef>,
    choice: ToolChoice,
    parallel: bool,
}

fn name_ok(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl Tools {
    /// Checks the three fields together; `None` when there are no tools (then `tool_choice`
    /// may only be `none` or `auto`).
    pub fn new(
        tools: Option<Vec<ToolDef>>,
        choice: Option<ToolChoiceWire>,
        parallel: Option<bool>,
    ) -> Result<Option<Self>, ApiError> {
        let tools = tools.unwrap_or_default();
        if tools.len() > MAX_TOOLS {
            return Err(ApiError::field(
                "tools",
                format!(
                    "tools holds {} functions, more than the {MAX_TOOLS} accepted",
                    tools.len()
                ),
            ));
        }
        let mut functions: Vec<FunctionDef> = Vec::with_capacity(tools.len());
        for (i, t) in tools.into_iter().enumerate() {
            if t.kind != "function" {
                return Err(ApiError::field(
                    &format!("tools[{i}].type"),
                    format!("tools[{i}].type must be \"function\", got {:?}", t.kind),
                ));
            }
            let mut f = t.function;
            let at = format!("tools[{i}].function.name");
            if !name_ok(&f.name) {
                return Err(ApiError::field(
                    &at,
                    format!("{at} must be 1 to 64 letters, digits, _ or -, got {:?}", f.name),
                ));
            }
            if functions.iter().any(|g| g.name == f.name) {
                return Err(ApiError::field(&at, format!("{at}: two tools are named {:?}", f.name)));
            }
            match &f.parameters {
                None => f.parameters = Some(json!({"type": "object", "properties": {}})),
                Some(p @ Value::Object(_)) => {
                    // Compiled into the grammar of required calls: held to the schema bounds.
                    if let Err(e) = crate::grammar::bounds::check(p) {
                        let at = format!("tools[{i}].function.parameters");
                        return Err(ApiError::field(&at, format!("{at}: {e}")));
                    }
                }
                Some(_) => {
                    let at = format!("tools[{i}].function.parameters");
                    return Err(ApiError::field(&at, format!("{at} must be a JSON schema object")));
                }
            }
            functions.push(f);
        }
        let choice = match choice {
            None => ToolChoice::Auto,
            Some(ToolChoiceWire::Mode(m)) => match m.as_str() {
                "none" => ToolChoice::None,
                "auto" => ToolChoice::Auto,
                "required" => ToolChoice::Required,
                _ => {
                    return Err(ApiError::field(
                        "tool_choice",
                        format!("tool_choice must be none, auto, required or a named function, got {m:?}"),
                    ));
                }
            },
            Some(ToolChoiceWire::Named(n)) => {
                if n.kind != "function" {
                    return Err(ApiError::field(
                        "tool_choice.type",
                        format!("tool_choice.type must be \"function\", got {:?}", n.kind),
                    ));
                }
                if !functions.iter().any(|f| f.name == n.function.name) {
                    return Err(ApiError::field(
                        "tool_choice.function.name",
                        format!("tool_choice names {:?}, which is not one of the tools", n.function.name),
                    ));
                }
                ToolChoice::Function(n.function.name)
            }
        };
        if functions.is_empty() {
            return match choice {
                ToolChoice::None | ToolChoice::Auto => Ok(None),
                _ => Err(ApiError::field(
                    "tool_choice",
                    "tool_choice required or a named function needs tools",
                )),
            };
        }
        Ok(Some(Self {
            functions,
            choice,
            parallel: parallel.unwrap_or(true),
        }))
    }

    /// What the model may do with them.
    pub fn choice(&self) -> &ToolChoice {
        &self.choice
    }

    /// The tools as templates take them (OpenAI's list of `{type, function}`), or `None` under
    /// `tool_choice: none`, when they are not shown.
    pub fn shown(&self) -> Option<Value> {
        if self.choice == ToolChoice::None {
            return None;
        }
        let list = self
            .functions
            .iter()
            .map(|f| {
                let mut function = json!({"name": f.name});
                if let Some(d) = &f.description {
                    function["description"] = json!(d);
                }
                function["parameters"] = f.parameters.clone().unwrap_or(Value::Null);
                json!({"type": "function", "function": function})
            })
            .collect();
        Some(Value::Array(list))
    }

    /// How the output is read for calls, or `None` under `tool_choice: none`.
    pub fn reader(&self) -> Option<CallReader> {
        (self.choice != ToolChoice::None).then(|| CallReader {
            names: self.functions.iter().map(|f| f.name.clone()).collect(),
            parallel: self.parallel,
            ..CallReader::default()
        })
    }

    /// The grammar `required` and a named function decode under: one call in tags (or, with
    /// parallel calls, one or more on their own lines) of the allowed functions, each function's
    /// arguments under its own schema (its `$defs` resolve as they would alone). `None` for
    /// `auto` and `none`.
    pub fn format(&self) -> Option<Format> {
        let (functions, many): (Vec<&FunctionDef>, bool) = match &self.choice {
            ToolChoice::None | ToolChoice::Auto => return None,
            ToolChoice::Required => (self.functions.iter().collect(), self.parallel),
            ToolChoice::Function(name) => (self.functions.iter().filter(|f| &f.name == name).collect(), false),
        };
        let mut g = String::from(if many {
            "start: call (\"\\n\" call)*\n"
        } else {
            "start: call\n"
        });
        let alternatives: Vec<String> = (0..functions.len()).map(|i| format!("call_{i}")).collect();
        g.push_str(&format!("call: {}\n", alternatives.join(" | ")));
        for (i, f) in functions.iter().enumerate() {
            // Names are letters, digits, `_` and `-`: nothing to escape in a Lark string.
            g.push_str(&format!(
                "call_{i}: \"{OPEN}\\n{{\\\"name\\\": \\\"{}\\\", \\\"arguments\\\": \" args_{i} \"}}\\n{CLOSE}\"\n",
                f.name
            ));
            let schema = crate::grammar::compact(f.parameters.clone().unwrap_or_else(|| json!({})));
            g.push_str(&format!("args_{i}: %json {schema}\n"));
        }
        Some(Format::Grammar(g))
    }
}

/// The prompt text of a chat: `messages` rendered with `template` and `tools` (if shown), as
/// the template takes them if it [renders tools](ChatTemplate::renders_tools), else as text
/// ([`conversation`]); with `add_generation_prompt`, ending where the assistant's answer starts.
pub fn render(
    template: &ChatTemplate,
    messages: Vec<ChatMessage>,
    tools: Option<&Value>,
    add_generation_prompt: bool,
) -> Result<String, ChatError> {
    if template.renders_tools() {
        template.render_with_tools(&messages, tools, add_generation_prompt)
    } else {
        template.render(&conversation(messages, tools), add_generation_prompt)
    }
}

/// `messages` as a template that does not render tools is given them: `tools` (if shown)
/// described in the system message with the call convention, each earlier call written into its
/// assistant message in tags, and each run of `tool` results made one user message of
/// `<tool_response>` blocks (so templates that insist on alternating turns take it).
pub fn conversation(messages: Vec<ChatMessage>, tools: Option<&Value>) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len() + 1);
    let mut results_open = false;
    for m in messages {
        if m.role == "tool" {
            let block = format!("<tool_response>\n{}\n</tool_response>", m.content);
            match out.last_mut() {
                Some(last) if results_open => {
                    last.content.push('\n');
                    last.content.push_str(&block);
                }
                _ => out.push(ChatMessage::new("user", block)),
            }
            results_open = true;
            continue;
        }
        results_open = false;
        let mut m = m;
        if let Some(calls) = m.tool_calls.take() {
            for c in calls {
                if !m.content.is_empty() {
                    m.content.push('\n');
                }
                let call = json!({"name": c.function.name, "arguments": c.function.arguments});
                m.content.push_str(&format!("{OPEN}\n{call}\n{CLOSE}"));
            }
        }
        m.tool_call_id = None;
        out.push(m);
    }
    if let Some(Value::Array(list)) = tools {
        let mut text = String::from(
            "You can call functions to help answer. Their signatures, as JSON, are between <tools> and </tools>:\n<tools>\n",
        );
        for t in list {
            text.push_str(&t.to_string());
            text.push('\n');
        }
        text.push_str(
            "</tools>\n\nTo call a function, write a JSON object with its name and arguments between <tool_call> and </tool_call>, like this:\n\
             <tool_call>\n{\"name\": \"function name\", \"arguments\": {\"argument\": \"value\"}}\n</tool_call>",
        );
        match out.first_mut() {
            Some(first) if first.role == "system" => {
                first.content.push_str("\n\n");
                first.content.push_str(&text);
            }
            _ => out.insert(0, ChatMessage::new("system", text)),
        }
    }
    out
}

/// A call read from the output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    /// Its id (`call_` and 24 random letters and digits).
    pub id: String,
    /// The function.
    pub name: String,
    /// Its arguments, as the JSON text the wire carries.
    pub arguments: String,
}

impl Call {
    /// The call as OpenAI's `tool_calls` entry, at `index` among the choice's calls.
    pub fn to_json(&self, index: usize) -> Value {
        json!({"index": index, "id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}})
    }
}

/// What the output reads as, piece by piece.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// Text for `content`.
    Text(String),
    /// A call.
    Call(Call),
}

/// Reads one choice's output, as it streams, into text and calls. Text that may yet turn out to
/// be a call (a partial `<tool_call>`, a call not yet closed, an output that opens with `{` or
/// `[`) is held until it is known; whitespace around calls is dropped. A call that names no
/// declared tool, whose JSON does not parse, or past the first when parallel calls are off, is
/// returned as the text it was.
#[derive(Debug, Clone, Default)]
pub struct CallReader {
    names: Vec<String>,
    parallel: bool,
    buf: String,
    in_call: bool,
    bare: bool,
    started: bool,
    calls: usize,
    /// Whitespace held back: emitted before the next text, dropped at a call.
    ws: String,
    /// Bytes of an open call's text already searched for its end.
    scanned: usize,
    /// Drop the whitespace that opens the next text (it follows a call).
    after_call: bool,
}

impl CallReader {
    /// Calls read so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Takes the next `text` of the output; appends what it completes to `out`.
    pub fn push(&mut self, text: &str, out: &mut Vec<Piece>) {
        self.buf.push_str(text);
        loop {
            if self.bare {
                return;
            }
            if self.in_call {
                // Only what may hold a new `</tool_call>` is searched: a call left open for the
                // rest of the output costs a scan of each piece once, not of all of it each time.
                let from = self.scanned.saturating_sub(CLOSE.len() - 1);
                let from = (from..=self.buf.len())
                    .find(|&i| self.buf.is_char_boundary(i))
                    .unwrap_or(0);
                let Some(i) = self.buf[from..].find(CLOSE).map(|i| i + from) else {
                    self.scanned = self.buf.len();
                    return;
                };
                let body = self.buf[..i].to_string();
                self.buf.drain(..i + CLOSE.len());
                self.in_call = false;
                self.scanned = 0;
                self.segment(&body, true, out);
                continue;
            }
            if !self.started {
                let t = self.buf.trim_start();
                if t.is_empty() {
                    return;
                }
                if t.starts_with('{') || t.starts_with('[') {
                    self.bare = true;
                    return;
                }
                self.started = true;
            }
            match self.buf.find(OPEN) {
                Some(i) => {
                    let before = self.buf[..i].to_string();
                    self.buf.drain(..i + OPEN.len());
                    self.text(&before, out);
                    self.in_call = true;
                    self.scanned = 0;
                }
                None => {
                    // Hold what may be the start of a tag (ASCII, so a character boundary).
                    let keep = (1..OPEN.len())
                        .rev()
                        .find(|&k| self.buf.ends_with(&OPEN[..k]))
                        .unwrap_or(0);
                    let cut = self.buf.len() - keep;
                    let ready: String = self.buf.drain(..cut).collect();
                    self.text(&ready, out);
                    return;
                }
            }
        }
    }

    /// The output has ended: appends what was held to `out`.
    pub fn finish(&mut self, out: &mut Vec<Piece>) {
        let rest = std::mem::take(&mut self.buf);
        if self.bare {
            self.bare = false;
            match self.parse(&rest) {
                Some(calls) => self.emit(calls, out),
                None => {
                    self.started = true;
                    self.text(&rest, out);
                }
            }
        } else if self.in_call {
            self.in_call = false;
            self.segment(&rest, false, out);
        } else {
            self.text(&rest, out);
        }
        if self.calls == 0 && !self.ws.is_empty() {
            out.push(Piece::Text(std::mem::take(&mut self.ws)));
        }
        self.ws.clear();
    }

    /// A tagged segment's body: its calls, or its text back as it was written.
    fn segment(&mut self, body: &str, closed: bool, out: &mut Vec<Piece>) {
        match self.parse(body) {
            Some(calls) => self.emit(calls, out),
            None => {
                let raw = if closed {
                    format!("{OPEN}{body}{CLOSE}")
                } else {
                    format!("{OPEN}{body}")
                };
                self.text(&raw, out);
            }
        }
    }

    fn emit(&mut self, calls: Vec<(String, String)>, out: &mut Vec<Piece>) {
        self.ws.clear();
        self.after_call = true;
        self.started = true;
        for (name, arguments) in calls {
            self.calls += 1;
            out.push(Piece::Call(Call {
                id: call_id(),
                name,
                arguments,
            }));
        }
    }

    /// `body` as calls of declared tools: a `{"name", "arguments"}` object (`parameters` is
    /// read as `arguments` too) or a list of them; `None` if it is anything else, or more calls
    /// than parallel calls allow.
    fn parse(&self, body: &str) -> Option<Vec<(String, String)>> {
        let v: Value = serde_json::from_str(body.trim()).ok()?;
        let items = match v {
            Value::Array(items) if !items.is_empty() => items,
            Value::Object(_) => vec![v],
            _ => return None,
        };
        if !self.parallel && self.calls + items.len() > 1 {
            return None;
        }
        items
            .into_iter()
            .map(|item| {
                let Value::Object(mut o) = item else { return None };
                let name = match o.remove("name")? {
                    Value::String(n) if self.names.contains(&n) => n,
                    _ => return None,
                };
                let args = match o.remove("arguments").or_else(|| o.remove("parameters")) {
                    None => json!({}),
                    // Some models write the arguments as a string of JSON, as the wire does.
                    Some(Value::String(s)) => serde_json::from_str(&s).ok()?,
                    Some(a) => a,
                };
                if !args.is_object() || !o.is_empty() {
                    return None;
                }
                Some((name, args.to_string()))
            })
            .collect()
    }

    /// Text for `content`, its trailing whitespace held back.
    fn text(&mut self, s: &str, out: &mut Vec<Piece>) {
        let s = if self.after_call { s.trim_start() } else { s };
        if s.is_empty() {
            return;
        }
        self.after_call = false;
        let body = s.trim_end();
        if body.is_empty() {
            self.ws.push_str(s);
            return;
        }
        let mut t = std::mem::take(&mut self.ws);
        t.push_str(body);
        self.ws.push_str(&s[body.len()..]);
        out.push(Piece::Text(t));
    }
}

fn call_id() -> String {
    use rand::Rng;
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    let s: String = (0..24)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect();
    format!("call_{s}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::{FunctionCall, ToolCall};

    fn weather() -> ToolDef {
        serde_json::from_value(json!({"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})).unwrap()
    }

    fn tools(choice: Option<Value>, parallel: Option<bool>) -> Result<Option<Tools>, ApiError> {
        let time: ToolDef = serde_json::from_value(json!({"type": "function", "function": {"name": "time"}})).unwrap();
        let choice = choice.map(|c| serde_json::from_value(c).unwrap());
        Tools::new(Some(vec![weather(), time]), choice, parallel)
    }

    /// Reads `chunks` as one output streamed in those pieces.
    fn read(t: &Tools, chunks: &[&str]) -> (String, Vec<(String, String)>) {
        let mut r = t.reader().unwrap();
        let mut out = Vec::new();
        for c in chunks {
            r.push(c, &mut out);
        }
        r.finish(&mut out);
        let mut text = String::new();
        let mut calls = Vec::new();
        for p in out {
            match p {
                Piece::Text(s) => text.push_str(&s),
                Piece::Call(c) => {
                    assert!(c.id.starts_with("call_") && c.id.len() == 29, "{}", c.id);
                    calls.push((c.name, c.arguments));
                }
            }
        }
        assert_eq!(r.calls(), calls.len());
        (text, calls)
    }

    fn split_everywhere(s: &str) -> Vec<Vec<&str>> {
        let cuts: Vec<usize> = (0..=s.len()).filter(|&i| s.is_char_boundary(i)).collect();
        let mut ways = vec![vec![s]];
        for &i in &cuts {
            ways.push(vec![&s[..i], &s[i..]]);
        }
        ways.push(cuts.windows(2).map(|w| &s[w[0]..w[1]]).collect());
        ways
    }

    #[test]
    fn calls_in_tags_are_read_however_the_output_is_split() {
        let t = tools(None, None).unwrap().unwrap();
        let out = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"time\", \"arguments\": {}}\n</tool_call>\n";
        for chunks in split_everywhere(out) {
            let (text, calls) = read(&t, &chunks);
            assert_eq!(text, "Let me look.", "{chunks:?}");
            assert_eq!(
                calls,
                [
                    ("get_weather".into(), r#"{"city":"Paris"}"#.into()),
                    ("time".into(), "{}".into())
                ]
            );
        }
    }

    #[test]
    fn bare_json_calls_and_plain_text() {
        let t = tools(None, None).unwrap().unwrap();
        for out in [
            r#"  {"name": "get_weather", "parameters": {"city": "Oslo"}}"#,
            r#"[{"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}]"#,
        ] {
            for chunks in split_everywhere(out) {
                assert_eq!(
                    read(&t, &chunks),
                    (String::new(), vec![("get_weather".into(), r#"{"city":"Oslo"}"#.into())])
                );
            }
        }
        // Text, JSON that is no call, a call of an undeclared function, an unclosed call that
        // does not parse, and a partial tag at the end all come back as written.
        for out in [
            "  Paris is sunny. <tool_ca",
            r#"{"city": "Oslo"}"#,
            "[1, 2]",
            "<tool_call>\n{\"name\": \"launch\", \"arguments\": {}}\n</tool_call>",
            "I will call <tool_call>{\"name\": \"time\", \"argu",
        ] {
            for chunks in split_everywhere(out) {
                assert_eq!(read(&t, &chunks), (out.to_string(), vec![]), "{chunks:?}");
            }
        }
        // An unclosed call that parses is a call (the model stopped at the end of its JSON).
        assert_eq!(
            read(&t, &["<tool_call>\n{\"name\": \"time\"}\n"]).1,
            [("time".to_string(), "{}".to_string())]
        );
    }

    #[test]
    fn parallel_calls_off_reads_only_the_first() {
        let t = tools(None, Some(false)).unwrap().unwrap();
        let one = "<tool_call>{\"name\": \"time\"}</tool_call>";
        let (text, calls) = read(&t, &[&format!("{one}\n{one}")]);
        assert_eq!((text.as_str(), calls.len()), (one, 1));
        let (text, calls) = read(&t, &[r#"[{"name": "time"}, {"name": "time"}]"#]);
        assert_eq!((calls.len(), text.starts_with('[')), (0, true));
    }

    #[test]
    fn bad_tools_and_choices_name_their_field() {
        let named = |n: &str| Some(json!({"type": "function", "function": {"name": n}}));
        for (choice, field) in [
            (Some(json!("sometimes")), "tool_choice"),
            (named("launch"), "tool_choice.function.name"),
            (
                Some(json!({"type": "tool", "function": {"name": "time"}})),
                "tool_choice.type",
            ),
        ] {
            let e = tools(choice, None).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field));
        }
        let def = |v: Value| serde_json::from_value::<ToolDef>(v).unwrap();
        for (t, field) in [
            (
                def(json!({"type": "retrieval", "function": {"name": "x"}})),
                "tools[1].type",
            ),
            (
                def(json!({"type": "function", "function": {"name": "a b"}})),
                "tools[1].function.name",
            ),
            (
                def(json!({"type": "function", "function": {"name": "get_weather"}})),
                "tools[1].function.name",
            ),
            (
                def(json!({"type": "function", "function": {"name": "x", "parameters": [1]}})),
                "tools[1].function.parameters",
            ),
        ] {
            let e = Tools::new(Some(vec![weather(), t]), None, None).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field));
        }
        let many = vec![weather(); MAX_TOOLS + 1];
        assert_eq!(
            Tools::new(Some(many), None, None).unwrap_err().param.as_deref(),
            Some("tools")
        );
        // No tools: only none and auto mean anything.
        assert!(Tools::new(None, None, None).unwrap().is_none());
        assert!(
            Tools::new(Some(vec![]), Some(ToolChoiceWire::Mode("none".into())), None)
                .unwrap()
                .is_none()
        );
        let e = Tools::new(None, Some(ToolChoiceWire::Mode("required".into())), None).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
    }

    #[test]
    fn choices_decide_what_is_shown_read_and_constrained() {
        let none = tools(Some(json!("none")), None).unwrap().unwrap();
        assert!(none.shown().is_none() && none.reader().is_none() && none.format().is_none());
        let auto = tools(None, None).unwrap().unwrap();
        let shown = auto.shown().unwrap();
        assert_eq!(
            shown[1],
            json!({"type": "function", "function": {"name": "time", "parameters": {"type": "object", "properties": {}}}})
        );
        assert_eq!(shown[0]["function"]["description"], "Weather in a city");
        assert!(auto.format().is_none());
        let Some(Format::Grammar(g)) = tools(Some(json!("required")), None).unwrap().unwrap().format() else {
            panic!("required constrains")
        };
        assert!(
            g.starts_with("start: call (\"\\n\" call)*\ncall: call_0 | call_1\n"),
            "{g}"
        );
        let named = json!({"type": "function", "function": {"name": "time"}});
        let Some(Format::Grammar(g)) = tools(Some(named), None).unwrap().unwrap().format() else {
            panic!("a named function constrains")
        };
        assert!(
            g.starts_with("start: call\ncall: call_0\n") && g.contains("\\\"time\\\""),
            "{g}"
        );
        assert!(!g.contains("get_weather"));
    }

    /// The grammar of `required` and of a named function, compiled against the real vocabulary,
    /// takes calls in tags of the allowed functions with arguments under their schemas, and
    /// nothing else; the reader reads what it takes as the calls they are.
    #[test]
    fn required_calls_decode_under_their_grammar() {
        use crate::grammar::{GrammarLimits, Grammars};
        use crate::testutil::{constraint_allows as allows, constraint_allows_end as ends};
        let tk = crate::testutil::tokenizer();
        let g = Grammars::new(
            tk.clone(),
            GrammarLimits {
                max_schema_bytes: 65536,
                compile_ms: 2000,
                memory_bytes: 256 << 20,
            },
        );
        let compile = |t: &Tools| g.compile(&t.format().unwrap()).unwrap().unwrap();
        let weather = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let time = "<tool_call>\n{\"name\": \"time\", \"arguments\": {}}\n</tool_call>";
        let required = tools(Some(json!("required")), None).unwrap().unwrap();
        let c = compile(&required);
        for ok in [weather.to_string(), format!("{weather}\n{time}")] {
            let mut c = c.clone();
            assert!(allows(&mut c, &tk, &ok) && ends(&mut c, &tk), "{ok}");
            assert_eq!(read(&required, &[&ok]).1.len(), ok.matches(OPEN).count());
        }
        for bad in [
            "Sure! <tool_call>",
            "<tool_call>\n{\"name\": \"launch\"",
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"town\"",
        ] {
            assert!(!allows(&mut c.clone(), &tk, bad), "{bad}");
        }
        let mut open = c.clone();
        assert!(allows(&mut open, &tk, &weather[..40]) && !ends(&mut open, &tk));
        // Named, or with parallel calls off: exactly one call.
        let named = json!({"type": "function", "function": {"name": "time"}});
        let c = compile(&tools(Some(named), None).unwrap().unwrap());
        assert!(!allows(&mut c.clone(), &tk, weather));
        assert!(!allows(&mut c.clone(), &tk, &format!("{time}\n")));
        let single = compile(&tools(Some(json!("required")), Some(false)).unwrap().unwrap());
        assert!(!allows(&mut single.clone(), &tk, &format!("{weather}\n")));
        let mut one = single.clone();
        assert!(allows(&mut one, &tk, time) && ends(&mut one, &tk));
    }

    #[test]
    fn conversations_carry_tools_calls_and_results_as_text() {
        let auto = tools(None, None).unwrap().unwrap();
        let mut asked = ChatMessage::new("assistant", "");
        asked.tool_calls = Some(vec![ToolCall {
            id: "call_1".into(),
            kind: "function".into(),
            function: FunctionCall {
                name: "get_weather".into(),
                arguments: json!({"city": "Paris"}),
            },
        }]);
        let mut result = ChatMessage::new("tool", "18 C");
        result.tool_call_id = Some("call_1".into());
        let messages = vec![
            ChatMessage::new("user", "Weather in Paris?"),
            asked,
            result.clone(),
            result,
        ];
        let c = conversation(messages.clone(), auto.shown().as_ref());
        assert_eq!(c.len(), 4);
        assert_eq!(c[0].role, "system");
        assert!(
            c[0].content
                .contains("<tools>\n{\"type\":\"function\",\"function\":{\"name\":\"get_weather\"")
        );
        assert_eq!(
            c[2].content,
            "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}\n</tool_call>"
        );
        assert!(c[2].tool_calls.is_none());
        assert_eq!(
            (c[3].role.as_str(), c[3].content.as_str()),
            (
                "user",
                "<tool_response>\n18 C\n</tool_response>\n<tool_response>\n18 C\n</tool_response>"
            )
        );
        // A system message of the client's own keeps its text first; without tools shown, no
        // system message is added.
        let mut with_system = messages.clone();
        with_system.insert(0, ChatMessage::new("system", "Be brief."));
        let c = conversation(with_system, auto.shown().as_ref());
        assert!(c[0].content.starts_with("Be brief.\n\nYou can call functions"));
        let c = conversation(messages, None);
        assert_eq!((c.len(), c[0].role.as_str()), (3, "user"));
    }
}
