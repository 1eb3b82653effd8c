//! Assistant replies as HTML: CommonMark (pulldown-cmark) and then a whitelist sanitizer
//! (ammonia), so nothing a model (or a prompt-injected user) writes can run script in a page.
//!
//! Raw HTML in the markdown is turned into text before rendering: a model that writes
//! `<img onerror=...>` shows those characters, it does not get an element. Ammonia then removes
//! whatever could still be dangerous (event handlers, `javascript:` URLs, unknown tags) from the
//! generated HTML, which is the guarantee the rest of the page relies on.
//!
//! Nesting is bounded: `>` repeated a hundred thousand times is that many nested blockquotes,
//! and the HTML sanitizer's work grows with the square of the depth (a single imported message
//! once held a page worker for a minute). Elements deeper than [`MAX_NESTING`] are flattened
//! into their parent (their text stays, their tags go), so rendering is linear in the text.

use std::collections::HashSet;
use std::sync::OnceLock;

use pulldown_cmark::{html, Event, Options, Parser};

/// The deepest element nesting rendered (blockquotes, lists, emphasis, links…): far more than
/// any reply needs, few enough that sanitizing stays cheap.
pub const MAX_NESTING: usize = 16;
/// Markdown longer than this (bytes) is shown as plain text: replies and imports are bounded
/// well below it, so only a message from elsewhere would reach it.
pub const MAX_MARKDOWN_BYTES: usize = 1 << 20;

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

/// Renders markdown to sanitized HTML, safe to insert into a page as is. Linear in the text
/// (see the module documentation); CPU work all the same, so pages call it off the event loop.
pub fn render(markdown: &str) -> String {
    if markdown.len() > MAX_MARKDOWN_BYTES {
        let mut out = String::from("<pre>");
        // A lone text event is written escaped.
        html::push_html(&mut out, std::iter::once(Event::Text(markdown.into())));
        out.push_str("</pre>");
        return out;
    }
    let mut opts = Options::empty();
    opts.insert(Options::ENABLE_TABLES);
    opts.insert(Options::ENABLE_STRIKETHROUGH);
    opts.insert(Options::ENABLE_TASKLISTS);
    // For each open element, whether its tags are kept (false: flattened, too deep).
    let mut open: Vec<bool> = Vec::new();
    let mut depth = 0usize;
    let events = Parser::new_ext(markdown, opts).filter_map(move |event| match event {
        Event::Html(raw) | Event::InlineHtml(raw) => Some(Event::Text(raw)),
        Event::Start(tag) => {
            let keep = depth < MAX_NESTING;
            open.push(keep);
            if keep {
                depth += 1;
            }
            keep.then_some(Event::Start(tag))
        }
        Event::End(tag) => {
            let keep = open.pop().unwrap_or(true);
            if keep {
                depth = depth.saturating_sub(1);
            }
            keep.then_some(Event::End(tag))
        }
        other => Some(other),
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
    fn deep_nesting_is_flattened_and_the_text_kept() {
        let deep = ">".repeat(120_000) + " the end";
        let html = render(&deep);
        assert_eq!(html.matches("<blockquote>").count(), super::MAX_NESTING);
        assert_eq!(html.matches("</blockquote>").count(), super::MAX_NESTING);
        assert!(html.contains("the end"), "{html}");
        // Emphasis and lists too; shallow markdown is untouched.
        let stars = format!("{}x{}", "*".repeat(500), "*".repeat(500));
        let _ = render(&stars);
        let list = (0..100)
            .map(|i| format!("{}- item {i}\n", "  ".repeat(i)))
            .collect::<String>();
        let html = render(&list);
        assert!(html.matches("<ul>").count() <= super::MAX_NESTING, "{html}");
        assert!(html.contains("item 99"));
        assert_eq!(
            render("> a\n> > b\n"),
            "<blockquote>\n<p>a</p>\n<blockquote>\n<p>b</p>\n</blockquote>\n</blockquote>\n"
        );
    }

    #[test]
    fn oversized_markdown_is_plain_escaped_text() {
        let big = format!("<b>{}</b>", "x".repeat(super::MAX_MARKDOWN_BYTES));
        let html = render(&big);
        assert!(html.starts_with("<pre>&lt;b&gt;"), "{}", &html[..40]);
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
