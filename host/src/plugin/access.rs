//! What a guest holds of KV: its page and sequence handles (resources of the world's `kv`
//! interface), and the host's access behind them, which the server implements over the engine.

use std::future::Future;
use std::pin::Pin;

use crate::kv::PageInfo;
use warden_kernels::tag::PageEntry;

/// A KV page handle, minted by the host for the request's own sequence: the page and the epoch
/// it had then. Every call re-checks both against the page's tag.
pub struct KvPage {
    pub(super) entry: PageEntry,
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
    fn pages(&self) -> BoxFuture<Option<Vec<PageEntry>>>;
    /// What the request's tenant may learn of `entry`, after the tag check.
    fn info(&self, entry: PageEntry) -> BoxFuture<Result<PageInfo, String>>;
    /// Pins the request's first `tokens` tokens in its tenant's prefix cache; the tokens pinned.
    fn pin(&self, tokens: usize) -> BoxFuture<Result<usize, String>>;
    /// Unpins the pinned prefixes within the request's cached prefix; the pages unpinned.
    fn unpin(&self) -> BoxFuture<Result<usize, String>>;
}
