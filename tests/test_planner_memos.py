"""The planner's speed-ups give the figures of the plain computations they replace, bit for bit (issue 34 item 4)."""

from __future__ import annotations

import random

import pytest

from fxpipe.core.block_sums import block_sums
from fxpipe.core.chain import Block, CostChain, SharedParam, block_units, merged_units
from fxpipe.core.cluster import Cluster, DeviceSpec, LinkSpec
from fxpipe.core.costgraph import Affine
from fxpipe.core.recompute import choose_recompute
from fxpipe.core.row_slices import shared_rows
from fxpipe.passes.partition.candidates import CandidateCosts
from fxpipe.passes.partition.cut_scores import cut_scorer
from fxpipe.passes.partition.selective import recompute_memory
from fxpipe.passes.partition.spans import StageChoice, spans_from_stops
from fxpipe.sim.stagecost import largest_unit_bytes, num_units, stage_memory_bytes, transfer_time

DEVICE = DeviceSpec("test", 2**30, (("float32", 1e12),), 1e11)
TWO_HOSTS = Cluster("t", 2, 4, DEVICE, LinkSpec(1e11, 1e-6), LinkSpec(1e9, 2e-5))


def random_stops(rng: random.Random, num_blocks: int, num_stages: int) -> list[int]:
    return sorted(rng.sample(range(1, num_blocks), num_stages - 1)) + [num_blocks]


def random_chain(seed: int, num_blocks: int = 24) -> CostChain:
    """Blocks whose FSDP units span several blocks, repeat, or hold nothing, and which re-save earlier values."""
    rng = random.Random(seed)
    blocks = []
    for index in range(num_blocks):
        units = tuple((f"u{rng.randint(0, num_blocks // 3)}", rng.choice([0, 1, 10**6, rng.randint(1, 10**7)]))
                      for _ in range(rng.randint(0, 3)))
        resaved = tuple((saver, Affine(rng.uniform(0, 9), rng.uniform(0, 1e5)))
                        for saver in sorted(rng.sample(range(index), min(index, rng.randint(0, 2)))))
        blocks.append(Block(f"b{index}", (f"n{index}",), Affine(1e-4, rng.uniform(1e-5, 1e-3)),
                            Affine(2e-4, rng.uniform(2e-5, 2e-3)), rng.choice([0, rng.randint(1, 10**7)]),
                            Affine(0, rng.uniform(1e3, 1e6)), resaved=resaved, units=units))
    cuts = tuple(Affine(0, rng.uniform(1e3, 1e5)) for _ in range(num_blocks - 1))
    return CostChain(tuple(blocks), cuts, source=f"memo:{seed}")


def walked_units(chain: CostChain, first: int, stop: int) -> list[int]:
    """The units of blocks ``[first, stop)`` merged by walking them (what stage_unit_bytes did on every call)."""
    units = merged_units(entry for block in chain.blocks[first:stop] for entry in block_units(block))
    return [num_bytes for _, num_bytes in units if num_bytes > 0]


def ranges_in_random_order(num_blocks: int, seed: int) -> list[tuple[int, int]]:
    ranges = [(first, stop) for first in range(num_blocks) for stop in range(first + 1, num_blocks + 1)]
    random.Random(seed).shuffle(ranges)  # runs grow from any first, to any stop, in any order
    return ranges


@pytest.mark.parametrize("seed", range(6))
def test_unit_figures_equal_the_walk(seed: int) -> None:
    chain = random_chain(seed)
    for first, stop in ranges_in_random_order(chain.num_blocks, seed):
        sizes = walked_units(chain, first, stop)
        assert largest_unit_bytes(chain, first, stop) == (float(max(sizes)) if len(sizes) >= 2 else 0.0)
        assert num_units(chain, first, stop) == max(1, len(sizes))


def test_negative_unit_entries_fall_back_to_the_walk() -> None:
    blocks = tuple(Block(f"b{i}", (), Affine(0, 1), Affine(0, 2), 10, units=(("shared", 9 - 6 * i), (f"own{i}", 5)))
                   for i in range(3))  # "shared" totals 9, 12, then 9 again: they shrink
    chain = CostChain(blocks, (Affine(0, 1), Affine(0, 1)))
    assert block_sums(chain).units(0, 3) is None
    assert largest_unit_bytes(chain, 0, 3) == 9.0 == float(max(walked_units(chain, 0, 3)))
    assert largest_unit_bytes(chain, 0, 2) == 12.0 and num_units(chain, 0, 3) == 4


@pytest.mark.parametrize("seed", range(4))
def test_resaved_sums_grown_in_pieces_equal_the_plain_sum(seed: int) -> None:
    chain = random_chain(seed, num_blocks=40)
    for first, stop in ranges_in_random_order(chain.num_blocks, seed):
        totals = [Affine.total(num_bytes for saver, num_bytes in block.resaved if saver < first)
                  for block in chain.blocks[first:stop]]
        expected = totals[0]
        for total in totals[1:]:
            expected = expected + total
        got = block_sums(chain).resaved(first, stop)
        assert (got.fixed, got.per_sample) == (expected.fixed, expected.per_sample)


def walked_transfer_time(cluster: Cluster, bytes_per_row: Affine, rows: int, src: tuple[int, ...],
                         dst: tuple[int, ...]) -> float:
    """The pairwise transfer time through ``Cluster.link`` for every pair (the code before the memo)."""
    busy: dict[tuple[str, int], float] = {}
    for sender, receiver, start, stop in shared_rows(rows, len(src), len(dst)):
        if src[sender] == dst[receiver]:
            continue
        seconds = cluster.link(src[sender], dst[receiver]).transfer_time(bytes_per_row.at(stop - start))
        busy[("send", src[sender])] = busy.get(("send", src[sender]), 0.0) + seconds
        busy[("recv", dst[receiver])] = busy.get(("recv", dst[receiver]), 0.0) + seconds
    return max(busy.values(), default=0.0)


@pytest.mark.parametrize("seed", range(40))
def test_transfer_time_equals_the_pairwise_walk(seed: int) -> None:
    rng = random.Random(seed)
    cluster = Cluster("t", rng.randint(1, 4), rng.choice([1, 2, 8]), DEVICE, LinkSpec(1e11, 1e-6), LinkSpec(1e9, 2e-5))
    src = tuple(rng.sample(range(cluster.num_devices), rng.randint(1, cluster.num_devices)))
    dst = tuple(rng.sample(range(cluster.num_devices), rng.randint(1, cluster.num_devices)))
    rows = rng.randint(max(len(src), len(dst)), 64)
    bytes_per_row = Affine(rng.uniform(0, 100), rng.uniform(1, 1e6))
    assert transfer_time(cluster, bytes_per_row, rows, src, dst) == walked_transfer_time(
        cluster, bytes_per_row, rows, src, dst)


def test_transfer_time_still_refuses_a_device_outside_the_cluster() -> None:
    cluster = Cluster("t", 2, 2, DEVICE, LinkSpec(1e11, 1e-6), LinkSpec(1e9, 2e-5))
    with pytest.raises(ValueError, match="device 4 is not in cluster"):
        transfer_time(cluster, Affine(0, 1), 4, (0, 1), (2, 4))


def walked_choices(model: CandidateCosts, spans: list, rows: int, setting: object) -> list[StageChoice]:  # type: ignore[type-arg]
    """Every stage's recompute choice and memory as stage_choices computed them before the per-stage memo (a
    recomputing stage's memory: whole-stage or per block, whichever needs less: selective.recompute_memory)."""
    choices = []
    for index, span in enumerate(spans):
        cost = model.cost(span.first, span.stop, rows, span.replicas, span.tensor_parallel)
        inflight = model.inflight(index, len(spans), model.global_batch_size // rows, "A")
        keep = stage_memory_bytes(cost, inflight, model.optimizer)
        recompute = choose_recompute(setting, index, len(spans), keep, model.memory_limit_bytes)  # type: ignore[arg-type]
        recomputed = recompute_memory(model.chain, span.first, span.stop, cost, inflight, model.optimizer, True, "none",
                                      1, 1, span.tensor_parallel, model.memory_limit_bytes) if recompute else keep
        choices.append(StageChoice(recompute, recomputed))
    return choices


@pytest.mark.parametrize("seed", range(8))
def test_memoised_stage_choices_equal_the_walk(seed: int) -> None:
    rng = random.Random(seed)
    chain = random_chain(seed, num_blocks=12)
    num_stages = rng.randint(1, 4)
    setting = rng.choice(["auto", "never", "always", tuple(rng.choice([True, False]) for _ in range(num_stages))])
    limit = rng.choice([10**7, 10**8, 10**9])
    model = CandidateCosts(chain, TWO_HOSTS, 64, "adam", limit, recompute=setting)
    for _ in range(20):  # many candidates through one model: its memo is shared between them
        stops = random_stops(rng, chain.num_blocks, num_stages)
        devices = [tuple(range(s * 2, s * 2 + rng.randint(1, 2))) for s in range(num_stages)]
        spans = spans_from_stops(stops, devices)
        rows = rng.choice([2, 4, 8])
        assert model.stage_choices(spans, rows, "A") == walked_choices(model, spans, rows, setting)


@pytest.mark.parametrize("seed", range(12))
def test_cut_scorer_equals_fits_then_latency(seed: int) -> None:
    rng = random.Random(seed)
    chain = random_chain(seed, num_blocks=16)
    num_stages = rng.randint(2, 5)
    setting = rng.choice(["auto", "never", "always", tuple(rng.choice([True, False]) for _ in range(num_stages)),
                          (True,)])  # the last one names another stage count: "auto"
    model = CandidateCosts(chain, TWO_HOSTS, 64, "adam", rng.choice([10**7, 10**8, 10**9]), recompute=setting,
                           schedule=rng.choice(["early_backward", "zero_bubble", "gpipe"]),
                           allreduce_bucket_bytes=rng.choice([0, 10**6]))
    devices = [tuple(range(s * 8 // num_stages, (s + 1) * 8 // num_stages)) for s in range(num_stages)]
    rows = rng.choice([4, 8])  # at least one row per replica (up to 4 devices a stage)
    score = cut_scorer(model, spans_from_stops(random_stops(rng, chain.num_blocks, num_stages), devices), rows)
    assert score is not None
    for _ in range(30):  # trials in any order: kept figures of earlier ones serve later ones
        stops = random_stops(rng, chain.num_blocks, num_stages)
        spans = spans_from_stops(stops, devices)
        assert score(stops) == (model.latency(spans, rows) if model.fits(spans, rows) else float("inf"))


def test_cut_scorer_leaves_tied_weights_and_sharding_to_the_model() -> None:
    chain = random_chain(0, num_blocks=6)
    cluster = Cluster("t", 1, 4, DEVICE, LinkSpec(1e11, 1e-6), LinkSpec(1e9, 2e-5))
    spans = spans_from_stops([3, 6], [(0, 1), (2, 3)])
    assert cut_scorer(CandidateCosts(chain, cluster, 64, "adam", 10**9, sharding="auto"), spans, 4) is None
    tied = CostChain(chain.blocks, chain.cut_bytes, shared_params=(SharedParam("w", 10, (0, 4)),))
    assert cut_scorer(CandidateCosts(tied, cluster, 64, "adam", 10**9), spans, 4) is None
