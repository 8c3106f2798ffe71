//! A model file opened for use: weights, tokenizer and chat template, from one GGUF file; or,
//! for a router, its tokenizer and chat template alone ([`ModelText`]).

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

/// What the API side needs of a model file: its tokenizer and chat template. A router opens
/// only this: it never repacks or keeps the weights (its nodes do).
#[derive(Clone)]
pub struct ModelText {
    /// Its tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// Its chat template, if it has one.
    pub chat: Option<Arc<ChatTemplate>>,
}

/// Checks `path` is there, logs, and maps and validates it.
fn map(path: &Path) -> Result<Gguf, LoadError> {
    if !path.exists() {
        return Err(LoadError::NotFound(path.into()));
    }
    let mib = std::fs::metadata(path).map_or(0, |m| m.len() >> 20);
    tracing::info!("model {}: validating and mapping {mib} MiB", path.display());
    Gguf::open(path).map_err(|e| LoadError::Gguf(path.into(), e))
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

impl ModelText {
    /// Opens and validates `path`, reading its tokenizer and chat template and none of its
    /// weights (the mapping goes when this returns); errors name the file.
    pub fn open(path: &Path) -> Result<Self, LoadError> {
        let started = Instant::now();
        let g = map(path)?;
        let text = Self::read(path, &g)?;
        tracing::info!(
            "model {}: tokenizer and chat template read in {:.0} ms (weights not loaded: the nodes hold them)",
            path.display(),
            ms(started)
        );
        Ok(text)
    }

    fn read(path: &Path, g: &Gguf) -> Result<Self, LoadError> {
        let tokenizer = Tokenizer::from_gguf(g).map_err(|e| LoadError::Tokenizer(path.into(), e))?;
        let chat = ChatTemplate::from_gguf(g).map_err(|e| LoadError::Chat(path.into(), e))?;
        Ok(Self {
            tokenizer: Arc::new(tokenizer),
            chat: chat.map(Arc::new),
        })
    }
}

impl LoadedModel {
    /// Opens and validates `path`; errors name the file and what was wrong.
    pub fn open(path: &Path) -> Result<Self, LoadError> {
        // Progress lines with their times: a large model takes a while at each stage.
        let (file, started) = (path.display(), Instant::now());
        let g = map(path)?;
        tracing::info!(
            "model {file}: mapped and validated in {:.0} ms; repacking its weights",
            ms(started)
        );
        let t = Instant::now();
        let model = Model::from_gguf(&g).map_err(|e| LoadError::Model(path.into(), e))?;
        tracing::info!("model {file}: weights repacked in {:.0} ms", ms(t));
        let t = Instant::now();
        let text = ModelText::read(path, &g)?;
        tracing::info!(
            "model {file}: tokenizer and chat template read in {:.0} ms; loaded in {:.0} ms",
            ms(t),
            ms(started)
        );
        Ok(Self {
            model: Arc::new(model),
            tokenizer: text.tokenizer,
            chat: text.chat,
        })
    }

    /// Its tokenizer and chat template.
    pub fn text(&self) -> ModelText {
        ModelText {
            tokenizer: self.tokenizer.clone(),
            chat: self.chat.clone(),
        }
    }
}
