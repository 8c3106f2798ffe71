//! What a guest can return, as the host takes it: a rewritten request (checked against a
//! client's limits, then rendered and tokenized as the server would, only when within them) and
//! `postprocess` outputs of any size against their bound.
#![no_main]

use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use warden::chat::ChatMessage;
use warden::plugin::{Input, Message, OutputBound, Request, Sampling};
use warden::serve::plugins::pipeline::check_rewritten;

#[path = "common.rs"]
mod common;

/// A request's body limit here, small so the fuzzer reaches it.
const MAX_BYTES: usize = 4096;

fn request(u: &mut Unstructured) -> Result<Request> {
    let input = if u.arbitrary()? {
        let n = u.int_in_range(0..=400)?;
        let mut messages = Vec::with_capacity(n);
        for _ in 0..n {
            messages.push(Message {
                role: u.arbitrary()?,
                content: u.arbitrary()?,
            });
        }
        Input::Chat(messages)
    } else {
        Input::Prompt(u.arbitrary()?)
    };
    Ok(Request {
        input,
        sampling: Sampling {
            temperature: u.arbitrary()?,
            top_p: u.arbitrary()?,
            top_k: u.arbitrary()?,
            min_p: u.arbitrary()?,
            repetition_penalty: u.arbitrary()?,
            presence_penalty: u.arbitrary()?,
            frequency_penalty: u.arbitrary()?,
            max_tokens: u.arbitrary()?,
            seed: u.arbitrary()?,
            stop: u.arbitrary()?,
            logit_bias: u.arbitrary()?,
        },
        config: String::new(),
        metadata: Vec::new(),
        first_token: None,
    })
}

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    if let Ok(req) = request(&mut u)
        && check_rewritten(&req, MAX_BYTES).is_ok()
    {
        let text = match req.input {
            Input::Prompt(p) => p,
            Input::Chat(m) => {
                let m: Vec<ChatMessage> = m.into_iter().map(|m| ChatMessage::new(m.role, m.content)).collect();
                common::template().render(&m, true).unwrap_or_default()
            }
        };
        let _ = common::tokenizer().encode(&text, true);
    }
    // (`Unstructured` yields zeros once the input is spent: stop there.)
    let mut bound = OutputBound::default();
    while !u.is_empty() {
        let (Ok(given), Ok(returned)) = (u.arbitrary::<u32>(), u.arbitrary::<u32>()) else {
            break;
        };
        if bound.admit(given as usize, returned as usize).is_err() {
            break;
        }
    }
});
