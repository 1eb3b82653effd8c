"""Lists and uses every model of a running smolchat server with the official `openai`,
`anthropic` and `ollama` Python clients.

Run by tests/models.rs, which starts the server (with more than one model) and passes:
  SMOLCHAT_BASE     http://127.0.0.1:PORT
  SMOLCHAT_MODELS   the model ids, comma-separated, the default first

Prints one line per check and `N passed, M failed`; exits non-zero when a check failed.
"""

import os
import sys
import traceback

import anthropic
import ollama
import openai

BASE = os.environ["SMOLCHAT_BASE"]
MODELS = os.environ["SMOLCHAT_MODELS"].split(",")
results = {"passed": 0, "failed": 0}


def check(name, f):
    try:
        f()
        results["passed"] += 1
        print(f"ok   {name}")
    except Exception:  # noqa: BLE001 - every failure is reported
        results["failed"] += 1
        print(f"FAIL {name}")
        traceback.print_exc()


oa = openai.OpenAI(base_url=BASE + "/v1", api_key="unused", timeout=120)
an = anthropic.Anthropic(base_url=BASE, api_key="unused", timeout=120)
ol = ollama.Client(host=BASE, timeout=120)


def openai_lists():
    ids = [m.id for m in oa.models.list()]
    for m in MODELS:
        assert m in ids, (m, ids)


def openai_uses(model):
    def run():
        r = oa.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Name a colour."}],
            temperature=0,
            max_tokens=4,
        )
        assert r.model == model, (r.model, model)
        assert r.usage.completion_tokens > 0
    return run


def anthropic_lists():
    ids = [m.id for m in an.models.list()]
    for m in MODELS:
        assert m in ids, (m, ids)


def anthropic_uses(model):
    def run():
        r = an.messages.create(
            model=model,
            max_tokens=4,
            messages=[{"role": "user", "content": "Name a colour."}],
        )
        assert r.model == model, (r.model, model)
        assert r.usage.output_tokens > 0
    return run


def ollama_lists():
    names = [m.model for m in ol.list().models]
    for m in MODELS:
        assert f"{m}:latest" in names, (m, names)


def ollama_uses(model):
    def run():
        r = ol.chat(
            model=model,
            messages=[{"role": "user", "content": "Name a colour."}],
            options={"temperature": 0, "num_predict": 4},
        )
        assert r.model == f"{model}:latest", (r.model, model)
        assert r.eval_count > 0
        running = [m.model for m in ol.ps().models]
        assert f"{model}:latest" in running, running
    return run


check("openai lists every model", openai_lists)
check("anthropic lists every model", anthropic_lists)
check("ollama lists every model", ollama_lists)
for model in MODELS:
    check(f"openai uses {model}", openai_uses(model))
    check(f"anthropic uses {model}", anthropic_uses(model))
    check(f"ollama uses {model}", ollama_uses(model))

print(f"{results['passed']} passed, {results['failed']} failed")
sys.exit(1 if results["failed"] else 0)
