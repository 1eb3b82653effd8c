//! The JSON API for organising conversations and for presets: `/api/folders`, `/api/conversations/tags` and
//! `/api/presets` (pinning, archiving, filing and tagging a conversation go through `PATCH
//! /api/conversations/{id}`, see [`super::api`]). Every rule lives in the service
//! ([`smolchat_service::conversations`]); these handlers parse, call it and answer.

use actix_web::{web, HttpResponse};
use serde::Deserialize;
use serde_json::json;

use super::api::parse_uuid;
use super::error::WebError;
use super::json::JsonBody;
use super::owner::Owner;
use super::AppState;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FolderInput {
    pub name: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PresetInput {
    pub name: String,
    pub system_prompt: String,
    /// Everyone's preset (admins only).
    #[serde(default)]
    pub shared: bool,
}

/// `GET /api/folders`: `{"folders": [{id, name, conversations, created_at}]}` by name.
pub async fn folders(state: web::Data<AppState>, owner: Owner) -> Result<HttpResponse, WebError> {
    let folders = state
        .platform
        .conversations()
        .folders(&owner.caller())
        .await?;
    Ok(HttpResponse::Ok().json(json!({ "folders": folders })))
}

/// `POST /api/folders` `{"name"}` → 201 and the folder.
pub async fn create_folder(
    state: web::Data<AppState>,
    owner: Owner,
    body: JsonBody<FolderInput>,
) -> Result<HttpResponse, WebError> {
    let folder = state
        .platform
        .conversations()
        .create_folder(&owner.caller(), &body.0.name)
        .await?;
    Ok(HttpResponse::Created().json(folder))
}

/// `PATCH /api/folders/{id}` `{"name"}` → 204.
pub async fn rename_folder(
    state: web::Data<AppState>,
    owner: Owner,
    path: web::Path<String>,
    body: JsonBody<FolderInput>,
) -> Result<HttpResponse, WebError> {
    let id = parse_uuid(&path, "folder id")?;
    state
        .platform
        .conversations()
        .rename_folder(&owner.caller(), id, &body.0.name)
        .await?;
    Ok(HttpResponse::NoContent().finish())
}

/// `DELETE /api/folders/{id}` → 204; its conversations stay, outside any folder.
pub async fn delete_folder(
    state: web::Data<AppState>,
    owner: Owner,
    path: web::Path<String>,
) -> Result<HttpResponse, WebError> {
    let id = parse_uuid(&path, "folder id")?;
    state
        .platform
        .conversations()
        .delete_folder(&owner.caller(), id)
        .await?;
    Ok(HttpResponse::NoContent().finish())
}

/// `GET /api/conversations/tags` (not `/api/tags`, Ollama's model list): `{"tags": [{tag, conversations}]}` by name.
pub async fn tags(state: web::Data<AppState>, owner: Owner) -> Result<HttpResponse, WebError> {
    let tags = state.platform.conversations().tags(&owner.caller()).await?;
    Ok(HttpResponse::Ok().json(json!({ "tags": tags })))
}

/// `GET /api/presets`: `{"presets": [{id, name, system_prompt, shared, updated_at}]}`, the
/// shared ones first.
pub async fn presets(state: web::Data<AppState>, owner: Owner) -> Result<HttpResponse, WebError> {
    let presets = state
        .platform
        .conversations()
        .presets(&owner.caller())
        .await?;
    Ok(HttpResponse::Ok().json(json!({ "presets": presets })))
}

/// `POST /api/presets` `{"name", "system_prompt", "shared"?}` → 201 and the preset.
pub async fn create_preset(
    state: web::Data<AppState>,
    owner: Owner,
    body: JsonBody<PresetInput>,
) -> Result<HttpResponse, WebError> {
    let input = body.0;
    let preset = state
        .platform
        .conversations()
        .create_preset(
            &owner.caller(),
            &input.name,
            &input.system_prompt,
            input.shared,
        )
        .await?;
    Ok(HttpResponse::Created().json(preset))
}

/// `PATCH /api/presets/{id}` `{"name", "system_prompt"}` → 204 (a shared one: admins only).
pub async fn update_preset(
    state: web::Data<AppState>,
    owner: Owner,
    path: web::Path<String>,
    body: JsonBody<PresetInput>,
) -> Result<HttpResponse, WebError> {
    let id = parse_uuid(&path, "preset id")?;
    let input = body.0;
    state
        .platform
        .conversations()
        .update_preset(&owner.caller(), id, &input.name, &input.system_prompt)
        .await?;
    Ok(HttpResponse::NoContent().finish())
}

/// `DELETE /api/presets/{id}` → 204 (a shared one: admins only).
pub async fn delete_preset(
    state: web::Data<AppState>,
    owner: Owner,
    path: web::Path<String>,
) -> Result<HttpResponse, WebError> {
    let id = parse_uuid(&path, "preset id")?;
    state
        .platform
        .conversations()
        .delete_preset(&owner.caller(), id)
        .await?;
    Ok(HttpResponse::NoContent().finish())
}
