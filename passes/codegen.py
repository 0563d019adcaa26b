"""Codegen: cut a traced graph into per-stage GraphModules with value routing, shapes and tied parameters."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
from torch import fx

from fxpipe.core import meta
from fxpipe.core.plan import Plan
from fxpipe.core.program import MODEL_INPUT, SplitProgram, StageProgram, ValueSpec, tree_leaves
from fxpipe.passes.batchdims import (
    MERGED,
    batch_size_of,
    check_outputs_follow,
    derive_batch_dim,
    fake_values,
    graph_batch_dims,
)
from fxpipe.passes.recompute_regions import with_recompute_regions
from fxpipe.passes.subgraph import extract_subgraph
from fxpipe.passes.trace_inputs import recorded_inputs


class CodegenError(ValueError):
    """A stage assignment does not fit the graph (missing, duplicated or misordered nodes)."""


_IMPLICIT_OPS = ("placeholder", "output")


def split_stages(
    gm: fx.GraphModule,
    stage_node_names: Sequence[Sequence[str]],
    *,
    example_inputs: Sequence[Any] | None = None,
) -> SplitProgram:
    """Split ``gm`` into stages; ``stage_node_names[s]`` are the nodes stage ``s`` computes.

    ``get_attr`` nodes need not be listed: each is duplicated into every stage that reads it, so
    parameters are never sent (a parameter held by several stages forms a tie group). Shapes come
    from running ``gm`` on fake tensors built like ``example_inputs`` (default:
    ``gm.meta["fxpipe.example_inputs"]`` written by ``fxpipe.passes.trace``). ``gm`` is not
    modified; stage modules share its parameter tensors.
    """
    return _split(gm, stage_node_names, example_inputs)[0]


def _split(gm: fx.GraphModule, stage_node_names: Sequence[Sequence[str]],
           example_inputs: Sequence[Any] | None) -> tuple[SplitProgram, dict[str, tuple[Any, Any]]]:
    """:func:`split_stages`, and the Python values crossing a cut that change with the batch rows (value at the
    example batch, at one more row): each carries its sender's rows (:func:`_check_row_counts`)."""
    example = recorded_inputs(gm, example_inputs, CodegenError, "split_stages")
    dims = graph_batch_dims(gm, example)
    batch = batch_size_of(example, dims)
    at_batch = _fake_values(gm, example, dims, batch)
    at_next = _fake_values(gm, example, dims, None if batch is None else batch + 1)
    if gm.meta.get(meta.BATCH_DIMS_DECLARED):
        check_outputs_follow(gm, example, dims, at_batch, at_next)
    assignment = _assign_nodes(gm, stage_node_names, at_batch)
    last = len(stage_node_names) - 1
    members = _stage_members(gm, assignment, last)
    consumers = _consumers(gm, assignment, last)
    _check_crossing_values(consumers, at_batch, at_next, batch)
    producers = {name: assignment.get(name, MODEL_INPUT) for name in consumers}
    output_tree = _output_tree(gm)
    leaves = _unique(tree_leaves(output_tree))
    stages = tuple(
        _build_stage(gm, index, members[index], consumers, producers, leaves if index == last else None)
        for index in range(last + 1)
    )
    model_inputs = tuple(node.name for node in gm.graph.nodes if node.op == "placeholder")
    value_names = _unique([*model_inputs, *consumers, *leaves])
    fixed = gm.meta.get(meta.STATIC_INPUT_DIMS, {})
    values = {name: _spec(name, at_batch[name], at_next[name], batch, fixed.get(name, ())) for name in value_names}
    for leaf in leaves:
        producers.setdefault(leaf, last)  # a leaf no other stage reads is computed on the last stage
    for name in model_inputs:
        producers.setdefault(name, MODEL_INPUT)
    varying = {name: (at_batch[name], at_next[name]) for name in consumers
               if not isinstance(at_batch[name], torch.Tensor) and not _equal(at_batch[name], at_next[name])}
    return SplitProgram(
        stages=stages,
        model_inputs=model_inputs,
        output_tree=output_tree,
        producers=MappingProxyType({name: producers[name] for name in value_names if name in producers}),
        consumers=MappingProxyType({name: consumers.get(name, ()) for name in value_names}),
        values=MappingProxyType(values),
        tie_groups=_tie_groups(stages),
    ), varying


def split_for_plan(
    gm: fx.GraphModule, plan: Plan, *, example_inputs: Sequence[Any] | None = None
) -> SplitProgram:
    """``split_stages`` with the node names of ``plan.stages`` (a plan made from the traced graph)."""
    empty = [stage.stage_index for stage in plan.stages if not stage.node_names]
    if empty:
        raise CodegenError(
            f"plan stages {empty} list no node names (a plan made from a profile file?); "
            "plan from the traced graph (fxpipe.plan(model, ...)) to generate stage code"
        )
    program, varying = _split(gm, [stage.node_names for stage in plan.stages], example_inputs)
    _check_row_counts(program, plan, varying)
    return with_recompute_regions(program, plan)


def _equal(value: Any, other: Any) -> bool:
    try:
        return bool(value == other)
    except Exception:  # a value without a plain equality: treat it as following the batch (refused if it matters)
        return False


def _check_row_counts(program: SplitProgram, plan: Plan, varying: Mapping[str, tuple[Any, Any]]) -> None:
    """A Python value that follows the batch rows (``x.size(0)``) crosses a cut as its sender computed it, for the
    sender's rows: right for a receiver replica holding the same rows (equal replica counts), wrong otherwise,
    and wrong silently where it feeds a ``view(n, -1)``. Refused between stages of different replica counts."""
    for name, (value, value_next) in sorted(varying.items()):
        producer = program.producers[name]
        for consumer in program.consumers.get(name, ()):
            sent, received = plan.stages[producer].replicas, plan.stages[consumer].replicas
            if sent != received:
                raise CodegenError(
                    f"value {name!r} is a Python {type(value).__name__} that follows the batch rows ({value!r} at "
                    f"the example batch, {value_next!r} with one more row) and crosses from stage {producer} "
                    f"({sent} replicas) to stage {consumer} ({received} replicas): each receiver would get its "
                    "sender's row count, not its own; cut after the ops that read it, or give both stages the "
                    "same replica count (the planners cut between layers, where sizes are read again)")


def _assign_nodes(
    gm: fx.GraphModule, stage_node_names: Sequence[Sequence[str]], fake_values: Mapping[str, Any]
) -> dict[str, int]:
    """Stage of every computing node (get_attr nodes only when listed), after checking the listing."""
    if not stage_node_names:
        raise CodegenError("stage_node_names is empty; give at least one stage of node names")
    nodes_by_name = {node.name: node for node in gm.graph.nodes}
    assignment: dict[str, int] = {}
    duplicated: list[str] = []
    unknown: list[str] = []
    for stage_index, names in enumerate(stage_node_names):
        for name in names:
            if name not in nodes_by_name:
                unknown.append(name)
            elif nodes_by_name[name].op in _IMPLICIT_OPS:
                continue  # placeholders and the output are implicit
            elif name in assignment:
                duplicated.append(f"{name} (stages {assignment[name]} and {stage_index})")
            else:
                assignment[name] = stage_index
    unassigned = [
        node.name
        for node in gm.graph.nodes
        if node.op not in (*_IMPLICIT_OPS, "get_attr") and node.name not in assignment
    ]
    if unknown or duplicated or unassigned:
        raise CodegenError(
            "each computing node must be listed in exactly one stage: "
            f"unknown {unknown}, duplicated {duplicated}, unassigned {unassigned}"
        )
    _unpack_on_producer(gm, assignment, fake_values)
    _check_order(gm, assignment)
    return assignment


def _unpack_on_producer(gm: fx.GraphModule, assignment: dict[str, int], fake_values: Mapping[str, Any]) -> None:
    """Move ``getitem`` of a tuple/list result onto the stage computing the tuple.

    Indexing is free, and it keeps containers of tensors (``split``, multi-output modules) from
    crossing a cut, where they would travel as Python objects without gradients.
    """
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not operator.getitem:
            continue
        source = node.args[0]
        if not isinstance(source, fx.Node) or source.name not in assignment:
            continue
        if isinstance(fake_values.get(source.name), tuple | list) and assignment[node.name] > assignment[source.name]:
            assignment[node.name] = assignment[source.name]


def _check_crossing_values(consumers: Mapping[str, tuple[int, ...]], fake_values: Mapping[str, Any],
                           fake_values_next: Mapping[str, Any], batch: int | None) -> None:
    for name in consumers:
        value, value_next = fake_values[name], fake_values_next[name]
        if not isinstance(value, torch.Tensor) and _holds_tensor(value):
            raise CodegenError(
                f"value {name!r} ({type(value).__name__} holding tensors) would cross a stage boundary as a Python "
                "object without gradients; put the nodes that read it on the stage that computes it"
            )
        if derive_batch_dim(value, value_next, batch) == MERGED:
            raise CodegenError(
                f"value {name!r} of shape {tuple(value.shape)} grows with the batch but no single dim holds it "
                f"(one more sample gives {tuple(value_next.shape)}: the batch is merged with another dim or in "
                "two dims), so it cannot be split between replicas by rows; cut before or after the op that "
                "flattens the batch (the planners never cut there)"
            )


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, tuple | list):
        return any(_holds_tensor(item) for item in value)
    if isinstance(value, dict):
        return any(_holds_tensor(item) for item in value.values())
    return False


def _check_order(gm: fx.GraphModule, assignment: Mapping[str, int]) -> None:
    for node in gm.graph.nodes:
        if node.op in (*_IMPLICIT_OPS, "get_attr"):
            continue
        for source in node.all_input_nodes:
            if source.op in ("placeholder", "get_attr"):
                continue
            if assignment[source.name] > assignment[node.name]:
                raise CodegenError(
                    f"node {node.name!r} on stage {assignment[node.name]} reads {source.name!r} computed on "
                    f"later stage {assignment[source.name]}; move {source.name!r} to stage "
                    f"<= {assignment[node.name]} or {node.name!r} to stage >= {assignment[source.name]}"
                )


def _reading_stages(node: fx.Node, assignment: Mapping[str, int], last: int) -> set[int]:
    stages: set[int] = set()
    for user in node.users:
        if user.op == "output":
            stages.add(last)
        elif user.op != "get_attr":
            stages.add(assignment[user.name])
    return stages


def _stage_members(gm: fx.GraphModule, assignment: Mapping[str, int], last: int) -> list[list[str]]:
    members: list[list[str]] = [[] for _ in range(last + 1)]
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            for stage_index in sorted(_reading_stages(node, assignment, last)):
                members[stage_index].append(node.name)
        elif node.op not in _IMPLICIT_OPS:
            members[assignment[node.name]].append(node.name)
    empty = [index for index, names in enumerate(members) if not names]
    if empty:
        raise CodegenError(f"stages {empty} compute no nodes; give every stage at least one node or use fewer stages")
    return members


def _consumers(gm: fx.GraphModule, assignment: Mapping[str, int], last: int) -> dict[str, tuple[int, ...]]:
    """Values read on a stage other than their producer (placeholders: every stage reading them)."""
    consumers: dict[str, tuple[int, ...]] = {}
    for node in gm.graph.nodes:
        if node.op in ("output", "get_attr"):
            continue
        producer = assignment.get(node.name, MODEL_INPUT)
        readers = sorted(_reading_stages(node, assignment, last) - {producer})
        if readers:
            consumers[node.name] = tuple(readers)
    return consumers


def _build_stage(
    gm: fx.GraphModule,
    stage_index: int,
    member_names: Sequence[str],
    consumers: Mapping[str, tuple[int, ...]],
    producers: Mapping[str, int],
    leaves: Sequence[str] | None,
) -> StageProgram:
    inputs = [name for name, readers in consumers.items() if stage_index in readers]
    if leaves is None:
        outputs = [name for name, readers in consumers.items() if producers[name] == stage_index]
    else:
        outputs = list(leaves)
    subgraph = extract_subgraph(
        gm,
        member_names,
        inputs=inputs,
        outputs=outputs,
        attribute_names=_attribute_names(gm, member_names),
        class_name=f"Stage{stage_index}",
    )
    param_names = _param_names(gm, subgraph.module)
    subgraph.module.meta[meta.PARAM_NAMES] = dict(param_names)
    subgraph.module.meta[meta.STAGE_INDEX] = stage_index
    return StageProgram(
        stage_index=stage_index,
        module=subgraph.module,
        input_values=subgraph.input_names,
        output_values=subgraph.output_names,
        param_names=param_names,
    )


def _original_names(gm: fx.GraphModule) -> Mapping[str, str]:
    names = gm.meta.get(meta.PARAM_NAMES)
    return names if isinstance(names, Mapping) else {}


def _attribute_names(gm: fx.GraphModule, member_names: Sequence[str]) -> dict[str, str]:
    """get_attr target -> original model name, so stage code shows the model's own parameter paths."""
    originals = _original_names(gm)
    nodes_by_name = {node.name: node for node in gm.graph.nodes}
    renames: dict[str, str] = {}
    for name in member_names:
        node = nodes_by_name[name]
        if node.op != "get_attr":
            continue
        from_node = node.meta.get(meta.PARAM_NAMES, ())
        original = from_node[0] if len(from_node) == 1 else originals.get(node.target, node.target)
        renames[node.target] = original
    return renames


def _canonical_names(gm: fx.GraphModule) -> dict[int, str]:
    """Tensor identity -> the original name it is first listed under (tied tensors share one name)."""
    originals = _original_names(gm)
    canonical: dict[int, str] = {}
    for path, tensor in [*gm.named_parameters(), *gm.named_buffers()]:
        canonical.setdefault(id(tensor), originals.get(path, path))
    return canonical


def _param_names(gm: fx.GraphModule, module: fx.GraphModule) -> tuple[tuple[str, str], ...]:
    canonical = _canonical_names(gm)
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return tuple((path, canonical.get(id(tensor), path)) for path, tensor in named)


def _tie_groups(stages: Sequence[StageProgram]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Trainable parameters held by several stages; their gradients are summed across those stages."""
    holders: dict[str, set[int]] = {}
    for stage in stages:
        trainable = {path for path, param in stage.module.named_parameters(remove_duplicate=False) if param.requires_grad}
        for path, original in stage.param_names:
            if path in trainable:
                holders.setdefault(original, set()).add(stage.stage_index)
    return tuple((name, tuple(sorted(held))) for name, held in sorted(holders.items()) if len(held) >= 2)


def _output_tree(gm: fx.GraphModule) -> Any:
    (output,) = [node for node in gm.graph.nodes if node.op == "output"]
    return fx.node.map_arg(output.args[0], lambda node: node.name)  # type: ignore[arg-type,return-value]


def _unique(names: Sequence[str] | Any) -> list[str]:
    return list(dict.fromkeys(names))


def value_specs(gm: fx.GraphModule, names: Sequence[str], example_inputs: Sequence[Any]) -> dict[str, ValueSpec]:
    """Shape, dtype, batch dim and gradient flags of ``names``, from two fake runs (batch B and B + 1)."""
    dims = graph_batch_dims(gm, example_inputs)
    batch = batch_size_of(example_inputs, dims)
    at_batch = _fake_values(gm, example_inputs, dims, batch)
    at_next = _fake_values(gm, example_inputs, dims, None if batch is None else batch + 1)
    return {name: _spec(name, at_batch[name], at_next[name], batch) for name in names}


def _fake_values(gm: fx.GraphModule, example_inputs: Sequence[Any], dims: Sequence[int | None],
                 rows: int | None) -> dict[str, Any]:
    """Every node's value when ``gm`` runs on fake inputs with ``rows`` batch rows (no real compute)."""
    try:
        return fake_values(gm, example_inputs, dims, rows)
    except Exception as error:  # re-raised with the batch size that broke it
        raise CodegenError(
            f"running the graph on fake inputs with {rows} batch rows (batch dims {list(dims)}) failed "
            f"({type(error).__name__}: {error}); shapes must follow the inputs' batch dims (no hard-coded batch "
            "size), and batch_dims must name the dims the model treats as the batch"
        ) from error


def _spec(name: str, value: Any, value_next: Any, batch: int | None, fixed_dims: tuple[int, ...] = ()) -> ValueSpec:
    if not isinstance(value, torch.Tensor):
        return ValueSpec(name=name, shape=(), dtype=None, batched=False, is_tensor=False, requires_grad=False)
    batch_dim = derive_batch_dim(value, value_next, batch)
    batched = batch_dim is not None and batch_dim != MERGED
    return ValueSpec(
        name=name,
        shape=tuple(int(size) for size in value.shape),
        dtype=value.dtype,
        batched=batched,
        is_tensor=True,
        requires_grad=bool(value.requires_grad and value.dtype.is_floating_point),
        batch_dim=batch_dim if batched and batch_dim is not None else 0,
        fixed_dims=tuple(fixed_dims),
    )


__all__ = [
    "CodegenError",
    "split_for_plan",
    "split_stages",
    "value_specs",
]
