"""The Banyan frontend language: programs over a state ``s`` that the server runs with prefix
reuse (``function``, ``gen``, ``select``, roles, ``fork``, ``run_batch``, ``session``)."""

from banyan.lang.backend import Backend, ServerError, ServerUnreachable, set_default_backend
from banyan.lang.ir import assistant, gen, select, system, user
from banyan.lang.program import Program, function
from banyan.lang.session import SessionState, session
from banyan.lang.state import ForkGroup, ProgramState

__all__ = ["Backend", "ForkGroup", "Program", "ProgramState", "ServerError", "ServerUnreachable", "SessionState",
           "assistant", "function", "gen", "select", "session", "set_default_backend", "system", "user"]
