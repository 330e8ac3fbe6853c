"""One-line errors for the ``banyan`` commands that talk to a server (``bench``, ``top``,
``check-env``) and the messages they share with the frontend library.

A command raises ``CommandError`` for what the user must fix; ``run_command`` prints it — or a
server that cannot be reached, a refused call, a file that cannot be read — as one line,
``banyan CMD: error: …``, with exit code 1 (``--debug`` or ``BANYAN_DEBUG=1``: the traceback).
Anything else is a bug and keeps its traceback."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable

from shared.entry import DEBUG_ENV

_CONNECT = re.compile(r"(?:ipv[46]|unix|dns):(\S+?): (?:Failed to connect to remote host: )?(.+)$")


class CommandError(Exception):
    """What a command's user must fix, in one line (the command's name is added)."""


def rpc_message(code: str, details: str, target: str = "") -> str:
    """A gRPC failure in words: a server that cannot be reached says so and where; another status
    is the server's own answer."""
    if code == "UNAVAILABLE" and "failed to connect" in details.lower():
        m = _CONNECT.search(details)
        where, why = (m.group(1), m.group(2).rstrip(".")) if m else (target, details)
        return f"no server answers at {where or target} ({why}): is `banyan serve` running there?"
    return f"the server answered {code}: {details}"


def describe(e: BaseException, target: str = "") -> str | None:
    """The one line for ``e``, or None when it is not a user-facing failure (a bug)."""
    if isinstance(e, CommandError):
        return str(e)
    try:
        import grpc
    except ImportError:  # (the commands run without grpc only where they never make a call)
        grpc = None
    if grpc is not None and isinstance(e, grpc.RpcError) and hasattr(e, "code"):
        return rpc_message(e.code().name, e.details() or "", target)
    if isinstance(e, ConnectionError):
        return f"cannot reach {target or 'the server'}: {e.strerror or e}"
    if isinstance(e, OSError):  # (urllib's URLError, a missing --dataset-path …)
        reason = getattr(e, "reason", None)
        return f"{reason if reason is not None else e}" + (f" ({target})" if target and reason is not None else "")
    return None


def run_command(prog: str, main: Callable[[list[str]], int], argv: list[str], target: str = "") -> int:
    """``main(argv)``'s exit code; a user-facing failure is one line on stderr and exit code 1."""
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        return main(argv)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        line = describe(e, target)
        if line is None or debug:
            raise
        print(f"{prog}: error: {line}", file=sys.stderr, flush=True)
        return 1
