//! Page tags and the one check of them (invariant 2): what every KV page carries (its owner,
//! the epoch of its allocation, the slots written), what a sequence holds of a page (a
//! [`PageEntry`]: the page and the epoch it was given), and [`check_pages`], which every read of a
//! page goes through. The pool that owns the pages maintains the tags; kernels only read them.

/// The owner of public-prefix pages: KV the server computes from text a policy marks public
/// (invariant 5), which tenants that policy allows read through [`PageEntry::public`] entries.
/// Never a tenant's id.
pub const PUBLIC_OWNER: u64 = u64::MAX;

/// The tag every KV page carries. The pool that owns the pages maintains it; kernels only read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PageTag {
    /// Owning tenant; 0 means the page is free.
    pub owner: u64,
    /// Allocation epoch: changes every time the page is freed, so stale references fail.
    pub epoch: u32,
    /// Token slots the owner has written, from slot 0.
    pub written: u32,
}

impl PageTag {
    /// Whether a holder `owner` with page table entry `e` may use this page: it must be the
    /// page's owner (or, for a public entry, the page must be a public prefix's) and hold the
    /// page's current epoch. Returns the violation otherwise.
    pub fn check_holder(&self, owner: u64, e: PageEntry) -> Result<(), IsolationViolation> {
        let expected = if e.public { PUBLIC_OWNER } else { owner };
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
    /// A public prefix's page, owned by [`PUBLIC_OWNER`]: readable, never writable. Only the
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
        expected: u64,
        /// The tag's owner.
        found: u64,
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
    owner: u64,
    pages: &[PageEntry],
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
    for (j, e) in pages[..need].iter().enumerate() {
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
