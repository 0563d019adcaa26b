"""Tensor-parallel analysis: Megatron pairs found on fx and export graphs, and the per-block figures of the chain."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe import hf_examples, passes
from fxpipe.core.chain import CostChain
from fxpipe.core.cluster import compact_cluster
from fxpipe.passes.tensor_parallel import find_tensor_parallel
from fxpipe.planning import costed_model


def _chain(model: nn.Module, inputs: Any, precision: str = "fp32") -> CostChain:
    return costed_model(model, inputs, compact_cluster(1, 8, "h100"), precision=precision).chain


def _weight_bytes(model: nn.Module, suffixes: tuple[str, ...]) -> int:
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if name.endswith(suffixes))


def test_gpt_mini_fx_graph_pairs_fused_qkv_and_mlp_and_its_vocabulary() -> None:
    model, inputs = fxpipe.models.build("gpt-mini")
    gm = passes.trace(model, inputs)
    code_before = gm.code
    analysis = find_tensor_parallel(gm)
    assert gm.code == code_before and all("fxpipe.tensor_parallel" not in node.meta for node in gm.graph.nodes)
    attention = [region for region in analysis.regions if "attn" in region.columns[0]]
    mlp = [region for region in analysis.regions if "mlp" in region.columns[0]]
    assert len(attention) == len(mlp) == 4 and len(analysis.regions) == 8
    first = attention[0]
    assert first.columns == ("h_0_attn_c_attn",) and first.rows == ("h_0_attn_c_proj",)
    assert first.fused == (("h_0_attn_c_attn", (128, 128, 128)),)  # q, k, v in one Linear
    assert first.divisor == 4  # the heads
    assert {"unflatten", "softmax", "matmul", "matmul_1", "flatten"} <= set(first.nodes)
    assert mlp[0].columns == ("h_0_mlp_c_fc",) and mlp[0].rows == ("h_0_mlp_c_proj",) and mlp[0].divisor == 512
    assert [(v.node, v.kind, v.vocab_size) for v in analysis.vocab] == [("wte", "embedding", 256),
                                                                          ("lm_head", "head", 256)]
    assert {"h_0_ln_1", "add_1", "ln_f"} <= set(analysis.sequence_nodes)
    assert analysis.replicated == ()


def test_gpt_mini_chain_splits_the_pair_weights_and_the_tied_vocabulary_once() -> None:
    model, inputs = fxpipe.models.build("gpt-mini")
    chain = _chain(model, inputs)
    split = sum(block.tp.param_bytes for block in chain.blocks if block.tp is not None)
    pair_weights = _weight_bytes(model, ("c_attn.weight", "c_attn.bias", "c_proj.weight", "c_fc.weight",
                                         "c_fc.bias"))
    assert split == pair_weights + _weight_bytes(model, ("wte.weight",))  # lm_head shares wte's weight
    matmul_blocks = [block for block in chain.blocks if any("c_fc" in name for name in block.node_names)]
    assert matmul_blocks and all(block.tp is not None and block.tp.time_share == 1.0 for block in matmul_blocks)
    rows = [block for block in chain.blocks if any(name.endswith("c_proj") for name in block.node_names)]
    hidden = 128 * 4  # (T=64 tokens x 128 channels) x 4 bytes per row
    assert all(block.tp is not None and block.tp.comm_bytes.per_sample == 64 * hidden for block in rows)


@pytest.mark.parametrize(("kv_heads", "kv_split"), [(2, True), (1, False)])
def test_hf_llama_gqa_kv_heads_split_when_divisible_else_stay_whole(kv_heads: int, kv_split: bool) -> None:
    model, inputs = hf_examples.llama(num_layers=1, heads=4, kv_heads=kv_heads)
    analysis = find_tensor_parallel(passes.trace(model, inputs))
    attention, mlp = analysis.regions
    assert attention.rows == ("linear_3",) and mlp.columns == ("linear_4", "linear_5") and mlp.rows == ("linear_6",)
    assert mlp.divisor == 64 and {"silu", "mul_19"} == set(mlp.nodes)
    if kv_split:
        assert attention.columns == ("linear", "linear_1", "linear_2")
        assert attention.replicable == ("linear_1", "linear_2")  # k, v: may stay whole for T = 4
        assert (attention.divisor, attention.divisor_replicated) == (2, 4)
    else:
        assert attention.columns == ("linear",) and attention.divisor == 4
        assert {name for name, _ in analysis.replicated} == {"linear_1", "linear_2"}
    assert "scaled_dot_product_attention" in attention.nodes


def test_hf_gpt2_conv1d_addmm_is_a_fused_column() -> None:
    model, inputs = hf_examples.gpt2(n_layer=1)
    analysis = find_tensor_parallel(passes.trace(model, inputs))
    attention, mlp = analysis.regions
    assert attention.columns == ("addmm",) and attention.rows == ("addmm_1",)
    assert attention.fused == (("addmm", (32, 32, 32)),) and attention.divisor == 2
    assert mlp.columns == ("addmm_2",) and mlp.rows == ("addmm_3",) and mlp.divisor == 128
    # the position table is looked up by positions, not token ids: not a vocabulary
    assert [(v.kind, v.weight) for v in analysis.vocab] == [("embedding", "transformer.wte.weight"),
                                                           ("head", "transformer.wte.weight")]


def test_llama_70b_config_on_meta_splits_eight_ways_with_kv_heads() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=8192, intermediate_size=28672,
                                      num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                                      max_position_embeddings=4096)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    inputs = {"input_ids": torch.zeros(2, 4096, dtype=torch.long)}
    chain = _chain(model, inputs, precision="bf16")
    tps = [block.tp for block in chain.blocks if block.tp is not None]
    layer = _weight_bytes(model, ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                                  "gate_proj.weight", "up_proj.weight", "down_proj.weight"))
    vocab = _weight_bytes(model, ("embed_tokens.weight", "lm_head.weight"))
    assert sum(tp.param_bytes for tp in tps) == layer + vocab
    divisors = {tp.divisor for tp in tps} - {0}
    assert divisors == {8, 28672, 128256}  # gcd(64 heads, 8 kv heads), the MLP width, the vocabulary
    matmuls = [block for block in chain.blocks if any(name.startswith("linear") for name in block.node_names)]
    assert len(matmuls) >= 4 and all(block.tp is not None and block.tp.time_share > 0.99 for block in matmuls)


def test_models_without_pairs_keep_tp_none() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.Flatten(), nn.Linear(8 * 4 * 4, 10))
    chain = _chain(model, torch.randn(2, 3, 8, 8))
    assert all(block.tp is None for block in chain.blocks)


def test_an_embedding_with_a_padding_row_is_not_vocabulary_parallel() -> None:
    model = nn.Sequential(nn.Embedding(64, 8, padding_idx=0), nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
    analysis = find_tensor_parallel(passes.trace(model, torch.randint(0, 64, (2, 5))))
    assert len(analysis.regions) == 1 and analysis.vocab == ()
