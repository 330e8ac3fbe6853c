"""How many streamed tokens one tokenizer replica delivers, with the scheduler taken out.

A fake scheduler (this process, the real ZMQ codec) answers the replica's hello with a ModelInfo
and, every ``--step-ms``, sends each running request one token (what a scheduler step does), real
text tokens of the model's tokenizer, ``--tokens`` per request. The replica is the real
``services.tokenizer`` process (``--root``: from another checkout, to compare versions); a client
process opens ``--streams`` gRPC Generate streams at once and counts what arrives. Offered load
is streams × 1000 / step-ms tokens/s: above what the replica can write, it falls behind, and
delivered tokens/s is its capacity.

    python -m benchmarks.bench_tokenizer --streams 256 --tokens 200 --step-ms 2 --out R.json [--root DIR]

Prints one line and writes JSON (delivered tokens/s, messages/s, tokens per message, the
replica's CPU seconds).

``--probe-rate R``: meanwhile another client process sends R requests a second of priority 10
that the fake scheduler answers at once (one token, finished): their time to first token is the
front end's own round trip (gRPC in, the replica's loop, the socket to the scheduler and back,
gRPC out) under the streaming load — W7's interactive requests minus the engine. The replica's
``event_loop_lag`` lines are summed up with it. ``--probe-in-step``: a probe's token comes with the
next step's outputs instead, last in that batch (as a scheduler step answers an admitted request
along with every running one): the probe then also waits for the replica to hand on the batch.

    python -m benchmarks.bench_tokenizer --streams 256 --tokens 400 --step-ms 25 --probe-rate 5
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu.stage_trace import lag_windows, quantile  # noqa: E402
from shared.messages.codec import Codec  # noqa: E402
from shared.messages.common import FinishReason  # noqa: E402
from shared.messages.to_scheduler import AbortReq, GenerateReq, LoadReq, ToScheduler, TokenizerHello  # noqa: E402
from shared.messages.to_tokenizer import Load, ModelInfo, ToTokenizer, TokenOut, TokenOutBatch  # noqa: E402


class FakeScheduler(threading.Thread):
    def __init__(self, endpoint: str, text_ids: list[int], tokens: int, step_s: float, vocab: int,
                 probe_in_step: bool = False) -> None:
        super().__init__(daemon=True)
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(endpoint)
        self.dec, self.enc = Codec(ToScheduler), Codec(ToTokenizer)
        self.ids, self.tokens, self.step_s, self.vocab = text_ids, tokens, step_s, vocab
        self.active: dict[str, list] = {}  # rid -> [replica, sent]
        self.stop = False
        self.steps = 0
        self.probe_in_step = probe_in_step
        self.probes: list[tuple[bytes, TokenOut]] = []  # (probe_in_step) answered with the next step, last

    def send(self, ident: bytes, msg) -> None:
        self.sock.send_multipart([ident, self.enc.encode(msg)])

    def run(self) -> None:
        next_step = time.perf_counter()
        while not self.stop:
            while self.sock.poll(0):
                ident, frame = self.sock.recv_multipart()
                msg = self.dec.decode(frame)
                if isinstance(msg, TokenizerHello):
                    self.send(ident, ModelInfo(model="bench", architecture="LlamaForCausalLM", vocab_size=self.vocab,
                                               context_length=4096, pool_size=1 << 20, max_running_requests=4096,
                                               eos_token_ids=[], device="cpu", dtype="float32"))
                elif isinstance(msg, GenerateReq) and msg.priority > 0:  # a probe: its token at once
                    out = TokenOut(rid=msg.rid, token_ids=[self.ids[0]], finish=FinishReason.LENGTH,
                                   prompt_tokens=len(msg.input_ids), completion_tokens=1)
                    if self.probe_in_step:
                        self.probes.append((ident, out))
                    else:
                        self.send(ident, TokenOutBatch(outs=[out]))
                elif isinstance(msg, GenerateReq):
                    self.active[msg.rid] = [ident, 0, len(msg.input_ids), msg.params.stream_interval, []]
                elif isinstance(msg, AbortReq):
                    self.active.pop(msg.rid, None)
                elif isinstance(msg, LoadReq):
                    self.send(ident, Load(msg.token, len(self.active), 0, 1 << 20, 0, 1 << 20, 0, self.steps, 0, 0, 0,
                                          0, 0))
            now = time.perf_counter()
            if now < next_step:
                time.sleep(min(next_step - now, 0.0005))
                continue
            next_step += self.step_s
            self.steps += 1
            batches: dict[bytes, list[TokenOut]] = {}
            for rid, st in list(self.active.items()):
                ident, sent, prompt, interval, held = st
                held.append(self.ids[(sent + hash(rid)) % len(self.ids)])
                st[1] = sent = sent + 1
                last = sent >= self.tokens
                if not (last or sent == 1 or len(held) >= interval):  # (the request's stream_interval)
                    continue
                batches.setdefault(ident, []).append(TokenOut(
                    rid=rid, token_ids=list(held), finish=FinishReason.LENGTH if last else None,
                    prompt_tokens=prompt if last else 0, completion_tokens=sent if last else 0))
                held.clear()
                if last:
                    del self.active[rid]
            for ident, out in self.probes:  # (after every stream's output of the step)
                batches.setdefault(ident, []).append(out)
            self.probes.clear()
            for ident, outs in batches.items():
                self.send(ident, TokenOutBatch(outs=outs))


def client(port: int, streams: int, tokens: int, interval: int, out: multiprocessing.Queue) -> None:
    import asyncio

    import grpc

    from shared.proto.banyan.v1 import generation_pb2 as pb
    from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc

    async def main() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
            counts = [0, 0]  # messages, tokens

            async def one(i: int) -> None:
                req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[100 + i % 50] * 16), sampling_params=pb.SamplingParams(
                    max_tokens=tokens, ignore_eos=True, temperature=0.0, stream_interval=interval))
                async for r in stub.Generate(req, timeout=600):
                    counts[0] += 1
                    counts[1] += len(r.token_ids)

            t0 = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(streams)))
            out.put({"wall_s": time.perf_counter() - t0, "messages": counts[0], "tokens": counts[1]})

    asyncio.run(main())


def prober(port: int, rate: float, ready, stop, out: multiprocessing.Queue) -> None:
    """Priority-10 one-token requests every 1 / ``rate`` s until ``stop`` (at least one), ``ready`` set once
    connected (the background starts then): their TTFTs (s)."""
    import asyncio

    import grpc

    from shared.proto.banyan.v1 import generation_pb2 as pb
    from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc

    async def main() -> None:
        ttfts: list[float] = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
            await ch.channel_ready()
            ready.set()

            async def one() -> None:
                req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7] * 16), priority=10,
                                         sampling_params=pb.SamplingParams(max_tokens=1, ignore_eos=True))
                t0 = time.perf_counter()
                async for r in stub.Generate(req, timeout=60):
                    if r.token_ids:
                        ttfts.append(time.perf_counter() - t0)
                        break

            tasks = []
            while not tasks or not stop.is_set():
                tasks.append(asyncio.create_task(one()))
                await asyncio.sleep(1 / rate)
            await asyncio.gather(*tasks)
        out.put(ttfts)

    asyncio.run(main())


def lag_lines(log: Path) -> dict:
    """The replica's ``event_loop_lag`` windows: how many, the worst p99 and max (ms)."""
    evs = [e for w in lag_windows(log).values() for e in w]
    return {"windows": len(evs), "p99_ms": max((e["p99_ms"] for e in evs), default=0.0),
            "max_ms": max((e["max_ms"] for e in evs), default=0.0)}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=200, help="tokens per request")
    ap.add_argument("--step-ms", type=float, default=2.0, help="one token per request per step")
    ap.add_argument("--model", default="", help="model directory whose tokenizer the replica loads (default: demo)")
    ap.add_argument("--root", default=str(ROOT), help="checkout the replica runs from")
    ap.add_argument("--stream-interval", type=int, default=1, help="the background streams' stream_interval: "
                    "the fake scheduler sends their tokens that many at a time")
    ap.add_argument("--probe-rate", type=float, default=0.0, help="priority-10 one-token requests a second, "
                    "answered at once by the fake scheduler: the front end's TTFT under the load (0: none)")
    ap.add_argument("--probe-in-step", action="store_true", help="a probe's token comes last in the next step's "
                    "batch rather than at once")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from banyan.cli import resolve  # (empty: the demo model)

    model_dir, _ = resolve(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    text_ids = tok.encode((ROOT / "docs" / "architecture.md").read_text(), add_special_tokens=False)
    with tempfile.TemporaryDirectory() as tmp:
        endpoint, port_file = f"ipc://{tmp}/sched.ipc", f"{tmp}/tok.port"
        sched = FakeScheduler(endpoint, text_ids, args.tokens, args.step_ms / 1e3, len(tok), args.probe_in_step)
        sched.start()
        env = dict(os.environ, PYTHONPATH=args.root, OMP_NUM_THREADS="1")
        log_path = Path(tmp) / "replica.log"
        log_file = open(log_path, "w")  # noqa: SIM115  (the replica writes to it until it stops)
        proc = subprocess.Popen([sys.executable, "-m", "services.tokenizer", "--scheduler-endpoint", endpoint,
                                 "--grpc-port", "0", "--http-port", "-1", "--port-file", port_file,
                                 "--model", model_dir, "--host", "127.0.0.1", "--log-format", "json"], cwd=args.root,
                                env=env, stdout=subprocess.DEVNULL, stderr=log_file)
        try:
            deadline = time.monotonic() + 120
            while not os.path.exists(port_file):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the tokenizer replica did not start")
                time.sleep(0.1)
            port = int(Path(port_file).read_text().split()[0])
            cpu0 = cpu_seconds(proc.pid)
            mp = multiprocessing.get_context("spawn")
            q: multiprocessing.Queue = mp.Queue()
            if args.probe_rate > 0:  # (connected before the background starts: its probes overlap it)
                ready, stop, pq = mp.Event(), mp.Event(), mp.Queue()
                p = mp.Process(target=prober, args=(port, args.probe_rate, ready, stop, pq), daemon=True)
                p.start()
                if not ready.wait(120):
                    raise RuntimeError("the prober did not connect")
            c = mp.Process(target=client, args=(port, args.streams, args.tokens, args.stream_interval, q))
            c.start()
            res = q.get(timeout=900)
            c.join()
            res["replica_cpu_s"] = cpu_seconds(proc.pid) - cpu0
            if args.probe_rate > 0:
                stop.set()
                ttfts = pq.get(timeout=120)
                p.join()
                res["probe"] = {"rate": args.probe_rate, "n": len(ttfts), **{
                    f"ttft_{k}_ms": round(quantile(ttfts, v) * 1e3, 2) for k, v in (("p50", 0.5), ("p90", 0.9),
                                                                              ("p99", 0.99), ("max", 1.0))}}
            res["replica_loop_lag"] = lag_lines(log_path)
        finally:
            sched.stop = True
            proc.terminate()
            proc.wait(30)
            log_file.close()
    offered = args.streams * 1e3 / args.step_ms
    res.update(label=args.label, root=args.root, streams=args.streams, tokens_per_request=args.tokens,
               stream_interval=args.stream_interval, probe_in_step=args.probe_in_step,
               step_ms=args.step_ms, offered_tok_s=offered, delivered_tok_s=res["tokens"] / res["wall_s"],
               messages_s=res["messages"] / res["wall_s"], tokens_per_message=res["tokens"] / max(1, res["messages"]),
               cpu_us_per_token=res["replica_cpu_s"] / max(1, res["tokens"]) * 1e6, cpus=os.cpu_count())
    print(f"{args.label or args.root}: offered {offered:,.0f} tok/s · delivered {res['delivered_tok_s']:,.0f} tok/s · "
          f"{res['messages_s']:,.0f} msg/s · {res['tokens_per_message']:.2f} tok/msg · replica "
          f"{res['cpu_us_per_token']:.1f} µs CPU/token · {res['tokens']} tokens in {res['wall_s']:.1f} s")
    if "probe" in res:
        pr, lag = res["probe"], res["replica_loop_lag"]
        print(f"  probes ({pr['n']} at {pr['rate']}/s, answered {'in the next step' if args.probe_in_step else 'at once'}): TTFT p50 / p90 / p99 / max "
              f"{pr['ttft_p50_ms']} / {pr['ttft_p90_ms']} / {pr['ttft_p99_ms']} / {pr['ttft_max_ms']} ms · replica "
              f"loop lag: {lag['windows']} windows over 5 ms, p99 ≤ {lag['p99_ms']} · max {lag['max_ms']} ms")
    if args.out:
        doc = json.loads(args.out.read_text()) if args.out.exists() else {"benchmark": "tokenizer_replica", "runs": []}
        doc["runs"].append(res)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
