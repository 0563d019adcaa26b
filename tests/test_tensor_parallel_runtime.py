"""Tensor-parallel stage replicas (``RxT``) on 4 gloo ranks: T=2 stages next to T=1 stages, with replicas and tied
weights, train exactly as one process (loss, gathered gradients, clipped norm, weights), predict and evaluate
other batch shapes, save and load across T, and each rank holds its share of the stage's weights."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.compile_parallel_loss import VocabParallelLoss
from fxpipe.core.plan import Plan, StagePlan
from fxpipe.passes import tensor_parallel_ops, trace
from fxpipe.runtime.faults.errors import PipelineSetupError
from fxpipe.runtime.parallel.tensor_parallel import (
    TensorParallelGroups,
    TensorParallelParam,
    assemble,
    shard_slice,
    tied_split_differences,
)
from fxpipe.runtime.transport.group_routes import group_routes
from tests.exactness_oracle import LEARNING_RATE, mismatches, train_reference
from tests.mp_utils import plan_from_cuts, run_ranks, with_layout
from tests.test_sharded_stages import _exported_matches, _world

transformers = pytest.importorskip("transformers")
hf_examples = pytest.importorskip("fxpipe.hf_examples")

WORLD_SIZE = 4
GLOBAL_BATCH = 8
NUM_MICROBATCHES = 2
NUM_STEPS = 3
SEQ_LEN = 8
MAX_NORM = 0.05  # below every step's norm: every step clips (checked against the reference's norms)
ADAM_EPS = 1e-5  # attention key biases get rounding-noise gradients (see test_hf_models)


class Attention(nn.Module):
    """Causal multi-head self-attention with separate q, k, v projections (B, S, D) -> (B, S, D)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def split(t: torch.Tensor) -> torch.Tensor:  # (B, S, D) -> (B, H, S, D / H)
            return t.unflatten(-1, (self.heads, -1)).transpose(1, 2)

        y = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)), is_causal=True)
        return self.out(y.transpose(1, 2).flatten(-2))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attention = Attention(dim, heads)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    """tokens (B, S) -> logits (B, S, vocab): embedding, attention + MLP blocks, untied output head."""

    def __init__(self, vocab: int, dim: int, heads: int, num_blocks: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(vocab, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(num_blocks)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embedding(tokens))))


def _token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _hf_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    return hf_examples.hf_loss(output, targets)


# name -> (factory of (model, example inputs), vocabulary, loss)
MODELS: dict[str, tuple[Any, int, Any]] = {
    "attention": (lambda: (TinyLM(64, 32, 4, 2), torch.zeros(2, SEQ_LEN, dtype=torch.long)), 64, _token_loss),
    "vocab": (lambda: (TinyLM(1024, 16, 2, 1), torch.zeros(2, SEQ_LEN, dtype=torch.long)), 1024, _token_loss),
    "llama": (lambda: hf_examples.llama(num_layers=1, hidden=32, heads=4, kv_heads=2, seq_len=SEQ_LEN), 100, _hf_loss),
    "gpt2": (lambda: hf_examples.gpt2(n_layer=1, n_head=4, seq_len=SEQ_LEN), 100, _hf_loss),
}
# (name, model, layout: (replicas, T) per stage, schedule, sharding over each TP index's replicas, torch_compile);
# names ending in SP run sequence-parallel
CASES = (
    ("attention 1x2:2", "attention", ((1, 2), (2, 1)), "early_backward", "none", False),
    ("llama 2x2 SP", "llama", ((2, 2),), "early_backward", "none", False),
    ("gpt2 1x2:1x2", "gpt2", ((1, 2), (1, 2)), "gpipe", "none", False),
    ("vocab 2:1x2", "vocab", ((2, 1), (1, 2)), "zero_bubble", "none", False),
    ("attention 2x2 ZeRO-2 SP", "attention", ((2, 2),), "early_backward", "gradients", False),
    ("vocab 2:1x2 compiled", "vocab", ((2, 1), (1, 2)), "early_backward", "none", {"backend": "aot_eager"}),
    # split backward: the T = 2 stage's compiled joint graph cut into F, B and W, its collectives traced as functional
    # ones (they traced as c10d ops nothing waited on, and gave wrong gradients: runtime/parallel/traced_collectives)
    ("vocab 2:1x2 compiled zero_bubble", "vocab", ((2, 1), (1, 2)), "zero_bubble", "none", {"backend": "aot_eager"}),
    # sequence parallelism's column linears (one autograd function gathering their input again in backward) traced
    # into the compiled F/B/W graphs
    ("attention 2x2 ZeRO-3 SP", "attention", ((2, 2),), "early_backward", "parameters", False),
    ("attention 1x2:1x2 zero_bubble SP", "attention", ((1, 2), (1, 2)), "zero_bubble", "none", False),
    ("attention 1x2:1x2 compiled SP", "attention", ((1, 2), (1, 2)), "early_backward", "none",
     {"backend": "aot_eager"}),
    ("attention 1x2:1x2 compiled zero_bubble SP", "attention", ((1, 2), (1, 2)), "zero_bubble", "none",
     {"backend": "aot_eager"}),
)


def _batch(model: str, rows: int, seq: int, seed: int) -> tuple[Any, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, MODELS[model][1], (rows, seq + 1), generator=generator)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return ({"input_ids": inputs} if model in ("llama", "gpt2") else inputs), targets


def _batches(model: str) -> list[tuple[Any, torch.Tensor]]:
    return [_batch(model, GLOBAL_BATCH, SEQ_LEN, 100 + step) for step in range(NUM_STEPS)]


def _clipped(model: nn.Module) -> float:
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))


def _plan(model: str, layout: tuple[tuple[int, int], ...], schedule: str = "early_backward") -> Plan:
    """Equal node-count cuts, then each stage as ``replicas`` groups of ``T`` devices, numbered stage by stage."""
    module, example = MODELS[model][0]()
    example = example if isinstance(example, tuple | dict) else (example,)
    plan = plan_from_cuts(trace(copy.deepcopy(module), example), [r for r, _ in layout], GLOBAL_BATCH, NUM_MICROBATCHES,
                          schedule=schedule)
    return with_layout(plan, layout)


def _compile(model: str, plan: Plan, sharding: str = "none", torch_compile: Any = False,
             sequence_parallel: bool = False) -> Any:
    module, example = MODELS[model][0]()
    return fxpipe.compile(module, example, loss_fn=MODELS[model][2], global_batch_size=GLOBAL_BATCH, plan=plan,
                          loss_reduction="mean", sharding=sharding, check_rows=False, torch_compile=torch_compile,
                          sequence_parallel=sequence_parallel)


def _reference(model: str) -> dict[str, Any]:
    module, _ = MODELS[model][0]()
    return train_reference(module, MODELS[model][2], _batches(model), adam_eps=ADAM_EPS, after_backward=_clipped)


def _whole_weights(pipe: Any) -> dict[str, torch.Tensor]:
    names = {name for name, _ in pipe.named_parameters()}
    return {name: tensor for name, tensor in pipe.state_dict().items() if name in names}


def _train(pipe: Any, model: str, reference: dict[str, Any]) -> dict[str, Any]:
    """Clipped AdamW steps: loss, gathered gradients, norm and final weights against the one-process reference."""
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=LEARNING_RATE, eps=ADAM_EPS)
    problems: list[str] = []
    losses, norms = [], []
    counts = pipe.driver.tp_communicator.counts if pipe.driver.tp_communicator is not None else {}
    collectives: dict[str, int] = {}
    for step, (inputs, targets) in enumerate(_batches(model)):
        before = dict(counts)
        losses.append(pipe.step(inputs, targets))
        if step == 1:
            collectives = {kind: count - before.get(kind, 0) for kind, count in counts.items() if count > before.get(kind, 0)}
        norms.append(float(pipe.clip_grad_norm_(MAX_NORM)))
        grads = {name: pipe.driver.whole(name, param.grad) for name, param in pipe.named_parameters()}
        tolerance = {"rtol": 1e-4, "atol": 1e-6} if step == 0 else {"rtol": 1e-3, "atol": 1e-6, "atol_of_largest": 1e-3}
        problems += mismatches(f"step {step} grad", grads, reference["grads_per_step"][step], **tolerance)
        optimizer.step()
        optimizer.zero_grad()
    problems += mismatches("weights", _whole_weights(pipe), reference["params"], rtol=0.0, atol=1e-4)
    if not torch.allclose(torch.tensor(losses), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-6):
        problems.append(f"losses {losses} vs {reference['losses']}")
    if not torch.allclose(torch.tensor(norms), torch.tensor(reference["after_backward"]), rtol=1e-4, atol=0.0) \
            or min(reference["after_backward"]) <= MAX_NORM:
        problems.append(f"clipped norms {norms} vs {reference['after_backward']}")
    return {"problems": problems, "optimizer": optimizer, "collectives": collectives}


def _inference(pipe: Any, model: str, reference: dict[str, Any]) -> list[str]:
    """predict (whole outputs on every rank) and evaluate of other batch shapes against the trained reference."""
    trained, loss_fn = reference["model"], MODELS[model][2]
    problems = []
    for rows, seq in ((GLOBAL_BATCH, SEQ_LEN - 2), (GLOBAL_BATCH - 3, SEQ_LEN)):  # T divides every length (SP)
        inputs, targets = _batch(model, rows, seq, 7)
        with torch.no_grad():
            expected = trained(**inputs) if isinstance(inputs, dict) else trained(inputs)
            expected_loss = float(loss_fn(expected, targets))
        output = pipe.predict(inputs)
        logits = output["logits"] if isinstance(output, dict) else output
        problems += mismatches(f"predict {rows}x{seq}", {"logits": logits},
                               {"logits": expected["logits"] if isinstance(expected, dict) else expected},
                               rtol=1e-3, atol=1e-4)
        loss = pipe.evaluate(inputs, targets)
        if abs(loss - expected_loss) > 1e-4 * abs(expected_loss):
            problems.append(f"evaluate {rows}x{seq}: {loss} vs {expected_loss}")
    return problems


def _share_problems(pipe: Any) -> list[str]:
    """Each sharded parameter holds 1/T of its whole tensor here, so the rank holds the stage's whole elements less
    (T-1)/T of the sharded ones."""
    degree, described = pipe.driver.tensor_parallel.degree, pipe.driver.tp_params
    whole = {name: tensor.numel() for name, tensor in _whole_weights(pipe).items()}
    sharded = [name for name, param in described.items() if param.dim is not None]
    problems = [f"{name}: {param.numel()} of {whole[name]} elements on a {degree}-way group"
                for name, param in pipe.named_parameters() if name in sharded and param.numel() * degree != whole[name]]
    held = sum(param.numel() for _, param in pipe.named_parameters())
    expected = sum(whole.values()) - sum(whole[name] for name in sharded) * (degree - 1) // degree
    return problems + ([f"holds {held} parameter elements, expected {expected}"] if held != expected else [])


# per generated collective node: the communicator calls it makes per micro-batch, (forward, backward); backward
# ones only run when the node's input carries a gradient
NODE_COLLECTIVES = {
    tensor_parallel_ops.copy_to_group: ({}, {"all_reduce": 1}),
    tensor_parallel_ops.reduce_from_group: ({"all_reduce": 1}, {}),
    tensor_parallel_ops.vocab_embedding: ({"all_reduce": 1}, {}),
    tensor_parallel_ops.gather_from_group: ({"all_gather": 1}, {}),
    tensor_parallel_ops.gather_for_inference: ({}, {}),  # gathers only under no_grad (evaluate, predict)
    tensor_parallel_ops.gather_sequence: ({"all_gather": 1}, {"reduce_scatter": 1}),
    tensor_parallel_ops.reduce_scatter_sequence: ({"reduce_scatter": 1}, {"all_gather": 1}),
    tensor_parallel_ops.split_sequence: ({}, {"all_gather": 1}),
    # column linears keeping their input's token share: gathered again in backward
    tensor_parallel_ops.sequence_columns: ({"all_gather": 1}, {"all_gather": 1, "reduce_scatter": 1}),
}


def _carries_gradient(pipe: Any) -> set[torch.fx.Node]:
    """Nodes of the stage's graph computed from a parameter or a stage input that requires grad."""
    stage = pipe.program.stages[pipe.stage_index]
    graph, module = pipe.module.graph, pipe.module
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    carrying = {node for node, name in zip(placeholders, stage.input_values, strict=True)
                if pipe.program.values[name].requires_grad}
    params = {name for name, _ in module.named_parameters()}
    for node in graph.nodes:
        if (node.op == "get_attr" and node.target in params
                or node.op == "call_module" and any(True for _ in module.get_submodule(node.target).parameters())
                or node.op in ("call_function", "call_method", "call_module")
                and any(arg in carrying for arg in node.all_input_nodes)):
            carrying.add(node)
    return carrying


def _implied_collectives(pipe: Any) -> dict[str, int]:
    """What the stage's generated collective nodes imply per step: their calls per micro-batch, times M."""
    implied: dict[str, int] = {}
    carrying = _carries_gradient(pipe)
    for node in pipe.module.graph.nodes:
        forward, backward = NODE_COLLECTIVES.get(node.target, ({}, {})) if node.op == "call_function" else ({}, {})
        for kind, count in [*forward.items(), *(backward.items() if backward and node.args[0] in carrying else ())]:
            implied[kind] = implied.get(kind, 0) + count * NUM_MICROBATCHES
    if isinstance(pipe.driver.runner.loss_fn, VocabParallelLoss):  # per micro-batch: the row maxima, then the sums
        # of exponentials and the target logits (compile_parallel_loss)
        implied["all_gather"] = implied.get("all_gather", 0) + NUM_MICROBATCHES
        implied["all_reduce"] = implied.get("all_reduce", 0) + 2 * NUM_MICROBATCHES
    return implied


# load T=2's checkpoint at T = 1, save, load at T = 2
LOAD_LAYOUTS: tuple[tuple[tuple[int, int], ...], ...] = (((2, 1), (2, 1)), ((2, 2),))


def _plans() -> dict[str, Plan]:
    """Every CASE's plan and the load layouts' (``load <layout>``), made once in the parent: the same on every rank."""
    plans = {name: _plan(model, layout, schedule) for name, model, layout, schedule, *_ in CASES}
    return {**plans, **{f"load {layout}": _plan("attention", layout) for layout in LOAD_LAYOUTS}}


def _references() -> dict[str, dict[str, Any]]:
    """One process's clipped training of each model the cases use (its trained model too: :func:`_inference`)."""
    return {model: _reference(model) for model in sorted({case[1] for case in CASES})}


def _run(rank: int, world_size: int, store_dir: str, directory: str, plans: dict[str, Plan],
         references: dict[str, dict[str, Any]]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for index, (name, model, _, schedule, sharding, compiled) in enumerate(CASES):
        started = time.perf_counter()
        with _world(store_dir, f"case-{index}", rank, world_size):
            pipe = _compile(model, plans[name], sharding, compiled, name.endswith(" SP"))
            record = _train(pipe, model, references[model])
            problems = record["problems"] + _share_problems(pipe)
            problems += [] if compiled else _inference(pipe, model, references[model])  # new shapes would recompile
            problems += _exported_matches(pipe, references[model])  # rank 0: every stage unsharded, trained weights
            split = compiled and schedule == "zero_bubble" and pipe.driver.tensor_parallel.degree > 1
            # collectives inside the compiled F/B/W graphs run as graph ops: the communicator counts none of them
            if record["collectives"] != _implied_collectives(pipe) and not split:
                problems.append(f"collectives per step {record['collectives']}, the layers imply "
                                f"{_implied_collectives(pipe)}")
            if index == 0:  # saved at T = 2 on stage 0, loaded below at T = 1 and back
                pipe.save(directory, optimizer=record["optimizer"], step=NUM_STEPS)
            results[name] = {"problems": problems, "stage": pipe.stage_index, "fsdp": pipe.driver.sharded is not None,
                             "degree": pipe.driver.tensor_parallel.degree, "collectives": record["collectives"],
                             "partial": sorted(n for n, p in pipe.driver.tp_params.items() if p.partial),
                             "frames": pipe.compile_stats()[rank].num_frames if compiled else 0,
                             "w_passes": pipe.compile_stats()[rank].num_weight_passes if compiled else 0,
                             "seconds": time.perf_counter() - started,
                             "sharded": sorted(n for n, p in pipe.driver.tp_params.items() if p.dim is not None)}
    trained = references["attention"]["params"]
    for index, layout in enumerate(LOAD_LAYOUTS):
        with _world(store_dir, f"load-{index}", rank, world_size):
            pipe = _compile("attention", plans[f"load {layout}"])
            optimizer = torch.optim.AdamW(pipe.parameters(), lr=LEARNING_RATE, eps=ADAM_EPS)
            pipe.load(directory, optimizer=optimizer)
            problems = mismatches(f"loaded {layout}", _whole_weights(pipe), trained, rtol=0.0, atol=1e-4)
            pipe.save(f"{directory}-{index}", optimizer=optimizer, step=NUM_STEPS)
            directory = f"{directory}-{index}"
            results[f"load {layout}"] = {"problems": problems}
    return results


@pytest.mark.multiprocess
def test_tensor_parallel_stages_train_like_one_process(tmp_path: Path) -> None:
    per_rank = run_ranks(_run, WORLD_SIZE, tmp_path, str(tmp_path / "checkpoint"), _plans(), _references(),
                         timeout_s=300.0)
    failures = []
    for rank, results in enumerate(per_rank):
        for name, record in results.items():
            failures += [f"{name} rank {rank}: {problem}" for problem in record["problems"][:3]]
    # the pass split what it should: stage 0's MLP pair on 1x2:2, the vocabulary head on 2:1x2
    attention = [results["attention 1x2:2"] for results in per_rank[:2]]
    assert all("blocks.0.down.weight" in record["sharded"] and record["stage"] == 0 for record in attention), attention
    assert all("head.weight" in results["vocab 2:1x2"]["sharded"] for results in per_rank[2:]), per_rank[2:]
    assert all(results["attention 2x2 ZeRO-2 SP"]["fsdp"] for results in per_rank)
    for name, *_ in CASES:  # every T=2 member holds split weights and its stage ran collectives
        split = [rank for rank, results in enumerate(per_rank) if results[name]["degree"] == 2]
        assert split and all(per_rank[rank][name]["sharded"] and per_rank[rank][name]["collectives"] for rank in split), (
            name, [(results[name]["sharded"][:3], results[name]["collectives"]) for results in per_rank])
    assert all(results["vocab 2:1x2 compiled"]["frames"] > 0 for results in per_rank)
    # the compiled T = 2 stage ran its W passes apart from B (exact: no failures above)
    assert all(results["vocab 2:1x2 compiled zero_bubble"]["w_passes"] > 0 for results in per_rank[2:]), per_rank[2:]
    for name in ("attention 2x2 ZeRO-2 SP", "llama 2x2 SP"):  # sequence-parallel norms: gradients partial over T
        assert all(results[name]["partial"] for results in per_rank), [results[name]["partial"] for results in per_rank]
    print({name: round(record.get("seconds", 0), 1) for name, record in per_rank[0].items()})
    assert not failures, "\n".join(failures)


def test_weights_tied_across_stages_of_different_degrees_are_refused_naming_them() -> None:
    plan = Plan(global_batch_size=8, num_microbatches=2,
                stages=(StagePlan(0, 0, 1, 1, (0, 1), tensor_parallel=2), StagePlan(1, 1, 2, 2, (2, 3))))
    with pytest.raises(PipelineSetupError, match=r"tied across stages \[0, 1\] .*\[2, 1\].*same T"):
        TensorParallelGroups.make(plan, 0, [(0, 1)])


def test_group_routes_pair_members_so_each_value_and_gradient_arrives_once() -> None:
    """1x2 -> 2 replicas of T=1 over 4 rows: each receiver replica takes its rows from member 0 (0 mod 2); backward,
    member 0 takes the gradient of rows 0-1 from rank 2 and rows 2-3 from rank 3, and so does member 1."""
    sender = StagePlan(0, 0, 1, 1, (0, 1), tensor_parallel=2)
    receiver = StagePlan(1, 1, 2, 2, (2, 3))
    activation, gradient = group_routes("h", True, 4, sender, receiver)
    assert [(r.sender_rank, r.receiver_rank, r.sender_rows, r.receiver_rows) for r in activation] == [
        (0, 2, (0, 2), (0, 2)),
        (0, 3, (2, 4), (0, 2))]
    assert [(r.sender_rank, r.receiver_rank, r.sender_rows) for r in gradient] == [
        (0, 2, (0, 2)), (1, 2, (0, 2)),
        (0, 3, (2, 4)), (1, 3, (2, 4))]
    # the other way (2 replicas of T=1 -> 1x2): both members take every row; only member 0's gradient goes back
    activation, gradient = group_routes("h", True, 4, receiver, sender)
    assert [(r.sender_rank, r.receiver_rank) for r in activation] == [(2, 0), (2, 1), (3, 0), (3, 1)]
    assert [(r.sender_rank, r.receiver_rank) for r in gradient] == [(2, 0), (3, 0)]


def test_fused_parameters_are_sliced_and_put_back_part_by_part() -> None:
    """GPT-2's fused q/k/v (parts 4, 4, 4 along dim 1): a member holds its half of each part, not a block."""
    full = torch.arange(3 * 12, dtype=torch.float32).reshape(3, 12)
    fused = TensorParallelParam("attn.c_attn.weight", 1, (3, 12), parts=(4, 4, 4))
    shards = [shard_slice(full, fused, 2, member) for member in range(2)]
    assert shards[0].tolist() == [row[0:2] + row[4:6] + row[8:10] for row in full.tolist()]
    assert torch.equal(assemble(shards, fused), full)
    plain = TensorParallelParam("mlp.up.weight", 0, (3, 12))
    assert torch.equal(assemble([shard_slice(full, plain, 3, member) for member in range(3)], plain), full)
    with pytest.raises(ValueError, match=r"has shape \(3, 12\) but the stage holds it as \(12, 3\)"):
        shard_slice(full, TensorParallelParam("w", 0, (12, 3)), 2, 0)


def test_a_weight_tied_across_stages_must_be_split_alike_on_every_owner() -> None:
    tie_groups = [("wte.weight", (0, 1))]
    # ranks 0, 1: stage 0 (T=2) split over the vocabulary; ranks 2, 3: stage 1 likewise, then whole; rank 4 owns none
    alike = [(0, {"wte.weight": (0, None)})] * 2 + [(1, {"wte.weight": (0, None)})] * 2 + [(2, {})]
    assert tied_split_differences(alike, tie_groups) == []
    whole = alike[:2] + [(1, {})] * 2 + [(2, {})]
    assert tied_split_differences(whole, tie_groups) == [("wte.weight", {0: (0, None), 1: (None, None)})]
