"""Checkpoint manifests, model fingerprints, finding the newest complete checkpoint, and offline consolidation."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from fxpipe.core import meta

if TYPE_CHECKING:
    from fxpipe.core.plan import Plan
    from fxpipe.core.program import SplitProgram

FORMAT_NAME = "fxpipe-checkpoint"
FORMAT_VERSION = 2  # 2: per-file checksums ("checksums"); version 1 checkpoints load with verify=False only
READABLE_VERSIONS = (1, 2)
MANIFEST_NAME = "fxpipe_manifest.json"
DCP_METADATA_NAME = ".metadata"  # written by torch.distributed.checkpoint when every rank's data is on disk
MODEL_PREFIX = "model/"
MANIFEST_CHECKSUM_FIELD = "manifest_sha256"  # format 2: sha256 of the manifest's other fields
REQUIRED_FIELDS = ("format", "format_version", "step", "extra", "world_size", "plan", "fingerprint",
                   "state_dict_keys", "optimizer", "files")
TEMPORARY_MARKERS = (".tmp-", ".old-")  # names save_checkpoint uses while a write is in progress


class CheckpointError(ValueError):
    """A checkpoint is incomplete, from another model, or cannot be read or written; the message says which."""


class CheckpointablePipe(Protocol):
    """What checkpointing reads of a pipelined module (``fxpipe.api.PipelinedModule`` is one)."""

    @property
    def plan(self) -> Plan: ...

    @property
    def program(self) -> SplitProgram: ...

    @property
    def graph_module(self) -> torch.fx.GraphModule: ...

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]: ...

    def parameters(self) -> Iterator[torch.nn.Parameter]: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None: ...


def model_fingerprint(program: SplitProgram) -> dict[str, dict[str, Any]]:
    """{original name -> {"shape", "dtype"}} of every parameter and buffer of the whole model, sorted by name.

    Built from all stages of the program, so every rank computes the same fingerprint whatever the plan.
    """
    found: dict[str, dict[str, Any]] = {}
    for stage in program.stages:
        for path, original in stage.param_names:
            tensor = _attribute(stage.module, path)
            if isinstance(tensor, torch.Tensor):
                found.setdefault(original, {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")})
    return {name: found[name] for name in sorted(found)}


def _attribute(module: torch.nn.Module, path: str) -> Any:
    owner_path, _, attribute = path.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    return getattr(owner, attribute, None)


def check_fingerprint(saved: Mapping[str, Any], current: Mapping[str, Any], directory: str | Path) -> None:
    """Raise CheckpointError naming missing, unexpected and reshaped entries when the two models differ."""
    missing = sorted(set(current) - set(saved))
    unexpected = sorted(set(saved) - set(current))
    reshaped = sorted(f"{name}: checkpoint {saved[name]['shape']} vs model {current[name]['shape']}"
                      for name in set(saved) & set(current) if list(saved[name]["shape"]) != current[name]["shape"])
    if missing or unexpected or reshaped:
        raise CheckpointError(
            f"checkpoint {str(directory)!r} is from another model: missing keys {_short(missing)}, unexpected keys "
            f"{_short(unexpected)}, shape mismatches {_short(reshaped)}; load a checkpoint saved from this model")


def _short(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return f"[{shown}{f', ... ({len(names)} in all)' if len(names) > limit else ''}]"


def state_dict_keys(pipe: CheckpointablePipe) -> dict[str, str]:
    """{key of the unsplit model's state_dict() -> stored (canonical) name}; tied aliases map to one name.

    Uses ``graph_module.meta["fxpipe.state_dict_names"]`` when the tracer records it; otherwise derives the
    keys from the traced module, which maps tied aliases but cannot tell non-persistent buffers apart.
    """
    graph_module = pipe.graph_module
    recorded = graph_module.meta.get(meta.STATE_DICT_NAMES)
    if isinstance(recorded, Mapping):
        return {str(key): str(recorded[key]) for key in sorted(recorded)}
    canonical: Mapping[str, str] = graph_module.meta[meta.PARAM_NAMES]
    keys = {}
    for path, _ in [*graph_module.named_parameters(remove_duplicate=False),
                    *graph_module.named_buffers(remove_duplicate=False)]:
        if path in canonical:
            keys[path] = canonical[path]
    for name in model_fingerprint(pipe.program):  # canonical names are state_dict keys of the model too
        keys.setdefault(name, name)
    return {key: keys[key] for key in sorted(keys)}


def manifest_checksum(manifest: Mapping[str, Any]) -> str:
    """sha256 of the manifest's canonical JSON without its own ``manifest_sha256`` field."""
    body = {key: value for key, value in manifest.items() if key != MANIFEST_CHECKSUM_FIELD}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_manifest(directory: Path, manifest: Mapping[str, Any]) -> None:
    """Write the manifest (with its own checksum) through a temporary file, fsync it, then rename it into place."""
    canonical = json.loads(json.dumps(manifest))  # as it will read back (e.g. integer keys of extra become strings)
    text = json.dumps({**canonical, MANIFEST_CHECKSUM_FIELD: manifest_checksum(canonical)}, indent=1, sort_keys=True)
    partial = directory / (MANIFEST_NAME + ".partial")
    with open(partial, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, directory / MANIFEST_NAME)
    fsync_directory(directory)


def fsync_directory(directory: Path) -> None:
    """Make renames and new files in ``directory`` durable (no-op where directories cannot be opened)."""
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def read_manifest(directory: str | Path, verify: bool = True) -> dict[str, Any]:
    """The manifest of a complete checkpoint; CheckpointError naming what is missing otherwise.

    With ``verify``, a format-2 manifest must match its own checksum (edited or damaged manifests are refused).
    """
    path = Path(directory)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist; pass a directory written by "
                              "save_checkpoint (latest_checkpoint(root) finds the newest complete one)")
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: {MANIFEST_NAME} is missing (the write was "
                              "interrupted before it finished); use latest_checkpoint(root) to find a complete one")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST_NAME} is unreadable ({error})") from error
    if not isinstance(manifest, dict):
        raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST_NAME} is not a JSON object")
    _check_manifest(path, manifest)
    if verify and manifest["format_version"] >= 2 and manifest.get(MANIFEST_CHECKSUM_FIELD) != manifest_checksum(manifest):
        raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST_NAME} was changed after saving (it does not match "
                              f"its {MANIFEST_CHECKSUM_FIELD!r}); restore it, load another checkpoint, or load with "
                              "verify=False to accept the edit")
    return manifest


def _check_manifest(path: Path, manifest: dict[str, Any]) -> None:
    missing_fields = [name for name in REQUIRED_FIELDS if name not in manifest]
    if missing_fields:
        raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST_NAME} lacks fields {missing_fields}")
    if manifest["format"] != FORMAT_NAME or (
            type(manifest["format_version"]) is not int or manifest["format_version"] not in READABLE_VERSIONS):
        raise CheckpointError(f"checkpoint {str(path)!r} has format {manifest['format']!r} version "
                              f"{manifest['format_version']!r}; this fxpipe reads {FORMAT_NAME!r} versions "
                              f"{list(READABLE_VERSIONS)}")
    if not isinstance(manifest["files"], list) or not all(isinstance(name, str) for name in manifest["files"]):
        raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST_NAME} field 'files' is not a list of names")
    _check_checksum_entries(path, manifest)
    missing_files = [name for name in [DCP_METADATA_NAME, *manifest["files"]] if not (path / name).is_file()]
    if missing_files:
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: files {missing_files} named by "
                              f"{MANIFEST_NAME} are missing")


def _check_checksum_entries(path: Path, manifest: dict[str, Any]) -> None:
    """Version 2 manifests list {"sha256", "bytes", "rank"} for .metadata and every data file."""
    if manifest["format_version"] < 2:
        return
    checksums = manifest.get("checksums")
    wanted = sorted({DCP_METADATA_NAME, *manifest["files"]})
    if not isinstance(checksums, dict) or sorted(checksums) != wanted or not all(
            isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and type(entry.get("bytes")) is int
            and type(entry.get("rank")) is int for entry in checksums.values()):
        raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST_NAME} field 'checksums' must map each of {wanted} "
                              "to {'sha256': hex, 'bytes': int, 'rank': int}; the manifest was edited or damaged, "
                              "load an older checkpoint")


def file_checksum(path: Path, rank: int, chunk_bytes: int = 1 << 20) -> dict[str, Any]:
    """{"sha256", "bytes", "rank"} of one file, read in chunks (``rank``: the rank that wrote it)."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
            size += len(chunk)
    return {"sha256": digest.hexdigest(), "bytes": size, "rank": rank}


def verify_files(directory: str | Path, manifest: Mapping[str, Any], names: list[str] | None = None) -> None:
    """Raise CheckpointError naming the first of ``names`` (default: all) whose size or sha256 differs from the manifest."""
    path = Path(directory)
    checksums: Mapping[str, Mapping[str, Any]] | None = manifest.get("checksums")
    if checksums is None:
        raise CheckpointError(f"checkpoint {str(path)!r} has format version {manifest['format_version']}, which records "
                              "no checksums; load or consolidate it with verify=False, then save it again")
    for name in sorted(checksums) if names is None else names:
        expected = checksums[name]
        try:
            actual = file_checksum(path / name, expected["rank"])
        except OSError as error:
            raise CheckpointError(f"checkpoint {str(path)!r}: cannot read {name!r} (written by rank "
                                  f"{expected['rank']}): {error}") from error
        if actual["bytes"] != expected["bytes"]:
            problem = f"has {actual['bytes']} bytes where the manifest records {expected['bytes']} (truncated or extended)"
        elif actual["sha256"] != expected["sha256"]:
            problem = (f"is corrupted: sha256 {actual['sha256'][:16]}... differs from the manifest's "
                       f"{expected['sha256'][:16]}...")
        else:
            continue
        raise CheckpointError(f"checkpoint {str(path)!r}: file {name!r} (written by rank {expected['rank']}) {problem}; "
                              "nothing was loaded: restore the file or load an older checkpoint")


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint under ``root`` (a direct subdirectory) with the highest step; None when there is none.

    Directories left by interrupted writes (no manifest, or a temporary name) are skipped.
    """
    root_path = Path(root)
    if not root_path.is_dir():
        return None
    best: tuple[int, str] | None = None
    for child in sorted(root_path.iterdir()):
        if not child.is_dir() or any(marker in child.name for marker in TEMPORARY_MARKERS):
            continue
        try:
            step = int(read_manifest(child)["step"])
        except (CheckpointError, TypeError, ValueError):
            continue
        if best is None or (step, child.name) > best:
            best = (step, child.name)
    return None if best is None else root_path / best[1]
