"""Run under torchrun by tests/test_user_errors.py: each user mistake in turn through the Python API, every
rank writing what it raised (type, message) to OUT_DIR/rank<R>.json; also the losses the CLI case loads."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import fxpipe
from fxpipe import models as zoo

ENTRY = zoo.get("mlp")
BATCH = 4


def loss_without_targets(output: torch.Tensor) -> torch.Tensor:
    """A loss_fn with the wrong signature (`fxpipe train --loss tests.user_error_cases:loss_without_targets`)."""
    return output.mean()


def squared_errors(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A loss that forgot to reduce: one value per element."""
    return (output - targets) ** 2


def summed_with_count(output: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A legal (sum, count) loss for loss_reduction='token_mean'."""
    return F.mse_loss(output, targets, reduction="sum"), output.shape[0]


class OverTime(torch.nn.Module):
    """(B, T, 3) -> (B, 2): a sequence model whose inputs a user may pass time-first by mistake."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(3, 3)
        self.outer = torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(torch.relu(self.inner(x))).mean(1)


def _compile_mlp(**options: Any) -> Any:
    model, example_inputs = zoo.build("mlp", **ENTRY.tiny_overrides)
    settings = {"loss_fn": ENTRY.loss_fn, "global_batch_size": BATCH, "plan": "dp", "costs": "analytic", **options}
    return fxpipe.compile(model, example_inputs, **settings)


def _transposed_step() -> Any:
    torch.manual_seed(0)
    pipe = fxpipe.compile(OverTime(), (torch.randn(BATCH, 6, 3),), loss_fn=F.mse_loss, global_batch_size=BATCH,
                          plan="dp", costs="analytic")
    return pipe.step(torch.randn(6, BATCH, 3), torch.randn(BATCH, 2))  # (T, B, C) for (B, T, C)


def cases(out_dir: Path, world_size: int) -> dict[str, Callable[[], Any]]:
    bad_plan = out_dir / "plan.json"
    bad_plan.write_text("{not json")
    return {
        "layout": lambda: _compile_mlp(plan=f"{world_size}:1"),
        "loss-signature": lambda: _compile_mlp(loss_fn=loss_without_targets),
        "loss-not-scalar": lambda: _compile_mlp(loss_fn=squared_errors),
        "token-mean-pair": lambda: _compile_mlp(loss_fn=summed_with_count, loss_reduction="token_mean"),
        "pair-without-token-mean": lambda: _compile_mlp(loss_fn=summed_with_count),
        "transposed-inputs": _transposed_step,
        "plan-file": lambda: _compile_mlp(plan=str(bad_plan)),
        "cluster": lambda: _compile_mlp(cluster="1x2:tpu"),
        "option": lambda: _compile_mlp(sync_params="sometimes"),
    }


def main() -> None:
    torch.set_num_threads(1)
    out_dir = Path(sys.argv[1])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results: dict[str, list[str]] = {}
    for name, case in cases(out_dir, world_size).items():
        try:
            case()
            results[name] = ["ok", ""]
        except Exception as error:  # noqa: BLE001  (recorded for the test, which compares ranks)
            results[name] = [type(error).__name__, str(error)]
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
