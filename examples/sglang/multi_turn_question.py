"""SGLang's multi-turn question program, unchanged, on Banyan: ``sgl.system`` / ``user`` /
``assistant`` turns through the frontend's chat template, one ``gen`` per answer; run once, as a
batch (``run_batch``) and streamed.

    banyan serve &                                  # HTTP on localhost:8000
    python examples/sglang/multi_turn_question.py [http://host:port]
"""

from __future__ import annotations

import sys

import sglang as sgl
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint


@sgl.function
def multi_turn_question(s, question_1, question_2):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question_1)
    s += sgl.assistant(sgl.gen("answer_1", max_tokens=32, temperature=0))
    s += sgl.user(question_2)
    s += sgl.assistant(sgl.gen("answer_2", max_tokens=32, temperature=0))


def single():
    state = multi_turn_question.run(question_1="What is the capital of France?",
                                    question_2="List two local attractions.")
    for m in state.messages():
        print(m["role"], ":", m["content"])
    return state


def stream():
    state = multi_turn_question.run(question_1="What is the capital of France?",
                                    question_2="List two local attractions.", stream=True)
    for out in state.text_iter():
        print(out, end="", flush=True)
    print()
    return state


def batch():
    states = multi_turn_question.run_batch([
        {"question_1": "What is the capital of the United States?", "question_2": "List two local attractions."},
        {"question_1": "What is the capital of France?", "question_2": "What is the population of this city?"},
    ])
    for s in states:
        print(s.messages())
    return states


def main(url: str = "http://localhost:8000") -> None:
    sgl.set_default_backend(RuntimeEndpoint(url))
    single()
    stream()
    batch()


if __name__ == "__main__":
    main(*sys.argv[1:2])
