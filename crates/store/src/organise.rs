//! Organising conversations (migration 0008): each owner's folders, the pinned and archived
//! flags, tags, and system-prompt presets (an owner's own, or shared with everyone when made by an
//! admin: `owner` NULL). The caller (the service) checks names, lengths and who may do what; the
//! store keeps folders and presets to their owner in every statement, so an id of someone else's
//! is "not found" here too.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::{now_micros, parse_time, parse_uuid, Store, StoreError, WriteTx};

/// One of an owner's folders.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Folder {
    pub id: Uuid,
    pub name: String,
    /// Conversations in it.
    pub conversations: i64,
    #[serde(serialize_with = "super::types::rfc3339_pub")]
    pub created_at: DateTime<Utc>,
}

/// Where a conversation is kept and how it is marked.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Organisation {
    pub pinned: bool,
    pub archived: bool,
    pub folder_id: Option<Uuid>,
    /// Sorted, no duplicates.
    pub tags: Vec<String>,
}

/// A change of [`Organisation`]: fields left `None` keep their value; `folder: Some(None)` takes
/// the conversation out of its folder; `tags` replaces the whole set.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OrganisationPatch {
    pub pinned: Option<bool>,
    pub archived: Option<bool>,
    pub folder: Option<Option<Uuid>>,
    pub tags: Option<Vec<String>>,
}

/// A named system prompt.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Preset {
    pub id: Uuid,
    pub name: String,
    pub system_prompt: String,
    /// Made by an admin for everyone (only admins may change it).
    pub shared: bool,
    #[serde(serialize_with = "super::types::rfc3339_pub")]
    pub updated_at: DateTime<Utc>,
}

/// A tag and how many of an owner's conversations carry it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TagCount {
    pub tag: String,
    pub conversations: i64,
}

#[derive(sqlx::FromRow)]
struct FolderRow {
    id: String,
    name: String,
    conversations: i64,
    created_at: i64,
}

#[derive(sqlx::FromRow)]
struct PresetRow {
    id: String,
    owner: Option<String>,
    name: String,
    system_prompt: String,
    updated_at: i64,
}

impl PresetRow {
    fn into_preset(self) -> Result<Preset, StoreError> {
        Ok(Preset {
            id: parse_uuid("presets", &self.id, &self.id)?,
            updated_at: parse_time("presets", &self.id, self.updated_at)?,
            shared: self.owner.is_none(),
            name: self.name,
            system_prompt: self.system_prompt,
        })
    }
}

/// Whose a preset is: `None` for the shared ones. Bound as `COALESCE(owner, '')`.
fn preset_key(owner: Option<&str>) -> &str {
    owner.unwrap_or("")
}

/// The owner-named things whose names are unique per owner.
#[derive(Clone, Copy)]
enum Named {
    Folder,
    Preset,
}

impl Named {
    fn taken(self, name: &str) -> StoreError {
        StoreError::NameTaken {
            what: match self {
                Named::Folder => "folder",
                Named::Preset => "preset",
            },
            name: name.to_string(),
        }
    }
}

/// Whether `owner` (a preset's `COALESCE(owner, '')`: `""` for the shared ones) has a `what`
/// named `name`, other than `except`.
async fn name_taken(
    tx: &mut WriteTx,
    what: Named,
    owner: &str,
    name: &str,
    except: Option<Uuid>,
) -> Result<bool, StoreError> {
    let query = match what {
        Named::Folder => "SELECT id FROM folders WHERE owner = $1 AND name = $2 AND id <> $3",
        Named::Preset => {
            "SELECT id FROM presets WHERE COALESCE(owner, '') = $1 AND name = $2 AND id <> $3"
        }
    };
    let found: Option<(String,)> = sqlx::query_as(query)
        .bind(owner)
        .bind(name)
        .bind(except.map(|id| id.to_string()).unwrap_or_default())
        .fetch_optional(&mut **tx)
        .await?;
    Ok(found.is_some())
}

impl Store {
    /// `owner`'s folders by name, with how many conversations each holds.
    pub async fn folders(&self, owner: &str) -> Result<Vec<Folder>, StoreError> {
        let rows: Vec<FolderRow> = sqlx::query_as(
            "SELECT f.id, f.name, f.created_at, \
               (SELECT COUNT(*) FROM conversations c WHERE c.folder_id = f.id) AS conversations \
             FROM folders f WHERE f.owner = $1 ORDER BY f.name, f.id",
        )
        .bind(owner)
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter()
            .map(|r| {
                Ok(Folder {
                    id: parse_uuid("folders", &r.id, &r.id)?,
                    created_at: parse_time("folders", &r.id, r.created_at)?,
                    name: r.name,
                    conversations: r.conversations,
                })
            })
            .collect()
    }

    /// A new folder of `owner`'s; [`StoreError::NameTaken`] when they have one by that name.
    pub async fn create_folder(&self, owner: &str, name: &str) -> Result<Folder, StoreError> {
        let mut tx = WriteTx::begin(self).await?;
        if name_taken(&mut tx, Named::Folder, owner, name, None).await? {
            tx.rollback().await?;
            return Err(Named::Folder.taken(name));
        }
        let id = Uuid::now_v7();
        let now = now_micros();
        sqlx::query("INSERT INTO folders (id, owner, name, created_at) VALUES ($1, $2, $3, $4)")
            .bind(id.to_string())
            .bind(owner)
            .bind(name)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(Folder {
            id,
            name: name.to_string(),
            conversations: 0,
            created_at: parse_time("folders", &id.to_string(), now)?,
        })
    }

    /// Renames `owner`'s folder `id`; false when they have no such folder.
    pub async fn rename_folder(
        &self,
        owner: &str,
        id: Uuid,
        name: &str,
    ) -> Result<bool, StoreError> {
        let mut tx = WriteTx::begin(self).await?;
        if name_taken(&mut tx, Named::Folder, owner, name, Some(id)).await? {
            tx.rollback().await?;
            return Err(Named::Folder.taken(name));
        }
        let done = sqlx::query("UPDATE folders SET name = $1 WHERE id = $2 AND owner = $3")
            .bind(name)
            .bind(id.to_string())
            .bind(owner)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(done.rows_affected() > 0)
    }

    /// Deletes `owner`'s folder `id`; its conversations stay, outside any folder. False when
    /// they have no such folder.
    pub async fn delete_folder(&self, owner: &str, id: Uuid) -> Result<bool, StoreError> {
        let mut tx = WriteTx::begin(self).await?;
        sqlx::query(
            "UPDATE conversations SET folder_id = NULL WHERE folder_id = $1 AND owner = $2",
        )
        .bind(id.to_string())
        .bind(owner)
        .execute(&mut *tx)
        .await?;
        let done = sqlx::query("DELETE FROM folders WHERE id = $1 AND owner = $2")
            .bind(id.to_string())
            .bind(owner)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(done.rows_affected() > 0)
    }

    /// How conversation `id` is organised; `None` when there is no such conversation.
    pub async fn organisation(&self, id: Uuid) -> Result<Option<Organisation>, StoreError> {
        let row: Option<(i64, i64, Option<String>)> =
            sqlx::query_as("SELECT pinned, archived, folder_id FROM conversations WHERE id = $1")
                .bind(id.to_string())
                .fetch_optional(&self.pool)
                .await?;
        let Some((pinned, archived, folder)) = row else {
            return Ok(None);
        };
        let tags: Vec<(String,)> = sqlx::query_as(
            "SELECT tag FROM conversation_tags WHERE conversation_id = $1 ORDER BY tag",
        )
        .bind(id.to_string())
        .fetch_all(&self.pool)
        .await?;
        let id_text = id.to_string();
        Ok(Some(Organisation {
            pinned: pinned != 0,
            archived: archived != 0,
            folder_id: folder
                .map(|f| parse_uuid("conversations", &id_text, &f))
                .transpose()?,
            tags: tags.into_iter().map(|(t,)| t).collect(),
        }))
    }

    /// Applies `patch` to conversation `id` of `owner`. A folder must be one of `owner`'s
    /// (else [`StoreError::FolderNotFound`]). Returns the new organisation, or `None` when the
    /// conversation is not `owner`'s. Does not touch `updated_at`: organising is not activity.
    pub async fn organise(
        &self,
        owner: &str,
        id: Uuid,
        patch: &OrganisationPatch,
    ) -> Result<Option<Organisation>, StoreError> {
        let mut tx = WriteTx::begin(self).await?;
        let mine: Option<(String,)> =
            sqlx::query_as("SELECT id FROM conversations WHERE id = $1 AND owner = $2")
                .bind(id.to_string())
                .bind(owner)
                .fetch_optional(&mut *tx)
                .await?;
        if mine.is_none() {
            tx.rollback().await?;
            return Ok(None);
        }
        if let Some(Some(folder)) = patch.folder {
            let found: Option<(String,)> =
                sqlx::query_as("SELECT id FROM folders WHERE id = $1 AND owner = $2")
                    .bind(folder.to_string())
                    .bind(owner)
                    .fetch_optional(&mut *tx)
                    .await?;
            if found.is_none() {
                tx.rollback().await?;
                return Err(StoreError::FolderNotFound(folder));
            }
        }
        if let Some(pinned) = patch.pinned {
            sqlx::query("UPDATE conversations SET pinned = $1 WHERE id = $2")
                .bind(i64::from(pinned))
                .bind(id.to_string())
                .execute(&mut *tx)
                .await?;
        }
        if let Some(archived) = patch.archived {
            sqlx::query("UPDATE conversations SET archived = $1 WHERE id = $2")
                .bind(i64::from(archived))
                .bind(id.to_string())
                .execute(&mut *tx)
                .await?;
        }
        if let Some(folder) = patch.folder {
            sqlx::query("UPDATE conversations SET folder_id = $1 WHERE id = $2")
                .bind(folder.map(|f| f.to_string()))
                .bind(id.to_string())
                .execute(&mut *tx)
                .await?;
        }
        if let Some(tags) = &patch.tags {
            sqlx::query("DELETE FROM conversation_tags WHERE conversation_id = $1")
                .bind(id.to_string())
                .execute(&mut *tx)
                .await?;
            let mut unique: Vec<&String> = tags.iter().collect();
            unique.sort();
            unique.dedup();
            for tag in unique {
                sqlx::query("INSERT INTO conversation_tags (conversation_id, tag) VALUES ($1, $2)")
                    .bind(id.to_string())
                    .bind(tag)
                    .execute(&mut *tx)
                    .await?;
            }
        }
        tx.commit().await?;
        self.organisation(id).await
    }

    /// The tags on `owner`'s conversations, by name, with how many carry each.
    pub async fn tags(&self, owner: &str) -> Result<Vec<TagCount>, StoreError> {
        let rows: Vec<(String, i64)> = sqlx::query_as(
            "SELECT t.tag, COUNT(*) FROM conversation_tags t \
             JOIN conversations c ON c.id = t.conversation_id \
             WHERE c.owner = $1 GROUP BY t.tag ORDER BY t.tag",
        )
        .bind(owner)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(tag, conversations)| TagCount { tag, conversations })
            .collect())
    }

    /// The presets `owner` can use: the shared ones, then their own, each by name.
    pub async fn presets(&self, owner: &str) -> Result<Vec<Preset>, StoreError> {
        let rows: Vec<PresetRow> = sqlx::query_as(
            "SELECT id, owner, name, system_prompt, updated_at FROM presets \
             WHERE owner IS NULL OR owner = $1 ORDER BY owner IS NOT NULL, name, id",
        )
        .bind(owner)
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter().map(PresetRow::into_preset).collect()
    }

    /// How many presets `owner` has (`None`: the shared ones).
    pub async fn count_presets(&self, owner: Option<&str>) -> Result<i64, StoreError> {
        let (n,): (i64,) =
            sqlx::query_as("SELECT COUNT(*) FROM presets WHERE COALESCE(owner, '') = $1")
                .bind(preset_key(owner))
                .fetch_one(&self.pool)
                .await?;
        Ok(n)
    }

    /// A new preset of `owner` (`None`: shared); [`StoreError::NameTaken`] when that owner (or
    /// the shared set) has one by that name.
    pub async fn create_preset(
        &self,
        owner: Option<&str>,
        name: &str,
        system_prompt: &str,
    ) -> Result<Preset, StoreError> {
        let mut tx = WriteTx::begin(self).await?;
        if name_taken(&mut tx, Named::Preset, preset_key(owner), name, None).await? {
            tx.rollback().await?;
            return Err(Named::Preset.taken(name));
        }
        let id = Uuid::now_v7();
        let now = now_micros();
        sqlx::query(
            "INSERT INTO presets (id, owner, name, system_prompt, created_at, updated_at) \
             VALUES ($1, $2, $3, $4, $5, $5)",
        )
        .bind(id.to_string())
        .bind(owner)
        .bind(name)
        .bind(system_prompt)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Preset {
            id,
            name: name.to_string(),
            system_prompt: system_prompt.to_string(),
            shared: owner.is_none(),
            updated_at: parse_time("presets", &id.to_string(), now)?,
        })
    }

    /// Preset `id` if `owner` may use it (theirs or shared).
    pub async fn preset(&self, owner: &str, id: Uuid) -> Result<Option<Preset>, StoreError> {
        let row: Option<PresetRow> = sqlx::query_as(
            "SELECT id, owner, name, system_prompt, updated_at FROM presets \
             WHERE id = $1 AND (owner IS NULL OR owner = $2)",
        )
        .bind(id.to_string())
        .bind(owner)
        .fetch_optional(&self.pool)
        .await?;
        row.map(PresetRow::into_preset).transpose()
    }

    /// Changes preset `id` of `owner` (`None`: a shared one); false when there is no such
    /// preset of that owner.
    pub async fn update_preset(
        &self,
        owner: Option<&str>,
        id: Uuid,
        name: &str,
        system_prompt: &str,
    ) -> Result<bool, StoreError> {
        let mut tx = WriteTx::begin(self).await?;
        if name_taken(&mut tx, Named::Preset, preset_key(owner), name, Some(id)).await? {
            tx.rollback().await?;
            return Err(Named::Preset.taken(name));
        }
        let done = sqlx::query(
            "UPDATE presets SET name = $1, system_prompt = $2, updated_at = $3 \
             WHERE id = $4 AND COALESCE(owner, '') = $5",
        )
        .bind(name)
        .bind(system_prompt)
        .bind(now_micros())
        .bind(id.to_string())
        .bind(preset_key(owner))
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(done.rows_affected() > 0)
    }

    /// Deletes preset `id` of `owner` (`None`: a shared one); false when there is none.
    pub async fn delete_preset(&self, owner: Option<&str>, id: Uuid) -> Result<bool, StoreError> {
        let done = sqlx::query("DELETE FROM presets WHERE id = $1 AND COALESCE(owner, '') = $2")
            .bind(id.to_string())
            .bind(preset_key(owner))
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() > 0)
    }
}

/// Moves `from`'s folders and presets to `to` (a guest signing up or in), inside the caller's
/// transaction. A folder whose name `to` already has is merged into theirs; a preset whose name
/// they already have keeps its prompt under the name with " (2)", " (3)"… added.
pub(crate) async fn reown_organisation(
    tx: &mut WriteTx,
    from: &str,
    to: &str,
) -> Result<(), StoreError> {
    let folders: Vec<(String, String)> =
        sqlx::query_as("SELECT id, name FROM folders WHERE owner = $1")
            .bind(from)
            .fetch_all(&mut **tx)
            .await?;
    for (id, name) in folders {
        let theirs: Option<(String,)> =
            sqlx::query_as("SELECT id FROM folders WHERE owner = $1 AND name = $2")
                .bind(to)
                .bind(&name)
                .fetch_optional(&mut **tx)
                .await?;
        match theirs {
            Some((existing,)) => {
                sqlx::query("UPDATE conversations SET folder_id = $1 WHERE folder_id = $2")
                    .bind(&existing)
                    .bind(&id)
                    .execute(&mut **tx)
                    .await?;
                sqlx::query("DELETE FROM folders WHERE id = $1")
                    .bind(&id)
                    .execute(&mut **tx)
                    .await?;
            }
            None => {
                sqlx::query("UPDATE folders SET owner = $1 WHERE id = $2")
                    .bind(to)
                    .bind(&id)
                    .execute(&mut **tx)
                    .await?;
            }
        }
    }
    let presets: Vec<(String, String)> =
        sqlx::query_as("SELECT id, name FROM presets WHERE owner = $1")
            .bind(from)
            .fetch_all(&mut **tx)
            .await?;
    for (id, name) in presets {
        let mut candidate = name.clone();
        let mut n = 1;
        loop {
            if !name_taken(tx, Named::Preset, to, &candidate, None).await? {
                break;
            }
            n += 1;
            candidate = format!("{name} ({n})");
        }
        sqlx::query("UPDATE presets SET owner = $1, name = $2 WHERE id = $3")
            .bind(to)
            .bind(&candidate)
            .bind(&id)
            .execute(&mut **tx)
            .await?;
    }
    Ok(())
}
