"""Test-wide settings: one thread per process, no machine calibration unless a test asks for it."""

from __future__ import annotations

import os

import torch

# Calibration measures this machine (tens of seconds); tests use the documented defaults.
os.environ.setdefault("FXPIPE_CALIBRATE", "0")
# Measured block costs vary from run to run; tests plan from the deterministic analytic model unless they
# ask for measured costs (costs="measured", --costs measured) or clear this (tests/test_measured_costs.py).
os.environ.setdefault("FXPIPE_COSTS", "analytic")
torch.set_num_threads(1)
