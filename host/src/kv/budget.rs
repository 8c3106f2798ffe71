//! Who may hold how many pages: each owner's cap, the floor it is guaranteed, the pages its open
//! sequences hold or have reserved, the ceiling on pinned pages, and who may read public
//! prefixes. Bookkeeping only: the pool asks before it opens a sequence and tells it what
//! closing gave back.

use std::collections::{HashMap, HashSet};

use warden_kernels::tag::Owner;

use super::error::KvError;

/// The pool's page budgets.
#[derive(Debug)]
pub(super) struct Budgets {
    /// Pages reserved or used per owner.
    held: HashMap<Owner, usize>,
    /// Most pages per owner, where capped.
    caps: HashMap<Owner, usize>,
    /// Pages guaranteed per owner.
    floors: HashMap<Owner, usize>,
    /// Most pages pinned by all owners together.
    pub(super) pin_ceiling: usize,
    /// Owners whose policy lets them read public prefixes (invariant 5).
    public_readers: HashSet<Owner>,
}

impl Budgets {
    /// No caps, floors or readers; pins up to `pin_ceiling` pages.
    pub(super) fn new(pin_ceiling: usize) -> Self {
        Self {
            held: HashMap::new(),
            caps: HashMap::new(),
            floors: HashMap::new(),
            pin_ceiling,
            public_readers: HashSet::new(),
        }
    }

    /// Caps `owner`'s pages; `None` lifts the cap.
    pub(super) fn set_cap(&mut self, owner: Owner, pages: Option<usize>) {
        match pages {
            Some(p) => self.caps.insert(owner, p),
            None => self.caps.remove(&owner),
        };
    }

    /// `owner`'s cap, if it has one.
    pub(super) fn cap(&self, owner: Owner) -> Option<usize> {
        self.caps.get(&owner).copied()
    }

    /// Guarantees `owner` `pages` pages; 0 removes the floor.
    pub(super) fn set_floor(&mut self, owner: Owner, pages: usize) {
        if pages == 0 {
            self.floors.remove(&owner);
        } else {
            self.floors.insert(owner, pages);
        }
    }

    /// The pages `owner` is guaranteed.
    pub(super) fn floor(&self, owner: Owner) -> usize {
        self.floors.get(&owner).copied().unwrap_or(0)
    }

    /// Pages `owner`'s open sequences hold or have reserved.
    pub(super) fn held(&self, owner: Owner) -> usize {
        self.held.get(&owner).copied().unwrap_or(0)
    }

    /// Pages other owners' floors still claim: what `owner` may not take.
    pub(super) fn floors_of_others(&self, owner: Owner) -> usize {
        self.floors
            .iter()
            .filter(|(o, _)| **o != owner)
            .map(|(o, f)| f.saturating_sub(self.held(*o)))
            .sum()
    }

    /// Whether `owner` may take `pages` more under its cap; the refusal names both.
    pub(super) fn check_cap(&self, owner: Owner, pages: usize) -> Result<(), KvError> {
        let in_use = self.held(owner);
        match self.cap(owner) {
            Some(budget) if in_use + pages > budget => Err(KvError::OwnerBudget {
                owner,
                wanted: pages,
                in_use,
                budget,
            }),
            _ => Ok(()),
        }
    }

    /// `owner` now holds `pages` more.
    pub(super) fn charge(&mut self, owner: Owner, pages: usize) {
        *self.held.entry(owner).or_insert(0) += pages;
    }

    /// `owner` gave `pages` back.
    pub(super) fn refund(&mut self, owner: Owner, pages: usize) {
        if let Some(n) = self.held.get_mut(&owner) {
            *n = n.saturating_sub(pages);
            if *n == 0 {
                self.held.remove(&owner);
            }
        }
    }

    /// Lets `owner` read public prefixes, or stops it.
    pub(super) fn set_public_reader(&mut self, owner: Owner, allowed: bool) {
        if allowed {
            self.public_readers.insert(owner);
        } else {
            self.public_readers.remove(&owner);
        }
    }

    /// Whether `owner` may read public prefixes.
    pub(super) fn reads_public(&self, owner: Owner) -> bool {
        self.public_readers.contains(&owner)
    }
}
