//! Stops generation as soon as the output can no longer be the start of a valid JSON value.

use std::cell::RefCell;

use warden_guest::{Capabilities, Plugin, Token, TokenAction};

/// A streaming JSON prefix checker: feed characters, learn whether the text so far can still
/// be extended into one valid JSON value.
#[derive(Default)]
struct Prefix {
    /// Open containers: `{` or `[`.
    stack: Vec<u8>,
    in_string: bool,
    escaped: bool,
    /// Characters of a bare literal (number, true, false, null) being read.
    literal: String,
    started: bool,
    done: bool,
    broken: bool,
}

impl Prefix {
    fn literal_ok(s: &str) -> bool {
        let words = ["true", "false", "null"];
        if words.iter().any(|w| w.starts_with(s)) {
            return true;
        }
        // A number prefix: -?digits(.digits)?([eE][+-]?digits)?
        let b = s.as_bytes();
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

    fn end_value(&mut self) {
        if self.stack.is_empty() {
            self.done = true;
        }
    }

    fn flush_literal(&mut self) {
        if !self.literal.is_empty() {
            self.literal.clear();
            self.end_value();
        }
    }

    fn push(&mut self, c: char) {
        if self.broken {
            return;
        }
        if self.in_string {
            match (self.escaped, c) {
                (true, _) => self.escaped = false,
                (false, '\\') => self.escaped = true,
                (false, '"') => {
                    self.in_string = false;
                    self.end_value();
                }
                _ => {}
            }
            return;
        }
        if c.is_ascii_alphanumeric() || c == '-' || c == '+' || c == '.' {
            if self.done && self.literal.is_empty() {
                self.broken = true;
                return;
            }
            self.literal.push(c);
            self.started = true;
            self.broken = !Self::literal_ok(&self.literal);
            return;
        }
        self.flush_literal();
        match c {
            ' ' | '\n' | '\r' | '\t' => {}
            _ if self.done => self.broken = true,
            '"' => {
                self.in_string = true;
                self.started = true;
            }
            '{' | '[' => {
                self.stack.push(c as u8);
                self.started = true;
            }
            '}' | ']' => {
                let open = if c == '}' { b'{' } else { b'[' };
                if self.stack.pop() != Some(open) {
                    self.broken = true;
                } else {
                    self.end_value();
                }
            }
            ':' | ',' if !self.stack.is_empty() => {}
            _ => self.broken = true,
        }
    }
}

thread_local! {
    static STATE: RefCell<Prefix> = RefCell::new(Prefix::default());
}

struct JsonGuard;

impl Plugin for JsonGuard {
    fn capabilities() -> Capabilities {
        Capabilities { on_token: true }
    }

    fn on_token(token: Token) -> TokenAction {
        STATE.with_borrow_mut(|p| {
            for c in token.text.chars() {
                p.push(c);
            }
            if p.broken || (p.done && p.literal.is_empty() && !p.in_string) {
                TokenAction::Stop
            } else {
                TokenAction::Continue
            }
        })
    }
}

warden_guest::plugin!(JsonGuard);
