"""Frozen per-service configuration.

Every field of a service config is a CLI flag (``--max-running-requests``) and an environment
variable (``BANYAN_MAX_RUNNING_REQUESTS``); the flag wins over the variable, the variable over the
default. Each config validates itself in ``__post_init__``; derived values are properties.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from dataclasses import dataclass, field

ENV_PREFIX = "BANYAN_"
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8")  # fp8: fp8_e4m3
QUANTIZATIONS = ("", "fp8")
WRITE_POLICIES = ("write_through", "write_back")
# the piecewise graphs' size when left to the worker (measured on the H200, 2026-12-03: W3 level,
# W4 +8 %, W5's and W7's prompt steps no longer launch-bound)
PIECEWISE_AUTO_TOKENS = 1536
# --tool-call-parser / --reasoning-parser (the parsers: services/tokenizer/tools/, services/tokenizer/reasoning.py)
TOOL_CALL_PARSERS = ("auto", "none", "hermes", "qwen25", "qwen3", "llama3_json", "llama3", "llama4_json", "mistral",
                     "pythonic", "llama4_pythonic", "deepseek_v3", "deepseek_v31")
REASONING_PARSERS = ("", "qwen3", "deepseek_r1")


class ConfigError(ValueError):
    """A configuration value is invalid."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True)
class CommonConfig:
    model: str = field(default="", metadata={
        "help": "HF model directory, or a hub id already in the local Hugging Face cache (never downloaded); "
                "empty: the embedded demo model"})
    served_model_name: str = field(default="", metadata={
        "append": True, "help": "the model's name in the APIs; repeat the flag (or comma-separate) for aliases: "
                                "the first is reported, requests may name any (empty: the hub id or the "
                                "directory's name; banyan-demo for the demo)"})
    log_level: str = field(default="info", metadata={"help": "debug | info | warning | error"})
    log_format: str = field(default="auto", metadata={
        "help": "text (one readable line per event and request stage) | json (one JSON object a line) | auto "
                "(text when stderr is a terminal, else JSON)"})
    otlp_endpoint: str = field(default="", metadata={
        "help": "export OpenTelemetry spans to this OTLP endpoint (grpc host:4317, or http/protobuf with "
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL; needs the otel extra; empty: no export)"})
    gc_full_interval: float = field(default=120.0, metadata={
        "help": "scheduler and tokenizer: seconds between Python's full garbage collections while busy (each "
                "walks every running request's token lists: ~0.1 s at 1,024 requests; they also run when "
                "idle); 0: Python's own thresholds, which under load run one every few dozen steps"})

    def __post_init__(self) -> None:
        _check(self.gc_full_interval >= 0, f"gc_full_interval {self.gc_full_interval} is below 0")
        _check(self.log_level in ("debug", "info", "warning", "error"),
               f"log_level {self.log_level!r} is not one of debug | info | warning | error")
        _check(self.log_format in ("auto", "text", "json"),
               f"log_format {self.log_format!r} is not one of auto | text | json")

    @property
    def served_model_names(self) -> list[str]:
        """The served names (aliases), first the one reported; [] when not set."""
        return [n.strip() for n in self.served_model_name.split(",") if n.strip()]


@dataclass(frozen=True)
class TokenizerConfig(CommonConfig):
    host: str = field(default="0.0.0.0", metadata={
        "help": "listen host of the gRPC and HTTP ports (0.0.0.0: every interface; 127.0.0.1: this machine only)"})
    grpc_port: int = field(default=50051, metadata={"help": "gRPC listen port (0 = pick a free port)"})
    scheduler_endpoint: str = field(default="tcp://127.0.0.1:5557", metadata={
        "help": "scheduler ZMQ endpoint; with data parallelism one per group, comma-separated (group 0 first)"})
    replica_id: str = field(default="", metadata={"help": "replica identity (empty: host-pid)"})
    port_file: str = field(default="", metadata={
        "help": "once serving, write the bound gRPC port to this file (the HTTP port, or -1, on line 2)"})
    grace_seconds: float = field(default=5.0, metadata={"help": "shutdown grace for in-flight RPCs"})
    http_port: int = field(default=8000, metadata={
        "help": "OpenAI-compatible HTTP listen port (0 = pick a free port, -1 = no HTTP)"})
    api_key: str = field(default="", repr=False, metadata={
        "help": "require 'Authorization: Bearer KEY' on HTTP and gRPC (health stays open; empty: no key)"})
    # data-parallel routing (several scheduler endpoints): see services/tokenizer/router.py
    router_block_tokens: int = field(default=32, metadata={
        "help": "DP routing: prefix blocks of this many tokens (a multiple of the schedulers' --page-size)"})
    router_max_blocks: int = field(default=1 << 18, metadata={
        "help": "DP routing: prefix blocks remembered per group at most (LRU; also bounded by its KV pool)"})
    router_balance_abs: int = field(default=32, metadata={
        "help": "DP routing: prefix affinity yields to load when a group has this many more requests in "
                "flight than the least loaded one …"})
    router_balance_rel: float = field(default=1.5, metadata={"help": "… and this many times as many"})
    router_probe_interval: float = field(default=1.0, metadata={
        "help": "DP routing: seconds between load probes of each group (others' load, dead groups; 0: none)"})
    # the Shepherd Model Gateway's engine API (sglang.grpc.scheduler.SglangScheduler): services/tokenizer/smg
    disable_smg_grpc: bool = field(default=False, metadata={
        "help": "do not serve SMG's gRPC engine service (sglang.grpc.scheduler.SglangScheduler)"})
    smg_grpc_port: int = field(default=-1, metadata={
        "help": "serve SMG's gRPC engine service on this port (-1: on the gRPC port, beside banyan.v1; "
                "0: pick a free port)"})
    disable_kv_events: bool = field(default=False, metadata={
        "help": "SMG's SubscribeKvEvents answers UNIMPLEMENTED (the gateway then routes on its own "
                "approximate prefix tree)"})
    scheduler_gone_grace: float = field(default=30.0, metadata={
        "help": "exit (code 1) once the connection to every scheduler has been closed this many seconds "
                "(0: never): a replica without schedulers cannot serve"})
    tool_call_parser: str = field(default="auto", metadata={
        "help": "the format of the model's tool calls: " + " | ".join(TOOL_CALL_PARSERS[2:]) + "; auto: detected "
                "from the chat template where it names one format (none: no tool_choice auto)"})
    reasoning_parser: str = field(default="", metadata={
        "help": "split the thinking part (<think>…</think>) into reasoning_content: qwen3 | deepseek_r1 "
                "(empty: off)"})
    restart_wait: float = field(default=60.0, metadata={
        "help": "new requests wait up to this many seconds for a scheduler group that is restarting (its "
                "connection closed and it has not served since) when no group serves (0: refuse them at once)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(0 <= self.grpc_port < 65536, f"grpc_port out of range: {self.grpc_port}")
        _check(-1 <= self.smg_grpc_port < 65536, f"smg_grpc_port out of range: {self.smg_grpc_port}")
        eps = self.scheduler_endpoints
        _check(len(eps) >= 1 and len(set(eps)) == len(eps),
               f"scheduler_endpoint needs distinct, non-empty endpoints: {self.scheduler_endpoint!r}")
        _check(self.router_block_tokens >= 1, "router_block_tokens must be >= 1")
        _check(self.router_max_blocks >= 1, "router_max_blocks must be >= 1")
        _check(self.router_balance_abs >= 0, "router_balance_abs must be >= 0")
        _check(self.router_balance_rel >= 1.0, "router_balance_rel must be >= 1")
        _check(self.router_probe_interval >= 0, "router_probe_interval must be >= 0")
        _check(self.scheduler_gone_grace >= 0, "scheduler_gone_grace must be >= 0")
        _check(self.restart_wait >= 0, "restart_wait must be >= 0")
        _check(-1 <= self.http_port < 65536, f"http_port out of range: {self.http_port}")
        _check(self.tool_call_parser in TOOL_CALL_PARSERS,
               f"tool_call_parser {self.tool_call_parser!r} is not one of {' | '.join(TOOL_CALL_PARSERS)}")
        _check(self.reasoning_parser in REASONING_PARSERS,
               f"reasoning_parser {self.reasoning_parser!r} is not one of {' | '.join(REASONING_PARSERS[1:])}")
        _check(self.api_key == self.api_key.strip(), "api_key must not start or end with whitespace")

    @property
    def scheduler_endpoints(self) -> list[str]:
        """One per data-parallel group."""
        return [e.strip() for e in self.scheduler_endpoint.split(",") if e.strip()]

    @property
    def identity(self) -> str:
        return self.replica_id or f"{os.uname().nodename}-{os.getpid()}"


@dataclass(frozen=True)
class SchedulerConfig(CommonConfig):
    tokenizer_endpoint: str = field(default="tcp://0.0.0.0:5557", metadata={"help": "bind: tokenizers connect here"})
    worker_endpoint: str = field(default="tcp://0.0.0.0:5558", metadata={"help": "bind: worker rank 0 connects here"})
    max_running_requests: int = field(default=0, metadata={
        "help": "requests running at once (0: 1024 with a GPU worker, where shared prefixes let a large batch "
                "read little KV per request, 256 on a CPU)"})
    max_prefill_tokens: int = field(default=16384, metadata={"help": "prompt tokens computed per step (all requests)"})
    chunked_prefill_size: int = field(default=8192, metadata={"help": "prompt tokens per request per step"})
    schedule_policy: str = field(default="lpm", metadata={
        "help": "fcfs | lpm (longest cached prefix first) | dfs-weight (prefix tree, heavier subtrees first) | lof "
                "(longest output first: offline batches end without a tail of late long requests)"})
    page_size: int = field(default=1, metadata={"help": "KV page size in tokens (prefix-cache granularity)"})
    disable_radix_cache: bool = field(default=False, metadata={"help": "turn prefix caching off"})
    max_queued_requests: int = field(default=0, metadata={
        "help": "requests waiting beyond this many are refused with RESOURCE_EXHAUSTED / 429 (0: no limit); with "
                "priority scheduling a full queue sheds its lowest-priority request for a higher-priority one"})
    enable_priority_scheduling: bool = field(default=False, metadata={
        "help": "order the waiting queue by request priority (higher first; the --schedule-policy within a "
                "level), with aging and preemption; without it priorities are ignored"})
    priority_preemption_threshold: int = field(default=10, metadata={
        "help": "priority scheduling: a waiting request that cannot start preempts running requests whose "
                "priority is at least this much lower (they keep their output and resume later; 0: never)"})
    priority_prefill_cap: int = field(default=2048, metadata={
        "help": "priority scheduling: prompt tokens a step gives requests below the highest priority present "
                "(running or waiting), so that an urgent request's steps stay short (0: no cap)"})
    step_time_target_ms: float = field(default=0.0, metadata={
        "help": "inter-token latency bound: while requests decode, a step carries only the prompt tokens that "
                "keep its predicted device time (a model fitted online to the worker's step times) within this "
                "many ms, at least 64 and an eighth of the prompt tokens waiting (long prompts are spread over "
                "more steps: steadier ITL, later first tokens); steps with nothing decoding are not limited. "
                "0: off (--max-prefill-tokens only)"})
    priority_prefill_cap_window: float = field(default=10.0, metadata={
        "help": "priority scheduling: the --priority-prefill-cap stays on this many seconds after the last "
                "higher-priority request left, so the next one does not find a full-size chunk in flight "
                "(0: only while one is running or waiting)"})
    disable_priority_urgent_steps: bool = field(default=False, metadata={
        "help": "priority scheduling: do not give a newly admitted top-priority request a step of its own (by "
                "default the step that admits it leaves lower-priority decodes and chunks out, at most two "
                "steps in a row, so its first token is not behind a full batch)"})
    priority_aging_seconds: float = field(default=300.0, metadata={
        "help": "priority scheduling: a request that has waited this long goes ahead of every priority level and "
                "is not preempted once running, so nothing starves (0: no aging)"})
    max_pinned_tokens: int = field(default=0, metadata={
        "help": "KV tokens that sessions and pinned prefixes may hold pinned (exempt from eviction) together; "
                "0: a quarter of the KV pool; at most half of it"})
    disable_jump_forward: bool = field(default=False, metadata={
        "help": "structured output: sample every token even where the grammar allows only one continuation"})
    disable_overlap_schedule: bool = field(default=False, metadata={
        "help": "build each step only after the previous one's results arrived (default: while it runs)"})
    disable_cascade_attention: bool = field(default=False, metadata={
        "help": "never read a prefix shared by many running requests once for the group (cascade attention)"})
    cascade_min_group: int = field(default=4, metadata={
        "help": "cascade attention: requests sharing a cached prefix before it is read once for all"})
    cascade_min_prefix: int = field(default=640, metadata={
        "help": "cascade attention: shortest shared prefix (tokens; below ~600 the merge costs more than it saves "
                "on an H200)"})
    cascade_min_saved: int = field(default=131072, metadata={
        "help": "cascade attention: KV tokens (sum of (group size - 1) x prefix) a step that could replay a CUDA "
                "graph must save to use it (a grouped step runs eagerly)"})
    cascade_min_saved_eager: int = field(default=32768, metadata={
        "help": "cascade attention: KV tokens a step that runs eagerly anyway (prefill chunks in it, or a batch "
                "above the largest CUDA graph) must save to use it"})
    metrics_port: int = field(default=0, metadata={"help": "serve Prometheus /metrics on this HTTP port (0: off)"})
    kv_events_endpoint: str = field(default="", metadata={
        "help": "also publish KV-cache block events on a ZMQ PUB socket bound here (e.g. tcp://*:5557; vLLM's / "
                "SGLang's msgpack KVEventBatch; with --dp N group g binds port + g); empty: only to subscribed "
                "tokenizers (SMG's SubscribeKvEvents)"})
    kv_events_topic: str = field(default="", metadata={"help": "the ZMQ topic of --kv-events-endpoint's messages"})
    kv_events_block_size: int = field(default=0, metadata={
        "help": "tokens per KV-event block, a multiple of --page-size (0: the smallest multiple >= 16)"})
    log_interval: float = field(default=10.0, metadata={
        "help": "seconds between summary log lines (running, queued, tokens/s in and out, cache hit rate, KV "
                "usage; none while idle; 0: off)"})
    hicache_write_policy: str = field(default="write_through", metadata={
        "help": "hierarchical cache (a worker with --hicache-size or --hicache-ratio): write_through (a node entering "
                "the KV pool is copied to host memory at once, overlapping the steps; evicting it is then free) | "
                "write_back (copied when the pool evicts it; the next step waits for that copy)"})
    worker_timeout: float = field(default=30.0, metadata={
        "help": "seconds without a heartbeat answer after which worker rank 0 counts as lost (host down, "
                "network cut; a worker process that exits is noticed at once); every request then fails "
                "with UNAVAILABLE until a worker is ready again"})

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.max_running_requests >= 0, "max_running_requests must be >= 0 (0: auto)")
        _check(self.worker_timeout >= 1.0, "worker_timeout must be >= 1 s")
        _check(self.max_prefill_tokens >= 16, "max_prefill_tokens must be >= 16")
        _check(self.chunked_prefill_size >= 16, "chunked_prefill_size must be >= 16")
        _check(self.schedule_policy in ("fcfs", "lpm", "dfs-weight", "lof"),
               f"bad schedule_policy {self.schedule_policy!r}")
        _check(self.page_size >= 1, "page_size must be >= 1")
        _check(self.max_queued_requests >= 0, "max_queued_requests must be >= 0")
        _check(self.priority_preemption_threshold >= 0, "priority_preemption_threshold must be >= 0 (0: never preempt)")
        _check(self.priority_prefill_cap >= 0, "priority_prefill_cap must be >= 0 (0: no cap)")
        _check(self.priority_aging_seconds >= 0, "priority_aging_seconds must be >= 0 (0: no aging)")
        _check(self.priority_prefill_cap_window >= 0, "priority_prefill_cap_window must be >= 0")
        _check(self.step_time_target_ms >= 0, "step_time_target_ms must be >= 0 (0: off)")
        _check(self.max_pinned_tokens >= 0, "max_pinned_tokens must be >= 0 (0: a quarter of the KV pool)")
        _check(self.cascade_min_group >= 2, "cascade_min_group must be >= 2")
        _check(self.cascade_min_prefix >= 1, "cascade_min_prefix must be >= 1")
        _check(self.cascade_min_saved >= 0 and self.cascade_min_saved_eager >= 0,
               "cascade_min_saved and cascade_min_saved_eager must be >= 0")
        _check(0 <= self.metrics_port < 65536, f"metrics_port out of range: {self.metrics_port}")
        _check(self.kv_events_block_size >= 0 and self.kv_events_block_size % self.page_size == 0,
               f"kv_events_block_size must be a multiple of page_size ({self.page_size}): {self.kv_events_block_size}")
        _check(self.log_interval >= 0, "log_interval must be >= 0 (0: no summary lines)")
        _check(self.hicache_write_policy in WRITE_POLICIES,
               f"hicache_write_policy {self.hicache_write_policy!r} is not one of {' | '.join(WRITE_POLICIES)}")


@dataclass(frozen=True)
class WorkerConfig(CommonConfig):
    scheduler_endpoint: str = field(default="tcp://127.0.0.1:5558", metadata={"help": "scheduler's worker endpoint"})
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda | cuda:N"})
    dtype: str = field(default="auto", metadata={"help": "auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16 | float16"})
    max_total_tokens: int = field(default=0, metadata={"help": "KV pool size in tokens (0: from memory)"})
    context_length: int = field(default=0, metadata={"help": "override the model's context length (0: config)"})
    seed: int = field(default=0, metadata={"help": "seed of the sampler for requests without one"})
    attention_backend: str = field(default="auto", metadata={
        "help": "auto (flashinfer on CUDA when installed, else torch) | flashinfer | torch; also picks the "
                "fused norm/rope/activation/sampling kernels"})
    mem_fraction_static: float = field(default=0.85, metadata={
        "help": "fraction of the GPU's memory for weights + KV pool (the KV pool gets what the weights leave)"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "KV cache storage: auto (the model dtype) | fp8_e4m3 (FP8 with a per-tensor scale, or the "
                "checkpoint's per-layer / per-head k_scale and v_scale: twice the tokens in the same memory)"})
    decode_attention: str = field(default="auto", metadata={
        "help": "decode attention kernel of the flashinfer backend: auto | flashinfer | triton (Banyan's split-KV "
                "kernel: reads an FP8 pool nearer bandwidth than FlashInfer's FP8-KV decode, and splits small batches' "
                "contexts over more programs); auto: triton for FP8 pools, and for bf16/fp16 pools at up to 16 rows"})
    quantization: str = field(default="", metadata={
        "help": "weight quantization: empty (none, or what the checkpoint's quantization_config says: FP8 "
                "checkpoints load as FP8) | fp8 (FP8 e4m3 weights with per-output-channel scales, quantized at "
                "load; activations scaled per token at run time; embeddings and lm_head stay in --dtype unless --fp8-vocab)"})
    fp8_vocab: bool = field(default=False, metadata={
        "help": "with FP8 weights (--quantization fp8 or an FP8 checkpoint): the embeddings and lm_head in FP8 "
                "too, per-row scales (weights ~0.50x bf16 instead of ~0.57x on an 8B model; more error)"})
    cuda_graph_max_bs: int = field(default=512, metadata={"help": "largest decode batch replayed as a CUDA graph"})
    disable_cuda_graph: bool = field(default=False, metadata={"help": "run every step eagerly"})
    piecewise_cuda_graph_max_tokens: int = field(default=-1, metadata={
        "help": "steps that are not pure decodes (prompts, prompts mixed with decodes, shared-prefix steps) of up to "
                "this many tokens replay the work between attentions from CUDA graphs, the attention eager (0: off; "
                f"-1: {PIECEWISE_AUTO_TOKENS} on one CUDA GPU with decode graphs, else off)"})
    disable_small_m_kernel: bool = field(default=False, metadata={
        "help": "never use Banyan's decode-size linear kernel (by default used for the weight shapes where it "
                "measured faster than the library at start-up)"})
    tp_size: int = field(default=1, metadata={"help": "tensor-parallel ranks (one worker process each)"})
    tp_rank: int = field(default=0, metadata={"help": "this worker's tensor-parallel rank (0 talks to the scheduler)"})
    dist_init_addr: str = field(default="", metadata={"help": "host:port of rank 0's torch.distributed store (tp > 1)"})
    metrics_port: int = field(default=0, metadata={
        "help": "serve Prometheus /metrics on this HTTP port (rank 0; 0: off)"})
    hicache_size: float = field(default=0.0, metadata={
        "help": "hierarchical KV cache: GiB of host memory (pinned on CUDA) per worker rank for KV evicted from "
                "the GPU pool (0: off unless --hicache-ratio)"})
    hicache_ratio: float = field(default=0.0, metadata={
        "help": "hierarchical KV cache: host tier size as a multiple of the KV pool's tokens (0: off unless "
                "--hicache-size; give one of the two)"})
    hicache_storage_dir: str = field(default="", metadata={
        "help": "hierarchical KV cache: a directory for a disk tier under the host tier (files survive restarts of "
                "the same model, tokenizer, dtype and layout; one subdirectory per rank; empty: no disk tier)"})
    hicache_storage_size: float = field(default=64.0, metadata={
        "help": "hierarchical KV cache: GiB the disk tier may use per rank (least recently used files go first)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.dtype in ("auto", "float32", "bfloat16", "float16"), f"bad dtype {self.dtype!r}")
        _check(self.max_total_tokens >= 0, "max_total_tokens must be >= 0")
        _check(self.context_length >= 0, "context_length must be >= 0")
        _check(self.attention_backend in ("auto", "flashinfer", "torch"),
               f"bad attention backend {self.attention_backend!r} (auto | flashinfer | torch)")
        _check(self.decode_attention in ("auto", "flashinfer", "triton"),
               f"bad decode_attention {self.decode_attention!r} (auto | flashinfer | triton)")
        _check(0.0 < self.mem_fraction_static <= 1.0, "mem_fraction_static must be in (0, 1]")
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES,
               f"bad kv_cache_dtype {self.kv_cache_dtype!r} ({' | '.join(KV_CACHE_DTYPES)})")
        _check(self.quantization in QUANTIZATIONS, f"quantization {self.quantization!r} is not supported (empty: "
               f"none or the checkpoint's own | fp8; AWQ, GPTQ, bitsandbytes and other methods are not)")
        _check(self.cuda_graph_max_bs >= 1, "cuda_graph_max_bs must be >= 1")
        _check(-1 <= self.piecewise_cuda_graph_max_tokens <= 16384,
               "piecewise_cuda_graph_max_tokens must be in [-1, 16384] (-1: auto, 0: off)")
        _check(self.tp_size >= 1, "tp_size must be >= 1")
        _check(0 <= self.tp_rank < self.tp_size, f"tp_rank {self.tp_rank} is not in [0, {self.tp_size})")
        _check(self.tp_size == 1 or ":" in self.dist_init_addr, "tp_size > 1 needs dist_init_addr (host:port)")
        _check(0 <= self.metrics_port < 65536, f"metrics_port out of range: {self.metrics_port}")
        _check(self.hicache_size >= 0 and self.hicache_ratio >= 0, "hicache_size and hicache_ratio must be >= 0")
        _check(not (self.hicache_size and self.hicache_ratio), "give hicache_size or hicache_ratio, not both")
        _check(not self.hicache_storage_dir or self.hicache, "hicache_storage_dir needs the host tier (the disk tier "
               "is read back through it): set hicache_size or hicache_ratio")
        _check(self.hicache_storage_size > 0, "hicache_storage_size must be > 0")

    @property
    def hicache(self) -> bool:
        """The hierarchical KV cache (a host tier, maybe a disk tier under it) is on."""
        return self.hicache_size > 0 or self.hicache_ratio > 0


def _parse(tp: typing.Any, raw: str) -> typing.Any:
    if tp is bool:
        return raw.strip().lower() in ("1", "true", "yes", "on")
    return tp(raw)


class _Repeat(argparse.Action):
    """A repeatable flag of a comma-separated field: the first use on the command line replaces the
    default (or the env var), later ones are appended."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        mark = f"_{self.dest}_given"
        now = getattr(namespace, self.dest) if getattr(namespace, mark, False) else ""
        setattr(namespace, self.dest, f"{now},{values}" if now else values)
        setattr(namespace, mark, True)


def add_arguments(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Add one ``--flag`` per field of ``cls``; defaults come from ``BANYAN_*`` env vars. A field whose
    flag the parser has already (a ``CommonConfig`` field when several services' flags are combined,
    as ``banyan serve`` does) is not added again."""
    hints = typing.get_type_hints(cls)
    have = {s for a in parser._actions for s in a.option_strings}
    for f in dataclasses.fields(cls):
        if f.name in skip or "--" + f.name.replace("_", "-") in have:
            continue
        tp = hints[f.name]
        env = ENV_PREFIX + f.name.upper()
        default = _parse(tp, os.environ[env]) if env in os.environ else f.default
        flag = "--" + f.name.replace("_", "-")
        shown = "<hidden>" if (f.metadata.get("secret") or not f.repr) and default else repr(default)
        help_ = f"{f.metadata.get('help', '')} [env {env}, default {shown}]"
        if tp is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_)
        elif f.metadata.get("append"):
            parser.add_argument(flag, action=_Repeat, default=default, help=help_)
        else:
            parser.add_argument(flag, type=tp, default=default, help=help_)


def from_namespace(cls: type, ns: argparse.Namespace, **overrides: typing.Any):
    """Build a frozen config from parsed args (fields missing from ``ns`` keep their default)."""
    kw = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
    kw.update(overrides)
    return cls(**kw)


def to_argv(cfg: typing.Any) -> list[str]:
    """The inverse of ``add_arguments``: flags that rebuild ``cfg`` in a child process."""
    argv: list[str] = []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(v, bool):
            argv.append(flag if v else "--no-" + f.name.replace("_", "-"))
        else:
            argv += [flag, str(v)]
    return argv
