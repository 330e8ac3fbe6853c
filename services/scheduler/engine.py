"""What exists only while a worker is attached: the model it serves, the KV bookkeeping sized from
its pool, the batcher, the grammar backend for its vocabulary and the steps in flight.

An ``EngineSession`` is built when worker rank 0 reports ``WorkerReady`` and dropped when the worker
is lost (its KV died with it): the scheduler has a session exactly when it serves. Conversation
sessions and pinned prefixes (their KV locked in its cache) live and die with it too. Totals
(``Counters``) and the grammar backend outlive sessions; the backend is rebuilt only when a new
worker brings another vocabulary. A worker with a host KV tier gets the hierarchical cache
(``hicache``: None without one, and then nothing of it runs).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from shared.config import SchedulerConfig
from shared.gc_pause import freeze_heap
from shared.logging import get_logger
from shared.messages.to_scheduler import StepOutput, WorkerError, WorkerReady
from shared.messages.to_tokenizer import ModelInfo
from shared.model_path import resolve_model
from services.scheduler.batcher import Batcher, Limits, Scheduled
from services.scheduler.plan import SPLIT_ROWS_NO_GRAPHS
from services.scheduler.cascade import CascadePolicy
from services.scheduler.counters import Counters
from services.scheduler.grammar import GrammarBackend
from services.scheduler.hicache import HiCache
from services.scheduler.kv import KVManager
from services.scheduler.pins import PinBudget, Pins, budget_limit
from services.scheduler.policy import POLICIES
from services.scheduler.priority import Preemptor, PriorityPolicy
from services.scheduler.sessions import Sessions

log = get_logger("scheduler")


@dataclass
class EngineSession:
    info: ModelInfo
    kv: KVManager
    batcher: Batcher
    grammar: GrammarBackend
    sessions: Sessions
    pins: Pins
    inflight: Scheduled | None = None  # overlap: the step the worker runs while the next is built
    last_built: bool = False  # the last loop iteration sent a step (the next one ``follows`` it)
    answers: dict[int, StepOutput | WorkerError] = field(default_factory=dict)  # by step id
    hicache: HiCache | None = None

    @classmethod
    def start(cls, cfg: SchedulerConfig, w: WorkerReady, counters: Counters,
              grammar: GrammarBackend | None, tokenizer: Future | None = None) -> EngineSession:
        running = cfg.max_running_requests or auto_max_running(w)
        kv = KVManager(w.pool_size, running, cfg.page_size, not cfg.disable_radix_cache, counters)
        hicache = None
        if w.host_pool_size and kv.caching:  # (loads in flight for requests not admitted yet: at most a step's
            hicache = HiCache.attach(kv, w, counters, cfg.hicache_write_policy == "write_back",  # prefill or a
                                     min(cfg.max_prefill_tokens, kv.pool_size // 4))  # quarter of the pool)
        cascade = None if cfg.disable_cascade_attention else \
            CascadePolicy(cfg.cascade_min_group, cfg.cascade_min_prefix, cfg.cascade_min_saved,
                          cfg.cascade_min_saved_eager, w.cuda_graph_max_bs)
        policy, preemptor = POLICIES[cfg.schedule_policy](), None
        if cfg.enable_priority_scheduling:
            policy = PriorityPolicy(policy, cfg.priority_aging_seconds)
            if cfg.priority_preemption_threshold:
                preemptor = Preemptor(policy, cfg.priority_preemption_threshold)
        limits = Limits(running, cfg.max_prefill_tokens, cfg.chunked_prefill_size,
                        cfg.priority_prefill_cap if cfg.enable_priority_scheduling else None,
                        cfg.priority_prefill_cap_window,
                        cfg.enable_priority_scheduling and not cfg.disable_priority_urgent_steps,
                        w.cuda_graph_max_bs or SPLIT_ROWS_NO_GRAPHS, cfg.step_time_target_ms)
        batcher = Batcher(kv, policy, limits, cascade, counters, preemptor)
        budget = PinBudget(budget_limit(cfg.max_pinned_tokens, kv.pool_size))
        info = ModelInfo(model=w.model, architecture=w.architecture, vocab_size=w.vocab_size,
                         context_length=w.context_length, pool_size=kv.pool_size,
                         max_running_requests=running, eos_token_ids=w.eos_token_ids,
                         device=w.device, dtype=w.dtype)
        return cls(info, kv, batcher, grammar_for(cfg, w, grammar, tokenizer), Sessions(kv, budget, w.context_length),
                   Pins(kv, budget), hicache=hicache)

    @property
    def busy(self) -> bool:
        return self.inflight is not None

    def expire(self, now: float) -> None:
        """Sessions idle past their TTL and pins past theirs end (looked at a few times a second)."""
        self.sessions.expire(now)
        self.pins.expire(now)

    @property
    def blocked(self) -> int:
        """Waiting requests kept aside until a tier copy ends (the loop need not spin for them)."""
        return self.hicache.blocked() if self.hicache is not None else 0

    @property
    def compiling(self) -> int:
        """Request branches waiting for their grammar to compile."""
        return sum(len(p.reqs) for p in self.grammar.pending)


def auto_max_running(w: WorkerReady) -> int:
    """``--max-running-requests 0``: 1024 on a GPU — with shared prefixes (one system prompt, n > 1
    samples) a large batch reads little KV per request, and the admission control keeps the pool
    from over-filling — and 256 on a CPU."""
    return 1024 if w.device.startswith("cuda") else 256


def grammar_for(cfg: SchedulerConfig, w: WorkerReady, old: GrammarBackend | None,
                tokenizer: Future | None = None) -> GrammarBackend:
    """The grammar backend for ``w``'s vocabulary: ``old`` when it matches (a restarted worker of the
    same model), else a new one, built before serving (building it later would contend with the
    loop), from ``tokenizer`` (``early_tokenizer``'s) where given."""
    if old is not None and (old.vocab_size, old.stop_ids) == (w.vocab_size, list(w.eos_token_ids)):
        return old
    if old is not None:
        old.close()
    grammar = GrammarBackend(resolve_model(cfg.model)[0], w.vocab_size, w.eos_token_ids, tokenizer=tokenizer)
    grammar.wait_ready()
    # the start-up heap (torch, transformers, xgrammar, the vocabulary) lives as long as the process:
    # out of the collector's sight, a full collection no longer walks it (ms per step, under load)
    freeze_heap()
    return grammar
