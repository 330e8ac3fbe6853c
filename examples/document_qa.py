"""One document, several questions: ``run_batch`` runs the program once per question,
concurrently. The questions share the document's prefix, which the server computes once (the
other answers report it as ``cached_tokens``).

    python examples/document_qa.py [host:port]         # or BANYAN_ADDRESS=host:port
"""

from __future__ import annotations

import sys

import banyan as bn

DOCUMENT = """\
The Banyan tree (Ficus benghalensis) is native to the Indian subcontinent. Its seeds often
germinate on other trees; the young plant sends aerial roots down to the ground, and these roots
thicken into woody trunks, so one tree can spread over a large area. The largest known banyan, in
Andhra Pradesh, covers about 19,000 square metres. The banyan is the national tree of India, and
its figs feed many birds and bats."""

QUESTIONS = [
    "Where is the banyan tree native to?",
    "How does one banyan tree spread over a large area?",
    "Which animals eat its figs?",
]


@bn.function
def document_qa(s, document: str, question: str, max_tokens: int = 48):
    s += bn.system("Answer questions using only the document. Be brief.")
    s += bn.user(f"Document:\n{document}\n\nQuestion: {question}")
    s += bn.assistant(bn.gen("answer", max_tokens=max_tokens, stop="\n\n", temperature=0))


def main(address: str | None = None) -> None:
    with bn.Backend(address) as backend:
        states = document_qa.run_batch([{"document": DOCUMENT, "question": q} for q in QUESTIONS],
                                       backend=backend, num_threads=3, progress_bar=True)
    for q, s in zip(QUESTIONS, states):
        r = s.results["answer"]
        print(f"Q: {q}\nA: {s['answer']}\n   ({r.prompt_tokens} prompt tokens, {r.cached_tokens} from the cache)")


if __name__ == "__main__":
    try:
        main(sys.argv[1] if len(sys.argv) > 1 else None)
    except bn.ServerError as e:  # (no server there, or it refused a call): one line, exit code 1
        sys.exit(f"{sys.argv[0]}: error: {e}")
