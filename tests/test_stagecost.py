"""Per-stage costs: slices, compute, memory with in-flight micro-batches, transfers over ports, allreduce."""

from __future__ import annotations

import pytest

from fxpipe.core.chain import Block, CostChain, SharedParam
from fxpipe.core.cluster import Cluster, DeviceSpec, LinkSpec
from fxpipe.core.costgraph import Affine
from fxpipe.passes.partition.block_partition import coarsen_chain
from fxpipe.sim.stagecost import (
    compute_times,
    gradient_allreduce_time,
    optimizer_factor,
    stage_cost,
    stage_memory_bytes,
    tie_groups,
    tied_copy_bytes,
    transfer_time,
)

DEVICE = DeviceSpec("test", 2**34, (("float32", 1e12),), 1e11)


def chain() -> CostChain:
    blocks = tuple(
        Block(f"b{i}", (), Affine(0.5, 2.0 * (i + 1)), Affine(1.0, 4.0 * (i + 1)), 100 * (i + 1), Affine(8, 16))
        for i in range(3)
    )
    return CostChain(blocks, (Affine(0, 32), Affine(4, 64)), input_bytes=Affine(0, 12), output_bytes=Affine(0, 1))


def two_hosts(intra: float = 100.0, inter: float = 10.0) -> Cluster:
    return Cluster("t", 2, 2, DEVICE, LinkSpec(intra, 0.0), LinkSpec(inter, 0.5))


def test_stage_cost_uses_the_largest_slice() -> None:
    cost = stage_cost(chain(), 1, 3, microbatch_rows=7, replicas=3)  # slices 3, 2, 2
    assert cost.rows == 3
    assert cost.forward_s == 0.5 + 4 * 3 + 0.5 + 6 * 3
    assert cost.backward_s == 1.0 + 8 * 3 + 1.0 + 12 * 3
    assert cost.param_bytes == 500
    assert cost.activation_bytes == 2 * (8 + 16 * 3)
    assert cost.input_bytes == 32 * 3  # cut 0
    assert cost.output_bytes == 0.0  # the last stage hands its output to the loss, locally


def test_first_stage_receives_no_activations() -> None:
    cost = stage_cost(chain(), 0, 2, microbatch_rows=4, replicas=1)
    assert cost.input_bytes == 0.0
    assert cost.output_bytes == 4 + 64 * 4  # cut 1


def test_compute_times_for_any_slice() -> None:
    assert compute_times(chain(), 0, 1, 5) == (0.5 + 2 * 5, 1.0 + 4 * 5)
    one_row = stage_cost(chain(), 0, 3, microbatch_rows=3, replicas=3)
    assert compute_times(chain(), 0, 3, 1) == (one_row.forward_s, one_row.backward_s)


def test_memory_counts_weights_inflight_and_buffers() -> None:
    cost = stage_cost(chain(), 1, 2, microbatch_rows=2, replicas=1)
    weights = 200 * 4.0
    per_microbatch = (8 + 16 * 2) + 32 * 2
    buffers = 32 * 2 + (4 + 64 * 2)
    assert stage_memory_bytes(cost, 3, "adam") == weights + 3 * per_microbatch + buffers
    assert stage_memory_bytes(cost, 3, "sgd") == 200 * 2 + 3 * per_microbatch + buffers
    assert stage_memory_bytes(cost, 5) - stage_memory_bytes(cost, 3) == 2 * per_microbatch


def test_unknown_optimizer_names_the_choices() -> None:
    assert optimizer_factor("AdamW") == 4.0
    with pytest.raises(ValueError, match="'lamb' is unknown; choose one of"):
        optimizer_factor("lamb")


def test_transfer_time_serializes_on_the_busiest_port() -> None:
    net = two_hosts()
    per_row = Affine(0, 10)
    # 1 -> 2 on one host: the sender's port sends two 2-row pieces (20 bytes each) one after another
    assert transfer_time(net, per_row, 4, [0], [1, 0]) == pytest.approx(20 / 100)  # piece to itself is free
    assert transfer_time(net, per_row, 4, [0], [1, 2]) == pytest.approx(20 / 100 + 0.5 + 20 / 10)
    # 2 -> 2 pairwise: each port carries one piece; the cross-host one sets the time
    assert transfer_time(net, per_row, 4, [0, 1], [2, 3]) == pytest.approx(0.5 + 20 / 10)
    # 3 -> 1: the receiver takes 2 + 1 rows across hosts and 1 row from its host mate, one at a time
    assert transfer_time(net, per_row, 4, [0, 1, 2], [3]) == pytest.approx(2 * 0.5 + 30 / 10 + 10 / 100)
    assert transfer_time(net, Affine(), 4, [0], [2]) == 0.0


def test_allreduce_matches_the_ring_formula() -> None:
    net = two_hosts()
    assert gradient_allreduce_time(net, 1000, [0]) == 0.0
    assert gradient_allreduce_time(net, 1000, [0, 1]) == pytest.approx(2 * 1000 * 1 / (2 * 100))
    assert gradient_allreduce_time(net, 1000, [0, 1, 2]) == pytest.approx(4 * 0.5 + 2 * 1000 * 2 / (3 * 10))


def test_shared_rows_equals_every_overlapping_pair() -> None:
    from fxpipe.core.row_slices import row_ranges, shared_rows

    for num_rows in range(1, 30):
        for num_senders in range(1, min(num_rows, 7) + 1):
            for num_receivers in range(1, min(num_rows, 7) + 1):
                brute = tuple(
                    (i, j, max(s0, r0), min(s1, r1))
                    for i, (s0, s1) in enumerate(row_ranges(num_rows, num_senders))
                    for j, (r0, r1) in enumerate(row_ranges(num_rows, num_receivers))
                    if max(s0, r0) < min(s1, r1)
                )
                assert shared_rows(num_rows, num_senders, num_receivers) == brute


def tied_chain() -> CostChain:
    """Four blocks; a 40-byte parameter read by blocks 0 and 3 (counted in block 0), a 6-byte one by 1 and 2."""
    blocks = tuple(Block(f"b{i}", (), Affine(0, 1.0), Affine(0, 2.0), 100, Affine(0, 1)) for i in range(4))
    return CostChain(blocks, (Affine(0, 8),) * 3,
                     shared_params=(SharedParam("wte", 40, (0, 3)), SharedParam("w", 6, (1, 2))))


def test_a_stage_holding_a_later_reader_of_a_shared_parameter_keeps_a_copy() -> None:
    chain = tied_chain()
    assert [tied_copy_bytes(chain, a, b) for a, b in ((0, 2), (2, 4), (0, 4), (1, 2), (2, 3), (3, 4))] == \
        [0, 46, 0, 0, 6, 40]
    assert stage_cost(chain, 2, 4, 4, 1).param_bytes == 200 + 46
    assert stage_cost(chain, 0, 4, 4, 1).param_bytes == 400  # one stage: one copy
    assert tie_groups(chain, [(0, 2), (2, 4)]) == [((0, 1), 46)]
    assert tie_groups(chain, [(0, 1), (1, 2), (2, 4)]) == [((0, 2), 40), ((1, 2), 6)]
    assert tie_groups(chain, [(0, 4)]) == []


def test_shared_parameters_must_name_two_ascending_blocks() -> None:
    blocks = tied_chain().blocks
    for bad in ((0,), (3, 0), (0, 0), (0, 4)):
        with pytest.raises(ValueError, match="shared parameter 'p' names blocks"):
            CostChain(blocks, (Affine(),) * 3, shared_params=(SharedParam("p", 4, bad),))


def test_coarsening_regroups_shared_parameters() -> None:
    chain = tied_chain()
    assert coarsen_chain(chain, [2, 4]).shared_params == (SharedParam("wte", 40, (0, 1)), SharedParam("w", 6, (0, 1)))
    assert coarsen_chain(chain, [1, 3, 4]).shared_params == (SharedParam("wte", 40, (0, 2)),)  # w: one block now
    assert coarsen_chain(chain, [4]).shared_params == ()
