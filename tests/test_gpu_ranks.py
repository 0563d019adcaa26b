"""Which device and backend a rank takes on a GPU host (fxpipe.runtime.transport.comm.pick_backend).

The CPU machine has no GPU: torch.cuda's answers are patched, so the checks cover the choice, not NCCL itself.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fxpipe.runtime.faults.errors import PipelineSetupError
from fxpipe.runtime.transport.comm import pick_backend


@pytest.fixture
def two_gpu_host(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    for name in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_each_local_rank_takes_its_own_gpu(two_gpu_host: pytest.MonkeyPatch) -> None:
    assert pick_backend() == ("nccl", torch.device("cuda", 0))  # a world of one, no launcher
    two_gpu_host.setenv("LOCAL_WORLD_SIZE", "2")
    two_gpu_host.setenv("LOCAL_RANK", "1")
    assert pick_backend() == ("nccl", torch.device("cuda", 1))


@pytest.mark.parametrize("local_rank", ["0", "2"])
def test_more_ranks_than_gpus_fail_on_every_rank_naming_both_counts(two_gpu_host: pytest.MonkeyPatch,
                                                                     local_rank: str) -> None:
    """Rank 0 as well as rank 2 of three on two GPUs: before, ranks 0 and 2 both took cuda:0 and NCCL failed at
    the first collective ("Duplicate GPU detected")."""
    two_gpu_host.setenv("LOCAL_WORLD_SIZE", "3")
    two_gpu_host.setenv("LOCAL_RANK", local_rank)
    two_gpu_host.setenv("RANK", local_rank)
    with pytest.raises(PipelineSetupError, match=r"runs 3 ranks.*shows 2 GPU\(s\).*--nproc-per-node 2.*"
                                                 r"CUDA_VISIBLE_DEVICES=''"):
        pick_backend()


def test_a_launcher_that_sets_visible_devices_per_rank_keeps_the_modulo_mapping(
        two_gpu_host: pytest.MonkeyPatch) -> None:
    """SLURM-style: each rank sees its own GPUs (here two), so rank 3 of 4 on the host takes its cuda:1."""
    two_gpu_host.setenv("CUDA_VISIBLE_DEVICES", "6,7")
    two_gpu_host.setenv("LOCAL_WORLD_SIZE", "4")
    two_gpu_host.setenv("LOCAL_RANK", "3")
    assert pick_backend() == ("nccl", torch.device("cuda", 1))


def test_a_cpu_host_takes_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert pick_backend() == ("gloo", torch.device("cpu"))
