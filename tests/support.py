"""Test support: tiny HF model directories (seeded random weights) and a live server process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024)


def run_in_triton_interpreter(script: str, done: str, timeout: float = 280) -> None:
    """Run ``script`` (Python source) in a fresh interpreter with ``TRITON_INTERPRET=1`` (Triton's
    kernels on the CPU) and check that it printed ``done``."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0 and done in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def make_tiny_model(arch: str, out: Path, tokenizer_dir: str, seed: int = 0, max_positions: int = 1024) -> Path:
    """Save a tiny random-weight model of ``arch`` (llama | qwen2 | qwen3) with the given tokenizer."""
    import torch
    import transformers

    vocab = json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text())
    vocab_size = len(vocab["model"]["vocab"]) + len(vocab.get("added_tokens", []))
    cfg_src = json.loads((Path(tokenizer_dir) / "config.json").read_text())
    common = dict(TINY, max_position_embeddings=max_positions, vocab_size=vocab_size, bos_token_id=cfg_src.get("bos_token_id"),
                  eos_token_id=cfg_src.get("eos_token_id"), initializer_range=0.08, dtype="float32")
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False, rope_theta=500000.0,
                                       rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                         high_freq_factor=4.0, original_max_position_embeddings=256))
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1000000.0)
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True, rope_theta=1000000.0)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(tokenizer_dir) / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, out / name)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``banyan serve`` in a subprocess, its stderr (JSON log lines) captured to a file. gRPC on
    ``target``; the OpenAI-compatible HTTP API on ``http_url`` (``http_port`` -1 when disabled by
    passing ``--http-port -1``)."""

    def __init__(self, model: str | None, log_path: Path, *args: str, env: dict | None = None) -> None:
        self.log_path = log_path
        ready = log_path.with_suffix(".ready")
        ready.unlink(missing_ok=True)
        # port 0: the launcher picks a free one and holds it until the tokenizers bind it (a port picked
        # here could be taken by another process before they do); the ready file names them
        ports = [f"--{kind}-port" for kind in ("grpc", "http") if f"--{kind}-port" not in args]
        cmd = [sys.executable, "-m", "banyan.cli", "serve", "--host", "127.0.0.1", "--ready-file", str(ready),
               *(x for p in ports for x in (p, "0")), *args]
        if model:
            cmd += ["--model", model]
        self._log = open(log_path, "wb")
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        # one OpenMP thread per process: the services share the CI box's 2 cores, and torch's spinning
        # threads, more of them than cores, slow every process down many times (set it to override)
        e = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONPATH": path, **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT, env=e)
        deadline = time.monotonic() + 180
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server failed to start:\n{self.log_path.read_text(errors='replace')[-4000:]}")
            time.sleep(0.1)
        lines = ready.read_text().split()
        self.port = int(lines[0])
        self.target = f"127.0.0.1:{self.port}"
        self.http_port = int(lines[1]) if len(lines) > 1 else -1
        self.http_url = f"http://127.0.0.1:{self.http_port}"
        # Prometheus /metrics of the scheduler and worker rank 0 (0: none); the tokenizers' is on http_url
        self.scheduler_metrics_port = int(lines[2]) if len(lines) > 2 else 0
        self.worker_metrics_port = int(lines[3]) if len(lines) > 3 else 0

    def channel(self, own_connection: bool = False) -> grpc.Channel:
        """A channel; ``own_connection`` opens a new TCP connection instead of sharing the
        process-wide subchannel pool (the kernel spreads new connections over the replicas)."""
        opts = [("grpc.use_local_subchannel_pool", 1)] if own_connection else []
        return grpc.insecure_channel(self.target, options=opts)

    def metrics(self, service: str = "tokenizer") -> str:
        """The Prometheus text of ``service`` (tokenizer | scheduler | worker)."""
        import urllib.request

        port = {"tokenizer": self.http_port, "scheduler": self.scheduler_metrics_port,
                "worker": self.worker_metrics_port}[service]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return r.read().decode()

    def log_text(self) -> str:
        if not self._log.closed:  # (also after stop(): a failed stop's message quotes the log)
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_records(self) -> list[dict]:
        """The JSON log records of every process in the log — also one written after another process's
        unfinished line (all of them share the file: a record may start mid-line)."""
        out = []
        for line in self.log_text().splitlines():
            at = line.find('{"')
            if at >= 0:
                try:
                    out.append(json.loads(line[at:]))
                except json.JSONDecodeError:
                    pass
        return out

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                self._log.write(f"[support.Server] still running {timeout} s after SIGTERM: killed\n".encode())
        self._log.write(f"[support.Server] exit code {self.proc.returncode}\n".encode())
        self._log.close()
        return self.proc.returncode


def hf_log_softmax(hf, ids: list[int]):
    """(len(ids), V): row p is the log-softmax of HF's logits after ``ids[:p + 1]`` (it predicts
    ``ids[p + 1]``), from one forward pass."""
    import torch

    with torch.no_grad():
        return torch.log_softmax(hf[0](torch.tensor([ids])).logits[0].float(), dim=-1)
