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

import torch

__all__ = ["OVERRIDDEN", "histc_meta"]


def histc_meta(input: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:
    """``torch.histc``'s result on any device and dtype: ``bins`` counts in the input's dtype (no values)."""
    return input.new_empty((bins,))


_LIBRARY = torch.library.Library("aten", "IMPL")  # kept alive for the process: its kernels stay registered
_LIBRARY.impl("histc", histc_meta, "Meta")
OVERRIDDEN = ("histc",)
