"""One rank of the multi-node tests: plan 'auto' for the launched nodes, one exact step, placement checks.

Run under torchrun (tests/test_multinode.py starts two launches as two nodes) or called from forked
gloo ranks; ``check_rank`` returns a JSON-ready dict of what this rank saw.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fxpipe
from fxpipe import models as zoo
from fxpipe.planning import costed_model, plan_chain
from fxpipe.runtime.calibration.topology import cluster_for, discover_topology

ENTRY = zoo.get("mlp")
BATCH = 8


def _planner_plan(model: torch.nn.Module, example_inputs: Any, plan: str) -> fxpipe.Plan:
    """The planner's own plan (cluster devices, before placement on ranks), made again on this rank."""
    topology = discover_topology()
    cluster = cluster_for(topology, torch.device("cpu"))
    chain = costed_model(model, tuple(example_inputs), cluster).chain
    return plan_chain(chain, cluster, BATCH, all_devices=True, layout=None if plan == "auto" else plan)


def exact_step(pipe: Any, batch_size: int) -> dict[str, Any]:
    """One step of the tiny zoo mlp against one process on the whole batch: loss, and this rank's gradients."""
    reference, _ = zoo.build("mlp", **ENTRY.tiny_overrides)
    inputs, targets = ENTRY.make_batch(batch_size, 5, **ENTRY.tiny_overrides)
    loss = pipe.step(inputs, targets)
    expected = ENTRY.loss_fn(reference(*inputs), targets)
    expected.backward()
    grads = dict(reference.named_parameters())
    exact = all(torch.allclose(p.grad, grads[name].grad, rtol=1e-4, atol=1e-7) for name, p in pipe.named_parameters())
    return {"loss": loss, "expected": expected.item(), "exact": exact, "num_params": len(list(pipe.parameters()))}


def check_rank(node_id: str, plan: str = "auto") -> dict[str, Any]:
    """Compile, step once, compare with one process; report each stage replica's planned host and real node."""
    model, example_inputs = zoo.build("mlp", **ENTRY.tiny_overrides)
    pipe = fxpipe.compile(model, example_inputs, loss_fn=ENTRY.loss_fn, global_batch_size=BATCH, plan=plan)
    step = exact_step(pipe, BATCH)
    node_ids: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(node_ids, node_id)
    planned = _planner_plan(model, example_inputs, plan)
    first_rank_of: dict[str | None, int] = {}
    for rank, node in enumerate(node_ids):
        first_rank_of.setdefault(node, rank)
    node_order = sorted(first_rank_of, key=first_rank_of.__getitem__)  # hosts are numbered by lowest rank
    per_host = planned.num_devices // len(node_order)
    placement = [[(node_order.index(node_ids[rank]), device // per_host) for rank, device in
                  zip(placed.devices, raw.devices, strict=True)] for placed, raw in
                 zip(pipe.plan.stages, planned.stages, strict=True)]
    result = {"rank": pipe.rank, "node": node_id, "layout": pipe.plan.layout, "cluster": pipe.plan.cluster,
              "devices": [list(stage.devices) for stage in pipe.plan.stages],
              "planned_devices": [list(stage.devices) for stage in planned.stages], "placement": placement,
              **step}
    pipe.close()
    return result


def main() -> None:
    """torchrun entry: the node is torchrun's agent (GROUP_RANK); writes ``rank<R>.json`` to argv[1]; argv[2],
    when given, is the plan (default "auto")."""
    torch.set_num_threads(1)
    result = check_rank(f"agent{os.environ['GROUP_RANK']}", sys.argv[2] if len(sys.argv) > 2 else "auto")
    (Path(sys.argv[1]) / f"rank{result['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
