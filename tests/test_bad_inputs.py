"""Table-driven bad-input sweep: every parser/validator rejects malformed input with its documented error.

Each row is (id, call, expected exception type, regex the message must match). The regexes ask
for the bad value and, where sensible, the fix. Rows marked ``xfail(strict=True)`` record behaviour
that is wrong today (wrong exception type or an unclear message) in a module this file does not
own; docs/errors.md lists them with the proposed fix. When a fix lands the row starts passing,
strict xfail turns that into a failure, and the mark must be removed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fxpipe import models
from fxpipe.core.chain import ChainError, CostChain, build_chain
from fxpipe.core.cluster import Cluster, ClusterSpecError, compact_cluster, parse_cluster
from fxpipe.core.costgraph import Affine, CostGraph, CostGraphError, CostNode
from fxpipe.core.plan import Plan, PlanError, StagePlan, plan_argument_kind, plan_from_dict
from fxpipe.core.planfile import chain_from_json, load_plan_file
from fxpipe.core.schedule import (
    Action,
    Op,
    Schedule,
    ScheduleError,
    early_backward,
    make_schedule,
    validate_schedule,
)
from fxpipe.models.registry import CallableSpecError, resolve_loss
from fxpipe.passes.markers import MarkerError
from fxpipe.passes.partition.dapple import partition
from fxpipe.passes.partition.request import InfeasiblePlanError, LayoutError, PlanningError
from fxpipe.passes.profiles_io import ProfileFormatError, parse_profile_text, read_profile
from fxpipe.passes.trace_inputs import ExampleInputsTypeError
from fxpipe.passes.tracing import TraceError, trace
from fxpipe.planning import ModelSpecError, load_model, plan_markers
from tests.planner_cases import chain as planner_chain

torch.set_num_threads(1)

Call = Callable[[Path], object]

# ---------------------------------------------------------------------------------------------
# Valid inputs that rows mutate.


def _cluster_json(**top: Any) -> dict[str, Any]:
    data = json.loads(json.dumps(compact_cluster(2, 2, "h100").to_json()))
    data.update(top)
    return data


def _cluster_json_with(section: str, key: str, value: Any) -> dict[str, Any]:
    data = _cluster_json()
    data[section][key] = value
    return data


GOOD_PLAN = Plan(8, 2, (StagePlan(0, 0, 2, 1, (0,)), StagePlan(1, 2, 4, 1, (1,))), num_blocks=4, num_devices=2)


def _plan_json(**top: Any) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(GOOD_PLAN.to_json())
    data.update(top)
    return data


def _plan_json_stage(position: int, **changes: Any) -> dict[str, Any]:
    data = _plan_json()
    data["stages"][position].update(changes)
    return data


def _replicas_exceed_rows() -> dict[str, Any]:
    """8 rows in 8 micro-batches of 1 row, but stage 0 has 2 replicas."""
    data = _plan_json_stage(0, replicas=2, devices=[0, 2])
    data.update(num_microbatches=8, num_devices=3)
    return data


NODE = ("{id} -- layer -- forward_compute_time={fwd}, backward_compute_time=1.0, activation_size={act}, "
        "parameter_size=4.0")


def _node(number: int, fwd: str = "1.0", act: str = "8.0", name: str | None = None) -> str:
    return NODE.format(id=name or f"node{number}", fwd=fwd, act=act)


def _profile(text: str) -> Call:
    return lambda _: parse_profile_text(text, profile_batch_size=1, source="bad.txt")


def _binary_profile(tmp_path: Path) -> object:
    path = tmp_path / "profile.bin"
    path.write_bytes(b"\xff\xfe\x00node1 -- \x80\x81")
    return read_profile(path, profile_batch_size=1)


def _binary_file(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.write_bytes(b"\xff\xfe\x00{\x80")
    return path


def _plan_file(tmp_path: Path, data: object) -> object:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return load_plan_file(path)


def _line_chain(num_nodes: int, param_bytes: int = 10**6) -> CostChain:
    nodes = tuple(
        CostNode(f"n{i}", (f"n{i - 1}",) if i else (), forward_s=Affine(0, 1e-3), backward_s=Affine(0, 2e-3),
                 output_bytes=Affine(0, 1e3), saved_bytes=Affine(0, 1e3), param_bytes=param_bytes)
        for i in range(num_nodes)
    )
    return build_chain(CostGraph(nodes))


def _plan_tiny(**options: Any) -> object:
    chain = _line_chain(4, options.pop("param_bytes", 10**6))
    return partition(chain, parse_cluster("1x4:v100"), options.pop("global_batch_size", 16), **options)


def _deadlocked_schedule() -> Schedule:
    f, b = Op.FORWARD, Op.BACKWARD
    stage0 = (Action(f, 0), Action(b, 0), Action(f, 1), Action(b, 1))
    stage1 = (Action(f, 1), Action(f, 0), Action(b, 0), Action(b, 1))
    return Schedule("bad", 2, 2, (stage0, stage1))


class _TwoInputs(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y


class _Branchy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent control flow: fx cannot trace it
            return x
        return -x


class _WithBranchyChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Branchy()
        self.proj = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.proj(x))


# ---------------------------------------------------------------------------------------------
# The table.


ROWS: list[Any] = [
    # --- cluster specs (fxpipe.core.cluster.parse_cluster / Cluster.from_json)
    ("cluster-bad-grammar", lambda _: parse_cluster("4y8:h100"), ClusterSpecError,
     r"'4y8:h100' is not a preset, a HOSTSxDEVICES:KIND spec.*cluster spec grammar"),
    ("cluster-unknown-device-kind", lambda _: parse_cluster("4x8:tpu"), ClusterSpecError,
     r"device kind 'tpu' is unknown; choose one of \[.*'h100'"),
    ("cluster-zero-hosts", lambda _: parse_cluster("0x8:h100"), ClusterSpecError,
     r"'0x8:h100' needs at least 1 host and 1 device per host"),
    ("cluster-bad-bandwidth-unit", lambda _: parse_cluster("4x8:h100,intra=450furlongs"), ClusterSpecError,
     r"'intra=450furlongs' has an unknown bandwidth unit 'furlongs'.*units: .*gb/s"),
    ("cluster-bytes-unit-for-bandwidth", lambda _: parse_cluster("4x8:h100,inter=50GB"), ClusterSpecError,
     r"unknown bandwidth unit 'GB'.*gb/s"),
    ("cluster-unknown-override-key", lambda _: parse_cluster("4x8:h100,speed=1GB/s"), ClusterSpecError,
     r"unknown key 'speed'; keys: intra, inter, collective, memory"),
    ("cluster-empty-spec", lambda _: parse_cluster("  "), ClusterSpecError, r"'  ' is empty"),
    ("cluster-json-missing-key", lambda _: Cluster.from_json({"format_version": 1}), ClusterSpecError,
     r"needs key 'device'"),
    ("cluster-json-format-version", lambda _: Cluster.from_json(_cluster_json(format_version=9)), ClusterSpecError,
     r"format_version 9 is unknown; expected 1"),
    pytest.param(
        "cluster-json-zero-bandwidth",
        lambda _: Cluster.from_json(_cluster_json_with("intra_host", "bandwidth_bytes_per_s", 0)),
        ClusterSpecError, r"bandwidth.*0",
    ),
    pytest.param(
        "cluster-json-zero-hosts", lambda _: Cluster.from_json(_cluster_json(num_hosts=0)),
        ClusterSpecError, r"num_hosts 0 must be positive",
    ),
    pytest.param(
        "cluster-json-bool-hosts", lambda _: Cluster.from_json(_cluster_json(num_hosts=True)),
        ClusterSpecError, r"num_hosts.*True",
    ),
    pytest.param(
        "cluster-json-non-numeric-flops",
        lambda _: Cluster.from_json(_cluster_json_with("device", "peak_flops", {"float32": "fast"})),
        ClusterSpecError, r"peak_flops.*'fast'",
    ),
    pytest.param(
        "cluster-json-infinite-memory",
        lambda _: Cluster.from_json(_cluster_json_with("device", "memory_bytes", float("inf"))),
        ClusterSpecError, r"memory_bytes.*inf",
    ),
    pytest.param(
        "cluster-memory-overflow", lambda _: parse_cluster("1x1:h100,memory=1e400GB"), ClusterSpecError,
        r"'memory=1e400GB' is too large",
    ),
    pytest.param(
        "cluster-bandwidth-decimal-overflow", lambda _: parse_cluster("1x1:h100,intra=1e999999GB/s"),
        ClusterSpecError, r"'intra=1e999999GB/s' is too large",
    ),
    pytest.param(
        "cluster-bandwidth-underflow", lambda _: parse_cluster("dapple-a,intra=1e-400GB/s"), ClusterSpecError,
        r"'intra=1e-400GB/s' must be positive \(it is 0 B/s\)",
    ),
    pytest.param(
        "cluster-negative-latency", lambda _: parse_cluster("4x8:h100,intra=450GB/s@-5us"), ClusterSpecError,
        r"'intra=450GB/s@-5us'.*latency like \d+(ns|us|ms|s)\b",
    ),
    pytest.param(
        "cluster-zero-memory", lambda _: parse_cluster("4x8:h100,memory=0GB"), ClusterSpecError,
        r"'memory=0GB'.*must be positive",
    ),
    ("cluster-file-binary", lambda tmp: parse_cluster(str(_binary_file(tmp, "c.json"))), ClusterSpecError,
     r"cannot read cluster file '.*c\.json' as text"),
    ("cluster-unknown-home", lambda _: parse_cluster("~0"), ClusterSpecError, r"'~0' is not a preset"),
    # --- plan JSON (fxpipe.core.plan)
    ("plan-not-json", lambda _: Plan.from_json("{stages: ["), PlanError, r"plan file is not JSON: Expecting"),
    ("plan-format-version", lambda _: plan_from_dict(_plan_json(format_version=2)), PlanError,
     r"format_version 2 is not supported; this fxpipe reads 1"),
    ("plan-overlapping-devices", lambda _: plan_from_dict(_plan_json_stage(1, devices=[0])), PlanError,
     r"devices \[0\] are assigned to more than one stage"),
    ("plan-non-contiguous-stages", lambda _: plan_from_dict(_plan_json_stage(1, first_block=3)), PlanError,
     r"stage 1 starts at block 3, expected 2 \(stages must be contiguous"),
    ("plan-batch-not-dividing", lambda _: plan_from_dict(_plan_json(num_microbatches=3)), PlanError,
     r"global batch 8 does not split into 3 equal micro-batches; choose a num_microbatches that divides it"),
    ("plan-replicas-exceed-rows", lambda _: plan_from_dict(_replicas_exceed_rows()), PlanError,
     r"stage 0 has 2 replicas but a micro-batch has only 1 rows; use fewer micro-batches or fewer replicas"),
    ("plan-no-stages", lambda _: plan_from_dict(_plan_json(stages=[])), PlanError, r"plan has no 'stages' list"),
    ("plan-file-missing", lambda tmp: load_plan_file(tmp / "absent.json"), PlanError,
     r"cannot read plan file '.*absent\.json'"),
    ("plan-file-chain-malformed", lambda tmp: _plan_file(tmp, {**_plan_json(), "cost_chain": {}}), PlanError,
     r"'cost_chain' is malformed: KeyError\('blocks'\)"),
    pytest.param(
        "plan-stage-not-object", lambda _: plan_from_dict(_plan_json(stages=[1])), PlanError,
        r"stages\[0\] must be a JSON object, got int",
    ),
    pytest.param(
        "plan-predicted-not-object", lambda _: plan_from_dict(_plan_json(predicted=[1.0])), PlanError,
        r"predicted must be a JSON object, got list",
    ),
    pytest.param(
        "plan-devices-not-list", lambda _: plan_from_dict(_plan_json_stage(0, devices=5)), PlanError,
        r"stages\[0\].*devices.*5",
    ),
    pytest.param(
        "plan-replicas-string", lambda _: plan_from_dict(_plan_json_stage(0, replicas="1")), PlanError,
        r"replicas.*'1'",
    ),
    pytest.param(
        "plan-stage-index-string", lambda _: plan_from_dict(_plan_json_stage(0, stage_index="0")), PlanError,
        r"stage_index '0'",
    ),
    pytest.param(
        "plan-bool-batch", lambda _: plan_from_dict(_plan_json(global_batch_size=True, num_microbatches=True)),
        PlanError, r"plan\.global_batch_size True must be an integer",
    ),
    ("plan-bool-batch-constructor", lambda _: Plan(True, 1, (StagePlan(0, 0, 1, 1, (0,)),)), PlanError,
     r"global_batch_size must be a positive integer, got True"),
    pytest.param(
        "plan-prediction-not-number",
        lambda _: plan_from_dict(_plan_json(predicted={"iteration_time_s": 1.0, "throughput_samples_per_s": 8.0,
                                                       "dp_iteration_time_s": ""})),
        PlanError, r"predicted\.dp_iteration_time_s.*''",
    ),
    ("plan-file-binary", lambda tmp: load_plan_file(_binary_file(tmp, "p.json")), PlanError,
     r"cannot read plan file '.*p\.json'"),
    ("plan-deeply-nested", lambda _: Plan.from_json("[" * 100_000), PlanError, r"plan file is not JSON"),
    # --- cost chains and Affine costs in plan files (fxpipe.core.planfile, fxpipe.core.costgraph)
    ("affine-wrong-shape", lambda _: Affine.from_json([1.0]), ValueError,
     r"an Affine cost is \[fixed, per_sample\]; got \[1\.0\]"),
    pytest.param(
        "affine-not-finite", lambda _: Affine.from_json([float("nan"), 0.0]), ValueError, r"finite.*nan",
    ),
    pytest.param(
        "chain-infinite-param-bytes",
        lambda _: chain_from_json({"blocks": [{"name": "b", "node_names": [], "forward_s": [0, 0],
                                               "backward_s": [0, 0], "param_bytes": float("inf"),
                                               "saved_bytes": [0, 0]}],
                                   "cut_bytes": [], "input_bytes": [0, 0], "output_bytes": [0, 0]}),
        PlanError, r"param_bytes|malformed",
    ),
    # --- profile files (fxpipe.passes.profiles_io)
    ("profile-missing-fields", _profile("node1 -- a -- forward_compute_time=1, backward_compute_time=1"),
     ProfileFormatError, r"bad\.txt:1: is neither a node line .*parameter_size=\.\.\."),
    ("profile-cycle", _profile(f"{_node(1)}\n{_node(2)}\n\tnode1 -- node2\n\tnode2 -- node1"),
     ProfileFormatError, r"bad\.txt:4: edges form a cycle: node1 -> node2 -> node1"),
    ("profile-dangling-edge", _profile(f"{_node(1)}\n\tnode1 -- node2"), ProfileFormatError,
     r"bad\.txt:2: edge refers to node2, which has no node line"),
    ("profile-non-numeric-time", _profile(_node(1, fwd="fast")), ProfileFormatError,
     r"bad\.txt:1: forward_compute_time 'fast' is not a number"),
    ("profile-negative-activation", _profile(_node(1, act="-8")), ProfileFormatError,
     r"activation_size '-8' must be a finite number >= 0"),
    ("profile-duplicate-node", _profile(f"{_node(1)}\n{_node(1)}"), ProfileFormatError,
     r"bad\.txt:2: node1 is defined twice \(first on line 1\)"),
    ("profile-empty", _profile("\n\n"), ProfileFormatError, r"no node lines found"),
    ("profile-batch-size-zero", lambda _: parse_profile_text(_node(1), profile_batch_size=0), ValueError,
     r"profile_batch_size must be >= 1; got 0"),
    pytest.param(
        "profile-activation-sum-overflows", _profile(_node(1, act="[1e308; 1e308]")), ProfileFormatError,
        r"bad\.txt:1: activation_size",
    ),
    pytest.param(
        "profile-huge-node-id", _profile(_node(1, name="node" + "9" * 5000)), ProfileFormatError,
        r"bad\.txt:1:",
    ),
    pytest.param(
        "profile-binary-file", _binary_profile, ProfileFormatError, r"profile\.bin.*(UTF-8|text)",
    ),
    ("profile-missing-file", lambda tmp: read_profile(tmp / "absent.txt", profile_batch_size=1), ProfileFormatError,
     r"absent\.txt: cannot read the profile file"),
    # --- cost graphs (fxpipe.core.costgraph) and chains (fxpipe.core.chain)
    ("costgraph-unknown-input", lambda _: CostGraph((CostNode("a", ("ghost",)),)), CostGraphError,
     r"node 'a' reads 'ghost', which is not an earlier node; nodes must be in topological order"),
    ("costgraph-negative-cost", lambda _: CostGraph((CostNode("a", forward_s=Affine(-1.0, 0.0)),)),
     CostGraphError, r"node 'a' has a negative forward_s: Affine\(fixed=-1\.0"),
    ("costgraph-duplicate-name", lambda _: CostGraph((CostNode("a"), CostNode("a"))), CostGraphError,
     r"duplicate node name 'a'"),
    ("costgraph-non-finite", lambda _: CostGraph((CostNode("a", saved_bytes=Affine(0.0, float("inf"))),)),
     CostGraphError, r"node 'a' has a non-finite saved_bytes"),
    ("chain-empty-graph", lambda _: build_chain(CostGraph(())), ChainError, r"empty cost graph"),
    ("chain-zero-max-blocks", lambda _: build_chain(CostGraph((CostNode("a"),)), max_blocks=0), ChainError,
     r"max_blocks must be >= 1 \(or None for no limit\); got 0"),
    # --- schedules (fxpipe.core.schedule)
    ("schedule-unknown-name", lambda _: make_schedule("zigzag", 2, 4), ScheduleError,
     r"schedule 'zigzag' is unknown; choose 'early_backward'.*'gpipe'"),
    ("schedule-zero-microbatches", lambda _: make_schedule("gpipe", 2, 0), ScheduleError,
     r">= 1 micro-batch; got S=2, M=0"),
    ("schedule-unknown-warmup", lambda _: early_backward(2, 4, "C"), ScheduleError,
     r"warm-up policy 'C' is unknown; choose 'A' or 'B'"),
    ("schedule-validate-stage-count",
     lambda _: validate_schedule(Schedule("x", 2, 1, ((Action(Op.FORWARD, 0), Action(Op.BACKWARD, 0)),))),
     ScheduleError, r"num_stages is 2 but per_stage has 1 lists"),
    ("schedule-validate-backward-first",
     lambda _: validate_schedule(Schedule("x", 1, 1, ((Action(Op.BACKWARD, 0), Action(Op.FORWARD, 0)),))),
     ScheduleError, r"stage 0: step 0 runs B0 before F0"),
    ("schedule-validate-deadlock", lambda _: validate_schedule(_deadlocked_schedule()), ScheduleError,
     r"deadlock: stage 0 waits at step 1 \(B0\)"),
    # --- planner (fxpipe.passes.partition.dapple)
    ("planner-unknown", lambda _: _plan_tiny(planner="magic"), PlanningError,
     r"planner 'magic' is unknown; choose one of \[.*'dapple'"),
    ("planner-malformed-layout", lambda _: _plan_tiny(layout="3-1"), LayoutError,
     r"layout '3-1' is malformed: use replica counts separated by ':'"),
    ("planner-layout-too-many-devices", lambda _: _plan_tiny(layout="3:3"), LayoutError,
     r"layout '3:3' needs 6 devices but the cluster has 4"),
    ("planner-layout-not-a-string", lambda _: _plan_tiny(layout=(3, 1)), LayoutError,
     r"layout must be a string such as '3:1' .* got \(3, 1\) \(tuple\): pass layout='3:1'"),
    ("planner-layout-unicode-digit", lambda _: _plan_tiny(layout="1:\u00b2"), LayoutError,
     r"layout '1:\u00b2' is malformed"),
    ("planner-infeasible-memory", lambda _: _plan_tiny(param_bytes=10**11), InfeasiblePlanError,
     r"no plan for global batch 16 fits in 16\.00 GiB per device"),
    ("planner-fewer-microbatches-than-stages", lambda _: _plan_tiny(layout="1:1:1:1", num_microbatches=2),
     PlanningError, r"num_microbatches=2 is fewer than the 4 stages .*M >= S"),
    ("planner-batch-not-dividing", lambda _: _plan_tiny(num_microbatches=3), PlanningError,
     r"global batch 16 does not divide into num_microbatches=3 .*choose a divisor of 16"),
    ("planner-recompute-unknown", lambda _: _plan_tiny(recompute="sometimes"), PlanningError,
     r"recompute='sometimes' is unknown; choose one of \('auto', 'never', 'always', 'selective'\)"),
    ("planner-recompute-per-stage-free-layout", lambda _: _plan_tiny(recompute="keep,recompute"), PlanningError,
     r"per-stage choices \(False, True\) but the stage count is the planner's choice; force a layout"),
    ("planner-recompute-per-stage-length", lambda _: _plan_tiny(layout="1:1", recompute=[True]), PlanningError,
     r"recompute gives 1 per-stage choices but the plan has 2 stages"),
    ("planner-zero-batch", lambda _: _plan_tiny(global_batch_size=0), PlanningError,
     r"global_batch_size must be (a )?positive( integer)?, got 0"),
    ("planner-layout-deeper-than-cuttable-blocks",
     lambda _: partition(planner_chain([1.0] * 4, [10**6, 0, 10**6, 0]), parse_cluster("1x4:v100"), 16,
                         layout="1:1:1"),
     LayoutError, r"layout '1:1:1' has 3 stages but the model has only 2 cuttable block.*use at most 2 stages"),
    ("planner-fixed-stages-other-planner", lambda _: _plan_tiny(planner="gpipe", num_stages=2), PlanningError,
     r"planner 'gpipe' cannot keep fixed cuts \(num_stages=2\); use 'dapple'"),
    ("plan-argument-misspelled-layout", lambda _: plan_argument_kind("2-1"), PlanError,
     r"plan '2-1' is not 'auto', 'markers', a layout .* nor an existing plan file"),
    ("plan-markers-without-markers", lambda _: plan_markers(nn.Linear(2, 2), (torch.ones(1, 2),),
                                                            parse_cluster("1x4:v100"), 4),
     MarkerError, r"calls no pipe_split\(\)"),
    ("model-factory-returns-module", lambda _: load_model("tests.test_bad_inputs:_TwoInputs"), ModelSpecError,
     r"factory 'tests.test_bad_inputs:_TwoInputs' must return \(nn.Module, example_inputs\), got _TwoInputs"),
    ("model-factory-missing-module", lambda _: load_model("no_such_models:build"), CallableSpecError,
     r"cannot import 'no_such_models' for model factory 'no_such_models:build'.*PYTHONPATH"),
    ("loss-unknown-name", lambda _: resolve_loss("hinge"), CallableSpecError,
     r"loss 'hinge' is unknown; use one of \['cross_entropy', 'mse'\] or 'package.module:function'"),
    # --- model zoo (fxpipe.models)
    ("model-unknown", lambda _: models.build("gpt-mimi", device="meta"), models.UnknownModelError,
     r"unknown model 'gpt-mimi'\. Did you mean 'gpt-mini'\? Known models: "),
    ("model-unknown-override", lambda _: models.build("gpt-mini", device="meta", n_layers=3), ValueError,
     r"unknown override\(s\) \['n_layers'\] for GPTConfig; valid keys: .*'n_layer'"),
    # --- tracing (fxpipe.passes.tracing)
    ("trace-bad-example-type", lambda _: trace(nn.Linear(2, 2), 3), ExampleInputsTypeError,
     r"example_inputs is a int; accepted forms: a Tensor"),
    ("trace-unknown-keyword", lambda _: trace(nn.Linear(2, 2), {"x": torch.ones(1, 2)}), ExampleInputsTypeError,
     r"example_inputs has key 'x', which is not a parameter of forward\(\) \['input'\]"),
    ("trace-missing-required-input", lambda _: trace(_TwoInputs(), (torch.ones(1),)), ExampleInputsTypeError,
     r"no value for forward\(\)'s required parameter 'y'"),
    ("trace-unknown-frontend", lambda _: trace(nn.Linear(2, 2), torch.ones(1, 2), frontend="jit"), ValueError,
     r"frontend='jit' is not one of \('auto', 'fx', 'export'\)"),
    ("trace-fx-control-flow-in-child", lambda _: trace(_WithBranchyChild(), torch.ones(1, 2), frontend="fx"),
     TraceError, r"torch\.fx could not trace .*inner.*leaf_modules=\[.*'inner'\]"),
    ("trace-fx-control-flow-at-root", lambda _: trace(_Branchy(), torch.ones(1, 2), frontend="fx"), TraceError,
     r"torch\.fx could not trace <root> \(_Branchy\).*Fix: .*torch\.(where|cond).*frontend='auto'"),
]


def _row_id(row: Any) -> str:
    return str(row.values[0] if hasattr(row, "values") else row[0])


def test_table_is_large_and_ids_are_unique() -> None:
    ids = [_row_id(row) for row in ROWS]
    assert len(ids) >= 15
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)


@pytest.mark.parametrize(("row_id", "call", "error", "pattern"), ROWS, ids=[_row_id(row) for row in ROWS])
def test_bad_input_is_rejected_with_a_clear_error(row_id: str, call: Call, error: type[BaseException],
                                                  pattern: str, tmp_path: Path) -> None:
    with pytest.raises(error) as caught:
        call(tmp_path)
    message = str(caught.value)
    assert re.search(pattern, message, re.DOTALL), f"{row_id}: {type(caught.value).__name__}: {message}"
