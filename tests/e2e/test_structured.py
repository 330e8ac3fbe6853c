"""Structured output end to end: JSON schema, regex, EBNF, choices and json_object through the
real services; bad grammars fail alone with INVALID_ARGUMENT."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import jsonschema
import pytest

from tests.support import ROOT, Server, make_tiny_model
from shared.proto.banyan.v1 import generation_pb2 as pb

LLAMA3 = ROOT.parent / "shared" / "assets" / "tokenizers" / "llama3"

# Strings are bounded with patterns: xgrammar 0.2.9 lets raw control characters (invalid JSON)
# into strings bounded by maxLength.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{0,11}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,6}$"}, "maxItems": 3},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
EBNF = r'''root ::= expr
expr ::= term (("+" | "-") term)*
term ::= num | "(" expr ")"
num ::= [1-9] [0-9]?
'''
EXPR = re.compile(r"^[0-9+\-()]+$")


def _tokenizer_dir(demo_dir: str, tmp: Path) -> str:
    """The Llama 3 tokenizer (real 128k vocab) when the team assets are here, else the demo one."""
    if not (LLAMA3 / "tokenizer.json").exists():
        return demo_dir
    d = tmp / "llama3-tok"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (d / name).write_bytes((LLAMA3 / name).read_bytes())
    (d / "config.json").write_text(json.dumps({"bos_token_id": 128000, "eos_token_id": [128001, 128009]}))
    return str(d)


@pytest.fixture(scope="module")
def server(demo_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("structured")
    model = tmp / "model"
    make_tiny_model("llama", model, _tokenizer_dir(demo_dir, tmp), seed=9)
    s = Server(str(model), tmp / "server.log")
    yield s
    assert s.stop() == 0, s.log_text()[-3000:]


def gen(stub, prompt="Answer:", max_tokens=160, **kw) -> tuple[list[str], list[pb.GenerateResponse]]:
    sp = kw.pop("sp", {})
    req = pb.GenerateRequest(text=prompt, sampling_params=pb.SamplingParams(max_tokens=max_tokens, **sp), **kw)
    resps = list(stub.Generate(req, timeout=300))
    n = max(r.index for r in resps) + 1
    return ["".join(r.text for r in resps if r.index == i) for i in range(n)], resps


def finals(resps):
    return [r for r in resps if r.finish_reason != pb.FINISH_REASON_UNSPECIFIED]


def test_json_schema_outputs_parse_and_validate(stub):
    def one(i):
        return gen(stub, f"Person {i}:", json_schema=json.dumps(SCHEMA), sp=dict(temperature=1.0, seed=i))

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(50)))
    for texts, resps in results:
        assert [f.finish_reason for f in finals(resps)] == [pb.FINISH_REASON_STOP], texts
        jsonschema.validate(json.loads(texts[0]), SCHEMA)


def test_regex_choice_ebnf_and_json_object(stub):
    texts, resps = gen(stub, regex=r"\d{3}-[a-z]{2,4}", sp=dict(temperature=1.0, seed=1))
    assert re.fullmatch(r"\d{3}-[a-z]{2,4}", texts[0]), texts
    texts, resps = gen(stub, choice=pb.Choices(choices=["yes", "no", "maybe later"]), sp=dict(temperature=1.0, seed=2))
    assert texts[0] in ("yes", "no", "maybe later") and finals(resps)[0].finish_reason == pb.FINISH_REASON_STOP
    texts, _ = gen(stub, ebnf=EBNF, sp=dict(temperature=1.0, seed=3))
    assert EXPR.match(texts[0]) and _balanced(texts[0]), texts
    texts, resps = gen(stub, json_object=True, max_tokens=300, sp=dict(temperature=0.7, seed=4))
    if finals(resps)[0].finish_reason == pb.FINISH_REASON_STOP:
        json.loads(texts[0])
    else:  # any JSON value may be longer than max_tokens: still a valid prefix, never garbage
        assert texts[0].lstrip()[:1] in '{["-0123456789tfn'


def _balanced(s: str) -> bool:
    depth = 0
    for ch in s:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth < 0:
            return False
    return depth == 0


def test_constrained_and_free_in_one_batch_with_n_and_cache_hits(stub):
    prompt = "Shared context for everyone. " * 20

    def constrained(i):
        return gen(stub, prompt, regex=r"(red|green|blue) [0-9]{2}", sp=dict(temperature=1.0, seed=i, n=3))

    def free(i):
        return gen(stub, prompt, max_tokens=24, sp=dict(temperature=1.0, seed=100 + i, ignore_eos=True))

    with ThreadPoolExecutor(12) as pool:
        cons = [pool.submit(constrained, i) for i in range(6)]
        frees = [pool.submit(free, i) for i in range(6)]
        cons, frees = [f.result() for f in cons], [f.result() for f in frees]
    for texts, resps in cons:
        assert len(texts) == 3 and all(re.fullmatch(r"(red|green|blue) [0-9]{2}", t) for t in texts), texts
    assert any(f.usage.cached_tokens > 0 for _, resps in cons for f in finals(resps))
    assert all(finals(resps)[0].usage.completion_tokens == 24 for _, resps in frees)


BAD = {
    "schema not JSON": dict(json_schema="{not json"),
    "schema not an object": dict(json_schema="3"),
    "schema unknown type": dict(json_schema='{"type": "objec"}'),
    "regex unclosed group": dict(regex="(ab"),
    "regex empty": dict(regex=""),
    "ebnf syntax error": dict(ebnf="root ::= (\"a\""),
    "ebnf undefined rule": dict(ebnf="root ::= missing"),
    "choice empty list": dict(choice=pb.Choices()),
    "choice empty string": dict(choice=pb.Choices(choices=["a", ""])),
}


def test_bad_grammars_fail_alone(stub):
    background = stub.Generate(pb.GenerateRequest(text="keep going", sampling_params=pb.SamplingParams(
        max_tokens=400, ignore_eos=True)), timeout=300)
    next(background)
    for name, kw in BAD.items():
        with pytest.raises(grpc.RpcError) as e:
            gen(stub, **kw)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert e.value.details(), name
    rest = list(background)
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH and rest[-1].usage.completion_tokens == 400
    texts, _ = gen(stub, regex=r"ok|fine")  # the same server keeps serving constrained requests
    assert texts[0] in ("ok", "fine")


def test_jump_forward_appends_forced_text_without_sampling(stub):
    before = stub.GetLoad(pb.GetLoadRequest())
    texts, resps = gen(stub, "Record:", json_schema=json.dumps(SCHEMA), sp=dict(temperature=0.0))
    after = stub.GetLoad(pb.GetLoadRequest())
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    forced = after.jump_forward_tokens - before.jump_forward_tokens
    completion = finals(resps)[0].usage.completion_tokens
    assert forced > 0  # e.g. '{"name": "' and '", "age": ' come from the grammar
    assert after.steps - before.steps < completion  # fewer model steps than output tokens
