"""Dropout and BatchNorm through a multi-rank hybrid (2:1) pipeline: exact against an eager reference that
replays every rank's random generator, then a checkpoint resume that continues bit for bit (RNG restored).

The reference is the unsplit model's modules run slice by slice as the runtime runs them: each stage-0
replica's rows of each micro-batch with that rank's generator (BatchNorm normalising with the slice's
statistics, as ``batch_norm="deferred"`` does), the last stage with its rank's generator, and the running
statistics from one whole-batch pass (``"deferred"`` commits them once per step over the whole batch).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.passes import trace
from fxpipe.runtime.checkpoint_io import load_checkpoint, save_checkpoint
from tests.mp_utils import join_world, leave_world, plan_from_cuts, run_ranks

pytestmark = pytest.mark.multiprocess

BATCH, NUM_MICROBATCHES, REPLICAS = 12, 2, (2, 1)  # micro-batches of 6 rows, 3 per stage-0 replica
SEED_OF_RANK = (101, 202, 303)
STEPS_BEFORE_SAVE, STEPS_AFTER_SAVE = 2, 2


class DropoutBatchNormNet(nn.Module):
    """Stage 0 (cut at the middle node): inp -> bn -> relu -> drop1; stage 1: mid -> relu -> drop2 -> out."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.bn, self.drop1 = nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Dropout(0.3)
        self.mid, self.drop2, self.out = nn.Linear(16, 12), nn.Dropout(0.2), nn.Linear(12, 4)

    def front(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop1(torch.relu(self.bn(self.inp(x))))

    def back(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop2(torch.relu(self.mid(h))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.back(self.front(x))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 6, generator=generator), torch.randint(0, 4, (BATCH,), generator=generator)


def _model() -> DropoutBatchNormNet:
    torch.manual_seed(0)
    return DropoutBatchNormNet()


def _halves(rows: int) -> list[tuple[int, int]]:
    first = rows - rows // 2  # the first replica takes the extra row
    return [(0, first), (first, rows)]


def reference_step(ref: DropoutBatchNormNet, rng: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> float:
    """One step's gradients (accumulated in ``ref``) and loss; advances ``rng`` (each rank's CPU generator)."""
    with torch.random.fork_rng(devices=[]):
        with torch.no_grad():  # "deferred": running statistics of the whole batch, committed once
            probe = copy.deepcopy(ref.bn).train()
            probe(ref.inp(x))
        rows, total = BATCH // NUM_MICROBATCHES, 0.0
        for m in range(NUM_MICROBATCHES):
            xs, ys = x[m * rows:(m + 1) * rows], y[m * rows:(m + 1) * rows]
            pieces = []
            for replica, (start, stop) in enumerate(_halves(rows)):
                torch.set_rng_state(rng[replica])
                pieces.append(ref.front(xs[start:stop]))
                rng[replica] = torch.get_rng_state()
            torch.set_rng_state(rng[2])
            loss = F.cross_entropy(ref.back(torch.cat(pieces)), ys) * rows / BATCH
            rng[2] = torch.get_rng_state()
            loss.backward()
            total += loss.item()
    with torch.no_grad():
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            getattr(ref.bn, name).copy_(getattr(probe, name))
    return total


def _compile(model: nn.Module) -> Any:
    example = (torch.randn(BATCH, 6),)
    plan = plan_from_cuts(trace(copy.deepcopy(model), example), REPLICAS, BATCH, NUM_MICROBATCHES)
    return fxpipe.compile(model, example, loss_fn=F.cross_entropy, global_batch_size=BATCH, plan=plan,
                          batch_norm="deferred")


def _optimizer(parameters: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.1, momentum=0.9)


def _snapshot(pipe: Any) -> dict[str, Any]:
    """Exact values as nested lists of Python floats (tensors would cross the result queue by fd passing)."""
    return {name: tensor.tolist() for name, tensor in pipe.state_dict().items()}


def _train_and_check(rank: int, store_dir: str, root: Path) -> dict[str, Any]:
    """Steps against the reference; checkpoint after STEPS_BEFORE_SAVE; the continuation's losses and state."""
    model = _model()
    ref = copy.deepcopy(model)
    pipe = _compile(model)
    optimizer, ref_optimizer = _optimizer(pipe.parameters()), _optimizer(ref.parameters())
    rng = []
    for seed in SEED_OF_RANK:
        torch.manual_seed(seed)
        rng.append(torch.get_rng_state())
    torch.manual_seed(SEED_OF_RANK[rank])  # this rank's generator from here on (compile drew from it)
    checked, continuation = 0, []
    for step in range(STEPS_BEFORE_SAVE + STEPS_AFTER_SAVE):
        if step == STEPS_BEFORE_SAVE:
            save_checkpoint(pipe, root / "mid", optimizer=optimizer, step=step)
        x, y = _batch(step)
        loss = pipe.step((x,), y)
        expected = reference_step(ref, rng, x, y)
        assert loss == pytest.approx(expected, rel=1e-5), (rank, step, loss, expected)
        grads = dict(ref.named_parameters())
        for name, parameter in pipe.named_parameters():
            torch.testing.assert_close(parameter.grad, grads[name].grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda text, name=name, step=step: f"rank {rank} step {step} grad {name}: {text}")
            checked += 1
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
        ref_state = ref.state_dict()
        for name, tensor in pipe.state_dict().items():  # parameters and BatchNorm buffers after the update
            torch.testing.assert_close(tensor, ref_state[name], rtol=1e-4, atol=1e-6,
                                       msg=lambda text, name=name, step=step: f"rank {rank} step {step} {name}: {text}")
        if step >= STEPS_BEFORE_SAVE:
            continuation.append(loss)
    return {"checked": checked, "losses": continuation, "state": _snapshot(pipe),
            "bn_tracked": int(pipe.state_dict().get("bn.num_batches_tracked", torch.tensor(-1)))}


def _resume(rank: int, root: Path) -> dict[str, Any]:
    """A fresh pipeline (other weights, scrambled generator) loads the checkpoint and runs the same steps."""
    torch.manual_seed(12345)
    pipe = _compile(DropoutBatchNormNet())
    optimizer = _optimizer(pipe.parameters())
    torch.manual_seed(999 + rank)  # the generator must come back from the checkpoint
    info = load_checkpoint(pipe, root / "mid", optimizer=optimizer)
    losses = []
    for step in range(info["step"], STEPS_BEFORE_SAVE + STEPS_AFTER_SAVE):
        x, y = _batch(step)
        losses.append(pipe.step((x,), y))
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "state": _snapshot(pipe), "step": info["step"]}


def _ranks(rank: int, world_size: int, store_dir: str) -> dict[str, Any]:
    root = Path(store_dir) / "checkpoints"
    join_world(store_dir, "train", rank, world_size)
    try:
        trained = _train_and_check(rank, store_dir, root)
    finally:
        leave_world()
    join_world(store_dir, "resume", rank, world_size)
    try:
        resumed = _resume(rank, root)
    finally:
        leave_world()
    return {"trained": trained, "resumed": resumed}


def test_dropout_and_batchnorm_are_exact_on_2_1_and_resume_bit_identically(tmp_path: Path) -> None:
    results = run_ranks(_ranks, sum(REPLICAS), tmp_path)
    for rank, result in enumerate(results):
        trained, resumed = result["trained"], result["resumed"]
        assert trained["checked"] > 0, rank
        assert resumed["step"] == STEPS_BEFORE_SAVE
        assert resumed["losses"] == trained["losses"], (rank, resumed["losses"], trained["losses"])
        assert resumed["state"].keys() == trained["state"].keys()
        for name, values in trained["state"].items():
            assert resumed["state"][name] == values, (rank, name)  # bit for bit
    assert results[0]["trained"]["bn_tracked"] == STEPS_BEFORE_SAVE + STEPS_AFTER_SAVE  # once per step
    # the two stage-0 replicas drew different dropout masks yet hold the same (all-reduced) weights
    assert results[0]["trained"]["state"] == results[1]["trained"]["state"]
