"""Cost chain: a cost graph cut into ordered blocks, with the bytes crossing every cut."""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from fxpipe.core.attention_core import cores_within_blocks, cuts_inside_cores
from fxpipe.core.costgraph import ZERO, Affine, CostGraph, CostNode
from fxpipe.core.sharding import block_path


@dataclass(frozen=True)
class Block:
    """A run of consecutive cost-graph nodes that always stay on one stage.

    ``saved_bytes`` counts each saved storage once, in the first block saving it. ``resaved`` holds, per
    earlier block ``i`` (ascending), the bytes of storages this block saves again whose last earlier saver
    is block ``i``: a stage starting after block ``i`` receives such a value as its own tensor and saves that
    copy, so a stage over blocks ``[first, stop)`` adds its blocks' entries with ``i < first``, each storage
    once (:func:`fxpipe.sim.stagecost.resaved_bytes`).
    """

    name: str
    node_names: tuple[str, ...]
    forward_s: Affine
    backward_s: Affine
    param_bytes: int
    saved_bytes: Affine = ZERO  # activation bytes autograd keeps for backward, per micro-batch slice
    resaved: tuple[tuple[int, Affine], ...] = ()  # (earlier block, bytes saved here again)
    tp: BlockTensorParallel | None = None  # how the block splits over a tensor-parallel group; None: it does not
    # parameter bytes per FSDP unit a sharded stage would gather them in: (module path of the numbered block,
    # fxpipe.core.sharding.block_path; "" the root, bytes); () where unknown (profiles): the block is its own unit
    units: tuple[tuple[str, int], ...] = ()
    # attention's core in this block (fxpipe.core.attention_core): the bytes recomputing only it saves per slice and
    # the forward time that costs; ZERO: no attention core (selective recompute "attention" does nothing here)
    attention_core_bytes: Affine = ZERO
    attention_core_s: Affine = ZERO


@dataclass(frozen=True)
class BlockTensorParallel:
    """What a T-way tensor-parallel group does with one block (found on the graph by
    :mod:`fxpipe.passes.tensor_parallel`); a stage with T > 1 costs its blocks from these figures.

    ``time_share``: the share of the block's ``forward_s`` and ``backward_s`` that divides by T (the sharded
    matmuls and the per-head / per-channel work between them); the rest runs whole on every group member.
    ``param_bytes``: the part of the block's ``param_bytes`` split T ways; the rest is replicated.
    ``saved_share``: the share of ``saved_bytes`` split T ways (under sequence parallelism, nearly all).
    ``comm_bytes``: per micro-batch slice, the bytes of the full activations at the block's collective points:
    each point is one all-gather into a column-parallel region and one reduce-scatter out of a row-parallel
    one in forward (sequence parallelism), the same two in backward; a group member moves ``(T-1)/T`` of it.
    ``divisor``: T must divide it (the gcd of the sharded head counts, channels and vocabulary); 0: no condition
    (a block of sequence-parallel norms and adds only).
    ``sequence_time_share`` and ``sequence_saved_share``: the parts of ``time_share`` and ``saved_share`` that come
    from token-row nodes between pairs (norms, dropout, residual adds) and from column linears' saved inputs, which
    split only under sequence parallelism; :func:`without_sequence_parallel` takes them out for stages that run
    without it.
    ``regather_bytes``: per micro-batch slice, the bytes of the column linears' inputs gathered over the tokens again
    in backward (sequence parallelism saves only a member's token share of them, as Megatron-LM does,
    :mod:`fxpipe.passes.tp_sequence_columns`); a group member moves ``(T-1)/T`` of it.
    """

    time_share: float
    param_bytes: int
    saved_share: float
    comm_bytes: Affine
    divisor: int
    sequence_time_share: float = 0.0
    sequence_saved_share: float = 0.0
    regather_bytes: Affine = ZERO


@dataclass(frozen=True)
class SharedParam:
    """A trainable parameter read by several blocks (tied weights); its bytes count in ``blocks[0]``'s ``param_bytes``.

    A stage holding any of ``blocks`` but not ``blocks[0]`` keeps a copy; copies' gradients are summed
    across the stages holding them.
    """

    name: str
    num_bytes: int
    blocks: tuple[int, ...]  # ascending, at least two


@dataclass(frozen=True)
class CostChain:
    """Ordered blocks plus, for each cut k (between block k and k+1), the bytes of every value crossing it.

    ``cut_bytes[k]`` counts skip connections too: a value produced in block i <= k and read in
    block j > k+... crosses every cut between them. ``input_bytes`` is what block 0 reads from
    the data loader; ``output_bytes`` what the last block hands to the loss. ``shared_params`` are
    the parameters several blocks read (:class:`SharedParam`).

    The loss runs with the last block, so its times and saved bytes are in ``blocks[-1]``;
    ``loss_saved_bytes`` repeats its saved part (a recomputing last stage still keeps it: the loss runs
    outside the recomputed forward). ``input_saved_bytes`` / ``target_saved_bytes`` are the parts of the
    first / last block's saved bytes that are the model's own inputs / the targets (slices of the global
    batch every rank holds).

    ``model_flops_per_sample`` is what one sample costs in model FLOPs as Megatron counts them (3 x the
    forward matmul FLOPs, :mod:`fxpipe.passes.model_flops`); ``tokens_per_sample`` a language model's
    sequence length. Both 0 when unknown (a profile file's chain, a model without token-id inputs).
    """

    blocks: tuple[Block, ...]
    cut_bytes: tuple[Affine, ...]
    input_bytes: Affine = ZERO
    output_bytes: Affine = ZERO
    source: str = ""
    shared_params: tuple[SharedParam, ...] = ()
    loss_saved_bytes: Affine = ZERO
    input_saved_bytes: Affine = ZERO
    target_saved_bytes: Affine = ZERO
    model_flops_per_sample: float = 0.0
    tokens_per_sample: int = 0
    # bytes of the compute copy kept per byte of fp32 master weights (precision bf16-params: 0.5; 0: none, the
    # masters compute), set for the precision the chain is planned in (fxpipe.sim.sharding_memory)
    param_copy_fraction: float = 0.0

    def __post_init__(self) -> None:
        if not self.blocks:
            raise ValueError("a cost chain needs at least one block")
        if len(self.cut_bytes) != len(self.blocks) - 1:
            raise ValueError(
                f"a chain of {len(self.blocks)} blocks has {len(self.blocks) - 1} cuts, "
                f"got {len(self.cut_bytes)} cut sizes"
            )
        for index, block in enumerate(self.blocks):
            earlier = [saver for saver, _ in block.resaved]
            if earlier != sorted(set(earlier)) or any(not 0 <= saver < index for saver in earlier):
                raise ValueError(f"block {index} ({block.name!r}) re-saves values of blocks {earlier}; they must be "
                                 f"ascending distinct indices of earlier blocks, in [0, {index})")
        for shared in self.shared_params:
            blocks = shared.blocks
            if len(blocks) < 2 or list(blocks) != sorted(set(blocks)) or blocks[0] < 0 or blocks[-1] >= len(self.blocks):
                raise ValueError(f"shared parameter {shared.name!r} names blocks {list(blocks)}; it needs two or more "
                                 f"ascending distinct block indices in [0, {len(self.blocks)})")
            if shared.num_bytes < 0:
                raise ValueError(f"shared parameter {shared.name!r} has negative size {shared.num_bytes}")

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


class ChainError(ValueError):
    """A cost graph cannot be turned into a chain (empty graph, bad ``max_blocks``)."""


@dataclass(frozen=True)
class _NodeCuts:
    """Per-node-position cut data: cut k lies between node k and node k+1 (k = 0..n-2)."""

    bytes_fixed: list[float]
    bytes_per_sample: list[float]
    forbidden: list[bool]  # a non-tensor value crosses the cut
    boundary_depth: list[int]  # shared module-path depth of the two sides (0 = top-level boundary)


def _last_use_positions(graph: CostGraph) -> list[int]:
    """For each node position, the position of its last reader (itself when nothing reads it)."""
    position = {node.name: index for index, node in enumerate(graph.nodes)}
    last_use = list(range(len(graph.nodes)))
    for index, node in enumerate(graph.nodes):
        for producer in node.inputs:
            source = position[producer]
            last_use[source] = max(last_use[source], index)
    return last_use


def _boundary_depth(left: str, right: str) -> int:
    """How deep two module paths agree; equal paths count one deeper (the cut is inside a module)."""
    if left == right:
        return (left.count(".") + 1 if left else 0) + 1
    shared = 0
    for a, b in zip(left.split("."), right.split("."), strict=False):
        if a != b:
            break
        shared += 1
    return shared


def _node_cuts(graph: CostGraph) -> _NodeCuts:
    """Bytes crossing every node-level cut, via difference arrays over [producer, last reader)."""
    num_nodes = len(graph.nodes)
    last_use = _last_use_positions(graph)
    delta_fixed = [0.0] * (num_nodes + 1)
    delta_per_sample = [0.0] * (num_nodes + 1)
    delta_non_tensor = [0] * (num_nodes + 1)
    for index, node in enumerate(graph.nodes):
        stop = last_use[index]  # the value crosses cuts index .. stop-1
        if stop == index:
            continue
        delta_fixed[index] += node.output_bytes.fixed
        delta_fixed[stop] -= node.output_bytes.fixed
        delta_per_sample[index] += node.output_bytes.per_sample
        delta_per_sample[stop] -= node.output_bytes.per_sample
        if not node.tensor_output:
            delta_non_tensor[index] += 1
            delta_non_tensor[stop] -= 1
    fixed = list(itertools.accumulate(delta_fixed[: num_nodes - 1]))
    per_sample = list(itertools.accumulate(delta_per_sample[: num_nodes - 1]))
    non_tensor = list(itertools.accumulate(delta_non_tensor[: num_nodes - 1]))
    paths = [node.module_path for node in graph.nodes]
    return _NodeCuts(
        bytes_fixed=[max(value, 0.0) for value in fixed],  # clamp float cancellation noise
        bytes_per_sample=[max(value, 0.0) for value in per_sample],
        forbidden=[count > 0 for count in non_tensor],
        boundary_depth=[_boundary_depth(paths[k], paths[k + 1]) for k in range(num_nodes - 1)],
    )


def _select_cuts(weights: list[float], cuts: _NodeCuts, allowed: list[int], num_blocks: int,
                 balance_rows: float) -> list[int]:
    """Pick up to ``num_blocks - 1`` allowed cuts so blocks carry about equal work.

    Each next cut aims at an equal share of the work still to place (so one heavy node does not
    skew the blocks after it). Every allowed cut within a quarter share of that target is a
    candidate; the score adds the balance error (in quarter shares) to the cut's boundary depth
    and bytes, each normalised to [0, 1] within the window, so balance stays within a quarter
    share while module boundaries and cheap cuts decide among near-equal choices.
    """
    prefix = list(itertools.accumulate(weights))
    total = prefix[-1]
    allowed_prefix = [prefix[k] for k in allowed]
    chosen: list[int] = []
    first_free = 0  # index into ``allowed`` of the first cut after the last chosen one
    stop_useful = bisect.bisect_left(allowed_prefix, total)  # later cuts would leave a workless tail
    allowed, allowed_prefix = allowed[:stop_useful], allowed_prefix[:stop_useful]
    for num_left in range(num_blocks, 1, -1):
        done = prefix[chosen[-1]] if chosen else 0.0
        share = (total - done) / num_left
        target, tolerance = done + share, 0.25 * share
        first_useful = max(bisect.bisect_right(allowed_prefix, done), first_free)  # no empty blocks
        lo = max(bisect.bisect_left(allowed_prefix, target - tolerance), first_useful)
        hi = max(bisect.bisect_right(allowed_prefix, target + tolerance), lo)
        window = allowed[lo:hi] or _nearest_cuts(allowed, allowed_prefix, target, first_useful)
        if not window:
            break
        cut = _best_cut(window, prefix, target, tolerance, cuts, balance_rows)
        chosen.append(cut)
        first_free = bisect.bisect_right(allowed, cut)
    return chosen


def _nearest_cuts(allowed: list[int], allowed_prefix: list[float], target: float, first_useful: int) -> list[int]:
    """The allowed cut (at or after ``first_useful``) whose prefix work is closest to ``target``."""
    after = max(bisect.bisect_left(allowed_prefix, target), first_useful)
    candidates = [i for i in (after - 1, after) if first_useful <= i < len(allowed)]
    if not candidates:
        return []
    best = min(candidates, key=lambda i: (abs(allowed_prefix[i] - target), i))
    return [allowed[best]]


def _best_cut(window: list[int], prefix: list[float], target: float, tolerance: float, cuts: _NodeCuts,
              balance_rows: float) -> int:
    """The window's cut with the lowest balance + boundary + bytes score (earliest on ties)."""
    sizes = [cuts.bytes_fixed[k] + cuts.bytes_per_sample[k] * balance_rows for k in window]
    depths = [cuts.boundary_depth[k] for k in window]
    min_size, size_span = min(sizes), (max(sizes) - min(sizes)) or 1.0
    min_depth, depth_span = min(depths), (max(depths) - min(depths)) or 1
    scale = tolerance if tolerance > 0 else 1.0

    def score(i: int) -> tuple[float, int]:
        balance = min(abs(prefix[window[i]] - target) / scale, 1.0)
        return (balance + (depths[i] - min_depth) / depth_span + (sizes[i] - min_size) / size_span, i)

    return window[min(range(len(window)), key=score)]


def _make_block(graph: CostGraph, index: int, first: int, stop: int, block_of: Mapping[str, int],
                cores: Mapping[str, tuple[Affine, Affine]] | None = None) -> Block:
    """Block ``index`` over nodes ``[first, stop)``; the last block runs the loss too (its costs, no node name).

    ``block_of`` maps each node name to its block (for the re-saved values' earlier savers).
    """
    nodes = graph.nodes[first:stop]
    costed = (*nodes, graph.loss) if stop == len(graph.nodes) and graph.loss is not None else nodes
    resaved = [(block_of[saver], num_bytes) for node in costed for saver, num_bytes in node.resaved]
    cores = cores or {}
    mine = [cores[node.name] for node in nodes if node.name in cores]  # keyed by each core's last node
    return Block(
        name=f"block{index}",
        node_names=tuple(node.name for node in nodes),
        forward_s=Affine.total(node.forward_s for node in costed),
        backward_s=Affine.total(node.backward_s for node in costed),
        param_bytes=sum(node.param_bytes for node in nodes),
        saved_bytes=Affine.total(node.saved_bytes for node in costed),
        resaved=merged_resaved(resaved, index),
        tp=block_tensor_parallel(costed),
        units=merged_units((block_path(node.param_names[0]) or "", node.param_bytes) for node in nodes
                           if node.param_bytes > 0 and node.param_names),
        attention_core_bytes=Affine.total(num_bytes for num_bytes, _ in mine),
        attention_core_s=Affine.total(seconds for _, seconds in mine),
    )


def block_tensor_parallel(nodes: Iterable[CostNode]) -> BlockTensorParallel | None:
    """:attr:`Block.tp` of a block over ``nodes`` (the loss included): time and saved shares weighted by each
    node's forward + backward time and saved bytes at one row; None when no node splits."""
    nodes = list(nodes)
    if not any(node.tp_time_share > 0 or node.tp_divisor > 0 or node.tp_param_bytes > 0 for node in nodes):
        return None
    return _weighted_tp([(node.forward_s + node.backward_s, node.saved_bytes,
                          BlockTensorParallel(node.tp_time_share, node.tp_param_bytes, node.tp_saved_share,
                                              node.tp_comm_bytes, node.tp_divisor,
                                              node.tp_time_share if node.tp_sequence else 0.0,
                                              node.tp_saved_share if node.tp_sequence
                                              else node.tp_sequence_saved_share, node.tp_regather_bytes))
                         for node in nodes])


def merged_tensor_parallel(blocks: Sequence[Block]) -> BlockTensorParallel | None:
    """:attr:`Block.tp` of one block merging ``blocks`` (a coarsened chain); None when none of them splits."""
    if all(block.tp is None for block in blocks):
        return None
    return _weighted_tp([(block.forward_s + block.backward_s, block.saved_bytes, block.tp or _WHOLE)
                         for block in blocks])


_WHOLE = BlockTensorParallel(0.0, 0, 0.0, ZERO, 0)


def without_sequence_parallel(chain: CostChain) -> CostChain:
    """``chain`` as tensor-parallel stages run it without sequence parallelism (``fxpipe.compile``'s default): each
    block's norms, dropout and residual adds between pairs run whole on every group member, in time and in saved
    bytes, and its column linears save their whole inputs, gathering nothing again in backward (its ``sequence_*``
    shares come out of its split shares, its ``regather_bytes`` go); a block with nothing else to split no longer
    splits. The chain itself when no block has such a share."""
    if not any(_sequence_only(block.tp) for block in chain.blocks):
        return chain
    return replace(chain, blocks=tuple(replace(block, tp=_without_sequence(block.tp)) for block in chain.blocks))


def _sequence_only(tp: BlockTensorParallel | None) -> bool:
    """Whether ``tp`` has figures that hold only under sequence parallelism."""
    return tp is not None and (tp.sequence_time_share > 0 or tp.sequence_saved_share > 0 or tp.regather_bytes != ZERO)


def _without_sequence(tp: BlockTensorParallel | None) -> BlockTensorParallel | None:
    if tp is None or not _sequence_only(tp):
        return tp
    kept = replace(tp, time_share=max(0.0, tp.time_share - tp.sequence_time_share),
                   saved_share=max(0.0, tp.saved_share - tp.sequence_saved_share),
                   sequence_time_share=0.0, sequence_saved_share=0.0, regather_bytes=ZERO)
    splits_nothing = (kept.time_share <= 1e-12 and kept.saved_share <= 1e-12 and kept.param_bytes == 0
                      and kept.divisor == 0 and kept.comm_bytes == ZERO)
    return None if splits_nothing else kept


def _weighted_tp(parts: list[tuple[Affine, Affine, BlockTensorParallel]]) -> BlockTensorParallel:
    """Shares weighted by time and saved bytes at one row; bytes summed; the gcd of the divisors (0: none)."""
    times = [time.at(1.0) for time, _, _ in parts]
    saved = [num_bytes.at(1.0) for _, num_bytes, _ in parts]
    total_time, total_saved = sum(times), sum(saved)
    divisors = [tp.divisor for _, _, tp in parts if tp.divisor > 0]

    def by_time(share: Callable[[BlockTensorParallel], float]) -> float:
        return sum(t * share(tp) for t, (_, _, tp) in zip(times, parts, strict=True)) / total_time \
            if total_time > 0 else 0.0

    def by_saved(share: Callable[[BlockTensorParallel], float]) -> float:
        return sum(b * share(tp) for b, (_, _, tp) in zip(saved, parts, strict=True)) / total_saved \
            if total_saved > 0 else 0.0

    return BlockTensorParallel(
        time_share=by_time(lambda tp: tp.time_share),
        param_bytes=sum(tp.param_bytes for _, _, tp in parts),
        saved_share=by_saved(lambda tp: tp.saved_share),
        comm_bytes=Affine.total(tp.comm_bytes for _, _, tp in parts),
        divisor=math.gcd(*divisors) if divisors else 0,
        sequence_time_share=by_time(lambda tp: tp.sequence_time_share),
        sequence_saved_share=by_saved(lambda tp: tp.sequence_saved_share),
        regather_bytes=Affine.total(tp.regather_bytes for _, _, tp in parts),
    )


def block_units(block: Block) -> tuple[tuple[str, int], ...]:
    """The block's (unit, bytes); a block without unit figures is a unit of its own (named after the block)."""
    if block.units or block.param_bytes <= 0:
        return block.units
    return ((f"<{block.name}>", block.param_bytes),)


def merged_units(entries: Iterable[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    """(unit, bytes) entries summed per unit, in order of first appearance."""
    totals: dict[str, int] = {}
    for unit, num_bytes in entries:
        totals[unit] = totals.get(unit, 0) + num_bytes
    return tuple(totals.items())


def merged_resaved(entries: Iterable[tuple[int, Affine]], block: int) -> tuple[tuple[int, Affine], ...]:
    """:attr:`Block.resaved` of block ``block`` from ``(earlier saver's block, bytes)`` entries: those of
    earlier blocks summed per block, ascending (a saver in ``block`` itself is no re-save across a cut)."""
    totals: dict[int, list[Affine]] = {}
    for saver, num_bytes in entries:
        assert saver <= block, f"block {block} re-saves a value first saved in later block {saver}"
        if saver < block:
            totals.setdefault(saver, []).append(num_bytes)
    return tuple((saver, Affine.total(totals[saver])) for saver in sorted(totals))


def build_chain(graph: CostGraph, *, max_blocks: int | None = 64, balance_rows: float = 1.0) -> CostChain:
    """Cut a topologically ordered cost graph into at most ``max_blocks`` consecutive blocks.

    Every node-level cut gets the bytes of all values produced at or before it and read after it
    (skip edges included, each value once). Cuts crossed by a non-tensor value are never block
    boundaries, nor cuts crossed by a tensor whose rows are not the batch rows (a ``(B*T, C)``
    flatten: it cannot be split between replicas by sample), which the cost graph also marks
    ``tensor_output=False``. With more allowed cuts than ``max_blocks - 1`` the cuts are chosen to balance
    forward + backward time at ``balance_rows`` rows per block, preferring module boundaries and
    small cut bytes among near-equal choices (see :func:`_select_cuts`); ``None`` keeps every
    allowed cut.
    """
    if not graph.nodes:
        raise ChainError("cannot build a chain from an empty cost graph; trace a model with at least one op")
    if max_blocks is not None and max_blocks < 1:
        raise ChainError(f"max_blocks must be >= 1 (or None for no limit); got {max_blocks}")
    cuts = _node_cuts(graph)
    inside = cuts_inside_cores(graph)  # a block holds each attention core whole, so it can recompute it alone
    allowed = [k for k, forbidden in enumerate(cuts.forbidden) if not forbidden and k not in inside]
    if max_blocks is not None and len(allowed) > max_blocks - 1:
        weights = [(node.forward_s + node.backward_s).at(balance_rows) for node in graph.nodes]
        if graph.loss is not None:  # the loss runs with the last node's block
            weights[-1] += (graph.loss.forward_s + graph.loss.backward_s).at(balance_rows)
        if max_blocks == 1:
            allowed = []
        elif sum(weights) > 0:
            allowed = _select_cuts(weights, cuts, allowed, max_blocks, balance_rows)
        else:  # no timing at all: spread blocks evenly over the allowed cuts
            step = len(allowed) / max_blocks
            allowed = sorted({allowed[int(step * j)] for j in range(1, max_blocks)})
    bounds = [0, *(k + 1 for k in allowed), len(graph.nodes)]
    block_of = {node.name: bisect.bisect_right(bounds, position) - 1 for position, node in enumerate(graph.nodes)}
    cores = cores_within_blocks(graph, block_of)
    blocks = tuple(_make_block(graph, index, first, stop, block_of, cores)
                   for index, (first, stop) in enumerate(itertools.pairwise(bounds)))
    return CostChain(
        blocks=blocks,
        cut_bytes=tuple(Affine(cuts.bytes_fixed[k], cuts.bytes_per_sample[k]) for k in allowed),
        input_bytes=graph.input_bytes,
        output_bytes=graph.nodes[-1].output_bytes,
        source=graph.source,
        shared_params=_shared_params(graph, bounds),
        loss_saved_bytes=graph.loss.saved_bytes if graph.loss is not None else ZERO,
        input_saved_bytes=graph.input_saved_bytes,
        target_saved_bytes=graph.target_saved_bytes if graph.loss is not None else ZERO,
    )


def _shared_params(graph: CostGraph, bounds: list[int]) -> tuple[SharedParam, ...]:
    """The graph's shared parameters that blocks ``[bounds[i], bounds[i+1])`` split over two or more blocks."""
    by_node = tuple(SharedParam(name, num_bytes, tuple(i for i, node in enumerate(graph.nodes) if name in node.param_names))
                    for name, num_bytes in graph.shared_params)
    return regroup_shared_params(by_node, [bisect.bisect_right(bounds, i) - 1 for i in range(len(graph.nodes))])


def regroup_shared_params(shared_params: tuple[SharedParam, ...], group_of_block: list[int]) -> tuple[SharedParam, ...]:
    """Shared parameters after merging blocks (or nodes into blocks): ``b`` becomes ``group_of_block[b]`` (ascending)."""
    result = []
    for shared in shared_params:
        groups = sorted({group_of_block[block] for block in shared.blocks})
        if len(groups) >= 2:
            result.append(SharedParam(shared.name, shared.num_bytes, tuple(groups)))
    return tuple(result)
