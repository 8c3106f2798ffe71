//! What the pool refuses, and why.

use warden_kernels::tag::{IsolationViolation, Owner};

use super::id::SeqId;

/// Errors from the KV pool.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    /// The pool cannot hold the configured maximum context (invariant 4).
    #[error(
        "KV pool holds {capacity_tokens} tokens ({pages} pages of {page_size}), less than the configured max context of {max_context} tokens; raise the KV memory budget or lower max_context"
    )]
    CapacityBelowContext {
        /// Tokens the pool holds.
        capacity_tokens: usize,
        /// Pages.
        pages: usize,
        /// Slots per page.
        page_size: usize,
        /// The configured maximum context.
        max_context: usize,
    },
    /// The page size or memory budget is unusable.
    #[error("invalid KV pool configuration: {0}")]
    BadConfig(String),
    /// Not enough unreserved pages in the pool.
    #[error("KV pool exhausted: {wanted} pages wanted, {available} available")]
    PoolExhausted {
        /// Pages wanted.
        wanted: usize,
        /// Pages free and unreserved.
        available: usize,
    },
    /// The owner's page budget would be exceeded.
    #[error("owner {owner} KV budget exceeded: {wanted} more pages wanted, {in_use} of {budget} in use")]
    OwnerBudget {
        /// Owner.
        owner: Owner,
        /// Pages wanted.
        wanted: usize,
        /// Pages already reserved or used.
        in_use: usize,
        /// Budget.
        budget: usize,
    },
    /// The sequence id is not open.
    #[error("sequence {0} has no KV state")]
    NoSuchSequence(SeqId),
    /// The sequence id is already open.
    #[error("sequence {0} is already open")]
    AlreadyOpen(SeqId),
    /// A sequence outgrew its reservation.
    #[error("sequence {seq} needs {needed} pages, reserved {reserved}")]
    ReservationExceeded {
        /// Sequence.
        seq: SeqId,
        /// Pages needed.
        needed: usize,
        /// Pages reserved.
        reserved: usize,
    },
    /// Pinning would take the owner past its cap of pinned pages.
    #[error("pinning {wanted} more pages would exceed the tenant's limit of {limit} pinned KV pages ({pinned} pinned)")]
    PinLimit {
        /// Pages the pin would add.
        wanted: usize,
        /// Pages the owner has pinned.
        pinned: usize,
        /// The cap.
        limit: usize,
    },
    /// Pinning would leave too little of the pool unpinned.
    #[error(
        "pinning {wanted} more pages would pass the server's ceiling of {ceiling} pinned KV pages ({pinned} pinned by all tenants); the rest is kept for requests"
    )]
    PinCeiling {
        /// Pages the pin would add.
        wanted: usize,
        /// Pages pinned by all owners.
        pinned: usize,
        /// The ceiling.
        ceiling: usize,
    },
    /// Nothing of the asked prefix is a whole, computed page in the cache.
    #[error(
        "nothing to pin: the first {tokens} tokens hold no whole computed page ({page_size} tokens a page, {cached} tokens of this sequence cached)"
    )]
    NothingToPin {
        /// Tokens asked for.
        tokens: usize,
        /// Slots per page.
        page_size: usize,
        /// Tokens of the sequence in the cache.
        cached: usize,
    },
    /// The sequence begins with a public prefix, which the server keeps pinned itself; none of
    /// its pages are the tenant's to pin.
    #[error(
        "this request begins with a public prefix, which the server keeps cached for every tenant allowed it; there is nothing of the tenant's own to pin"
    )]
    PublicPrefix,
    /// Public prefixes need the prefix cache, which this server runs without.
    #[error("public prefixes need the prefix cache, which this server runs without (kv.prefix_cache = false)")]
    PublicWithoutCache,
    /// A public prefix shorter than a page: nothing of it could be shared.
    #[error(
        "a public prefix of {tokens} tokens holds no whole KV page ({page_size} tokens): nothing of it could be shared"
    )]
    PublicPrefixTooShort {
        /// Its tokens.
        tokens: usize,
        /// Slots per page.
        page_size: usize,
    },
    /// Pinning needs the prefix cache, which this server runs without.
    #[error(
        "the prefix cache is off for this tenant (its policy says kv.prefix_cache = \"off\", or the server has kv.prefix_cache = false), so nothing can be pinned"
    )]
    PrefixCacheOff,
    /// A transferred page's content does not have the page's shape.
    #[error(
        "a transferred page says {written} slots written and carries {values} values; the page's shape needs {expected}"
    )]
    BadPageData {
        /// Slots it says are written.
        written: u32,
        /// Values it carries (K or V).
        values: usize,
        /// Values that many slots take.
        expected: usize,
    },
    /// A transferred page's content does not match its checksum (corrupted on the way).
    #[error(
        "transferred page {index} fails its checksum (sent {expected:#018x}, received content gives {found:#018x})"
    )]
    PageChecksum {
        /// The page's index in the sequence.
        index: usize,
        /// The checksum sent.
        expected: u64,
        /// The checksum of what arrived.
        found: u64,
    },
    /// A tag check failed.
    #[error(transparent)]
    Isolation(#[from] IsolationViolation),
}
