"""Checks that a plan given to ``fxpipe.compile`` fits the model being compiled, made alike on every rank."""

from __future__ import annotations

import torch

from fxpipe.core.plan import Plan
from fxpipe.core.program import SplitProgram
from fxpipe.runtime.faults.errors import PipelineSetupError


def check_plan_matches(plan: Plan, graph_module: torch.fx.GraphModule) -> None:
    """A plan (from a file, say) must name this model's graph nodes; say which model it was made for if not."""
    known = {node.name for node in graph_module.graph.nodes}
    foreign = [name for stage in plan.stages for name in stage.node_names if name not in known]
    if foreign:
        made_for = f"model {plan.model!r}" if plan.model else "another model"
        raise PipelineSetupError(f"the plan was made for {made_for}: {len(foreign)} of its node names (e.g. "
                                 f"{foreign[:3]}) are not in this {type(graph_module).__name__}'s graph; re-plan "
                                 "for this model (fxpipe plan MODEL --json PLAN.json, or plan='auto')")


def check_stages_hold_parameters(program: SplitProgram, plan: Plan) -> None:
    """Refuse, on every rank alike, a plan with a stage that holds no parameters.

    The planner never makes one; a user's plan (file, Plan object) can. Its ranks would have nothing
    to optimise, and ``torch.optim.AdamW(pipe.parameters())`` would fail on them alone while the other
    ranks wait, so the mistake is reported here instead.
    """
    empty = [stage.stage_index for stage in program.stages if next(iter(stage.module.parameters()), None) is None]
    if empty:
        raise PipelineSetupError(f"plan {plan.layout!r} gives stage(s) {empty} no parameters, so their ranks "
                                 "would have nothing to optimise; move those cuts (or re-plan with plan='auto', "
                                 "a layout or plan='markers': planned stages always hold parameters)")


def check_model_holds_weights(model: torch.nn.Module, inputs: object) -> None:
    """Refuse a model whose weights are meta placeholders or FSDP2 shards while its example inputs are real.

    An earlier ``fxpipe.compile`` of the same model object leaves it so when its plan had tensor-parallel stages
    (members release the unsharded weights) or sharded stages (FSDP2 shards in place); compiling it again would
    fail deep inside a forward ("Tensor on device meta is not on the expected device cpu").
    """
    leaves = [value for value in torch.utils._pytree.tree_leaves(inputs) if isinstance(value, torch.Tensor)]
    if not leaves or any(value.is_meta for value in leaves):
        return  # planning on the meta device (costs="analytic") holds no weights by design
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in named:
            sharded = type(tensor).__name__ == "DTensor" or type(getattr(tensor, "data", None)).__name__ == "DTensor"
            if tensor.is_meta or sharded:
                state = "a meta placeholder" if tensor.is_meta else "an FSDP2 shard (DTensor)"
                raise PipelineSetupError(
                    f"the model's {kind} {name!r} is {state}, not a weight: an earlier fxpipe.compile of this model "
                    "object released it (tensor-parallel members keep only their shards; sharded stages shard in "
                    "place), or the model was built on the meta device; build the model again (or load its "
                    "state dict into a fresh one) for each fxpipe.compile")
