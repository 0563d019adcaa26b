"""The loss in the cost model: costed from loss_fn on fake outputs (or the estimate), on the last block, in fit checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxpipe import models as zoo
from fxpipe import passes
from fxpipe.core import meta
from fxpipe.core.chain import Block, CostChain, build_chain
from fxpipe.core.cluster import Cluster, DeviceSpec, LinkSpec
from fxpipe.core.costgraph import Affine
from fxpipe.core.planfile import chain_from_json, chain_to_json
from fxpipe.passes.costs import BATCH
from fxpipe.passes.losscost import ESTIMATE
from fxpipe.passes.partition.dapple import partition
from fxpipe.passes.partition.request import PlanningError
from fxpipe.sim.stagecost import activation_peak_bytes, stage_cost, stage_memory_bytes

VOCAB, WIDTH, SEQ = 512, 16, 8


class TinyLM(nn.Module):
    """idx (B, T) -> logits (B, T, VOCAB): the logits dwarf everything else, as in a vocabulary-heavy LM."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(idx))


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _annotated(**loss: object) -> torch.fx.GraphModule:
    idx = torch.zeros(4, SEQ, dtype=torch.int64)
    return passes.annotate_costs(passes.trace(TinyLM(), (idx,)), **loss)  # type: ignore[arg-type]


LOGITS_PER_ROW = SEQ * VOCAB * 4  # float32 logits of one row
TARGETS_PER_ROW = SEQ * 8  # int64 token ids of one row


def test_loss_fn_on_fake_outputs_saves_log_softmax_and_targets() -> None:
    gm = _annotated(loss_fn=_lm_loss)  # targets guessed: class ids, the logits' shape less the vocabulary
    cost = gm.meta[meta.LOSS_COST]
    assert gm.meta[meta.LOSS_SOURCE] == "loss_fn"
    assert cost.saved_bytes.coeff(BATCH) == LOGITS_PER_ROW + TARGETS_PER_ROW
    assert gm.meta[meta.TARGET_SAVED_BYTES] == TARGETS_PER_ROW * BATCH
    assert gm.meta[meta.INPUT_SAVED_BYTES] == TARGETS_PER_ROW * BATCH  # the embedding saves the token ids
    assert sympy_positive(cost.forward_flops) and sympy_positive(cost.backward_flops)
    given = _annotated(loss_fn=_lm_loss, example_targets=torch.zeros(4, SEQ, dtype=torch.int64))
    assert given.meta[meta.LOSS_COST] == cost


def sympy_positive(expr: object) -> bool:
    return float(expr.subs(BATCH, 1)) > 0  # type: ignore[attr-defined]


def test_without_loss_fn_the_documented_estimate_saves_the_output() -> None:
    gm = _annotated()
    assert gm.meta[meta.LOSS_SOURCE] == ESTIMATE
    assert gm.meta[meta.LOSS_COST].saved_bytes == LOGITS_PER_ROW * BATCH


def test_a_loss_fn_that_fails_on_fakes_falls_back_to_the_estimate_and_says_why() -> None:
    def broken(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise ValueError("no fakes here")

    assert "no guessed targets" in _annotated(loss_fn=broken).meta[meta.LOSS_SOURCE]  # every guess failed
    gm = _annotated(loss_fn=broken, example_targets=torch.zeros(4, SEQ, dtype=torch.int64))
    assert gm.meta[meta.LOSS_SOURCE].startswith("estimate (loss_fn failed") and "no fakes here" in \
        gm.meta[meta.LOSS_SOURCE]
    assert gm.meta[meta.LOSS_COST].saved_bytes == LOGITS_PER_ROW * BATCH


def test_the_loss_cost_lands_on_the_last_block_only() -> None:
    graph = passes.to_cost_graph(_annotated(loss_fn=_lm_loss))
    assert graph.loss is not None and graph.loss.op == "loss:loss_fn"
    without = build_chain(graph.__class__(graph.nodes, graph.source, graph.input_bytes), max_blocks=None)
    chain = build_chain(graph, max_blocks=None)
    loss_saved = Affine(4.0, LOGITS_PER_ROW + TARGETS_PER_ROW)
    assert chain.loss_saved_bytes == loss_saved
    assert chain.blocks[-1].saved_bytes == without.blocks[-1].saved_bytes + loss_saved
    assert chain.blocks[:-1] == without.blocks[:-1]
    assert all("loss" not in block.node_names for block in chain.blocks)  # no fx node: codegen never sees it
    assert chain.output_bytes == without.output_bytes  # still what the model hands to the loss
    again = chain_from_json(chain_to_json(chain))
    assert (again.loss_saved_bytes, again.input_saved_bytes, again.target_saved_bytes) == \
        (chain.loss_saved_bytes, chain.input_saved_bytes, chain.target_saved_bytes)


def test_zoo_lm_plans_count_the_loss_on_the_last_stage() -> None:
    from fxpipe.planning import costed_model, model_loss

    model, example_inputs = zoo.build("gpt-mini", device="meta")
    cluster = _cluster(2**40)
    loss = model_loss("gpt-mini", example_inputs)
    chain = costed_model(model, example_inputs, cluster, loss_fn=loss["loss_fn"],
                         example_targets=loss["example_targets"]).chain
    estimate = costed_model(model, example_inputs, cluster).chain
    logits = chain.output_bytes.per_sample
    assert chain.loss_saved_bytes.per_sample >= logits  # log-softmax of the logits at least
    assert estimate.loss_saved_bytes.per_sample == logits


def _cluster(memory_bytes: int) -> Cluster:
    device = DeviceSpec("test", memory_bytes, (("float32", 1e12),), 1e12)
    return Cluster("test-1x2", 1, 2, device, LinkSpec(1e10), LinkSpec(1e10))


def _two_block_chain(loss_per_row: float) -> CostChain:
    blocks = (Block("a", ("a",), Affine(0, 1e-3), Affine(0, 2e-3), 1000, Affine(0, 100)),
              Block("b", ("b",), Affine(0, 1e-3), Affine(0, 2e-3), 1000, Affine(0, 100 + loss_per_row)))
    return CostChain(blocks, (Affine(0, 10),), loss_saved_bytes=Affine(0, loss_per_row))


def test_fit_checks_count_the_loss() -> None:
    light, heavy = _two_block_chain(0.0), _two_block_chain(1e6)
    last_light, last_heavy = stage_cost(light, 1, 2, 8, 1), stage_cost(heavy, 1, 2, 8, 1)
    assert stage_memory_bytes(last_heavy, 1) - stage_memory_bytes(last_light, 1) == 8 * 1e6
    # recomputing the last stage does not drop the loss's saved tensors (the loss runs outside the checkpoint)
    assert stage_memory_bytes(last_heavy, 2, recompute=True) - stage_memory_bytes(last_light, 2, recompute=True) \
        == 2 * 8 * 1e6
    assert activation_peak_bytes(last_heavy, 1, 4) == 8 * (100 + 1e6)
    limit = 10**5  # room for the light chain's stages (a few KB each), not for 4 rows of the loss's 1 MB
    assert partition(light, _cluster(limit), 8, layout="1:1", num_microbatches=2).num_stages == 2
    with pytest.raises(PlanningError, match="memory|fit"):
        partition(heavy, _cluster(limit), 8, layout="1:1", num_microbatches=2)
