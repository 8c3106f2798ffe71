//! Why a call on the engine gave no result, and why a process could not start one.

use crate::engine::EngineError;
use crate::kv::KvError;
use crate::loaded::LoadError;

/// The engine the configuration describes for a model could not start.
#[derive(Debug, thiserror::Error)]
#[error("starting the engine of model {model} (see [kv], [limits] and its [[models]] entry in the config)")]
pub struct StartError {
    /// The model's id.
    pub model: String,
    /// Why.
    #[source]
    pub source: EngineError,
}

/// Why a process could not start serving: its model, its engine, or a file, socket or thread
/// step on the way (what every role's start shares).
#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    /// The model file does not load.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// The engine does not start (the pool, the configuration).
    #[error(transparent)]
    Start(#[from] StartError),
    /// The configuration asks for what this role cannot do.
    #[error("{0}")]
    Config(String),
    /// A file, socket or thread operation failed.
    #[error("{what}")]
    Io {
        /// What was being done.
        what: String,
        /// Why it failed.
        source: std::io::Error,
    },
}

impl StartupError {
    /// For `map_err`: an I/O failure while doing `what`.
    pub fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Self {
        let what = what.into();
        move |source| StartupError::Io { what, source }
    }
}

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
