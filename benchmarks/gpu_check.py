"""GPU checks on one CUDA device: cost model against measured block times, saved-activation bytes, step overhead.

Run (on a machine with a GPU): python benchmarks/gpu_check.py --out DIR
Smoke run here (CPU, tiny): python benchmarks/gpu_check.py --device cpu --tiny --out /tmp/gpu_check

1. Cost model: per-block forward+backward time of a GPT measured on the device (measure_costs,
   synchronised) against the analytic roofline model for the device's DeviceSpec; and random
   contiguous block ranges predicted from the measured blocks, as benchmarks/cost_fidelity.py does
   on the CPU.
2. Memory: bytes autograd saves for backward in one eager step (saved-tensor hooks) against the cost
   graph's saved_bytes, which annotate_costs derives on fake CPU tensors; and the CUDA allocator's
   peak during an fxpipe step against the planner's stage memory model.
3. Overhead: a 1-stage fxpipe step against eager forward+backward, alternating, median ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import fxpipe  # noqa: E402
from benchmarks.cost_fidelity import random_ranges  # noqa: E402
from fxpipe import models as zoo  # noqa: E402
from fxpipe.core.cluster import H200_141GB, DeviceSpec  # noqa: E402
from fxpipe.passes import annotate_costs, to_cost_graph, trace  # noqa: E402
from fxpipe.passes.profile import default_blocks, measure_costs  # noqa: E402
from fxpipe.runtime.autograd.measure import SavedActivationMeter  # noqa: E402
from tests.mp_utils import plan_from_cuts  # noqa: E402

FULL = {"n_layer": 12, "n_embd": 768, "n_head": 12, "block_size": 1024, "vocab_size": 50304}
TINY = {"n_layer": 2, "n_embd": 64, "n_head": 2, "block_size": 32, "vocab_size": 256}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _build(overrides: dict[str, Any], device: torch.device, batch: int) -> tuple[torch.nn.Module, tuple[Any, ...]]:
    model, inputs = zoo.build("gpt2-small", **overrides, batch_size=batch)
    return model.to(device), tuple(t.to(device) for t in inputs)


def cost_model_check(overrides: dict[str, Any], device: torch.device, spec: DeviceSpec, batches: tuple[int, int],
                     num_ranges: int) -> dict[str, Any]:
    """Per-block and per-range times: measured on the device vs analytic (roofline) vs sum of measured blocks."""
    cpu_model, cpu_inputs = _build(overrides, torch.device("cpu"), batches[1])
    analytic = to_cost_graph(annotate_costs(trace(cpu_model, cpu_inputs)), device=spec).by_name()
    model, inputs = _build(overrides, device, batches[1])
    gm = trace(model, inputs)
    blocks = default_blocks(gm)
    ranges = random_ranges(len(blocks), num_ranges, random.Random(0))
    range_nodes = [tuple(n for block in blocks[a:b] for n in block) for a, b in ranges]
    measured = measure_costs(gm, inputs, blocks=[*blocks, *range_nodes], batch_sizes=batches, warmup=3, repeats=7)
    rows = batches[1]
    block_rows = []
    for block in measured.blocks[: len(blocks)]:
        actual = block.forward_s.at(rows) + block.backward_s.at(rows)
        predicted = sum(analytic[n].forward_s.at(rows) + analytic[n].backward_s.at(rows)
                        for n in block.node_names if n in analytic)
        block_rows.append({"block": block.name, "measured_ms": actual * 1e3, "analytic_ms": predicted * 1e3})
    range_errors = []
    for (first, stop), timing in zip(ranges, measured.blocks[len(blocks):], strict=True):
        actual = timing.forward_s.at(rows) + timing.backward_s.at(rows)
        predicted = sum(b.forward_s.at(rows) + b.backward_s.at(rows) for b in measured.blocks[first:stop])
        range_errors.append(abs(predicted - actual) / actual)
    total_measured = sum(r["measured_ms"] for r in block_rows)
    total_analytic = sum(r["analytic_ms"] for r in block_rows)
    return {"blocks": block_rows, "total_measured_ms": total_measured, "total_analytic_ms": total_analytic,
            "analytic_over_measured": total_analytic / total_measured,
            "range_median_error": statistics.median(range_errors), "range_max_error": max(range_errors),
            "num_ranges": len(range_errors), "rows": rows}


def memory_check(overrides: dict[str, Any], device: torch.device, batch: int) -> dict[str, Any]:
    """Saved-for-backward bytes measured on the device vs the cost graph's prediction (made on CPU fakes)."""
    entry = zoo.get("gpt2-small")
    cpu_model, cpu_inputs = _build(overrides, torch.device("cpu"), batch)
    graph = to_cost_graph(annotate_costs(trace(cpu_model, cpu_inputs)), device=H200_141GB)
    predicted = graph.total("saved_bytes").at(batch)
    model, inputs = _build(overrides, device, batch)
    targets = entry.make_batch(batch, seed=0, **overrides)[1].to(device)
    meter = SavedActivationMeter.for_parameters(model.parameters())
    with meter.measure():
        entry.loss_fn(model(*inputs), targets).backward()
    _sync(device)
    return {"predicted_saved_bytes": predicted, "measured_saved_bytes": meter.peak_bytes,
            "predicted_over_measured": predicted / meter.peak_bytes, "rows": batch}


def step_check(overrides: dict[str, Any], device: torch.device, batch: int, num_microbatches: int,
               steps: int) -> dict[str, Any]:
    """fxpipe 1-stage step vs eager (alternating), and the allocator peak against the plan's memory model."""
    entry = zoo.get("gpt2-small")
    model, inputs = _build(overrides, device, batch)
    eager, _ = _build(overrides, device, batch)
    targets = entry.make_batch(batch, seed=0, **overrides)[1].to(device)
    plan = plan_from_cuts(trace(model, inputs), (1,), batch, num_microbatches, schedule="gpipe")
    pipe = fxpipe.compile(model, inputs, loss_fn=entry.loss_fn, global_batch_size=batch, plan=plan)
    times: dict[str, list[float]] = {"fxpipe": [], "eager": []}

    def fx_step() -> None:
        pipe.step(inputs, targets)

    def eager_step() -> None:
        entry.loss_fn(eager(*inputs), targets).backward()

    for index in range(steps + 3):
        for name, fn in (("fxpipe", fx_step), ("eager", eager_step)) if index % 2 else (
                ("eager", eager_step), ("fxpipe", fx_step)):
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            if index >= 3:
                times[name].append(time.perf_counter() - start)
    result: dict[str, Any] = {name: statistics.median(v) * 1e3 for name, v in times.items()}
    result["ratio"] = result["fxpipe"] / result["eager"]
    if device.type == "cuda":
        del eager
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        pipe.step(inputs, targets)
        torch.cuda.synchronize()
        result["allocator_peak_above_weights_and_grads_bytes"] = torch.cuda.max_memory_allocated() - base
    pipe.measure = True
    pipe.step(inputs, targets)
    result["fxpipe_saved_peak_bytes"] = pipe.step_stats()[0].peak_activation_bytes
    result["num_microbatches"] = num_microbatches
    pipe.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    device = torch.device(args.device)
    overrides = TINY if args.tiny else FULL
    batches = (2, 4) if args.tiny else (4, 8)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                              "torch": torch.__version__, "model": {"name": "gpt2-small", **overrides}}
    checks = {
        "memory": lambda: memory_check(overrides, device, batches[1]),
        "step": lambda: step_check(overrides, device, batches[1], 1, 6 if args.tiny else 20),
        "costed_model": lambda: cost_model_check(overrides, device, H200_141GB, batches, 8 if args.tiny else 20),
    }
    for name, check in checks.items():
        start = time.perf_counter()
        try:
            report[name] = check()
        except Exception as error:  # one failed check must not hide the others' figures
            report[name] = {"error": f"{type(error).__name__}: {error}"}
        report[name]["seconds"] = time.perf_counter() - start
        print(name, json.dumps({k: v for k, v in report[name].items() if k != "blocks"}), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_check.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
