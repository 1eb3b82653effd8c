"""Drives a running smolchat server with the official `openai` Python client.

Run by tests/openai.rs, which starts the server and passes:
  SMOLCHAT_BASE_URL   http://127.0.0.1:PORT/v1
  SMOLCHAT_API_KEY    the key the server was started with
  SMOLCHAT_BIN        the smolchat binary (for `generate` and `tokenize`)
  SMOLCHAT_MODEL_PATH the GGUF file the server serves

Prints one line per check and `N passed, M failed`; exits non-zero when a check failed.
"""

import os
import subprocess
import sys
import traceback

import openai

BASE = os.environ["SMOLCHAT_BASE_URL"]
KEY = os.environ["SMOLCHAT_API_KEY"]
BIN = os.environ["SMOLCHAT_BIN"]
MODEL_PATH = os.environ["SMOLCHAT_MODEL_PATH"]

SYSTEM = "You are a concise assistant."
USER = "What is the capital of France?"
MAX_TOKENS = 24

# No retries: a refusal must surface as the exception the client maps it to.
client = openai.OpenAI(base_url=BASE, api_key=KEY, max_retries=0, timeout=120)
results = {"passed": 0, "failed": 0}
state = {}


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


def smolchat(*args):
    out = subprocess.run(
        [BIN, *args, "--model", MODEL_PATH],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return out.stdout


def messages():
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": USER},
    ]


def expect_error(exc_type, status, fn, code=None, param=None):
    try:
        fn()
    except exc_type as e:
        assert e.status_code == status, (e.status_code, e)
        body = e.body or {}
        assert body.get("message"), body
        if code is not None:
            assert body.get("code") == code, body
        if param is not None:
            assert body.get("param") == param, body
        return e
    raise AssertionError(f"no {exc_type.__name__} raised")


@check("models.list and retrieve")
def _():
    models = client.models.list().data
    assert len(models) == 1, models
    m = models[0]
    assert m.id == os.path.splitext(os.path.basename(MODEL_PATH))[0], m.id
    extra = m.model_extra or {}
    assert extra.get("context_length") == 8192, extra
    assert extra.get("max_model_len") == 8192, extra
    assert client.models.retrieve(m.id).id == m.id
    state["model"] = m.id


MODEL = client.models.list().data[0].id


@check("chat non-streaming, greedy")
def _():
    r = client.chat.completions.create(
        model=MODEL, messages=messages(), temperature=0, max_tokens=MAX_TOKENS
    )
    assert r.object == "chat.completion"
    assert r.model == MODEL
    c = r.choices[0]
    assert c.message.role == "assistant"
    assert c.message.content, r
    assert c.finish_reason in ("stop", "length"), c.finish_reason
    u = r.usage
    assert u.completion_tokens <= MAX_TOKENS and u.completion_tokens > 0, u
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens, u
    assert u.prompt_tokens_details.cached_tokens <= u.prompt_tokens, u
    state["reply"] = c.message.content
    state["usage"] = u
    state["finish"] = c.finish_reason


@check("chat streaming equals non-streaming, with usage")
def _():
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages(),
        temperature=0,
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage, roles, ids = "", None, None, [], set()
    for chunk in stream:
        ids.add(chunk.id)
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            assert chunk.choices == [], chunk
            usage = chunk.usage
            continue
        delta = chunk.choices[0].delta
        if delta.role:
            roles.append(delta.role)
        text += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert roles == ["assistant"], roles
    assert len(ids) == 1, ids
    assert text == state["reply"], (text, state["reply"])
    assert finish == state["finish"], finish
    assert usage is not None
    assert usage.prompt_tokens == state["usage"].prompt_tokens
    assert usage.completion_tokens == state["usage"].completion_tokens
    # The same conversation again: its prompt prefix comes from the kept KV cache.
    assert usage.prompt_tokens_details.cached_tokens > 0, usage


@check("greedy reply equals `smolchat generate`")
def _():
    out = smolchat(
        "generate",
        "--temperature",
        "0",
        "--max-tokens",
        str(MAX_TOKENS),
        "--system",
        SYSTEM,
        USER,
    )
    # `generate` ends its output with one newline of its own.
    assert out.endswith("\n")
    assert out[:-1] == state["reply"], (out, state["reply"])


# SmolLM2's template is ChatML; the rendered prompt, written out by hand.
RENDERED = (
    f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
    f"<|im_start|>user\n{USER}<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@check("usage.prompt_tokens equals `smolchat tokenize --special` of the rendered prompt")
def _():
    import json

    ids = json.loads(smolchat("tokenize", "--special", "--add-bos", RENDERED))
    assert state["usage"].prompt_tokens == len(ids), (state["usage"], len(ids))


@check("completions (raw prompt) non-streaming and streaming equal the chat reply")
def _():
    r = client.completions.create(
        model=MODEL, prompt=RENDERED, temperature=0, max_tokens=MAX_TOKENS
    )
    assert r.object == "text_completion"
    assert r.choices[0].text == state["reply"], (r.choices[0].text, state["reply"])
    assert r.choices[0].finish_reason == state["finish"]
    assert r.usage.prompt_tokens == state["usage"].prompt_tokens
    assert r.usage.completion_tokens == state["usage"].completion_tokens
    stream = client.completions.create(
        model=MODEL,
        prompt=RENDERED,
        temperature=0,
        max_tokens=MAX_TOKENS,
        stream=True,
    )
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert text == state["reply"], (text, state["reply"])


@check("prompt_tokens grow by the tokens of added text")
def _():
    extra = " Answer in one word."
    r = client.chat.completions.create(
        model=MODEL,
        messages=[messages()[0], {"role": "user", "content": USER + extra}],
        temperature=0,
        max_tokens=1,
    )
    import json

    longer = RENDERED.replace(USER, USER + extra)
    ids = json.loads(smolchat("tokenize", "--special", "--add-bos", longer))
    assert r.usage.prompt_tokens == len(ids), (r.usage, len(ids))
    assert r.usage.prompt_tokens > state["usage"].prompt_tokens


@check("stop string, seed and penalties are accepted; stop cuts the greedy reply")
def _():
    reply = state["reply"]
    cut = next((ch for ch in [" ", ",", "."] if ch in reply.strip()), None)
    assert cut is not None, reply
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages(),
        temperature=0,
        max_completion_tokens=MAX_TOKENS,
        stop=[cut],
        seed=7,
        presence_penalty=0.0,
        frequency_penalty=0.0,
    )
    assert r.choices[0].message.content == reply[: reply.index(cut)], (r, reply)
    assert r.choices[0].finish_reason == "stop"
    # Sampled replies are reproducible with a seed.
    a, b = (
        client.chat.completions.create(
            model=MODEL,
            messages=messages(),
            temperature=1.0,
            seed=1234,
            max_tokens=8,
            presence_penalty=0.5,
            frequency_penalty=0.5,
        ).choices[0].message.content
        for _ in range(2)
    )
    assert a == b, (a, b)


@check("n=9 and wrong field types raise BadRequestError naming the field")
def _():
    expect_error(
        openai.BadRequestError,
        400,
        lambda: client.chat.completions.create(
            model=MODEL, messages=messages(), n=9, max_tokens=4
        ),
        param="n",
    )
    expect_error(
        openai.BadRequestError,
        400,
        lambda: client.chat.completions.create(
            model=MODEL, messages=messages(), max_tokens=4, extra_body={"temperature": "hot"}
        ),
        param="temperature",
    )
    expect_error(
        openai.BadRequestError,
        400,
        lambda: client.chat.completions.create(model=MODEL, messages=[], max_tokens=4),
        param="messages",
    )


@check("a prompt beyond the context raises BadRequestError context_length_exceeded")
def _():
    e = expect_error(
        openai.BadRequestError,
        400,
        lambda: client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hello " * 9000}],
            max_tokens=4,
        ),
        code="context_length_exceeded",
    )
    assert "8192" in e.body["message"], e.body


@check("an unknown model raises NotFoundError")
def _():
    expect_error(
        openai.NotFoundError,
        404,
        lambda: client.chat.completions.create(
            model="gpt-4o", messages=messages(), max_tokens=4
        ),
        code="model_not_found",
        param="model",
    )


@check("a wrong or missing key raises AuthenticationError")
def _():
    bad = openai.OpenAI(base_url=BASE, api_key="sk-wrong", max_retries=0)
    expect_error(openai.AuthenticationError, 401, lambda: bad.models.list())
    expect_error(
        openai.AuthenticationError,
        401,
        lambda: bad.chat.completions.create(model=MODEL, messages=messages(), max_tokens=4),
    )
    none = openai.OpenAI(
        base_url=BASE, api_key="unused", max_retries=0, default_headers={"Authorization": ""}
    )
    expect_error(openai.AuthenticationError, 401, lambda: none.models.list())


@check("tools are accepted (this model's template has no tool section)")
def _():
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages(),
        temperature=0,
        max_tokens=MAX_TOKENS,
        tools=[
            {
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
        ],
        tool_choice="auto",
    )
    assert r.choices[0].message.content == state["reply"]


@check("chat logprobs with top_logprobs, whole and streamed")
def _():
    r = client.chat.completions.create(
        model=MODEL, messages=messages(), temperature=0, max_tokens=MAX_TOKENS,
        logprobs=True, top_logprobs=3,
    )
    c = r.choices[0]
    entries = c.logprobs.content
    assert len(entries) == r.usage.completion_tokens, (len(entries), r.usage)
    for e in entries:
        assert e.logprob <= 0, e
        assert len(e.top_logprobs) == 3, e
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True), tops
        # Greedy: the chosen token is the most likely one.
        assert e.token == e.top_logprobs[0].token and abs(e.logprob - tops[0]) < 1e-5, e
    text = b"".join(bytes(e.bytes) for e in entries).decode()
    assert text == c.message.content, (text, c.message.content)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages(), temperature=0, max_tokens=MAX_TOKENS,
        logprobs=True, top_logprobs=3, stream=True,
    )
    streamed = []
    for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs and choice.logprobs.content:
                streamed.extend(choice.logprobs.content)
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [
        (e.token, round(e.logprob, 5)) for e in entries
    ], (streamed, entries)


@check("completions logprobs: the legacy arrays")
def _():
    r = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n, lp
    assert all(len(t) <= 2 for t in lp.top_logprobs), lp.top_logprobs
    assert lp.text_offset == sorted(lp.text_offset), lp.text_offset
    assert "".join(lp.tokens) == r.choices[0].text, (lp.tokens, r.choices[0].text)


@check("logprobs refusals")
def _():
    expect_error(
        openai.BadRequestError, 400,
        lambda: client.chat.completions.create(
            model=MODEL, messages=messages(), max_tokens=2, logprobs=True, top_logprobs=21
        ),
        param="top_logprobs",
    )
    expect_error(
        openai.BadRequestError, 400,
        lambda: client.chat.completions.create(
            model=MODEL, messages=messages(), max_tokens=2, top_logprobs=2
        ),
        param="top_logprobs",
    )


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "kind": {"enum": ["person", "robot", "cat"]},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "kind", "tags", "address"],
    "additionalProperties": False,
}


@check("n=3: three seeded choices, whole and streamed alike, usage over all")
def _():
    kw = dict(model=MODEL, messages=messages(), max_tokens=12, temperature=1.0, seed=21, n=3)
    r = client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2], r.choices
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1, texts
    # The prompt counted once, every choice's tokens.
    assert 3 <= r.usage.completion_tokens <= 36, r.usage
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, r.usage
    # Choice i is the same reply as a single request seeded seed + i.
    single = client.chat.completions.create(**dict(kw, n=1, seed=22)).choices[0].message.content
    assert single == texts[1], (single, texts)
    streamed = {0: "", 1: "", 2: ""}
    finished = set()
    usage = None
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert [streamed[i] for i in range(3)] == texts, (streamed, texts)
    assert finished == {0, 1, 2}
    assert usage and usage.completion_tokens == r.usage.completion_tokens, (usage, r.usage)


@check("responses.create: whole and streamed, instructions and input items")
def _():
    kw = dict(model=MODEL, instructions=SYSTEM, input=USER, temperature=0, max_output_tokens=MAX_TOKENS)
    r = client.responses.create(**kw)
    assert r.object == "response" and r.status in ("completed", "incomplete"), r
    assert r.output_text == state["reply"], (r.output_text, state["reply"])
    assert r.usage.input_tokens > 5 and r.usage.output_tokens >= 1, r.usage
    kinds, final = [], None
    for event in client.responses.create(**kw, stream=True):
        kinds.append(event.type)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete"), kinds
    assert "response.output_text.delta" in kinds and "response.output_item.done" in kinds, kinds
    assert final.output_text == r.output_text, (final.output_text, r.output_text)
    items = client.responses.create(
        model=MODEL, temperature=0, max_output_tokens=MAX_TOKENS,
        input=[{"role": "developer", "content": SYSTEM}, {"role": "user", "content": [{"type": "input_text", "text": USER}]}],
    )
    assert items.output_text == r.output_text, (items.output_text, r.output_text)


@check("responses: forced function call, text.format schema, refusals")
def _():
    import json

    tool = {"type": "function", "name": "get_capital", "description": "Capital of a country",
            "parameters": {"type": "object", "properties": {"country": {"type": "string", "maxLength": 30}},
                           "required": ["country"], "additionalProperties": False}}
    r = client.responses.create(model=MODEL, input=USER, tools=[tool], tool_choice="required",
                                temperature=1.0, max_output_tokens=80)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_capital", r.output
    assert isinstance(json.loads(calls[0].arguments)["country"], str)
    # The call answered: a second turn with the output.
    r2 = client.responses.create(model=MODEL, temperature=0, max_output_tokens=16, tools=[tool], input=[
        {"role": "user", "content": USER},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_capital", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Paris"},
    ])
    assert r2.status in ("completed", "incomplete")
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}},
              "required": ["capital"], "additionalProperties": False}
    r3 = client.responses.create(model=MODEL, input=USER, temperature=1.0, max_output_tokens=60,
                                 text={"format": {"type": "json_schema", "name": "c", "schema": schema, "strict": True}})
    assert set(json.loads(r3.output_text)) == {"capital"}, r3.output_text
    expect_error(openai.BadRequestError, 400,
                 lambda: client.responses.create(model=MODEL, input=[{"type": "image_generation_call"}]),
                 param="input[0]")


@check("responses: stored, retrieved, chained with previous_response_id, deleted")
def _():
    import json

    first = client.responses.create(model=MODEL, instructions=SYSTEM, input=USER, temperature=0,
                                    max_output_tokens=MAX_TOKENS)
    assert first.store is True and first.id.startswith("resp_"), first
    again = client.responses.retrieve(first.id)
    assert again.id == first.id and again.output_text == first.output_text, (again, first)
    assert again.output[-1].id == first.output[-1].id, "the same message id"
    assert again.usage.output_tokens == first.usage.output_tokens
    # A follow-up sees the earlier turn: its prompt holds the first question and answer.
    follow = client.responses.create(model=MODEL, previous_response_id=first.id, input="And of Italy?",
                                     temperature=0, max_output_tokens=MAX_TOKENS)
    assert follow.previous_response_id == first.id
    alone = client.responses.create(model=MODEL, input="And of Italy?", temperature=0,
                                    max_output_tokens=MAX_TOKENS, store=False)
    assert alone.store is False
    expect_error(openai.NotFoundError, 404, lambda: client.responses.retrieve(alone.id))
    grown = follow.usage.input_tokens - alone.usage.input_tokens
    assert grown >= first.usage.output_tokens + 5, (follow.usage, alone.usage, first.usage)
    # Streamed and stored: retrievable as soon as the stream has ended.
    final = None
    for event in client.responses.create(model=MODEL, previous_response_id=follow.id, input="Thanks!",
                                         temperature=0, max_output_tokens=8, stream=True):
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert client.responses.retrieve(final.id).output_text == final.output_text
    # A forced call, answered in a chained request by its call_id.
    tool = {"type": "function", "name": "get_capital", "description": "Capital of a country",
            "parameters": {"type": "object", "properties": {"country": {"type": "string", "maxLength": 30}},
                           "required": ["country"], "additionalProperties": False}}
    called = client.responses.create(model=MODEL, input=USER, tools=[tool], tool_choice="required",
                                     temperature=0, max_output_tokens=80)
    call = [o for o in called.output if o.type == "function_call"][0]
    stored_call = [o for o in client.responses.retrieve(called.id).output if o.type == "function_call"][0]
    assert (stored_call.call_id, stored_call.name, json.loads(stored_call.arguments)) == (
        call.call_id, call.name, json.loads(call.arguments))
    answered = client.responses.create(model=MODEL, previous_response_id=called.id, tools=[tool],
                                       temperature=0, max_output_tokens=16,
                                       input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Paris"}])
    assert answered.status in ("completed", "incomplete"), answered
    # Deleted: gone for retrieval and for chaining.
    deleted = client.responses.delete(first.id)
    expect_error(openai.NotFoundError, 404, lambda: client.responses.retrieve(first.id))
    expect_error(openai.NotFoundError, 404, lambda: client.responses.create(
        model=MODEL, previous_response_id=first.id, input="x", max_output_tokens=2))
    expect_error(openai.BadRequestError, 400, lambda: client.responses.create(
        model=MODEL, previous_response_id="resp_123", input="x"), param="previous_response_id")
    # Another caller (a personal key would be another owner; no key at all stores nothing).
    anonymous = openai.OpenAI(base_url=BASE, api_key="none", max_retries=0, timeout=30)
    try:
        anonymous.responses.retrieve(follow.id)
        raise AssertionError("an unauthenticated caller read a stored response")
    except (openai.AuthenticationError, openai.NotFoundError):
        pass
    del deleted


@check("response_format json_schema (strict): 50 samples at temperature 1 all validate")
def _():
    import concurrent.futures
    import json

    import jsonschema

    def one(i):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Describe a character as JSON ({i})."}],
            temperature=1.0,
            seed=i,
            max_tokens=200,
            response_format={"type": "json_schema", "json_schema": {"name": "character", "schema": SCHEMA, "strict": True}},
        )
        c = r.choices[0]
        assert c.finish_reason == "stop", (c.finish_reason, c.message.content)
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
        return c.message.content

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(one, range(50)))
    assert len(set(outs)) > 1, "50 samples at temperature 1 were all the same"


@check("response_format json_object, and a Lark grammar for arithmetic")
def _():
    import json
    import re

    r = client.chat.completions.create(
        model=MODEL, messages=messages(), temperature=1.0, seed=3, max_tokens=120,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict), r.choices[0].message.content
    grammar = "\n".join([
        'start: term (OP term)~0..3',
        'term: NUMBER | "(" NUMBER OP NUMBER ")"',
        'NUMBER: /[1-9][0-9]{0,2}|0/',
        'OP: "+" | "-" | "*"',
    ])
    for i in range(10):
        r = client.completions.create(
            model=MODEL, prompt=f"An arithmetic expression ({i}): ", max_tokens=80, temperature=1.0,
            seed=i, extra_body={"guided_grammar": grammar},
        )
        c = r.choices[0]
        assert c.finish_reason == "stop", (c.finish_reason, c.text)
        assert re.fullmatch(r"[0-9+\-*()]+", c.text), c.text
        eval(compile(c.text, "<expr>", "eval"), {"__builtins__": {}})  # parses as arithmetic


@check("tool_choice required and named force a call with valid arguments")
def _():
    import json

    import jsonschema

    tools = [
        {"type": "function", "function": {"name": "get_capital", "description": "Capital of a country",
            "parameters": {"type": "object", "properties": {"country": {"type": "string", "maxLength": 30}},
                "required": ["country"], "additionalProperties": False}}},
        {"type": "function", "function": {"name": "add", "description": "Add two numbers",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"], "additionalProperties": False}}},
    ]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        for seed in range(3):
            r = client.chat.completions.create(
                model=MODEL, messages=messages(), max_tokens=100, temperature=1.0, seed=seed,
                tools=tools, tool_choice=choice,
            )
            c = r.choices[0]
            assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
            call = c.message.tool_calls[0].function
            if choice != "required":
                assert call.name == "add", call
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    expect_error(
        openai.BadRequestError, 400,
        lambda: client.chat.completions.create(
            model=MODEL, messages=messages(), max_tokens=4, tools=tools,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        ),
        param="tool_choice",
    )


@check("a GBNF grammar (llama-server's `grammar`) for arithmetic: every sample parses")
def _():
    import re

    # A finite language (at most four terms, one level of parentheses), so every sample ends.
    gbnf = "\n".join([
        "# a small arithmetic language",
        "root ::= term (op term){0,3}",
        'term ::= num | "(" num op num ")"',
        'num ::= [1-9] [0-9]{0,2} | "0"',
        'op ::= "+" | "-" | "*"',
    ])
    for i in range(20):
        r = client.completions.create(
            model=MODEL, prompt=f"Arithmetic ({i}): ", max_tokens=80, temperature=1.0, seed=100 + i,
            extra_body={"grammar": gbnf},
        )
        c = r.choices[0]
        assert c.finish_reason == "stop", (c.finish_reason, c.text)
        assert re.fullmatch(r"[0-9+\-*()]+", c.text), c.text
        eval(compile(c.text, "<expr>", "eval"), {"__builtins__": {}})


@check("grammar refusals name the field")
def _():
    expect_error(
        openai.BadRequestError, 400,
        lambda: client.chat.completions.create(
            model=MODEL, messages=messages(), max_tokens=2,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        ),
        param="response_format",
    )
    expect_error(
        openai.BadRequestError, 400,
        lambda: client.completions.create(
            model=MODEL, prompt="x", max_tokens=2, extra_body={"grammar": "root ::= \"a"},
        ),
        param="grammar",
    )


# Embeddings: llama.cpp's vectors for the same texts (tests/data/README.md says how they were made).
import json as _json
import math as _math

EMBED_REF = _json.load(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "smollm2-135m-embeddings.json")))


def dot(a, b):
    return sum(x * y for x, y in zip(a, b))


@check("embeddings: llama.cpp's vectors, the same alone and in a batch, paraphrases ranked first")
def _():
    texts = EMBED_REF["texts"]
    # The client asks for base64 unless told otherwise: both encodings are checked.
    batch = client.embeddings.create(model=MODEL, input=texts)
    assert batch.object == "list" and len(batch.data) == len(texts)
    assert [d.index for d in batch.data] == list(range(len(texts)))
    assert batch.usage.prompt_tokens > len(texts) and batch.usage.total_tokens == batch.usage.prompt_tokens
    vectors = [d.embedding for d in batch.data]
    for i, v in enumerate(vectors):
        assert len(v) == 576, len(v)
        assert abs(_math.sqrt(dot(v, v)) - 1.0) < 1e-4, "L2-normalized"
        cosine = dot(v, EMBED_REF["mean"][i])
        assert cosine > 0.999, (i, cosine)
    for i in (0, 4, 9):
        alone = client.embeddings.create(model=MODEL, input=texts[i], encoding_format="float").data[0].embedding
        assert max(abs(a - b) for a, b in zip(alone, vectors[i])) < 1e-5, i
    for g in range(0, len(texts), 3):
        a, paraphrase, unrelated = vectors[g], vectors[g + 1], vectors[g + 2]
        assert dot(a, paraphrase) > dot(a, unrelated) + 0.05, (texts[g], dot(a, paraphrase), dot(a, unrelated))


@check("embeddings: last-token pooling, token-id inputs and refusals")
def _():
    texts = EMBED_REF["texts"][:3]
    last = client.embeddings.create(model=MODEL, input=texts, extra_body={"pooling": "last"})
    for i, d in enumerate(last.data):
        assert dot(d.embedding, EMBED_REF["last"][i]) > 0.999, i
    ids = [int(t) for t in _json.loads(smolchat("tokenize", texts[0]))]
    by_ids = client.embeddings.create(model=MODEL, input=[ids], encoding_format="float").data[0].embedding
    by_text = client.embeddings.create(model=MODEL, input=texts[0], encoding_format="float").data[0].embedding
    assert max(abs(a - b) for a, b in zip(by_ids, by_text)) < 1e-5
    expect_error(
        openai.BadRequestError, 400,
        lambda: client.embeddings.create(model=MODEL, input="x", dimensions=64),
        code="unsupported_parameter", param="dimensions",
    )
    expect_error(openai.BadRequestError, 400, lambda: client.embeddings.create(model=MODEL, input=[]), param="input")
    expect_error(
        openai.BadRequestError, 400,
        lambda: client.embeddings.create(model=MODEL, input="word " * 9000),
        code="context_length_exceeded", param="input[0]",
    )
    expect_error(openai.NotFoundError, 404, lambda: client.embeddings.create(model="gpt-4", input="x"))


print(f"{results['passed']} passed, {results['failed']} failed", flush=True)
sys.exit(1 if results["failed"] else 0)
