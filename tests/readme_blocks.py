"""The README's fenced command blocks (```bash and ```python), for the doc tests
(tests/e2e/test_readme.py runs those that need no Docker or GPU, tests/deploy/test_readme_docker.py
the Docker ones)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tests.support import ROOT

FENCE = re.compile(r"^```(bash|python)\n(.*?)^```", re.S | re.M)


@dataclass(frozen=True)
class Block:
    section: str  # the `## ` heading above it
    lang: str
    text: str

    def __str__(self) -> str:
        first = self.text.strip().splitlines()[0]
        return f"{self.section}: {first[:70]}"


def readme_blocks() -> list[Block]:
    text = (ROOT / "README.md").read_text()
    heads = [(m.start(), m.group(1)) for m in re.finditer(r"^## (.+)$", text, re.M)]
    out = []
    for m in FENCE.finditer(text):
        section = next((h for pos, h in reversed(heads) if pos < m.start()), "")
        out.append(Block(section, m.group(1), m.group(2)))
    return out


def text_blocks(section: str) -> list[str]:
    """The ```text blocks (output the README quotes) under the ``## section`` heading."""
    text = (ROOT / "README.md").read_text()
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    return [m.group(1) for m in re.finditer(r"^```text\n(.*?)^```", text[start:end if end > 0 else None], re.S | re.M)]


def matching(blocks: list[Block], needle: str) -> list[Block]:
    return [b for b in blocks if needle in b.text]
