"""``--step-time-target-ms`` on a live server: while a request decodes, a 1,000-token prompt is spread
over many steps (the decoding request in each of them, the worker's step trace says) instead of
stalling it for one long step; its greedy output is what it is alone; the scheduler's metrics show the
fitted model and the budget."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import pytest

from shared.proto.banyan.v1 import generation_pb2 as pb
from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc
from tests.support import Server, make_tiny_model


@pytest.fixture(scope="module")
def model_dir(demo_dir, tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("llama-2k-step")
    make_tiny_model("llama", d, demo_dir, seed=5, max_positions=2048)
    return str(d)


def request(ids: list[int], max_tokens: int, salt: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), cache_salt=salt, sampling_params=pb.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, temperature=0.0))


def beside_a_decoder(server: Server, prompt: list[int]) -> list[int]:
    """Send ``prompt`` while another request decodes → its output."""
    got = [0]
    started, stop = threading.Event(), threading.Event()
    with server.channel() as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        call = stub.Generate(request(list(range(30, 50)), 1500), timeout=300)

        def decode() -> None:
            try:
                for r in call:
                    got[0] += len(r.token_ids)
                    if got[0] >= 8:
                        started.set()
                    if stop.is_set():
                        break
            except Exception:  # (cancelled below)
                pass

        t = threading.Thread(target=decode, daemon=True)
        t.start()
        assert started.wait(120), "the decoding request did not start"
        out = [x for r in stub.Generate(request(prompt, 4), timeout=120) for x in r.token_ids]
        stop.set()
        call.cancel()
        t.join(30)
    return out


def pairs(trace: Path) -> list[int]:
    """Tokens of each step that had two rows with prompt tokens among them (the prompt beside the decoder)."""
    steps = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    return [s["tokens"] for s in steps if s["rows"] == 2 and s["tokens"] > 2]


def test_a_long_prompt_beside_a_decoder_is_spread_over_steps(model_dir, tmp_path) -> None:
    prompt = [random.Random(3).randrange(10, 1900) for _ in range(1000)]
    trace = tmp_path / "steps_target.jsonl"
    s = Server(model_dir, tmp_path / "target.log", "--step-time-target-ms", "0.01",  # (below any step)
               env={"BANYAN_STEP_TRACE": str(trace)})
    try:
        out = beside_a_decoder(s, prompt)
        # (a target below any step: the floors — an eighth of the prompt tokens left, at least 64 —
        # 125, 110, 96, 84, 74, then 64s; each chunk beside the decoder's token)
        chunks = pairs(trace)
        assert len(chunks) >= 12 and max(chunks) <= 125 + 1 and sum(chunks) >= 1000, chunks
        with s.channel() as ch:
            alone = [x for r in pb_grpc.GenerationServiceStub(ch).Generate(request(prompt, 4, salt="alone"),
                                                                            timeout=120) for x in r.token_ids]
        assert out == alone and len(out) == 4
        m = s.metrics("scheduler")
        assert "banyan:step_prompt_budget_tokens 64.0" in m, m[-2000:]
        fitted = {line.split('"')[1]: float(line.split()[-1]) for line in m.splitlines()
                  if line.startswith("banyan:step_model_ms{")}
        assert set(fitted) == {"base", "per_decode_row", "per_prompt_token", "prompt_step"}
        assert fitted["per_prompt_token"] > 0 and fitted != {"base": 2.0, "per_decode_row": 0.05,  # (the prior:
                                                             "per_prompt_token": 0.03, "prompt_step": 0.0}  # unfitted)
    finally:
        assert s.stop() == 0, s.log_text()[-3000:]

    trace = tmp_path / "steps_off.jsonl"
    s = Server(model_dir, tmp_path / "off.log", env={"BANYAN_STEP_TRACE": str(trace)})  # without: one step
    try:
        assert beside_a_decoder(s, prompt) == out
        assert 1001 in pairs(trace), pairs(trace)
        assert "banyan:step_prompt_budget_tokens" not in s.metrics("scheduler")
    finally:
        assert s.stop() == 0, s.log_text()[-3000:]
