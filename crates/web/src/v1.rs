//! What every API dialect shares (OpenAI's `/v1`, Anthropic's `/v1/messages`, the Responses API
//! and Ollama's `/api`): who may call ([`auth`]), whose the request is ([`identity`]), and the
//! one pipeline a parsed request goes through ([`pipeline`]: the checks, the prompt, the
//! submission). A change meant for every API is made here, never in one dialect's file.

mod auth;
mod identity;
mod pipeline;
pub(crate) mod stream;

pub use auth::{api_caller_is_admin, ApiAccount};
use auth::{bearer, GlobalKey};
pub(crate) use auth::{check_admin_only, require_api_key};
pub(crate) use identity::{
    api_owner, api_user, cache_salt, cache_salt_of, client_identity, ApiUser,
};
pub(crate) use pipeline::{
    build_chat_prompt, check_model, checked_chat, collect, defaults, encode, generation_failed,
    log_finished, model_error, model_name, read_files, resolve_model, submit, WORKER_GONE,
};
pub use pipeline::{chat_prompt, chat_render_input};

use std::sync::atomic::Ordering;
use std::sync::OnceLock;

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header;
use actix_web::middleware::Next;
use actix_web::web;
use actix_web::{HttpMessage, HttpRequest};
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::openai::body::{ChatBody, GenerationBody};
use crate::openai::request::{self, Defaults, GenerationOptions};
use crate::{AppState, WebError};
use smolchat_service::completions::{CacheUse, Completion, CompletionRequest};
use smolchat_service::completions::{Failure, GenSummary, RequestId};
use smolchat_service::conversations::ConversationError;
use smolchat_service::models::{ModelError, ServedModel};
use smolchat_service::platform::Platform;
use smolchat_text::prompt::{Prompt, PromptBuilder};
use smolchat_text::template::{ChatMessage, ChatTemplate, RenderOptions};
use smolchat_text::TextError;
use std::sync::Arc;
