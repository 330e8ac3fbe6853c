"""Intent routing: ``select`` classifies a request, and the program branches on the answer, each
branch asking its own follow-up questions (one with a regex-constrained answer).

``select`` scores every choice by the model's log-probabilities of its tokens after the
conversation so far, in one server call that computes the shared prefix once.

    python examples/intent_branch.py [host:port]       # or BANYAN_ADDRESS=host:port
"""

from __future__ import annotations

import sys

import banyan as bn

INTENTS = ["weather", "arithmetic", "small talk"]
REQUESTS = ["Will it rain in Paris tomorrow?", "What is 17 times 23?", "Hi! How are you doing today?"]


@bn.function
def route(s, request: str, method: str = "mean", max_tokens: int = 32):
    s += bn.system("You sort requests by intent, then help with them.")
    s += bn.user(f"Request: {request}\nIs this about {', '.join(INTENTS[:-1])} or {INTENTS[-1]}?")
    s += bn.assistant(bn.select("intent", choices=INTENTS, method=method))
    if s["intent"] == "weather":
        s += bn.user("Which city is it about? Answer with the city name only.")
        s += bn.assistant(bn.gen("city", max_tokens=8, stop=["\n", "."], temperature=0))
        s += bn.user("Give a one-sentence forecast.")
        s += bn.assistant(bn.gen("forecast", max_tokens=max_tokens, stop="\n", temperature=0))
    elif s["intent"] == "arithmetic":
        s += bn.user("Give the result as digits only.")
        s += bn.assistant(bn.gen("result", regex=r"-?[0-9]{1,8}", max_tokens=12, temperature=0))
    else:
        s += bn.user("Reply politely in one sentence.")
        s += bn.assistant(bn.gen("reply", max_tokens=max_tokens, stop="\n", temperature=0))


def main(address: str | None = None) -> None:
    with bn.Backend(address) as backend:
        for request in REQUESTS:
            s = route.run(request, backend=backend)
            scores = ", ".join(f"{c} {v:.2f}" for c, v in zip(INTENTS, s["intent_scores"]))
            print(f"{request!r} → {s['intent']}  (mean logprob: {scores})")
            for name in ("city", "forecast", "result", "reply"):
                if name in s.values:
                    print(f"  {name}: {s[name]!r}")


if __name__ == "__main__":
    try:
        main(sys.argv[1] if len(sys.argv) > 1 else None)
    except bn.ServerError as e:  # (no server there, or it refused a call): one line, exit code 1
        sys.exit(f"{sys.argv[0]}: error: {e}")
