//! Keeps the output a valid JSON value (with config `object`, a JSON object): it constrains the
//! first token (in `preprocess`) and,
//! after each token, the next to the tokens
//! whose bytes keep the output the start of one (and no control token, which would end it or
//! start a chat turn), and stops the choice once the value is complete.
//!
//! `init` reads the model's vocabulary (every token's bytes) once; each `on-token` checks the
//! vocabulary against the output so far. Inside a string (most of the time) a token without `"`,
//! `\` or control bytes keeps it valid, so only the others are checked byte by byte.

use std::cell::RefCell;

use warden_guest::{Capabilities, Plugin, PluginError, Request, Token, TokenAction, TokenConstraint};

/// What may come next outside a string.
#[derive(Default, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// A value (at the start, or after `:` or an array's `,`).
    #[default]
    Value,
    /// A value or `]` (after `[`).
    ValueOrClose,
    /// A key or `}` (after `{`).
    KeyOrClose,
    /// A key (after an object's `,`).
    Key,
    /// `:` (after a key).
    Colon,
    /// `,` or the container's close (after a value).
    CommaOrClose,
}

/// A streaming JSON prefix checker: feed characters, learn whether the text so far can still
/// be extended into one valid JSON value. It is `Copy` (containers as bits, a bare literal in a
/// small buffer), so checking a token against it costs no allocation.
#[derive(Default, Clone, Copy)]
struct Prefix {
    /// Open containers, innermost in the lowest bit: 1 for `{`, 0 for `[`.
    stack: u64,
    depth: u8,
    expect: Expect,
    in_string: bool,
    /// The string being read is an object's key.
    key: bool,
    escaped: bool,
    /// Characters of a bare literal (number, true, false, null) being read.
    literal: [u8; 32],
    literal_len: u8,
    done: bool,
    broken: bool,
}

/// Deepest nesting the checker follows (deeper is refused).
const MAX_DEPTH: u8 = 64;

impl Prefix {
    fn literal_ok(b: &[u8]) -> bool {
        let words: [&[u8]; 3] = [b"true", b"false", b"null"];
        if words.iter().any(|w| w.starts_with(b)) {
            return true;
        }
        // A number prefix: -?digits(.digits)?([eE][+-]?digits)?
        let mut i = 0;
        if i < b.len() && b[i] == b'-' {
            i += 1;
        }
        let digits = |i: &mut usize| {
            let s = *i;
            while *i < b.len() && b[*i].is_ascii_digit() {
                *i += 1;
            }
            *i > s
        };
        if i == b.len() {
            return true;
        }
        if !digits(&mut i) {
            return false;
        }
        if i < b.len() && b[i] == b'.' {
            i += 1;
            digits(&mut i);
        }
        if i < b.len() && (b[i] == b'e' || b[i] == b'E') {
            i += 1;
            if i < b.len() && (b[i] == b'+' || b[i] == b'-') {
                i += 1;
            }
            digits(&mut i);
        }
        i == b.len()
    }

    /// Whether a literal that ends here is a whole value: `true`, `false`, `null` or a number
    /// with digits after its point and exponent.
    fn literal_complete(b: &[u8]) -> bool {
        if [&b"true"[..], b"false", b"null"].contains(&b) {
            return true;
        }
        let last = b.last().copied().unwrap_or(b'-');
        Self::literal_ok(b) && last.is_ascii_digit()
    }

    /// A value ended: the container goes on, or the whole value is done.
    fn after_value(&mut self) {
        self.expect = Expect::CommaOrClose;
        if self.depth == 0 {
            self.done = true;
        }
    }

    fn wants_value(&self) -> bool {
        matches!(self.expect, Expect::Value | Expect::ValueOrClose) && !self.done
    }

    fn flush_literal(&mut self) {
        if self.literal_len > 0 {
            if !Self::literal_complete(&self.literal[..self.literal_len as usize]) {
                self.broken = true;
            }
            self.literal_len = 0;
            self.after_value();
        }
    }

    /// Feeds one byte of UTF-8: bytes of a multi-byte character belong inside a string.
    fn push_byte(&mut self, b: u8) {
        if b.is_ascii() {
            self.push(b);
        } else if self.in_string {
            self.escaped = false;
        } else {
            self.broken = true;
        }
    }

    fn push(&mut self, c: u8) {
        if self.broken {
            return;
        }
        if self.in_string {
            match (self.escaped, c) {
                (true, _) => self.escaped = false,
                (false, b'\\') => self.escaped = true,
                (false, b'"') => {
                    self.in_string = false;
                    if self.key {
                        self.expect = Expect::Colon;
                    } else {
                        self.after_value();
                    }
                }
                (false, c) if c < 0x20 => self.broken = true,
                _ => {}
            }
            return;
        }
        if c.is_ascii_alphanumeric() || c == b'-' || c == b'+' || c == b'.' {
            let n = self.literal_len as usize;
            if (n == 0 && !self.wants_value()) || n == self.literal.len() {
                self.broken = true;
                return;
            }
            self.literal[n] = c;
            self.literal_len += 1;
            self.broken = !Self::literal_ok(&self.literal[..=n]);
            return;
        }
        self.flush_literal();
        if self.broken {
            return;
        }
        let top_is_object = self.depth > 0 && self.stack & 1 == 1;
        match c {
            b' ' | b'\n' | b'\r' | b'\t' => {}
            _ if self.done => self.broken = true,
            b'"' if self.wants_value() => {
                self.in_string = true;
                self.key = false;
            }
            b'"' if matches!(self.expect, Expect::Key | Expect::KeyOrClose) => {
                self.in_string = true;
                self.key = true;
            }
            b'{' | b'[' if self.wants_value() && self.depth < MAX_DEPTH => {
                self.stack = (self.stack << 1) | u64::from(c == b'{');
                self.depth += 1;
                self.expect = if c == b'{' {
                    Expect::KeyOrClose
                } else {
                    Expect::ValueOrClose
                };
            }
            b'}' if top_is_object && matches!(self.expect, Expect::KeyOrClose | Expect::CommaOrClose) => {
                self.stack >>= 1;
                self.depth -= 1;
                self.after_value();
            }
            b']' if self.depth > 0
                && !top_is_object
                && matches!(self.expect, Expect::ValueOrClose | Expect::CommaOrClose) =>
            {
                self.stack >>= 1;
                self.depth -= 1;
                self.after_value();
            }
            b':' if self.expect == Expect::Colon => self.expect = Expect::Value,
            b',' if self.expect == Expect::CommaOrClose && self.depth > 0 => {
                self.expect = if top_is_object { Expect::Key } else { Expect::Value };
            }
            _ => self.broken = true,
        }
    }

    /// Whether the value is complete (nothing open, no literal that could go on).
    fn complete(&self) -> bool {
        self.done && self.literal_len == 0 && !self.in_string
    }
}

/// The vocabulary, read once by `init`.
#[derive(Default)]
struct Vocab {
    /// Each token's bytes (empty for control tokens).
    bytes: Vec<Vec<u8>>,
    /// Tokens that keep a string open whatever they hold: no `"`, `\` or control bytes.
    plain: Vec<bool>,
}

thread_local! {
    static STATE: RefCell<Prefix> = RefCell::new(Prefix::default());
    static VOCAB: RefCell<Vocab> = RefCell::new(Vocab::default());
    /// The tokens a reply may start with, worked out once in `init`.
    static FIRST: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

/// Reads every token's bytes, and which keep a string open.
fn read_vocabulary() -> Vocab {
    let bytes = warden_guest::read_vocabulary();
    let plain = bytes
        .iter()
        .map(|b| !b.is_empty() && b.iter().all(|&c| c != b'"' && c != b'\\' && c >= 0x20))
        .collect();
    Vocab { bytes, plain }
}

/// The tokens that keep `p` the start of a JSON value.
fn allowed(p: &Prefix, v: &Vocab) -> Vec<u32> {
    let in_plain_string = p.in_string && !p.escaped;
    (0..v.bytes.len())
        .filter(|&id| {
            let bytes = &v.bytes[id];
            if bytes.is_empty() {
                return false;
            }
            if in_plain_string && v.plain[id] {
                return true;
            }
            let mut q = *p;
            for &b in bytes {
                q.push_byte(b);
                if q.broken {
                    return false;
                }
            }
            true
        })
        .map(|id| id as u32)
        .collect()
}

struct JsonGuard;

impl Plugin for JsonGuard {
    /// Reads the vocabulary, and works out the tokens a reply may start with: a JSON value's
    /// start (with config `object`, an object's: its first character other than space is `{`).
    /// The server runs this once per configuration, so requests start from its result.
    fn init(config: String) -> Result<(), PluginError> {
        let vocab = read_vocabulary();
        let mut first = allowed(&Prefix::default(), &vocab);
        if config.trim() == "object" {
            first.retain(|&id| vocab.bytes[id as usize].iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{'));
        }
        VOCAB.with_borrow_mut(|v| *v = vocab);
        FIRST.with_borrow_mut(|f| *f = first);
        Ok(())
    }

    fn capabilities() -> Capabilities {
        Capabilities { on_token: true }
    }

    /// The first token, which no `on-token` answer precedes, must start the reply too.
    fn preprocess(mut req: Request) -> Result<Request, PluginError> {
        req.first_token = Some(TokenConstraint {
            allowed: Some(FIRST.with_borrow(Vec::clone)),
            bias: vec![],
        });
        Ok(req)
    }

    fn on_token(token: Token) -> TokenAction {
        STATE.with_borrow_mut(|p| {
            VOCAB.with_borrow(|v| {
                match v.bytes.get(token.id as usize) {
                    Some(bytes) => bytes.iter().for_each(|&b| p.push_byte(b)),
                    None => p.broken = true,
                }
                if p.broken || p.complete() {
                    return TokenAction::Stop;
                }
                TokenAction::Constrain(TokenConstraint {
                    allowed: Some(allowed(p, v)),
                    bias: vec![],
                })
            })
        })
    }
}

warden_guest::plugin!(JsonGuard);
