"""Runs this rank's lowered schedule: transfers, forward/backward per slice, gradient sync, loss broadcast."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from fxpipe.core import schedule as schedules
from fxpipe.core.plan import Plan
from fxpipe.runtime.autograd.measure import ActionTimer, MeasureMode, SavedActivationMeter, StepStats
from fxpipe.runtime.execution.actions import stage_actions
from fxpipe.runtime.execution.loss_allreduce import sum_loss_and_votes
from fxpipe.runtime.execution.measured_step import measured_step
from fxpipe.runtime.execution.receives import Inbox
from fxpipe.runtime.execution.stage import LossFn, StageRunner, read_local_loss, unique_params
from fxpipe.runtime.execution.stage_routes import ShapedStep, ShapedSteps, check_outgoing, gradient_routes
from fxpipe.runtime.execution.step_state import StepState
from fxpipe.runtime.faults.errors import PipelineSetupError
from fxpipe.runtime.faults.failures import DEFAULT_STALL_TIMEOUT_S, FailureLog, NoLog
from fxpipe.runtime.gradients.buckets import OverlappedAllreduce, split_overlapped
from fxpipe.runtime.gradients.grad_sync import (
    reduce_groups,
    reduce_sets,
    restore_stashed,
    start_allreduces,
    stash_grads,
    tied_stage_sets,
)
from fxpipe.runtime.gradients.trainable import TrainableSet
from fxpipe.runtime.parallel.param_precision import unsharded_call
from fxpipe.runtime.parallel.sharded_stage import ShardedStage
from fxpipe.runtime.parallel.tensor_parallel import TensorParallelGroups
from fxpipe.runtime.parallel.tensor_parallel_driver import TensorParallelDriver
from fxpipe.runtime.transport.batch_layout import BatchLayout, infer_value_dtypes
from fxpipe.runtime.transport.batchcheck import BatchChecker, check_shapes, describe_batch_dims
from fxpipe.runtime.transport.comm import (
    DEFAULT_TIMEOUT_S,
    DistContext,
    MessageKind,
    PeerExchange,
    Pending,
    device_rows,
    message_tag,
    pack,
    take_rows,
    unflatten_into,
)
from fxpipe.runtime.transport.rows import RowMap

if TYPE_CHECKING:
    from fxpipe.core.program import SplitProgram

Op = schedules.Op
Rows = tuple[int, int] | None  # a piece's rows of its value (None: all of it)


def lowered_actions(plan: Plan, stage_index: int) -> tuple[schedules.Action, ...]:
    """This stage's full action list from the plan's schedule, validated."""
    return stage_actions(plan.schedule, plan.num_stages, plan.num_microbatches, plan.warmup_policy,
                         stage_index).actions


def check_world(plan: Plan, program: SplitProgram, world_size: int) -> None:
    """The plan's devices must be exactly ranks 0..world_size-1 and match the program's stages."""
    if plan.all_devices() != list(range(world_size)):
        raise PipelineSetupError(
            f"plan {plan.layout!r} runs on devices {plan.all_devices()} but the process group has {world_size} "
            f"ranks; launch with --nproc-per-node={plan.world_size} (torchrun) or plan for {world_size} devices")
    if len(program.stages) != plan.num_stages:
        raise PipelineSetupError(f"program has {len(program.stages)} stages but the plan has {plan.num_stages}; "
                                 "generate the program from this plan (split_for_plan)")


class PipelineDriver(TensorParallelDriver):
    """One rank's part of a pipelined model: its stage replica, routes, process groups and step()."""

    def __init__(self, program: SplitProgram, plan: Plan, loss_fn: LossFn | None, *, context: DistContext,
                 autocast_dtype: torch.dtype | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 loss_reduction: str = "auto", check_batch: str = "first", target_batch_dim: int = 0,
                 stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S) -> None:
        check_world(plan, program, context.world_size)
        if loss_fn is None:
            raise PipelineSetupError("loss_fn is missing; pass loss_fn=callable(output, targets) -> scalar tensor")
        self.program, self.plan, self.context = program, plan, context
        self.target_batch_dim = target_batch_dim  # the targets' batch dim (inputs': program.values)
        self.rank = context.rank
        self.stage_index, self.replica_index = plan.stage_of_device(self.rank)
        self.stage = program.stages[self.stage_index]
        self.num_replicas = plan.stages[self.stage_index].replicas
        self.is_last = self.stage_index == plan.num_stages - 1
        # zero-bubble: B computes input gradients only and W (after it) the parameter gradients
        self.split_backward = any(action.op is Op.WEIGHT for action in lowered_actions(plan, self.stage_index))
        self.rows = RowMap.of(plan, self.replica_index, self.num_replicas)  # at the plan's batch (partial data)
        self.value_index = {name: i for i, name in enumerate(sorted(program.values))}
        self.autocast_dtype = self.compiled_autocast = autocast_dtype  # a caller's torch.autocast may change the first
        self.runner = StageRunner(self.stage, program, context.device, loss_fn=loss_fn,
                                  autocast_dtype=autocast_dtype, loss_reduction=loss_reduction,
                                  recompute=plan.stages[self.stage_index].recompute, target_batch_dim=target_batch_dim)
        # run at the start and at the end of every step (deferred BN statistics: reset, commit)
        self.start_hooks: list[Callable[[], None]] = []
        self.step_hooks: list[Callable[[], None]] = []
        self.exchange = PeerExchange(self.rank, context.device, timeout_s)
        self.preempted = False  # see fxpipe.runtime.faults.preemption
        self.exchange.failures = self.failures = FailureLog.for_default_group(self, self.rank, context.world_size)
        self._doing: FailureLog | NoLog = self.failures or NoLog()  # its .action: one write per action
        self.batch_checker = BatchChecker(check_batch, self.exchange, describe_batch_dims(program, target_batch_dim))
        # per autocast dtype a call ran under (compile's, a caller's torch.autocast): the values' dtypes, and one
        # ShapedStep per batch shape seen (the plan's made at once): no message asks a peer for shapes
        self._precisions: dict[torch.dtype | None, tuple[dict[str, torch.dtype | None], ShapedSteps]] = {}
        self.use_autocast(autocast_dtype)
        self.inbox = Inbox(self.exchange, context.device, self._tag, ahead=context.backend == "gloo",
                           stage_of=lambda rank: plan.stage_of_device(rank)[0])
        self._refresh_params()
        # T-way groups of tensor-parallel stages (fxpipe.runtime.parallel.tensor_parallel); then per stage, then per
        # tied stage set (fxpipe.runtime.sync reuses them)
        self._init_tensor_parallel(TensorParallelGroups.make(plan, self.rank, tied_stage_sets(program)))
        self.groups = reduce_groups(plan, program)
        if self.failures is not None:  # the heartbeat thread watches this rank's waits (failures.py)
            tp = self.tensor_parallel
            self.failures.watch_waits(stall_timeout_s, [*self.groups, tp.group, tp.replica_sum, *tp.tied_sums])
        self.overlap: OverlappedAllreduce | None = None
        self._set_reductions(frozenset())
        self.forward_only = False  # True while evaluate/predict run (fxpipe.runtime.inference)
        self.measure = MeasureMode.OFF  # what each step records in last_stats (see MeasureMode)
        self.last_stats: StepStats | None = None
        self.saved_meter: SavedActivationMeter | None = None  # made on the first fully measured step
        self.sharded: ShardedStage | None = None  # FSDP2 replicas (shard_stage, fxpipe.runtime.parallel.sharded_stage)

    # ---- setup ---------------------------------------------------------------------------------

    @property
    def sum_group(self) -> dist.ProcessGroup | None:
        """The group this stage's own gradients sum over: its replicas (on a tensor-parallel stage, the same member
        of each replica)."""
        return self.tensor_parallel.replica_sum if self.tensor_parallel.degree > 1 else self.groups[self.stage_index]

    def _set_reductions(self, partial: frozenset[str]) -> None:
        """This stage's gradient sums (fxpipe.runtime.gradients.grad_sync); the stage's own as overlapped buckets."""
        if self.overlap is not None:
            self.overlap.remove()
        sets = reduce_sets(self.plan, self.program, self.stage_index, self._own_params, self.groups,
                           self.tensor_parallel, partial)
        # Earlier steps' gradients are set aside only when this step's must be reduced or divided on
        # their own; otherwise autograd accumulates into them as in eager (old + new == new + old).
        self._stashes = bool(sets) or self.runner.loss_reduction == "token_mean"
        # the stage's own gradients: buckets launched during its last backward (plan.allreduce_bucket_bytes)
        self.overlap, self.reduce_sets = split_overlapped(sets, self.sum_group, self.plan.allreduce_bucket_bytes)

    def _use_stage_module(self, module: torch.fx.GraphModule) -> None:
        """Run ``module`` (a tensor-parallel shard) and walk its parameters again."""
        self.runner.use_module(module)
        self._refresh_params()

    def _refresh_params(self) -> None:
        # Walking parameters by path costs milliseconds; the set changes only when the module does.
        self._own_params = unique_params(self.runner.parameters())
        self._param_list = [param for _, param in self._own_params]
        self.trainable = TrainableSet(self.runner.parameters())

    def shard_stage(self, param_dtype: torch.dtype | None = None) -> None:
        """Shard this rank's stage as the plan says (fxpipe.runtime.parallel.sharded_stage; nothing for ``"none"``): after
        setup and the replicas' parameter sync, which runs on whole tensors. FSDP2 now reduces the stage's
        gradients, so the replica allreduce goes; tied weights stay whole and keep their own sums (bf16-params)."""
        stage_plan = self.plan.stages[self.stage_index]
        replica_group = self.sum_group  # on a tensor-parallel stage: this member's own kind over the replicas
        if stage_plan.sharding == "none" or replica_group is None:
            self.runner.call = unsharded_call(self.runner.module, param_dtype, stage_plan.recompute)
            return
        # under any of a parameter's names; gradients partial over a tensor-parallel group keep their whole-stage sum
        kept = {name for name, _ in self.program.tie_groups} | {n for n, p in self.tp_params.items() if p.partial}
        self.sharded = ShardedStage(self.runner.module, stage_plan.sharding, replica_group, self.context.device,
                                    stage_plan.recompute, [p for name, p in self.runner.parameters() if name in kept],
                                    self.runner.compiled, stage_plan.reshard_after_forward, param_dtype)
        self.runner.call = self.sharded
        if self.overlap is not None:
            self.overlap.remove()
            self.overlap = None
        self.reduce_sets = [(group, params) for group, params in self.reduce_sets if group is not replica_group]
        self._refresh_params()
        self._stashes = bool(self.reduce_sets) or self.runner.loss_reduction == "token_mean"
        live = {id(param) for param in self._param_list}  # the tied sets' parameters were left whole, not replaced
        assert all(id(p) in live for _, params in self.reduce_sets for p in params), "a reduced parameter was sharded"

    def use_autocast(self, dtype: torch.dtype | None) -> None:
        """Run the next calls' forwards under autocast of ``dtype`` (None: none), with that precision's value dtypes
        and layouts (made on first use; fxpipe.runtime.numerics.caller_autocast)."""
        if dtype == self.autocast_dtype and dtype in self._precisions:
            return
        if dtype not in self._precisions:
            dtypes = infer_value_dtypes(self.program, self.context.device, dtype)
            self._precisions[dtype] = dtypes, ShapedSteps(self.program, self.plan, self.stage_index, self.rank,
                                                          self.context.device, dtype, dtypes, self.target_batch_dim,
                                                          self.token_split)
        self.dtypes, self.shapes = self._precisions[dtype]
        self.autocast_dtype = self.runner.autocast_dtype = dtype
        self.batch_checker.precision = "" if dtype == self.compiled_autocast else f"caller's autocast {dtype}"

    # ---- the step ------------------------------------------------------------------------------

    def step(self, inputs: tuple[Any, ...], targets: Any, *, partial: bool = False) -> float:
        """One iteration over the global batch; returns the batch loss (the same float on every rank).

        ``partial``: ``inputs``/``targets`` hold only the rows this rank reads (``input_rows()`` /
        ``target_rows()``, in that order); values this rank does not read may be None.
        """
        if self.failures is not None:
            self.failures.step_index += 1
        self.trainable.check(self.rank, self.stage_index)
        shaped = self.begin(inputs, targets, partial=partial)
        self.inbox.start_step(shaped.messages, shaped.actions.following)
        for hook in self.start_hooks:
            hook()
        # while the loss probe is open (the first step) a contradiction drops the step's gradients: keep them apart
        stash = stash_grads(self._own_params) if self._stashes or self.runner.probe.active else None
        state = StepState(inputs, targets, shaped, partial)
        self.runner.reset()
        handlers = {Op.RECV_ACTIVATION: self.recv_activation, Op.FORWARD: self._forward,
                    Op.SEND_ACTIVATION: self.send_activation, Op.RECV_GRADIENT: self._recv_gradient,
                    Op.BACKWARD: self._backward_input if self.split_backward else self._backward,
                    Op.WEIGHT: self._backward_weight, Op.SEND_GRADIENT: self._send_gradient}
        if self.measure is MeasureMode.OFF:
            self.run_actions(state, stash, handlers, None)
        else:
            measured_step(self, state, stash, handlers)
        return state.loss

    def run_actions(self, state: StepState, stash: dict[int, torch.Tensor | None] | None,
                     handlers: Mapping[Op, Callable[[StepState, int], None]], timer: ActionTimer | None) -> None:
        """This rank's actions in schedule order, then the step's end; ``timer`` records each action."""
        doing = self._doing
        for action in state.shaped.actions.actions:
            doing.action = action
            started = timer.start() if timer is not None else 0.0
            if action.op is Op.ALLREDUCE:
                state.reductions.extend(start_allreduces(self.overlap, self.reduce_sets))
            else:
                handlers[action.op](state, action.microbatch_index)
            if timer is not None:
                timer.stop(action, started)
        self._finish(state, stash)
        doing.action = None

    def begin(self, inputs: tuple[Any, ...], targets: Any, *, partial: bool = False,
              fold: bool = True) -> ShapedStep:
        """Check the batch and find its layout, on every rank before any transfer; returns the ShapedStep.

        Local refusals come first and last: a collective with ranks that went on would hang. The batch
        check compares the batch over all ranks before the first steps and before any shape this rank has
        not run yet (all ranks pass the same batches, so all see the same shapes as new); later it folds
        into the step's closing allreduce (``fold=False``: nothing folds, only the compare before).
        Every rank sees the same batch, so every rank works out the same layout and raises the same errors.
        """
        self.inbox.check_clean()
        shaped = self.shapes.plan_step if partial else self.shapes.known(inputs, targets)
        self.batch_checker.check(inputs, targets, partial=partial, new_shape=shaped is None, fold=fold)
        if partial:  # partial data runs at the plan's shapes (the rows each rank reads are the plan's)
            check_shapes(self.program, inputs, targets, num_rows=self.rows.num_rows, reads=self.stage.input_values,
                         reads_targets=self.is_last, target_batch_dim=self.target_batch_dim)
        return shaped or self.shapes.add(inputs, targets)

    def _tag(self, kind: MessageKind, microbatch_index: int, value: str) -> int:
        return message_tag(kind, microbatch_index, self.value_index[value], len(self.value_index))

    def recv_activation(self, state: StepState, m: int) -> None:
        received: dict[str, Any] = {}
        in_routes = state.shaped.routes[m].inputs
        for name, routes in in_routes.items():
            if not self.program.values[name].is_tensor:
                tags = (self._tag(MessageKind.OBJECT_LENGTH, m, name), self._tag(MessageKind.OBJECT_BYTES, m, name))
                received[name] = self.exchange.recv_object(routes[0].sender_rank, tags,
                                                           f"receive object {name!r} of micro-batch {m}")
        pieces = self.inbox.take(MessageKind.ACTIVATION, m)
        for name, routes in in_routes.items():
            if self.program.values[name].is_tensor:
                bufs = [pieces[name, index] for index in range(len(routes))]
                received[name] = bufs[0] if len(bufs) == 1 else torch.cat(bufs, self.program.values[name].batch_dim)
        state.received[m] = received

    def _send(self, kind: MessageKind, m: int, outgoing: Sequence[tuple[int, str, torch.Tensor, Rows]],
              what: str, layout: BatchLayout) -> list[Pending]:
        """Send ``(peer, value name, piece, its rows)``: one packed message per peer, each piece checked against
        the step's layout first (what the receiver's buffer holds)."""
        by_peer: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for peer, name, piece, rows in outgoing:
            check_outgoing(self.program, layout, name, rows, piece, f"rank {self.rank} (stage {self.stage_index}): "
                           f"send {what} micro-batch {m} to rank {peer} (stage {self.plan.stage_of_device(peer)[0]})")
            by_peer.setdefault(peer, []).append((name, piece))
        ops: list[tuple[bool, torch.Tensor, int, int, str]] = []
        for peer, items in by_peer.items():
            names = [name for name, _ in items]
            ops.append((True, pack([t for _, t in items]), peer, self._tag(kind, m, names[0]),
                        f"send {what} {', '.join(map(repr, names))} of micro-batch {m}"))
        return self.exchange.post(ops)

    def stage_inputs(self, state: StepState, m: int) -> tuple[dict[str, Any], Any, int]:
        """Micro-batch ``m``'s stage inputs (received and sliced from the batch), targets and rows."""
        rows = state.shaped.rows
        start, stop = rows.local(m) if state.partial else rows.per_microbatch[m]
        values = state.received.pop(m, {}) if self.forward_only else dict(state.received.get(m, {}))
        for index, name in enumerate(self.program.model_inputs):
            if name in self.stage.input_values:
                spec = self.program.values[name]
                values[name] = device_rows(state.inputs[index], spec.batch_dim if spec.batched else None, start, stop,
                                           self.context.device)
        if not self.is_last or state.targets is None:
            return values, None, stop - start
        targets = tree_map(lambda t: device_rows(t, self.target_batch_dim, start, stop, self.context.device),
                           state.targets)
        return values, targets, stop - start

    def _forward(self, state: StepState, m: int) -> None:
        values, targets, rows = self.stage_inputs(state, m)
        if self.is_last:
            # weighted by rows / batch rows if the loss is a per-row mean (the runner's probe finds out)
            loss, count = self.runner.forward_loss(m, values, targets, rows, state.shaped.layout.num_rows)
            state.loss_parts.append(loss)  # no float(loss) here: it would wait for the device per micro-batch
            state.count_parts.append(count)
        else:
            state.outputs[m] = self.runner.forward(m, values)

    def send_activation(self, state: StepState, m: int) -> None:
        outputs = state.outputs[m]
        outgoing: list[tuple[int, str, torch.Tensor, Rows]] = []
        for name, routes in state.shaped.routes[m].outputs.items():
            value = outputs[name]
            for route in routes:
                if not isinstance(value, torch.Tensor):
                    tags = (self._tag(MessageKind.OBJECT_LENGTH, m, name),
                            self._tag(MessageKind.OBJECT_BYTES, m, name))
                    state.sends.extend(self.exchange.send_object(
                        value, route.receiver_rank, tags, f"send object {name!r} of micro-batch {m}"))
                    continue
                rows = route.sender_rows
                piece = value if rows is None else take_rows(value, self.program.values[name].batch_dim, *rows)
                outgoing.append((route.receiver_rank, name, piece, rows))
        state.sends.extend(self._send(MessageKind.ACTIVATION, m, outgoing, "activation", state.shaped.layout))

    def _recv_gradient(self, state: StepState, m: int) -> None:
        outputs = state.outputs[m]
        grads: dict[str, torch.Tensor] = {}
        for (name, index), buf in self.inbox.take(MessageKind.GRADIENT, m).items():
            rows = state.shaped.routes[m].gradient_rows[name, index]
            grad = grads.setdefault(name, torch.zeros_like(outputs[name]))
            target = grad if rows is None else take_rows(grad, self.program.values[name].batch_dim, *rows)
            target.add_(buf)
        state.output_grads[m] = grads

    def _backward(self, state: StepState, m: int) -> None:
        with self._overlapping(m == state.shaped.actions.last_gradient):
            state.input_grads[m] = self.runner.backward(m, state.output_grads.pop(m, {}))
        state.outputs.pop(m, None)

    @contextlib.contextmanager
    def _overlapping(self, last: bool) -> Iterator[None]:
        """Around the step's last gradient-producing backward: buckets launch as gradients land."""
        overlap = self.overlap if last else None
        if self.sharded is not None:
            self.sharded.before_backward(last)
        if overlap is not None:
            overlap.arm()
        yield
        if overlap is not None:
            overlap.backward_done()

    def _backward_input(self, state: StepState, m: int) -> None:
        if self.sharded is not None:  # FSDP2 reduces after W (_backward_weight), not in B's hooks
            self.sharded.before_split_backward()
        state.input_grads[m] = self.runner.backward_input(m, state.output_grads.pop(m, {}))
        state.outputs.pop(m, None)

    def _backward_weight(self, state: StepState, m: int) -> None:
        last = m == state.shaped.actions.last_gradient
        overlap = self.overlap if last else None  # none on a sharded stage: FSDP2 reduces
        if overlap is None:
            self.runner.backward_weight(m)
        else:
            # W writes .grad itself (no hook fires): it reports each gradient; what B gave (norm scales,
            # stage 0's whole backward) is final already
            in_w = {id(param) for param in self.runner.weight_params(m)}
            overlap.arm(ready=[param for _, param in self._own_params if id(param) not in in_w])
            self.runner.backward_weight(m, overlap.gradient_ready)
            overlap.backward_done()
        if self.sharded is not None:  # FSDP2's post-backward, which its hook ran too early (in B)
            self.sharded.after_weights(last)

    def _send_gradient(self, state: StepState, m: int) -> None:
        grads, received = state.input_grads.pop(m), state.received.pop(m)
        outgoing: list[tuple[int, str, torch.Tensor, Rows]] = []
        for name, routes in gradient_routes(self.program, state.shaped.routes[m].gradient_sends):
            grad = grads.get(name)
            if grad is None:  # the stage did not use the value on a differentiable path
                grad = torch.zeros_like(received[name])
            for route in routes:
                rows = route.receiver_rows
                batch_dim = self.program.values[name].batch_dim
                outgoing.append((route.sender_rank, name, grad if rows is None else take_rows(grad, batch_dim, *rows),
                                 rows))
        state.sends.extend(self._send(MessageKind.GRADIENT, m, outgoing, "gradient of", state.shaped.layout))

    # ---- gradient sync and loss ----------------------------------------------------------------

    def _finish(self, state: StepState, stash: dict[int, torch.Tensor | None] | None) -> None:
        for work, flat, tensors in state.reductions:
            self.exchange.wait([Pending(work, -1, f"gradient allreduce of stage {self.stage_index}", flat)])
            unflatten_into(flat, tensors)
        self.exchange.wait(state.sends)
        self.inbox.verify()
        state.loss = self._broadcast_loss(state)
        dropped = self.runner.probe.take_error()  # the same on every rank (folded into the loss allreduce)
        if stash is not None:  # a dropped step's gradients go: loss_fn is not what they were weighted for
            restore_stashed(self._own_params, stash, keep_this_step=dropped is None)
        if dropped is not None:
            raise dropped
        for hook in self.step_hooks:
            hook()

    def _broadcast_loss(self, state: StepState) -> float:
        """Sum the last stage replicas' weighted losses and hand the total to every rank.

        ``token_mean``: the slices' losses are sums; the total count comes with the loss, and this
        step's gradients (already summed over ranks) are divided by it, as one process would.
        """
        return self.runner.batch_loss(*self.reduce_loss(state), self._param_list)

    def reduce_loss(self, state: StepState) -> tuple[float, float]:
        """The summed weighted losses and counts of all last-stage replicas, on every rank (one allreduce that
        also carries the preemption vote and the folded batch check)."""
        loss_sum, count = read_local_loss(state.loss_parts, state.count_parts)
        if self.tensor_parallel.member > 0:  # every member of a group computed the same loss: it counts once
            loss_sum, count = 0.0, 0.0
        probe = self.runner.probe.fold_values()  # while open: every rank's verdict on loss_fn (loss_probe)
        folds = self.batch_checker.fold_values() if self.context.world_size > 1 else []  # one rank: no batch to compare
        loss_sum, count, self.preempted, folded = sum_loss_and_votes(self.exchange, self.context, loss_sum, count,
                                                                     [*probe, *folds])
        self.runner.probe.conclude(folded[:len(probe)])
        if self.context.world_size > 1:
            self.batch_checker.check_folded(folded[len(probe):])
        return loss_sum, count
