"""Session-backed program states (``bn.session``): the conversation lives on the server.

A ``SessionState`` is a ``ProgramState`` whose generations continue a server session
(``OpenSession``): each ``gen`` sends only what was added since the previous one — the new chat
turns, rendered by the server as a continuation, or the new text — and the server keeps every
token and pins their KV, so no turn recomputes (or even re-sends) the conversation so far, however
much other traffic passes in between. ``fork`` branches the session: each copy continues the
same turn, sharing its KV. The session is closed when the ``with`` block ends (or by ``close``);
otherwise it expires after ``ttl_seconds`` without a turn.

    with bn.session(backend, ttl_seconds=600) as s:
        s += bn.system("You are terse.")
        s += bn.user("Name a colour.")
        s += bn.assistant(bn.gen("colour", max_tokens=8))
        s += bn.user("And a fruit of that colour?")
        s += bn.assistant(bn.gen("fruit", max_tokens=8))   # sends only the new user turn

In a chat session a ``gen`` makes up its whole assistant turn (text before or after it in the same
turn would not be in the server's copy); ``select`` needs the whole prompt and is not available.
"""

from __future__ import annotations

import uuid

from banyan.lang.backend import Backend, default_backend
from banyan.lang.ir import Gen, Select
from banyan.lang.state import ProgramState
from shared.proto.banyan.v1 import generation_pb2 as pb


class SessionState(ProgramState):
    def __init__(self, backend: Backend, session_id: str, capacity: int = 0, ttl_seconds: int = 0) -> None:
        super().__init__(backend)
        self.session_id, self.capacity, self.ttl_seconds = session_id, capacity, ttl_seconds
        self.turn = ""  # the server-side turn this state continues ("": the session's start)
        self._sent_turns = 0  # chat: the turns the session already holds
        self._sent_chars = 0  # text: the characters it already holds
        self._sealed = -1  # chat: the index of the assistant turn a gen filled (nothing more may go in it)

    def _gen(self, g: Gen) -> None:
        sp, constraint = self._gen_params(g)
        req = pb.GenerateRequest(request_id=f"turn-{uuid.uuid4().hex}", session_id=self.session_id,
                                 session_parent=self.turn, sampling_params=sp, **constraint)
        chat = bool(self._turns) or self._open is not None
        if chat:
            if self._open is None or self._open[0] != "assistant" or self._open[1]:
                raise ValueError("in a session, gen makes up a whole assistant turn: s += assistant(gen(...))")
            new = self._turns[self._sent_turns:]
            if not new:
                raise ValueError("nothing new to send: add a user turn before the next gen")
            req.chat.CopyFrom(pb.ChatInput(messages=[pb.ChatMessage(role=r, content=c) for r, c in new],
                                           add_generation_prompt=True))
        else:
            new_text = self._text[self._sent_chars:]
            if not new_text:
                raise ValueError("nothing new to send: add text before the next gen")
            req.text = new_text
        res = self.backend.run(req)
        self.turn = req.request_id
        self._store(g, res)
        ProgramState._append(self, res.text)
        if chat:  # the open assistant turn is in the session now, as generated
            self._sealed = len(self._turns)
            self._sent_turns = len(self._turns) + 1
        else:
            self._sent_chars = len(self._text)

    def _append(self, text: str) -> None:
        if self._open is not None and self._sealed == len(self._turns):
            raise ValueError("in a session, gen makes up a whole assistant turn: nothing else goes in it")
        ProgramState._append(self, text)

    def _select(self, s: Select) -> None:
        raise ValueError("select is not available in a session state (it scores against the whole prompt)")

    def close(self) -> int:
        """Close the server session (its KV is no longer pinned). → the tokens it held."""
        return self.backend.close_session(self.session_id)

    def __enter__(self) -> SessionState:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def session(backend: Backend | None = None, ttl_seconds: int | None = None, capacity: int | None = None,
            cache_salt: str = "") -> SessionState:
    """Open a server session and return a state backed by it (use it in a ``with`` block, or call
    ``close``). ``ttl_seconds``: idle seconds before the server drops it (default 600);
    ``capacity``: tokens it may hold (default: the context window, within the server's budget)."""
    backend = backend or default_backend()
    resp = backend.open_session(ttl_seconds, capacity, cache_salt)
    return SessionState(backend, resp.session_id, resp.capacity, resp.ttl_seconds)
