"""A tensor-parallel group's collectives as graph ops, for the graphs traced on fake tensors (compiled_split's F/B/W).

``GroupCommunicator`` runs ``dist.all_reduce`` on a copy it reads afterwards, waiting on the work in Python (the
exchange's stall detection). Traced by ``make_fx``, that becomes a ``c10d.allreduce_`` node whose work no node
waits on, so the split graphs read the copy while gloo's thread may still be reducing into it: the compiled
tensor-parallel stage under zero-bubble got the unreduced gradient behind ``copy_to_group`` (its input's and the
norms' gradients wrong; tests/test_traced_collectives.py). Functional collectives
(``torch.distributed._functional_collectives``) trace into an op that returns its result and an explicit
``wait_tensor``, as torch's own compiled collectives do.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._subclasses.fake_tensor import is_fake

__all__ = ["is_fake", "traced_all_gather", "traced_all_reduce"]


def traced_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The group's sum of ``tensor``, as a functional all-reduce and its wait."""
    return funcol.wait_tensor(funcol.all_reduce(tensor.contiguous(), "sum", _group(group)))


def traced_all_gather(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The members' ``tensor`` concatenated along ``dim`` in member order, as a functional all-gather and its wait."""
    gathered = funcol.all_gather_tensor(tensor.contiguous(), 0, _group(group))
    whole = funcol.wait_tensor(gathered)
    size = dist.get_world_size(group)
    return torch.cat(whole.chunk(size, 0), dim) if dim % tensor.dim() != 0 else whole


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return group if group is not None else dist.group.WORLD  # type: ignore[return-value]
