"""Distributed checkpoint save/load of a PipelinedModule (torch.distributed.checkpoint), atomic and weights-only."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import uuid
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.futures import Future

from fxpipe.core.checkpoint import (
    DCP_METADATA_NAME,
    FORMAT_NAME,
    FORMAT_VERSION,
    MODEL_PREFIX,
    CheckpointablePipe,
    CheckpointError,
    check_fingerprint,
    file_checksum,
    fsync_directory,
    model_fingerprint,
    read_manifest,
    state_dict_keys,
    verify_files,
    write_manifest,
)
from fxpipe.runtime.parallel.sharded_stage import full_value, is_sharded, shard_of
from fxpipe.runtime.transport.comm import broadcast_text

T = TypeVar("T")

OPTIM_PREFIX = "optim/"        # optim/<param name>/<state key> -> tensor
OPTIM_META_PREFIX = "optim_meta/"  # optim_meta/<param name> -> JSON bytes (group settings, non-tensor state)
RNG_PREFIX = "rng/"            # rng/<rank>/cpu, rng/<rank>/cuda -> uint8 generator state

# The only globals a DCP .metadata pickle may name: DCP's own metadata records, torch.Size, dtypes, paths.
_SAFE_MODULES = {"torch.distributed.checkpoint.metadata"}
_SAFE_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"),
                 ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("collections", "OrderedDict"),
                 ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata refusing every global outside an allow-list, so no code in a checkpoint runs."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _SAFE_MODULES or (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata names {module}.{name}, which fxpipe does not load")


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata is read with an allow-list unpickler (tensors are read weights-only)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError) as error:
            raise CheckpointError(f"checkpoint {str(self.path)!r}: cannot read {path.name}: {error}") from error
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"checkpoint {str(self.path)!r}: {path.name} holds {type(metadata).__name__}")
        if metadata.storage_meta is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


# ---- save -----------------------------------------------------------------------------------------


class _RecordingWriter(FileSystemWriter):
    """FileSystemWriter that remembers the file-name prefix DCP gave this rank (``__<rank>_``)."""

    prefix: str | None = None

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[Any]:
        self.prefix = str(plan.storage_data.prefix)
        return super().write_data(plan, planner)


def save_checkpoint(pipe: CheckpointablePipe, directory: str | Path, *, optimizer: torch.optim.Optimizer | None = None,
                    step: int = 0, extra: Mapping[str, Any] | None = None) -> Path:
    """Save this rank's parameters, buffers, optimizer state and RNG state; every rank calls it.

    Data goes to ``<directory>.tmp-<uuid>`` through DCP (replicated tensors written once); each rank then
    hashes the files it wrote, and rank 0 writes the manifest (with every file's sha256) last and renames
    the folder to ``directory`` (replacing an older one only once the new one is complete). Any failure
    (full disk, read-only or vanished directory) raises CheckpointError on every rank, removes the partial
    folder and leaves earlier checkpoints as they were. ``extra`` must be JSON-serializable. Returns ``directory``.
    """
    target = Path(directory)
    _json_or_error(extra, "extra")
    token = broadcast_text(uuid.uuid4().hex if dist.get_rank() == 0 else None)
    temporary = target.with_name(f"{target.name}.tmp-{token}")
    try:
        _collectively(lambda: temporary.mkdir(parents=True, exist_ok=True), f"create {str(temporary)!r}")
        state = _collectively(lambda: _state_to_save(pipe, optimizer), "collect the state to save")[0]
        writer = _RecordingWriter(temporary, sync_files=True)
        _dcp_call(lambda: dcp.save(state, storage_writer=writer), f"save checkpoint {str(target)!r}")
        checksums: dict[str, Any] = {}
        for part in _collectively(lambda: _own_checksums(temporary, writer.prefix), f"hash {str(temporary)!r}",
                                  share=True):
            checksums.update(part)
        _collectively(lambda: _publish(pipe, temporary, target, optimizer, step, extra, checksums)
                      if dist.get_rank() == 0 else None, f"publish checkpoint {str(target)!r}")
    except CheckpointError:
        if dist.get_rank() == 0:  # every rank knows the save failed, so nobody writes into it any more
            shutil.rmtree(temporary, ignore_errors=True)
        raise
    return target


def _state_to_save(pipe: CheckpointablePipe, optimizer: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    state = {MODEL_PREFIX + name: tensor for name, tensor in pipe.state_dict().items()}
    if optimizer is not None:
        state.update(_optimizer_entries(pipe, optimizer))
    state.update(_rng_entries(dist.get_rank()))
    return state


def _collectively(action: Callable[[], T], what: str, share: bool = False) -> list[T]:
    """Run ``action`` on every rank; CheckpointError on every rank naming each rank where it failed.

    Returns ``[this rank's result]``, or with ``share`` every rank's result by rank. A failure on one
    rank (OSError, ValueError such as CheckpointError) would otherwise leave the others waiting in the
    next collective; here every rank learns of it and raises the same error.
    """
    result: T | None = None
    message: str | None = None
    caught: Exception | None = None
    try:
        result = action()
    except (OSError, ValueError) as error:  # CheckpointError is a ValueError
        caught, message = error, f"{type(error).__name__}: {error}"
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (message, result if share else None))
    failures = [f"rank {rank}: {failed}" for rank, (failed, _) in enumerate(gathered) if failed is not None]
    if failures:
        raise CheckpointError(f"could not {what}: {'; '.join(failures)}") from caught
    return [shared for _, shared in gathered] if share else [result]  # type: ignore[list-item]


def _dcp_call(action: Callable[[], Any], what: str) -> None:
    """Run a collective DCP call; its CheckpointException (a BaseException) becomes CheckpointError (an Exception)."""
    try:
        action()
    except CheckpointException as error:
        failures = "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}"
                             for rank, (exc, _) in sorted(error.failures.items()))
        raise CheckpointError(f"could not {what}: {failures}") from error


def _own_checksums(temporary: Path, prefix: str | None) -> dict[str, dict[str, Any]]:
    """Checksums of the files this rank wrote (DCP names them ``<prefix><n>.distcp``; rank 0 also wrote .metadata)."""
    rank = dist.get_rank()
    names = sorted(p.name for p in temporary.iterdir() if prefix is not None and p.name.startswith(prefix))
    if rank == 0:
        names.append(DCP_METADATA_NAME)
    return {name: file_checksum(temporary / name, rank) for name in names}


def _publish(pipe: CheckpointablePipe, temporary: Path, target: Path, optimizer: torch.optim.Optimizer | None,
             step: int, extra: Mapping[str, Any] | None, checksums: Mapping[str, Any]) -> None:
    """Rank 0: write the manifest last, then rename the finished folder into place."""
    plan = pipe.plan
    files = sorted(p.name for p in temporary.iterdir() if p.is_file())
    unhashed = sorted(set(files) - set(checksums))
    if unhashed:
        raise CheckpointError(f"checkpoint {str(target)!r}: files {unhashed} were written by no rank's DCP writer; "
                              "is another job writing into the same directory?")
    manifest = {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "step": int(step),
        "extra": dict(extra) if extra is not None else {}, "world_size": dist.get_world_size(),
        "plan": {"layout": plan.layout, "stages": [list(s.devices) for s in plan.stages],
                 "global_batch_size": plan.global_batch_size, "num_microbatches": plan.num_microbatches},
        "fingerprint": model_fingerprint(pipe.program), "state_dict_keys": state_dict_keys(pipe),
        "optimizer": type(optimizer).__name__ if optimizer is not None else None,
        "grad_scaler": _scaler_state(pipe),
        "files": files,
        "checksums": {name: checksums[name] for name in files},
    }
    write_manifest(temporary, manifest)
    _replace(temporary, target)


def _scaler_state(pipe: CheckpointablePipe) -> dict[str, Any] | None:
    """The state of the pipe's grad scaler (``pipe.grad_scaler()``; the same on every rank), or None without one."""
    scaler = getattr(pipe, "scaler", None)
    return dict(scaler.state_dict()) if scaler is not None and scaler.is_enabled() else None


def _restore_scaler(pipe: CheckpointablePipe, saved: dict[str, Any] | None, directory: str | Path) -> None:
    """Load the saved scaler state into the pipe's scaler; warn (every rank alike) when one side lacks it."""
    scaler = getattr(pipe, "scaler", None)
    if scaler is not None and scaler.is_enabled() and saved:
        scaler.load_state_dict(saved)
    elif scaler is not None and scaler.is_enabled():
        warnings.warn(f"checkpoint {str(directory)!r} holds no grad scaler state (saved without pipe.grad_scaler()); "
                      f"the pipe's scaler keeps its scale {scaler.get_scale()}", stacklevel=3)
    elif saved:
        warnings.warn(f"checkpoint {str(directory)!r} holds grad scaler state (scale {saved.get('scale')}) but this "
                      "pipe has no enabled scaler; call pipe.grad_scaler() before pipe.load to restore it",
                      stacklevel=3)


def _replace(temporary: Path, target: Path) -> None:
    """Rename ``temporary`` to ``target``; an older ``target`` is moved aside first and put back if that fails."""
    retired = target.with_name(f"{target.name}.old-{uuid.uuid4().hex}")
    if target.exists():
        os.replace(target, retired)
    try:
        os.replace(temporary, target)
    except OSError:
        if retired.exists():
            os.replace(retired, target)
        raise
    fsync_directory(target.parent)
    if retired.exists():
        shutil.rmtree(retired)


def _optimizer_entries(pipe: CheckpointablePipe, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Optimizer state keyed by parameter name: tensors as they are, settings as JSON bytes."""
    names = _optimizer_param_names(pipe, optimizer)
    saved = optimizer.state_dict()
    entries: dict[str, torch.Tensor] = {}
    for group in saved["param_groups"]:
        settings = {key: value for key, value in group.items() if key != "params"}
        for index in group["params"]:
            name = names[index]
            scalars = {}
            for key, value in saved["state"].get(index, {}).items():
                if isinstance(value, torch.Tensor):  # whole tensors (a sharded or tensor-parallel stage's gathered)
                    entries[f"{OPTIM_PREFIX}{name}/{key}"] = _whole(pipe, name, value)
                else:
                    scalars[key] = value
            meta = {"group": settings, "scalars": scalars}
            entries[OPTIM_META_PREFIX + name] = _json_bytes(meta, f"optimizer state of {name!r}")
    return entries


def _whole(pipe: CheckpointablePipe, name: str, value: torch.Tensor) -> torch.Tensor:
    """Optimizer state of parameter ``name`` whole: a tensor-parallel shard's gathered (state shaped as the shard)."""
    driver = getattr(pipe, "driver", None)
    param = driver.tp_params.get(name) if driver is not None else None
    if param is not None and value.dim() == len(param.full_shape):
        return driver.whole(name, value)  # type: ignore[union-attr]
    return full_value(value)


def _optimizer_param_names(pipe: CheckpointablePipe, optimizer: torch.optim.Optimizer) -> list[str]:
    """Original names of the optimizer's parameters, in its state_dict index order."""
    by_id = {id(param): name for name, param in pipe.named_parameters()}
    names = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in by_id:
                raise CheckpointError(f"the optimizer holds a parameter of shape {tuple(param.shape)} that is not "
                                      "in pipe.parameters(); build the optimizer from pipe.parameters()")
            names.append(by_id[id(param)])
    return names


def _rng_entries(rank: int) -> dict[str, torch.Tensor]:
    entries = {f"{RNG_PREFIX}{rank}/cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        entries[f"{RNG_PREFIX}{rank}/cuda"] = torch.cuda.get_rng_state().cpu()
    return entries


def _json_or_error(value: Any, what: str) -> str:
    try:
        return json.dumps(value, sort_keys=True)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{what} must be JSON-serializable (numbers, strings, lists, dicts): {error}") from error


def _json_bytes(value: Any, what: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(_json_or_error(value, what).encode()), dtype=torch.uint8).clone()


# ---- load -----------------------------------------------------------------------------------------


def load_checkpoint(pipe: CheckpointablePipe, directory: str | Path, *, optimizer: torch.optim.Optimizer | None = None,
                    verify: bool = True) -> dict[str, Any]:
    """Load parameters (and optimizer / RNG state) into this rank's stage; every rank calls it.

    Works across plans and world sizes: every rank reads the entries it holds by name. RNG state is
    restored for ranks that existed when saving. With ``verify`` (the default) the ranks first check
    every file's size and sha256 against the manifest (each rank hashes a share of the files). Any
    failure raises CheckpointError on every rank before anything is loaded. Returns ``{"step": int, "extra": dict}``.
    """
    reader = SafeFileSystemReader(directory)
    manifest, stored, names = _collectively(lambda: _checked_manifest(pipe, directory, optimizer, verify, reader),
                                            f"load checkpoint {str(directory)!r}")[0]
    state: dict[str, torch.Tensor] = {MODEL_PREFIX + name: tensor for name, tensor in pipe.state_dict().items()}
    for name in names:
        state.update(_empty_entries(stored, f"{OPTIM_PREFIX}{name}/"))
        state.update(_empty_entries(stored, OPTIM_META_PREFIX + name, exact=True))
    rank = dist.get_rank()
    state.update(_empty_entries(stored, f"{RNG_PREFIX}{rank}/"))
    _dcp_call(lambda: dcp.load(state, storage_reader=reader), f"load checkpoint {str(directory)!r}")
    _collectively(lambda: _restore(pipe, optimizer, names, state, rank), f"restore checkpoint {str(directory)!r}")
    _restore_scaler(pipe, manifest.get("grad_scaler"), directory)
    return {"step": int(manifest["step"]), "extra": manifest["extra"]}


def _restore(pipe: CheckpointablePipe, optimizer: torch.optim.Optimizer | None, names: list[str],
             state: Mapping[str, torch.Tensor], rank: int) -> None:
    # DCP loaded into state_dict()'s tensors: views of the weights, or gathered copies of a sharded stage's,
    # whose shards each rank copies back here (no collective)
    pipe.load_state_dict({key[len(MODEL_PREFIX):]: value for key, value in state.items() if key.startswith(MODEL_PREFIX)})
    if optimizer is not None:
        _restore_optimizer(pipe, optimizer, names, state)
    _restore_rng(state, rank)


def _checked_manifest(pipe: CheckpointablePipe, directory: str | Path, optimizer: torch.optim.Optimizer | None,
                      verify: bool, reader: SafeFileSystemReader) -> tuple[dict[str, Any], Mapping[str, Any], list[str]]:
    """This rank's checks before loading: a complete manifest, the same model, and (``verify``) its share of files.

    Returns the manifest, DCP's stored-entry metadata and the optimizer's parameter names.
    """
    manifest = read_manifest(directory, verify)
    check_fingerprint(manifest["fingerprint"], model_fingerprint(pipe.program), directory)
    if optimizer is not None and manifest["optimizer"] is None:
        raise CheckpointError(f"checkpoint {str(directory)!r} holds no optimizer state; load it with optimizer=None "
                              "or save with optimizer=...")
    if verify:
        names = sorted(manifest.get("checksums") or [DCP_METADATA_NAME])
        verify_files(directory, manifest, names[dist.get_rank()::dist.get_world_size()])
    param_names = _optimizer_param_names(pipe, optimizer) if optimizer is not None else []
    return manifest, reader.read_metadata().state_dict_metadata, param_names


def _empty_entries(stored: Mapping[str, Any], prefix: str, exact: bool = False) -> dict[str, torch.Tensor]:
    """Empty tensors of the saved shape and dtype for every stored key matching ``prefix``."""
    entries = {}
    for key, meta in stored.items():
        tensor = _empty(meta) if (key == prefix if exact else key.startswith(prefix)) else None
        if tensor is not None:
            entries[key] = tensor
    return entries


def _empty(meta: Any) -> torch.Tensor | None:
    """An empty CPU tensor matching stored tensor metadata; None for anything else (absent, bytes)."""
    if not isinstance(meta, TensorStorageMetadata):
        return None
    return torch.empty(meta.size, dtype=meta.properties.dtype)


def _restore_optimizer(pipe: CheckpointablePipe, optimizer: torch.optim.Optimizer, names: list[str],
                       state: Mapping[str, torch.Tensor]) -> None:
    """Rebuild an index-keyed optimizer state_dict from the name-keyed entries and load it."""
    current = optimizer.state_dict()
    by_name: dict[str, dict[str, Any]] = {}
    for key, tensor in state.items():
        if key.startswith(OPTIM_PREFIX):
            name, _, state_key = key[len(OPTIM_PREFIX):].rpartition("/")
            by_name.setdefault(name, {})[state_key] = tensor
    params = [param for group in optimizer.param_groups for param in group["params"]]
    restored: dict[int, dict[str, Any]] = {}
    groups = []
    for group in current["param_groups"]:
        settings = dict(group)
        for index in group["params"]:
            meta = _decode_meta(state, names[index])
            tensors = {key: _shaped_for(pipe, names[index], value, params[index])
                       for key, value in by_name.get(names[index], {}).items()}
            entries = {**tensors, **meta["scalars"]}
            if entries:
                restored[index] = entries
            settings.update({key: _like(group.get(key), value) for key, value in meta["group"].items()})
        groups.append(settings)
    optimizer.load_state_dict({"state": restored, "param_groups": groups})


def _shaped_for(pipe: CheckpointablePipe, name: str, value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A whole optimizer-state tensor as the parameter holds its state: this rank's shard for a sharded one."""
    driver = getattr(pipe, "driver", None)
    if driver is not None and name in driver.tp_params and value.dim() == param.dim():
        value = driver.part(name, value)  # this member's part, then (FSDP2 over the replicas too) its shard of that
    return shard_of(value, param) if is_sharded(param) and value.shape == param.shape else value


def _decode_meta(state: Mapping[str, torch.Tensor], name: str) -> dict[str, Any]:
    key = OPTIM_META_PREFIX + name
    if key not in state:
        raise CheckpointError(f"checkpoint holds no optimizer state for parameter {name!r}; it was saved without "
                              "an optimizer over that parameter")
    decoded = json.loads(bytes(state[key].tolist()).decode())
    assert isinstance(decoded, dict)
    return decoded


def _like(current: Any, loaded: Any) -> Any:
    """JSON turns tuples (Adam betas) into lists; give them back the type the optimizer uses."""
    return tuple(loaded) if isinstance(current, tuple) and isinstance(loaded, list) else loaded


def _restore_rng(state: Mapping[str, torch.Tensor], rank: int) -> None:
    cpu = state.get(f"{RNG_PREFIX}{rank}/cpu")
    if cpu is not None:
        torch.set_rng_state(cpu)
    cuda = state.get(f"{RNG_PREFIX}{rank}/cuda")
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)


# ---- offline --------------------------------------------------------------------------------------


def read_tensors(directory: str | Path, entries: Mapping[str, Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Read ``{key: {"shape", "dtype"}}`` from a checkpoint in this process alone (no process group)."""
    reader = SafeFileSystemReader(directory)
    stored = reader.read_metadata().state_dict_metadata
    absent = sorted(key for key in entries if not isinstance(stored.get(key), TensorStorageMetadata))
    if absent:
        raise CheckpointError(f"checkpoint {str(directory)!r} lacks tensors {absent[:8]} its manifest names")
    state = {key: tensor for key in entries if (tensor := _empty(stored[key])) is not None}
    with warnings.catch_warnings():  # DCP warns that it loads in one process, which is the point here
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        _dcp_call(lambda: dcp.load(state, storage_reader=reader, no_dist=True), f"read {str(directory)!r}")
    return state


def consolidate(directory: str | Path, *, verify: bool = True) -> dict[str, torch.Tensor]:
    """One state_dict for the original unsplit model (``model.load_state_dict(sd)`` strict) from a checkpoint.

    Runs offline in one process (no process group); tensors are read weights-only. With ``verify`` (the
    default) every file's size and sha256 are checked against the manifest first.
    """
    manifest = read_manifest(directory, verify)
    if verify:
        verify_files(directory, manifest)
    stored = read_tensors(directory, {MODEL_PREFIX + name: entry for name, entry in manifest["fingerprint"].items()})
    keys: Mapping[str, str] = manifest["state_dict_keys"]
    return {key: stored[MODEL_PREFIX + keys[key]] for key in sorted(keys)}
