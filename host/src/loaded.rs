//! A model file opened for use: weights, tokenizer and chat template, from one GGUF file.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, bail};

use crate::chat::ChatTemplate;
use crate::gguf::Gguf;
use crate::model::Model;
use crate::tokenizer::Tokenizer;

/// A model's id in the API: its file's stem.
pub fn model_id(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into())
}

/// Everything a GGUF file gives.
pub struct LoadedModel {
    /// The weights.
    pub model: Arc<Model>,
    /// Its tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// Its chat template, if it has one.
    pub chat: Option<Arc<ChatTemplate>>,
}

impl LoadedModel {
    /// Opens and validates `path`; errors name the file and what was wrong.
    pub fn open(path: &Path) -> anyhow::Result<Self> {
        if !path.exists() {
            bail!(
                "model file {} not found (run scripts/fetch-model.sh for the default model)",
                path.display()
            );
        }
        let g = Gguf::open(path).with_context(|| format!("reading {}", path.display()))?;
        let model = Model::from_gguf(&g).with_context(|| format!("loading {}", path.display()))?;
        let tokenizer = Tokenizer::from_gguf(&g).with_context(|| format!("tokenizer of {}", path.display()))?;
        let chat = ChatTemplate::from_gguf(&g).with_context(|| format!("chat template of {}", path.display()))?;
        Ok(Self {
            model: Arc::new(model),
            tokenizer: Arc::new(tokenizer),
            chat: chat.map(Arc::new),
        })
    }
}
