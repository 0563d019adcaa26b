"""Predicted vs measured saved-activation peaks per stage on gloo ranks: the prediction at most 10 % under the
measurement, 25 % over."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.memory_fidelity import HIGHEST, LOWEST, SMALL_VGG, VOCAB_LM, Case, ratio, run

pytestmark = pytest.mark.multiprocess

# A vocabulary-heavy LM (the loss's log-softmax dwarfs the last stage's layers), two layouts.
CASES = (
    Case("gpt-mini", VOCAB_LM, "1:1:1:1"),
    Case("gpt-mini", VOCAB_LM, "2:1:1"),
)
# A CNN whose cut falls between a ReLU and a convolution that both save the crossing value: the later stage
# saves its received copy again (fxpipe.core.chain.Block.resaved)
CNN_CASES = (Case("vgg-19", SMALL_VGG, "2:2"),)
# Tensor-parallel members, without and with sequence parallelism: a column linear saves its whole input, the
# vocabulary-parallel loss one shard of the logits (its target logit is indexed, not gathered: gather's backward
# would keep the shard twice), norms and adds split only with sequence parallelism
TP_CASES = (Case("gpt-mini", VOCAB_LM, "1x2:1x2"), Case("gpt-mini", VOCAB_LM, "1x2:1x2", sequence_parallel=True))


def test_predicted_activation_peaks_match_measured_steps(tmp_path: Path) -> None:
    _check_within_bounds(run(CASES, str(tmp_path)))


def test_cnn_activation_peaks_match_measured_steps(tmp_path: Path) -> None:
    _check_within_bounds(run(CNN_CASES, str(tmp_path)), CNN_CASES)


def test_tensor_parallel_members_activation_peaks_match_measured_steps(tmp_path: Path) -> None:
    _check_within_bounds(run(TP_CASES, str(tmp_path)), TP_CASES)


def test_a_received_value_saved_for_backward_keeps_only_its_own_bytes(tmp_path: Path) -> None:
    """tied-lm's stage 1 receives two values in one message (its first norm's output, which its first linear saves,
    and the residual) and is predicted exactly: each received piece is its own storage, so the saved one does not
    keep the message's other piece and header alive (before: one value too many per micro-batch in flight)."""
    rows = run((Case("tied-lm", (), "1:1:1:1"),), str(tmp_path))
    stage = next(row for row in rows if row["stage"] == 1)
    assert stage["inflight"] > 1 and stage["predicted"] > 0
    assert abs(ratio(stage) - 1.0) < 0.01, (stage["predicted"], stage["measured"])


def _check_within_bounds(rows: list[dict[str, Any]], cases: tuple[Case, ...] = CASES) -> None:
    assert {row["case"] for row in rows} == set(cases)
    outside = [(row["case"].describe(), row["case"].layout, row["stage"], row["predicted"], row["measured"])
               for row in rows if not LOWEST <= ratio(row) <= HIGHEST]
    assert not outside, f"(model, layout, stage, predicted, measured) outside [{LOWEST}, {HIGHEST}]: {outside}"
    last = [row for row in rows if row["case"].model == "gpt-mini" and row["stage"] == 2 and row["case"].layout == "2:1:1"]
    assert cases is not CASES or (last and last[0]["predicted"] > 2 * 2**20)  # the loss's log-softmax: 4 x 32 x 4096 x 4 B
