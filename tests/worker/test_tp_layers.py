"""Tensor parallelism on CPU: two gloo ranks produce the logits of one rank."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tests.worker.test_models import random_seqs, run_schedule, save_tiny_model, tiny_config

from services.worker.tp import TPGroup

TP = 2
# a mixed step schedule: chunked prefill of request 0 next to decode steps of request 1
SEQS_LENGTHS, CHUNKS = [12, 6], [[5, 7], [3, 1, 1, 1]]  # token ids < 509: valid in both vocabularies


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, model_dirs: list[Path], out_dir: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP)
    try:
        torch.set_num_threads(1)
        for i, model_dir in enumerate(model_dirs):
            logits = run_schedule(model_dir, random_seqs(SEQS_LENGTHS, vocab=509), CHUNKS, TPGroup(rank, TP))
            torch.save(logits, out_dir / f"model{i}_rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_tp2_matches_tp1(tmp_path: Path) -> None:
    variants = {
        "kv_split": tiny_config("llama"),  # 2 KV heads: one per rank
        "kv_replicated_padded_vocab": tiny_config("llama", num_key_value_heads=1, vocab_size=509),
    }
    model_dirs = []
    for name, config in variants.items():
        save_tiny_model(config, tmp_path / name)
        model_dirs.append(tmp_path / name)

    mp.spawn(_rank_main, args=(_free_port(), model_dirs, tmp_path), nprocs=TP, join=True)

    for i, model_dir in enumerate(model_dirs):
        expected = run_schedule(model_dir, random_seqs(SEQS_LENGTHS, vocab=509), CHUNKS)
        for rank in range(TP):
            got = torch.load(tmp_path / f"model{i}_rank{rank}.pt")
            for g, e in zip(got, expected, strict=True):
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
