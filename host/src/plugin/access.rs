//! What a guest holds of KV: its page and sequence handles (resources of the world's `kv`
//! interface), and the host's access behind them, which the server implements over the engine.

use std::future::Future;
use std::pin::Pin;

use crate::kv::{KvError, PageHandle, PageInfo};

/// A KV page handle, minted by the pool for the request's own sequence: the page and the epoch
/// it had then. Every call re-checks both against the page's tag.
pub struct KvPage {
    pub(super) handle: PageHandle,
}

/// The request's sequence handle.
pub struct Sequence;

/// A boxed, sendable future.
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// How an instance reaches its own request's KV. The server implements it over the engine
/// thread, which answers with the pool's tag checks; the instance never sees an address.
pub trait KvAccess: Send + Sync + 'static {
    /// Whether the request has been admitted (so it has a sequence to show).
    fn started(&self) -> bool;
    /// The request's page table, if it is open.
    fn pages(&self) -> BoxFuture<Option<Vec<PageHandle>>>;
    /// What the request's tenant may learn of page `h`, after the tag check.
    fn info(&self, h: PageHandle) -> BoxFuture<Result<PageInfo, KvAccessError>>;
    /// Pins the request's first `tokens` tokens in its tenant's prefix cache; the tokens pinned.
    fn pin(&self, tokens: usize) -> BoxFuture<Result<usize, KvAccessError>>;
    /// Unpins the pinned prefixes within the request's cached prefix; the pages unpinned.
    fn unpin(&self) -> BoxFuture<Result<usize, KvAccessError>>;
}

/// Why a guest's KV call got no answer. The world's `kv` interface hands the guest its message.
#[derive(Debug, Clone, thiserror::Error)]
pub enum KvAccessError {
    /// The request ended, and its sequence with it.
    #[error("the request has ended; its pages are gone")]
    Ended,
    /// The request is not admitted yet.
    #[error("the request has no sequence yet")]
    NotStarted,
    /// The sequence has no page table to show now.
    #[error("the sequence holds no KV pages now (it has ended)")]
    NoPages,
    /// The engine's queue for plugin questions is full.
    #[error("the engine's queue is full; retry")]
    Busy,
    /// The engine stopped before answering.
    #[error("the engine stopped")]
    Stopped,
    /// The engine did not answer before the call's deadline.
    #[error("the engine did not answer within the call's time limit")]
    TimedOut,
    /// A handle this instance does not hold.
    #[error("no such handle")]
    NoSuchHandle,
    /// The instance holds as many handles as it may.
    #[error("more than {0} live handles; drop some first")]
    TooManyHandles(usize),
    /// The instance's resource table has no room for another handle.
    #[error("resource table has no free keys")]
    TableFull,
    /// The pool refused: a failed tag check, or a pin past a limit.
    #[error(transparent)]
    Pool(#[from] KvError),
    /// What a decode node answered, for a question a router forwarded to it.
    #[error("{0}")]
    Remote(String),
    /// The decode node answered another question than the one asked.
    #[error("the decode node answered another question")]
    Mismatched,
}

/// The `kv` interface's errors are strings: the message, as the guest reads it.
impl From<KvAccessError> for String {
    fn from(e: KvAccessError) -> Self {
        e.to_string()
    }
}

/// On the cluster link an error travels as its message, and arrives as [`KvAccessError::Remote`].
impl serde::Serialize for KvAccessError {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for KvAccessError {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(KvAccessError::Remote)
    }
}
