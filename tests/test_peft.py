"""PEFT LoRA on a tiny HF Llama (a forward(*args, **kwargs) wrapper): compiles from keyword inputs, trains only the
adapters exactly on hybrid layouts of 3 gloo ranks (frozen weights get no gradient and no allreduce), and its
checkpoint consolidates to weights PeftModel loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.core.cluster import parse_cluster
from fxpipe.core.plan import Plan
from fxpipe.passes import trace
from fxpipe.passes.trace_inputs import ExampleInputsTypeError
from fxpipe.passes.tracing import TraceError
from fxpipe.planning import costed_model, plan_chain
from tests.exactness_oracle import mismatches
from tests.mp_utils import join_world, leave_world, run_ranks

peft = pytest.importorskip("peft")
hf_examples = pytest.importorskip("fxpipe.hf_examples")

WORLD_SIZE = 3
GLOBAL_BATCH = 6
LAYOUTS = ("2:1", "1:2")
LEARNING_RATE = 1e-2
MAX_NORM = 0.1  # clipping as a fine-tuning loop does; below the adapters' gradient norm here, so it scales them
# rows and sequence length of each step: the example's, then a shorter sequence
STEP_SHAPES = ((GLOBAL_BATCH, 16), (GLOBAL_BATCH, 11), (GLOBAL_BATCH, 16))


def lora_llama() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The tiny HF Llama (3 layers) with LoRA adapters on the attention's q and v projections: only they train."""
    model, example_inputs = hf_examples.llama(num_layers=3)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                             init_lora_weights=False)  # B != 0: the adapters change the output from step 0
    return peft.get_peft_model(model, config), example_inputs


def _batches() -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    batches = []
    for step, (rows, seq) in enumerate(STEP_SHAPES):
        inputs, targets = hf_examples.make_batch("llama", rows, 200 + step)
        batches.append(({"input_ids": inputs["input_ids"][:, :seq]}, targets[:, :seq].contiguous()))
    return batches


def _trainable(module: Any) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]


def _reference(batches: list[Any]) -> dict[str, Any]:
    """One process, whole batch, clipping and AdamW over the parameters that require grad: losses, norms, grads, weights."""
    model, _ = lora_llama()
    optimizer = torch.optim.AdamW([p for _, p in _trainable(model)], lr=LEARNING_RATE)
    losses, grads, norms = [], [], []
    for inputs, targets in batches:
        loss = hf_examples.hf_loss(model(**inputs, use_cache=False), targets)
        loss.backward()
        losses.append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_([p for _, p in _trainable(model)], MAX_NORM)))
        grads.append({name: p.grad.clone() for name, p in _trainable(model)})
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "grads": grads, "norms": norms, "params": {k: p.detach().clone() for k, p in model.named_parameters()}}


def _train(plan: Plan, batches: list[Any], reference: dict[str, Any], save_to: str | None) -> dict[str, Any]:
    model, example_inputs = lora_llama()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    pipe = fxpipe.compile(model, example_inputs, loss_fn=hf_examples.hf_loss, global_batch_size=GLOBAL_BATCH,
                          plan=plan)
    optimizer = torch.optim.AdamW([p for p in pipe.parameters() if p.requires_grad], lr=LEARNING_RATE)
    losses, problems = [], []
    for step, (inputs, targets) in enumerate(batches):
        losses.append(pipe.step(inputs, targets))
        norm = float(pipe.clip_grad_norm_(MAX_NORM))  # the adapters' norm: frozen weights have no gradient
        if abs(norm - reference["norms"][step]) > 1e-4 * reference["norms"][step]:
            problems.append(f"step {step}: gradient norm {norm} != {reference['norms'][step]}")
        grads = {name: p.grad for name, p in _trainable(pipe)}
        tolerance = {"rtol": 1e-4, "atol": 1e-6} if step == 0 else {"rtol": 1e-3, "atol": 1e-6, "atol_of_largest": 1e-3}
        problems += mismatches(f"step {step} grad", grads, reference["grads"][step], **tolerance)
        # a frozen weight gets no gradient, not even zeros from a replica allreduce
        problems += [f"step {step}: frozen {name} has a gradient" for name, p in pipe.named_parameters()
                     if not p.requires_grad and p.grad is not None]
        optimizer.step()
        optimizer.zero_grad()
    params = {name: p.detach() for name, p in pipe.named_parameters()}
    problems += mismatches("param", params, reference["params"], rtol=0.0, atol=1e-4)
    problems += [f"frozen {name} changed" for name, p in pipe.named_parameters()
                 if not p.requires_grad and not torch.equal(p.detach(), initial[name])]
    if save_to is not None:
        pipe.save(save_to, step=len(batches))
    return {"losses": losses, "problems": problems, "trainable": sorted(name for name, _ in _trainable(pipe)),
            "held": sorted(params)}


def _all_layouts(rank: int, world_size: int, store_dir: str, plans: list[Plan], save_to: str) -> list[dict[str, Any]]:
    batches = _batches()
    reference = _reference(batches)
    records = []
    for index, plan in enumerate(plans):
        join_world(store_dir, f"peft-{index}", rank, world_size)
        try:
            records.append({**_train(plan, batches, reference, save_to if index == 0 else None),
                            "reference_losses": reference["losses"]})
        finally:
            leave_world()
    return records


@pytest.mark.multiprocess
def test_lora_llama_trains_only_the_adapters_exactly_and_consolidates_for_peft(tmp_path: Path) -> None:
    model, example_inputs = lora_llama()
    cluster = parse_cluster(f"local:{WORLD_SIZE}")
    chain = costed_model(model, example_inputs, cluster).chain
    plans = [plan_chain(chain, cluster, GLOBAL_BATCH, layout=layout) for layout in LAYOUTS]
    assert [plan.layout for plan in plans] == list(LAYOUTS)
    checkpoint = tmp_path / "checkpoint"
    per_rank = run_ranks(_all_layouts, WORLD_SIZE, tmp_path, plans, str(checkpoint), timeout_s=400.0)
    adapters = sorted(name for name, _ in _trainable(model))
    assert adapters and all(".lora_" in name for name in adapters)
    failures = []
    for index, layout in enumerate(LAYOUTS):
        records = [records[index] for records in per_rank]
        failures += [f"{layout}: {p}" for r in records for p in r["problems"]]
        if len({tuple(r["losses"]) for r in records}) != 1:
            failures.append(f"{layout}: ranks report different losses")
        if not torch.allclose(torch.tensor(records[0]["losses"]), torch.tensor(records[0]["reference_losses"]),
                              rtol=1e-5, atol=1e-6):
            failures.append(f"{layout}: losses {records[0]['losses']} != {records[0]['reference_losses']}")
        if sorted({name for r in records for name in r["trainable"]}) != adapters:
            failures.append(f"{layout}: the ranks' trainable parameters are not the adapters")
        if sorted({name for r in records for name in r["held"]}) != sorted(dict(model.named_parameters())):
            failures.append(f"{layout}: the ranks do not hold the model's parameters together")
    assert not failures, "\n".join(failures)
    _check_consolidated_loads_into_peft(checkpoint, tmp_path)


def _check_consolidated_loads_into_peft(checkpoint: Path, tmp_path: Path) -> None:
    """fxpipe.consolidate -> PeftModel.load_state_dict (strict) -> save_pretrained -> PeftModel.from_pretrained."""
    consolidated = fxpipe.consolidate(checkpoint)
    trained = _reference(_batches())["params"]
    fresh, _ = lora_llama()
    assert sorted(consolidated) == sorted(fresh.state_dict())
    fresh.load_state_dict(consolidated, strict=True)
    assert not mismatches("consolidated", dict(fresh.named_parameters()), trained, rtol=0.0, atol=1e-4)
    fresh.save_pretrained(tmp_path / "adapter")  # PEFT's own format: the adapters alone
    base, _ = hf_examples.llama(num_layers=3)
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    adapters = {name: p for name, p in loaded.named_parameters() if ".lora_" in name}
    assert adapters and not mismatches("from_pretrained", adapters, trained, rtol=0.0, atol=1e-4)


class _Holder(nn.Module):
    """A wrapper whose forward(*args, **kwargs) hides the names and that fxpipe cannot see through (two children)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.scale = nn.Linear(1, 1)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)


def test_a_wrapper_traces_through_to_the_wrapped_signature_or_says_what_to_pass() -> None:
    model, example_inputs = lora_llama()
    gm = trace(model, example_inputs)  # PeftModel -get_base_model()-> LlamaForCausalLM
    assert gm.meta["fxpipe.frontend"] == "export" and gm.meta["fxpipe.input_names"] == ("input_ids",)
    assert "forward" not in model.__dict__  # the temporary named forward is gone
    wider = torch.cat([example_inputs["input_ids"]] * 2)[:, :9]  # another batch and length: one program
    torch.testing.assert_close(gm(wider)["logits"], model(input_ids=wider, use_cache=False).logits, rtol=0, atol=0)
    positional = trace(model, (example_inputs["input_ids"],))  # positional values bind to the wrapped names
    assert positional.meta["fxpipe.input_names"] == ("input_ids",)
    with pytest.raises(TraceError, match=r"frontend='fx' cannot trace inputs \['input_ids'\].*PeftModel "
                                         r"-get_base_model\(\)-> LlamaForCausalLM"):
        trace(model, example_inputs, frontend="fx")
    with pytest.raises(ExampleInputsTypeError, match=r"key 'input_idz'.*through PeftModel -get_base_model"):
        trace(model, {"input_idz": example_inputs["input_ids"]})
    with pytest.raises(ExampleInputsTypeError, match=r"_Holder.forward takes \*\*kwargs.*found no module.*Fix: "
                                                     r"compile the wrapped model itself"):
        trace(_Holder(model), example_inputs)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        return self.body(x) * scale


class _Passes(nn.Module):
    """forward(*args, **kwargs) around its only child: the names are the child's."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _Net()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs) + 1


def test_a_sole_child_wrapper_traces_with_the_childs_names_and_defaults() -> None:
    model, x = _Passes(), torch.randn(3, 4)
    gm = trace(model, {"x": x})
    assert gm.meta["fxpipe.frontend"] == "export" and gm.meta["fxpipe.input_names"] == ("x",)
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)  # the child's default scale=2.0 applies
    assert list(gm.meta["fxpipe.param_names"].values()) == ["inner.body.weight", "inner.body.bias"]
