"""Sequence shards across a stage boundary: two sequence-parallel stages of the same T (threads, one communicator
per member) pass member j's token share to member j, and give one process's outputs and gradients exactly."""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from test_tensor_parallel_shard import AttentionBlock, _weighted_sum
from torch import Tensor, fx
from tp_threads import ThreadGroup, full_gradient, run_members

from fxpipe import passes
from fxpipe.compile_sequence_boundary import sequence_boundary
from fxpipe.core.program import tree_leaves
from fxpipe.passes import tensor_parallel_ops as ops
from fxpipe.passes.codegen import split_for_plan
from fxpipe.passes.tp_shard import TensorParallelStage, shard_stage
from tests import test_tensor_parallel_runtime as runtime_tests
from tests.mp_utils import run_ranks


def _output_node(gm: fx.GraphModule) -> str:
    (output,) = [node for node in gm.graph.nodes if node.op == "output"]
    return str(output.args[0])


def _shard(gm: fx.GraphModule, group: ThreadGroup, name: str, boundary: frozenset[str]) -> list[TensorParallelStage]:
    members = []
    for rank in range(group.size):
        key = f"test-seqshard-{name}-{group.size}-{rank}"
        ops.register_group(key, group.member(rank))
        members.append(shard_stage(copy.deepcopy(gm), group.size, rank, group_key=key, sequence_parallel=True,
                                   sequence_boundary=boundary))
    return members


@pytest.mark.parametrize("degree", [2, 4])
def test_two_stages_exchange_token_shares(degree: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 8, 32)
    first, second = (passes.trace(AttentionBlock(), x) for _ in range(2))
    # one process: the two stages in a row
    reference_x = x.clone().requires_grad_()
    ref_first, ref_second = copy.deepcopy(first), copy.deepcopy(second)
    middle = ref_first(reference_x)
    expected = ref_second(middle)
    _weighted_sum(expected).backward()
    group = ThreadGroup(degree)
    senders = _shard(first, group, "first", frozenset({_output_node(first)}))
    receivers = _shard(second, group, "second", frozenset({"x"}))
    assert all(s.sequence_boundary == {_output_node(first)} for s in senders)
    assert all(r.sequence_boundary == {"x"} for r in receivers)

    def work(rank: int) -> tuple[Tensor, Tensor, Tensor]:
        torch.set_num_threads(1)
        member_x = x.clone().requires_grad_()
        sent = senders[rank].module(member_x)
        received = sent.detach().requires_grad_()  # what the transport would carry: this member's share only
        output = receivers[rank].module(received)
        _weighted_sum(output).backward()
        assert received.grad is not None
        sent.backward(received.grad)  # the gradient goes back share to share
        assert member_x.grad is not None
        return sent.detach(), output.detach(), member_x.grad

    results = run_members(degree, work)
    shares = [sent for sent, _, _ in results]
    # each member sends 1/T of the boundary value: its own tokens, in member order
    assert all(share.numel() * degree == middle.numel() for share in shares)
    torch.testing.assert_close(torch.cat(shares, 1), middle.detach(), rtol=1e-5, atol=1e-5)
    for _, output, input_grad in results:
        torch.testing.assert_close(output, expected.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(input_grad, reference_x.grad, rtol=1e-4, atol=1e-5)
    for members, reference in ((senders, ref_first), (receivers, ref_second)):
        for parameter in members[0].parameters:
            grads = [(m.parameters[i], m.module.get_parameter(m.parameters[i].path).grad)
                     for m in members for i, p in enumerate(m.parameters) if p.path == parameter.path]
            torch.testing.assert_close(full_gradient(grads), reference.get_parameter(parameter.path).grad,
                                       rtol=1e-4, atol=1e-5, msg=lambda text, n=parameter.name: f"{n}: {text}")  # type: ignore[misc]


def test_boundary_applies_only_to_sequence_parallel_token_rows() -> None:
    x = torch.randn(2, 8, 32)
    gm = passes.trace(AttentionBlock(), x)
    group = ThreadGroup(2)
    members = _shard(gm, group, "whole", frozenset({"x", _output_node(gm), "no_such_value"}))
    # without sequence parallelism nothing is split, so nothing crosses split either
    plain = shard_stage(copy.deepcopy(gm), 2, 0, group_key="test-seqshard-whole-2-0",
                        sequence_boundary=frozenset({"x"}))
    assert plain.sequence_boundary == frozenset()
    assert members[0].sequence_boundary == {"x", _output_node(gm)}


# ---- the runtime: one 4-rank gloo world, 1x2:1x2 sequence-parallel against one process ----------------------------

def _counting_sends(step: Any) -> list[int]:
    """Run ``step`` with the driver's pack counting the bytes of the pieces each send carries; the counts."""
    from fxpipe.runtime.execution import driver as driver_module

    sent: list[int] = []
    original = driver_module.pack

    def pack(tensors: list[Tensor]) -> Tensor:
        sent.append(sum(t.numel() * t.element_size() for t in tensors))
        return original(tensors)

    driver_module.pack = pack  # type: ignore[assignment]
    try:
        step()
    finally:
        driver_module.pack = original  # type: ignore[assignment]
    return sent


def _run(rank: int, world_size: int, store_dir: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    reference = runtime_tests._reference("attention")
    results: dict[str, Any] = {}
    for index, sequence_parallel in enumerate((True, False)):
        with runtime_tests._world(store_dir, f"seqshard-{index}", rank, world_size):
            pipe = runtime_tests._compile("attention", runtime_tests._plan("attention", ((1, 2), (1, 2))),
                                          sequence_parallel=sequence_parallel)
            record = runtime_tests._train(pipe, "attention", reference)
            inputs, targets = runtime_tests._batches("attention")[0]
            sent = _counting_sends(functools.partial(pipe.step, inputs, targets))
            results[f"sp={sequence_parallel}"] = {
                "problems": record["problems"] + runtime_tests._inference(pipe, "attention", reference), "stage": pipe.stage_index, "sent": sum(sent),
                "split": dict(pipe.driver.token_split)}
    return results


@pytest.mark.multiprocess
def test_sequence_parallel_stages_send_token_shares_and_train_like_one_process(tmp_path: Path) -> None:
    per_rank = run_ranks(_run, 4, tmp_path, timeout_s=300.0)
    failures = [f"{name} rank {rank}: {problem}" for rank, results in enumerate(per_rank)
                for name, record in results.items() for problem in record["problems"][:3]]
    assert not failures, "\n".join(failures)
    # the block output between the stages crosses as token shares (T = 2) on every rank, only under SP
    assert all(results["sp=True"]["split"] and set(results["sp=True"]["split"].values()) == {2}
               for results in per_rank), [results["sp=True"]["split"] for results in per_rank]
    assert all(not results["sp=False"]["split"] for results in per_rank)
    # bytes each rank sends per step (stage 0: activations, stage 1: their gradients): 1/T of the whole values
    print({rank: (results["sp=False"]["sent"], results["sp=True"]["sent"]) for rank, results in enumerate(per_rank)})
    for rank, results in enumerate(per_rank):
        whole, shares = results["sp=False"]["sent"], results["sp=True"]["sent"]
        assert whole > 0 and shares * 2 == whole, (rank, shares, whole)


@pytest.mark.parametrize(("layout", "crosses"), [(((1, 2), (1, 2)), True), (((1, 2), (2, 1)), False),
                                                  (((1, 4), (1, 2)), False)])
def test_only_values_between_sequence_parallel_stages_of_one_t_cross_as_shares(
        layout: tuple[tuple[int, int], ...], crosses: bool) -> None:
    plan = runtime_tests._plan("attention", layout)
    module, example = runtime_tests.MODELS["attention"][0]()
    program = split_for_plan(passes.trace(module, (example,)), plan, example_inputs=(example,))
    first, first_split = sequence_boundary(program, plan, 0)
    second, second_split = sequence_boundary(program, plan, 1)
    assert first_split == second_split  # both sides agree
    if crosses:  # (batch, tokens, width) activations of the cut block; model inputs and logits stay whole
        assert first_split and set(first_split.values()) == {2}
        assert all(len(program.values[value].shape) == 3 for value in first_split)
        assert len(first) == len(second) == len(first_split)  # one node per value on each side
        assert not set(first_split) & {*program.model_inputs, *tree_leaves(program.output_tree)}
    else:
        assert not first and not second and not first_split
