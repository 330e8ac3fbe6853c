"""``banyan convert model.gguf OUT_DIR``: a GGUF file written out as an HF model directory; and the
GGUF step of ``banyan serve --model x.gguf`` (shared/gguf does the work)."""

from __future__ import annotations

import sys

from shared.entry import Parser
from shared.gguf import GGUFError

PROG = "banyan convert"


def resolve_gguf(prog: str, model: str, dtype: str) -> tuple[str, str] | None:
    """(HF directory, served name) of GGUF file ``model`` (converted on first use, then cached), or
    None once a one-line error has been printed."""
    from shared.model_path import resolve_model

    print(f"{prog}: reading {model} (converted once into an HF directory, then cached)", file=sys.stderr)
    try:
        model_dir, name = resolve_model(model, dtype)
    except GGUFError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return None
    print(f"{prog}: {model} → {model_dir}", file=sys.stderr)
    return model_dir, name


def main(argv: list[str]) -> int:
    from shared.gguf.convert import DTYPES, convert

    ap = Parser(prog=PROG, description="Write a GGUF file out as an HF model directory (config.json, "
                "generation_config.json, safetensors with every tensor dequantized, tokenizer files)")
    ap.add_argument("gguf", help="the .gguf file")
    ap.add_argument("out_dir", help="the directory to write (created; files of the same names replaced)")
    ap.add_argument("--dtype", choices=DTYPES, default="float32",
                    help="dtype of the safetensors weights [default float32]")
    ns = ap.parse_args(argv)
    try:
        out = convert(ns.gguf, ns.out_dir, ns.dtype)
    except GGUFError as e:
        if ns.debug:
            raise
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    print(f"{PROG}: wrote {out}")
    return 0
