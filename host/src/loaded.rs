//! A model file opened for use: weights, tokenizer and chat template, from one GGUF file.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

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
        // Progress lines with their times: a large model takes a while at each stage.
        let ms = |t: Instant| t.elapsed().as_secs_f64() * 1e3;
        let (file, started) = (path.display(), Instant::now());
        let mib = std::fs::metadata(path).map_or(0, |m| m.len() >> 20);
        tracing::info!("model {file}: validating and mapping {mib} MiB");
        let g = Gguf::open(path).map_err(|e| LoadError::Gguf(path.into(), e))?;
        tracing::info!(
            "model {file}: mapped and validated in {:.0} ms; repacking its weights",
            ms(started)
        );
        let t = Instant::now();
        let model = Model::from_gguf(&g).map_err(|e| LoadError::Model(path.into(), e))?;
        tracing::info!("model {file}: weights repacked in {:.0} ms", ms(t));
        let t = Instant::now();
        let tokenizer = Tokenizer::from_gguf(&g).map_err(|e| LoadError::Tokenizer(path.into(), e))?;
        let chat = ChatTemplate::from_gguf(&g).map_err(|e| LoadError::Chat(path.into(), e))?;
        tracing::info!(
            "model {file}: tokenizer and chat template read in {:.0} ms; loaded in {:.0} ms",
            ms(t),
            ms(started)
        );
        Ok(Self {
            model: Arc::new(model),
            tokenizer: Arc::new(tokenizer),
            chat: chat.map(Arc::new),
        })
    }
}
