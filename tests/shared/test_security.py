"""Security properties that need no server: no pickle on any socket (the codec and the queues
refuse pickled frames without running them; no module imports a pickle-based serializer),
``banyan serve`` keeps its ZMQ endpoints private (ipc:// in a directory only its user can
enter), the API key is compared in constant time, and message size limits are set.

Covered elsewhere, against a live server: the API key on HTTP and gRPC
(e2e/test_openai.py::test_api_key_on_http_and_grpc), oversized gRPC messages and HTTP bodies
refused (e2e/test_bad_input.py), only the public ports listening (e2e/test_drain.py)."""

from __future__ import annotations

import ast
import os
import pickle
import signal
import stat
from pathlib import Path

import msgspec
import pytest
import zmq

from shared.messages.codec import Codec, WireError
from shared.messages.common import SamplingParams
from shared.messages.to_scheduler import AbortReq, GenerateReq, ToScheduler
from shared.messages.to_tokenizer import ToTokenizer
from shared.messages.to_worker import ToWorker
from shared.transport import DealerQueue, RouterQueue

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("banyan", "services", "shared")
PICKLING_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "joblib", "marshal", "shelve",
                    "multiprocessing"}  # multiprocessing pickles everything it sends between processes
PICKLING_CALLS = {"send_pyobj", "recv_pyobj", "load", "loads"}  # pyzmq's pickle API; torch.load / pickle.loads
OBJECT_COLLECTIVES = {"broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                      "send_object_list", "recv_object_list"}  # torch.distributed pickles these


class _Evil:
    """Unpickling it runs code: it sets an environment variable."""

    def __reduce__(self):
        return exec, ("import os; os.environ['BANYAN_PWNED'] = '1'",)


@pytest.mark.parametrize("union", [ToScheduler, ToTokenizer, ToWorker])
def test_codecs_refuse_pickled_frames(union):
    """Every channel's codec refuses pickle (with or without the wire version byte) and untyped
    msgpack, and never runs what a pickle would run."""
    codec = Codec(union)
    evil = pickle.dumps(_Evil())
    frames = [evil, bytes([1]) + evil, pickle.dumps(GenerateReq(rid="r", input_ids=[1], params=SamplingParams())),
              bytes([1]) + pickle.dumps({"type": "gen", "rid": "r"}, protocol=0),
              bytes([1]) + msgspec.msgpack.encode({"unknown": "message"})]
    for frame in frames:
        with pytest.raises(WireError):
            codec.decode(frame)
    assert "BANYAN_PWNED" not in os.environ


def test_queues_drop_pickled_frames_and_keep_serving():
    """A peer that sends pickle is dropped frame by frame; the next valid message still arrives."""
    ctx = zmq.Context()
    endpoint = "inproc://security-test"
    try:
        router = RouterQueue(ctx, endpoint, Codec(ToScheduler), Codec(ToTokenizer))
        peer = ctx.socket(zmq.DEALER)
        peer.setsockopt(zmq.IDENTITY, b"peer")
        peer.connect(endpoint)
        peer.send(pickle.dumps(_Evil()))
        peer.send(bytes([1]) + pickle.dumps(_Evil()))
        peer.send(Codec(ToScheduler).encode(AbortReq(rid="ok")))
        got = None
        for _ in range(200):
            if router.sock.poll(50) and (got := router.recv_nowait()) is not None:
                break
        assert got == (b"peer", AbortReq(rid="ok"))
        assert "BANYAN_PWNED" not in os.environ

        worker_side = DealerQueue(ctx, "inproc://security-worker", Codec(ToWorker), Codec(ToScheduler), bind=True)
        sender = ctx.socket(zmq.DEALER)
        sender.connect("inproc://security-worker")
        sender.send(pickle.dumps(_Evil()))
        assert worker_side.recv(timeout_ms=200) is None  # dropped, not executed
        assert "BANYAN_PWNED" not in os.environ
        peer.close(0)
        sender.close(0)
    finally:
        ctx.destroy(linger=0)


def _sources() -> list[Path]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if not p.name.endswith("_pb2.py")]
    assert len(files) > 50
    return files


def test_no_module_uses_a_pickle_based_serializer():
    found = []
    for path in _sources():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[0]]
            found += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names if n in PICKLING_MODULES]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                attr, owner = node.func.attr, node.func.value
                owner_name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
                if attr in ("send_pyobj", "recv_pyobj") or attr in OBJECT_COLLECTIVES or \
                        (attr in PICKLING_CALLS and owner_name in ("torch", "pickle")):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} calls {owner_name}.{attr}")
    assert not found, found


def test_serve_keeps_zmq_endpoints_private(demo_dir, monkeypatch):
    """The endpoints ``banyan serve`` hands its services (two data-parallel groups here) are
    ipc:// sockets in a fresh directory only the server's user can enter."""
    from banyan import launcher
    from shared.config import SchedulerConfig, TokenizerConfig, WorkerConfig

    spawned: list[tuple[str, object]] = []
    modes: list[os.stat_result] = []

    def spawn(self, name, module, cfg, extra_env=None):
        spawned.append((name, cfg))
        if name.startswith("tokenizer"):
            modes.append(os.stat(os.path.dirname(cfg.port_file)))  # (the launcher removes it when it returns)
            self.signals = 1  # everything is spawned: leave the supervision loop at once

    monkeypatch.setattr(launcher.Launcher, "_spawn", spawn)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    cfg = launcher.ServeConfig(tokenizer=TokenizerConfig(grpc_port=0, http_port=-1), scheduler=SchedulerConfig(),
                               worker=WorkerConfig(device="cpu"), dp=2)
    try:
        assert launcher.Launcher(cfg).run() == 0
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    endpoints = set()
    for name, c in spawned:
        for field in ("tokenizer_endpoint", "worker_endpoint", "scheduler_endpoint"):
            value = getattr(c, field, None)
            if value:
                endpoints.update(value.split(","))
    assert len(endpoints) == 4, endpoints  # per group: tokenizers → scheduler, scheduler ↔ worker
    dirs = set()
    for ep in endpoints:
        assert ep.startswith("ipc://"), ep
        dirs.add(os.path.dirname(ep[len("ipc://"):]))
    assert len(dirs) == 1
    mode = modes[0]
    assert mode.st_uid == os.getuid() and stat.S_IMODE(mode.st_mode) == 0o700, oct(mode.st_mode)
    assert not os.path.exists(dirs.pop())  # removed on the way out


def test_api_key_is_compared_in_constant_time(monkeypatch):
    from services.tokenizer import auth

    calls = []
    real = auth.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    key = auth.ApiKey("s3cret")
    assert key.allows("Bearer s3cret") and not key.allows("Bearer s3cre7") and not key.allows("Bearer ")
    assert calls == [(b"s3cret", b"s3cret"), (b"s3cre7", b"s3cret"), (b"", b"s3cret")]


def test_message_size_limits_are_set(demo_dir, monkeypatch):
    """The gRPC server is built with receive and send limits; the HTTP front has a body limit."""
    import grpc

    from services.tokenizer import server
    from services.tokenizer.http import middleware

    assert 0 < server.MAX_MESSAGE <= 64 << 20 and 0 < middleware.MAX_BODY <= 64 << 20
    seen = {}

    def fake_server(*args, options=(), **kwargs):
        seen.update(dict(options))
        raise RuntimeError("stop here")

    monkeypatch.setattr(grpc.aio, "server", fake_server)
    import asyncio

    from shared.config import TokenizerConfig

    monkeypatch.setattr(server, "SchedulerClient", lambda *a, **k: None)
    with pytest.raises(RuntimeError, match="stop here"):
        asyncio.run(server.run(TokenizerConfig(model=demo_dir, grpc_port=0, http_port=-1)))
    assert seen["grpc.max_receive_message_length"] == server.MAX_MESSAGE
    assert seen["grpc.max_send_message_length"] == server.MAX_MESSAGE
