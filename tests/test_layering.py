"""Planning and execution stay apart: only fxpipe/runtime/ imports torch.distributed."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = ("fxpipe", "passes", "models")


def _imports_torch_distributed(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(), filename=str(path))
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        if any(name == "torch.distributed" or name.startswith("torch.distributed.") for name in names):
            lines.append(node.lineno)
    return lines


def _source_files() -> list[Path]:
    return sorted(p for d in PACKAGE_DIRS for p in (ROOT / d).rglob("*.py"))


@pytest.mark.parametrize("path", _source_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_only_runtime_imports_torch_distributed(path: Path) -> None:
    if path.is_relative_to(ROOT / "fxpipe" / "runtime"):
        return
    lines = _imports_torch_distributed(path)
    assert not lines, f"{path.relative_to(ROOT)} imports torch.distributed at lines {lines}; move that code to fxpipe/runtime/"


def test_planning_import_does_not_load_torch_distributed_modules_of_ours() -> None:
    code = (
        "import sys, fxpipe, fxpipe.core.plan, fxpipe.core.schedule, fxpipe.core.cluster, fxpipe.core.chain\n"
        "bad = [m for m in sys.modules if m.startswith('fxpipe.runtime')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_fxpipe_module_imports_first_in_a_fresh_interpreter() -> None:
    """No import cycle depends on which module a user imports first (fxpipe.passes.partition.latency once did)."""
    names = sorted(f"fxpipe.{p.stem}" for p in (ROOT / "fxpipe").glob("*.py") if p.stem not in ("__init__", "__main__"))
    code = ("import importlib, sys\nfailed = []\nfor name in sys.argv[1:]:\n"
            "    for loaded in [m for m in sys.modules if m == 'fxpipe' or m.startswith('fxpipe.')]:\n"
            "        del sys.modules[loaded]\n"
            "    try:\n        importlib.import_module(name)\n"
            "    except ImportError as error:\n        failed.append(f'{name}: {error}')\n"
            "assert not failed, failed\n")
    subprocess.run([sys.executable, "-c", code, *names], check=True)
