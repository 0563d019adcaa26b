"""Autocast for fake cost runs: CPU autocast, or CUDA's op lists played on CPU fakes (fakes cannot be CUDA here)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_map

# Ops CUDA autocast runs in float32 (output float32) where CPU autocast keeps the input's dtype
# (torch/csrc/autograd/autocast_mode.cpp, the CUDA fp32 and fp32_set_opt_dtype lists, the overloads a
# traced model reaches). Matmuls and convolutions go to the low dtype under both; these ops only decide
# what activations and messages weigh, since everything that is not a matmul is costed at the float32 rate.
CUDA_FLOAT32_OPS = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
    "native_layer_norm", "group_norm", "native_group_norm", "cosine_similarity", "dist", "renorm", "logsumexp",
    "softmax.int", "_softmax", "log_softmax.int", "_log_softmax", "cumsum", "cumprod", "sum", "sum.dim_IntList",
    "prod", "prod.dim_int",
)  # those CPU autocast already lists (prod in torch 2.13) keep CPU's kernel
AUTOCAST_DEVICES = ("cpu", "cuda")


class AutocastPolicyError(ValueError):
    """An autocast device type or dtype that cost runs cannot play."""


@contextlib.contextmanager
def fake_autocast(device_type: str, dtype: torch.dtype | None) -> Iterator[None]:
    """Run the block under the autocast ``device_type`` training would use, on CPU fakes; nothing when ``dtype`` is None.

    ``"cpu"`` is CPU autocast itself. ``"cuda"`` is CPU autocast with the ops of :data:`CUDA_FLOAT32_OPS`
    sent to float32 for as long as the block runs (kernels registered for the AutocastCPU key and removed
    after), so values get the dtypes CUDA autocast gives them.
    """
    if dtype is None:
        yield
        return
    if device_type not in AUTOCAST_DEVICES or dtype not in (torch.bfloat16, torch.float16):
        raise AutocastPolicyError(f"cannot cost autocast on {device_type!r} in {dtype}; use device type 'cpu' or "
                                  "'cuda' with torch.bfloat16 or torch.float16")
    with contextlib.ExitStack() as stack:
        if device_type == "cuda":
            stack.enter_context(_cuda_float32_ops())
        stack.enter_context(torch.autocast("cpu", dtype=dtype))
        yield


@contextlib.contextmanager
def _cuda_float32_ops() -> Iterator[None]:
    library = torch.library.Library("aten", "IMPL")
    try:
        for name in CUDA_FLOAT32_OPS:
            if torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "AutocastCPU"):
                continue
            packet, _, overload = name.partition(".")
            library.impl(name, _float32_kernel(getattr(getattr(torch.ops.aten, packet), overload or "default")),
                         "AutocastCPU")
        yield
    finally:
        library._destroy()  # puts back CPU autocast's own kernels


def _float32_kernel(op: Any) -> Callable[..., Any]:
    def to_float32(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dtype in (torch.bfloat16, torch.float16):
            return value.float()
        return value

    def kernel(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = tree_map(to_float32, (args, kwargs))
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)):
            return op(*args, **kwargs)

    return kernel
