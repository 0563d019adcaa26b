"""The single-process oracle every multi-rank exactness test compares with: AdamW steps of the unsplit model on
the whole batch (every step's gradients, losses, final parameters) and the same steps through a pipeline.

Gradients are compared on every step, not only the first: AdamW's update is invariant to a uniform gradient
scale, so a scale bug from step 2 on would leave the parameters right. The parameters the ranks hold
together must be the model's, each held by some rank (:func:`coverage_problems`, gathered across the
ranks that run the pipeline).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fxpipe import models as zoo

LEARNING_RATE = 1e-2
ADAM_EPS = 1e-8  # AdamW's default


def _call(model: torch.nn.Module, inputs: Any) -> Any:
    """Inputs as ``pipe.step`` takes them: keyword inputs, one tensor, or a tuple of positional inputs."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    return model(inputs) if isinstance(inputs, torch.Tensor) else model(*inputs)


def train_reference(model: torch.nn.Module, loss_fn: Any, batches: list[Any], *, adam_eps: float = ADAM_EPS,
                    after_backward: Callable[[torch.nn.Module], Any] | None = None) -> dict[str, Any]:
    """One process, whole batch: gradients of every step (``"grads"``: step 1's), losses, parameters after
    len(batches) AdamW steps.

    ``after_backward(model)`` runs before each optimizer step (e.g. clipping); its results are ``"after_backward"``.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, eps=adam_eps)
    losses, grads_per_step, hooked = [], [], []
    for inputs, targets in batches:
        loss = loss_fn(_call(model, inputs), targets)
        loss.backward()
        losses.append(loss.item())
        if after_backward is not None:
            hooked.append(after_backward(model))
        grads_per_step.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"losses": losses, "grads": grads_per_step[0] if grads_per_step else {}, "grads_per_step": grads_per_step,
            "params": params, "model": model, "after_backward": hooked}


def mismatches(kind: str, actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], *, rtol: float,
               atol: float, atol_of_largest: float = 0.0) -> list[str]:
    """One line per tensor of ``actual`` that differs from ``expected`` beyond the tolerances (``atol``, or
    ``atol_of_largest`` times the expected tensor's largest magnitude when that is more)."""
    problems = []
    for name, tensor in actual.items():
        scaled = atol_of_largest * float(expected[name].abs().max()) if expected[name].numel() else 0.0
        try:
            torch.testing.assert_close(tensor, expected[name], rtol=rtol, atol=max(atol, scaled))
        except AssertionError as error:
            problems.append(f"{kind} {name}: {str(error).splitlines()[0:3]}")
    return problems


def coverage_problems(names_by_rank: list[list[str]], model_names: list[str]) -> list[str]:
    """Problems with which parameters the ranks hold: a name no rank holds, or one the model does not have."""
    held = {name for names in names_by_rank for name in names}
    problems = [f"parameter {name} is held by no rank" for name in sorted(set(model_names) - held)]
    return problems + [f"parameter {name} held by a rank is not the model's" for name in sorted(held - set(model_names))]


def _names_of_every_rank(names: list[str]) -> list[list[str]]:
    """Each rank's parameter names (this process's alone outside a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [names]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, names)
    return gathered


def train_and_compare(pipe: Any, batches: list[Any], reference: dict[str, Any], *, adam_eps: float = ADAM_EPS,
                      after_backward: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """AdamW steps on ``pipe``; every step's gradients (rtol 1e-4) and the final parameters against ``reference``,
    and the parameters held across the process group against the model's (:func:`coverage_problems`).

    Every rank of the process group calls this together (the names are gathered once, before training).
    ``after_backward(pipe)`` runs after each ``step`` (before the gradients are compared); results as in
    :func:`train_reference`.
    """
    names = sorted(name for name, _ in pipe.named_parameters())
    problems = coverage_problems(_names_of_every_rank(names), sorted(reference["params"]))
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=LEARNING_RATE, eps=adam_eps)
    losses, hooked = [], []
    for step, (inputs, targets) in enumerate(batches):
        losses.append(pipe.step(inputs, targets))
        if after_backward is not None:
            hooked.append(after_backward(pipe))
        grads = {name: p.grad for name, p in pipe.named_parameters()}
        # step 0 from equal weights: float rounding only. Later steps start from weights that already differ by
        # the rounding Adam amplifies (up to the 1e-4 checked below), so a gradient may differ by ~1e-3 of its
        # tensor's scale; a scale or misrouting bug moves it by far more
        tolerance = {"rtol": 1e-4, "atol": 1e-6} if step == 0 else {"rtol": 1e-3, "atol": 1e-6, "atol_of_largest": 1e-3}
        problems += mismatches(f"step {step} grad", grads, reference["grads_per_step"][step], **tolerance)
        optimizer.step()
        optimizer.zero_grad()
    params = {name: p.detach() for name, p in pipe.named_parameters()}
    problems += mismatches("param", params, reference["params"], rtol=0.0, atol=1e-4)
    return {"losses": losses, "problems": problems, "names": names, "after_backward": hooked}


def sum_mse(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, targets, reduction="sum")


def summed_lm(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")


def padded_lm_mean(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """What the unsplit model computes: mean over the tokens that are not padding (ignore_index)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def padded_lm_sum_count(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same loss for fxpipe's loss_reduction="token_mean": (sum over tokens, number of tokens)."""
    total = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    return total, (targets != -100).sum()


def padded_lm_batches(batch_size: int, seed: int, num_steps: int) -> list[Any]:
    """The tiny tied-lm's batches with rows of random lengths (targets after each row's length are -100)."""
    entry = zoo.get("tied-lm")
    batches = []
    for step in range(num_steps):
        inputs, targets = entry.make_batch(batch_size, seed + step, **entry.tiny_overrides)
        generator = torch.Generator().manual_seed(seed + step)
        lengths = torch.randint(1, targets.shape[1] + 1, (targets.shape[0],), generator=generator)
        padding = torch.arange(targets.shape[1])[None, :] >= lengths[:, None]  # rows of different lengths
        batches.append((inputs, targets.masked_fill(padding, -100)))
    return batches
