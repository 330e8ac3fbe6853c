"""The start-up tunings' decisions on disk (``kernels/tuning_cache.py``), on the CPU: configs round-trip through
JSON, a second process's reader sees what the first saved, kinds kept in one file merge, a torn or foreign file and
a config type no longer known mean "time it again", and a cached config is used only when its check passes.
(tests/gpu/test_tuning_cache_gpu.py: the tunings themselves, twice.)"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from services.worker.kernels import tuning_cache as tc
from services.worker.kernels.cuda_gemv import CudaConfig


@dataclass(frozen=True)
class Tile:
    block_n: int
    block_k: int
    warps: int = 4


def test_configs_round_trip_and_unknown_types_are_dropped() -> None:
    for cfg in (Tile(32, 256, 8), CudaConfig(16, 4, 1, True)):
        assert tc.decode(json.loads(json.dumps(tc.encode(cfg))), (Tile, CudaConfig)) == cfg
    assert tc.encode(None) is None and tc.decode(None, (Tile,)) is None
    assert tc.decode({"type": "Gone", "block_n": 1}, (Tile,)) is None
    assert tc.decode({"type": "Tile", "block_n": 1, "renamed": 2}, (Tile,)) is None


def test_saved_decisions_are_read_back_and_kinds_merge(tmp_path) -> None:
    path = tmp_path / "tuning" / "abc.json"
    first = tc.Decisions("small_m", path)
    assert first.get("4096x4096 bfloat16", torch.bfloat16, (Tile,)) == {}
    first.put("4096x4096 bfloat16", torch.bfloat16, [(1, Tile(4, 1024)), (16, None)],
              ["M≤1: Tile 10.0 us vs library 12.0", "M≤16: library 14.0 us"])
    first.save()
    other = tc.Decisions("gemm", path)
    other.put("6144x4096 float8_e4m3fn", torch.bfloat16, [(64, None)], ["M≤64: library 30.0 us"])
    other.save()
    again = tc.Decisions("small_m", path)
    assert again.get("4096x4096 bfloat16", torch.bfloat16, (Tile,)) == {
        1: (Tile(4, 1024), "M≤1: Tile 10.0 us vs library 12.0"), 16: (None, "M≤16: library 14.0 us")}
    assert again.get("4096x4096 bfloat16", torch.float16, (Tile,)) == {}  # (another activation dtype)
    assert tc.Decisions("gemm", path).get("6144x4096 float8_e4m3fn", torch.bfloat16, (Tile,)) == {
        64: (None, "M≤64: library 30.0 us")}
    assert sorted(json.loads(path.read_text())) == ["gemm", "small_m"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["abc.json", "abc.lock"]  # (no temporary file left)


def test_a_pick_whose_type_is_gone_is_timed_again(tmp_path) -> None:
    path = tmp_path / "d.json"
    d = tc.Decisions("gemm", path)
    d.put("n", torch.bfloat16, [(1, Tile(4, 8)), (4, None)], ["a", "b"])
    d.save()
    assert tc.Decisions("gemm", path).get("n", torch.bfloat16, (CudaConfig,)) == {4: (None, "b")}


@pytest.mark.parametrize("text", ["{torn", "[1, 2]", '{"gemm": [1]}', '{"gemm": {"n @torch.bfloat16": {"picks": 3}}}',
                                  '{"gemm": {"n @torch.bfloat16": {"picks": [[1, 2]]}}}'])
def test_a_torn_or_foreign_file_means_time_again_and_is_rewritten(tmp_path, text) -> None:
    path = tmp_path / "d.json"
    path.write_text(text)
    d = tc.Decisions("gemm", path)
    assert d.get("n", torch.bfloat16, (Tile,)) == {}
    d.put("n", torch.bfloat16, [(1, None)], ["M≤1: library 1.0 us"])
    d.save()
    assert tc.Decisions("gemm", path).get("n", torch.bfloat16, (Tile,)) == {1: (None, "M≤1: library 1.0 us")}


def test_a_cached_config_is_used_only_when_its_check_passes() -> None:
    def boom(cfg):
        raise RuntimeError("the CUDA library did not build")

    assert not tc.reuse(None, lambda cfg: True)
    assert tc.reuse((None, "library"), boom)  # (the library needs no check)
    assert tc.reuse((Tile(1, 2), "x"), lambda cfg: cfg == Tile(1, 2))
    assert not tc.reuse((Tile(1, 2), "x"), lambda cfg: False)
    assert not tc.reuse((Tile(1, 2), "x"), boom)


def test_off_the_gpu_or_turned_off_nothing_is_kept(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("BANYAN_TUNING_CACHE", str(tmp_path))
    assert tc.directory() == tmp_path
    d = tc.Decisions.on("gemm", torch.device("cpu"))
    d.put("n", torch.bfloat16, [(1, None)], ["x"])
    d.save()
    assert d.path is None and list(tmp_path.iterdir()) == []
    monkeypatch.setenv("BANYAN_TUNING_CACHE", "0")
    assert tc.directory() is None
    monkeypatch.delenv("BANYAN_TUNING_CACHE")
    monkeypatch.setenv("BANYAN_CACHE_DIR", str(tmp_path / "c"))
    assert tc.directory() == tmp_path / "c" / "tuning"


def test_ranks_saving_at_once_keep_every_rank_s_shapes(tmp_path) -> None:
    """Tensor-parallel ranks tune their own shards' shapes and save together: none is lost to another's write."""
    import multiprocessing as mp

    ctx, path = mp.get_context("spawn"), tmp_path / "f.json"
    go = ctx.Barrier(4)
    procs = [ctx.Process(target=_save_as_rank, args=(path, rank, go)) for rank in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    got = tc.Decisions("gemm", path)
    assert all(got.get(f"rank{r} shape{i}", torch.bfloat16, (Tile,)) == {1: (None, "x")} for r in range(4)
               for i in range(40))


def _save_as_rank(path, rank: int, go) -> None:
    go.wait(30)  # (all ranks imported: their saves overlap)
    for i in range(40):
        d = tc.Decisions("gemm", path)
        d.put(f"rank{rank} shape{i}", torch.bfloat16, [(1, None)], ["x"])
        d.save()
