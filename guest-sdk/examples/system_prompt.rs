//! Injects the tenant's system prompt (the plugin's config) into every chat that has none, and
//! wraps raw prompts in it.

use warden_guest::{Input, Message, Plugin, PluginError, Request};

struct SystemPrompt;

impl Plugin for SystemPrompt {
    fn preprocess(mut req: Request) -> Result<Request, PluginError> {
        let system = req.config.trim().to_string();
        if system.is_empty() {
            return Err(PluginError {
                code: "plugin_config".into(),
                message: "system_prompt needs the system prompt as its config".into(),
            });
        }
        req.input = match req.input {
            Input::Chat(mut messages) => {
                if !messages.iter().any(|m| m.role == "system") {
                    messages.insert(
                        0,
                        Message {
                            role: "system".into(),
                            content: system,
                        },
                    );
                }
                Input::Chat(messages)
            }
            Input::Prompt(p) => Input::Prompt(format!("{system}\n\n{p}")),
        };
        Ok(req)
    }
}

warden_guest::plugin!(SystemPrompt);
