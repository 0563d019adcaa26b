"""fp16 loss scaling (``pipe.grad_scaler()``) on 3 gloo ranks against one process with ``torch.amp.GradScaler``.

Each case trains under fp16 autocast on the CPU with scales chosen so that some steps overflow: the steps
skipped and the scale of every step must be those of one process running the unsplit model under
``torch.autocast(dtype=torch.float16)`` with torch's scaler, and the weights must agree within fp16 noise
(measured per case, :func:`_tolerances`). One case overflows on the first stage only; the same run with a
per-rank found-inf (what torch's own GradScaler does) makes the ranks skip different steps, which the
job-wide allreduce prevents. One world of 3 ranks serves every case.

Overflow margins: every scale sits at least 5x above or below where a stage's fp16 gradients overflow, on
every step of the run, in one process summing 12, 6 or 3 rows per slice (measured as max |scaled gradient|
per stage before unscale_): WideInput's first stage reaches 2**19.7..2**20.3 at 2**15 and its second at most
2**13.5 (overflow: 2**16); gpt-mini overflows above 2**21 and not below 2**19, used at 2**26 and 2**16. So
the pipeline, which sums 3 or 6 rows per slice in fp16 and the rest in fp32, sees the same overflows.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe import models as zoo
from fxpipe.passes import trace
from fxpipe.runtime.checkpoint_io import _restore_scaler
from fxpipe.runtime.grad_scaler import GradScalerError, PipelineGradScaler, make_grad_scaler
from tests.exactness_oracle import LEARNING_RATE
from tests.mp_utils import join_world, leave_world, plan_from_cuts, run_ranks

WORLD_SIZE = 3
GLOBAL_BATCH = 12
NUM_MICROBATCHES = 2  # stage 0's two replicas then sum 3 rows per slice in fp16, stage 1 six
NUM_STEPS = 7
MAX_NORM = 1.0
INPUT_SCALE = 1000.0  # WideInput's inputs: its first layer's weight gradients are ~1000x the others'
WIDE_LEARNING_RATE = 1e-4  # its first layer's weights are ~3e-4: a larger AdamW step would move the thresholds
# AdamW's eps: with the default 1e-8, AdamW turns the fp16 rounding of a gradient near zero into a whole lr step
# of either sign (measured on gpt-mini: weights of one-process runs summing 12 or 3 rows per slice then differ
# by 0.019, half of what the 4 steps move them, 0.040); with 1e-4 by 3e-4, so the weights check means something
ADAM_EPS = 1e-4

# scaler arguments: (init, backoff, growth) jump between a scale far above and one far below the overflow
# thresholds; growth_interval=2 so the scale comes back up and overflows again: skip, step, step, skip, ...
FIRST_STAGE_ONLY = {"init_scale": 2.0**15, "backoff_factor": 2.0**-8, "growth_factor": 2.0**8, "growth_interval": 2}
EVERY_STAGE = {"init_scale": 2.0**26, "backoff_factor": 2.0**-18, "growth_factor": 2.0**18, "growth_interval": 2}
GPT_EVERY_STAGE = {"init_scale": 2.0**26, "backoff_factor": 2.0**-10, "growth_factor": 2.0**10, "growth_interval": 2}


class WideInput(nn.Module):
    """x (B, 8) of magnitude INPUT_SCALE -> Linear(8, 16) (weights / INPUT_SCALE) -> GELU -> Linear(16, 16) -> GELU
    -> Linear(16, 4): the first layer's weight gradient is ~INPUT_SCALE times the others', so a scale between the
    two thresholds overflows the first stage only."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.hidden, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        with torch.no_grad():
            self.first.weight.div_(INPUT_SCALE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(nn.functional.gelu(self.hidden(nn.functional.gelu(self.first(x)))))


def _wide_model() -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    return WideInput(), (torch.randn(GLOBAL_BATCH, 8) * INPUT_SCALE,)


def _wide_batches(count: int) -> list[Any]:
    batches = []
    for step in range(count):
        generator = torch.Generator().manual_seed(300 + step)
        inputs = torch.randn(GLOBAL_BATCH, 8, generator=generator) * INPUT_SCALE
        batches.append(((inputs,), torch.randn(GLOBAL_BATCH, 4, generator=generator)))
    return batches


def _gpt_model() -> tuple[nn.Module, Any]:
    return zoo.build("gpt-mini", seed=0, **zoo.get("gpt-mini").tiny_overrides)


def _gpt_batches(count: int) -> list[Any]:
    entry = zoo.get("gpt-mini")
    return [entry.make_batch(GLOBAL_BATCH, 300 + step, **entry.tiny_overrides) for step in range(count)]


def _mse(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, targets)


# name -> (build, batches, loss_fn, AdamW learning rate)
MODELS = {"wide": (_wide_model, _wide_batches, _mse, WIDE_LEARNING_RATE),
          "gpt-mini": (_gpt_model, _gpt_batches, zoo.get("gpt-mini").loss_fn, LEARNING_RATE)}

# (name, model, replicas, schedule, sharding, scaler arguments, pipe.step calls per optimizer step)
CASES = (
    ("gpt-mini 2:1 dapple", "gpt-mini", (2, 1), "dapple", "none", GPT_EVERY_STAGE, 1),
    ("wide 2:1 zero_bubble, first stage only", "wide", (2, 1), "zero_bubble", "none", FIRST_STAGE_ONLY, 1),
    ("wide 2:1 dapple, ZeRO-2 stage, accumulating 2 steps", "wide", (2, 1), "dapple", "gradients", EVERY_STAGE, 2),
)


def _call(model: nn.Module, inputs: Any) -> Any:
    return model(*inputs) if isinstance(inputs, tuple) else model(inputs)


def reference(model_name: str, scaler_args: dict[str, float], accumulate: int, num_slices: int = 1) -> dict[str, Any]:
    """One process, unsplit model, fp16 autocast, torch.amp.GradScaler: the loop of docs/training_loop.md, with
    ``accumulate`` batches' gradients summed per optimizer step.

    ``num_slices`` > 1 accumulates the batch's gradient over that many row slices (each loss weighted by its
    share of the rows), as a pipeline sums its slices: the same numbers but another fp16 summation order.
    """
    build, batches, loss_fn, learning_rate = MODELS[model_name]
    model, _ = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, eps=ADAM_EPS)
    scaler = torch.amp.GradScaler("cpu", **scaler_args)
    scales, skipped, losses, norms = [], [], [], []
    every_batch = batches(NUM_STEPS * accumulate)
    for step in range(NUM_STEPS):
        for inputs, targets in every_batch[step * accumulate:(step + 1) * accumulate]:
            rows = GLOBAL_BATCH // num_slices
            loss_sum = 0.0
            for start in range(0, GLOBAL_BATCH, rows):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = loss_fn(_call(model, tuple(x[start:start + rows] for x in inputs)),
                                   targets[start:start + rows])
                scaler.scale(loss * (rows / GLOBAL_BATCH)).backward()
                loss_sum += loss.item() * rows / GLOBAL_BATCH
            losses.append(loss_sum)
        scale = scaler.get_scale()
        scaler.unscale_(optimizer)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        scales.append(scale)
        skipped.append(scaler.get_scale() < scale)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"scales": scales, "skipped": skipped, "losses": losses, "norms": norms, "params": params}


def _tolerances(model_name: str, scaler_args: dict[str, float], accumulate: int,
                whole: dict[str, Any]) -> dict[str, float]:
    """What the pipeline may differ by: 4x the spread measured between one-process runs that differ only in
    how the batch's gradient is summed (whole batch vs 2 slices of 6 rows vs 4 of 3, the slicings of these
    plans' stages): fp16 rounding of the per-slice sums, carried into the weights by AdamW (see ADAM_EPS). The
    pipeline mixes those slicings and adds replicas in another order, hence the factor. ``weights``: absolute; ``norms``, ``losses``: relative."""
    spread = {"weights": 0.0, "norms": 0.0, "losses": 0.0}
    for num_slices in (2, 4):
        sliced = reference(model_name, scaler_args, accumulate, num_slices=num_slices)
        assert sliced["skipped"] == whole["skipped"], f"the overflow margins do not hold for {num_slices} slices"
        spread["weights"] = max(spread["weights"], *(float((sliced["params"][name] - value).abs().max())
                                                     for name, value in whole["params"].items()))
        stepped = zip(whole["norms"], sliced["norms"], whole["skipped"], strict=True)
        spread["norms"] = max(spread["norms"], *(abs(a - b) / a for a, b, skip in stepped if not skip))
        pairs = zip(whole["losses"], sliced["losses"], strict=True)
        spread["losses"] = max(spread["losses"], *(abs(a - b) / a for a, b in pairs))
    assert min(spread.values()) > 0.0, f"summation orders agree exactly, nothing measures the fp16 noise: {spread}"
    return {key: 4.0 * value for key, value in spread.items()}


def _compile(model_name: str, replicas: tuple[int, ...], schedule: str, sharding: str) -> Any:
    build, _, loss_fn, _ = MODELS[model_name]
    model, example_inputs = build()
    plan = plan_from_cuts(trace(copy.deepcopy(model), example_inputs), replicas, GLOBAL_BATCH, NUM_MICROBATCHES)
    return fxpipe.compile(model, example_inputs, loss_fn=loss_fn, global_batch_size=GLOBAL_BATCH, plan=plan,
                          schedule=schedule, sharding=sharding, autocast_dtype=torch.float16)


def _train(pipe: Any, model_name: str, scaler: Any, accumulate: int) -> dict[str, Any]:
    """The loop users write: step (``accumulate`` times), unscale_, clip, scaler.step, update; records what each
    rank saw."""
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=MODELS[model_name][3], eps=ADAM_EPS)
    scales, skipped, losses, local_overflow, norms = [], [], [], [], []
    every_batch = MODELS[model_name][1](NUM_STEPS * accumulate)
    for step in range(NUM_STEPS):
        for inputs, targets in every_batch[step * accumulate:(step + 1) * accumulate]:
            losses.append(pipe.step(inputs, targets))
        local_overflow.append(any(not bool(torch.isfinite(p.grad).all()) for p in pipe.parameters()
                                  if p.grad is not None))
        scale = scaler.get_scale()
        scaler.unscale_(optimizer)
        norms.append(float(pipe.clip_grad_norm_(MAX_NORM)))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        scales.append(scale)
        skipped.append(scaler.get_scale() < scale)
    # as lists: tensors a rank returns through the result queue would be shared memory of an exited process
    weights = {name: t.tolist() for name, t in pipe.state_dict().items() if name in dict(pipe.named_parameters())}
    return {"scales": scales, "skipped": skipped, "losses": losses, "local_overflow": local_overflow,
            "weights": weights, "optimizer": optimizer, "final_scale": scaler.get_scale(), "norms": norms}


def _checkpoint_round_trip(pipe: Any, scaler: Any, optimizer: Any, directory: str) -> dict[str, Any]:
    """Save, change the scaler, load: the saved scale and growth tracker come back (and sit in the manifest)."""
    saved = scaler.state_dict()
    pipe.save(directory, optimizer=optimizer, step=NUM_STEPS)
    scaler.update(new_scale=3.0)
    scaler._growth_tracker.fill_(1)
    pipe.load(directory, optimizer=optimizer)
    manifest = json.loads((Path(directory) / "fxpipe_manifest.json").read_text())
    return {"saved": saved, "loaded": scaler.state_dict(), "manifest": manifest["grad_scaler"]}


def _per_rank_run(pipe: Any, model_name: str, initial: dict[str, torch.Tensor], args: dict[str, float],
                  accumulate: int) -> Any:
    """The same training with each rank deciding on its own flags, as torch's GradScaler on pipe.parameters()."""
    pipe.load_state_dict(initial)
    pipe.driver.runner.scaler = None  # a fresh scaler for the second run (grad_scaler() refuses a second one)
    scaler = pipe.grad_scaler(**args)
    scaler._agree = lambda flag: flag  # type: ignore[method-assign]
    return _train(pipe, model_name, scaler, accumulate)


def _run(rank: int, world_size: int, store_dir: str) -> dict[str, Any]:
    results = {}
    for index, (name, model_name, replicas, schedule, sharding, args, accumulate) in enumerate(CASES):
        join_world(store_dir, f"case-{index}", rank, world_size)
        try:
            pipe = _compile(model_name, replicas, schedule, sharding)
            initial = {key: value.clone() for key, value in pipe.state_dict().items()}
            scaler = pipe.grad_scaler(**args)
            record = _train(pipe, model_name, scaler, accumulate)
            record["stage"] = pipe.stage_index
            record["class"] = type(scaler).__name__
            if index == 0:
                try:
                    pipe.grad_scaler()
                except GradScalerError as error:
                    record["second_call"] = str(error)
                record["checkpoint"] = _checkpoint_round_trip(pipe, scaler, record["optimizer"],
                                                              str(Path(store_dir) / "ckpt"))
            if model_name == "wide" and schedule == "zero_bubble":
                again = _per_rank_run(pipe, model_name, initial, args, accumulate)
                record["per_rank"] = {key: again[key] for key in ("skipped", "scales")}
            record.pop("optimizer")
            results[name] = record
        finally:
            leave_world()
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_run, WORLD_SIZE, tmp_path_factory.mktemp("scaler"), timeout_s=300.0)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_skips_scales_and_weights_match_one_process(ranks: list[dict[str, Any]], case: tuple[Any, ...]) -> None:
    name, model_name, _, _, _, args, accumulate = case
    expected = reference(model_name, args, accumulate)
    assert any(expected["skipped"]) and not all(expected["skipped"]), expected["skipped"]  # the case exercises both
    tolerance = _tolerances(model_name, args, accumulate, expected)
    weights: dict[str, torch.Tensor] = {}
    for rank, results in enumerate(ranks):
        record = results[name]
        assert record["class"] == PipelineGradScaler.__name__ and issubclass(PipelineGradScaler, torch.amp.GradScaler)
        assert record["skipped"] == expected["skipped"], f"rank {rank}"
        assert record["scales"] == expected["scales"], f"rank {rank}"
        # the unscaled loss (a scaled one is off by the scale, >= 2**8) and the unscaled gradients' whole-model norm
        torch.testing.assert_close(record["losses"], expected["losses"], rtol=tolerance["losses"], atol=0.0)
        stepped = [not skip for skip in expected["skipped"]]
        torch.testing.assert_close([n for n, ok in zip(record["norms"], stepped, strict=True) if ok],
                                   [n for n, ok in zip(expected["norms"], stepped, strict=True) if ok],
                                   rtol=tolerance["norms"], atol=0.0)
        weights.update({key: torch.tensor(value) for key, value in record["weights"].items()})
    assert set(weights) == set(expected["params"])
    worst = {key: float((weights[key] - value).abs().max()) for key, value in expected["params"].items()}
    assert max(worst.values()) <= tolerance["weights"], (tolerance, worst)


@pytest.mark.multiprocess
def test_one_stage_overflows_and_all_ranks_skip_together(ranks: list[dict[str, Any]]) -> None:
    record = [results["wide 2:1 zero_bubble, first stage only"] for results in ranks]
    first, last = record[0], record[2]
    assert (first["stage"], last["stage"]) == (0, 1)
    # the skipped steps overflowed on stage 0 only: without the allreduce stage 1 would have stepped
    assert first["local_overflow"] == first["skipped"] and not any(last["local_overflow"]), record
    # what torch's per-rank check does: the ranks skip different steps and their scales part
    per_rank = [results["per_rank"] for results in record]
    assert per_rank[0]["skipped"] != per_rank[2]["skipped"] and per_rank[0]["scales"] != per_rank[2]["scales"]


@pytest.mark.multiprocess
def test_scaler_state_round_trips_through_checkpoints(ranks: list[dict[str, Any]]) -> None:
    for rank, results in enumerate(ranks):
        checkpoint = results["gpt-mini 2:1 dapple"]["checkpoint"]
        assert checkpoint["loaded"] == checkpoint["saved"] == checkpoint["manifest"], f"rank {rank}"
        assert checkpoint["saved"]["scale"] == results["gpt-mini 2:1 dapple"]["final_scale"]
        assert "already has a grad scaler" in results["gpt-mini 2:1 dapple"]["second_call"]


def _one_rank_driver() -> Any:
    """What PipelineGradScaler reads of a driver, for a world of one (no allreduce)."""
    context = SimpleNamespace(device=torch.device("cpu"), world_size=1)
    return SimpleNamespace(context=context, stage_index=0, runner=SimpleNamespace(scaler=None))


def test_a_rank_without_gradients_still_decides() -> None:
    """A frozen stage's optimizer holds no gradient: torch's GradScaler.step would assert "No inf checks were
    recorded"; this rank must still produce its flag (and join the allreduce), and steps like the others."""
    parameter = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([parameter], lr=1.0)
    scaler = make_grad_scaler(_one_rank_driver(), init_scale=4.0)
    scaler.step(optimizer)  # no gradient at all
    scaler.update()
    assert scaler.get_scale() == 4.0 and parameter.detach().tolist() == [1.0, 1.0]
    parameter.grad = torch.tensor([8.0, float("inf")])
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == 2.0 and parameter.detach().tolist() == [1.0, 1.0]  # skipped, backed off
    with pytest.raises(GradScalerError, match="already has a grad scaler"):
        make_grad_scaler(scaler._driver)


def test_checkpoint_without_scaler_state_warns(tmp_path: Path) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    with pytest.warns(UserWarning, match="holds no grad scaler state"):
        _restore_scaler(SimpleNamespace(scaler=scaler), None, tmp_path)
    assert scaler.get_scale() == 8.0
    with pytest.warns(UserWarning, match="call pipe.grad_scaler\\(\\) before pipe.load"):
        _restore_scaler(SimpleNamespace(scaler=None), {"scale": 2.0}, tmp_path)
    _restore_scaler(SimpleNamespace(scaler=scaler), {**scaler.state_dict(), "scale": 2.0}, tmp_path)
    assert scaler.get_scale() == 2.0
