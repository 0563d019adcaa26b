"""The reference simulator's memory under mixed-precision parameters (precision ``bf16-params``), buffer by buffer
with each buffer's dtype, written apart from fxpipe/sim/sharding_memory.py: fp32 masters, shards, gradient
shards and Adam state; bf16 (``copy`` bytes per master byte) gathered weights, flat all-gather outputs and fresh
unsharded gradients; fp32 reduce-scatter inputs and ZeRO-1's gradients accumulated across micro-batches."""

from __future__ import annotations


def mixed_peak_bytes(level: str, held: float, unit: float, replicas: int, kept_per_byte: int,
                     num_microbatches: int, reshard: bool, copy: float) -> float:
    """A stage replica's weights + gradients + optimizer state at the peak; ``unit`` the largest FSDP unit
    (``held`` for a stage of one unit), ``reshard``: ZeRO-3 frees the weights after forward."""
    if level == "none" or replicas == 1:
        masters_grads_state, copies = kept_per_byte * held, copy * held
        return masters_grads_state + copies
    shards_and_state = (kept_per_byte - 1) * held / replicas  # fp32 master shards and Adam moments
    all_grad_shards = held / replicas
    later = num_microbatches > 1
    fp32_input = unit  # a reduce-scatter's flat input, cast to the reduce dtype
    if level == "optimizer" and later:  # bf16 weights kept, fp32 gradients accumulated, one unit's bf16 ones
        return shards_and_state + copy * held + held + copy * unit
    if level != "parameters" or not reshard:
        if not later:  # the one backward: a unit's bf16 gradients beside its fp32 input, shards made later
            return shards_and_state + copy * held + copy * unit + fp32_input
        return shards_and_state + all_grad_shards + copy * held + copy * unit + fp32_input
    third = 1.0 if held >= 3 * unit else 0.0
    if later:  # a forward: one unit gathered, the next one's flat output and its copy, the previous flat output
        return shards_and_state + all_grad_shards + copy * (unit + unit + unit + third * unit) + fp32_input
    made_shards = (held - 2 * unit) / replicas
    gathered, gradients, prefetched = copy * unit, copy * unit, copy * unit
    return shards_and_state + made_shards + gathered + gradients + prefetched + third * fp32_input
