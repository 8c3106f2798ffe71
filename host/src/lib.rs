//! Warden: serves LLMs to many tenants from one pool of accelerators, with isolation as its product.
//!
//! Layers, lowest first; a module imports only from layers below its own (`tests/architecture.rs`
//! checks it):
//!
//! ```text
//! boot, bench                    role selection; the benchmark
//! serve | cluster                the HTTPS API, tenants, plugins | prefill, decode and router processes
//! runner                         the engine thread, its jobs and updates, the EngineHandle trait
//! metrics                        the Prometheus registry
//! config, plugin, policy,        the config file; the Wasm plugin runtime; tenants' policies;
//!   grammar                      structured output's grammars
//! loaded, engine                 a model file opened; admission, scheduling, sampling
//! tokenizer, chat, model,        the vocabulary; chat templates; the forward pass; KV transfer;
//!   transfer, fair               capacity tenants share, taken in turns
//! gguf, tenant, net, pem, heap,  model files; tenant names; listening; PEM files; the heap;
//!   kv, log, child, procstat     the KV pool; the log; confined children; /proc's counters
//! warden_kernels                 (its own crate) the compute kernels
//! ```
//!
//! `docs/design.md` says which invariants every module keeps, and why.
#![deny(missing_docs)]

pub mod bench;
pub mod boot;
pub mod chat;
pub mod child;
pub mod cluster;
pub mod config;
pub mod engine;
pub mod fair;
pub mod gguf;
pub mod grammar;
pub mod heap;
pub mod kv;
pub mod loaded;
pub mod log;
pub mod metrics;
pub mod model;
pub mod net;
pub mod pem;
pub mod plugin;
pub mod policy;
pub mod procstat;
pub mod runner;
pub mod serve;
pub mod tenant;
pub mod tokenizer;
pub mod transfer;

#[cfg(test)]
mod testutil;

/// Where `scripts/fetch-model.sh` puts the default model, relative to the checkout.
pub const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// Where `scripts/fetch-model.sh` puts Gemma 3 270M Q4_K_M (the K-quant, sliding-window model
/// the tests run), relative to the checkout.
pub const GEMMA_MODEL: &str = "models/gemma-3-270m.Q4_K_M.gguf";
