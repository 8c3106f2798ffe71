//! Page tags and the one check of them (invariant 2): what every KV page carries (its owner,
//! the epoch of its allocation, the slots written), what a sequence holds of a page (a
//! [`PageEntry`]: the page and the epoch it was given), and [`check_pages`], which every read of a
//! page goes through. The pool that owns the pages maintains the tags; kernels only read them.

use std::fmt;

/// A tenant's id: what the tags of its pages name. Never 0 (no owner: a free page) and never
/// `u64::MAX` ([`Owner::PUBLIC`]); only [`TenantId::new`] makes one, so no tenant can be either.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TenantId(u64);

impl TenantId {
    /// Tenant `id`, if it may be one (not 0, not `u64::MAX`).
    pub const fn new(id: u64) -> Option<Self> {
        match id {
            0 | u64::MAX => None,
            id => Some(Self(id)),
        }
    }

    /// The number (for storage, the wire and metrics).
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for TenantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

#[cfg(feature = "serde")]
impl serde::Serialize for TenantId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for TenantId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let id = <u64 as serde::Deserialize>::deserialize(d)?;
        TenantId::new(id).ok_or_else(|| serde::de::Error::custom(format!("{id} is not a tenant id")))
    }
}

/// Whom a page or a sequence belongs to, as tags record it: a tenant, the public prefixes, or
/// nobody (a free page's tag). The encoding (0 and `u64::MAX`) is this type's alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Owner(u64);

impl Owner {
    /// A free page's owner.
    pub const NONE: Owner = Owner(0);

    /// The owner of public-prefix pages: KV the server computes from text a policy marks public
    /// (invariant 5), which tenants that policy allows read through [`PageEntry::public`]
    /// entries. Never a tenant.
    pub const PUBLIC: Owner = Owner(u64::MAX);

    /// The tenant, if a tenant owns it.
    pub const fn tenant(self) -> Option<TenantId> {
        TenantId::new(self.0)
    }
}

impl From<TenantId> for Owner {
    fn from(t: TenantId) -> Self {
        Owner(t.0)
    }
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Owner::NONE => f.write_str("none"),
            Owner::PUBLIC => f.write_str("public"),
            Owner(id) => write!(f, "{id}"),
        }
    }
}

/// The tag every KV page carries. The pool that owns the pages maintains it; kernels only read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PageTag {
    /// Owning tenant; [`Owner::NONE`] when the page is free.
    pub owner: Owner,
    /// Allocation epoch: changes every time the page is freed, so stale references fail.
    pub epoch: u32,
    /// Token slots the owner has written, from slot 0.
    pub written: u32,
}

impl PageTag {
    /// Whether a holder `owner` with page table entry `e` may use this page: it must be the
    /// page's owner (or, for a public entry, the page must be a public prefix's) and hold the
    /// page's current epoch. Returns the violation otherwise.
    pub fn check_holder(&self, owner: Owner, e: PageEntry) -> Result<(), IsolationViolation> {
        let expected = if e.public { Owner::PUBLIC } else { owner };
        if self.owner != expected {
            return Err(IsolationViolation::ForeignOwner {
                page: e.page,
                expected,
                found: self.owner,
            });
        }
        if self.epoch != e.epoch {
            return Err(IsolationViolation::StaleEpoch {
                page: e.page,
                expected: e.epoch,
                found: self.epoch,
            });
        }
        Ok(())
    }
}

/// One entry of a sequence's page table: which page, and the epoch the sequence was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageEntry {
    /// Page index in the pool.
    pub page: u32,
    /// Epoch at allocation.
    pub epoch: u32,
    /// A public prefix's page, owned by [`Owner::PUBLIC`]: readable, never writable. Only the
    /// pool sets it, for tenants whose policy allows public prefixes.
    pub public: bool,
}

impl PageEntry {
    /// An entry for a page of the holder's own.
    pub fn own(page: u32, epoch: u32) -> Self {
        Self {
            page,
            epoch,
            public: false,
        }
    }
}

/// Why a read was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IsolationViolation {
    /// The page belongs to another owner (or to none).
    #[error("KV page {page} belongs to owner {found}, not to reader {expected}")]
    ForeignOwner {
        /// Page index.
        page: u32,
        /// The reader.
        expected: Owner,
        /// The tag's owner.
        found: Owner,
    },
    /// A write to a public prefix's page, which is read-only.
    #[error("KV page {page} holds a public prefix and cannot be written")]
    PublicPage {
        /// Page index.
        page: u32,
    },
    /// The page was freed and reallocated since the reader got it.
    #[error("KV page {page} has epoch {found}, reader holds epoch {expected} (stale reference)")]
    StaleEpoch {
        /// Page index.
        page: u32,
        /// The reader's epoch.
        expected: u32,
        /// The tag's epoch.
        found: u32,
    },
    /// The read covers slots nobody has written.
    #[error("read of {needed} slots of KV page {page}, only {written} written")]
    UnwrittenSlots {
        /// Page index.
        page: u32,
        /// Slots the read needs.
        needed: u32,
        /// Slots written.
        written: u32,
    },
    /// The page index is outside the pool.
    #[error("KV page {page} is outside the pool of {pages} pages")]
    NoSuchPage {
        /// Page index.
        page: u32,
        /// Pool size.
        pages: usize,
    },
    /// The page table is too short for the positions read.
    #[error("page table of {have} pages cannot cover {positions} positions")]
    ShortPageTable {
        /// Entries present.
        have: usize,
        /// Positions read.
        positions: usize,
    },
}

/// Whether tags are compared. [`TagCheck::Enforce`] everywhere: the one other variant exists
/// only in builds with the `bench-tags-off` feature, for the benchmark that measures what the
/// checks cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TagCheck {
    /// Compare owner, epoch and written slots before every read.
    Enforce,
    /// Bench-only: skip the comparisons (page indices are still bounds-checked).
    #[cfg(feature = "bench-tags-off")]
    SkipForBenchmark,
}

/// Checks every page a read of positions `0..positions` touches.
pub fn check_pages(
    owner: Owner,
    pages: &[PageEntry],
    positions: usize,
    page_size: usize,
    tags: &[PageTag],
    check: TagCheck,
) -> Result<(), IsolationViolation> {
    check_page_range(owner, pages, 0, positions, page_size, tags, check)
}

/// Checks every page a read of positions `from..positions` touches (a sliding window reads no
/// page wholly before `from`, and checks none).
pub fn check_page_range(
    owner: Owner,
    pages: &[PageEntry],
    from: usize,
    positions: usize,
    page_size: usize,
    tags: &[PageTag],
    check: TagCheck,
) -> Result<(), IsolationViolation> {
    // Without the bench feature, enforcing is the only way there is.
    #[cfg(not(feature = "bench-tags-off"))]
    let TagCheck::Enforce = check;
    let need = positions.div_ceil(page_size);
    if pages.len() < need {
        return Err(IsolationViolation::ShortPageTable {
            have: pages.len(),
            positions,
        });
    }
    let first = (from / page_size).min(need);
    for (j, e) in pages[..need].iter().enumerate().skip(first) {
        let tag = tags.get(e.page as usize).ok_or(IsolationViolation::NoSuchPage {
            page: e.page,
            pages: tags.len(),
        })?;
        #[cfg(feature = "bench-tags-off")]
        if check == TagCheck::SkipForBenchmark {
            continue;
        }
        tag.check_holder(owner, *e)?;
        let needed = (positions - j * page_size).min(page_size) as u32;
        if needed > tag.written {
            return Err(IsolationViolation::UnwrittenSlots {
                page: e.page,
                needed,
                written: tag.written,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_is_never_the_free_or_the_public_owner() {
        assert_eq!((TenantId::new(0), TenantId::new(u64::MAX)), (None, None));
        let t = TenantId::new(7).expect("a tenant");
        let o = Owner::from(t);
        assert_eq!((o.tenant(), t.get()), (Some(t), 7));
        assert_eq!((Owner::NONE.tenant(), Owner::PUBLIC.tenant()), (None, None));
        assert_ne!(o, Owner::PUBLIC);
        assert_eq!(Owner::default(), Owner::NONE, "a fresh tag is free");
    }
}
