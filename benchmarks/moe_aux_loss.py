"""HF Mixtral (MoE, built from a tiny config) on hybrid layouts: the loss and gradients of one step against one process,
with and without the router's load-balancing loss.

Run: python benchmarks/moe_aux_loss.py

Three gloo ranks on this machine's CPUs run layouts ``2:1`` and ``1:2`` with 2 micro-batches on a global batch of 8
sequences of 16 tokens. The load-balancing loss is computed over the tokens the model sees in one call; under a
pipeline that is one micro-batch slice, so fxpipe's loss is the row-weighted mean of per-slice losses. The table
compares it with one process on the whole batch (what ``model(batch)`` gives) and with one process on the same
slices (what fxpipe computes, exactly). tests/test_moe_aux_loss.py checks the same figures.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import fxpipe  # noqa: E402
from fxpipe.hf_examples import hf_loss  # noqa: E402

WORLD_SIZE = 3
GLOBAL_BATCH = 8
SEQ_LEN = 16
NUM_MICROBATCHES = 2
LAYOUTS = ("2:1", "1:2")
# the rows of each loss slice: micro-batches of 4 rows, then split over the last stage's replicas
SLICE_ROWS = {"2:1": (4, 4), "1:2": (2, 2, 2, 2)}


def mixtral() -> nn.Module:
    """A 2-layer MixtralForCausalLM: 4 experts, top-2 routing, no router jitter, router logits returned."""
    import transformers

    config = transformers.MixtralConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                        num_attention_heads=2, num_key_value_heads=1, vocab_size=100,
                                        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
                                        output_router_logits=True, router_jitter_noise=0.0)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config).train()


def lm_loss(output: Mapping[str, Any], targets: torch.Tensor) -> torch.Tensor:
    return hf_loss(output, targets)


def lm_and_balance_loss(output: Mapping[str, Any], targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy plus the router's load-balancing loss at Mixtral's default weight (router_aux_loss_coef 0.001)."""
    return hf_loss(output, targets) + 0.001 * output["aux_loss"]


LOSSES: dict[str, Callable[[Mapping[str, Any], torch.Tensor], torch.Tensor]] = {
    "lm": lm_loss, "lm+balance": lm_and_balance_loss}


def batch() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 100, (GLOBAL_BATCH, SEQ_LEN + 1), generator=generator)
    return {"input_ids": tokens[:, :-1]}, tokens[:, 1:]


def one_process(loss_fn: Callable[..., torch.Tensor], slice_rows: tuple[int, ...] | None) -> dict[str, Any]:
    """Loss and gradients of one process on the whole batch (``slice_rows`` None) or on these row slices, each
    weighted by its rows (what a pipeline computes)."""
    model = mixtral()
    inputs, targets = batch()
    bounds = [0, *torch.tensor(slice_rows or (GLOBAL_BATCH,)).cumsum(0).tolist()]
    total = torch.zeros(())
    for start, stop in zip(bounds, bounds[1:], strict=False):
        output = model(input_ids=inputs["input_ids"][start:stop], use_cache=False)
        total = total + loss_fn(output, targets[start:stop]) * (stop - start) / GLOBAL_BATCH
    total.backward()
    return {"loss": total.item(), "grads": {name: p.grad.clone() for name, p in model.named_parameters()}}


def relative_errors(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """{parameter: max |actual - expected| relative to that tensor's largest |expected|}."""
    return {name: float((actual[name] - expected[name]).abs().max() / expected[name].abs().max().clamp_min(1e-30))
            for name in actual}


class ChosenLoss:
    """A loss_fn for ``fxpipe.compile`` that computes ``LOSSES[self.name]``: one pipeline steps under each loss."""

    def __init__(self) -> None:
        self.name = "lm"

    def __call__(self, output: Mapping[str, Any], targets: torch.Tensor) -> torch.Tensor:
        return LOSSES[self.name](output, targets)


def pipelined(layout: str) -> dict[str, dict[str, Any]]:
    """One ``pipe.step`` per loss from the same weights on this rank (all ranks call it): loss and this rank's grads."""
    inputs, targets = batch()
    loss_fn = ChosenLoss()
    pipe = fxpipe.compile(mixtral(), inputs, loss_fn=loss_fn, global_batch_size=GLOBAL_BATCH, plan=layout,
                          num_microbatches=NUM_MICROBATCHES)
    results = {}
    try:
        for name in LOSSES:  # no optimizer step: each loss starts from the same weights
            loss_fn.name = name
            loss = pipe.step(inputs, targets)
            results[name] = {"loss": loss, "grads": {key: p.grad.clone() for key, p in pipe.named_parameters()}}
            for param in pipe.parameters():
                param.grad = None
    finally:
        pipe.close()
    return results


def compare(layout: str) -> list[dict[str, Any]]:
    """This rank's figures for ``layout``, per loss: fxpipe vs one process on the whole batch and on the same slices."""
    figures = []
    for name, result in pipelined(layout).items():
        whole, sliced = one_process(LOSSES[name], None), one_process(LOSSES[name], SLICE_ROWS[layout])
        figures.append({"layout": layout, "loss_name": name, "fxpipe": result["loss"], "whole": whole["loss"],
                        "sliced": sliced["loss"], "grad_vs_whole": relative_errors(result["grads"], whole["grads"]),
                        "grad_vs_sliced": relative_errors(result["grads"], sliced["grads"])})
    return figures


def rank_main(rank: int, world_size: int, store_dir: str, layouts: tuple[str, ...] = LAYOUTS) -> list[dict[str, Any]]:
    """Every layout in turn, each in a fresh default group of ``world_size`` ranks; one record per (layout, loss)."""
    from tests.mp_utils import run_scenarios

    cases = {layout: (lambda layout=layout: compare(layout)) for layout in layouts}
    return [record for records in run_scenarios(cases, rank, world_size, store_dir, "moe").values()
            for record in records]


def main() -> None:
    import tempfile

    from tabulate import tabulate

    from tests.mp_utils import run_ranks

    with tempfile.TemporaryDirectory() as store_dir:
        per_rank = run_ranks(rank_main, WORLD_SIZE, store_dir, timeout_s=900.0)
    rows = []
    for index, case in enumerate(per_rank[0]):
        grads_whole = max(max(records[index]["grad_vs_whole"].values()) for records in per_rank)
        grads_sliced = max(max(records[index]["grad_vs_sliced"].values()) for records in per_rank)
        worst = max(((error, name) for records in per_rank for name, error in records[index]["grad_vs_whole"].items()))
        rows.append([case["layout"], case["loss_name"], f"{case['fxpipe']:.8f}", f"{case['whole']:.8f}",
                     f"{case['sliced']:.8f}", f"{(case['fxpipe'] - case['whole']) / case['whole']:+.1e}",
                     f"{grads_whole:.1e} ({worst[1]})", f"{grads_sliced:.1e}"])
    print(tabulate(rows, disable_numparse=True,
                   headers=["layout", "loss", "fxpipe", "1 process, whole batch", "1 process, same slices",
                            "loss rel. diff vs whole", "grad err vs whole", "grad err vs slices"]))
    print("grad err: max over parameters of max |fxpipe - reference| / max |reference| (every rank's parameters)")


if __name__ == "__main__":
    main()
