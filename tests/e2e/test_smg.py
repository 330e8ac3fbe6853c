"""Banyan behind the real Shepherd Model Gateway (``smg`` 1.13.0, the Rust binary of the ``smg``
wheel): two ``banyan serve`` engines (demo model) registered as gRPC workers of one gateway with
the cache-aware policy, all on loopback. The gateway fetches its tokenizer from the engines
(GetTokenizer: no model files, no network), serves the OpenAI API and drives the engines over
SMG's ``sglang.grpc.scheduler`` service: chat and completions (streaming and not, n = 2, a JSON
schema, logprobs, stop strings) with greedy text identical to Banyan's own API, prompt log-probs and
prefill-only requests through its native /generate (vs HF), client
disconnect aborting the request on the engine, a prefix family landing on one engine, and a killed
engine seen by the gateway's health checks (then back once its worker is restarted)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import jsonschema
import openai
import pytest
import requests

from tests.support import Server, free_port

SMG = shutil.which("smg")
ENGINE_ARGS = ("--page-size", "16", "--max-total-tokens", "8192")
SYSTEM = ("You are a careful assistant for a library of very old maps. " * 12).strip()  # ~ 150 tokens


class Gateway:
    """``smg launch`` in a subprocess in front of ``urls`` (its log captured)."""

    def __init__(self, urls: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [SMG, "launch", "--host", "127.0.0.1", "--port", str(self.port),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               "--worker-urls", *urls, "--policy", "cache_aware", "--block-size", "16",
               "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
               "--health-success-threshold", "1", "--worker-warmup-secs", "0", "--worker-warmup-divert-every", "0",
               "--log-level", "info"]
        # loopback only: the hub lookup of the tokenizer (the model is not on the hub) fails at once and
        # the gateway takes the engines' (GetTokenizer)
        env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}", "HF_HUB_OFFLINE": "1"}
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"smg did not get ready:\n{self.log_text()[-4000:]}")
            time.sleep(0.5)

    def _ready(self) -> bool:
        try:
            workers = self.workers()
            if len(workers) < 2 or not all(w["is_healthy"] for w in workers):
                return False
            r = requests.post(self.url + "/v1/completions", timeout=30,
                              json={"model": "banyan-demo", "prompt": "hi", "max_tokens": 1})
            return r.status_code == 200
        except requests.RequestException:
            return False

    def workers(self) -> list[dict]:
        return requests.get(self.url + "/workers", timeout=10).json()["workers"]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def log_text(self) -> str:
        """The gateway's log, without its terminal colours."""
        if not self._log.closed:
            self._log.flush()
        return re.sub(r"\x1b\[[0-9;]*m", "", self.log_path.read_text(errors="replace"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def engines(demo_dir, tmp_path_factory):
    assert SMG, "the smg gateway binary is missing: install the test extra (pip install -e '.[test]')"
    out: list = [None, None]

    def start(i: int) -> None:
        try:
            # (no --model: the embedded demo model, served as banyan-demo; demo_dir built it once)
            out[i] = Server(None, tmp_path_factory.mktemp(f"engine{i}") / "server.log", *ENGINE_ARGS)
        except Exception as e:  # (raised in the test thread below)
            out[i] = e

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [e for e in out if isinstance(e, Exception)]
    if errors:
        for s in out:
            if isinstance(s, Server):
                s.stop()
        raise errors[0]
    yield out
    for s in out:
        assert s.stop() == 0, s.log_text()[-3000:]


@pytest.fixture(scope="module")
def gateway(engines, tmp_path_factory):
    g = Gateway([f"grpc://{e.target}" for e in engines], tmp_path_factory.mktemp("smg") / "smg.log")
    yield g
    g.stop()


@pytest.fixture(scope="module")
def banyan(engines):
    """Banyan's own OpenAI API (engine 0)."""
    with openai.OpenAI(base_url=engines[0].http_url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


def engine_of(engines: list[Server], rid: str, timeout: float = 30) -> int:
    """Which engine's scheduler queued request ``rid`` (the gateway's response id is the request id)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        hits = [i for i, e in enumerate(engines) if any(
            r.get("stage") == "queued" and r.get("request_id") == rid for r in e.log_records())]
        if hits:
            assert len(hits) == 1, hits
            return hits[0]
        time.sleep(0.2)
    raise AssertionError(f"no engine queued {rid}")


def same_text(a: str, b: str) -> bool:
    """Equal up to an unfinished UTF-8 character at the end (Banyan ends it with U+FFFD, the
    gateway leaves it out)."""
    return a.rstrip("\ufffd") == b.rstrip("\ufffd")


def test_the_gateway_takes_the_tokenizer_from_the_engines(gateway):
    log = gateway.log_text()
    assert "Fetching tokenizer from worker" in log and "Successfully loaded tokenizer 'banyan-demo'" in log, \
        log[-3000:]
    with gateway.client() as c:
        assert [m.id for m in c.models.list().data] == ["banyan-demo"]
    for w in gateway.workers():
        assert w["connection_mode"] == "grpc" and w["labels"]["max_context_length"] == "4096"


def test_greedy_chat_and_completions_equal_banyans_own(gateway, banyan, engines):
    msgs = [{"role": "user", "content": "Tell me about old maps."}]
    with gateway.client() as c:
        via = c.chat.completions.create(model="banyan-demo", messages=msgs, max_tokens=24, temperature=0)
        mine = banyan.chat.completions.create(model="banyan-demo", messages=msgs, max_tokens=24, temperature=0)
        assert via.usage.prompt_tokens == mine.usage.prompt_tokens  # the same chat template, the same ids
        assert same_text(via.choices[0].message.content, mine.choices[0].message.content)
        assert via.choices[0].finish_reason == mine.choices[0].finish_reason == "length"
        assert via.usage.completion_tokens == 24
        # completions: the gateway tokenizes the text without BOS; Banyan gets the same ids
        text = "Once upon a time"
        done = c.completions.create(model="banyan-demo", prompt=text, max_tokens=20, temperature=0)
    ids = requests.post(engines[0].http_url + "/tokenize", timeout=30,
                        json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert done.usage.prompt_tokens == len(ids)
    mine = banyan.completions.create(model="banyan-demo", prompt=ids, max_tokens=20, temperature=0)
    assert same_text(done.choices[0].text, mine.choices[0].text)


def test_streaming_n2_json_schema_and_logprobs(gateway, banyan):
    msgs = [{"role": "user", "content": "Name a cartographer."}]
    with gateway.client() as c:
        whole = c.chat.completions.create(model="banyan-demo", messages=msgs, max_tokens=12, temperature=0, n=2)
        parts = {0: "", 1: ""}
        finish, usage = {}, None
        for chunk in c.chat.completions.create(model="banyan-demo", messages=msgs, max_tokens=12, temperature=0,
                                               n=2, stream=True, stream_options={"include_usage": True}):
            usage = chunk.usage or usage
            for ch in chunk.choices:
                parts[ch.index] += ch.delta.content or ""
                finish[ch.index] = ch.finish_reason or finish.get(ch.index)
        assert len(whole.choices) == 2 and finish == {0: "length", 1: "length"}
        for ch in whole.choices:  # greedy: both samples alike, streamed or not
            assert same_text(parts[ch.index], ch.message.content)
        assert usage is not None and usage.completion_tokens == 24
        schema = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"},
                                                   "born": {"type": "integer"}},
                  "required": ["name", "born"], "additionalProperties": False}
        r = c.chat.completions.create(model="banyan-demo", messages=msgs, max_tokens=80, temperature=0.8, n=2,
                                      response_format={"type": "json_schema",
                                                       "json_schema": {"name": "person", "schema": schema}})
        assert len(r.choices) == 2
        for ch in r.choices:
            assert ch.finish_reason == "stop"
            jsonschema.validate(json.loads(ch.message.content), schema)
        lp = c.chat.completions.create(model="banyan-demo", messages=msgs, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=2)
    mine = banyan.chat.completions.create(model="banyan-demo", messages=msgs, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2)
    got, want = lp.choices[0].logprobs.content, mine.choices[0].logprobs.content
    assert len(got) == len(want) == 4
    for g, w in zip(got, want):
        assert g.logprob == pytest.approx(w.logprob, abs=1e-4) and len(g.top_logprobs) == 2
        assert [t.logprob for t in g.top_logprobs] == pytest.approx([t.logprob for t in w.top_logprobs], abs=1e-4)


def test_a_stop_token_ends_the_request_on_the_engine(gateway, engines):
    """The gateway matches stop strings itself; one that is a single token it also sends down as
    a stop token id, and the engine stops generating there."""
    msgs = [{"role": "user", "content": "Describe a map."}]
    with gateway.client() as c:
        full = c.chat.completions.create(model="banyan-demo", messages=msgs, max_tokens=40, temperature=0,
                                         logprobs=True)
        toks = [t.token for t in full.choices[0].logprobs.content]
        text = "".join(toks)

        def one_token(s: str) -> bool:
            return len(requests.post(engines[0].http_url + "/tokenize", timeout=30, json={
                "prompt": s, "add_special_tokens": False}).json()["tokens"]) == 1

        k = next(k for k in range(8, 30) if len(toks[k].strip()) >= 2 and "\ufffd" not in toks[k]
                 and text.find(toks[k]) == len("".join(toks[:k])) and one_token(toks[k]))
        cut = c.chat.completions.create(model="banyan-demo", messages=msgs, max_tokens=40, temperature=0,
                                        stop=[toks[k]])
    assert cut.choices[0].finish_reason == "stop"
    assert same_text(cut.choices[0].message.content, "".join(toks[:k]))
    engine = engines[engine_of(engines, cut.id)]
    deadline = time.monotonic() + 30
    while not (sent := [r for r in engine.log_records() if r.get("stage") == "sent" and r.get("request_id") == cut.id]):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert sent[0]["completion_tokens"] == k + 1 < 40  # Banyan generated up to the stop token, no further


def test_prompt_logprobs_and_prefill_only_through_the_gateway(gateway, demo_dir):
    """The gateway's native /generate with return_logprob and logprob_start_len: the prompt's
    log-probs from Banyan's engine service (vs HF fp32), also for a prefill-only request.
    (smg 1.13 does not forward logit_bias / min_new_tokens to the engine: the logit processors are
    tested on the engine service directly, tests/e2e/test_smg_engine.py.)"""
    import torch
    import transformers

    prompt = [5, 260, 301, 977, 1203, 44, 610, 18, 1450, 92]
    hf = transformers.AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    for start, new in ((0, 3), (4, 0)):
        r = requests.post(gateway.url + "/generate", timeout=60, json={
            "model": "banyan-demo", "input_ids": prompt, "return_logprob": True, "logprob_start_len": start,
            "sampling_params": {"max_new_tokens": new, "temperature": 0}})
        assert r.status_code == 200, r.text
        (out,) = r.json() if isinstance(r.json(), list) else [r.json()]
        meta = out["meta_info"]
        assert meta["completion_tokens"] == new and meta["finish_reason"]["type"] == "length"
        got = meta["input_token_logprobs"]
        assert [int(t) for _, t in got] == prompt[start:]
        want = [None if p == 0 else lp[p - 1, prompt[p]].item() for p in range(start, len(prompt))]
        assert (got[0][0] is None) == (want[0] is None)
        assert [v for v, _ in got if v is not None] == pytest.approx([w for w in want if w is not None], abs=1e-4)


def test_client_disconnect_aborts_on_the_engine(gateway, engines):
    r = requests.post(gateway.url + "/v1/completions", stream=True, timeout=60,
                      json={"model": "banyan-demo", "prompt": "An endless story", "max_tokens": 3000,
                            "temperature": 0, "ignore_eos": True, "stream": True})
    events = (line for line in r.iter_lines() if line.startswith(b"data: {"))
    rid = json.loads(next(events)[6:])["id"]
    next(events)
    r.close()  # the client goes away mid-stream
    engine = engines[engine_of(engines, rid)]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done = [x for x in engine.log_records() if x.get("request_id") == rid and x.get("stage") == "finished"
                and x.get("service") == "scheduler"]
        if done:
            break
        time.sleep(0.2)
    assert done and done[0]["finish_reason"] == "abort" and done[0]["completion_tokens"] < 3000, done


def test_a_prefix_family_lands_on_one_engine(gateway, engines):
    rids, cached = [], []
    with gateway.client() as c:
        for i in range(6):
            r = c.chat.completions.create(model="banyan-demo", max_tokens=2, temperature=0, messages=[
                {"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}?"}])
            rids.append(r.id)
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
            prompt = r.usage.prompt_tokens
    where = {engine_of(engines, rid) for rid in rids}
    assert len(where) == 1, where
    # the gateway routes on the engines' KV events: it learned their block size from them
    assert "Learned block_size from KV event model_id=banyan-demo block_size=16" in gateway.log_text()
    assert all(c >= prompt - 24 for c in cached[1:]), (cached, prompt)  # the family's prefix was cached


def test_a_killed_engine_is_seen_by_the_gateway(gateway, engines):
    """Engine 1's worker is killed: its health check fails (it serves nothing until the launcher's
    restarted worker is ready), the gateway routes around it, then takes it back."""
    url = f"grpc://{engines[1].target}"
    worker = next(r["pid"] for r in engines[1].log_records()
                  if r.get("event") == "started" and r.get("process") == "worker-0")
    os.kill(worker, signal.SIGKILL)

    def healthy() -> bool:
        return next(w for w in gateway.workers() if w["url"] == url)["is_healthy"]

    deadline = time.monotonic() + 60
    while healthy():
        assert time.monotonic() < deadline, "the gateway never saw the engine fail"
        time.sleep(0.2)
    with gateway.client() as c:
        for i in range(3):  # served by the other engine meanwhile
            r = c.completions.create(model="banyan-demo", prompt=f"Map {i}", max_tokens=2)
            assert r.choices[0].finish_reason == "length" and engine_of(engines, r.id) == 0
    deadline = time.monotonic() + 180
    while not healthy():
        assert time.monotonic() < deadline, "the gateway never took the restarted engine back"
        time.sleep(0.5)
