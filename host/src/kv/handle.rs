//! What a holder outside the engine thread keeps of a page: a handle the pool mints.

use serde::{Deserialize, Serialize};
use warden_kernels::tag::PageEntry;

/// A page as something outside the engine thread names it (a plugin's page handle, a question a
/// router forwards to its decode node): the page and the epoch it had when the pool gave it out.
///
/// Only the pool mints one ([`super::KvPool::handles`]); the cluster link reads back, from the
/// wire, handles its own decode node's pool minted. A handle keeps nothing alive: the page may
/// be freed and reused meanwhile, and every use goes through the pool's tag check, which refuses
/// a stale or foreign one (invariant 2). Its serialized form is the cluster protocol's page entry
/// (`page`, `epoch`, `public`).
#[must_use]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PageHandle {
    page: u32,
    epoch: u32,
    public: bool,
}

impl PageHandle {
    /// The handle for a sequence's table entry `e`.
    pub(super) fn of(e: PageEntry) -> Self {
        Self {
            page: e.page,
            epoch: e.epoch,
            public: e.public,
        }
    }

    /// The entry it names, for the tag check.
    pub(super) fn entry(self) -> PageEntry {
        PageEntry {
            page: self.page,
            epoch: self.epoch,
            public: self.public,
        }
    }

    /// A handle for tests of holders (a fake pool's answer).
    #[cfg(test)]
    pub(crate) fn for_test(page: u32, epoch: u32) -> Self {
        Self::of(PageEntry::own(page, epoch))
    }
}
