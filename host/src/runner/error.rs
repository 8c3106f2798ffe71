//! Why a call on the engine gave no result.

use crate::kv::KvError;

/// Why a call on the engine (its thread, or a cluster's nodes) gave no result.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EngineCallError {
    /// The engine stopped before answering.
    #[error("the engine stopped")]
    Stopped,
    /// The engine thread is gone (a call on it found no one to answer).
    #[error("the engine thread is gone")]
    Gone,
    /// The request the call was about has ended.
    #[error("the request has ended")]
    Ended,
    /// An incoming transfer failed (the request has ended with it).
    #[error(transparent)]
    Transfer(#[from] crate::transfer::TransferError),
    /// The pool refused.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// What a cluster's nodes said, one message for each node that refused.
    #[error("{}", .0.join("; "))]
    Nodes(Vec<String>),
}
