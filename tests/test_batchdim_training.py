"""Issue #16 item 5 on 3 gloo ranks (layout 2:1): a seq-first TransformerEncoder with ``batch_dims=1`` trains as
one process on the whole batch, for T != B and T == B (there with partial data: each rank only its rows, along
dim 1); T == B without ``batch_dims`` and a wrong declaration are refused at compile on every rank."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.passes import trace
from fxpipe.runtime.transport.rows import gather_rows
from tests.exactness_oracle import train_and_compare, train_reference
from tests.mp_utils import plan_from_cuts, run_ranks, run_scenarios

pytestmark = pytest.mark.multiprocess

WORLD_SIZE = 3
GLOBAL_BATCH = 6
NUM_STEPS = 3
WIDTH = 8


class SeqFirstEncoder(nn.Module):
    """(T, B, WIDTH) -> (T, B, 3): a position table over T, two encoder layers (batch_first=False), a head."""

    def __init__(self, seq_len: int) -> None:
        super().__init__()
        self.positions = nn.Parameter(torch.randn(seq_len, 1, WIDTH) * 0.1)  # (T, 1, C): per position, not per row
        # bias=False: the attention key bias has a zero gradient in exact arithmetic, so AdamW would turn
        # float rounding there into lr-sized steps that differ between any two summation orders
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(WIDTH, 2, 16, dropout=0.0, batch_first=False, bias=False) for _ in range(2))
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.positions                        # (T, B, C)
        for layer in self.layers:
            x = layer(x)                              # (T, B, C): attention over T, rows of B apart
        return self.head(x)                           # (T, B, 3)


class BatchFirstPool(nn.Module):
    """(B, T, WIDTH) -> (B, 3): pools over T, so dim 1 is not the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(WIDTH, WIDTH)
        self.second = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x))).mean(1)


def _batches(seq_len: int, seed: int) -> list[Any]:
    generator = torch.Generator().manual_seed(seed)
    return [((torch.randn(seq_len, GLOBAL_BATCH, WIDTH, generator=generator),),
             torch.randn(seq_len, GLOBAL_BATCH, 3, generator=generator)) for _ in range(NUM_STEPS)]


def _model(seq_len: int) -> nn.Module:
    torch.manual_seed(0)
    return SeqFirstEncoder(seq_len)


def _plan(model: nn.Module, example_inputs: Any, **trace_options: Any) -> fxpipe.Plan:
    return plan_from_cuts(trace(copy.deepcopy(model), example_inputs, **trace_options), (2, 1), GLOBAL_BATCH, 2)


def _error_of(action: Any) -> str:
    try:
        action()
    except Exception as error:  # the test compares the messages of every rank
        return f"{type(error).__name__}: {error}"
    return "no error"


class _PartialPipe:
    """Each rank passes step() only the rows it reads (partial=True), gathered along dim 1 of inputs and targets."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pipe, name)

    def step(self, inputs: Any, targets: Any) -> float:
        return self.pipe.step((gather_rows(inputs[0], self.pipe.input_rows(), 1),),
                              gather_rows(targets, self.pipe.target_rows(), 1), partial=True)


def _seq_first_scenario(seq_len: int, *, partial: bool = False) -> dict[str, Any]:
    model = _model(seq_len)
    batches = _batches(seq_len, 40 + seq_len)
    reference = train_reference(copy.deepcopy(model), F.mse_loss, batches)
    example_inputs = batches[0][0]
    pipe = fxpipe.compile(model, example_inputs, loss_fn=F.mse_loss, global_batch_size=GLOBAL_BATCH,
                          plan=_plan(model, example_inputs, batch_dims=1), batch_dims=1)
    record = train_and_compare(_PartialPipe(pipe) if partial else pipe, batches, reference)
    if not torch.allclose(torch.tensor(record["losses"]), torch.tensor(reference["losses"]), rtol=1e-5):
        record["problems"].append(f"losses {record['losses']} != reference {reference['losses']}")
    record["batch_dims"] = sorted({spec.batch_dim for spec in pipe.program.values.values() if spec.batched})
    return record


def _ambiguous_scenario() -> str:
    """T == B and no batch_dims: refused (guessing dim 0 would split the sequence)."""
    model = _model(GLOBAL_BATCH)
    example_inputs = _batches(GLOBAL_BATCH, 1)[0][0]
    plan = _plan(model, example_inputs, batch_dims=1)
    return _error_of(lambda: fxpipe.compile(model, example_inputs, loss_fn=F.mse_loss,
                                            global_batch_size=GLOBAL_BATCH, plan=plan))


def _wrong_declaration_scenario() -> str:
    """A batch-first model declared batch_dims=1: its output pools dim 1 away, so the declaration is refused."""
    torch.manual_seed(0)
    model = BatchFirstPool()
    example_inputs = (torch.randn(GLOBAL_BATCH, 5, WIDTH),)
    plan = plan_from_cuts(trace(copy.deepcopy(model), example_inputs), (2, 1), GLOBAL_BATCH, 2)
    return _error_of(lambda: fxpipe.compile(model, example_inputs, loss_fn=F.mse_loss,
                                            global_batch_size=GLOBAL_BATCH, plan=plan, batch_dims=1))


SCENARIOS = {
    "T != B": lambda: _seq_first_scenario(5),
    "T == B": lambda: _seq_first_scenario(GLOBAL_BATCH, partial=True),
    "ambiguous": _ambiguous_scenario,
    "wrong declaration": _wrong_declaration_scenario,
}


def _all_scenarios(rank: int, world_size: int, store_dir: str) -> dict[str, Any]:
    return run_scenarios(SCENARIOS, rank, world_size, store_dir, "batchdim")


def test_seq_first_batch_dims_match_one_process(tmp_path: Any) -> None:
    per_rank = run_ranks(_all_scenarios, WORLD_SIZE, tmp_path)
    failures = []
    for name in ("T != B", "T == B"):
        for rank, result in enumerate(ranks[name] for ranks in per_rank):
            if result["problems"]:
                failures.append(f"{name} rank {rank}: {result['problems'][:10]}")
            if result["batch_dims"] != [1]:
                failures.append(f"{name} rank {rank}: cut values' batch dims {result['batch_dims']} != [1]")
        if len({tuple(ranks[name]["losses"]) for ranks in per_rank}) != 1:
            failures.append(f"{name}: ranks report different losses")
    for rank, ranks in enumerate(per_rank):
        ambiguous, wrong = ranks["ambiguous"], ranks["wrong declaration"]
        if not ambiguous.startswith("BatchDimError") or "batch_dims={'x': 1}" not in ambiguous:
            failures.append(f"ambiguous, rank {rank}: {ambiguous}")
        if not wrong.startswith("BatchDimError") or "dim 1 of input 'x'" not in wrong or "dim 0" not in wrong:
            failures.append(f"wrong declaration, rank {rank}: {wrong}")
    assert not failures, "\n".join(failures)
