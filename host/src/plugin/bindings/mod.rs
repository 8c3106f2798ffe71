//! The generated bindings of the two worlds: `warden:plugin@0.2.0` (`wit/plugin.wit`, [`v2`])
//! and `warden:plugin@0.1.0` (`wit/deps/plugin-0.1.0/plugin.wit`, [`v1`]). The 0.1.0 interfaces
//! both import (`types`, `kv`, `tokenizer`, `log`) are generated once, in [`v1`], and shared by
//! [`v2`], so one host implementation serves both.

pub mod v1;
pub mod v2;
