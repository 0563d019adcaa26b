"""Property-based fuzzing of every parser: only documented errors escape, and valid inputs round-trip.

Each parser gets arbitrary text, JSON-like values or mutated valid inputs. An escaping exception must
be one of the types docs/errors.md lists for that parser. Crashes found so far are listed in
``KNOWN_*`` as (type, message regex) so the fuzzers keep hunting for new ones; each has a strict-xfail
reproducer in tests/test_bad_inputs.py or at the end of this file. When a parser is fixed, its
reproducer XPASSes (a failure under strict xfail): delete the entry here and the xfail mark there.
"""

from __future__ import annotations

import copy
import json
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

from fxpipe import models
from fxpipe.core.chain import Block, ChainError, CostChain, SharedParam, build_chain
from fxpipe.core.cluster import Cluster, ClusterSpecError, compact_cluster, parse_cluster
from fxpipe.core.costgraph import Affine, CostGraph, CostGraphError, CostNode
from fxpipe.core.plan import BaselineResult, Plan, PlanError, Prediction, StagePlan, plan_from_dict
from fxpipe.core.planfile import chain_from_json, chain_to_json, load_plan_file, save_plan_file
from fxpipe.core.recompute import RECOMPUTE_MODES, RecomputeError, parse_recompute
from fxpipe.core.schedule import Action, Op, Schedule, ScheduleError, make_schedule, validate_schedule
from fxpipe.passes.partition.dapple import parse_layout
from fxpipe.passes.partition.request import LayoutError, PlanningError, PlanRequest, check_request
from fxpipe.passes.profiles_io import ProfileFormatError, parse_profile_text
from fxpipe.passes.trace_inputs import ExampleInputsTypeError
from fxpipe.passes.tracing import TraceError, trace

torch.set_num_threads(1)
# FXPIPE_FUZZ_SCALE=10 runs ten times more examples (a longer local hunt); CI keeps the default.
_SCALE = float(os.environ.get("FXPIPE_FUZZ_SCALE", "1"))
# Under CI the examples are derandomized, so a submission's verdict does not depend on luck;
# local runs explore new inputs every time (that is how the NUL-byte path crash was found).
FUZZ = settings(max_examples=int(200 * _SCALE), deadline=None, suppress_health_check=[HealthCheck.too_slow],
                derandomize=bool(os.environ.get("CI")))
# Structured strategies (graphs, plans, files, tracing) cost more per example.
FUZZ_SLOW = settings(FUZZ, max_examples=int(80 * _SCALE))
T = TypeVar("T")
Known = tuple[tuple[type[BaseException], str], ...]

# Known escapes (type, message regex); reproducers: tests/test_bad_inputs.py rows named in the comment.


def _call(function: Callable[[], T], allowed: tuple[type[BaseException], ...], known: Known = ()) -> T | None:
    """``function()``; None when it raised an allowed type or a known escape; anything else propagates."""
    try:
        return function()
    except allowed:
        return None
    except Exception as error:
        if any(isinstance(error, kind) and re.search(pattern, f"{type(error).__name__} {error}")
               for kind, pattern in known):
            return None
        raise


# ---------------------------------------------------------------------------------------------
# Strategies.

json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
edge_values = st.sampled_from([0, -1, 1, 2**63, 0.5, -0.0, float("nan"), float("inf"), "", "1", True, False,
                               None, [], {}, [0], {"a": 1}])


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += _paths(item, (*prefix, index))
    return found


@st.composite
def mutated(draw: st.DrawFn, valid: Any, num_edits: int = 3) -> Any:
    """``valid`` (JSON-like) with up to ``num_edits`` values replaced, deleted or given edge values."""
    data = json.loads(json.dumps(valid))
    for _ in range(draw(st.integers(1, num_edits))):
        path = draw(st.sampled_from(_paths(data)))
        if not path:
            data = copy.deepcopy(draw(json_values | edge_values))
            continue
        parent = data
        for key in path[:-1]:
            parent = parent[key]
        if draw(st.booleans()) and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = copy.deepcopy(draw(edge_values | json_values))  # never edit a shared [] or {}
    return data


finite = st.floats(0, 1e6, allow_nan=False, allow_infinity=False)
affines = st.builds(Affine, finite, finite)
names = st.text(max_size=8)
KINDS = ("v100", "a100", "h100", "h200", "cpu", "V100-16GB", "tpu", "")
BANDWIDTH_UNITS = ("GB/s", "gb/s", "Gb/s", "Gbps", "MiB/s", "B/s", "tbps", "GB", "furlongs", "")
TIME_UNITS = ("s", "ms", "us", "ns", "GB/s", "")
SIZE_UNITS = ("GB", "GiB", "MB", "B", "tib", "GB/s", "")
numbers = (st.integers(0, 10**6).map(str) | finite.map(repr)
           | st.sampled_from(["-1", "0", ".5", "5.", "1e3", "1e400", "1e-400", "1e999999", "nan", "x", ""]))


@st.composite
def cluster_specs(draw: st.DrawFn) -> str:
    base = draw(st.sampled_from(["dapple-a", "dapple-b", "DAPPLE-C", "dgx-h100", "local", "compact", "junk"]))
    if base in ("dgx-h100", "local") and draw(st.booleans()):
        base += f":{draw(st.integers(0, 4))}"
    elif base == "compact":
        base = f"{draw(st.integers(0, 4))}x{draw(st.integers(0, 8))}:{draw(st.sampled_from(KINDS))}"
    elif base == "junk":
        base = draw(st.text(max_size=12))
    parts = [base]
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from(["intra", "inter", "collective", "memory", "INTRA", "speed", ""]))
        if key.lower() == "memory":
            value = draw(numbers) + draw(st.sampled_from(SIZE_UNITS))
        else:
            value = draw(numbers) + draw(st.sampled_from(BANDWIDTH_UNITS))
            if draw(st.booleans()):
                value += "@" + draw(numbers) + draw(st.sampled_from(TIME_UNITS))
        parts.append(f"{key}{draw(st.sampled_from(['=', '=', ':', '']))}{value}")
    return ",".join(parts)


@st.composite
def valid_plans(draw: st.DrawFn) -> Plan:
    replicas = draw(st.lists(st.integers(1, 3), min_size=1, max_size=4))
    devices = draw(st.permutations(range(sum(replicas) + draw(st.integers(0, 2)))))
    sizes = draw(st.lists(st.integers(1, 3), min_size=len(replicas), max_size=len(replicas)))
    stages, first, used = [], 0, 0
    for index, (count, size) in enumerate(zip(replicas, sizes, strict=True)):
        stages.append(StagePlan(index, first, first + size, count, tuple(devices[used:used + count]),
                                node_names=tuple(draw(st.lists(names, max_size=2))), forward_s=draw(finite),
                                peak_memory_bytes=draw(st.integers(0, 2**40))))
        first, used = first + size, used + count
    num_microbatches = draw(st.integers(1, 8))
    predicted = draw(st.none() | st.builds(Prediction, finite, finite, finite, finite, finite))
    baselines = draw(st.dictionaries(st.sampled_from(["gpipe", "dp", "pipedream"]),
                                     st.builds(BaselineResult, names, finite, st.integers(0, 8), st.just(True), names)
                                     | st.builds(BaselineResult, names, st.none(), st.integers(0, 8), st.just(False),
                                                 names),
                                     max_size=2))
    return Plan(num_microbatches * draw(st.integers(max(replicas), 6)), num_microbatches, tuple(stages),
                schedule=draw(st.sampled_from(["early_backward", "gpipe"])), warmup_policy=draw(st.sampled_from("AB")),
                planner=draw(names), model=draw(names), num_devices=len(devices) * draw(st.integers(0, 1)),
                num_blocks=first * draw(st.integers(0, 1)), block_names=tuple(draw(st.lists(names, max_size=3))),
                predicted=predicted, planning_time_s=draw(finite), baselines=tuple(sorted(baselines.items())),
                notes=tuple(draw(st.lists(names, max_size=2))))


@st.composite
def chains(draw: st.DrawFn) -> CostChain:
    num_blocks = draw(st.integers(1, 5))
    blocks = tuple(Block(draw(names), tuple(draw(st.lists(names, max_size=3))), draw(affines), draw(affines),
                         draw(st.integers(0, 2**50)), draw(affines)) for _ in range(num_blocks))
    cuts = tuple(draw(affines) for _ in range(num_blocks - 1))
    shared = tuple(SharedParam(draw(names), draw(st.integers(0, 2**40)), tuple(sorted(blocks_read)))
                   for blocks_read in draw(st.lists(st.sets(st.integers(0, num_blocks - 1), min_size=2), max_size=2))
                   ) if num_blocks >= 2 else ()
    return CostChain(blocks, cuts, draw(affines), draw(affines), draw(names), shared)


@st.composite
def clusters(draw: st.DrawFn) -> Cluster:
    kind = draw(st.sampled_from(["v100", "a100", "h100", "h200"]))
    spec = f"{draw(st.integers(1, 4))}x{draw(st.integers(1, 8))}:{kind}"
    if draw(st.booleans()):
        spec += f",inter={draw(st.integers(1, 400))}Gbps@{draw(st.integers(0, 50))}us"
    return parse_cluster(spec)


@st.composite
def cost_graphs(draw: st.DrawFn, valid: bool = True) -> CostGraph:
    """Topologically ordered graphs (``valid``) or nodes with any names, inputs and costs."""
    costs = affines if valid else st.builds(Affine, st.floats(), st.floats())
    count = draw(st.integers(0 if not valid else 1, 8))
    nodes = []
    for index in range(count):
        earlier = [f"n{i}" for i in range(index)]
        pool = earlier if valid else [*earlier, "n0", "ghost", f"n{index}"]
        inputs = tuple(draw(st.lists(st.sampled_from(pool), unique=True, max_size=3))) if pool else ()
        nodes.append(CostNode(f"n{index}" if valid else draw(st.sampled_from(["n0", "n1", f"n{index}"])), inputs,
                              forward_s=draw(costs), backward_s=draw(costs), output_bytes=draw(costs),
                              saved_bytes=draw(costs), param_bytes=draw(st.integers(0 if valid else -5, 2**40)),
                              module_path=draw(st.sampled_from(["", "a", "a.b", "c"])),
                              tensor_output=draw(st.booleans())))
    return CostGraph(tuple(nodes))


VALID_PROFILE = """node1 -- Input -- forward_compute_time=0.1, backward_compute_time=0.0, activation_size=64.0, parameter_size=0.0
node2 -- Linear(a, b) -- forward_compute_time=2.5, backward_compute_time=5.0, activation_size=[32.0; 32.0], parameter_size=4096.0
node3 -- Loss -- forward_compute_time=0.5, backward_compute_time=0.5, activation_size=4.0, parameter_size=0.0
\tnode1 -- node2
\tnode2 -- node3
\tnode1 -- node3
"""
PROFILE_ALPHABET = "node0123456789 -\t\n,=[];.eanif_tcompsz"


@st.composite
def mutated_text(draw: st.DrawFn, text: str, alphabet: str, num_edits: int = 4) -> str:
    chars = list(text)
    for _ in range(draw(st.integers(1, num_edits))):
        position = draw(st.integers(0, len(chars)))
        action = draw(st.sampled_from(["insert", "delete", "replace"]))
        if action == "insert" or position == len(chars):
            chars.insert(position, draw(st.sampled_from(alphabet)))
        elif action == "delete":
            del chars[position]
        else:
            chars[position] = draw(st.sampled_from(alphabet))
    return "".join(chars)


@st.composite
def profile_texts(draw: st.DrawFn) -> str:
    lines = []
    for _ in range(draw(st.integers(0, 5))):
        fields = [draw(numbers) for _ in range(4)]
        if draw(st.booleans()):
            fields[2] = "[" + "; ".join(draw(st.lists(numbers, max_size=3))) + "]"
        lines.append(f"node{draw(st.integers(0, 6))} -- {draw(st.text(max_size=6))} -- forward_compute_time="
                     f"{fields[0]}, backward_compute_time={fields[1]}, activation_size={fields[2]}, "
                     f"parameter_size={fields[3]}")
    for _ in range(draw(st.integers(0, 6))):
        lines.append(f"\tnode{draw(st.integers(0, 6))} -- node{draw(st.integers(0, 6))}")
    return "\n".join(draw(st.permutations(lines)))


# ---------------------------------------------------------------------------------------------
# Cluster specs and cluster JSON.


def _cluster_round_trips(cluster: Cluster) -> None:
    text = json.dumps(cluster.to_json(), sort_keys=True)
    again = Cluster.from_json(json.loads(text))
    assert again == cluster
    assert json.dumps(again.to_json(), sort_keys=True) == text


@FUZZ
@given(st.text(max_size=40) | cluster_specs())
@example("~\x00")  # a NUL byte in a path-like spec once escaped as a bare ValueError
def test_parse_cluster_raises_only_cluster_spec_error(spec: str) -> None:
    cluster = _call(lambda: parse_cluster(spec, calibrate=False), (ClusterSpecError,))
    if cluster is not None:
        assert cluster.num_devices >= 1
        assert cluster.intra_host.bandwidth_bytes_per_s > 0 and cluster.inter_host.bandwidth_bytes_per_s > 0
        _cluster_round_trips(cluster)


@FUZZ
@given(json_values | mutated(compact_cluster(2, 4, "a100").to_json()) | mutated(parse_cluster("dapple-a").to_json()))
def test_cluster_from_json_raises_only_cluster_spec_error(data: Any) -> None:
    _call(lambda: Cluster.from_json(data), (ClusterSpecError,))


@FUZZ
@given(clusters())
def test_cluster_json_round_trips(cluster: Cluster) -> None:
    _cluster_round_trips(cluster)


# ---------------------------------------------------------------------------------------------
# Plans, chains, plan files.

GOOD_PLAN_JSON = json.loads(Plan(8, 2, (StagePlan(0, 0, 2, 1, (0,)), StagePlan(1, 2, 4, 2, (1, 2))),
                                 num_devices=4, num_blocks=4, predicted=Prediction(1.0, 8.0, 0.1, 1.0, 2.0),
                                 baselines=(("dp", BaselineResult("dp", 2.0, 1)),)).to_json())


@FUZZ
@given(st.text(max_size=60))
def test_plan_from_json_text_raises_only_plan_error(text: str) -> None:
    _call(lambda: Plan.from_json(text), (PlanError,))


@FUZZ
@given(json_values | mutated(GOOD_PLAN_JSON))
def test_plan_from_dict_raises_only_plan_error(data: Any) -> None:
    plan = _call(lambda: plan_from_dict(data), (PlanError,))
    if plan is not None:  # whatever parses must serialise and read back the same
        text = plan.to_json()
        assert Plan.from_json(text).to_json() == text


@FUZZ_SLOW
@given(valid_plans())
def test_plan_json_round_trips_byte_identically(plan: Plan) -> None:
    text = plan.to_json()
    again = Plan.from_json(text)
    assert again == plan
    assert again.to_json() == text


@FUZZ
@given(json_values | mutated(chain_to_json(build_chain(CostGraph(
    (CostNode("a", output_bytes=Affine(0, 1), param_names=("w",)), CostNode("b", ("a",), param_names=("w",))),
    shared_params=(("w", 4),)), max_blocks=None))))
def test_chain_from_json_raises_only_plan_error(data: Any) -> None:
    _call(lambda: chain_from_json(data), (PlanError,))


@FUZZ
@given(json_values)
def test_affine_from_json_raises_only_value_error(data: Any) -> None:
    affine = _call(lambda: Affine.from_json(data), (ValueError,))
    if affine is not None:
        assert Affine.from_json(affine.to_json()) == affine or affine.fixed != affine.fixed  # NaN != NaN


@FUZZ
@given(chains())
def test_chain_json_round_trips(chain: CostChain) -> None:
    assert chain_from_json(json.loads(json.dumps(chain_to_json(chain)))) == chain


@FUZZ_SLOW
@given(valid_plans(), chains(), clusters())
def test_plan_file_round_trips(plan: Plan, chain: CostChain, cluster: Cluster) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "plan.json"
        save_plan_file(path, plan, chain, cluster)
        assert load_plan_file(path) == (plan, chain, cluster)


@FUZZ_SLOW
@given(st.text(max_size=80) | json_values.map(json.dumps)
       | mutated({**GOOD_PLAN_JSON, "cost_chain": chain_to_json(CostChain((Block("b", ("n",), Affine(), Affine(), 1),),
                                                                          ())),
                  "cluster_spec": compact_cluster(1, 4, "h100").to_json()}).map(json.dumps))
def test_load_plan_file_raises_only_plan_or_cluster_errors(text: str) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "plan.json"
        path.write_text(text)
        _call(lambda: load_plan_file(path), (PlanError, ClusterSpecError))


# ---------------------------------------------------------------------------------------------
# Profiles, cost graphs, chains.


@FUZZ
@given(st.text(max_size=200) | profile_texts() | mutated_text(VALID_PROFILE, PROFILE_ALPHABET))
def test_parse_profile_text_raises_only_profile_format_error(text: str) -> None:
    graph = _call(lambda: parse_profile_text(text, profile_batch_size=2), (ProfileFormatError,))
    if graph is not None:
        node_ids = {line.split(" -- ")[0] for line in text.splitlines() if line.startswith("node")}
        assert {node.name for node in graph.nodes} == node_ids
        for line in text.splitlines():
            if line[:1].isspace() and " -- " in line and line.strip():
                source, _, destination = line.split()
                assert source in graph.by_name()[destination].inputs


def test_valid_profile_parses() -> None:
    graph = parse_profile_text(VALID_PROFILE, profile_batch_size=2)
    assert [node.name for node in graph.nodes] == ["node1", "node2", "node3"]
    assert graph.by_name()["node3"].inputs == ("node2", "node1")


@FUZZ_SLOW
@given(st.data())
def test_cost_graph_raises_only_cost_graph_error(data: st.DataObject) -> None:
    _call(lambda: data.draw(cost_graphs(valid=False)), (CostGraphError,))


@FUZZ_SLOW
@given(cost_graphs(), st.none() | st.integers(-2, 9), st.floats(0, 1e4))
def test_build_chain_raises_only_chain_error(graph: CostGraph, max_blocks: int | None, balance_rows: float) -> None:
    chain = _call(lambda: build_chain(graph, max_blocks=max_blocks, balance_rows=balance_rows), (ChainError,))
    if chain is None:
        assert max_blocks is not None and max_blocks < 1
        return
    assert [name for block in chain.blocks for name in block.node_names] == [node.name for node in graph.nodes]
    assert max_blocks is None or chain.num_blocks <= max_blocks
    assert len(chain.cut_bytes) == chain.num_blocks - 1
    total = graph.total("forward_s").per_sample
    assert sum(block.forward_s.per_sample for block in chain.blocks) == pytest.approx(total)


# ---------------------------------------------------------------------------------------------
# Schedules, planner arguments, model names, trace inputs.

schedule_names = st.sampled_from(["gpipe", "early_backward", "dapple", "1f1b", "GPipe", ""]) | st.text(max_size=8)


@FUZZ
@given(schedule_names, st.integers(-2, 8), st.integers(-2, 12), st.sampled_from(["A", "B", "C", ""]))
def test_make_schedule_raises_only_schedule_error(name: str, num_stages: int, num_microbatches: int,
                                                  policy: str) -> None:
    schedule = _call(lambda: make_schedule(name, num_stages, num_microbatches, policy), (ScheduleError,))
    if schedule is not None:
        assert (schedule.num_stages, schedule.num_microbatches) == (num_stages, num_microbatches)
        validate_schedule(schedule)


actions = st.builds(Action, st.sampled_from(list(Op)), st.integers(-1, 4))


@FUZZ
@given(st.integers(-1, 3), st.integers(-1, 4), st.lists(st.lists(actions, max_size=10).map(tuple), max_size=4))
def test_validate_schedule_raises_only_schedule_error(num_stages: int, num_microbatches: int,
                                                      per_stage: list[tuple[Action, ...]]) -> None:
    _call(lambda: validate_schedule(Schedule("fuzz", num_stages, num_microbatches, tuple(per_stage))),
          (ScheduleError,))


@FUZZ
@given(st.text(max_size=12) | st.text("0123456789:dpDP \u00b2\u0663x-", max_size=10),
       st.integers(1, 16), st.integers(1, 16))
def test_parse_layout_raises_only_layout_error(layout: str, num_devices: int, num_blocks: int) -> None:
    counts = _call(lambda: parse_layout(layout, num_devices, num_blocks), (LayoutError,), ())
    if counts is not None:
        assert all(count >= 1 for count in counts) and sum(counts) <= num_devices
        assert len(counts) <= num_blocks or counts == (num_devices,)



@FUZZ
@given(json_values | st.text("keep,recompute auTO", max_size=24) | st.binary(max_size=4))
def test_parse_recompute_raises_only_recompute_error(value: Any) -> None:
    setting = _call(lambda: parse_recompute(value), (RecomputeError,), ())
    if setting is not None:
        assert setting in RECOMPUTE_MODES or (isinstance(setting, tuple) and setting
                                              and all(isinstance(choice, bool) for choice in setting))


TINY_CHAIN = CostChain((Block("b0", ("n0",), Affine(0, 1), Affine(0, 2), 8), Block("b1", ("n1",), Affine(0, 1),
                                                                                    Affine(0, 2), 8)), (Affine(0, 4),))


@FUZZ
@given(st.integers(-3, 64), st.none() | st.integers(-2, 70), schedule_names, st.sampled_from([None, "A", "B", "x"]),
       st.none() | st.lists(st.integers(1, 3), min_size=1, max_size=3).map(tuple), st.integers(-1, 3))
def test_check_request_raises_only_planning_error(global_batch_size: int, num_microbatches: int | None,
                                                  schedule: str, warmup_policy: str | None,
                                                  layout: tuple[int, ...] | None, rerank: int) -> None:
    request = PlanRequest(TINY_CHAIN, compact_cluster(1, 4, "v100"), global_batch_size, layout, num_microbatches,
                          schedule, warmup_policy, rerank=rerank)
    _call(lambda: check_request(request), (PlanningError,))


@FUZZ
@given(st.text(max_size=16) | st.sampled_from(models.names()).flatmap(lambda name: mutated_text(name, "-_ab01", 2)))
def test_unknown_model_names_raise_unknown_model_error(name: str) -> None:
    if name in models.names():
        return
    with pytest.raises(models.UnknownModelError, match=re.escape(repr(name))):
        models.build(name, device="meta")


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.proj(x) if mask is None else self.proj(x) * mask


MODEL = _TwoInputs()
trace_leaves = json_scalars | st.sampled_from([torch.ones(1, 2), torch.zeros(3, 2), nn.Linear(1, 1)])
trace_values = st.recursive(
    trace_leaves,
    lambda children: (st.lists(children, max_size=3) | st.lists(children, max_size=3).map(tuple)
                      | st.dictionaries(st.sampled_from(["x", "mask", "y", "input"]) | st.integers(), children,
                                        max_size=3)),
    max_leaves=6,
)


@FUZZ_SLOW
@given(trace_values)
def test_trace_rejects_bad_example_inputs_with_type_error(example_inputs: Any) -> None:
    gm = _call(lambda: trace(MODEL, example_inputs, frontend="fx"), (ExampleInputsTypeError, TraceError))
    if gm is not None:
        assert len(gm.meta["fxpipe.example_inputs"]) == len(gm.meta["fxpipe.input_names"]) >= 1


# ---------------------------------------------------------------------------------------------
# Reproducers of fuzz findings not covered by a row of tests/test_bad_inputs.py.


def test_cluster_spec_with_huge_count() -> None:
    with pytest.raises(ClusterSpecError, match="counts have at most 6 digits"):
        parse_cluster("9" * 5000 + "x1:h100")
