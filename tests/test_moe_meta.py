"""HF Mixtral (MoE) planned at the sizes people plan: costed on the meta device and under bf16 autocast.

Two things stopped it. On the meta device transformers' expert dispatch takes its GPU branch, an int32
``torch.histc``, which torch's Meta kernel refuses on fxpipe's CPU fakes (fxpipe/passes/meta_kernels.py). Under
autocast, torch.export's ``_assert_tensor_metadata`` guard on the router's logits (float32 when traced, bfloat16 under
autocast, before a ``.float()``) failed; the export front end keeps those guards asserting nothing, and the
conversions.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fxpipe import passes
from fxpipe.core.cluster import parse_cluster
from fxpipe.passes.meta_kernels import OVERRIDDEN
from fxpipe.planning import costed_model

transformers = pytest.importorskip("transformers")


def _mixtral(device: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    config = transformers.MixtralConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_local_experts=4,
                                        num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
                                        vocab_size=64, max_position_embeddings=16, router_jitter_noise=0.0)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.MixtralForCausalLM(config)
    inputs = {"input_ids": torch.randint(0, 64, (2, 16), device=device)}
    return model, inputs


def test_histc_has_a_shape_on_cpu_fakes_of_any_dtype() -> None:
    assert OVERRIDDEN == ("histc",)
    with FakeTensorMode():
        counts = torch.histc(torch.empty(10, dtype=torch.int32), bins=4, min=0, max=3)
    assert (counts.shape, counts.dtype) == (torch.Size([4]), torch.int32)
    with pytest.raises(RuntimeError, match="histogram_cpu"):  # real tensors keep torch's own kernel
        torch.histc(torch.zeros(10, dtype=torch.int32), bins=4, min=0, max=3)


@pytest.mark.parametrize("device", ["meta", "cpu"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_mixtral_costs_on_the_meta_device_and_under_bf16(device: str, precision: str) -> None:
    model, inputs = _mixtral(device)
    chain = costed_model(model, inputs, parse_cluster("2x8:h100"), costs="analytic", precision=precision).chain
    experts = [block for block in chain.blocks if block.param_bytes > 0]
    assert experts and sum(block.forward_s.at(2) for block in chain.blocks) > 0


def test_the_traced_graph_runs_under_autocast_as_the_model_does() -> None:
    """No metadata guard is left, the conversions stay, and under bf16 autocast the graph computes what the model
    computes under it (it raised an AssertionError at the router before)."""
    model, inputs = _mixtral("cpu")
    graph_module = passes.trace(model, inputs)
    calls = [node for node in graph_module.graph.nodes if node.op == "call_function"]
    guards = [node for node in calls if "_assert_tensor_metadata" in str(node.target)]
    assert guards and all(not node.kwargs and len(node.args) == 1 for node in guards)  # kept, asserting nothing
    assert any(str(node.target).startswith("aten.to") for node in calls)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(**inputs).logits
        output = graph_module(**inputs)
    logits = output["logits"] if isinstance(output, dict) else output[0]
    assert logits.dtype == expected.dtype
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
