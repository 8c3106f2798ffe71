//! Disaggregated serving: `warden serve --role prefill|decode|router` (`all` is the single
//! process of [`crate::serve`]).
//!
//! A **prefill node** and a **decode node** each own a model and a KV pool, and each refuses to
//! start when its pool cannot hold the maximum context (invariant 4). The **router** owns
//! everything a client meets (HTTPS, keys, policies, plugins, usage) and no pool: it dispatches
//! each admitted choice to a decode node, naming the prefill node its prompt is computed on.
//!
//! One request, one TCP connection per hop, so a connection's end is the request's end:
//!
//! ```text
//! router ──Generate──▶ decode node: admits it and opens its pages (a refusal ends it here,
//!    ▲                   before any transfer: invariant 1)
//!    │                 decode ──Prefill──▶ prefill node: computes the prompt but its last token
//!    │                 decode ◀──Begin, Batch…, End── prefill (bounded, acknowledged batches;
//!    │                         the prefill node keeps its pages until the final Ack: invariant 7)
//!    └──Opened, Token…, Done── decode: verifies, commits, decodes
//! ```
//!
//! A client that goes away drops the router's connection; the decode node cancels the request
//! through the engine's retirement path, which drops its connection to the prefill node, which
//! lets its pages go. Pages are only ever read or written on their engine's thread, between
//! steps, so none is freed while a transfer touches it.
//!
//! Nodes talk plain TCP over loopback only (the configuration refuses other addresses), or
//! mutual TLS under the cluster's CA on any address ([`tls`]); every link socket has keep-alive
//! probes and a user timeout, so a cut link fails its requests. Modules: [`link`] (the messages,
//! their framing and the transport), [`node`] (the prefill and decode processes), [`ops`] (a
//! node's probes and metrics over HTTP), [`router`]
//! (the router's engine backend), [`health`] (which nodes the router may send work to); with the
//! `transfer-faults` feature only, `faults` (what a prefill node can do wrong to a transfer, on
//! the router's word); in tests only, `lifecycle_model` (the request lifecycle and transfer,
//! model-checked with `stateright`).

#[cfg(feature = "transfer-faults")]
pub mod faults;
pub mod health;
pub mod link;
pub mod node;
pub mod ops;
pub mod router;
pub mod tls;

#[cfg(test)]
mod lifecycle_model;

use serde::{Deserialize, Serialize};

use crate::config::Role;

/// What a node serves, as it answers a router's `Describe`: the router serves only when every
/// node agrees on the model, the page size and the maximum context.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    /// The node's role.
    pub role: Role,
    /// The model's id (its file stem).
    pub model: String,
    /// SHA-256 of the model file, hex.
    pub digest: String,
    /// Token slots per KV page.
    pub page_size: usize,
    /// Most prompt plus completion tokens per request.
    pub max_context: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Tokens the pool can hold for one sequence.
    pub pool_tokens: usize,
    /// Pages in the pool.
    pub pages: usize,
    /// Pages that may be pinned in prefix caches.
    pub pinnable_pages: usize,
}

impl NodeInfo {
    /// What of it every node must share.
    pub fn agreement(&self) -> Agreement {
        Agreement {
            digest: self.digest.clone(),
            page_size: self.page_size,
            max_context: self.max_context,
        }
    }

    /// What the node at `addr` serves, for messages.
    pub fn describe(&self, addr: &impl std::fmt::Display) -> String {
        format!(
            "{} node {addr} (model {} sha256 {}, page size {}, max context {})",
            self.role,
            self.model,
            &self.digest[..self.digest.len().min(12)],
            self.page_size,
            self.max_context
        )
    }
}

/// What every node of a cluster must serve alike. The router checks it when it starts and each
/// time its probe finds a node answering; every request carries it, and a node that serves
/// something else refuses the request (a node restarted with another model or page size gets no
/// work between two probes).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Agreement {
    /// SHA-256 of the model file, hex.
    pub digest: String,
    /// Token slots per KV page.
    pub page_size: usize,
    /// Most prompt plus completion tokens per request.
    pub max_context: usize,
}

impl Agreement {
    /// Whether `node` at `addr` serves what was agreed; if not, what differs.
    pub fn check(&self, node: &NodeInfo, addr: &impl std::fmt::Display) -> Result<(), Disagreement> {
        if *self == node.agreement() {
            return Ok(());
        }
        Err(Disagreement {
            node: node.describe(addr),
            agreed: self.clone(),
        })
    }
}

/// A node that serves something other than what its cluster agreed on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{node} but the cluster agreed on sha256 {}, page size {}, max context {}",
    &agreed.digest[..agreed.digest.len().min(12)],
    agreed.page_size,
    agreed.max_context
)]
pub struct Disagreement {
    /// The node, as [`NodeInfo::describe`] says it.
    pub node: String,
    /// What the cluster agreed on.
    pub agreed: Agreement,
}

/// SHA-256 of a file, hex: how nodes show they serve the same model.
pub fn file_digest(path: &std::path::Path) -> std::io::Result<String> {
    use sha2::{Digest, Sha256};
    use std::io::Read;
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_agrees_only_on_the_same_model_page_size_and_context() {
        let node = NodeInfo {
            role: Role::Decode,
            model: "m".into(),
            digest: "ab".repeat(32),
            page_size: 16,
            max_context: 2048,
            vocab: 10,
            pool_tokens: 4096,
            pages: 256,
            pinnable_pages: 64,
        };
        let addr = "127.0.0.1:9";
        let agreed = node.agreement();
        assert_eq!(agreed.check(&node, &addr), Ok(()));
        let other = NodeInfo {
            pages: 3,
            pool_tokens: 48,
            ..node.clone()
        };
        assert_eq!(agreed.check(&other, &addr), Ok(()), "pools may differ");
        for changed in [
            NodeInfo {
                page_size: 32,
                ..node.clone()
            },
            NodeInfo {
                max_context: 1024,
                ..node.clone()
            },
            NodeInfo {
                digest: "cd".repeat(32),
                ..node.clone()
            },
        ] {
            let e = agreed.check(&changed, &addr).expect_err("a disagreement").to_string();
            assert!(
                e.contains("127.0.0.1:9") && e.contains("agreed on sha256 ababab"),
                "{e}"
            );
        }
    }
}
