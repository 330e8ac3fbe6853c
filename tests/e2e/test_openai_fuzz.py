"""Fuzz the OpenAI-compatible HTTP API from its own ``/openapi.json`` with schemathesis: schema-valid
and schema-violating requests to every operation must never get a 5xx (nor FastAPI's raw 422),
errors must be OpenAI-shaped, and the server must still serve afterwards. Bounded in time and in
generation cost, so it fits CI on 2 cores. Runs against a server without an API key."""

from __future__ import annotations

import time

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.support import Server

FUZZ_SECONDS = 40.0  # the whole fuzz run stops drawing cases after this
EXAMPLES = 50  # per operation and mode
GENERATE = ("/v1/chat/completions", "/v1/completions")


@pytest.fixture(scope="module")
def server(demo_dir, tmp_path_factory):
    s = Server(None, tmp_path_factory.mktemp("openai-fuzz") / "server.log")
    yield s
    assert s.stop() == 0, s.log_text()[-3000:]


def _cheap(case) -> None:
    """Keep a generated request's generation small (the API allows a whole context window)."""
    body = case.body
    if case.path == "/generate" and isinstance(body, dict):  # SGLang's native API (http/native/)
        sps = body.get("sampling_params")
        for sp in sps if isinstance(sps, list) else [sps]:
            if isinstance(sp, dict):
                sp["max_new_tokens"] = min(sp["max_new_tokens"], 8) if isinstance(sp.get("max_new_tokens"), int) else 8
                if isinstance(sp.get("n"), int) and sp["n"] > 4:
                    sp["n"] = 4
        if sps is None:
            body["sampling_params"] = {"max_new_tokens": 8}
        return
    if case.path == "/v1/responses" and isinstance(body, dict):  # (OpenAI's Responses API: http/responses.py)
        out = body.get("max_output_tokens")
        body["max_output_tokens"] = min(out, 8) if isinstance(out, int) and not isinstance(out, bool) else 8
        return
    if case.path not in GENERATE or not isinstance(body, dict):
        return
    for name in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(name), int) and body[name] > 8:
            body[name] = 8
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 8
    if isinstance(body.get("n"), int) and body["n"] > 4:
        body["n"] = 4
    if isinstance(body.get("prompt"), list) and len(body["prompt"]) > 4 and isinstance(body["prompt"][0], (str, list)):
        body["prompt"] = body["prompt"][:4]


def test_fuzz_openapi_no_server_errors(server):
    schema = schemathesis.openapi.from_url(server.http_url + "/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    assert {op.path for op in operations} >= set(GENERATE)
    deadline = time.monotonic() + FUZZ_SECONDS
    calls = 0

    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @settings(max_examples=EXAMPLES, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def check(case) -> None:
                nonlocal calls
                if time.monotonic() > deadline:
                    return
                _cheap(case)
                r = case.call(base_url=server.http_url, timeout=60)
                calls += 1
                what = f"{case.method} {case.path} {case.body!r:.600} → {r.status_code} {r.text[:400]}"
                assert r.status_code < 500 and r.status_code != 422, what
                if r.status_code >= 400:
                    assert r.json()["error"]["message"], what

            try:
                check()
            except Unsatisfiable:  # an operation without inputs has nothing to violate
                assert mode == GenerationMode.NEGATIVE, op.label
    assert calls >= 50, f"only {calls} fuzz calls in {FUZZ_SECONDS} s"
    assert requests.get(server.http_url + "/health", timeout=10).status_code == 200
    r = requests.post(server.http_url + "/v1/completions", json={"prompt": "still alive", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert server.proc.poll() is None
