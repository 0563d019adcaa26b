"""Runs this rank's chunks (virtual stages) through its device group's lowered list: local hand-offs, messages per chunk pair."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_map

from fxpipe.core import schedule as schedules
from fxpipe.core.plan import Plan
from fxpipe.runtime.autograd.measure import ActionTimer, MeasureMode, SavedActivationMeter, StepStats
from fxpipe.runtime.execution.loss_allreduce import sum_loss_and_votes
from fxpipe.runtime.execution.receives import Inbox
from fxpipe.runtime.execution.stage import LossFn, StageRunner, read_local_loss, unique_params
from fxpipe.runtime.execution.stage_routes import check_outgoing
from fxpipe.runtime.execution.virtual_layouts import VirtualLayouts
from fxpipe.runtime.execution.virtual_measure import measured_actions
from fxpipe.runtime.execution.virtual_routes import (
    Link,
    VirtualStep,
    chunk_links,
    group_actions,
    link_tag,
)
from fxpipe.runtime.execution.virtual_sharding import ChunkSharding
from fxpipe.runtime.faults.errors import PipelineSetupError
from fxpipe.runtime.faults.failures import DEFAULT_STALL_TIMEOUT_S, FailureLog, NoLog
from fxpipe.runtime.gradients.grad_sync import restore_stashed, stash_grads
from fxpipe.runtime.gradients.virtual_grads import VirtualGroups, sum_gradients
from fxpipe.runtime.parallel.param_precision import unsharded_call
from fxpipe.runtime.parallel.tensor_parallel_driver import TensorParallelDriver
from fxpipe.runtime.transport.comm import (
    DEFAULT_TIMEOUT_S,
    DistContext,
    MessageKind,
    PeerExchange,
    Pending,
    device_rows,
    pack,
    take_rows,
)

if TYPE_CHECKING:
    from fxpipe.core.program import SplitProgram
    from fxpipe.runtime.numerics.batchnorm import DeferredCommit

Op = schedules.Op
Key = tuple[int, int]  # (chunk, micro-batch)


@dataclass
class VirtualState:
    """What one step (or forward-only pass) keeps between actions, per (chunk, micro-batch)."""

    inputs: tuple[Any, ...]
    targets: Any
    shaped: VirtualStep
    inboxes: dict[tuple[Link, MessageKind], Inbox]
    partial: bool = False  # inputs/targets hold only this replica's rows (RowMap.local), not the global batch
    received: dict[Key, dict[str, Any]] = field(default_factory=dict)  # remote inputs (zeros for unused gradients)
    outputs: dict[Key, dict[str, Any]] = field(default_factory=dict)
    input_grads: dict[Key, dict[str, Any]] = field(default_factory=dict)
    sends: list[Pending] = field(default_factory=list)
    loss_parts: list[torch.Tensor] = field(default_factory=list)
    count_parts: list[torch.Tensor | float] = field(default_factory=list)


class VirtualDriver(TensorParallelDriver):
    """One rank's part of a virtual-stage pipeline: one StageRunner per chunk of its device group, and step(); on a
    T-way group each chunk runs this member's shard (fxpipe.compile_virtual_tensor_parallel), ``whole``/``part``
    by original name as on one stage."""

    def __init__(self, program: SplitProgram, plan: Plan, loss_fn: LossFn | None, *, context: DistContext,
                 autocast_dtype: torch.dtype | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 loss_reduction: str = "auto", target_batch_dim: int = 0,
                 stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S) -> None:
        if plan.all_devices() != list(range(context.world_size)) or len(program.stages) != plan.num_stages:
            raise PipelineSetupError(f"plan {plan.layout!r} ({plan.num_stages} chunks) runs on devices "
                                     f"{plan.all_devices()} but the process group has {context.world_size} ranks and "
                                     f"the program {len(program.stages)} stages; launch with "
                                     f"--nproc-per-node={plan.world_size} and split the program from this plan")
        self.program, self.plan, self.context, self.rank = program, plan, context, context.rank
        self.target_batch_dim = target_batch_dim
        self.group_index = plan.group_of_chunk(plan.stage_of_device(self.rank)[0])
        self.chunks = plan.chunks_of_group(self.group_index)
        self.stage_index, self.replica_index = self.chunks[0], plan.stage_of_device(self.rank)[1]
        self.last_chunk = plan.num_stages - 1
        self.runners = {c: StageRunner(program.stages[c], program, context.device, loss_fn=loss_fn,
                                       autocast_dtype=autocast_dtype, loss_reduction=loss_reduction,
                                       recompute=plan.stages[c].recompute, target_batch_dim=target_batch_dim)
                        for c in self.chunks}
        # the runner whose loss probe this rank folds into the loss allreduce (one per rank, as one stage each)
        self.runner = self.runners.get(self.last_chunk, self.runners[self.chunks[-1]])
        self.links = {c: chunk_links(program, plan, c) for c in self.chunks}
        self.split_backward = any(a.op is Op.WEIGHT for a in group_actions(
            plan.schedule, plan.num_stages, plan.num_microbatches, plan.virtual_stages, self.group_index))
        # value dtypes and layouts per autocast dtype a call runs under (compile's, or a caller's torch.autocast)
        self.compiled_autocast = autocast_dtype
        self.layouts = VirtualLayouts(program, plan, self.group_index, self.rank, context.device, target_batch_dim,
                                      autocast_dtype)
        self.value_index = {name: i for i, name in enumerate(sorted(program.values))}
        self.exchange = PeerExchange(self.rank, context.device, timeout_s)
        self.exchange.failures = self.failures = FailureLog.for_default_group(self, self.rank, context.world_size)
        self._doing: FailureLog | NoLog = self.failures or NoLog()
        self.groups = VirtualGroups.make(plan, program, self.group_index)
        self._init_tensor_parallel(self.groups.tensor_parallel)  # shards: set by fxpipe.compile_virtual_tensor_parallel
        self.partial_grads: frozenset[str] = frozenset()  # gradients partial over a T-way group: summed over all of it
        if self.failures is not None:  # the heartbeat thread names a silent peer while this rank waits
            self.failures.watch_waits(stall_timeout_s, [self.groups.replicas, self.groups.devices,
                                                        self.tensor_parallel.group,
                                                        *(g for g, _ in self.groups.tied.values())])
        # each parameter once: chunks of one rank may share a tied weight's Parameter (autograd then sums it locally)
        self.named = unique_params(item for c in self.chunks for item in self.runners[c].parameters())
        self.forward_only = False
        self.preempted = False
        self._failed_step: str | None = None  # why a step failed: later steps are refused
        self.sharding: ChunkSharding | None = None  # FSDP2 per sharded chunk (shard_chunks, fxpipe.runtime.execution.virtual_sharding)
        self.summed = self.named  # what sum_gradients reduces: all but what FSDP2 reduces
        self.batch_norm: DeferredCommit | None = None  # batch_norm "deferred"/"sync" (fxpipe.virtual_pipe)
        self.measure = MeasureMode.OFF  # pipe.measure (fxpipe.runtime.execution.virtual_measure)
        self.last_stats: StepStats | None = None
        self.saved_meter: SavedActivationMeter | None = None

    def shard_chunks(self, param_dtype: torch.dtype | None = None) -> None:
        """Shard the chunks the plan shards (fxpipe.runtime.execution.virtual_sharding), after the parameter sync;
        FSDP2 then reduces their untied parameters, so the driver's allreduce leaves them out. ``param_dtype``
        (bf16-params): every chunk computes with bf16 copies of its fp32 masters, as one stage does."""
        sharding = ChunkSharding(self.plan, self.runners, self.groups, self.context.device, self.partial_grads,
                                 param_dtype)
        for chunk, runner in self.runners.items():
            if chunk not in sharding.stages:
                runner.call = unsharded_call(runner.module, param_dtype, self.plan.stages[chunk].recompute)
        if not sharding.stages:
            return
        self.sharding = sharding
        self.named = unique_params(item for c in self.chunks for item in self.runners[c].parameters())
        fsdp = sharding.reduced_by_fsdp()
        self.summed = [(name, param) for name, param in self.named if id(param) not in fsdp]

    # ---- layout ----------------------------------------------------------------------------------

    def use_autocast(self, dtype: torch.dtype | None) -> None:
        """Run the next calls' forwards under autocast of ``dtype`` (None: none), with its value dtypes and layouts."""
        self.layouts.use(dtype)
        for runner in self.runners.values():
            runner.autocast_dtype = dtype

    def shaped(self, inputs: Sequence[Any], targets: Any) -> VirtualStep:
        return self.layouts.shaped(inputs, targets)

    def start(self, inputs: tuple[Any, ...], targets: Any, *, forward_only: bool, partial: bool = False) -> VirtualState:
        """The step's state, with one inbox per (chunk pair, kind) this rank receives, first receives posted;
        ``partial``: ``inputs``/``targets`` hold only this rank's rows (``input_rows()``/``target_rows()``)."""
        if self._failed_step is not None:  # its receives may still be posted: they would take this step's messages
            raise PipelineSetupError(f"rank {self.rank}: an earlier step failed ({self._failed_step}); build the "
                                     "pipeline again (fxpipe.compile) to go on")
        shaped = self.layouts.plan_step(inputs, targets) if partial else self.shaped(inputs, targets)
        inboxes = {}
        try:
            for (link, kind), messages in shaped.messages.items():
                if forward_only and kind is MessageKind.GRADIENT:
                    continue
                inbox = Inbox(self.exchange, self.context.device, self._tagger(link),
                              ahead=self.context.backend == "gloo",
                              stage_of=lambda rank: self.plan.stage_of_device(rank)[0])
                inbox.start_step(messages, shaped.following(link, kind, forward_only))
                inboxes[link, kind] = inbox
        except BaseException as error:  # receives posted before the failure would take a later step's messages
            self.mark_failed(error)
            raise
        return VirtualState(inputs, targets, shaped, inboxes, partial)

    def _tagger(self, link: Link) -> Callable[[MessageKind, int, str], int]:
        def tag(kind: MessageKind, m: int, value: str) -> int:
            return link_tag(kind, m, self.value_index[value], len(self.value_index), link, self.plan.num_stages)
        return tag

    # ---- the step ----------------------------------------------------------------------------------

    def step(self, inputs: tuple[Any, ...], targets: Any, *, partial: bool = False) -> float:
        """One iteration over the global batch; returns the batch loss (the same float on every rank)."""
        if self.failures is not None:
            self.failures.step_index += 1
        state = self.start(inputs, targets, forward_only=False, partial=partial)
        if self.batch_norm is not None:  # drop sums a failed step left behind
            self.batch_norm.reset()
        stash = stash_grads(self.named)
        handlers: dict[Op, Callable[[VirtualState, int, int], None]] = {
            Op.FORWARD: self.forward, Op.BACKWARD: self._backward, Op.WEIGHT: self._weight}
        if self.sharding is not None:
            self.sharding.start_step(state.shaped.actions, self.split_backward)
        try:
            with measured_actions(self) as timer:
                self.run_actions(state, state.shaped.actions, handlers, timer)
            self.finish_transfers(state)
            sum_gradients(self.summed, self.groups, self.exchange, f"device group {self.group_index}",
                          self.partial_grads)
            if self.batch_norm is not None:  # running statistics of the whole batch, once per step
                self.batch_norm()
            loss = self.runner.batch_loss(*self.reduce_loss(state), [p for _, p in self.named])
        except BaseException as error:
            self.mark_failed(error)
            for runner in self.runners.values():
                runner.reset()
            restore_stashed(self.named, stash, keep_this_step=False)
            raise
        dropped = self.runner.probe.take_error()
        restore_stashed(self.named, stash, keep_this_step=dropped is None)
        if dropped is not None:
            raise dropped
        return loss

    def mark_failed(self, error: BaseException) -> None:
        """Refuse later steps and forward passes: a failed one may leave receives posted."""
        self._failed_step = f"{type(error).__name__}: {str(error)[:200]}"

    def run_actions(self, state: VirtualState, actions: Sequence[schedules.Action],
                    handlers: Mapping[Op, Callable[[VirtualState, int, int], None]],
                    timer: ActionTimer | None = None) -> None:
        """Each compute action through its handler; transfers happen inside them (sends as soon as a value is made,
        receives where it is read), so RA/SA/RG/SG and the allreduce (after the list) have nothing left to do.
        ``timer`` (``pipe.measure``) records each compute action under its chunk."""
        doing = self._doing
        for action in actions:
            doing.action = action
            handler = handlers.get(action.op)
            if handler is not None:
                started = timer.start() if timer is not None else 0.0
                handler(state, action.chunk_index, action.microbatch_index)
                if timer is not None:
                    timer.stop(action, started, action.chunk_index)
        doing.action = None

    def finish_transfers(self, state: VirtualState) -> None:
        self.exchange.wait(state.sends)
        for inbox in state.inboxes.values():
            inbox.verify()

    def chunk_inputs(self, state: VirtualState, chunk: int, m: int) -> tuple[dict[str, Any], Any, int]:
        """Micro-batch ``m``'s inputs of ``chunk``: model inputs sliced, local chunks' outputs, remote pieces."""
        program, rows = self.program, state.shaped.rows
        start, stop = rows.local(m) if state.partial else rows.per_microbatch[m]
        values: dict[str, Any] = {}
        for index, name in enumerate(program.model_inputs):
            if name in program.stages[chunk].input_values:
                spec = program.values[name]
                values[name] = device_rows(state.inputs[index], spec.batch_dim if spec.batched else None, start, stop,
                                           self.context.device)
        remote_in, _, local = self.links[chunk]
        for producer in local:
            produced = state.outputs[producer, m]
            values.update({n: produced[n] for n in program.stages[chunk].input_values if n in produced})
        received: dict[str, Any] = {}
        for link in remote_in:
            tag = self._tagger(link)
            for name, routes in state.shaped.in_routes[m][link].activations.items():
                if not program.values[name].is_tensor:
                    received[name] = self.exchange.recv_object(routes[0].sender_rank, _object_tags(tag, m, name),
                                                               f"receive object {name!r} of micro-batch {m}")
            pieces = state.inboxes[link, MessageKind.ACTIVATION].take(MessageKind.ACTIVATION, m)
            for name, routes in state.shaped.in_routes[m][link].activations.items():
                if not program.values[name].is_tensor:
                    continue
                bufs = [pieces[name, i] for i in range(len(routes))]
                received[name] = bufs[0] if len(bufs) == 1 else torch.cat(bufs, program.values[name].batch_dim)
        state.received[chunk, m] = received
        values.update(received)
        if chunk != self.last_chunk or state.targets is None:
            return values, None, stop - start
        targets = tree_map(lambda t: device_rows(t, self.target_batch_dim, start, stop, self.context.device),
                           state.targets)
        return values, targets, stop - start

    def forward(self, state: VirtualState, chunk: int, m: int) -> None:
        values, targets, rows = self.chunk_inputs(state, chunk, m)
        runner, global_rows = self.runners[chunk], state.shaped.layout.num_rows
        if self.forward_only:
            outputs, loss, count = runner.infer(values, targets, rows, global_rows)
            if loss is not None:
                state.loss_parts.append(loss)
                state.count_parts.append(count)
            state.outputs[chunk, m] = outputs
        elif chunk == self.last_chunk:
            loss, count = runner.forward_loss(m, values, targets, rows, global_rows)
            state.loss_parts.append(loss)
            state.count_parts.append(count)
            state.outputs[chunk, m] = {}
        else:
            state.outputs[chunk, m] = runner.forward(m, values)
        for link in self.links[chunk][1]:
            self._send_activations(state, link, m)

    def _send_activations(self, state: VirtualState, link: Link, m: int) -> None:
        outputs = state.outputs[link[0], m]
        outgoing = []
        tag = self._tagger(link)
        for name, routes in state.shaped.out_routes[m][link].activations.items():
            batch_dim = self.program.values[name].batch_dim
            for route in routes:
                if not isinstance(outputs[name], torch.Tensor):
                    state.sends.extend(self.exchange.send_object(outputs[name], route.receiver_rank,
                                                                 _object_tags(tag, m, name),
                                                                 f"send object {name!r} of micro-batch {m}"))
                    continue
                rows = route.sender_rows
                piece = outputs[name] if rows is None else take_rows(outputs[name], batch_dim, *rows)
                outgoing.append((route.receiver_rank, name, piece, rows))
        self._send(state, MessageKind.ACTIVATION, link, m, outgoing)

    def _send(self, state: VirtualState, kind: MessageKind, link: Link, m: int,
              outgoing: Sequence[tuple[int, str, torch.Tensor, tuple[int, int] | None]]) -> None:
        """One packed message per peer of chunk pair ``link``, each piece checked against the step's layout first."""
        by_peer: dict[int, list[tuple[str, torch.Tensor]]] = {}
        what = "activation" if kind is MessageKind.ACTIVATION else "gradient of"
        for peer, name, piece, rows in outgoing:
            check_outgoing(self.program, state.shaped.layout, name, rows, piece,
                           f"rank {self.rank} (chunks {link}): send {what} micro-batch {m} to rank {peer}")
            by_peer.setdefault(peer, []).append((name, piece))
        tag = self._tagger(link)
        state.sends.extend(self.exchange.post([
            (True, pack([t for _, t in items]), peer, tag(kind, m, items[0][0]),
             f"send {what} {', '.join(repr(n) for n, _ in items)} of micro-batch {m} (chunks {link[0]} -> {link[1]})")
            for peer, items in by_peer.items()]))

    def _output_grads(self, state: VirtualState, chunk: int, m: int) -> dict[str, torch.Tensor]:
        """The gradients of ``chunk``'s outputs: summed over its local consumers and the pieces remote ones sent."""
        outputs = state.outputs.pop((chunk, m))
        grads: dict[str, torch.Tensor] = {}
        for consumer in (k for k in self.chunks if chunk in self.links[k][2]):
            given = state.input_grads.get((consumer, m), {})
            for name in [n for n in given if n in outputs]:  # a value has one producer: its gradients go now
                grad = given.pop(name)
                if grad is not None:
                    grads[name] = grad if name not in grads else grads[name] + grad
        for link in self.links[chunk][1]:
            pieces = state.inboxes[link, MessageKind.GRADIENT].take(MessageKind.GRADIENT, m)
            for name, routes in state.shaped.out_routes[m][link].gradients.items():
                batch_dim = self.program.values[name].batch_dim
                total = grads[name] = grads[name].clone() if name in grads else torch.zeros_like(outputs[name])
                for index, route in enumerate(routes):
                    rows = route.sender_rows
                    (total if rows is None else take_rows(total, batch_dim, *rows)).add_(pieces[name, index])
        return grads

    def _backward(self, state: VirtualState, chunk: int, m: int) -> None:
        runner = self.runners[chunk]
        output_grads = self._output_grads(state, chunk, m)
        if self.split_backward:
            if self.sharding is not None:  # FSDP2 reduces after W (_weight), not in B's hooks
                self.sharding.before_split_backward(chunk)
            state.input_grads[chunk, m] = runner.backward_input(m, output_grads)
        else:
            if self.sharding is not None:
                self.sharding.before_backward(chunk, m)
            state.input_grads[chunk, m] = runner.backward(m, output_grads)
        for link in self.links[chunk][0]:
            self._send_gradients(state, link, m)
        # what the remote producers got is sent (packed copies): keep only the local producers' gradients
        received = state.received.pop((chunk, m), {})
        kept = {n: g for n, g in state.input_grads[chunk, m].items() if n not in received}
        if kept:
            state.input_grads[chunk, m] = kept
        else:
            del state.input_grads[chunk, m]

    def _send_gradients(self, state: VirtualState, link: Link, m: int) -> None:
        grads, received = state.input_grads[link[1], m], state.received[link[1], m]
        outgoing = []
        for name, routes in state.shaped.in_routes[m][link].gradients.items():
            grad = grads.get(name)
            if grad is None:  # the chunk did not use the value on a differentiable path
                grad = torch.zeros_like(received[name])
            batch_dim = self.program.values[name].batch_dim
            for route in routes:
                rows = route.receiver_rows
                outgoing.append((route.sender_rank, name, grad if rows is None else take_rows(grad, batch_dim, *rows),
                                 rows))
        self._send(state, MessageKind.GRADIENT, link, m, outgoing)

    def _weight(self, state: VirtualState, chunk: int, m: int) -> None:
        self.runners[chunk].backward_weight(m)
        if self.sharding is not None:  # FSDP2's post-backward, which its hook ran too early (in B)
            self.sharding.after_weights(chunk, m)

    # ---- loss ----------------------------------------------------------------------------------------

    def reduce_loss(self, state: VirtualState) -> tuple[float, float]:
        """The summed weighted losses and counts of the last chunk's replicas, on every rank (one allreduce that
        also carries the preemption vote and every rank's loss-probe verdict)."""
        loss_sum, count = read_local_loss(state.loss_parts, state.count_parts)
        if self.tensor_parallel.member > 0:  # every member of a group computed the same loss: it counts once
            loss_sum, count = 0.0, 0.0
        probe = self.runner.probe.fold_values()
        loss_sum, count, self.preempted, probe = sum_loss_and_votes(self.exchange, self.context, loss_sum, count, probe)
        for runner in self.runners.values():
            runner.probe.conclude(probe)
        return loss_sum, count


def _object_tags(tag: Callable[[MessageKind, int, str], int], m: int, name: str) -> tuple[int, int]:
    """The two tags of a Python object value's length and bytes."""
    return tag(MessageKind.OBJECT_LENGTH, m, name), tag(MessageKind.OBJECT_BYTES, m, name)
