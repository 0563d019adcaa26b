"""The loss probe: on the first step, finds whether loss_fn is a per-row mean or a sum, and checks a declared one."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map

from fxpipe.runtime.faults.errors import LossReductionError

# What one last-stage replica can find, folded into the step's loss allreduce as counts (one slot each):
#   "mean" / "sum"  the loss of a slice is the row-weighted mean / the sum of its parts' losses
#   "token_mean"    a declared (sum, count) adds up over the parts
#   "mean_one_row"  a one-row slice whose loss stays when the row is doubled: a per-row mean, or a token
#                   mean (one row has one token ratio); settled by the next slice, tested with this one
#   "neither"       no hypothesis fits: a token mean with uneven padding, a loss drawing random numbers
#   "failed"        loss_fn raised on a part, or nothing in the slice could be split by rows
VERDICTS = ("mean", "sum", "token_mean", "mean_one_row", "neither", "failed")
# How "auto" weights a slice it could not probe (all-zero losses): checked when the verdict comes
PROVISIONAL = "mean"
DROPPED = "This step's gradients were dropped (earlier steps' are kept)."
TOKEN_MEAN_FIX = ("return (sum, count) and pass loss_reduction='token_mean', e.g. loss_fn=lambda logits, labels: "
                  "(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction='sum'), "
                  "(labels != -100).sum())")
DESCRIBED = {"mean": "a per-row mean (a slice's loss is the row-weighted mean of its halves' losses)",
             "sum": "a sum over rows (a slice's loss is the sum of its halves' losses)"}

# loss_fn on (a part of) a slice: (the slice's outputs by value name, its targets) -> (loss, count)
EvaluateLoss = Callable[[Mapping[str, Any], Any], tuple[torch.Tensor, torch.Tensor | float]]
Part = tuple[int, int] | None  # rows [start, stop) of the slice; None: the slice's rows twice


def probe_tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance for comparing losses that loss_fn returned in ``dtype``.

    The probe applies loss_fn to the same output values, whole and in parts: only the loss's own
    reductions differ (summation order, the rounding of its result). A bf16 result rounds to 2**-9
    each, so a few eps; float32 and float64 keep 1e-5 for sums over millions of terms.
    """
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    return max(1e-5, 4 * eps)


def reduction_verdict(union: float, part_a: float, part_b: float, rows_a: int, rows_b: int, rtol: float) -> str:
    """``"mean"``, ``"sum"``, ``"neither"`` or ``"inconclusive"`` from the losses of two parts and of their union.

    A per-row mean predicts ``union == (rows_a * part_a + rows_b * part_b) / (rows_a + rows_b)``, a sum
    ``union == part_a + part_b``. One is accepted when it is within ``rtol`` and the predictions lie
    more than ``4 * rtol`` apart (the other is then clearly off); predictions that close (all-zero
    losses), or a value that is not finite, tell nothing. Errors are relative to
    ``max(|union|, |part_a| + |part_b|)``, the size of the terms the loss added up.
    """
    if not all(math.isfinite(value) for value in (union, part_a, part_b)):
        return "inconclusive"
    scale = max(abs(union), abs(part_a) + abs(part_b))
    mean = (rows_a * part_a + rows_b * part_b) / (rows_a + rows_b)
    total = part_a + part_b
    if scale == 0.0 or abs(mean - total) <= 4 * rtol * scale:
        return "inconclusive"
    if abs(union - mean) <= rtol * scale:
        return "mean"
    if abs(union - total) <= rtol * scale:
        return "sum"
    return "neither"


def additive_verdict(union: tuple[float, float], part_a: tuple[float, float], part_b: tuple[float, float],
                     rtol: float) -> str:
    """``"token_mean"`` if a ``(sum, count)`` adds up over two parts, ``"neither"`` if not, or ``"inconclusive"``."""
    (total, count), (sum_a, count_a), (sum_b, count_b) = union, part_a, part_b
    if not all(math.isfinite(value) for value in (total, count, sum_a, count_a, sum_b, count_b)):
        return "inconclusive"
    if abs(count - (count_a + count_b)) > 1e-6 * max(abs(count), 1.0):
        return "neither"
    scale = max(abs(total), abs(sum_a) + abs(sum_b))
    if scale == 0.0:
        return "inconclusive"
    return "token_mean" if abs(total - (sum_a + sum_b)) <= rtol * scale else "neither"


@dataclass
class _Kept:
    """A one-row slice (detached), kept until the next slice is tested together with it."""

    outputs: dict[str, Any]
    targets: Any
    loss: float


class LossProbe:
    """One rank's loss probe; every rank has one, so every rank folds the same number of values.

    While the verdict is open (``active``, the same on every rank) the last stage probes its first
    slice before the slice's weight is chosen (:meth:`observe`), each rank folds its verdict into the
    loss allreduce that ends the step (:meth:`fold_values`), and every rank reads the same sums
    (:meth:`conclude`): a settled verdict ends probing everywhere; a contradiction becomes the same
    error on every rank, which the driver raises after dropping the step's gradients.
    """

    def __init__(self, declared: str, output_dims: Mapping[str, int | None], target_batch_dim: int) -> None:
        self.declared = declared  # "auto", "mean", "sum" or "token_mean"
        self.output_dims = dict(output_dims)  # the last stage's batch dim per output value (None: not batched)
        self.target_batch_dim = target_batch_dim
        self.active = True
        self.resolved: str | None = None if declared == "auto" else declared
        self.local: str | None = None  # this rank's verdict
        self.detail = ""  # this rank's numbers behind it, for the error message
        self.kept: _Kept | None = None
        self.num_provisional = 0  # this step's slices weighted as PROVISIONAL, unprobed
        self.provisional_total = 0.0  # all ranks', all steps so far (from the folds)
        self.error: LossReductionError | None = None

    def weighting(self) -> str:
        """The reduction to weight a slice by now: the declared one, else what the probe found (or PROVISIONAL)."""
        if self.declared != "auto":
            return self.declared
        if self.resolved is not None:
            return self.resolved
        return "sum" if self.local == "sum" else PROVISIONAL

    def start_step(self) -> None:
        """Forget what a step that failed half-way left: a one-row slice is only tested within its step."""
        self.num_provisional = 0
        self.error = None
        if self.local == "mean_one_row":
            self.local, self.kept = None, None

    def observe(self, evaluate: EvaluateLoss, outputs: Mapping[str, Any], targets: Any, rows: int,
                loss: torch.Tensor, count: torch.Tensor | float) -> str:
        """Probe one last-stage slice while the verdict is open; the reduction to weight this slice by.

        Costs nothing once settled. While open: a slice of ``rows > 1`` rows is evaluated in two halves
        (together one more loss evaluation of the slice's rows, no autograd); a one-row slice with its
        row doubled, and then with the next slice (:meth:`_test_kept`). Each read of the numbers waits
        for the device, on the first step only.
        """
        if not self.active:
            return self.weighting()
        if self.local is None:
            self.local, self.detail = self._probe(evaluate, outputs, targets, rows, loss, count)
            if self.local is None and self.declared == "auto":
                self.num_provisional += 1
        elif self.local == "mean_one_row" and self.kept is not None:
            self._test_kept(evaluate, outputs, targets, rows, loss)
        return self.weighting()

    def _probe(self, evaluate: EvaluateLoss, outputs: Mapping[str, Any], targets: Any, rows: int,
               loss: torch.Tensor, count: torch.Tensor | float) -> tuple[str | None, str]:
        if rows < 1:
            return None, ""
        parts: list[Part] = [(0, rows // 2), (rows // 2, rows)] if rows > 1 else [None]
        results = []
        for part in parts:
            part_outputs, part_targets, split = self._select(outputs, targets, rows, part)
            if not split:  # no batched leaf: the model computes the loss itself, or the batch is elsewhere
                return self._unsplittable(rows)
            failure, result = _try(evaluate, part_outputs, part_targets)
            if result is None:
                return "failed", f"loss_fn raised {failure} on {_describe(part, rows)}"
            results.append(result)
        values = _read([loss, count, *(value for result in results for value in result)])
        rtol = probe_tolerance(loss.dtype)
        if rows > 1:
            union, part_a, part_b = (values[0], values[1]), (values[2], values[3]), (values[4], values[5])
            rows_a, rows_b = rows // 2, rows - rows // 2
        else:  # the row twice is the union of two parts that are the row itself
            union, part_a, part_b = (values[2], values[3]), (values[0], values[1]), (values[0], values[1])
            rows_a = rows_b = 1
        detail = _numbers(union[0], part_a[0], part_b[0], rows_a, rows_b, doubled=rows == 1)
        if self.declared == "token_mean":
            verdict = additive_verdict(union, part_a, part_b, rtol)
        else:
            verdict = reduction_verdict(union[0], part_a[0], part_b[0], rows_a, rows_b, rtol)
            if verdict == "mean" and rows == 1:
                verdict = "mean_one_row"
                self.kept = _Kept(*self._select(outputs, targets, rows, (0, 1))[:2], loss=values[0])
        return (None if verdict == "inconclusive" else verdict), detail

    def _unsplittable(self, rows: int) -> tuple[str, str]:
        what = f"no output or target of the slice holds its {rows} rows in its batch dim"
        if self.declared == "auto":
            return "failed", f"{what} (does the model compute the loss itself?)"
        return self.declared, f"{what}; loss_reduction={self.declared!r} taken as declared"

    def _test_kept(self, evaluate: EvaluateLoss, outputs: Mapping[str, Any], targets: Any, rows: int,
                   loss: torch.Tensor) -> None:
        """The kept one-row slice and this slice together: a per-row mean, or rows weighted otherwise."""
        kept = self.kept
        assert kept is not None
        joined_outputs = {name: _join(kept.outputs.get(name), value, self.output_dims.get(name), rows)
                          for name, value in outputs.items()}
        joined_targets = tree_map(lambda old, new: _join(old, new, self.target_batch_dim, rows), kept.targets, targets)
        failure, result = _try(evaluate, joined_outputs, joined_targets)
        if result is None:
            self.local, self.detail, self.kept = "failed", f"loss_fn raised {failure} on {1 + rows} rows", None
            return
        union, current = _read([result[0], loss])
        verdict = reduction_verdict(union, kept.loss, current, 1, rows, probe_tolerance(loss.dtype))
        if verdict != "inconclusive":
            self.local = "mean" if verdict == "mean" else "neither"
            self.detail, self.kept = _numbers(union, kept.loss, current, 1, rows), None

    def _select(self, outputs: Mapping[str, Any], targets: Any, rows: int,
                part: Part) -> tuple[dict[str, Any], Any, bool]:
        """Rows ``part`` of every output and target leaf that holds the slice's rows (others whole), detached;
        and whether any leaf was split."""
        split = [False]

        def select(value: Any, dim: int | None) -> Any:
            if not _holds_rows(value, dim, rows):
                return value
            assert dim is not None
            split[0] = True
            value = value.detach()
            return torch.cat([value, value], dim) if part is None else value.narrow(dim, part[0], part[1] - part[0])

        selected = {name: select(value, self.output_dims.get(name)) for name, value in outputs.items()}
        return selected, tree_map(lambda value: select(value, self.target_batch_dim), targets), split[0]

    def fold_values(self) -> list[float]:
        """This rank's part of the loss allreduce while the verdict is open: its verdict (one-hot), its
        provisional slices; nothing once settled (the same on every rank)."""
        if not self.active:
            return []
        return [float(self.local == verdict) for verdict in VERDICTS] + [float(self.num_provisional)]

    def conclude(self, sums: Sequence[float]) -> None:
        """After the allreduce, on every rank with the same sums: settle the verdict, or keep the error to raise."""
        if not self.active:
            return
        counts = dict(zip(VERDICTS, sums, strict=False))
        self.provisional_total += sums[len(VERDICTS)]
        self.num_provisional = 0
        verdict, self.error = self._decide(counts)
        if verdict is not None and self.error is None:
            self.resolved, self.active, self.kept = verdict, False, None

    def take_error(self) -> LossReductionError | None:
        error, self.error = self.error, None
        return error

    def _decide(self, counts: Mapping[str, float]) -> tuple[str | None, LossReductionError | None]:
        """The job's verdict from every replica's (None while nobody could tell) and the error it makes, if any."""
        here = f" (this rank: {self.detail})" if self.detail else ""
        if counts["failed"]:
            return None, self._failed(int(counts["failed"]), here)
        if counts["neither"]:
            return None, self._neither(int(counts["neither"]), here)
        means = counts["mean"] + counts["mean_one_row"]
        if means and counts["sum"]:
            return None, LossReductionError(
                f"last-stage replicas disagree about loss_fn: {int(means)} found a per-row mean, {int(counts['sum'])} "
                f"a sum over rows{here}; loss_fn must be a function of its rows alone (no random numbers, no "
                f"dependence on how many rows it gets). {DROPPED}")
        found = [name for name in ("mean", "sum", "token_mean") if counts[name]]
        if not found and counts["mean_one_row"]:
            if self.declared != "auto":
                found = ["mean"]  # as declared: one row cannot show a token mean, the user says it is none
            else:
                return None, LossReductionError(
                    "loss_reduction='auto' cannot tell a per-row mean from a token mean here: every last-stage slice "
                    f"it probed on this step holds one row, and one row has one token ratio{here}; pass "
                    f"loss_reduction='mean' if loss_fn is a per-row mean, or {TOKEN_MEAN_FIX}. {DROPPED}")
        if not found:
            return None, None  # inconclusive on every replica: probe again on the next step
        verdict = found[0]
        if self.declared not in ("auto", verdict):
            return None, LossReductionError(
                f"loss_reduction={self.declared!r} but loss_fn is {DESCRIBED.get(verdict, verdict)}{here}; pass "
                f"loss_reduction={verdict!r} (or 'auto'). {DROPPED}")
        if self.declared == "auto" and self.provisional_total and verdict != PROVISIONAL:
            return None, LossReductionError(
                f"loss_fn is {DESCRIBED[verdict]}{here}, but {int(self.provisional_total)} earlier slice(s) whose "
                f"losses could not be probed (all zero or not finite) were weighted as a per-row mean; pass "
                f"loss_reduction={verdict!r}. {DROPPED}")
        return verdict, None

    def _neither(self, num_replicas: int, here: str) -> LossReductionError:
        if self.declared == "token_mean":
            return LossReductionError(
                f"loss_reduction='token_mean' but the (sum, count) loss_fn returns does not add up over rows on "
                f"{num_replicas} last-stage replica(s){here}: return the sum over tokens (reduction='sum', not a "
                f"mean) and the number of tokens it counted. {DROPPED}")
        subject = "loss_fn" if self.declared == "auto" else f"loss_reduction={self.declared!r} but loss_fn"
        return LossReductionError(
            f"{subject} is neither a per-row mean nor a sum over rows on {num_replicas} last-stage replica(s): a "
            f"slice's loss is neither the row-weighted mean nor the sum of its parts' losses{here}, so slices "
            "cannot be combined into the whole batch's loss (training would silently differ from one process). A "
            f"token mean over rows with different numbers of tokens (padding, ignore_index=-100) is such a loss: "
            f"{TOKEN_MEAN_FIX}. A loss_fn drawing random numbers fails this check too. {DROPPED}")

    def _failed(self, num_replicas: int, here: str) -> LossReductionError:
        return LossReductionError(
            f"the loss_reduction probe could not evaluate loss_fn on parts of a slice on {num_replicas} last-stage "
            f"replica(s){here}; fxpipe calls loss_fn on slices of any number of rows (the model's outputs and the "
            "targets, cut along their batch dims), so it must accept them; a loss the model computes itself (no output "
            "or target holds the rows) cannot be probed: declare loss_reduction='mean', 'sum' or 'token_mean'. "
            f"{DROPPED}")


def _holds_rows(value: Any, dim: int | None, rows: int) -> bool:
    return isinstance(value, torch.Tensor) and dim is not None and value.dim() > dim and value.shape[dim] == rows


def _join(kept: Any, value: Any, dim: int | None, rows: int) -> Any:
    """The kept one-row leaf followed by this slice's rows (leaves without rows: this slice's)."""
    if dim is None or not (_holds_rows(value, dim, rows) and _holds_rows(kept, dim, 1)):
        return value
    return torch.cat([kept, value.detach()], dim)


def _try(evaluate: EvaluateLoss, outputs: Mapping[str, Any], targets: Any
         ) -> tuple[str, tuple[torch.Tensor, torch.Tensor | float] | None]:
    """``evaluate`` without autograd; a raise becomes its description, reported on every rank at the step's end
    (raising here alone would leave the other ranks waiting)."""
    try:
        with torch.no_grad():
            return "", evaluate(outputs, targets)
    except Exception as error:  # noqa: BLE001 - folded into the allreduce and raised on every rank
        return f"{type(error).__name__}: {error}", None


def _read(values: Sequence[torch.Tensor | float]) -> list[float]:
    """The values as floats, with one wait for the device."""
    tensors = [value for value in values if isinstance(value, torch.Tensor)]
    read = iter(torch.stack([t.detach().reshape(()).to(device=tensors[0].device, dtype=torch.float64)
                             for t in tensors]).tolist() if tensors else [])
    return [next(read) if isinstance(value, torch.Tensor) else float(value) for value in values]


def _describe(part: Part, rows: int) -> str:
    return f"the slice's {rows} row(s) twice" if part is None else f"rows {part[0]}:{part[1]} of a {rows}-row slice"


def _numbers(union: float, part_a: float, part_b: float, rows_a: int, rows_b: int, *, doubled: bool = False) -> str:
    mean = (rows_a * part_a + rows_b * part_b) / (rows_a + rows_b)
    if doubled:
        return (f"a one-row slice has loss {part_a:.7g}, its row twice {union:.7g}; a per-row mean gives {mean:.7g}, "
                f"a sum {part_a + part_b:.7g}")
    return (f"parts of {rows_a} and {rows_b} rows have losses {part_a:.7g} and {part_b:.7g}, together {union:.7g}; "
            f"a per-row mean gives {mean:.7g}, a sum {part_a + part_b:.7g}")
