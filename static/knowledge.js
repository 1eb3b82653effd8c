// The knowledge page: create and delete collections, add and remove documents, and watch
// their indexing (through /api/knowledge; the page itself is rendered by the server).
(() => {
  const root = document.getElementById("knowledge");
  if (!root) return;
  const csrf = document.body.dataset.csrf;
  const message = document.getElementById("kb-message");
  const say = (text) => { message.textContent = text; };
  async function api(method, path, body, type) {
    const headers = { "x-csrf-token": csrf };
    if (type) headers["content-type"] = type;
    const r = await fetch(path, { method, credentials: "same-origin", headers, body });
    if (!r.ok) {
      const text = await r.text();
      let why = text;
      try { why = JSON.parse(text).error.message || text; } catch (_) { /* not JSON */ }
      throw new Error(why);
    }
    return r.status === 204 ? null : r.json();
  }
  const collectionOf = (el) => el.closest("section.collection").dataset.id;

  document.getElementById("new-collection").addEventListener("submit", async (e) => {
    e.preventDefault();
    const name = e.target.elements.name.value;
    try {
      await api("POST", "/api/knowledge", JSON.stringify({ name }), "application/json");
      location.reload();
    } catch (err) { say(err.message); }
  });

  root.addEventListener("change", async (e) => {
    const input = e.target.closest("input.kb-upload");
    if (!input) return;
    const id = collectionOf(input);
    for (const file of input.files) {
      say(`Adding ${file.name}…`);
      try {
        await api("POST", `/api/knowledge/${id}/documents?name=${encodeURIComponent(file.name)}`, file, "application/octet-stream");
      } catch (err) { say(`${file.name}: ${err.message}`); return; }
    }
    location.reload();
  });

  root.addEventListener("click", async (e) => {
    const del = e.target.closest(".kb-delete");
    const rm = e.target.closest(".kb-remove");
    try {
      if (del && confirm("Delete this collection and its documents?")) {
        await api("DELETE", `/api/knowledge/${collectionOf(del)}`);
        location.reload();
      } else if (rm) {
        const row = rm.closest("tr");
        await api("DELETE", `/api/knowledge/${collectionOf(rm)}/documents/${row.dataset.doc}`);
        row.remove();
      }
    } catch (err) { say(err.message); }
  });

  // Indexing runs in the background: the rows say where each document stands until it ends.
  const open = () => [...root.querySelectorAll("tr[data-status=pending], tr[data-status=indexing]")];
  async function poll() {
    const ids = new Set(open().map(collectionOf));
    for (const id of ids) {
      try {
        const got = await api("GET", `/api/knowledge/${id}`);
        for (const d of got.documents) {
          const row = root.querySelector(`tr[data-doc="${d.id}"]`);
          if (!row) continue;
          row.dataset.status = d.status;
          row.querySelector(".kb-status").textContent =
            d.status === "indexing" ? `indexing: ${d.embedded} of ${d.chunks} passages`
            : d.status === "ready" ? `ready: ${d.chunks} passages`
            : d.status === "failed" ? `failed: ${d.error || ""}` : "waiting";
        }
      } catch (err) { say(err.message); }
    }
    if (open().length) setTimeout(poll, 1000);
  }
  if (open().length) setTimeout(poll, 500);
})();
