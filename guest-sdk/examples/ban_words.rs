//! Keeps configured words out of the output: the config lists words, one a line; `init` finds
//! the tokens that spell one of them (whatever their ASCII case, with or without a leading space) in
//! the model's vocabulary, and every token, the first included, is sampled with those tokens
//! biased by -100. It shows the cheap end of steering: one bias list a token, worked out once.
//! (A word the model spells in several tokens is not caught: that takes a plugin that follows
//! the text, as `json_guard` does.)

use std::cell::RefCell;

use warden_guest::{Capabilities, Plugin, PluginError, Request, Token, TokenAction, TokenConstraint, vocabulary};

thread_local! {
    static BANNED: RefCell<Vec<(u32, f32)>> = const { RefCell::new(Vec::new()) };
}

fn constraint() -> TokenConstraint {
    TokenConstraint {
        allowed: None,
        bias: BANNED.with_borrow(Clone::clone),
    }
}

struct BanWords;

impl Plugin for BanWords {
    fn init(config: String) -> Result<(), PluginError> {
        let words: Vec<String> = config
            .lines()
            .map(|l| l.trim().to_lowercase())
            .filter(|l| !l.is_empty())
            .collect();
        if words.is_empty() {
            return Err(PluginError {
                code: "plugin_config".into(),
                message: "ban_words needs words to ban, one a line".into(),
            });
        }
        let size = vocabulary::size();
        let mut banned = Vec::new();
        let mut first = 0;
        while first < size {
            let batch = vocabulary::token_bytes(first, 4096);
            if batch.is_empty() {
                break;
            }
            for (i, bytes) in batch.iter().enumerate() {
                // No allocation per token: the vocabulary is tens of thousands of them.
                let text = bytes.trim_ascii();
                if !text.is_empty() && words.iter().any(|w| w.as_bytes().eq_ignore_ascii_case(text)) {
                    banned.push((first + i as u32, -100.0));
                }
            }
            first += batch.len() as u32;
        }
        BANNED.with_borrow_mut(|b| *b = banned);
        Ok(())
    }

    fn capabilities() -> Capabilities {
        Capabilities { on_token: true }
    }

    fn preprocess(mut req: Request) -> Result<Request, PluginError> {
        req.first_token = Some(constraint());
        Ok(req)
    }

    fn on_token(_token: Token) -> TokenAction {
        TokenAction::Constrain(constraint())
    }
}

warden_guest::plugin!(BanWords);
