//! A plugin built against `warden:plugin@0.1.0` (the world before 0.2.0), with wit-bindgen
//! directly: the server runs components of both versions, and its tests run this one to show a
//! 0.1.0 component keeps working. It adds its config as a system message, and upper-cases the
//! output (0.1.0's `postprocess` has `is-final`, not the finish).

mod bindings {
    wit_bindgen::generate!({
        path: "wit/deps/plugin-0.1.0",
        world: "tenant-plugin",
    });
}

use bindings::warden::plugin::types::{Capabilities, Chunk, Input, Message, PluginError, Request, Token, TokenAction};

struct Legacy;

impl bindings::Guest for Legacy {
    fn capabilities() -> Capabilities {
        Capabilities { on_token: false }
    }

    fn preprocess(mut req: Request) -> Result<Request, PluginError> {
        if let Input::Chat(messages) = &mut req.input {
            messages.insert(
                0,
                Message {
                    role: "system".into(),
                    content: req.config.trim().to_string(),
                },
            );
        }
        Ok(req)
    }

    fn postprocess(chunk: Chunk, _is_final: bool) -> Result<Chunk, PluginError> {
        Ok(Chunk {
            text: chunk.text.to_uppercase(),
        })
    }

    fn on_token(_token: Token) -> TokenAction {
        TokenAction::Continue
    }
}

bindings::export!(Legacy with_types_in bindings);
