"""Selective recompute per block (keep / block / attention core): plan data, costs, the planner's choice, simulator
against the reference, and training on gloo ranks exactly as without recompute and as one process."""

from __future__ import annotations

import copy
import itertools
import random
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe import models as zoo
from fxpipe.core.block_recompute import expanded_choices, normalized_choices
from fxpipe.core.chain import Block, CostChain
from fxpipe.core.cluster import Cluster, DeviceSpec, LinkSpec
from fxpipe.core.costgraph import Affine
from fxpipe.core.plan import Plan, PlanError, StagePlan
from fxpipe.core.recompute import force_recompute, parse_recompute
from fxpipe.passes import trace
from fxpipe.passes.partition.dapple import partition
from fxpipe.passes.partition.latency import stage_times
from fxpipe.passes.partition.selective import block_options, fits, greedy_block_choices, pick_block_choices
from fxpipe.passes.recompute_regions import checkpoint_regions, stage_regions
from fxpipe.planning import costed_model
from fxpipe.sim.recompute_cost import selective_figures
from fxpipe.sim.simulate import simulate
from tests.exactness_oracle import train_and_compare, train_reference
from tests.mp_utils import join_world, leave_world, plan_from_cuts, run_ranks
from tests.reference_sim import rerun_and_dropped
from tests.test_oracle_simulate import assert_agrees, rich_setup

# ---------------------------------------------------------------- plan data


def _stage(**changes: Any) -> StagePlan:
    return replace(StagePlan(0, 0, 3, 1, (0,), node_names=("a", "b", "c", "d")), **changes)


def test_block_recompute_round_trips_and_is_left_out_of_json_when_empty() -> None:
    plain = Plan(4, 2, (_stage(),))
    assert "block_recompute" not in plain.to_json() and "block_node_counts" not in plain.to_json()
    assert "block_recompute" not in Plan(4, 2, (_stage(recompute=True),)).to_json()  # today's flag keeps its bytes
    mixed = Plan(4, 2, (_stage(block_recompute=("keep", "attention", "block"), block_node_counts=(1, 2, 1)),))
    assert Plan.from_json(mixed.to_json()) == mixed
    assert '"attention"' in mixed.to_json()


@pytest.mark.parametrize("changes, message", [
    ({"block_recompute": ("keep", "block")}, r"block_recompute \['keep', 'block'\] for 3 blocks"),
    ({"block_recompute": ("keep", "all", "block")}, r"choices \['all'\]; choose each from"),
    ({"block_recompute": ("keep", "attention", "block"), "recompute": True}, "leave block_recompute out or set"),
    ({"block_recompute": ("keep", "attention", "block"), "block_node_counts": (1, 1, 1)},
     r"block_node_counts \[1, 1, 1\] for 3 blocks and 4 node names"),
])
def test_bad_block_recompute_names_the_value_and_the_fix(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        Plan(4, 2, (_stage(**changes),))


def test_choices_normalize_to_the_whole_stage_flag_and_expand_to_fine_blocks() -> None:
    assert normalized_choices(("keep", "keep")) == (False, ())
    assert normalized_choices(("block", "block")) == (True, ())
    assert normalized_choices(("block", "attention")) == (False, ("block", "attention"))
    # coarse blocks 1, 2 of stops [2, 3, 6]: fine blocks [2, 3) and [3, 6)
    assert expanded_choices(("attention", "block"), 1, [2, 3, 6]) == ("attention", "block", "block", "block")


def test_selective_setting_parses_and_forces_attention_on_every_block() -> None:
    assert parse_recompute("selective") == "selective"
    plan = force_recompute(Plan(4, 2, (_stage(recompute=True),)), "selective")
    assert plan.stages[0].block_recompute == ("attention",) * 3 and not plan.stages[0].recompute
    assert force_recompute(plan, "never").stages[0].block_recompute == ()


# ---------------------------------------------------------------- attention cores on the graph


def test_attention_cores_are_found_on_gpt_mini_and_hold_the_softmax_bytes() -> None:
    model, example = zoo.build("gpt-mini")
    costed = costed_model(model, example, _cluster(), max_blocks=8)
    nodes = costed.cost_graph.by_name()
    cored = [block for block in costed.chain.blocks if block.attention_core_bytes.per_sample > 0]
    assert len(cored) >= 2
    for block in cored:
        softmaxes = [name for name in block.node_names if nodes[name].op.endswith(":softmax")]
        # what recomputing the core saves: the probabilities (scores are not saved: scale and mask save nothing)
        assert block.attention_core_bytes == Affine.total(nodes[name].saved_bytes for name in softmaxes)
        assert block.attention_core_s == Affine.total(
            nodes[name].forward_s for name in block.node_names if name.startswith(("matmul", "mul", "masked_fill",
                                                                                      "softmax")))


@pytest.mark.parametrize("implementation, core_op", [("sdpa", "scaled_dot_product_attention"), ("eager", "softmax")])
def test_hf_llama_cores_in_both_attention_implementations(implementation: str, core_op: str) -> None:
    hf_examples = pytest.importorskip("fxpipe.hf_examples")
    model, example = hf_examples.llama()
    model.config._attn_implementation = implementation
    gm = trace(copy.deepcopy(model), example)
    stage = StagePlan(0, 0, 1, 1, (0,), block_recompute=("attention",))
    regions = stage_regions(gm, stage)
    assert len(regions) == 2  # one per layer
    assert all(any(core_op in name for name in region) for region in regions)
    if implementation == "eager":  # costing the model is most of this test's time: once is enough
        chain = costed_model(model, example, _cluster(), max_blocks=4).chain
        assert sum(block.attention_core_bytes.per_sample > 0 for block in chain.blocks) == 2


# ---------------------------------------------------------------- costs and the planner's choice


def _cluster(memory_bytes: int = 2**34) -> Cluster:
    device = DeviceSpec("dev", memory_bytes, (("float32", 1e13),), 1e12)
    return Cluster("1x2", 1, 2, device, LinkSpec(25e9, 5e-6), LinkSpec(25e9, 5e-6))


def _transformer_chain(num_layers: int, core_share: float) -> CostChain:
    """Layers of one block each: forward 1 ms/row, backward 2 ms/row, 1 MiB saved per row of which ``core_share``
    is attention's core (long sequences, many heads: the probabilities), costing 5% of the forward to redo."""
    saved = 2.0**20
    block = Block("layer", (), Affine(0, 1e-3), Affine(0, 2e-3), 2**22, Affine(0, saved),
                  attention_core_bytes=Affine(0, core_share * saved), attention_core_s=Affine(0, 5e-5))
    return CostChain((block,) * num_layers, (Affine(0, saved / 16),) * (num_layers - 1), input_bytes=Affine(0, 1e3))


def test_selective_figures_per_choice() -> None:
    chain = _transformer_chain(3, 0.6)
    figures = selective_figures(chain, 0, ("keep", "attention", "block"), rows=4, slowdown=2.0)
    assert figures is not None
    attention_bytes, block_bytes = 0.6 * 2**20 * 4, (2**20 - 2**20 / 16) * 4  # block 2 keeps the cut it reads
    assert figures.saved_bytes == pytest.approx(attention_bytes + block_bytes)
    assert figures.transient_bytes == pytest.approx(block_bytes)
    assert figures.extra_forward_s == pytest.approx(2.0 * 4 * (5e-5 + 1e-3))
    assert selective_figures(chain, 0, (), rows=4) is None


def _exhaustive(options: list[list[tuple[str, float, float]]], inflight: int, excess: float
                ) -> tuple[float, tuple[str, ...]] | None:
    best = None
    for picked in itertools.product(*options):
        if fits([num_bytes for _, num_bytes, _ in picked], inflight, excess):
            seconds = sum(s for _, _, s in picked)
            if best is None or seconds < best[0] - 1e-15:
                best = (seconds, tuple(name for name, _, _ in picked))
    return best


def _random_options(rng: random.Random, num_blocks: int) -> list[list[tuple[str, float, float]]]:
    """Transformer-like blocks: a core cheap per byte and a whole block saving most of its bytes."""
    options = []
    for _ in range(num_blocks):
        saved, forward = rng.uniform(1, 2), rng.uniform(1, 2)
        options.append([("keep", 0.0, 0.0), ("attention", rng.uniform(0.2, 0.7) * saved, rng.uniform(0.03, 0.1) * forward),
                        ("block", 0.95 * saved, forward)])
    return options


def _seconds(options: list[list[tuple[str, float, float]]], picked: tuple[str, ...]) -> float:
    return sum(dict((name, s) for name, _, s in block)[choice] for block, choice in zip(options, picked, strict=True))


def test_choice_is_the_exhaustive_optimum_on_small_stages() -> None:
    rng = random.Random(0)
    for _ in range(300):
        options = _random_options(rng, rng.randint(1, 5))
        inflight = rng.randint(1, 4)
        excess = rng.uniform(0, inflight * sum(block[2][1] for block in options))
        picked, best = pick_block_choices(options, inflight, excess), _exhaustive(options, inflight, excess)
        assert (picked is None) == (best is None), (options, inflight, excess)
        if picked is not None and best is not None:
            assert _seconds(options, picked) == pytest.approx(best[0], rel=1e-9, abs=1e-12)


def test_greedy_choice_against_exhaustive_search() -> None:
    """The greedy rule used past EXHAUSTIVE_BLOCKS blocks, on 7-8 blocks: it fits whenever something fits; its time
    against the optimum is printed (a knapsack: greedy is not optimal), and equal on identical blocks."""
    rng = random.Random(1)
    ratios = []
    for case in range(60):
        options = _random_options(rng, rng.randint(7, 8))
        if case % 3 == 0:
            options = [options[0]] * len(options)  # identical layers, as a transformer stage's
        inflight = rng.randint(1, 4)
        excess = rng.uniform(0, inflight * sum(block[2][1] for block in options))
        picked, best = greedy_block_choices(options, inflight, excess), _exhaustive(options, inflight, excess)
        assert (picked is None) == (best is None), (options, inflight, excess)
        if picked is not None and best is not None and best[0] > 0:
            ratios.append(_seconds(options, picked) / best[0])
            if case % 3 == 0:
                assert ratios[-1] == pytest.approx(1.0), (options, inflight, excess, picked, best)
    print(f"greedy over optimum: median {sorted(ratios)[len(ratios) // 2]:.4f}, worst {max(ratios):.4f}")


def _plan(chain: CostChain, memory_bytes: int, recompute: str = "auto") -> Plan:
    return partition(chain, _cluster(memory_bytes), 64, layout="1:1", num_microbatches=8, recompute=recompute,
                     memory_limit_bytes=memory_bytes)


def test_planner_recomputes_attention_cores_where_they_save_enough_and_keeps_when_memory_is_plenty() -> None:
    chain = _transformer_chain(8, 0.6)
    roomy = _plan(chain, 2**36)
    assert [(s.recompute, s.block_recompute) for s in roomy.stages] == [(False, ())] * 2
    keep_peak = max(roomy.stages[0].peak_memory_bytes, roomy.stages[1].peak_memory_bytes)
    tight = int(keep_peak * 0.7)  # the probabilities are 60% of the activations: cores alone fit
    plan = _plan(chain, tight)
    assert any(set(s.block_recompute) == {"attention", "keep"} or set(s.block_recompute) == {"attention"}
               for s in plan.stages), [s.block_recompute for s in plan.stages]
    assert all("block" not in s.block_recompute and not s.recompute for s in plan.stages)
    assert max(s.peak_memory_bytes for s in plan.stages) <= tight
    always = _plan(chain, tight, "always")
    assert plan.predicted is not None and always.predicted is not None and roomy.predicted is not None
    assert roomy.predicted.iteration_time_s <= plan.predicted.iteration_time_s < always.predicted.iteration_time_s
    # the simulator's memory is the plan's
    assert simulate(plan, chain, _cluster(tight)).peak_memory_bytes == tuple(s.peak_memory_bytes for s in plan.stages)
    # without cores (short sequences) the same squeeze needs whole blocks
    plain = _plan(_transformer_chain(8, 0.0), tight)
    assert any("block" in s.block_recompute or s.recompute for s in plain.stages)


def test_selective_recompute_setting_recomputes_every_core() -> None:
    plan = _plan(_transformer_chain(4, 0.6), 2**36, "selective")
    assert [s.block_recompute for s in plan.stages] == [("attention",) * 2] * 2
    assert [s.block_node_counts for s in plan.stages] == [(0, 0)] * 2  # the hand chain's blocks name no nodes


# ---------------------------------------------------------------- simulator, reference and pivot model agree


def _with_selective(seed: int) -> tuple[Plan, CostChain, Cluster, dict[str, float | str]]:
    plan, chain, net, options = rich_setup(seed)
    rng = random.Random(seed + 5 * 10**6)
    blocks = tuple(replace(block, attention_core_bytes=Affine(0, rng.uniform(0, 0.7) * block.saved_bytes.per_sample),
                           attention_core_s=Affine(0, rng.uniform(0, 0.1) * block.forward_s.per_sample))
                   for block in chain.blocks)
    chain = replace(chain, blocks=blocks)
    stages = tuple(replace(stage, recompute=False, block_recompute=tuple(
        rng.choice(("keep", "block", "attention")) for _ in range(stage.stop_block - stage.first_block)))
                   if plan.schedule != "zero_bubble" and rng.random() < 0.7 else stage for stage in plan.stages)
    return plan.with_updates(stages=stages), chain, net, options


def test_simulator_matches_the_reference_with_per_block_recompute() -> None:
    seen = 0
    for seed in range(150):
        plan, chain, net, options = _with_selective(seed)
        seen += any(s.block_recompute for s in plan.stages)
        assert_agrees(plan, chain, net, f"seed {seed}: {[s.block_recompute for s in plan.stages]}", **options)
    assert seen > 50


def test_pivot_model_charges_the_same_rerun_forward() -> None:
    for seed in range(40):
        plan, chain, net, _ = _with_selective(seed)
        plain = plan.with_updates(stages=tuple(replace(s, block_recompute=()) for s in plan.stages))
        selective, base = stage_times(plan, chain, net), stage_times(plain, chain, net)
        for index, stage in enumerate(plan.stages):
            rows = -(-plan.microbatch_size // stage.replicas)
            extra = rerun_and_dropped(chain, stage, rows)[0] * net.compute_slowdown
            step = selective.stage_index.index(index)  # steps interleave stages and costly transfers
            assert selective.backward[step] - base.backward[step] == pytest.approx(extra, rel=1e-9, abs=1e-15)


def test_block_options_name_only_choices_that_save_bytes() -> None:
    chain = _transformer_chain(2, 0.0)
    assert [[name for name, _, _ in block] for block in block_options(chain, 0, 2, 4)] == [["keep", "block"]] * 2


# ---------------------------------------------------------------- training on gloo ranks (one spawned world)

GLOBAL_BATCH = 8
NUM_MICROBATCHES = 2


class TinyAttention(nn.Module):
    """Two pre-norm attention + MLP layers written out by hand (scores, softmax, dropout on the probabilities,
    probabilities x V), then a head."""

    def __init__(self, p: float, width: int = 16, heads: int = 2, layers: int = 2) -> None:
        super().__init__()
        self.heads, self.p = heads, p
        self.qkv = nn.ModuleList(nn.Linear(width, 3 * width) for _ in range(layers))
        self.proj = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.mlp = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(),
                                               nn.Linear(2 * width, width)) for _ in range(layers))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, seq, width) -> (batch, seq, 3)
        for qkv, proj, mlp in zip(self.qkv, self.proj, self.mlp, strict=True):
            q, k, v = qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4).unbind(0)  # (b, h, t, d)
            scores = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5
            probs = nn.functional.dropout(torch.softmax(scores, dim=-1), self.p, self.training)
            x = x + proj(torch.matmul(probs, v).transpose(1, 2).flatten(-2))
            x = x + mlp(x)
        return self.head(x)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def _batch(seed: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(GLOBAL_BATCH, 6, 16, generator=generator),), torch.randn(GLOBAL_BATCH, 6, 3, generator=generator)


def _tiny_plan(model: nn.Module, choices: tuple[tuple[str, str], ...] | None) -> Plan:
    """Two stages of two blocks each, with per-block ``choices`` per stage: a layer's attention up to its residual add
    (the core inside), then the rest of the stage."""
    plan = plan_from_cuts(trace(copy.deepcopy(model), _batch(0)[0]), (1, 1), GLOBAL_BATCH, NUM_MICROBATCHES)
    stages = []
    for stage in plan.stages:
        half = 1 + next(i for i, name in enumerate(stage.node_names) if name.startswith("add"))
        stages.append(replace(stage, first_block=2 * stage.stage_index, stop_block=2 * stage.stage_index + 2,
                              block_recompute=choices[stage.stage_index] if choices else (),
                              block_node_counts=(half, len(stage.node_names) - half) if choices else ()))
    return plan.with_updates(stages=tuple(stages))


# stage 0 recomputes its core, then its MLP block whole; stage 1 its core, then keeps
MIXED = (("attention", "block"), ("attention", "keep"))


def _tiny_step(p: float, choices: Any, seed: int, rank: int, store_dir: str, name: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyAttention(p)
    plan = _tiny_plan(model, choices)
    join_world(store_dir, name, rank, 2)
    try:
        pipe = fxpipe.compile(model, _batch(0)[0], loss_fn=_loss, global_batch_size=GLOBAL_BATCH, plan=plan)
        inputs, targets = _batch(7)
        torch.manual_seed(seed)
        loss = pipe.step(inputs, targets)
        regions = sorted(name for name, _ in pipe.module.named_children() if name.startswith("fxpipe_recompute_"))
        return {"loss": loss, "grads": {n: p.grad.clone() for n, p in pipe.named_parameters()}, "regions": regions}
    finally:
        leave_world()


def _llama_problems(rank: int, store_dir: str) -> list[str]:
    """HF Llama (eager attention, its dropout at 0) on 2 stages recomputing every core, against one process."""
    hf_examples = pytest.importorskip("fxpipe.hf_examples")
    model, example = hf_examples.llama()
    model.config._attn_implementation = "eager"
    batches = [hf_examples.make_batch("llama", GLOBAL_BATCH, 100 + step) for step in range(2)]
    reference_model = copy.deepcopy(model)
    reference = train_reference(reference_model, hf_examples.hf_loss, batches)
    plan = force_recompute(plan_from_cuts(trace(copy.deepcopy(model), example), (1, 1), GLOBAL_BATCH, 2), "selective")
    join_world(store_dir, "llama", rank, 2)
    try:
        pipe = fxpipe.compile(model, example, loss_fn=hf_examples.hf_loss, global_batch_size=GLOBAL_BATCH, plan=plan)
        return train_and_compare(pipe, batches, reference)["problems"]
    finally:
        leave_world()


# a small GPT whose attention probabilities (seq 128, 2 heads) outweigh its other activations
MEMORY_LM = {"vocab_size": 512, "n_embd": 64, "block_size": 128, "n_layer": 2, "n_head": 2}
MEMORY_BATCH, MEMORY_MICROBATCHES = 16, 4


def _memory_plans() -> tuple[Plan, Plan, list[tuple[int, int]]]:
    """gpt-mini on 2 local ranks kept, the same plan recomputing every attention core, and the model's activation
    peaks per stage for both (fxpipe.sim.stagecost.activation_peak_bytes, with the per-block figures)."""
    from fxpipe.core.cluster import parse_cluster
    from fxpipe.planning import plan_chain
    from fxpipe.sim.stagecost import activation_peak_bytes, stage_cost

    rows = MEMORY_BATCH // MEMORY_MICROBATCHES
    entry = zoo.get("gpt-mini")
    model, example = zoo.build("gpt-mini", batch_size=rows, **MEMORY_LM)
    cluster = parse_cluster("1x2:cpu")
    chain = costed_model(model, example, cluster, costs="analytic", loss_fn=entry.loss_fn,
                         example_targets=entry.make_batch(rows, 0, **MEMORY_LM)[1]).chain
    keep = plan_chain(chain, cluster, MEMORY_BATCH, layout="1:1", num_microbatches=MEMORY_MICROBATCHES,
                      recompute="never")
    selective = force_recompute(keep, "selective")
    predicted = []
    for stage in selective.stages:
        cost = stage_cost(chain, stage.first_block, stage.stop_block, selective.microbatch_size, stage.replicas)
        figures = selective_figures(chain, stage.first_block, stage.block_recompute, cost.rows)
        predicted.append((activation_peak_bytes(cost, stage.inflight_microbatches, selective.num_microbatches),
                          activation_peak_bytes(cost, stage.inflight_microbatches, selective.num_microbatches, False,
                                                figures)))
    return keep, selective, predicted


def _measured_peak(plan: Plan, rank: int, store_dir: str, name: str) -> int:
    entry = zoo.get("gpt-mini")
    model, example = zoo.build("gpt-mini", batch_size=plan.microbatch_size, **MEMORY_LM)
    join_world(store_dir, name, rank, 2)
    try:
        pipe = fxpipe.compile(model, example, loss_fn=entry.loss_fn, global_batch_size=MEMORY_BATCH, plan=plan)
        inputs, targets = entry.make_batch(MEMORY_BATCH, 1, **MEMORY_LM)
        pipe.step(inputs, targets)  # warm-up outside the hooks
        pipe.measure = True
        pipe.step(inputs, targets)
        return int(pipe.step_stats()[rank].peak_activation_bytes or 0)
    finally:
        leave_world()


def _all_checks(rank: int, world_size: int, store_dir: str, keep_plan: Plan, selective_plan: Plan) -> dict[str, Any]:
    peaks = (_measured_peak(keep_plan, rank, store_dir, "memory-keep"),
             _measured_peak(selective_plan, rank, store_dir, "memory-selective"))
    keep = _tiny_step(0.3, None, 1, rank, store_dir, "keep")
    mixed = _tiny_step(0.3, MIXED, 1, rank, store_dir, "mixed")
    other_seed = _tiny_step(0.3, None, 2, rank, store_dir, "other-seed")
    batches = [_batch(100 + step) for step in range(2)]
    torch.manual_seed(0)
    # the key biases' gradients are exactly zero in exact arithmetic (softmax ignores a shift): rounding noise that
    # Adam would scale to full steps; a larger eps keeps it small (as tests/test_hf_models.py does)
    reference = train_reference(TinyAttention(0.0), _loss, batches, adam_eps=1e-5)
    torch.manual_seed(0)
    model = TinyAttention(0.0)
    plan = _tiny_plan(model, MIXED)
    join_world(store_dir, "oracle", rank, 2)
    try:
        pipe = fxpipe.compile(model, _batch(0)[0], loss_fn=_loss, global_batch_size=GLOBAL_BATCH, plan=plan)
        oracle = train_and_compare(pipe, batches, reference, adam_eps=1e-5)["problems"]
    finally:
        leave_world()
    return {
        "peaks": peaks,
        "regions": (keep["regions"], mixed["regions"]),
        "losses": (keep["loss"], mixed["loss"]),
        "unequal": sorted(name for name, grad in keep["grads"].items() if not torch.equal(mixed["grads"][name], grad)),
        "seed_matters": any(not torch.equal(other_seed["grads"][name], grad) for name, grad in keep["grads"].items()),
        "oracle": oracle,
        "llama": _llama_problems(rank, store_dir),
    }


@pytest.mark.multiprocess
def test_per_block_recompute_trains_exactly(tmp_path: Any) -> None:
    keep_plan, selective_plan, predicted = _memory_plans()
    per_rank = run_ranks(_all_checks, 2, tmp_path, keep_plan, selective_plan)
    # measured saved-activation peaks, every core recomputed, are the model's within 5%; they drop where it says
    assert predicted[0][1] < predicted[0][0]  # stage 0 holds attention
    for rank, result in enumerate(per_rank):
        print(f"stage {rank}: measured kept, selective {result['peaks']} B; predicted {predicted[rank]} B")
        assert predicted[rank][1] == pytest.approx(result["peaks"][1], rel=0.05), (rank, predicted, result["peaks"])
        assert (result["peaks"][1] < result["peaks"][0]) == (predicted[rank][1] < predicted[rank][0]), rank
    # stage 0: its core and its MLP block (a region each); stage 1: its core
    assert [result["regions"] for result in per_rank] == [([], [f"fxpipe_recompute_{i}" for i in range(count)])
                                                         for count in (2, 1)]
    for rank, result in enumerate(per_rank):
        # dropout on the probabilities draws the same masks when the core runs again: bitwise equal gradients
        assert result["losses"][0] == result["losses"][1], (rank, result["losses"])
        assert result["unequal"] == [], (rank, result["unequal"])
        assert result["seed_matters"], rank  # dropout is live, so the equality is not vacuous
        assert result["oracle"] == [], (rank, result["oracle"])
        assert result["llama"] == [], (rank, result["llama"])


def test_regions_replace_their_nodes_with_checkpointed_calls() -> None:
    """The stage code: one call per region, the layers and parameters under their own names, same outputs and
    gradients as the uncut graph (one process, no dropout)."""
    torch.manual_seed(0)
    model = TinyAttention(0.0)
    gm = trace(copy.deepcopy(model), _batch(0)[0])
    stage = StagePlan(0, 0, 1, 1, (0,), block_recompute=("attention",))
    regions = stage_regions(gm, stage)
    assert len(regions) == 2 and all(region[0].startswith("matmul") and region[-1].startswith("matmul")
                                     for region in regions)
    cut = checkpoint_regions(gm, regions)
    assert [n for n, _ in cut.named_parameters()] == [n for n, _ in gm.named_parameters()]
    assert sorted(n for n, _ in cut.named_children() if n.startswith("fxpipe_recompute_")) == [
        "fxpipe_recompute_0", "fxpipe_recompute_1"]
    assert not any(node.name in set(regions[0]) for node in cut.graph.nodes)
    inputs, targets = _batch(3)
    for module in (gm, cut):
        _loss(module(*inputs), targets).backward()
    for (name, expected), (_, actual) in zip(gm.named_parameters(), cut.named_parameters(), strict=True):
        assert torch.equal(actual.grad, expected.grad), name
