"""The last tensor-parallel stage's loss on vocabulary shards: the Megatron cross-entropy in place of the user's loss."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten

from fxpipe.core.program import tree_leaves
from fxpipe.passes.tensor_parallel_ops import vocab_parallel_cross_entropy
from fxpipe.passes.tp_loss import is_token_cross_entropy
from fxpipe.runtime.execution.stage import rebuild_tree

if TYPE_CHECKING:
    from fxpipe.core.program import SplitProgram, StageProgram

LossFn = Callable[[Any, Any], Any]


class VocabParallelLoss:
    """``loss_fn(output, targets)`` computed from this member's vocabulary columns of the logits (leaf ``leaf`` of
    the output tree): the row maximum and the sum of exponentials are all-reduced over the group and the target's
    logit comes from the member that holds it, so no member materializes the whole logits. Whole logits (evaluate
    and predict gather them) go to the user's ``loss_fn``."""

    def __init__(self, loss_fn: LossFn, leaf: int, key: str, vocab_start: int, vocab_size: int) -> None:
        self.loss_fn, self.leaf, self.key = loss_fn, leaf, key
        self.vocab_start, self.vocab_size = vocab_start, vocab_size

    def __call__(self, output: Any, targets: Any) -> Any:
        logits = tree_flatten(output)[0][self.leaf]
        if logits.shape[-1] == self.vocab_size:
            return self.loss_fn(output, targets)
        return vocab_parallel_cross_entropy(logits, targets, self.key, self.vocab_start)


def output_leaf(program: SplitProgram, value: str) -> int:
    """Where value ``value`` sits among the leaves of the model's output tree (as loss_fn receives it)."""
    named = rebuild_tree(program.output_tree, {name: name for name in tree_leaves(program.output_tree)})
    return tree_flatten(named)[0].index(value)


def output_value(stage: StageProgram, module: torch.fx.GraphModule, node_name: str) -> str | None:
    """The stage output value that the stage graph's node ``node_name`` returns (None: not returned directly)."""
    output = next(node for node in module.graph.nodes if node.op == "output")
    returned = tree_flatten(output.args[0])[0]
    index = next((i for i, node in enumerate(returned) if getattr(node, "name", None) == node_name), None)
    return None if index is None else stage.output_values[index]


def parallel_loss_for(loss_fn: LossFn, program: SplitProgram, value: str, key: str, vocab_start: int,
                      vocab_size: int) -> VocabParallelLoss | None:
    """The vocabulary-parallel loss for logits ``value`` when ``loss_fn`` is the token cross-entropy of them (a
    numerical check on random logits, :func:`fxpipe.passes.tp_loss.is_token_cross_entropy`); None otherwise."""
    spec = program.values[value]
    shape = tuple(spec.shape)
    generator = torch.Generator().manual_seed(0)
    targets = torch.randint(0, vocab_size, shape[:-1], generator=generator)
    targets.view(-1)[::3] = -100  # ignored tokens: a loss with another ignore_index is not this one

    def output_of(logits: torch.Tensor) -> Any:  # the other outputs as zeros: the check reads the logits only
        values = {name: torch.zeros(program.values[name].shape, dtype=torch.float64)
                  if program.values[name].is_tensor else None for name in tree_leaves(program.output_tree)}
        return rebuild_tree(program.output_tree, {**values, value: logits})

    if not is_token_cross_entropy(loss_fn, shape, targets, output_of):
        return None
    return VocabParallelLoss(loss_fn, output_leaf(program, value), key, vocab_start, vocab_size)
