"""A five-step reasoning chain in plain text: each step builds on the text of the steps before it
and constrains its output differently (stop strings, a JSON schema, a regex, a choice).

    python examples/reasoning_chain.py [host:port]     # or BANYAN_ADDRESS=host:port
"""

from __future__ import annotations

import json
import sys

import banyan as bn

PROBLEM = "A baker makes 12 loaves each hour for 7 hours, then sells 50 of them. How many are left?"

NUMBERS_SCHEMA = {
    "type": "object",
    "properties": {
        "rate": {"type": "integer", "minimum": 0, "maximum": 1000},
        "hours": {"type": "integer", "minimum": 0, "maximum": 1000},
        "sold": {"type": "integer", "minimum": 0, "maximum": 1000},
    },
    "required": ["rate", "hours", "sold"],
    "additionalProperties": False,
}


@bn.function
def reasoning_chain(s, problem: str, max_tokens: int = 32):
    s += f"Problem: {problem}\n"
    s += "Step 1. Restate the question: "
    s += bn.gen("question", max_tokens=max_tokens, stop="\n", temperature=0)
    s += "\nStep 2. Plan: "
    s += bn.gen("plan", max_tokens=max_tokens, stop=["\n", "Step"], temperature=0)
    s += "\nStep 3. The numbers as JSON: "
    s += bn.gen("numbers", max_tokens=48, json_schema=NUMBERS_SCHEMA, temperature=0)
    s += "\nStep 4. The answer in digits: "
    s += bn.gen("answer", max_tokens=8, regex=r"[0-9]{1,5}", temperature=0)
    s += "\nStep 5. Is that answer right? "
    s += bn.select("check", choices=["yes", "no"])
    s += "\n"


def main(address: str | None = None) -> None:
    with bn.Backend(address) as backend:
        s = reasoning_chain.run(PROBLEM, backend=backend)
    print(s.text())
    numbers = json.loads(s["numbers"])
    print("parsed:", numbers, "→ expected", numbers["rate"] * numbers["hours"] - numbers["sold"],
          "| model said", s["answer"], "| self-check:", s["check"])


if __name__ == "__main__":
    try:
        main(sys.argv[1] if len(sys.argv) > 1 else None)
    except bn.ServerError as e:  # (no server there, or it refused a call): one line, exit code 1
        sys.exit(f"{sys.argv[0]}: error: {e}")
