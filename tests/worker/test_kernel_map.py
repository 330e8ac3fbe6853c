"""The attention kernel map (``attention/kernel_map.py``): the per-plan rules of the flashinfer backend as one table,
logged at start-up, built from the same rule functions the backend applies per plan."""

from __future__ import annotations

from services.worker.attention import decode_rules as dr
from services.worker.attention.kernel_map import attention_map, table


def test_the_default_bf16_map_splits_decodes_at_the_triton_rows() -> None:
    up_to = dr.triton_rows_up_to("auto", "cuda", quantized=False)
    got = attention_map("flashinfer", "bfloat16", up_to, dr.mixed_decode_triton("auto", False), True, 65536 // 8)
    decode = [e for e in got if e.step.startswith("decode")]
    assert [(e.rows, e.kernel.split()[0]) for e in decode] == [("1-255", "triton_decode"), ("256+", "flashinfer")]
    assert [e.kernel for e in got if e.step == "mixed: decode rows"] == ["flashinfer decode, tensor cores (FA2)"]
    assert "| prefill, no cached prefix | all | flashinfer ragged" in table(got)


def test_an_fp8_pool_takes_the_triton_decode_everywhere_and_torch_is_the_reference() -> None:
    up_to = dr.triton_rows_up_to("auto", "cuda", quantized=True)
    got = attention_map("flashinfer", "float8_e4m3fn", up_to, dr.mixed_decode_triton("auto", True), True, 8192)
    assert [(e.step, e.rows) for e in got if "decode" in e.step] == [("decode (graph or eager)", "1-8192"),
                                                                      ("mixed: decode rows", "1-8192")]
    off = attention_map("flashinfer", "bfloat16", dr.triton_rows_up_to("flashinfer", "cuda", False), False, False, 8192)
    assert [(e.rows, e.kernel) for e in off if e.step.startswith("decode")] == [("1+", "flashinfer decode, CUDA cores")]
    assert [e.kernel for e in attention_map("torch", "float32", 0, False, False, 0)][0].startswith("torch reference")
