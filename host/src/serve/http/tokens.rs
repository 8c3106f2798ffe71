//! `POST /tokenize` and `POST /detokenize`, in vLLM's shape: what a prompt or a conversation is
//! to a model's tokenizer (as the model reads it before any plugin), and token ids back to text.
//! Each is a request of its tenant like any other: the model under its policy's
//! `allowed_models`, a slot of its concurrency and one of its requests per minute, the body
//! within the body limit, the work off the runtime.

use std::sync::Arc;

use hyper::{Response, StatusCode};
use serde_json::json;

use super::generate::{admit, counted, off_runtime};
use super::reply::{Body, json_response, model_not_found};
use crate::serve::access::Access;
use crate::serve::error::ApiError;
use crate::serve::openai::{DetokenizeRequest, TokenizeRequest, chat_messages};
use crate::serve::state::{Served, State};
use crate::serve::store::Tenant;
use crate::serve::tools::render;

/// The model a request names, or the server's one model when it names none.
fn pick(state: &State, model: Option<&str>, access: &Access) -> Result<Arc<Served>, ApiError> {
    let served = match model {
        Some(id) => state.model(id).ok_or_else(|| model_not_found(id))?,
        None => match state.models.as_slice() {
            [one] => one,
            _ => {
                return Err(ApiError::field(
                    "model",
                    "this server serves several models: name one in model",
                ));
            }
        },
    };
    access.model(&served.id);
    Ok(served.clone())
}

pub(super) async fn tokenize(
    state: &Arc<State>,
    t: Tenant,
    body: &[u8],
    access: &Arc<Access>,
) -> Result<Response<Body>, ApiError> {
    let mut model = None;
    let r = async {
        let r = TokenizeRequest::parse(body, state.cfg.limits.json_depth)?;
        let served = pick(state, r.model.as_deref(), access)?;
        model = Some(served.id.clone());
        // Held until the answer is made: the tenant's slot and its request.
        let _admitted = admit(state, &t, served.clone(), None)?;
        let tk = served.tokenizer.clone();
        let tokens = match (r.prompt, r.messages) {
            (Some(text), _) => {
                let add_bos = r.add_special_tokens.unwrap_or(true);
                off_runtime(move || {
                    let mut ids = tk.encode(&text, true);
                    if !add_bos && tk.add_bos() && ids.first().copied() == tk.bos_id() {
                        ids.remove(0);
                    }
                    Ok(ids)
                })
                .await?
            }
            (None, messages) => {
                let template = served.chat.clone().ok_or_else(|| {
                    ApiError::new(
                        StatusCode::BAD_REQUEST,
                        "no_chat_template",
                        "this model has no chat template; tokenize a prompt",
                    )
                })?;
                let messages = chat_messages(messages.as_deref().unwrap_or_default())?;
                let open = r.add_generation_prompt.unwrap_or(true);
                off_runtime(move || {
                    let text = render(&template, messages, None, open)
                        .map_err(|e| ApiError::field("messages", format!("rendering the chat template: {e}")))?;
                    Ok(tk.encode_chat(&text))
                })
                .await?
            }
        };
        // Up to a whole body's tokens: off the runtime too.
        let strs = match r.return_token_strs {
            Some(true) => {
                let (tk, ids) = (served.tokenizer.clone(), tokens.clone());
                let strs = off_runtime(move || {
                    Ok(ids
                        .iter()
                        .map(|&id| String::from_utf8_lossy(&tk.token_bytes(id)).into_owned())
                        .collect::<Vec<_>>())
                })
                .await?;
                Some(strs)
            }
            _ => None,
        };
        Ok(json_response(
            StatusCode::OK,
            &json!({
                "count": tokens.len(),
                "max_model_len": served.admission.max_context,
                "tokens": tokens,
                "token_strs": strs,
            }),
        ))
    }
    .await;
    counted(state, &t, model.as_deref(), r)
}

pub(super) async fn detokenize(
    state: &Arc<State>,
    t: Tenant,
    body: &[u8],
    access: &Arc<Access>,
) -> Result<Response<Body>, ApiError> {
    let mut model = None;
    let r = async {
        let r: DetokenizeRequest = crate::serve::openai::parse_body(
            body,
            state.cfg.limits.json_depth,
            crate::serve::openai::DETOKENIZE_FIELDS,
        )?;
        let served = pick(state, r.model.as_deref(), access)?;
        model = Some(served.id.clone());
        let _admitted = admit(state, &t, served.clone(), None)?;
        let vocab = served.tokenizer.vocab_size();
        if let Some(i) = r.tokens.iter().position(|&id| id as usize >= vocab) {
            return Err(ApiError::field(
                &format!("tokens[{i}]"),
                format!(
                    "tokens[{i}] = {} is not a token of model {} (its vocabulary has {vocab})",
                    r.tokens[i], served.id
                ),
            ));
        }
        let tk = served.tokenizer.clone();
        let tokens = r.tokens;
        let text = off_runtime(move || Ok(tk.decode(&tokens))).await?;
        Ok(json_response(StatusCode::OK, &json!({"prompt": text})))
    }
    .await;
    counted(state, &t, model.as_deref(), r)
}
