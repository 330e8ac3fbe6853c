"""`banyan check-env`'s package rows name the package whose version they show (`http api  OK
fastapi 0.165.0`, not a bare number under a check's name)."""

from __future__ import annotations

from importlib.metadata import version

from banyan.tools.check_env import check_package


def test_a_package_row_names_its_package() -> None:
    row = check_package("http api", "fastapi", "fastapi", "the OpenAI-compatible API")
    assert row.status == "ok" and row.detail == f"fastapi {version('fastapi')}", row


def test_a_missing_package_says_how_to_get_it() -> None:
    row = check_package("nothing", "no_such_module_here", "no-such-dist", "a test")
    assert row.status == "fail" and "pip install" in row.detail, row
