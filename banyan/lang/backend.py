"""The frontend's link to a Banyan server: the public gRPC API (tokenizer service)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import grpc

from banyan.errors import rpc_message
from shared.proto.banyan.v1 import generation_pb2 as pb
from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc


class ServerError(RuntimeError):
    """The server refused or failed a call; ``code`` is the gRPC status name, the text its message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


class ServerUnreachable(ServerError):
    """No server answers at the backend's address (nothing listens there, or it cannot be reached);
    ``code`` is ``UNAVAILABLE``, ``address`` the backend's."""

    def __init__(self, address: str, message: str) -> None:
        super().__init__("UNAVAILABLE", message)
        self.address = address

    def __str__(self) -> str:
        return self.message


def _error(e: grpc.RpcError, address: str) -> ServerError:
    code, details = e.code().name, e.details() or ""
    if code == "UNAVAILABLE" and "failed to connect" in details.lower():
        return ServerUnreachable(address, rpc_message(code, details, address) + " (Backend(address) or BANYAN_ADDRESS)")
    return ServerError(code, details)


@dataclass(frozen=True)
class GenResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int




DEFAULT_ADDRESS = "localhost:50051"


class Backend:
    """Talks to ``banyan serve`` at ``address`` (host:port; default ``$BANYAN_ADDRESS``, else
    localhost:50051). Thread-safe: programs run in parallel (run_batch, fork) share one channel.
    Usable as a context manager (closes the channel)."""

    def __init__(self, address: str | None = None, timeout: float = 600.0, api_key: str = "") -> None:
        address = address or os.environ.get("BANYAN_ADDRESS") or DEFAULT_ADDRESS
        self.address = address
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
        self.stub = pb_grpc.GenerationServiceStub(self.channel)
        self.timeout = timeout
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    def close(self) -> None:
        self.channel.close()

    def _call(self, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except grpc.RpcError as e:
            raise _error(e, self.address) from None

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def chat_ids(self, messages: list[tuple[str, str]], add_generation_prompt: bool) -> list[int]:
        chat = pb.ChatInput(messages=[pb.ChatMessage(role=r, content=c) for r, c in messages],
                            add_generation_prompt=add_generation_prompt)
        return list(self._call(self.stub.Tokenize, pb.TokenizeRequest(chat=chat), timeout=self.timeout,
                          metadata=self.metadata).token_ids)

    def text_ids(self, text: str, add_special_tokens: bool) -> list[int]:
        req = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list(self._call(self.stub.Tokenize, req, timeout=self.timeout, metadata=self.metadata).token_ids)

    def generate(self, ids: list[int], sampling: pb.SamplingParams, **constraint) -> GenResult:
        return self.run(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling_params=sampling, **constraint))

    def run(self, req: pb.GenerateRequest) -> GenResult:
        """One Generate call, its streamed chunks gathered."""
        parts, toks, last = [], [], None
        try:
            for chunk in self.stub.Generate(req, timeout=self.timeout, metadata=self.metadata):
                parts.append(chunk.text)
                toks.extend(chunk.token_ids)
                last = chunk
        except grpc.RpcError as e:
            raise _error(e, self.address) from None
        assert last is not None
        return GenResult("".join(parts), toks, pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower(),
                         last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_tokens)

    def open_session(self, ttl_seconds: int | None = None, capacity: int | None = None,
                     cache_salt: str = "") -> pb.OpenSessionResponse:
        req = pb.OpenSessionRequest(ttl_seconds=ttl_seconds, capacity=capacity, cache_salt=cache_salt)
        return self._call(self.stub.OpenSession, req, timeout=self.timeout, metadata=self.metadata)

    def close_session(self, session_id: str) -> int:
        """→ the tokens the session held."""
        req = pb.CloseSessionRequest(session_id=session_id)
        return self._call(self.stub.CloseSession, req, timeout=self.timeout, metadata=self.metadata).tokens

    def score(self, ids: list[int], continuations: list[str]) -> pb.ScoreResponse:
        req = pb.ScoreRequest(token_ids=pb.TokenIds(ids=ids), continuations=continuations)
        return self._call(self.stub.Score, req, timeout=self.timeout, metadata=self.metadata)


_default: Backend | None = None


def set_default_backend(backend: Backend | None) -> None:
    """The backend ``run`` / ``run_batch`` use when given none (``None`` clears it)."""
    global _default
    _default = backend


def default_backend() -> Backend:
    if _default is None:
        raise RuntimeError("no backend: call banyan.set_default_backend(banyan.Backend('host:port')) "
                           "or pass backend= to run()")
    return _default
