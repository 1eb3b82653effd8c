//! Assistant replies as HTML: CommonMark (pulldown-cmark) and then a whitelist sanitizer
//! (ammonia), so nothing a model (or a prompt-injected user) writes can run script in a page.
//!
//! Raw HTML in the markdown is turned into text before rendering: a model that writes
//! `<img onerror=...>` shows those characters, it does not get an element. Ammonia then removes
//! whatever could still be dangerous (event handlers, `javascript:` URLs, unknown tags) from the
//! generated HTML, which is the guarantee the rest of the page relies on.
//!
//! Math: `$…$` and `$$…$$` (pulldown-cmark's math extension), and `\(…\)` and `\[…\]` (turned
//! into the dollar forms first, outside code), become `<span class="math math-inline|display">`
//! holding the TeX as escaped text; the page's script typesets them with the vendored KaTeX.
//! Code blocks keep their `language-xyz` class for the page's vendored highlighter. Neither
//! needs markup from the model: both work on text the sanitizer already let through.
//!
//! [`LiveMarkdown`] renders a reply while it streams: finished blocks once, the open block on
//! each new piece of text.
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
        // Math spans (typeset by the page), and nothing else a span could borrow.
        b.add_allowed_classes("span", ["math", "math-inline", "math-display"].iter());
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
    opts.insert(Options::ENABLE_MATH);
    let markdown = &bracket_math_to_dollars(markdown);
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

/// Rewrites `\(x\)` as `$x$` and `\[x\]` as `$$x$$` outside code spans and fenced code, so
/// pulldown-cmark's math extension (dollars only) sees the LaTeX delimiters models also write.
/// The contents are trimmed: `$ x $` is not math to the extension. Unclosed openers stay as they
/// are.
fn bracket_math_to_dollars(markdown: &str) -> std::borrow::Cow<'_, str> {
    if !markdown.contains("\\(") && !markdown.contains("\\[") {
        return markdown.into();
    }
    let text = markdown;
    let mut out = String::with_capacity(text.len());
    let bytes = text.as_bytes();
    let mut i = 0;
    let mut line_start = true;
    let mut fence: Option<(u8, usize)> = None;
    while i < bytes.len() {
        if line_start {
            let end = text[i..].find('\n').map_or(text.len(), |n| i + n + 1);
            let line = &text[i..end];
            let skip = match fence {
                Some(f) => {
                    if closes_fence(line, f) {
                        fence = None;
                    }
                    true
                }
                None => match opens_fence(line) {
                    Some(f) => {
                        fence = Some(f);
                        true
                    }
                    None => false,
                },
            };
            if skip {
                out.push_str(line);
                i = end;
                continue;
            }
            line_start = false;
        }
        let c = bytes[i];
        if c == b'\n' {
            line_start = true;
            out.push('\n');
            i += 1;
        } else if c == b'`' {
            // A code span: copied as is up to its closing run of as many backticks.
            let run = bytes[i..].iter().take_while(|&&b| b == b'`').count();
            let ticks = &text[i..i + run];
            match text[i + run..].find(ticks) {
                Some(n) => {
                    let end = i + run + n + run;
                    out.push_str(&text[i..end]);
                    line_start = text[i..end].ends_with('\n');
                    i = end;
                }
                None => {
                    out.push_str(ticks);
                    i += run;
                }
            }
        } else if c == b'\\' && matches!(bytes.get(i + 1), Some(b'(') | Some(b'[')) {
            let (close, dollars) = if bytes[i + 1] == b'(' {
                ("\\)", "$")
            } else {
                ("\\]", "$$")
            };
            match text[i + 2..].find(close) {
                Some(n) if !text[i + 2..i + 2 + n].trim().is_empty() => {
                    let inner = text[i + 2..i + 2 + n].trim();
                    out.push_str(dollars);
                    out.push_str(inner);
                    out.push_str(dollars);
                    i += 2 + n + 2;
                }
                _ => {
                    out.push_str(&text[i..i + 2]);
                    i += 2;
                }
            }
        } else {
            let ch = text[i..].chars().next().unwrap_or('\u{fffd}');
            out.push(ch);
            i += ch.len_utf8().max(1);
        }
    }
    out.into()
}

/// `Some((fence char, run length))` when `line` opens a fenced code block.
fn opens_fence(line: &str) -> Option<(u8, usize)> {
    let t = line.trim_start_matches(' ');
    if line.len() - t.len() > 3 {
        return None;
    }
    let c = *t.as_bytes().first()?;
    if c != b'`' && c != b'~' {
        return None;
    }
    let run = t.bytes().take_while(|&b| b == c).count();
    if run < 3 || (c == b'`' && t[run..].contains('`')) {
        return None;
    }
    Some((c, run))
}

/// Whether `line` closes a fence opened by `(char, run)`.
fn closes_fence(line: &str, (c, run): (u8, usize)) -> bool {
    let t = line.trim_start_matches(' ');
    if line.len() - t.len() > 3 {
        return false;
    }
    let n = t.bytes().take_while(|&b| b == c).count();
    n >= run && t[n..].trim().is_empty()
}

/// A reply rendered while it streams. The text is cut into blocks at blank lines outside fenced
/// code: the blocks before the last such cut are rendered once and never again ([`LiveUpdate::
/// blocks`]); the open block after it is rendered on each push ([`LiveUpdate::tail`]), an
/// unclosed code fence as a code block to the end. So each piece of text costs the rendering
/// of the open block, not of the whole reply. Everything goes through [`render`]: the page
/// never gets HTML the sanitizer has not seen. The finished reply is rendered whole by the page
/// afterwards (a list split by blank lines renders as consecutive lists meanwhile).
#[derive(Debug, Default)]
pub struct LiveMarkdown {
    text: String,
    /// Bytes of `text` already sent as finished blocks.
    done: usize,
    /// Bytes of `text` scanned for cuts (whole lines only).
    scanned: usize,
    /// The fenced code block open at `scanned`.
    fence: Option<(u8, usize)>,
}

/// What a push adds to the page: finished blocks to append, and the open block to show in
/// place of the previous one.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LiveUpdate {
    pub blocks: String,
    pub tail: String,
}

impl LiveMarkdown {
    /// Appends streamed text and says what changed.
    pub fn push(&mut self, piece: &str) -> LiveUpdate {
        self.text.push_str(piece);
        let mut cut = self.done;
        while let Some(n) = self.text[self.scanned..].find('\n') {
            let line = &self.text[self.scanned..self.scanned + n + 1];
            match self.fence {
                Some(f) => {
                    if closes_fence(line, f) {
                        self.fence = None;
                    }
                }
                None => {
                    if let Some(f) = opens_fence(line) {
                        self.fence = Some(f);
                    } else if line.trim().is_empty() {
                        cut = self.scanned + n + 1;
                    }
                }
            }
            self.scanned += n + 1;
        }
        let blocks = if cut > self.done {
            let html = render(&self.text[self.done..cut]);
            self.done = cut;
            html
        } else {
            String::new()
        };
        LiveUpdate {
            blocks,
            tail: render(&self.text[self.done..]),
        }
    }

    /// Ends the text so far (a tool call comes next): whatever was not yet a finished block
    /// becomes one, and the next text starts a new one. The HTML of that last block.
    pub fn flush(&mut self) -> String {
        let html = if self.done < self.text.len() {
            render(&self.text[self.done..])
        } else {
            String::new()
        };
        *self = LiveMarkdown::default();
        html
    }
}

#[cfg(test)]
mod tests {
    use super::{render, LiveMarkdown};

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

    #[test]
    fn math_in_all_four_delimiters_becomes_math_spans() {
        let html = render(
            "Euler: $e^{i\\pi}+1=0$ and \\(a^2\\)\n\n$$\\int_0^1 x\\,dx$$\n\n\\[ b < c \\]\n",
        );
        assert_eq!(
            html.matches("class=\"math math-inline\"").count(),
            2,
            "{html}"
        );
        assert_eq!(
            html.matches("class=\"math math-display\"").count(),
            2,
            "{html}"
        );
        assert!(html.contains("e^{i\\pi}+1=0"), "{html}");
        assert!(html.contains("b &lt; c"), "{html}");
        // Not in code: a code span and a fenced block keep their backslashes.
        let code = render("`\\(x\\)` and\n\n```\n\\[y\\]\n```\n");
        assert!(!code.contains("math"), "{code}");
        assert!(
            code.contains("\\(x\\)") && code.contains("\\[y\\]"),
            "{code}"
        );
        // A span may not carry any other class.
        assert!(!render("hi").contains("class"));
    }

    #[test]
    fn live_rendering_sends_finished_blocks_once_and_the_open_block_each_time() {
        let reply = "Here is code:\n\n```rust\nfn main() {\n\n    let x = 1;\n}\n```\n\nThe sum $a+b$ is done.\n";
        let mut live = LiveMarkdown::default();
        let mut blocks = String::new();
        let mut last_tail = String::new();
        let mut saw_open_code = false;
        // Fed a few bytes at a time, as tokens come.
        let mut rest = reply;
        while !rest.is_empty() {
            let mut n = 3.min(rest.len());
            while !rest.is_char_boundary(n) {
                n += 1;
            }
            let u = live.push(&rest[..n]);
            rest = &rest[n..];
            blocks.push_str(&u.blocks);
            saw_open_code |= u.tail.contains("<code class=\"language-rust\">fn main");
            last_tail = u.tail;
        }
        // The blank line inside the fence did not cut the code block in two.
        assert!(saw_open_code, "the open code block was shown as code");
        assert_eq!(blocks.matches("<pre>").count(), 1, "{blocks}");
        assert!(blocks.contains("let x = 1;"), "{blocks}");
        assert!(blocks.starts_with("<p>Here is code:</p>"), "{blocks}");
        // The last paragraph is still the open block; blocks + tail is the whole render.
        assert!(last_tail.contains("math math-inline"), "{last_tail}");
        assert_eq!(format!("{blocks}{last_tail}"), render(reply));
    }

    #[test]
    fn live_rendering_never_lets_markup_through() {
        let mut live = LiveMarkdown::default();
        let mut seen = String::new();
        for piece in [
            "<img src=x one",
            "rror=alert(1)> <scr",
            "ipt>alert(2)</script>\n\n[a](java",
            "script:alert(3))\n",
        ] {
            let u = live.push(piece);
            seen.push_str(&u.blocks);
            seen.push_str(&u.tail);
        }
        assert!(
            !seen.contains("<img") && !seen.contains("<script") && !seen.contains("javascript:"),
            "{seen}"
        );
    }
}
