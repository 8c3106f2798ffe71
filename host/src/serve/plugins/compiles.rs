//! Compiling tenants' components, fairly and within budget (invariant 8): every compile, an
//! upload's or a pre-initialisation's, takes its tenant's turn at the server's compiler (fair
//! across tenants, one at a time per tenant; see [`crate::fair::Turns`]) and is charged, in wall
//! time, to its tenant's compile budget: seconds per minute, with a burst of one minute's worth.
//!
//! A tenant in debt is refused before its compile is queued, and again when its turn comes (its
//! own earlier compiles may have spent the budget while it waited), with the time until the
//! debt is paid back. A timed-out compile is charged the whole timeout; a compile can run into
//! debt by at most one timeout.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::plugin::compile::Compiler;
use crate::plugin::{Plugin, PluginFailure};
use crate::policy::rate::Gcra;
use crate::tenant::TenantId;

/// Why a compile did not produce a plugin.
#[derive(Debug)]
pub enum CompileRefused {
    /// The tenant has spent its compile budget: retry after this long.
    Budget {
        /// Its budget, seconds per minute.
        seconds_per_minute: u64,
        /// Until a compile fits again.
        retry_after: Duration,
    },
    /// The compiler refused the component or failed on it.
    Failed(PluginFailure),
}

/// The server's compiles: its compiler and each tenant's budget.
pub struct Compiles {
    compiler: Arc<Compiler>,
    /// Per tenant, in milliseconds of compile per minute.
    budgets: Mutex<HashMap<TenantId, Gcra>>,
}

impl Compiles {
    /// Compiles through `compiler`.
    pub fn new(compiler: Arc<Compiler>) -> Self {
        Self {
            compiler,
            budgets: Mutex::new(HashMap::new()),
        }
    }

    /// The compiler.
    pub fn compiler(&self) -> &Arc<Compiler> {
        &self.compiler
    }

    fn budgets(&self) -> std::sync::MutexGuard<'_, HashMap<TenantId, Gcra>> {
        self.budgets.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `tenant`, with `seconds_per_minute` of compile, may compile now: its budget is not
    /// in debt.
    pub fn check(&self, tenant: TenantId, seconds_per_minute: u64) -> Result<(), CompileRefused> {
        let now = Instant::now();
        let per_minute = seconds_per_minute.saturating_mul(1000);
        let mut budgets = self.budgets();
        let g = budgets
            .entry(tenant)
            .or_insert_with(|| Gcra::per_minute(per_minute, now));
        *g = g.with_limit(per_minute);
        match g.ready_in(now) {
            None => Ok(()),
            Some(retry_after) => Err(CompileRefused::Budget {
                seconds_per_minute,
                retry_after,
            }),
        }
    }

    /// Compiles `bytes` for `tenant` (whose budget is `seconds_per_minute`) once its turn comes,
    /// if its budget allows then, and charges the time it took.
    pub async fn compile(
        &self,
        tenant: TenantId,
        seconds_per_minute: u64,
        bytes: &[u8],
    ) -> Result<Plugin, CompileRefused> {
        self.check(tenant, seconds_per_minute)?;
        let turn = self.compiler.turn(tenant).await;
        self.check(tenant, seconds_per_minute)?;
        let started = Instant::now();
        let r = self.compiler.compile(&turn, bytes).await;
        let took = match &r {
            Err(PluginFailure::CompileTimeout(limit)) => started.elapsed().max(*limit),
            _ => started.elapsed(),
        };
        drop(turn);
        self.charge(tenant, took);
        r.map_err(CompileRefused::Failed)
    }

    /// Charges `took` of compile to `tenant`'s budget.
    fn charge(&self, tenant: TenantId, took: Duration) {
        let now = Instant::now();
        if let Some(g) = self.budgets().get_mut(&tenant) {
            g.charge(took.as_millis().min(u128::from(u64::MAX)) as u64, now);
        }
    }

    /// Forgets `tenant` (deleted).
    pub fn forget(&self, tenant: TenantId) {
        self.budgets().remove(&tenant);
    }
}
