//! `warden:plugin@0.2.0`: its own `types` and `vocabulary`; 0.1.0's interfaces are [`super::v1`]'s.
#![allow(missing_docs)]

wasmtime::component::bindgen!({
    path: "../wit",
    world: "tenant-plugin",
    exports: { default: async },
    with: {
        "warden:plugin/types@0.1.0": super::v1::warden::plugin::types,
        "warden:plugin/kv@0.1.0": super::v1::warden::plugin::kv,
        "warden:plugin/tokenizer@0.1.0": super::v1::warden::plugin::tokenizer,
        "warden:plugin/log@0.1.0": super::v1::warden::plugin::log,
    },
});
