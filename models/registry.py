"""Model zoo plumbing: ModelEntry, override checking, deterministic builds and shared losses."""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

DEFAULT_BATCH_SIZE = 4
BUILD_ONLY_KEYS = ("batch_size", "seed")

Inputs = tuple[Tensor, ...]
Batch = tuple[Inputs, Tensor]
BuildFn = Callable[..., tuple[nn.Module, Inputs]]
LossFn = Callable[[Tensor, Tensor], Tensor]
MakeBatchFn = Callable[..., Batch]
# batch_fn(config, batch_size, generator) -> (inputs, targets), all on the CPU.
ConfigBatchFn = Callable[[Any, int, torch.Generator], Batch]


class UnknownModelError(ValueError):
    """A model name that is not in the zoo."""


@dataclass(frozen=True)
class ModelEntry:
    """One zoo model: how to build it, its loss, its data, and its reference size.

    build(device="cpu", **overrides) -> (model, example_inputs); overrides are config fields plus
    `batch_size` (rows of the example inputs) and `seed` (weight init seed, default 0).
    make_batch(batch_size, seed, **overrides) -> (inputs, targets) on the CPU, deterministic in seed.
    tiny_overrides: config overrides that give a CPU-test-sized variant of the same architecture.
    """

    name: str
    description: str
    build: BuildFn
    loss_fn: LossFn
    make_batch: MakeBatchFn
    paper_params: int | None
    tiny_overrides: Mapping[str, Any] = field(default_factory=dict)


def apply_overrides(config: Any, overrides: Mapping[str, Any], *, extra: tuple[str, ...] = ()) -> Any:
    """Return `config` with `overrides` applied; unknown keys raise ValueError naming valid ones."""
    valid = [f.name for f in dataclasses.fields(config)]
    unknown = sorted(key for key in overrides if key not in valid and key not in extra)
    if unknown:
        raise ValueError(
            f"unknown override(s) {unknown} for {type(config).__name__}; "
            f"valid keys: {sorted([*valid, *extra])}"
        )
    return dataclasses.replace(config, **{k: v for k, v in overrides.items() if k in valid})


class _SkipRandomInit(TorchFunctionMode):
    """Turn in-place random initialisation into a no-op (used on the meta device only).

    Meta tensors hold no values, and Tensor.normal_ on meta routes through a decomposition that
    imports torch._dynamo (seconds of start-up), so skipping it keeps paper-size builds instant.
    """

    _SKIPPED = frozenset({Tensor.normal_, Tensor.uniform_})

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in self._SKIPPED or getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else next(iter((kwargs or {}).values()))
        return func(*args, **(kwargs or {}))


def _construct(model_cls: Callable[[Any], nn.Module], config: Any, device: str | torch.device, seed: int) -> nn.Module:
    # fork_rng keeps the caller's global RNG untouched while making weights depend only on seed.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            if torch.device(device).type != "meta":
                return model_cls(config)
            with _SkipRandomInit():
                return model_cls(config)


def _build(
    model_cls: Callable[[Any], nn.Module],
    config: Any,
    batch_fn: ConfigBatchFn,
    device: str | torch.device = "cpu",
    **overrides: Any,
) -> tuple[nn.Module, Inputs]:
    cfg = apply_overrides(config, overrides, extra=BUILD_ONLY_KEYS)
    batch_size = int(overrides.get("batch_size", DEFAULT_BATCH_SIZE))
    seed = int(overrides.get("seed", 0))
    model = _construct(model_cls, cfg, device, seed)
    generator = torch.Generator().manual_seed(seed)
    inputs, _ = batch_fn(cfg, batch_size, generator)
    return model, tuple(t.to(device) for t in inputs)


def _make_batch(config: Any, batch_fn: ConfigBatchFn, batch_size: int, seed: int, **overrides: Any) -> Batch:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    cfg = apply_overrides(config, overrides)
    return batch_fn(cfg, batch_size, torch.Generator().manual_seed(seed))


def make_entry(
    name: str,
    description: str,
    *,
    model_cls: Callable[[Any], nn.Module],
    config: Any,
    batch_fn: ConfigBatchFn,
    loss_fn: LossFn,
    paper_params: int | None = None,
    tiny_overrides: Mapping[str, Any] | None = None,
) -> ModelEntry:
    """Bundle a config preset, its model class and data/loss functions into a ModelEntry."""
    return ModelEntry(
        name=name,
        description=description,
        build=functools.partial(_build, model_cls, config, batch_fn),
        loss_fn=loss_fn,
        make_batch=functools.partial(_make_batch, config, batch_fn),
        paper_params=paper_params,
        tiny_overrides=dict(tiny_overrides or {}),
    )


def token_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross entropy of (B, T, V) logits against (B, T) token ids."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def class_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross entropy of (B, C) logits against (B,) class ids."""
    return F.cross_entropy(logits, targets)


def mean_squared_error(output: Tensor, targets: Tensor) -> Tensor:
    """Mean squared error over all elements."""
    return F.mse_loss(output, targets)


def cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross entropy of (..., C) logits against (...) class ids: (B, C) classes or (B, T, V) tokens."""
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


# Losses `fxpipe train --loss NAME` knows by name; anything else is given as module:function.
LOSSES: dict[str, LossFn] = {"cross_entropy": cross_entropy, "mse": mean_squared_error}


class CallableSpecError(ValueError):
    """A ``package.module:function`` spec (model factory, loss, data) cannot be loaded."""


def load_callable(spec: str, what: str) -> Callable[..., Any]:
    """The function named by ``package.module:function`` (``what`` names its role in errors)."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise CallableSpecError(f"{what} {spec!r} is not of the form 'package.module:function'")
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except ImportError as error:
        raise CallableSpecError(f"cannot import {module_name!r} for {what} {spec!r}: {error}; run from the folder "
                                "holding the module or put it on PYTHONPATH") from error
    except AttributeError as error:
        raise CallableSpecError(f"module {module_name!r} has no {attribute!r} ({what} {spec!r})") from error
    if not callable(found):
        raise CallableSpecError(f"{what} {spec!r} is a {type(found).__name__}, not a function")
    return found  # type: ignore[no-any-return]


def resolve_loss(spec: str) -> LossFn:
    """A loss by name (``cross_entropy``, ``mse``) or ``package.module:function``."""
    if spec in LOSSES:
        return LOSSES[spec]
    if ":" in spec:
        return load_callable(spec, "loss")
    raise CallableSpecError(f"loss {spec!r} is unknown; use one of {sorted(LOSSES)} or 'package.module:function'")


def random_tokens(generator: torch.Generator, vocab_size: int, *shape: int) -> Tensor:
    """Uniform random token ids (int64) of the given shape."""
    return torch.randint(0, vocab_size, shape, generator=generator, dtype=torch.long)


def next_token_batch(generator: torch.Generator, vocab_size: int, batch_size: int, seq_len: int) -> Batch:
    """Language-model batch: inputs (B, T) token ids and targets shifted by one position."""
    tokens = random_tokens(generator, vocab_size, batch_size, seq_len + 1)
    return (tokens[:, :-1].contiguous(),), tokens[:, 1:].contiguous()


def image_batch(generator: torch.Generator, image_size: int, num_classes: int, batch_size: int) -> Batch:
    """Image batch: inputs (B, 3, H, W) standard normal, targets (B,) class ids."""
    images = torch.randn(batch_size, 3, image_size, image_size, generator=generator)
    labels = torch.randint(0, num_classes, (batch_size,), generator=generator, dtype=torch.long)
    return (images,), labels
