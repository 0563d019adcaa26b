"""Mixed-precision parameters (precision ``bf16-params``) on 3 gloo ranks against one process under the same policy.

Every case trains gpt-mini (4 blocks, its embedding tied to the head across stages) on a 2:1 layout under bf16
autocast with ``param_dtype=torch.bfloat16``: stage 0's two replicas unsharded (the runtime's own bf16 copies,
fxpipe.runtime.parallel.param_precision), ZeRO-1 and ZeRO-3 (FSDP2's MixedPrecisionPolicy), and under zero-bubble
unsharded and ZeRO-2 (W apart from B). Each rank checks
that its masters and their gradients stay fp32 while the stage's layers compute with bf16 weights; step 1's
gradients and the weights after NUM_STEPS AdamW steps must match one process that makes its bf16 copies the
same way (one differentiable cast per master per step, fp32 masters, same AdamW).

Tolerance (:func:`_tolerances`): 4x the spread measured between one-process runs that differ only in how the
batch is sliced (whole, 4 slices of 3 rows, 6 of 2: the plan's slicings are 2 rows on stage 0's replicas, 4 on
stage 1): each slice's weight gradient is rounded to bf16 before the fp32 sum, so slicing alone moves it. The
same tolerance is checked to be far below what autocast over fp32 weights (precision ``bf16``) differs by: a
pipeline that ignored ``param_dtype`` fails. One memory case: a ZeRO-3 stage of wide layers under the policy
against the planner's model_state_bytes (fxpipe.sim.sharding_memory), within 5%. One world for the file.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.func import functional_call

import fxpipe
from fxpipe import models as zoo
from fxpipe.core.precision import param_copy_fraction
from fxpipe.passes import trace
from fxpipe.runtime.parallel.sharded_stage import full_value
from fxpipe.sim.sharding_memory import model_state_bytes
from fxpipe.sim.stagecost import optimizer_factor
from tests import fsdp_memory_probe
from tests.exactness_oracle import ADAM_EPS, LEARNING_RATE
from tests.mp_utils import join_world, leave_world, plan_from_cuts, run_ranks

MODEL = "gpt-mini"
OVERRIDES = {**zoo.get(MODEL).tiny_overrides, "n_layer": 4}
WORLD_SIZE = 3
GLOBAL_BATCH = 12
NUM_MICROBATCHES = 3
NUM_STEPS = 3
BF16 = torch.bfloat16
# (stage 0's level over its 2 replicas, schedule); stage 1 (1 replica) is unsharded. Zero-bubble's W runs the
# weight gradients apart from B: through the runtime's casts (none) and FSDP2's post-backward (ZeRO-2).
# "recompute": both stages recompute in backward, on the same copies (ZeRO-3 then one unit, stage 1 unsharded)
CASES = (("none", "dapple"), ("optimizer", "dapple"), ("parameters", "dapple"), ("none", "zero_bubble"),
         ("gradients", "zero_bubble"), ("parameters", "recompute"))
TIED_USE = {"wte.weight": 0, "lm_head.weight": 1}  # the stage each use of gpt-mini's tied weight runs on
# Step 1's gradients: each slice's bf16 gradient (8 significant bits) added in fp32 (24) is exact unless the slices'
# magnitudes differ by more than 2**16, so the order of the pipeline's sums (replicas, micro-batches) rarely
# matters; this bounds those rare roundings (measured: every gradient bit-identical, docs/sharding.md)
GRAD_TOLERANCE = 1e-6  # of each tensor's largest magnitude
MEMORY_WIDTH, MEMORY_LAYERS, MEMORY_TOLERANCE = 512, 8, 0.05


def _batches() -> list[Any]:
    entry = zoo.get(MODEL)
    return [entry.make_batch(GLOBAL_BATCH, 500 + step, **OVERRIDES) for step in range(NUM_STEPS)]


def reference(slices_of: Mapping[str, int], param_dtype: torch.dtype | None = BF16,
              make_optimizer: Any = None) -> dict[str, Any]:
    """One process under the policy, each weight's gradient summed over the slices its stage cuts the batch into:
    ``slices_of`` maps each use path of a master (``named_parameters(remove_duplicate=False)``: a weight tied across
    stages has one per stage) to the number of slices. Per step and slicing, one bf16 copy per use path of each
    fp32 master (a leaf here, so a hook can take each slice's bf16 gradient), each slice's loss weighted by its rows;
    each slice's gradient is added in fp32 into its master's, then AdamW on the fp32 masters. ``param_dtype`` None:
    bf16 autocast over fp32 weights (precision ``bf16``, no copies), the same slicings. ``make_optimizer``: the
    optimizer for the model's parameters (default AdamW at the oracle's rate)."""
    torch.manual_seed(0)
    model = zoo.build(MODEL, **OVERRIDES)[0]
    loss_fn = zoo.get(MODEL).loss_fn
    optimizer = (make_optimizer or _adamw)(model.parameters())
    paths = dict(model.named_parameters(remove_duplicate=False))
    first_grads: dict[str, torch.Tensor] = {}
    losses = []
    for inputs, targets in _batches():
        sums = {path: torch.zeros_like(param) for path, param in paths.items()}
        losses.append(0.0)  # the step's loss as the first slicing sums it
        for num_slices in sorted(set(slices_of.values())):
            copies = {path: param.detach().to(param_dtype or param.dtype).requires_grad_() for path, param in paths.items()}
            for path, copy_ in copies.items():
                if slices_of[path] == num_slices:
                    copy_.register_hook(functools.partial(_add_float, sums[path]))
            rows = GLOBAL_BATCH // num_slices
            for start in range(0, GLOBAL_BATCH, rows):
                with torch.autocast("cpu", dtype=BF16):
                    part = tuple(value[start:start + rows] for value in inputs)
                    logits = functional_call(model, copies, part, tie_weights=False)
                    loss = loss_fn(logits, targets[start:start + rows]) * (rows / GLOBAL_BATCH)
                loss.backward()
                if num_slices == min(slices_of.values()):
                    losses[-1] += float(loss.detach())
        for path, param in paths.items():
            param.grad = sums[path] if param.grad is None else param.grad + sums[path]
        if not first_grads:
            first_grads = {name: param.grad.clone() for name, param in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    return {"grads": first_grads, "params": {name: p.detach().clone() for name, p in model.named_parameters()},
            "losses": losses}


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LEARNING_RATE, eps=ADAM_EPS)


def _add_float(total: torch.Tensor, grad: torch.Tensor) -> None:
    total.add_(grad.float())


def _largest_difference(left: Mapping[str, torch.Tensor], right: Mapping[str, torch.Tensor]) -> float:
    """The largest difference of any tensor, in units of that tensor's largest magnitude in ``right``."""
    return max(float((left[name] - value).abs().max() / value.abs().max().clamp_min(1e-30))
               for name, value in right.items())


def plan_slicing(names_by_stage: Mapping[int, set[str]]) -> dict[str, int]:
    """Each use path's slices per step on the 2:1 plan: stage 0 runs 2 rows per slice (6 slices: M = 3 micro-batches
    over 2 replicas), stage 1 4 rows (3 slices). The tied weight is the embedding on stage 0 and the head on stage 1."""
    slices = {0: 2 * NUM_MICROBATCHES, 1: NUM_MICROBATCHES}
    model = zoo.build(MODEL, **OVERRIDES)[0]
    canonical = {id(param): name for name, param in model.named_parameters()}
    slicing = {}
    for path, param in model.named_parameters(remove_duplicate=False):
        stages = [stage for stage, names in names_by_stage.items() if canonical[id(param)] in names]
        if len(stages) > 1:
            assert path in TIED_USE, f"{path} is held by stages {stages}; the test knows only {TIED_USE}"
            stages = [TIED_USE[path]]
        slicing[path] = slices[stages[0]]
    return slicing


@contextmanager
def _world(store_dir: str, name: str, rank: int, world_size: int) -> Iterator[None]:
    join_world(store_dir, name, rank, world_size)
    try:
        yield
    finally:
        leave_world()


def _compile(level: str, schedule: str) -> Any:
    model, example_inputs = zoo.build(MODEL, **OVERRIDES)
    plan = plan_from_cuts(trace(copy.deepcopy(model), example_inputs), (2, 1), GLOBAL_BATCH, NUM_MICROBATCHES)
    recompute = schedule == "recompute"
    stages = tuple(replace(stage, sharding=level if stage.replicas > 1 else "none", recompute=recompute)
                   for stage in plan.stages)
    return fxpipe.compile(model, example_inputs, loss_fn=zoo.get(MODEL).loss_fn, global_batch_size=GLOBAL_BATCH,
                          plan=plan.with_updates(stages=stages), schedule="dapple" if recompute else schedule,
                          recompute="always" if recompute else "never", autocast_dtype=BF16,
                          param_dtype=BF16)


def _weight_dtypes(pipe: Any) -> set[str]:
    """Hooks recording the dtype of the weight every Linear of the stage computes with."""
    seen: set[str] = set()
    for module in pipe.driver.runner.module.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda layer, args: seen.add(str(layer.weight.dtype)))
    return seen


def _train(pipe: Any) -> dict[str, Any]:
    """NUM_STEPS AdamW steps: step 1's gradients and the last weights (whole), dtypes of masters, grads, compute."""
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=LEARNING_RATE, eps=ADAM_EPS)
    computed = _weight_dtypes(pipe)
    grads: dict[str, torch.Tensor] = {}
    master_dtypes: set[str] = set()
    for step, (inputs, targets) in enumerate(_batches()):
        pipe.step(inputs, targets)
        master_dtypes |= {f"{p.dtype}/{p.grad.dtype}" for p in pipe.parameters()}
        if step == 0:
            grads = {name: full_value(p.grad).numpy() for name, p in pipe.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    params = {name: full_value(p).numpy() for name, p in pipe.named_parameters()}  # numpy: tensors do not pickle here
    return {"grads": grads, "params": params, "masters": sorted(master_dtypes), "computed": sorted(computed),
            "stage": pipe.driver.stage_index, "recompute": pipe.driver.runner.recompute}


def _measured_memory() -> dict[str, Any]:
    """A ZeRO-3 stage of MEMORY_LAYERS wide layers on all 3 ranks under the policy: its peak model-state bytes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(MEMORY_WIDTH, MEMORY_WIDTH) for _ in range(MEMORY_LAYERS)))
    rows = 4 * NUM_MICROBATCHES
    example = (torch.randn(rows, MEMORY_WIDTH),)
    plan = plan_from_cuts(trace(copy.deepcopy(model), example), (WORLD_SIZE,), rows, NUM_MICROBATCHES)
    pipe = fxpipe.compile(model, example, loss_fn=lambda out, target: ((out.float() - target) ** 2).sum(),
                          global_batch_size=rows, plan=plan, schedule="dapple", sharding="parameters",
                          autocast_dtype=BF16, param_dtype=BF16)
    batch = (torch.randn(rows, MEMORY_WIDTH), torch.randn(rows, MEMORY_WIDTH))
    params, peak, where = fsdp_memory_probe.warmed_peak_model_state_bytes(pipe, batch, LEARNING_RATE)
    whole = sum(p.to_local().numel() for p in params) * WORLD_SIZE * 4  # fp32 masters' whole bytes (P)
    return {"param_bytes": whole, "peak": peak, "where": where, "unit_bytes": pipe.driver.sharded.largest_unit_bytes}


def _run(rank: int, world_size: int, store_dir: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    fsdp_memory_probe.install()
    results: dict[str, Any] = {}
    for level, schedule in CASES:
        with _world(store_dir, f"mixed-{level}-{schedule}", rank, world_size):
            results[f"{level} {schedule}"] = _train(_compile(level, schedule))
    with _world(store_dir, "mixed-memory", rank, world_size):
        results["memory"] = _measured_memory()
    return results


@pytest.mark.multiprocess
def test_bf16_params_train_as_one_process_on_every_level(tmp_path: Path) -> None:
    """Unsharded, ZeRO-1 and ZeRO-3 replicas under bf16-params match one process under the same policy; masters
    and gradients are fp32, compute weights bf16; the memory model's ZeRO-3 figure matches the measured peak."""
    ranks = run_ranks(_run, WORLD_SIZE, tmp_path)
    stage_names = {results["none dapple"]["stage"]: set(results["none dapple"]["grads"]) for results in ranks}
    slicing = plan_slicing(stage_names)
    expected = reference(slicing)
    autocast_only = reference(slicing, param_dtype=None)
    weight_tolerance = 0.01 * _largest_difference(autocast_only["params"], expected["params"])
    failures = []
    for level in (f"{level} {schedule}" for level, schedule in CASES):
        grads: dict[str, torch.Tensor] = {}
        params: dict[str, torch.Tensor] = {}
        for rank, results in enumerate(ranks):
            record = results[level]
            if record["masters"] != ["torch.float32/torch.float32"] or record["computed"] != ["torch.bfloat16"]:
                failures.append(f"{level} rank {rank}: master/grad dtypes {record['masters']}, compute weights "
                                f"{record['computed']}; want fp32 masters and gradients, bf16 compute")
            if record["recompute"] != level.endswith("recompute"):
                failures.append(f"{level} rank {rank}: the stage recomputes: {record['recompute']}")
            grads.update({name: torch.from_numpy(value) for name, value in record["grads"].items()})
            params.update({name: torch.from_numpy(value) for name, value in record["params"].items()})
        if set(params) != set(expected["params"]):
            failures.append(f"{level}: the ranks hold {sorted(params)}, the model {sorted(expected['params'])}")
            continue
        for key, found, tolerance in (("grads", grads, GRAD_TOLERANCE), ("params", params, weight_tolerance)):
            difference = _largest_difference(found, expected[key])
            if difference > tolerance:
                failures.append(f"{level}: {key} differ from one process by {difference:.3g} > {tolerance:.3g}")
    failures += _memory_failures(ranks)
    assert not failures, "\n".join(failures)


def _memory_failures(ranks: list[dict[str, Any]]) -> list[str]:
    failures = []
    for rank, results in enumerate(ranks):
        record = results["memory"]
        predicted = model_state_bytes(record["param_bytes"], optimizer_factor("adamw"), "parameters", WORLD_SIZE,
                                      NUM_MICROBATCHES, unit_bytes=record["unit_bytes"],
                                      param_copy_fraction=param_copy_fraction("bf16-params"))
        if abs(record["peak"] - predicted) > MEMORY_TOLERANCE * predicted:
            failures.append(f"memory rank {rank}: measured peak {record['peak']} B at {record['where']} vs "
                            f"model_state_bytes {predicted:.0f} B (P = {record['param_bytes']} B, unit "
                            f"{record['unit_bytes']} B), want within {MEMORY_TOLERANCE:.0%}")
    return failures
