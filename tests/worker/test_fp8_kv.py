"""FP8 KV cache on the CPU: the pool's quantized write and dequantized read, per-layer / per-head
scales (from the checkpoint, split over tensor-parallel ranks), the doubled capacity, logits against
the model-dtype cache within stated bounds, and the FlashInfer backend's FP8 plans (dtypes, k/v
scales, the shared-prefix level) against a PyTorch stand-in of FlashInfer.

Bounds: the logits' relative error against the same model with a float32 cache ≤ 0.08 and top-1
agreement ≥ 90 % on positions whose reference top-2 margin is ≥ 0.1 (measured on these tiny random
models: 0.040–0.043, 100 %); with FP8 weights too and the checkpoint's scales ≤ 0.15 and ≥ 80 % of
fewer positions (measured 0.087–0.093, 88–94 % of 17–18; the default scales give the same there).
"""

from __future__ import annotations

import sys

import pytest
import torch
from tests import fake_flashinfer
from tests.cascade_cases import CASES, GROUPED, build
from tests.worker.fp8_checkpoints import make_fp8_checkpoint
from tests.worker.test_fp8_weights import logits_agreement
from tests.worker.test_models import random_seqs, run_schedule, save_tiny_model, tiny_config

from benchmarks.driver import Driver

import services.worker.runner as runner_mod
from services.worker.attention.torch_backend import TorchAttention
from services.worker.kv_pool import KVPool
from services.worker.quant.fp8 import FP8
from services.worker.quant.kv import KVScales, layer_scales, quantize_kv
from services.worker.runner import ModelRunner
from shared.config import ConfigError, WorkerConfig


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_tiny_model(tiny_config(request.param, max_position_embeddings=4096), path)
    return request.param, path


def test_pool_stores_e4m3_and_reads_back_dequantized() -> None:
    scales = KVScales([torch.tensor([0.5, 2.0])], [torch.tensor([1.0, 0.25])], "checkpoint")
    pool = KVPool(1, 16, 2, 8, torch.bfloat16, "cpu", kv_dtype=FP8, scales=scales)
    plain = KVPool(1, 16, 2, 8, torch.bfloat16, "cpu")
    assert pool.dtype == FP8 and pool.compute_dtype == torch.bfloat16
    assert 2 * pool.bytes_per_token == plain.bytes_per_token
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(5, 2, 8, generator=g) * 4).bfloat16(), (torch.randn(5, 2, 8, generator=g)).bfloat16()
    k[0, 1, 0], v[1, 1, 3] = 5000, -300  # beyond 448 x scale: saturate (a plain cast would give NaN)
    slots = torch.tensor([3, 9, 1, 15, 7])
    pool.store(0, slots, k, v)
    rk, rv = pool.read(0, slots)
    assert rk.dtype == torch.float32 and rk.isfinite().all() and rv.isfinite().all()
    assert rk[0, 1, 0] == 448 * 2.0 and rv[1, 1, 3] == -448 * 0.25
    ok = torch.ones_like(rk, dtype=torch.bool)
    ok[0, 1, 0] = False
    err = (rk - k.float()).abs()[ok] / k.float().abs()[ok].clamp(min=2**-6 * 2.0)
    assert err.max() <= 2**-4  # e4m3: half an ulp of 3 mantissa bits
    assert torch.equal(pool.k[0][slots].view(torch.uint8), quantize_kv(k, 1 / scales.k[0]).view(torch.uint8))
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots] = False
    assert (pool.k[0][untouched].float() == 0).all()


def test_layer_scales_split_over_ranks_like_the_kv_heads() -> None:
    per_head = torch.tensor([1.0, 2.0, 3.0, 4.0])
    found = {0: {"k": per_head, "v": torch.tensor(0.5)}, 2: {"k": torch.tensor([7.0])}}
    s = layer_scales(found, 3, 4, tp_rank=1, tp_size=2)
    assert s.source == "checkpoint"
    assert s.k[0].tolist() == [3.0, 4.0] and s.v[0].tolist() == [0.5, 0.5]
    assert s.k[1].tolist() == [1.0, 1.0] and s.k[2].tolist() == [7.0, 7.0]  # missing: 1.0
    assert layer_scales(found, 3, 4, tp_rank=3, tp_size=8).k[0].tolist() == [2.0]  # fewer heads than ranks
    with pytest.raises(ValueError, match="3 values; expected 1 or one per KV head"):
        layer_scales({0: {"k": torch.ones(3)}}, 1, 4)
    with pytest.raises(ValueError, match="positive and finite"):
        layer_scales({0: {"v": torch.tensor(0.0)}}, 1, 4)


def test_fp8_kv_logits_within_bounds(tiny) -> None:
    arch, path = tiny
    seqs = random_seqs([30, 17, 9])
    chunks = [[12, 18], [5, 5, 7], [3] + [1] * 6]  # chunked prefill next to decode steps
    ref = torch.cat(run_schedule(path, seqs, chunks))
    rel, top1, n = logits_agreement(torch.cat(run_schedule(path, seqs, chunks, kv_dtype=FP8)), ref)
    assert n >= 20 and rel <= 0.08 and top1 >= 0.9, (arch, rel, top1, n)


def test_capacity_doubles_and_is_reported(tiny, monkeypatch) -> None:
    _, path = tiny
    monkeypatch.setattr(runner_mod, "CPU_KV_BYTES", 1 << 20)
    runners = {kv: ModelRunner(WorkerConfig(model=str(path), dtype="bfloat16", kv_cache_dtype=kv), str(path))
               for kv in ("auto", "fp8_e4m3")}
    bf16, fp8 = runners["auto"], runners["fp8_e4m3"]
    assert (bf16.kv_cache_dtype, fp8.kv_cache_dtype) == ("bfloat16", "fp8_e4m3")
    assert fp8.pool_size + 1 == 2 * (bf16.pool_size + 1) and bf16.pool_size > 1000  # (slot 0 is padding)
    assert fp8.kv.bytes_per_token * 2 == bf16.kv.bytes_per_token
    assert fp8.kv.k[0].dtype == FP8 and fp8.kv.scales.source == "default"
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        WorkerConfig(kv_cache_dtype="int8")


def test_checkpoint_kv_scales_are_used(tiny, tmp_path) -> None:
    _, path = tiny
    ckpt = make_fp8_checkpoint(path, tmp_path / "m", "ct-channel", kv_scales="head")
    runners = {kv: ModelRunner(WorkerConfig(model=str(ckpt), max_total_tokens=256, kv_cache_dtype=kv), str(ckpt))
               for kv in ("auto", "fp8_e4m3")}
    r, plain = runners["fp8_e4m3"], runners["auto"]
    assert r.kv.scales.source == "checkpoint" and r.quantization == "fp8 (compressed-tensors checkpoint)"
    heads = r.spec.num_kv_heads
    torch.testing.assert_close(r.kv.scales.k[1], torch.linspace(0.02, 0.05, heads) * 2)
    torch.testing.assert_close(r.kv.scales.v[0], torch.linspace(0.02, 0.05, heads) * 2)
    assert plain.kv.scales is None and plain.kv_cache_dtype == "float32"  # scales unused without FP8 KV
    seqs = random_seqs([21, 8])
    got = []
    for runner in (r, plain):  # FP8 weights both; the cache FP8 with the checkpoint's scales, or float32
        driver = Driver(runner, max_rows=4)
        first = runner.forward(driver.batch([("a", seqs[0][:9], False), ("b", seqs[1], False)]), all_logits=True)
        got.append(torch.cat([first, runner.forward(driver.batch([("a", seqs[0][9:], False)]), all_logits=True)]))
    rel, top1, _ = logits_agreement(got[0], got[1])
    assert 0 < rel <= 0.15 and top1 >= 0.8, (rel, top1)


# --- the FlashInfer backend's FP8 plans, against a PyTorch stand-in --------------------------------------


def fp8_flashinfer():
    """fake_flashinfer with FlashInfer's FP8-KV semantics: plans carry q/kv dtypes that runs check;
    a run over an e4m3 cache multiplies the scores by k_scale (FlashInfer folds it into the softmax
    scale) and the output by v_scale — here by dequantizing K and V, which is the same product."""
    m = fake_flashinfer.module()

    def fp8(cls):
        class Fp8(cls):
            def plan(self, *args, q_data_type=None, kv_data_type=None, **kw):
                self.dtypes = (q_data_type, kv_data_type or q_data_type)
                super().plan(*args, **kw)

            def run(self, q, *kv, return_lse=False, k_scale=None, v_scale=None, **out):
                if len(kv) == 2:  # ragged: the new tokens' own K/V, never scaled
                    assert k_scale is None and v_scale is None and kv[0].dtype == q.dtype == self.dtypes[0]
                    return super().run(q, *kv, return_lse=return_lse, **out)
                k_cache, v_cache = kv[0]
                assert (q.dtype, k_cache.dtype) == self.dtypes, "run dtypes differ from the plan's"
                if k_cache.dtype == FP8:
                    k_cache = k_cache.float() * (1.0 if k_scale is None else k_scale)
                    v_cache = v_cache.float() * (1.0 if v_scale is None else v_scale)
                else:
                    assert k_scale is None and v_scale is None
                return super().run(q, (k_cache, v_cache), return_lse=return_lse, **out)  # (out=, lse=: paged)
        return Fp8

    for name in ("BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper",
                 "BatchPrefillWithRaggedKVCacheWrapper"):
        setattr(m, name, fp8(getattr(m, name)))
    return m


@pytest.mark.parametrize("name,grouped,per_head", [(n, False, False) for n in CASES] + [(n, True, False) for n in GROUPED]
                         + [("decode", False, True), ("mixed", True, True)])
def test_flashinfer_fp8_plans_on_a_stand_in(monkeypatch, name, grouped, per_head) -> None:
    from services.worker.attention.flashinfer_backend import FlashInferAttention

    monkeypatch.setitem(sys.modules, "flashinfer", fp8_flashinfer())
    plain_pool, plain, cascaded, (q, k, v) = build(name, 8, 2, 16, torch.float32, "cpu")
    ks, vs = (torch.tensor([0.02, 0.05]), torch.tensor([0.03, 0.01])) if per_head else \
        (torch.tensor([0.03, 0.03]), torch.tensor([0.02, 0.02]))
    pool = KVPool(1, plain_pool.num_slots, 2, 16, torch.float32, "cpu", kv_dtype=FP8, scales=KVScales([ks], [vs], "x"))
    pool.k[0].copy_(quantize_kv(plain_pool.k[0] * 0.1, 1 / ks))
    pool.v[0].copy_(quantize_kv(plain_pool.v[0] * 0.1, 1 / vs))
    k, v = k * 0.1, v * 0.1
    batch = cascaded if grouped else plain
    fi = FlashInferAttention(pool, 8)
    fi.prepare(batch)
    got = fi.forward(q, k, v, 0)
    if name == "fresh":  # no KV before the step: the ragged plan attends over the new K/V unquantized
        ref = TorchAttention(KVPool(1, plain_pool.num_slots, 2, 16, torch.float32, "cpu"))
    else:
        ref = TorchAttention(pool)  # reads the same e4m3 values, dequantized
        assert (torch.float32, FP8) in (getattr(fi.decode, "dtypes", None), getattr(fi.paged, "dtypes", None))
    ref.prepare(plain)
    torch.testing.assert_close(got, ref.forward(q, k, v, 0), rtol=1e-4, atol=1e-5)
    assert fi.shared.plans == int(grouped)
