// Replies' code highlighted and their math typeset, in the chat and on share pages, from the
// sanitized HTML: the server marks code blocks with `language-x` and math with `span.math`
// holding the TeX as text (web/markdown.rs). Both libraries (vendored highlight.js and KaTeX)
// write only their own escaped markup, KaTeX with `trust` off (no links, no HTML), and both work
// through the DOM, so the page's CSP needs no inline styles. Idempotent: done elements are
// marked (`.hljs`, `.typeset`) and skipped.
(function () {
  "use strict";
  if (window.hljs) hljs.configure({ ignoreUnescapedHTML: true });
  function typeset(root) {
    if (window.hljs) {
      root.querySelectorAll(".md pre code:not(.hljs)").forEach((code) => {
        try { hljs.highlightElement(code); } catch (_) { /* stays plain */ }
      });
    }
    if (window.katex) {
      root.querySelectorAll(".md span.math:not(.typeset)").forEach((m) => {
        try {
          katex.render(m.textContent, m, { displayMode: m.classList.contains("math-display"), throwOnError: false, trust: false });
        } catch (_) { /* the TeX stays as text */ }
        m.classList.add("typeset");
      });
    }
  }
  window.smolchatTypeset = typeset;
  typeset(document);
})();
