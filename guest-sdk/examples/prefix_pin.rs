//! Puts the tenant's system prompt (the plugin's config) first in every chat and pins it in the
//! tenant's prefix cache, so that under memory pressure the next request still skips computing
//! it: the long shared instructions of an assistant are computed once.
//!
//! Config: the system prompt. A first line of exactly `#unpin` switches the plugin to release
//! the pin instead (its requests still carry the same prompt, so they reach the pinned pages):
//! upload the config with it to free the tenant's pinned pages, then put the plain config back.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use warden_guest::log::Level;
use warden_guest::{Capabilities, Input, Message, Plugin, PluginError, Request, Token, TokenAction, kv, tokenizer};

/// Tokens of the system prompt alone, counted in `init` for `on_token`.
static PIN_TOKENS: AtomicU32 = AtomicU32::new(0);
/// The config asked to release the pin instead.
static UNPIN: AtomicBool = AtomicBool::new(false);
thread_local! {
    /// The system prompt, from the config.
    static SYSTEM: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
}

struct PrefixPin;

impl Plugin for PrefixPin {
    /// Reads the config and counts the system prompt's tokens, once per configuration.
    fn init(config: String) -> Result<(), PluginError> {
        let (unpin, system) = match config.split_once('\n') {
            Some((first, rest)) if first.trim() == "#unpin" => (true, rest),
            _ => (false, config.as_str()),
        };
        let system = system.trim().to_string();
        if system.is_empty() {
            return Err(PluginError {
                code: "plugin_config".into(),
                message: "prefix_pin needs the system prompt as its config".into(),
            });
        }
        // The chat template puts a few tokens before the system text, so its own token count
        // never reaches past it: the pinned pages hold nothing but the shared prefix.
        let n = u32::try_from(tokenizer::encode(&system).len()).unwrap_or(u32::MAX);
        PIN_TOKENS.store(n, Ordering::Relaxed);
        UNPIN.store(unpin, Ordering::Relaxed);
        SYSTEM.set(system);
        Ok(())
    }

    fn capabilities() -> Capabilities {
        Capabilities { on_token: true }
    }

    fn preprocess(mut req: Request) -> Result<Request, PluginError> {
        let system = SYSTEM.with_borrow(String::clone);
        req.input = match req.input {
            Input::Chat(mut messages) => {
                match messages.first_mut() {
                    // Keep the client's own system message, after the shared prefix.
                    Some(m) if m.role == "system" => m.content = format!("{system}\n\n{}", m.content),
                    _ => messages.insert(
                        0,
                        Message {
                            role: "system".into(),
                            content: system,
                        },
                    ),
                }
                Input::Chat(messages)
            }
            Input::Prompt(p) => Input::Prompt(format!("{system}\n\n{p}")),
        };
        Ok(req)
    }

    fn on_token(token: Token) -> TokenAction {
        // At the first token the whole prompt is computed and in the tenant's cache.
        if token.index != 1 {
            return TokenAction::Continue;
        }
        let Some(seq) = kv::current() else {
            return TokenAction::Continue;
        };
        if UNPIN.load(Ordering::Relaxed) {
            match seq.unpin_prefix() {
                Ok(pages) => warden_guest::log(Level::Info, &format!("unpinned {pages} pages")),
                Err(e) => warden_guest::log(Level::Warn, &format!("unpin failed: {e}")),
            }
        } else {
            // A failed pin (the tenant's cap, a prompt shorter than a page) costs only speed.
            match seq.pin_prefix(PIN_TOKENS.load(Ordering::Relaxed)) {
                Ok(tokens) => warden_guest::log(Level::Info, &format!("pinned {tokens} tokens")),
                Err(e) => warden_guest::log(Level::Warn, &format!("pin failed: {e}")),
            }
        }
        TokenAction::Continue
    }
}

warden_guest::plugin!(PrefixPin);
