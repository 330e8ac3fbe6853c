"""FP8 through ``banyan serve``: a server on an FP8 checkpoint (HF ``fp8`` layout, per-tensor weight
scales, static activation scales, per-layer KV-cache scales) with an FP8 KV cache generates, batched
(chunked prefills next to decodes), what the worker computes for the same tokens in-process
(teacher-forced: same tokens, log-probabilities within 1e-2 — measured ≤ 3e-4: float noise that
moves a value across an e4m3 rounding boundary shows, in batches of other shapes), and reports what it serves with
(start-up line, the scheduler's worker_ready, worker metrics). Unsupported quantization fails at
start with a message naming the method."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.support import Server, make_tiny_model
from tests.worker.fp8_checkpoints import make_fp8_checkpoint, with_quantization_config
from benchmarks.driver import Driver
from services.worker.runner import ModelRunner
from shared.config import WorkerConfig
from shared.proto.banyan.v1 import generation_pb2 as pb
from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc

PROMPTS = [[(11 * i + 5 * j) % 400 + 7 for j in range(n)] for i, n in enumerate([3, 20, 45, 9, 70, 1])]
NEW = 12


@pytest.fixture(scope="module")
def models(demo_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("fp8")
    src = make_tiny_model("llama", d / "bf16", demo_dir, seed=5)
    return src, make_fp8_checkpoint(src, d / "fp8", "fp8-tensor", kv_scales="layer")


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    s = Server(str(models[1]), tmp_path_factory.mktemp("fp8-serve") / "server.log", "--kv-cache-dtype", "fp8_e4m3",
               "--max-prefill-tokens", "64", "--max-running-requests", "4")
    yield s
    assert s.stop() == 0, s.log_text()[-3000:]


def _generate(stub, ids: list[int]) -> tuple[list[int], list[float]]:
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling_params=pb.SamplingParams(
        max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=True))
    toks, lps = [], []
    for r in stub.Generate(req, timeout=120):
        toks += r.token_ids
        lps += [x.token.logprob for x in r.logprobs]
    return toks, lps


def test_serves_an_fp8_checkpoint_with_an_fp8_kv_cache(server, stub, models):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        outs = list(pool.map(lambda p: _generate(stub, p), PROMPTS))
    ref = ModelRunner(WorkerConfig(model=str(models[1]), max_total_tokens=2048, kv_cache_dtype="fp8_e4m3"),
                      str(models[1]))
    driver = Driver(ref, max_rows=8)
    for i, (prompt, (toks, lps)) in enumerate(zip(PROMPTS, outs, strict=True)):
        assert len(toks) == len(lps) == NEW
        logits = ref.forward(driver.batch([(f"r{i}", prompt + toks[:-1], False)]), all_logits=True)[len(prompt) - 1:]
        logp = torch.log_softmax(logits.double(), -1)
        chosen = logp[torch.arange(NEW), torch.tensor(toks)]
        assert (chosen - torch.tensor(lps, dtype=torch.float64)).abs().max() < 1e-2, (i, chosen, lps)
        top2 = logp.topk(2, -1)
        near_tie = (top2.values[:, 0] - top2.values[:, 1]) < 1e-2
        assert ((top2.indices[:, 0] == torch.tensor(toks)) | near_tie).all(), (i, toks, top2.indices[:, 0])


def test_reports_what_it_serves_with(server, stub):
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    records = server.log_records()
    loaded = next(r for r in records if r.get("event") == "model_loaded")
    ready = next(r for r in records if r.get("event") == "worker_ready" and "kv_cache_dtype" in r)
    assert loaded["kv_cache_dtype"] == ready["kv_cache_dtype"] == "fp8_e4m3" and loaded["kv_scales"] == "checkpoint"
    assert loaded["quantization"] == ready["quantization"] == "fp8 (fp8 checkpoint)"
    assert loaded["pool_size"] == info.kv_pool_tokens
    metrics = server.metrics("worker")
    m = re.search(r'^banyan:kv_pool_tokens\{kv_cache_dtype="fp8_e4m3"\} (\S+)$', metrics, re.M)
    assert m and float(m.group(1)) == info.kv_pool_tokens
    per_token = re.search(r'^banyan:kv_pool_bytes_per_token\{kv_cache_dtype="fp8_e4m3"\} (\S+)$', metrics, re.M)
    assert per_token and float(per_token.group(1)) == 2 * 2 * 2 * 16  # K+V, 2 layers, 2 KV heads of 16, 1 byte
    assert re.search(r'^banyan:weight_bytes\{quantization="fp8 \(fp8 checkpoint\)"\} \d', metrics, re.M)


@pytest.mark.parametrize("how", ["flag", "checkpoint"])
def test_unsupported_quantization_fails_at_start_naming_it(models, tmp_path, how):
    src = models[0]
    if how == "flag":
        model, args, message = src, ("--quantization", "awq"), "quantization 'awq' is not supported"
    else:
        model = with_quantization_config(src, tmp_path / "awq", {"quant_method": "awq", "bits": 4, "group_size": 128})
        args, message = (), "quantization method 'awq' is not supported"
    with pytest.raises(RuntimeError, match="server failed to start") as err:
        Server(str(model), tmp_path / "server.log", *args)
    assert message in str(err.value)
