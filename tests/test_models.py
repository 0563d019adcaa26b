"""Tests for the model zoo: builds, tracing, parameter counts, tied weights, batches and errors."""

from __future__ import annotations

import pytest
import torch

import fxpipe.models as zoo
from fxpipe.models import UnknownModelError

torch.set_num_threads(1)

ALL_NAMES = zoo.names()
PAPER_NAMES = [name for name in ALL_NAMES if zoo.get(name).paper_params is not None]
EXPECTED_NAMES = {
    "gpt-mini", "gpt2-small", "gpt3-xl", "gpt3-6.7b", "gpt3-13b", "gpt3-175b", "bert-large", "bert-48",
    "xlnet-36", "gnmt-16", "vgg-19", "resnet-50", "amoebanet-36", "mlp", "skipnet", "tied-lm",
}


def _num_unique_params(model: torch.nn.Module) -> int:
    # parameters() yields each Parameter object once, so tied weights count once.
    return sum(p.numel() for p in model.parameters())


def _build_tiny(name: str, **extra: object) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    return zoo.build(name, **{**zoo.get(name).tiny_overrides, **extra})


def test_names_sorted_and_complete() -> None:
    assert ALL_NAMES == sorted(ALL_NAMES)
    assert set(ALL_NAMES) == EXPECTED_NAMES


@pytest.mark.parametrize("name", ALL_NAMES)
def test_tiny_forward_loss_backward(name: str) -> None:
    entry = zoo.get(name)
    model, inputs = _build_tiny(name, batch_size=3)
    assert isinstance(inputs, tuple) and all(t.shape[0] == 3 for t in inputs)
    _, targets = entry.make_batch(3, 0, **entry.tiny_overrides)
    loss = entry.loss_fn(model(*inputs), targets)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads), "every parameter takes part in the loss"
    assert any(bool(g.abs().sum() > 0) for g in grads if g is not None)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_symbolic_trace_reproduces_eager(name: str) -> None:
    model, inputs = _build_tiny(name)
    model.eval()  # BatchNorm running statistics must not change between the two calls
    traced = torch.fx.symbolic_trace(model)
    with torch.no_grad():
        torch.testing.assert_close(traced(*inputs), model(*inputs))


@pytest.mark.parametrize("name", ALL_NAMES)
def test_example_inputs_match_make_batch(name: str) -> None:
    entry = zoo.get(name)
    _, inputs = _build_tiny(name, batch_size=2, seed=5)
    batch_inputs, _ = entry.make_batch(2, 5, **entry.tiny_overrides)
    for example, batch in zip(inputs, batch_inputs, strict=True):
        torch.testing.assert_close(example, batch)


@pytest.mark.parametrize("name", PAPER_NAMES)
def test_paper_size_on_meta_matches_paper_params(name: str) -> None:
    entry = zoo.get(name)
    assert entry.paper_params is not None
    model, inputs = zoo.build(name, device="meta")  # time limit: benchmarks/unit_speed.py
    assert all(p.is_meta for p in model.parameters()) and all(t.is_meta for t in inputs)
    num_params = _num_unique_params(model)
    assert abs(num_params - entry.paper_params) <= 0.05 * entry.paper_params, (name, num_params)


@pytest.mark.parametrize("name", ["gpt2-small", "bert-48", "xlnet-36", "gnmt-16"])
def test_paper_size_traces_on_meta(name: str) -> None:
    model, _ = zoo.build(name, device="meta")
    graph_module = torch.fx.symbolic_trace(model)
    assert any(node.op == "call_module" for node in graph_module.graph.nodes)


def test_gpt_tied_weight_is_one_parameter() -> None:
    model, _ = zoo.build("gpt-mini")
    assert model.lm_head.weight is model.wte.weight
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    assert "lm_head.weight" in names and "wte.weight" in names
    unique = dict(model.named_parameters())
    assert "lm_head.weight" not in unique  # counted once


def test_tied_lm_reads_embedding_twice_in_graph() -> None:
    model, _ = zoo.build("tied-lm")
    graph_module = torch.fx.symbolic_trace(model)
    uses = [node for node in graph_module.graph.nodes
            if (node.op == "call_module" and node.target == "embedding")
            or (node.op == "get_attr" and node.target == "embedding.weight")]
    assert len(uses) == 2


def test_bert_mask_feeds_every_layer() -> None:
    num_layers = 3
    model, inputs = _build_tiny("bert-48", num_layers=num_layers)
    graph_module = torch.fx.symbolic_trace(model)
    node = next(n for n in graph_module.graph.nodes if n.op == "placeholder" and n.name == "attention_mask")
    while len(node.users) == 1:  # follow the mask -> additive bias chain to where it fans out
        node = next(iter(node.users))
    assert len(node.users) == num_layers
    input_ids, attention_mask = inputs
    attention_mask = attention_mask.clone()
    attention_mask[:, -4:] = 0
    assert not torch.allclose(model(input_ids, attention_mask), model(*inputs))


def test_skipnet_has_long_skips() -> None:
    model, _ = zoo.build("skipnet")
    graph_module = torch.fx.symbolic_trace(model)
    order = {node: index for index, node in enumerate(graph_module.graph.nodes)}
    spans = [order[user] - order[node] for node in graph_module.graph.nodes for user in node.users]
    assert max(spans) > 8


def test_gpt_mini_trains_quickly() -> None:
    entry = zoo.get("gpt-mini")
    model, _ = zoo.build("gpt-mini")
    inputs, targets = entry.make_batch(4, 0, block_size=16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(10):
        loss = entry.loss_fn(model(*inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0  # memorises one batch: ~5.5 -> ~2.5


def test_shorter_sequence_than_block_size() -> None:
    model, _ = zoo.build("gpt-mini")
    traced = torch.fx.symbolic_trace(model)
    tokens = torch.randint(0, 256, (2, 10))
    torch.testing.assert_close(traced(tokens), model(tokens))
    assert traced(tokens).shape == (2, 10, 256)


def test_build_is_deterministic_and_seeded() -> None:
    first, _ = zoo.build("mlp")
    second, _ = zoo.build("mlp")
    third, _ = zoo.build("mlp", seed=1)
    torch.testing.assert_close(first.state_dict(), second.state_dict())
    assert not torch.equal(first.layers[0].weight, third.layers[0].weight)


@pytest.mark.parametrize("name", ["gpt-mini", "bert-large", "gnmt-16", "resnet-50"])
def test_make_batch_deterministic(name: str) -> None:
    entry = zoo.get(name)
    first = entry.make_batch(3, 7, **entry.tiny_overrides)
    second = entry.make_batch(3, 7, **entry.tiny_overrides)
    other = entry.make_batch(3, 8, **entry.tiny_overrides)
    torch.testing.assert_close(first, second)
    assert not torch.equal(first[0][0], other[0][0])


def test_make_batch_shapes_follow_overrides() -> None:
    (images,), labels = zoo.get("vgg-19").make_batch(2, 0, image_size=32, num_classes=10)
    assert images.shape == (2, 3, 32, 32) and images.dtype == torch.float32
    assert labels.shape == (2,) and labels.dtype == torch.long and int(labels.max()) < 10
    (src, tgt), targets = zoo.get("gnmt-16").make_batch(2, 0, src_len=7, tgt_len=5)
    assert src.shape == (2, 7) and tgt.shape == (2, 5) and targets.shape == (2, 5)


def test_unknown_model_lists_names_and_closest() -> None:
    with pytest.raises(UnknownModelError) as info:
        zoo.build("bert48")
    message = str(info.value)
    assert "'bert-48'" in message.split("Known models")[0]
    assert all(name in message for name in ALL_NAMES)
    assert isinstance(info.value, ValueError)


def test_bad_override_names_key_and_valid_fields() -> None:
    with pytest.raises(ValueError, match="num_layrs") as info:
        zoo.build("bert-48", num_layrs=2)
    assert "num_layers" in str(info.value) and "batch_size" in str(info.value)
    with pytest.raises(ValueError, match="bogus"):
        zoo.get("mlp").make_batch(2, 0, bogus=1)
    with pytest.raises(ValueError, match="batch_size"):
        zoo.get("mlp").make_batch(0, 0)
