//! What the engine does with the prefix cache beyond admission: a tenant's requests sharing a
//! prompt's first page wait for the one computing it; plugins read, pin and unpin their own
//! request's pages; and the server's public prefixes are computed and pinned here.

use warden_kernels::tag::Owner;

use super::request::RequestId;
use super::{Engine, EngineConfig, Seq};
use crate::kv::{KvError, KvPool, PageHandle, PageInfo};
use crate::model::{StepError, StepSeq};
use crate::tenant::TenantId;

impl Engine {
    /// The page table of request `id`, if it is open and `owner`'s.
    pub fn kv_pages(&self, id: RequestId, owner: TenantId) -> Option<Vec<PageHandle>> {
        let (o, _) = self.pool.table(id.seq()).ok()?;
        (o == Owner::from(owner)).then(|| self.pool.handles(id.seq()).ok().map(|(_, h)| h))?
    }

    /// What holder `owner` may learn of page `h` (after its tag check).
    pub fn kv_inspect(&self, owner: TenantId, h: PageHandle) -> Result<PageInfo, KvError> {
        self.pool.inspect(owner, h)
    }

    /// Pins the first `tokens` tokens of request `id` (if it is open and `owner`'s) in the
    /// owner's prefix cache, in whole computed pages; returns the tokens pinned.
    pub fn kv_pin(&mut self, id: RequestId, owner: TenantId, tokens: usize) -> Result<usize, KvError> {
        self.owned(id, owner)?;
        let limit = self
            .tenants
            .get(&owner)
            .map_or(self.cfg.max_pinned_pages, |k| k.max_pinned_pages);
        self.pool.pin_prefix(id.seq(), tokens, limit)
    }

    /// Unpins the pinned prefixes within request `id`'s cached prefix (if it is open and
    /// `owner`'s); returns the pages unpinned.
    pub fn kv_unpin(&mut self, id: RequestId, owner: TenantId) -> Result<usize, KvError> {
        self.owned(id, owner)?;
        self.pool.unpin_prefix(id.seq())
    }

    /// Makes `prefixes` the server's public prefixes: token sequences a policy marks public
    /// (invariant 5 allows sharing KV across tenants only so). The engine computes each one's
    /// whole pages itself, under [`Owner::PUBLIC`], and pins them (within the server's pin
    /// ceiling); a request of a tenant whose settings allow public prefixes and whose prompt
    /// begins with one adopts those pages read-only instead of computing them. Prefixes dropped
    /// from the list leave the cache (sequences using their pages keep them). Blocks for the
    /// prefill of what is new; a list equal to the current one does nothing. On an error the
    /// prefixes before the failing one stay in force.
    pub fn set_public_prefixes(&mut self, prefixes: &[Vec<u32>]) -> Result<(), KvError> {
        if self.public_prefixes == prefixes {
            return Ok(());
        }
        self.pool.forget_owner(Owner::PUBLIC);
        self.public_prefixes.clear();
        if prefixes.is_empty() {
            return Ok(());
        }
        if !self.cfg.prefix_cache {
            return Err(KvError::PublicWithoutCache);
        }
        for tokens in prefixes {
            let whole = tokens.len() / self.cfg.page_size * self.cfg.page_size;
            if whole == 0 {
                return Err(KvError::PublicPrefixTooShort {
                    tokens: tokens.len(),
                    page_size: self.cfg.page_size,
                });
            }
            let tokens = &tokens[..whole];
            let id = self.next_id;
            self.next_id = self.next_id.next();
            let from = self
                .pool
                .open(id.seq(), Owner::PUBLIC, self.pool.pages_for(whole), tokens)?;
            let filled = self.fill_public(id, tokens, from);
            self.pool.close(id.seq())?;
            filled?;
            self.public_prefixes.push(tokens.to_vec());
        }
        Ok(())
    }

    /// Computes `tokens[from..]` into public sequence `id`, caches and pins its pages.
    fn fill_public(&mut self, id: RequestId, tokens: &[u32], from: usize) -> Result<(), KvError> {
        let mut at = from;
        while at < tokens.len() {
            let n = (tokens.len() - at).min(self.cfg.max_batch_tokens);
            self.pool.ensure(id.seq(), at + n)?;
            self.pool.commit_slots(id.seq(), at + n)?;
            let seqs = [StepSeq {
                seq: id.seq(),
                tokens: &tokens[at..at + n],
                pos0: at,
                want_logits: false,
                prompt: true,
            }];
            for r in self
                .model
                .forward(&mut self.pool, &seqs, self.cfg.tag_check, &mut self.scratch)
            {
                match r {
                    Ok(_) => {}
                    Err(StepError::Kv(e)) => return Err(e),
                    Err(StepError::Isolation(v)) => return Err(v.into()),
                }
            }
            at += n;
        }
        self.pool.cache_computed(id.seq(), tokens)?;
        self.pool.pin_prefix(id.seq(), tokens.len(), usize::MAX)?;
        Ok(())
    }

    /// Whether `owner`'s requests use the prefix cache.
    pub(super) fn prefix_cache_for(&self, owner: TenantId) -> bool {
        self.cfg.prefix_cache && self.tenants.get(&owner).is_none_or(|k| k.prefix_cache)
    }

    fn owned(&self, id: RequestId, owner: TenantId) -> Result<(), KvError> {
        if !self.prefix_cache_for(owner) {
            return Err(KvError::PrefixCacheOff);
        }
        match self.pool.table(id.seq()) {
            Ok((o, _)) if o == Owner::from(owner) => Ok(()),
            _ => Err(KvError::NoSuchSequence(id.seq())),
        }
    }

    /// Whether `s` should wait for a running sequence of its owner whose prompt begins with the
    /// same page of tokens and is still being computed (the choices of an `n` > 1 request, or a
    /// burst of requests with one system prompt): once it is, `s` adopts those pages from the
    /// prefix cache instead of computing them a second time. The wait is bounded by that one
    /// prefill, and other requests are admitted past `s` meanwhile.
    pub(super) fn follows_a_prefill(&self, s: &Seq) -> bool {
        let ps = self.cfg.page_size;
        if !self.prefix_cache_for(s.owner) || s.prompt_len <= ps {
            return false;
        }
        let first = &s.tokens[..ps];
        self.running
            .iter()
            .any(|r| r.owner == s.owner && r.computed < r.prompt_len && r.tokens.get(..ps) == Some(first))
    }

    /// Pages that may be pinned, by tenants and public prefixes together: all but one request
    /// of the maximum context.
    pub fn pinnable_pages(&self) -> usize {
        Self::pinnable(&self.pool, &self.cfg)
    }

    pub(super) fn pinnable(pool: &KvPool, cfg: &EngineConfig) -> usize {
        pool.counters()
            .pages_total
            .saturating_sub(pool.pages_for(cfg.max_context))
    }
}
