//! The live view of the engine, the replicas and every conversation (polled every 2 s), and the
//! actions on one conversation from its table.

use actix_web::{web, HttpRequest, HttpResponse};
use askama::Template;

use super::session::require_admin;
use super::PageQuery;
use crate::api::{page_request, parse_id};
use crate::error::PageError;
use crate::html::html;
use crate::owner::Owner;
use crate::AppState;
use smolchat_service::admin::LiveView as Live;
use smolchat_service::completions::{DeviceMemory, GraphStats, SequenceState, WarmStats};

pub struct EngineView {
    /// Where and on which path the model computes (`cpu · cpu`, `cuda:0 · fast`).
    pub device: String,
    pub tier: String,
    /// Why the tier is not the one asked for, if it is not.
    pub tier_note: String,
    pub queued: usize,
    pub queue_capacity: usize,
    pub running: usize,
    pub max_running: usize,
    pub tokens_per_s: String,
    pub kv_used: String,
    pub kv_budget: String,
    pub kv_percent: String,
    pub cached_sequences: usize,
    /// The KV spill tier (empty when off): percent of its budget, then what it holds.
    pub spill_percent: String,
    pub spill: String,
    /// Typed drafts warmed in spare steps: the headline and its detail ("off" when off).
    pub warm: (String, String),
    pub evictions: u64,
    pub generated_tokens: u64,
    /// The GPU's memory (empty off a GPU): percent used, then what holds it.
    pub gpu_used_percent: String,
    pub gpu_memory: String,
    /// How decode graphs have been used (empty without graphs).
    pub graphs: String,
    /// Speculative decoding: acceptance and tokens per verifying step (empty when nothing was
    /// drafted).
    pub speculation: String,
    pub speculation_sub: String,
}

pub struct AdminRow {
    pub id: String,
    pub owner: String,
    pub title: String,
    pub message_count: i64,
    pub last_activity: String,
    pub state: &'static str,
    pub kv: String,
    pub active: bool,
    /// The replica holding the conversation's KV cache ("—": none).
    pub replica: String,
    /// Speculative decoding: acceptance and tokens per verifying step ("—": no drafts).
    pub drafts: String,
}

/// One replica on the admin page.
pub struct ReplicaView {
    pub name: String,
    pub url: String,
    /// "live", "stopped" or "dead" (no heartbeat within the lease).
    pub state: &'static str,
    /// The replica serving this page.
    pub here: bool,
    pub heartbeat: String,
    pub queued: usize,
    pub running: usize,
    pub tokens_per_s: String,
    pub kv: String,
    pub streams: usize,
    pub held_count: usize,
}

pub struct LiveView {
    pub engine: EngineView,
    /// Every configured model (a table shown when there is more than one).
    pub models: Vec<super::ModelRowView>,
    /// The MCP servers (a section shown when there are any).
    pub mcp: Vec<super::McpServerView>,
    /// Every replica on the database, live or gone within the hour.
    pub replicas: Vec<ReplicaView>,
    pub rows: Vec<AdminRow>,
    pub updated: String,
    /// The cursor this page starts after ("" for the newest page); the poll keeps it.
    pub before: String,
    /// The next (older) page's cursor, "" on the last page.
    pub next: String,
}

/// Conversations per admin table page: the table (and each 2-second poll of it) stays small
/// however many conversations there are.
const ADMIN_PAGE: usize = 50;

#[derive(Template)]
#[template(path = "admin_live.html")]
struct LiveFragment {
    live: LiveView,
}

fn mib(bytes: usize) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

fn gib(bytes: usize) -> String {
    format!("{:.1} GiB", bytes as f64 / (1024.0 * 1024.0 * 1024.0))
}

/// The GPU memory tile's value and line: percent of the card in use, and what holds it.
fn gpu_memory_view(memory: Option<DeviceMemory>) -> (String, String) {
    let Some(m) = memory.filter(|m| m.total_bytes > 0) else {
        return (String::new(), String::new());
    };
    let used = m.total_bytes.saturating_sub(m.free_bytes);
    (
        format!("{:.0}", 100.0 * used as f64 / m.total_bytes as f64),
        format!(
            "weights {} · KV {} · free {} of {}",
            gib(m.weights_bytes),
            gib(m.kv_bytes),
            gib(m.free_bytes),
            gib(m.total_bytes)
        ),
    )
}

/// The "Warmed while typing" tile: prompt tokens of sent messages that drafts had computed,
/// then what drafts cost.
fn warm_view(w: WarmStats) -> (String, String) {
    if !w.enabled {
        return ("off".into(), "scheduler.warm_drafts = false".into());
    }
    let now = if w.warming {
        " · one being computed".to_string()
    } else {
        String::new()
    };
    (
        format!("{} tokens", w.reused_tokens),
        format!(
            "reused on send · {} drafts, {} tokens computed in spare steps · {} interrupted by replies · {} waiting{now}",
            w.started, w.tokens, w.interrupted, w.waiting
        ),
    )
}

fn graphs_view(graphs: Option<GraphStats>) -> String {
    graphs.map_or_else(String::new, |g| {
        format!(
            "{} replays · {} captures · {} invalidated",
            g.replays, g.captures, g.invalidated
        )
    })
}

pub(super) async fn live_view(state: &AppState, before: &str) -> Result<LiveView, PageError> {
    let page = page_request(Some(ADMIN_PAGE), Some(before))?;
    let live = state.platform.admin().live(&page).await?;
    let mut view = render_live(live, &page, state.platform.model());
    view.mcp = state
        .platform
        .conversations()
        .tool_servers()
        .iter()
        .map(super::McpServerView::of)
        .collect();
    Ok(view)
}

/// The operator's live view as the page shows it.
fn render_live(
    live: Live,
    page: &smolchat_service::records::PageRequest,
    model: &smolchat_service::platform::ModelInfo,
) -> LiveView {
    let now = chrono::Utc::now();
    let replicas = live
        .replicas
        .iter()
        .map(|r| ReplicaView {
            name: r.name.clone(),
            url: r.url.clone(),
            state: if r.live {
                "live"
            } else if r.stopped_at.is_some() {
                "stopped"
            } else {
                "dead"
            },
            here: r.id == live.this_replica,
            heartbeat: format!(
                "{:.0} s ago",
                (now - r.heartbeat_at).num_milliseconds().max(0) as f64 / 1e3
            ),
            queued: r.load.queued,
            running: r.load.running,
            tokens_per_s: format!("{:.1}", r.load.tokens_per_s),
            kv: format!(
                "{} of {}",
                mib(r.load.kv_bytes),
                mib(r.load.kv_budget_bytes)
            ),
            streams: r.load.streams,
            held_count: r.load.held_count,
        })
        .collect();
    let models = live.models.iter().map(super::ModelRowView::of).collect();
    let rows = live
        .conversations
        .into_iter()
        .map(|c| AdminRow {
            id: c.summary.id.to_string(),
            kv: c.kv_bytes.map(mib).unwrap_or_else(|| "—".into()),
            drafts: c.speculation.map_or_else(
                || "—".into(),
                |(drafted, accepted, steps)| {
                    format!(
                        "{:.0}% · {:.1} tok/step",
                        100.0 * accepted as f64 / drafted.max(1) as f64,
                        (accepted + steps) as f64 / steps.max(1) as f64
                    )
                },
            ),
            replica: c.replica.unwrap_or_else(|| "—".into()),
            // The account's name, or enough of a guest's id to tell guests apart.
            owner: c.owner_name.unwrap_or_else(|| {
                format!(
                    "guest {}",
                    c.summary.owner.chars().take(8).collect::<String>()
                )
            }),
            title: if c.summary.title.is_empty() {
                "(untitled)".into()
            } else {
                c.summary.title
            },
            message_count: c.summary.message_count,
            last_activity: c.summary.updated_at.format("%Y-%m-%d %H:%M:%S").to_string(),
            state: match c.state {
                SequenceState::Idle => "idle",
                SequenceState::Queued => "queued",
                SequenceState::Prefilling => "prefilling",
                SequenceState::Generating => "generating",
                SequenceState::Warming => "warming (typing)",
            },
            active: !matches!(c.state, SequenceState::Idle),
        })
        .collect();
    let stats = live.stats;
    let percent = if stats.kv_budget_bytes > 0 {
        100.0 * stats.kv_bytes as f64 / stats.kv_budget_bytes as f64
    } else {
        0.0
    };
    let (gpu_used_percent, gpu_memory) = gpu_memory_view(stats.device_memory);
    LiveView {
        models,
        mcp: Vec::new(),
        engine: EngineView {
            device: model.device.clone(),
            tier: model.tier.clone(),
            tier_note: model.tier_note.clone().unwrap_or_default(),
            queued: stats.queued,
            queue_capacity: stats.queue_capacity,
            running: stats.running,
            max_running: stats.max_running,
            tokens_per_s: format!("{:.1}", stats.tokens_per_s),
            kv_used: mib(stats.kv_bytes),
            kv_budget: mib(stats.kv_budget_bytes),
            kv_percent: format!("{percent:.0}"),
            cached_sequences: stats.cached_sequences,
            spill_percent: stats.spill.map_or_else(String::new, |t| {
                format!(
                    "{:.0}",
                    100.0 * t.bytes as f64 / t.budget_bytes.max(1) as f64
                )
            }),
            spill: stats.spill.map_or_else(String::new, |t| {
                let ram = if t.ram_bytes > 0 {
                    format!(" ({} in RAM)", mib(t.ram_bytes))
                } else {
                    String::new()
                };
                let mean = if t.restores > 0 {
                    format!(
                        " (mean {:.1} ms)",
                        t.restore_micros as f64 / 1e3 / t.restores as f64
                    )
                } else {
                    String::new()
                };
                format!(
                    "{} of {}{ram} · {} conversations · {} written, {} restored{mean}, {} not found, {} unusable",
                    mib(t.bytes as usize),
                    mib(t.budget_bytes as usize),
                    t.files,
                    t.writes,
                    t.restores,
                    t.misses,
                    t.rejected
                )
            }),
            warm: warm_view(stats.warm),
            evictions: stats.evictions,
            generated_tokens: stats.generated_tokens,
            gpu_used_percent,
            gpu_memory,
            graphs: graphs_view(stats.graphs),
            speculation: if stats.drafted_tokens > 0 {
                format!(
                    "{:.0}%",
                    100.0 * stats.accepted_draft_tokens as f64 / stats.drafted_tokens as f64
                )
            } else {
                String::new()
            },
            speculation_sub: if stats.verifying_steps > 0 {
                let mut sub = format!(
                    "accepted · {:.2} tokens per verifying step · {} drafted",
                    (stats.accepted_draft_tokens + stats.verifying_steps) as f64
                        / stats.verifying_steps as f64,
                    stats.drafted_tokens
                );
                if stats.step_position_ms > 0.0 {
                    // As the model worker measured them (`smolchat_serving::speculate::StepCost`).
                    let per = stats.step_position_ms;
                    sub.push_str(&format!(
                        " · a position costs {per:.2} ms of a {:.1} ms step (drafts pay above {:.0}% acceptance)",
                        stats.step_fixed_ms + per,
                        100.0 * stats.draft_break_even
                    ));
                }
                sub
            } else {
                String::new()
            },
        },
        replicas,
        rows,
        updated: now.format("%H:%M:%S UTC").to_string(),
        before: page.before.map(|c| c.encode()).unwrap_or_default(),
        next: live.next.map(|c| c.encode()).unwrap_or_default(),
    }
}

/// `GET /admin/live?before=`
pub async fn live(
    state: web::Data<AppState>,
    owner: Owner,
    req: HttpRequest,
    query: web::Query<PageQuery>,
) -> Result<HttpResponse, PageError> {
    require_admin(&state, &owner, &req).await?;
    html(&LiveFragment {
        live: live_view(&state, &query.before).await?,
    })
}

/// `POST /admin/c/{id}/stop`
pub async fn stop(
    state: web::Data<AppState>,
    owner: Owner,
    req: HttpRequest,
    path: web::Path<String>,
) -> Result<HttpResponse, PageError> {
    let by = require_admin(&state, &owner, &req).await?;
    let id = parse_id(&path)?;
    state.platform.admin().stop(&by, id).await?;
    Ok(HttpResponse::NoContent().finish())
}

/// `POST /admin/c/{id}/evict`
pub async fn evict(
    state: web::Data<AppState>,
    owner: Owner,
    req: HttpRequest,
    path: web::Path<String>,
) -> Result<HttpResponse, PageError> {
    let by = require_admin(&state, &owner, &req).await?;
    let id = parse_id(&path)?;
    state.platform.admin().evict(&by, id).await?;
    Ok(HttpResponse::NoContent().finish())
}

/// `DELETE /admin/c/{id}`
pub async fn delete(
    state: web::Data<AppState>,
    owner: Owner,
    req: HttpRequest,
    path: web::Path<String>,
) -> Result<HttpResponse, PageError> {
    let by = require_admin(&state, &owner, &req).await?;
    let id = parse_id(&path)?;
    state.platform.admin().delete(&by, id).await?;
    Ok(HttpResponse::NoContent().finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gpu_tiles_say_what_holds_the_memory_and_stay_empty_off_a_gpu() {
        assert_eq!(gpu_memory_view(None), (String::new(), String::new()));
        let gib = 1usize << 30;
        let (percent, line) = gpu_memory_view(Some(DeviceMemory {
            weights_bytes: 2 * gib,
            kv_bytes: 40 * gib,
            free_bytes: 20 * gib,
            total_bytes: 80 * gib,
        }));
        assert_eq!(percent, "75");
        assert_eq!(
            line,
            "weights 2.0 GiB · KV 40.0 GiB · free 20.0 GiB of 80.0 GiB"
        );
        assert_eq!(graphs_view(None), "");
        let g = GraphStats {
            warmups: 3,
            captures: 3,
            replays: 120,
            invalidated: 1,
        };
        assert_eq!(
            graphs_view(Some(g)),
            "120 replays · 3 captures · 1 invalidated"
        );
    }
}
