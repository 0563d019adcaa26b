"""Hugging Face transformers models (tiny configs, built offline) compile, plan and train exactly on 4 gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import fx, nn

import fxpipe
from fxpipe.cli import main as cli_main
from fxpipe.core.chain import build_chain
from fxpipe.core.cluster import parse_cluster
from fxpipe.core.plan import Plan
from fxpipe.passes import annotate_costs, to_cost_graph, trace
from fxpipe.passes.codegen import CodegenError, split_stages
from fxpipe.passes.costs import CostAnnotationError
from fxpipe.planning import costed_model, plan_chain
from tests.exactness_oracle import coverage_problems, mismatches, train_and_compare, train_reference
from tests.mp_utils import join_world, leave_world, run_ranks

transformers = pytest.importorskip("transformers")
hf_examples = pytest.importorskip("fxpipe.hf_examples")

WORLD_SIZE = 4
GLOBAL_BATCH = 8
NUM_STEPS = 3
# Attention key biases get exactly zero gradient in exact arithmetic (softmax ignores a shift), so their
# gradients are rounding noise that Adam would scale up to full lr steps; a larger eps keeps noise small.
ADAM_EPS = 1e-5
# each model trains under the planner's own layout and two fixed ones; every fixed layout runs for two
# models (a torch.export trace per rank per layout is most of this file's time)
LAYOUTS = {"gpt2": ("2:1:1", "1:1:1:1", "auto"), "bert-mlm": ("1:3", "2:2", "auto"),
           "llama": ("2:1:1", "2:2", "auto"), "vit": ("1:3", "1:1:1:1", "auto")}


# rows and sequence length of each step: the example's, a shorter sequence, a short last batch (no recompiling)
STEP_SHAPES = ((GLOBAL_BATCH, 16), (GLOBAL_BATCH, 11), (GLOBAL_BATCH - 3, 16))


def _batches(name: str) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    batches = []
    for step, (rows, seq) in enumerate(STEP_SHAPES):
        inputs, targets = hf_examples.make_batch(name, rows, 100 + step)
        if name != "vit":  # the image models' patch grid is fixed; the text models take any length
            inputs = {key: value[:, :seq].contiguous() for key, value in inputs.items()}
            targets = targets[:, :seq].contiguous()
        batches.append((inputs, targets))
    return batches


def _reference(name: str, batches: list[Any]) -> dict[str, Any]:
    """One process, whole batch: step-1 gradients, losses, parameters after NUM_STEPS AdamW steps."""
    return train_reference(hf_examples.HF_FACTORIES[name]()[0], hf_examples.hf_loss, batches, adam_eps=ADAM_EPS)


def _train(name: str, plan: Plan, batches: list[Any], reference: dict[str, Any]) -> dict[str, Any]:
    model, example_inputs = hf_examples.HF_FACTORIES[name]()
    pipe = fxpipe.compile(model, example_inputs, loss_fn=hf_examples.hf_loss, global_batch_size=GLOBAL_BATCH,
                          plan=plan)
    return {"plan": pipe.plan.layout, **train_and_compare(pipe, batches, reference, adam_eps=ADAM_EPS)}


def _plans(name: str) -> list[Plan]:
    """The plan of every layout, as compile(plan=layout) makes it on rank 0, from one costed chain."""
    model, example_inputs = hf_examples.HF_FACTORIES[name]()
    cluster = parse_cluster(f"local:{WORLD_SIZE}")
    chain = costed_model(model, example_inputs, cluster).chain
    return [plan_chain(chain, cluster, GLOBAL_BATCH, layout=None if layout == "auto" else layout)
            for layout in LAYOUTS[name]]


HF_NAMES = ("gpt2", "bert-mlm", "llama", "vit")


def _train_all_models(rank: int, world_size: int, store_dir: str,
                      work: dict[str, tuple[list[Plan], dict[str, Any]]]) -> dict[str, list[dict[str, Any] | None]]:
    """Every model's layouts, one fresh group each, in this one world of ranks; records by model."""
    return {name: _train_all_layouts(rank, store_dir, name, plans, reference)
            for name, (plans, reference) in work.items()}


def _train_all_layouts(rank: int, store_dir: str, name: str, plans: list[Plan],
                       reference: dict[str, Any]) -> list[dict[str, Any] | None]:
    batches = _batches(name)
    records: list[dict[str, Any] | None] = []
    for index, plan in enumerate(plans):
        if rank >= plan.world_size:
            records.append(None)  # "auto" may use fewer ranks; this one sits it out
            continue
        join_world(store_dir, f"{name}-{index}", rank, plan.world_size)
        try:
            record = _train(name, plan, batches, reference)
        finally:
            leave_world()
        records.append({**record, "reference_losses": reference["losses"], "all_names": sorted(reference["params"])})
    return records


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], dict[str, list[Plan]]]:
    """One world of WORLD_SIZE ranks trains every model under every layout: records by rank, and the plans.

    Plans and references are made once, here (the reference without its model: the ranks need only its numbers).
    """
    plans = {name: _plans(name) for name in HF_NAMES}
    references = {name: {key: value for key, value in _reference(name, _batches(name)).items() if key != "model"}
                  for name in HF_NAMES}
    work = {name: (plans[name], references[name]) for name in HF_NAMES}
    return run_ranks(_train_all_models, WORLD_SIZE, tmp_path_factory.mktemp("hf"), work, timeout_s=1200.0), plans


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", HF_NAMES)
def test_hf_model_trains_like_one_process_on_hybrid_layouts(
        name: str, per_rank: tuple[list[dict[str, Any]], dict[str, list[Plan]]]) -> None:
    all_records, plans = per_rank
    assert [plan.layout for plan in plans[name][:-1]] == list(LAYOUTS[name][:-1])
    failures = []
    for index, layout in enumerate(LAYOUTS[name]):
        records = [by_model[name][index] for by_model in all_records if by_model[name][index] is not None]
        problems = [p for r in records for p in r["problems"]]
        if problems:
            failures.append(f"{name} {layout}: {problems[:4]}")
        if len({tuple(r["losses"]) for r in records}) != 1:
            failures.append(f"{name} {layout}: ranks report different losses")
        if not torch.allclose(torch.tensor(records[0]["losses"]), torch.tensor(records[0]["reference_losses"]),
                              rtol=1e-5, atol=1e-6):
            failures.append(f"{name} {layout}: losses {records[0]['losses']} != {records[0]['reference_losses']}")
        failures += [f"{name} {layout}: {p}"
                     for p in coverage_problems([r["names"] for r in records], records[0]["all_names"])]
    assert not failures, "\n".join(failures)


def _symbolic_scalars(gm: fx.GraphModule) -> list[fx.Node]:
    return [node for node in gm.graph.nodes
            if node.op == "call_function" and isinstance(node.meta.get("val"), torch.SymInt | torch.SymFloat)]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hf_model_traces_with_a_symbolic_batch_and_costs_exactly(name: str) -> None:
    model, example_inputs = hf_examples.HF_FACTORIES[name]()
    gm = trace(model, example_inputs)
    assert gm.meta["fxpipe.frontend"] == "export" and gm.meta["fxpipe.symbolic_batch"]
    wider = {key: torch.cat([value, value]) for key, value in example_inputs.items()}  # another batch size
    output = gm(*wider.values())
    assert isinstance(output, dict)  # a ModelOutput comes back as a plain dict
    torch.testing.assert_close(output["logits"], model(**wider)["logits"], rtol=0, atol=0)
    order = {node: index for index, node in enumerate(gm.graph.nodes)}
    for node in _symbolic_scalars(gm):  # each size sits right before its readers, so no cut separates them
        for user in node.users:
            between = list(gm.graph.nodes)[order[node] + 1:order[user]]
            assert all(other in _symbolic_scalars(gm) for other in between), (node.name, user.name)
    annotated = annotate_costs(gm)
    assert annotated.meta["fxpipe.cost_mode"] == "symbolic"


def test_planner_and_codegen_never_send_batch_times_sequence_rows() -> None:
    model, example_inputs = hf_examples.gpt2()
    gm = trace(model, example_inputs)
    graph = to_cost_graph(annotate_costs(gm))
    flattened = {node.name for node in graph.nodes if node.op.endswith(":addmm.default")}
    assert flattened and not any(node.tensor_output for node in graph.nodes if node.name in flattened)
    chain = build_chain(graph, max_blocks=None)
    position = {node.name: index for index, node in enumerate(graph.nodes)}
    readers = {node.name: max([position[user.name] for user in graph.nodes if node.name in user.inputs],
                              default=position[node.name]) for node in graph.nodes}
    ends = [position[block.node_names[-1]] for block in chain.blocks[:-1]]
    crossing = {name for name in flattened for end in ends if position[name] <= end < readers[name]}
    assert len(chain.blocks) > 10 and not crossing
    addmm = next(node for node in gm.graph.nodes if node.target is torch.ops.aten.addmm.default)
    names = [node.name for node in gm.graph.nodes if node.op not in ("placeholder", "output", "get_attr")]
    cut = names.index(addmm.name) + 1
    with pytest.raises(CodegenError, match=rf"{addmm.name}.*grows with the batch but no single dim holds it"):
        split_stages(gm, [names[:cut], names[cut:]])


class _HardCodedBatch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(4, 16) * 2  # only batch 4 fits


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 16)
        self.head = _HardCodedBatch()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def test_cost_error_names_the_node_op_and_module_that_fixed_the_batch() -> None:
    gm = trace(_Net(), (torch.randn(4, 16),), frontend="export")
    assert gm.meta["fxpipe.symbolic_batch"] is False  # export refused the symbolic batch: static fallback
    with pytest.raises(CostAnnotationError, match=r"node 'reshape' \(op reshape.default, module head\)"
                       r".*specialised the batch to 4.*at batch 8.*fails"):
        annotate_costs(gm)


def test_fxpipe_plan_accepts_a_hugging_face_factory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert cli_main(["plan", "fxpipe.hf_examples:gpt2", "--cluster", "local:4", "--global-batch", "8",
                     "--layout", "2:1:1", "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert [stage["replicas"] for stage in plan["stages"]] == [2, 1, 1]
    assert "plan 2:1:1" in capsys.readouterr().out


class _LogitsOnly(nn.Module):
    """The issue's reproduction: a GPT-2 wrapped to return ``.logits`` with ``use_cache=False``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def test_wrapped_gpt2_compiles_and_steps_exactly_in_a_world_of_one() -> None:
    model = _LogitsOnly(hf_examples.gpt2()[0])
    reference = _LogitsOnly(hf_examples.gpt2()[0])
    inputs, targets = hf_examples.make_batch("gpt2", 4, seed=7)

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return hf_examples.hf_loss({"logits": output}, target)

    pipe = fxpipe.compile(model, (inputs["input_ids"],), loss_fn=loss_fn, global_batch_size=4, plan="dp")
    try:
        loss = pipe.step((inputs["input_ids"],), targets)
    finally:
        pipe.close()
    expected = loss_fn(reference(inputs["input_ids"]), targets)
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-6)
    grads = {key: p.grad for key, p in reference.named_parameters()}
    assert not mismatches("grad", {key: p.grad for key, p in pipe.named_parameters()}, grads, rtol=1e-4, atol=1e-6)
