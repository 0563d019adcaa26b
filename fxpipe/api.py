"""fxpipe.compile (function and decorator): a model plus a plan becomes a PipelinedModule that trains under torchrun."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fxpipe.cluster import Cluster
from fxpipe.plan import Plan, plan_argument_kind
from fxpipe.runtime.errors import PipelineSetupError

if TYPE_CHECKING:
    from fxpipe.runtime.driver import PipelineDriver
    from fxpipe.runtime.measure import StepStats

_MARKER_FAILURE = "fxpipe: marker planning failed: "
SCHEDULE_ALIASES = {"dapple": "early_backward", "early_backward": "early_backward", "1f1b": "early_backward",
                    "gpipe": "gpipe"}


@dataclass(frozen=True)
class CompileOptions:
    """Everything ``fxpipe.compile`` takes besides the model and its example inputs."""

    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    global_batch_size: int | None
    plan: str | Path | Plan = "auto"
    schedule: str | None = None
    num_microbatches: int | None = None
    warmup_policy: str | None = None
    cluster: str | Cluster | None = None
    optimizer: str = "adam"
    autocast_dtype: torch.dtype | None = None
    timeout_s: float = 60.0


class PipelinedModule:
    """This rank's share of a pipelined model: one replica of one stage, and ``step`` for the whole job.

    Every rank calls ``step(inputs, targets)`` with the same global batch and gets the same loss.
    ``parameters()``/``named_parameters()``/``state_dict()`` cover this rank's stage only and use the
    original model's names, so ``torch.optim.AdamW(pipe.parameters())`` is this rank's optimizer.
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

    def step(self, inputs: Any, targets: Any) -> float:
        """Forward and backward of the global batch; gradients land in ``parameters()``; returns the loss."""
        return self.driver.step(self._positional(inputs), targets)

    def _positional(self, inputs: Any) -> tuple[Any, ...]:
        if isinstance(inputs, Mapping):
            names = self.driver.program.model_inputs
            missing = [name for name in names if name not in inputs]
            if missing:
                raise TypeError(f"inputs dict lacks {missing}; the model takes {list(names)}")
            return tuple(inputs[name] for name in names)
        if isinstance(inputs, tuple | list):
            return tuple(inputs)
        return (inputs,)

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        seen: set[int] = set()
        for name, param in self.driver.runner.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                yield name, param

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        for _, param in self.named_parameters():
            yield param

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers of this rank's stage under their original names (detached)."""
        module = self.driver.runner.module
        state = {}
        for path, original in self.driver.stage.param_names:
            owner_path, _, attribute = path.rpartition(".")
            owner = module.get_submodule(owner_path) if owner_path else module
            value = getattr(owner, attribute)
            if isinstance(value, torch.Tensor):
                state[original] = value.detach()
        return state

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy the entries this stage holds from a full (or partial) state dict keyed by original names."""
        own = self.state_dict()
        missing = sorted(set(own) - set(state))
        if missing:
            raise KeyError(f"state dict lacks {missing} held by stage {self.stage_index}")
        with torch.no_grad():
            for name, tensor in own.items():
                tensor.copy_(state[name])

    def train(self, mode: bool = True) -> PipelinedModule:
        self.driver.runner.module.train(mode)
        return self

    def eval(self) -> PipelinedModule:
        return self.train(False)

    def export(self, directory: str | Path) -> None:
        """Write every stage's code, weights and a manifest (codegen ``export_program``); rank 0 writes."""
        from fxpipe.passes.codegen import export_program

        if self.rank == 0:
            export_program(self.driver.program, directory)

    @property
    def measure(self) -> bool | str:
        """True: each step records a timeline and the exact saved-activation peak (``step_stats``).

        ``"timeline"`` records the timeline only: counting saved tensors hooks every one of them,
        which slows a CPU step by up to ~20%, so time-sensitive measurements leave it out.
        """
        return self.driver.measure

    @measure.setter
    def measure(self, enabled: bool | str) -> None:
        if enabled not in (True, False, "timeline"):
            raise ValueError(f"measure must be True, False or 'timeline'; got {enabled!r}")
        self.driver.measure = enabled

    def step_stats(self) -> list[StepStats]:
        """All ranks' StepStats of the last measured step (a collective: call on every rank)."""
        return self.driver.gather_stats()

    def save(self, directory: str | Path, *, optimizer: torch.optim.Optimizer | None = None, step: int = 0,
             extra: Mapping[str, Any] | None = None) -> Path:
        """Atomic sharded checkpoint under original names (every rank calls it); see fxpipe.checkpoint."""
        from fxpipe.checkpoint import save_checkpoint

        return save_checkpoint(self, directory, optimizer=optimizer, step=step, extra=extra)

    def load(self, directory: str | Path, *, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """Load a checkpoint saved under any plan; returns ``{"step": ..., "extra": ...}``."""
        from fxpipe.checkpoint import load_checkpoint

        return load_checkpoint(self, directory, optimizer=optimizer)

    def close(self) -> None:
        """Wait for all ranks, then release the process group if ``compile`` created it."""
        from fxpipe.runtime.comm import close_distributed

        close_distributed(self.driver.context)

    def __repr__(self) -> str:
        return (f"PipelinedModule(layout={self.plan.layout!r}, rank={self.rank}, stage={self.stage_index}, "
                f"replica={self.replica_index}, schedule={self.plan.schedule!r})")


def compile(model: Any = None, example_inputs: Any = None, *, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
            global_batch_size: int | None = None, plan: str | Path | Plan = "auto", schedule: str | None = None,
            num_microbatches: int | None = None, cluster: str | Cluster | None = None, optimizer: str = "adam",
            warmup_policy: str | None = None, autocast_dtype: torch.dtype | None = None,
            timeout_s: float = 60.0) -> Any:
    """Pipeline ``model`` over the process group's ranks; returns a :class:`PipelinedModule`.

    ``plan``: ``"auto"`` (DAPPLE planner on ``cluster``, default ``local:<world size>``), a layout such as
    ``"3:1"`` (planner picks cuts and placement), ``"markers"`` (cuts at the model's
    ``torch.distributed.pipelining.pipe_split()`` calls; the planner picks replicas and placement on
    every rank), a :class:`Plan`, or a plan JSON path. ``schedule``:
    ``"dapple"`` (early backward) or ``"gpipe"``; None keeps the plan's. ``loss_fn(output, targets)``
    must return a batch-mean scalar. As a decorator, ``@fxpipe.compile(loss_fn=..., global_batch_size=...)``
    on a model class or factory makes ``Factory(*args, example_inputs=..., **kwargs)`` return the module.
    """
    options = CompileOptions(loss_fn, global_batch_size, plan, schedule, num_microbatches, warmup_policy,
                             cluster, optimizer, autocast_dtype, timeout_s)
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
    """The body of :func:`compile` for a built model: trace, plan, split, and set up this rank."""
    from fxpipe.passes import trace
    from fxpipe.passes.codegen import split_for_plan
    from fxpipe.plan_checks import check_plan_matches, check_stages_hold_parameters
    from fxpipe.runtime.comm import init_distributed
    from fxpipe.runtime.driver import PipelineDriver

    if options.loss_fn is None or not callable(options.loss_fn):
        raise PipelineSetupError("loss_fn is missing; pass loss_fn=callable(output, targets) -> scalar tensor "
                                 "(a batch mean, e.g. torch.nn.functional.cross_entropy)")
    inputs = example_inputs if isinstance(example_inputs, tuple | dict) else (example_inputs,)
    context = init_distributed(options.timeout_s)
    graph_module = trace(model, inputs)
    resolved = resolve_plan(options, model, _keyword_inputs(graph_module, inputs), context.world_size)
    check_plan_matches(resolved, graph_module)
    program = split_for_plan(graph_module, resolved)
    check_stages_hold_parameters(program, resolved)
    driver = PipelineDriver(program, resolved, options.loss_fn, context=context,
                            autocast_dtype=options.autocast_dtype, timeout_s=options.timeout_s)
    return PipelinedModule(driver, graph_module)


def _keyword_inputs(graph_module: torch.fx.GraphModule, inputs: Any) -> Any:
    """The traced example inputs keyed by forward()'s parameter names, so a re-trace binds keyword-only ones."""
    values = graph_module.meta.get("fxpipe.example_inputs")
    names = graph_module.meta.get("fxpipe.input_names")
    if values is None or names is None:
        return inputs
    return dict(zip(names, values, strict=True))


def resolve_plan(options: CompileOptions, model: torch.nn.Module, example_inputs: Any, world_size: int) -> Plan:
    """The Plan to run: given, loaded from a file, or made by the planner on rank 0 and broadcast."""
    kind = "plan" if isinstance(options.plan, Plan) else plan_argument_kind(options.plan)
    if isinstance(options.plan, Plan):
        plan = options.plan
    elif kind == "file":
        plan = Plan.load(options.plan)
    elif kind == "markers":
        plan = _marker_plan(options, model, example_inputs, world_size)
    else:
        plan = _planned(options, model, example_inputs, world_size)
    return apply_overrides(plan, options)


def apply_overrides(plan: Plan, options: CompileOptions) -> Plan:
    """Check the batch size against the plan and apply schedule / micro-batch / warm-up overrides."""
    if options.global_batch_size is not None and options.global_batch_size != plan.global_batch_size:
        raise PipelineSetupError(f"global_batch_size={options.global_batch_size} but the plan was made for "
                                 f"{plan.global_batch_size}; re-plan or pass the plan's batch size")
    changes: dict[str, Any] = {}
    if options.schedule is not None:
        changes["schedule"] = _schedule_name(options.schedule)
    if options.num_microbatches is not None:
        changes["num_microbatches"] = options.num_microbatches
    if options.warmup_policy is not None:
        changes["warmup_policy"] = options.warmup_policy
    return plan.with_updates(**changes) if changes else plan


def _schedule_name(schedule: str) -> str:
    if schedule not in SCHEDULE_ALIASES:
        raise PipelineSetupError(f"schedule {schedule!r} is unknown; choose 'dapple' (early backward) or 'gpipe'")
    return SCHEDULE_ALIASES[schedule]


def _planned(options: CompileOptions, model: torch.nn.Module, example_inputs: Any, world_size: int) -> Plan:
    """Run the planner on rank 0 only (a calibrated cluster may measure differently per rank)."""
    from fxpipe.runtime.comm import broadcast_text

    if options.global_batch_size is None:
        raise PipelineSetupError("global_batch_size is missing; it is required unless a Plan is given")
    text = None
    if _rank() == 0:
        text = _run_planner(options, model, example_inputs, world_size).to_json()
    return Plan.from_json(broadcast_text(text))


def _run_planner(options: CompileOptions, model: torch.nn.Module, example_inputs: Any, world_size: int) -> Plan:
    from fxpipe.cluster import parse_cluster
    from fxpipe.planning import cost_model, plan_chain

    cluster = options.cluster if options.cluster is not None else f"local:{world_size}"
    resolved = parse_cluster(cluster) if isinstance(cluster, str) else cluster
    costed = cost_model(model, example_inputs if isinstance(example_inputs, Mapping) else tuple(example_inputs),
                        resolved)
    layout = None if options.plan == "auto" else str(options.plan)
    assert options.global_batch_size is not None
    return plan_chain(costed.chain, resolved, options.global_batch_size, layout=layout,
                      num_microbatches=options.num_microbatches,
                      schedule=_schedule_name(options.schedule or "dapple"),
                      warmup_policy=options.warmup_policy, optimizer=options.optimizer)


def _rank() -> int:
    from fxpipe.runtime.comm import current_rank

    return current_rank()


def _marker_plan(options: CompileOptions, model: torch.nn.Module, example_inputs: Any, world_size: int) -> Plan:
    """``plan="markers"``: cuts at the model's pipe_split() calls, made on rank 0 and broadcast.

    A mistake found on rank 0 (no markers, a parameter-less marked stage) is broadcast too, so every
    rank raises it at once instead of waiting for a plan.
    """
    from fxpipe.cluster import parse_cluster
    from fxpipe.planning import plan_markers
    from fxpipe.runtime.comm import broadcast_text

    if options.global_batch_size is None:
        raise PipelineSetupError("global_batch_size is missing; it is required unless a Plan is given")
    text = None
    failure: ValueError | None = None
    if _rank() == 0:
        cluster = options.cluster if options.cluster is not None else f"local:{world_size}"
        try:
            plan, _ = plan_markers(model, example_inputs,
                                   parse_cluster(cluster) if isinstance(cluster, str) else cluster,
                                   options.global_batch_size, num_microbatches=options.num_microbatches,
                                   schedule=_schedule_name(options.schedule or "dapple"),
                                   warmup_policy=options.warmup_policy, optimizer=options.optimizer,
                                   use_all_devices=True)
            text = plan.to_json()
        except ValueError as error:
            failure, text = error, _MARKER_FAILURE + f"{type(error).__name__}: {error}"
    text = broadcast_text(text)
    if failure is not None:
        raise failure
    if text.startswith(_MARKER_FAILURE):
        raise PipelineSetupError(f"rank 0 could not plan at the markers: {text[len(_MARKER_FAILURE):]}")
    return Plan.from_json(text)

