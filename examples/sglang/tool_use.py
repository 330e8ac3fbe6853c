"""SGLang's control-flow example, unchanged, on Banyan: ``select`` picks a tool by the model's
log-probabilities of each choice (prefill-only ``/generate`` calls with ``logprob_start_len``),
then a Python ``if`` branches on it; one branch's answer is regex-constrained.

    python examples/sglang/tool_use.py [http://host:port]
"""

from __future__ import annotations

import sys

import sglang as sgl
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint


@sgl.function
def tool_use(s, question):
    s += "To answer this question: " + question + ", "
    s += "I need to use a " + sgl.select("tool", choices=["calculator", "search engine"]) + ". "
    if s["tool"] == "calculator":
        s += "The math expression is " + sgl.gen("expression", regex=r"[0-9]{1,4} [+*-] [0-9]{1,4}", max_tokens=12)
    elif s["tool"] == "search engine":
        s += "The key word to search is " + sgl.gen("word", max_tokens=8, stop=[".", "\n"], temperature=0)


def main(url: str = "http://localhost:8000") -> None:
    sgl.set_default_backend(RuntimeEndpoint(url))
    for q in ("What is 17 times 23?", "Who wrote Hamlet?"):
        state = tool_use.run(question=q)
        print(state.text())


if __name__ == "__main__":
    main(*sys.argv[1:2])
