//! The tenant-private prefix cache's index: which full KV pages hold which token prefix, and for
//! which tenant.
//!
//! * A node stands for one full page of some tenant's tokens. Its key is structured, not a
//!   digest: (owner, parent node, the page's tokens), compared exactly. No hash collision and no
//!   crafted prompt can make one tenant's lookup land on another's page: the owner is the
//!   server-assigned tenant id (never reused), and it is part of every key (invariant 5).
//! * Nodes form one tree per tenant: a node's parent is the node of the page before it, so a
//!   path from the root is a prefix, position by position. Node ids are never reused, so a stale
//!   id names nothing.
//! * Pins: `pin` marks the last node of a path as a pin point; every node on the path counts the
//!   pin points below it, and a node with any is never evicted.
//! * Eviction order: nodes the pool reports idle (only the cache holds the page, nothing pinned
//!   below) wait in least-recently-idle order; evicting one removes its whole subtree, whose
//!   nodes are then unreachable anyway.
//!
//! This index knows nothing of reference counts or tags: [`super::KvPool`] owns those, tells the
//! index when a node becomes idle or busy, and drops the pages of removed nodes.

use std::collections::{BTreeMap, HashMap};

use warden_kernels::tag::{Owner, PageEntry};

/// A node's id; 0 is the root (no page).
pub(super) type NodeId = u64;

/// The parent of a prefix's first page.
pub(super) const ROOT: NodeId = 0;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    owner: Owner,
    parent: NodeId,
    tokens: Box<[u32]>,
}

#[derive(Debug)]
struct Node {
    key: Key,
    entry: PageEntry,
    children: Vec<NodeId>,
    /// The last page of a pinned prefix.
    pin_point: bool,
    /// Pin points in this node's subtree, itself included.
    pinned_below: u32,
    /// Its place in the eviction order, while idle.
    idle_since: Option<u64>,
}

/// The index.
#[derive(Debug, Default)]
pub(super) struct PrefixIndex {
    by_key: HashMap<Key, NodeId>,
    nodes: HashMap<NodeId, Node>,
    idle: BTreeMap<u64, NodeId>,
    tick: u64,
    last_id: NodeId,
    /// Per owner, nodes with a pin point at or below them.
    pinned: HashMap<Owner, usize>,
}

impl PrefixIndex {
    /// The node for `owner`'s page of `tokens` right after `parent`, if cached.
    pub fn find(&self, owner: Owner, parent: NodeId, tokens: &[u32]) -> Option<NodeId> {
        let key = Key {
            owner,
            parent,
            tokens: tokens.into(),
        };
        self.by_key.get(&key).copied()
    }

    /// Adds `owner`'s page `entry`, holding `tokens` right after `parent` (which must exist, or
    /// be [`ROOT`]). The node starts busy (not evictable).
    pub fn insert(&mut self, owner: Owner, parent: NodeId, tokens: &[u32], entry: PageEntry) -> NodeId {
        debug_assert!(parent == ROOT || self.nodes.contains_key(&parent));
        self.last_id += 1;
        let id = self.last_id;
        let key = Key {
            owner,
            parent,
            tokens: tokens.into(),
        };
        self.by_key.insert(key.clone(), id);
        if let Some(p) = self.nodes.get_mut(&parent) {
            p.children.push(id);
        }
        self.nodes.insert(
            id,
            Node {
                key,
                entry,
                children: Vec::new(),
                pin_point: false,
                pinned_below: 0,
                idle_since: None,
            },
        );
        id
    }

    /// Whether node `id` exists.
    pub fn contains(&self, id: NodeId) -> bool {
        self.nodes.contains_key(&id)
    }

    /// The page node `id` names.
    pub fn entry(&self, id: NodeId) -> Option<PageEntry> {
        self.nodes.get(&id).map(|n| n.entry)
    }

    /// Whether node `id` (or anything below it) is pinned.
    pub fn is_pinned(&self, id: NodeId) -> bool {
        self.nodes.get(&id).is_some_and(|n| n.pinned_below > 0)
    }

    /// Whether node `id` waits for eviction.
    pub fn is_idle(&self, id: NodeId) -> bool {
        self.nodes.get(&id).is_some_and(|n| n.idle_since.is_some())
    }

    /// Moves node `id` into or out of the eviction order. A node that becomes idle goes to the
    /// back: the longest idle is evicted first.
    pub fn set_idle(&mut self, id: NodeId, idle: bool) {
        let Some(n) = self.nodes.get_mut(&id) else { return };
        match (n.idle_since, idle) {
            (None, true) => {
                self.tick += 1;
                n.idle_since = Some(self.tick);
                self.idle.insert(self.tick, id);
            }
            (Some(t), false) => {
                n.idle_since = None;
                self.idle.remove(&t);
            }
            _ => {}
        }
    }

    /// Idle nodes: each one's eviction frees at least its own page.
    pub fn idle_count(&self) -> usize {
        self.idle.len()
    }

    /// The longest-idle node.
    pub fn oldest_idle(&self) -> Option<NodeId> {
        self.idle.first_key_value().map(|(_, &id)| id)
    }

    /// Removes node `id` and its subtree; returns the pages they named.
    pub fn remove_subtree(&mut self, id: NodeId) -> Vec<PageEntry> {
        let mut out = Vec::new();
        let Some(n) = self.nodes.get(&id) else { return out };
        let parent = n.key.parent;
        if let Some(p) = self.nodes.get_mut(&parent) {
            p.children.retain(|&c| c != id);
        }
        let mut stack = vec![id];
        while let Some(id) = stack.pop() {
            let Some(n) = self.nodes.remove(&id) else { continue };
            self.by_key.remove(&n.key);
            if let Some(t) = n.idle_since {
                self.idle.remove(&t);
            }
            if n.pinned_below > 0
                && let Some(c) = self.pinned.get_mut(&n.key.owner)
            {
                *c -= 1;
                if *c == 0 {
                    self.pinned.remove(&n.key.owner);
                }
            }
            stack.extend(n.children);
            out.push(n.entry);
        }
        out
    }

    /// The roots of `owner`'s tree.
    pub fn roots_of(&self, owner: Owner) -> Vec<NodeId> {
        self.nodes
            .iter()
            .filter(|(_, n)| n.key.owner == owner && n.key.parent == ROOT)
            .map(|(&id, _)| id)
            .collect()
    }

    /// Nodes of `path` (a path from the root) that pinning it would newly pin.
    pub fn unpinned_on(&self, path: &[NodeId]) -> usize {
        match path.last().and_then(|id| self.nodes.get(id)) {
            Some(last) if last.pin_point => 0,
            _ => path.iter().filter(|id| !self.is_pinned(**id)).count(),
        }
    }

    /// Pins `path` (a path from the root, owned by `owner`); returns the nodes that were not
    /// pinned before, whose pages the pool must take out of the eviction order.
    pub fn pin(&mut self, owner: Owner, path: &[NodeId]) -> Vec<NodeId> {
        let mut newly = Vec::new();
        let Some(last) = path.last().and_then(|id| self.nodes.get_mut(id)) else {
            return newly;
        };
        if last.pin_point {
            return newly;
        }
        last.pin_point = true;
        for id in path {
            if let Some(n) = self.nodes.get_mut(id) {
                n.pinned_below += 1;
                if n.pinned_below == 1 {
                    *self.pinned.entry(owner).or_insert(0) += 1;
                    newly.push(*id);
                }
            }
        }
        newly
    }

    /// Clears every pin point on `path` (a path from the root, owned by `owner`); returns the
    /// nodes no longer pinned, which the pool may make evictable.
    pub fn unpin(&mut self, owner: Owner, path: &[NodeId]) -> Vec<NodeId> {
        let mut freed = Vec::new();
        for (i, id) in path.iter().enumerate() {
            let Some(n) = self.nodes.get_mut(id) else { break };
            if !n.pin_point {
                continue;
            }
            n.pin_point = false;
            for up in &path[..=i] {
                if let Some(u) = self.nodes.get_mut(up) {
                    u.pinned_below -= 1;
                    if u.pinned_below == 0 {
                        if let Some(c) = self.pinned.get_mut(&owner) {
                            *c -= 1;
                        }
                        freed.push(*up);
                    }
                }
            }
        }
        if self.pinned.get(&owner) == Some(&0) {
            self.pinned.remove(&owner);
        }
        freed
    }

    /// Pages `owner` has pinned.
    pub fn pinned_pages(&self, owner: Owner) -> usize {
        self.pinned.get(&owner).copied().unwrap_or(0)
    }

    /// Pages pinned by anyone.
    pub fn pinned_total(&self) -> usize {
        self.pinned.values().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tenant `n`'s owner.
    fn o(n: u64) -> Owner {
        crate::testutil::tenant(n).into()
    }

    fn e(page: u32) -> PageEntry {
        PageEntry::own(page, 0)
    }

    #[test]
    fn keys_are_exact_and_per_owner() {
        let mut ix = PrefixIndex::default();
        let a = ix.insert(o(1), ROOT, &[1, 2], e(0));
        assert_eq!(ix.find(o(1), ROOT, &[1, 2]), Some(a));
        assert_eq!(ix.find(o(2), ROOT, &[1, 2]), None, "another owner never finds it");
        assert_eq!(ix.find(o(1), ROOT, &[1, 3]), None);
        assert_eq!(ix.find(o(1), a, &[1, 2]), None, "position is part of the key");
    }

    #[test]
    fn pins_count_per_owner_and_unpin_keeps_others_pins() {
        let mut ix = PrefixIndex::default();
        let a = ix.insert(o(1), ROOT, &[1], e(0));
        let b = ix.insert(o(1), a, &[2], e(1));
        let c = ix.insert(o(1), a, &[3], e(2));
        assert_eq!(ix.unpinned_on(&[a, b]), 2);
        assert_eq!(ix.pin(o(1), &[a, b]), vec![a, b]);
        assert!(ix.pin(o(1), &[a, b]).is_empty(), "pinning twice is a no-op");
        assert_eq!(ix.pin(o(1), &[a, c]), vec![c]);
        assert_eq!(ix.pinned_pages(o(1)), 3);
        // Unpinning one path leaves the shared node pinned for the other.
        assert_eq!(ix.unpin(o(1), &[a, b]), vec![b]);
        assert!(ix.is_pinned(a) && ix.is_pinned(c) && !ix.is_pinned(b));
        assert_eq!(ix.unpin(o(1), &[a, c]), vec![a, c]);
        assert_eq!(ix.pinned_pages(o(1)), 0);
    }

    #[test]
    fn eviction_order_and_subtree_removal() {
        let mut ix = PrefixIndex::default();
        let a = ix.insert(o(1), ROOT, &[1], e(0));
        let b = ix.insert(o(1), a, &[2], e(1));
        let c = ix.insert(o(2), ROOT, &[1], e(2));
        ix.set_idle(c, true);
        ix.set_idle(a, true);
        ix.set_idle(b, true);
        assert_eq!(ix.idle_count(), 3);
        assert_eq!(ix.oldest_idle(), Some(c));
        ix.set_idle(c, false);
        assert_eq!(ix.oldest_idle(), Some(a));
        let mut gone: Vec<u32> = ix.remove_subtree(a).iter().map(|e| e.page).collect();
        gone.sort();
        assert_eq!(gone, vec![0, 1]);
        assert_eq!(ix.idle_count(), 0);
        assert!(!ix.contains(b) && ix.contains(c));
        assert_eq!(ix.find(o(1), ROOT, &[1]), None);
        assert_eq!(ix.roots_of(o(2)), vec![c]);
    }
}
