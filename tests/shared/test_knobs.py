"""The knob registry (``shared/knobs.py``): every ``BANYAN_*`` name the code uses is declared there or is a service
config field's variable; services and shared code read them through the registry, never ``os.environ``; values are
parsed and checked once, and listed by ``banyan check-env``."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from shared import config, knobs

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"BANYAN_[A-Z0-9_]*[A-Z0-9]")
NOT_VARIABLES = {"BANYAN_GEMV_BF16"}  # (a C macro of gemv.cu, set by the build's -D flag)
ENVIRON_READ = re.compile(r"(os\.environ|getenv|environ\.get)\W+[^\n]*BANYAN_"  # (a read, or a membership test)
                          r"|BANYAN_[A-Z_]*\"\s*\)?\s*in\s+os\.environ")
READS_ALLOWED = {"shared/knobs.py", "shared/config.py"}  # (the registry and the config flags' defaults)


def _config_variables() -> set[str]:
    classes = (config.CommonConfig, config.TokenizerConfig, config.SchedulerConfig, config.WorkerConfig)
    return {config.ENV_PREFIX + f.name.upper() for c in classes for f in dataclasses.fields(c)}


def _sources():
    for top in ("services", "shared", "banyan"):
        yield from sorted((ROOT / top).rglob("*.py"))


def test_every_banyan_name_in_the_code_is_declared() -> None:
    known = knobs.ENV_NAMES | _config_variables() | NOT_VARIABLES
    unknown = {}
    for path in _sources():
        for name in set(NAME.findall(path.read_text())) - known:
            unknown.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert not unknown, f"BANYAN_* names neither in shared/knobs.py nor a config field: {unknown}"


def test_services_and_shared_read_banyan_variables_only_through_the_registry() -> None:
    direct = []
    for path in _sources():
        rel = str(path.relative_to(ROOT))
        if rel in READS_ALLOWED or rel.startswith("banyan/"):  # (banyan/: the CLIs' flag defaults, declared above)
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if ENVIRON_READ.search(line):
                direct.append(f"{rel}:{n}: {line.strip()}")
    assert not direct, "read through shared.knobs.get:\n" + "\n".join(direct)


def test_no_knob_shadows_a_config_flag_and_each_says_what_it_does() -> None:
    assert not knobs.ENV_NAMES & _config_variables()
    for k in knobs.KNOBS.values():
        assert k.meaning and k.kind in ("internal", "host", "cli", "process"), k
        assert isinstance(k.default, k.type), k
        assert not k.choices or k.default in k.choices, k


def test_values_are_parsed_checked_and_read_once(monkeypatch) -> None:
    monkeypatch.setenv("BANYAN_DECODE_BLOCK", "32")
    monkeypatch.setenv("BANYAN_CUDA_NORM", "0")
    knobs.reload()
    try:
        assert knobs.get("decode_block") == 32 and knobs.get("cuda_norm") is False
        monkeypatch.setenv("BANYAN_DECODE_BLOCK", "64")
        assert knobs.get("decode_block") == 32  # (read once a process)
        assert knobs.get("decode_block", fresh=True) == 64
        assert knobs.fingerprint()["cuda_norm"] is False and "decode_block" not in knobs.fingerprint()
        with pytest.raises(knobs.KnobError, match="BANYAN_DECODE_BLOCK='48'"):
            knobs.load({"BANYAN_DECODE_BLOCK": "48"})
        with pytest.raises(knobs.KnobError, match="BANYAN_CUDA_NORM='yes'"):
            knobs.load({"BANYAN_CUDA_NORM": "yes"})
        with pytest.raises(KeyError):
            knobs.get("no_such_knob")
    finally:
        monkeypatch.undo()
        knobs.reload()
    assert knobs.get("decode_block") == 0 and knobs.get("cuda_norm") is True


def test_check_env_lists_the_knobs(monkeypatch, capsys) -> None:
    from banyan.tools import check_env

    monkeypatch.setenv("BANYAN_GEMM", "fp8")
    row = check_env.check_knobs()
    assert row.status == "ok" and "BANYAN_GEMM=fp8" in row.detail
    assert check_env.main(["--knobs"]) == 0
    out = capsys.readouterr().out
    assert all(k.env in out for k in knobs.KNOBS.values())
    monkeypatch.setenv("BANYAN_GEMM", "sometimes")
    row = check_env.check_knobs()
    assert row.status == "fail" and "BANYAN_GEMM" in row.detail
    knobs.reload()
