"""Test-wide settings: one thread per process, no machine calibration unless a test asks for it; tests
marked ``needs_profiles`` skip without ../shared/profiles locally but fail under ``CI=true``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import fxpipe.runtime.calibration.calibrate  # noqa: F401  (registers the `local` cluster's machine probe, as the CLI does)

# Calibration measures this machine (tens of seconds); tests use the documented defaults.
os.environ.setdefault("FXPIPE_CALIBRATE", "0")
# Measured block costs vary from run to run; tests plan from the deterministic analytic model unless they
# ask for measured costs (costs="measured", --costs measured) or clear this (tests/test_measured_costs.py).
os.environ.setdefault("FXPIPE_COSTS", "analytic")
torch.set_num_threads(1)

_ROOT = Path(__file__).resolve().parents[1]
# Next to the repository (the project's layout), or inside it when checked out on its own.
SHARED_PROFILES = next((path for path in (_ROOT.parent / "shared" / "profiles", _ROOT / "shared" / "profiles")
                        if path.is_dir()), _ROOT.parent / "shared" / "profiles")


def in_ci() -> bool:
    """CI systems set ``CI=true``; there a missing input is a broken job, not a reason to skip."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "needs_profiles: reads ../shared/profiles (fails, not skips, when CI=true)")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("needs_profiles") is None or SHARED_PROFILES.is_dir():
        return
    message = f"{SHARED_PROFILES} is missing: check out the project's shared/ folder next to the repository"
    if in_ci():
        pytest.fail(f"CI=true and {message}", pytrace=False)
    pytest.skip(message)
