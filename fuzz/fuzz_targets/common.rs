//! What several targets share: the real default model's tokenizer and chat template (the test
//! setup fetches the model; `WARDEN_MODEL` names another file).

use std::sync::OnceLock;

use warden::chat::ChatTemplate;
use warden::gguf::Gguf;
use warden::tokenizer::Tokenizer;

fn model() -> &'static Gguf {
    static G: OnceLock<Gguf> = OnceLock::new();
    G.get_or_init(|| {
        let path = std::env::var("WARDEN_MODEL").unwrap_or_else(|_| {
            concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../",
                "models/SmolLM2-135M-Instruct.Q4_1.gguf"
            )
            .into()
        });
        Gguf::open(&path).unwrap_or_else(|e| panic!("{path}: {e} (run scripts/fetch-model.sh)"))
    })
}

/// The model's tokenizer.
#[allow(dead_code)] // not every target tokenizes
pub fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::from_gguf(model()).expect("the model's tokenizer"))
}

/// The model's chat template.
#[allow(dead_code)] // not every target renders
pub fn template() -> &'static ChatTemplate {
    static C: OnceLock<ChatTemplate> = OnceLock::new();
    C.get_or_init(|| {
        ChatTemplate::from_gguf(model())
            .expect("the model's chat template")
            .expect("the model has a chat template")
    })
}
