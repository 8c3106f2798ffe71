//! The SDK for Warden tenant plugins.
//!
//! A plugin is a WebAssembly component implementing the `tenant-plugin` world of
//! `wit/plugin.wit` (the crate carries its own copy). `README.md` takes an author from nothing
//! to an uploaded plugin. With this crate, implement [`Plugin`] (every method has a pass-through
//! default) and export it with [`plugin!`]; build with
//! `cargo build --target wasm32-wasip2 --release` and upload the `.wasm` file.
//!
//! ```
//! use warden_guest::{Chunk, Finish, Plugin, PluginError};
//!
//! struct Shout;
//!
//! impl Plugin for Shout {
//!     fn postprocess(chunk: Chunk, _end: Option<Finish>) -> Result<Chunk, PluginError> {
//!         Ok(Chunk { text: chunk.text.to_uppercase() })
//!     }
//! }
//!
//! warden_guest::plugin!(Shout);
//! # fn main() {}
//! ```
//!
//! Warden instantiates a plugin afresh for every request (and each choice of an `n` > 1
//! request), starting as [`Plugin::init`] left it, so statics set there are in every request and
//! what a request changes lives for that request: a streaming `postprocess` may keep held-back
//! text in one, and `preprocess` may leave state there for the output calls. `on_token` may
//! constrain the next token ([`TokenAction::Constrain`]); [`vocabulary`] says what each id is. There is no clock,
//! network, filesystem or threads; [`kv`], [`tokenizer`] and [`log`] are the host's services.
//!
//! `kv::current()` gives the request's sequence during `on_token` and `postprocess` (not in
//! `preprocess`, before admission); its pages are handles the host checks on every call. Its
//! `pin_prefix(tokens)` keeps the sequence's first tokens in the tenant's own prefix cache, safe
//! from eviction, so later requests that start the same way skip computing them (see
//! `examples/prefix_pin.rs`); `unpin_prefix()` lets them go.
//!
//! Each call runs under the server's fuel, time and memory limits (`[plugins]` in its config),
//! and a request's calls share one time budget. Set up in `init`, not per request: the server
//! runs `init` once per version and configuration and starts every request from the memory it
//! left (a snapshot), so regexes compiled there, or a vocabulary read there, cost a request
//! nothing ([`parse_config`] reads a JSON configuration into a type of the plugin's own). Work
//! done in `preprocess` is paid on every request. Host calls cost fuel too
//! (`tokenizer::encode` 500 a byte, for one), and what a plugin returns is bounded (see
//! `wit/plugin.wit`). `std::thread::sleep` returns at once: the clock never moves.

/// The bindings wit-bindgen generates for `wit/plugin.wit` (plugins use the re-exports below).
#[doc(hidden)]
#[allow(clippy::too_many_arguments)] // generated code
pub mod bindings {
    wit_bindgen::generate!({
        // The SDK's own copy of the world (and of 0.1.0's, which it imports from), so the crate
        // builds on its own; the host's tests check that it equals the server's `wit/`.
        path: "wit",
        world: "tenant-plugin",
        pub_export_macro: true,
        export_macro_name: "export_world",
        default_bindings_module: "warden_guest::bindings",
        // The 0.1.0 interfaces the world imports (`kv`, `tokenizer`, `log`) are generated here too.
        generate_all,
    });
}

pub use bindings::warden::plugin0_1_0::types::{Capabilities, Chunk, Input, Message, PluginError, Token};
pub use bindings::warden::plugin0_1_0::{kv, log, tokenizer};
pub use bindings::warden::plugin0_2_0::types::{Finish, Request, Sampling, TokenAction, TokenConstraint};
pub use bindings::warden::plugin0_2_0::vocabulary;

/// A plugin. Every method has a default that passes its input through unchanged.
pub trait Plugin {
    /// Sets up from the tenant's configuration before any request (parse it, compile its
    /// rules); an error refuses the configuration. Keep what it builds in a static: every
    /// request's instance starts as `init` left it. Default: nothing to set up.
    fn init(config: String) -> Result<(), PluginError> {
        let _ = config;
        Ok(())
    }

    /// What the plugin implements beyond `preprocess` and `postprocess`. Default: nothing, so
    /// `on_token` is never called.
    fn capabilities() -> Capabilities {
        Capabilities { on_token: false }
    }

    /// Before tokenizing: rewrite the request (messages or prompt, and every sampling field),
    /// or refuse it with an error the client sees.
    fn preprocess(req: Request) -> Result<Request, PluginError> {
        Ok(req)
    }

    /// Each piece of output text; the last comes with `end`, how the choice ended (its finish
    /// reason and token counts). Text may be held back (kept in a static) and released on a
    /// later call; the last call must release everything.
    fn postprocess(chunk: Chunk, end: Option<Finish>) -> Result<Chunk, PluginError> {
        let _ = end;
        Ok(chunk)
    }

    /// Each generated token, when [`capabilities`](Plugin::capabilities) sets `on_token`:
    /// continue, stop the choice after it, or constrain the next token
    /// ([`TokenAction::Constrain`]: only some ids, and/or a bias per id). The next token waits
    /// for this answer.
    fn on_token(token: Token) -> TokenAction {
        let _ = token;
        TokenAction::Continue
    }
}

/// Every token's bytes, by id (a control token's are empty), read from the host 4,096 tokens a
/// call. It costs about 200 fuel a token: read it once, in [`Plugin::init`].
pub fn read_vocabulary() -> Vec<Vec<u8>> {
    let size = vocabulary::size();
    let mut bytes: Vec<Vec<u8>> = Vec::with_capacity(size as usize);
    while (bytes.len() as u32) < size {
        let got = vocabulary::token_bytes(bytes.len() as u32, 4096);
        if got.is_empty() {
            break;
        }
        bytes.extend(got);
    }
    bytes
}

/// Reads a plugin's configuration (the text `init` is given) as JSON into `T`, most often a
/// struct of the plugin's own deriving `serde::Deserialize`: a configuration that does not fit
/// is refused with code `plugin_config` and a message that says where and why, so the server
/// refuses to set it.
///
/// ```
/// use serde::Deserialize;
///
/// #[derive(Debug, Deserialize)]
/// struct Config {
///     system_prompt: String,
///     #[serde(default)]
///     uppercase: bool,
/// }
///
/// let c: Config = warden_guest::parse_config(r#"{"system_prompt": "Be brief."}"#).unwrap();
/// assert_eq!((c.system_prompt.as_str(), c.uppercase), ("Be brief.", false));
/// let e = warden_guest::parse_config::<Config>(r#"{"uppercase": true}"#).unwrap_err();
/// assert_eq!(e.code, "plugin_config");
/// assert!(e.message.contains("system_prompt"), "{}", e.message);
/// ```
#[cfg(feature = "config")]
pub fn parse_config<T: serde::de::DeserializeOwned>(config: &str) -> Result<T, PluginError> {
    serde_json::from_str(config).map_err(|e| PluginError {
        code: "plugin_config".into(),
        message: format!("the configuration is not what this plugin reads: {e}"),
    })
}

/// Logs `message` at `level` into the tenant's log (rate-limited by the host).
pub fn log(level: log::Level, message: &str) {
    log::log(level, message)
}

/// Exports a [`Plugin`] implementation as the component's `tenant-plugin` world.
#[macro_export]
macro_rules! plugin {
    ($ty:ty) => {
        #[doc(hidden)]
        pub struct __WardenPlugin;

        impl $crate::bindings::Guest for __WardenPlugin {
            fn init(config: ::std::string::String) -> ::core::result::Result<(), $crate::PluginError> {
                <$ty as $crate::Plugin>::init(config)
            }
            fn capabilities() -> $crate::Capabilities {
                <$ty as $crate::Plugin>::capabilities()
            }
            fn preprocess(req: $crate::Request) -> ::core::result::Result<$crate::Request, $crate::PluginError> {
                <$ty as $crate::Plugin>::preprocess(req)
            }
            fn postprocess(
                chunk: $crate::Chunk,
                end: ::core::option::Option<$crate::Finish>,
            ) -> ::core::result::Result<$crate::Chunk, $crate::PluginError> {
                <$ty as $crate::Plugin>::postprocess(chunk, end)
            }
            fn on_token(token: $crate::Token) -> $crate::TokenAction {
                <$ty as $crate::Plugin>::on_token(token)
            }
        }

        $crate::bindings::export_world!(__WardenPlugin with_types_in $crate::bindings);
    };
}
