"""Activation recomputation per stage or block: the user's setting, the planner's choice, and forcing it on a plan."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from fxpipe.core.plan import Plan

RECOMPUTE_MODES = ("auto", "never", "always", "selective")
STAGE_CHOICES = {"keep": False, "recompute": True}
# A checked setting: one of RECOMPUTE_MODES, or one choice per stage (True = recompute).
RecomputeSetting = str | tuple[bool, ...]


class RecomputeError(ValueError):
    """A ``recompute=`` setting is malformed or does not match the plan's stages."""


def parse_recompute(value: object) -> RecomputeSetting:
    """``"auto"`` (the planner picks per block: docs/recompute.md), ``"never"``, ``"always"``, ``"selective"`` (every
    block recomputes attention's core only, as Megatron's selective recompute), or per stage ``True``/``False``/``"keep"``/``"recompute"``
    (a sequence, or a string such as ``"keep,recompute"``); returns a mode or a tuple of bools."""
    if isinstance(value, str):
        if value in RECOMPUTE_MODES:
            return value
        if "," not in value and value not in STAGE_CHOICES:
            raise RecomputeError(f"recompute={value!r} is unknown; choose one of {RECOMPUTE_MODES} or one of "
                                 f"{sorted(STAGE_CHOICES)} per stage, such as 'keep,recompute'")
        value = value.split(",")
    if not isinstance(value, Sequence) or isinstance(value, bytes) or not value:
        raise RecomputeError(f"recompute={value!r} must be one of {RECOMPUTE_MODES} or a non-empty sequence "
                             "with one choice per stage (True/False or 'keep'/'recompute')")
    return tuple(_stage_choice(item, index) for index, item in enumerate(value))


def _stage_choice(item: object, index: int) -> bool:
    if isinstance(item, bool):
        return item
    if isinstance(item, str) and item.strip() in STAGE_CHOICES:
        return STAGE_CHOICES[item.strip()]
    raise RecomputeError(f"recompute choice {item!r} for stage {index} is unknown; use True/False or "
                         f"one of {sorted(STAGE_CHOICES)}")


def check_stage_count(setting: RecomputeSetting, num_stages: int) -> None:
    """A per-stage setting must name every stage exactly once."""
    if isinstance(setting, tuple) and len(setting) != num_stages:
        raise RecomputeError(f"recompute gives {len(setting)} per-stage choices but the plan has {num_stages} "
                             f"stages; give {num_stages} choices or use one of {RECOMPUTE_MODES}")


def choose_recompute(setting: RecomputeSetting, stage_index: int, num_stages: int, keep_bytes: float,
                     limit_bytes: float) -> bool:
    """Whether stage ``stage_index`` recomputes: forced by the setting, or under ``"auto"`` exactly when
    keeping its activations (``keep_bytes`` peak per device) would not fit in ``limit_bytes``.

    Recomputation only ever adds time, so ``"auto"`` never picks it for a stage that fits without it (the planner
    then narrows a recomputing stage to per-block choices: :mod:`fxpipe.passes.partition.selective`);
    ``"selective"`` recomputes per block, never whole stages.
    """
    if isinstance(setting, tuple):
        check_stage_count(setting, num_stages)
        return setting[stage_index]
    if setting == "auto":
        return keep_bytes > limit_bytes
    return setting == "always"


def force_recompute(plan: Plan, value: object) -> Plan:
    """The plan with its stages' recompute flags set by ``value``; ``"auto"`` keeps the plan's own choices.

    Used for plans given whole (a file or a Plan), where the planner's memory figures are not redone:
    recomputation changes memory and time, never the gradients.
    """
    setting = parse_recompute(value)
    if setting == "auto":
        return plan
    if setting == "selective":  # "attention" on a block without a core keeps it whole
        return plan.with_updates(stages=tuple(replace(stage, recompute=False, block_recompute=("attention",) * (
            stage.stop_block - stage.first_block)) for stage in plan.stages))
    check_stage_count(setting, plan.num_stages)
    flags = setting if isinstance(setting, tuple) else (setting == "always",) * plan.num_stages
    return plan.with_updates(stages=tuple(replace(stage, recompute=flag, block_recompute=())
                                          for stage, flag in zip(plan.stages, flags, strict=True)))
