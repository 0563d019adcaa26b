"""Exactness helpers on data, one process: batch digests, loss contracts, deferred BatchNorm, row maps, options."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxpipe.core.plan import Plan, StagePlan
from fxpipe.runtime.execution.stage import check_loss_reduction, split_loss
from fxpipe.runtime.faults.errors import PipelineSetupError
from fxpipe.runtime.numerics.batchnorm import (
    DeferredBatchNorm,
    check_batch_norm_mode,
    check_layers_kept,
    install_deferred,
    original_layers,
)
from fxpipe.runtime.sync import check_sync_mode
from fxpipe.runtime.transport.batchcheck import (
    BatchMismatchError,
    check_batch_mode,
    data_digest,
    layout_digest,
    raise_on_difference,
)
from fxpipe.runtime.transport.rows import RowMap


def test_digests_see_data_shape_and_dtype() -> None:
    x = torch.arange(12.0).reshape(3, 4)
    assert data_digest([x]) == data_digest([x.clone()])
    assert data_digest([x]) != data_digest([x + 1e-6])
    assert layout_digest([x]) != layout_digest([x.reshape(4, 3)])
    assert layout_digest([x]) != layout_digest([x.double()])
    assert 0 <= data_digest([x]) < 2**63


def test_raise_on_difference_names_the_ranks() -> None:
    raise_on_difference([(1, 5), (1, 5), (1, 5)])
    raise_on_difference([(1, 5), (1, 0), (1, 5)])  # rank 1 did not fingerprint its data this step
    with pytest.raises(BatchMismatchError, match=r"ranks \[2\] passed step\(\) a different global batch than rank 0"):
        raise_on_difference([(1, 5), (1, 5), (1, 6)])
    with pytest.raises(BatchMismatchError, match=r"ranks \[1, 3\] passed step\(\) inputs/targets of other shapes"):
        raise_on_difference([(1, 5), (2, 5), (1, 5), (3, 5)])


def test_loss_contracts() -> None:
    loss = torch.tensor(2.0)
    assert split_loss(loss, "mean") == (loss, 0.0)
    total, count = split_loss((loss, torch.tensor(7)), "token_mean")
    assert total is loss and count == 7.0
    with pytest.raises(TypeError, match=r"token_mean' needs loss_fn to return \(loss_sum, count\)"):
        split_loss(loss, "token_mean")
    with pytest.raises(TypeError, match="loss_fn must return a scalar tensor"):
        split_loss(torch.ones(3), "sum")


@pytest.mark.parametrize(("check", "value", "message"), [
    (check_loss_reduction, "avg", "loss_reduction='avg' is unknown"),
    (check_batch_mode, "sometimes", "check_batch='sometimes' is unknown"),
    (check_sync_mode, "copy", "sync_params='copy' is unknown"),
    (check_batch_norm_mode, "frozen", "batch_norm='frozen' is unknown"),
])
def test_unknown_options_name_the_choices(check: object, value: str, message: str) -> None:
    with pytest.raises(PipelineSetupError, match=message):
        check(value)  # type: ignore[operator]


@pytest.mark.parametrize("momentum", [0.1, None])
def test_deferred_batch_norm_commits_whole_batch_statistics(momentum: float | None) -> None:
    torch.manual_seed(0)
    reference = nn.BatchNorm2d(3, momentum=momentum)
    holder = nn.Sequential(nn.BatchNorm2d(3, momentum=momentum))
    layers = install_deferred(holder)
    assert len(layers) == 1 and isinstance(holder[0], DeferredBatchNorm)
    for _ in range(3):
        batch = torch.randn(8, 3, 4, 4) * 2 + 1
        reference(batch)
        for chunk in batch.split([3, 5]):  # micro-batches of different sizes
            out = holder(chunk)
            torch.testing.assert_close(out, F.batch_norm(chunk, None, None, training=True))  # own statistics
        layers[0].commit(layers[0].sums())
    torch.testing.assert_close(holder[0].running_mean, reference.running_mean)
    torch.testing.assert_close(holder[0].running_var, reference.running_var)
    assert int(holder[0].num_batches_tracked) == int(reference.num_batches_tracked) == 3
    holder.eval()
    reference.eval()
    probe = torch.randn(2, 3, 4, 4)
    torch.testing.assert_close(holder(probe), reference(probe))


def test_row_map_of_a_replica() -> None:
    stages = (StagePlan(stage_index=0, first_block=0, stop_block=1, replicas=2, devices=(0, 1)),
              StagePlan(stage_index=1, first_block=1, stop_block=2, replicas=1, devices=(2,)))
    plan = Plan(global_batch_size=12, num_microbatches=3, stages=stages, schedule="early_backward",
                warmup_policy="A", planner="test")
    second = RowMap.of(plan, 1, 2)
    assert second.per_microbatch == ((2, 4), (6, 8), (10, 12))
    assert second.ranges() == second.per_microbatch and second.num_rows == 6
    assert [second.local(m) for m in range(3)] == [(0, 2), (2, 4), (4, 6)]
    assert RowMap.of(plan, 0, 1).ranges() == ((0, 12),)


def test_deferred_batch_norm_refuses_dissolved_layers() -> None:
    model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3))
    check_layers_kept(model, [model], "deferred")  # the layer is still a module: fine
    check_layers_kept(model, [nn.Conv2d(3, 3, 1)], "microbatch")
    with pytest.raises(PipelineSetupError, match="batch_norm='sync' needs batch norm layers as modules"):
        check_layers_kept(model, [nn.Conv2d(3, 3, 1)], "sync")


def test_original_layers_come_back_for_export() -> None:
    holder = nn.Sequential(nn.Conv2d(3, 3, 1), nn.Sequential(nn.BatchNorm2d(3)))
    original = holder[1][0]
    layers = install_deferred(holder)
    assert layers[0].weight is original.weight and layers[0].running_mean is original.running_mean
    holder.eval()
    with original_layers(holder):
        assert holder[1][0] is original and not original.training
    assert holder[1][0] is layers[0]
