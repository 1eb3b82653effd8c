//! The store against real SQLite files and a real PostgreSQL server: every test opens a fresh
//! database (a file in its own temp dir, or a new PostgreSQL database). Tests in `both!` run
//! twice, as `name::sqlite` and `name::postgres`; the rest are about SQLite files (WAL, backup,
//! in-memory databases).

mod common;

use chrono::NaiveDate;
use std::time::Duration;

use smolchat_store::{
    backup, Attachments, ConversationSettings, FinishedReply, ImportedMessage, ListFilter,
    MessageStatus, OrganisationPatch, PageRequest, ReplicaLoad, Role, SessionKind, Store,
    StoreError, Timings, TITLE_MAX_CHARS,
};
use tempfile::TempDir;
use uuid::Uuid;

/// A temp dir (removed on drop) and the URL of a database file inside a not-yet-existing
/// subdirectory, so every test also checks that `open` creates it.
fn temp_db() -> (TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nested").join("smolchat.db");
    let url = format!("sqlite://{}", path.display());
    (dir, url)
}

async fn fresh_sqlite() -> (TempDir, String, Store) {
    let (dir, url) = temp_db();
    let store = Store::open(&url).await.unwrap();
    (dir, url, store)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Db {
    Sqlite,
    Postgres(&'static str),
}

/// A fresh store on `db`: (the temp dir of a SQLite file, the URL, the store).
async fn fresh(db: Db) -> (Option<TempDir>, String, Store) {
    match db {
        Db::Sqlite => {
            let (dir, url, store) = fresh_sqlite().await;
            (Some(dir), url, store)
        }
        Db::Postgres(url) => {
            let store = Store::open(url).await.unwrap();
            (None, url.to_string(), store)
        }
    }
}

/// Runs each test body on SQLite and on PostgreSQL (skipped, with the reason printed, when no
/// PostgreSQL server can be had; `make test` always has one).
macro_rules! both {
    ($(async fn $name:ident($db:ident) $body:block)*) => {
        $(
            mod $name {
                #[allow(unused_imports)]
                use super::*;

                async fn run($db: Db) $body

                #[tokio::test]
                async fn sqlite() {
                    run(Db::Sqlite).await
                }

                #[tokio::test]
                async fn postgres() {
                    if let Some(url) = common::pg::fresh_database().await {
                        run(Db::Postgres(Box::leak(url.into_boxed_str()))).await
                    }
                }
            }
        )*
    };
}

fn settings() -> ConversationSettings {
    ConversationSettings::default()
}

fn reply(status: MessageStatus) -> FinishedReply {
    FinishedReply {
        content: "The answer is 4.".into(),
        reasoning: Some("2 + 2 = 4".into()),
        raw: "<think>\n2 + 2 = 4\n</think>\nThe answer is 4.".into(),
        status,
        error: None,
        prompt_tokens: 42,
        completion_tokens: 17,
        cached_tokens: 30,
        timings: Timings {
            queue_ms: 1.5,
            prefill_ms: 20.25,
            ttft_ms: 22.0,
            generation_ms: 340.125,
            tokens_per_s: 50.0,
            drafted_tokens: 24,
            accepted_tokens: 15,
            restored_tokens: 12,
            warmed_tokens: 6,
            model: Some("smollm3-3b".into()),
        },
    }
}

both! {
async fn create_get_and_list_newest_first(db) {
    let (_dir, _url, store) = fresh(db).await;
    let a = store
        .create_conversation("alice", &settings())
        .await
        .unwrap();
    let b = store
        .create_conversation("alice", &settings())
        .await
        .unwrap();
    assert_eq!(a.owner, "alice");
    assert_eq!(a.title, "");
    assert!(a.updated_at >= a.created_at);
    assert_ne!(a.id, b.id);
    assert_eq!(a.id.get_version_num(), 7);

    let got = store.get_conversation(a.id).await.unwrap().unwrap();
    assert_eq!(got.id, a.id);
    assert_eq!(got.owner, "alice");
    assert_eq!(got.settings, a.settings);
    assert_eq!(got.created_at, a.created_at);

    let list = store.list_conversations("alice", None).await.unwrap();
    let ids: Vec<Uuid> = list.iter().map(|c| c.id).collect();
    assert_eq!(ids, vec![b.id, a.id], "newest first");

    // Activity in `a` moves it to the top.
    store.insert_user_message(a.id, "hello").await.unwrap();
    let list = store.list_conversations("alice", None).await.unwrap();
    assert_eq!(list[0].id, a.id);
    assert_eq!(list[0].message_count, 1);
    assert_eq!(list[1].message_count, 0);
    assert_eq!(list[0].title, "hello");
}
}

both! {
async fn owners_only_see_their_own_conversations(db) {
    let (_dir, _url, store) = fresh(db).await;
    let a = store
        .create_conversation("owner-a", &settings())
        .await
        .unwrap();
    let b = store
        .create_conversation("owner-b", &settings())
        .await
        .unwrap();

    let list_b = store.list_conversations("owner-b", None).await.unwrap();
    assert_eq!(list_b.len(), 1);
    assert_eq!(list_b[0].id, b.id);
    let list_a = store.list_conversations("owner-a", None).await.unwrap();
    assert_eq!(list_a.len(), 1);
    assert_eq!(list_a[0].id, a.id);
    assert!(store
        .list_conversations("nobody", None)
        .await
        .unwrap()
        .is_empty());

    let all = store.list_all_conversations().await.unwrap();
    let ids: Vec<Uuid> = all.iter().map(|c| c.id).collect();
    assert_eq!(ids, vec![b.id, a.id]);
    assert_eq!(all[0].owner, "owner-b");
}
}

both! {
async fn search_matches_title_and_message_content_ignoring_case(db) {
    let (_dir, _url, store) = fresh(db).await;
    let rust = store.create_conversation("u", &settings()).await.unwrap();
    store
        .rename_conversation(rust.id, "Learning Rust")
        .await
        .unwrap();
    let cooking = store.create_conversation("u", &settings()).await.unwrap();
    store
        .insert_user_message(cooking.id, "Dinner ideas")
        .await
        .unwrap();
    let a = store.start_assistant_message(cooking.id).await.unwrap();
    store
        .finish_assistant_message(
            a.id,
            &FinishedReply {
                content: "Try a Mushroom RISOTTO with 100% arborio_rice.".into(),
                ..reply(MessageStatus::Complete)
            },
        )
        .await
        .unwrap();
    // Another owner's matching conversation must never show up.
    let other = store.create_conversation("v", &settings()).await.unwrap();
    store
        .rename_conversation(other.id, "rust too")
        .await
        .unwrap();

    let ids = |v: Vec<smolchat_store::ConversationSummary>| -> Vec<Uuid> {
        v.into_iter().map(|c| c.id).collect()
    };
    assert_eq!(
        ids(store.list_conversations("u", Some("rUsT")).await.unwrap()),
        vec![rust.id]
    );
    assert_eq!(
        ids(store
            .list_conversations("u", Some("risotto"))
            .await
            .unwrap()),
        vec![cooking.id]
    );
    // `%` and `_` are literal characters, not LIKE wildcards.
    assert_eq!(
        ids(store.list_conversations("u", Some("100%")).await.unwrap()),
        vec![cooking.id]
    );
    assert!(store
        .list_conversations("u", Some("m_shroom"))
        .await
        .unwrap()
        .is_empty());
    assert!(store
        .list_conversations("u", Some("%"))
        .await
        .unwrap()
        .iter()
        .all(|c| c.id == cooking.id));
    assert!(store
        .list_conversations("u", Some("no such text"))
        .await
        .unwrap()
        .is_empty());
    // A blank search is no filter.
    assert_eq!(
        store
            .list_conversations("u", Some("  "))
            .await
            .unwrap()
            .len(),
        2
    );
}
}

both! {
async fn rename(db) {
    let (_dir, _url, store) = fresh(db).await;
    let c = store.create_conversation("u", &settings()).await.unwrap();
    assert!(store
        .rename_conversation(c.id, "Ünïcödé ✓ title")
        .await
        .unwrap());
    let got = store.get_conversation(c.id).await.unwrap().unwrap();
    assert_eq!(got.title, "Ünïcödé ✓ title");
    assert!(got.updated_at >= c.updated_at);
    // A renamed conversation keeps its title when the first message arrives.
    store
        .insert_user_message(c.id, "something else")
        .await
        .unwrap();
    let got = store.get_conversation(c.id).await.unwrap().unwrap();
    assert_eq!(got.title, "Ünïcödé ✓ title");
}
}

both! {
async fn settings_round_trip(db) {
    let (_dir, _url, store) = fresh(db).await;
    let defaults = ConversationSettings::default();
    assert!(defaults.thinking);
    assert_eq!(defaults.top_k, 40);
    assert_eq!(defaults.max_tokens, 1024);
    assert_eq!(defaults.pinned_date, chrono::Local::now().date_naive());

    let custom = ConversationSettings {
        knowledge: Vec::new(),
        system_prompt: Some("You are terse.\n/no_think".into()),
        thinking: false,
        temperature: 0.0,
        top_p: 0.5,
        top_k: 1,
        max_tokens: 77,
        seed: Some(u64::MAX),
        ignore_eos: true,
        grammar: Some("root ::= \"ok\"".into()),
        pinned_date: NaiveDate::from_ymd_opt(2024, 2, 29).unwrap(),
        model: Some("smollm2-q8".into()),
        tools: vec!["calculator".into(), "files__read_file".into()],
        tool_choice: Some("required".into()),
    };
    let c = store.create_conversation("u", &custom).await.unwrap();
    assert_eq!(c.settings, custom);
    assert_eq!(
        store
            .get_conversation(c.id)
            .await
            .unwrap()
            .unwrap()
            .settings,
        custom
    );

    let changed = ConversationSettings {
        seed: None,
        system_prompt: None,
        temperature: 1.25,
        ..custom.clone()
    };
    assert!(store.update_settings(c.id, &changed).await.unwrap());
    let got = store
        .get_conversation(c.id)
        .await
        .unwrap()
        .unwrap()
        .settings;
    assert_eq!(got, changed);
    assert_eq!(got.pinned_date, custom.pinned_date);

    // Values that could not be read back are refused, and nothing changes.
    let bad = ConversationSettings {
        temperature: f32::NAN,
        ..changed.clone()
    };
    assert!(matches!(
        store.update_settings(c.id, &bad).await,
        Err(StoreError::InvalidSettings(_))
    ));
    assert!(matches!(
        store.create_conversation("u", &bad).await,
        Err(StoreError::InvalidSettings(_))
    ));
    assert_eq!(
        store
            .get_conversation(c.id)
            .await
            .unwrap()
            .unwrap()
            .settings,
        changed
    );
}
}

both! {
async fn delete_cascades_to_messages(db) {
    let (_dir, _url, store) = fresh(db).await;
    let keep = store.create_conversation("u", &settings()).await.unwrap();
    let gone = store.create_conversation("u", &settings()).await.unwrap();
    store.insert_user_message(keep.id, "keep me").await.unwrap();
    let m1 = store.insert_user_message(gone.id, "one").await.unwrap();
    let m2 = store.start_assistant_message(gone.id).await.unwrap();

    assert!(store.delete_conversation(gone.id).await.unwrap());
    assert!(store.get_conversation(gone.id).await.unwrap().is_none());
    assert!(store.messages(gone.id).await.unwrap().is_empty());
    assert!(store.get_message(m1.id).await.unwrap().is_none());
    assert!(store.get_message(m2.id).await.unwrap().is_none());
    assert!(!store.delete_conversation(gone.id).await.unwrap());
    assert_eq!(store.messages(keep.id).await.unwrap().len(), 1);
    assert_eq!(store.list_conversations("u", None).await.unwrap().len(), 1);
}
}

both! {
async fn messages_come_back_in_order_with_their_statuses(db) {
    let (_dir, _url, store) = fresh(db).await;
    let c = store.create_conversation("u", &settings()).await.unwrap();
    let mut expected = Vec::new();
    for turn in 0..5 {
        let u = store
            .insert_user_message(c.id, &format!("question {turn}"))
            .await
            .unwrap();
        assert_eq!(u.role, Role::User);
        assert_eq!(u.status, MessageStatus::Complete);
        expected.push((u.id, Role::User, MessageStatus::Complete));
        let a = store.start_assistant_message(c.id).await.unwrap();
        let status = match turn {
            0 | 1 => MessageStatus::Complete,
            2 => MessageStatus::Stopped,
            3 => MessageStatus::Error,
            _ => MessageStatus::Streaming,
        };
        if status != MessageStatus::Streaming {
            store
                .finish_assistant_message(a.id, &reply(status))
                .await
                .unwrap();
        }
        expected.push((a.id, Role::Assistant, status));
    }
    let messages = store.messages(c.id).await.unwrap();
    let got: Vec<_> = messages.iter().map(|m| (m.id, m.role, m.status)).collect();
    assert_eq!(got, expected);
    let positions: Vec<i64> = messages.iter().map(|m| m.position).collect();
    assert_eq!(positions, (1..=10).collect::<Vec<_>>());
    assert!(messages.iter().all(|m| m.conversation_id == c.id));
    assert_eq!(messages[4].content, "question 2");
    let summary = &store.list_conversations("u", None).await.unwrap()[0];
    assert_eq!(summary.message_count, 10);
}
}

both! {
async fn title_is_derived_from_the_first_user_message(db) {
    let (_dir, _url, store) = fresh(db).await;

    let short = store.create_conversation("u", &settings()).await.unwrap();
    store
        .insert_user_message(short.id, "\n   What is NoPE?   \nIt is a thing in SmolLM3.")
        .await
        .unwrap();
    store
        .insert_user_message(short.id, "A second message does not rename")
        .await
        .unwrap();
    let got = store.get_conversation(short.id).await.unwrap().unwrap();
    assert_eq!(got.title, "What is NoPE?");

    let long = store.create_conversation("u", &settings()).await.unwrap();
    let text = format!(
        "{}\nsecond line",
        "Explain the attention mechanism ".repeat(10)
    );
    store.insert_user_message(long.id, &text).await.unwrap();
    let title = store
        .get_conversation(long.id)
        .await
        .unwrap()
        .unwrap()
        .title;
    assert!(title.ends_with('…'), "{title}");
    assert!(title.chars().count() <= TITLE_MAX_CHARS, "{title}");
    assert!(title.starts_with("Explain the attention mechanism Explain"));
    assert!(!title.contains('\n'));

    // Multibyte text without spaces: cut on a char boundary, never inside a code point.
    let cjk = store.create_conversation("u", &settings()).await.unwrap();
    let text = "🦀日本語のテキストをたくさん書きます".repeat(8);
    store.insert_user_message(cjk.id, &text).await.unwrap();
    let title = store.get_conversation(cjk.id).await.unwrap().unwrap().title;
    assert_eq!(title.chars().count(), TITLE_MAX_CHARS);
    assert!(title.ends_with('…'));
    let prefix: String = text.chars().take(TITLE_MAX_CHARS - 1).collect();
    assert_eq!(title, format!("{prefix}…"));

    // A message with no visible text leaves the title empty; the next one names it.
    let blank = store.create_conversation("u", &settings()).await.unwrap();
    store
        .insert_user_message(blank.id, " \n\t\n")
        .await
        .unwrap();
    assert_eq!(
        store
            .get_conversation(blank.id)
            .await
            .unwrap()
            .unwrap()
            .title,
        ""
    );
    store
        .insert_user_message(blank.id, "Real question")
        .await
        .unwrap();
    assert_eq!(
        store
            .get_conversation(blank.id)
            .await
            .unwrap()
            .unwrap()
            .title,
        "Real question"
    );
}
}

both! {
async fn assistant_message_start_and_finish_store_every_field(db) {
    let (_dir, _url, store) = fresh(db).await;
    let c = store.create_conversation("u", &settings()).await.unwrap();
    store.insert_user_message(c.id, "2 + 2?").await.unwrap();

    let started = store.start_assistant_message(c.id).await.unwrap();
    assert_eq!(started.role, Role::Assistant);
    assert_eq!(started.status, MessageStatus::Streaming);
    assert_eq!(started.content, "");
    assert_eq!(started.position, 2);
    assert!(started.reasoning.is_none() && started.raw.is_none() && started.timings.is_none());
    assert!(started.prompt_tokens.is_none());

    let r = reply(MessageStatus::Complete);
    let finished = store
        .finish_assistant_message(started.id, &r)
        .await
        .unwrap();
    let stored = store.get_message(started.id).await.unwrap().unwrap();
    for m in [&finished, &stored] {
        assert_eq!(m.id, started.id);
        assert_eq!(m.position, 2);
        assert_eq!(m.status, MessageStatus::Complete);
        assert_eq!(m.content, r.content);
        assert_eq!(m.reasoning, r.reasoning);
        assert_eq!(m.raw.as_deref(), Some(r.raw.as_str()));
        assert_eq!(m.error, None);
        assert_eq!(m.prompt_tokens, Some(42));
        assert_eq!(m.completion_tokens, Some(17));
        assert_eq!(m.cached_tokens, Some(30));
        assert_eq!(m.timings.as_ref(), Some(&r.timings));
        assert_eq!(m.created_at, started.created_at);
    }

    // An error reply keeps its partial text and the error.
    let second = store.start_assistant_message(c.id).await.unwrap();
    let err = FinishedReply {
        content: "partial".into(),
        reasoning: None,
        raw: "partial".into(),
        status: MessageStatus::Error,
        error: Some("model failed: out of memory".into()),
        timings: Timings {
            tokens_per_s: f64::NAN,
            ..Timings::default()
        },
        ..reply(MessageStatus::Error)
    };
    let m = store
        .finish_assistant_message(second.id, &err)
        .await
        .unwrap();
    assert_eq!(m.status, MessageStatus::Error);
    assert_eq!(m.content, "partial");
    assert_eq!(m.reasoning, None);
    assert_eq!(m.error.as_deref(), Some("model failed: out of memory"));
    // NaN cannot be stored as JSON; it is kept as 0 so the row stays readable.
    assert_eq!(m.timings.unwrap().tokens_per_s, 0.0);

    // `streaming` is not a final state; user messages and unknown ids are not replies.
    assert!(matches!(
        store
            .finish_assistant_message(second.id, &reply(MessageStatus::Streaming))
            .await,
        Err(StoreError::InvalidStatus(_))
    ));
    let user = store.insert_user_message(c.id, "next").await.unwrap();
    assert!(matches!(
        store
            .finish_assistant_message(user.id, &reply(MessageStatus::Complete))
            .await,
        Err(StoreError::MessageNotFound(_))
    ));
    assert_eq!(
        store.get_message(user.id).await.unwrap().unwrap().content,
        "next"
    );
}
}

both! {
async fn regenerate_and_edit_keep_versions_and_the_branch_shown_is_a_path(db) {
    let (_dir, _url, store) = fresh(db).await;
    let c = store.create_conversation("u", &settings()).await.unwrap();
    let other = store.create_conversation("u", &settings()).await.unwrap();
    let (elsewhere, _) = store.insert_exchange(other.id, "elsewhere", None, &Attachments::default()).await.unwrap();
    let done = |id| {
        let store = store.clone();
        async move {
            store
                .finish_assistant_message(id, &reply(MessageStatus::Complete))
                .await
                .unwrap();
        }
    };
    let ids = |ms: Vec<smolchat_store::Message>| ms.iter().map(|m| m.id).collect::<Vec<_>>();
    let (u1, a1) = store.insert_exchange(c.id, "q1", None, &Attachments::default()).await.unwrap();
    done(a1.id).await;
    let (u2, a2) = store.insert_exchange(c.id, "q2", None, &Attachments::default()).await.unwrap();
    done(a2.id).await;
    assert_eq!(a2.parent_id, Some(u2.id));
    assert_eq!(u2.parent_id, Some(a1.id));
    assert_eq!(u1.parent_id, None);

    // Regenerate: a second reply to q2 beside the first, shown.
    let a2b = store.insert_reply(c.id, u2.id).await.unwrap();
    assert_eq!(a2b.parent_id, Some(u2.id));
    done(a2b.id).await;
    assert_eq!(ids(store.branch(c.id).await.unwrap()), [u1.id, a1.id, u2.id, a2b.id]);
    assert_eq!(store.messages(c.id).await.unwrap().len(), 5, "nothing is deleted");

    // Back to the first reply.
    assert_eq!(store.select_branch(c.id, a2.id).await.unwrap(), a2.id);
    assert_eq!(ids(store.branch(c.id).await.unwrap()), [u1.id, a1.id, u2.id, a2.id]);
    // Continuing goes on from the branch shown.
    let (u3, a3) = store.insert_exchange(c.id, "q3", None, &Attachments::default()).await.unwrap();
    done(a3.id).await;
    assert_eq!(u3.parent_id, Some(a2.id));

    // Edit the first question: a new branch from the root.
    let (u1b, a1b) = store.insert_exchange(c.id, "q1, edited", Some(u1.id), &Attachments::default()).await.unwrap();
    done(a1b.id).await;
    assert_eq!(u1b.parent_id, None);
    assert_eq!(ids(store.branch(c.id).await.unwrap()), [u1b.id, a1b.id]);
    // Back to the original: where it was last continued (after a2, not the newer a2b).
    let leaf = store.select_branch(c.id, u1.id).await.unwrap();
    assert_eq!(leaf, a3.id);
    assert_eq!(
        ids(store.branch(c.id).await.unwrap()),
        [u1.id, a1.id, u2.id, a2.id, u3.id, a3.id]
    );
    assert_eq!(store.select_branch(c.id, a2b.id).await.unwrap(), a2b.id);
    assert_eq!(store.messages(c.id).await.unwrap().len(), 9);

    // Not a user message, another conversation's, unknown: refused, nothing written.
    for bad in [a1.id, elsewhere.id, Uuid::now_v7()] {
        assert!(matches!(
            store.insert_reply(c.id, bad).await,
            Err(StoreError::MessageNotFound(_))
        ));
    }
    assert!(matches!(
        store.select_branch(c.id, elsewhere.id).await,
        Err(StoreError::MessageNotFound(_))
    ));
    assert_eq!(store.messages(c.id).await.unwrap().len(), 9);
    assert_eq!(store.branch(c.id).await.unwrap().last().map(|m| m.id), Some(a2b.id));
}
}

both! {
async fn reopening_the_file_finds_everything(db) {
    let (_dir, url, store) = fresh(db).await;
    let custom = ConversationSettings {
        seed: Some(7),
        pinned_date: NaiveDate::from_ymd_opt(2025, 1, 31).unwrap(),
        ..settings()
    };
    let c = store.create_conversation("persist", &custom).await.unwrap();
    let u = store
        .insert_user_message(c.id, "remember me")
        .await
        .unwrap();
    let a = store.start_assistant_message(c.id).await.unwrap();
    store
        .finish_assistant_message(a.id, &reply(MessageStatus::Stopped))
        .await
        .unwrap();
    let before = store.messages(c.id).await.unwrap();
    store.close().await;

    let store = Store::open(&url).await.unwrap();
    assert_eq!(store.interrupted_on_open(), 0);
    let got = store.get_conversation(c.id).await.unwrap().unwrap();
    assert_eq!(got.title, "remember me");
    assert_eq!(got.settings, custom);
    assert_eq!(got.created_at, c.created_at);
    let after = store.messages(c.id).await.unwrap();
    assert_eq!(after.len(), 2);
    assert_eq!(after[0].id, u.id);
    assert_eq!(after[1].id, a.id);
    assert_eq!(after[1].status, MessageStatus::Stopped);
    assert_eq!(after[1].timings, before[1].timings);
    assert_eq!(after[1].raw, before[1].raw);
    assert_eq!(
        store
            .list_conversations("persist", None)
            .await
            .unwrap()
            .len(),
        1
    );
    store.close().await;
}
}

#[tokio::test]
async fn streaming_replies_become_interrupted_after_a_crash() {
    let (_dir, url, store) = fresh_sqlite().await;
    let c = store.create_conversation("u", &settings()).await.unwrap();
    store
        .insert_user_message(c.id, "tell me a story")
        .await
        .unwrap();
    let done = store.start_assistant_message(c.id).await.unwrap();
    store
        .finish_assistant_message(done.id, &reply(MessageStatus::Complete))
        .await
        .unwrap();
    store.insert_user_message(c.id, "another").await.unwrap();
    let cut = store.start_assistant_message(c.id).await.unwrap();
    // The "crash": the store goes away without finishing the reply or closing.
    drop(store);

    let store = Store::open(&url).await.unwrap();
    assert_eq!(store.interrupted_on_open(), 1);
    let m = store.get_message(cut.id).await.unwrap().unwrap();
    assert_eq!(m.status, MessageStatus::Interrupted);
    assert!(m.error.is_some());
    let untouched = store.get_message(done.id).await.unwrap().unwrap();
    assert_eq!(untouched.status, MessageStatus::Complete);
    assert_eq!(untouched.error, None);
    drop(store);

    // Recovery happens once: the next start finds nothing to do.
    let store = Store::open(&url).await.unwrap();
    assert_eq!(store.interrupted_on_open(), 0);
    store.close().await;
}

#[tokio::test]
async fn journal_mode_is_wal_and_integrity_is_ok() {
    let (dir, _url, store) = fresh_sqlite().await;
    assert_eq!(store.journal_mode().await.unwrap(), "wal");
    let c = store.create_conversation("u", &settings()).await.unwrap();
    store.insert_user_message(c.id, "hi").await.unwrap();
    assert!(dir.path().join("nested").join("smolchat.db-wal").exists());
    assert_eq!(store.integrity_check().await.unwrap(), "ok");
    store.close().await;
}

#[tokio::test]
async fn in_memory_databases_work() {
    let store = Store::open("sqlite::memory:").await.unwrap();
    let c = store.create_conversation("u", &settings()).await.unwrap();
    store.insert_user_message(c.id, "in memory").await.unwrap();
    // A clone shares the same (single) connection and so the same database.
    let clone = store.clone();
    assert_eq!(clone.messages(c.id).await.unwrap().len(), 1);
    assert_eq!(store.integrity_check().await.unwrap(), "ok");
}

/// A write to an unknown conversation is refused without losing anything: an in-memory database
/// lives in its single connection, which must survive the refused transaction.
#[tokio::test]
async fn a_refused_write_keeps_an_in_memory_database() {
    let store = Store::open("sqlite::memory:").await.unwrap();
    let c = store.create_conversation("u", &settings()).await.unwrap();
    store.insert_user_message(c.id, "kept").await.unwrap();
    assert!(matches!(
        store.insert_user_message(Uuid::now_v7(), "lost").await,
        Err(StoreError::ConversationNotFound(_))
    ));
    assert!(matches!(
        store.start_assistant_message(Uuid::now_v7()).await,
        Err(StoreError::ConversationNotFound(_))
    ));
    assert!(matches!(
        store
            .finish_assistant_message(Uuid::now_v7(), &reply(MessageStatus::Complete))
            .await,
        Err(StoreError::MessageNotFound(_))
    ));
    let messages = store.messages(c.id).await.unwrap();
    assert_eq!(messages.len(), 1);
    assert_eq!(messages[0].content, "kept");
}

both! {
async fn unknown_ids_are_not_errors(db) {
    let (_dir, _url, store) = fresh(db).await;
    let nobody = Uuid::now_v7();
    assert!(store.get_conversation(nobody).await.unwrap().is_none());
    assert!(store.get_message(nobody).await.unwrap().is_none());
    assert!(!store.rename_conversation(nobody, "x").await.unwrap());
    assert!(!store.update_settings(nobody, &settings()).await.unwrap());
    assert!(!store.delete_conversation(nobody).await.unwrap());
    assert!(store.messages(nobody).await.unwrap().is_empty());
    assert!(store.branch(nobody).await.unwrap().is_empty());
    // Writes into a conversation that does not exist are reported, and write nothing.
    assert!(matches!(
        store.insert_user_message(nobody, "hi").await,
        Err(StoreError::ConversationNotFound(id)) if id == nobody
    ));
    assert!(matches!(
        store.start_assistant_message(nobody).await,
        Err(StoreError::ConversationNotFound(id)) if id == nobody
    ));
    assert!(matches!(
        store
            .finish_assistant_message(nobody, &reply(MessageStatus::Complete))
            .await,
        Err(StoreError::MessageNotFound(id)) if id == nobody
    ));
    assert!(store.list_all_conversations().await.unwrap().is_empty());
}
}

both! {
async fn sql_looking_input_is_stored_verbatim(db) {
    let (_dir, _url, store) = fresh(db).await;
    let evil = "'; DROP TABLE messages; --";
    let owner = "x' OR '1'='1";
    let c = store.create_conversation(owner, &settings()).await.unwrap();
    let m = store.insert_user_message(c.id, evil).await.unwrap();
    assert_eq!(m.content, evil);
    assert!(store.rename_conversation(c.id, evil).await.unwrap());
    let s = ConversationSettings {
        system_prompt: Some(format!("{evil} \"quoted\" \\ {{json}}")),
        ..settings()
    };
    assert!(store.update_settings(c.id, &s).await.unwrap());

    let got = store.get_conversation(c.id).await.unwrap().unwrap();
    assert_eq!(got.owner, owner);
    assert_eq!(got.title, evil);
    assert_eq!(got.settings, s);
    assert_eq!(store.messages(c.id).await.unwrap()[0].content, evil);
    // The owner string is a value, not a predicate: another owner sees nothing.
    assert!(store
        .list_conversations("x", None)
        .await
        .unwrap()
        .is_empty());
    assert_eq!(
        store
            .list_conversations(owner, Some(evil))
            .await
            .unwrap()
            .len(),
        1
    );
    assert_eq!(store.integrity_check().await.unwrap(), "ok");
}
}

both! {
async fn concurrent_writers_keep_positions_unique(db) {
    let (_dir, _url, store) = fresh(db).await;
    let c = store.create_conversation("u", &settings()).await.unwrap();
    let tasks: Vec<_> = (0..16)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                store
                    .insert_user_message(c.id, &format!("m{i}"))
                    .await
                    .unwrap()
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let positions: Vec<i64> = store
        .messages(c.id)
        .await
        .unwrap()
        .iter()
        .map(|m| m.position)
        .collect();
    assert_eq!(positions, (1..=16).collect::<Vec<_>>());
}
}

#[tokio::test]
async fn bad_urls_and_unwritable_paths_are_errors() {
    assert!(matches!(
        Store::open("mysql://localhost/x").await,
        Err(StoreError::Url { .. })
    ));
    // Nothing listens on port 1: a clear "cannot open", with the password kept out of it.
    let refused = Store::open("postgres://smol:hunter2@127.0.0.1:1/x").await;
    match refused {
        Err(e @ StoreError::Open { .. }) => {
            let text = e.to_string();
            assert!(!text.contains("hunter2"), "{text}");
            assert!(text.contains("cannot open the database"), "{text}");
        }
        other => panic!("expected an open error, got {other:?}"),
    }
    assert!(matches!(
        Store::open("sqlite://x.db?mode=bogus").await,
        Err(StoreError::Url { .. })
    ));
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"not a directory").unwrap();
    let url = format!("sqlite://{}/db.sqlite", file.display());
    assert!(Store::open(&url).await.is_err());
    // A file that is not a database is reported, not a panic.
    let junk = dir.path().join("junk.db");
    std::fs::write(&junk, vec![0x42u8; 8192]).unwrap();
    assert!(Store::open(&format!("sqlite://{}", junk.display()))
        .await
        .is_err());
}

/// A backup taken while a writer keeps inserting holds a consistent snapshot: every message the
/// writer had committed before the backup started, a streaming reply still `streaming` (the live
/// server's business, not the copy's), and it opens as a store with the same rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backup_of_a_live_database_restores_the_same_rows() {
    let (dir, url, store) = fresh_sqlite().await;
    let c = store.create_conversation("u", &settings()).await.unwrap();
    for i in 0..20 {
        store
            .insert_user_message(c.id, &format!("before {i}"))
            .await
            .unwrap();
    }
    let streaming = store.start_assistant_message(c.id).await.unwrap();
    // A writer that keeps going while the backup runs.
    let writer = {
        let store = store.clone();
        tokio::spawn(async move {
            for i in 0..200 {
                store
                    .insert_user_message(c.id, &format!("during {i}"))
                    .await
                    .unwrap();
            }
        })
    };
    let dest = dir.path().join("backup.db");
    let report = backup(&url, &dest).await.unwrap();
    writer.await.unwrap();
    assert!(report.bytes > 0);
    assert_eq!(report.conversations, 1);
    // The 20 messages before, the streaming reply, and whatever prefix of the writer's
    // messages had committed: positions have no gaps.
    assert!(
        report.messages >= 21 && report.messages <= 221,
        "{report:?}"
    );

    // The live database was not touched: its reply is still streaming.
    assert_eq!(
        store
            .get_message(streaming.id)
            .await
            .unwrap()
            .unwrap()
            .status,
        MessageStatus::Streaming
    );
    let live = store.messages(c.id).await.unwrap();
    store.close().await;

    let restored_url = format!("sqlite://{}", dest.display());
    let restored = Store::open(&restored_url).await.unwrap();
    assert_eq!(restored.integrity_check().await.unwrap(), "ok");
    let copied = restored.messages(c.id).await.unwrap();
    assert_eq!(copied.len() as i64, report.messages);
    // The copy is a prefix of the live conversation, row for row.
    for (a, b) in copied.iter().zip(&live) {
        assert_eq!(
            (a.id, a.position, &a.content),
            (b.id, b.position, &b.content)
        );
    }
    let positions: Vec<i64> = copied.iter().map(|m| m.position).collect();
    assert_eq!(positions, (1..=copied.len() as i64).collect::<Vec<_>>());
    // Opening the copy as a server would marks its streaming reply interrupted, as after a crash.
    assert_eq!(restored.interrupted_on_open(), 1);
    restored.close().await;
}

#[tokio::test]
async fn backup_refuses_what_it_cannot_do_clearly() {
    let (dir, url, store) = fresh_sqlite().await;
    store.close().await;
    let existing = dir.path().join("exists.db");
    std::fs::write(&existing, b"x").unwrap();
    let err = backup(&url, &existing).await.unwrap_err().to_string();
    assert!(err.contains("already exists"), "{err}");
    assert_eq!(std::fs::read(&existing).unwrap(), b"x", "never overwritten");

    let err = backup(&url, &dir.path().join("no/such/dir/b.db"))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("folder does not exist"), "{err}");

    let err = backup("sqlite::memory:", &dir.path().join("m.db"))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("only a sqlite: database file or a postgres:// database"),
        "{err}"
    );

    let missing = format!("sqlite://{}", dir.path().join("missing.db").display());
    let err = backup(&missing, &dir.path().join("b.db"))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("does not exist"), "{err}");
    assert!(
        !dir.path().join("missing.db").exists(),
        "no database was created"
    );
}

/// Fills a database with what a backup must keep: an account with an API key, a conversation
/// with an exchange (its reply finished), a folder and a file; returns the conversation.
async fn something_to_back_up(store: &Store) -> Uuid {
    use smolchat_store::{NewFile, NewUser, UserRole};
    let hash = "$argon2id$v=19$m=19456,t=2,p=1$c2FsdHNhbHRzYWx0$aGFzaGhhc2hoYXNoaGFzaGhhc2hoYXNoaGFzaGhhc2g";
    store
        .create_user(&NewUser {
            id: "u-backup",
            name: "backup-person",
            password_hash: hash,
            role: UserRole::Admin,
            invite: None,
            adopt_from: None,
        })
        .await
        .unwrap();
    store
        .create_api_key(&"k".repeat(64), "u-backup", "laptop", "sk-smol-abcd")
        .await
        .unwrap();
    let c = store
        .create_conversation("u-backup", &settings())
        .await
        .unwrap();
    let file = store
        .create_file(
            c.id,
            "u-backup",
            &NewFile {
                name: "notes.md",
                kind: "markdown",
                media_type: "text/markdown",
                size_bytes: 7,
                text: "# notes",
                tokens: 9,
            },
        )
        .await
        .unwrap();
    let (_, reply) = store
        .insert_exchange(
            c.id,
            "hello",
            None,
            &Attachments {
                raw: Some(
                    "<file name=\"notes.md\" type=\"markdown\">\n# notes\n</file>\n\nhello".into(),
                ),
                pending: vec![file.id],
                keep_from: None,
            },
        )
        .await
        .unwrap();
    store
        .finish_assistant_message(reply.id, &reply_with("hi there"))
        .await
        .unwrap();
    store.create_folder("u-backup", "Work").await.unwrap();
    c.id
}

fn reply_with(text: &str) -> FinishedReply {
    FinishedReply {
        content: text.into(),
        ..reply(MessageStatus::Complete)
    }
}

/// Everything a restored copy must hold the same as the original.
async fn snapshot(store: &Store, conversation: Uuid) -> serde_json::Value {
    let user = store.user_by_name("backup-person").await.unwrap().unwrap();
    serde_json::json!({
        "user": [user.id, user.name, format!("{:?}", user.role)],
        "keys": format!("{:?}", store.list_api_keys("u-backup").await.unwrap()),
        "conversation": store.get_conversation(conversation).await.unwrap(),
        "messages": store.messages(conversation).await.unwrap(),
        "files": store.files_of(conversation).await.unwrap().iter().map(|f| (&f.name, &f.text, f.message_id)).collect::<Vec<_>>(),
        "folders": store.folders("u-backup").await.unwrap().iter().map(|f| f.name.clone()).collect::<Vec<_>>(),
    })
}

#[tokio::test]
async fn postgres_backup_and_restore_round_trip_users_keys_and_conversations() {
    let Some(url) = common::pg::fresh_database().await else {
        return;
    };
    let store = Store::open(&url).await.unwrap();
    let id = something_to_back_up(&store).await;
    let before = snapshot(&store, id).await;
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("smolchat.dump");
    // While the database is open and in use.
    let report = backup(&url, &dump).await.unwrap();
    assert_eq!((report.conversations, report.messages), (1, 2));
    assert!(report.bytes > 0);
    let err = backup(&url, &dump).await.unwrap_err().to_string();
    assert!(err.contains("already exists"), "{err}");
    store.close().await;

    let Some(target) = common::pg::fresh_database().await else {
        return;
    };
    let restored = smolchat_store::restore(&dump, &target).await.unwrap();
    assert_eq!((restored.conversations, restored.messages), (1, 2));
    let copy = Store::open(&target).await.unwrap();
    assert_eq!(snapshot(&copy, id).await, before);
    // A database that is not empty is refused, saying why.
    let err = smolchat_store::restore(&dump, &target)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("already has"), "{err}");
    copy.close().await;
}

#[tokio::test]
async fn sqlite_backup_and_restore_round_trip() {
    let (dir, url, store) = fresh_sqlite().await;
    let id = something_to_back_up(&store).await;
    let before = snapshot(&store, id).await;
    let copy_path = dir.path().join("backup.db");
    backup(&url, &copy_path).await.unwrap();
    store.close().await;
    let target = format!(
        "sqlite://{}",
        dir.path().join("restored/smolchat.db").display()
    );
    let restored = smolchat_store::restore(&copy_path, &target).await.unwrap();
    assert_eq!((restored.conversations, restored.messages), (1, 2));
    let copy = Store::open(&target).await.unwrap();
    assert_eq!(snapshot(&copy, id).await, before);
    copy.close().await;
    let err = smolchat_store::restore(&copy_path, &target)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("already exists"), "{err}");
    let junk = dir.path().join("junk.db");
    std::fs::write(&junk, b"not a database at all").unwrap();
    let err = smolchat_store::restore(
        &junk,
        &format!("sqlite://{}", dir.path().join("x.db").display()),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("not a SQLite database") || err.contains("integrity"),
        "{err}"
    );
}

// One exchange is one transaction; replacing the last exchange either happens whole or not at
// all (an unknown or non-user message to replace changes nothing).
both! {
async fn insert_exchange_replaces_atomically(db) {
    let (_dir, _url, store) = fresh(db).await;
    let c = store.create_conversation("u", &settings()).await.unwrap();
    let (u1, a1) = store.insert_exchange(c.id, "first", None, &Attachments::default()).await.unwrap();
    assert_eq!((u1.position, a1.position), (1, 2));
    assert_eq!(a1.status, MessageStatus::Streaming);
    store
        .finish_assistant_message(a1.id, &reply(MessageStatus::Complete))
        .await
        .unwrap();
    let (u2, a2) = store.insert_exchange(c.id, "second", None, &Attachments::default()).await.unwrap();
    store
        .finish_assistant_message(a2.id, &reply(MessageStatus::Complete))
        .await
        .unwrap();
    let before = store.messages(c.id).await.unwrap();

    for bad in [Uuid::now_v7(), a2.id] {
        assert!(matches!(
            store.insert_exchange(c.id, "never", Some(bad), &Attachments::default()).await,
            Err(StoreError::MessageNotFound(_))
        ));
        let now = store.messages(c.id).await.unwrap();
        let key = |m: &smolchat_store::Message| (m.id, m.position, m.content.clone());
        assert_eq!(
            now.iter().map(key).collect::<Vec<_>>(),
            before.iter().map(key).collect::<Vec<_>>()
        );
    }
    assert!(matches!(
        store.insert_exchange(Uuid::now_v7(), "x", None, &Attachments::default()).await,
        Err(StoreError::ConversationNotFound(_))
    ));

    let (u3, a3) = store
        .insert_exchange(c.id, "second, edited", Some(u2.id), &Attachments::default())
        .await
        .unwrap();
    // A new version: the edited question and its reply are shown; the old ones are kept.
    let after = store.branch(c.id).await.unwrap();
    let summary: Vec<&str> = after.iter().map(|m| m.content.as_str()).collect();
    assert_eq!(summary, ["first", "The answer is 4.", "second, edited", ""]);
    assert_eq!((after[2].id, after[3].id), (u3.id, a3.id));
    assert_eq!(u3.parent_id, u2.parent_id);
    assert_eq!(store.messages(c.id).await.unwrap().len(), 6);
}
}

/// A session id as the sign-in layer makes them (64 hex characters; the table checks the length).
fn sid(n: u8) -> String {
    format!("{n:02x}").repeat(32)
}

both! {
async fn sessions_are_valid_until_revoked_expired_or_the_credential_changes(db) {
    let (_dir, url, store) = fresh(db).await;
    let hour = chrono::Duration::hours(1);
    let a = store
        .create_session(&sid(1), SessionKind::Admin, "admin", "fp1", hour)
        .await
        .unwrap();
    assert_eq!(a.subject, "admin");
    assert_eq!(a.revoked_at, None);
    assert!(a.expires_at > a.created_at + chrono::Duration::minutes(59));
    store
        .create_session(&sid(2), SessionKind::Admin, "admin", "fp1", hour)
        .await
        .unwrap();
    store
        .create_session(&sid(3), SessionKind::User, "u-1", "fp1", hour)
        .await
        .unwrap();

    let valid = |id: String, kind, fp: &'static str| {
        let store = store.clone();
        async move { store.valid_session(&id, kind, fp).await.unwrap().is_some() }
    };
    assert!(valid(sid(1), SessionKind::Admin, "fp1").await);
    // Another kind, another fingerprint (the credential changed), an unknown id: refused.
    assert!(!valid(sid(1), SessionKind::User, "fp1").await);
    assert!(!valid(sid(1), SessionKind::Admin, "fp2").await);
    assert!(!valid(sid(9), SessionKind::Admin, "fp1").await);

    // Revoking one leaves the other; revoking twice reports nothing to do.
    assert!(store.revoke_session(&sid(1)).await.unwrap());
    assert!(!store.revoke_session(&sid(1)).await.unwrap());
    assert!(!valid(sid(1), SessionKind::Admin, "fp1").await);
    assert!(valid(sid(2), SessionKind::Admin, "fp1").await);
    let revoked = store.get_session(&sid(1)).await.unwrap().unwrap();
    assert!(revoked.revoked_at.is_some());

    // Revoking a subject's sessions leaves other subjects alone.
    assert_eq!(
        store
            .revoke_sessions_of(SessionKind::Admin, "admin")
            .await
            .unwrap(),
        1
    );
    assert!(!valid(sid(2), SessionKind::Admin, "fp1").await);
    assert!(valid(sid(3), SessionKind::User, "fp1").await);

    // Sessions survive reopening the database.
    store.close().await;
    let store = Store::open(&url).await.unwrap();
    assert!(store
        .valid_session(&sid(3), SessionKind::User, "fp1")
        .await
        .unwrap()
        .is_some());
}
}

both! {
async fn expired_sessions_are_refused_and_purged(db) {
    let (_dir, _url, store) = fresh(db).await;
    store
        .create_session(
            &sid(1),
            SessionKind::Admin,
            "admin",
            "fp",
            chrono::Duration::zero(),
        )
        .await
        .unwrap();
    store
        .create_session(
            &sid(2),
            SessionKind::Admin,
            "admin",
            "fp",
            chrono::Duration::hours(1),
        )
        .await
        .unwrap();
    store
        .create_session(
            &sid(3),
            SessionKind::Admin,
            "admin",
            "fp",
            chrono::Duration::hours(3),
        )
        .await
        .unwrap();
    // The clock is the test's: now, and two hours on (session 2 expired, 3 not).
    let now = chrono::Utc::now();
    let later = now + chrono::Duration::hours(2);
    let valid = |n, at| {
        let store = store.clone();
        async move {
            store
                .valid_session_at(&sid(n), SessionKind::Admin, "fp", at)
                .await
                .unwrap()
                .is_some()
        }
    };
    assert!(!valid(1, now).await, "expired at creation");
    assert!(valid(2, now).await);
    assert!(!valid(2, later).await, "expired since");
    assert!(valid(3, later).await);
    assert_eq!(store.purge_expired_sessions_at(later).await.unwrap(), 2);
    assert!(store.get_session(&sid(1)).await.unwrap().is_none());
    assert!(store.get_session(&sid(2)).await.unwrap().is_none());
    assert!(store.get_session(&sid(3)).await.unwrap().is_some());
    assert_eq!(store.purge_expired_sessions_at(later).await.unwrap(), 0);
}
}

both! {
async fn session_ids_must_look_like_hashes(db) {
    let (_dir, _url, store) = fresh(db).await;
    // The table refuses anything but a 64-character id, so a raw token of another shape can
    // never be stored by mistake.
    let err = store
        .create_session(
            "short",
            SessionKind::Admin,
            "admin",
            "fp",
            chrono::Duration::hours(1),
        )
        .await;
    assert!(err.is_err(), "{err:?}");
    // Ids are unique.
    store
        .create_session(
            &sid(1),
            SessionKind::Admin,
            "admin",
            "fp",
            chrono::Duration::hours(1),
        )
        .await
        .unwrap();
    assert!(store
        .create_session(
            &sid(1),
            SessionKind::Admin,
            "admin",
            "fp",
            chrono::Duration::hours(1)
        )
        .await
        .is_err());
}
}

both! {
async fn pages_follow_the_keyset_cursor(db) {
    let (_dir, _url, store) = fresh(db).await;
    let mut ids = Vec::new();
    for _ in 0..7 {
        ids.push(
            store
                .create_conversation("p", &settings())
                .await
                .unwrap()
                .id,
        );
    }
    store
        .create_conversation("someone else", &settings())
        .await
        .unwrap();
    // Activity reorders them; pages follow the list's order.
    for id in ids.iter().rev() {
        store.rename_conversation(*id, "same").await.unwrap();
    }
    let all = store.list_conversations("p", None).await.unwrap();
    let want: Vec<Uuid> = all.iter().map(|c| c.id).collect();
    let mut got = Vec::new();
    let mut before = None;
    loop {
        let page = store
            .list_conversations_page(
                "p",
                &ListFilter::default(),
                &PageRequest { limit: 3, before },
            )
            .await
            .unwrap();
        assert!(page.items.len() <= 3);
        got.extend(page.items.iter().map(|c| c.id));
        match page.next {
            Some(c) => before = Some(c),
            None => break,
        }
    }
    assert_eq!(got, want, "every conversation once, in list order");
    // Search applies within pages.
    let page = store
        .list_conversations_page(
            "p",
            &ListFilter {
                search: Some("nothing".into()),
                ..ListFilter::default()
            },
            &PageRequest {
                limit: 3,
                before: None,
            },
        )
        .await
        .unwrap();
    assert!(page.items.is_empty() && page.next.is_none());
    // The admin list pages over every owner.
    let first = store
        .list_all_conversations_page(&PageRequest {
            limit: 5,
            before: None,
        })
        .await
        .unwrap();
    let rest = store
        .list_all_conversations_page(&PageRequest {
            limit: 5,
            before: first.next,
        })
        .await
        .unwrap();
    assert_eq!(first.items.len() + rest.items.len(), 8);
    assert!(rest.next.is_none());
    assert_eq!(store.count_conversations("p").await.unwrap(), 7);
    // Cursors survive a trip through text and refuse anything else.
    let c = first.next.unwrap();
    assert_eq!(smolchat_store::Cursor::decode(&c.encode()), Some(c));
    assert_eq!(smolchat_store::Cursor::decode("12_not-a-uuid"), None);
}
}

both! {
async fn imports_are_all_or_nothing_and_keep_every_field(db) {
    let (_dir, _url, store) = fresh(db).await;
    let at = chrono::DateTime::from_timestamp_micros(1_751_968_800_123_456).unwrap();
    let message = |role, status, content: &str| ImportedMessage {
        role,
        content: content.to_string(),
        reasoning: (role == Role::Assistant).then(|| "thought".to_string()),
        raw: (role == Role::Assistant).then(|| format!("<think>thought</think>{content}")),
        status,
        error: None,
        prompt_tokens: Some(12),
        completion_tokens: Some(3),
        cached_tokens: Some(0),
        timings: Some(Timings {
            ttft_ms: 5.5,
            ..Timings::default()
        }),
        created_at: at,
        files: Vec::new(),
    };
    let good = vec![
        message(Role::User, MessageStatus::Complete, "hi"),
        message(Role::Assistant, MessageStatus::Stopped, "hello"),
    ];
    let c = store
        .import_conversation("me", "Imported", &settings(), &good)
        .await
        .unwrap();
    assert_eq!((c.owner.as_str(), c.title.as_str()), ("me", "Imported"));
    let stored = store.messages(c.id).await.unwrap();
    assert_eq!(stored.len(), 2);
    assert_eq!(stored[1].status, MessageStatus::Stopped);
    assert_eq!(stored[1].reasoning.as_deref(), Some("thought"));
    assert_eq!(
        stored[1].raw.as_deref(),
        Some("<think>thought</think>hello")
    );
    assert_eq!(stored[1].timings.as_ref().unwrap().ttft_ms, 5.5);
    assert_eq!(stored[0].created_at, at);
    assert_eq!((stored[0].position, stored[1].position), (1, 2));

    // A message that cannot be stored fails the whole import: no conversation is left behind.
    let bad = vec![
        message(Role::User, MessageStatus::Complete, "hi"),
        message(Role::Assistant, MessageStatus::Streaming, ""),
    ];
    assert!(store
        .import_conversation("me", "Broken", &settings(), &bad)
        .await
        .is_err());
    assert_eq!(store.count_conversations("me").await.unwrap(), 1);
    assert!(stored.iter().all(|m| m.imported), "imported text is the importer's");

    // A conversation stored whole under given ids (a stored response): the model's reply is
    // not imported, the client's turns are; ids and flags must match the messages.
    let id = uuid::Uuid::now_v7();
    let reply_id = uuid::Uuid::now_v7();
    let mut rows = smolchat_store::StoredRow::linear(2, |i| i == 0);
    rows[1].id = reply_id;
    let c = store
        .insert_conversation(id, "me", "Stored", &settings(), &good, &rows)
        .await
        .unwrap();
    assert_eq!(c.id, id);
    let stored = store.messages(id).await.unwrap();
    assert_eq!(stored[1].id, reply_id);
    assert_eq!(
        (stored[0].imported, stored[1].imported),
        (true, false)
    );
    assert!(store
        .insert_conversation(uuid::Uuid::now_v7(), "me", "Short", &settings(), &good, &rows[..1])
        .await
        .is_err());
    // A tree: the second message follows nothing (two first messages); the first is shown.
    let mut tree = smolchat_store::StoredRow::linear(2, |_| true);
    tree[1].parent = None;
    tree[0].current = true;
    tree[1].current = false;
    let t = store
        .insert_conversation(uuid::Uuid::now_v7(), "me", "Tree", &settings(), &good, &tree)
        .await
        .unwrap();
    let shown = store.branch(t.id).await.unwrap();
    assert_eq!(shown.iter().map(|m| m.id).collect::<Vec<_>>(), [tree[0].id]);
    // A message may only follow an earlier one.
    let mut bad = smolchat_store::StoredRow::linear(2, |_| true);
    bad[0].parent = Some(1);
    assert!(matches!(
        store
            .insert_conversation(uuid::Uuid::now_v7(), "me", "Bad", &settings(), &good, &bad)
            .await,
        Err(StoreError::BadTree(_))
    ));
    assert_eq!(store.count_conversations("me").await.unwrap(), 3);
}
}

both! {
async fn replicas_end_only_the_replies_of_dead_replicas(db) {
    let (_dir, url, a) = fresh(db).await;
    // A second server process on the same database.
    let b = Store::open_beside_server(&url).await.unwrap();
    let lease = Duration::from_secs(3);
    let ra = a.register_replica("a", "http://a", lease).await.unwrap();
    let rb = b.register_replica("b", "http://b", lease).await.unwrap();
    assert_eq!((ra.interrupted, rb.interrupted), (0, 0));
    let ca = a.create_conversation("u", &settings()).await.unwrap();
    let cb = b.create_conversation("u", &settings()).await.unwrap();
    let (_, reply_a) = a.insert_exchange(ca.id, "hi", None, &Attachments::default()).await.unwrap();
    let (_, reply_b) = b.insert_exchange(cb.id, "hi", None, &Attachments::default()).await.unwrap();
    assert_eq!(
        b.streaming_replica(ca.id).await.unwrap(),
        Some((reply_a.id, Some(ra.replica.id)))
    );
    // One reply streams per conversation, whichever replica asks; the refusal stores nothing.
    assert!(matches!(
        b.insert_exchange(ca.id, "again", None, &Attachments::default()).await,
        Err(StoreError::ReplyInProgress(id)) if id == ca.id
    ));
    assert_eq!(a.messages(ca.id).await.unwrap().len(), 2);
    // Both alive: a sweep touches nothing.
    assert_eq!(b.sweep_dead_replicas(lease).await.unwrap(), 0);

    // `a` stops sending heartbeats (killed); `b` goes on. After the lease, b's sweep ends a's
    // reply, keeping its partial text, and only that one.
    assert!(a
        .save_partial_reply(reply_a.id, "partial", None, "partial")
        .await
        .unwrap());
    // Both beats go stale (the lease is judged by the database's clock, so time must pass);
    // then only `b` beats, and the sweep right after sees `a` dead and `b` alive. The only
    // timing this needs is that the sweep follows b's heartbeat within the lease (3 s).
    tokio::time::sleep(lease + Duration::from_millis(200)).await;
    assert!(b.heartbeat(rb.replica.id, &ReplicaLoad::default()).await.unwrap());
    assert_eq!(b.sweep_dead_replicas(lease).await.unwrap(), 1);
    let ended = b.get_message(reply_a.id).await.unwrap().unwrap();
    assert_eq!(ended.status, MessageStatus::Interrupted);
    assert_eq!(ended.content, "partial");
    assert!(ended.error.is_some());
    let running = b.get_message(reply_b.id).await.unwrap().unwrap();
    assert_eq!(running.status, MessageStatus::Streaming);
    let live: Vec<String> = b
        .live_replicas(lease)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.name)
        .collect();
    assert_eq!(live, ["b"]);
    // The conversation is free again for the replica that takes it over.
    b.insert_exchange(ca.id, "again", None, &Attachments::default()).await.unwrap();

    // `b` restarts under its name: its own earlier reply ends at once, without waiting for the
    // lease, and the old run can no longer beat.
    let b2 = Store::open_beside_server(&url).await.unwrap();
    let rb2 = b2.register_replica("b", "http://b", lease).await.unwrap();
    assert_eq!(rb2.interrupted, 2, "b's reply and the one b took over from a");
    assert_eq!(
        b2.get_message(reply_b.id).await.unwrap().unwrap().status,
        MessageStatus::Interrupted
    );
    assert!(!b.heartbeat(rb.replica.id, &ReplicaLoad::default()).await.unwrap());
    let load = ReplicaLoad {
        running: 3,
        held: vec![ca.id],
        held_count: 1,
        ..ReplicaLoad::default()
    };
    assert!(b2.heartbeat(rb2.replica.id, &load).await.unwrap());
    let all = b2.replicas(lease, Duration::from_secs(3600)).await.unwrap();
    assert_eq!(all.len(), 3);
    let newest = &all[0];
    assert_eq!((newest.id, newest.live), (rb2.replica.id, true));
    assert_eq!(newest.load, load);
    let old_b = all.iter().find(|r| r.id == rb.replica.id).unwrap();
    assert!(!old_b.live && old_b.stopped_at.is_some());
    let dead_a = all.iter().find(|r| r.id == ra.replica.id).unwrap();
    assert!(!dead_a.live && dead_a.stopped_at.is_none());
    b2.stop_replica(rb2.replica.id).await.unwrap();
    assert!(b2.live_replicas(lease).await.unwrap().is_empty());
}
}

both! {
async fn user_names_ignore_case_on_both_backends(db) {
    let (_dir, _url, store) = fresh(db).await;
    let hash = "$argon2id$v=19$m=19456,t=2,p=1$c2FsdHNhbHQ$aGFzaGhhc2hoYXNoaGFzaA";
    let new = |id: &'static str, name: &'static str| smolchat_store::NewUser {
        id,
        name,
        password_hash: hash,
        role: smolchat_store::UserRole::User,
        invite: None,
        adopt_from: None,
    };
    assert!(matches!(
        store.create_user(&new("u1", "Alice")).await.unwrap(),
        smolchat_store::CreatedUser::Created { .. }
    ));
    assert!(matches!(
        store.create_user(&new("u2", "alice")).await.unwrap(),
        smolchat_store::CreatedUser::NameTaken
    ));
    assert_eq!(store.user_by_name("ALICE").await.unwrap().unwrap().id, "u1");
    store.create_user(&new("u3", "bob")).await.unwrap();
    let names = store
        .user_names(&["u1".to_string(), "u3".to_string(), "guest".to_string()])
        .await
        .unwrap();
    assert_eq!(names.len(), 2);
    assert_eq!(names["u3"], "bob");
    store.add_api_usage("u1", 10, 5).await.unwrap();
    store.add_api_usage("u1", 1, 2).await.unwrap();
    let usage = store.api_usage("u1").await.unwrap();
    assert_eq!((usage.requests, usage.prompt_tokens, usage.completion_tokens), (2, 11, 7));
    let listed = store.list_users(10, 0).await.unwrap();
    let order: Vec<&str> = listed.iter().map(|u| u.user.name.as_str()).collect();
    assert_eq!(order, ["Alice", "bob"]);
    assert_eq!(listed[0].tokens, 18);
}
}

both! {
async fn token_sums_saturate_whatever_is_stored(db) {
    // Rows from before imports were bounded may hold any 64-bit count: the admin page's sums
    // cap each value instead of overflowing into an error (SQLite "integer overflow",
    // PostgreSQL "bigint out of range").
    let (_dir, _url, store) = fresh(db).await;
    let hash = "$argon2id$v=19$m=19456,t=2,p=1$c2FsdHNhbHQ$aGFzaGhhc2hoYXNoaGFzaA";
    store
        .create_user(&smolchat_store::NewUser {
            id: "u1",
            name: "huge",
            password_hash: hash,
            role: smolchat_store::UserRole::User,
            invite: None,
            adopt_from: None,
        })
        .await
        .unwrap();
    let c = store.create_conversation("u1", &settings()).await.unwrap();
    for _ in 0..3 {
        store.insert_user_message(c.id, "hi").await.unwrap();
        let a = store.start_assistant_message(c.id).await.unwrap();
        store
            .finish_assistant_message(
                a.id,
                &FinishedReply {
                    prompt_tokens: 6_000_000_000_000_000_000,
                    completion_tokens: i64::MAX,
                    ..reply(MessageStatus::Complete)
                },
            )
            .await
            .unwrap();
    }
    store.add_api_usage("u1", i64::MAX / 2, i64::MAX / 2).await.unwrap();
    let listed = store.list_users(10, 0).await.unwrap();
    let cap = smolchat_store::MAX_TOKEN_COUNT;
    assert_eq!(listed[0].tokens, 6 * cap + 2 * cap);
    // Text kept by the owner: what the import quota counts.
    let stored = store.stored_text_bytes("u1").await.unwrap();
    let one = "hi".len() + reply(MessageStatus::Complete).content.len()
        + reply(MessageStatus::Complete).reasoning.unwrap_or_default().len()
        + reply(MessageStatus::Complete).raw.len();
    assert_eq!(stored, 3 * one as u64);
    assert_eq!(store.stored_text_bytes("nobody").await.unwrap(), 0);
}
}

both! {
async fn search_finds_substrings_through_the_index(db) {
    let (_dir, _url, store) = fresh(db).await;
    let c = store.create_conversation("u", &settings()).await.unwrap();
    store
        .insert_user_message(c.id, "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich")
        .await
        .unwrap();
    let d = store.create_conversation("u", &settings()).await.unwrap();
    store
        .insert_user_message(d.id, "a 'quoted' \"phrase\" with 50% off_sale\\path")
        .await
        .unwrap();
    let found = |q: &'static str| {
        let store = store.clone();
        async move {
            store
                .list_conversations("u", Some(q))
                .await
                .unwrap()
                .into_iter()
                .map(|c| c.id)
                .collect::<Vec<_>>()
        }
    };
    // Substrings, not words; any case (ASCII at least); through the trigram index.
    assert_eq!(found("oxkä").await, vec![c.id]);
    assert_eq!(found("SYLTER DEI").await, vec![c.id]);
    assert_eq!(found("\"phrase\"").await, vec![d.id]);
    assert_eq!(found("50% off_").await, vec![d.id]);
    assert_eq!(found("le\\pa").await, vec![d.id]);
    assert_eq!(found("'quoted'").await, vec![d.id]);
    assert!(found("0%_off").await.is_empty());
    // Edits and deletions reach the index.
    store.delete_conversation(c.id).await.unwrap();
    assert!(found("Boxkämpfer").await.is_empty());
}

async fn folders_pins_archive_and_tags_filter_lists_and_stay_with_their_owner(db) {
    let (_dir, _url, store) = fresh(db).await;
    let a = store.create_conversation("alice", &settings()).await.unwrap();
    let b = store.create_conversation("alice", &settings()).await.unwrap();
    let c = store.create_conversation("alice", &settings()).await.unwrap();
    let theirs = store.create_conversation("bob", &settings()).await.unwrap();
    let work = store.create_folder("alice", "Work").await.unwrap();
    assert!(matches!(
        store.create_folder("alice", "Work").await,
        Err(StoreError::NameTaken { .. })
    ));
    // Another owner may use the same name.
    let bobs = store.create_folder("bob", "Work").await.unwrap();

    let set = |pinned, archived, folder, tags: &[&str]| OrganisationPatch {
        pinned,
        archived,
        folder,
        tags: Some(tags.iter().map(|t| t.to_string()).collect()),
    };
    let got = store
        .organise("alice", a.id, &set(Some(true), None, Some(Some(work.id)), &["rust", "db", "rust"]))
        .await
        .unwrap()
        .unwrap();
    assert!(got.pinned && !got.archived);
    assert_eq!(got.folder_id, Some(work.id));
    assert_eq!(got.tags, vec!["db".to_string(), "rust".to_string()]);
    store
        .organise("alice", b.id, &set(None, Some(true), None, &["rust"]))
        .await
        .unwrap()
        .unwrap();
    // Someone else's conversation, or someone else's folder: not found / refused, nothing set.
    assert_eq!(
        store
            .organise("alice", theirs.id, &set(Some(true), None, None, &[]))
            .await
            .unwrap(),
        None
    );
    assert!(matches!(
        store
            .organise("alice", c.id, &set(None, None, Some(Some(bobs.id)), &[]))
            .await,
        Err(StoreError::FolderNotFound(_))
    ));
    assert_eq!(store.organisation(c.id).await.unwrap().unwrap().folder_id, None);

    let list = |filter: ListFilter| {
        let store = store.clone();
        async move {
            let page = store
                .list_conversations_page(
                    "alice",
                    &filter,
                    &PageRequest {
                        limit: 50,
                        before: None,
                    },
                )
                .await
                .unwrap();
            let mut ids: Vec<Uuid> = page.items.iter().map(|s| s.id).collect();
            ids.sort();
            ids
        }
    };
    let sorted = |mut v: Vec<Uuid>| {
        v.sort();
        v
    };
    let unarchived = ListFilter {
        archived: Some(false),
        ..ListFilter::default()
    };
    assert_eq!(list(unarchived.clone()).await, sorted(vec![a.id, c.id]));
    assert_eq!(
        list(ListFilter {
            archived: Some(true),
            ..ListFilter::default()
        })
        .await,
        vec![b.id]
    );
    assert_eq!(
        list(ListFilter {
            pinned: Some(true),
            ..unarchived.clone()
        })
        .await,
        vec![a.id]
    );
    assert_eq!(
        list(ListFilter {
            folder: Some(work.id),
            ..ListFilter::default()
        })
        .await,
        vec![a.id]
    );
    assert_eq!(
        list(ListFilter {
            tag: Some("rust".into()),
            ..ListFilter::default()
        })
        .await,
        sorted(vec![a.id, b.id])
    );
    let summary = store.list_conversations("alice", None).await.unwrap();
    let first = summary.iter().find(|s| s.id == a.id).unwrap();
    assert!(first.pinned && first.folder_id == Some(work.id));
    let tags = store.tags("alice").await.unwrap();
    assert_eq!(
        tags.iter()
            .map(|t| (t.tag.as_str(), t.conversations))
            .collect::<Vec<_>>(),
        vec![("db", 1), ("rust", 2)]
    );
    assert!(store.tags("bob").await.unwrap().is_empty());
    let folders = store.folders("alice").await.unwrap();
    assert_eq!(folders.len(), 1);
    assert_eq!(folders[0].conversations, 1);

    // Renaming and deleting folders: only the owner's; the conversations stay, unfiled.
    assert!(!store.rename_folder("bob", work.id, "Mine").await.unwrap());
    assert!(store.rename_folder("alice", work.id, "Job").await.unwrap());
    assert!(!store.delete_folder("bob", work.id).await.unwrap());
    assert!(store.delete_folder("alice", work.id).await.unwrap());
    assert_eq!(store.organisation(a.id).await.unwrap().unwrap().folder_id, None);
    assert!(store.get_conversation(a.id).await.unwrap().is_some());
    // Tags go with their conversation.
    store.delete_conversation(b.id).await.unwrap();
    assert_eq!(store.tags("alice").await.unwrap().len(), 2);
    assert_eq!(store.tags("alice").await.unwrap()[1].conversations, 1);
}

async fn presets_are_an_owners_own_or_shared(db) {
    let (_dir, _url, store) = fresh(db).await;
    let shared = store
        .create_preset(None, "Translator", "Translate to French.")
        .await
        .unwrap();
    assert!(shared.shared);
    let mine = store
        .create_preset(Some("alice"), "Terse", "Answer in one line.")
        .await
        .unwrap();
    // The same name is fine for another owner and for the shared set.
    store
        .create_preset(Some("bob"), "Terse", "Be short.")
        .await
        .unwrap();
    store
        .create_preset(Some("alice"), "Translator", "Mine.")
        .await
        .unwrap();
    assert!(matches!(
        store.create_preset(Some("alice"), "Terse", "again").await,
        Err(StoreError::NameTaken { .. })
    ));
    let names = |v: Vec<smolchat_store::Preset>| {
        v.into_iter()
            .map(|p| (p.name, p.shared))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        names(store.presets("alice").await.unwrap()),
        vec![
            ("Translator".to_string(), true),
            ("Terse".to_string(), false),
            ("Translator".to_string(), false)
        ]
    );
    assert!(store.preset("alice", shared.id).await.unwrap().is_some());
    assert!(store.preset("bob", mine.id).await.unwrap().is_none());
    // Only the owner changes their own; the shared ones only as shared (owner None).
    assert!(!store
        .update_preset(Some("bob"), mine.id, "x", "y")
        .await
        .unwrap());
    assert!(!store
        .update_preset(Some("alice"), shared.id, "x", "y")
        .await
        .unwrap());
    assert!(store
        .update_preset(Some("alice"), mine.id, "Terser", "One word.")
        .await
        .unwrap());
    assert!(store
        .update_preset(None, shared.id, "Translator", "Translate to German.")
        .await
        .unwrap());
    assert_eq!(
        store.preset("bob", shared.id).await.unwrap().unwrap().system_prompt,
        "Translate to German."
    );
    assert!(!store.delete_preset(Some("bob"), mine.id).await.unwrap());
    assert!(!store.delete_preset(Some("alice"), shared.id).await.unwrap());
    assert!(store.delete_preset(Some("alice"), mine.id).await.unwrap());
    assert!(store.delete_preset(None, shared.id).await.unwrap());
    assert_eq!(store.count_presets(Some("alice")).await.unwrap(), 1);
    assert_eq!(store.count_presets(None).await.unwrap(), 0);
}

async fn the_audit_log_pages_filters_and_purges(db) {
    use smolchat_store::{AuditFilter, NewAuditEntry};
    let (_dir, _url, store) = fresh(db).await;
    for (actor, action, target) in [
        ("user:a", "auth.sign_in", "user:a"),
        ("admin", "admin.stop", "conversation:1"),
        ("user:b", "auth.sign_in", "user:b"),
        ("user:a", "conversation.delete", "conversation:100%_x"),
    ] {
        store
            .record_audit(&NewAuditEntry {
                actor: actor.into(),
                action: action.into(),
                target: target.into(),
                address: "127.0.0.1".into(),
                detail: String::new(),
            })
            .await
            .unwrap();
    }
    let all = store.audit_page(&AuditFilter::default(), 10).await.unwrap();
    assert_eq!(all.len(), 4);
    assert_eq!(all[0].action, "conversation.delete", "newest first");
    let page = |f: AuditFilter| {
        let store = store.clone();
        async move {
            store
                .audit_page(&f, 10)
                .await
                .unwrap()
                .into_iter()
                .map(|e| e.target)
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(
        page(AuditFilter {
            action: Some("auth.sign_in".into()),
            ..AuditFilter::default()
        })
        .await,
        vec!["user:b", "user:a"]
    );
    assert_eq!(
        page(AuditFilter {
            actor: Some("user:a".into()),
            ..AuditFilter::default()
        })
        .await,
        vec!["conversation:100%_x", "user:a"]
    );
    // The text is plain: `%` and `_` match themselves.
    assert_eq!(
        page(AuditFilter {
            text: Some("100%_".into()),
            ..AuditFilter::default()
        })
        .await,
        vec!["conversation:100%_x"]
    );
    assert!(page(AuditFilter {
        text: Some("0%x".into()),
        ..AuditFilter::default()
    })
    .await
    .is_empty());
    // Paging continues from the last id seen.
    let first = store.audit_page(&AuditFilter::default(), 2).await.unwrap();
    let rest = page(AuditFilter {
        before: Some(first[1].id.clone()),
        ..AuditFilter::default()
    })
    .await;
    assert_eq!(rest, vec!["conversation:1", "user:a"]);
    // Nothing is old enough to purge yet.
    assert_eq!(store.purge_audit(1).await.unwrap(), 0);
}

async fn usage_counters_add_up_per_window(db) {
    use smolchat_store::{Period, Usage};
    let (_dir, _url, s) = fresh(db).await;
    let at = |t: &str| -> chrono::DateTime<chrono::Utc> { t.parse().unwrap() };
    let t = at("2026-11-26T10:15:20Z");
    s.add_usage("user:a", 100, 1, t).await.unwrap();
    s.add_usage("user:a", 50, 1, t + chrono::Duration::seconds(30))
        .await
        .unwrap();
    // The next minute, the same day and month.
    let later = t + chrono::Duration::seconds(60);
    s.add_usage("user:a", 7, 0, later).await.unwrap();
    assert_eq!(
        s.usage("user:a", Period::Minute, t).await.unwrap(),
        Usage {
            tokens: 150,
            events: 2
        }
    );
    assert_eq!(s.usage("user:a", Period::Minute, later).await.unwrap().tokens, 7);
    assert_eq!(s.usage("user:a", Period::Day, t).await.unwrap().tokens, 157);
    assert_eq!(s.usage("user:a", Period::Month, t).await.unwrap().tokens, 157);
    assert_eq!(s.usage("user:b", Period::Day, t).await.unwrap(), Usage::default());
    assert_eq!(s.count_event("conv:a", t).await.unwrap(), 1);
    assert_eq!(s.count_event("conv:a", t).await.unwrap(), 2);
    assert_eq!(s.count_event("conv:a", later).await.unwrap(), 1);
    let days = s.usage_history("user:a", Period::Day, 10).await.unwrap();
    assert_eq!(days.len(), 1);
    assert_eq!(days[0].0, at("2026-11-26T00:00:00Z"));
    // A day later the minutes are gone, the day stays.
    let removed = s.trim_usage(t + chrono::Duration::days(2)).await.unwrap();
    assert!(removed >= 3, "{removed}");
    assert_eq!(s.usage("user:a", Period::Day, t).await.unwrap().tokens, 157);
    s.forget_usage("user:a").await.unwrap();
    assert_eq!(s.usage("user:a", Period::Day, t).await.unwrap().tokens, 0);
}

async fn deleting_a_user_removes_everything_they_own(db) {
    let (_dir, _url, store) = fresh(db).await;
    let id = something_to_back_up(&store).await;
    let other = store.create_conversation("someone-else", &settings()).await.unwrap();
    // A linked sign-in and counted usage go with the account too.
    assert!(store
        .link_identity("u-backup", "https://id.example.com", "sub-1")
        .await
        .unwrap());
    let now = chrono::Utc::now();
    store.add_usage("user:u-backup", 42, 1, now).await.unwrap();
    // Counted under their key, their conversation creations and their /v1 use.
    let keys = store.list_api_keys("u-backup").await.unwrap();
    let key_subject = format!("key:{}", keys[0].id);
    store.add_usage(&key_subject, 9, 1, now).await.unwrap();
    store.count_event("conv:owner:u-backup", now).await.unwrap();
    store.add_api_usage("u-backup", 10, 5).await.unwrap();
    let gone = store.delete_user("u-backup").await.unwrap().expect("deleted");
    use smolchat_store::{Period, StoreError};
    for subject in [key_subject.as_str(), "conv:owner:u-backup"] {
        let left = store.usage(subject, Period::Minute, now).await.unwrap();
        assert_eq!((left.tokens, left.events), (0, 0), "{subject} left behind");
    }
    assert_eq!(store.api_usage("u-backup").await.unwrap().requests, 0);
    // A request that finishes just after the delete writes nothing back.
    assert!(matches!(
        store.add_api_usage("u-backup", 10, 5).await,
        Err(StoreError::OwnerGone(_))
    ));
    for subject in ["user:u-backup", key_subject.as_str()] {
        assert!(
            matches!(
                store.add_usage(subject, 1, 1, now).await,
                Err(StoreError::OwnerGone(_))
            ),
            "{subject}"
        );
        assert_eq!(store.usage(subject, Period::Day, now).await.unwrap().tokens, 0);
    }
    assert_eq!(store.api_usage("u-backup").await.unwrap().requests, 0);
    // Keyless callers' usage and guests' counters are not an account's.
    store.add_api_usage("api:0123", 1, 1).await.unwrap();
    store.add_usage("user:some-guest", 1, 1, now).await.unwrap();
    assert!(store
        .user_by_identity("https://id.example.com", "sub-1")
        .await
        .unwrap()
        .is_none());
    assert_eq!(
        store
            .usage("user:u-backup", smolchat_store::Period::Day, now)
            .await
            .unwrap()
            .tokens,
        0
    );
    assert_eq!((gone.conversations, gone.api_keys), (1, 1));
    assert!(store.get_conversation(id).await.unwrap().is_none());
    assert!(store.messages(id).await.unwrap().is_empty());
    assert!(store.files_of(id).await.unwrap().is_empty());
    assert!(store.list_api_keys("u-backup").await.unwrap().is_empty());
    assert!(store.folders("u-backup").await.unwrap().is_empty());
    assert!(store.user_by_id("u-backup").await.unwrap().is_none());
    assert!(store.get_conversation(other.id).await.unwrap().is_some(), "others keep theirs");
    assert_eq!(store.delete_user("u-backup").await.unwrap(), None);
}
}
