"""Whether fixed per-step costs dominate a plan's prediction: uncounted (no figures), or counted but so large a share
that the prediction is best read as a lower bound."""

from __future__ import annotations

from dataclasses import replace

from fxpipe.core.chain import CostChain
from fxpipe.core.cluster import Cluster
from fxpipe.core.costgraph import Affine
from fxpipe.core.hardware import REFERENCE_ACTION_OVERHEAD_S
from fxpipe.core.plan import Plan
from fxpipe.sim.simulate import simulate

# Fixed costs dominate when the iteration with no compute and no bytes is at least this share of the whole.
FIXED_SHARE_LIMIT = 0.5
LOWER_BOUND_NOTE = ("predicted iteration {predicted_ms:.3g} ms is a lower bound: the cluster has no figures for "
                    "the runtime's fixed costs (its Python per forward and backward, per step), and with "
                    "{action_us:.0f} us per action they would be {share:.0%} of the step ({floor_ms:.3g} of "
                    "{total_ms:.3g} ms with latencies and syncs); `local` clusters measure them, a cluster JSON "
                    "takes action_overhead_s and step_overhead_s (docs/clusters.md)")
# Counted, they still leave the prediction low where they make up much of it: on quiet CPU ranks the tiny MLP's
# steps (fixed costs 36-88% of the prediction) measured 5-44% slower than predicted, gpt-mini's (2-7%) 2-19%
# (benchmarks/small_fidelity.md, the quiet run); the note goes on plans whose share is at least this.
COUNTED_SHARE_LIMIT = 0.3
COUNTED_NOTE = ("predicted iteration {predicted_ms:.3g} ms is likely a lower bound: the runtime's fixed costs "
                "(Python per action and per step, message latencies, syncs) are {share:.0%} of it ({floor_ms:.3g} "
                "ms), and steps made largely of them ran up to 44% longer than predicted on CPU ranks "
                "(benchmarks/small_fidelity.md); a bigger batch or model makes the prediction more reliable")


def without_work(chain: CostChain) -> CostChain:
    """``chain`` with every block's compute, parameters and saved bytes and every cut's bytes at zero: its
    structure alone, whose iteration is what latencies, per-message, per-action and per-step costs take."""
    zero = Affine()
    blocks = tuple(replace(block, forward_s=zero, backward_s=zero, param_bytes=0, saved_bytes=zero, resaved=())
                   for block in chain.blocks)
    return CostChain(blocks, tuple(zero for _ in chain.cut_bytes))


def fixed_cost_share(plan: Plan, chain: CostChain, cluster: Cluster) -> tuple[float, float]:
    """(seconds of ``plan``'s iteration without work (:func:`without_work`), seconds with it) on ``cluster``."""
    from fxpipe.sim.virtual_simulate import simulate_virtual  # imports this module's simulate

    run = simulate_virtual if plan.chunk_groups else simulate
    floor = run(plan, without_work(chain), cluster, timeline=False).iteration_time_s
    return floor, run(plan, chain, cluster, timeline=False).iteration_time_s


def fixed_cost_note(plan: Plan, chain: CostChain, cluster: Cluster) -> str:
    """The note marking ``plan``'s prediction a lower bound, or "" (counted, or not dominating).

    A cluster with :attr:`Cluster.action_overhead_s` or :attr:`Cluster.step_overhead_s` counts them; when they
    are still at least :data:`COUNTED_SHARE_LIMIT` of the iteration, the note says the prediction is likely low
    (measured so on CPU ranks). Without them, the plan is simulated again with :data:`REFERENCE_ACTION_OVERHEAD_S` per action,
    with and without its work; when the fixed part is at least :data:`FIXED_SHARE_LIMIT` of that iteration,
    the prediction (which leaves them out) is a lower bound and the note says so. The plan is unchanged.
    """
    if plan.predicted is None:
        return ""
    if cluster.action_overhead_s > 0 or cluster.step_overhead_s > 0:
        floor, total = fixed_cost_share(plan, chain, cluster)
        if total <= 0 or floor < COUNTED_SHARE_LIMIT * total:
            return ""
        return COUNTED_NOTE.format(predicted_ms=plan.predicted.iteration_time_s * 1e3, share=floor / total,
                                   floor_ms=floor * 1e3)
    floor, total = fixed_cost_share(plan, chain, replace(cluster, action_overhead_s=REFERENCE_ACTION_OVERHEAD_S))
    if total <= 0 or floor < FIXED_SHARE_LIMIT * total:
        return ""
    return LOWER_BOUND_NOTE.format(predicted_ms=plan.predicted.iteration_time_s * 1e3,
                                   action_us=REFERENCE_ACTION_OVERHEAD_S * 1e6, share=floor / total,
                                   floor_ms=floor * 1e3, total_ms=total * 1e3)
