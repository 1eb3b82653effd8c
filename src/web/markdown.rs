//! Assistant replies as HTML: CommonMark (pulldown-cmark) and then a whitelist sanitizer
//! (ammonia), so nothing a model (or a prompt-injected user) writes can run script in a page.
//!
//! Raw HTML in the markdown is turned into text before rendering: a model that writes
//! `<img onerror=...>` shows those characters, it does not get an element. Ammonia then removes
//! whatever could still be dangerous (event handlers, `javascript:` URLs, unknown tags) from the
//! generated HTML, which is the guarantee the rest of the page relies on.

use std::collections::HashSet;
use std::sync::OnceLock;

use pulldown_cmark::{html, Event, Options, Parser};

fn sanitizer() -> &'static ammonia::Builder<'static> {
    static CLEANER: OnceLock<ammonia::Builder<'static>> = OnceLock::new();
    CLEANER.get_or_init(|| {
        let mut b = ammonia::Builder::default();
        // Code blocks keep their `language-xyz` class (for a later highlighter); nothing else
        // may carry a class, so message content cannot borrow the page's own styles.
        b.add_tag_attributes("code", ["class"].iter());
        b.url_schemes(HashSet::from(["http", "https", "mailto"]));
        b.link_rel(Some("noopener noreferrer nofollow"));
        b
    })
}

/// Renders markdown to sanitized HTML, safe to insert into a page as is.
pub fn render(markdown: &str) -> String {
    let mut opts = Options::empty();
    opts.insert(Options::ENABLE_TABLES);
    opts.insert(Options::ENABLE_STRIKETHROUGH);
    opts.insert(Options::ENABLE_TASKLISTS);
    let events = Parser::new_ext(markdown, opts).map(|event| match event {
        Event::Html(raw) | Event::InlineHtml(raw) => Event::Text(raw),
        other => other,
    });
    let mut out = String::with_capacity(markdown.len() * 3 / 2);
    html::push_html(&mut out, events);
    sanitizer().clean(&out).to_string()
}

#[cfg(test)]
mod tests {
    use super::render;

    #[test]
    fn markdown_renders_code_and_emphasis() {
        let html = render("**bold** and `x`\n\n```rust\nfn main() {}\n```\n");
        assert!(html.contains("<strong>bold</strong>"), "{html}");
        assert!(html.contains("<code>x</code>"), "{html}");
        assert!(
            html.contains("<pre><code class=\"language-rust\">fn main() {}"),
            "{html}"
        );
    }

    #[test]
    fn raw_html_is_text() {
        let html = render("hi <script>alert(1)</script> <img src=x onerror=alert(1)>");
        assert!(!html.contains("<script"), "{html}");
        assert!(!html.contains("<img"), "{html}");
        assert!(html.contains("&lt;script&gt;"), "{html}");
        let block = render("<div onclick=\"x()\">a</div>\n");
        assert!(!block.contains("<div"), "{block}");
    }

    #[test]
    fn javascript_links_are_dropped() {
        let html = render("[click](javascript:alert(1)) ![i](javascript:alert(2))");
        assert!(!html.contains("javascript:"), "{html}");
        let ok = render("[site](https://example.com)");
        assert!(ok.contains("href=\"https://example.com\""), "{ok}");
        assert!(ok.contains("noopener"), "{ok}");
    }
}
