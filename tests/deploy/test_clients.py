"""The Go and Java clients (clients/): built offline from Debian's packages, run against a live
server, and checked against the Python stub's answer to the same greedy request; plus `buf lint`
and the `buf generate` template (buf from the npm registry).

The toolchains come from scripts/install_client_toolchains.sh (apt-get, only for what is missing).
If it cannot install them the tests fail with its output: a client that cannot be built is a
failure, not a skip. Generated stubs and binaries go to a temporary build directory.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import grpc
import pytest

from shared.proto.banyan.v1 import generation_pb2 as pb, generation_pb2_grpc as pb_grpc
from tests.support import ROOT, Server

API_KEY = "client-test-key"
PROMPT = "Once upon a time"
MAX_TOKENS = 12
OUTPUT = re.compile(  # the clients' output: see clients/go/main.go (Java prints the same)
    r"^health: (?P<health>\S+)\n"
    r"model: (?P<model>\S+) .*\n"
    r"--- generation\n(?P<text>.*)\n"
    r"--- finish_reason=(?P<finish>\S+) prompt_tokens=(?P<prompt>\d+) completion_tokens=(?P<completion>\d+)"
    r" cached_tokens=\d+ messages=(?P<messages>\d+) request_id=\S+\n\Z", re.S)


def run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, **kw)


def explain(r: subprocess.CompletedProcess) -> str:
    return f"{r.args} exited {r.returncode}\n--- stdout\n{r.stdout[-6000:]}\n--- stderr\n{r.stderr[-6000:]}"


@pytest.fixture(scope="module")
def toolchains() -> subprocess.CompletedProcess:
    """Installs the client toolchains (a no-op once installed)."""
    r = run(["bash", "scripts/install_client_toolchains.sh"], timeout=1200)
    assert r.returncode == 0, "could not install the client toolchains:\n" + explain(r)
    return r


@pytest.fixture(scope="module")
def buf(toolchains) -> str:
    """The buf executable the script installed."""
    m = re.search(r"^buf: (.+)$", toolchains.stdout, re.M)
    assert m, explain(toolchains)
    return m.group(1)


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("clients-build")


@pytest.fixture(scope="module")
def clients(buf, build_dir) -> dict[str, Path]:
    """Builds both clients; returns their executables by language."""
    out = {}
    for lang in ("go", "java"):
        r = run(["bash", f"clients/{lang}/build.sh", str(build_dir / lang)], timeout=600)
        assert r.returncode == 0, f"the {lang} client did not build:\n" + explain(r)
        assert "warning" not in r.stderr.lower(), explain(r)
        out[lang] = build_dir / lang / "banyan-client"
        assert os.access(out[lang], os.X_OK), explain(r)
    return out


@pytest.fixture(scope="module")
def server(demo_dir, tmp_path_factory):
    s = Server(None, tmp_path_factory.mktemp("clients") / "server.log", "--api-key", API_KEY)
    yield s
    assert s.stop() == 0, s.log_text()[-3000:]


@pytest.fixture(scope="module")
def stub(server):
    with server.channel() as ch:
        yield pb_grpc.GenerationServiceStub(ch)


def python_generate(stub, chat: bool) -> tuple[str, pb.GenerateResponse]:
    """The reference: the same greedy request through the Python stub (text, last message)."""
    sp = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    if chat:
        req = pb.GenerateRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content=PROMPT)]),
                                 sampling_params=sp)
    else:
        req = pb.GenerateRequest(text=PROMPT, sampling_params=sp)
    chunks = list(stub.Generate(req, timeout=120, metadata=[("authorization", f"Bearer {API_KEY}")]))
    return "".join(c.text for c in chunks), chunks[-1]


def client_cmd(lang: str, exe: Path, target: str, chat: bool) -> list[str]:
    # Go's flag package takes -flag and --flag alike; the Java client takes --flag.
    cmd = [str(exe), "--target", target, "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), "--temperature", "0"]
    return cmd + (["--chat"] if chat else [])


@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
@pytest.mark.parametrize("lang", ["go", "java"])
def test_client_streams_the_same_greedy_text_as_python(lang, chat, clients, server, stub):
    expected_text, last = python_generate(stub, chat)
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and expected_text
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30,
                             metadata=[("authorization", f"Bearer {API_KEY}")])

    env = dict(os.environ, BANYAN_API_KEY=API_KEY, LANG="C", LC_ALL="C")  # C locale: output must stay UTF-8
    r = run(client_cmd(lang, clients[lang], server.target, chat), timeout=180, env=env)
    assert r.returncode == 0, explain(r)
    m = OUTPUT.match(r.stdout)
    assert m, explain(r)
    assert m["health"] == "SERVING"
    assert m["model"] == info.model
    assert m["text"] == expected_text
    assert m["finish"] == pb.FinishReason.Name(last.finish_reason)
    assert int(m["prompt"]) == last.usage.prompt_tokens
    assert int(m["completion"]) == last.usage.completion_tokens == MAX_TOKENS
    assert int(m["messages"]) > 1, "the reply should arrive as a stream of several messages"


@pytest.mark.parametrize("lang", ["go", "java"])
def test_client_reports_a_rejected_call_and_exits_nonzero(lang, clients, server):
    env = {k: v for k, v in os.environ.items() if k != "BANYAN_API_KEY"}
    r = run(client_cmd(lang, clients[lang], server.target, False) + ["--api-key", "wrong"], timeout=180, env=env)
    assert r.returncode == 1, explain(r)
    assert "health: SERVING" in r.stdout  # health is open without the key
    assert re.search("unauthenticated", r.stderr, re.I), explain(r)
    assert "--- generation" not in r.stdout


def test_buf_lint_passes(buf):
    r = run([buf, "lint"], timeout=300)
    assert r.returncode == 0, explain(r)


def test_buf_generate_template_writes_the_stubs(toolchains, tmp_path):
    """buf.gen.yaml, with the same local plugins the offline build uses: `buf generate` as the README
    says, with the script's bin/ folder (buf, protoc-gen-grpc-java) on PATH and nothing else done."""
    m = re.search(r"^bin: (\S+)", toolchains.stdout, re.M)
    assert m, explain(toolchains)
    env = dict(os.environ, PATH=f"{m.group(1)}{os.pathsep}{os.environ['PATH']}")
    r = run(["buf", "generate", "--template", "buf.gen.yaml", "-o", str(tmp_path / "out")], timeout=300, env=env)
    assert r.returncode == 0, explain(r)
    out = tmp_path / "out" / "clients"
    for f in ("go/gen/banyan/v1/generation.pb.go", "go/gen/banyan/v1/generation_grpc.pb.go",
              "java/gen/ai/banyan/v1/GenerationServiceGrpc.java", "java/gen/ai/banyan/v1/GenerateRequest.java"):
        assert (out / f).is_file(), f"buf generate did not write {f}: {sorted(p.name for p in out.rglob('*'))}"
