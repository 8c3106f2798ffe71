//! Faults injected into KV transfers, compiled only into builds with the `transfer-faults`
//! feature (the test command's; never a release build): a router started with
//! `WARDEN_TRANSFER_FAULTS=tenant=fault,...` names the fault in the dispatch of that tenant's
//! requests, and the prefill node commits it on the transfer's first
//! batch. Every fault but `delay` must fail the request on the decode node, with its error and
//! no output (invariant 7); the leak-canary suite checks that it does.

use std::collections::HashMap;
use std::time::Duration;

use tokio::io::{AsyncWrite, AsyncWriteExt};

use super::link::{self, Fault};
use crate::transfer::wire::Frame;

/// The environment variable a router reads its faults from.
pub const ENV: &str = "WARDEN_TRANSFER_FAULTS";

/// The faults `WARDEN_TRANSFER_FAULTS` names, by tenant name; a malformed entry is reported
/// and skipped.
pub fn from_env() -> HashMap<String, Fault> {
    let mut out = HashMap::new();
    let Ok(v) = std::env::var(ENV) else {
        return out;
    };
    for entry in v.split(',').filter(|e| !e.trim().is_empty()) {
        match entry
            .split_once('=')
            .and_then(|(t, f)| Some((t.trim(), Fault::parse(f.trim())?)))
        {
            Some((tenant, fault)) => {
                tracing::info!("cluster: injecting {fault:?} into tenant {tenant}'s transfers ({ENV})");
                out.insert(tenant.to_string(), fault);
            }
            None => tracing::warn!(
                "cluster: {ENV}: ignoring {entry:?} (tenant=drop|truncate|corrupt|duplicate|reorder|delay|retag)"
            ),
        }
    }
    out
}

/// Sends a transfer's frames, committing its fault on the first batch.
pub struct Injector {
    fault: Option<Fault>,
    held: Option<Frame>,
}

impl Injector {
    /// An injector of `fault` (none: frames go as they are).
    pub fn new(fault: Option<Fault>) -> Self {
        Self { fault, held: None }
    }

    /// Sends `f`, or what the fault makes of it.
    pub async fn send<W: AsyncWrite + Unpin>(&mut self, w: &mut W, f: Frame) -> std::io::Result<()> {
        if let Some(held) = self.held.take() {
            link::send_frame(w, &f).await?;
            return link::send_frame(w, &held).await;
        }
        let fault = match (&f, self.fault) {
            (Frame::Batch { .. }, Some(fault)) => fault,
            _ => return link::send_frame(w, &f).await,
        };
        self.fault = None;
        match fault {
            Fault::Drop => Ok(()),
            Fault::Truncate => {
                let bytes = link::encode_frame(&f);
                w.write_all(&bytes[..bytes.len() / 2]).await?;
                w.shutdown().await?;
                Err(std::io::Error::other("transfer truncated (injected)"))
            }
            Fault::Corrupt => {
                let mut f = f;
                if let Frame::Batch { pages, .. } = &mut f
                    && let Some(x) = pages.first_mut().and_then(|p| p.data.k.first_mut())
                {
                    *x = half::f16::from_bits(x.to_bits() ^ 0x0400);
                }
                link::send_frame(w, &f).await
            }
            Fault::Duplicate => {
                link::send_frame(w, &f).await?;
                link::send_frame(w, &f).await
            }
            Fault::Reorder => {
                self.held = Some(f);
                Ok(())
            }
            Fault::Delay => {
                tokio::time::sleep(Duration::from_millis(200)).await;
                link::send_frame(w, &f).await
            }
            Fault::Retag => {
                let mut f = f;
                if let Frame::Batch { owner, .. } = &mut f
                    && let Some(other) = crate::tenant::TenantId::new(owner.get() % (u64::MAX - 1) + 1)
                {
                    *owner = other;
                }
                link::send_frame(w, &f).await
            }
        }
    }
}
