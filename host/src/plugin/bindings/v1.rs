//! `warden:plugin@0.1.0`.
#![allow(missing_docs)]

wasmtime::component::bindgen!({
    path: "../wit/deps/plugin-0.1.0",
    world: "tenant-plugin",
    // Guest code runs as futures that yield at every epoch tick, so a busy plugin never holds a
    // runtime thread for longer than one tick. Host imports stay synchronous.
    exports: { default: async },
    // KV questions go to the engine thread and wait for its answer.
    imports: {
        "warden:plugin/kv.[method]sequence.pages": async,
        "warden:plugin/kv.[method]sequence.pin-prefix": async,
        "warden:plugin/kv.[method]sequence.unpin-prefix": async,
        "warden:plugin/kv.[method]kv-page.info": async,
    },
    with: {
        "warden:plugin/kv.kv-page": crate::plugin::access::KvPage,
        "warden:plugin/kv.sequence": crate::plugin::access::Sequence,
    },
});
