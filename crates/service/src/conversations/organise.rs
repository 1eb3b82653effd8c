//! Organising an owner's conversations (folders, pins, archive, tags) and system-prompt presets:
//! the checks on names and sizes, and who may change what. The store keeps every statement to
//! the owner, so another owner's conversation, folder or preset is "not found" here, never
//! "forbidden".

use uuid::Uuid;

use super::{invalid, ConversationError, Conversations, Result};
use crate::caller::Caller;
use crate::validation::not_text;
use smolchat_store::{Folder, Organisation, OrganisationPatch, Preset, StoreError, TagCount};

/// The longest folder, tag and preset name, in characters.
pub const NAME_MAX_CHARS: usize = 64;
/// The longest tag, in characters.
pub const TAG_MAX_CHARS: usize = 32;
/// Tags on one conversation.
pub const MAX_TAGS: usize = 16;
/// Folders one owner may have.
pub const MAX_FOLDERS: usize = 200;
/// Presets one owner may have, and shared presets in all.
pub const MAX_PRESETS: i64 = 100;

/// A trimmed name of 1 to `limit` characters of text, or why not.
fn checked_name(field: &'static str, what: &str, name: &str, limit: usize) -> Result<String> {
    let name = name.trim();
    if name.is_empty() {
        return Err(invalid(
            field,
            format!("`{field}`: the {what} needs a name"),
        ));
    }
    let chars = name.chars().count();
    if chars > limit {
        return Err(invalid(
            field,
            format!("`{field}`: the {what} name has {chars} characters; the limit is {limit}"),
        ));
    }
    if let Some(c) = name.chars().find(|c| c.is_control()) {
        return Err(invalid(
            field,
            format!(
                "`{field}`: the {what} name contains the control character U+{:04X}; names are \
                 one line of text",
                c as u32
            ),
        ));
    }
    if let Some(bad) = not_text(name) {
        return Err(invalid(
            field,
            format!("`{field}`: the {what} name contains {bad}, which is not text; remove it"),
        ));
    }
    Ok(name.to_string())
}

/// Tags as stored: trimmed, lower case, no duplicates, each checked.
fn checked_tags(tags: &[String]) -> Result<Vec<String>> {
    let mut out: Vec<String> = Vec::with_capacity(tags.len());
    for tag in tags {
        let tag = checked_name("tags", "tag", tag, TAG_MAX_CHARS)?.to_lowercase();
        if tag.contains(',') {
            return Err(invalid(
                "tags",
                format!("`tags`: {tag:?} contains a comma; give each tag on its own"),
            ));
        }
        if !out.contains(&tag) {
            out.push(tag);
        }
    }
    if out.len() > MAX_TAGS {
        return Err(invalid(
            "tags",
            format!(
                "`tags`: {} tags; a conversation may have at most {MAX_TAGS}",
                out.len()
            ),
        ));
    }
    out.sort();
    Ok(out)
}

/// A store refusal of a name, as the field's error.
fn name_error(field: &'static str, e: StoreError) -> ConversationError {
    match e {
        StoreError::NameTaken { .. } => invalid(field, format!("`{field}`: {e}")),
        StoreError::FolderNotFound(id) => ConversationError::NoSuch(format!(
            "you have no folder {id}; list yours with GET /api/folders"
        )),
        other => other.into(),
    }
}

/// An import's organisation, checked: the patch (without its folder) and the folder's name.
pub(super) fn checked_import(
    o: &super::ExportedOrganisation,
) -> Result<(OrganisationPatch, Option<String>)> {
    let folder = o
        .folder
        .as_deref()
        .map(|f| checked_name("organisation.folder", "folder", f, NAME_MAX_CHARS))
        .transpose()?;
    let tags = checked_tags(&o.tags).map_err(|e| match e {
        ConversationError::Invalid { message, .. } => {
            invalid("organisation.tags", format!("organisation: {message}"))
        }
        other => other,
    })?;
    Ok((
        OrganisationPatch {
            pinned: Some(o.pinned),
            archived: Some(o.archived),
            folder: None,
            tags: Some(tags),
        },
        folder,
    ))
}

impl Conversations {
    /// Files an imported conversation: in the caller's folder named `folder` (made when they
    /// have none by that name), pinned, archived and tagged as exported.
    pub(super) async fn organise_import(
        &self,
        caller: &Caller,
        id: Uuid,
        mut patch: OrganisationPatch,
        folder: Option<&str>,
    ) -> Result<()> {
        if let Some(name) = folder {
            let existing = self
                .store
                .folders(&caller.owner)
                .await?
                .into_iter()
                .find(|f| f.name == name);
            let folder = match existing {
                Some(f) => f,
                None => self.create_folder(caller, name).await?,
            };
            patch.folder = Some(Some(folder.id));
        }
        self.store
            .organise(&caller.owner, id, &patch)
            .await
            .map_err(|e| name_error("organisation.folder", e))?;
        Ok(())
    }

    /// How the caller's conversation `id` is organised.
    pub async fn organisation(&self, caller: &Caller, id: Uuid) -> Result<Organisation> {
        self.owned(caller, id).await?;
        self.store
            .organisation(id)
            .await?
            .ok_or(ConversationError::NotFound)
    }

    /// Pins, archives, files or tags the caller's conversation `id` (fields left `None` keep
    /// their value; `tags` replaces the set).
    pub async fn organise(
        &self,
        caller: &Caller,
        id: Uuid,
        mut patch: OrganisationPatch,
    ) -> Result<Organisation> {
        if let Some(tags) = &patch.tags {
            patch.tags = Some(checked_tags(tags)?);
        }
        self.store
            .organise(&caller.owner, id, &patch)
            .await
            .map_err(|e| name_error("folder_id", e))?
            .ok_or(ConversationError::NotFound)
    }

    /// The caller's folders by name.
    pub async fn folders(&self, caller: &Caller) -> Result<Vec<Folder>> {
        Ok(self.store.folders(&caller.owner).await?)
    }

    /// A new folder of the caller's.
    pub async fn create_folder(&self, caller: &Caller, name: &str) -> Result<Folder> {
        let name = checked_name("name", "folder", name, NAME_MAX_CHARS)?;
        if self.store.folders(&caller.owner).await?.len() >= MAX_FOLDERS {
            return Err(invalid(
                "name",
                format!("you have {MAX_FOLDERS} folders, the most one may have; delete one first"),
            ));
        }
        self.store
            .create_folder(&caller.owner, &name)
            .await
            .map_err(|e| name_error("name", e))
    }

    /// Renames the caller's folder `id`.
    pub async fn rename_folder(&self, caller: &Caller, id: Uuid, name: &str) -> Result<()> {
        let name = checked_name("name", "folder", name, NAME_MAX_CHARS)?;
        match self.store.rename_folder(&caller.owner, id, &name).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(ConversationError::NoSuch(format!(
                "you have no folder {id}"
            ))),
            Err(e) => Err(name_error("name", e)),
        }
    }

    /// Deletes the caller's folder `id`; its conversations stay, outside any folder.
    pub async fn delete_folder(&self, caller: &Caller, id: Uuid) -> Result<()> {
        if self.store.delete_folder(&caller.owner, id).await? {
            Ok(())
        } else {
            Err(ConversationError::NoSuch(format!(
                "you have no folder {id}"
            )))
        }
    }

    /// The tags on the caller's conversations, with counts.
    pub async fn tags(&self, caller: &Caller) -> Result<Vec<TagCount>> {
        Ok(self.store.tags(&caller.owner).await?)
    }

    /// The presets the caller can use: the shared ones, then their own.
    pub async fn presets(&self, caller: &Caller) -> Result<Vec<Preset>> {
        Ok(self.store.presets(&caller.owner).await?)
    }

    /// Checks a preset's prompt against the system-prompt limits.
    fn checked_preset_prompt(&self, prompt: &str) -> Result<()> {
        let limit = self.cfg.settings_limits.max_prompt_chars;
        let chars = prompt.chars().count();
        if prompt.trim().is_empty() {
            return Err(invalid(
                "system_prompt",
                "`system_prompt`: a preset needs a system prompt",
            ));
        }
        if chars > limit {
            return Err(invalid(
                "system_prompt",
                format!("`system_prompt` has {chars} characters; the limit is {limit}"),
            ));
        }
        if let Some(bad) = not_text(prompt) {
            return Err(invalid(
                "system_prompt",
                format!("`system_prompt` contains {bad}, which is not text; remove it"),
            ));
        }
        Ok(())
    }

    /// A new preset: the caller's own, or (`shared`, admins only) everyone's.
    pub async fn create_preset(
        &self,
        caller: &Caller,
        name: &str,
        system_prompt: &str,
        shared: bool,
    ) -> Result<Preset> {
        if shared && !caller.admin {
            return Err(ConversationError::Forbidden(
                "only admins make shared presets; leave `shared` out to make one of your own"
                    .into(),
            ));
        }
        let name = checked_name("name", "preset", name, NAME_MAX_CHARS)?;
        self.checked_preset_prompt(system_prompt)?;
        let owner = (!shared).then_some(caller.owner.as_str());
        if self.store.count_presets(owner).await? >= MAX_PRESETS {
            return Err(invalid(
                "name",
                format!(
                    "there are {MAX_PRESETS} presets already, the most allowed; delete one first"
                ),
            ));
        }
        self.store
            .create_preset(owner, &name, system_prompt)
            .await
            .map_err(|e| name_error("name", e))
    }

    /// Whose preset `id` is, for a change by the caller: `Some(owner)` for their own, `None`
    /// for a shared one (admins only).
    async fn preset_owner<'a>(&self, caller: &'a Caller, id: Uuid) -> Result<Option<&'a str>> {
        let preset = self
            .store
            .preset(&caller.owner, id)
            .await?
            .ok_or_else(|| ConversationError::NoSuch(format!("there is no preset {id}")))?;
        if !preset.shared {
            return Ok(Some(caller.owner.as_str()));
        }
        if !caller.admin {
            return Err(ConversationError::Forbidden(format!(
                "preset {:?} is shared with everyone; only admins change it",
                preset.name
            )));
        }
        Ok(None)
    }

    /// Renames and rewrites preset `id` (the caller's, or a shared one for an admin).
    pub async fn update_preset(
        &self,
        caller: &Caller,
        id: Uuid,
        name: &str,
        system_prompt: &str,
    ) -> Result<()> {
        let name = checked_name("name", "preset", name, NAME_MAX_CHARS)?;
        self.checked_preset_prompt(system_prompt)?;
        let owner = self.preset_owner(caller, id).await?;
        match self
            .store
            .update_preset(owner, id, &name, system_prompt)
            .await
        {
            Ok(true) => Ok(()),
            Ok(false) => Err(ConversationError::NoSuch(format!(
                "there is no preset {id}"
            ))),
            Err(e) => Err(name_error("name", e)),
        }
    }

    /// Deletes preset `id` (the caller's, or a shared one for an admin).
    pub async fn delete_preset(&self, caller: &Caller, id: Uuid) -> Result<()> {
        let owner = self.preset_owner(caller, id).await?;
        if self.store.delete_preset(owner, id).await? {
            Ok(())
        } else {
            Err(ConversationError::NoSuch(format!(
                "there is no preset {id}"
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_are_trimmed_lowercased_deduplicated_and_bounded() {
        let tags = checked_tags(&["  Rust ".into(), "rust".into(), "DB".into()]).unwrap();
        assert_eq!(tags, vec!["db".to_string(), "rust".to_string()]);
        assert!(checked_tags(&["".into()]).is_err());
        assert!(checked_tags(&["a,b".into()]).is_err());
        assert!(checked_tags(&["x".repeat(TAG_MAX_CHARS + 1)]).is_err());
        let many: Vec<String> = (0..=MAX_TAGS).map(|i| format!("t{i}")).collect();
        assert!(checked_tags(&many).is_err());
        assert!(checked_tags(&["bell\u{7}".into()]).is_err());
    }

    #[test]
    fn names_are_trimmed_and_checked() {
        assert_eq!(
            checked_name("name", "folder", " Work ", 64).unwrap(),
            "Work"
        );
        assert!(checked_name("name", "folder", "   ", 64).is_err());
        assert!(checked_name("name", "folder", &"x".repeat(65), 64).is_err());
    }
}
