"""Shape-only (Meta) kernels for aten ops whose own Meta kernel refuses what fxpipe's fake runs must cost.

fxpipe's fake runs (costing, codegen's shapes) run every node on fake tensors on the CPU: a CUDA fake cannot be made
without a GPU. A graph traced on the meta device, the only way to plan a model too large for host memory, may take
a branch written for GPUs. transformers' MoE expert dispatch (``integrations/moe.py``) does: off the CPU it counts
tokens per expert with ``torch.histc`` on int32 indices. torch's Meta kernel for ``aten::histc`` refuses integer
input on CPU fakes as the CPU kernel does ("histogram_cpu" not implemented for 'torch.int32'), so such a model could
not be costed (HF Mixtral on the meta device). The kernel here gives ``histc``'s result shape and dtype whatever the
device: ``bins`` counts in the input's dtype. Only the Meta key changes: real tensors run torch's own kernels.

Registered once, process-wide, when fxpipe's tracer or fake runs are first imported (a scoped registration would
not do: FakeTensorMode caches the results of ops it has run).
"""

from __future__ import annotations

import inspect

import torch

__all__ = ["OVERRIDDEN", "histc_meta"]


def histc_meta(input: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:
    """``torch.histc``'s result on any device and dtype: ``bins`` counts in the input's dtype (no values)."""
    return input.new_empty((bins,))


def _override(library: torch.library.Library, op_name: str, kernel: object, dispatch_key: str) -> None:
    """Register ``kernel`` over any Python kernel torch itself registered for the op and key.

    torch 2.11 registers its own ``histc`` Meta kernel from Python (``torch._meta_registrations``), and there
    ``Library.impl`` refuses a second one unless ``allow_override=True`` is passed (torch 2.13 allows it by
    default); torch releases without the flag keep the guard in the module-level set ``torch.library._impls``.
    """
    if "allow_override" in inspect.signature(library.impl).parameters:
        library.impl(op_name, kernel, dispatch_key, allow_override=True)
        return
    torch.library._impls.discard(f"{library.ns}/{op_name}/{dispatch_key}")
    library.impl(op_name, kernel, dispatch_key)


_LIBRARY = torch.library.Library("aten", "IMPL")  # kept alive for the process: its kernels stay registered
_override(_LIBRARY, "histc", histc_meta, "Meta")
OVERRIDDEN = ("histc",)
