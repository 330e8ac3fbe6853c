"""structlog logging (JSON lines or readable text) and the request-stage log line.

Every request stage (received, tokenized, queued, scheduled, first_token, finished, sent) is one
line ``{"event": "stage", "stage": ..., "request_id": ..., "service": ...}`` written by the
process where it happens, so one request can be followed through every service's logs.

``--log-format``: ``json`` (one JSON object a line: what log collectors and the tests parse),
``text`` (one readable line a record: local time, service, the event or the stage, the request
id, then ``key=value``; the timestamps, trace ids and pids are left out) or ``auto`` (the default:
text when stderr is a terminal, JSON otherwise — a file, a pipe, a container's log).
"""

from __future__ import annotations

import logging
import os
import sys
import time

import structlog

_service = "banyan"
FORMATS = ("auto", "text", "json")
# left out of text lines: the time is shown as local time, the rest is for machines
_TEXT_HIDDEN = frozenset({"event", "level", "timestamp", "service", "pid", "t", "trace_id", "stage", "request_id",
                          "exception"})


def resolve_format(fmt: str, stream=None) -> str:
    """``auto`` → ``text`` when ``stream`` (stderr) is a terminal, else ``json``."""
    if fmt != "auto":
        return fmt
    stream = sys.stderr if stream is None else stream
    try:
        return "text" if stream.isatty() else "json"
    except (AttributeError, ValueError):  # a closed or odd stream
        return "json"


def setup_logging(service: str, level: str = "info", fmt: str = "auto") -> None:
    """Configure log lines on stderr for this process, tagged with the service name."""
    global _service
    _service = service
    lvl = getattr(logging, level.upper())
    logging.basicConfig(stream=sys.stderr, level=lvl, format="%(message)s", force=True)
    renderer = render_text if resolve_format(fmt) == "text" else structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _add_service,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        # one write per line (print() writes the text and its newline apart: with several processes
        # on one log file, lines would interleave)
        logger_factory=structlog.WriteLoggerFactory(file=_Stderr()),
        cache_logger_on_first_use=False,
    )


class _Stderr:
    """Whatever ``sys.stderr`` is when a line is written (a test harness may swap and close it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _add_service(_logger, _name, event_dict):
    event_dict.setdefault("service", _service)
    event_dict.setdefault("pid", os.getpid())
    return event_dict


def _value(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
    s = str(v)
    return repr(s) if (" " in s or not s) and isinstance(v, str) else s


def render_text(_logger, _name, ev: dict) -> str:
    """One readable line: ``HH:MM:SS.mmm service  WHAT  request_id  key=value …`` (WHAT: the
    stage of a stage line, else the event; a level other than info is shown before it)."""
    t = ev.get("t") or time.time()
    clock = time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"
    level = ev.get("level", "info")
    what = ev.get("stage") if ev.get("event") == "stage" else ev.get("event")
    parts = [clock, f"{ev.get('service', _service):<9}"]
    if level != "info":
        parts.append(level.upper())
    parts.append(f"{what!s:<15}")
    if "request_id" in ev:
        parts.append(str(ev["request_id"]))
    parts += [f"{k}={_value(v)}" for k, v in ev.items() if k not in _TEXT_HIDDEN]
    line = " ".join(parts)
    if ev.get("exception"):
        line += "\n" + str(ev["exception"]).rstrip()
    return line


def get_logger(name: str):
    return structlog.get_logger(name)


_stage_log = get_logger("stage")


def stage(name: str, request_id: str, **fields) -> None:
    """Log one request lifecycle stage."""
    _stage_log.info("stage", stage=name, request_id=request_id, t=time.time(), **fields)
