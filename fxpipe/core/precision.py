"""The precision a job trains in (``fp32``, ``bf16``, ``fp16``, ``bf16-params``): names, dtypes, and the rates that apply."""

from __future__ import annotations

from fxpipe.core.hardware import DeviceSpec

# precision -> the autocast dtype it trains under (None: no autocast, everything float32)
PRECISIONS: dict[str, str | None] = {"fp32": None, "bf16": "bfloat16", "fp16": "float16", "bf16-params": "bfloat16"}
# precision -> the dtype of the parameter copies a stage computes with (absent: the fp32 master weights themselves).
# bf16-params is FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) on every stage: fp32 masters
# (what the optimizer sees), bf16 compute copies, fp32 gradients and reductions; under bf16 autocast as "bf16".
PARAM_DTYPES: dict[str, str] = {"bf16-params": "bfloat16"}
DEFAULT_PRECISION = "fp32"
# Dtypes a device's matmul units run faster than float32 (tensor cores); no preset has any other fast dtype.
LOW_PRECISION_DTYPES = ("bfloat16", "float16")


class PrecisionError(ValueError):
    """A precision name is unknown, or the device has no rate for its dtype."""


def check_precision(precision: str) -> str:
    """``precision`` itself when it is one of :data:`PRECISIONS`, else a PrecisionError naming the choices."""
    if precision not in PRECISIONS:
        raise PrecisionError(f"precision {precision!r} is unknown; choose one of {sorted(PRECISIONS)} "
                             "(fp32: no autocast; bf16/fp16: torch.autocast with that dtype over the fp32 weights; bf16-params: "
                             "bf16 autocast with bf16 copies of the fp32 master weights, gradients reduced in fp32)")
    return precision


def autocast_dtype_name(precision: str) -> str | None:
    """The autocast dtype name of ``precision`` (``"bfloat16"``), None for fp32."""
    return PRECISIONS[check_precision(precision)]


def param_dtype_name(precision: str) -> str | None:
    """The dtype name of the parameter copies ``precision`` computes with (``"bfloat16"``), None: the fp32 masters."""
    return PARAM_DTYPES.get(check_precision(precision))


def param_copy_fraction(precision: str) -> float:
    """Bytes of the compute copy ``precision`` keeps per byte of fp32 master weights (bf16: 2 of 4; 0: none)."""
    return 0.5 if param_dtype_name(precision) else 0.0


def precision_of_dtype(dtype_name: str | None, param_dtype: str | None = None) -> str:
    """The precision of an autocast dtype name and a parameter copy dtype name (``"bfloat16"`` -> ``"bf16"``;
    None -> ``"fp32"``; ``("bfloat16", "bfloat16")`` -> ``"bf16-params"``)."""
    if param_dtype is not None:
        for mixed, copy_dtype in PARAM_DTYPES.items():
            if copy_dtype == param_dtype and PRECISIONS[mixed] == dtype_name:
                return mixed
        raise PrecisionError(f"param_dtype {param_dtype!r} with autocast dtype {dtype_name!r} is not a precision "
                             "fxpipe trains in; use param_dtype=torch.bfloat16 with autocast_dtype=torch.bfloat16 "
                             "(precision 'bf16-params'), or param_dtype=None")
    for precision, name in PRECISIONS.items():
        if name == dtype_name and precision not in PARAM_DTYPES:
            return precision
    raise PrecisionError(f"autocast dtype {dtype_name!r} is not one fxpipe plans for; use torch.bfloat16, "
                         "torch.float16 or None (float32)")


def autocast_device_type(device: DeviceSpec) -> str:
    """Whose autocast op lists cost a model for ``device``: ``"cpu"`` for CPU ranks, ``"cuda"`` for GPUs."""
    return "cpu" if device.name.startswith("CPU") else "cuda"


def matmul_flops_per_s(device: DeviceSpec, dtype_name: str) -> float:
    """The rate matmuls and convolutions run at in ``dtype_name`` on ``device``: its achievable matmul rate
    (``DeviceSpec.matmul_flops``, published GEMM figures on GPU presets) where it has one, else its peak.

    Tensor-core dtypes take the device's rate for them (a PrecisionError when it has none, such as
    bfloat16 on a V100); any other dtype (float32, float64) takes the float32 rate.
    """
    table = dict(device.peak_flops)
    achievable = dict(device.matmul_flops)
    if dtype_name in table:
        return achievable.get(dtype_name, table[dtype_name])
    if dtype_name in LOW_PRECISION_DTYPES:
        precision = precision_of_dtype(dtype_name)
        raise PrecisionError(f"device {device.name!r} has no {dtype_name} rate (it lists {sorted(table)}), so "
                             f"precision {precision!r} cannot be planned for it; choose a precision it lists "
                             "(fp16 on a V100) or fp32")
    return achievable.get("float32", device.flops_per_s("float32"))
