//! Each tenant's share of the plugin instance pool: what its requests (and the set-up work done
//! for its plugins: upload and config checks, pre-initialising) hold at once. A tenant past its
//! share waits or is refused; the pool is never taken from the tenants within theirs.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::tenant::TenantId;

/// Instances each tenant holds now.
#[derive(Clone, Default)]
pub struct Shares {
    held: Arc<Mutex<HashMap<TenantId, usize>>>,
}

/// A hold on `n` of a tenant's instances; dropping it gives them back.
pub struct Share {
    held: Arc<Mutex<HashMap<TenantId, usize>>>,
    tenant: TenantId,
    n: usize,
}

impl Drop for Share {
    fn drop(&mut self) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(h) = held.get_mut(&self.tenant) {
            *h = h.saturating_sub(self.n);
            if *h == 0 {
                held.remove(&self.tenant);
            }
        }
    }
}

impl Shares {
    /// Takes `n` of `tenant`'s instances if it holds at most `cap - n`; else says how many it
    /// holds.
    pub fn take(&self, tenant: TenantId, cap: usize, n: usize) -> Result<Share, usize> {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let now = held.get(&tenant).copied().unwrap_or(0);
        if now + n > cap {
            return Err(now);
        }
        held.insert(tenant, now + n);
        Ok(Share {
            held: self.held.clone(),
            tenant,
            n,
        })
    }
}
