//! Warden: serves LLMs to many tenants from one pool of accelerators, with isolation as its product.
//!
//! Layers, one direction: [`gguf`] (model files) → [`model`] (llama forward pass over
//! `warden_kernels`) → [`kv`] (the tagged, paged KV pool) → [`engine`] (admission, scheduling,
//! sampling). Beside them, [`tokenizer`] and [`chat`] turn conversations into tokens and
//! tokens back into text. See `DESIGN.md` in the shared folder for the invariants every module keeps.
#![deny(missing_docs)]

pub mod chat;
pub mod gguf;
pub mod kv;
pub mod model;
pub mod tokenizer;
