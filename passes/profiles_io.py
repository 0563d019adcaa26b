"""Read PipeDream/DAPPLE per-layer profile text (node and edge lines) into a CostGraph."""

from __future__ import annotations

import heapq
import math
import re
from dataclasses import dataclass
from pathlib import Path

from fxpipe.core.costgraph import Affine, CostGraph, CostNode

# node5 -- layer_0 -- forward_compute_time=2.69, backward_compute_time=4.47, activation_size=..., parameter_size=...
# The label may itself contain " -- ", commas and parentheses, so the metrics are matched from the end.
# Node ids have at most 9 digits (int() of thousands of digits is refused by Python).
_NODE_LINE = re.compile(
    r"^(?P<id>node(?P<number>[0-9]{1,9})) -- (?P<label>.*) -- "
    r"forward_compute_time=(?P<forward>[^,]+), backward_compute_time=(?P<backward>[^,]+), "
    r"activation_size=(?P<activation>\[[^\]]*\]|[^,]+), parameter_size=(?P<params>\S+)\s*$"
)
_EDGE_LINE = re.compile(r"^\s+(?P<src>node[0-9]{1,9}) -- (?P<dst>node[0-9]{1,9})\s*$")
_MS = 1e-3


class ProfileFormatError(ValueError):
    """A profile file is malformed: a line that does not parse, a dangling edge, a cycle."""


@dataclass(frozen=True)
class _Row:
    """One parsed node line, with where it came from (for error messages)."""

    name: str
    number: int
    label: str
    forward_ms: float
    backward_ms: float
    activation_bytes: float
    param_bytes: float
    line_number: int


def _error(path: str, line_number: int, line: str, why: str) -> ProfileFormatError:
    return ProfileFormatError(f"{path}:{line_number}: {why}\n  {line.rstrip()!r:.200}")


def _number(text: str, path: str, line_number: int, line: str, field: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise _error(path, line_number, line, f"{field} {text!r} is not a number") from None
    return _finite(value, text, path, line_number, line, field)


def _finite(value: float, text: str, path: str, line_number: int, line: str, field: str) -> float:
    if not (value >= 0 and math.isfinite(value)):
        raise _error(path, line_number, line, f"{field} {text!r:.80} must be a finite number >= 0")
    return value


def _activation_bytes(text: str, path: str, line_number: int, line: str) -> float:
    """``123`` or ``[a; b; c]`` (several outputs: their sizes add up)."""
    if text.startswith("["):
        parts = [part.strip() for part in text[1:-1].split(";")]
        total = sum(_number(part, path, line_number, line, "activation_size entry") for part in parts)
        return _finite(total, text, path, line_number, line, "activation_size (the sum of its entries)")
    return _number(text, path, line_number, line, "activation_size")


def _parse_node(match: re.Match[str], path: str, line_number: int, line: str) -> _Row:
    return _Row(
        name=match["id"],
        number=int(match["number"]),
        label=match["label"].strip(),
        forward_ms=_number(match["forward"], path, line_number, line, "forward_compute_time"),
        backward_ms=_number(match["backward"], path, line_number, line, "backward_compute_time"),
        activation_bytes=_activation_bytes(match["activation"].strip(), path, line_number, line),
        param_bytes=_number(match["params"], path, line_number, line, "parameter_size"),
        line_number=line_number,
    )


def _parse_lines(text: str, path: str) -> tuple[dict[str, _Row], list[tuple[str, str, int, str]]]:
    """Node rows by id, and edges as (src, dst, line number, line) in file order."""
    rows: dict[str, _Row] = {}
    edges: list[tuple[str, str, int, str]] = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        edge = _EDGE_LINE.match(line)
        if edge:
            edges.append((edge["src"], edge["dst"], line_number, line))
            continue
        node = _NODE_LINE.match(line)
        if not node:
            raise _error(path, line_number, line, "is neither a node line 'nodeN -- label -- forward_compute_time=..., "
                         "backward_compute_time=..., activation_size=..., parameter_size=...' nor an "
                         "indented edge line 'nodeA -- nodeB' (node ids have at most 9 digits)")
        row = _parse_node(node, path, line_number, line)
        if row.name in rows:
            raise _error(path, line_number, line, f"{row.name} is defined twice (first on line "
                         f"{rows[row.name].line_number})")
        rows[row.name] = row
    for src, dst, line_number, line in edges:
        for end in (src, dst):
            if end not in rows:
                raise _error(path, line_number, line, f"edge refers to {end}, which has no node line")
    return rows, edges


def _topological_order(rows: dict[str, _Row], edges: list[tuple[str, str, int, str]], path: str) -> list[str]:
    """Kahn's algorithm; among ready nodes the smallest node id number goes first (stable output)."""
    successors: dict[str, list[str]] = {name: [] for name in rows}
    num_pending = dict.fromkeys(rows, 0)
    for src, dst, _, _ in dict.fromkeys((s, d, 0, "") for s, d, _, _ in edges):
        successors[src].append(dst)
        num_pending[dst] += 1
    ready = [(row.number, name) for name, row in rows.items() if num_pending[name] == 0]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        _, name = heapq.heappop(ready)
        order.append(name)
        for successor in successors[name]:
            num_pending[successor] -= 1
            if num_pending[successor] == 0:
                heapq.heappush(ready, (rows[successor].number, successor))
    if len(order) < len(rows):
        stuck = {name for name, count in num_pending.items() if count > 0}
        raise _cycle_error(stuck, edges, rows, path)
    return order


def _cycle_error(stuck: set[str], edges: list[tuple[str, str, int, str]], rows: dict[str, _Row],
                 path: str) -> ProfileFormatError:
    """Walk back through stuck predecessors until a node repeats; report that cycle's last edge line."""
    stuck_edges = [edge for edge in edges if edge[0] in stuck and edge[1] in stuck]
    predecessor = {dst: (src, line_number, line) for src, dst, line_number, line in stuck_edges}
    walk: list[str] = [min(stuck, key=lambda name: rows[name].number)]
    while walk[-1] not in walk[:-1]:
        walk.append(predecessor[walk[-1]][0])
    cycle = walk[walk.index(walk[-1]):]  # dst, src, src-of-src, ..., dst
    cycle_edges = [predecessor[dst] for dst in cycle[:-1]]
    _, line_number, line = max(cycle_edges, key=lambda edge: edge[1])
    names = " -> ".join(reversed(cycle))
    return _error(path, line_number, line, f"edges form a cycle: {names}")


def parse_profile_text(text: str, *, profile_batch_size: int, source: str = "<text>") -> CostGraph:
    """A CostGraph from profile text; see :func:`read_profile`."""
    if profile_batch_size < 1:
        raise ValueError(f"profile_batch_size must be >= 1; got {profile_batch_size}")
    rows, edges = _parse_lines(text, source)
    if not rows:
        raise ProfileFormatError(f"{source}: no node lines found; is this a PipeDream profile file?")
    order = _topological_order(rows, edges, source)
    inputs: dict[str, list[str]] = {name: [] for name in rows}
    for src, dst, _, _ in edges:
        if src not in inputs[dst]:
            inputs[dst].append(src)
    per_row = 1.0 / profile_batch_size
    nodes = []
    for name in order:
        row = rows[name]
        output_bytes = Affine(0.0, row.activation_bytes * per_row)
        nodes.append(CostNode(
            name=name,
            inputs=tuple(inputs[name]),
            forward_s=Affine(0.0, row.forward_ms * _MS * per_row),
            backward_s=Affine(0.0, row.backward_ms * _MS * per_row),
            output_bytes=output_bytes,
            saved_bytes=output_bytes,  # the profile has no saved-for-backward figure: approximate by the output
            param_bytes=round(row.param_bytes),
            module_path=name,  # each profiled row is one top-level layer
            op=row.label,
        ))
    sources = [node.output_bytes for node in nodes if not node.inputs]
    return CostGraph(tuple(nodes), source=f"profile:{source}", input_bytes=Affine.total(sources))


def read_profile(path: str | Path, *, profile_batch_size: int) -> CostGraph:
    """Read a PipeDream profiler graph file (format: shared/profiles/README.md) into a CostGraph.

    Per node: times (ms at the profile batch size) become ``Affine(0, seconds / pbs)``; the
    activation size (summed over a ``[a; b]`` list) becomes ``output_bytes`` per row and, as the
    documented approximation, ``saved_bytes`` too; ``parameter_size`` is taken as bytes. Edges
    become ``CostNode.inputs``; nodes are sorted topologically (ties by node id number). Node
    names are the file's ids (``node5``); the label goes to ``CostNode.op``. Source nodes (no
    incoming edge) are the model inputs: their output sizes add up to ``input_bytes``.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ProfileFormatError(f"{path}: not a UTF-8 text profile ({error}); give the PipeDream graph.txt "
                                 "file, not a binary or other encoding") from error
    except OSError as error:
        raise ProfileFormatError(f"{path}: cannot read the profile file: {error}") from error
    return parse_profile_text(text, profile_batch_size=profile_batch_size, source=str(path))
