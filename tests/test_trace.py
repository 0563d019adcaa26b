"""Tests for fxpipe.passes.tracing: both front ends against eager outputs and gradients, meta, errors."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn
from torch.utils._pytree import tree_leaves

import fxpipe.models as zoo
from fxpipe.passes.tracing import ExampleInputsTypeError, TraceError, trace

torch.set_num_threads(1)


# ----------------------------------------------------------------------------- helpers


def _loss(output: Any) -> Tensor:
    """A scalar that depends on every floating output element (weights break symmetries)."""
    total = torch.zeros(())
    for leaf in tree_leaves(output):
        if isinstance(leaf, Tensor) and leaf.is_floating_point():
            weights = torch.linspace(0.5, 1.5, leaf.numel()).reshape(leaf.shape)
            total = total + (leaf * weights).sum()
    return total


def _grads(
    fn: Any, args: tuple[Any, ...], params: list[nn.Parameter], kwargs: dict[str, Any] | None = None
) -> tuple[Any, list[Tensor]]:
    output = fn(*args, **(kwargs or {}))
    grads = torch.autograd.grad(_loss(output), params, allow_unused=True)
    return output, [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, params, strict=True)]


def _assert_same_structure_and_values(actual: Any, expected: Any) -> None:
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and list(actual) == list(expected)
        for key in expected:
            _assert_same_structure_and_values(actual[key], expected[key])
    elif isinstance(expected, (tuple, list)):
        assert isinstance(actual, (tuple, list)) and len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            _assert_same_structure_and_values(a, e)
    elif isinstance(expected, Tensor):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    else:
        assert actual == expected


def _assert_matches_eager(
    model: nn.Module, gm: fx.GraphModule, eager_kwargs: dict[str, Any] | None = None
) -> None:
    """gm(*example_inputs) equals the eager model: outputs and gradients of every original parameter."""
    args = gm.meta["fxpipe.example_inputs"]
    named = dict(model.named_parameters())
    expected, expected_grads = _grads(model, () if eager_kwargs else args, list(named.values()), eager_kwargs)
    if isinstance(expected, dict) and type(expected) is not dict:  # Hugging Face ModelOutput
        expected = dict(expected)
    gm_named = dict(gm.named_parameters(remove_duplicate=False))
    param_names = gm.meta["fxpipe.param_names"]
    by_name = {name: gm_named[path] for path, name in param_names.items() if path in gm_named}
    assert set(by_name) <= set(named)
    actual, actual_grads = _grads(gm, args, [by_name.get(name, p) for name, p in named.items()])
    _assert_same_structure_and_values(actual, expected)
    for name, got, want in zip(named, actual_grads, expected_grads, strict=True):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), f"gradient of {name} differs"


def _assert_meta_conventions(gm: fx.GraphModule, model: nn.Module) -> None:
    """Every fxpipe.* key the brief promises, with values that point back into the original model."""
    original: dict[str, Tensor] = dict(model.named_parameters(remove_duplicate=False))
    original.update(model.named_buffers(remove_duplicate=False))
    canonical = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    gm_tensors: dict[str, Tensor] = dict(gm.named_parameters(remove_duplicate=False))
    gm_tensors.update(gm.named_buffers(remove_duplicate=False))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert gm.meta["fxpipe.frontend"] in ("fx", "export")
    assert isinstance(gm.meta["fxpipe.example_inputs"], tuple)
    assert len(gm.meta["fxpipe.example_inputs"]) == len(placeholders)
    assert gm.meta["fxpipe.input_names"] == tuple(n.target for n in placeholders)
    assert set(gm.meta["fxpipe.param_names"]) == set(gm_tensors)
    for path, name in gm.meta["fxpipe.param_names"].items():
        assert name in canonical and gm_tensors[path] is original[name], (path, name)
    for node in gm.graph.nodes:
        names = node.meta["fxpipe.param_names"]
        assert isinstance(names, tuple) and set(names) <= canonical, node.format_node()
        model.get_submodule(node.meta["fxpipe.module_path"])  # a real module path of the model


# ----------------------------------------------------------------------------- small models


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.relu(self.fc(x))  # (B, D)


class Stack(nn.Module):
    def __init__(self, dim: int = 8, num_blocks: int = 3) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block(dim) for _ in range(num_blocks)])
        self.head = nn.Linear(dim, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(x))


class TiedWeights(nn.Module):
    """The embedding weight is read by a leaf (head.weight is the same Parameter) and by F.linear."""

    def __init__(self, vocab_size: int = 16, dim: int = 8) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        x = torch.tanh(self.embedding(tokens))  # (B, T, D)
        return self.head(x), F.linear(x, self.embedding.weight)  # (B, T, V) twice


class KeywordModel(nn.Module):
    """Optional inputs with defaults and dict/tuple outputs."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(
        self, x: Tensor, mask: Tensor | None = None, scale: float = 2.0, bias: Tensor | None = None
    ) -> dict[str, Any]:
        h = self.proj(x) * scale
        if mask is not None:
            h = h * mask
        if bias is not None:
            h = h + bias
        return {"hidden": h, "pair": (h.sum(-1), x)}


class WithBuffers(nn.Module):
    def __init__(self, dim: int = 6) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.norm = nn.BatchNorm1d(dim)
        self.register_buffer("offset", torch.linspace(-1, 1, dim))
        self.register_buffer("scale", torch.full((dim,), 0.5), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(self.fc(x) + self.offset) * self.scale


class LoopOverTime(nn.Module):
    """`range(x.shape[1])` needs a concrete size: fx cannot trace it, torch.export can."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim)])
        self.cell = nn.GRUCell(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        h = self.blocks[0](x[:, 0])  # (B, D)
        for step in range(x.shape[1]):
            h = self.cell(x[:, step], h)
        return h


class Untraceable(nn.Module):
    """Python branching on a tensor value plus a numpy call: neither fx nor torch.export can trace it."""

    def forward(self, x: Tensor) -> Tensor:
        if x.sum() > 0:
            return torch.from_numpy(np.tanh(x.detach().numpy()))
        return x


class HasUntraceableBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(4), Untraceable(), Block(4)])

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class MyLSTM(nn.LSTM):
    """A user subclass of a recurrent layer: still a leaf by default."""


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = MyLSTM(4, 4, batch_first=True)
        self.gru = nn.GRU(4, 4, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        out, (_, _) = self.rnn(x)
        out, _ = self.gru(out)
        return out


# ----------------------------------------------------------------------------- zoo models


@pytest.mark.parametrize("name", zoo.names())
def test_zoo_model_traces_to_eager_outputs_and_gradients(name: str) -> None:
    model, example_inputs = zoo.build(name, **zoo.get(name).tiny_overrides)
    model.eval()  # dropout off: eager and traced runs must see the same function
    gm = trace(model, example_inputs)
    _assert_meta_conventions(gm, model)
    _assert_matches_eager(model, gm)


def test_paper_size_bert48_on_meta_traces_quickly_without_allocating() -> None:
    model, example_inputs = zoo.build("bert-48", device="meta")
    gm = trace(model, example_inputs)  # time limit: benchmarks/unit_speed.py
    assert gm.meta["fxpipe.frontend"] == "fx"
    assert all(p.is_meta for p in gm.parameters())
    assert all(t.is_meta for t in gm.meta["fxpipe.example_inputs"])
    num_params = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in gm.parameters()) == num_params > 300_000_000
    read = {name for node in gm.graph.nodes for name in node.meta["fxpipe.param_names"]}
    assert read == {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}


# ----------------------------------------------------------------------------- Hugging Face models


def _tiny_gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32)
    return transformers.GPT2LMHeadModel(config).eval()


def _tiny_bert() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        vocab_size=100, max_position_embeddings=32, type_vocab_size=2,
    )
    return transformers.BertModel(config).eval()


def test_hf_gpt2_goes_through_export_with_one_tied_parameter() -> None:
    model = _tiny_gpt2()
    tokens = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(TraceError):
        trace(model, tokens, frontend="fx")  # plain symbolic tracing cannot trace HF models
    gm = trace(model, tokens)
    assert gm.meta["fxpipe.frontend"] == "export"
    assert gm.meta["fxpipe.input_names"] == ("input_ids",)
    _assert_meta_conventions(gm, model)
    _assert_matches_eager(model, gm, {"input_ids": tokens, "use_cache": False})
    assert len(list(gm.parameters())) == len(list(model.parameters()))  # tied: still one Parameter
    tied = "transformer.wte.weight"
    assert model.get_submodule("lm_head").weight is model.get_parameter(tied)
    readers = [n for n in gm.graph.nodes if tied in n.meta["fxpipe.param_names"]]
    assert len(readers) == 1 and len(readers[0].users) == 2  # embedding lookup and output projection
    user_paths = {user.meta["fxpipe.module_path"] for user in readers[0].users}
    assert user_paths == {"transformer.wte", "lm_head"}


def test_hf_bert_keyword_inputs_return_a_plain_dict() -> None:
    model = _tiny_bert()
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 100, (2, 8), generator=generator)
    segments = torch.randint(0, 2, (2, 8), generator=generator)
    # Keyword order differs from forward()'s; attention_mask (between them) keeps its default.
    gm = trace(model, {"token_type_ids": segments, "input_ids": tokens})
    assert gm.meta["fxpipe.frontend"] == "export"
    assert gm.meta["fxpipe.input_names"] == ("input_ids", "token_type_ids")
    assert gm.meta["fxpipe.example_inputs"][0] is tokens and gm.meta["fxpipe.example_inputs"][1] is segments
    _assert_meta_conventions(gm, model)
    _assert_matches_eager(model, gm, {"input_ids": tokens, "token_type_ids": segments})
    assert type(gm(tokens, segments)) is dict
    module_paths = {n.meta["fxpipe.module_path"] for n in gm.graph.nodes}
    assert "encoder.layer.1.attention.self.query" in module_paths


# ----------------------------------------------------------------------------- fx front end features


def test_fx_module_paths_and_param_names() -> None:
    model = Stack()
    gm = trace(model, torch.randn(3, 8))
    assert gm.meta["fxpipe.frontend"] == "fx"
    _assert_meta_conventions(gm, model)
    by_name = {n.name: n for n in gm.graph.nodes}
    assert by_name["blocks_1_fc"].meta["fxpipe.module_path"] == "blocks.1.fc"
    assert by_name["blocks_1_fc"].meta["fxpipe.param_names"] == ("blocks.1.fc.weight", "blocks.1.fc.bias")
    assert by_name["relu_1"].meta["fxpipe.module_path"] == "blocks.1"
    assert by_name["x"].meta["fxpipe.module_path"] == "" and by_name["x"].meta["fxpipe.param_names"] == ()
    _assert_matches_eager(model, gm)


def test_tied_weight_stays_one_parameter_with_two_uses() -> None:
    model = TiedWeights()
    gm = trace(model, torch.randint(0, 16, (2, 5)))
    _assert_meta_conventions(gm, model)
    assert len(list(gm.parameters())) == 1 and next(gm.parameters()) is model.embedding.weight
    assert gm.meta["fxpipe.param_names"] == {
        "embedding.weight": "embedding.weight",
        "head.weight": "embedding.weight",
    }
    readers = [n.op for n in gm.graph.nodes if n.meta["fxpipe.param_names"] == ("embedding.weight",)]
    assert sorted(readers) == ["call_module", "call_module", "get_attr"]
    _assert_matches_eager(model, gm)


def test_keyword_inputs_follow_the_signature_and_keep_defaults() -> None:
    model = KeywordModel()
    x, bias = torch.randn(2, 4), torch.randn(2, 4)
    gm = trace(model, {"bias": bias, "x": x})
    assert gm.meta["fxpipe.input_names"] == ("x", "bias")
    assert gm.meta["fxpipe.example_inputs"] == (x, bias)
    assert [n.target for n in gm.graph.nodes if n.op == "placeholder"] == ["x", "bias"]
    _assert_meta_conventions(gm, model)
    _assert_matches_eager(model, gm, {"x": x, "bias": bias})  # mask=None and scale=2.0 kept
    out = gm(x, bias)
    assert list(out) == ["hidden", "pair"] and isinstance(out["pair"], tuple)


def test_buffers_are_shared_and_named() -> None:
    model = WithBuffers()
    x = torch.randn(4, 6)
    reference = copy.deepcopy(model)
    gm = trace(model, x)
    _assert_meta_conventions(gm, model)
    assert {"offset", "scale", "norm.running_mean"} <= set(gm.meta["fxpipe.param_names"].values())
    offset_readers = [n for n in gm.graph.nodes if n.meta["fxpipe.param_names"] == ("offset",)]
    assert [n.op for n in offset_readers] == ["get_attr"]
    torch.testing.assert_close(gm(x), reference(x))  # training-mode BatchNorm: same output ...
    torch.testing.assert_close(model.norm.running_mean, reference.norm.running_mean)  # ... same stats update
    model.eval()
    _assert_matches_eager(model, gm)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_trace_does_not_mutate_the_model(frontend: str) -> None:
    model = WithBuffers()
    model.fc.eval()  # mixed modes must survive
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modes = [m.training for m in model.modules()]
    gm = trace(model, torch.randn(4, 6), frontend=frontend)
    assert gm.meta["fxpipe.frontend"] == frontend
    assert [m.training for m in model.modules()] == modes
    after = model.state_dict()
    assert list(after) == list(before)
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    assert all(p.grad is None and p.requires_grad for p in model.parameters())


def test_recurrent_layers_and_user_leaves_stay_whole() -> None:
    model = Recurrent()
    gm = trace(model, torch.randn(2, 3, 4))
    assert [(n.target, n.meta["fxpipe.module_path"]) for n in gm.graph.nodes if n.op == "call_module"] == [
        ("rnn", "rnn"), ("gru", "gru")]
    _assert_matches_eager(model, gm)
    stack = Stack()
    by_class = trace(stack, torch.randn(3, 8), leaf_modules=[Block])
    by_prefix = trace(stack, torch.randn(3, 8), leaf_modules=["blocks.1"])
    called_by_class = [n.target for n in by_class.graph.nodes if n.op == "call_module"]
    called_by_prefix = [n.target for n in by_prefix.graph.nodes if n.op == "call_module"]
    assert called_by_class == ["blocks.0", "blocks.1", "blocks.2", "head"]
    assert called_by_prefix == ["blocks.0.fc", "blocks.1", "blocks.2.fc", "head"]
    leaf = next(n for n in by_prefix.graph.nodes if n.target == "blocks.1")
    assert leaf.meta["fxpipe.param_names"] == ("blocks.1.fc.weight", "blocks.1.fc.bias")
    with pytest.raises(TypeError, match="leaf_modules entry 3"):
        trace(stack, torch.randn(3, 8), leaf_modules=[3])  # type: ignore[list-item]


def test_fx_failure_falls_back_to_export() -> None:
    model = LoopOverTime()
    x = torch.randn(2, 3, 4)
    with pytest.raises(TraceError, match=r"<root> \(LoopOverTime\)"):
        trace(model, x, frontend="fx")
    gm = trace(model, x)
    assert gm.meta["fxpipe.frontend"] == "export"
    _assert_meta_conventions(gm, model)
    _assert_matches_eager(model, gm)
    linear = torch.ops.aten.linear.default
    linear_paths = {n.meta["fxpipe.module_path"] for n in gm.graph.nodes if n.target is linear}
    assert "blocks.0.fc" in linear_paths
    assert gm.meta["fxpipe.param_names"]["blocks.0.fc.weight"] == "blocks.0.fc.weight"


def test_trace_is_deterministic() -> None:
    model = Stack()
    x = torch.randn(3, 8)
    assert trace(model, x).code == trace(model, x).code
    assert trace(model, x, frontend="export").code == trace(model, x, frontend="export").code


# ----------------------------------------------------------------------------- errors


def test_untraceable_model_names_the_module_and_both_reasons() -> None:
    model = HasUntraceableBlock()
    x = torch.ones(2, 4)
    with pytest.raises(TraceError) as caught:
        trace(model, x)
    message = str(caught.value)
    assert "blocks.1 (Untraceable)" in message
    assert "symbolically traced variables cannot be used as inputs to control flow" in message
    assert "torch.export fallback failed in blocks.1 (Untraceable)" in message and caught.value.export_reason
    assert caught.value.module_path == "blocks.1" and caught.value.module_class == "Untraceable"
    assert caught.value.export_module_path == "blocks.1"
    with pytest.raises(TraceError, match=r"torch.export could not trace blocks\.1 \(Untraceable\)"):
        trace(model, x, frontend="export")
    with pytest.raises(TraceError, match=r"blocks\.1 \(Untraceable\).*leaf_modules"):
        trace(model, x, frontend="fx")
    gm = trace(model, x, leaf_modules=["blocks.1"])  # the broken block as a leaf: traceable
    assert gm.meta["fxpipe.frontend"] == "fx"
    torch.testing.assert_close(gm(x), model(x))


@pytest.mark.parametrize(
    ("example_inputs", "pattern"),
    [
        ("tokens", r"example_inputs is a str; accepted forms: a Tensor, a tuple or list"),
        ({torch.zeros(1)}, r"example_inputs is a set; accepted forms"),
        ((torch.zeros(2, 8), [torch.zeros(2, 8)]), r"example_inputs\[1\] is a list; accepted forms"),
        ({"x": 3}, r"example_inputs\['x'\] is a int"),
        ({"y": torch.zeros(2, 8)}, r"key 'y', which is not a parameter of forward\(\) \['x'\]"),
        ((torch.zeros(2, 8), torch.zeros(2, 8)), r"2 positional values but forward\(\) takes 1"),
        ((), r"no value for forward\(\)'s required parameter 'x'"),
    ],
)
def test_wrong_example_inputs_raise_a_specific_type_error(example_inputs: Any, pattern: str) -> None:
    with pytest.raises(ExampleInputsTypeError, match=pattern) as caught:
        trace(Stack(), example_inputs)
    assert isinstance(caught.value, TypeError)


def test_fx_failure_at_the_root_suggests_a_rewrite_not_a_leaf() -> None:
    with pytest.raises(TraceError) as caught:
        trace(Untraceable(), torch.ones(2, 4), frontend="fx")
    assert str(caught.value).startswith("torch.fx could not trace <root> (Untraceable): ")
    assert "torch.where" in str(caught.value) and "leaf_modules" not in str(caught.value)


def test_unknown_frontend_is_rejected() -> None:
    with pytest.raises(ValueError, match="frontend='jit'"):
        trace(Stack(), torch.randn(3, 8), frontend="jit")


def test_package_attribute_stays_callable_after_submodule_import() -> None:
    import fxpipe.passes
    import fxpipe.passes.tracing  # noqa: F401  (rebinds fxpipe.passes.tracing to the submodule)
    from fxpipe.passes import trace as package_trace

    gm = package_trace(Stack(), torch.randn(3, 8))
    assert isinstance(gm, fx.GraphModule) and fxpipe.passes.TraceError is TraceError
