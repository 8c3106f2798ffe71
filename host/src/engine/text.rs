//! Output text of one sequence: token bytes assembled into UTF-8, and stop strings matched across
//! token boundaries without ever emitting text that may turn out to be part of a stop string.

use crate::tokenizer::Tokenizer;

/// What the engine needs of a tokenizer to turn tokens into text.
pub trait Detokenizer: Send + Sync {
    /// The bytes token `id` stands for in output (empty for control tokens).
    fn token_bytes(&self, id: u32) -> Vec<u8>;
    /// Whether `id` ends generation.
    fn is_eog(&self, id: u32) -> bool;
}

/// A model's own tokenizer, as the engine runs it.
impl Detokenizer for Tokenizer {
    fn token_bytes(&self, id: u32) -> Vec<u8> {
        Tokenizer::token_bytes(self, id)
    }
    fn is_eog(&self, id: u32) -> bool {
        Tokenizer::is_eog(self, id)
    }
}

/// Incremental text of one sequence.
#[derive(Debug, Default)]
pub struct TextStream {
    stops: Vec<String>,
    /// Bytes of an incomplete UTF-8 sequence.
    partial: Vec<u8>,
    /// Text decoded so far and not yet emitted (held back while it may start a stop string).
    held: String,
}

impl TextStream {
    /// A stream that ends at any of `stops`.
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops,
            ..Default::default()
        }
    }

    /// Adds a token's bytes. Returns the text now safe to emit, and whether a stop string was
    /// found (the stop string and anything after it are dropped).
    pub fn push(&mut self, bytes: &[u8]) -> (String, bool) {
        self.partial.extend_from_slice(bytes);
        let valid = match std::str::from_utf8(&self.partial) {
            Ok(s) => s.len(),
            Err(e) if e.error_len().is_some() => {
                // Invalid bytes (not just an unfinished sequence): decode lossily now.
                let s = String::from_utf8_lossy(&self.partial).into_owned();
                self.partial.clear();
                self.held.push_str(&s);
                return self.scan();
            }
            Err(e) => e.valid_up_to(),
        };
        let done: Vec<u8> = self.partial.drain(..valid).collect();
        // `done` is valid UTF-8 by construction.
        self.held.push_str(&String::from_utf8_lossy(&done));
        self.scan()
    }

    fn scan(&mut self) -> (String, bool) {
        if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, true);
        }
        // Hold back the longest suffix that is a prefix of a stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in self.held.char_indices() {
                let suffix = &self.held[i..];
                if suffix.len() <= s.len() && s.starts_with(suffix) {
                    keep = keep.max(suffix.len());
                    break;
                }
            }
        }
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        (out, false)
    }

    /// Everything still held, at the end of generation.
    pub fn finish(&mut self) -> String {
        let mut s = std::mem::take(&mut self.held);
        if !self.partial.is_empty() {
            s.push_str(&String::from_utf8_lossy(&std::mem::take(&mut self.partial)));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_string_across_tokens_is_never_emitted() {
        let mut t = TextStream::new(vec!["END".into()]);
        assert_eq!(t.push(b"hello E"), ("hello ".into(), false));
        assert_eq!(t.push(b"N"), ("".into(), false));
        assert_eq!(t.push(b"Dtail"), ("".into(), true));
    }

    #[test]
    fn false_start_is_released() {
        let mut t = TextStream::new(vec!["END".into()]);
        assert_eq!(t.push(b"E"), ("".into(), false));
        assert_eq!(t.push(b"x"), ("Ex".into(), false));
        assert_eq!(t.finish(), "");
    }

    #[test]
    fn multibyte_chars_wait_for_their_last_byte() {
        let mut t = TextStream::new(vec![]);
        let smile = "😀".as_bytes();
        assert_eq!(t.push(&smile[..2]).0, "");
        assert_eq!(t.push(&smile[2..]).0, "😀");
    }
}
