"""Generate the Python gRPC stubs from protos/ into shared/proto/ (``--check``: fail if stale).

protoc writes absolute imports (``from banyan.v1 import generation_pb2``); they are rewritten to
``shared.proto.banyan.v1`` so the stubs live inside the ``shared`` package.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
OUT = ROOT / "shared" / "proto"


def generate(dest: pathlib.Path) -> None:
    from grpc_tools import protoc
    import grpc_tools

    files = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTOS}", f"-I{include}", f"--python_out={dest}", f"--pyi_out={dest}",
            f"--grpc_python_out={dest}", *files]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for py in dest.rglob("*.py*"):
        text = py.read_text()
        py.write_text(text.replace("from banyan.v1 import", "from shared.proto.banyan.v1 import"))
    for d in [dest, *[p for p in dest.rglob("*") if p.is_dir()]]:
        (d / "__init__.py").touch()


def snapshot(d: pathlib.Path) -> dict[str, str]:
    return {str(p.relative_to(d)): p.read_text() for p in sorted(d.rglob("*")) if p.is_file()
            and "__pycache__" not in p.parts}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="exit 1 if shared/proto is not current")
    a = ap.parse_args()
    if a.check:
        with tempfile.TemporaryDirectory() as tmp:
            generate(pathlib.Path(tmp))
            if snapshot(pathlib.Path(tmp)) != snapshot(OUT):
                print("shared/proto is stale: run python scripts/gen_protos.py", file=sys.stderr)
                return 1
        print("stubs are current")
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    generate(OUT)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
