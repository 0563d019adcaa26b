"""The options of ``fxpipe.compile``, one frozen record that every compile step reads."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fxpipe.core.cluster import Cluster
from fxpipe.core.plan import Plan


@dataclass(frozen=True)
class CompileOptions:
    """Everything ``fxpipe.compile`` takes besides the model and its example inputs."""

    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    global_batch_size: int | None
    plan: str | Path | Plan = "auto"
    schedule: str | None = None
    num_microbatches: int | None = None
    warmup_policy: str | None = None
    cluster: str | Cluster | None = None
    optimizer: str = "adam"
    autocast_dtype: torch.dtype | None = None
    timeout_s: float = 60.0
    stall_timeout_s: float = 5.0  # a rank silent this long is named as stalled (fxpipe.runtime.faults.failures)
    # exactness options (docs/exactness.md)
    sync_params: str = "broadcast"
    check_batch: str = "first"
    loss_reduction: str = "auto"  # fxpipe.runtime.numerics.loss_probe
    batch_norm: str = "microbatch"
    # where the batch is (docs/exactness.md, "The batch dimension"): None = dim 0, checked for ambiguity
    batch_dims: int | Mapping[str, int] | None = None
    target_batch_dim: int | None = None  # None: batch_dims when it is one int, else 0
    recompute: str | Sequence[bool | str] = "auto"  # fxpipe.core.recompute.parse_recompute
    # fxpipe.core.sharding.check_request (ZeRO levels, docs/sharding.md); None: a given plan's levels, else "none"
    sharding: str | Sequence[str] | None = None
    costs: str = "auto"  # where the planner's block times come from (fxpipe.job_costs)
    check_rows: bool = True  # refuse a model whose rows see each other when the plan splits the batch
    # torch.compile per stage: False, True or torch.compile's keyword arguments (fxpipe.runtime.compile.stage_compile)
    torch_compile: bool | Mapping[str, Any] = False
    verbose: bool | None = None  # print the plan table on rank 0 (None: when stdout is a terminal)
    sequence_parallel: bool = False  # tensor-parallel stages run norms and adds between pairs on token shards
    param_dtype: torch.dtype | None = None  # bf16 compute copies of fp32 masters (fxpipe.runtime.parallel.param_precision)
    virtual_stages: int | str = 1  # model chunks per device group, or "auto" (docs/virtual_stages.md)
