//! The served model's tokenizer: any text encodes (with and without special tokens) to tokens
//! whose bytes are exactly the text's bytes that have a token (SmolLM2's vocabulary lacks a few
//! control bytes, which are dropped, as llama.cpp drops them), text of such bytes alone decodes
//! back to itself, and any token list decodes.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let tk = common::tokenizer();
    let text = String::from_utf8_lossy(data);
    let ids = tk.encode(&text, false);
    assert!(ids.iter().all(|&i| (i as usize) < tk.vocab_size()));
    let got: Vec<u8> = ids.iter().flat_map(|&i| tk.token_bytes(i)).collect();
    let kept: Vec<u8> = text.bytes().filter(|&b| tk.byte_has_token(b)).collect();
    assert_eq!(got, kept, "the tokens hold exactly the text's bytes that have a token");
    let mut buf = [0u8; 4];
    let clean: String = text
        .chars()
        .filter(|c| c.encode_utf8(&mut buf).bytes().all(|b| tk.byte_has_token(b)))
        .collect();
    assert_eq!(
        tk.decode(&tk.encode(&clean, false)),
        clean,
        "encode then decode is the identity"
    );
    let _ = tk.encode(&text, true);
    let ids: Vec<u32> = data
        .chunks(2)
        .map(|c| u32::from(c[0]) | u32::from(*c.get(1).unwrap_or(&0)) << 8)
        .collect();
    let _ = tk.decode(&ids);
});
