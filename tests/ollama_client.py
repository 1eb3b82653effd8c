"""Drives a running smolchat server with the official `ollama` Python client.

Run by tests/openai.rs, which starts the server and passes:
  SMOLCHAT_HOST     http://127.0.0.1:PORT (the Ollama API is on the server's own port)
  SMOLCHAT_API_KEY  the key the server was started with

Prints one line per check and `N passed, M failed`; exits non-zero when a check failed.
"""

import os
import sys
import traceback

import httpx
import ollama

HOST = os.environ["SMOLCHAT_HOST"]
KEY = os.environ["SMOLCHAT_API_KEY"]
AUTH = {"Authorization": f"Bearer {KEY}"}

client = ollama.Client(host=HOST, headers=AUTH, timeout=120)
results = {"passed": 0, "failed": 0}
state = {}
GREEDY = {"temperature": 0, "num_predict": 16}
MESSAGES = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


def check(name):
    def run(fn):
        try:
            fn()
            results["passed"] += 1
            print(f"ok   {name}", flush=True)
        except Exception:  # noqa: BLE001 - every failure is reported, then the next check runs
            results["failed"] += 1
            print(f"FAIL {name}", flush=True)
            traceback.print_exc()
        return fn

    return run


@check("list: the loaded model, as a GGUF")
def _():
    models = client.list().models
    assert len(models) == 1, models
    m = models[0]
    assert m.model and m.model.endswith(":latest"), m.model
    assert m.size and m.size > 0
    assert m.details.format == "gguf", m.details
    state["model"] = m.model


@check("show: details, template and capabilities")
def _():
    s = client.show(state["model"])
    assert s.details.format == "gguf"
    assert s.template and "{" in s.template
    assert "completion" in (s.capabilities or []), s.capabilities
    assert any(k.endswith(".context_length") for k in (s.modelinfo or {})), s.modelinfo


@check("ps: the model is loaded")
def _():
    running = client.ps().models
    assert [m.model for m in running] == [state["model"]], running


@check("version")
def _():
    r = httpx.get(f"{HOST}/api/version", headers=AUTH)
    assert r.status_code == 200 and r.json()["version"], r.text


@check("chat, whole")
def _():
    r = client.chat(model=state["model"], messages=MESSAGES, options=GREEDY)
    assert r.done and r.done_reason in ("stop", "length"), r
    assert r.message.role == "assistant" and r.message.content, r.message
    assert r.eval_count and r.eval_count >= 1 and r.prompt_eval_count > 5, r
    assert r.total_duration and r.total_duration > 0
    state["chat"] = r.message.content


@check("chat, streamed: the same greedy reply")
def _():
    parts = list(client.chat(model=state["model"], messages=MESSAGES, options=GREEDY, stream=True))
    assert parts[-1].done and not any(p.done for p in parts[:-1]), parts[-1]
    text = "".join(p.message.content or "" for p in parts)
    assert text == state["chat"], (text, state["chat"])
    assert parts[-1].eval_count >= 1


@check("chat with tools offered")
def _():
    tool = {
        "type": "function",
        "function": {
            "name": "get_capital",
            "description": "Capital of a country",
            "parameters": {
                "type": "object",
                "properties": {"country": {"type": "string"}},
                "required": ["country"],
            },
        },
    }
    r = client.chat(model=state["model"], messages=MESSAGES, options=GREEDY, tools=[tool])
    assert r.done and r.message.role == "assistant"


@check("generate, whole and streamed")
def _():
    r = client.generate(model=state["model"], prompt="Name a colour.", options=GREEDY)
    assert r.done and r.response, r
    parts = list(client.generate(model=state["model"], prompt="Name a colour.", options=GREEDY, stream=True))
    assert "".join(p.response for p in parts) == r.response
    assert parts[-1].done and parts[-1].eval_count >= 1


@check("generate, raw prompt and a system prompt")
def _():
    r = client.generate(model=state["model"], prompt="Once upon a time", raw=True, options=GREEDY)
    assert r.done and r.response
    r = client.generate(model=state["model"], prompt="Hi", system="Answer in French.", options=GREEDY)
    assert r.done and r.response


@check("an empty prompt loads the model")
def _():
    r = client.generate(model=state["model"], prompt="")
    assert r.done and r.done_reason == "load", r


@check("a seeded sample repeats")
def _():
    opts = {"temperature": 1.0, "seed": 7, "num_predict": 12}
    a = client.chat(model=state["model"], messages=MESSAGES, options=opts).message.content
    b = client.chat(model=state["model"], messages=MESSAGES, options=opts).message.content
    assert a == b, (a, b)


def refused(fn, status, words):
    try:
        fn()
    except ollama.ResponseError as e:
        assert e.status_code == status, (e.status_code, e.error)
        assert all(w in e.error for w in words), e.error
        return
    raise AssertionError("not refused")


@check("format: JSON and a JSON Schema")
def _():
    import json

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"enum": ["France", "Spain"]}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    r = client.chat(model=state["model"], messages=MESSAGES, format=schema, options={"temperature": 1, "seed": 4, "num_predict": 80})
    v = json.loads(r.message.content)
    assert set(v) == {"city", "country"} and v["country"] in ("France", "Spain"), v
    r = client.generate(model=state["model"], prompt="A JSON object:", format="json", options={"temperature": 1, "seed": 5, "num_predict": 80})
    if r.done_reason == "stop":
        assert isinstance(json.loads(r.response), dict), r.response


@check("refusals in Ollama's shape")
def _():
    refused(lambda: client.chat(model="no-such-model", messages=MESSAGES), 404, ["no-such-model"])
    refused(
        lambda: client.chat(model=state["model"], messages=MESSAGES, options={"mirostat": 2}),
        400,
        ["mirostat"],
    )
    refused(
        lambda: client.chat(model=state["model"], messages=MESSAGES, options={"temperature": -1}),
        400,
        ["temperature"],
    )
    refused(
        lambda: client.chat(model=state["model"], messages=MESSAGES, format={"type": 7}),
        400,
        ["format"],
    )
    refused(
        lambda: client.chat(
            model=state["model"],
            messages=[{"role": "user", "content": "x", "images": ["aGk="]}],
        ),
        400,
        ["images"],
    )
    headers = {**AUTH, "Content-Type": "application/json"}
    r = httpx.post(f"{HOST}/api/chat", headers=headers, content=b"{not json", timeout=30)
    assert r.status_code == 400 and isinstance(r.json()["error"], str), r.text


@check("embed and embeddings: normalized vectors, batched like alone, paraphrase first")
def _():
    texts = ["How do I reset my password?", "I forgot my password, how can I change it?", "The train to Paris leaves at noon."]
    r = client.embed(model=state["model"], input=texts)
    vectors = r["embeddings"]
    assert len(vectors) == 3 and all(len(v) == 576 for v in vectors)
    assert r["prompt_eval_count"] > 3
    dot = lambda a, b: sum(x * y for x, y in zip(a, b))
    assert all(abs(dot(v, v) - 1.0) < 1e-4 for v in vectors)
    assert dot(vectors[0], vectors[1]) > dot(vectors[0], vectors[2])
    alone = client.embed(model=state["model"], input=texts[1])["embeddings"][0]
    assert max(abs(a - b) for a, b in zip(alone, vectors[1])) < 1e-5
    legacy = client.embeddings(model=state["model"], prompt=texts[1])["embedding"]
    assert max(abs(a - b) for a, b in zip(legacy, vectors[1])) < 1e-5
    # Too long: refused with "truncate": false (cut to the window by default: tests/openai.rs,
    # on a server with a small window, where that is quick).
    long = "word " * 9000
    refused(lambda: client.embed(model=state["model"], input=long, truncate=False), 400, ["context"])
    refused(lambda: client.embed(model=state["model"], input=[]), 400, ["input"])


@check("a wrong key is refused, in Ollama's shape")
def _():
    bad = ollama.Client(host=HOST, headers={"Authorization": "Bearer wrong"}, timeout=30)
    refused(lambda: bad.list(), 401, [])
    r = httpx.get(f"{HOST}/api/tags", timeout=30)
    assert r.status_code == 401 and isinstance(r.json()["error"], str), r.text


print(f"{results['passed']} passed, {results['failed']} failed", flush=True)
sys.exit(1 if results["failed"] else 0)
