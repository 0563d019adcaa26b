"""Virtual stages as plain numbers: which device group runs each model chunk (loop or V layout), and the checks."""

from __future__ import annotations

from collections.abc import Sequence

LOOP = "loop"  # chunk c on group c mod G (Megatron's virtual pipeline, torch's interleaved schedules)
V_SHAPE = "v"  # group g holds chunks g and 2G-1-g (torch's ZBV and DualPipeV): two chunks per group
CHUNK_LAYOUTS = (LOOP, V_SHAPE)


def loop_chunk_groups(num_groups: int, virtual_stages: int) -> tuple[int, ...]:
    """The group of every chunk when the chunks loop over the groups ``virtual_stages`` times."""
    return tuple(chunk % num_groups for chunk in range(num_groups * virtual_stages))


def v_chunk_groups(num_groups: int) -> tuple[int, ...]:
    """The group of every chunk of a V: down the groups, then back up (the last group runs the middle two)."""
    return (*range(num_groups), *reversed(range(num_groups)))


def chunk_groups_for(layout: str, num_groups: int, virtual_stages: int) -> tuple[int, ...]:
    """The chunk-to-group map of ``layout`` ("loop" or "v") for ``num_groups`` groups of ``virtual_stages`` chunks."""
    if layout == LOOP:
        return loop_chunk_groups(num_groups, virtual_stages)
    if layout == V_SHAPE and virtual_stages == 2:
        return v_chunk_groups(num_groups)
    raise ValueError(f"chunk layout {layout!r} with virtual_stages={virtual_stages} is not one of "
                     f"{list(CHUNK_LAYOUTS)}; a V holds exactly 2 chunks per group, a loop any number")


def chunk_layout_of(chunk_groups: tuple[int, ...], virtual_stages: int) -> str | None:
    """Which layout a chunk-to-group map is ("loop" first where both fit: one group), or None."""
    if virtual_stages < 1 or len(chunk_groups) % virtual_stages:
        return None
    num_groups = len(chunk_groups) // virtual_stages
    if chunk_groups == loop_chunk_groups(num_groups, virtual_stages):
        return LOOP
    if virtual_stages == 2 and chunk_groups == v_chunk_groups(num_groups):
        return V_SHAPE
    return None


def chunk_group_problems(chunk_groups: tuple[int, ...], virtual_stages: object, num_chunks: int) -> list[str]:
    """What is wrong with a plan's ``virtual_stages`` and chunk-to-group map for ``num_chunks`` chunks (stages)."""
    if not isinstance(virtual_stages, int) or isinstance(virtual_stages, bool) or virtual_stages < 1:
        return [f"virtual_stages must be a positive integer (1: one stage per device group), got {virtual_stages!r}"]
    if virtual_stages == 1:
        return [] if not chunk_groups else [
            f"chunk_groups={list(chunk_groups)} needs virtual_stages >= 2; drop chunk_groups or set virtual_stages"]
    if num_chunks % virtual_stages:
        return [f"virtual_stages={virtual_stages} does not divide the {num_chunks} stages (chunks); list "
                f"virtual_stages chunks per device group"]
    num_groups = num_chunks // virtual_stages
    if chunk_layout_of(chunk_groups, virtual_stages) is None:
        loop = list(loop_chunk_groups(num_groups, virtual_stages))
        also = f" or the V {list(v_chunk_groups(num_groups))}" if virtual_stages == 2 else ""
        return [f"chunk_groups={list(chunk_groups)} is not a layout of {num_chunks} chunks on {num_groups} groups; "
                f"use the loop {loop}{also}"]
    return []


def shared_device_problems(chunk_groups: tuple[int, ...],
                           stages: Sequence[tuple[tuple[int, ...], int, int]]) -> list[str]:
    """What is wrong with the devices of stages ``(devices, replicas, tensor_parallel)``: no device may serve two
    groups, and the chunks of one group (``chunk_groups``; none: every stage its own group) list the same
    devices, replicas and tensor-parallel degree."""
    groups = chunk_groups or tuple(range(len(stages)))
    first_of: dict[int, int] = {}
    seen: set[int] = set()
    problems = []
    for index, (devices, replicas, tensor_parallel) in enumerate(stages):
        group = groups[index]
        if group in first_of:
            first = first_of[group]
            if stages[first] != (devices, replicas, tensor_parallel):
                problems.append(f"chunk {index} runs on group {group} with devices={list(devices)}, replicas="
                                f"{replicas}, tensor_parallel={tensor_parallel} but chunk {first} of that group has "
                                f"devices={list(stages[first][0])}, replicas={stages[first][1]}, tensor_parallel="
                                f"{stages[first][2]}; list the group's devices on every chunk of it")
            continue
        first_of[group] = index
        overlap = seen.intersection(devices)
        if overlap:
            problems.append(f"devices {sorted(overlap)} are assigned to more than one "
                            + ("device group" if chunk_groups else "stage"))
        seen.update(devices)
    return problems
