"""Sharded replicas (ZeRO inside a stage's replica group): level names, the request a user makes, its checks.

A stage's ``sharding`` level says what its replicas split among themselves instead of each holding all
of it (ZeRO-1/2/3 over the stage's replica group):

- ``"none"``: every replica holds the full weights, gradients and optimizer state (DAPPLE's data parallelism);
- ``"optimizer"``: the optimizer state is split (ZeRO-1);
- ``"gradients"``: the gradients too, reduce-scattered instead of all-reduced (ZeRO-2);
- ``"parameters"``: the weights too, all-gathered before use and freed after (ZeRO-3).

A request (``fxpipe.compile(sharding=...)``, ``--sharding``) is ``"auto"`` (the planner picks per stage),
one level for every stage, or one level per stage. A stage of one replica has nothing to split: it is
always ``"none"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol, TypeVar, cast

SHARDING_LEVELS = ("none", "optimizer", "gradients", "parameters")
SHARDING_AUTO = "auto"
SHARDING_CHOICES = (SHARDING_AUTO, *SHARDING_LEVELS)
DEFAULT_SHARDING = "none"

ShardingRequest = str | Sequence[str]


def block_path(name: str) -> str | None:
    """The FSDP unit a parameter or module path belongs to: the path up to its first numbered component
    (``h.3.attn.c_attn.weight`` -> ``h.3``, ``model.layers.0.mlp...`` -> ``model.layers.0``), else None (the root)."""
    parts = name.split(".")
    for index, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:index + 1])
    return None


class ShardingError(ValueError):
    """A sharding level or request is unknown, or does not fit the plan."""


def check_level(level: str, where: str = "sharding") -> str:
    """``level`` itself when it is one of :data:`SHARDING_LEVELS`, else a ShardingError naming the choices."""
    if level not in SHARDING_LEVELS:
        raise ShardingError(f"{where} {level!r} is unknown; choose one of {list(SHARDING_LEVELS)} "
                            "(none, or ZeRO-1/2/3 inside the stage's replica group)")
    return level


def schedule_levels(levels: Sequence[str], schedule: str) -> tuple[str, ...]:
    """The ``levels`` a stage may run under ``schedule``: zero-bubble's W runs after later forwards, which
    free ZeRO-3's gathered weights, so it drops ``"parameters"`` (``("none",)`` when nothing is left)."""
    if schedule != "zero_bubble":
        return tuple(levels)
    return tuple(level for level in levels if level != "parameters") or (DEFAULT_SHARDING,)


def check_request(request: ShardingRequest) -> ShardingRequest:
    """``request`` itself when it is ``"auto"``, a level, or a non-empty sequence of levels; else a ShardingError."""
    if isinstance(request, str):
        if request != SHARDING_AUTO:
            check_level(request)
        return request
    levels = tuple(request)
    if not levels:
        raise ShardingError("sharding is an empty sequence; give one level per stage, one level, or 'auto'")
    for index, level in enumerate(levels):
        if not isinstance(level, str):
            raise ShardingError(f"sharding[{index}] is {level!r}; each stage's level is one of {list(SHARDING_LEVELS)}")
        check_level(level, f"sharding[{index}]")
    return levels


def parse_request(text: str) -> ShardingRequest:
    """A ``--sharding`` argument: ``auto``, one level, or comma-separated levels, one per stage."""
    parts = [part.strip() for part in text.split(",")]
    return check_request(parts[0] if len(parts) == 1 else parts)


def stage_levels(request: ShardingRequest, replicas: Sequence[int]) -> tuple[str, ...]:
    """The level of each stage for an explicit request (not ``"auto"``), ``"none"`` where a stage has one replica.

    One level applies to every stage; a sequence must give exactly one level per stage.
    """
    check_request(request)
    if isinstance(request, str):
        if request == SHARDING_AUTO:
            raise ShardingError("sharding='auto' is decided by the planner; stage_levels takes explicit levels")
        levels = (request,) * len(replicas)
    else:
        levels = tuple(request)
        if len(levels) != len(replicas):
            raise ShardingError(f"sharding gives {len(levels)} levels {list(levels)} for a plan of {len(replicas)} "
                                f"stages (replicas {list(replicas)}); give one level per stage or one for all")
    return tuple(level if count > 1 else DEFAULT_SHARDING for level, count in zip(levels, replicas, strict=True))


class _StagedPlan(Protocol):
    """What :func:`force_sharding` reads of a :class:`fxpipe.core.plan.Plan` (typed so without importing it:
    fxpipe.core.plan imports this module for the level names)."""

    @property
    def stages(self) -> Sequence[Any]: ...

    def with_updates(self, **changes: Any) -> Any: ...


PlanT = TypeVar("PlanT", bound=_StagedPlan)


def force_sharding(plan: PlanT, request: ShardingRequest) -> PlanT:
    """``plan`` with each stage's level set by an explicit request; ``"auto"`` keeps the planner's levels.

    For plans whose levels the user decides (a plan file, a layout, ``fxpipe.compile(sharding="optimizer")``).
    """
    check_request(request)
    if request == SHARDING_AUTO:
        return plan
    levels = stage_levels(request, [stage.replicas for stage in plan.stages])
    if levels == tuple(stage.sharding for stage in plan.stages):
        return plan
    # reshard_after_forward is ZeRO-3's alone (a planned kept stage forced to another level drops it)
    stages = tuple(replace(stage, sharding=level, reshard_after_forward=stage.reshard_after_forward
                           if level == "parameters" else None) for stage, level in zip(plan.stages, levels, strict=True))
    return cast(PlanT, plan.with_updates(stages=stages))
