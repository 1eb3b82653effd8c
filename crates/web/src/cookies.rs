//! Cookie names and attributes in one place.
//!
//! Over HTTPS (the client's connection, as [`super::client`] decides it) every cookie is named
//! with the `__Host-` prefix: browsers accept such a cookie only when it is `Secure`, has
//! `Path=/` and no `Domain`, so a sibling subdomain cannot set ("toss") one of ours, and a guest
//! cookie planted that way cannot be adopted at sign-up. Over plain HTTP the prefix is not
//! allowed, and the plain names are used. Requests over HTTPS read only the prefixed names.

use std::borrow::Cow;

use actix_web::cookie::{Cookie, CookieBuilder};

/// The guest's signed owner id.
pub const OWNER: &str = "smolchat_owner";
/// An account's session.
pub const SESSION: &str = "smolchat_session";
/// The admin page's session.
pub const ADMIN: &str = "smolchat_admin";

/// The name a cookie has on a connection that is (or is not) HTTPS.
pub fn name(base: &'static str, https: bool) -> Cow<'static, str> {
    if https {
        Cow::Owned(format!("__Host-{base}"))
    } else {
        Cow::Borrowed(base)
    }
}

/// A cookie of ours: its name for the connection, `Path=/` (plain HTTP may narrow it with
/// `path`), HttpOnly, and `Secure` over HTTPS.
pub fn build(
    base: &'static str,
    value: String,
    https: bool,
    path: &'static str,
) -> CookieBuilder<'static> {
    Cookie::build(name(base, https), value)
        .path(if https { "/" } else { path })
        .http_only(true)
        .secure(https)
}

/// A cookie that removes ours of that name.
pub fn removal(base: &'static str, https: bool, path: &'static str) -> Cookie<'static> {
    let mut gone = build(base, String::new(), https, path).finish();
    gone.make_removal();
    gone
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn https_cookies_carry_the_host_prefix_and_its_rules() {
        let c = build(SESSION, "v".into(), true, "/admin").finish();
        assert_eq!(c.name(), "__Host-smolchat_session");
        assert_eq!(c.path(), Some("/"));
        assert_eq!(c.secure(), Some(true));
        assert_eq!(c.domain(), None);
        let plain = build(ADMIN, "v".into(), false, "/admin").finish();
        assert_eq!(plain.name(), "smolchat_admin");
        assert_eq!(plain.path(), Some("/admin"));
        assert_eq!(plain.secure(), Some(false));
    }
}
