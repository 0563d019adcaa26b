"""Forced layouts: stages written ``R`` or ``RxT`` parsed, and what a tensor-parallel group cannot split, said."""

from __future__ import annotations

from fxpipe.core.chain import CostChain
from fxpipe.core.plan import Plan
from fxpipe.passes.partition.request import LayoutError
from fxpipe.sim.tensor_parallel_cost import splits

__all__ = ["check_degrees", "parse_layout", "parse_stage_layout", "replicated_block_notes"]


def parse_layout(layout: str, num_devices: int, num_blocks: int, devices_per_host: int | None = None
                 ) -> tuple[int, ...]:
    """``"3:1"`` -> (3, 1); ``"dp"`` -> (num_devices,): the replica counts of :func:`parse_stage_layout`."""
    return parse_stage_layout(layout, num_devices, num_blocks, devices_per_host)[0]


def parse_stage_layout(layout: str, num_devices: int, num_blocks: int, devices_per_host: int | None = None
                       ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``"3:1"`` -> ((3, 1), (1, 1)); ``"48x8:48x8"`` -> ((48, 48), (8, 8)); ``"4x2"`` -> ((4,), (2,));
    ``"dp"`` -> ((num_devices,), (1,)): replicas and tensor-parallel group size per stage. Raises LayoutError
    naming the bad part.

    ``num_blocks`` is the number of cuttable blocks (:func:`parameter_groups`): no stage may be empty;
    ``devices_per_host`` (default: no limit) bounds T, as a group stays inside one host.
    """
    if not isinstance(layout, str):
        written = ":".join(map(str, layout)) if isinstance(layout, (list, tuple)) else "3:1"
        raise LayoutError(f"layout must be a string such as '3:1' or '48x8:48x8'; got {layout!r} "
                          f"({type(layout).__name__}): pass layout={written!r}")
    text = layout.strip().lower()
    if text == "dp":
        return (num_devices,), (1,)
    parts = [part.split("x") for part in text.split(":")]
    if not all(len(fields) <= 2 and all(f.isdecimal() and f.isascii() and int(f) > 0 for f in fields)
               for fields in parts):
        raise LayoutError(f"layout {layout!r} is malformed: use replica counts separated by ':', each optionally "
                          "'RxT' (R replicas, each a T-way tensor-parallel group), e.g. '3:1', '1:1:1:1', '48x8:48x8', "
                          "'1x2:2', or 'dp'")
    counts = tuple(int(fields[0]) for fields in parts)
    degrees = tuple(int(fields[1]) if len(fields) == 2 else 1 for fields in parts)
    for index, degree in enumerate(degrees):
        if devices_per_host is not None and degree > devices_per_host:
            raise LayoutError(f"layout {layout!r}: stage {index} asks for T={degree}, but a tensor-parallel group "
                              f"stays inside one host and the cluster has {devices_per_host} devices per host; use "
                              f"T <= {devices_per_host}")
    needed = sum(r * t for r, t in zip(counts, degrees, strict=True))
    if needed > num_devices:
        raise LayoutError(f"layout {layout!r} needs {needed} devices but the cluster has {num_devices} (each stage "
                          "takes its replicas x T); use fewer replicas or a larger cluster")
    if len(counts) > num_blocks:
        raise LayoutError(f"layout {layout!r} has {len(counts)} stages but the model has only {num_blocks} "
                          f"cuttable block(s) (runs of layers holding parameters; no cut is made where a Python "
                          f"value or a value whose rows are not the batch rows, such as a (batch*seq, hidden) "
                          f"flatten, would cross), so every stage cannot get parameters; use at most {num_blocks} "
                          f"stages")
    return counts, degrees


def check_degrees(layout: str, degrees: tuple[int, ...], chain: CostChain) -> None:
    """A forced T > 1 must split at least one block (else its members would all run the same whole stage), and a
    weight tied between the first and the last block (an LM's embedding and head) needs one T on both ends."""
    last = chain.num_blocks - 1
    for shared in chain.shared_params:
        if len(degrees) > 1 and shared.blocks[0] == 0 and shared.blocks[-1] == last and degrees[0] != degrees[-1]:
            raise LayoutError(f"layout {layout!r}: the first and last stages share the tied parameter "
                              f"{shared.name!r} but have T={degrees[0]} and T={degrees[-1]}; a tied weight is summed "
                              "shard by shard, so give both ends the same T (e.g. '1x2:1x2'), or untie the weights")
    split = [block for block in chain.blocks if block.tp is not None]
    for index, degree in enumerate(degrees):
        if degree == 1 or any(splits(block, degree) for block in split):
            continue
        if not split:
            raise LayoutError(f"layout {layout!r}: stage {index} asks for T={degree}, but no block of the model has "
                              "a tensor-parallel split (Block.tp: the tensor-parallel analysis found no column- and "
                              "row-parallel pairs in it, or its costs came without them, as from a profile file); "
                              "use T = 1")
        divisors = ", ".join(f"{block.name!r} divisor {block.tp.divisor}" for block in split[:4] if block.tp)
        raise LayoutError(f"layout {layout!r}: stage {index} asks for T={degree}, which divides no block's "
                          f"tensor-parallel divisor ({divisors}{', ...' if len(split) > 4 else ''}); use a T that "
                          "divides the head counts, e.g. one of "
                          f"{[t for t in (2, 4, 8) if any(splits(block, t) for block in split)] or [1]}")


def replicated_block_notes(plan: Plan, chain: CostChain) -> list[str]:
    """Per stage of T-way groups, the blocks with a split that T does not divide: they run whole on every member."""
    notes = []
    for stage in plan.stages:
        whole = [block for block in chain.blocks[stage.first_block:stage.stop_block]
                 if block.tp is not None and not splits(block, stage.tensor_parallel)]
        if stage.tensor_parallel > 1 and whole:
            named = ", ".join(f"{block.name!r} (divisor {block.tp.divisor})" for block in whole[:4] if block.tp)
            notes.append(f"stage {stage.stage_index} (T={stage.tensor_parallel}): {len(whole)} block(s) run whole on "
                         f"every group member, as T does not divide their split: {named}"
                         + (", ..." if len(whole) > 4 else ""))
    return notes
