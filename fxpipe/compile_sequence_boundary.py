"""Which stage boundary values cross between sequence-parallel stages of the same T as token shares."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
from torch import fx
from torch.utils._pytree import tree_flatten

from fxpipe.core.program import MODEL_INPUT, tree_leaves
from fxpipe.passes.tp_shard import shard_stage

if TYPE_CHECKING:
    from fxpipe.core.plan import Plan
    from fxpipe.core.program import SplitProgram


def _candidates(program: SplitProgram, plan: Plan) -> dict[str, int]:
    """value -> T of the (batch, tokens, width) values whose producer and every consumer are T-way stages, T > 1
    (not model inputs, which every rank slices from the batch, nor model outputs, which predict returns whole)."""
    found = {}
    outputs = set(tree_leaves(program.output_tree))
    for name, producer in program.producers.items():
        spec, consumers = program.values[name], program.consumers.get(name, ())
        if producer == MODEL_INPUT or name in outputs:
            continue
        degree = plan.stages[producer].tensor_parallel
        if degree > 1 and consumers and spec.is_tensor and spec.batched and len(spec.shape) == 3 \
                and all(plan.stages[stage].tensor_parallel == degree for stage in consumers):
            found[name] = degree
    return found


def _node_names(program: SplitProgram, stage_index: int, values: dict[str, int]) -> dict[str, str]:
    """node name -> value of stage ``stage_index``'s placeholders and returned nodes that are among ``values``."""
    stage = program.stages[stage_index]
    nodes = list(stage.module.graph.nodes)
    placeholders = [node for node in nodes if node.op == "placeholder"]
    names = {node.name: value for node, value in zip(placeholders, stage.input_values, strict=False) if value in values}
    returned = tree_flatten(next(node for node in nodes if node.op == "output").args[0])[0]
    names |= {node.name: value for node, value in zip(returned, stage.output_values, strict=False)
              if value in values and isinstance(node, fx.Node) and node.op != "placeholder"}
    return names


def _accepted(program: SplitProgram, stage_index: int, degree: int, names: dict[str, str]) -> set[str]:
    """The values stage ``stage_index``'s pass takes or leaves split over the tokens (a probe run; no collective)."""
    stage = program.stages[stage_index]
    example = [torch.zeros(spec.shape, dtype=spec.dtype) if spec.is_tensor else None
               for spec in (program.values[name] for name in stage.input_values)]
    probe = shard_stage(copy.deepcopy(stage.module), degree, 0, group_key="sequence-boundary-probe",
                        example_inputs=example, sequence_parallel=True, sequence_boundary=frozenset(names))
    return {names[name] for name in probe.sequence_boundary}


def sequence_boundary(program: SplitProgram, plan: Plan, stage_index: int) -> tuple[frozenset[str], dict[str, int]]:
    """Stage ``stage_index``'s boundary under sequence parallelism: the node names its pass takes and leaves split,
    and value -> T of the values it receives or sends as token shares (member j to member j).

    A value crosses split when its producer and every consumer are sequence-parallel T-way stages (the same T) whose
    passes all keep it split over the tokens; elsewhere it stays whole. Every rank works this out alike."""
    candidates = _candidates(program, plan)
    own = _node_names(program, stage_index, candidates)
    if not own:
        return frozenset(), {}
    mine = {value for value in own.values()}
    neighbours = sorted({program.producers[v] for v in mine} | {s for v in mine for s in program.consumers[v]})
    accepted = {stage: _accepted(program, stage, plan.stages[stage].tensor_parallel,
                                 _node_names(program, stage, candidates)) for stage in neighbours}
    split = {value: candidates[value] for value in mine
             if all(value in accepted[stage] for stage in (program.producers[value], *program.consumers[value]))}
    return frozenset(name for name, value in own.items() if value in split), split
