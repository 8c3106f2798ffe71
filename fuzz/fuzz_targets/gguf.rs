//! Model files: any bytes parse or are refused with an error (never a panic, an out-of-bounds read
//! or an allocation the file's size does not justify), and what parses feeds the tokenizer and
//! chat template loaders the same way.
#![no_main]

use libfuzzer_sys::fuzz_target;
use warden::chat::ChatTemplate;
use warden::gguf::Gguf;
use warden::tokenizer::Tokenizer;

fuzz_target!(|data: &[u8]| {
    if let Ok(g) = Gguf::from_bytes(data.to_vec()) {
        let _ = Tokenizer::from_gguf(&g);
        let _ = ChatTemplate::from_gguf(&g);
    }
});
