"""Calibration of the ``local`` cluster in the processes already running: never starts a process; cached.

Compute figures come from this process (one CPU thread, or its GPU); link figures from ranks 0 and 1
of the existing process group when a collective caller (``fxpipe.compile``, on every rank) asks for
them. A world of one needs no links. Anything that fails degrades to the documented defaults with a
``warnings.warn``; see docs/clusters.md.
"""

from __future__ import annotations

import json
import os
import re
import socket
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.core.hardware import Calibration, gpu_preset
from fxpipe.core.local_probe import LocalMachine, register_local_probe
from fxpipe.runtime.calibration.calibrate_measure import (
    DEVICE_KEYS,
    LINK_KEYS,
    measure_device,
    measure_pair_link,
)

# 5: sections (device, link) with their own age, per device kind; links measured over the process group.
CALIBRATION_VERSION = 5
# A cached calibration older than this is measured again (the machine, its load or its neighbours change).
CALIBRATION_MAX_AGE_S = 7 * 24 * 3600.0


class CalibrationError(RuntimeError):
    """A calibration measurement failed; callers turn it into a warning and default figures."""


def device_kind(device: torch.device) -> str:
    """``cpu`` or ``cuda-<model>``: what a cache file's figures describe."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_properties(device).name
    return "cuda-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def cache_path(kind: str = "cpu") -> Path:
    """``$FXPIPE_CACHE_DIR`` or ``~/.cache/fxpipe``, one file per hostname, torch version and device kind."""
    folder = Path(os.environ.get("FXPIPE_CACHE_DIR") or Path.home() / ".cache" / "fxpipe")
    safe_version = torch.__version__.replace("+", "_")
    return folder / f"calibration-{socket.gethostname()}-torch{safe_version}-{kind}.json"


def read_cache(path: Path) -> dict[str, dict[str, float]]:
    """The fresh sections of a cache file (``device``, ``link``); stale, foreign or damaged ones are left out."""
    try:
        cached = json.loads(path.read_text())
        sections = cached["sections"] if cached.get("version") == CALIBRATION_VERSION else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}  # no file, or a damaged one: measured again and overwritten
    fresh = {}
    for name, keys in (("device", DEVICE_KEYS), ("link", LINK_KEYS)):
        try:
            section = sections[name]
            age_s = time.time() - float(section["measured_at"])
            figures = {key: float(section["figures"][key]) for key in keys}
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
        if 0 <= age_s <= CALIBRATION_MAX_AGE_S:
            fresh[name] = figures
    return fresh


def write_cache(path: Path, measured: dict[str, dict[str, float]]) -> None:
    """Add freshly ``measured`` sections to the cache file, keeping the other fresh section (atomic replace)."""
    now = time.time()
    sections: dict[str, Any] = {}
    kept = read_cache(path)  # fresh sections of the current format only
    if kept:
        sections = {name: json.loads(path.read_text())["sections"][name] for name in kept}
    sections.update({name: {"measured_at": now, "figures": figures} for name, figures in measured.items()})
    payload = {"version": CALIBRATION_VERSION, "hostname": socket.gethostname(), "torch": torch.__version__,
               "sections": sections}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)  # atomic: concurrent processes never read a half-written file


def _warn(what: str, error: BaseException) -> None:
    warnings.warn(f"fxpipe: measuring {what} failed ({type(error).__name__}: {error}); planning with the default "
                  "figures (docs/clusters.md). FXPIPE_CALIBRATE=0 skips measuring.", RuntimeWarning, stacklevel=3)


def _cache_file(device: torch.device) -> Path | None:
    """This device's cache file, or None (with a warning) when there is no place for one (no home folder)."""
    try:
        return cache_path(device_kind(device))
    except (OSError, RuntimeError, KeyError) as error:  # Path.home() raises RuntimeError without a home
        warnings.warn(f"fxpipe: no calibration cache ({error}); set FXPIPE_CACHE_DIR to keep the figures",
                      RuntimeWarning, stacklevel=3)
        return None


def _save(path: Path | None, measured: dict[str, dict[str, float]]) -> None:
    if path is None:
        return
    try:
        write_cache(path, measured)
    except OSError as error:  # a read-only home: the figures still serve this run
        warnings.warn(f"fxpipe: cannot write the calibration cache {path}: {error}", RuntimeWarning, stacklevel=3)


def calibrate_here(device: torch.device | None = None, *, refresh: bool = False,
                   need_device: bool = True) -> Calibration:
    """This process alone: device figures from the cache or measured in-process (~1.5 s); links only from the cache."""
    device = device or torch.device("cpu")
    path = _cache_file(device)
    cached = {} if refresh or path is None else read_cache(path)
    figures = cached.get("device")
    source = "cached" if figures is not None else "measured in this process" if need_device else "not needed"
    if figures is None and need_device:
        try:
            figures = measure_device(device)
        except Exception as error:  # noqa: BLE001 - any failure degrades to defaults, with a warning
            _warn("this device", error)
            figures, source = None, "defaults (measurement failed)"
        else:
            _save(path, {"device": figures})
    links = cached.get("link")
    return Calibration(figures, links, f"device {source}; links " + ("cached" if links else "not measured"))


def calibrate_group(device: torch.device, *, refresh: bool = False, need_device: bool = True) -> Calibration:
    """Every rank of the default process group calls this; all get the same figures.

    Rank 0's cache is shared; missing sections are measured by the ranks themselves (device: every
    rank, CPU ranks one at a time so they do not share cores while timing, then the per-figure median;
    links: ranks 0 and 1) and rank 0 writes them to its cache.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    path = _cache_file(device) if rank == 0 else None
    cached = _from_rank0(None if refresh or path is None else read_cache(path)) or {}
    measured: dict[str, dict[str, float]] = {}
    device_figures, links = cached.get("device"), cached.get("link")
    if device_figures is None and need_device:
        device_figures = _group_device_figures(device)
        measured.update({"device": device_figures} if device_figures is not None else {})
    if links is None and world_size >= 2:
        links = _group_link_figures(device)
        measured.update({"link": links} if links is not None else {})
    if measured and rank == 0:
        _save(path, measured)
    device_state = _state("device" in cached, device_figures, need_device)
    link_state = _state("link" in cached, links, world_size >= 2)
    return Calibration(device_figures, links, f"over the {dist.get_backend()} process group of {world_size} "
                                              f"rank(s): device {device_state}, links {link_state}")


def _state(was_cached: bool, figures: dict[str, float] | None, needed: bool) -> str:
    """How a section's figures came about, for the cluster's description."""
    if was_cached:
        return "cached"
    if not needed:
        return "not needed"
    return "measured" if figures is not None else "defaults (measurement failed)"


def _from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _attempt(measure: Callable[[], dict[str, float]]) -> dict[str, float] | str:
    """``measure()``'s figures, or the error it raised as text (so every rank still runs the same collectives)."""
    try:
        return measure()
    except Exception as error:  # noqa: BLE001 - reported on every rank by _agreed
        return f"rank {dist.get_rank()}: {type(error).__name__}: {error}"


def _agreed(what: str, mine: dict[str, float] | str | None) -> list[dict[str, float]] | None:
    """Every rank's figures (None where a rank measured nothing); None on every rank, with a warning, if any failed."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    problems = [str(item) for item in gathered if isinstance(item, str)]
    if problems:
        _warn(what, CalibrationError("; ".join(problems)))
        return None
    return [item for item in gathered if item is not None]


def _group_device_figures(device: torch.device) -> dict[str, float] | None:
    """Every rank measures its device; the per-figure median over ranks (the same on every rank)."""
    mine: dict[str, float] | str | None = None
    if device.type == "cuda":
        mine = _attempt(lambda: measure_device(device))  # each GPU is its own hardware: all at once
    else:
        for turn in range(dist.get_world_size()):  # CPU ranks share cores: one at a time
            if turn == dist.get_rank():
                mine = _attempt(lambda: measure_device(device))
            dist.barrier()
    gathered = _agreed("the devices", mine)
    if gathered is None:
        return None
    return {key: statistics.median(float(figures[key]) for figures in gathered) for key in DEVICE_KEYS}


def _group_link_figures(device: torch.device) -> dict[str, float] | None:
    """Ranks 0 and 1 time their link (over a two-rank subgroup); every rank gets rank 0's figures."""
    rank = dist.get_rank()
    pair = dist.new_group([0, 1]) if dist.get_world_size() > 2 else None
    mine = _attempt(lambda: measure_pair_link(rank, device, pair)) if rank in (0, 1) else None
    if pair is not None:
        dist.barrier()
        if rank in (0, 1):
            dist.destroy_process_group(pair)
    gathered = _agreed("the link between ranks 0 and 1", mine)
    return None if gathered is None else gathered[0]


def local_device(collective: bool = False) -> torch.device:
    """The device a local rank computes on: the process group's (CUDA for NCCL), else this process's GPU, else CPU."""
    if collective and dist.is_initialized():
        backend = str(dist.get_backend())
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gpu_properties(device: torch.device) -> tuple[str, int, int]:
    """(model name, total memory in bytes, visible GPU count) of a CUDA device."""
    properties = torch.cuda.get_device_properties(device)
    return str(properties.name), int(properties.total_memory), int(torch.cuda.device_count())


def calibrate(device: torch.device, *, collective: bool = False, refresh: bool = False,
              need_device: bool = True) -> Calibration:
    """Figures for ``device``: over the process group when ``collective`` (every rank must call), else here.

    ``need_device=False`` measures links only (a GPU with a datasheet preset); its device figures may still
    come from the cache.
    """
    if collective and dist.is_initialized():
        return calibrate_group(device, refresh=refresh, need_device=need_device)
    return calibrate_here(device, refresh=refresh, need_device=need_device)


def probe_local_machine(*, measure: bool, collective: bool, refresh: bool) -> LocalMachine:
    """This machine for the ``local`` cluster (see :func:`fxpipe.core.cluster.local_cluster`): its GPUs and,
    when ``measure``, calibrated figures (a GPU with a datasheet preset measures links only)."""
    device = local_device(collective)
    gpu = gpu_properties(device) if device.type == "cuda" else None
    known_gpu = gpu is not None and gpu_preset(gpu[0], gpu[1]) is not None  # its datasheet figures are used
    measured = (calibrate(device, collective=collective, refresh=refresh, need_device=not known_gpu)
                if measure else None)
    return LocalMachine(gpu, measured)


# Core never imports the runtime; the runtime hands it the way to measure this machine.
register_local_probe(probe_local_machine)
