//! The tagged, paged KV pool: the only owner of KV memory and of every page's tag.
//!
//! * Capacity is a fixed number of pages derived from a memory budget; a pool that cannot hold the
//!   configured maximum context refuses to exist ([`KvPool::check_capacity`], invariant 4).
//! * A sequence opens with a reservation of pages, charged against its owner's budget (a cap);
//!   pages other owners are guaranteed (their floors) are not available to it. Pages are
//!   allocated from that reservation as its positions grow, and the reservation itself may grow
//!   under the same checks ([`KvPool::reserve_to`]). Page table entries ([`PageEntry`]) are
//!   minted only here, carrying the page's epoch at allocation.
//! * Every page has a reference count: the open sequences whose tables hold it, and the prefix
//!   cache. Closing a sequence drops its references; a page returns to the free list only when
//!   the last holder lets go (invariant 3). On free its epoch is bumped and its tag cleared, so
//!   any stale entry fails the tag check (invariant 2). Nothing outside the pool holds a page:
//!   a guest's page handle (a [`PageHandle`], which only the pool mints) or a transfer's entry is
//!   checked against the tag at every use.
//! * The tenant-private prefix cache (`prefix`): a sequence's fully computed pages are offered
//!   to its owner's cache ([`KvPool::cache_computed`]), which holds a reference on each; a later
//!   sequence of the same owner whose prompt starts with the same tokens adopts those pages at
//!   [`KvPool::open`] instead of computing them again. Shared pages are full, so nobody writes
//!   them again; their tag keeps the owner, so only that owner's sequences can read them. Pages
//!   only the cache holds are evictable (least recently idle first) and count as available;
//!   pinned prefixes ([`KvPool::pin_prefix`]) are not, within a per-owner cap and a ceiling for
//!   all owners that always leaves room for one request of the maximum context.
//! * Counters record free, used, cached and pinned pages, allocations, cache hits and evictions,
//!   and tag mismatches.
//!
//! Here: the page slab (tags, epochs, reference counts, the free list, and the one read and one
//! write tag check), the K/V storage, and sequences' tables. Beside it: `budget` (caps, floors,
//! pages held, the pin ceiling, public readers), `handle` (what holders outside the engine
//! thread keep of a page), `id` (a sequence's id), `prefix` (the prefix cache's index), `page`
//! (a page's checksummed content as holders and transfers see it) and `error`.

mod budget;
mod error;
mod handle;
mod id;
mod page;
mod prefix;

use std::collections::HashMap;

use half::f16;
use warden_kernels::attention::{AttnShape, KvLayer};
use warden_kernels::tag::{IsolationViolation, Owner, PageEntry, PageTag};

pub use self::error::KvError;
pub use self::handle::PageHandle;
pub use self::id::SeqId;
use self::page::Checksum;
pub use self::page::{PageData, PageInfo};

/// Pool counters, as `/metrics` and tests read them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KvCounters {
    /// Pages in the pool.
    pub pages_total: usize,
    /// Pages on the free list.
    pub pages_free: usize,
    /// Pages owned by an open sequence.
    pub pages_used: usize,
    /// Pages only the prefix cache holds (pinned or evictable).
    pub pages_cached: usize,
    /// Pages in pinned prefixes (whether or not a sequence also uses them).
    pub pages_pinned: usize,
    /// Prompt tokens served from the prefix cache since start.
    pub prefix_hit_tokens: u64,
    /// Cached pages evicted to make room since start.
    pub prefix_evictions: u64,
    /// Pages reserved for open sequences and not yet allocated.
    pub pages_reserved: usize,
    /// Page allocations since start.
    pub allocations: u64,
    /// Pages returned to the free list since start.
    pub frees: u64,
    /// Reads or writes refused by a tag check since start.
    pub tag_mismatches: u64,
}

#[derive(Debug)]
struct SeqKv {
    owner: Owner,
    pages: Vec<PageEntry>,
    reserved: usize,
    /// The cache nodes of this sequence's leading pages, as far as its computed tokens are
    /// cached (its own pages, or equal ones cached before).
    chain: Vec<prefix::NodeId>,
    /// Whether its leading pages are a public prefix's (then `chain` is in the public tree, and
    /// nothing of the sequence is cached or pinned for its owner).
    public: bool,
}

/// The pool.
pub struct KvPool {
    shape: AttnShape,
    n_layers: usize,
    n_pages: usize,
    k: Vec<f16>,
    v: Vec<f16>,
    tags: Vec<PageTag>,
    /// Holders of each page: open sequences and the prefix cache.
    refs: Vec<u32>,
    /// Open sequences whose table holds each page.
    seq_refs: Vec<u32>,
    /// The cache node holding each page, if any.
    cached: Vec<Option<prefix::NodeId>>,
    free: Vec<u32>,
    seqs: HashMap<SeqId, SeqKv>,
    prefix: prefix::PrefixIndex,
    /// Caps, floors, pages held per owner, the pin ceiling and the public readers.
    budgets: budget::Budgets,
    reserved_total: usize,
    counters: KvCounters,
}

impl std::fmt::Debug for KvPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvPool")
            .field("shape", &self.shape)
            .field("counters", &self.counters())
            .finish()
    }
}

impl KvPool {
    /// Bytes one page takes across all layers (K and V, f16).
    pub fn page_bytes(shape: &AttnShape, n_layers: usize) -> usize {
        2 * n_layers * shape.page_elems() * std::mem::size_of::<f16>()
    }

    /// A pool of as many pages as `memory_bytes` holds.
    pub fn new(shape: AttnShape, n_layers: usize, memory_bytes: usize) -> Result<Self, KvError> {
        if shape.page_size == 0 || shape.page_size > 4096 {
            return Err(KvError::BadConfig(format!(
                "page size {} (1 to 4096 tokens)",
                shape.page_size
            )));
        }
        let per_page = Self::page_bytes(&shape, n_layers);
        let n_pages = memory_bytes / per_page;
        if n_pages == 0 || n_pages > u32::MAX as usize {
            return Err(KvError::BadConfig(format!(
                "a KV memory budget of {memory_bytes} bytes holds {n_pages} pages of {per_page} bytes"
            )));
        }
        let elems = n_layers * n_pages * shape.page_elems();
        Ok(Self {
            shape,
            n_layers,
            n_pages,
            k: vec![f16::ZERO; elems],
            v: vec![f16::ZERO; elems],
            tags: vec![PageTag::default(); n_pages],
            refs: vec![0; n_pages],
            seq_refs: vec![0; n_pages],
            cached: vec![None; n_pages],
            // Pop from the end: page 0 first.
            free: (0..n_pages as u32).rev().collect(),
            seqs: HashMap::new(),
            prefix: prefix::PrefixIndex::default(),
            budgets: budget::Budgets::new(n_pages),
            reserved_total: 0,
            counters: KvCounters {
                pages_total: n_pages,
                ..Default::default()
            },
        })
    }

    /// The KV and head shape.
    pub fn shape(&self) -> &AttnShape {
        &self.shape
    }

    /// Tokens the whole pool holds.
    pub fn capacity_tokens(&self) -> usize {
        self.n_pages * self.shape.page_size
    }

    /// Invariant 4: refuses a pool that cannot hold one sequence of `max_context` tokens.
    pub fn check_capacity(&self, max_context: usize) -> Result<(), KvError> {
        if self.capacity_tokens() < max_context {
            return Err(KvError::CapacityBelowContext {
                capacity_tokens: self.capacity_tokens(),
                pages: self.n_pages,
                page_size: self.shape.page_size,
                max_context,
            });
        }
        Ok(())
    }

    /// Pages needed for `tokens` positions.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.shape.page_size)
    }

    /// Caps the pages (reserved plus used) that `owner` may hold; `None` lifts the cap.
    pub fn set_owner_budget(&mut self, owner: impl Into<Owner>, pages: Option<usize>) {
        self.budgets.set_cap(owner.into(), pages);
    }

    /// Caps the pages pinned by all owners together, so that pins can never take the room one
    /// request of the maximum context needs.
    pub fn set_pin_ceiling(&mut self, pages: usize) {
        self.budgets.pin_ceiling = pages;
    }

    /// Guarantees `owner` a floor of `pages` pages: other owners' sequences may not take the
    /// pages it would need to reach it. 0 removes the floor.
    pub fn set_owner_floor(&mut self, owner: impl Into<Owner>, pages: usize) {
        self.budgets.set_floor(owner.into(), pages);
    }

    /// The most pages one sequence of `owner` could ever get now: the pool less other owners'
    /// unused floors and every pinned page.
    pub fn pages_open_to(&self, owner: impl Into<Owner>) -> usize {
        self.n_pages
            .saturating_sub(self.budgets.floors_of_others(owner.into()))
            .saturating_sub(self.prefix.pinned_total())
    }

    /// Pages `owner`'s open sequences hold or have reserved.
    pub fn pages_held(&self, owner: impl Into<Owner>) -> usize {
        self.budgets.held(owner.into())
    }

    /// The page budget of `owner`, if one is set.
    pub fn owner_budget(&self, owner: impl Into<Owner>) -> Option<usize> {
        self.budgets.cap(owner.into())
    }

    /// Free or evictable pages not promised to any open sequence.
    pub fn available_pages(&self) -> usize {
        let have = self.free.len() + self.prefix.idle_count();
        have - self.reserved_total.min(have)
    }

    /// Opens a sequence for `owner` with `pages` pages in all, or refuses without changing
    /// anything. Its leading pages come from the owner's prefix cache as far as whole pages of
    /// `reusable` (the prompt tokens it may take from the cache; pass none to compute all) match;
    /// the rest are reserved. Returns how many tokens the cache served.
    pub fn open(
        &mut self,
        seq: SeqId,
        owner: impl Into<Owner>,
        pages: usize,
        reusable: &[u32],
    ) -> Result<usize, KvError> {
        self.open_leaving(seq, owner, pages, reusable, 0)
    }

    /// [`open`](Self::open), refused also unless `headroom` pages stay available after it (room
    /// for the sequences already open to grow into).
    pub fn open_leaving(
        &mut self,
        seq: SeqId,
        owner: impl Into<Owner>,
        pages: usize,
        reusable: &[u32],
        headroom: usize,
    ) -> Result<usize, KvError> {
        let owner = owner.into();
        assert_ne!(owner, Owner::NONE, "no owner marks free pages");
        if self.seqs.contains_key(&seq) {
            return Err(KvError::AlreadyOpen(seq));
        }
        // The owner's own cache, or the public prefixes if its policy allows them and they
        // cover more.
        let mut chain = self.cached_chain(owner, reusable, pages);
        let mut public = false;
        if self.budgets.reads_public(owner) {
            let shared = self.cached_chain(Owner::PUBLIC, reusable, pages);
            if shared.len() > chain.len() {
                (chain, public) = (shared, true);
            }
        }
        // Adopting an idle page takes it out of what is available.
        let adopted_idle = chain.iter().filter(|&&id| self.prefix.is_idle(id)).count();
        let reserve = pages - chain.len();
        self.budgets.check_cap(owner, pages)?;
        // Other owners' guaranteed floors are not available to this one.
        let available = self
            .available_pages()
            .saturating_sub(self.budgets.floors_of_others(owner));
        if reserve + adopted_idle + headroom > available {
            return Err(KvError::PoolExhausted {
                wanted: reserve + adopted_idle + headroom,
                available,
            });
        }
        let mut table = Vec::with_capacity(pages);
        for &id in &chain {
            let e = self.prefix.entry(id).expect("a found node exists");
            self.refs[e.page as usize] += 1;
            self.seq_refs[e.page as usize] += 1;
            self.settle(e.page);
            table.push(PageEntry { public, ..e });
        }
        let hit = chain.len() * self.shape.page_size;
        self.reserved_total += reserve;
        self.budgets.charge(owner, pages);
        self.counters.prefix_hit_tokens += hit as u64;
        self.seqs.insert(
            seq,
            SeqKv {
                owner,
                pages: table,
                reserved: reserve,
                chain,
                public,
            },
        );
        Ok(hit)
    }

    /// The cache nodes of `tree`'s prefix cache matching whole pages of `reusable`, at most
    /// `pages`. The cache holds only full pages of that owner; each tag is checked all the same,
    /// and anything else ends the match (invariant 2).
    fn cached_chain(&mut self, tree: Owner, reusable: &[u32], pages: usize) -> Vec<prefix::NodeId> {
        let ps = self.shape.page_size;
        let mut chain = Vec::new();
        for tokens in reusable.chunks_exact(ps).take(pages) {
            let parent = chain.last().copied().unwrap_or(prefix::ROOT);
            let Some(id) = self.prefix.find(tree, parent, tokens) else {
                break;
            };
            let e = self.prefix.entry(id).expect("a found node exists");
            let tag = self.tags[e.page as usize];
            if tag.check_holder(tree, e).is_err() || tag.written as usize != ps {
                self.counters.tag_mismatches += 1;
                break;
            }
            chain.push(id);
        }
        chain
    }

    /// Lets `owner` read public prefixes, or stops it (for sequences opened from now on).
    pub fn set_public_access(&mut self, owner: impl Into<Owner>, allowed: bool) {
        self.budgets.set_public_reader(owner.into(), allowed);
    }

    /// Puts page `page` into the eviction order if only the cache holds it and nothing pinned
    /// depends on it, and takes it out otherwise.
    fn settle(&mut self, page: u32) {
        let i = page as usize;
        if let Some(id) = self.cached[i] {
            let idle = self.refs[i] == 1 && !self.prefix.is_pinned(id);
            self.prefix.set_idle(id, idle);
        }
    }

    /// A page off the free list, evicting the longest-idle cached prefix if the list is empty.
    fn take_free_page(&mut self) -> Option<u32> {
        if self.free.is_empty()
            && let Some(id) = self.prefix.oldest_idle()
        {
            self.counters.prefix_evictions += self.uncache(id);
        }
        self.free.pop()
    }

    /// Removes cache node `id` and its subtree, dropping the cache's reference on their pages;
    /// returns how many pages it dropped.
    fn uncache(&mut self, id: prefix::NodeId) -> u64 {
        let mut dropped = 0;
        for e in self.prefix.remove_subtree(id) {
            let i = e.page as usize;
            if self.cached[i].is_some() && self.tags[i].epoch == e.epoch {
                self.cached[i] = None;
                dropped += 1;
                self.unref(e.page);
            }
        }
        dropped
    }

    /// The cache's nodes for the sequence's leading pages, trimmed to those still cached.
    fn live_chain(&mut self, seq: SeqId) -> Result<&mut SeqKv, KvError> {
        let s = self.seqs.get_mut(&seq).ok_or(KvError::NoSuchSequence(seq))?;
        // Evicting a node removes its subtree, so the first missing node ends what is valid.
        let valid = s.chain.iter().take_while(|&&id| self.prefix.contains(id)).count();
        s.chain.truncate(valid);
        Ok(s)
    }

    /// Offers the sequence's whole computed pages to its owner's prefix cache: `computed` are the
    /// tokens (from position 0) whose K and V the sequence has written. A page whose tokens are
    /// cached already is not cached twice.
    pub fn cache_computed(&mut self, seq: SeqId, computed: &[u32]) -> Result<(), KvError> {
        let ps = self.shape.page_size;
        let s = self.live_chain(seq)?;
        if s.public {
            return Ok(());
        }
        let (owner, full) = (s.owner, (computed.len() / ps).min(s.pages.len()));
        let mut chain = std::mem::take(&mut s.chain);
        let pages = s.pages[chain.len()..full].to_vec();
        for (j, e) in (chain.len()..full).zip(pages) {
            let tokens = &computed[j * ps..(j + 1) * ps];
            let parent = chain.last().copied().unwrap_or(prefix::ROOT);
            let id = match self.prefix.find(owner, parent, tokens) {
                Some(id) => id,
                None => {
                    let i = e.page as usize;
                    let tag = self.tags[i];
                    if let Err(v) = tag.check_holder(owner, e) {
                        self.counters.tag_mismatches += 1;
                        self.seqs.get_mut(&seq).expect("open").chain = chain;
                        return Err(v.into());
                    }
                    if tag.written as usize != ps || self.cached[i].is_some() {
                        break;
                    }
                    let id = self.prefix.insert(owner, parent, tokens, e);
                    self.cached[i] = Some(id);
                    self.refs[i] += 1;
                    id
                }
            };
            chain.push(id);
        }
        self.seqs.get_mut(&seq).expect("open").chain = chain;
        Ok(())
    }

    /// Pins the first `tokens` tokens of the sequence's prefix in its owner's cache, in whole
    /// pages as far as they are cached, so eviction cannot take them: a later request of the
    /// owner that starts with them skips their prefill. An owner may pin at most `limit` pages.
    /// Returns the tokens pinned (a multiple of the page size).
    pub fn pin_prefix(&mut self, seq: SeqId, tokens: usize, limit: usize) -> Result<usize, KvError> {
        let ps = self.shape.page_size;
        let s = self.live_chain(seq)?;
        if s.public {
            return Err(KvError::PublicPrefix);
        }
        let owner = s.owner;
        let path: Vec<prefix::NodeId> = s.chain.iter().take(tokens / ps).copied().collect();
        if path.is_empty() {
            return Err(KvError::NothingToPin {
                tokens,
                page_size: ps,
                cached: s.chain.len() * ps,
            });
        }
        let wanted = self.prefix.unpinned_on(&path);
        let pinned = self.prefix.pinned_pages(owner);
        if pinned + wanted > limit {
            return Err(KvError::PinLimit { wanted, pinned, limit });
        }
        let all = self.prefix.pinned_total();
        if all + wanted > self.budgets.pin_ceiling {
            return Err(KvError::PinCeiling {
                wanted,
                pinned: all,
                ceiling: self.budgets.pin_ceiling,
            });
        }
        // Pinning an idle page takes it out of what is available.
        let idle = path.iter().filter(|&&id| self.prefix.is_idle(id)).count();
        if idle > self.available_pages() {
            return Err(KvError::PoolExhausted {
                wanted: idle,
                available: self.available_pages(),
            });
        }
        for id in self.prefix.pin(owner, &path) {
            let e = self.prefix.entry(id).expect("a pinned node exists");
            self.settle(e.page);
        }
        Ok(path.len() * ps)
    }

    /// Unpins every pinned prefix that ends within the sequence's cached prefix; its pages become
    /// evictable once nothing else holds or pins them. Returns how many pages that unpinned.
    pub fn unpin_prefix(&mut self, seq: SeqId) -> Result<usize, KvError> {
        let s = self.live_chain(seq)?;
        if s.public {
            return Ok(0);
        }
        let (owner, path) = (s.owner, s.chain.clone());
        let freed = self.prefix.unpin(owner, &path);
        for &id in &freed {
            let e = self.prefix.entry(id).expect("an unpinned node exists");
            self.settle(e.page);
        }
        Ok(freed.len())
    }

    /// Drops everything `owner` has in the prefix cache, pinned or not (e.g. when the tenant is
    /// deleted). Pages its open sequences use stay with them.
    pub fn forget_owner(&mut self, owner: impl Into<Owner>) {
        let owner = owner.into();
        for id in self.prefix.roots_of(owner) {
            self.uncache(id);
        }
    }

    /// Pages the sequence holds or has reserved.
    pub fn pages_of(&self, seq: SeqId) -> Result<usize, KvError> {
        let s = self.seqs.get(&seq).ok_or(KvError::NoSuchSequence(seq))?;
        Ok(s.pages.len() + s.reserved)
    }

    /// Grows the sequence's reservation until it holds `pages` pages in all (nothing, if it
    /// holds that many already), charged to its owner as [`open`](Self::open) charges: refused,
    /// changing nothing, past the owner's cap or past the pages available to it (other owners'
    /// floors are not).
    pub fn reserve_to(&mut self, seq: SeqId, pages: usize) -> Result<(), KvError> {
        let s = self.seqs.get(&seq).ok_or(KvError::NoSuchSequence(seq))?;
        let (owner, more) = (s.owner, pages.saturating_sub(s.pages.len() + s.reserved));
        if more == 0 {
            return Ok(());
        }
        self.budgets.check_cap(owner, more)?;
        let available = self
            .available_pages()
            .saturating_sub(self.budgets.floors_of_others(owner));
        if more > available {
            return Err(KvError::PoolExhausted {
                wanted: more,
                available,
            });
        }
        self.seqs.get_mut(&seq).expect("looked up above").reserved += more;
        self.reserved_total += more;
        self.budgets.charge(owner, more);
        Ok(())
    }

    /// The pages `owner` is guaranteed (0: no floor).
    pub fn owner_floor(&self, owner: impl Into<Owner>) -> usize {
        self.budgets.floor(owner.into())
    }

    /// Allocates pages from the sequence's reservation until it covers `positions` tokens.
    pub fn ensure(&mut self, seq: SeqId, positions: usize) -> Result<(), KvError> {
        let need = self.pages_for(positions);
        let s = self.seqs.get_mut(&seq).ok_or(KvError::NoSuchSequence(seq))?;
        if need > s.pages.len() + s.reserved {
            return Err(KvError::ReservationExceeded {
                seq,
                needed: need,
                reserved: s.pages.len() + s.reserved,
            });
        }
        let (owner, have) = (s.owner, s.pages.len());
        for _ in have..need {
            // Reserved pages are free or evictable: `open` checks `available_pages`, and every
            // change that takes pages out of that set checks it too.
            let page = self.take_free_page().expect("a reserved page is free or evictable");
            let i = page as usize;
            debug_assert_eq!(self.refs[i], 0);
            self.refs[i] = 1;
            self.seq_refs[i] = 1;
            self.tags[i] = PageTag {
                owner,
                epoch: self.tags[i].epoch,
                written: 0,
            };
            let s = self.seqs.get_mut(&seq).expect("open");
            s.pages.push(PageEntry::own(page, self.tags[i].epoch));
            s.reserved -= 1;
            self.reserved_total -= 1;
            self.counters.allocations += 1;
        }
        Ok(())
    }

    /// The sequence's owner and page table.
    pub fn table(&self, seq: SeqId) -> Result<(Owner, &[PageEntry]), KvError> {
        let s = self.seqs.get(&seq).ok_or(KvError::NoSuchSequence(seq))?;
        Ok((s.owner, &s.pages))
    }

    /// The sequence's owner and handles to its pages, for holders outside the engine thread.
    pub fn handles(&self, seq: SeqId) -> Result<(Owner, Vec<PageHandle>), KvError> {
        let (owner, table) = self.table(seq)?;
        Ok((owner, table.iter().copied().map(PageHandle::of).collect()))
    }

    /// Marks positions `0..upto` of the sequence as written. Called when a step that writes those
    /// slots begins: the step writes each layer's slot before that layer's attention reads it.
    pub fn commit_slots(&mut self, seq: SeqId, upto: usize) -> Result<(), KvError> {
        let ps = self.shape.page_size;
        let s = self.seqs.get(&seq).ok_or(KvError::NoSuchSequence(seq))?;
        if self.pages_for(upto) > s.pages.len() {
            return Err(IsolationViolation::ShortPageTable {
                have: s.pages.len(),
                positions: upto,
            }
            .into());
        }
        for (j, e) in s.pages.iter().enumerate() {
            let t = &mut self.tags[e.page as usize];
            if let Err(v) = t.check_holder(s.owner, *e) {
                self.counters.tag_mismatches += 1;
                return Err(v.into());
            }
            let w = upto.saturating_sub(j * ps).min(ps) as u32;
            t.written = t.written.max(w);
        }
        Ok(())
    }

    /// Writes one token's K and V rows (`kv_dim` each) for `layer` at `pos` of the sequence whose
    /// page table is `pages`, after checking that the page is the writer's.
    pub fn write(
        &mut self,
        layer: usize,
        owner: Owner,
        pages: &[PageEntry],
        pos: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), KvError> {
        let ps = self.shape.page_size;
        let kvd = self.shape.kv_dim();
        assert!(layer < self.n_layers && k.len() == kvd && v.len() == kvd);
        let e = *pages.get(pos / ps).ok_or(IsolationViolation::ShortPageTable {
            have: pages.len(),
            positions: pos + 1,
        })?;
        self.check_write(owner, e)?;
        let at = ((layer * self.n_pages + e.page as usize) * ps + pos % ps) * kvd;
        half::slice::HalfFloatSliceExt::convert_from_f32_slice(&mut self.k[at..at + kvd], k);
        half::slice::HalfFloatSliceExt::convert_from_f32_slice(&mut self.v[at..at + kvd], v);
        Ok(())
    }

    /// What holder `owner` with handle `h` may learn of a page: its written slots, epoch, and a
    /// checksum of the K and V it holds (written slots only, every layer). The tag is checked
    /// first, so a stale or foreign handle learns nothing. A refusal here is not counted as an
    /// isolation violation: it is how a plugin finds that a page it was shown has since left
    /// its sequence.
    pub fn inspect(&self, owner: impl Into<Owner>, h: PageHandle) -> Result<PageInfo, KvError> {
        let e = h.entry();
        let tag = self.check_read(owner.into(), e)?;
        let ps = self.shape.page_size;
        let kvd = self.shape.kv_dim();
        let slots = (tag.written as usize).min(ps);
        let mut sum = Checksum::default();
        for layer in 0..self.n_layers {
            let at = (layer * self.n_pages + e.page as usize) * ps * kvd;
            sum.add(&self.k[at..at + slots * kvd]);
            sum.add(&self.v[at..at + slots * kvd]);
        }
        Ok(PageInfo {
            written: tag.written,
            epoch: tag.epoch,
            checksum: sum.finish(),
        })
    }

    /// Layers of K and V each page holds.
    pub fn n_layers(&self) -> usize {
        self.n_layers
    }

    /// The content of the page behind holder `owner`'s entry `e`, for a transfer: tag-checked
    /// first (invariant 2), so a stale or foreign entry exports nothing.
    pub fn export_page(&self, owner: impl Into<Owner>, e: PageEntry) -> Result<PageData, KvError> {
        let tag = self.check_read(owner.into(), e)?;
        let ps = self.shape.page_size;
        let kvd = self.shape.kv_dim();
        let slots = (tag.written as usize).min(ps);
        let mut k = Vec::with_capacity(self.n_layers * slots * kvd);
        let mut v = Vec::with_capacity(self.n_layers * slots * kvd);
        let mut sum = Checksum::default();
        for layer in 0..self.n_layers {
            let at = (layer * self.n_pages + e.page as usize) * ps * kvd;
            let (ks, vs) = (&self.k[at..at + slots * kvd], &self.v[at..at + slots * kvd]);
            sum.add(ks);
            sum.add(vs);
            k.extend_from_slice(ks);
            v.extend_from_slice(vs);
        }
        Ok(PageData {
            written: slots as u32,
            k,
            v,
            checksum: sum.finish(),
        })
    }

    /// Writes a transferred page into page `index` of the sequence's table (allocated with
    /// [`ensure`](Self::ensure)) after checking that the page is the sequence's own, that the
    /// content has the page's shape, and that its checksum holds. The slots are not marked
    /// written: the receiver does that with [`commit_slots`](Self::commit_slots) once the whole
    /// transfer is verified, so nothing reads a page of a transfer that may yet fail.
    pub fn import_page(&mut self, seq: SeqId, index: usize, data: &PageData) -> Result<(), KvError> {
        let ps = self.shape.page_size;
        let kvd = self.shape.kv_dim();
        let s = self.seqs.get(&seq).ok_or(KvError::NoSuchSequence(seq))?;
        let e = *s.pages.get(index).ok_or(IsolationViolation::ShortPageTable {
            have: s.pages.len(),
            positions: (index + 1) * ps,
        })?;
        self.check_write(s.owner, e)?;
        let slots = data.written as usize;
        let len = self.n_layers * slots * kvd;
        if slots == 0 || slots > ps || data.k.len() != len || data.v.len() != len {
            return Err(KvError::BadPageData {
                written: data.written,
                values: data.k.len().max(data.v.len()),
                expected: len,
            });
        }
        let sum = data.computed_checksum(self.n_layers);
        if sum != data.checksum {
            return Err(KvError::PageChecksum {
                index,
                expected: data.checksum,
                found: sum,
            });
        }
        for layer in 0..self.n_layers {
            let at = (layer * self.n_pages + e.page as usize) * ps * kvd;
            let from = layer * slots * kvd;
            self.k[at..at + slots * kvd].copy_from_slice(&data.k[from..from + slots * kvd]);
            self.v[at..at + slots * kvd].copy_from_slice(&data.v[from..from + slots * kvd]);
        }
        Ok(())
    }

    /// One layer's K/V storage, for attention.
    pub fn layer(&self, layer: usize) -> KvLayer<'_> {
        let n = self.n_pages * self.shape.page_elems();
        KvLayer {
            k: &self.k[layer * n..(layer + 1) * n],
            v: &self.v[layer * n..(layer + 1) * n],
        }
    }

    /// Every page's tag.
    pub fn tags(&self) -> &[PageTag] {
        &self.tags
    }

    /// Counts a refused read (attention reports these to the engine, which reports them here).
    pub fn record_violation(&mut self) {
        self.counters.tag_mismatches += 1;
    }

    fn unref(&mut self, page: u32) {
        let i = page as usize;
        self.refs[i] -= 1;
        if self.refs[i] == 0 {
            let t = &mut self.tags[i];
            // Invariant 3: the epoch changes before the page can be handed out again.
            *t = PageTag {
                owner: Owner::NONE,
                epoch: t.epoch.wrapping_add(1),
                written: 0,
            };
            self.free.push(page);
            self.counters.frees += 1;
        }
    }

    /// Closes a sequence: returns its unused reservation and drops its page references. Pages the
    /// prefix cache or other sequences still hold stay.
    pub fn close(&mut self, seq: SeqId) -> Result<(), KvError> {
        let s = self.seqs.remove(&seq).ok_or(KvError::NoSuchSequence(seq))?;
        self.reserved_total -= s.reserved;
        let mut held = s.reserved;
        for e in s.pages {
            let i = e.page as usize;
            // Release only what the tags say this sequence holds: an entry that names another
            // owner's page or a stale epoch (a corrupted table) must not free someone else's page.
            match self.tags.get(i) {
                Some(t) if t.check_holder(s.owner, e).is_ok() && self.seq_refs[i] > 0 => {
                    self.seq_refs[i] -= 1;
                    self.unref(e.page);
                    self.settle(e.page);
                    held += 1;
                }
                _ => self.counters.tag_mismatches += 1,
            }
        }
        self.budgets.refund(s.owner, held);
        Ok(())
    }

    /// A sequence's page table, writable: tests use it to forge the tables a bug (or an attacker)
    /// would produce, and check that the tags catch them.
    #[cfg(test)]
    pub(crate) fn forge_table(&mut self, seq: SeqId) -> &mut Vec<PageEntry> {
        &mut self.seqs.get_mut(&seq).expect("open sequence").pages
    }

    /// The tag check of a read of page `e` by `owner` (invariant 2): the page exists and the
    /// holder holds it at its epoch (a public entry: the page is a public prefix's).
    fn check_read(&self, owner: Owner, e: PageEntry) -> Result<PageTag, IsolationViolation> {
        let tag = *self.tags.get(e.page as usize).ok_or(IsolationViolation::NoSuchPage {
            page: e.page,
            pages: self.n_pages,
        })?;
        tag.check_holder(owner, e)?;
        Ok(tag)
    }

    /// The tag check of a write to page `e` by `owner`: a read's, and the page is the holder's
    /// own (a public prefix's is read-only). A refused write to an existing page counts as a
    /// tag mismatch.
    fn check_write(&mut self, owner: Owner, e: PageEntry) -> Result<(), IsolationViolation> {
        let checked = if e.public {
            Err(IsolationViolation::PublicPage { page: e.page })
        } else {
            self.check_read(owner, e).map(|_| ())
        };
        if let Err(v) = &checked
            && !matches!(v, IsolationViolation::NoSuchPage { .. })
        {
            self.counters.tag_mismatches += 1;
        }
        checked
    }

    /// The counters now.
    pub fn counters(&self) -> KvCounters {
        let mut c = self.counters;
        c.pages_free = self.free.len();
        c.pages_used = self.seq_refs.iter().filter(|&&n| n > 0).count();
        c.pages_cached = (0..self.n_pages)
            .filter(|&i| self.seq_refs[i] == 0 && self.cached[i].is_some())
            .count();
        c.pages_pinned = self.prefix.pinned_total();
        c.pages_reserved = self.reserved_total;
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::tenant;
    use proptest::prelude::*;

    #[test]
    fn the_page_checksum_is_xxh3_of_the_little_endian_values_layer_by_layer() {
        // Two layers, one slot each, kv_dim 3 (and more than one buffer's worth below).
        let vals = |base: f32, n: usize| (0..n).map(|i| f16::from_f32(base + i as f32)).collect::<Vec<_>>();
        let data = PageData {
            written: 1,
            k: vals(1.0, 6),
            v: vals(100.0, 6),
            checksum: 0,
        };
        let mut bytes = Vec::new();
        for l in 0..2 {
            for x in data.k[l * 3..l * 3 + 3].iter().chain(&data.v[l * 3..l * 3 + 3]) {
                bytes.extend_from_slice(&x.to_bits().to_le_bytes());
            }
        }
        assert_eq!(data.computed_checksum(2), xxhash_rust::xxh3::xxh3_64(&bytes));
        let long = PageData {
            written: 1,
            k: vals(0.5, 10_000),
            v: vals(7.0, 10_000),
            checksum: 0,
        };
        let bytes: Vec<u8> = long
            .k
            .iter()
            .chain(&long.v)
            .flat_map(|x| x.to_bits().to_le_bytes())
            .collect();
        assert_eq!(long.computed_checksum(1), xxhash_rust::xxh3::xxh3_64(&bytes));
    }

    const SHAPE: AttnShape = AttnShape {
        n_heads: 2,
        n_kv_heads: 1,
        head_dim: 4,
        page_size: 4,
    };

    fn pool(pages: usize) -> KvPool {
        KvPool::new(SHAPE, 2, pages * KvPool::page_bytes(&SHAPE, 2)).unwrap()
    }

    #[test]
    fn capacity_check_names_both_numbers() {
        let p = pool(10);
        assert!(p.check_capacity(40).is_ok());
        let e = p.check_capacity(41).unwrap_err().to_string();
        assert!(e.contains("40 tokens") && e.contains("41 tokens"), "{e}");
    }

    #[test]
    fn free_bumps_epoch_and_clears_tag() {
        let mut p = pool(2);
        p.open(SeqId(1), tenant(5), 1, &[]).unwrap();
        p.ensure(SeqId(1), 3).unwrap();
        let e = p.table(SeqId(1)).unwrap().1[0];
        p.commit_slots(SeqId(1), 3).unwrap();
        assert_eq!(
            p.tags()[e.page as usize],
            PageTag {
                owner: tenant(5).into(),
                epoch: e.epoch,
                written: 3
            }
        );
        p.close(SeqId(1)).unwrap();
        assert_eq!(
            p.tags()[e.page as usize],
            PageTag {
                owner: Owner::NONE,
                epoch: e.epoch + 1,
                written: 0
            }
        );
        // The stale entry no longer works for writes.
        assert!(p.write(0, tenant(5).into(), &[e], 0, &[0.0; 4], &[0.0; 4]).is_err());
        assert_eq!(p.counters().tag_mismatches, 1);
    }

    #[test]
    fn budgets_and_exhaustion_refuse_without_side_effects() {
        let mut p = pool(4);
        p.set_owner_budget(tenant(7), Some(2));
        assert!(matches!(
            p.open(SeqId(1), tenant(7), 3, &[]),
            Err(KvError::OwnerBudget { .. })
        ));
        p.open(SeqId(1), tenant(7), 2, &[]).unwrap();
        assert!(matches!(
            p.open(SeqId(2), tenant(7), 1, &[]),
            Err(KvError::OwnerBudget { .. })
        ));
        p.open(SeqId(3), tenant(8), 2, &[]).unwrap();
        assert!(matches!(
            p.open(SeqId(4), tenant(9), 1, &[]),
            Err(KvError::PoolExhausted { .. })
        ));
        assert_eq!(p.counters().allocations, 0);
        assert!(matches!(
            p.ensure(SeqId(1), 9),
            Err(KvError::ReservationExceeded { .. })
        ));
    }

    #[test]
    fn writes_to_foreign_pages_are_refused() {
        let mut p = pool(2);
        p.open(SeqId(1), tenant(5), 1, &[]).unwrap();
        p.open(SeqId(2), tenant(6), 1, &[]).unwrap();
        p.ensure(SeqId(1), 1).unwrap();
        p.ensure(SeqId(2), 1).unwrap();
        let theirs = p.table(SeqId(2)).unwrap().1.to_vec();
        let e = p
            .write(0, tenant(5).into(), &theirs, 0, &[1.0; 4], &[1.0; 4])
            .unwrap_err();
        assert!(matches!(e, KvError::Isolation(IsolationViolation::ForeignOwner { .. })));
    }

    /// Opens `seq` for `owner`, writes `tokens.len()` positions and offers them to the cache.
    fn computed(p: &mut KvPool, seq: SeqId, owner: impl Into<Owner>, pages: usize, tokens: &[u32]) -> usize {
        let hit = p.open(seq, owner, pages, tokens).unwrap();
        p.ensure(seq, tokens.len()).unwrap();
        p.commit_slots(seq, tokens.len()).unwrap();
        p.cache_computed(seq, tokens).unwrap();
        hit
    }

    const TOKS: [u32; 16] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16];

    #[test]
    fn public_prefixes_are_read_only_and_only_for_owners_allowed_them() {
        let mut p = pool(12);
        // The server computes and pins a public prefix of two pages.
        assert_eq!(computed(&mut p, SeqId(1), Owner::PUBLIC, 2, &TOKS[..8]), 0);
        assert_eq!(p.pin_prefix(SeqId(1), 8, usize::MAX).unwrap(), 8);
        p.close(SeqId(1)).unwrap();
        p.set_public_access(tenant(5), true);
        // Owner 5 is allowed: it adopts both pages, as public entries of Owner::PUBLIC's pages.
        assert_eq!(p.open(SeqId(2), tenant(5), 3, &TOKS[..11]).unwrap(), 8);
        let table = p.table(SeqId(2)).unwrap().1.to_vec();
        assert!(table.iter().all(|e| e.public));
        for e in &table {
            assert_eq!(p.tags()[e.page as usize].owner, Owner::PUBLIC);
            assert!(
                p.inspect(tenant(5), PageHandle::of(*e)).is_ok(),
                "readable through the public entry"
            );
            assert!(
                p.inspect(tenant(5), PageHandle::of(PageEntry { public: false, ..*e }))
                    .is_err(),
                "not as the owner's own page"
            );
        }
        // Never writable, even by a sequence holding it.
        let e = p
            .write(0, tenant(5).into(), &table, 0, &[1.0; 4], &[1.0; 4])
            .unwrap_err();
        assert!(
            matches!(e, KvError::Isolation(IsolationViolation::PublicPage { .. })),
            "{e}"
        );
        // Its pages are not the owner's to cache or pin.
        p.ensure(SeqId(2), 11).unwrap();
        p.commit_slots(SeqId(2), 11).unwrap();
        p.cache_computed(SeqId(2), &TOKS[..11]).unwrap();
        assert!(matches!(p.pin_prefix(SeqId(2), 8, 64), Err(KvError::PublicPrefix)));
        assert_eq!(p.unpin_prefix(SeqId(2)).unwrap(), 0);
        // Owner 6 is not allowed: the same tokens are a miss.
        assert_eq!(p.open(SeqId(3), tenant(6), 3, &TOKS[..11]).unwrap(), 0);
        // Once access is withdrawn, owner 5 misses too.
        p.set_public_access(tenant(5), false);
        assert_eq!(p.open(SeqId(4), tenant(5), 3, &TOKS[..11]).unwrap(), 0);
        for seq in [2, 3, 4] {
            p.close(SeqId(seq)).unwrap();
        }
        let c = p.counters();
        assert_eq!((c.pages_cached, c.pages_pinned, c.pages_used), (2, 2, 0), "{c:?}");
        p.forget_owner(Owner::PUBLIC);
        assert_eq!(p.counters().pages_free, 12);
    }

    #[test]
    fn the_prefix_cache_serves_its_owner_only() {
        let mut p = pool(12);
        assert_eq!(computed(&mut p, SeqId(1), tenant(5), 3, &TOKS[..10]), 0);
        p.close(SeqId(1)).unwrap();
        let c = p.counters();
        assert_eq!(
            (c.pages_cached, c.pages_free, c.pages_used),
            (2, 10, 0),
            "two whole pages cached"
        );
        assert_eq!(p.available_pages(), 12, "idle cached pages count as available");
        // The same owner adopts both whole pages; the partial third was never cached.
        assert_eq!(p.open(SeqId(2), tenant(5), 3, &TOKS[..11]).unwrap(), 8);
        let first = p.table(SeqId(2)).unwrap().1.to_vec();
        assert_eq!(first.len(), 2);
        // Another owner with the same tokens computes everything.
        assert_eq!(p.open(SeqId(3), tenant(6), 3, &TOKS[..11]).unwrap(), 0);
        assert!(p.table(SeqId(3)).unwrap().1.is_empty());
        // A different first page misses even if the second matches.
        let mut other = TOKS;
        other[0] = 99;
        assert_eq!(p.open(SeqId(4), tenant(5), 3, &other[..11]).unwrap(), 0);
        assert_eq!(p.counters().prefix_hit_tokens, 8);
        // Shared pages are used once, however many sequences hold them.
        assert_eq!(p.open(SeqId(5), tenant(5), 2, &TOKS[..8]).unwrap(), 8);
        assert_eq!(p.table(SeqId(5)).unwrap().1, &first[..]);
        let c = p.counters();
        assert_eq!((c.pages_used, c.pages_cached), (2, 0));
        for s in 2..=5 {
            p.close(SeqId(s)).unwrap();
        }
        p.forget_owner(tenant(5));
        let c = p.counters();
        assert_eq!((c.pages_free, c.pages_cached, c.pages_reserved), (12, 0, 0));
    }

    #[test]
    fn eviction_frees_idle_prefixes_oldest_first_and_bumps_epochs() {
        let mut p = pool(4);
        computed(&mut p, SeqId(1), tenant(5), 1, &TOKS[..4]);
        p.close(SeqId(1)).unwrap();
        computed(&mut p, SeqId(2), tenant(5), 1, &TOKS[4..8]);
        p.close(SeqId(2)).unwrap();
        let old = p
            .prefix
            .entry(p.prefix.find(tenant(5).into(), prefix::ROOT, &TOKS[..4]).unwrap())
            .unwrap();
        // Another owner takes three pages: two free, then the longest idle is evicted.
        p.open(SeqId(3), tenant(6), 3, &[]).unwrap();
        p.ensure(SeqId(3), 12).unwrap();
        let c = p.counters();
        assert_eq!((c.prefix_evictions, c.pages_cached), (1, 1));
        assert_ne!(
            p.tags()[old.page as usize].epoch,
            old.epoch,
            "an evicted page gets a new epoch"
        );
        assert_eq!(
            p.open(SeqId(4), tenant(5), 1, &TOKS[..4]).unwrap(),
            0,
            "the evicted prefix is gone"
        );
        p.close(SeqId(4)).unwrap();
        assert_eq!(
            p.open(SeqId(4), tenant(5), 1, &TOKS[4..8]).unwrap(),
            4,
            "the younger one is still cached"
        );
    }

    #[test]
    fn pinned_prefixes_survive_pressure_within_the_owners_cap() {
        let mut p = pool(4);
        computed(&mut p, SeqId(1), tenant(5), 3, &TOKS[..12]);
        let e = p.pin_prefix(SeqId(1), 12, 2).unwrap_err();
        assert!(
            matches!(
                e,
                KvError::PinLimit {
                    wanted: 3,
                    pinned: 0,
                    limit: 2
                }
            ),
            "{e}"
        );
        assert_eq!(p.pin_prefix(SeqId(1), 9, 2).unwrap(), 8, "whole pages only");
        assert!(
            p.pin_prefix(SeqId(1), 3, 2)
                .unwrap_err()
                .to_string()
                .contains("no whole computed page")
        );
        p.close(SeqId(1)).unwrap();
        let c = p.counters();
        assert_eq!((c.pages_pinned, c.pages_cached), (2, 3));
        assert_eq!(p.available_pages(), 2, "pinned pages are not available");
        assert!(matches!(
            p.open(SeqId(2), tenant(6), 3, &[]),
            Err(KvError::PoolExhausted { .. })
        ));
        p.open(SeqId(2), tenant(6), 2, &[]).unwrap();
        p.ensure(SeqId(2), 8).unwrap();
        assert_eq!(p.counters().prefix_evictions, 1, "only the unpinned page went");
        p.close(SeqId(2)).unwrap();
        assert_eq!(p.open(SeqId(3), tenant(5), 3, &TOKS[..12]).unwrap(), 8);
        assert_eq!(p.unpin_prefix(SeqId(3)).unwrap(), 2);
        p.close(SeqId(3)).unwrap();
        let c = p.counters();
        assert_eq!((c.pages_pinned, c.pages_cached), (0, 2));
        assert_eq!(p.available_pages(), 4);
        p.forget_owner(tenant(5));
        assert_eq!(p.counters().pages_free, 4);
    }

    #[test]
    fn forgetting_an_owner_leaves_its_open_sequences_their_pages() {
        let mut p = pool(4);
        computed(&mut p, SeqId(1), tenant(5), 2, &TOKS[..8]);
        p.pin_prefix(SeqId(1), 8, 4).unwrap();
        p.forget_owner(tenant(5));
        let c = p.counters();
        assert_eq!((c.pages_used, c.pages_cached, c.pages_pinned), (2, 0, 0));
        p.close(SeqId(1)).unwrap();
        assert_eq!(p.counters().pages_free, 4);
    }

    #[test]
    fn pins_stop_at_the_ceiling_and_floors_narrow_what_is_open() {
        let mut p = pool(8);
        p.set_pin_ceiling(2);
        computed(&mut p, SeqId(1), tenant(5), 3, &TOKS[..12]);
        let e = p.pin_prefix(SeqId(1), 12, 8).unwrap_err();
        assert!(
            matches!(
                e,
                KvError::PinCeiling {
                    wanted: 3,
                    pinned: 0,
                    ceiling: 2
                }
            ),
            "{e}"
        );
        p.pin_prefix(SeqId(1), 8, 8).unwrap();
        p.set_owner_floor(tenant(6), 3);
        assert_eq!(p.pages_open_to(tenant(5)), 8 - 3 - 2);
        assert_eq!(p.pages_open_to(tenant(6)), 8 - 2, "its own floor is open to it");
    }

    #[test]
    fn floors_keep_pages_for_their_owner() {
        let mut p = pool(8);
        p.set_owner_floor(tenant(5), 3);
        let e = p.open(SeqId(1), tenant(6), 6, &[]).unwrap_err();
        assert_eq!(
            e,
            KvError::PoolExhausted {
                wanted: 6,
                available: 5
            }
        );
        p.open(SeqId(1), tenant(6), 5, &[]).unwrap();
        p.open(SeqId(2), tenant(5), 3, &[]).expect("the floor is there");
        p.close(SeqId(2)).unwrap();
        // Using part of its floor leaves only the rest claimed.
        p.open(SeqId(3), tenant(5), 2, &[]).unwrap();
        p.close(SeqId(1)).unwrap();
        assert!(p.open(SeqId(4), tenant(6), 6, &[]).is_err());
        p.open(SeqId(4), tenant(6), 5, &[]).unwrap();
        p.set_owner_floor(tenant(5), 0);
        p.close(SeqId(4)).unwrap();
        p.open(SeqId(5), tenant(6), 6, &[]).expect("no floor left");
    }

    proptest! {
        /// Random open/grow/cache/pin/close/forget sequences over owners that share
        /// the same tokens: pages are conserved, no page is free while referenced, every page in a
        /// table is its owner's, reservations are always backed, and at quiescence every page is
        /// free again.
        #[test]
        fn pool_state_machine_conserves_pages(ops in proptest::collection::vec((0u8..7, 0u64..6, 1usize..17), 1..120)) {
            let mut p = pool(8);
            let mut written: HashMap<SeqId, usize> = HashMap::new();
            let owner = |seq: u64| tenant(seq % 3 + 1);
            for (op, seq, n) in ops {
                match op {
                    0 => if let Ok(hit) = p.open(SeqId(seq), owner(seq), n.min(16).div_ceil(4), &TOKS[..n % 16]) {
                        written.insert(SeqId(seq), hit);
                    },
                    1 => if p.ensure(SeqId(seq), n).is_ok() {
                        p.commit_slots(SeqId(seq), n).unwrap();
                        let w = written.entry(SeqId(seq)).or_insert(0);
                        *w = (*w).max(n);
                    },
                    2 => { let _ = p.close(SeqId(seq)); written.remove(&SeqId(seq)); }
                    3 => if let Some(&w) = written.get(&SeqId(seq)) { p.cache_computed(SeqId(seq), &TOKS[..w]).unwrap(); },
                    4 => { let _ = p.pin_prefix(SeqId(seq), n, 3); }
                    5 => { let _ = p.unpin_prefix(SeqId(seq)); }
                    _ => p.forget_owner(owner(seq)),
                }
                let c = p.counters();
                prop_assert_eq!(c.pages_free + c.pages_used + c.pages_cached, 8);
                prop_assert!(c.pages_reserved <= p.free.len() + p.prefix.idle_count());
                prop_assert!(c.pages_pinned <= 9);
                prop_assert_eq!(c.tag_mismatches, 0);
                for (seq, s) in &p.seqs {
                    prop_assert_eq!(s.owner, Owner::from(owner(seq.0)));
                    for e in &s.pages {
                        prop_assert_eq!(p.tags[e.page as usize].owner, s.owner);
                    }
                }
            }
            for s in 0..6 { let _ = p.close(SeqId(s)); }
            for o in 1..=3 { p.forget_owner(tenant(o)); }
            let c = p.counters();
            prop_assert_eq!((c.pages_free, c.pages_reserved, c.pages_pinned), (8, 0, 0));
        }
    }
}
