"""fxpipe.compile (function and decorator): a model plus a plan becomes a PipelinedModule that trains under torchrun."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fxpipe.compile_options import CompileOptions
from fxpipe.compile_plan import resolve_plan
from fxpipe.core import meta
from fxpipe.core.cluster import Cluster
from fxpipe.core.plan import Plan
from fxpipe.core.recompute import parse_recompute
from fxpipe.core.sharding import ShardingError, check_request
from fxpipe.pipe_inputs import on_model_device, positional_inputs
from fxpipe.pipe_lifecycle import PipeLifecycle
from fxpipe.runtime.faults.errors import PipelineSetupError

if TYPE_CHECKING:
    from fxpipe.runtime.execution.driver import PipelineDriver



class PipelinedModule(PipeLifecycle):
    """This rank's share of a pipelined model: one replica of one stage, and ``step`` for the whole job.

    Every rank calls ``step(inputs, targets)`` with the same global batch and gets the same loss.
    ``parameters()``/``named_parameters()``/``state_dict()`` cover this rank's stage only and use the
    original model's names, so ``torch.optim.AdamW(pipe.parameters())`` is this rank's optimizer. On a
    sharded stage (``sharding``, docs/sharding.md) ``parameters()`` yields this rank's DTensor shards and
    ``state_dict()`` whole tensors.
    """

    def __init__(self, driver: PipelineDriver, graph_module: torch.fx.GraphModule) -> None:
        self.driver = driver
        self.graph_module = graph_module

    plan = property(lambda self: self.driver.plan, doc="The Plan this module runs.")
    program = property(lambda self: self.driver.program, doc="The SplitProgram (all stages' code).")
    rank = property(lambda self: self.driver.rank, doc="This process's rank.")
    stage_index = property(lambda self: self.driver.stage_index, doc="The stage this rank runs.")
    replica_index = property(lambda self: self.driver.replica_index, doc="Which replica of the stage.")
    module = property(lambda self: self.driver.runner.module, doc="This rank's stage GraphModule.")
    loss_reduction = property(lambda self: self.driver.runner.probe.resolved,
                              doc="The loss_reduction in force: the declared one, or what 'auto' found (None before).")

    def step(self, inputs: Any, targets: Any, *, partial: bool = False) -> float:
        """Forward and backward of the global batch; gradients land in ``parameters()``; returns the loss.

        Every rank passes the same global batch, or with ``partial=True`` only the rows it reads:
        ``input_rows()`` of the inputs and ``target_rows()`` of the targets, concatenated in that
        order (None where it reads none). See docs/exactness.md.
        """
        if partial and inputs is None:
            inputs = {name: None for name in self.driver.program.model_inputs}
        return self._collective(self.driver.step, self._positional(inputs, partial), targets, partial=partial)

    def evaluate(self, inputs: Any, targets: Any) -> float:
        """The loss of the global batch, forward only: what ``step`` would return, with no gradient touched.

        Collective (every rank passes the same batch); runs under ``torch.no_grad`` in the module's
        current mode, so call ``eval()`` first for dropout and BatchNorm as in validation.
        """
        from fxpipe.runtime.inference import evaluate

        return self._collective(evaluate, self.driver, self._positional(inputs), targets)

    def predict(self, inputs: Any) -> Any:
        """The model's output for the global batch, with the structure the model returns, on every rank.

        Collective and forward only, like :meth:`evaluate`; ``pipe(inputs)`` is the same call.
        """
        from fxpipe.runtime.inference import predict

        return self._collective(predict, self.driver, self._positional(inputs))

    __call__ = predict

    def input_rows(self) -> tuple[tuple[int, int], ...] | None:
        """Global-batch row ranges ``[start, stop)`` whose inputs this rank reads (None: it reads none)."""
        from fxpipe.runtime.transport.rows import input_rows

        return input_rows(self.driver.program, self.stage_index, self.driver.rows)

    def target_rows(self) -> tuple[tuple[int, int], ...] | None:
        """Global-batch row ranges whose targets this rank reads: last-stage replicas only, else None."""
        from fxpipe.runtime.transport.rows import target_rows

        return target_rows(self.driver.program, self.stage_index, self.driver.rows)

    def _positional(self, inputs: Any, partial: bool = False) -> tuple[Any, ...]:
        return positional_inputs(self.driver.program.model_inputs, inputs, partial)

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        seen: set[int] = set()
        for name, param in self.driver.runner.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                yield name, param

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        for _, param in self.named_parameters():
            yield param

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model: the norm of every stage's gradients.

        Call on every rank after ``step``; returns the same total on every rank. Each parameter counts
        once (not once per replica or per stage holding a tied weight). ``clip_grad_norm_(pipe.parameters())``
        would clip each rank by its own stage's norm instead.
        """
        from fxpipe.runtime.clipping import clip_grad_norm

        return clip_grad_norm(self.driver, list(self.named_parameters()), max_norm, norm_type, error_if_nonfinite)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers of this rank's stage under their original names (detached), whole tensors.

        A sharded stage's parameters are gathered (``DTensor.full_tensor``): a collective over the stage's
        replicas, so every rank calls it (as ``save`` does); a tensor-parallel stage's over its group.
        """
        return {name: self.driver.whole(name, tensor) for name, tensor in self._stage_tensors().items()}

    def _stage_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's parameters (shards on a sharded stage) and buffers by original name, every alias."""
        module = self.driver.runner.module
        state = {}
        for path, original in self.driver.stage.param_names:
            owner_path, _, attribute = path.rpartition(".")
            owner = module.get_submodule(owner_path) if owner_path else module
            value = getattr(owner, attribute)
            if isinstance(value, torch.Tensor):
                state[original] = value
        return state

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy the entries this stage holds from a full (or partial) state dict keyed by original names
        (into a sharded stage: each rank its shard of each whole tensor)."""
        from fxpipe.runtime.parallel.sharded_stage import copy_full_into

        own = self._stage_tensors()
        missing = sorted(set(own) - set(state))
        if missing:
            raise KeyError(f"state dict lacks {missing} held by stage {self.stage_index}")
        for name, tensor in own.items():
            copy_full_into(tensor, self.driver.part(name, state[name]))

    def train(self, mode: bool = True) -> PipelinedModule:
        self.driver.runner.module.train(mode)
        return self

    def eval(self) -> PipelinedModule:
        return self.train(False)

    def __repr__(self) -> str:
        return (f"PipelinedModule(layout={self.plan.layout!r}, rank={self.rank}, stage={self.stage_index}, "
                f"replica={self.replica_index}, schedule={self.plan.schedule!r})")


def compile(model: Any = None, example_inputs: Any = None, *, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
            global_batch_size: int | None = None, plan: str | Path | Plan = "auto", schedule: str | None = None,
            num_microbatches: int | None = None, cluster: str | Cluster | None = None, optimizer: str = "adam",
            warmup_policy: str | None = None, autocast_dtype: torch.dtype | None = None,
            timeout_s: float = 60.0, sync_params: str = "broadcast", check_batch: str = "first",
            loss_reduction: str = "auto", batch_norm: str = "microbatch",
            batch_dims: int | Mapping[str, int] | None = None, target_batch_dim: int | None = None,
            recompute: str | Sequence[bool | str] = "auto", costs: str = "auto", check_rows: bool = True,
            stall_timeout_s: float = 5.0, sharding: str | Sequence[str] | None = None,
            torch_compile: bool | Mapping[str, Any] = False, verbose: bool | None = None,
            sequence_parallel: bool = False, param_dtype: torch.dtype | None = None,
            virtual_stages: int | str = 1) -> Any:
    """Pipeline ``model`` over the process group's ranks; returns a :class:`PipelinedModule`.

    ``plan``: ``"auto"`` (DAPPLE planner on ``cluster``, default ``local:<world size>``), a layout such as
    ``"3:1"`` (planner picks cuts and placement), ``"markers"`` (cuts at the model's
    ``torch.distributed.pipelining.pipe_split()`` calls; the planner picks replicas and placement on
    every rank), a :class:`Plan`, or a plan JSON path. ``schedule``: ``"dapple"`` (early backward), ``"gpipe"``,
    ``"zero_bubble"`` (split backward, W deferred), ``"auto"`` (the planner picks per plan), or with ``virtual_stages``
    (model chunks per device group: 1, 2, ... or ``"auto"``; docs/virtual_stages.md) ``"interleaved"``,
    ``"interleaved_zero_bubble"`` or ``"zbv"``; None keeps the plan's (plans made here: ``"dapple"``). ``loss_fn(output, targets)``
    returns what ``loss_reduction`` says: ``"auto"`` (default) a scalar that the first step finds to be a
    per-row mean or a sum over rows (a loss that is neither raises on every rank, naming ``"token_mean"``),
    ``"mean"`` a per-row mean scalar, ``"sum"`` a sum over rows, ``"token_mean"`` a ``(sum, count)`` pair
    (e.g. tokens not equal to ``ignore_index``); a declared one the first step contradicts raises too.
    ``sync_params``: ``"broadcast"`` (replicas and tied weights start from the lowest rank's values),
    ``"verify"`` (fail naming the first differing tensor) or ``"off"``. ``check_batch``: ``"first"``,
    ``"always"`` or ``"off"`` (every rank must pass the same global batch). ``batch_norm``:
    ``"microbatch"``, ``"deferred"`` (running statistics once per step) or ``"sync"`` (also normalise
    over the stage's replicas, as SyncBatchNorm). ``batch_dims``: the dim holding the batch, one int for
    every input or ``{input name: dim}`` (others 0), e.g. ``1`` for a seq-first ``(T, B, C)`` model;
    ``target_batch_dim``: the targets' (default: ``batch_dims`` when an int, else 0); with neither,
    dim 0, and an input whose batch size also sits in another dim the model can grow is refused as
    ambiguous. See docs/exactness.md. ``recompute``: ``"auto"`` (the planner recomputes a stage's
    activations only where keeping them does not fit, per block), ``"never"``, ``"always"``, ``"selective"``
    (attention cores only; docs/recompute.md) or one ``"keep"``/``"recompute"`` per stage. ``sharding``: what a stage's replicas split among themselves (ZeRO
    inside the replica group, through FSDP2; docs/sharding.md): ``"none"``, ``"optimizer"``, ``"gradients"``,
    ``"parameters"``, one level per stage, or ``"auto"`` (the planner picks each stage's level with its recompute
    choice; a given plan keeps its levels); None (default) keeps a given plan's levels and plans unsharded.
    ``schedule="zero_bubble"`` runs ``"optimizer"`` and ``"gradients"`` (FSDP2 reduces after W) and refuses
    ``"parameters"``.
    ``costs``: where the planner's block times come from: ``"auto"``
    (measured by every rank at once for the launched devices, analytic for a ``cluster`` naming other
    devices; ``$FXPIPE_COSTS`` overrides), ``"measured"`` or ``"analytic"`` (no measuring). ``check_rows``:
    when the plan splits the batch (micro-batches or replicas), run the model in eval mode on the example
    batch whole and in halves and refuse it if rows see each other (docs/exactness.md). ``autocast_dtype``:
    ``torch.bfloat16`` or ``torch.float16`` trains under autocast (fp32 master weights), and the planner costs and
    measures the model under the same autocast (the plan's ``precision``, docs/clusters.md); ``param_dtype=torch.
    bfloat16`` too: bf16 copies of the fp32 masters compute, gradients sum in fp32 (``"bf16-params"``). ``timeout_s``:
    how long a transfer or collective waits on ranks that are alive; ``stall_timeout_s``: a rank whose heartbeat
    stopped this long (frozen, stopped) is named as the root cause on every rank (docs/faults.md).
    ``torch_compile``: True (or torch.compile's keyword arguments, e.g. ``{"backend": "aot_eager"}``) compiles
    each stage's forward, and its backward through AOTAutograd, with the batch dim dynamic (docs/compile.md).
    ``verbose``: True prints the plan table (as ``fxpipe plan`` does) on rank 0, False never; None (default) prints
    it when rank 0's stdout is a terminal. The plan is ``pipe.plan`` either way (``pipe.plan.to_json()``).
    ``sequence_parallel``: on stages of T-way tensor-parallel groups (``RxT``, docs/tensor_parallel.md), norms, dropout
    and residual adds between pairs run on each member's share of the tokens (every batch's sequence length must
    then divide by T). As a decorator, ``@fxpipe.compile(loss_fn=..., global_batch_size=...)``
    on a model class or factory makes ``Factory(*args, example_inputs=..., **kwargs)`` return the module.
    """
    options = CompileOptions(loss_fn, global_batch_size, plan, schedule, num_microbatches, warmup_policy,
                             cluster, optimizer, autocast_dtype, timeout_s, sync_params=sync_params,
                             check_batch=check_batch, loss_reduction=loss_reduction, batch_norm=batch_norm,
                             batch_dims=batch_dims, target_batch_dim=target_batch_dim, recompute=recompute,
                             costs=costs, check_rows=check_rows, stall_timeout_s=stall_timeout_s,
                             sharding=sharding, torch_compile=torch_compile, verbose=verbose,
                             sequence_parallel=sequence_parallel, param_dtype=param_dtype,
                             virtual_stages=virtual_stages)
    if model is None:
        return functools.partial(_wrap_factory, options=options)
    if isinstance(model, torch.nn.Module):
        return compile_module(model, example_inputs, options)
    if callable(model) and example_inputs is None:
        return _wrap_factory(model, options)
    raise TypeError(f"fxpipe.compile takes an nn.Module (with example_inputs) or a model class/factory, got "
                    f"{type(model).__name__}")


def _wrap_factory(factory: Callable[..., torch.nn.Module], options: CompileOptions) -> Callable[..., PipelinedModule]:
    @functools.wraps(factory)
    def build(*args: Any, example_inputs: Any, **kwargs: Any) -> PipelinedModule:
        model = factory(*args, **kwargs)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"{getattr(factory, '__name__', factory)!r} returned {type(model).__name__}, not an "
                            "nn.Module; decorate a model class or a function returning a model")
        return compile_module(model, example_inputs, options)

    return build


def compile_module(model: torch.nn.Module, example_inputs: Any, options: CompileOptions) -> PipelinedModule:
    """The body of :func:`compile` for a built model: trace, plan, split, and set up this rank.

    The process group comes first; every later setup phase is collective (:func:`setup_phase`), so an
    error on any rank raises on every rank within seconds, naming the rank and the phase.
    """
    from fxpipe.compile_tensor_parallel import apply_tensor_parallel
    from fxpipe.passes import trace
    from fxpipe.passes.batchdims import resolve_target_dim
    from fxpipe.passes.codegen import split_for_plan
    from fxpipe.passes.row_independence import check_rows_independent
    from fxpipe.plan_checks import check_model_holds_weights, check_plan_matches, check_stages_hold_parameters
    from fxpipe.runtime.autograd.recompute import check_recompute_batch_norm
    from fxpipe.runtime.compile.stage_compile import parse_torch_compile, with_compile_notes
    from fxpipe.runtime.compiled_stages import compile_stage, warm_compiled_stage
    from fxpipe.runtime.execution.driver import PipelineDriver, check_world
    from fxpipe.runtime.execution.stage import check_loss_reduction
    from fxpipe.runtime.faults.guard import release_group, setup_group, setup_phase
    from fxpipe.runtime.loss_check import check_loss_fn
    from fxpipe.runtime.numerics.batchnorm import check_batch_norm_mode, check_layers_kept, warn_batch_norm
    from fxpipe.runtime.parallel.param_precision import with_param_dtype
    from fxpipe.runtime.parallel.tensor_parallel import check_layout_options
    from fxpipe.runtime.sync import check_sync_mode, synchronize_driver
    from fxpipe.runtime.transport.batchcheck import check_batch_mode
    from fxpipe.runtime.transport.comm import init_distributed

    context = init_distributed(options.timeout_s)
    group = setup_group()
    try:
        with setup_phase("checking options", group):
            if options.loss_fn is None or not callable(options.loss_fn):
                raise PipelineSetupError("loss_fn is missing; pass loss_fn=callable(output, targets) -> scalar "
                                         "tensor (a batch mean, e.g. torch.nn.functional.cross_entropy)")
            check_sync_mode(options.sync_params)
            check_batch_norm_mode(options.batch_norm)
            check_loss_reduction(options.loss_reduction)
            check_batch_mode(options.check_batch)
            target_dim = resolve_target_dim(options.batch_dims, options.target_batch_dim)
            parse_recompute(options.recompute)
            try:
                if options.sharding is not None:
                    check_request(options.sharding)
            except ShardingError as error:
                raise PipelineSetupError(str(error)) from None
            compile_settings = parse_torch_compile(options.torch_compile)
            check_model_holds_weights(model, example_inputs)
            if not options.stall_timeout_s > 0:
                raise PipelineSetupError(f"stall_timeout_s={options.stall_timeout_s!r}; pass a positive number of "
                                         "seconds (default 5.0: longer than any call that holds the GIL)")
        example_inputs = on_model_device(model, example_inputs)
        inputs = example_inputs if isinstance(example_inputs, tuple | dict) else (example_inputs,)
        with preserved_state(model):  # tracing, cost measurement and codegen's shape run use the real module
            with setup_phase("tracing", group):
                graph_module = trace(model, inputs, batch_dims=options.batch_dims)
            resolved = resolve_plan(options, model, _keyword_inputs(graph_module, inputs), context, group,
                                    traced=graph_module)
            if options.check_rows and (resolved.num_microbatches > 1 or any(s.replicas > 1 for s in resolved.stages)):
                with setup_phase("checking that batch rows are independent", group):
                    check_rows_independent(model, _keyword_inputs(graph_module, inputs),
                                           graph_module.meta[meta.BATCH_DIMS])
            with setup_phase("code generation", group):
                check_plan_matches(resolved, graph_module)
                program = with_param_dtype(split_for_plan(graph_module, resolved), options.param_dtype)
                check_world(resolved, program, context.world_size)
                check_loss_fn(options.loss_fn, program, options.loss_reduction)
                check_stages_hold_parameters(program, resolved)
                check_layout_options(resolved, options.batch_norm)
                check_recompute_batch_norm(resolved, [stage.module for stage in program.stages], options.batch_norm)
                resolved = with_compile_notes(resolved, compile_settings, options.timeout_s)
    finally:
        release_group(group)
    warn_batch_norm(model, resolved, options.batch_norm)
    check_layers_kept(model, [stage.module for stage in program.stages], options.batch_norm)
    if resolved.chunk_groups:  # virtual stages: a rank runs several chunks (fxpipe.virtual_pipe)
        from fxpipe.virtual_pipe import build_virtual_pipe

        return build_virtual_pipe(program, resolved, options, context, target_dim, compile_settings,  # type: ignore[return-value]
                                  graph_module)
    driver = PipelineDriver(program, resolved, options.loss_fn, context=context,
                            autocast_dtype=options.autocast_dtype, timeout_s=options.timeout_s,
                            loss_reduction=options.loss_reduction, check_batch=options.check_batch,
                            target_batch_dim=target_dim, stall_timeout_s=options.stall_timeout_s)
    if options.batch_norm != "microbatch":
        from fxpipe.runtime.numerics.batchnorm import DeferredCommit, install_deferred

        replica_group = driver.groups[driver.stage_index]
        layers = install_deferred(driver.runner.module, replica_group if options.batch_norm == "sync" else None)
        if layers:
            commit = DeferredCommit(layers, replica_group)
            driver.start_hooks.append(commit.reset)
            driver.step_hooks.append(commit)
    compile_stage(driver, compile_settings, options.batch_norm)
    synchronize_driver(driver, options.sync_params)  # on full tensors, before sharding
    if apply_tensor_parallel(driver, options.sequence_parallel, graph_module) is not None:  # the shard replaced the module compile_stage wrapped
        compile_stage(driver, compile_settings, options.batch_norm)
    driver.shard_stage(options.param_dtype)
    if compile_settings is not None:
        warm_compiled_stage(driver)  # a collective: every rank compiles here, not in the first step
    if context.rank == 0:
        from fxpipe.report import print_plan

        print_plan(resolved, options.verbose)
    return PipelinedModule(driver, graph_module)


@contextlib.contextmanager
def preserved_state(model: torch.nn.Module) -> Iterator[None]:
    """Restore the model's buffers (BatchNorm statistics and counters) and gradients after the block.

    Forward and backward runs change buffers and ``.grad`` but never parameter values, so only
    buffers are copied (parameters would double the model's memory at compile).
    """
    buffers = {id(b): (b, b.detach().clone()) for b in model.buffers()}
    grads = {id(p): (p, p.grad) for p in model.parameters()}
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in buffers.values():
                buffer.copy_(value)
        for param, grad in grads.values():
            param.grad = grad


def _keyword_inputs(graph_module: torch.fx.GraphModule, inputs: Any) -> Any:
    """The traced example inputs keyed by forward()'s parameter names, so a re-trace binds keyword-only ones."""
    values = graph_module.meta.get(meta.EXAMPLE_INPUTS)
    names = graph_module.meta.get(meta.INPUT_NAMES)
    if values is None or names is None:
        return inputs
    return dict(zip(names, values, strict=True))
