// smolchat's page script: the composer, the live reply stream, copy buttons and error toasts.
// No framework: the server renders everything; this only streams text in and swaps in the
// server-rendered (sanitized) message when a reply is done. Text from the server is only ever
// inserted with textContent, never as HTML, except the server-rendered fragments.
(function () {
  "use strict";
  const csrf = document.body.dataset.csrf || "";

  function toast(text, kind) {
    const box = document.getElementById("toasts");
    if (!box) return;
    const t = document.createElement("div");
    t.className = "toast" + (kind ? " " + kind : "");
    t.setAttribute("role", "alert");
    t.textContent = text;
    box.appendChild(t);
    // Kept after the toast fades, for whoever looks later (the browser tests do).
    if (kind !== "ok") document.body.dataset.lastError = text;
    setTimeout(() => t.remove(), 8000);
  }

  // Error responses are small HTML documents with an `.alert` (see pages.rs).
  function errorText(status, body) {
    try {
      const doc = new DOMParser().parseFromString(body, "text/html");
      const alert = doc.querySelector(".alert");
      if (alert && alert.textContent.trim()) return alert.textContent.trim();
    } catch (_) { /* fall through */ }
    return "request failed (" + status + ")";
  }

  function streamReady() {
    return Promise.race([streamOpen, new Promise((resolve) => setTimeout(resolve, 5000))]);
  }

  async function post(url, fields, method) {
    const body = new URLSearchParams(fields || {});
    const res = await fetch(url, {
      method: method || "POST",
      headers: { "X-CSRF-Token": csrf, "Content-Type": "application/x-www-form-urlencoded" },
      body: body,
      credentials: "same-origin",
    });
    if (!res.ok) {
      const text = errorText(res.status, await res.text());
      const err = new Error(text);
      err.status = res.status;
      throw err;
    }
    return res;
  }

  // The JSON API (folders, tags, presets, organising): errors are {"error": {"message"}}.
  async function api(method, url, body) {
    const res = await fetch(url, {
      method: method,
      headers: { "X-CSRF-Token": csrf, "Content-Type": "application/json" },
      body: body === undefined ? undefined : JSON.stringify(body),
      credentials: "same-origin",
    });
    if (!res.ok) {
      let text = "request failed (" + res.status + ")";
      try { text = (await res.json()).error.message || text; } catch (_) { /* keep it */ }
      const err = new Error(text);
      err.status = res.status;
      throw err;
    }
    return res.status === 204 ? null : res.json();
  }

  // The sidebar's list again, in the view it shows.
  function refreshList() {
    if (!window.htmx) return;
    const view = document.getElementById("conv-view");
    const search = document.getElementById("search");
    const q = new URLSearchParams({ active: document.getElementById("app") ? document.getElementById("app").dataset.conversation || "" : "" });
    if (view && view.value) q.set("view", view.value);
    if (search && search.value) q.set("q", search.value);
    htmx.ajax("GET", "/conversations?" + q.toString(), { target: "#conv-list", swap: "innerHTML" });
  }

  function explain(err) {
    if (err.status === 503) toast("The server is busy right now: " + err.message, "");
    else toast(err.message, "");
  }

  document.addEventListener("htmx:responseError", (e) => {
    const xhr = e.detail.xhr;
    toast(errorText(xhr.status, xhr.responseText));
  });
  document.addEventListener("htmx:sendError", () => toast("The server cannot be reached."));

  // Highlighted code and typeset math: static/typeset.js (shared with the share page).
  function typeset(root) { if (window.smolchatTypeset) window.smolchatTypeset(root); }
  // Copy buttons on code blocks (added client-side: the sanitized HTML carries no buttons).
  function enhance(root) {
    typeset(root);
    root.querySelectorAll(".md pre").forEach((pre) => {
      if (pre.querySelector(".copy-btn")) return;
      const b = document.createElement("button");
      b.type = "button";
      b.className = "copy-btn";
      b.textContent = "Copy";
      pre.appendChild(b);
    });
  }
  async function copyText(text) {
    try {
      await navigator.clipboard.writeText(text);
    } catch (_) {
      const ta = document.createElement("textarea");
      ta.value = text;
      document.body.appendChild(ta);
      ta.select();
      document.execCommand("copy");
      ta.remove();
    }
  }
  // Copy buttons: on code blocks, and on every message (its text as shown).
  document.addEventListener("click", async (e) => {
    const b = e.target.closest(".copy-btn, .msg-copy-btn");
    if (!b) return;
    let text;
    if (b.classList.contains("copy-btn")) {
      text = (b.parentElement.querySelector("code") || b.parentElement).textContent;
    } else {
      const m = b.closest(".msg");
      const body = m && (m.querySelector(".md") || m.querySelector(".text"));
      text = body ? (body.classList.contains("md") ? body.innerText : body.textContent).trim() : "";
    }
    await copyText(text);
    b.textContent = "Copied";
    setTimeout(() => (b.textContent = "Copy"), 1500);
  });
  enhance(document);

  // A citation [n] opens the passage it names, under its reply's sources.
  document.addEventListener("click", (e) => {
    const a = e.target.closest("a.cite");
    if (!a) return;
    const item = document.getElementById(a.getAttribute("href").slice(1));
    if (!item) return;
    e.preventDefault();
    const list = item.closest("details.sources");
    if (list) list.open = true;
    const one = item.querySelector("details.source");
    if (one) one.open = true;
    item.scrollIntoView({ block: "nearest" });
    item.classList.add("flash");
    setTimeout(() => item.classList.remove("flash"), 1500);
  });

  // Times in the browser's own zone (the server writes them in UTC, saying so).
  function localTimes(root) {
    root.querySelectorAll("time[datetime]").forEach((t) => {
      const d = new Date(t.getAttribute("datetime"));
      if (isNaN(d)) return;
      t.textContent = d.toLocaleString(undefined, { month: "short", day: "numeric", hour: "2-digit", minute: "2-digit" });
      t.title = d.toString();
    });
  }
  localTimes(document);
  document.addEventListener("htmx:afterSwap", (e) => localTimes(e.target));

  const app = document.getElementById("app");
  if (!app) return; // admin and error pages

  // Import: the chosen file (a conversation exported as JSON) goes to the JSON API as it is;
  // the server checks everything and answers with the new conversation, which is then opened.
  const importFile = document.getElementById("import-file");
  if (importFile) {
    importFile.addEventListener("change", async () => {
      const file = importFile.files && importFile.files[0];
      const out = document.getElementById("import-status");
      if (!file) return;
      if (out) out.textContent = "Importing…";
      try {
        const res = await fetch("/api/conversations/import", {
          method: "POST",
          headers: { "Content-Type": "application/json" },
          body: await file.text(),
          credentials: "same-origin",
        });
        const body = await res.json().catch(() => ({}));
        if (res.status === 201 && body.id) {
          window.location.href = "/c/" + body.id;
          return;
        }
        const why = (body.error && body.error.message) || "the import failed (" + res.status + ")";
        if (out) out.textContent = "";
        toast(why);
      } catch (e) {
        if (out) out.textContent = "";
        toast("the import failed: " + e);
      }
      importFile.value = "";
    });
  }
  const convId = app.dataset.conversation;
  const messages = document.getElementById("messages");
  const form = document.getElementById("composer");
  const input = document.getElementById("input");
  const sendBtn = document.getElementById("send-btn");
  const stopBtn = document.getElementById("stop-btn");
  const status = document.getElementById("live-status");
  const ctxUsed = document.getElementById("ctx-used");
  // The model picker: a new chat is created on the model picked; in a conversation a change
  // applies to its next reply (the prompt is rebuilt with that model's template).
  const modelSelect = document.getElementById("model-select");
  const followUps = document.getElementById("follow-ups");
  if (followUps) {
    followUps.addEventListener("click", (e) => {
      const b = e.target.closest(".follow-up");
      if (!b || busy) return;
      input.value = b.textContent;
      followUps.hidden = true;
      form.requestSubmit();
    });
  }
  const pickedModel = () => (modelSelect ? modelSelect.value : "");
  // A send to a model that is not loaded waits while it loads: say so.
  function sayIfLoading() {
    if (!modelSelect) return;
    const opt = modelSelect.options[modelSelect.selectedIndex];
    if (opt && /\((not loaded|loading)\)$/.test(opt.textContent)) {
      status.textContent = "Loading " + modelSelect.value + "… (its first reply waits while it loads)";
    }
  }
  if (modelSelect && convId) {
    let shown = modelSelect.value;
    modelSelect.addEventListener("change", async () => {
      try {
        const res = await post("/c/" + convId + "/model", { model: modelSelect.value });
        const done = await res.json();
        shown = done.model;
        const sw = document.getElementById("thinking-switch");
        const field = document.getElementById("thinking-field");
        if (sw) sw.hidden = !done.can_think;
        if (field) field.hidden = !done.can_think;
        toast("The next reply comes from " + done.model + ".", "ok");
      } catch (err) {
        modelSelect.value = shown;
        explain(err);
      }
    });
  }
  let busy = false;
  // The user message being edited (a new version of it is sent), or null.
  let editing = null;
  // After a new version (regenerate, edit) the page reloads when the reply is done, so the
  // version arrows and the branch shown come from the server.
  let reloadWhenDone = false;
  // Resolved once the reply stream (below) is open; a send waits for it (see there).
  let streamOpen = Promise.resolve();

  function setBusy(b, text) {
    busy = b;
    stopBtn.hidden = !b;
    sendBtn.hidden = b;
    messages.classList.toggle("idle", !b);
    status.textContent = text || "";
  }
  function scrollDown() {
    const near = messages.scrollHeight - messages.scrollTop - messages.clientHeight < 160;
    if (near) messages.scrollTop = messages.scrollHeight;
  }

  // Sidebar drawer at phone width.
  const menu = document.getElementById("menu-btn");
  const backdrop = document.getElementById("backdrop");
  if (menu) menu.addEventListener("click", () => app.classList.toggle("nav-open"));
  if (backdrop) backdrop.addEventListener("click", () => app.classList.remove("nav-open"));

  const settingsBtn = document.getElementById("settings-btn");
  if (settingsBtn) settingsBtn.addEventListener("click", () => {
    const s = document.getElementById("settings");
    s.hidden = !s.hidden;
    settingsBtn.setAttribute("aria-expanded", String(!s.hidden));
  });
  // Share: make a link, show it once in a dialog, copy or revoke it.
  const shareBtn = document.getElementById("share-btn");
  const shareDialog = document.getElementById("share-dialog");
  let shareId = null;
  if (shareBtn && shareDialog) {
    shareBtn.addEventListener("click", async () => {
      try {
        const res = await post("/c/" + convId + "/share");
        const made = await res.json();
        shareId = made.id;
        document.getElementById("share-url").value = made.url;
        document.getElementById("share-revoke").disabled = false;
        shareDialog.showModal();
        document.getElementById("share-url").select();
      } catch (err) { explain(err); }
    });
    document.getElementById("share-copy").addEventListener("click", async () => {
      const url = document.getElementById("share-url").value;
      try { await navigator.clipboard.writeText(url); toast("Link copied."); } catch (_) { document.getElementById("share-url").select(); }
    });
    document.getElementById("share-revoke").addEventListener("click", async () => {
      if (!shareId) return;
      try {
        await post("/c/" + convId + "/shares/" + shareId + "/revoke");
        document.getElementById("share-revoke").disabled = true;
        document.getElementById("share-url").value = "(revoked)";
        toast("The link is revoked.");
      } catch (err) { explain(err); }
    });
    document.getElementById("share-close").addEventListener("click", () => shareDialog.close());
  }
  // Organise: pin, archive, file in a folder (an existing one or a new one), tag.
  const organiseBtn = document.getElementById("organise-btn");
  const organiseDialog = document.getElementById("organise-dialog");
  if (organiseBtn && organiseDialog) {
    organiseBtn.addEventListener("click", () => organiseDialog.showModal());
    document.getElementById("organise-close").addEventListener("click", () => organiseDialog.close());
    document.getElementById("organise-form").addEventListener("submit", async (e) => {
      e.preventDefault();
      const f = e.target;
      try {
        let folder = f.folder_id.value || null;
        const fresh = f.new_folder.value.trim();
        if (fresh) folder = (await api("POST", "/api/folders", { name: fresh })).id;
        const tags = f.tags.value.split(",").map((t) => t.trim()).filter((t) => t);
        const done = await api("PATCH", "/api/conversations/" + convId, {
          pinned: f.pinned.checked, archived: f.archived.checked, folder_id: folder, tags: tags,
        });
        organiseDialog.close();
        toast(done.organisation.archived ? "Saved. The conversation is archived: find it under Archived." : "Saved.", "ok");
        // Folders and tags feed the view menu: the page is simplest to reload for them.
        if (fresh || tags.length) location.reload(); else refreshList();
      } catch (err) { explain(err); }
    });
  }

  // Presets: choosing one fills the system prompt (Save keeps it); the prompt can be saved as
  // a new preset (admins may share it with everyone); a preset can be deleted.
  const presetSelect = document.getElementById("preset-select");
  if (presetSelect) {
    const promptBox = document.querySelector("#settings textarea[name=system_prompt]");
    presetSelect.addEventListener("change", () => {
      const opt = presetSelect.selectedOptions[0];
      if (opt && opt.value && promptBox) { promptBox.value = opt.dataset.prompt || ""; promptBox.focus(); }
    });
    document.getElementById("preset-save").addEventListener("click", async () => {
      const name = document.getElementById("preset-name");
      const shared = document.getElementById("preset-shared");
      try {
        const p = await api("POST", "/api/presets", { name: name.value, system_prompt: promptBox ? promptBox.value : "", shared: !!(shared && shared.checked) });
        const opt = document.createElement("option");
        opt.value = p.id;
        opt.dataset.prompt = p.system_prompt;
        opt.dataset.shared = String(p.shared);
        opt.textContent = p.name + (p.shared ? " (shared)" : "");
        presetSelect.appendChild(opt);
        presetSelect.value = p.id;
        name.value = "";
        toast("Preset saved.", "ok");
      } catch (err) { explain(err); }
    });
    document.getElementById("preset-delete").addEventListener("click", async () => {
      const opt = presetSelect.selectedOptions[0];
      if (!opt || !opt.value) { toast("Choose the preset to delete first."); return; }
      if (!window.confirm("Delete the preset \u201c" + opt.textContent + "\u201d?")) return;
      try {
        await api("DELETE", "/api/presets/" + opt.value);
        opt.remove();
        presetSelect.value = "";
        toast("Preset deleted.", "ok");
      } catch (err) { explain(err); }
    });
  }

  const renameBtn = document.getElementById("rename-btn");
  if (renameBtn) renameBtn.addEventListener("click", async () => {
    const title = window.prompt("Rename conversation", renameBtn.dataset.title || "");
    if (title === null) return;
    try {
      await post("/c/" + convId + "/rename", { title: title });
      location.reload();
    } catch (err) { explain(err); }
  });

  // Enter sends, Shift+Enter is a new line; the box grows with its text.
  function autosize() {
    input.style.height = "auto";
    input.style.height = Math.min(input.scrollHeight, window.innerHeight * 0.4) + "px";
  }
  input.addEventListener("input", autosize);

  // Warm before send: while the user types, the settled part of the message (up to its last
  // space, so the word being typed is left out) and its attached files go to the server, which
  // computes the prompt they make in spare time; on send only what changed is computed.
  // Throttled, only for a new message in an open conversation, and only when something new
  // settled since the last draft.
  // Read each time, so it can be switched off on a page already open.
  const warmDrafts = () => form.dataset.warmDrafts === "1";
  const DRAFT_INTERVAL_MS = 400;
  const DRAFT_MIN_CHARS = 16;
  let draftTimer = null;
  let lastDraft = "";
  function settledDraft() {
    return input.value.replace(/\S*$/, "");
  }
  async function sendDraft() {
    draftTimer = null;
    if (!warmDrafts() || !convId || editing || busy) return;
    const files = pendingIds();
    const settled = settledDraft();
    if (settled.trim().length < DRAFT_MIN_CHARS && !files.length) return;
    const key = files.join(",") + "\n" + settled;
    if (key === lastDraft) return;
    lastDraft = key;
    try {
      const res = await post("/c/" + convId + "/draft", { content: settled, files: files.join(",") });
      const out = await res.json();
      document.body.dataset.lastDraft = JSON.stringify(out);
    } catch (_) {
      // Best effort: the message is sent as usual whatever happened to its draft.
      lastDraft = "";
    }
  }
  // At most one draft per DRAFT_INTERVAL_MS while the user types (a pause sends the last).
  function draftSoon() {
    if (!warmDrafts() || !convId || editing || draftTimer) return;
    draftTimer = setTimeout(sendDraft, DRAFT_INTERVAL_MS);
  }
  input.addEventListener("input", draftSoon);
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      form.requestSubmit();
    }
  });

  // `#` in the composer picks a knowledge collection: the conversation searches it for each
  // message from then on (its settings' `knowledge`; a new chat is made with it).
  const picker = document.getElementById("kb-picker");
  const kbChips = document.getElementById("kb-chips");
  let collections = null;
  let pickAt = -1;
  let picked = 0;
  async function allCollections() {
    if (collections === null) {
      try { collections = (await api("GET", "/api/knowledge")).collections; } catch (_) { collections = []; }
    }
    return collections;
  }
  function closePicker() {
    if (picker) { picker.hidden = true; picker.textContent = ""; }
    pickAt = -1;
  }
  function chosenIds() {
    return [...document.querySelectorAll("input[name^='kb:']")].filter((i) => i.checked).map((i) => i.name.slice(3));
  }
  async function choose(c) {
    const before = input.value.slice(0, pickAt);
    const after = input.value.slice(input.selectionStart);
    input.value = before + after.replace(/^\S*/, "").replace(/^\s*/, before && !before.endsWith(" ") ? " " : "");
    closePicker();
    try {
      if (!convId) {
        const made = await api("POST", "/api/conversations", Object.assign({ knowledge: [c.id] }, pickedModel() ? { model: pickedModel() } : {}));
        sessionStorage.setItem("smolchat-draft-" + made.id, input.value);
        location.href = "/c/" + made.id;
        return;
      }
      const ids = chosenIds();
      if (!ids.includes(c.id)) ids.push(c.id);
      await api("PATCH", "/api/conversations/" + convId, { knowledge: ids });
      addKbChip(c.id, c.name);
      announce("Searching " + c.name + " for each message");
    } catch (err) { explain(err); }
    input.focus();
  }
  function addKbChip(id, name) {
    const box = document.querySelector("input[name='kb:" + id + "']");
    if (box) box.checked = true;
    if (!kbChips || kbChips.querySelector("[data-id='" + id + "']")) return;
    const li = document.createElement("li");
    li.className = "kb-chip";
    li.dataset.id = id;
    const s = document.createElement("span");
    s.className = "muted small";
    s.textContent = "Searching";
    li.append(s, " " + name);
    kbChips.append(li);
    kbChips.hidden = false;
  }
  function showPicker(list) {
    picker.textContent = "";
    list.forEach((c, i) => {
      const li = document.createElement("li");
      li.setAttribute("role", "option");
      li.className = "kb-option";
      li.id = "kb-option-" + i;
      li.textContent = c.name;
      li.setAttribute("aria-selected", i === picked ? "true" : "false");
      li.addEventListener("mousedown", (e) => { e.preventDefault(); choose(c); });
      picker.append(li);
    });
    picker.hidden = list.length === 0;
  }
  let matches = [];
  if (picker) {
    input.addEventListener("input", async () => {
      const upto = input.value.slice(0, input.selectionStart);
      const m = upto.match(/(^|\s)#([^\s#]*)$/);
      if (!m) { closePicker(); return; }
      pickAt = upto.length - m[2].length - 1;
      const q = m[2].toLowerCase();
      matches = (await allCollections()).filter((c) => c.name.toLowerCase().includes(q)).slice(0, 8);
      picked = 0;
      showPicker(matches);
    });
    // Before the composer's own Enter (capture): with the list open, keys move in it.
    input.addEventListener("keydown", (e) => {
      if (picker.hidden || !matches.length) return;
      if (e.key === "ArrowDown" || e.key === "ArrowUp") {
        picked = (picked + (e.key === "ArrowDown" ? 1 : matches.length - 1)) % matches.length;
        showPicker(matches);
      } else if (e.key === "Enter" || e.key === "Tab") {
        choose(matches[picked]);
      } else if (e.key === "Escape") {
        closePicker();
      } else {
        return;
      }
      e.preventDefault();
      e.stopImmediatePropagation();
    }, true);
    input.addEventListener("blur", () => setTimeout(closePicker, 150));
  }
  if (convId) {
    const kept = sessionStorage.getItem("smolchat-draft-" + convId);
    if (kept !== null) {
      sessionStorage.removeItem("smolchat-draft-" + convId);
      if (!input.value) input.value = kept;
    }
  }

  // `el` and every message after it: what a new version from `el` takes off the page (they
  // stay stored, as the other versions).
  function fromHere(el) {
    const out = [el];
    for (let n = el.nextElementSibling; n; n = n.nextElementSibling) out.push(n);
    return out;
  }
  const editBar = document.getElementById("editing");
  function setEditing(el) {
    editing = el;
    editBar.hidden = !el;
  }
  document.getElementById("cancel-edit").addEventListener("click", () => { setEditing(null); input.value = ""; autosize(); });

  messages.addEventListener("click", async (e) => {
    // Allow or Deny a tool call that waits; the stream brings what happens next.
    const decide = e.target.closest(".tool-allow, .tool-deny");
    if (decide) {
      const block = decide.closest(".tool-decide");
      if (block) block.querySelectorAll("button").forEach((b) => (b.disabled = true));
      try {
        await post("/c/" + convId + "/tools/decide", {
          message: decide.dataset.message,
          step: decide.dataset.step,
          decision: decide.classList.contains("tool-allow") ? "allow" : "deny",
        });
      } catch (err) {
        if (block) block.querySelectorAll("button").forEach((b) => (b.disabled = false));
        explain(err);
      }
      return;
    }
    const regen = e.target.closest(".regen-btn");
    const edit = e.target.closest(".edit-btn");
    const ver = e.target.closest(".ver-btn");
    if (regen) {
      // A new reply beside this one; `started` brings it, possibly before the POST answers:
      // so this reply and what follows are hidden first.
      const reply = regen.closest(".msg");
      const old = fromHere(reply);
      old.forEach((el) => (el.hidden = true));
      try {
        await streamReady();
        await post("/c/" + convId + "/regenerate", { message: reply.dataset.parent || "" });
        old.forEach((el) => el.remove());
        reloadWhenDone = true;
      } catch (err) {
        old.forEach((el) => (el.hidden = false));
        explain(err);
      }
    } else if (edit) {
      const u = edit.closest(".msg");
      input.value = u.querySelector(".text").textContent;
      setEditing(u);
      autosize();
      input.focus();
    } else if (ver && ver.dataset.message && !busy) {
      try {
        await post("/c/" + convId + "/select", { message: ver.dataset.message });
        location.reload();
      } catch (err) { explain(err); }
    }
  });

  // Files: uploaded as soon as they are chosen (the server checks type and size, reads the text
  // and counts its tokens), shown as chips above the composer, sent with the next message.
  const pendingList = document.getElementById("pending-files");
  const fileInput = document.getElementById("file-input");
  const attachBtn = document.getElementById("attach-btn");
  const maxFileMib = Number(form.dataset.maxFileMib || "10");
  function pendingIds() {
    return pendingList ? [...pendingList.querySelectorAll(".file-chip")].map((c) => c.dataset.id) : [];
  }
  function addChip(f) {
    const li = document.createElement("li");
    li.className = "file-chip";
    li.dataset.id = f.id;
    li.title = f.tokens + " tokens in the prompt";
    const kind = document.createElement("span");
    kind.className = "file-kind";
    kind.textContent = f.kind;
    const name = document.createElement("span");
    name.className = "file-name";
    name.textContent = f.name;
    const size = document.createElement("span");
    size.className = "file-size";
    size.textContent = f.size_bytes >= 1048576 ? (f.size_bytes / 1048576).toFixed(1) + " MB" : f.size_bytes >= 1024 ? (f.size_bytes / 1024).toFixed(1) + " KB" : f.size_bytes + " B";
    const rm = document.createElement("button");
    rm.type = "button";
    rm.className = "link-btn file-remove";
    rm.setAttribute("aria-label", "Remove " + f.name);
    rm.textContent = "×";
    li.append(kind, name, size, rm);
    pendingList.appendChild(li);
    pendingList.hidden = false;
  }
  async function upload(conv, file) {
    if (file.size > maxFileMib * 1048576) {
      throw new Error("\u201c" + file.name + "\u201d is " + (file.size / 1048576).toFixed(1) + " MB; files may be at most " + maxFileMib + " MB.");
    }
    const res = await fetch("/api/conversations/" + conv + "/files?name=" + encodeURIComponent(file.name), {
      method: "POST", body: file, credentials: "same-origin",
      headers: { "X-CSRF-Token": csrf, "Content-Type": "application/octet-stream" },
    });
    if (!res.ok) {
      let text = "the upload failed (" + res.status + ")";
      try { text = (await res.json()).error.message || text; } catch (_) { /* keep it */ }
      throw new Error(text);
    }
    return res.json();
  }
  if (attachBtn && fileInput && pendingList) {
    attachBtn.addEventListener("click", () => fileInput.click());
    fileInput.addEventListener("change", async () => {
      const chosen = [...fileInput.files];
      fileInput.value = "";
      if (!chosen.length) return;
      let conv = convId;
      try {
        // A new chat gets its conversation first; the page then opens it with the chips.
        if (!conv) conv = (await api("POST", "/api/conversations", pickedModel() ? { model: pickedModel() } : {})).id;
      } catch (err) { explain(err); return; }
      status.textContent = "Reading " + chosen.length + (chosen.length === 1 ? " file…" : " files…");
      for (const file of chosen) {
        try {
          const f = await upload(conv, file);
          if (f.outcome === "searched") {
            // Too long to read whole: the conversation searches it for each message instead.
            toast(f.message, "info");
            addKbChip(f.collection, f.collection_name);
            announce(f.message);
            continue;
          }
          if (convId) addChip(f);
          announce("Attached " + f.name);
          draftSoon();
        } catch (err) { toast(err.message); }
      }
      status.textContent = "";
      if (!convId) location.href = "/c/" + conv;
    });
    pendingList.addEventListener("click", async (e) => {
      const b = e.target.closest(".file-remove");
      if (!b) return;
      const chip = b.closest(".file-chip");
      try {
        await api("DELETE", "/api/conversations/" + convId + "/files/" + chip.dataset.id);
        chip.remove();
        if (!pendingIds().length) pendingList.hidden = true;
      } catch (err) { explain(err); }
    });
  }

  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    const content = input.value;
    if (!content.trim() || busy) return;
    // The message goes now: no draft of it after this.
    if (draftTimer) { clearTimeout(draftTimer); draftTimer = null; }
    lastDraft = "";
    sendBtn.disabled = true;
    if (followUps) followUps.hidden = true;
    sayIfLoading();
    try {
      if (!convId) {
        const res = await post("/c", { content: content, model: pickedModel() });
        location.href = res.headers.get("HX-Redirect") || "/";
        return;
      }
      if (editing) {
        const target = editing;
        const old = fromHere(target);
        old.forEach((el) => (el.hidden = true));
        try {
          await streamReady();
          await post("/c/" + convId + "/edit", { content: content, message: target.dataset.id });
        } catch (err) {
          old.forEach((el) => (el.hidden = false));
          throw err;
        }
        old.forEach((el) => el.remove());
        setEditing(null);
        reloadWhenDone = true;
      } else {
        const files = pendingIds();
        await streamReady();
        await post("/c/" + convId + "/messages", { content: content, files: files.join(",") });
        if (files.length) {
          // The chips go with the message; the page shows them on it once the reply is done.
          pendingList.textContent = "";
          pendingList.hidden = true;
          reloadWhenDone = true;
        }
      }
      input.value = "";
      autosize();
    } catch (err) {
      explain(err);
    } finally {
      sendBtn.disabled = false;
    }
  });

  // Keyboard shortcuts (the list is in the #shortcuts dialog).
  const shortcuts = document.getElementById("shortcuts");
  const openShortcuts = () => { if (shortcuts && !shortcuts.open) shortcuts.showModal(); };
  const shortcutsBtn = document.getElementById("shortcuts-btn");
  if (shortcutsBtn) shortcutsBtn.addEventListener("click", openShortcuts);
  const shortcutsClose = document.getElementById("shortcuts-close");
  if (shortcutsClose) shortcutsClose.addEventListener("click", () => shortcuts.close());
  async function copyLastReply() {
    const all = messages.querySelectorAll(".msg.assistant .md");
    if (!all.length) return;
    const text = all[all.length - 1].innerText.trim();
    try {
      await navigator.clipboard.writeText(text);
      toast("Reply copied.", "info");
    } catch (_) {
      toast("The browser did not allow copying.");
    }
  }
  document.addEventListener("keydown", (e) => {
    const key = e.key.length === 1 ? e.key.toLowerCase() : e.key;
    const ctrl = e.ctrlKey || e.metaKey;
    const dialogOpen = document.querySelector("dialog[open]");
    let handled = true;
    if (ctrl && e.shiftKey && key === "o") location.href = "/";
    else if (e.shiftKey && !ctrl && key === "Escape") input.focus();
    else if (key === "Escape" && !e.shiftKey && !ctrl && busy && !dialogOpen) stopBtn.click();
    else if (ctrl && e.shiftKey && key === "y") {
      const r = document.querySelector(".messages.idle > .msg.assistant:last-child .regen-btn");
      if (r) r.click();
    } else if (ctrl && e.shiftKey && key === "k") copyLastReply();
    else if (ctrl && !e.shiftKey && key === "k") {
      const s = document.getElementById("search");
      if (s) s.focus();
    } else if (ctrl && e.shiftKey && key === "s") {
      if (window.matchMedia("(max-width: 800px)").matches) app.classList.toggle("nav-open");
      else document.body.classList.toggle("sidebar-hidden");
    } else if (ctrl && key === "/") openShortcuts();
    else handled = false;
    if (handled) e.preventDefault();
  });

  // A screen reader hears each finished reply (the streamed tokens are not read one by one).
  const announcer = document.getElementById("announcer");
  function announce(text) {
    if (!announcer || !text) return;
    const p = document.createElement("p");
    p.textContent = text;
    announcer.appendChild(p);
    while (announcer.childElementCount > 3) announcer.firstElementChild.remove();
  }

  stopBtn.addEventListener("click", async () => {
    try { await post("/c/" + convId + "/stop"); } catch (err) { explain(err); }
  });

  if (!convId) { setBusy(false); return; }

  // The live stream. `started` may be a replay of a reply this page already shows (after a
  // reload): then the bubble is reset and refilled by the replayed events.
  function ensureUser(m) {
    if (document.getElementById("msg-" + m.id)) return;
    const empty = document.getElementById("empty");
    if (empty) empty.remove();
    const el = document.createElement("article");
    el.className = "msg user";
    el.id = "msg-" + m.id;
    el.dataset.id = m.id;
    el.innerHTML = '<div class="bubble"><div class="text"></div></div><div class="actions"><button type="button" class="link-btn msg-copy-btn" aria-label="Copy this message">Copy</button><button type="button" class="link-btn edit-btn" title="Edit: a new version from here">Edit</button></div>';
    el.querySelector(".text").textContent = m.content;
    messages.appendChild(el);
  }
  function ensureAssistant(id) {
    let el = document.getElementById("msg-" + id);
    if (!el) {
      el = document.createElement("article");
      el.id = "msg-" + id;
      el.dataset.id = id;
      el.innerHTML = '<div class="avatar" aria-hidden="true">✦</div><div class="bubble"><details class="thinking" hidden open><summary>Thinking</summary><div class="thinking-text"></div></details><div class="md"></div><div class="meta"><span class="stats"></span><button type="button" class="link-btn msg-copy-btn" aria-label="Copy this reply">Copy</button><button type="button" class="link-btn regen-btn">Regenerate</button></div></div>';
      messages.appendChild(el);
    }
    el.className = "msg assistant streaming";
    el.querySelector(".thinking-text").textContent = "";
    el.querySelector(".thinking").hidden = true;
    const md = el.querySelector(".md");
    // Finished blocks are appended to .live-blocks; the open one replaces .live-tail's content.
    md.innerHTML = '<div class="live-blocks"></div><div class="live-tail"></div><span class="stream"></span>';
    return el;
  }
  let current = null;

  // A reply this page shows as streaming may end before the stream below is open (a fast
  // reply, a slow page load): `after` has the server say how it ended (its `done`) instead of
  // leaving the page "Joining the reply…" for good.
  const streamingReply = messages.querySelector("article.msg.assistant.streaming");
  const after = streamingReply ? "&after=" + encodeURIComponent(streamingReply.dataset.id) : "";
  const events = new EventSource("/api/conversations/" + convId + "/events?render=html" + after);
  // The server subscribes before it answers the stream's request, so once the stream is open no
  // event of a reply started later can be missed: sends and edits wait for it (at most 5 s, so
  // a stream that cannot open does not block the composer), and again after it reconnects.
  const waitForOpen = () => {
    streamOpen = new Promise((resolve) => events.addEventListener("open", resolve, { once: true }));
  };
  waitForOpen();
  // When the stream was refused (an error status, which EventSource never retries) while the
  // page shows a reply being written, nothing would ever tell it how the reply ends: load the
  // page again (it subscribes anew and shows how the reply stands), a few times at most.
  let heard = false;
  function rejoin() {
    const key = "smolchat-rejoin-" + convId;
    const tries = Number(sessionStorage.getItem(key) || "0");
    if (tries >= 3) {
      status.textContent = "Lost the reply's stream; reload the page to see how it ended.";
      return;
    }
    sessionStorage.setItem(key, String(tries + 1));
    location.reload();
  }
  events.addEventListener("error", () => {
    if (events.readyState === EventSource.CLOSED && busy) setTimeout(rejoin, 1500);
    else if (events.readyState !== EventSource.OPEN) waitForOpen();
  });
  // A page that joined a reply and hears nothing of it for long looks at the stored reply: if
  // it has ended, the page is loaded again to show it.
  if (app.dataset.replying === "true") {
    setTimeout(async () => {
      if (heard || !busy) return;
      try {
        const c = await api("GET", "/api/conversations/" + convId);
        const last = (c.messages || []).filter((m) => m.role === "assistant").pop();
        if (last && last.status !== "streaming") rejoin();
      } catch (_) { /* the stream may still come */ }
    }, 15000);
  }
  function on(name, fn) {
    events.addEventListener(name, (e) => {
      heard = true;
      let data;
      try { data = JSON.parse(e.data); } catch (_) { return; }
      fn(data);
    });
  }
  on("started", (d) => {
    ensureUser(d.user_message);
    current = ensureAssistant(d.assistant_message_id);
    setBusy(true, "Waiting in the queue…");
    messages.scrollTop = messages.scrollHeight;
  });
  on("prefilling", (d) => {
    setBusy(true, "Reading " + d.prompt_tokens + " prompt tokens (" + d.cached_tokens + " cached)…");
  });
  on("reasoning", (d) => {
    if (!current) return;
    const t = current.querySelector(".thinking");
    t.hidden = false;
    t.querySelector(".thinking-text").append(d.text);
    status.textContent = "Thinking…";
    scrollDown();
  });
  on("answer", (d) => {
    if (!current) return;
    const t = current.querySelector(".thinking");
    if (!t.hidden && t.open && status.textContent === "Thinking…") t.open = false;
    current.querySelector(".stream").append(d.text);
    status.textContent = "Writing…";
    scrollDown();
  });
  // The reply as sanitized HTML while it streams (the server renders it; see events.rs).
  on("answer_html", (d) => {
    if (!current) return;
    const t = current.querySelector(".thinking");
    if (!t.hidden && t.open && status.textContent === "Thinking…") t.open = false;
    const blocks = current.querySelector(".live-blocks");
    const tail = current.querySelector(".live-tail");
    if (!blocks || !tail) return;
    if (d.blocks) {
      const tpl = document.createElement("template");
      tpl.innerHTML = d.blocks;
      const holder = document.createElement("div");
      holder.className = "live-block";
      holder.appendChild(tpl.content);
      blocks.appendChild(holder);
      enhance(holder);
    }
    tail.innerHTML = d.tail;
    enhance(tail);
    status.textContent = "Writing…";
    scrollDown();
  });
  // A tool call of the reply, made or ended: the answer's open block is closed (`flush`), then
  // the call's block (server-rendered) is added or replaced where the answer stands.
  on("tool_step", (d) => {
    if (!current) return;
    const blocks = current.querySelector(".live-blocks");
    const tail = current.querySelector(".live-tail");
    if (!blocks) return;
    if (d.flush) {
      const holder = document.createElement("div");
      holder.className = "live-block";
      holder.innerHTML = d.flush;
      blocks.appendChild(holder);
      enhance(holder);
    }
    if (tail) tail.innerHTML = "";
    const stream = current.querySelector(".stream");
    if (stream) stream.textContent = "";
    const tpl = document.createElement("template");
    tpl.innerHTML = (d.html || "").trim();
    const fresh = tpl.content.firstElementChild;
    if (!fresh) return;
    const old = document.getElementById(fresh.id);
    if (old) old.replaceWith(fresh); else blocks.appendChild(fresh);
    const s = d.step || {};
    if (s.status === "awaiting_approval") setBusy(true, "Waiting for you to allow or deny " + s.name + "…");
    else if (s.status === "running") setBusy(true, "Running " + s.name + "…");
    else setBusy(true, "Tool " + s.name + ": " + s.status);
    scrollDown();
  });
  on("continuing", () => {
    setBusy(true, "Reading the tools' results…");
  });
  on("done", async (d) => {
    sessionStorage.removeItem("smolchat-rejoin-" + convId);
    const m = d.message;
    const el = current || document.getElementById("msg-" + m.id);
    // A `done` replayed for a reply already shown finished (the stream reconnected with its
    // `after`): nothing to do.
    if (!current && el && !el.classList.contains("streaming")) return;
    current = null;
    setBusy(false);
    // The reply's model is loaded now.
    if (modelSelect && modelSelect.selectedIndex >= 0) modelSelect.options[modelSelect.selectedIndex].textContent = modelSelect.value;
    if (m.prompt_tokens != null) ctxUsed.textContent = String((m.prompt_tokens || 0) + (m.completion_tokens || 0));
    if (m.status === "stopped") status.textContent = "Stopped.";
    announce("Reply" + (m.status === "stopped" ? " (stopped)" : "") + ": " + (m.content || "").slice(0, 400));
    if (d.summary && d.summary.reason === "length") status.textContent = "The reply hit its token limit or the context is full.";
    try {
      const res = await fetch("/c/" + convId + "/m/" + m.id, { credentials: "same-origin" });
      if (res.ok && el) {
        const tpl = document.createElement("template");
        tpl.innerHTML = (await res.text()).trim();
        const fresh = tpl.content.firstElementChild;
        if (fresh) { el.replaceWith(fresh); enhance(fresh); }
      }
    } catch (_) { /* the streamed text stays */ }
    refreshList();
    scrollDown();
    if (reloadWhenDone) { reloadWhenDone = false; location.reload(); }
  });
  on("error", (d) => {
    if (d && d.message) toast(d.message);
    setBusy(false);
  });
  // The task model titled the conversation after its first reply.
  // The task model's questions to ask next, under the last reply: a click sends one.
  on("follow_ups", (d) => {
    const last = [...messages.querySelectorAll("article.msg.assistant")].pop();
    if (!followUps || !last || last.dataset.id !== d.message_id || busy) return;
    followUps.replaceChildren(...d.questions.map((q) => {
      const b = document.createElement("button");
      b.type = "button";
      b.className = "btn small follow-up";
      b.textContent = q;
      return b;
    }));
    followUps.hidden = d.questions.length === 0;
  });
  on("titled", (d) => {
    const h = document.getElementById("conv-title");
    if (h && d.title) h.textContent = d.title;
    const rename = document.getElementById("rename-btn");
    if (rename && d.title) rename.dataset.title = d.title;
    if (d.title) document.title = d.title + " · smolchat";
    refreshList();
  });

  setBusy(app.dataset.replying === "true", app.dataset.replying === "true" ? "Joining the reply…" : "");
  messages.scrollTop = messages.scrollHeight;
})();
