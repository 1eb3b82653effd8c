//! The plain records the services hand out (conversations, messages, users, keys, replicas,
//! list pages), as the store defines them. The web layer names them through here: it never
//! depends on the store, and none of these gives access to it.

pub use smolchat_store::{
    offset_in, ApiKeyRecord, AuditEntry, AuditFilter, Chunk, Collection, Conversation,
    ConversationSettings, ConversationSummary, Cursor, Document, DocumentStatus, FileRecord,
    Folder, ImportedMessage, ListFilter, ListPage, Message, MessageSource, MessageStatus,
    Organisation, OrganisationPatch, PageRequest, Preset, ReplicaRecord, Role, StoredRow, TagCount,
    ToolStep, ToolStepStatus, User, UserOverview, UserRole, MAX_PAGE,
};
