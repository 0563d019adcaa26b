"""A tensor-parallel stage's collectives traced into zero-bubble's compiled F, B and W graphs (compiled_split) as
functional collectives with their waits, and the split graphs' gradients equal to eager autograd's, on 2 gloo ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fxpipe.passes import tensor_parallel_ops as ops
from fxpipe.runtime.compile.compiled_split import build_split
from fxpipe.runtime.parallel.tensor_parallel import GroupCommunicator
from tests.mp_utils import join_world, leave_world, run_ranks


class _Pair(torch.nn.Module):
    """norm -> copy_to_group -> this member's columns -> reduce_from_group: the norm's gradients need the backward
    all-reduce of copy_to_group (B computes it; W reads it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm, self.up, self.down = torch.nn.LayerNorm(8), torch.nn.Linear(8, 4), torch.nn.Linear(4, 8, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        hidden = self.up(ops.copy_to_group(self.norm(x), "traced"))
        return (ops.reduce_from_group(self.down(torch.relu(hidden)), "traced"),)


def _split_and_eager(rank: int, world_size: int, store_dir: str) -> dict[str, Any]:
    join_world(store_dir, "traced", rank, world_size)
    try:
        ops.register_group("traced", GroupCommunicator(dist.group.WORLD, world_size, rank))
        module = _Pair()
        with torch.no_grad():  # members hold different columns
            for param in (module.up.weight, module.up.bias, module.down.weight):
                param.add_(0.1 * rank)
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
        grad = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
        params = dict(module.named_parameters())
        graphs: list[torch.fx.GraphModule] = []

        def keep(graph: torch.fx.GraphModule) -> Any:
            graphs.append(graph)
            return graph

        split = build_split(module, params, {}, [x], [True], [False], keep)
        with torch.no_grad():
            results = list(split.forward(*params.values(), x))
            saved = results[split.num_results:]
            input_part = list(split.input_grads(*[saved[i] for i in split.saved_for_b], grad))
            weight_grads = list(split.weight_grads(*[saved[i] for i in split.saved_for_w], *input_part[1:]))
        leaf = x.clone().requires_grad_()
        (output,) = module(leaf)
        output.backward(grad)
        eager = [param.grad for param in params.values()]
        targets = [str(node.target) for graph in graphs for node in graph.graph.nodes if node.op == "call_function"]
        pairs = [("output", results[0], output.detach()), ("input grad", input_part[0], leaf.grad),
                 *[(f"{name} grad", split, whole) for name, split, whole in zip(params, weight_grads, eager, strict=True)]]
        problems = []
        for name, split, whole in pairs:  # the same ops on the same values, apart from the cut: float rounding only
            if not torch.allclose(split, whole, rtol=1e-5, atol=1e-6):
                problems.append(f"{name}: largest difference {float((split - whole).abs().max()):.3g}")
        return {"problems": problems, "targets": targets}
    finally:
        ops.unregister_group("traced")
        leave_world()


@pytest.mark.multiprocess
def test_split_graphs_run_the_groups_collectives_and_give_eager_gradients(tmp_path: Path) -> None:
    for rank, result in enumerate(run_ranks(_split_and_eager, 2, tmp_path)):
        # functional all-reduces, each waited on; no in-place c10d op whose work nothing waits on
        functional = [t for t in result["targets"] if "_c10d_functional.all_reduce" in t]
        assert len(functional) == 2 and sum("wait_tensor" in t for t in result["targets"]) >= 2, result["targets"]
        assert not [t for t in result["targets"] if t.startswith("c10d.")], result["targets"]
        assert result["problems"] == [], (rank, result["problems"])
