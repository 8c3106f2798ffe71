//! Redacts email addresses, phone numbers and card numbers from the output, correctly across
//! streaming chunk boundaries: text that could still be the start of one is held back until the
//! next chunk (or the final call) decides.

use std::cell::RefCell;

use warden_guest::{Chunk, Finish, Plugin, PluginError};

/// Longest PII the holdback covers: anything that might be part of one within this many bytes
/// of the end waits for more text.
const HOLD: usize = 64;

thread_local! {
    static HELD: RefCell<String> = const { RefCell::new(String::new()) };
    static REDACTED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

fn is_email_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '%' | '+' | '-')
}

/// Byte ranges of emails, card numbers (13–19 digits, spaces or dashes between groups) and
/// phone numbers (10–15 digits, with an optional leading '+', spaces, dashes, dots, parens).
fn find_pii(s: &str) -> Vec<(usize, usize, &'static str)> {
    let b = s.as_bytes();
    let mut out = Vec::new();
    // Emails: local@domain.tld
    let mut i = 0;
    while let Some(at) = s[i..].find('@').map(|p| p + i) {
        let mut start = at;
        while start > 0 && is_email_char(b[start - 1] as char) {
            start -= 1;
        }
        let mut end = at + 1;
        while end < b.len() && (b[end].is_ascii_alphanumeric() || b[end] == b'.' || b[end] == b'-') {
            end += 1;
        }
        while end > at + 1 && b[end - 1] == b'.' {
            end -= 1;
        }
        let domain = &s[at + 1..end];
        if start < at && domain.contains('.') && !domain.starts_with('.') {
            out.push((start, end, "[EMAIL]"));
        }
        i = end.max(at + 1);
    }
    // Digit runs with separators: cards and phones.
    let mut i = 0;
    while i < b.len() {
        let starts = b[i].is_ascii_digit() || (b[i] == b'+' && i + 1 < b.len() && b[i + 1].is_ascii_digit());
        if !starts || (i > 0 && b[i - 1].is_ascii_alphanumeric()) {
            i += 1;
            continue;
        }
        let (mut end, mut digits, mut last_digit) = (i, 0, i);
        while end < b.len() && (b[end].is_ascii_digit() || matches!(b[end], b' ' | b'-' | b'.' | b'(' | b')' | b'+')) {
            if b[end].is_ascii_digit() {
                digits += 1;
                last_digit = end + 1;
            }
            end += 1;
        }
        let end = last_digit;
        let kind = if (13..=19).contains(&digits) && !s[i..end].contains('(') {
            Some("[CARD]")
        } else if (10..=15).contains(&digits) {
            Some("[PHONE]")
        } else {
            None
        };
        if let Some(k) = kind
            && !out.iter().any(|&(a, z, _)| i < z && a < end)
        {
            out.push((i, end, k));
        }
        i = end.max(i + 1);
    }
    out.sort();
    out
}

fn redact(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut at = 0;
    for (a, z, tag) in find_pii(s) {
        if a >= at {
            out.push_str(&s[at..a]);
            out.push_str(tag);
            at = z;
        }
    }
    out.push_str(&s[at..]);
    out
}

struct PiiRedactor;

impl Plugin for PiiRedactor {
    fn postprocess(chunk: Chunk, end: Option<Finish>) -> Result<Chunk, PluginError> {
        HELD.with_borrow_mut(|held| {
            held.push_str(&chunk.text);
            if end.is_some() {
                let all = std::mem::take(held);
                let text = redact(&all);
                let n = REDACTED.get() + find_pii(&all).len();
                if n > 0 {
                    warden_guest::log(warden_guest::log::Level::Info, &format!("redacted {n} items"));
                }
                return Ok(Chunk { text });
            }
            // Emit up to a split point no PII crosses, holding back the last HOLD bytes (at a
            // character boundary), which could still grow into one.
            let mut split = held.len().saturating_sub(HOLD);
            while !held.is_char_boundary(split) {
                split -= 1;
            }
            for (a, z, _) in find_pii(held) {
                if a < split && split < z {
                    split = a;
                }
            }
            let rest = held.split_off(split);
            let ready = std::mem::replace(held, rest);
            REDACTED.set(REDACTED.get() + find_pii(&ready).len());
            Ok(Chunk { text: redact(&ready) })
        })
    }
}

warden_guest::plugin!(PiiRedactor);
