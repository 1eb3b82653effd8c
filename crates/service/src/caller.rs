//! Who is asking.

/// Who is asking, as the layers below the web see it: the owner id their conversations are
/// stored under (a guest's random id or an account's id), whether they are an admin, whether
/// they are a guest (no account), and the client address (per-address bounds for guests, whose
/// owner ids cost nothing to mint). Built by the web layer from the request; every rule below
/// the web layer that depends on who asks takes one of these.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub owner: String,
    pub admin: bool,
    pub guest: bool,
    pub address: Option<std::net::IpAddr>,
}
