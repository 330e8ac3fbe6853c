"""The kernel map: which attention kernel runs each kind of step, by its rows and the pool's KV dtype — the rules
``FlashInferAttention`` applies per plan (``decode_rules.triton_rows_up_to``, ``decode_rules.mixed_decode_triton``),
written out as one table. The runner logs it at start-up (``kernel_map`` in ``model_loaded``); docs/architecture.md
("Kernel map") shows it for the defaults."""

from __future__ import annotations

from typing import NamedTuple


class Entry(NamedTuple):
    step: str  # decode (graph or eager) | mixed: decode rows | mixed: prompt chunks | prefill | cascade
    rows: str  # the rows it applies to
    kernel: str


def attention_map(backend: str, kv_dtype: str, triton_up_to: int, mixed_triton: bool, tensor_cores: bool,
                  max_pairs_rows: int) -> list[Entry]:
    """The attention kernel of each step kind of ``backend`` ("flashinfer" | "torch") over a ``kv_dtype`` pool:
    decode plans of up to ``triton_up_to`` rows (and ``max_pairs_rows``, the Triton decode's launch bound) through
    the Triton decode, the rest FlashInfer's decode (``tensor_cores``: its tensor-core FA2 kernel, GQA groups >= 4);
    a mixed step's decode rows as a decode-only step's when ``mixed_triton``, else FlashInfer's."""
    if backend != "flashinfer":
        return [Entry("every step", "all", f"torch reference (sdpa over the gathered KV, {kv_dtype} pool)")]
    fi_decode = "flashinfer decode, " + ("tensor cores (FA2)" if tensor_cores else "CUDA cores")
    up_to = min(triton_up_to, max_pairs_rows)
    decode = ([Entry("decode (graph or eager)", f"1-{up_to}", "triton_decode (split-KV, launch by batch size)")]
              if up_to else [])
    if up_to < max_pairs_rows or not up_to:
        decode.append(Entry("decode (graph or eager)", f"{up_to + 1}+", fi_decode))
    mixed = [Entry("mixed: decode rows", e.rows, e.kernel) for e in decode] if mixed_triton else [
        Entry("mixed: decode rows", "all", fi_decode)]
    return [*decode, *mixed,
            Entry("mixed: prompt chunks", "all", "flashinfer paged prefill (FA3 on Hopper)"),
            Entry("prefill, no cached prefix", "all", "flashinfer ragged prefill over the new K/V (FA3 on Hopper)"),
            Entry("prefill, cached prefix", "all", "flashinfer paged prefill (FA3 on Hopper)"),
            Entry("cascade: shared prefix", "all", "flashinfer paged prefill (FA2), merged by LSE"),
            Entry("cascade: own KV", "all", "as decode / paged prefill above, with LSE")]


def table(entries: list[Entry]) -> str:
    """The map as a Markdown table."""
    return "\n".join(["| step | rows | kernel |", "| --- | --- | --- |",
                      *(f"| {e.step} | {e.rows} | {e.kernel} |" for e in entries)])
