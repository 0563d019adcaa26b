"""Selective recompute in stage code: each recomputed block or attention core becomes one checkpointed call."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import fx
from torch.utils.checkpoint import checkpoint

from fxpipe.core import meta
from fxpipe.core.attention_core import attention_cores
from fxpipe.core.costgraph import CostNode
from fxpipe.core.plan import Plan, StagePlan
from fxpipe.core.program import SplitProgram

REGION_PREFIX = "fxpipe_recompute_"


class RecomputeRegionError(ValueError):
    """A plan's per-block recompute cannot be placed on its stage code."""


class CheckpointedRegion(torch.nn.Module):
    """Runs ``region`` keeping only its inputs for backward, which runs it again first (non-reentrant
    checkpointing: random draws and autocast state as in the first run, so gradients are exact)."""

    is_checkpointed_region = True  # how a sharded stage's FSDP units find regions (fxpipe.runtime.parallel.fsdp_units)

    def __init__(self, region: fx.GraphModule) -> None:
        super().__init__()
        # hidden from the module tree: the region's layers are the stage's own (same objects, one set of parameters
        # under the stage's paths); parameters it reads through get_attr arrive as arguments
        object.__setattr__(self, "region", region)

    def forward(self, *args: Any) -> Any:
        region: fx.GraphModule = self.__dict__["region"]
        if not torch.is_grad_enabled():  # evaluation and predict: nothing is saved anyway
            return region(*args)
        outputs = checkpoint(region, *args, use_reentrant=False, preserve_rng_state=True)
        # under torch.compile no meter measures (pipe.measure runs eager), and dynamo cannot trace the hook lookup:
        # reading it broke the stage's graph at every region, each then compiled as a frame of its own
        meter = None if torch.compiler.is_compiling() else _active_meter()
        return outputs if meter is None else _measured(region, args, outputs, meter)


def _active_meter() -> Any:
    """The saved-activation meter measuring this step (``pipe.measure``: fxpipe.runtime.autograd.measure), if any:
    the object whose pack hook is the innermost saved-tensor hook."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    owner = getattr(hooks[0], "__self__", None) if hooks else None
    return owner if hasattr(owner, "note_transient") else None


class _Hold(torch.autograd.Function):
    """A scalar whose node saves a region's inputs: the checkpoint keeps them out of the meter's sight until the
    region's backward, so the meter is shown them (the same storages, no copy) for as long."""

    @staticmethod
    def forward(ctx: Any, *values: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*values)
        return torch.zeros(())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return (None,) * len(ctx.saved_tensors)


def _measured(region: fx.GraphModule, args: Sequence[Any], outputs: tuple[Any, ...], meter: Any) -> tuple[Any, ...]:
    """``outputs`` (unchanged) with what the meter should see: the region's inputs counted as kept until its
    backward starts, and then the bytes its recomputation rebuilds (a dry run of the region counts them)."""
    inputs = [a for a in args if isinstance(a, torch.Tensor)]
    first = next((value for value in outputs if isinstance(value, torch.Tensor) and value.requires_grad), None)
    if first is None:
        return outputs
    keeper = [_Hold.apply(*inputs)]
    rebuilt = _rebuilt_bytes(region, args, {t.untyped_storage().data_ptr() for t in inputs} | meter.excluded)

    def at_backward(grad: torch.Tensor) -> None:
        meter.note_transient(rebuilt)
        keeper.clear()  # the inputs' count ends here; the checkpoint frees them as this backward ends

    first.register_hook(at_backward)
    return outputs


def _rebuilt_bytes(region: fx.GraphModule, args: Sequence[Any], excluded: set[int]) -> int:
    """Bytes of the storages the region saves for backward, beyond ``excluded`` ones (its inputs, parameters):
    what its recomputation holds again (a dry run; random number generators left as they were)."""
    sizes: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = tensor.untyped_storage().data_ptr()
        if key not in excluded:
            sizes[key] = tensor.untyped_storage().nbytes()
        return tensor

    devices = sorted({a.device for a in args if isinstance(a, torch.Tensor) and a.device.type == "cuda"}, key=str)
    with torch.random.fork_rng(devices=devices), torch.enable_grad(), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        region(*args)
    return sum(sizes.values())


def stage_regions(gm: fx.GraphModule, stage: StagePlan, *, positional: bool = False) -> list[tuple[str, ...]]:
    """Node names of every region the stage recomputes: a "block" block's nodes, an "attention" block's cores,
    in graph order; block boundaries come from ``stage.block_node_counts`` (a stage all "attention" needs none).

    ``positional``: ``gm`` is a tensor-parallel member's shard of the stage (fxpipe.passes.tp_shard), whose split
    linears and collectives carry new names; each node then goes with the block of the stage node it was rewritten
    from (:func:`_stretches`)."""
    names = {node.name for node in gm.graph.nodes if node.op not in ("placeholder", "output")}
    choices = stage.block_recompute
    if not choices:
        return []
    if not stage.block_node_counts:
        if set(choices) != {"attention"}:
            raise RecomputeRegionError(
                f"stage {stage.stage_index} recomputes per block {list(choices)} but the plan has no "
                "block_node_counts to find its blocks' nodes; plan it with fxpipe (fxpipe.plan / fxpipe plan) or use "
                "recompute='selective', 'always' or 'never'")
        return [core for core in _cores(gm) if set(core) <= names]
    blocks = _stretches(gm, stage) if positional else _planned_blocks(stage, names)
    regions: list[tuple[str, ...]] = []
    cores = _cores(gm)
    for choice, block in zip(choices, blocks, strict=True):
        if choice == "block" and block:
            regions.append(block)
        elif choice == "attention":
            regions.extend(core for core in cores if set(core) <= set(block))
    return regions


def _planned_blocks(stage: StagePlan, names: set[str]) -> list[tuple[str, ...]]:
    """Each block's node names, as the plan lists them, that the stage's graph holds."""
    blocks, start = [], 0
    for count in stage.block_node_counts:
        blocks.append(tuple(name for name in stage.node_names[start:start + count] if name in names))
        start += count
    return blocks


def _stretches(gm: fx.GraphModule, stage: StagePlan) -> list[tuple[str, ...]]:
    """Each block's nodes on a rewritten stage graph: a node belongs to the block of the planned node it was
    rewritten from (:data:`meta.TP_ORIGIN`; a split linear renamed ``linear_3`` stays in its block: before, such a
    block was found empty and silently kept), any other node to the block of the last planned node before it
    (get_attr nodes aside: a region reads them as arguments)."""
    block_of: dict[str, int] = {}
    start = 0
    for index, count in enumerate(stage.block_node_counts):
        block_of.update((name, index) for name in stage.node_names[start:start + count])
        start += count
    blocks: list[list[str]] = [[] for _ in stage.block_node_counts]
    current: int | None = None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        current = max(block_of.get(node.meta.get(meta.TP_ORIGIN, node.name), -1), current if current is not None else -1)
        if current >= 0:  # nodes before the first planned one (a rewrite's entry collectives) stay outside
            blocks[current].append(node.name)
    return [tuple(block) for block in blocks]


def _cores(gm: fx.GraphModule) -> list[tuple[str, ...]]:
    """Attention cores on a stage's graph, found as on the cost graph (ops named as fxpipe.passes.costs names them)."""
    nodes = [CostNode(node.name, tuple(i.name for i in node.all_input_nodes), op=f"{node.op}:{_op_name(gm, node)}")
             for node in gm.graph.nodes if node.op not in ("placeholder", "output")]
    return attention_cores(nodes)


def _op_name(gm: fx.GraphModule, node: fx.Node) -> str:
    if node.op == "call_module":
        return type(gm.get_submodule(str(node.target))).__name__
    return getattr(node.target, "__name__", str(node.target))


def checkpoint_regions(gm: fx.GraphModule, regions: Sequence[Sequence[str]]) -> fx.GraphModule:
    """A copy of ``gm`` in which each region (node names) is one call of a :class:`CheckpointedRegion`; ``gm``
    is not changed."""
    result = gm
    for index, region in enumerate(regions):
        result = _checkpoint_region(result, set(region), f"{REGION_PREFIX}{index}")
    return result


def _checkpoint_region(gm: fx.GraphModule, members: set[str], name: str) -> fx.GraphModule:
    nodes = list(gm.graph.nodes)
    inside = [node for node in nodes if node.name in members and node.op not in ("get_attr", "placeholder", "output")]
    inside_set = set(inside)
    inputs = list(dict.fromkeys(i for node in inside for i in node.all_input_nodes if i not in inside_set))
    outputs = [node for node in inside if any(user not in inside_set for user in node.users)]
    region = fx.GraphModule(gm, _region_graph(inside, inputs, outputs))  # shares gm's layers
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    pending = [node for node in nodes if node not in inside_set]
    placed = False
    while pending:  # original order, a node waiting until what it reads is placed (region outputs included)
        for position, node in enumerate(pending):
            if all(i in env for i in node.all_input_nodes):
                env[node] = graph.node_copy(node, env.__getitem__)
                del pending[position]
                break
        else:
            raise AssertionError(f"region {name} cannot be placed: {[n.name for n in pending]} wait on each other")
        if not placed and all(i in env for i in inputs):
            call = graph.call_module(name, tuple(env[i] for i in inputs))
            for slot, output in enumerate(outputs):
                env[output] = graph.call_function(_item, (call, slot))
            placed = True
    graph.lint()
    wrapper = CheckpointedRegion(region)
    root = torch.nn.Module()  # gm's own layers and attributes (the same objects), with the region added
    root._modules = {**gm._modules, name: wrapper}
    root._parameters, root._buffers = dict(gm._parameters), dict(gm._buffers)
    result = fx.GraphModule(root, graph, class_name=type(gm).__name__)
    # every layer of gm stays under its path and in its order (those only the region calls too), then the region
    result._modules = {**gm._modules, name: wrapper}
    return result


def _item(values: tuple[Any, ...], slot: int) -> Any:
    return values[slot]


def _region_graph(inside: Sequence[fx.Node], inputs: Sequence[fx.Node], outputs: Sequence[fx.Node]) -> fx.Graph:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {node: graph.placeholder(node.name) for node in inputs}
    for node in inside:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[node] for node in outputs))
    return graph


def with_recompute_regions(program: SplitProgram, plan: Plan) -> SplitProgram:
    """``program`` whose stages recompute the plan's per-block choices (:func:`checkpoint_regions`). A
    tensor-parallel stage gets its regions on each member's shard instead (:func:`tensor_parallel_regions`): the
    sharding pass rewrites the graph the regions would hide. Its regions are checked here all the same."""
    stages = []
    for stage_program, stage in zip(program.stages, plan.stages, strict=True):
        regions = stage_regions(stage_program.module, stage)
        if regions and stage.tensor_parallel == 1:
            stage_program = replace(stage_program, module=_kept_meta(
                checkpoint_regions(stage_program.module, regions), stage_program.module.meta))
        stages.append(stage_program)
    return replace(program, stages=tuple(stages))


def _kept_meta(gm: fx.GraphModule, meta: Mapping[str, Any]) -> fx.GraphModule:
    gm.meta.update(meta)
    return gm


def tensor_parallel_regions(sharded: fx.GraphModule, stage: StagePlan) -> fx.GraphModule:
    """A tensor-parallel member's shard of ``stage`` recomputing the plan's per-block choices (``sharded`` itself
    when there are none). Each region reruns its collectives in the backward, in the same order on every member
    (the same graph; non-reentrant checkpointing stops a recompute after the region's last saved tensor alike)."""
    regions = stage_regions(sharded, stage, positional=True)
    return _kept_meta(checkpoint_regions(sharded, regions), sharded.meta) if regions else sharded
