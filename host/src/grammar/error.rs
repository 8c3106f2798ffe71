//! Why a format was not compiled: one error for every stage (size, bounds, the child's check,
//! the compile).

/// Why a format was not compiled.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GrammarError {
    /// The schema (or the grammar made from the tools' schemas) is larger than the limit.
    #[error("the {what} is {size} bytes, more than the limit of {limit}")]
    TooLarge {
        /// What was too large.
        what: &'static str,
        /// Its size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// A keyword whose compile cost its size does not bound, over its limit.
    #[error("{keyword} {value} is too large to compile: {limit}")]
    Keyword {
        /// The keyword.
        keyword: &'static str,
        /// Its value, as given.
        value: String,
        /// What it may be.
        limit: String,
    },
    /// llguidance refused it (an unsupported keyword, an inconsistent schema, a limit hit).
    #[error("the schema cannot be used: {0}")]
    Invalid(String),
    /// Compiling it took longer than the limit, and was stopped.
    #[error("compiling it took longer than {ms} ms and was stopped; simplify it")]
    TimedOut {
        /// The limit.
        ms: u64,
    },
    /// Compiling it needed more memory than the limit, and was stopped.
    #[error("compiling it needed more than {mib} MiB and was stopped; simplify it")]
    TooMuchMemory {
        /// The limit.
        mib: u64,
    },
    /// The vocabulary could not be made into a token trie.
    #[error("structured output is unavailable for this model: {0}")]
    Unavailable(String),
}
