"""SGLang's ``/generate`` body → one ``Item`` per prompt (``Prompt``, ``SamplingRequest``,
``Constraint`` and what the response needs), for ``validation.prepare`` as on every other front.

Fields SGLang has and Banyan does not are refused by name (400), unknown ones too; fields that only
steer SGLang's own logging are accepted and ignored. ``max_new_tokens`` defaults to 128 (SGLang's
default). Prompt log-probs follow SGLang: ``logprob_start_len`` = k returns an entry for every prompt
position from k on, the first one's log-prob ``None``; -1 (the default) none.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shared.errors import InvalidArgument
from shared.messages.common import Constraint
from services.tokenizer.http.native import protocol as api
from services.tokenizer.validation import MAX_TOP_LOGPROBS, Prompt, SamplingRequest

MAX_BATCH = 512  # prompts in one /generate request
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's

# SGLang fields Banyan does not serve: set to anything but their default, a 400 naming them
UNSUPPORTED = {
    "input_embeds": "input embeddings", "image_data": "multimodal inputs", "video_data": "multimodal inputs",
    "audio_data": "multimodal inputs", "mm_hashes": "multimodal inputs", "mm_content_hashes": "multimodal inputs",
    "use_audio_in_video": "multimodal inputs", "video_config": "multimodal inputs", "modalities": "multimodal inputs",
    "lora_path": "LoRA adapters", "lora_id": "LoRA adapters", "custom_logit_processor": "custom logit processors",
    "token_ids_logprob": "log-probs of chosen token ids", "return_hidden_states": "hidden states",
    "return_routed_experts": "routed experts", "return_indexer_topk": "indexer top-k",
    "return_sampling_mask": "sampling masks", "sampling_logprobs_mode": "sampling masks",
    "return_flat_raw_top_logprobs": "flat top log-probs", "return_flat_raw_output_top_logprobs": "flat top log-probs",
    "bootstrap_host": "prefill/decode disaggregation", "bootstrap_port": "prefill/decode disaggregation",
    "bootstrap_room": "prefill/decode disaggregation", "bootstrap_pair_key": "prefill/decode disaggregation",
    "decode_tp_size": "prefill/decode disaggregation", "disagg_prefill_dp_rank": "prefill/decode disaggregation",
    "positional_embed_overrides": "positional embedding overrides", "watermark": "watermarks",
    "background": "background requests", "require_reasoning": "reasoning controls",
    "max_thinking_tokens": "reasoning controls", "extra_key": "extra cache keys",
}
IGNORED = frozenset({"routing_key", "conversation_id", "custom_labels", "session_id", "routed_dp_rank",
                     "http_worker_ipc", "routed_experts_start_len"})
SAMPLING_UNSUPPORTED = {
    "stop_regex": "stop regular expressions", "structural_tag": "structural tags", "beam_width": "beam search",
    "custom_params": "custom logit processor parameters", "watermark": "watermarks",
    "ebnf_full_assistant": "EBNF over the whole assistant turn",
}


# validation.py's field names → SGLang's
_NAMES = [(re.compile(r"\bsampling_params\.(prompt_)?top_logprobs\b"), "top_logprobs_num"),
          (re.compile(r"\bsampling_params\.prompt_logprobs_start\b"), "logprob_start_len"),
          (re.compile(r"\bmax_tokens\b"), "max_new_tokens"), (re.compile(r"\bmin_tokens\b"), "min_new_tokens"),
          (re.compile(r"\brequest_id\b"), "rid")]


def sglang_names(e: InvalidArgument) -> InvalidArgument:
    """A validation error with the fields named as SGLang names them."""
    msg = str(e)
    for pattern, name in _NAMES:
        msg = pattern.sub(name, msg)
    return InvalidArgument(msg)


@dataclass(frozen=True)
class Item:
    """One prompt of a ``/generate`` request."""

    prompt: Prompt
    sampling: SamplingRequest
    constraint: Constraint | None
    rid: str | None  # the body's ``rid`` for it, if given
    return_logprob: bool
    logprob_start: int  # -1: output log-probs only
    top_logprobs: int
    max_new_tokens: int  # 0: prefill only

    @property
    def prefill_only(self) -> bool:
        return self.max_new_tokens == 0


def _set(v: object) -> bool:
    """Given a value other than the field's default (None, false, empty)."""
    return v is not None and v is not False and not (isinstance(v, (str, list, dict)) and not v)


def refuse_unsupported(extra: dict | None, table: dict[str, str], ignored: frozenset[str], prefix: str) -> None:
    for name, value in (extra or {}).items():
        if name in table:
            if _set(value):
                raise InvalidArgument(f"{prefix}{name} is not supported: Banyan does not serve {table[name]}")
        elif name not in ignored:
            raise InvalidArgument(f"{prefix}{name}: unrecognized request argument (not supported)")


def _per_item(value, n: int, name: str) -> list:
    """A field given once for the whole batch or once per prompt."""
    if isinstance(value, list):
        if len(value) != n:
            raise InvalidArgument(f"{name} has {len(value)} entries for {n} prompts (give one, or one per prompt)")
        return value
    return [value] * n


def prompts(body: api.GenerateRequest) -> tuple[list[Prompt], bool]:
    """The prompts and whether the body was a batch (a list: the response is a list)."""
    if (body.text is None) == (body.input_ids is None):
        raise InvalidArgument("give exactly one of text or input_ids")
    if body.text is not None:
        texts, batch = (body.text, True) if isinstance(body.text, list) else ([body.text], False)
        out = [Prompt(text=t) for t in texts]
    else:
        ids = body.input_ids
        batch = bool(ids) and isinstance(ids[0], list)
        rows = ids if batch else [ids]
        out = [Prompt(token_ids=list(x)) for x in rows]  # type: ignore[arg-type]
    if not out:
        raise InvalidArgument(f"{'text' if body.text is not None else 'input_ids'} must not be an empty batch")
    if len(out) > MAX_BATCH:
        raise InvalidArgument(f"the batch has {len(out)} prompts (at most {MAX_BATCH})")
    return out, batch


def constraint(sp: api.SamplingParams, prefix: str) -> Constraint | None:
    found = [Constraint(kind, value=v) for kind, v in (("regex", sp.regex), ("json_schema", sp.json_schema),
                                                        ("ebnf", sp.ebnf)) if v is not None]
    if len(found) > 1:
        raise InvalidArgument(f"give at most one of {prefix}regex, {prefix}json_schema and {prefix}ebnf")
    return found[0] if found else None


def sampling(sp: api.SamplingParams, return_logprob: bool, top: int, prefix: str) -> tuple[SamplingRequest, int]:
    """SGLang's sampling params → a ``SamplingRequest`` and max_new_tokens (0: prefill only)."""
    refuse_unsupported(sp.model_extra, SAMPLING_UNSUPPORTED, frozenset(), prefix)
    if sp.no_stop_trim:
        raise InvalidArgument(f"{prefix}no_stop_trim is not supported: the matched stop string is never in the text")
    if sp.seed is not None and sp.sampling_seed is not None and sp.seed != sp.sampling_seed:
        raise InvalidArgument(f"{prefix}seed and {prefix}sampling_seed disagree: give one")
    max_new = DEFAULT_MAX_NEW_TOKENS if sp.max_new_tokens is None else sp.max_new_tokens
    if max_new < 0:
        raise InvalidArgument(f"{prefix}max_new_tokens must be >= 0 (0: prefill only), got {max_new}")
    stop = [] if sp.stop is None else [sp.stop] if isinstance(sp.stop, str) else list(sp.stop)
    req = SamplingRequest(
        logit_bias=_logit_bias(sp.logit_bias, prefix), min_tokens=sp.min_new_tokens,
        repetition_penalty=sp.repetition_penalty,
        max_tokens=max_new, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p,
        seed=sp.seed if sp.seed is not None else sp.sampling_seed, n=sp.n, stop=stop,
        stop_token_ids=list(sp.stop_token_ids or ()), ignore_eos=bool(sp.ignore_eos),
        skip_special_tokens=sp.skip_special_tokens is not False, presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty, logprobs=return_logprob and max_new > 0,
        top_logprobs=top if return_logprob and max_new > 0 else None, stream_interval=sp.stream_interval)
    return req, max_new


def _logit_bias(bias: dict[str, float] | None, prefix: str) -> dict[int, float] | None:
    """SGLang's ``logit_bias`` keys are token ids written as strings."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise InvalidArgument(f"{prefix}logit_bias: key {key[:40]!r} is not a token id") from None
    return out


def items(body: api.GenerateRequest) -> tuple[list[Item], bool]:
    """One ``Item`` per prompt, and whether the body was a batch."""
    refuse_unsupported(body.model_extra, UNSUPPORTED, IGNORED, "")
    ps, batch = prompts(body)
    n = len(ps)
    if batch and isinstance(body.rid, str):
        raise InvalidArgument("rid must be a list with one id per prompt for a batch")
    rids = _per_item(body.rid, n, "rid")
    if len(set(r for r in rids if r is not None)) < len([r for r in rids if r is not None]):
        raise InvalidArgument("rid: the ids of a batch must differ")
    sps = _per_item(body.sampling_params or api.SamplingParams(), n, "sampling_params")
    want = _per_item(body.return_logprob, n, "return_logprob")
    starts = _per_item(body.logprob_start_len, n, "logprob_start_len")
    tops = _per_item(body.top_logprobs_num, n, "top_logprobs_num")
    out = []
    for i, (prompt, rid, sp, lp, start, top) in enumerate(zip(ps, rids, sps, want, starts, tops)):
        where = f"[{i}]" if isinstance(body.sampling_params, list) else ""
        start = -1 if start is None else start
        top = 0 if top is None else top
        if start < -1:
            raise InvalidArgument(f"logprob_start_len must be >= -1 (-1: output log-probs only), got {start}")
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
        req, max_new = sampling(sp, bool(lp), top, f"sampling_params{where}.")
        out.append(Item(prompt, req, constraint(sp, f"sampling_params{where}."), rid, bool(lp),
                        start if lp else -1, top if lp else 0, max_new))
    return out, batch
