"""Drives a running smolchat server with the official `anthropic` Python client.

Run by tests/openai.rs, which starts the server and passes:
  SMOLCHAT_HOST     http://127.0.0.1:PORT (the client adds /v1/messages)
  SMOLCHAT_API_KEY  the key the server was started with

Prints one line per check and `N passed, M failed`; exits non-zero when a check failed.
"""

import os
import sys
import traceback

import anthropic
import httpx

HOST = os.environ["SMOLCHAT_HOST"]
KEY = os.environ["SMOLCHAT_API_KEY"]

# No retries: a refusal must surface as the exception the client maps it to.
client = anthropic.Anthropic(base_url=HOST, api_key=KEY, max_retries=0, timeout=120)
results = {"passed": 0, "failed": 0}
state = {}
SYSTEM = "You are a concise assistant."
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
TOOL = {
    "name": "get_capital",
    "description": "Capital of a country",
    "input_schema": {
        "type": "object",
        "properties": {"country": {"type": "string", "maxLength": 30}},
        "required": ["country"],
        "additionalProperties": False,
    },
}


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


@check("the served model's id")
def _():
    r = httpx.get(f"{HOST}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    state["model"] = r.json()["data"][0]["id"]


# This SDK (2.x) no longer takes sampling arguments; the server still reads them, sent as
# extra body fields, so replies are greedy and comparable.
GREEDY = {"temperature": 0}


def create(**kw):
    args = dict(model=state["model"], max_tokens=24, system=SYSTEM, messages=MESSAGES, extra_body=GREEDY)
    args.update(kw)
    return client.messages.create(**args)


@check("messages.create: a message with a text block and usage")
def _():
    r = create()
    assert r.type == "message" and r.role == "assistant", r
    assert r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"], r.content
    assert r.content[0].text, r
    assert r.stop_reason in ("end_turn", "max_tokens"), r.stop_reason
    assert r.usage.input_tokens > 5 and r.usage.output_tokens >= 1, r.usage
    state["text"] = r.content[0].text


@check("messages.stream: the same greedy text, and the final message")
def _():
    with client.messages.stream(
        model=state["model"], max_tokens=24, system=SYSTEM, messages=MESSAGES, extra_body=GREEDY
    ) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == state["text"], (text, state["text"])
    assert final.content[0].text == state["text"]
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.output_tokens >= 1


@check("streamed events in Anthropic's order")
def _():
    kinds = []
    with client.messages.create(
        model=state["model"], max_tokens=8, messages=MESSAGES, extra_body=GREEDY, stream=True
    ) as events:
        for e in events:
            kinds.append(e.type)
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    assert kinds[1] == "content_block_start" and "content_block_delta" in kinds, kinds
    assert kinds[-2] == "message_delta" and kinds[-3] == "content_block_stop", kinds


@check("stop_sequences end the reply at the sequence")
def _():
    words = state["text"].split()
    assert len(words) >= 3, state["text"]
    seq = words[2]
    r = create(stop_sequences=[seq])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == seq, r
    assert seq not in r.content[0].text


@check("tools offered, and a tool_result answered")
def _():
    r = create(tools=[TOOL], tool_choice={"type": "auto"})
    assert r.stop_reason in ("end_turn", "max_tokens", "tool_use"), r
    assert all(b.type in ("text", "tool_use") for b in r.content), r.content
    r = create(
        tools=[TOOL],
        messages=[
            MESSAGES[0],
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_01", "name": "get_capital", "input": {"country": "France"}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "Paris"}]},
        ],
    )
    assert r.content and r.content[-1].type in ("text", "tool_use"), r


@check("tool_choice any and tool force a call whose input matches the schema")
def _():
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_capital"}):
        r = create(max_tokens=160, tools=[TOOL], tool_choice=choice, extra_body={"temperature": 1})
        uses = [b for b in r.content if b.type == "tool_use"]
        assert r.stop_reason == "tool_use" and len(uses) == 1, r
        assert uses[0].name == "get_capital" and isinstance(uses[0].input.get("country"), str), uses


@check("thinking enabled is accepted")
def _():
    r = create(max_tokens=32, extra_body={"temperature": 1}, thinking={"type": "enabled", "budget_tokens": 1024})
    assert r.content and all(b.type in ("thinking", "text") for b in r.content), r.content


@check("output_config.format: a JSON Schema the reply follows")
def _():
    import json

    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 20}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    r = create(max_tokens=60, output_config={"format": {"type": "json_schema", "schema": schema}})
    assert r.stop_reason == "end_turn", r
    assert set(json.loads(r.content[0].text)) == {"capital"}, r.content


@check("the key as a bearer token works too")
def _():
    bearer = anthropic.Anthropic(base_url=HOST, auth_token=KEY, api_key=None, max_retries=0)
    r = bearer.messages.create(model=state["model"], max_tokens=4, messages=MESSAGES)
    assert r.type == "message"


@check("refusals map onto the client's exceptions")
def _():
    bad = anthropic.Anthropic(base_url=HOST, api_key="wrong", max_retries=0)
    try:
        bad.messages.create(model=state["model"], max_tokens=4, messages=MESSAGES)
        raise AssertionError("a wrong key was accepted")
    except anthropic.AuthenticationError as e:
        assert e.body["error"]["type"] == "authentication_error", e.body
    for kw, exc in [
        ({"model": "claude-nope"}, anthropic.NotFoundError),
        ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [TOOL]}, anthropic.BadRequestError),
        ({"extra_body": {"temperature": 5}}, anthropic.BadRequestError),
        ({"output_config": {"format": {"type": "json_schema", "schema": {"type": 7}}}}, anthropic.BadRequestError),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGk="}}]}]},
            anthropic.BadRequestError,
        ),
    ]:
        try:
            create(**kw)
            raise AssertionError(f"{kw} was accepted")
        except exc as e:
            assert e.body["type"] == "error" and e.body["error"]["message"], e.body
    r = httpx.post(
        f"{HOST}/v1/messages",
        headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
        json={"model": state["model"], "messages": MESSAGES},
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert "max_tokens" in r.json()["error"]["message"], r.text


print(f"{results['passed']} passed, {results['failed']} failed", flush=True)
sys.exit(1 if results["failed"] else 0)
