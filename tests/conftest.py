"""Test-wide settings: one thread per process, no machine calibration unless a test asks for it."""

from __future__ import annotations

import os

import torch

import fxpipe.runtime.calibrate  # noqa: F401  (registers the `local` cluster's machine probe, as the CLI does)

# Calibration measures this machine (tens of seconds); tests use the documented defaults.
os.environ.setdefault("FXPIPE_CALIBRATE", "0")
torch.set_num_threads(1)
