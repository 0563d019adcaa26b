"""Measure a sharded stage's per-device model-state bytes on a gloo rank: the process's live heap bytes
(glibc ``mallinfo2``: every CPU tensor torch allocates, whoever holds it) sampled where FSDP2's peak can fall.

The samples are taken on entry to and exit from FSDP2's own steps (all-gather, its copy-out, the
reduce-scatter's copy-in and call, pre/post-forward and backward, reshard), after the step and after the
optimizer step. Subtracting the heap at a quiet point (after ``optimizer.zero_grad()``), where the model state
is exactly the weight shards and the optimizer state (summed from their storages), leaves the model state
plus what else the step allocates; a stage of wide layers and few rows keeps the rest (activations, received
buffers) under 1% of it. Glibc-only: :func:`available` says whether this process can measure.

Gloo's reduce-scatter keeps a staging copy of its input until its worker thread drops the finished work,
briefly after the call returns; NCCL has none, and the planner's figure leaves it out
(fxpipe/sim/sharding_memory.py). The probe waits for that drop before sampling after a reduce-scatter.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

GLOO_DROP_S = 0.02  # the gloo worker drops a finished reduce-scatter's staging copy, on an idle machine within this
# A busy machine can keep the worker thread off a core for longer: after a reduce-scatter the heap is polled
# until it has not fallen for GLOO_STEADY_S (GLOO_POLL_S apart), at most GLOO_WAIT_S in all.
GLOO_POLL_S = 0.005
GLOO_STEADY_S = 0.1
GLOO_WAIT_S = 3.0


def settle() -> None:
    """Wait until the gloo worker has dropped a finished collective's staging copy: the heap stops falling."""
    time.sleep(GLOO_DROP_S)
    start = last_drop = time.monotonic()
    lowest = heap_bytes()
    while time.monotonic() - last_drop < GLOO_STEADY_S and time.monotonic() - start < GLOO_WAIT_S:
        time.sleep(GLOO_POLL_S)
        now = heap_bytes()
        if now < lowest - 4096:
            lowest, last_drop = now, time.monotonic()


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc() -> Any:
    name = ctypes.util.find_library("c")
    library = ctypes.CDLL(name) if name else None
    if library is None or not hasattr(library, "mallinfo2"):
        return None
    library.mallinfo2.restype = _MallInfo2
    return library


_LIBC = _libc()
SAMPLES: list[tuple[str, int]] = []


def available() -> bool:
    return _LIBC is not None


def heap_bytes() -> int:
    """Bytes the process holds from malloc now: in use in its arenas plus its mmapped chunks."""
    info = _LIBC.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def install() -> None:
    """Sample the heap around FSDP2's steps (this rank process only: its module namespaces are patched)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_module

    def sampled(label: str, function: Callable[..., Any], settles: bool = False) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            SAMPLES.append((f"{label}:in", heap_bytes()))
            result = function(*args, **kwargs)
            if settles:
                settle()
            SAMPLES.append((f"{label}:out", heap_bytes()))
            return result
        return wrapped

    for name in ("foreach_all_gather", "foreach_all_gather_copy_out", "foreach_reduce"):
        setattr(group_module, name, sampled(name, getattr(group_module, name), settles=name == "foreach_reduce"))
    collectives.foreach_reduce_scatter_copy_in = sampled(  # type: ignore[attr-defined]
        "reduce_scatter_copy_in", collectives.foreach_reduce_scatter_copy_in)
    group = group_module.FSDPParamGroup
    for name in ("pre_backward", "post_backward", "post_forward", "wait_for_unshard", "reshard"):
        setattr(group, name, sampled(name, getattr(group, name)))


def resident_bytes(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the storages of this rank's weights (their shards), gradients and optimizer state."""
    storages: dict[int, int] = {}
    tensors = [*params, *(p.grad for p in params)]
    tensors += [value for state in optimizer.state.values() for value in state.values()
                if isinstance(value, torch.Tensor) and value.dim() > 0]
    for tensor in tensors:
        if tensor is None:
            continue
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def peak_model_state_bytes(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                           step: Callable[[], Any]) -> tuple[int, str]:
    """The peak model-state bytes of one ``step()`` then ``optimizer.step()``, and where it fell; call after
    ``optimizer.zero_grad()`` of an earlier step (FSDP2 set up, the optimizer state allocated)."""
    assert available(), "glibc's mallinfo2 is needed"
    dist.barrier()  # every earlier collective finished: gloo holds no staging copy
    time.sleep(GLOO_DROP_S)
    gc.collect()
    quiet = resident_bytes(params, optimizer)
    SAMPLES.clear()
    SAMPLES.append(("start", heap_bytes()))
    step()
    SAMPLES.append(("after step", heap_bytes()))
    optimizer.step()
    SAMPLES.append(("after optimizer.step", heap_bytes()))
    offset = SAMPLES[0][1] - quiet
    label, peak = max(SAMPLES, key=lambda sample: sample[1])
    return peak - offset, label


def warmed_peak_model_state_bytes(pipe: Any, batch: tuple[Any, ...], learning_rate: float
                                  ) -> tuple[list[torch.nn.Parameter], int, str]:
    """``pipe``'s parameters and :func:`peak_model_state_bytes` of one more AdamW step on ``batch``, after two
    steps that set FSDP2 up and allocate AdamW's state."""
    params = list(pipe.parameters())
    optimizer = torch.optim.AdamW(params, lr=learning_rate)
    for _ in range(2):
        pipe.step(*batch)
        optimizer.step()
        optimizer.zero_grad()
    peak, where = peak_model_state_bytes(params, optimizer, lambda: pipe.step(*batch))
    return params, peak, where
