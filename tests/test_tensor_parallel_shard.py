"""shard_stage: T members (threads, one communicator each) give one process's outputs and gradients exactly."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn
from torch.utils._pytree import tree_leaves
from tp_threads import ThreadGroup, full_gradient, run_members

import fxpipe
from fxpipe import hf_examples, passes
from fxpipe.core import meta
from fxpipe.passes import tensor_parallel_ops as ops
from fxpipe.passes.codegen import split_stages
from fxpipe.passes.tp_loss import is_token_cross_entropy
from fxpipe.passes.tp_shard import TensorParallelStage, shard_stage

LossOf = Callable[[Tensor], Tensor]


class AttentionBlock(nn.Module):
    """Pre-norm attention (separate q, k, v) and a gated MLP, as nanoGPT / Llama write them."""

    def __init__(self, width: int = 32, heads: int = 4, hidden: int = 64) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(width, width)
        self.gate, self.up = nn.Linear(width, hidden, bias=False), nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: Tensor) -> Tensor:
        batch, tokens, width = x.shape
        h = self.norm1(x)
        q, k, v = (proj(h).view(batch, tokens, self.heads, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, T, width / heads)
        x = x + self.out(attention.transpose(1, 2).reshape(batch, tokens, width))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def _members(gm: fx.GraphModule, degree: int, **options: Any) -> tuple[list[TensorParallelStage], ThreadGroup]:
    group = ThreadGroup(degree)
    stages = []
    for rank in range(degree):
        key = f"test-tp-{degree}-{rank}"
        ops.register_group(key, group.member(rank))
        stages.append(shard_stage(copy.deepcopy(gm), degree, rank, group_key=key, **options))
    return stages, group


def _reference(gm: fx.GraphModule, inputs: tuple[Any, ...], loss_of: LossOf) -> tuple[Tensor, dict[str, Tensor]]:
    reference = copy.deepcopy(gm)
    output = tree_leaves(reference(*inputs))[0]
    loss_of(output).backward()
    names = gm.meta.get(meta.PARAM_NAMES, {})
    return output.detach(), {names.get(path, path): p.grad for path, p in reference.named_parameters()}


def _check_members(gm: fx.GraphModule, degree: int, loss_of: LossOf,
                   **options: Any) -> tuple[list[TensorParallelStage], ThreadGroup]:
    """Run the ``degree`` members on the traced example inputs; compare outputs and every parameter's gradient."""
    inputs = tuple(gm.meta[meta.EXAMPLE_INPUTS])
    expected_output, expected_grads = _reference(gm, inputs, loss_of)
    stages, group = _members(gm, degree, **options)

    def work(rank: int) -> Tensor:
        torch.set_num_threads(1)
        output = tree_leaves(stages[rank].module(*inputs))[0]
        loss_of(output).backward()
        return output.detach()

    for output in run_members(degree, work):
        torch.testing.assert_close(output, expected_output, rtol=1e-5, atol=1e-5)
    by_name: dict[str, list[Any]] = {}
    for stage in stages:
        for parameter in stage.parameters:
            by_name.setdefault(parameter.name, []).append((parameter, stage.module.get_parameter(parameter.path).grad))
    assert by_name.keys() == expected_grads.keys()
    largest = max(grad.abs().max().item() for grad in expected_grads.values())
    for name, members in by_name.items():
        # relative to the gradient, or to the model's largest one for (near) zero gradients such as k's bias
        scale = max(expected_grads[name].abs().max().item(), 1e-2 * largest)
        torch.testing.assert_close(full_gradient(members) / scale, expected_grads[name] / scale, rtol=0, atol=2e-4,
                                   msg=lambda text, name=name: f"{name}: {text}")  # type: ignore[misc]
    return stages, group


def _weighted_sum(output: Tensor) -> Tensor:
    weights = torch.linspace(-1.0, 1.0, output.numel()).reshape(output.shape)
    return (output * weights).sum()


def _split_bytes(stage: TensorParallelStage) -> tuple[int, int]:
    """(bytes of the member's split parameters, bytes of those parameters whole)."""
    held = full = 0
    for parameter in stage.parameters:
        if parameter.dim is not None:
            tensor = stage.module.get_parameter(parameter.path)
            held += tensor.numel() * tensor.element_size()
            full += int(torch.Size(parameter.full_shape).numel()) * tensor.element_size()
    return held, full


@pytest.mark.parametrize(("degree", "sequence_parallel"), [(2, False), (4, False), (2, True), (4, True)])
def test_hand_written_attention_block(degree: int, sequence_parallel: bool) -> None:
    torch.manual_seed(0)
    gm = passes.trace(AttentionBlock(), torch.randn(2, 8, 32))
    stages, group = _check_members(gm, degree, _weighted_sum, sequence_parallel=sequence_parallel)
    held, full = _split_bytes(stages[0])
    assert held * degree == full and full > 0
    split = {p.name for p in stages[0].parameters if p.dim is not None}
    assert split == {"q.weight", "q.bias", "k.weight", "k.bias", "v.weight", "v.bias", "out.weight", "gate.weight",
                     "up.weight", "down.weight"}
    partial = {p.name for p in stages[0].parameters if p.partial_grad}
    if sequence_parallel:
        # forward: 2 all-gathers into the pairs, 2 reduce-scatters out, 1 all-gather of the output; backward:
        # 2 all-gathers of the pairs' inputs again (only their token shares are saved), 2 reduce-scatters,
        # 2 all-gathers (the output's gather keeps a share; the input needs no gradient)
        assert group.counts == [11] * degree
        assert any("2 column inputs saved as token shares" in note for note in stages[0].notes)
        assert partial == {"norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias", "out.bias", "down.bias"}
    else:  # one all-reduce per pair forward (row sums) and one backward (column inputs)
        assert group.counts == [4] * degree and partial == set()


@pytest.mark.parametrize(("degree", "sequence_parallel"), [(2, False), (4, True)])
def test_gpt_mini_fused_qkv_and_tied_vocabulary(degree: int, sequence_parallel: bool) -> None:
    model, inputs = fxpipe.models.build("gpt-mini", n_layer=2)
    stages, _ = _check_members(passes.trace(model, inputs[0]), degree, _weighted_sum,
                               sequence_parallel=sequence_parallel)
    held, full = _split_bytes(stages[0])
    assert held * degree == full
    by_name = {p.name: p for p in stages[0].parameters}
    assert by_name["h.0.attn.c_attn.weight"].parts == (128, 128, 128) and by_name["wte.weight"].dim == 0
    assert "lm_head.weight" not in by_name  # the tied head reads wte's split table: one parameter


@pytest.mark.parametrize(("kv_heads", "kv_split", "sequence_parallel"), [(2, True, True), (1, False, False)])
def test_hf_llama_gqa(kv_heads: int, kv_split: bool, sequence_parallel: bool) -> None:
    model, inputs = hf_examples.llama(num_layers=2, heads=4, kv_heads=kv_heads)
    stages, _ = _check_members(passes.trace(model, inputs), 2, _weighted_sum, sequence_parallel=sequence_parallel)
    by_name = {p.name: p for p in stages[0].parameters}
    k_proj = by_name["model.layers.0.self_attn.k_proj.weight"]
    assert (k_proj.dim == 0) == kv_split and k_proj.partial_grad == (not kv_split)
    assert by_name["model.layers.0.self_attn.q_proj.weight"].dim == 0
    assert by_name["model.layers.0.mlp.down_proj.weight"].dim == 1
    assert by_name["model.layers.0.input_layernorm.weight"].partial_grad == sequence_parallel or not kv_split
    code = stages[0].module.code
    assert ("reduce_scatter_sequence" in code) == sequence_parallel and ("reduce_from_group" in code) != sequence_parallel


def test_hf_gpt2_conv1d_fused_qkv() -> None:
    model, inputs = hf_examples.gpt2(n_layer=2)
    stages, _ = _check_members(passes.trace(model, inputs), 2, _weighted_sum, sequence_parallel=True)
    by_name = {p.name: p for p in stages[0].parameters}
    assert by_name["transformer.h.0.attn.c_attn.weight"].dim == 1  # Conv1D weights are (in, out)
    assert by_name["transformer.h.0.attn.c_attn.weight"].parts == (32, 32, 32)
    assert by_name["transformer.h.0.attn.c_proj.weight"].dim == 0


class VocabLM(nn.Module):
    """An LM whose vocabulary dominates its weights: a 1024-token table and head around one small MLP."""

    def __init__(self, vocab: int = 1024, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids)
        x = x + self.down(F.gelu(self.up(x)))
        return self.head(self.norm(x))  # (B, T, vocab)


@pytest.mark.parametrize("degree", [2, 4])
def test_vocabulary_parallel_head_and_cross_entropy(degree: int) -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 1024, (2, 12))
    targets = torch.randint(0, 1024, (2, 12))
    targets[0, :3] = -100  # ignored tokens
    gm = passes.trace(VocabLM(), ids)
    _, expected_grads = _reference(gm, (ids,), lambda logits: F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    expected_loss = F.cross_entropy(gm(ids).flatten(0, 1), targets.flatten())
    stages, group = _members(gm, degree, parallel_loss=True)

    def work(rank: int) -> Tensor:
        torch.set_num_threads(1)
        stage = stages[rank]
        assert stage.vocab_parallel_logits is not None
        _, start, vocab = stage.vocab_parallel_logits
        logits = stage.module(ids)
        assert logits.shape[-1] == vocab // degree  # the logits stay split
        loss = ops.vocab_parallel_cross_entropy(logits, targets, stage.group_key, start)
        loss.backward()
        return loss.detach()

    for loss in run_members(degree, work):
        torch.testing.assert_close(loss, expected_loss.detach())
    for name in ("embed.weight", "head.weight", "up.weight", "down.weight", "norm.weight"):
        members = [(p, stage.module.get_parameter(p.path).grad) for stage in stages for p in stage.parameters
                   if p.name == name]
        torch.testing.assert_close(full_gradient(members), expected_grads[name], rtol=1e-4, atol=1e-6)
    held, full = _split_bytes(stages[0])
    total = sum(p.numel() * p.element_size() for p in gm.parameters())
    assert held * degree == full and full > 0.9 * total  # the vocabulary dominates and splits


def test_a_pair_cut_by_a_stage_boundary_stays_whole() -> None:
    model, inputs = fxpipe.models.build("gpt-mini", n_layer=2)
    gm = passes.trace(model, inputs[0])
    names = [node.name for node in gm.graph.nodes if node.op not in ("placeholder", "output")]
    cut = names.index("h_1_attn_c_attn") + 1  # between layer 1's qkv projection and its attention
    program = split_stages(gm, [names[:cut], names[cut:]])
    first, second = program.stages
    values = dict(zip(program.model_inputs, gm.meta[meta.EXAMPLE_INPUTS], strict=True))
    values.update(zip(first.output_values, first.module(*(values[name] for name in first.input_values)), strict=True))
    second_gm = second.module
    second_gm.meta[meta.EXAMPLE_INPUTS] = tuple(value.detach() if isinstance(value, Tensor) else value
                                                for value in (values[name] for name in second.input_values))
    stages, _ = _check_members(second_gm, 2, _weighted_sum, example_inputs=second_gm.meta[meta.EXAMPLE_INPUTS])
    split = {p.name for p in stages[0].parameters if p.dim is not None}
    assert "h.1.attn.c_proj.weight" not in split  # its column half is on the other stage
    assert {"h.1.mlp.c_fc.weight", "h.1.mlp.c_proj.weight", "wte.weight"} <= split


def test_token_cross_entropy_is_recognised_by_value() -> None:
    targets = torch.tensor([[1, 2, -100], [3, 0, 9]])
    assert is_token_cross_entropy(lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()), (2, 3, 10),
                                  targets)
    assert is_token_cross_entropy(hf_examples.hf_loss, (2, 3, 10), targets, output_of=lambda logits: {"logits": logits})
    smoothed = lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten(), label_smoothing=0.1)  # noqa: E731
    assert not is_token_cross_entropy(smoothed, (2, 3, 10), targets)
    assert not is_token_cross_entropy(lambda logits, y: logits.square().mean(), (2, 3, 10), targets)


class FusedGatedMLP(nn.Module):
    """SwiGLU with gate and up in one Linear, split by chunk (as many Llama ports write it)."""

    def __init__(self, width: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.gate_up = nn.Linear(width, 2 * hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def test_fused_gate_up_split_by_chunk() -> None:
    torch.manual_seed(0)
    stages, _ = _check_members(passes.trace(FusedGatedMLP(), torch.randn(3, 4, 16)), 2, _weighted_sum)
    by_name = {p.name: p for p in stages[0].parameters}
    assert by_name["gate_up.weight"].parts == (32, 32) and by_name["down.weight"].dim == 1


def test_degree_one_is_the_stage_unchanged() -> None:
    gm = passes.trace(FusedGatedMLP(), torch.randn(3, 4, 16))
    stage = shard_stage(gm, 1, 0, group_key="never-registered")
    inputs = gm.meta[meta.EXAMPLE_INPUTS]
    torch.testing.assert_close(stage.module(*inputs), gm(*inputs), rtol=0, atol=0)
    assert all(p.dim is None and not p.partial_grad for p in stage.parameters) and "tensor_parallel_ops" not in stage.module.code
    with pytest.raises(ValueError, match="degree=2, rank=2"):
        shard_stage(gm, 2, 2)
