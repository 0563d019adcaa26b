"""The exactness oracle itself: it catches a gradient scale bug that starts on step 2 (AdamW would hide it in
the parameters) and a parameter no rank holds."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from tests.exactness_oracle import coverage_problems, train_and_compare, train_reference


class OneProcessPipe:
    """The whole model in this process, stepping like ``pipe.step``; ``scale_from_step`` multiplies the
    gradients from that step on, ``hidden`` parameters are left out of ``named_parameters``."""

    def __init__(self, model: nn.Module, scale_from_step: int | None = None, hidden: tuple[str, ...] = ()) -> None:
        self.model, self.scale_from_step, self.hidden, self.steps = model, scale_from_step, hidden, 0

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.model.named_parameters() if n not in self.hidden]

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_parameters()]

    def step(self, inputs: Any, targets: torch.Tensor) -> float:
        loss = nn.functional.mse_loss(self.model(*inputs), targets)
        loss.backward()
        if self.scale_from_step is not None and self.steps >= self.scale_from_step:
            for param in self.model.parameters():
                param.grad *= 2.0
        self.steps += 1
        return loss.item()


def _setup() -> tuple[nn.Module, list[Any], dict[str, Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    batches = [((torch.randn(6, 4),), torch.randn(6, 2)) for _ in range(3)]
    return model, batches, train_reference(copy.deepcopy(model), nn.functional.mse_loss, batches)


def test_the_oracle_passes_an_exact_pipe() -> None:
    model, batches, reference = _setup()
    assert train_and_compare(OneProcessPipe(model), batches, reference)["problems"] == []


def test_a_gradient_scale_bug_from_step_two_on_is_caught() -> None:
    model, batches, reference = _setup()
    problems = train_and_compare(OneProcessPipe(model, scale_from_step=1), batches, reference)["problems"]
    assert any(p.startswith("step 1 grad") for p in problems), problems
    assert not any(p.startswith("step 0") for p in problems), problems


def test_a_parameter_held_by_no_rank_is_caught() -> None:
    model, batches, _ = _setup()  # one step: the hidden bias is then only missing, not also untrained
    reference = train_reference(copy.deepcopy(model), nn.functional.mse_loss, batches[:1])
    problems = train_and_compare(OneProcessPipe(model, hidden=("2.bias",)), batches[:1], reference)["problems"]
    assert problems == ["parameter 2.bias is held by no rank"]
    assert coverage_problems([["a"], ["b", "c"]], ["a", "b", "c"]) == []
    assert coverage_problems([["a"], ["a", "x"]], ["a", "b"]) == ["parameter b is held by no rank",
                                                                 "parameter x held by a rank is not the model's"]
