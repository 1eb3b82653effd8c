//! Conversation affinity: a turn (send, regenerate, edit) that arrives at a replica which does not
//! own the conversation is forwarded, as the same HTTP request, to the replica that does (see
//! `actors::cluster`: rendezvous hashing of the conversation id over the live replicas). The
//! owner holds the conversation's KV cache, so the turn reuses it instead of recomputing the
//! whole conversation.
//!
//! Only turns move: everything else (pages, lists, event streams, stop, delete) is answered by
//! whichever replica receives it, from the shared database and the bus. A forwarded request
//! carries [`FORWARDED`] and is always answered where it lands, so a disagreement about who
//! owns what (a replica just joined or died) costs at most one hop, never a loop. When the owner
//! cannot be reached, the receiving replica answers the turn itself (cold cache, nothing lost).
//!
//! [`FORWARDED`] is believed only with a valid signature: an HMAC, under a key derived from
//! `server.cookie_secret` (the same on every replica), of the sending replica, the client's
//! address and scheme, the method, the request target and the time (60 s of clock skew
//! allowed). So an outside client cannot send it to force cold re-prefills, and the receiving
//! replica counts the request against the real client's address, not the forwarding replica's.
//! The request body is read under `limits.body_timeout_s`, as everywhere else.
//!
//! Replica-to-replica traffic is plain HTTP and carries the users' cookies: keep it on a private
//! network, or put TLS between replicas (`replica.url = "https://…"` behind a terminating proxy
//! on each replica).

use std::time::Duration;

use actix_web::body::{BoxBody, EitherBody, MessageBody};
use actix_web::dev::{Payload, ServiceRequest, ServiceResponse};
use actix_web::http::{header, Method, StatusCode};
use actix_web::middleware::Next;
use actix_web::web::{self, Bytes};
use actix_web::{HttpMessage, HttpResponse};
use futures_util::StreamExt;
use uuid::Uuid;

use super::client::{sign, Client, ForwardedHere, FORWARDED};
use super::AppState;
use actix_web::ResponseError;

/// A turn's body (a message up to `limits.max_message_chars`, as JSON or a form) is far below
/// this; a larger one is answered locally, where the usual limits refuse it.
const MAX_FORWARDED_BODY: usize = 4 << 20;
/// A forwarded turn answers once the message is stored and the reply queued: seconds at most.
const FORWARD_TIMEOUT: Duration = Duration::from_secs(30);
/// How long to wait for the owner's TCP connection before answering here instead.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// Headers that describe one connection, not the request (RFC 9110 §7.6.1), plus the ones the
/// client library sets itself.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
];

/// The HTTP client replicas forward with.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .connect_timeout(CONNECT_TIMEOUT)
        .timeout(FORWARD_TIMEOUT)
        // Responses are passed on as they are; a redirect belongs to the browser.
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap_or_else(|_| reqwest::Client::new())
}

/// The conversation whose turn this request is: POST to `/api/conversations/{id}/…` or
/// `/c/{id}/…` ending in `messages`, `regenerate`, `edit` or `draft`. `path` is the decoded path the
/// router matches (`req.match_info().as_str()`), so no spelling of it escapes routing.
pub fn turn_of(method: &Method, path: &str) -> Option<Uuid> {
    if method != Method::POST {
        return None;
    }
    let rest = path
        .strip_prefix("/api/conversations/")
        .or_else(|| path.strip_prefix("/c/"))?;
    let (id, action) = rest.split_once('/')?;
    // A draft warms the cache where the turn will run.
    if !matches!(action, "messages" | "regenerate" | "edit" | "draft") {
        return None;
    }
    Uuid::parse_str(id).ok()
}

pub async fn affinity(
    mut req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<EitherBody<impl MessageBody, BoxBody>>, actix_web::Error> {
    let target = turn_of(req.method(), req.match_info().as_str())
        .filter(|_| req.extensions().get::<ForwardedHere>().is_none())
        .and_then(|conversation| {
            let state = req.app_data::<web::Data<AppState>>()?;
            let cluster = &state.platform.cluster();
            let owner = cluster.route(conversation);
            (owner.id != cluster.me().id && !owner.url.is_empty())
                .then(|| (state.clone(), owner, conversation))
        });
    let Some((state, owner, conversation)) = target else {
        return next
            .call(req)
            .await
            .map(ServiceResponse::map_into_left_body);
    };

    let limit = req
        .app_data::<super::json::BodyTimeout>()
        .copied()
        .unwrap_or_default()
        .0;
    let body = match actix_web::rt::time::timeout(limit, read_body(req.take_payload())).await {
        Ok(Some(body)) => body,
        Ok(None) => {
            // Too large or broken: let the local handler refuse it with its usual message.
            return next
                .call(req)
                .await
                .map(ServiceResponse::map_into_left_body);
        }
        Err(_) => {
            let response = super::WebError::RequestTimeout(format!(
                "the request body did not arrive within {} s",
                limit.as_secs()
            ))
            .error_response();
            return Ok(req.into_response(response).map_into_right_body());
        }
    };
    let url = format!(
        "{}{}",
        owner.url,
        req.uri().path_and_query().map_or("/", |pq| pq.as_str())
    );
    // actix-web and reqwest use different majors of the `http` crate: convert through text.
    let method = reqwest::Method::from_bytes(req.method().as_str().as_bytes())
        .unwrap_or(reqwest::Method::POST);
    let target = req.uri().path_and_query().map_or("/", |pq| pq.as_str());
    let signature = sign(
        state.cookie_key.signing(),
        &state.platform.cluster().me().id.to_string(),
        &Client::of(req.request()),
        req.method().as_str(),
        target,
    );
    let mut forwarded = state
        .forward
        .request(method, &url)
        .header(FORWARDED, signature)
        .body(body.clone());
    for (name, value) in req.headers() {
        // Forwarding headers of the client's are not passed on: the signed header says who the
        // client is.
        let name_str = name.as_str();
        if !HOP_BY_HOP.contains(&name_str)
            && !matches!(
                name_str,
                FORWARDED | "x-forwarded-for" | "x-forwarded-proto" | "forwarded"
            )
        {
            forwarded = forwarded.header(name.as_str(), value.as_bytes());
        }
    }
    match forwarded.send().await {
        Ok(response) => {
            let status =
                StatusCode::from_u16(response.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
            let mut out = HttpResponse::build(status);
            for (name, value) in response.headers() {
                if !HOP_BY_HOP.contains(&name.as_str()) {
                    if let Ok(value) = header::HeaderValue::from_bytes(value.as_bytes()) {
                        out.append_header((name.as_str(), value));
                    }
                }
            }
            match response.bytes().await {
                Ok(bytes) => {
                    metrics::counter!("smolchat_forwarded_turns_total", "outcome" => "forwarded")
                        .increment(1);
                    tracing::debug!(%conversation, to = %owner.name, "turn forwarded to its replica");
                    let response = out.body(bytes);
                    Ok(req.into_response(response).map_into_right_body())
                }
                Err(e) => {
                    // The owner took the turn but its answer was lost: answering here would
                    // send the message twice, so say what happened instead.
                    tracing::warn!(%conversation, to = %owner.name, "forwarded turn's answer lost: {e}");
                    let response = HttpResponse::BadGateway()
                        .insert_header((header::RETRY_AFTER, "1"))
                        .json(serde_json::json!({"error": {
                            "message": "the server holding this conversation stopped answering while taking your message; reload to see whether it was saved",
                            "type": "unavailable",
                        }}));
                    Ok(req.into_response(response).map_into_right_body())
                }
            }
        }
        Err(e) => {
            // Not reachable (just died, not yet past its lease): answer here with a cold cache.
            metrics::counter!("smolchat_forwarded_turns_total", "outcome" => "fallback")
                .increment(1);
            tracing::warn!(%conversation, to = %owner.name, "cannot forward a turn ({e}); answering it here");
            req.set_payload(Payload::from(body));
            next.call(req)
                .await
                .map(ServiceResponse::map_into_left_body)
        }
    }
}

/// The whole request body, or `None` past [`MAX_FORWARDED_BODY`] or on a read error.
async fn read_body(mut payload: Payload) -> Option<Bytes> {
    let mut body = web::BytesMut::new();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.ok()?;
        if body.len() + chunk.len() > MAX_FORWARDED_BODY {
            return None;
        }
        body.extend_from_slice(&chunk);
    }
    Some(body.freeze())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_turns_are_routed() {
        let id = Uuid::now_v7();
        for path in [
            format!("/api/conversations/{id}/messages"),
            format!("/api/conversations/{id}/regenerate"),
            format!("/api/conversations/{id}/edit"),
            format!("/c/{id}/messages"),
            format!("/c/{id}/regenerate"),
            format!("/c/{id}/edit"),
            format!("/c/{id}/draft"),
            format!("/api/conversations/{id}/draft"),
        ] {
            assert_eq!(turn_of(&Method::POST, &path), Some(id), "{path}");
            assert_eq!(turn_of(&Method::GET, &path), None, "{path}");
        }
        for path in [
            format!("/api/conversations/{id}/stop"),
            format!("/api/conversations/{id}"),
            format!("/c/{id}/rename"),
            format!("/api/conversations/{id}/events"),
            "/api/conversations/not-a-uuid/messages".to_string(),
            "/api/conversations".to_string(),
            "/c".to_string(),
        ] {
            assert_eq!(turn_of(&Method::POST, &path), None, "{path}");
        }
    }
}
