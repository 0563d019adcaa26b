"""Plan data: stages, replica counts, devices, micro-batches, predictions; validation and JSON."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from fxpipe.core.block_recompute import block_recompute_problems
from fxpipe.core.jsonvalues import JSONValueError, field_hints, read_field
from fxpipe.core.precision import DEFAULT_PRECISION, PRECISIONS
from fxpipe.core.schedule import TRAINING_SCHEDULES, WARMUP_POLICIES
from fxpipe.core.sharding import DEFAULT_SHARDING, SHARDING_LEVELS
from fxpipe.core.utilization import model_flops_utilization, tokens_per_s_per_device
from fxpipe.core.virtual import chunk_group_problems, chunk_layout_of, shared_device_problems
from fxpipe.core.virtual_fit import schedule_fit_problems

FORMAT_VERSION = 1
PLAN_KEYWORDS = ("auto", "markers")
# a stage is "R" (R replicas) or "RxT" (R replicas, each a T-way tensor-parallel group); one stage is "dp" or "RxT"
LAYOUT_PATTERN = re.compile(r"dp|[0-9]+x[0-9]+|[0-9]+(x[0-9]+)?(:[0-9]+(x[0-9]+)?)+")


class PlanError(ValueError):
    """A plan is inconsistent or a plan file is malformed."""


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: blocks ``[first_block, stop_block)`` of the cost chain on ``replicas`` devices.

    Predicted figures are per device: ``forward_s``/``backward_s`` for one micro-batch slice,
    ``peak_memory_bytes`` for weights, gradients, optimizer state, in-flight activations and
    receive buffers. ``node_names`` lists the fx nodes the stage computes (empty for plans made
    from profile files). ``recompute``: the stage keeps only its inputs per in-flight micro-batch and
    runs its forward again in backward (``backward_s`` excludes that extra forward); absent = keep.
    ``activation_bytes`` is what autograd saves for one slice (the loss's saved tensors included on the
    last stage); ``activation_peak_bytes`` the most it holds at once over a step, what a measured step
    records (``pipe.step_stats()``; :func:`fxpipe.sim.stagecost.activation_peak_bytes`). ``sharding``: what
    the stage's replicas split among themselves (:mod:`fxpipe.core.sharding`; absent = ``"none"``).
    ``tensor_parallel`` (T): each replica is a T-way tensor-parallel group inside one node, so the stage runs
    on ``replicas * T`` devices; replica ``r``'s group is ``devices[r*T:(r+1)*T]`` and the per-device figures
    are one group member's (absent = 1). ``reshard_after_forward``: whether a sharded stage's FSDP units free
    their gathered weights after each forward (gathering them again for the backward) or keep them until
    that micro-batch's backward; absent (None) = the level's default: only ``"parameters"`` (ZeRO-3) frees.
    """

    stage_index: int
    first_block: int
    stop_block: int
    replicas: int
    devices: tuple[int, ...]
    node_names: tuple[str, ...] = ()
    forward_s: float = 0.0
    backward_s: float = 0.0
    allreduce_s: float = 0.0
    param_bytes: int = 0
    activation_bytes: int = 0
    peak_memory_bytes: int = 0
    inflight_microbatches: int = 0
    recompute: bool = False
    activation_peak_bytes: int = 0
    sharding: str = DEFAULT_SHARDING
    tensor_parallel: int = 1
    reshard_after_forward: bool | None = None
    # per block of the stage: "keep", "block" or "attention" (fxpipe.core.block_recompute); () = every block as
    # ``recompute`` says. Written only when choices differ, so older plans keep their bytes.
    block_recompute: tuple[str, ...] = ()
    block_node_counts: tuple[int, ...] = ()  # with block_recompute: how many of node_names each block holds

    @property
    def num_devices(self) -> int:
        return self.replicas * self.tensor_parallel

    def replica_devices(self, replica_index: int) -> tuple[int, ...]:
        """The devices of one replica: its tensor-parallel group, in group-rank order."""
        size = self.tensor_parallel
        return self.devices[replica_index * size:(replica_index + 1) * size]


@dataclass(frozen=True)
class Prediction:
    """What the planner expects of a plan (from the exact simulator when it ran).

    ``cost_source`` says where the block times behind the figures came from: ``"measured"`` (timed on
    this machine's devices), ``"analytic"`` (the device model; optimistic, see docs/clusters.md),
    ``"profile"`` (a profile file), or ``""`` when not recorded.

    ``model_flops_per_sample`` (model FLOPs as Megatron counts them: 3 x the forward matmul FLOPs),
    ``tokens_per_sample`` (a language model's sequence length) and ``peak_flops_per_device`` (the datasheet
    peak for the plan's precision) give MFU and tokens/s per device (:mod:`fxpipe.core.utilization`);
    0 = unknown (absent from the JSON, and from files written before them).
    """

    iteration_time_s: float
    throughput_samples_per_s: float
    bubble_fraction: float = 0.0
    analytic_iteration_time_s: float = 0.0
    dp_iteration_time_s: float = 0.0
    cost_source: str = ""
    model_flops_per_sample: float = 0.0
    tokens_per_sample: int = 0
    peak_flops_per_device: float = 0.0

    @property
    def speedup_over_dp(self) -> float:
        if self.dp_iteration_time_s <= 0 or self.iteration_time_s <= 0:
            return math.nan
        return self.dp_iteration_time_s / self.iteration_time_s


@dataclass(frozen=True)
class BaselineResult:
    """One baseline planner's plan, scored by the same simulator; ``iteration_time_s`` is None (JSON null)
    when the baseline is infeasible, so no reader mistakes it for the fastest plan."""

    layout: str
    iteration_time_s: float | None
    num_microbatches: int = 0
    feasible: bool = True
    note: str = ""


@dataclass(frozen=True)
class Plan:
    """A complete hybrid pipeline + data parallel plan; the same value drives codegen, simulation and runtime."""

    global_batch_size: int
    num_microbatches: int
    stages: tuple[StagePlan, ...]
    schedule: str = "early_backward"
    warmup_policy: str = "A"
    planner: str = "dapple"
    model: str = ""
    cluster: str = ""
    num_devices: int = 0
    num_blocks: int = 0
    block_names: tuple[str, ...] = ()
    predicted: Prediction | None = None
    # How long planning took: a fact of the run, not of the plan, so it is left out of the plan's own JSON
    # and of equality; `fxpipe plan --json` writes it in the file's top-level "run" object instead.
    planning_time_s: float = field(default=0.0, compare=False)
    baselines: tuple[tuple[str, BaselineResult], ...] = ()
    format_version: int = FORMAT_VERSION
    notes: tuple[str, ...] = field(default=())
    # > 0: each stage all-reduces its gradients in buckets of this many bytes as the last backward
    # produces them (fxpipe.sim.allreduce_overlap); 0 (plans written before): one allreduce after it
    allreduce_bucket_bytes: int = 0
    # what the job trains in (fxpipe.core.precision): "fp32", or "bf16"/"fp16" autocast with fp32 master
    # weights; the predictions were costed for it. Plans written before it existed are fp32.
    precision: str = DEFAULT_PRECISION
    # virtual stages (docs/virtual_stages.md): each device group runs this many model chunks; then ``stages`` are
    # the chunks in model order and ``chunk_groups[c]`` is chunk c's group (fxpipe.core.virtual: a loop or a V).
    # Chunks of one group list the same devices. 1 and () (plans written before): one stage per group.
    virtual_stages: int = 1
    chunk_groups: tuple[int, ...] = ()
    # whether tensor-parallel stages were costed running sequence parallelism (norms, dropout and residual adds on
    # token shards: compile's ``sequence_parallel``, which must match); False (absent: plans written before) without
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        validate_plan(self)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def microbatch_size(self) -> int:
        return self.global_batch_size // self.num_microbatches

    @property
    def layout(self) -> str:
        """The replica layout in the DAPPLE paper's notation: ``"dp"``, ``"3:1"``, ``"1:1:1:1"``; under virtual
        stages it names the device groups (``"1:1:1:1"`` with ``virtual_stages=2``: 8 chunks on 4 groups)."""
        firsts = [self.stages[self.chunks_of_group(g)[0]] for g in range(self.num_groups)]
        return layout_string(tuple(stage.replicas for stage in firsts), tuple(stage.tensor_parallel for stage in firsts))

    @property
    def world_size(self) -> int:
        return sum(self.stages[self.chunks_of_group(g)[0]].num_devices for g in range(self.num_groups))

    @property
    def num_groups(self) -> int:
        """Device groups: one per stage, or under virtual stages one per ``virtual_stages`` chunks."""
        return len(self.stages) // self.virtual_stages

    @property
    def chunk_layout(self) -> str | None:
        """How the chunks lie on the groups: ``"loop"`` or ``"v"`` (fxpipe.core.virtual); None without virtual stages."""
        return chunk_layout_of(self.chunk_groups, self.virtual_stages) if self.chunk_groups else None

    def group_of_chunk(self, chunk_index: int) -> int:
        """The device group that runs chunk (stage) ``chunk_index``."""
        if not 0 <= chunk_index < len(self.stages):
            raise PlanError(f"chunk {chunk_index} is not in this plan (chunks 0..{len(self.stages) - 1})")
        return self.chunk_groups[chunk_index] if self.chunk_groups else chunk_index

    def chunks_of_group(self, group_index: int) -> tuple[int, ...]:
        """The chunks (stage indices) device group ``group_index`` runs, in model order."""
        if not 0 <= group_index < self.num_groups:
            raise PlanError(f"group {group_index} is not in this plan (groups 0..{self.num_groups - 1})")
        if not self.chunk_groups:
            return (group_index,)
        return tuple(c for c, group in enumerate(self.chunk_groups) if group == group_index)

    def stage_of_device(self, device: int) -> tuple[int, int]:
        """``(stage_index, replica_index)`` of the stage replica that runs on ``device``."""
        for stage in self.stages:  # under virtual stages: the device's first chunk
            if device in stage.devices:
                return stage.stage_index, stage.devices.index(device) // stage.tensor_parallel
        raise PlanError(f"device {device} runs no stage of this plan (devices: {self.all_devices()})")

    def all_devices(self) -> list[int]:
        return sorted({d for stage in self.stages for d in stage.devices})  # chunks of one group share devices

    def with_updates(self, **changes: Any) -> Plan:
        return replace(self, **changes)

    def to_json_dict(self) -> dict[str, Any]:
        data = asdict(self)
        del data["planning_time_s"]
        for stage in data["stages"]:  # absent = 1: plans without tensor parallelism keep their bytes
            if stage["tensor_parallel"] == 1:
                del stage["tensor_parallel"]
            if stage["reshard_after_forward"] is None:  # absent = the level's default
                del stage["reshard_after_forward"]
            for key in ("block_recompute", "block_node_counts"):  # absent = every block as "recompute" says
                if not stage[key]:
                    del stage[key]
        if self.virtual_stages == 1:  # absent = one stage per group: plans without virtual stages keep their bytes
            del data["virtual_stages"], data["chunk_groups"]
        if not self.sequence_parallel:  # absent = False: plans costed without it keep their bytes
            del data["sequence_parallel"]
        data["layout"] = self.layout
        data["baselines"] = {name: asdict(result) for name, result in self.baselines}
        if self.predicted is not None:
            data["predicted"]["peak_memory_bytes"] = [stage.peak_memory_bytes for stage in self.stages]
            data["predicted"]["speedup_over_dp"] = _finite_or_none(self.predicted.speedup_over_dp)
            _utilization_json(data["predicted"], self)
        return data

    def to_json(self) -> str:
        """Deterministic JSON text (sorted keys, fixed indentation)."""
        return json.dumps(self.to_json_dict(), indent=2, sort_keys=True) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @staticmethod
    def from_json(text: str) -> Plan:
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as error:  # JSONDecodeError, an int of too many digits, deep nesting
            raise PlanError(f"plan file is not JSON: {error}") from error
        return plan_from_dict(data)

    @staticmethod
    def load(path: str | Path) -> Plan:
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise PlanError(f"cannot read plan file {str(path)!r}: {error}") from error
        try:
            return Plan.from_json(text)
        except PlanError as error:  # name the file: the message may reach every rank of a launch
            raise PlanError(f"{str(path)!r}: {error}; write plan files with `fxpipe plan ... --json FILE`") from None


def plan_argument_kind(plan: str | Path) -> str:
    """What ``compile(plan=...)`` / ``fxpipe train --plan`` was given: "auto", "markers", "layout" or "file".

    A string that is none of the keywords, not a layout such as ``3:1``/``dp``, not an existing file
    and not shaped like a path (``.json`` suffix or a folder) is a mistake, reported as such rather than
    as a missing plan file.
    """
    if isinstance(plan, Path):
        return "file"
    if plan in PLAN_KEYWORDS:
        return plan
    if LAYOUT_PATTERN.fullmatch(plan):
        return "layout"
    if Path(plan).exists() or plan.endswith(".json") or "/" in plan:
        return "file"
    raise PlanError(f"plan {plan!r} is not 'auto', 'markers', a layout (replica counts joined by ':', such as "
                    "'3:1' or '1:1:1:1', or 'dp') nor an existing plan file; fix the spelling or the path")


def _utilization_json(predicted: dict[str, Any], plan: Plan) -> None:
    """Leave out unknown (0) utilization figures, so plans without them keep their bytes; add the derived MFU
    and tokens/s per device (for readers; not read back) where they are known."""
    for key in ("model_flops_per_sample", "tokens_per_sample", "peak_flops_per_device"):
        if not predicted[key]:
            del predicted[key]
    for key, value in (("mfu", model_flops_utilization(plan)), ("tokens_per_s_per_device", tokens_per_s_per_device(plan))):
        if value is not None:
            predicted[key] = value


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def layout_string(replicas: tuple[int, ...], tensor_parallel: tuple[int, ...] = ()) -> str:
    """``"dp"``, ``"3:1"``; a stage whose replicas are T-way tensor-parallel groups is written ``"RxT"``."""
    degrees = tensor_parallel or (1,) * len(replicas)
    if len(replicas) == 1 and degrees[0] == 1:
        return "dp"
    return ":".join(str(r) if t == 1 else f"{r}x{t}" for r, t in zip(replicas, degrees, strict=True))


def _build(cls: type, data: Any, where: str) -> Any:
    """``cls(**data)`` with every field checked against its annotation (PlanError names ``where.field``)."""
    if not isinstance(data, Mapping):
        raise PlanError(f"{where} must be a JSON object, got {type(data).__name__}")
    hints = field_hints(cls)
    try:
        # keys that are not fields (derived ones such as "layout") are written for readers, not read back
        kwargs = {key: read_field(data, key, hints[key], where) for key in data if key in hints}
    except JSONValueError as error:
        raise PlanError(str(error)) from None
    try:
        return cls(**kwargs)
    except TypeError as error:  # a required field is missing
        raise PlanError(f"{where} is missing fields: {error}") from error


def _baseline(data: Any, where: str) -> BaselineResult:
    result: BaselineResult = _build(BaselineResult, data, where)
    if not result.feasible and result.iteration_time_s == 0.0:  # files written before infeasible meant null
        return replace(result, iteration_time_s=None)
    return result


def plan_from_dict(data: Any) -> Plan:
    if not isinstance(data, Mapping):
        raise PlanError(f"a plan is a JSON object, got {type(data).__name__}")
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        raise PlanError(f"plan format_version {version!r} is not supported; this fxpipe reads {FORMAT_VERSION}")
    stages_data = data.get("stages")
    if not isinstance(stages_data, list) or not stages_data:
        raise PlanError("plan has no 'stages' list")
    stages = tuple(_build(StagePlan, s, f"stages[{i}]") for i, s in enumerate(stages_data))
    predicted_data = data.get("predicted")
    # derived "peak_memory_bytes" and "speedup_over_dp" are not Prediction fields: _build skips them
    predicted = None if predicted_data is None else _build(Prediction, predicted_data, "predicted")
    baselines_data = data.get("baselines") or {}
    if not isinstance(baselines_data, Mapping):
        raise PlanError("plan 'baselines' must be an object keyed by planner name")
    baselines = tuple(
        (name, _baseline(value, f"baselines.{name}")) for name, value in sorted(baselines_data.items())
    )
    rest = {k: v for k, v in data.items() if k not in ("stages", "predicted", "baselines")}
    rest.update(stages=stages, predicted=predicted, baselines=baselines)
    return _build(Plan, rest, "plan")  # type: ignore[no-any-return]


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise PlanError(message)


def validate_plan(plan: Plan) -> None:
    """Check a plan's internal consistency; raises PlanError naming the offending value."""
    for name in ("global_batch_size", "num_microbatches"):
        value = getattr(plan, name)
        _check(isinstance(value, int) and not isinstance(value, bool) and value > 0,
               f"{name} must be a positive integer, got {value!r}")
    _check(plan.global_batch_size % plan.num_microbatches == 0,
           f"global batch {plan.global_batch_size} does not split into {plan.num_microbatches} equal "
           "micro-batches; choose a num_microbatches that divides it")
    _check(isinstance(plan.allreduce_bucket_bytes, int) and plan.allreduce_bucket_bytes >= 0,
           f"allreduce_bucket_bytes must be a non-negative integer (0: allreduce after backward), got "
           f"{plan.allreduce_bucket_bytes!r}")
    _check(plan.precision in PRECISIONS,
           f"precision {plan.precision!r} is unknown; choose one of {sorted(PRECISIONS)}")
    _check(plan.schedule in TRAINING_SCHEDULES,
           f"schedule {plan.schedule!r} is unknown; choose one of {sorted(TRAINING_SCHEDULES)}")
    _check(plan.warmup_policy in WARMUP_POLICIES,
           f"warmup_policy {plan.warmup_policy!r} is unknown; choose one of {WARMUP_POLICIES}")
    _check(len(plan.stages) > 0, "a plan needs at least one stage")
    _check_virtual(plan)
    seen_devices: set[int] = set()
    expected_first = 0
    for index, stage in enumerate(plan.stages):
        _check(stage.stage_index == index, f"stages[{index}] has stage_index {stage.stage_index!r}; use {index}")
        _check(stage.first_block == expected_first,
               f"stage {index} starts at block {stage.first_block}, expected {expected_first} (stages must be "
               "contiguous and in order)")
        _check(stage.stop_block > stage.first_block, f"stage {index} has no blocks "
               f"([{stage.first_block}, {stage.stop_block}))")
        _check(isinstance(stage.tensor_parallel, int) and stage.tensor_parallel >= 1,
               f"stage {index} has tensor_parallel={stage.tensor_parallel!r}; use a positive integer (1: none)")
        _check(stage.replicas >= 1 and len(stage.devices) == stage.replicas * stage.tensor_parallel,
               f"stage {index} has replicas={stage.replicas} x tensor_parallel={stage.tensor_parallel} but "
               f"devices={list(stage.devices)}; list replicas * tensor_parallel devices, one group after another")
        _check(all(isinstance(d, int) and d >= 0 for d in stage.devices),
               f"stage {index} devices must be non-negative integers, got {list(stage.devices)}")
        microbatch_rows = plan.global_batch_size // plan.num_microbatches
        _check(stage.replicas <= microbatch_rows,
               f"stage {index} has {stage.replicas} replicas but a micro-batch has only {microbatch_rows} rows; "
               "use fewer micro-batches or fewer replicas")
        _check(stage.sharding in SHARDING_LEVELS,
               f"stage {index} has sharding {stage.sharding!r}; choose one of {list(SHARDING_LEVELS)}")
        _check(stage.reshard_after_forward in (None, True, False)
               and (stage.reshard_after_forward is None or stage.sharding == "parameters"),
               f"stage {index} has reshard_after_forward={stage.reshard_after_forward!r} at sharding {stage.sharding!r}; "
               "it applies to 'parameters' (ZeRO-3) stages only: true or false, or leave it out")
        _check(stage.sharding == DEFAULT_SHARDING or stage.replicas > 1,
               f"stage {index} has sharding {stage.sharding!r} on 1 replica; a single replica has nothing to split, "
               f"use {DEFAULT_SHARDING!r}")
        problems = block_recompute_problems(index, stage.stop_block - stage.first_block, stage.recompute,
                                            stage.block_recompute, stage.block_node_counts, len(stage.node_names))
        _check(not problems, "; ".join(problems))
        seen_devices.update(stage.devices)
        expected_first = stage.stop_block
    device_problems = shared_device_problems(plan.chunk_groups, [(s.devices, s.replicas, s.tensor_parallel)
                                                                 for s in plan.stages])
    _check(not device_problems, "; ".join(device_problems))
    if plan.num_blocks:
        _check(expected_first == plan.num_blocks,
               f"stages cover blocks [0, {expected_first}) but the chain has {plan.num_blocks} blocks")
    if plan.num_devices:
        _check(len(seen_devices) <= plan.num_devices and max(seen_devices) < plan.num_devices,
               f"plan uses devices {sorted(seen_devices)} but the cluster has {plan.num_devices}")
    for name, result in plan.baselines:
        _check((result.iteration_time_s is None) == (not result.feasible),
               f"baseline {name!r} has feasible={result.feasible} but iteration_time_s={result.iteration_time_s!r}; "
               "an infeasible baseline has no time (None) and a feasible one has a time")


def _check_virtual(plan: Plan) -> None:
    """``virtual_stages`` and ``chunk_groups`` fit the stages and the schedule (fxpipe.core.virtual_fit)."""
    problems = chunk_group_problems(plan.chunk_groups, plan.virtual_stages, len(plan.stages)) or schedule_fit_problems(
        plan.schedule, plan.chunk_groups, plan.virtual_stages, len(plan.stages), plan.num_microbatches)
    _check(not problems, "; ".join(problems))
    # the virtual runtime sums each group's gradients once after its list: a bucketed plan would run unbucketed
    _check(plan.virtual_stages == 1 or not plan.allreduce_bucket_bytes,
           f"allreduce_bucket_bytes={plan.allreduce_bucket_bytes} with virtual_stages={plan.virtual_stages}: gradient "
           "buckets are not supported with virtual stages yet; set allreduce_bucket_bytes to 0 "
           "(docs/virtual_stages.md)")
