//! Warden: serves LLMs to many tenants from one pool of accelerators, with isolation as its product.
//!
//! Layers, one direction: [`gguf`] (model files) → [`model`] (llama forward pass over
//! `warden_kernels`) → [`kv`] (the tagged, paged KV pool) → [`engine`] (admission, scheduling,
//! sampling). Beside them, [`tokenizer`] and [`chat`] turn conversations into tokens and
//! tokens back into text. [`serve`] puts HTTPS, tenants and API keys in front of the engine;
//! [`cluster`] splits it into prefill, decode and router processes joined by [`transfer`]. See
//! `DESIGN.md` in the shared folder for the invariants every module keeps.
#![deny(missing_docs)]

pub mod bench;
pub mod chat;
pub mod cluster;
pub mod engine;
pub mod gguf;
pub mod kv;
pub mod loaded;
pub mod model;
pub mod plugin;
pub mod policy;
pub mod serve;
pub mod tokenizer;
pub mod transfer;

#[cfg(test)]
mod testutil;

/// Where `scripts/fetch-model.sh` puts the default model, relative to the checkout.
pub const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
