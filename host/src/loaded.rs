//! A model file opened for use: weights, tokenizer and chat template, from one GGUF file.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::chat::{ChatError, ChatTemplate};
use crate::gguf::{Gguf, GgufError};
use crate::model::{Model, ModelError};
use crate::tokenizer::{Tokenizer, TokenizerError};

/// Why a model file could not be opened; each names the file.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// No such file.
    #[error("model file {} not found (run scripts/fetch-model.sh for the default model)", .0.display())]
    NotFound(PathBuf),
    /// Not a GGUF file this reader accepts.
    #[error("reading {}", .0.display())]
    Gguf(PathBuf, #[source] GgufError),
    /// Its weights or hyperparameters.
    #[error("loading {}", .0.display())]
    Model(PathBuf, #[source] ModelError),
    /// Its tokenizer.
    #[error("tokenizer of {}", .0.display())]
    Tokenizer(PathBuf, #[source] TokenizerError),
    /// Its chat template.
    #[error("chat template of {}", .0.display())]
    Chat(PathBuf, #[source] ChatError),
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
    pub fn open(path: &Path) -> Result<Self, LoadError> {
        if !path.exists() {
            return Err(LoadError::NotFound(path.into()));
        }
        let g = Gguf::open(path).map_err(|e| LoadError::Gguf(path.into(), e))?;
        let model = Model::from_gguf(&g).map_err(|e| LoadError::Model(path.into(), e))?;
        let tokenizer = Tokenizer::from_gguf(&g).map_err(|e| LoadError::Tokenizer(path.into(), e))?;
        let chat = ChatTemplate::from_gguf(&g).map_err(|e| LoadError::Chat(path.into(), e))?;
        Ok(Self {
            model: Arc::new(model),
            tokenizer: Arc::new(tokenizer),
            chat: chat.map(Arc::new),
        })
    }
}
