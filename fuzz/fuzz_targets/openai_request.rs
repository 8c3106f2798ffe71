//! Request bodies of both endpoints: parsed (unknown fields ignored, then refused), checked and
//! planned as the server does, then with a prompt through the check that makes the engine's
//! validated request; every refusal is an error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use warden::config::UnknownFields;
use warden::engine::request::AdmissionLimits;
use warden::serve::openai::{ChatRequest, CompletionRequest, RequestLimits};
use warden::tenant::TenantId;

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
    let Some(tenant) = TenantId::new(1) else {
        return;
    };
    for unknown in [UnknownFields::Ignore, UnknownFields::Refuse] {
        if let Ok(r) = ChatRequest::parse(data, 32, unknown) {
            let _ = r.chat_messages();
            if let Ok(logprobs) = r.logprobs()
                && let Ok(p) = r.common.plan(&LIMITS, logprobs)
            {
                let _ = p.params.with_prompt(tenant, vec![1, 2, 3], &ADMISSION);
            }
        }
        if let Ok(r) = CompletionRequest::parse(data, 32, unknown) {
            let _ = (r.asked(), r.echo());
            if let Ok(logprobs) = r.logprobs()
                && let Ok(p) = r.common.plan(&LIMITS, logprobs)
            {
                let _ = p.params.with_prompt(tenant, vec![1, 2, 3], &ADMISSION);
            }
        }
    }
});
