"""Plain-number cost graph: what every front end (fx graphs, profile files) hands to the planner."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from fxpipe.core.jsonvalues import JSONValueError, conform


@dataclass(frozen=True)
class Affine:
    """A cost that grows linearly with the number of batch rows: ``fixed + per_sample * rows``.

    Used for times (seconds) and sizes (bytes). Profiles measured at one batch size become
    ``Affine(0, t / pbs)``; analytic costs carry a fixed per-kernel overhead.
    """

    fixed: float = 0.0
    per_sample: float = 0.0

    def at(self, rows: float) -> float:
        """The cost for ``rows`` batch rows."""
        return self.fixed + self.per_sample * rows

    def __add__(self, other: Affine) -> Affine:
        return Affine(self.fixed + other.fixed, self.per_sample + other.per_sample)

    def scaled(self, factor: float) -> Affine:
        return Affine(self.fixed * factor, self.per_sample * factor)

    @staticmethod
    def total(items: Iterable[Affine]) -> Affine:
        fixed = 0.0
        per_sample = 0.0
        for item in items:
            fixed += item.fixed
            per_sample += item.per_sample
        return Affine(fixed, per_sample)

    def to_json(self) -> list[float]:
        return [self.fixed, self.per_sample]

    @staticmethod
    def from_json(value: object) -> Affine:
        """``[fixed, per_sample]``: two finite numbers (not NaN, inf or a bool); ValueError otherwise."""
        try:
            fixed, per_sample = conform(value, tuple[float, float])
        except JSONValueError:
            raise ValueError(f"an Affine cost is [fixed, per_sample]; got {value!r:.80}; use two finite "
                             "numbers (not nan, inf or a bool)") from None
        return Affine(fixed, per_sample)


ZERO = Affine()


@dataclass(frozen=True)
class CostNode:
    """One node of a cost graph (an fx node or a profiled layer).

    ``output_bytes`` is the size of everything the node outputs (sent to consumers across a cut);
    ``saved_bytes`` is what autograd keeps alive for backward because of this node (each storage counted
    at the first node saving it); ``resaved`` lists ``(earlier node, bytes)`` per storage this node saves
    again after the named node (the last earlier one saving it): a stage that does not hold that node
    receives the value as its own tensor and saves that copy (:attr:`fxpipe.core.chain.Block.resaved`);
    ``param_bytes`` counts only the parameters this node is the first user of, so a tied
    parameter is counted once in the graph's total. ``param_names`` lists every parameter the
    node uses (under the original model's names), shared ones included. Planners never cut where
    a value with ``tensor_output=False`` would cross (sizes depend on each replica's slice).
    """

    name: str
    inputs: tuple[str, ...] = ()
    forward_s: Affine = ZERO
    backward_s: Affine = ZERO
    output_bytes: Affine = ZERO
    saved_bytes: Affine = ZERO
    param_bytes: int = 0
    forward_flops: Affine = ZERO
    backward_flops: Affine = ZERO
    module_path: str = ""
    param_names: tuple[str, ...] = ()
    op: str = ""
    tensor_output: bool = True  # False for ints, shapes, bools: no cut may send such a value
    resaved: tuple[tuple[str, Affine], ...] = ()
    # Under a T-way tensor-parallel group (found by fxpipe.passes.tensor_parallel; zero: the node runs whole):
    tp_time_share: float = 0.0  # the share of forward_s / backward_s that divides by T
    tp_param_bytes: int = 0  # the part of param_bytes split T ways
    tp_saved_share: float = 0.0  # the share of saved_bytes split T ways
    tp_comm_bytes: Affine = ZERO  # full activation bytes at this node's collective point (per forward)
    tp_divisor: int = 0  # T must divide it (0: no condition)
    # a token-row node between pairs (norm, dropout, residual add): it splits only under sequence parallelism
    tp_sequence: bool = False
    # the part of tp_saved_share that splits only under sequence parallelism (a column linear saving its input's
    # token share), and the bytes gathered again in backward for it (per forward; fxpipe.passes.tp_sequence_columns)
    tp_sequence_saved_share: float = 0.0
    tp_regather_bytes: Affine = ZERO


class CostGraphError(ValueError):
    """A cost graph is malformed (unknown input, cycle, duplicate name, negative cost)."""


@dataclass(frozen=True)
class CostGraph:
    """A DAG of CostNodes in topological order; edges are ``CostNode.inputs``.

    ``input_bytes`` is the per-row size of the model's own inputs (what stage 0 receives) and
    ``source`` says which front end produced the graph (``"fx"``, ``"profile:<file>"``).
    ``shared_params`` gives ``(name, bytes)`` of every trainable parameter more than one node reads
    (a tied embedding and head): a stage holding a later user keeps its own copy, and the copies'
    gradients are summed across stages.

    ``loss`` is the loss on the model's output (no fx node: it runs with the last stage, outside the
    stage's code; ``name`` says what costed it), None when not costed (profile files).
    ``input_saved_bytes`` is the part of the nodes' ``saved_bytes`` that is the model's own inputs
    (token ids an embedding saves, images a first convolution saves), ``target_saved_bytes`` the part of
    the loss's that is the targets.
    """

    nodes: tuple[CostNode, ...]
    source: str = ""
    input_bytes: Affine = ZERO
    shared_params: tuple[tuple[str, int], ...] = ()
    loss: CostNode | None = None
    input_saved_bytes: Affine = ZERO
    target_saved_bytes: Affine = ZERO

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for node in (*self.nodes, *((self.loss,) if self.loss is not None else ())):
            if node.name in seen:
                raise CostGraphError(f"duplicate node name {node.name!r} in cost graph")
            for producer in node.inputs:
                if producer not in seen:
                    raise CostGraphError(
                        f"node {node.name!r} reads {producer!r}, which is not an earlier node; "
                        "nodes must be in topological order and every input must exist"
                    )
            for field in ("forward_s", "backward_s", "output_bytes", "saved_bytes"):
                value: Affine = getattr(node, field)
                if not (math.isfinite(value.fixed) and math.isfinite(value.per_sample)):
                    raise CostGraphError(f"node {node.name!r} has a non-finite {field}: {value}")
                if value.fixed < 0 or value.per_sample < 0:
                    raise CostGraphError(f"node {node.name!r} has a negative {field}: {value}")
            for saver, num_bytes in node.resaved:
                if saver not in seen:
                    raise CostGraphError(f"node {node.name!r} re-saves a value of {saver!r}, which is not an earlier "
                                         "node; name the last earlier node that saves the same storage")
                if not (math.isfinite(num_bytes.fixed) and math.isfinite(num_bytes.per_sample)) \
                        or num_bytes.fixed < 0 or num_bytes.per_sample < 0:
                    raise CostGraphError(f"node {node.name!r} re-saves {num_bytes} bytes of {saver!r}; "
                                         "use finite non-negative sizes")
            if node.param_bytes < 0:
                raise CostGraphError(f"node {node.name!r} has negative param_bytes {node.param_bytes}")
            if node is not self.loss:
                seen.add(node.name)
        for name, num_bytes in self.shared_params:
            if num_bytes < 0:
                raise CostGraphError(f"shared parameter {name!r} has negative size {num_bytes}")

    def by_name(self) -> Mapping[str, CostNode]:
        return {node.name: node for node in self.nodes}

    def consumers(self) -> dict[str, list[str]]:
        """Map each node name to the names of the nodes that read its output, in graph order."""
        result: dict[str, list[str]] = {node.name: [] for node in self.nodes}
        for node in self.nodes:
            for producer in node.inputs:
                result[producer].append(node.name)
        return result

    @property
    def total_param_bytes(self) -> int:
        return sum(node.param_bytes for node in self.nodes)

    def total(self, field: str) -> Affine:
        """Sum of one Affine field (``forward_s``, ``backward_s``, ...) over all nodes."""
        return Affine.total(getattr(node, field) for node in self.nodes)

    def to_json(self) -> dict[str, object]:
        def node_json(node: CostNode) -> dict[str, object]:
            out: dict[str, object] = {}
            for field in dataclasses.fields(node):
                value = getattr(node, field.name)
                if field.name.startswith("tp_") and value == field.default:
                    continue  # graphs without tensor parallelism keep their bytes
                if field.name == "resaved":
                    out[field.name] = [[saver, num_bytes.to_json()] for saver, num_bytes in value]
                    continue
                out[field.name] = value.to_json() if isinstance(value, Affine) else (
                    list(value) if isinstance(value, tuple) else value
                )
            return out

        return {
            "source": self.source,
            "input_bytes": self.input_bytes.to_json(),
            "nodes": [node_json(node) for node in self.nodes],
            "shared_params": [[name, num_bytes] for name, num_bytes in self.shared_params],
            "loss": None if self.loss is None else node_json(self.loss),
            "input_saved_bytes": self.input_saved_bytes.to_json(),
            "target_saved_bytes": self.target_saved_bytes.to_json(),
        }
