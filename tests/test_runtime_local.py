"""Runtime pieces without a process group: row routes, tags, buffers, output trees, autocast dtypes, action lists."""

from __future__ import annotations

import pytest
import torch

from fxpipe import models as zoo
from fxpipe.core.plan import Plan, StagePlan
from fxpipe.core.schedule import Action, Op
from fxpipe.passes import trace
from fxpipe.passes.codegen import split_for_plan
from fxpipe.runtime.execution.driver import check_world, lowered_actions
from fxpipe.runtime.execution.stage import rebuild_tree
from fxpipe.runtime.faults.errors import CommunicationError, MessageLayoutError, PipelineSetupError
from fxpipe.runtime.transport.batch_layout import infer_value_dtypes
from fxpipe.runtime.transport.comm import (
    PACK_ALIGN,
    MessageKind,
    Route,
    buffer_shape,
    check_header,
    header_bytes,
    header_view,
    message_tag,
    pack,
    packed_bytes,
    routes_between,
    slice_rows,
    unpack,
)
from tests.mp_utils import plan_from_cuts

torch.set_num_threads(1)


def test_routes_three_senders_to_one_receiver_cover_the_micro_batch() -> None:
    # micro-batch of 4 rows: senders hold rows [0,2) [2,3) [3,4); the single receiver holds all four
    routes = routes_between("h", True, 4, (0, 1, 2), (3,))
    assert routes == (
        Route("h", 0, 3, (0, 2), (0, 2)),
        Route("h", 1, 3, (0, 1), (2, 3)),
        Route("h", 2, 3, (0, 1), (3, 4)),
    )


def test_routes_between_uneven_replica_counts_share_exact_rows() -> None:
    # 5 rows, 2 senders [0,3) [3,5) -> 3 receivers [0,2) [2,4) [4,5)
    routes = routes_between("h", True, 5, (0, 1), (2, 3, 4))
    assert routes == (
        Route("h", 0, 2, (0, 2), (0, 2)),
        Route("h", 0, 3, (2, 3), (0, 1)),
        Route("h", 1, 3, (0, 1), (1, 2)),
        Route("h", 1, 4, (1, 2), (0, 1)),
    )
    received = {}
    for route in routes:
        start, stop = route.receiver_rows  # type: ignore[misc]
        received.setdefault(route.receiver_rank, 0)
        received[route.receiver_rank] += stop - start
    assert received == {2: 2, 3: 2, 4: 1}


def test_unbatched_values_go_whole_from_sender_j_mod_senders() -> None:
    routes = routes_between("mask", False, 6, (0, 1), (2, 3, 4))
    assert [(r.sender_rank, r.receiver_rank, r.sender_rows) for r in routes] == [(0, 2, None), (1, 3, None),
                                                                                  (0, 4, None)]


def test_slice_rows_follow_micro_batch_then_replica() -> None:
    assert [slice_rows(1, 4, r, 3) for r in range(3)] == [(4, 6), (6, 7), (7, 8)]


def test_buffer_shape_scales_only_batched_dim_zero() -> None:
    assert buffer_shape((4, 8, 16), True, 3) == (3, 8, 16)
    assert buffer_shape((8, 16), False, 3) == (8, 16)


def test_message_tags_are_unique_per_kind_microbatch_and_value() -> None:
    tags = {message_tag(kind, m, v, 5) for kind in MessageKind for m in range(4) for v in range(5)}
    assert len(tags) == len(MessageKind) * 4 * 5


def test_pack_then_unpack_gives_every_piece_back_bit_exact_with_its_dtype() -> None:
    pieces = [torch.randn(2, 3, 5), torch.rand(3) > 0.5, torch.randn(4, 4).t(), torch.arange(7, dtype=torch.int64),
              torch.randn(2, 3).to(torch.bfloat16), torch.tensor(2.5)]
    buffer = pack(pieces)
    layouts = [(tuple(p.shape), p.dtype) for p in pieces]
    assert buffer.dtype == torch.uint8 and buffer.numel() == packed_bytes(layouts)
    for got, want in zip(unpack(buffer, layouts), pieces, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
        assert (got.storage_offset() * got.element_size()) % PACK_ALIGN == 0
        assert got.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # views, no copy


def test_packed_bytes_pads_each_piece_to_the_alignment_behind_the_header() -> None:
    layouts = [((3,), torch.bool), ((1,), torch.float32), ((4,), torch.float64)]
    # header: magic, payload bytes, piece count, then (dtype code, elements) per piece = 9 int64 words -> 80 bytes
    assert header_bytes(3) == 80
    assert packed_bytes(layouts) == 80 + PACK_ALIGN + PACK_ALIGN + 2 * PACK_ALIGN


def test_unpack_rejects_a_message_of_the_wrong_size() -> None:
    with pytest.raises(CommunicationError, match="packed message has 8 bytes but its pieces need 64"):
        unpack(torch.empty(8, dtype=torch.uint8), [((2,), torch.float32)])


def test_a_header_names_the_value_and_both_dtypes_when_the_sender_sent_another_dtype() -> None:
    """The autocast corruption: bfloat16 sent, float32 expected; gloo leaves the rest of the buffer unwritten."""
    sent = pack([torch.ones(2, 3, dtype=torch.bfloat16), torch.zeros(4)])
    expected = [((2, 3), torch.float32), ((4,), torch.float32)]
    buffer = torch.full((packed_bytes(expected),), 255, dtype=torch.uint8)
    buffer[:sent.numel()] = sent  # what gloo does with a shorter message
    words = header_view(buffer, 2).tolist()
    with pytest.raises(MessageLayoutError, match=r"receive 'h' from rank 0 \(stage 0\): 'h': expected torch.float32 of "
                       r"shape \(2, 3\) \(6 elements\), received torch.bfloat16 with 6 elements"):
        check_header(words, expected, ["h", "mask"], "receive 'h' from rank 0 (stage 0)")
    check_header(header_view(sent, 2).tolist(), [((2, 3), torch.bfloat16), ((4,), torch.float32)], ["h", "mask"], "")
    with pytest.raises(MessageLayoutError, match="not the expected 2 piece"):
        check_header([0] * 7, expected, ["h", "mask"], "receive")


def test_rebuild_tree_restores_nested_outputs() -> None:
    tree = {"logits": "a", "extra": ("b", None, ["c"])}
    assert rebuild_tree(tree, {"a": 1, "b": 2, "c": 3}) == {"logits": 1, "extra": (2, None, [3])}


def _two_stage_program(name: str = "tied-lm") -> tuple[Plan, object]:
    entry = zoo.get(name)
    model, example_inputs = zoo.build(name, **entry.tiny_overrides)
    gm = trace(model, example_inputs)
    plan = plan_from_cuts(gm, (1, 1), 4, 2)
    return plan, split_for_plan(gm, plan)


def test_autocast_dtypes_make_bf16_receive_buffers() -> None:
    _, program = _two_stage_program()
    plain = infer_value_dtypes(program, torch.device("cpu"), None)  # type: ignore[arg-type]
    mixed = infer_value_dtypes(program, torch.device("cpu"), torch.bfloat16)  # type: ignore[arg-type]
    crossing = [name for name, producer in program.producers.items() if producer == 0]  # type: ignore[attr-defined]
    assert crossing and all(plain[name] == torch.float32 for name in crossing)
    leaves = [program.output_tree] if isinstance(program.output_tree, str) else []  # type: ignore[attr-defined]
    assert leaves and mixed[leaves[0]] == torch.bfloat16  # the tied head is a linear: bf16 under autocast


def test_lowered_actions_for_the_middle_stage_of_gpipe() -> None:
    stages = tuple(StagePlan(i, i, i + 1, 1, (i,), ("x",)) for i in range(3))
    plan = Plan(global_batch_size=4, num_microbatches=2, stages=stages, schedule="gpipe")
    assert lowered_actions(plan, 1) == (
        Action(Op.RECV_ACTIVATION, 0), Action(Op.FORWARD, 0), Action(Op.SEND_ACTIVATION, 0),
        Action(Op.RECV_ACTIVATION, 1), Action(Op.FORWARD, 1), Action(Op.SEND_ACTIVATION, 1),
        Action(Op.RECV_GRADIENT, 1), Action(Op.BACKWARD, 1), Action(Op.SEND_GRADIENT, 1),
        Action(Op.RECV_GRADIENT, 0), Action(Op.BACKWARD, 0), Action(Op.SEND_GRADIENT, 0),
        Action(Op.ALLREDUCE),
    )


def test_world_size_must_match_the_plan() -> None:
    plan, program = _two_stage_program()
    check_world(plan, program, 2)  # type: ignore[arg-type]
    with pytest.raises(PipelineSetupError, match="--nproc-per-node=2"):
        check_world(plan, program, 4)  # type: ignore[arg-type]
