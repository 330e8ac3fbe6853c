"""SMG's ``sglang.grpc.scheduler`` messages ↔ Banyan's request path, at the edge.

A ``GenerateRequest`` becomes a token-id ``Prompt``, a ``SamplingRequest`` and an optional
``Constraint``, checked by ``validation.prepare`` like the other fronts' requests; Banyan's
``Chunk``s become ``GenerateStreamChunk`` / ``GenerateComplete`` messages.

Proto3 cannot tell an unset scalar from its zero, so SMG sends every sampling field explicitly
(the gateway fills OpenAI's defaults: temperature 1, top_p 1, top_k -1 …); a zero means zero here
(temperature 0 is greedy, top_p 0 is refused), except ``n`` (0 = 1) and ``repetition_penalty``
(0 = 1, off), as SGLang reads them.

Fields asking for what Banyan does not do are refused with INVALID_ARGUMENT naming the field,
never ignored: multimodal inputs, input embeddings, LoRA, disaggregation, hidden states, logprobs
of chosen token ids, custom logit processors, ``custom_params``. ``structural_tag`` (the gateway's
tool-call grammar) is compiled like Banyan's own (xgrammar's format, or SGLang's older one).
``return_logprob`` with ``logprob_start_len`` ≥ 0 returns the prompt's log-probs from there
(``input_logprobs``, the first position's value unset; on branch 0's first chunk and its complete
message; a start at or past the prompt's end: none), with ``top_logprobs_num`` alternatives;
``max_new_tokens`` 0 is a prefill-only request; ``repetition_penalty``, ``min_new_tokens`` and
``logit_bias`` (token ids as strings) go to Banyan's logit processors (docs/sampling.md).
``stream_interval`` is honoured (0 = 1: tokens as they come). Detokenization options (``skip_special_tokens``,
``spaces_between_special_tokens``, ``no_stop_trim``) shape text the gateway makes from the token
ids; Banyan uses ``skip_special_tokens`` for the text it matches stop strings against.
``require_reasoning`` is accepted: Banyan does not count reasoning tokens (reasoning_tokens 0).
"""

from __future__ import annotations

import re

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from shared.errors import InvalidArgument
from shared.messages.common import Constraint
from services.tokenizer.tools.grammar import external_structural_tag
from services.tokenizer.generation import Chunk, TokenLogprob
from services.tokenizer.validation import Prompt, SamplingRequest

CONSTRAINTS = {"regex": "regex", "json_schema": "json_schema", "ebnf_grammar": "ebnf"}
# Banyan's names in validation messages → SMG's names of the same fields
_NAMES = [(re.compile(r"\bsampling_params\.max_tokens\b"), "sampling_params.max_new_tokens"),
          (re.compile(r"\bsampling_params\.top_logprobs\b"), "top_logprobs_num"),
          (re.compile(r"\bsampling_params\.min_tokens\b"), "sampling_params.min_new_tokens"),
          (re.compile(r"\bsampling_params\.prompt_logprobs_start\b"), "logprob_start_len"),
          (re.compile(r"\bsampling_params\.prompt_top_logprobs\b"), "top_logprobs_num")]


def _refuse(field: str, what: str) -> None:
    raise InvalidArgument(f"{field}: {what} is not supported by Banyan")


def check_supported(req: pb.GenerateRequest) -> None:
    """Refuse what Banyan cannot do (the message names the field)."""
    if req.HasField("mm_inputs") and req.mm_inputs.ByteSize():
        _refuse("mm_inputs", "multimodal input")
    if req.input_embeds:
        _refuse("input_embeds", "input embeddings")
    if req.lora_id:
        _refuse("lora_id", "LoRA")
    if req.HasField("disaggregated_params") and req.disaggregated_params.ByteSize():
        _refuse("disaggregated_params", "prefill/decode disaggregation")
    if req.return_hidden_states:
        _refuse("return_hidden_states", "returning hidden states")
    if req.custom_logit_processor:
        _refuse("custom_logit_processor", "a custom logit processor")
    if req.token_ids_logprob:
        _refuse("token_ids_logprob", "logprobs of chosen token ids")
    sp = req.sampling_params
    if sp.HasField("custom_params") and sp.custom_params.fields:
        _refuse("sampling_params.custom_params", "custom sampling parameters")


def prompt(req: pb.GenerateRequest) -> Prompt:
    if not req.HasField("tokenized") or not req.tokenized.input_ids:
        raise InvalidArgument("tokenized.input_ids is required (this service takes token ids, not text)")
    return Prompt(token_ids=list(req.tokenized.input_ids))


def sampling(req: pb.GenerateRequest) -> SamplingRequest:
    sp = req.sampling_params
    if req.top_logprobs_num < 0:
        raise InvalidArgument(f"top_logprobs_num must be >= 0, got {req.top_logprobs_num}")
    start = None
    if req.return_logprob and 0 <= req.logprob_start_len < len(req.tokenized.input_ids):
        start = req.logprob_start_len
    return SamplingRequest(
        max_tokens=sp.max_new_tokens if sp.HasField("max_new_tokens") else None,
        temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p, n=sp.n or 1,
        stop=list(sp.stop), stop_token_ids=list(sp.stop_token_ids), ignore_eos=sp.ignore_eos,
        skip_special_tokens=sp.skip_special_tokens, presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty, logprobs=req.return_logprob,
        top_logprobs=req.top_logprobs_num if req.return_logprob else None,
        stream_interval=(sp.stream_interval or None) if sp.HasField("stream_interval") else None,
        prompt_logprobs_start=start, prompt_top_logprobs=req.top_logprobs_num if start is not None else None,
        logit_bias=_logit_bias(sp), min_tokens=sp.min_new_tokens or None,
        repetition_penalty=sp.repetition_penalty or None)


def _logit_bias(sp: pb.SamplingParams) -> dict[int, float] | None:
    """SMG's logit_bias (token ids as decimal strings) → token id → bias."""
    out = {}
    for key, value in sp.logit_bias.items():
        if not key.strip().isdigit():
            raise InvalidArgument(f"sampling_params.logit_bias: {key[:40]!r} is not a token id")
        out[int(key)] = value
    return out or None


def constraint(req: pb.GenerateRequest) -> Constraint | None:
    kind = req.sampling_params.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "structural_tag":  # (the gateway's tool-call grammar)
        return external_structural_tag(req.sampling_params.structural_tag, "sampling_params.structural_tag")
    return Constraint(CONSTRAINTS[kind], value=getattr(req.sampling_params, kind))


def smg_names(e: InvalidArgument) -> InvalidArgument:
    """A validation error with the fields named as SMG's proto names them."""
    msg = str(e)
    for pattern, name in _NAMES:
        msg = pattern.sub(name, msg)
    return InvalidArgument(msg)


def output_logprobs(lps: list[TokenLogprob] | None, top: bool) -> pb.OutputLogProbs | None:
    if not lps:
        return None
    out = pb.OutputLogProbs(token_logprobs=[t.logprob for t in lps], token_ids=[t.token_id for t in lps])
    if top:
        out.top_logprobs.extend(pb.TopLogProbs(values=[lp for _, lp in t.top], token_ids=[i for i, _ in t.top])
                                for t in lps)
    return out


def input_logprobs(lps: list[TokenLogprob] | None, top: bool) -> pb.InputLogProbs | None:
    """Prompt log-probs as SGLang sends them (the prompt's first token: no value)."""
    if not lps:
        return None
    out = pb.InputLogProbs(token_ids=[t.token_id for t in lps], token_logprobs=[
        pb.InputTokenLogProb(value=t.logprob) if t.logprob is not None else pb.InputTokenLogProb() for t in lps])
    if top:
        out.top_logprobs.extend(pb.TopLogProbs(values=[lp for _, lp in t.top], token_ids=[i for i, _ in t.top])
                                for t in lps)
    return out


class Branch:
    """What one branch (``index``) has produced so far: the complete message repeats it."""

    __slots__ = ("ids", "lps", "prompt_lps")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.lps: list[TokenLogprob] = []
        self.prompt_lps: list[TokenLogprob] | None = None  # branch 0's prompt log-probs, when asked for


def stream_chunk(rid: str, c: Chunk, b: Branch, prompt_tokens: int, top: bool) -> pb.GenerateResponse:
    """An incremental chunk; counts are cumulative (cached tokens are known at the end)."""
    return pb.GenerateResponse(request_id=rid, chunk=pb.GenerateStreamChunk(
        token_ids=c.token_ids, prompt_tokens=prompt_tokens, completion_tokens=len(b.ids),
        cached_tokens=c.usage.cached_tokens if c.usage else 0,
        output_logprobs=output_logprobs(c.logprobs, top), input_logprobs=input_logprobs(c.prompt_logprobs, top),
        index=c.index))


def complete(rid: str, c: Chunk, b: Branch, streamed: bool, top: bool) -> pb.GenerateResponse:
    """The branch's completion: finish reason, counts, matched stop; the output ids (all of them,
    or when streaming — as SGLang does — the last chunk's) and logprobs likewise."""
    assert c.usage is not None
    ids, lps = (c.token_ids, c.logprobs) if streamed else (b.ids, b.lps)
    done = pb.GenerateComplete(output_ids=ids, finish_reason=str(c.finish), prompt_tokens=c.usage.prompt_tokens,
                               completion_tokens=c.usage.completion_tokens, cached_tokens=c.usage.cached_tokens,
                               output_logprobs=output_logprobs(lps, top), index=c.index,
                               input_logprobs=input_logprobs(b.prompt_lps, top))
    if c.matched_stop:
        done.matched_stop_str = c.matched_stop
    elif c.matched_stop_token_id is not None:
        done.matched_token_id = c.matched_stop_token_id
    return pb.GenerateResponse(request_id=rid, complete=done)
