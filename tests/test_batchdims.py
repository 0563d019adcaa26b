"""The batch dimension (issue #16 item 5): declared dims, each value's derived dim, split/concat along it, the errors."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import fx, nn

from fxpipe.core.meta import COST as COST_KEY
from fxpipe.core.program import SplitProgram
from fxpipe.passes import annotate_costs, trace
from fxpipe.passes.batchdims import (
    MERGED,
    BatchDimError,
    default_batch_dims,
    derive_batch_dim,
    resolve_batch_dims,
    resolve_target_dim,
)
from fxpipe.passes.codegen import CodegenError, split_stages
from fxpipe.passes.codegen_io import export_program, load_program
from fxpipe.passes.costs import BATCH
from fxpipe.passes.profile import resize_batch
from fxpipe.runtime.faults.errors import BatchShapeError
from fxpipe.runtime.transport.batchcheck import (
    BatchMismatchError,
    check_shapes,
    describe_batch_dims,
    raise_on_difference,
)
from fxpipe.runtime.transport.comm import buffer_shape, take_rows

T, B, C = 5, 4, 8  # sequence length, batch, width


class SeqFirst(nn.Module):
    """(T, B, C) -> (T, B, 3), seq-first: the attention mixes T, never B."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(C, C)
        self.layer = nn.TransformerEncoderLayer(C, 2, 16, dropout=0.0, batch_first=False)
        self.head = nn.Linear(C, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.inp(x)))


class Flattens(nn.Module):
    """Merges T and B into rows (a (T*B, C) value), then splits them again."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(C, C)
        self.second = nn.Linear(C, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = self.first(x).reshape(-1, C)
        return self.second(flat).reshape(x.shape)


class Pools(nn.Module):
    """(B, T, C) -> (B, 3): batch-first, pools over dim 1."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(C, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.first(x).mean(1)


def _compute_nodes(gm: fx.GraphModule) -> list[str]:
    return [node.name for node in gm.graph.nodes if node.op not in ("placeholder", "output", "get_attr")]


def _halves(gm: fx.GraphModule) -> list[list[str]]:
    """Two stages, cut after the input projection (inside the attention, export graphs merge B with the heads)."""
    names = _compute_nodes(gm)
    nodes = {node.name: node for node in gm.graph.nodes}
    cut = 1 + max(i for i, name in enumerate(names) if nodes[name].meta.get("fxpipe.module_path") == "inp")
    return [names[:cut], names[cut:]]


def test_resolve_batch_dims_forms() -> None:
    x, mask, scale = torch.zeros(T, B, C), torch.zeros(B, T), torch.zeros(())
    names = ("x", "mask", "scale")
    assert resolve_batch_dims(names, (x, mask, scale), {"x": 1}) == (1, 0, None)
    assert resolve_batch_dims(names, (x, torch.zeros(T, B), scale), 1) == (1, 1, None)
    assert resolve_batch_dims(names, (x, torch.zeros(B, T), scale), -2) == (1, 0, None)  # -2: dim 1 of 3, dim 0 of 2
    assert default_batch_dims((x, torch.zeros(T), torch.zeros(3), scale)) == (0, 0, None, None)
    assert resolve_batch_dims(names, (x, mask, scale), None) == (0, None, None)  # mask's dim 0 has B != T rows
    assert resolve_target_dim(1, None) == 1
    assert resolve_target_dim({"x": 1}, None) == 0
    assert resolve_target_dim({"x": 1}, 1) == 1


@pytest.mark.parametrize(("batch_dims", "message"), [
    ({"y": 1}, "batch_dims names ['y'], which are not model inputs ['x']"),
    (3, "batch_dims says input 'x' has its batch in dim 3, but it has shape (5, 4, 8) (3 dims)"),
    ("1", "batch_dims is a str; give an int (every input) or a dict"),
    ({"x": 1.0}, "batch_dims for input 'x' is 1.0; give an int dim"),
])
def test_resolve_batch_dims_errors(batch_dims: Any, message: str) -> None:
    with pytest.raises(BatchDimError) as error:
        resolve_batch_dims(("x",), (torch.zeros(T, B, C),), batch_dims)
    assert message in str(error.value)


def test_inputs_disagreeing_on_the_declared_batch_are_refused() -> None:
    with pytest.raises(BatchDimError, match=r"'x' dim 1: 4, 'y' dim 0: 5"):
        resolve_batch_dims(("x", "y"), (torch.zeros(T, B, C), torch.zeros(T, 2)), {"x": 1})
    with pytest.raises(BatchDimError, match="target_batch_dim=-1"):
        resolve_target_dim(None, -1)


@pytest.mark.parametrize(("shape", "shape_next", "expected"), [
    ((4, 3), (5, 3), 0),
    ((5, 4, 8), (5, 5, 8), 1),
    ((5, 4, 8), (5, 4, 8), None),     # does not follow the batch: a constant
    ((20, 8), (25, 8), MERGED),       # (T*B, C): the batch merged with T
    ((4, 4), (5, 5), MERGED),         # the batch in two dims
    ((4, 8), (6, 8), MERGED),         # two rows more per row
    ((4, 8), (5, 8, 1), MERGED),
])
def test_derive_batch_dim(shape: tuple[int, ...], shape_next: tuple[int, ...], expected: int | None) -> None:
    assert derive_batch_dim(torch.empty(shape), torch.empty(shape_next), 4) == expected


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_seq_first_batch_is_symbolic_and_every_cut_value_has_dim_1(frontend: str) -> None:
    model = SeqFirst()
    gm = trace(model, (torch.randn(T, B, C),), batch_dims=1, frontend=frontend)
    assert gm.meta["fxpipe.batch_dims"] == (1,) and gm.meta["fxpipe.batch_dims_declared"] is True
    if frontend == "export":
        assert gm.meta["fxpipe.symbolic_batch"] is True
    costed = annotate_costs(gm)
    assert costed.meta["fxpipe.cost_mode"] == "symbolic"
    (placeholder,) = [node for node in costed.graph.nodes if node.op == "placeholder"]
    assert placeholder.meta[COST_KEY].output_bytes == T * C * 4 * BATCH  # per sample: a (T, C) slice
    program = split_stages(gm, _halves(gm))
    batched = {name: spec.batch_dim for name, spec in program.values.items() if spec.batched}
    assert set(batched.values()) == {1} and len(batched) == len(program.values)
    assert program.values["x"].shape == (T, B, C)


def _run_split(program: SplitProgram, x: torch.Tensor, parts: list[tuple[int, int]]) -> torch.Tensor:
    """Stage by stage, each stage on row slices along each value's batch dim, outputs concatenated back."""
    values: dict[str, torch.Tensor] = {"x": x}
    for stage in program.stages:
        pieces = []
        for start, stop in parts:
            args = [take_rows(values[name], program.values[name].batch_dim, start, stop) for name in stage.input_values]
            pieces.append(stage.module(*args))
        for index, name in enumerate(stage.output_values):
            values[name] = torch.cat([piece[index] for piece in pieces], program.values[name].batch_dim)
    return values[program.output_tree]


def test_split_and_concat_along_dim_1_equal_the_eager_model() -> None:
    model = SeqFirst().eval()
    gm = trace(model, (torch.randn(T, B, C),), batch_dims=1)
    program = split_stages(gm, _halves(gm))
    x = torch.randn(T, 7, C)  # another batch: 7 rows as 3 + 4
    with torch.no_grad():
        torch.testing.assert_close(_run_split(program, x, [(0, 3), (3, 7)]), model(x), rtol=1e-5, atol=1e-6)


def test_batch_dim_survives_export(tmp_path: Path) -> None:
    gm = trace(Flattens(), (torch.randn(T, B, C),), batch_dims=1)
    names = _compute_nodes(gm)
    program = split_stages(gm, [names[:1], names[1:]])
    export_program(program, tmp_path)
    loaded = load_program(tmp_path)
    assert {name: spec.batch_dim for name, spec in loaded.values.items()} == \
        {name: spec.batch_dim for name, spec in program.values.items()}
    x = torch.randn(T, B + 3, C)  # the exported stages' batch is symbolic in dim 1
    with torch.no_grad():
        torch.testing.assert_close(_run_split(loaded, x, [(0, B + 3)]), _run_split(program, x, [(0, B + 3)]),
                                   rtol=0, atol=0)


def test_t_equal_b_without_batch_dims_is_ambiguous() -> None:
    model = SeqFirst()
    with pytest.raises(BatchDimError) as error:
        trace(model, (torch.randn(B, B, C),))
    assert "input 'x' has shape (4, 4, 8): dims 0 and 1 both have 4 rows" in str(error.value)
    assert "batch_dims={'x': 1}" in str(error.value) and "batch_dims=0 to confirm dim 0" in str(error.value)
    assert trace(model, (torch.randn(B, B, C),), batch_dims=0).meta["fxpipe.batch_dims"] == (0,)
    assert trace(model, (torch.randn(T, B, C),)).meta["fxpipe.batch_dims"] == (0,)  # T != B: nothing to tell apart
    square = nn.Sequential(nn.Linear(B, 16), nn.ReLU())  # (B, B) into Linear(B, ...): dim 1 cannot grow
    assert trace(square, (torch.randn(B, B),)).meta["fxpipe.batch_dims"] == (0,)


def test_a_declared_dim_the_outputs_do_not_keep_is_refused() -> None:
    gm = trace(Pools(), (torch.randn(B, T, C),), batch_dims=1)
    with pytest.raises(BatchDimError) as error:
        split_stages(gm, [_compute_nodes(gm)])
    message = str(error.value)
    assert "batch_dims declares dim 1 of input 'x' (shape (4, 5, 8)) as the batch" in message
    assert "growing its dim 0 instead grows output 'mean' in dim 0, so the model treats dim 0 as the batch" in message


def test_a_cut_through_a_merged_batch_is_refused() -> None:
    gm = trace(Flattens(), (torch.randn(T, B, C),), batch_dims=1)
    names = _compute_nodes(gm)
    cut = names.index("second")  # 'reshape' (T*B, C) crosses this cut
    with pytest.raises(CodegenError, match=r"value 'reshape' of shape \(20, 8\) grows with the batch but no single "
                                           r"dim holds it \(one more sample gives \(25, 8\)"):
        split_stages(gm, [names[:cut], names[cut:]])
    program = split_stages(gm, [names[:1], names[1:]])  # after 'first': a (T, B, C) value, dim 1
    assert program.values["first"].batch_dim == 1


def test_rows_and_shapes_along_the_batch_dim() -> None:
    value = torch.arange(2 * 6 * 3).reshape(2, 6, 3)
    assert torch.equal(take_rows(value, 1, 2, 5), value[:, 2:5])
    assert take_rows(value, 1, 0, 6) is value
    assert buffer_shape((5, 4, 8), True, 3, 1) == (5, 3, 8)
    assert buffer_shape((5, 4, 8), False, 3, 1) == (5, 4, 8)
    gm = trace(SeqFirst(), (torch.randn(T, B, C),), batch_dims=1)
    program = split_stages(gm, _halves(gm))
    check_shapes(program, (torch.randn(T, 6, C),), torch.randn(T, 6, 3), num_rows=6, reads=None,
                 reads_targets=True, target_batch_dim=1)
    with pytest.raises(BatchShapeError, match=r"plan expects \(5, 6, 8\) torch.float32 \(batch in dim 1;"):
        check_shapes(program, (torch.randn(6, 6, C),), None, num_rows=6, reads=None, reads_targets=False)
    with pytest.raises(BatchShapeError, match=r"targets have 5 rows in their batch dim 0 \(shape \(5, 6, 3\)\)"):
        check_shapes(program, (torch.randn(T, 6, C),), torch.randn(T, 6, 3), num_rows=6, reads=None,
                     reads_targets=True)


def test_measured_costs_resize_the_batch_dim() -> None:
    value = torch.arange(6).reshape(2, 3)
    assert resize_batch(value, 5, 1).tolist() == [[0, 1, 2, 0, 1], [3, 4, 5, 3, 4]]
    assert resize_batch(value, 1, 0).tolist() == [[0, 1, 2]]
    assert resize_batch(value, 5, None) is value


class Aliased(nn.Module):
    """One Linear under two names, as torch.distributed.pipelining's ModelWithParamAlias."""

    def __init__(self) -> None:
        super().__init__()
        self.lin0 = self.lin1 = nn.Linear(B, B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin1(torch.relu(self.lin0(x)))


def test_the_ambiguity_probe_leaves_the_model_as_it_was() -> None:
    """The same tensors afterwards, with no weak reference (module.to() cannot swap a parameter that has one)."""
    for model, x in ((nn.Sequential(nn.Linear(B, 16)), torch.randn(B, B)), (Aliased(), torch.randn(B, B)),
                     (SeqFirst(), torch.randn(B, B, C))):  # the probe fails, fails, succeeds
        before = dict(model.named_parameters(remove_duplicate=False))
        try:
            trace(model, (x,))
        except BatchDimError:
            pass
        after = dict(model.named_parameters(remove_duplicate=False))
        assert all(after[name] is tensor for name, tensor in before.items())
        assert [name for name, p in after.items() if weakref.getweakrefcount(p)] == []


def test_a_seq_first_model_left_at_dim_0_refuses_its_real_batches() -> None:
    """T != B and no batch_dims: dim 0 (T) is taken as the batch; real (T, G, C) batches never fit the plan."""
    gm = trace(SeqFirst(), (torch.randn(T, B, C),))
    assert gm.meta["fxpipe.batch_dims"] == (0,)
    program = split_stages(gm, _halves(gm))
    assert {spec.batch_dim for spec in program.values.values() if spec.batched} == {0}
    for global_batch in (T, B, 6):
        with pytest.raises(BatchShapeError, match=r"input 'x' has shape \(5, \d+, 8\)"):
            check_shapes(program, (torch.randn(T, global_batch, C),), torch.randn(T, global_batch, 3),
                         num_rows=global_batch, reads=None, reads_targets=True)


def test_batch_mismatch_messages_name_the_batch_dims() -> None:
    gm = trace(SeqFirst(), (torch.randn(T, B, C),), batch_dims=1)
    where = describe_batch_dims(split_stages(gm, _halves(gm)), 1)
    assert where == "batch in dim 1 of 'x', dim 1 of the targets"
    with pytest.raises(BatchMismatchError, match=r"other shapes or dtypes than rank 0 \(batch in dim 1 of 'x', dim 1 "
                                                 r"of the targets\)"):
        raise_on_difference([(1, 5), (2, 5)], where)


@pytest.mark.parametrize("text, expected", [("1", 1), (" 0 ", 0), ("x=1", {"x": 1}), ("x=1, mask=0", {"x": 1, "mask": 0})])
def test_batch_dims_text_parses(text: str, expected: object) -> None:
    from fxpipe.passes.batchdims import parse_batch_dims

    assert parse_batch_dims(text) == expected


@pytest.mark.parametrize("text, message", [("one", "neither a dim"), ("x=1,y", "'y' is not name=dim"),
                                           ("=1", "no input name")])
def test_bad_batch_dims_text_is_refused(text: str, message: str) -> None:
    from fxpipe.passes.batchdims import BatchDimError, parse_batch_dims

    with pytest.raises(BatchDimError, match=message):
        parse_batch_dims(text)
