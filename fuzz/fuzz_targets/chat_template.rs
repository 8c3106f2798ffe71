//! The model's chat template over arbitrary messages: it renders or refuses with an error, within
//! its fuel and output limits, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use warden::chat::ChatMessage;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let mut parts = text.split('\0');
    let mut messages = Vec::new();
    while let (Some(role), Some(content)) = (parts.next(), parts.next()) {
        messages.push(ChatMessage::new(role, content));
    }
    let t = common::template();
    let _ = t.render(&messages, true);
    let _ = t.render(&messages, false);
});
