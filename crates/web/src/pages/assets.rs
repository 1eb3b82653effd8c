//! `GET /static/…`: the CSS, scripts, icons and vendored libraries, compiled into the binary so
//! the app works offline, each with its content type and a cache lifetime.

use super::*;

/// One of KaTeX's fonts (woff2 only: the first format of each `@font-face`, which every browser
/// we serve takes).
macro_rules! katex_font {
    ($name:literal) => {
        (
            concat!("vendor/katex-0.19.1/fonts/KaTeX_", $name, ".woff2"),
            "font/woff2",
            include_bytes!(concat!(
                "../../../../static/vendor/katex-0.19.1/fonts/KaTeX_",
                $name,
                ".woff2"
            )),
        )
    };
}

pub(super) const STATIC_FILES: &[(&str, &str, &[u8])] = &[
    // The installable web app: no service worker (it could serve stale private pages).
    (
        "manifest.webmanifest",
        "application/manifest+json",
        include_bytes!("../../../../static/manifest.webmanifest"),
    ),
    (
        "icons/icon-192.png",
        "image/png",
        include_bytes!("../../../../static/icons/icon-192.png"),
    ),
    (
        "icons/icon-512.png",
        "image/png",
        include_bytes!("../../../../static/icons/icon-512.png"),
    ),
    (
        "icons/icon-maskable-512.png",
        "image/png",
        include_bytes!("../../../../static/icons/icon-maskable-512.png"),
    ),
    (
        "app.css",
        "text/css; charset=utf-8",
        include_bytes!("../../../../static/app.css"),
    ),
    (
        "typeset.js",
        "text/javascript; charset=utf-8",
        include_bytes!("../../../../static/typeset.js"),
    ),
    (
        "chat.js",
        "text/javascript; charset=utf-8",
        include_bytes!("../../../../static/chat.js"),
    ),
    (
        "knowledge.js",
        "text/javascript; charset=utf-8",
        include_bytes!("../../../../static/knowledge.js"),
    ),
    (
        "vendor/htmx-2.0.11.min.js",
        "text/javascript; charset=utf-8",
        include_bytes!("../../../../static/vendor/htmx-2.0.11.min.js"),
    ),
    (
        "vendor/htmx-ext-sse-2.2.4.min.js",
        "text/javascript; charset=utf-8",
        include_bytes!("../../../../static/vendor/htmx-ext-sse-2.2.4.min.js"),
    ),
    (
        "vendor/highlight-11.12.0.min.js",
        "text/javascript; charset=utf-8",
        include_bytes!("../../../../static/vendor/highlight-11.12.0.min.js"),
    ),
    (
        "vendor/katex-0.19.1/katex.min.js",
        "text/javascript; charset=utf-8",
        include_bytes!("../../../../static/vendor/katex-0.19.1/katex.min.js"),
    ),
    (
        "vendor/katex-0.19.1/katex.min.css",
        "text/css; charset=utf-8",
        include_bytes!("../../../../static/vendor/katex-0.19.1/katex.min.css"),
    ),
    katex_font!("AMS-Regular"),
    katex_font!("Caligraphic-Bold"),
    katex_font!("Caligraphic-Regular"),
    katex_font!("Fraktur-Bold"),
    katex_font!("Fraktur-Regular"),
    katex_font!("Main-Bold"),
    katex_font!("Main-BoldItalic"),
    katex_font!("Main-Italic"),
    katex_font!("Main-Regular"),
    katex_font!("Math-BoldItalic"),
    katex_font!("Math-Italic"),
    katex_font!("SansSerif-Bold"),
    katex_font!("SansSerif-Italic"),
    katex_font!("SansSerif-Regular"),
    katex_font!("Script-Regular"),
    katex_font!("Size1-Regular"),
    katex_font!("Size2-Regular"),
    katex_font!("Size3-Regular"),
    katex_font!("Size4-Regular"),
    katex_font!("Typewriter-Regular"),
    (
        "favicon.svg",
        "image/svg+xml",
        include_bytes!("../../../../static/favicon.svg"),
    ),
];

/// `GET /static/{path}`
pub async fn static_file(path: web::Path<String>) -> Result<HttpResponse, WebError> {
    let name = path.into_inner();
    let (_, mime, bytes) = STATIC_FILES
        .iter()
        .find(|(n, _, _)| *n == name)
        .ok_or_else(|| WebError::NotFound(format!("no static file {name:?}")))?;
    Ok(HttpResponse::Ok()
        .content_type(*mime)
        .insert_header((header::X_CONTENT_TYPE_OPTIONS, "nosniff"))
        // Short: our own files change with the binary and have no version in their names.
        .insert_header((header::CACHE_CONTROL, "public, max-age=300"))
        .body(*bytes))
}
