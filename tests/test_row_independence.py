"""Rows of a batch must not see each other when a plan splits the batch: exact checks of the row test, and
compile refusing (on every rank) a model that mixes rows, while check_rows=False and unsplit plans pass."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from fxpipe.passes.batchdims import BatchDimError
from fxpipe.passes.row_independence import check_rows_independent
from tests.mp_utils import join_world, leave_world, run_ranks


class RowWise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.norm = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.relu(self.norm(self.a(x)))))


class CentresOverTheBatch(nn.Module):
    """A normalisation over the batch written by hand: every row's output depends on every other row."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.a(x)
        return self.b(hidden - hidden.mean(0, keepdim=True))


class SeqFirst(nn.Module):
    """(T, B, C) attention over T: dim 0 is the sequence, dim 1 the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


class WithExtras(nn.Module):
    """A batched output, an unbatched one (a scalar) and an integer one, as dict values."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.a(x) * scale
        return {"out": out, "total": out.sum(), "argmax": out.argmax(-1)}


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def test_row_wise_models_pass_and_keep_their_mode_and_rng() -> None:
    torch.manual_seed(0)
    model = RowWise().train()
    before = torch.random.get_rng_state()
    stats = model.norm.running_mean.clone()
    check_rows_independent(model, {"x": _x(8, 4)}, (0,))
    assert model.training and all(m.training for m in model.modules())
    assert torch.equal(torch.random.get_rng_state(), before)
    assert torch.equal(model.norm.running_mean, stats)  # eval mode: batch norm statistics untouched


def test_unbatched_and_integer_outputs_are_skipped_and_a_shared_input_is_passed_whole() -> None:
    check_rows_independent(WithExtras(), {"x": _x(6, 4), "scale": torch.full((1, 3), 2.0)}, (0, None))


def test_a_model_mixing_rows_is_refused_naming_the_output_and_the_fix() -> None:
    with pytest.raises(BatchDimError) as error:
        check_rows_independent(CentresOverTheBatch(), {"x": _x(8, 4)}, (0,))
    message = str(error.value)
    assert "not independent" in message and "first 4 of 8 rows" in message and "dim 0 of 'x'" in message
    assert "check_rows=False" in message and "num_microbatches=1" in message and "the model's output" in message


def test_a_seq_first_model_declared_batch_first_is_refused_and_passes_with_the_right_dim() -> None:
    torch.manual_seed(0)
    model, x = SeqFirst(), _x(5, 6, 8)
    with pytest.raises(BatchDimError, match="output for the first 2 of 5 rows"):
        check_rows_independent(model, {"x": x}, (0,))
    check_rows_independent(model, {"x": x}, (1,))


def test_one_row_and_meta_inputs_cannot_be_checked_and_pass() -> None:
    check_rows_independent(CentresOverTheBatch(), {"x": _x(1, 4)}, (0,))
    check_rows_independent(CentresOverTheBatch().to("meta"), {"x": torch.empty(8, 4, device="meta")}, (0,))


def _compile_cases(rank: int, world_size: int, store_dir: str) -> dict[str, str]:
    import fxpipe

    join_world(store_dir, f"rows-{world_size}", rank, world_size)
    torch.manual_seed(0)
    inputs, loss = (_x(8, 4),), nn.functional.mse_loss
    results = {}
    cases = {"split": {"plan": "dp"}, "unchecked": {"plan": "dp", "check_rows": False}}
    for name, options in (cases if world_size > 1 else {"unsplit": {"plan": "dp"}}).items():
        try:
            fxpipe.compile(CentresOverTheBatch(), inputs, loss_fn=loss, global_batch_size=8, **options)
            results[name] = "compiled"
        except BatchDimError as error:  # RemoteSetupError on ranks that did not fail would also name it
            results[name] = f"{type(error).__name__}: {error}"
        except Exception as error:  # noqa: BLE001  (reported to the test, which fails naming it)
            results[name] = f"{type(error).__name__}: {error}"
    leave_world()
    return results


@pytest.mark.multiprocess
def test_compile_refuses_on_every_rank_unless_unsplit_or_unchecked(tmp_path: Any) -> None:
    for rank, result in enumerate(run_ranks(_compile_cases, 2, tmp_path)):
        assert result["split"].startswith("BatchDimError") and "not independent" in result["split"], (rank, result)
        assert result["unchecked"] == "compiled", (rank, result)
    (alone,) = run_ranks(_compile_cases, 1, tmp_path)  # plan dp on one rank, M=1: nothing is split
    assert alone == {"unsplit": "compiled"}
