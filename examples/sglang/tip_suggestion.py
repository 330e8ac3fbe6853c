"""SGLang's parallelism example, unchanged, on Banyan: ``fork`` the state into two branches that
expand one tip each (the shared prefix is computed once and served from the radix cache), then
join their answers back into the main text.

    python examples/sglang/tip_suggestion.py [http://host:port]
"""

from __future__ import annotations

import sys

import sglang as sgl
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint


@sgl.function
def tip_suggestion(s, topic="staying healthy"):
    s += ("Here are two tips for " + topic + ": 1. Balanced Diet. 2. Regular Exercise. "
          "Each tip below is expanded into a short paragraph of practical advice.\n\n")
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"Now, expand tip {i + 1} into a paragraph:\n"
        f += sgl.gen("detailed_tip", max_tokens=24, stop="\n\n", temperature=0)
    s += "Tip 1:" + forks[0]["detailed_tip"] + "\n"
    s += "Tip 2:" + forks[1]["detailed_tip"] + "\n"
    s += "In summary" + sgl.gen("summary", max_tokens=16, temperature=0)


def main(url: str = "http://localhost:8000") -> None:
    sgl.set_default_backend(RuntimeEndpoint(url))
    state = tip_suggestion.run()
    print(state.text())


if __name__ == "__main__":
    main(*sys.argv[1:2])
