"""Clients that send one benchmark request and time it: Banyan's gRPC API, or any
OpenAI-compatible HTTP server (``/v1/completions``, streaming), so other engines can be measured
with the same tool."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from banyan.bench.datasets import BenchRequest
from banyan.errors import rpc_message

Progress = Callable[[int], object] | None  # called with the number of tokens that just arrived


@dataclass
class Result:
    ok: bool
    prompt_len: int
    output_len: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0  # seconds to the first token
    itl: list[float] = field(default_factory=list)  # gaps between later token arrivals
    latency: float = 0.0
    error: str = ""
    token_times: list[float] = field(default_factory=list)  # perf_counter() at each token's arrival
    output_ids: list[int] = field(default_factory=list)  # (gRPC only: the multi-turn workload's history)


class GrpcBackend:
    def __init__(self, target: str, connections: int = 1, stream_interval: int = 1, cache_salt: str = "") -> None:
        """``connections``: TCP connections the requests are spread over, round robin (the tokenizer
        replicas of one ``banyan serve`` share its port: the kernel gives each connection to one of
        them, so one connection's streams all land on one replica, as one client's would);
        ``stream_interval``: the requests' (tokens a streamed message carries; 1: each as it comes);
        ``cache_salt``: the requests' (a fresh one keeps what earlier runs cached out of this run)."""
        import grpc

        from shared.proto.banyan.v1 import generation_pb2 as pb
        from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc

        if connections < 1:
            raise ValueError("connections must be >= 1")
        self.pb = pb
        opts = [("grpc.max_receive_message_length", 64 << 20)]
        if connections > 1:  # (a channel of its own subchannel pool: a connection of its own)
            opts.append(("grpc.use_local_subchannel_pool", 1))
        self.channels = [grpc.aio.insecure_channel(target, options=opts) for _ in range(connections)]
        self._stubs = [pb_grpc.GenerationServiceStub(c) for c in self.channels]
        self._next = 0
        self.stream_interval = stream_interval
        self.cache_salt = cache_salt

    @property
    def stub(self):
        """The next connection's stub (round robin)."""
        self._next = (self._next + 1) % len(self._stubs)
        return self._stubs[self._next]

    async def send(self, r: BenchRequest, ignore_eos: bool, temperature: float, progress: Progress = None) -> Result:
        pb = self.pb
        sp = pb.SamplingParams(max_tokens=r.output_len, ignore_eos=ignore_eos, temperature=temperature)
        if self.stream_interval != 1:
            sp.stream_interval = self.stream_interval
        req = pb.GenerateRequest(sampling_params=sp, priority=r.priority, cache_salt=self.cache_salt)
        if r.prompt_ids:
            req.token_ids.ids.extend(r.prompt_ids)
        else:
            req.text = r.prompt_text
        if r.json_schema:
            req.json_schema = r.json_schema
        res = Result(ok=False, prompt_len=r.prompt_len)
        t0 = last = time.perf_counter()
        try:
            async for chunk in self.stub.Generate(req):
                now = time.perf_counter()
                if chunk.token_ids:
                    res.output_ids.extend(chunk.token_ids)
                    res.token_times += [now] * len(chunk.token_ids)
                    if res.output_len == 0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                    res.output_len += len(chunk.token_ids)
                    if progress is not None:
                        progress(len(chunk.token_ids))
                if chunk.HasField("usage"):
                    res.cached_tokens = chunk.usage.cached_tokens
                    res.prompt_len = chunk.usage.prompt_tokens
            res.ok = True
        except Exception as e:  # a failed request is counted, not fatal
            res.error = (rpc_message(e.code().name, e.details() or "") if hasattr(e, "details") else str(e))[:200]
        res.latency = time.perf_counter() - t0
        return res

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()


class OpenAIBackend:
    def __init__(self, base_url: str, model: str, api_key: str = "") -> None:
        import aiohttp

        self.url = base_url.rstrip("/") + "/v1/completions"
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.session = aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=3600))

    async def send(self, r: BenchRequest, ignore_eos: bool, temperature: float, progress: Progress = None) -> Result:
        body = {"model": self.model, "prompt": r.prompt_ids or r.prompt_text, "max_tokens": r.output_len,
                "temperature": temperature, "stream": True, "stream_options": {"include_usage": True},
                "ignore_eos": ignore_eos}
        if r.priority:
            body["priority"] = r.priority
        if r.json_schema:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "bench", "schema": json.loads(r.json_schema)}}
        res = Result(ok=False, prompt_len=r.prompt_len)
        t0 = last = time.perf_counter()
        chunks = 0
        try:
            async with self.session.post(self.url, json=body) as resp:
                if resp.status != 200:
                    res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return res
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[5:])
                    now = time.perf_counter()
                    if data.get("choices") and data["choices"][0].get("text"):
                        res.token_times.append(now)
                        if chunks == 0:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last, chunks = now, chunks + 1
                        if progress is not None:
                            progress(1)
                    usage = data.get("usage")
                    if usage:
                        res.output_len = usage.get("completion_tokens", chunks)
                        res.prompt_len = usage.get("prompt_tokens", res.prompt_len)
                        res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
            res.output_len = res.output_len or chunks
            res.ok = True
        except Exception as e:
            res.error = str(e)[:200]
        res.latency = time.perf_counter() - t0
        return res

    async def close(self) -> None:
        await self.session.close()
