"""The conftest rule for inputs outside the repository: skip locally, fail under CI=true."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import conftest
import pytest


class _Item:
    def __init__(self, marked: bool) -> None:
        self.marked = marked

    def get_closest_marker(self, name: str) -> Any:
        return object() if self.marked and name == "needs_profiles" else None


def test_missing_profiles_fail_under_ci_and_skip_elsewhere(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(conftest, "SHARED_PROFILES", tmp_path / "missing")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true and .*missing is missing"):
        conftest.pytest_runtest_setup(_Item(True))  # type: ignore[arg-type]
    conftest.pytest_runtest_setup(_Item(False))  # type: ignore[arg-type]  # unmarked tests are not touched
    monkeypatch.setenv("CI", "")
    with pytest.raises(pytest.skip.Exception, match="missing is missing"):
        conftest.pytest_runtest_setup(_Item(True))  # type: ignore[arg-type]
    monkeypatch.setattr(conftest, "SHARED_PROFILES", tmp_path)  # present: runs, under CI or not
    monkeypatch.setenv("CI", "true")
    conftest.pytest_runtest_setup(_Item(True))  # type: ignore[arg-type]
