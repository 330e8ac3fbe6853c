"""structlog JSON logging and the request-stage log line.

Every request stage (received, tokenized, queued, scheduled, first_token, finished, sent) is one
JSON line ``{"event": "stage", "stage": ..., "request_id": ..., "service": ...}`` written by the
process where it happens, so one request can be followed through every service's logs.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import structlog

_service = "banyan"


def setup_logging(service: str, level: str = "info") -> None:
    """Configure JSON lines on stderr for this process, tagged with the service name."""
    global _service
    _service = service
    lvl = getattr(logging, level.upper())
    logging.basicConfig(stream=sys.stderr, level=lvl, format="%(message)s", force=True)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _add_service,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        # one write per line (print() writes the text and its newline apart: with several processes
        # on one log file, lines would interleave)
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def _add_service(_logger, _name, event_dict):
    event_dict.setdefault("service", _service)
    event_dict.setdefault("pid", os.getpid())
    return event_dict


def get_logger(name: str):
    return structlog.get_logger(name)


_stage_log = get_logger("stage")


def stage(name: str, request_id: str, **fields) -> None:
    """Log one request lifecycle stage."""
    _stage_log.info("stage", stage=name, request_id=request_id, t=time.time(), **fields)
