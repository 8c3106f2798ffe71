//! Request bodies of both endpoints: parsed, checked and planned as the server does, then through
//! the engine's admission check; every refusal is an error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use warden::engine::request::AdmissionLimits;
use warden::serve::openai::{ChatRequest, CompletionRequest, RequestLimits};

const LIMITS: RequestLimits = RequestLimits {
    default_max_tokens: 256,
    max_n: 8,
};

const ADMISSION: AdmissionLimits = AdmissionLimits {
    max_context: 8192,
    vocab: 49152,
    pool_tokens: 16384,
};

fuzz_target!(|data: &[u8]| {
    if let Ok(r) = ChatRequest::parse(data, 32) {
        let _ = r.chat_messages();
        let _ = r.logprobs();
        if let Ok(p) = r.common.plan(1, vec![1, 2, 3], &LIMITS) {
            let _ = p.req.validate(&ADMISSION);
        }
    }
    if let Ok(r) = CompletionRequest::parse(data, 32)
        && let Ok(p) = r.common.plan(1, vec![1, 2, 3], &LIMITS)
    {
        let _ = p.req.validate(&ADMISSION);
    }
});
