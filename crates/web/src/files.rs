//! Files in a conversation over HTTP: `POST /api/conversations/{id}/files?name=…` (the file's
//! bytes as the body; any content type), `GET …/files`, `DELETE …/files/{file}` (a file not
//! yet sent). A message takes waiting files with `"files": [ids]` (see [`super::api`]). What is
//! accepted and how it reads in the prompt is `smolchat_service::files`.

use actix_web::{web, HttpRequest, HttpResponse};
use serde::Deserialize;
use serde_json::json;

use super::api::OnConversation;
use super::api::{parse_id, parse_uuid};
use super::error::WebError;
use super::json::read_bytes;
use super::owner::Owner;
use super::AppState;
use smolchat_service::conversations::Uploaded;

#[derive(Debug, Deserialize)]
pub struct UploadQuery {
    /// The file's name: its extension says its type.
    pub name: Option<String>,
}

/// The `name` an upload's query string gives (its extension says its type); `example` shows
/// how to give it.
pub fn upload_name(req: &HttpRequest, example: &str) -> Result<String, WebError> {
    let query = web::Query::<UploadQuery>::from_query(req.query_string())
        .map_err(|e| WebError::BadRequest(format!("bad query string: {e}")))?;
    query
        .name
        .clone()
        .filter(|n| !n.trim().is_empty())
        .ok_or_else(|| {
            WebError::BadRequest(format!(
                "say the file's name: POST {example} (its extension gives its type)"
            ))
        })
}

/// An upload's body, at most `limit` bytes; more is 413 naming `what` and the `setting`.
pub async fn upload_body(
    req: &HttpRequest,
    payload: web::Payload,
    name: &str,
    limit: usize,
    what: &str,
    setting: &str,
) -> Result<Vec<u8>, WebError> {
    let too_large = || {
        WebError::PayloadTooLarge(format!(
            "{name:?} is larger than {} MiB, the most {what} may be ({setting})",
            limit >> 20
        ))
    };
    read_bytes(req, payload.into_inner(), limit, too_large).await
}

/// `POST /api/conversations/{id}/files?name=report.pdf` → 201 and the file (no text): it waits
/// for the next message that names it in `files`. A file too long to read whole is, for an
/// account, added to the conversation's own knowledge collection and searched for each message
/// instead: 201 `{"outcome": "searched", "message", "collection", "collection_name",
/// "document"}`.
pub async fn upload(
    state: web::Data<AppState>,
    on: OnConversation,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, WebError> {
    let name = upload_name(&req, "…/files?name=report.pdf")?;
    let service = state.platform.conversations();
    let OnConversation { caller, id, .. } = on;
    // Whose it is before reading the body: another owner's id is 404 whatever is sent.
    service.owned(&caller, id).await?;
    let limit = state.platform.config().limits.max_file_mib as usize * (1 << 20);
    let bytes = upload_body(&req, payload, &name, limit, "a file", "limits.max_file_mib").await?;
    // A file too long to read whole is searched instead (for an account): the answer says so.
    match service.upload_or_search(&caller, id, &name, bytes).await? {
        Uploaded::Attached(file) => Ok(HttpResponse::Created().json(file)),
        searched => Ok(HttpResponse::Created().json(searched)),
    }
}

/// `GET /api/conversations/{id}/files`: `{"files": [...]}`, those messages carry
/// (`message_id`) and those waiting (`message_id: null`).
pub async fn list(
    state: web::Data<AppState>,
    on: OnConversation,
) -> Result<HttpResponse, WebError> {
    let OnConversation { caller, id, .. } = on;
    let files = state.platform.conversations().files(&caller, id).await?;
    Ok(HttpResponse::Ok().json(json!({ "files": files })))
}

/// `DELETE /api/conversations/{id}/files/{file}` → 204 (only a file no message carries yet).
pub async fn remove(
    state: web::Data<AppState>,
    owner: Owner,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, WebError> {
    let (id, file) = path.into_inner();
    let id = parse_id(&id)?;
    let file = parse_uuid(&file, "file id")?;
    state
        .platform
        .conversations()
        .remove_file(&owner.caller(), id, file)
        .await?;
    Ok(HttpResponse::NoContent().finish())
}
