"""The real ``sglang`` frontend package (pinned, installed without its GPU runtime) against a live
``banyan serve`` through ``RuntimeEndpoint``, unmodified: ``gen`` (plain, regex, stop strings,
streaming), ``select`` (the default token-length-normalized method) with its choice and log-probs
checked against HF transformers (fp32, |Δ| ≤ 1e-4), ``fork`` + join with the branches served from
the cached prefix, multi-turn ``system`` / ``user`` / ``assistant`` chat, ``run_batch`` over 16
inputs, and the example programs in ``examples/sglang/``."""

from __future__ import annotations

import re
import sys

import pytest

from tests.support import ROOT, Server
from tests.support import hf_log_softmax as hf_rows

import sglang as sgl  # (tests/requirements-nodeps.txt installs it: a missing one fails here, never skips)
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

sys.path.insert(0, str(ROOT / "examples" / "sglang"))
import multi_turn_question  # noqa: E402
import tip_suggestion  # noqa: E402
import tool_use  # noqa: E402

TOL = 1e-4
PREFIX = ("You are reading a long and carefully written note about rivers, bridges and the sea, "
          "which goes on for a while so that its prefix spans several prefill chunks of the server. ")


@pytest.fixture(scope="module")
def server(demo_dir, tmp_path_factory):
    s = Server(None, tmp_path_factory.mktemp("sglang") / "server.log", "--chunked-prefill-size", "32")
    yield s
    assert s.stop() == 0, s.log_text()[-3000:]


@pytest.fixture(scope="module")
def backend(server):
    b = RuntimeEndpoint(server.http_url)
    sgl.set_default_backend(b)
    return b




def hf_greedy(hf, text: str, n: int) -> list[int]:
    """``n`` greedy tokens after ``text``, one HF forward pass each."""
    import torch

    model, tok = hf
    ids = tok.encode(text)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


def select_reference(hf, text: str, choices: list[str]) -> tuple[list[float], list[list]]:
    """What the frontend's token-length-normalized ``select`` computes, from HF's log-probs: the
    prompt's token count L, log-probs from position L - 2 (``logprob_start_len``; that position's
    entry None), each choice's mean over the rest."""
    _, tok = hf
    start = max(len(tok.encode(text)) - 2, 0)
    means, entries = [], []
    for c in choices:
        ids = tok.encode(text + c)
        lp = hf_rows(hf, ids)
        assert not text.endswith(tok.decode([ids[start]])), "token healing would drop an entry: change the prompt"
        vals = [lp[p - 1, ids[p]].item() for p in range(start + 1, len(ids))]
        means.append(sum(vals) / len(vals))
        entries.append([[None, ids[start]]] + [[v, ids[p]] for v, p in zip(vals, range(start + 1, len(ids)))])
    return means, entries


@sgl.function
def qa(s, question, max_tokens=8):
    s += "Question: " + question + "\nAnswer:"
    s += sgl.gen("answer", max_tokens=max_tokens, temperature=0)


def test_connects_and_reads_model_info(backend, server):
    assert backend.get_model_name() == "banyan-demo"
    assert sgl.get_server_info()["model_path"] == "banyan-demo"
    backend.flush_cache()


def test_gen_plain_matches_hf_greedy(backend, hf):
    state = qa.run(question="What is a river?")
    _, tok = hf
    want = hf_greedy(hf, "Question: What is a river?\nAnswer:", 8)
    assert state["answer"] == tok.decode(want, skip_special_tokens=True)
    meta = state.get_meta_info("answer")
    assert meta["completion_tokens"] == 8 and meta["finish_reason"] == {"type": "length", "length": 8}


def test_gen_regex_and_stop(backend, hf):
    @sgl.function
    def prog(s):
        s += "The year was " + sgl.gen("year", regex=r"(19|20)[0-9]{2}", max_tokens=6)
        s += ". The next words were" + sgl.gen("words", max_tokens=16, temperature=0)

    free = prog.run()
    assert re.fullmatch(r"(19|20)[0-9]{2}", free["year"])
    cut = free["words"][len(free["words"]) // 3:][:3]
    assert cut and cut not in free["words"][:free["words"].index(cut)]

    @sgl.function
    def stopped(s, year, stop_at):
        s += "The year was " + year + ". The next words were" + sgl.gen("words", max_tokens=16, temperature=0,
                                                                          stop=stop_at)

    out = stopped.run(year=free["year"], stop_at=[cut])
    assert out["words"] == free["words"][:free["words"].index(cut)]
    assert out.get_meta_info("words")["finish_reason"] == {"type": "stop", "matched": cut}


def test_gen_streaming(backend):
    whole = qa.run(question="Where do bridges go?", max_tokens=10)
    state = qa.run(question="Where do bridges go?", max_tokens=10, stream=True)
    parts = list(state.text_iter("answer"))
    assert len(parts) > 1 and "".join(parts) == whole["answer"]


@pytest.mark.parametrize("method", [None, "token_length_normalized"])
def test_select_matches_hf(backend, hf, method):
    choices = ["the river", "a bridge over the water", "the sea"]
    kwargs = {} if method is None else {"choices_method": getattr(sgl, method)}

    @sgl.function
    def pick(s):
        s += "Q: Where does the water go in the end?\nA: It goes to"
        s += sgl.select("where", choices=choices, **kwargs)

    state = pick.run()
    means, entries = select_reference(hf, "Q: Where does the water go in the end?\nA: It goes to", choices)
    meta = state.get_meta_info("where")
    assert meta["normalized_prompt_logprobs"] == pytest.approx(means, abs=TOL)
    for got, want in zip(meta["input_token_logprobs"], entries):
        assert [e[1] for e in got] == [w[1] for w in want] and got[0][0] is None
        assert [e[0] for e in got[1:]] == pytest.approx([w[0] for w in want[1:]], abs=TOL)
    best = max(range(len(means)), key=means.__getitem__)
    runner_up = max(v for i, v in enumerate(means) if i != best)
    assert means[best] - runner_up > 2 * TOL  # not a near-tie: the choice is determined
    assert state["where"] == choices[best]


def test_fork_join_branches_hit_the_cache(backend, hf):
    _, tok = hf

    @sgl.function
    def branches(s):
        s += PREFIX
        s.sync()  # (fork caches the prefix only if it is in the text already: it reads the text before syncing)
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"Branch {i}:" + sgl.gen("b", max_tokens=4, temperature=0)
        s["metas"] = [f["b"] is not None and f.get_meta_info("b") for f in forks]
        forks.join()
        s += "Done."

    state = branches.run()
    assert len(state["b"]) == 3 and all(state["b"])  # joined: one value per branch
    prefix_tokens = len(tok.encode(PREFIX))
    for i, meta in enumerate(state["metas"]):
        prompt = len(tok.encode(PREFIX + f"Branch {i}:"))
        assert meta["prompt_tokens"] == prompt
        # the fork's prefill-only request cached the shared prefix (the last token may merge)
        assert meta["cached_tokens"] >= prefix_tokens - 1, (meta, prefix_tokens)
    assert state.text() == PREFIX + "Done."


def test_multi_turn_chat(backend):
    state = multi_turn_question.multi_turn_question.run(question_1="What is a bridge?", question_2="And a river?")
    msgs = state.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert msgs[2]["content"] == state["answer_1"].strip() and msgs[4]["content"] == state["answer_2"].strip()
    assert state["answer_1"] and state["answer_2"]
    second = state.get_meta_info("answer_2")
    assert second["cached_tokens"] > 0  # the conversation so far came from the cache
    assert state.text().startswith("SYSTEM:You are a helpful assistant.\nUSER:What is a bridge?\nASSISTANT:")


def test_run_batch_16(backend, hf):
    questions = [f"What is {i} plus {i}?" for i in range(16)]
    states = qa.run_batch([{"question": q, "max_tokens": 6} for q in questions], num_threads=8, progress_bar=True)
    assert len(states) == 16
    singles = {q: qa.run(question=q, max_tokens=6)["answer"] for q in questions[:3]}
    for q, st in zip(questions, states):
        assert st.get_meta_info("answer")["completion_tokens"] == 6
        if q in singles:
            assert st["answer"] == singles[q]  # greedy: batched or alone, the same answer


def test_examples_run(backend, server, capsys):
    url = server.http_url
    multi_turn_question.main(url)
    tip_suggestion.main(url)
    tool_use.main(url)
    out = capsys.readouterr().out
    assert "Tip 1:" in out and "Tip 2:" in out and "In summary" in out
    assert out.count("I need to use a ") == 2 and "ASSISTANT:" in out
