"""``benchmarks/gpu/knob_table.py``: the decode knob sweeps' JSON (as ``fp8_decode_bench`` writes it) summed up per
shape and pool — the fastest configuration and its gain over the served launch's best split count."""

from __future__ import annotations

import json

from benchmarks.gpu import knob_table


def bench_rows(path, rows) -> None:
    path.write_text(json.dumps({"rows": rows, "configs": []}))


def test_the_fastest_configuration_and_its_gain_per_shape(tmp_path, capsys) -> None:
    bench_rows(tmp_path / "bknob_64_4_2_0.json", [
        {"batch": 64, "context": 1024, "flashinfer_bf16_us": 78.9, "triton_bf16_served_us": 73.4,
         "triton_bf16_served_1splits_min0_us": 73.2, "triton_bf16_served_2splits_min0_us": 73.3},
        {"batch": 128, "context": 1024, "flashinfer_bf16_us": 148.7, "triton_bf16_served_1splits_min0_us": 130.0,
         "triton_bf16_served_2splits_min0_us": 145.0}])
    bench_rows(tmp_path / "bknob_32_4_3_1.json", [
        {"batch": 64, "context": 1024, "flashinfer_bf16_us": 80.0, "triton_bf16_served_1splits_min0_us": 66.0,
         "triton_bf16_served_2splits_min0_us": "RuntimeError: out of resources"},
        {"batch": 128, "context": 1024, "flashinfer_bf16_us": 149.0, "triton_bf16_served_1splits_min0_us": 131.0,
         "triton_bf16_served_2splits_min0_us": 140.0}])
    bench_rows(tmp_path / "bknob_32_4_2_0.json", [
        {"batch": 64, "context": 1024, "flashinfer_bf16_us": 79.5, "triton_bf16_served_1splits_min0_us": 75.0}])
    bench_rows(tmp_path / "bknob_w_64_4_3_1.json", [
        {"batch": 600, "context": 1536, "flashinfer_bf16_us": 700.0, "triton_bf16_served_1splits_min0_us": 690.0}])
    bench_rows(tmp_path / "fknob_0.json", [
        {"batch": 600, "context": 1536, "flashinfer_fp8_us": 620.0, "triton_fp8_served_us": 605.0,
         "triton_fp8_64_4w3s_f16_asm_us": 640.0}])
    bench_rows(tmp_path / "fknob_1.json", [
        {"batch": 600, "context": 1536, "flashinfer_fp8_us": 621.0, "triton_fp8_served_us": 550.0,
         "triton_fp8_64_4w3s_f16_asm_us": 560.0}])
    rows = knob_table.summary(knob_table.collect(tmp_path))
    got = {(r["batch"], r["pool"]): r for r in rows}
    assert set(got) == {(64, "bf16"), (128, "bf16"), (600, "fp8")}  # (600 × bf16: no served run to compare with)
    assert got[64, "bf16"]["best"] == "bf16 32_4_3_1 s1" and got[64, "bf16"]["gain"] == round(1 - 66.0 / 73.2, 4)
    assert got[64, "bf16"]["flashinfer"] == 78.9  # (the served run's, the first read)
    assert got[128, "bf16"]["best"] == "bf16 64_4_2_0 s1" and got[128, "bf16"]["gain"] == 0.0
    assert got[600, "fp8"]["best"] == "fp8 served pipe1" and got[600, "fp8"]["served_best_split"] == 605.0
    assert "bf16 32_4_3_1 s2" not in got[64, "bf16"]["all"]  # (a configuration that failed: left out)
    table = knob_table.markdown(rows)
    assert "| 64 × 1024 | bf16 | 78.9 | 73.2 | `bf16 32_4_3_1 s1` | 66.0 | +9.8% |" in table
