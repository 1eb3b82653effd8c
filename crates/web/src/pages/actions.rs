//! The chat page's form actions: create, send, stop, regenerate, edit, select a version,
//! rename, settings, thinking, delete, export. Each parses its form, calls the conversation
//! service with the caller and answers what HTMX or `static/chat.js` expects.

use crate::api::OnConversation;
use std::future::Future;
use std::pin::Pin;

use actix_web::dev::Payload;
use actix_web::FromRequest;
use serde::de::DeserializeOwned;
use smolchat_service::Caller;

use super::*;

#[derive(Deserialize)]
pub struct ContentForm {
    #[serde(default)]
    content: String,
    /// Waiting files the message carries, comma-separated ids (the page's chips).
    #[serde(default)]
    files: String,
    /// A new chat's model (the picker); empty or absent: the default.
    #[serde(default)]
    model: String,
}

/// The ids of a comma-separated list.
pub(super) fn file_ids(list: &str) -> Result<Vec<Uuid>, WebError> {
    list.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| parse_uuid(s, "file id"))
        .collect()
}

/// `…/edit` and `…/regenerate`: the user message a new version is made of (the branch's last
/// one when absent), and for an edit its new text.
#[derive(Deserialize)]
pub struct MessageForm {
    #[serde(default)]
    content: String,
    #[serde(default)]
    message: Option<String>,
}

#[derive(Deserialize)]
pub struct SelectForm {
    message: String,
}

/// A form action on one conversation: the caller, the conversation (from the path) checked as
/// the caller's before the body is read, so another owner's id is 404 whatever the form holds,
/// and the form.
pub struct OwnedForm<T> {
    caller: Caller,
    id: Uuid,
    form: T,
}

impl<T: DeserializeOwned + 'static> FromRequest for OwnedForm<T> {
    type Error = PageError;
    type Future = Pin<Box<dyn Future<Output = Result<Self, PageError>>>>;

    fn from_request(req: &HttpRequest, payload: &mut Payload) -> Self::Future {
        let req = req.clone();
        let body = web::Payload::from_request(&req, payload);
        Box::pin(async move {
            let payload = body
                .await
                .map_err(|e| WebError::BadRequest(format!("the request body: {e}")))?;
            let state = req
                .app_data::<web::Data<AppState>>()
                .cloned()
                .ok_or_else(|| WebError::Internal("app state missing".into()))?;
            let owner = Owner::extract(&req).await?;
            let id = parse_id(req.match_info().get("id").unwrap_or_default())?;
            let caller = owner.caller();
            state.platform.conversations().owned(&caller, id).await?;
            let form = read_form(&state, &req, payload).await?;
            Ok(OwnedForm { caller, id, form })
        })
    }
}

/// An HTMX redirect (a full page load of `to`), with `Location` for other clients.
pub(super) fn hx_redirect(status: StatusCode, to: &str) -> HttpResponse {
    HttpResponse::build(status)
        .insert_header(("HX-Redirect", to.to_string()))
        .insert_header((header::LOCATION, to.to_string()))
        .finish()
}

/// `POST /c`: a new conversation, with its first message if the form has one.
pub async fn create(
    state: web::Data<AppState>,
    owner: Owner,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, PageError> {
    let form: ContentForm = read_form(&state, &req, payload).await?;
    let created = state
        .platform
        .conversations()
        .create(
            &owner.caller(),
            NewConversation {
                first_message: Some(form.content),
                settings: SettingsPatch {
                    model: (!form.model.is_empty()).then_some(form.model),
                    ..SettingsPatch::default()
                },
                ..NewConversation::default()
            },
        )
        .await?;
    Ok(hx_redirect(
        StatusCode::CREATED,
        &format!("/c/{}", created.conversation.id),
    ))
}

/// `POST /c/{id}/messages`
pub async fn send(
    state: web::Data<AppState>,
    action: OwnedForm<ContentForm>,
) -> Result<HttpResponse, PageError> {
    let OwnedForm { caller, id, form } = action;
    let files = file_ids(&form.files)?;
    state
        .platform
        .conversations()
        .send_with_files(&caller, id, form.content, files)
        .await?;
    Ok(HttpResponse::Accepted().finish())
}

/// `POST /c/{id}/draft`: the message being typed, warmed while the user types (see
/// `api::warm_draft`); answers what was done, as JSON.
pub async fn draft(
    state: web::Data<AppState>,
    action: OwnedForm<ContentForm>,
) -> Result<HttpResponse, PageError> {
    let OwnedForm { caller, id, form } = action;
    let files = file_ids(&form.files)?;
    let outcome = state
        .platform
        .conversations()
        .warm_draft(&caller, id, form.content, files)
        .await?;
    Ok(HttpResponse::Accepted().json(outcome))
}

/// `POST /c/{id}/stop`
pub async fn stop(
    state: web::Data<AppState>,
    on: OnConversation<PageError>,
) -> Result<HttpResponse, PageError> {
    let OnConversation { caller, id, .. } = on;
    state.platform.conversations().stop(&caller, id).await?;
    Ok(HttpResponse::NoContent().finish())
}

/// `POST /c/{id}/tools/decide`: the Allow or Deny button of a tool call.
#[derive(Deserialize)]
pub struct DecideForm {
    message: String,
    step: String,
    /// `allow` or `deny`.
    decision: String,
}

pub async fn decide_tool(
    state: web::Data<AppState>,
    action: OwnedForm<DecideForm>,
) -> Result<HttpResponse, PageError> {
    let OwnedForm { caller, id, form } = action;
    let message = api::optional_message_id(Some(&form.message))?
        .ok_or_else(|| WebError::BadRequest("`message`: the reply's id is required".into()))?;
    let step: i64 = form_number("step", &form.step, "a call's number")?;
    let allow = match form.decision.as_str() {
        "allow" => true,
        "deny" => false,
        other => {
            return Err(WebError::BadRequest(format!(
                "`decision`: {other:?} is neither allow nor deny"
            ))
            .into())
        }
    };
    state
        .platform
        .conversations()
        .decide_tool(&caller, id, message, step, allow)
        .await?;
    Ok(HttpResponse::NoContent().finish())
}

/// `POST /c/{id}/regenerate`
pub async fn regenerate(
    state: web::Data<AppState>,
    action: OwnedForm<MessageForm>,
) -> Result<HttpResponse, PageError> {
    let OwnedForm { caller, id, form } = action;
    // The user message to answer again (the branch's last one when absent).
    let message = api::optional_message_id(form.message.as_deref())?;
    state
        .platform
        .conversations()
        .regenerate(&caller, id, message)
        .await?;
    Ok(HttpResponse::Accepted().finish())
}

/// `POST /c/{id}/edit`
pub async fn edit(
    state: web::Data<AppState>,
    action: OwnedForm<MessageForm>,
) -> Result<HttpResponse, PageError> {
    let OwnedForm { caller, id, form } = action;
    let message = api::optional_message_id(form.message.as_deref())?;
    state
        .platform
        .conversations()
        .edit(&caller, id, form.content, message)
        .await?;
    Ok(HttpResponse::Accepted().finish())
}

/// `POST /c/{id}/select`: shows the branch through a version (‹ › on a message); the page
/// reloads the conversation.
pub async fn select(
    state: web::Data<AppState>,
    action: OwnedForm<SelectForm>,
) -> Result<HttpResponse, PageError> {
    let OwnedForm { caller, id, form } = action;
    let message = api::parse_uuid(&form.message, "message id")?;
    state
        .platform
        .conversations()
        .select(&caller, id, message)
        .await?;
    Ok(hx_redirect(StatusCode::SEE_OTHER, &format!("/c/{id}")))
}

#[derive(Deserialize)]
pub struct TitleForm {
    title: String,
}

/// `POST /c/{id}/rename`
pub async fn rename(
    state: web::Data<AppState>,
    action: OwnedForm<TitleForm>,
) -> Result<HttpResponse, PageError> {
    let OwnedForm { caller, id, form } = action;
    state
        .platform
        .conversations()
        .rename(&caller, id, &form.title)
        .await?;
    Ok(HttpResponse::NoContent()
        .insert_header(("HX-Refresh", "true"))
        .finish())
}

/// The numbers arrive as text and are parsed here, so that a bad one is refused with its
/// field's name (the form decoder's own error, "invalid digit found in string", names none).
#[derive(Deserialize)]
pub struct SettingsForm {
    #[serde(default)]
    system_prompt: String,
    temperature: String,
    top_p: String,
    max_tokens: String,
    /// A checkbox: present ("on") when checked.
    thinking: Option<String>,
    /// GBNF; empty (or left out) removes it.
    #[serde(default)]
    grammar: String,
    /// Not in the page's form (admins' benchmarks); when a client sends it, it goes through the
    /// same check as on the JSON API (admins only).
    ignore_eos: Option<String>,
    /// Present when the form shows the tools (then a tool left unchecked is not offered).
    tools_shown: Option<String>,
    /// `auto`, `required` or a tool's name.
    #[serde(default)]
    tool_choice: String,
    /// Present when the form shows the collections (`kb:<id>` checkboxes).
    knowledge_shown: Option<String>,
    /// The tools' checkboxes, `tool:<name>` = `on` (one field a tool: the form decoder takes no
    /// repeated field).
    #[serde(flatten)]
    checked: std::collections::HashMap<String, String>,
}

/// A checkbox field: browsers send `on` when it is checked and nothing when it is not.
pub(super) fn checkbox(field: &str, value: Option<&str>) -> Result<bool, WebError> {
    match value {
        None => Ok(false),
        Some("on" | "true" | "1") => Ok(true),
        Some("off" | "false" | "0") => Ok(false),
        Some(other) => Err(WebError::BadRequest(format!(
            "`{field}`: {other:?} is not a checkbox value (on, or leave the field out)"
        ))),
    }
}

/// Parses one form field, naming it and what it must be when it is not that.
pub(super) fn form_number<T: std::str::FromStr>(
    field: &str,
    value: &str,
    what: &str,
) -> Result<T, WebError> {
    value
        .trim()
        .parse()
        .map_err(|_| WebError::BadRequest(format!("`{field}`: {value:?} is not {what}")))
}

/// `POST /c/{id}/settings`: the settings panel (used from the next message on).
pub async fn settings(
    state: web::Data<AppState>,
    action: OwnedForm<SettingsForm>,
) -> Result<HttpResponse, PageError> {
    let OwnedForm { caller, id, form } = action;
    let patch = SettingsPatch {
        // An empty prompt removes it.
        system_prompt: Some(form.system_prompt),
        max_tokens: Some(form_number(
            "max_tokens",
            &form.max_tokens,
            "a whole number",
        )?),
        temperature: Some(form_number("temperature", &form.temperature, "a number")?),
        top_p: Some(form_number("top_p", &form.top_p, "a number")?),
        thinking: Some(checkbox("thinking", form.thinking.as_deref())?),
        grammar: Some(form.grammar),
        ignore_eos: form
            .ignore_eos
            .as_deref()
            .map(|v| checkbox("ignore_eos", Some(v)))
            .transpose()?,
        tools: match form.tools_shown {
            Some(_) => {
                let mut chosen = Vec::new();
                for (field, value) in &form.checked {
                    if let Some(name) = field.strip_prefix("tool:") {
                        if checkbox(field, Some(value))? {
                            chosen.push(name.to_string());
                        }
                    }
                }
                chosen.sort();
                Some(chosen)
            }
            None => None,
        },
        tool_choice: form.tools_shown.as_ref().map(|_| form.tool_choice.clone()),
        knowledge: match form.knowledge_shown {
            Some(_) => {
                let mut chosen = Vec::new();
                for (field, value) in &form.checked {
                    if let Some(id) = field.strip_prefix("kb:") {
                        if checkbox(field, Some(value))? {
                            chosen.push(uuid::Uuid::parse_str(id).map_err(|_| {
                                WebError::BadRequest(format!(
                                    "`{field}`: {id:?} is not a collection id"
                                ))
                            })?);
                        }
                    }
                }
                chosen.sort();
                Some(chosen)
            }
            None => None,
        },
        ..SettingsPatch::default()
    };
    state
        .platform
        .conversations()
        .update(&caller, id, None, &patch)
        .await?;
    Ok(HttpResponse::Ok()
        .content_type("text/html; charset=utf-8")
        .body("<span class=\"saved\">Saved</span>"))
}

#[derive(Deserialize)]
pub struct ThinkingForm {
    thinking: Option<String>,
}

/// `POST /c/{id}/thinking`: the quick switch in the header.
pub async fn thinking(
    state: web::Data<AppState>,
    action: OwnedForm<ThinkingForm>,
) -> Result<HttpResponse, PageError> {
    let OwnedForm { caller, id, form } = action;
    let patch = SettingsPatch {
        thinking: Some(checkbox("thinking", form.thinking.as_deref())?),
        ..SettingsPatch::default()
    };
    state
        .platform
        .conversations()
        .update(&caller, id, None, &patch)
        .await?;
    Ok(HttpResponse::NoContent().finish())
}

#[derive(Deserialize)]
pub struct ModelForm {
    #[serde(default)]
    model: String,
}

/// `POST /c/{id}/model`: the picker in the header. The next reply comes from that model,
/// its prompt built with that model's template.
pub async fn model(
    state: web::Data<AppState>,
    action: OwnedForm<ModelForm>,
) -> Result<HttpResponse, PageError> {
    let OwnedForm { caller, id, form } = action;
    let patch = SettingsPatch {
        model: Some(form.model),
        ..SettingsPatch::default()
    };
    let service = state.platform.conversations();
    let updated = service.update(&caller, id, None, &patch).await?;
    let model = service.model_of(&updated.settings);
    // The page shows the thinking switch only for a model that can think.
    Ok(HttpResponse::Ok().json(serde_json::json!({
        "model": model,
        "can_think": service.can_think(&model),
    })))
}

/// `DELETE /c/{id}`
pub async fn delete(
    state: web::Data<AppState>,
    on: OnConversation<PageError>,
) -> Result<HttpResponse, PageError> {
    let OnConversation { caller, id, .. } = on;
    state.platform.conversations().delete(&caller, id).await?;
    Ok(hx_redirect(StatusCode::OK, "/"))
}

/// The conversation as a download.
pub(super) async fn export(
    state: &AppState,
    owner: &Owner,
    id: &str,
    format: ExportFormat,
) -> Result<HttpResponse, PageError> {
    let id = parse_id(id)?;
    let doc = state
        .platform
        .conversations()
        .export(&owner.caller(), id)
        .await?;
    Ok(export_response(&doc, format)?)
}

/// `GET /c/{id}/export.json`
pub async fn export_json(
    state: web::Data<AppState>,
    owner: Owner,
    path: web::Path<String>,
) -> Result<HttpResponse, PageError> {
    export(&state, &owner, &path, ExportFormat::Json).await
}

/// `GET /c/{id}/export.md`
pub async fn export_md(
    state: web::Data<AppState>,
    owner: Owner,
    path: web::Path<String>,
) -> Result<HttpResponse, PageError> {
    export(&state, &owner, &path, ExportFormat::Markdown).await
}
