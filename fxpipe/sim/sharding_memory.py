"""Per-device bytes of a stage's weights, gradients and optimizer state under each sharding level (ZeRO-1/2/3),
at the step's peak, as the runtime holds them (:mod:`fxpipe.runtime.parallel.sharded_stage`).

Per-block FSDP units (the runtime's default, :mod:`fxpipe.runtime.parallel.fsdp_units`), U the largest unit's
bytes (the planner takes the largest chain block of the stage), n >= 2 units; measured on gloo ranks
(tests/test_sharded_stages.py, docs/sharding.md):

    optimizer:               2 P + (f-1) P / r        as one unit: the weights stay gathered, full gradients accumulate
    gradients, M = 1:        P + f P / r              the weights gathered; each unit's gradients are reduced and
                                                      freed, and the last backward reshards unit by unit
    gradients, M >= 2:       P + f P / r + 2 U        + one unit's new gradients and the previous unit's kept
                                                      reduce-scatter input
    parameters, M >= 2:      f P / r + 5 U            a forward: the unit gathered, the next one's flat all-gather
                                                      output and its copy (prefetched), the previous flat output
                                                      (kept until the next copy-out) and the last backward's kept
                                                      reduce-scatter input (with all gradient shards)
    parameters, M = 1:       f P / r + 4 U - 2 U / r  the backward of the second unit: it gathered, its gradients,
                                                      the first unit prefetched, the kept reduce-scatter input of
                                                      the third; the first two units' gradient shards not made yet
    with at most two units (P < 3 U) one U less: no third unit's buffer meets the other two (measured within
    about 0.5 U, below the figure; the tests hold stages of four or more units to 5%)
    parameters kept gathered from forward to backward (``reshard_after_forward`` false): as gradients

Whole stage as one unit (a recomputed or compiled stage, or a plan without block units):

Legend: P the stage's parameter bytes (fp32 master weights), r its replicas, f the optimizer's bytes kept
per parameter byte (:data:`fxpipe.sim.stagecost.OPTIMIZER_STATE_FACTORS`: weights 1 + gradients 1 +
state f - 2), M the micro-batches each replica runs per step (its backwards):

    none:                    f P                every replica holds everything (DAPPLE)
    optimizer:               2 P + (f-1) P / r  ZeRO-1
    gradients, parameters:   2 P + (f-1) P / r  ZeRO-2/3, M = 1
                             3 P + f P / r      ZeRO-2/3, M >= 2

Why (FSDP2 as torch 2.13 runs it, torch/distributed/fsdp/_fully_shard/): the runtime ``fully_shard``-s one
wrapper around the whole stage, so the stage is ONE unit: what FSDP2 gathers or reduces at once is all of P.

- Gathered weights cost P on top of the shard P/r, which FSDP2 keeps (the all-gather reads it in place).
  While gathering, FSDP2's flat all-gather output (P) and the per-parameter copies it splits into (P) are
  both alive; the flat one is freed at the forward's end, before any gradient exists. ZeRO-1/2 keep the
  gathered weights for the whole step; ZeRO-3 gathers them in every forward and every backward.
- The unsharded gradients are P. The reduce-scatter copies them into a flat input (P) before freeing them,
  then writes the shard's gradient (P/r, kept until the optimizer step).
- FSDP2 keeps a backward's flat reduce-scatter input (P) alive until the NEXT backward's reduce-scatter
  (``reduce_scatter_states``, ``set_reduce_scatter_max_input_buffers``' default 1), or the step's last
  backward. ZeRO-2/3 reduce-scatter in every backward, so from the second micro-batch on that P sits beside
  the gathered weights P and the new gradients P (with the shards P/r, the gradient shards P/r and the state):
  3 P + f P / r, more than ZeRO-1, and more than ``none`` where 3 P + f P / r > f P (Adam: r < 4).
- ZeRO-1: weights P + P/r, gradients P, state (f-2) P / r through the step; its one reduce-scatter (last
  backward) runs after the weights are freed: the peak is 2 P + (f-1) P / r. ZeRO-2/3 with M = 1 likewise.

Mixed-precision parameters (precision ``bf16-params``, :mod:`fxpipe.runtime.parallel.param_precision`), c the
compute copy's bytes per master byte (bf16 over fp32: 1/2); P, U stay the fp32 masters' bytes. FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` gathers bf16 weights (all-gather output and copies
c U each), makes bf16 unsharded gradients (c U) and reduce-scatters an fp32 input (U); ZeRO-1's gradients accumulate
unsharded in fp32 (P) across the micro-batches that do not sync. Per byte of weights under Adam (f = 4): none
4 + 2 + 4 + 8 = 18 bytes per parameter (f + c of P) against 16 without copies. Measured on 3 gloo ranks, 8 units
of 1 MiB (P = 8 U, r = 3, Adam; tests/test_mixed_precision_params.py, docs/sharding.md):

    none:                    (f + c) P                the fp32 masters, gradients and state, and the bf16 copy
    optimizer, M >= 2:       (1 + c) P + (f-1) P / r + c U        weights gathered in bf16, fp32 gradients
                                                      accumulated, the last backward's bf16 gradients of one unit
    optimizer, gradients (or parameters kept), M = 1:
                             c P + (f-1) P / r + (1 + c) U        bf16 weights; one unit's bf16 gradients and its
                                                      fp32 reduce-scatter input (gradient shards made unit by unit)
    gradients (or kept), M >= 2:  c P + f P / r + (1 + c) U       measured 16.30 U, figure 16.17 U
    parameters, M >= 2:      f P / r + 4 c U + U      the fp32 table's five buffers, four of them bf16: 13.81 U
                                                      measured, 13.67 U figure
    parameters, M = 1:       f P / r + 3 c U + U - 2 U / r        12.60 U measured, 12.50 U figure
    with at most two units (P < 3 U) the third unit's buffer goes, as above: c U at M >= 2, U at M = 1; a stage
    of one unit takes U = P.

The all-gather moves c of the weights' bytes; reduce-scatters and all-reduces move fp32 gradients
(:func:`fxpipe.sim.sharding_cost.sharding_comm`).

Not counted: collective backends' own staging (gloo's reduce-scatter may hold another copy of its input
while it runs; NCCL does not), and gradient shards kept from the previous step when the optimizer does not
set them to None (``zero_grad(set_to_none=False)``: + P / r). A stage of one replica has nothing to split:
every level is ``none`` there.
"""

from __future__ import annotations

from dataclasses import replace

from fxpipe.core.chain import CostChain
from fxpipe.core.precision import param_copy_fraction
from fxpipe.core.sharding import check_level


def chain_in_precision(chain: CostChain, precision: str) -> CostChain:
    """``chain`` counting the compute copies ``precision`` keeps (bf16-params), for the planner and the simulator.
    A chain already counting them keeps them: the planner simulates its plans before it records their precision."""
    fraction = param_copy_fraction(precision)
    return chain if fraction in (0.0, chain.param_copy_fraction) else replace(chain, param_copy_fraction=fraction)


def model_state_bytes(param_bytes: float, factor: float, sharding: str = "none", replicas: int = 1,
                      num_microbatches: int | None = None, unit_bytes: float = 0.0,
                      reshard_after_forward: bool | None = None, param_copy_fraction: float = 0.0) -> float:
    """Weights + gradients + optimizer state per device of a stage at the step's peak (module docstring's tables).

    ``num_microbatches``: the micro-batches each replica runs per step (M); required for a sharded level on
    more than one replica, where ZeRO-2/3's peak depends on it. ``unit_bytes``: the largest FSDP unit's bytes
    where the stage is sharded per block (0: the whole stage is one unit). ``reshard_after_forward``: the plan's
    choice for a ZeRO-3 stage (None: its default, free after forward). ``param_copy_fraction``: bytes of the
    compute copies per master byte (bf16-params: 0.5; 0: the masters compute, the fp32 tables).
    """
    check_level(sharding)
    if param_copy_fraction > 0.0:
        return mixed_state_bytes(param_bytes, factor, sharding, replicas, num_microbatches, unit_bytes,
                                 reshard_after_forward, param_copy_fraction)
    if sharding == "none" or replicas <= 1:
        return param_bytes * factor
    if num_microbatches is None or num_microbatches < 1:
        raise ValueError(f"model_state_bytes(sharding={sharding!r}, replicas={replicas}) needs num_microbatches "
                         f">= 1 (the micro-batches each replica runs per step), got {num_microbatches!r}: pass the "
                         "plan's num_microbatches")
    shard = param_bytes / replicas
    if 0.0 < unit_bytes < param_bytes and sharding != "optimizer":
        return per_unit_state_bytes(param_bytes, factor, sharding, replicas, num_microbatches, unit_bytes,
                                    reshard_after_forward)
    if sharding == "optimizer" or num_microbatches == 1:
        return 2.0 * param_bytes + (factor - 1.0) * shard
    return 3.0 * param_bytes + factor * shard


def per_unit_state_bytes(param_bytes: float, factor: float, sharding: str, replicas: int, num_microbatches: int,
                         unit_bytes: float, reshard_after_forward: bool | None = None) -> float:
    """ZeRO-2/3 with the stage sharded per block (the module docstring's first table)."""
    sharded = factor * param_bytes / replicas
    several = num_microbatches >= 2
    if sharding == "gradients" or reshard_after_forward is False:
        return param_bytes + sharded + (2.0 * unit_bytes if several else 0.0)
    buffers = 5.0 * unit_bytes if several else 4.0 * unit_bytes - 2.0 * unit_bytes / replicas
    if param_bytes < 3.0 * unit_bytes:
        buffers -= unit_bytes
    return sharded + buffers


def mixed_state_bytes(param_bytes: float, factor: float, sharding: str, replicas: int, num_microbatches: int | None,
                      unit_bytes: float, reshard_after_forward: bool | None, copy: float) -> float:
    """:func:`model_state_bytes` under mixed-precision parameters, ``copy`` = c (the module docstring's last table)."""
    if sharding == "none" or replicas <= 1:
        return (factor + copy) * param_bytes
    if num_microbatches is None or num_microbatches < 1:
        raise ValueError(f"model_state_bytes(sharding={sharding!r}, replicas={replicas}) needs num_microbatches "
                         f">= 1, got {num_microbatches!r}: pass the plan's num_microbatches")
    unit = unit_bytes if 0.0 < unit_bytes < param_bytes else param_bytes
    several = num_microbatches >= 2
    rest = (factor - 1.0) * param_bytes / replicas  # weight shards and optimizer state (gradient shards not yet)
    if sharding == "optimizer" and several:
        return (1.0 + copy) * param_bytes + rest + copy * unit
    if sharding != "parameters" or reshard_after_forward is False:
        if not several:
            return copy * param_bytes + rest + (1.0 + copy) * unit
        return copy * param_bytes + factor * param_bytes / replicas + (1.0 + copy) * unit
    buffers = (4.0 * copy * unit + unit) if several else (3.0 * copy * unit + unit - 2.0 * unit / replicas)
    if param_bytes < 3.0 * unit:  # no third unit's buffer: M >= 2 the previous bf16 flat output, M = 1 the fp32
        buffers -= copy * unit if several else unit  # reduce-scatter input kept from the third unit
    return factor * param_bytes / replicas + buffers
