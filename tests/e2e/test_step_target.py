"""``--step-time-target-ms`` on a live server: while a request decodes, a 1,000-token prompt is spread
over many steps (the decoding request gets a token in each of them) instead of stalling it for one
long step; its greedy output is what it is alone; the scheduler's metrics show the fitted model and
the budget."""

from __future__ import annotations

import random
import threading

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


def tokens_beside_a_decoder(server: Server, prompt: list[int]) -> tuple[int, list[int]]:
    """Send ``prompt`` while another request decodes → (tokens the decoder got between sending it and its
    first token, its output)."""
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
        before = got[0]
        stream = stub.Generate(request(prompt, 4), timeout=120)
        first = next(stream)
        during = got[0] - before
        out = list(first.token_ids) + [x for r in stream for x in r.token_ids]
        assert got[0] < 1500, "the decoder finished before the prompt did: the test proves nothing"
        stop.set()
        call.cancel()
        t.join(30)
    return during, out


def test_a_long_prompt_beside_a_decoder_is_spread_over_steps(model_dir, tmp_path) -> None:
    prompt = [random.Random(3).randrange(10, 1900) for _ in range(1000)]
    s = Server(model_dir, tmp_path / "target.log", "--step-time-target-ms", "0.01")  # (below any step: 64 a step)
    try:
        during, out = tokens_beside_a_decoder(s, prompt)
        # ≥ 1,000 / 64 steps before its first token, each giving the decoder one (the stream may lag a few)
        assert during >= 12, during
        with s.channel() as ch:
            alone = [x for r in pb_grpc.GenerationServiceStub(ch).Generate(request(prompt, 4, salt="alone"),
                                                                            timeout=120) for x in r.token_ids]
        assert out == alone and len(out) == 4
        m = s.metrics("scheduler")
        assert "banyan:step_prompt_budget_tokens 64.0" in m, m[-2000:]
        fitted = {line.split('"')[1]: float(line.split()[-1]) for line in m.splitlines()
                  if line.startswith("banyan:step_model_ms{")}
        assert set(fitted) == {"base", "per_decode_row", "per_prompt_token"}
        assert fitted["per_prompt_token"] > 0 and fitted != {"base": 2.0, "per_decode_row": 0.05,
                                                             "per_prompt_token": 0.03}  # (the prior: not fitted)
    finally:
        assert s.stop() == 0, s.log_text()[-3000:]

    s = Server(model_dir, tmp_path / "off.log")  # without the flag: the prompt in one step
    try:
        during, out_off = tokens_beside_a_decoder(s, prompt)
        assert during <= 8, during
        assert out_off == out
        assert "banyan:step_prompt_budget_tokens" not in s.metrics("scheduler")
    finally:
        assert s.stop() == 0, s.log_text()[-3000:]
