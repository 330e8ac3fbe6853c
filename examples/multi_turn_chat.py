"""Multi-turn chat: a system prompt, then three user questions, each answered by the model.

Every turn re-sends the whole conversation; the server's prefix cache reuses the KV of the turns
before it, which shows as ``cached_tokens`` in each answer's usage.

    python examples/multi_turn_chat.py [host:port]     # or BANYAN_ADDRESS=host:port
"""

from __future__ import annotations

import sys

import banyan as bn

QUESTIONS = [
    "What is the capital of France?",
    "How many people live there?",
    "Name one famous museum in that city.",
]


@bn.function
def multi_turn_chat(s, questions: list[str], max_tokens: int = 48):
    s += bn.system("You are a helpful assistant. Answer in one or two sentences.")
    for i, question in enumerate(questions):
        s += bn.user(question)
        s += bn.assistant(bn.gen(f"answer_{i}", max_tokens=max_tokens, temperature=0))


def main(address: str | None = None) -> None:
    with bn.Backend(address) as backend:
        s = multi_turn_chat.run(QUESTIONS, backend=backend)
    for role, content in s.messages():
        print(f"{role:>9}: {content}")
    for i in range(len(QUESTIONS)):
        usage = s.results[f"answer_{i}"]
        print(f"turn {i + 1}: {usage.prompt_tokens} prompt tokens, {usage.cached_tokens} from the cache")


if __name__ == "__main__":
    try:
        main(sys.argv[1] if len(sys.argv) > 1 else None)
    except bn.ServerError as e:  # (no server there, or it refused a call): one line, exit code 1
        sys.exit(f"{sys.argv[0]}: error: {e}")
