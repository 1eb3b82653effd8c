//! Share links on the page: `GET /s/{token}` (the read-only snapshot, outside the owner-cookie
//! scopes), and making and revoking a conversation's links from its chat page.

use super::*;
use crate::api::OnConversation;

/// One message of a share page.
pub struct SharedMessageView {
    pub role: &'static str,
    /// A user message's text (escaped by the template).
    pub text: String,
    /// An assistant message's answer as sanitized HTML.
    pub html: String,
    pub reasoning: String,
}

#[derive(Template)]
#[template(path = "share.html")]
pub struct SharePage {
    pub title: String,
    pub shared_on: String,
    pub messages: Vec<SharedMessageView>,
}

/// `GET /s/{token}`: a share link's snapshot, read-only, for anyone holding the link (no
/// account, no cookie set). Never indexed, never sends the link on as a referrer; a token that
/// is not a live share is 404 like any other.
pub async fn shared(
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, PageError> {
    let token = path.into_inner();
    let shared = state
        .platform
        .conversations()
        .shared(&token)
        .await
        .map_err(|e| match e {
            ConversationError::NotFound => {
                WebError::NotFound("there is no such share link (it may have been revoked)".into())
            }
            other => other.into(),
        })?;
    let messages = web::block(move || {
        shared
            .messages
            .into_iter()
            .map(|m| {
                let assistant = m.role == Role::Assistant;
                SharedMessageView {
                    role: if assistant { "assistant" } else { "user" },
                    html: if assistant {
                        crate::tool_steps::answer_with_steps(&m.content, &m.tool_steps)
                    } else {
                        String::new()
                    },
                    text: m.content,
                    reasoning: m.reasoning.unwrap_or_default(),
                }
            })
            .collect::<Vec<_>>()
    })
    .await
    .map_err(|e| WebError::Internal(format!("rendering a share: {e}")))?;
    let page = SharePage {
        title: shared.title,
        shared_on: shared.created_at.format("%Y-%m-%d").to_string(),
        messages,
    };
    let mut res = html(&page)?;
    let headers = res.headers_mut();
    headers.insert(
        actix_web::http::header::HeaderName::from_static("x-robots-tag"),
        actix_web::http::header::HeaderValue::from_static("noindex, nofollow"),
    );
    headers.insert(
        actix_web::http::header::REFERRER_POLICY,
        actix_web::http::header::HeaderValue::from_static("no-referrer"),
    );
    headers.insert(
        actix_web::http::header::CACHE_CONTROL,
        actix_web::http::header::HeaderValue::from_static("no-store"),
    );
    Ok(res)
}

/// `POST /c/{id}/share`: a new share link of the branch shown, as JSON `{id, url}` for the
/// page's dialog (the token is shown this once).
pub async fn share(
    state: web::Data<AppState>,
    on: OnConversation<PageError>,
    req: HttpRequest,
) -> Result<HttpResponse, PageError> {
    let OnConversation { caller, id, .. } = on;
    let made = state.platform.conversations().share(&caller, id).await?;
    Ok(HttpResponse::Created().json(serde_json::json!({
        "id": made.share.id,
        "url": super::api::share_url(&state, &req, &made.token),
    })))
}

/// `POST /c/{id}/shares/{share}/revoke`
pub async fn revoke_share(
    state: web::Data<AppState>,
    owner: Owner,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, PageError> {
    let (id, share) = path.into_inner();
    let id = parse_id(&id)?;
    let share = api::parse_uuid(&share, "share id")?;
    state
        .platform
        .conversations()
        .revoke_share(&owner.caller(), id, share)
        .await?;
    Ok(HttpResponse::NoContent().finish())
}
