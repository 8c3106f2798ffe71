//! Tokenizers built from a GGUF file's `tokenizer.ggml.*` metadata, following llama.cpp.
//!
//! Two vocabulary kinds, named as `tokenizer.ggml.model` names them:
//!
//! - `gpt2`: byte-level BPE. The text is split by a pre-tokenizer (`tokenizer.ggml.pre` picks
//!   which), each piece's bytes are mapped to GPT-2's printable byte alphabet and merged pairwise,
//!   lowest `tokenizer.ggml.merges` rank first.
//! - `llama`: SentencePiece-style BPE. Spaces become `▁`, a `▁` is put in front of the text, and
//!   adjacent symbols are merged highest `tokenizer.ggml.scores` first; characters with no token
//!   fall back to `<0xXX>` byte tokens.
//!
//! Before either runs, special tokens (CONTROL and UNKNOWN types when `parse_special` is set,
//! USER_DEFINED ones always) are cut out of the text literally, longest first.
//!
//! Everything read from the file is checked in [`Tokenizer::from_gguf`], which names what is wrong
//! in a [`TokenizerError`]. A built tokenizer cannot fail: [`Tokenizer::encode`] takes any text and
//! [`Tokenizer::decode`] and [`Tokenizer::token_bytes`] take any id.
//!
//! ```no_run
//! use warden::{gguf::Gguf, tokenizer::Tokenizer};
//! let gguf = Gguf::open("models/SmolLM2-135M-Instruct.Q4_1.gguf").unwrap();
//! let tok = Tokenizer::from_gguf(&gguf).unwrap();
//! let ids = tok.encode("The capital of France is", true);
//! assert_eq!(ids, [504, 3575, 282, 4649, 314]);
//! assert_eq!(tok.decode(&ids), "The capital of France is");
//! assert!(tok.is_eog(2)); // <|im_end|>
//! ```

use std::cmp::{Ordering, Reverse};
use std::collections::hash_map::Entry;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use crate::gguf::{Gguf, Value};

const KEY_MODEL: &str = "tokenizer.ggml.model";
const KEY_PRE: &str = "tokenizer.ggml.pre";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
const KEY_MERGES: &str = "tokenizer.ggml.merges";
const KEY_SCORES: &str = "tokenizer.ggml.scores";
const KEY_BOS: &str = "tokenizer.ggml.bos_token_id";
const KEY_EOS: &str = "tokenizer.ggml.eos_token_id";
const KEY_EOT: &str = "tokenizer.ggml.eot_token_id";
const KEY_EOM: &str = "tokenizer.ggml.eom_token_id";
const KEY_UNK: &str = "tokenizer.ggml.unknown_token_id";
const KEY_PAD: &str = "tokenizer.ggml.padding_token_id";
const KEY_FIM_PAD: &str = "tokenizer.ggml.fim_pad_token_id";
const KEY_FIM_REP: &str = "tokenizer.ggml.fim_rep_token_id";
const KEY_FIM_SEP: &str = "tokenizer.ggml.fim_sep_token_id";
const KEY_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
const KEY_ADD_SPACE_PREFIX: &str = "tokenizer.ggml.add_space_prefix";

/// The pre-tokenizer names [`Tokenizer::from_gguf`] accepts for `gpt2` vocabularies.
pub const SUPPORTED_PRE: &[&str] = &[
    "default",
    "gpt-2",
    "smollm",
    "starcoder",
    "refact",
    "command-r",
    "codeshell",
    "exaone",
    "minerva-7b",
    "llama3",
    "llama-v3",
    "llama-bpe",
    "qwen2",
];

/// What is wrong with a model's tokenizer metadata.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TokenizerError {
    /// A required key is absent.
    #[error("missing metadata key {0:?}")]
    MissingKey(&'static str),
    /// A key whose value has the wrong type.
    #[error("metadata key {key:?} should be {expected}, found {found}")]
    WrongType {
        /// The key.
        key: &'static str,
        /// The type wanted.
        expected: &'static str,
        /// The type found.
        found: &'static str,
    },
    /// An array element with the wrong type.
    #[error("metadata key {key:?}: element {index} should be {expected}, found {found}")]
    WrongElementType {
        /// The key.
        key: &'static str,
        /// The element's index.
        index: usize,
        /// The type wanted.
        expected: &'static str,
        /// The type found.
        found: &'static str,
    },
    /// A `tokenizer.ggml.model` Warden does not implement.
    #[error("unsupported tokenizer model {0:?} in tokenizer.ggml.model (supported: \"gpt2\", \"llama\")")]
    UnknownModel(String),
    /// A `tokenizer.ggml.pre` Warden does not implement.
    #[error("unsupported pre-tokenizer {name:?} in tokenizer.ggml.pre (supported: {})", SUPPORTED_PRE.join(", "))]
    UnknownPre {
        /// The name given.
        name: String,
    },
    /// `tokenizer.ggml.tokens` has no entries, or more than a `u32` id can name.
    #[error("tokenizer.ggml.tokens has {0} entries (must be between 1 and 2^32 - 1)")]
    BadVocabSize(usize),
    /// Two tokens with the same text.
    #[error("duplicate token {text:?} at ids {first} and {second}")]
    DuplicateToken {
        /// The text.
        text: String,
        /// The first id.
        first: u32,
        /// The second id.
        second: u32,
    },
    /// A per-token array whose length is not the vocabulary size.
    #[error("metadata key {key:?} has {found} entries, expected {expected} (one per token)")]
    LengthMismatch {
        /// The key.
        key: &'static str,
        /// Its length.
        found: usize,
        /// The vocabulary size.
        expected: usize,
    },
    /// A token type that is not one of GGUF's (0 to 6).
    #[error("tokenizer.ggml.token_type[{index}] = {value} is not a token type (0..=6)")]
    BadTokenType {
        /// The token id.
        index: usize,
        /// The value found.
        value: i64,
    },
    /// A score that is not a number.
    #[error("tokenizer.ggml.scores[{index}] is NaN")]
    BadScore {
        /// The token id.
        index: usize,
    },
    /// A merge rule that cannot be applied.
    #[error("tokenizer.ggml.merges[{index}] = {merge:?}: {why}")]
    BadMerge {
        /// Its rank.
        index: usize,
        /// Its text.
        merge: String,
        /// What is wrong.
        why: String,
    },
    /// A special token id past the end of the vocabulary.
    #[error("metadata key {key:?} = {id} is out of range for a vocabulary of {vocab} tokens")]
    IdOutOfRange {
        /// The key.
        key: &'static str,
        /// The id given.
        id: u64,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A token of type BYTE whose text is not `<0xXX>`.
    #[error("token {id} ({text:?}) has type BYTE but is not of the form <0xXX>")]
    BadByteToken {
        /// The token id.
        id: u32,
        /// Its text.
        text: String,
    },
    /// `add_bos_token` is true but there is no BOS token.
    #[error("tokenizer.ggml.add_bos_token is true but tokenizer.ggml.bos_token_id is not set")]
    AddBosWithoutBos,
}

// Token attributes, as llama.cpp's `llama_token_attr` bits.
const ATTR_UNKNOWN: u8 = 1 << 0;
const ATTR_UNUSED: u8 = 1 << 1;
const ATTR_NORMAL: u8 = 1 << 2;
const ATTR_CONTROL: u8 = 1 << 3;
const ATTR_USER_DEFINED: u8 = 1 << 4;
const ATTR_BYTE: u8 = 1 << 5;

/// The attribute of a GGUF `token_type` value (0 undefined, 1 normal, 2 unknown, 3 control,
/// 4 user-defined, 5 unused, 6 byte).
fn attr_of_type(t: i64) -> Option<u8> {
    Some(match t {
        0 => 0,
        1 => ATTR_NORMAL,
        2 => ATTR_UNKNOWN,
        3 => ATTR_CONTROL,
        4 => ATTR_USER_DEFINED,
        5 => ATTR_UNUSED,
        6 => ATTR_BYTE,
        _ => return None,
    })
}

/// Sentinel for "no token" in dense tables.
const NONE: u32 = u32::MAX;

/// `▁` (U+2581), SentencePiece's visible space.
const SPM_SPACE: &str = "\u{2581}";

/// GPT-2's byte-to-character table: printable Latin-1 bytes stand for themselves, the other 68
/// bytes for U+0100 onwards, in byte order.
const BYTE_CHARS: [char; 256] = {
    let mut out = ['\0'; 256];
    let mut next = 256u32;
    let mut b = 0usize;
    while b < 256 {
        let cp = if is_printable_byte(b as u32) {
            b as u32
        } else {
            next += 1;
            next - 1
        };
        out[b] = match char::from_u32(cp) {
            Some(c) => c,
            None => '\0',
        };
        b += 1;
    }
    out
};

/// The bytes GPT-2 maps to U+0100.. (the non-printable ones), in order.
const NON_PRINTABLE: [u8; 68] = {
    let mut out = [0u8; 68];
    let mut n = 0;
    let mut b = 0usize;
    while b < 256 {
        if !is_printable_byte(b as u32) {
            out[n] = b as u8;
            n += 1;
        }
        b += 1;
    }
    out
};

const fn is_printable_byte(b: u32) -> bool {
    matches!(b, 33..=126 | 161..=172 | 174..=255)
}

/// The byte a GPT-2 alphabet character stands for.
fn gpt2_char_to_byte(c: char) -> Option<u8> {
    let u = c as u32;
    if is_printable_byte(u) {
        Some(u as u8)
    } else if (256..256 + NON_PRINTABLE.len() as u32).contains(&u) {
        Some(NON_PRINTABLE[(u - 256) as usize])
    } else {
        None
    }
}

/// A multiplicative hasher for the `u64` pair keys of the merge table (whose keys come from the
/// model file, not from requests, so flooding is not a concern).
#[derive(Default)]
struct PairHasher(u64);

impl Hasher for PairHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(26) ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }

    fn finish(&self) -> u64 {
        self.0 ^ (self.0 >> 29)
    }
}

type PairMap = HashMap<u64, Merge, BuildHasherDefault<PairHasher>>;

fn pair_key(left: u32, right: u32) -> u64 {
    ((left as u64) << 32) | right as u64
}

#[derive(Clone, Copy)]
struct Merge {
    rank: u32,
    result: u32,
}

/// One stage of a pre-tokenizer: splits a piece at every match of `re`, keeping the text between
/// matches as pieces of its own (as llama.cpp's `unicode_regex_split` does).
#[derive(Debug)]
struct Stage {
    re: regex::Regex,
    lookahead: Lookahead,
}

/// How a stage's pattern stands in for GPT-2's trailing `\s+(?!\S)|\s+`: the pattern ends in a
/// plain `\s+`, and a whitespace run that alternative matches gives its last character to the
/// next piece when more text follows. (The `regex` crate has no look-ahead; emulating it keeps
/// matching linear-time.)
#[derive(Debug, Clone, Copy, PartialEq)]
enum Lookahead {
    /// No such alternative.
    No,
    /// The pattern ends in `\s+`, and only that alternative can match whitespace alone.
    Ws,
    /// The pattern ends in `\s*[\r\n]+|\s+`: whitespace-only matches without `\r` or `\n` come
    /// from `\s+` (with a newline in the run, the earlier alternative matches first).
    WsAfterNewlines,
}

impl Stage {
    fn new(pattern: &str, lookahead: Lookahead) -> Self {
        // The patterns are constants of this file, all compiled by the tests below.
        let re = regex::Regex::new(pattern).expect("built-in pre-tokenizer pattern compiles");
        Self { re, lookahead }
    }

    /// Whether the match `m` (followed by more text) came from the trailing `\s+` and has more
    /// than one character, so `\s+(?!\S)` would have stopped one character short.
    fn gives_back_last(&self, m: &str) -> bool {
        let ws_only = || m.chars().all(char::is_whitespace);
        let several = || m.chars().nth(1).is_some();
        match self.lookahead {
            Lookahead::No => false,
            Lookahead::Ws => several() && ws_only(),
            Lookahead::WsAfterNewlines => several() && ws_only() && !m.contains(['\r', '\n']),
        }
    }

    fn split_into<'t>(&self, s: &'t str, out: &mut Vec<&'t str>) {
        let mut pos = 0; // start of the text not yet emitted
        let mut at = 0; // where to search next
        while at < s.len() {
            let Some(m) = self.re.find_at(s, at) else { break };
            let (start, mut end) = (m.start(), m.end());
            if end < s.len() && self.gives_back_last(m.as_str()) {
                end -= m.as_str().chars().next_back().map_or(0, char::len_utf8);
            }
            if start > pos {
                out.push(&s[pos..start]);
            }
            if end > start {
                out.push(&s[start..end]);
                pos = end;
                at = end;
            } else {
                // An empty match: step over one character (none of the built-in patterns can
                // match empty, but never loop on one).
                at = start + s[start..].chars().next().map_or(1, char::len_utf8);
            }
        }
        if pos < s.len() {
            out.push(&s[pos..]);
        }
    }
}

// GPT-2's pattern and llama.cpp's adaptations of llama3's and qwen2's, with the trailing
// `\s+(?!\S)|\s+` written as `\s+` (see [`Lookahead`]).
const GPT2_PATTERN: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+";
const LLAMA3_PATTERN: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+";
const QWEN2_PATTERN: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+";

/// A `gpt2` vocabulary's pre-tokenizer: stages applied in order, each to every piece the previous
/// one produced (llama.cpp's `regex_exprs` for the `tokenizer.ggml.pre` name).
#[derive(Debug)]
struct PreTokenizer {
    stages: Vec<Stage>,
}

impl PreTokenizer {
    /// The pre-tokenizer named `name` (`None`: the key is absent), and whether that vocabulary
    /// ignores merges for pieces that are whole tokens, and whether it adds BOS by default.
    fn named(name: Option<&str>) -> Result<(Self, bool, bool), TokenizerError> {
        let stages = |s: Vec<Stage>| Self { stages: s };
        Ok(match name.unwrap_or("default") {
            "default" => (
                stages(vec![
                    Stage::new(r"[\p{P}\$\+<=>\^~\|]+", Lookahead::No),
                    Stage::new(GPT2_PATTERN, Lookahead::Ws),
                    Stage::new(r"\p{N}+", Lookahead::No),
                    Stage::new(r"[0-9][0-9][0-9]", Lookahead::No),
                ]),
                false,
                false,
            ),
            "gpt-2" => (stages(vec![Stage::new(GPT2_PATTERN, Lookahead::Ws)]), false, false),
            "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => (
                stages(vec![
                    Stage::new(r"\p{N}", Lookahead::No),
                    Stage::new(GPT2_PATTERN, Lookahead::Ws),
                ]),
                false,
                false,
            ),
            "llama3" | "llama-v3" | "llama-bpe" => (
                stages(vec![Stage::new(LLAMA3_PATTERN, Lookahead::WsAfterNewlines)]),
                true,
                true,
            ),
            "qwen2" => (
                stages(vec![Stage::new(QWEN2_PATTERN, Lookahead::WsAfterNewlines)]),
                false,
                false,
            ),
            other => {
                return Err(TokenizerError::UnknownPre {
                    name: other.to_string(),
                });
            }
        })
    }

    fn split<'t>(&self, text: &'t str) -> Vec<&'t str> {
        let mut pieces = vec![text];
        for stage in &self.stages {
            let mut next = Vec::with_capacity(pieces.len() * 2);
            for p in pieces {
                stage.split_into(p, &mut next);
            }
            pieces = next;
        }
        pieces
    }
}

/// Byte-level BPE state.
struct Bpe {
    pre: PreTokenizer,
    /// `(left, right)` token ids → rank and merged token.
    merges: PairMap,
    /// The token of each byte's GPT-2 character, or [`NONE`].
    byte_tokens: [u32; 256],
    /// Pieces that are whole tokens are emitted without merging (llama3).
    ignore_merges: bool,
}

/// SentencePiece-style BPE state.
struct Spm {
    scores: Vec<f32>,
    /// The `<0xXX>` token of each byte, or [`NONE`].
    byte_tokens: [u32; 256],
    add_space_prefix: bool,
}

enum Algo {
    Bpe(Bpe),
    Spm(Spm),
}

/// A tokenizer read from GGUF metadata; see the [module docs](self).
///
/// Invariants, established by [`Tokenizer::from_gguf`]:
/// - every id it holds or returns (special ids, merge results, `encode` output) is below
///   [`Tokenizer::vocab_size`];
/// - token texts are unique, so `encode` is deterministic;
/// - [`Tokenizer::eog_ids`] is sorted and contains EOS, EOT and EOM when they exist.
pub struct Tokenizer {
    tokens: Vec<String>,
    attrs: Vec<u8>,
    by_text: HashMap<String, u32>,
    algo: Algo,
    /// Special tokens for literal matching, longest text first.
    specials: Vec<u32>,
    /// `token_bytes` of every token, concatenated; token `i` is `piece_bytes[piece_ends[i-1]..piece_ends[i]]`.
    piece_bytes: Vec<u8>,
    piece_ends: Vec<usize>,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    eom: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    add_bos: bool,
    eog: Vec<u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field(
                "model",
                &match self.algo {
                    Algo::Bpe(_) => "gpt2",
                    Algo::Spm(_) => "llama",
                },
            )
            .field("vocab_size", &self.tokens.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("add_bos", &self.add_bos)
            .field("eog", &self.eog)
            .finish()
    }
}

fn get_string<'g>(g: &'g Gguf, key: &'static str) -> Result<Option<&'g str>, TokenizerError> {
    match g.get(key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(TokenizerError::WrongType {
            key,
            expected: "string",
            found: v.type_name(),
        }),
    }
}

fn get_bool(g: &Gguf, key: &'static str) -> Result<Option<bool>, TokenizerError> {
    match g.get(key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(TokenizerError::WrongType {
            key,
            expected: "bool",
            found: v.type_name(),
        }),
    }
}

fn get_array<'g>(g: &'g Gguf, key: &'static str) -> Result<Option<&'g [Value]>, TokenizerError> {
    match g.get(key) {
        None => Ok(None),
        Some(Value::Array(a)) => Ok(Some(a)),
        Some(v) => Err(TokenizerError::WrongType {
            key,
            expected: "array",
            found: v.type_name(),
        }),
    }
}

fn get_str_array<'g>(g: &'g Gguf, key: &'static str) -> Result<Option<Vec<&'g str>>, TokenizerError> {
    let Some(a) = get_array(g, key)? else { return Ok(None) };
    a.iter()
        .enumerate()
        .map(|(index, v)| match v {
            Value::String(s) => Ok(s.as_str()),
            v => Err(TokenizerError::WrongElementType {
                key,
                index,
                expected: "string",
                found: v.type_name(),
            }),
        })
        .collect::<Result<_, _>>()
        .map(Some)
}

fn get_id(g: &Gguf, key: &'static str, vocab: usize) -> Result<Option<u32>, TokenizerError> {
    let Some(v) = g.get(key) else { return Ok(None) };
    let id = v.as_u64().ok_or(TokenizerError::WrongType {
        key,
        expected: "unsigned integer",
        found: v.type_name(),
    })?;
    // 0xFFFFFFFF is "none", as llama.cpp reads it (its LLAMA_TOKEN_NULL as a u32): older
    // converters (llama2.c's among them) write it for a padding or separator token the model
    // does not have.
    if id == u64::from(u32::MAX) {
        return Ok(None);
    }
    if id >= vocab as u64 {
        return Err(TokenizerError::IdOutOfRange { key, id, vocab });
    }
    Ok(Some(id as u32))
}

/// The byte a `<0xXX>` token stands for.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

// Token texts llama.cpp recognises when the file does not name the token (`llama_vocab::load`).
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];
const EOM_TEXTS: &[&str] = &["<|eom_id|>"];
const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP_TEXTS: &[&str] = &["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"];
const FIM_SEP_TEXTS: &[&str] = &["<|file_sep|>"];
/// Tokens that end generation whatever the metadata says.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// A piece of input after special-token partitioning.
enum Fragment<'t> {
    Text(&'t str),
    Token(u32),
}

impl Tokenizer {
    /// Builds the tokenizer described by `gguf`'s `tokenizer.ggml.*` keys, checking all of them.
    ///
    /// Defaults where a key is absent: `add_bos_token` true for `llama` (and the llama3
    /// pre-tokenizer), false otherwise; `add_space_prefix` true (`llama` only); for `llama`,
    /// BOS 1, EOS 2 and UNK 0 when those ids exist; `pre` "default". EOT, EOM and the FIM
    /// pad/repo/separator tokens, when not named, are found by their text as llama.cpp does.
    pub fn from_gguf(gguf: &Gguf) -> Result<Self, TokenizerError> {
        let model = get_string(gguf, KEY_MODEL)?.ok_or(TokenizerError::MissingKey(KEY_MODEL))?;
        let is_bpe = match model {
            "gpt2" => true,
            "llama" => false,
            other => return Err(TokenizerError::UnknownModel(other.to_string())),
        };
        let tokens = get_str_array(gguf, KEY_TOKENS)?.ok_or(TokenizerError::MissingKey(KEY_TOKENS))?;
        let n = tokens.len();
        if n == 0 || n >= NONE as usize {
            return Err(TokenizerError::BadVocabSize(n));
        }

        // Texts and types.
        let mut by_text: HashMap<String, u32> = HashMap::with_capacity(n);
        for (i, &t) in tokens.iter().enumerate() {
            if t.is_empty() {
                continue; // never produced by encode; decodes to nothing
            }
            match by_text.entry(t.to_string()) {
                Entry::Occupied(e) => {
                    return Err(TokenizerError::DuplicateToken {
                        text: t.to_string(),
                        first: *e.get(),
                        second: i as u32,
                    });
                }
                Entry::Vacant(e) => {
                    e.insert(i as u32);
                }
            }
        }
        let mut attrs = match get_array(gguf, KEY_TOKEN_TYPE)? {
            Some(types) => {
                if types.len() != n {
                    return Err(TokenizerError::LengthMismatch {
                        key: KEY_TOKEN_TYPE,
                        found: types.len(),
                        expected: n,
                    });
                }
                types
                    .iter()
                    .enumerate()
                    .map(|(index, v)| {
                        let t = v.as_i64().ok_or(TokenizerError::WrongElementType {
                            key: KEY_TOKEN_TYPE,
                            index,
                            expected: "integer",
                            found: v.type_name(),
                        })?;
                        attr_of_type(t).ok_or(TokenizerError::BadTokenType { index, value: t })
                    })
                    .collect::<Result<Vec<u8>, _>>()?
            }
            // Without types every token is normal, except that a SentencePiece vocabulary's
            // `<0xXX>` tokens are still its byte tokens.
            None => tokens
                .iter()
                .map(|t| {
                    if !is_bpe && parse_byte_token(t).is_some() {
                        ATTR_BYTE
                    } else {
                        ATTR_NORMAL
                    }
                })
                .collect(),
        };
        for (i, &a) in attrs.iter().enumerate() {
            if a & ATTR_BYTE != 0 && parse_byte_token(tokens[i]).is_none() {
                return Err(TokenizerError::BadByteToken {
                    id: i as u32,
                    text: tokens[i].to_string(),
                });
            }
        }

        // The algorithm.
        let mut add_bos_default = !is_bpe;
        let algo = if is_bpe {
            let (pre, ignore_merges, pre_adds_bos) = PreTokenizer::named(get_string(gguf, KEY_PRE)?)?;
            add_bos_default = pre_adds_bos;
            let merges = get_str_array(gguf, KEY_MERGES)?.ok_or(TokenizerError::MissingKey(KEY_MERGES))?;
            if merges.len() >= NONE as usize {
                return Err(TokenizerError::LengthMismatch {
                    key: KEY_MERGES,
                    found: merges.len(),
                    expected: NONE as usize - 1,
                });
            }
            let mut table = PairMap::with_capacity_and_hasher(merges.len(), Default::default());
            let mut joined = String::new();
            for (index, &m) in merges.iter().enumerate() {
                let bad = |why: &str| TokenizerError::BadMerge {
                    index,
                    merge: m.to_string(),
                    why: why.to_string(),
                };
                // As llama.cpp: the separator is the first space after the first byte.
                let Some(sep) = m.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1) else {
                    return Err(bad("no space separates the two tokens"));
                };
                let (left, right) = (&m[..sep], &m[sep + 1..]);
                let lookup = |t: &str, which: &str| {
                    by_text
                        .get(t)
                        .copied()
                        .ok_or_else(|| bad(&format!("{which} {t:?} is not a token")))
                };
                let l = lookup(left, "left side")?;
                let r = lookup(right, "right side")?;
                joined.clear();
                joined.push_str(left);
                joined.push_str(right);
                let result = lookup(&joined, "merged text")?;
                // A repeated pair keeps its first (best) rank, as llama.cpp's `emplace` does.
                table.entry(pair_key(l, r)).or_insert(Merge {
                    rank: index as u32,
                    result,
                });
            }
            let mut byte_tokens = [NONE; 256];
            let mut buf = [0u8; 4];
            for (b, slot) in byte_tokens.iter_mut().enumerate() {
                if let Some(&id) = by_text.get(&*BYTE_CHARS[b].encode_utf8(&mut buf)) {
                    *slot = id;
                }
            }
            Algo::Bpe(Bpe {
                pre,
                merges: table,
                byte_tokens,
                ignore_merges,
            })
        } else {
            let scores = match get_array(gguf, KEY_SCORES)? {
                Some(s) => {
                    if s.len() != n {
                        return Err(TokenizerError::LengthMismatch {
                            key: KEY_SCORES,
                            found: s.len(),
                            expected: n,
                        });
                    }
                    s.iter()
                        .enumerate()
                        .map(|(index, v)| {
                            let f = v.as_f64().ok_or(TokenizerError::WrongElementType {
                                key: KEY_SCORES,
                                index,
                                expected: "number",
                                found: v.type_name(),
                            })?;
                            if f.is_nan() {
                                return Err(TokenizerError::BadScore { index });
                            }
                            // `+ 0.0` turns -0.0 into 0.0, so equal scores compare equal below.
                            Ok(f as f32 + 0.0)
                        })
                        .collect::<Result<Vec<f32>, _>>()?
                }
                None => vec![0.0; n],
            };
            let mut byte_tokens = [NONE; 256];
            for (b, slot) in byte_tokens.iter_mut().enumerate() {
                if let Some(&id) = by_text.get(&format!("<0x{b:02X}>")) {
                    *slot = id;
                }
            }
            Algo::Spm(Spm {
                scores,
                byte_tokens,
                add_space_prefix: get_bool(gguf, KEY_ADD_SPACE_PREFIX)?.unwrap_or(true),
            })
        };

        // Special ids.
        let in_range = |id: u32| (id < n as u32).then_some(id);
        let default = |id: u32| if is_bpe { None } else { in_range(id) };
        let bos = get_id(gguf, KEY_BOS, n)?.or_else(|| default(1));
        let eos = get_id(gguf, KEY_EOS, n)?.or_else(|| default(2));
        let unk = get_id(gguf, KEY_UNK, n)?.or_else(|| default(0));
        let pad = get_id(gguf, KEY_PAD, n)?;
        let add_bos = get_bool(gguf, KEY_ADD_BOS)?.unwrap_or(add_bos_default);
        if add_bos && bos.is_none() {
            return Err(TokenizerError::AddBosWithoutBos);
        }

        // End-of-generation tokens (llama.cpp `llama_vocab::impl::load`). A token found by its
        // text is made a control token, so it is never printed.
        let find = |texts: &[&str], attrs: &mut [u8]| {
            let id = (0..n).find(|&i| texts.contains(&tokens[i]))?;
            attrs[id] |= ATTR_CONTROL;
            Some(id as u32)
        };
        let mut detect = |key, texts: &[&str]| -> Result<Option<u32>, TokenizerError> {
            Ok(match get_id(gguf, key, n)? {
                Some(id) => Some(id),
                None => find(texts, &mut attrs),
            })
        };
        let eot = detect(KEY_EOT, EOT_TEXTS)?;
        let eom = detect(KEY_EOM, EOM_TEXTS)?;
        let fim = [
            detect(KEY_FIM_PAD, FIM_PAD_TEXTS)?,
            detect(KEY_FIM_REP, FIM_REP_TEXTS)?,
            detect(KEY_FIM_SEP, FIM_SEP_TEXTS)?,
        ];
        let mut eog: Vec<u32> = fim.into_iter().flatten().collect();
        for (i, t) in tokens.iter().enumerate() {
            if EOG_TEXTS.contains(t) {
                eog.push(i as u32);
                attrs[i] |= ATTR_CONTROL;
            }
            // gpt-oss: these always print.
            if matches!(*t, "<|channel|>" | "<|message|>" | "<|start|>" | "<|constrain|>") {
                attrs[i] = ATTR_USER_DEFINED;
            }
        }
        eog.extend([eos, eot, eom].into_iter().flatten());
        eog.sort_unstable();
        eog.dedup();
        let eog_with = |eog: &[u32], text: &str| eog.iter().copied().find(|&id| tokens[id as usize] == text);
        // o200k_harmony and solar-open: `<|end|>` ends a message, not the generation.
        if let Some(end) = eog_with(&eog, "<|end|>") {
            let has = |t| eog_with(&eog, t).is_some();
            let call = has("<|call|>") || has("<|calls|>");
            if call && (has("<|return|>") || has("<|flush|>")) {
                eog.retain(|&id| id != end);
                attrs[end as usize] = ATTR_USER_DEFINED;
            }
        }
        // gemma4 and paddleocr: `</s>` is not an end of generation there.
        if let Some(s) = eog_with(&eog, "</s>")
            && eog_with(&eog, "<|tool_response>").is_some()
        {
            eog.retain(|&id| id != s);
            attrs[s as usize] = ATTR_NORMAL;
        }

        // Literal special tokens, longest first (ties by id, for determinism).
        let mut specials: Vec<u32> = (0..n as u32)
            .filter(|&i| {
                attrs[i as usize] & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN) != 0
                    && !tokens[i as usize].is_empty()
            })
            .collect();
        specials.sort_by_key(|&i| Reverse(tokens[i as usize].len()));

        let tokens: Vec<String> = tokens.into_iter().map(str::to_string).collect();
        let mut tok = Self {
            tokens,
            attrs,
            by_text,
            algo,
            specials,
            piece_bytes: Vec::new(),
            piece_ends: Vec::with_capacity(n),
            bos,
            eos,
            eot,
            eom,
            unk,
            pad,
            add_bos,
            eog,
        };
        let mut bytes = Vec::new();
        for id in 0..n {
            tok.render_piece(id, &mut bytes);
            tok.piece_ends.push(bytes.len());
        }
        tok.piece_bytes = bytes;
        Ok(tok)
    }

    /// Appends what token `id` (in range) prints, as llama.cpp's `token_to_piece` without
    /// `special`: nothing for control, unknown, unused and undefined tokens; the text of
    /// user-defined ones; the byte of byte tokens; the decoded text of normal ones.
    fn render_piece(&self, id: usize, out: &mut Vec<u8>) {
        let attr = self.attrs[id];
        let text = &self.tokens[id];
        if attr & (ATTR_CONTROL | ATTR_UNKNOWN) != 0 {
            return;
        }
        if attr & ATTR_USER_DEFINED != 0 {
            out.extend_from_slice(text.as_bytes());
        } else if attr & ATTR_NORMAL != 0 {
            match self.algo {
                Algo::Bpe(_) => {
                    let mut buf = [0u8; 4];
                    for c in text.chars() {
                        match gpt2_char_to_byte(c) {
                            Some(b) => out.push(b),
                            // Not in GPT-2's alphabet: print the character itself.
                            None => out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes()),
                        }
                    }
                }
                Algo::Spm(_) => out.extend_from_slice(text.replace(SPM_SPACE, " ").as_bytes()),
            }
        } else if attr & ATTR_BYTE != 0 {
            // Checked in `from_gguf`.
            if let Some(b) = parse_byte_token(text) {
                out.push(b);
            }
        }
    }

    /// Token ids for a rendered chat prompt (special tokens parsed). A template that writes the
    /// BOS token's text itself (Gemma's does) gets no second BOS: when this tokenizer adds BOS,
    /// a leading BOS text is dropped first, as llama.cpp's chat code does.
    pub fn encode_chat(&self, text: &str) -> Vec<u32> {
        let bos_text = self.bos.filter(|_| self.add_bos).and_then(|b| self.token_text(b));
        match bos_text.and_then(|b| text.strip_prefix(b)) {
            Some(rest) if bos_text.is_some_and(|b| !b.is_empty()) => self.encode(rest, true),
            _ => self.encode(text, true),
        }
    }

    /// Token ids for `text`, with BOS first when [`Tokenizer::add_bos`].
    ///
    /// With `parse_special`, control tokens written literally in `text` (such as `<|im_start|>`)
    /// become their ids; without, they are tokenized as plain text. User-defined tokens are
    /// always matched, as in llama.cpp.
    pub fn encode(&self, text: &str, parse_special: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if self.add_bos
            && let Some(bos) = self.bos
        {
            out.push(bos);
        }
        let fragments = self.partition(text, parse_special);
        let mut prev_special = true;
        for f in fragments {
            match f {
                Fragment::Token(id) => {
                    out.push(id);
                    prev_special = true;
                }
                Fragment::Text(t) => {
                    match &self.algo {
                        Algo::Bpe(bpe) => {
                            for piece in bpe.pre.split(t) {
                                self.bpe_piece(bpe, piece.as_bytes(), &mut out);
                            }
                        }
                        Algo::Spm(spm) => {
                            // As llama.cpp: a space before the text and after each special token.
                            let mut s = String::with_capacity(t.len() + 4);
                            if spm.add_space_prefix && prev_special {
                                s.push(' ');
                            }
                            s.push_str(t);
                            self.spm_text(spm, &s.replace(' ', SPM_SPACE), &mut out);
                        }
                    }
                    prev_special = false;
                }
            }
        }
        out
    }

    /// Cuts the special tokens out of `text`, each token in turn over every remaining text
    /// fragment, longest token first (llama.cpp's `tokenizer_st_partition`).
    fn partition<'t>(&self, text: &'t str, parse_special: bool) -> Vec<Fragment<'t>> {
        let mut frags = Vec::new();
        if text.is_empty() {
            return frags;
        }
        frags.push(Fragment::Text(text));
        for &id in &self.specials {
            if !parse_special && self.attrs[id as usize] & (ATTR_CONTROL | ATTR_UNKNOWN) != 0 {
                continue;
            }
            let needle = self.tokens[id as usize].as_str();
            let found = frags
                .iter()
                .any(|f| matches!(f, Fragment::Text(t) if t.contains(needle)));
            if !found {
                continue;
            }
            let mut next = Vec::with_capacity(frags.len() + 2);
            for f in frags {
                match f {
                    Fragment::Text(mut rest) => {
                        while let Some(p) = rest.find(needle) {
                            if p > 0 {
                                next.push(Fragment::Text(&rest[..p]));
                            }
                            next.push(Fragment::Token(id));
                            rest = &rest[p + needle.len()..];
                        }
                        if !rest.is_empty() {
                            next.push(Fragment::Text(rest));
                        }
                    }
                    tok => next.push(tok),
                }
            }
            frags = next;
        }
        frags
    }

    /// Byte-level BPE of one pre-tokenized piece: symbols start as one per byte and the adjacent
    /// pair with the lowest merge rank (leftmost on ties) is merged until none is left.
    fn bpe_piece(&self, bpe: &Bpe, piece: &[u8], out: &mut Vec<u32>) {
        if piece.is_empty() {
            return;
        }
        if bpe.ignore_merges {
            let mapped: String = piece.iter().map(|&b| BYTE_CHARS[b as usize]).collect();
            if let Some(&id) = self.by_text.get(&mapped) {
                out.push(id);
                return;
            }
        }
        #[derive(Clone, Copy)]
        struct Sym {
            id: u32,
            prev: usize,
            next: usize,
        }
        const END: usize = usize::MAX;
        let mut syms: Vec<Sym> = piece
            .iter()
            .enumerate()
            .map(|(i, &b)| Sym {
                id: bpe.byte_tokens[b as usize],
                prev: if i == 0 { END } else { i - 1 },
                next: if i + 1 == piece.len() { END } else { i + 1 },
            })
            .collect();
        // (rank, left, right, left id, right id), smallest first.
        type Heap = BinaryHeap<Reverse<(u32, usize, usize, u32, u32)>>;
        let mut heap = Heap::new();
        let push = |heap: &mut Heap, syms: &[Sym], l: usize, r: usize| {
            if l == END || r == END {
                return;
            }
            let (a, b) = (syms[l].id, syms[r].id);
            if let Some(m) = bpe.merges.get(&pair_key(a, b)) {
                heap.push(Reverse((m.rank, l, r, a, b)));
            }
        };
        for i in 1..syms.len() {
            push(&mut heap, &syms, i - 1, i);
        }
        let mut alive = vec![true; syms.len()];
        while let Some(Reverse((_, l, r, a, b))) = heap.pop() {
            // Stale if either side has merged since: ids change on every merge.
            if !alive[l] || !alive[r] || syms[l].next != r || syms[l].id != a || syms[r].id != b {
                continue;
            }
            let Some(m) = bpe.merges.get(&pair_key(a, b)) else {
                continue;
            };
            syms[l].id = m.result;
            alive[r] = false;
            let after = syms[r].next;
            syms[l].next = after;
            if after != END {
                syms[after].prev = l;
            }
            push(&mut heap, &syms, syms[l].prev, l);
            push(&mut heap, &syms, l, after);
        }
        let mut i = 0;
        while i != END {
            // A byte with no token in the vocabulary is dropped, as llama.cpp does.
            if syms[i].id != NONE {
                out.push(syms[i].id);
            }
            i = syms[i].next;
        }
    }

    /// SentencePiece-style BPE of escaped text: symbols start as one per character and the
    /// adjacent pair that forms the token with the highest score (leftmost on ties) is merged
    /// until no pair forms a token; symbols that are not tokens become byte tokens.
    fn spm_text(&self, spm: &Spm, text: &str, out: &mut Vec<u32>) {
        if text.is_empty() {
            return;
        }
        #[derive(Clone, Copy)]
        struct Sym {
            start: usize,
            len: usize,
            prev: usize,
            next: usize,
        }
        const END: usize = usize::MAX;
        let mut syms: Vec<Sym> = Vec::with_capacity(text.len());
        for (i, (start, c)) in text.char_indices().enumerate() {
            syms.push(Sym {
                start,
                len: c.len_utf8(),
                prev: if i == 0 { END } else { i - 1 },
                next: END,
            });
            if i > 0 {
                syms[i - 1].next = i;
            }
        }
        struct Bigram {
            score: f32,
            left: usize,
            right: usize,
            size: usize,
        }
        impl PartialEq for Bigram {
            fn eq(&self, o: &Self) -> bool {
                self.cmp(o) == Ordering::Equal
            }
        }
        impl Eq for Bigram {}
        impl PartialOrd for Bigram {
            fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
                Some(self.cmp(o))
            }
        }
        impl Ord for Bigram {
            // Max-heap: higher score first, then the leftmost.
            fn cmp(&self, o: &Self) -> Ordering {
                self.score.total_cmp(&o.score).then(o.left.cmp(&self.left))
            }
        }
        let mut heap = BinaryHeap::new();
        let push = |heap: &mut BinaryHeap<Bigram>, syms: &[Sym], l: usize, r: usize| {
            if l == END || r == END {
                return;
            }
            let (start, end) = (syms[l].start, syms[r].start + syms[r].len);
            if let Some(&id) = self.by_text.get(&text[start..end]) {
                heap.push(Bigram {
                    score: spm.scores[id as usize],
                    left: l,
                    right: r,
                    size: end - start,
                });
            }
        };
        for i in 1..syms.len() {
            push(&mut heap, &syms, i - 1, i);
        }
        while let Some(bg) = heap.pop() {
            let (l, r) = (bg.left, bg.right);
            // Stale if either side has merged since (lengths only grow; a merged-away symbol
            // has length 0).
            if syms[l].len == 0 || syms[r].len == 0 || syms[l].len + syms[r].len != bg.size {
                continue;
            }
            syms[l].len += syms[r].len;
            syms[r].len = 0;
            let after = syms[r].next;
            syms[l].next = after;
            if after != END {
                syms[after].prev = l;
            }
            push(&mut heap, &syms, syms[l].prev, l);
            push(&mut heap, &syms, l, after);
        }
        let mut i = 0;
        while i != END {
            let s = syms[i];
            let piece = &text[s.start..s.start + s.len];
            if let Some(&id) = self.by_text.get(piece) {
                out.push(id);
            } else {
                for &b in piece.as_bytes() {
                    match (spm.byte_tokens[b as usize], self.unk) {
                        (NONE, Some(unk)) => out.push(unk),
                        (NONE, None) => {}
                        (id, _) => out.push(id),
                    }
                }
            }
            i = s.next;
        }
    }

    /// The text of `ids`: their [`Tokenizer::token_bytes`] concatenated and read as UTF-8, invalid
    /// sequences replaced by U+FFFD. For `llama` vocabularies with `add_space_prefix`, the space
    /// `encode` put before the text is removed from the first token that prints anything, so
    /// `decode(encode(s)) == s`; give whole sequences, not a suffix of one.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        let mut strip_space = matches!(&self.algo, Algo::Spm(s) if s.add_space_prefix);
        for &id in ids {
            let mut piece = self.piece(id);
            if strip_space && !piece.is_empty() {
                if let [b' ', rest @ ..] = piece {
                    piece = rest;
                }
                strip_space = false;
            }
            bytes.extend_from_slice(piece);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    fn piece(&self, id: u32) -> &[u8] {
        let i = id as usize;
        if i >= self.piece_ends.len() {
            return &[];
        }
        let start = if i == 0 { 0 } else { self.piece_ends[i - 1] };
        &self.piece_bytes[start..self.piece_ends[i]]
    }

    /// The bytes token `id` stands for in output text: GPT-2 byte characters mapped back to bytes
    /// (`gpt2`), `▁` as a space and `<0xXX>` as its byte (`llama`), a user-defined token's text.
    /// Empty for control, unknown-type and unused tokens, and for ids past the vocabulary.
    ///
    /// A token may be part of a UTF-8 character; concatenate before reading text.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        self.piece(id).to_vec()
    }

    /// Whether byte `b` of a text has a token of its own to fall back on: always for SentencePiece
    /// vocabularies with an unknown token; for byte-level BPE, whether the vocabulary has the
    /// byte's character (SmolLM2's lacks a few control bytes). `encode` drops a byte without one,
    /// as llama.cpp does.
    pub fn byte_has_token(&self, b: u8) -> bool {
        match &self.algo {
            Algo::Bpe(bpe) => bpe.byte_tokens[b as usize] != NONE,
            Algo::Spm(spm) => spm.byte_tokens[b as usize] != NONE || self.unk.is_some(),
        }
    }

    /// Whether generating `id` ends the generation (see [`Tokenizer::eog_ids`]).
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// The end-of-generation tokens, sorted: EOS, EOT and EOM, the FIM pad, repository and file
    /// separator tokens, and any token whose text llama.cpp treats as an end of turn
    /// (`<|im_end|>`, `<|endoftext|>`, `<|eot_id|>`, `<end_of_turn>`, `</s>`, ...).
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }

    /// The BOS token, if the vocabulary has one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// The EOS token, if the vocabulary has one.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// The end-of-turn token, named in the file or found by its text (`<|eot_id|>`, `<|im_end|>`, ...).
    pub fn eot_id(&self) -> Option<u32> {
        self.eot
    }

    /// The end-of-message token (`<|eom_id|>`), if any.
    pub fn eom_id(&self) -> Option<u32> {
        self.eom
    }

    /// The unknown token, if the vocabulary has one.
    pub fn unk_id(&self) -> Option<u32> {
        self.unk
    }

    /// The padding token, if the vocabulary has one.
    pub fn pad_id(&self) -> Option<u32> {
        self.pad
    }

    /// Whether [`Tokenizer::encode`] puts BOS first.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// The number of tokens; every valid id is below it.
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// The vocabulary text of token `id` (GPT-2 byte characters or `▁` as stored), if it exists.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The id of the token whose vocabulary text is exactly `text`.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.by_text.get(text).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::writer::GgufWriter;
    use std::path::PathBuf;
    use std::sync::OnceLock;

    fn model_path() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf")
    }

    /// The SmolLM2 tokenizer; fails (not skips) the test when the model is absent.
    fn smollm() -> &'static Tokenizer {
        static TOK: OnceLock<Tokenizer> = OnceLock::new();
        TOK.get_or_init(|| {
            let path = model_path();
            assert!(
                path.exists(),
                "model missing: run scripts/fetch-model.sh ({})",
                path.display()
            );
            let g = Gguf::open(&path).unwrap();
            Tokenizer::from_gguf(&g).unwrap()
        })
    }

    #[test]
    fn tokenizer_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Tokenizer>();
    }

    #[test]
    fn gpt2_byte_alphabet_is_a_bijection() {
        let mut seen = std::collections::HashSet::new();
        for b in 0..=255u8 {
            let c = BYTE_CHARS[b as usize];
            assert!(seen.insert(c), "{c:?} twice");
            assert_eq!(gpt2_char_to_byte(c), Some(b));
        }
        assert_eq!(BYTE_CHARS[b' ' as usize], 'Ġ');
        assert_eq!(BYTE_CHARS[b'\n' as usize], 'Ċ');
        assert_eq!(BYTE_CHARS[b'a' as usize], 'a');
        assert_eq!(gpt2_char_to_byte('€'), None);
    }

    fn split(pre: &str, text: &str) -> Vec<String> {
        let (p, _, _) = PreTokenizer::named(Some(pre)).unwrap();
        p.split(text).into_iter().map(str::to_string).collect()
    }

    #[test]
    fn smollm_pre_tokenizer_matches_the_gpt2_regex_with_single_digits() {
        assert_eq!(split("smollm", "Hello world"), ["Hello", " world"]);
        assert_eq!(split("smollm", "12345"), ["1", "2", "3", "4", "5"]);
        assert_eq!(split("smollm", "a 12"), ["a", " ", "1", "2"]);
        // `\s+(?!\S)`: a whitespace run before a word leaves its last space to the word.
        assert_eq!(split("smollm", "  \n\n  x"), ["  \n\n ", " x"]);
        assert_eq!(split("smollm", "a   b"), ["a", "  ", " b"]);
        assert_eq!(split("smollm", "a\nb"), ["a", "\n", "b"]);
        assert_eq!(split("smollm", "x  "), ["x", "  "]);
        assert_eq!(split("smollm", "I'm don't"), ["I", "'m", " don", "'t"]);
        assert_eq!(split("smollm", "fib(n):"), ["fib", "(", "n", "):"]);
        assert_eq!(split("smollm", "héllo 世界!!"), ["héllo", " 世界", "!!"]);
        assert_eq!(split("gpt-2", "x 123"), ["x", " 123"]);
    }

    #[test]
    fn llama3_pre_tokenizer_groups_newlines_and_digit_triples() {
        assert_eq!(split("llama-bpe", "1234567"), ["123", "456", "7"]);
        assert_eq!(split("llama-bpe", "a  \nb"), ["a", "  \n", "b"]);
        assert_eq!(split("llama-bpe", "a  b"), ["a", " ", " b"]);
        assert_eq!(split("llama-bpe", "I'M ok"), ["I", "'M", " ok"]);
    }

    #[test]
    fn unknown_pre_tokenizer_is_named() {
        let e = PreTokenizer::named(Some("martian")).unwrap_err();
        assert!(e.to_string().contains("\"martian\""), "{e}");
        assert!(e.to_string().contains("smollm"), "{e}");
    }

    // ---- the real model (llama.cpp is the reference for every expected id) ----

    #[test]
    fn smollm_encodes_like_llama_cpp() {
        let t = smollm();
        assert_eq!(t.encode("The capital of France is", true), [504, 3575, 282, 4649, 314]);
        assert_eq!(t.encode("def fibonacci(n):", true), [1604, 3987, 46477, 24, 94, 727]);
        assert_eq!(t.encode("", true), Vec::<u32>::new());
    }

    #[test]
    fn smollm_encodes_like_hf_tokenizers() {
        // Reference: Hugging Face `tokenizers` 0.23 built from this file's vocabulary and merges
        // with SmolLM2's pre-tokenizer (individual digits, then byte-level GPT-2 regex).
        let t = smollm();
        let cases: &[(&str, &[u32])] = &[
            ("  \n\n  x", &[256, 8866, 1792]),
            ("12345", &[33, 34, 35, 36, 37]),
            ("Hello   world\n", &[19556, 256, 905, 198]),
            ("I'm sure they'll", &[57, 5248, 2090, 502, 3060]),
            ("héllo 😀", &[88, 2756, 31394, 40303, 218]),
            (
                "x = [1, 22]\n\tif y:\n\t\treturn",
                &[
                    104, 446, 933, 33, 28, 216, 34, 34, 77, 198, 197, 342, 329, 42, 3354, 197, 5406,
                ],
            ),
        ];
        for (text, want) in cases {
            assert_eq!(t.encode(text, true), *want, "{text:?}");
        }
    }

    #[test]
    fn smollm_metadata() {
        let t = smollm();
        assert_eq!(t.vocab_size(), 49152);
        assert_eq!(t.eog_ids(), [0, 2, 4]);
        assert!(t.is_eog(0) && t.is_eog(2) && t.is_eog(4));
        assert!(!t.is_eog(1) && !t.is_eog(3) && !t.is_eog(504) && !t.is_eog(u32::MAX));
        assert!(!t.add_bos());
        assert_eq!(t.bos_id(), Some(1));
        assert_eq!(t.eos_id(), Some(2));
        assert_eq!(t.token_text(1), Some("<|im_start|>"));
        assert_eq!(t.token_text(4), Some("<reponame>"));
        assert_eq!(t.token_text(49152), None);
    }

    #[test]
    fn smollm_special_tokens_parse_only_when_asked() {
        let t = smollm();
        assert_eq!(t.encode("<|im_start|>", true), [1]);
        let plain = t.encode("<|im_start|>", false);
        assert!(plain.len() > 1 && !plain.contains(&1), "{plain:?}");
        assert_eq!(t.decode(&plain), "<|im_start|>");
        let chat = t.encode("<|im_start|>user\nHi<|im_end|>\n", true);
        assert_eq!(chat.first(), Some(&1));
        assert!(chat.contains(&2));
        // Control tokens print nothing.
        assert_eq!(t.decode(&chat), "user\nHi\n");
        assert!(t.token_bytes(1).is_empty() && t.token_bytes(0).is_empty());
    }

    #[test]
    fn smollm_token_bytes() {
        let t = smollm();
        assert_eq!(t.token_bytes(3575), b" capital");
        assert_eq!(t.token_bytes(504), b"The");
        assert!(t.token_bytes(u32::MAX).is_empty());
        assert!(t.token_bytes(49152).is_empty());
        // A multi-byte character split over tokens is reassembled by concatenation.
        let ids = t.encode("😀", false);
        let bytes: Vec<u8> = ids.iter().flat_map(|&i| t.token_bytes(i)).collect();
        assert_eq!(bytes, "😀".as_bytes());
    }

    const TRICKY: &[&str] = &[
        "",
        "Hello, world!",
        "12345",
        "3.14159 and 1,000,000",
        "  \n\n  x",
        "trailing spaces   ",
        "\t\ttabs\tand\r\nCRLF\r\n",
        "I'm sure you'll see they've done it, didn't they? We'd",
        "DON'T SHOUT'S",
        "héllo wörld, ça va? Ñandú",
        "日本語のテキスト、中文文本",
        "emoji 😀🎉👩‍👩‍👧 flags 🇫🇷",
        "Ελληνικά и русский текст",
        "mixed\u{a0}nbsp\u{2003}em space",
        "code: fn main() { println!(\"{}\", x[0]); }",
        "<|im_start|> looks special <|im_end|>",
        "\u{0}\u{1}\u{7f}",
        "      ",
        "\n",
        "a\u{301}e\u{301} combining",
    ];

    #[test]
    fn smollm_round_trips_tricky_strings() {
        let t = smollm();
        for s in TRICKY {
            for special in [false, true] {
                let ids = t.encode(s, special);
                assert!(ids.iter().all(|&i| (i as usize) < t.vocab_size()));
                if special && s.contains("<|im_") {
                    continue; // control tokens print nothing
                }
                assert_eq!(t.decode(&ids), *s, "ids {ids:?}");
            }
        }
    }

    /// Characters whose UTF-8 bytes all have a token in SmolLM2's vocabulary (it lacks the
    /// control bytes 0x04 0x06 0x13 0x14 0x16 0x1D and the lead bytes of U+40000 and above).
    fn smollm_representable(t: &Tokenizer, c: char) -> bool {
        let mut buf = [0u8; 4];
        c.encode_utf8(&mut buf).bytes().all(|b| t.byte_has_token(b))
    }

    #[test]
    fn smollm_drops_only_bytes_it_has_no_token_for() {
        let t = smollm();
        assert!(!smollm_representable(t, '\u{4}'));
        assert!(!smollm_representable(t, '\u{40000}'));
        assert!(smollm_representable(t, '\u{3ffff}'));
        assert_eq!(t.decode(&t.encode("a\u{4}b", false)), "ab");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

        #[test]
        fn smollm_encode_never_panics_and_round_trips(s in proptest::prelude::any::<String>()) {
            let t = smollm();
            let ids = t.encode(&s, false);
            proptest::prop_assert!(ids.iter().all(|&i| (i as usize) < t.vocab_size()));
            // Exactly the bytes the vocabulary can express come back.
            let got: Vec<u8> = ids.iter().flat_map(|&i| t.token_bytes(i)).collect();
            let kept: Vec<u8> = s.bytes().filter(|&b| t.byte_has_token(b)).collect();
            proptest::prop_assert_eq!(got, kept);
            let clean: String = s.chars().filter(|&c| smollm_representable(t, c)).collect();
            proptest::prop_assert_eq!(t.decode(&t.encode(&clean, false)), clean);
            // With special parsing on, encoding must not panic either.
            let _ = t.encode(&s, true);
        }

        #[test]
        fn smollm_round_trips_text_like_strings(s in "[a-zA-Z0-9 \n\t.,;:'\"!?()<>|_éü€😀-]{0,64}") {
            let t = smollm();
            proptest::prop_assert_eq!(t.decode(&t.encode(&s, false)), s);
        }
    }

    // ---- synthetic vocabularies ----

    fn strings(v: &[&str]) -> Value {
        Value::Array(v.iter().map(|s| Value::String(s.to_string())).collect())
    }

    /// A small SentencePiece vocabulary: <unk> <s> </s>, the 256 byte tokens, then `pieces`.
    fn spm_gguf(pieces: &[(&str, f32)], extra: impl FnOnce(GgufWriter) -> GgufWriter) -> Gguf {
        let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
        let mut types = vec![2, 3, 3];
        let mut scores = vec![0.0f32; 3];
        for b in 0..=255u8 {
            tokens.push(format!("<0x{b:02X}>"));
            types.push(6);
            scores.push(0.0);
        }
        for (p, s) in pieces {
            tokens.push(p.to_string());
            types.push(1);
            scores.push(*s);
        }
        let w = GgufWriter::default()
            .kv(KEY_MODEL, Value::String("llama".into()))
            .kv(
                KEY_TOKENS,
                Value::Array(tokens.into_iter().map(Value::String).collect()),
            )
            .kv(
                KEY_TOKEN_TYPE,
                Value::Array(types.into_iter().map(Value::I32).collect()),
            )
            .kv(KEY_SCORES, Value::Array(scores.into_iter().map(Value::F32).collect()));
        Gguf::from_bytes(extra(w).build()).unwrap()
    }

    const SPM_BASE: usize = 3 + 256;

    #[test]
    fn spm_merges_highest_score_first() {
        // ids: ▁ 259, a 260, b 261, c 262, ab 263, bc 264, ▁a 265, abc 266
        let pieces = |ab: f32, bc: f32| {
            [
                ("▁", -1.0),
                ("a", -2.0),
                ("b", -2.0),
                ("c", -2.0),
                ("ab", ab),
                ("bc", bc),
                ("▁a", -8.0),
                ("abc", -0.5),
            ]
        };
        let id = |i: usize| (SPM_BASE + i) as u32;
        // "ab" beats "bc" and "▁a": ▁ ab c, then ab + c forms "abc".
        let t = Tokenizer::from_gguf(&spm_gguf(&pieces(-3.0, -4.0), |w| w)).unwrap();
        assert!(t.add_bos());
        assert_eq!(t.encode("abc", false), [1, id(0), id(7)]);
        // "bc" beats "ab": ▁ a bc, then a + bc forms "abc" all the same.
        let t2 = Tokenizer::from_gguf(&spm_gguf(&pieces(-4.0, -3.0), |w| w)).unwrap();
        assert_eq!(t2.encode("abc", false), [1, id(0), id(7)]);
        // Without "abc", the order decides the split.
        let mut p = pieces(-3.0, -4.0).to_vec();
        p[7] = ("zzz", -0.5);
        let t3 = Tokenizer::from_gguf(&spm_gguf(&p, |w| w)).unwrap();
        assert_eq!(t3.encode("abc", false), [1, id(0), id(4), id(3)]);
        p[4].1 = -4.0;
        p[5].1 = -3.0;
        let t4 = Tokenizer::from_gguf(&spm_gguf(&p, |w| w)).unwrap();
        assert_eq!(t4.encode("abc", false), [1, id(6), id(5)]);
        for t in [&t, &t2, &t3, &t4] {
            assert_eq!(t.decode(&t.encode("abc", false)), "abc");
        }
    }

    #[test]
    fn spm_falls_back_to_bytes_and_round_trips() {
        let t = Tokenizer::from_gguf(&spm_gguf(&[("▁", -1.0), ("a", -2.0), ("▁a", -1.5)], |w| w)).unwrap();
        let ids = t.encode("a€ a", false);
        // ▁a, then € as E2 82 AC, then ▁a.
        let byte = |b: u32| 3 + b;
        assert_eq!(ids, [1, 261, byte(0xE2), byte(0x82), byte(0xAC), 261]);
        assert_eq!(t.decode(&ids), "a€ a");
        assert_eq!(t.token_bytes(byte(0xE2)), [0xE2]);
        assert_eq!(t.token_bytes(261), b" a");
        assert!(t.token_bytes(1).is_empty()); // <s>
        assert!(t.token_bytes(0).is_empty()); // <unk>
        assert_eq!(t.eog_ids(), [2]); // </s> as EOS
        // Special tokens, and the space SentencePiece puts after them.
        assert_eq!(t.encode("<s>a", true), [1, 1, 261]);
        let plain = t.encode("<s>", false);
        assert_eq!(plain[0], 1);
        assert!(!plain[1..].contains(&1));
        assert_eq!(t.decode(&plain), "<s>");
    }

    #[test]
    fn spm_without_byte_tokens_uses_unk() {
        let g = GgufWriter::default()
            .kv(KEY_MODEL, Value::String("llama".into()))
            .kv(KEY_TOKENS, strings(&["<unk>", "<s>", "</s>", "▁", "a"]))
            .kv(KEY_TOKEN_TYPE, Value::Array([2, 3, 3, 1, 1].map(Value::I32).to_vec()))
            .kv(KEY_ADD_BOS, Value::Bool(false))
            .build();
        let t = Tokenizer::from_gguf(&Gguf::from_bytes(g).unwrap()).unwrap();
        assert_eq!(t.encode("ab", false), [3, 4, 0]);
        assert_eq!(t.decode(&[3, 4, 0]), "a");
        // Without the space prefix: no ▁ is added, and none is removed.
        let g = GgufWriter::default()
            .kv(KEY_MODEL, Value::String("llama".into()))
            .kv(KEY_TOKENS, strings(&["<unk>", "<s>", "</s>", "▁", "a"]))
            .kv(KEY_ADD_BOS, Value::Bool(false))
            .kv(KEY_ADD_SPACE_PREFIX, Value::Bool(false))
            .build();
        let t = Tokenizer::from_gguf(&Gguf::from_bytes(g).unwrap()).unwrap();
        assert_eq!(t.encode("a", false), [4]);
        assert_eq!(t.encode(" a", false), [3, 4]);
        assert_eq!(t.decode(&[3, 4]), " a");
    }

    type Kvs = Vec<(&'static str, Value)>;

    /// A byte-level vocabulary: the 256 byte characters, then `extra` tokens, with `merges`.
    fn gpt2_kvs(extra: &[&str], merges: &[&str]) -> Kvs {
        let mut tokens: Vec<String> = BYTE_CHARS.iter().map(|c| c.to_string()).collect();
        tokens.extend(extra.iter().map(|s| s.to_string()));
        vec![
            (KEY_MODEL, Value::String("gpt2".into())),
            (KEY_PRE, Value::String("gpt-2".into())),
            (
                KEY_TOKENS,
                Value::Array(tokens.into_iter().map(Value::String).collect()),
            ),
            (KEY_MERGES, strings(merges)),
        ]
    }

    /// `kvs` with `key` set to `v` (replaced, or added).
    fn with(mut kvs: Kvs, key: &'static str, v: Value) -> Kvs {
        kvs.retain(|(k, _)| *k != key);
        kvs.push((key, v));
        kvs
    }

    fn without(mut kvs: Kvs, key: &str) -> Kvs {
        kvs.retain(|(k, _)| *k != key);
        kvs
    }

    fn build(kvs: Kvs) -> Result<Tokenizer, TokenizerError> {
        let w = kvs.into_iter().fold(GgufWriter::default(), |w, (k, v)| w.kv(k, v));
        Tokenizer::from_gguf(&Gguf::from_bytes(w.build()).unwrap())
    }

    #[test]
    fn gpt2_merges_lowest_rank_first() {
        let c = |ch: char| BYTE_CHARS.iter().position(|&x| x == ch).unwrap() as u32;
        // extra ids: he 256, ll 257, hell 258, hello 259, el 260, Ġh 261
        let extra = ["he", "ll", "hell", "hello", "el", "Ġh"];
        let t = build(gpt2_kvs(&extra, &["h e", "l l", "he ll", "hell o"])).unwrap();
        assert_eq!(t.encode("hello", false), [259]);
        assert_eq!(t.encode(" hello", false), [c('Ġ'), 259]);
        // "e l" outranks "h e" and "l l": h el l o, and nothing merges further.
        let t = build(gpt2_kvs(&extra, &["e l", "h e", "l l", "he ll", "hell o"])).unwrap();
        assert_eq!(t.encode("hello", false), [c('h'), 260, c('l'), c('o')]);
        assert_eq!(t.decode(&t.encode("hello", false)), "hello");
        assert!(!t.add_bos());
        assert!(t.eog_ids().is_empty());
        // The llama3 pre-tokenizer adds BOS by default and skips merging whole-token pieces.
        let kvs = with(
            gpt2_kvs(&extra, &["e l", "h e", "l l", "he ll", "hell o"]),
            KEY_PRE,
            Value::String("llama-bpe".into()),
        );
        assert!(matches!(build(kvs.clone()), Err(TokenizerError::AddBosWithoutBos)));
        let t = build(with(kvs, KEY_BOS, Value::U32(0))).unwrap();
        assert_eq!(t.encode("hello", false), [0, 259]);
    }

    #[test]
    fn gpt2_control_and_user_defined_tokens() {
        let mut types = vec![Value::I32(1); 258];
        types[256] = Value::I32(3);
        types[257] = Value::I32(4);
        let kvs = gpt2_kvs(&["<|endoftext|>", "<tool>"], &[]);
        let t = build(with(
            with(kvs, KEY_TOKEN_TYPE, Value::Array(types)),
            KEY_EOS,
            Value::U32(256),
        ))
        .unwrap();
        assert_eq!(t.encode("a<|endoftext|>", true), [97, 256]);
        // User-defined tokens match even without parse_special, and print their text.
        assert_eq!(t.encode("<tool>", false), [257]);
        assert_eq!(t.token_bytes(257), b"<tool>");
        assert!(t.token_bytes(256).is_empty());
        assert_eq!(t.eog_ids(), [256]);
    }

    #[test]
    fn special_tokens_match_longest_first() {
        let mut types = vec![Value::I32(1); 259];
        types[256] = Value::I32(3);
        types[257] = Value::I32(3);
        types[258] = Value::I32(3);
        let t = build(with(
            gpt2_kvs(&["<a>", "<a><b>", "<b>"], &[]),
            KEY_TOKEN_TYPE,
            Value::Array(types),
        ))
        .unwrap();
        assert_eq!(t.encode("<a><b><b><a>", true), [257, 258, 256]);
    }

    #[test]
    fn eog_detection_follows_llama_cpp() {
        // <|end|> is dropped from EOG when <|return|> and <|call|> exist (gpt-oss); FIM
        // repository tokens end generation.
        let extra = ["<|end|>", "<|return|>", "<|call|>", "<|fim_repo|>", "<|channel|>"];
        let t = build(gpt2_kvs(&extra, &[])).unwrap();
        assert_eq!(t.eog_ids(), [257, 258, 259]);
        assert_eq!(t.token_bytes(256), b"<|end|>"); // now user-defined: printed
        assert!(t.token_bytes(257).is_empty()); // made control: not printed
        assert_eq!(t.token_bytes(260), b"<|channel|>");
        // Named ids join the set even when their text is unremarkable.
        let kvs = with(gpt2_kvs(&["<x>", "<y>", "<z>"], &[]), KEY_EOT, Value::U32(256));
        let t = build(with(with(kvs, KEY_EOM, Value::U32(257)), KEY_EOS, Value::U32(258))).unwrap();
        assert_eq!(t.eog_ids(), [256, 257, 258]);
    }

    // ---- malformed metadata: errors, never panics ----

    #[test]
    fn malformed_metadata_is_rejected_with_a_named_error() {
        use TokenizerError as E;
        let ok = || gpt2_kvs(&["he"], &["h e"]);
        assert!(build(ok()).is_ok());
        // Missing tokens array, model or merges; unknown model or pre-tokenizer.
        assert_eq!(build(without(ok(), KEY_TOKENS)).unwrap_err(), E::MissingKey(KEY_TOKENS));
        assert_eq!(build(without(ok(), KEY_MODEL)).unwrap_err(), E::MissingKey(KEY_MODEL));
        assert_eq!(build(without(ok(), KEY_MERGES)).unwrap_err(), E::MissingKey(KEY_MERGES));
        let e = build(with(ok(), KEY_MODEL, Value::String("bert".into()))).unwrap_err();
        assert!(e.to_string().contains("\"bert\""), "{e}");
        assert!(matches!(
            build(with(ok(), KEY_PRE, Value::String("klingon".into()))),
            Err(E::UnknownPre { name }) if name == "klingon"
        ));
        assert!(matches!(
            build(with(ok(), KEY_PRE, Value::U32(1))),
            Err(E::WrongType { key: KEY_PRE, .. })
        ));
        // Non-string tokens (GGUF arrays are of one type); tokens that are not an array; no
        // tokens; duplicate tokens.
        assert!(matches!(
            build(with(ok(), KEY_TOKENS, Value::Array((0..300).map(Value::U32).collect()))),
            Err(E::WrongElementType {
                key: KEY_TOKENS,
                index: 0,
                found: "u32",
                ..
            })
        ));
        assert!(matches!(
            build(with(ok(), KEY_TOKENS, Value::String("abc".into()))),
            Err(E::WrongType { key: KEY_TOKENS, .. })
        ));
        assert_eq!(
            build(with(ok(), KEY_TOKENS, strings(&[]))).unwrap_err(),
            E::BadVocabSize(0)
        );
        let dup = with(gpt2_kvs(&[], &[]), KEY_TOKENS, strings(&["x", "y", "x"]));
        assert!(matches!(
            build(dup),
            Err(E::DuplicateToken {
                first: 0,
                second: 2,
                ..
            })
        ));
        // Merges referencing unknown tokens, or without a separator, or not strings.
        for (m, why) in [
            ("h zz", "right side \"zz\""),
            ("zz h", "left side \"zz\""),
            ("q e", "merged text \"qe\""),
            ("he", "no space"),
            (" ", "no space"),
        ] {
            let e = build(gpt2_kvs(&["he"], &[m])).unwrap_err();
            assert!(
                matches!(&e, E::BadMerge { index: 0, .. }) && e.to_string().contains(why),
                "{m:?}: {e}"
            );
        }
        let e = build(gpt2_kvs(&["he"], &["h e", "zz yy"])).unwrap_err();
        assert!(matches!(e, E::BadMerge { index: 1, .. }), "{e}");
        assert!(matches!(
            build(with(ok(), KEY_MERGES, Value::Array(vec![Value::U8(1)]))),
            Err(E::WrongElementType {
                key: KEY_MERGES,
                index: 0,
                ..
            })
        ));
        // token_type of the wrong length, of the wrong type, or out of range.
        let types = |v: Vec<Value>| build(with(ok(), KEY_TOKEN_TYPE, Value::Array(v)));
        assert_eq!(
            types(vec![Value::I32(1); 10]).unwrap_err(),
            E::LengthMismatch {
                key: KEY_TOKEN_TYPE,
                found: 10,
                expected: 257
            }
        );
        let mut tt = vec![Value::I32(1); 257];
        tt[3] = Value::I32(9);
        assert_eq!(types(tt.clone()).unwrap_err(), E::BadTokenType { index: 3, value: 9 });
        assert!(matches!(
            types(vec![Value::String("1".into()); 257]),
            Err(E::WrongElementType {
                key: KEY_TOKEN_TYPE,
                index: 0,
                ..
            })
        ));
        tt[3] = Value::I32(6); // BYTE, but its text is not <0xXX>
        assert!(matches!(types(tt), Err(E::BadByteToken { id: 3, .. })));
        // Special ids out of range or of the wrong type; add_bos not a bool or without BOS.
        let id = |k, v| build(with(ok(), k, v));
        assert_eq!(
            id(KEY_BOS, Value::U32(257)).unwrap_err(),
            E::IdOutOfRange {
                key: KEY_BOS,
                id: 257,
                vocab: 257
            }
        );
        assert!(matches!(
            id(KEY_EOS, Value::U64(u64::MAX)),
            Err(E::IdOutOfRange { key: KEY_EOS, .. })
        ));
        assert!(matches!(
            id(KEY_PAD, Value::U32(1 << 20)),
            Err(E::IdOutOfRange { key: KEY_PAD, .. })
        ));
        // 0xFFFFFFFF means none (llama2.c conversions carry it), whichever id carries it.
        for key in [KEY_PAD, KEY_EOT, KEY_UNK] {
            let t = id(key, Value::U32(u32::MAX)).expect("a file whose special id is 0xFFFFFFFF loads");
            assert_eq!(t.encode("he", false), build(ok()).unwrap().encode("he", false), "{key}");
        }
        assert_eq!(id(KEY_PAD, Value::U32(u32::MAX)).unwrap().pad, None);
        assert!(matches!(
            id(KEY_EOT, Value::I32(-1)),
            Err(E::WrongType { key: KEY_EOT, .. })
        ));
        assert!(matches!(
            id(KEY_UNK, Value::F32(1.0)),
            Err(E::WrongType { key: KEY_UNK, .. })
        ));
        assert!(matches!(
            id(KEY_ADD_BOS, Value::U8(1)),
            Err(E::WrongType { key: KEY_ADD_BOS, .. })
        ));
        assert_eq!(id(KEY_ADD_BOS, Value::Bool(true)).unwrap_err(), E::AddBosWithoutBos);
        assert!(id(KEY_BOS, Value::U32(256)).is_ok());
        // SentencePiece scores: wrong length, NaN, non-numeric.
        let spm = |scores: Vec<Value>| {
            build(vec![
                (KEY_MODEL, Value::String("llama".into())),
                (KEY_TOKENS, strings(&["<unk>", "<s>", "</s>"])),
                (KEY_SCORES, Value::Array(scores)),
            ])
        };
        assert!(matches!(
            spm(vec![Value::F32(0.0); 2]),
            Err(E::LengthMismatch { key: KEY_SCORES, .. })
        ));
        assert_eq!(
            spm(vec![Value::F32(0.0), Value::F32(f32::NAN), Value::F32(0.0)]).unwrap_err(),
            E::BadScore { index: 1 }
        );
        assert!(matches!(
            spm(vec![Value::Bool(true); 3]),
            Err(E::WrongElementType {
                key: KEY_SCORES,
                index: 0,
                ..
            })
        ));
        // The defaults BOS 1, EOS 2 and UNK 0 exist here, so this one is fine.
        let t = spm(vec![Value::F32(0.0); 3]).unwrap();
        assert_eq!((t.bos_id(), t.eos_id(), t.unk_id()), (Some(1), Some(2), Some(0)));
    }

    #[test]
    fn a_valid_minimal_gpt2_vocabulary_builds_and_encodes_anything() {
        // Only "a" exists: everything else is dropped, nothing panics.
        let t = build(vec![
            (KEY_MODEL, Value::String("gpt2".into())),
            (KEY_TOKENS, strings(&["a", ""])),
            (KEY_MERGES, strings(&[])),
        ])
        .unwrap();
        assert_eq!(t.encode("a b a 😀", true), [0, 0]);
        assert!(t.token_bytes(1).is_empty());
        assert_eq!(t.decode(&[0, 1, 5, u32::MAX]), "a");
    }
}
