//! Knowledge over HTTP (`/api/knowledge…`): collections, their documents and search. What is
//! allowed and how documents are read, cut and searched is `smolchat_service::knowledge`.
//!
//! | route | |
//! |---|---|
//! | `GET /api/knowledge` | `{"collections": [...]}` the caller may search |
//! | `POST /api/knowledge` `{"name", "description"?}` | 201, a new collection |
//! | `GET /api/knowledge/{id}` | `{"collection", "documents"}` (each document's indexing state) |
//! | `DELETE /api/knowledge/{id}` | 204: with its documents, passages and vectors |
//! | `PUT /api/knowledge/{id}/sharing` `{"everyone", "accounts"?}` | admins: who may search it |
//! | `POST /api/knowledge/{id}/documents?name=…` | 201: the file's bytes as the body, indexed in the background |
//! | `DELETE /api/knowledge/{id}/documents/{doc}` | 204 |
//! | `POST /api/knowledge/search` `{"collections", "query", "k"?, "mode"?}` | `{"passages": [...]}` best first |
//!
//! `GET /knowledge` is the page: the caller's collections and documents, each document's
//! indexing as it goes (`static/knowledge.js` calls the routes above).

use actix_web::middleware::from_fn;
use actix_web::{web, HttpRequest, HttpResponse};
use askama::Template;
use serde::Deserialize;
use serde_json::json;
use smolchat_service::knowledge::SearchMode;
use smolchat_service::Caller;
use uuid::Uuid;

use super::api::parse_uuid;
use super::error::{PageError, WebError};
use super::html::html;
use super::json::JsonBody;
use super::owner::Owner;
use super::AppState;

/// Registers `/ops/knowledge…`: the same routes for the command line (`smolchat knowledge`),
/// the admin token as the bearer; collections made there are the admin's (`admin`), and the
/// list is every collection.
pub fn ops_routes(cfg: &mut web::ServiceConfig) {
    use super::method_not_allowed;
    cfg.service(
        web::resource("/ops/knowledge")
            .route(web::get().to(ops_list))
            .route(web::post().to(ops_create))
            .default_service(web::to(method_not_allowed)),
    )
    .service(
        web::resource("/ops/knowledge/{id}")
            .route(web::get().to(ops_get))
            .default_service(web::to(method_not_allowed)),
    )
    .service(
        web::resource("/ops/knowledge/{id}/sharing")
            .route(web::put().to(ops_share))
            .default_service(web::to(method_not_allowed)),
    )
    .service(
        web::resource("/ops/knowledge/{id}/documents")
            .route(web::post().to(ops_add_document))
            .default_service(web::to(method_not_allowed)),
    )
    .service(
        web::resource("/ops/knowledge/{id}/documents/{doc}")
            .route(web::delete().to(ops_delete_document))
            .default_service(web::to(method_not_allowed)),
    );
}

fn ops(state: &AppState, req: &HttpRequest) -> Result<Caller, WebError> {
    super::admin::ops_caller(state, req)
}

async fn ops_list(state: web::Data<AppState>, req: HttpRequest) -> Result<HttpResponse, WebError> {
    let caller = ops(&state, &req)?;
    let knowledge = state.platform.knowledge();
    let mut out = Vec::new();
    for c in knowledge.all_collections(&caller).await? {
        let (c, documents) = knowledge.collection(&caller, c.id).await?;
        let mut v = serde_json::to_value(&c).unwrap_or_default();
        v["documents"] = serde_json::to_value(&documents).unwrap_or_default();
        out.push(v);
    }
    Ok(HttpResponse::Ok().json(json!({ "collections": out })))
}

async fn ops_create(
    state: web::Data<AppState>,
    req: HttpRequest,
    body: JsonBody<NewCollectionBody>,
) -> Result<HttpResponse, WebError> {
    create_for(&state, ops(&state, &req)?, body.0).await
}

async fn ops_get(
    state: web::Data<AppState>,
    req: HttpRequest,
    path: web::Path<String>,
) -> Result<HttpResponse, WebError> {
    get_for(&state, ops(&state, &req)?, &path).await
}

async fn ops_share(
    state: web::Data<AppState>,
    req: HttpRequest,
    path: web::Path<String>,
    body: JsonBody<SharingBody>,
) -> Result<HttpResponse, WebError> {
    share_for(&state, ops(&state, &req)?, &path, body.0).await
}

async fn ops_add_document(
    state: web::Data<AppState>,
    req: HttpRequest,
    path: web::Path<String>,
    payload: web::Payload,
) -> Result<HttpResponse, WebError> {
    let caller = ops(&state, &req)?;
    add_document_for(&state, caller, &path, &req, payload).await
}

async fn ops_delete_document(
    state: web::Data<AppState>,
    req: HttpRequest,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, WebError> {
    let caller = ops(&state, &req)?;
    let (id, doc) = path.into_inner();
    delete_document_for(&state, caller, &id, &doc).await
}

/// Registers the page (outside the `/api` scope).
pub fn page_routes(cfg: &mut web::ServiceConfig) {
    cfg.service(
        web::resource("/knowledge")
            .wrap(from_fn(super::csrf::require_token))
            .wrap(from_fn(super::owner::owner_cookie))
            .route(web::get().to(page))
            .default_service(web::to(super::method_not_allowed)),
    );
}

#[derive(Template)]
#[template(path = "knowledge.html")]
struct KnowledgePage {
    csrf: String,
    collections: Vec<CollectionView>,
}

struct CollectionView {
    id: String,
    name: String,
    /// "shared with everyone", "shared with you", … (empty: private).
    sharing: String,
    /// The caller may change it (its owner, or an admin).
    mine: bool,
    documents: Vec<DocumentView>,
}

struct DocumentView {
    id: String,
    name: String,
    status: &'static str,
    progress: String,
    size: String,
}

/// `GET /knowledge`
async fn page(state: web::Data<AppState>, owner: Owner) -> Result<HttpResponse, PageError> {
    use smolchat_service::records::DocumentStatus;
    let caller = owner.caller();
    let knowledge = state.platform.knowledge();
    let mut collections = Vec::new();
    for c in knowledge.collections(&caller).await? {
        let (c, docs) = knowledge.collection(&caller, c.id).await?;
        let mine = c.owner == caller.owner || caller.admin;
        collections.push(CollectionView {
            id: c.id.to_string(),
            sharing: if c.shared {
                "shared with everyone".into()
            } else if c.owner != caller.owner {
                "shared with you".into()
            } else if !c.shared_with.is_empty() {
                format!("shared with {} accounts", c.shared_with.len())
            } else {
                String::new()
            },
            name: c.name,
            mine,
            documents: docs
                .into_iter()
                .map(|d| DocumentView {
                    id: d.id.to_string(),
                    status: d.status.as_str(),
                    progress: match d.status {
                        DocumentStatus::Pending => "waiting".into(),
                        DocumentStatus::Indexing => {
                            format!("indexing: {} of {} passages", d.embedded, d.chunks)
                        }
                        DocumentStatus::Ready => format!("ready: {} passages", d.chunks),
                        DocumentStatus::Failed => {
                            format!("failed: {}", d.error.unwrap_or_default())
                        }
                    },
                    size: super::pages::human_size(d.size_bytes),
                    name: d.name,
                })
                .collect(),
        });
    }
    html(&KnowledgePage {
        csrf: super::csrf::token_for(&state.cookie_key, &owner.csrf_subject()),
        collections,
    })
}

/// Registers the routes inside the `/api` scope.
pub fn routes(cfg: &mut web::ServiceConfig) {
    use super::method_not_allowed;
    cfg.service(
        web::resource("/knowledge")
            .route(web::get().to(list))
            .route(web::post().to(create))
            .default_service(web::to(method_not_allowed)),
    )
    // Before `/knowledge/{id}`, which would take "search" for an id.
    .service(
        web::resource("/knowledge/search")
            .route(web::post().to(search))
            .default_service(web::to(method_not_allowed)),
    )
    .service(
        web::resource("/knowledge/{id}")
            .route(web::get().to(get))
            .route(web::delete().to(delete))
            .default_service(web::to(method_not_allowed)),
    )
    .service(
        web::resource("/knowledge/{id}/sharing")
            .route(web::put().to(share))
            .default_service(web::to(method_not_allowed)),
    )
    .service(
        web::resource("/knowledge/{id}/documents")
            .route(web::post().to(add_document))
            .default_service(web::to(method_not_allowed)),
    )
    .service(
        web::resource("/knowledge/{id}/documents/{doc}")
            .route(web::delete().to(delete_document))
            .default_service(web::to(method_not_allowed)),
    );
}

fn collection_id(raw: &str) -> Result<Uuid, WebError> {
    parse_uuid(raw, "collection id")
}

async fn list(state: web::Data<AppState>, owner: Owner) -> Result<HttpResponse, WebError> {
    let collections = state
        .platform
        .knowledge()
        .collections(&owner.caller())
        .await?;
    Ok(HttpResponse::Ok().json(json!({ "collections": collections })))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NewCollectionBody {
    name: String,
    #[serde(default)]
    description: String,
}

async fn create(
    state: web::Data<AppState>,
    owner: Owner,
    body: JsonBody<NewCollectionBody>,
) -> Result<HttpResponse, WebError> {
    create_for(&state, owner.caller(), body.0).await
}

async fn create_for(
    state: &AppState,
    caller: Caller,
    body: NewCollectionBody,
) -> Result<HttpResponse, WebError> {
    let c = state
        .platform
        .knowledge()
        .create_collection(&caller, &body.name, &body.description)
        .await?;
    Ok(HttpResponse::Created()
        .insert_header(("Location", format!("/api/knowledge/{}", c.id)))
        .json(c))
}

async fn get(
    state: web::Data<AppState>,
    owner: Owner,
    path: web::Path<String>,
) -> Result<HttpResponse, WebError> {
    get_for(&state, owner.caller(), &path).await
}

async fn get_for(state: &AppState, caller: Caller, id: &str) -> Result<HttpResponse, WebError> {
    let id = collection_id(id)?;
    let (collection, documents) = state.platform.knowledge().collection(&caller, id).await?;
    Ok(HttpResponse::Ok().json(json!({ "collection": collection, "documents": documents })))
}

async fn delete(
    state: web::Data<AppState>,
    owner: Owner,
    path: web::Path<String>,
) -> Result<HttpResponse, WebError> {
    let id = collection_id(&path)?;
    state
        .platform
        .knowledge()
        .delete_collection(&owner.caller(), id)
        .await?;
    Ok(HttpResponse::NoContent().finish())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SharingBody {
    everyone: bool,
    /// Account names.
    #[serde(default)]
    accounts: Vec<String>,
}

async fn share(
    state: web::Data<AppState>,
    owner: Owner,
    path: web::Path<String>,
    body: JsonBody<SharingBody>,
) -> Result<HttpResponse, WebError> {
    share_for(&state, owner.caller(), &path, body.0).await
}

async fn share_for(
    state: &AppState,
    caller: Caller,
    id: &str,
    body: SharingBody,
) -> Result<HttpResponse, WebError> {
    let id = collection_id(id)?;
    let c = state
        .platform
        .knowledge()
        .share(&caller, id, body.everyone, &body.accounts)
        .await?;
    Ok(HttpResponse::Ok().json(c))
}

async fn add_document(
    state: web::Data<AppState>,
    owner: Owner,
    path: web::Path<String>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, WebError> {
    add_document_for(&state, owner.caller(), &path, &req, payload).await
}

async fn add_document_for(
    state: &AppState,
    caller: Caller,
    id: &str,
    req: &HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, WebError> {
    let id = collection_id(id)?;
    let name = super::files::upload_name(req, "…/documents?name=handbook.pdf")?;
    let knowledge = state.platform.knowledge();
    // Whose it is before reading the body: another owner's id is 404 whatever is sent.
    knowledge.collection(&caller, id).await?;
    let limit = knowledge.max_document_bytes();
    let bytes = super::files::upload_body(
        req,
        payload,
        &name,
        limit,
        "a document",
        "knowledge.max_document_mib",
    )
    .await?;
    let doc = knowledge.add_document(&caller, id, &name, bytes).await?;
    Ok(HttpResponse::Created().json(doc))
}

async fn delete_document(
    state: web::Data<AppState>,
    owner: Owner,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, WebError> {
    let (id, doc) = path.into_inner();
    delete_document_for(&state, owner.caller(), &id, &doc).await
}

async fn delete_document_for(
    state: &AppState,
    caller: Caller,
    id: &str,
    doc: &str,
) -> Result<HttpResponse, WebError> {
    let id = collection_id(id)?;
    let doc = parse_uuid(doc, "document id")?;
    state
        .platform
        .knowledge()
        .delete_document(&caller, id, doc)
        .await?;
    Ok(HttpResponse::NoContent().finish())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SearchBody {
    collections: Vec<String>,
    query: String,
    k: Option<usize>,
    #[serde(default)]
    mode: SearchMode,
}

async fn search(
    state: web::Data<AppState>,
    owner: Owner,
    body: JsonBody<SearchBody>,
) -> Result<HttpResponse, WebError> {
    let b = body.0;
    let ids = b
        .collections
        .iter()
        .map(|c| collection_id(c))
        .collect::<Result<Vec<_>, _>>()?;
    let passages = state
        .platform
        .knowledge()
        .search(&owner.caller(), &ids, &b.query, b.k, b.mode)
        .await?;
    Ok(HttpResponse::Ok().json(json!({ "passages": passages })))
}
