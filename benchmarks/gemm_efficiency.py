"""Dense GEMM throughput over transformer layer shapes, as a fraction of the device preset's datasheet peak.

Run (on a GPU): python benchmarks/gemm_efficiency.py [--preset h200] [--out DIR] [--repeats 7]
Smoke run anywhere: python benchmarks/gemm_efficiency.py --device cpu --tiny

Each row is one linear layer of a transformer at hidden size ``h`` over ``tokens`` rows: attention's fused
q/k/v projection (h -> 3h), its output projection (h -> h), the MLP's up (h -> 4h) and down (4h -> h)
projections; with ``tp`` > 1 the member's share under Megatron-style tensor parallelism (column layers split
their output, row layers their input, ``tp`` ways). Every layer is timed in its three GEMMs as training runs
them: forward ``Y = X W^T``, input gradient ``dX = dY W`` and weight gradient ``dW = dY^T X``
(``torch.matmul`` on contiguous operands laid out as autograd leaves them). Each GEMM is timed with CUDA
events: ``--warmup`` calls, then the median of ``--repeats`` timed calls. float32 runs at full float32
precision (``torch.backends.cuda.matmul.allow_tf32`` off, torch's default and what fxpipe's costs assume);
``tf32`` rows are the same float32 tensors with TF32 allowed.

The summary per dtype is the median and the range of achieved FLOP/s over the unsharded rows (tp=1) and over
the sharded ones, against the preset's datasheet peak (``DeviceSpec.peak_flops``) and its current achievable
figure (``DeviceSpec.matmul_flops``). Output: a table on stdout and ``gemm_efficiency.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fxpipe.core.hardware import H100_80GB, H200_141GB, DeviceSpec  # noqa: E402

PRESETS = {"h100": H100_80GB, "h200": H200_141GB}
LAYERS = (("qkv", 1, 3, "column"), ("proj", 1, 1, "row"), ("up", 1, 4, "column"), ("down", 4, 1, "row"))
FULL_SHAPES = tuple((hidden, tokens, 1) for hidden in (4096, 8192) for tokens in (4096, 8192, 16384)) + tuple(
    (8192, tokens, 8) for tokens in (4096, 16384))
TINY_SHAPES = ((256, 256, 1), (256, 512, 2))
DTYPES = {"bfloat16": (torch.bfloat16, False), "float32": (torch.float32, False), "tf32": (torch.float32, True)}


@dataclass(frozen=True)
class Row:
    dtype: str
    hidden: int
    tokens: int
    tp: int
    layer: str
    gemm: str
    m: int
    n: int
    k: int
    ms: float
    tflops: float


def layer_operands(hidden: int, tokens: int, tp: int, in_mult: int, out_mult: int,
                   kind: str) -> tuple[int, int]:
    """(in_features, out_features) of one member's share of a linear layer."""
    in_features, out_features = in_mult * hidden, out_mult * hidden
    if kind == "column":
        out_features //= tp
    else:
        in_features //= tp
    return in_features, out_features


def gemms(tokens: int, in_features: int, out_features: int, dtype: torch.dtype,
          device: torch.device) -> dict[str, tuple[Callable[[], torch.Tensor], tuple[int, int, int]]]:
    """The three training GEMMs of ``Y = X W^T``; each with its (m, n, k)."""
    x = torch.randn(tokens, in_features, device=device, dtype=dtype)
    w = torch.randn(out_features, in_features, device=device, dtype=dtype)
    dy = torch.randn(tokens, out_features, device=device, dtype=dtype)
    return {"fwd": (lambda: torch.matmul(x, w.t()), (tokens, out_features, in_features)),
            "dgrad": (lambda: torch.matmul(dy, w), (tokens, in_features, out_features)),
            "wgrad": (lambda: torch.matmul(dy.t(), x), (out_features, in_features, tokens))}


def time_ms(fn: Callable[[], torch.Tensor], warmup: int, repeats: int, device: torch.device) -> float:
    """Median milliseconds of one call: CUDA events on a GPU, the wall clock on the CPU (a smoke run)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def measure(shapes: tuple[tuple[int, int, int], ...], dtypes: tuple[str, ...], warmup: int, repeats: int,
            device: torch.device) -> list[Row]:
    rows = []
    for dtype_name in dtypes:
        dtype, tf32 = DTYPES[dtype_name]
        torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            for hidden, tokens, tp in shapes:
                for layer, in_mult, out_mult, kind in LAYERS:
                    in_features, out_features = layer_operands(hidden, tokens, tp, in_mult, out_mult, kind)
                    for gemm, (fn, (m, n, k)) in gemms(tokens, in_features, out_features, dtype, device).items():
                        ms = time_ms(fn, warmup, repeats, device)
                        rows.append(Row(dtype_name, hidden, tokens, tp, layer, gemm, m, n, k, ms,
                                        2.0 * m * n * k / (ms * 1e-3) / 1e12))
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = False
    return rows


def peak_flops(preset: DeviceSpec, dtype_name: str) -> float:
    """The datasheet peak a dtype's rows are measured against (TF32: half the bf16 tensor-core rate, dense)."""
    table = dict(preset.peak_flops)
    return table["bfloat16"] / 2 if dtype_name == "tf32" else table[dtype_name]


def summary(rows: list[Row], preset: DeviceSpec) -> list[dict[str, Any]]:
    out = []
    achievable = dict(preset.matmul_flops)
    for dtype_name in dict.fromkeys(row.dtype for row in rows):
        for label, pick in (("tp=1", lambda row: row.tp == 1), ("tp>1", lambda row: row.tp > 1)):
            tflops = sorted(row.tflops for row in rows if row.dtype == dtype_name and pick(row))
            if not tflops:
                continue
            peak = peak_flops(preset, dtype_name) / 1e12
            current = achievable.get(dtype_name)
            out.append({"dtype": dtype_name, "rows": label, "count": len(tflops), "median_tflops": statistics.median(tflops),
                        "min_tflops": tflops[0], "max_tflops": tflops[-1], "peak_tflops": peak,
                        "median_fraction_of_peak": statistics.median(tflops) / peak,
                        "preset_matmul_tflops": current / 1e12 if current else None})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="h200")
    parser.add_argument("--out", default=".")
    parser.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke run)")
    parser.add_argument("--tiny", action="store_true", help="two small shapes (a smoke run)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bfloat16", "float32", "tf32"])
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gemm_efficiency.py --device cuda: no CUDA device is visible (--device cpu --tiny smoke-runs it)")
    preset = PRESETS[args.preset]
    rows = measure(TINY_SHAPES if args.tiny else FULL_SHAPES, tuple(args.dtypes), args.warmup, args.repeats, device)
    table = summary(rows, preset)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}, CUDA {torch.version.cuda}; "
          f"preset {preset.name}")
    print(tabulate([asdict(row) for row in rows], headers="keys", floatfmt=".3f"))
    print()
    print(tabulate(table, headers="keys", floatfmt=".3f"))
    report = {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda,
              "preset": preset.name, "warmup": args.warmup, "repeats": args.repeats,
              "rows": [asdict(row) for row in rows], "summary": table}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gemm_efficiency.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
