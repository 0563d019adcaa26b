"""How the ``local`` cluster learns about this machine: a probe the runtime registers (core never imports the runtime)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

from fxpipe.core.hardware import Calibration


def calibration_enabled(calibrate: bool | None) -> bool:
    """``calibrate`` when given, else the environment: ``FXPIPE_CALIBRATE=0`` turns measuring off (CI)."""
    if calibrate is not None:
        return calibrate
    return os.environ.get("FXPIPE_CALIBRATE", "1").strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class LocalMachine:
    """This machine as the ``local`` cluster sees it: ``gpu`` (model name, memory bytes, visible count) when
    ranks compute on GPUs, and the calibrated figures (None when calibration is off)."""

    gpu: tuple[str, int, int] | None
    measured: Calibration | None


class LocalProbe(Protocol):
    def __call__(self, *, measure: bool, collective: bool, refresh: bool) -> LocalMachine: ...


# Measuring the machine is the runtime's job and core never imports the runtime: fxpipe.runtime.calibration.calibrate
# registers its probe when imported (the CLI, fxpipe.plan and fxpipe.compile import it before planning).
_LOCAL_PROBE: list[LocalProbe] = []


def register_local_probe(probe: LocalProbe) -> None:
    """Make ``probe`` the way :func:`local_cluster` measures this machine (``fxpipe.runtime.calibration.calibrate`` calls this)."""
    _LOCAL_PROBE[:] = [probe]


def local_probe() -> LocalProbe | None:
    """The registered probe, None when ``fxpipe.runtime.calibration.calibrate`` was not imported."""
    return _LOCAL_PROBE[0] if _LOCAL_PROBE else None
