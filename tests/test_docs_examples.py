"""The docs teach only public API: every Python block in README.md and docs/*.md parses, its import lines
run, and every fxpipe name it imports or reads is public; ``fxpipe.__all__`` is that API (cheap to import,
shown by ``dir``), every error a user can meet is in it, and docs/errors.md has a row for each.

What counts as a Python block: a fenced block whose info string is ``python`` or ``py``, and an indented
code block right after a paragraph ending in "Python:". Any other code block (unlabelled fence, indented)
that parses as Python and holds an import or reads an attribute of ``fxpipe`` or ``pipe`` is reported:
label it ```python.

What is public: the module ``fxpipe`` and the names in ``fxpipe.__all__``; the submodules
``fxpipe.models``, ``fxpipe.data`` and ``fxpipe.passes`` (all three in ``fxpipe.__all__``) and the names in
their own ``__all__``. Attributes of public objects (``pipe.step``, ``fxpipe.models.get(...).loss_fn``)
are not followed. A block that shows internals on purpose (rare; prefer public API) carries the comment
``# internal API: <why>`` and is then exempt from the public-name check only.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

import fxpipe

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
PUBLIC_MODULES = ("fxpipe", "fxpipe.data", "fxpipe.models", "fxpipe.passes")
PYTHON_INFO = ("python", "py")
INTERNAL_MARK = re.compile(r"#\s*internal API:\s*\S")
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([\w+-]*)")
# Exceptions and warnings defined in the package that never reach the caller (each is converted first).
INTERNAL_ERRORS = {
    "JSONValueError": "read_field's callers raise PlanError / ClusterSpecError",
    "NodeRunError": "annotate_costs falls back to a static batch and records why",
    "SplitUnsupported": "the stage runs W inside B with a CompileFallbackWarning",
    "ExportTraceFailure": "trace raises TraceError",
    "FxTraceFailure": "trace raises TraceError",
    "CalibrationError": "becomes a RuntimeWarning and the default figures",
    "_NotSymbolic": "annotate_costs falls back",
    "_Uncacheable": "the node runs uncached",
    "Conflict": "the tensor-parallel pass keeps the conflicting column linears whole",
    "TensorParallelError": "shard_stage's caller (the runtime) passes a plan's degree and rank",
    "GroupNotRegisteredError": "the runtime registers each tensor-parallel group before its stage runs",
}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the block's first code line
    info: str  # the fence's info string; "indented" or "indented-python" for indented blocks
    code: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def is_python(self) -> bool:
        return self.info in (*PYTHON_INFO, "indented-python")


def code_blocks(path: Path, text: str) -> list[Block]:
    """Fenced and indented code blocks, in order (CommonMark's rules, enough of them for these docs)."""
    lines, blocks, index, paragraph_end = text.splitlines(), [], 0, ""
    while index < len(lines):
        fence = FENCE.match(lines[index])
        if fence:
            marker, start = fence.group(1), index + 1
            index = start
            while index < len(lines) and not lines[index].strip().startswith(marker):
                index += 1
            blocks.append(Block(path, start + 1, fence.group(2).lower(), "\n".join(lines[start:index])))
            index, paragraph_end = index + 1, ""
            continue
        previous_blank = index == 0 or not lines[index - 1].strip()
        if lines[index].startswith("    ") and lines[index].strip() and previous_blank:
            start = index
            while index < len(lines) and (lines[index].startswith("    ") or not lines[index].strip()):
                index += 1
            info = "indented-python" if paragraph_end.endswith("Python:") else "indented"
            code = textwrap.dedent("\n".join(lines[start:index])).strip("\n")
            blocks.append(Block(path, start + 1, info, code))
            paragraph_end = ""
            continue
        if lines[index].strip():
            paragraph_end = lines[index].strip()
        index += 1
    return blocks


ALL_BLOCKS = [block for path in DOC_FILES for block in code_blocks(path, path.read_text(encoding="utf-8"))]
PYTHON_BLOCKS = [block for block in ALL_BLOCKS if block.is_python]


def _ours(module: str) -> bool:
    return module == "fxpipe" or module.startswith("fxpipe.")


def _public_names(module: str) -> set[str]:
    return set(importlib.import_module(module).__all__)


def _check_import(node: ast.Import | ast.ImportFrom, bound: dict[str, str]) -> list[str]:
    """Problems with one import line; records which local names it binds to public modules."""
    problems = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            if not _ours(alias.name):
                continue
            if alias.name not in PUBLIC_MODULES:
                problems.append(f"line {node.lineno}: `import {alias.name}`: not a public module {PUBLIC_MODULES}")
            else:  # `import fxpipe.models` binds the name fxpipe; `import fxpipe.models as zoo` binds zoo
                bound[alias.asname or "fxpipe"] = alias.name if alias.asname else "fxpipe"
        return problems
    module = node.module or ""
    if node.level or not _ours(module):
        return problems
    if module not in PUBLIC_MODULES:
        return [f"line {node.lineno}: `from {module} import ...`: not a public module {PUBLIC_MODULES}; "
                f"import from fxpipe (fxpipe.__all__)"]
    for alias in node.names:
        full = f"{module}.{alias.name}"
        if full in PUBLIC_MODULES:
            bound[alias.asname or alias.name] = full
        elif alias.name not in _public_names(module):
            problems.append(f"line {node.lineno}: `from {module} import {alias.name}`: "
                            f"{alias.name!r} is not in {module}.__all__")
    return problems


def public_api_problems(tree: ast.AST) -> list[str]:
    """Every fxpipe module a block imports, name it imports, or attribute it reads that is not public."""
    bound: dict[str, str] = {}  # local name -> the public module it holds
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            problems += _check_import(node, bound)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound):
            continue
        module, current = bound[node.value.id], node
        while f"{module}.{current.attr}" in PUBLIC_MODULES:  # fxpipe.models.build: follow into the submodule
            parent = parents.get(current)
            if not (isinstance(parent, ast.Attribute) and parent.value is current):
                break
            module, current = f"{module}.{current.attr}", parent
        name = current.attr
        if f"{module}.{name}" not in PUBLIC_MODULES and name not in _public_names(module):
            problems.append(f"line {current.lineno}: `{module}.{name}` is not public API (not in {module}.__all__)")
    return problems


def run_imports(tree: ast.Module, filename: str) -> None:
    imports: list[ast.stmt] = [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]
    exec(compile(ast.Module(body=imports, type_ignores=[]), filename, "exec"), {})


def test_the_docs_have_python_blocks_to_check() -> None:
    files = {block.path.name for block in PYTHON_BLOCKS}
    assert {"README.md", "checkpoints.md", "huggingface.md", "export.md"} <= files, files


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=str)
def test_python_block_parses_imports_and_names_only_public_api(block: Block) -> None:
    try:
        tree = ast.parse(block.code, filename=str(block))
    except SyntaxError as error:
        pytest.fail(f"{block}: the Python block does not parse: {error}")
    if not INTERNAL_MARK.search(block.code):
        problems = public_api_problems(tree)
        assert not problems, (f"{block} uses non-public API (use fxpipe.__all__, or mark the block "
                              f"'# internal API: <why>'):\n" + "\n".join(problems))
    run_imports(tree, str(block))


def test_no_python_hides_in_an_unlabelled_block() -> None:
    hidden = []
    for block in ALL_BLOCKS:
        if block.is_python:
            continue
        for chunk in re.split(r"\n\s*\n", block.code):  # shell lines and Python can share one indented block
            try:
                tree = ast.parse(chunk)
            except SyntaxError:
                continue
            if any(isinstance(node, ast.Import | ast.ImportFrom) or (
                    isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in ("fxpipe", "pipe")) for node in ast.walk(tree)):
                hidden.append(f"{block}: {chunk.strip().splitlines()[0]}")
    assert not hidden, f"code blocks that are Python but not labelled ```python (so not checked): {hidden}"


def _resolves(dotted: str) -> bool:
    """``dotted`` names a module, or an attribute path inside the longest module prefix that imports."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:end]))
        except ImportError:
            continue
        for name in parts[end:]:
            if not hasattr(found, name):
                return False
            found = getattr(found, name)
        return True
    return False


def test_every_fxpipe_name_the_docs_mention_exists() -> None:
    """Prose may name internals (`fxpipe.sim.stagecost.WEIGHT_GRAD_FRACTION`), but they must exist; quoted
    meta keys (`meta["fxpipe.batch_dims"]`) are strings, not names."""
    missing = set()
    for path in DOC_FILES:
        for span in re.findall(r"`[^`\n]+`", path.read_text(encoding="utf-8")):
            for match in re.finditer(r"(?<![\w.\"'/])fxpipe(?:\.[A-Za-z_]\w*)+", span):
                if not _resolves(match.group(0)):
                    missing.add(f"{path.relative_to(ROOT)}: {match.group(0)}")
    assert not missing, f"names in the docs that do not exist: {sorted(missing)}"


def test_the_checker_refuses_internal_modules_and_names() -> None:
    code = textwrap.dedent("""
        import fxpipe
        import fxpipe.runtime.checkpoint_io
        from fxpipe.core.checkpoint import latest_checkpoint
        from fxpipe import consolidate, not_a_public_name
        from fxpipe.models import build, registry
        found = fxpipe.latest_checkpoint("ckpt")
        fxpipe.runtime.checkpoint_io.save_checkpoint(pipe, "ckpt")
        fxpipe.models.registry.load_callable("a:b")
        model, inputs = fxpipe.models.build("mlp")
    """)
    problems = public_api_problems(ast.parse(code))
    expected = ["`import fxpipe.runtime.checkpoint_io`", "`from fxpipe.core.checkpoint import ...`",
                "'not_a_public_name' is not in fxpipe.__all__", "'registry' is not in fxpipe.models.__all__",
                "`fxpipe.runtime` is not public", "`fxpipe.models.registry` is not public"]
    for text in expected:
        assert sum(text in problem for problem in problems) == 1, (text, problems)
    assert len(problems) == len(expected), problems
    checkpoints_block = next(block for block in PYTHON_BLOCKS if block.path.name == "checkpoints.md")
    assert "fxpipe.latest_checkpoint" in checkpoints_block.code  # the page issue 37 found on fxpipe.core


def test_indented_python_after_python_colon_counts() -> None:
    text = "Python:\n\n    from fxpipe.core.plan import Plan\n\nShell:\n\n    fxpipe plan mlp\n"
    blocks = code_blocks(ROOT / "README.md", text)
    assert [(block.info, block.line) for block in blocks] == [("indented-python", 3), ("indented", 7)]
    assert public_api_problems(ast.parse(blocks[0].code))


def test_import_fxpipe_is_cheap_and_dir_shows_the_public_api() -> None:
    code = ("import sys, fxpipe\n"
            "assert 'torch' not in sys.modules, 'import fxpipe loaded torch'\n"
            "missing = set(fxpipe.__all__) - set(dir(fxpipe))\n"
            "assert not missing, missing\n"
            "assert {'compile', 'plan', 'consolidate', 'latest_checkpoint', 'models', 'PipelinedModule', 'Plan',\n"
            "        'Cluster', 'CheckpointError', 'PipelineSetupError'} <= set(fxpipe.__all__)\n")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert len(set(fxpipe.__all__)) == len(fxpipe.__all__)
    for name in fxpipe.__all__:
        assert getattr(fxpipe, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        fxpipe.nope  # noqa: B018


def _package_modules() -> list[str]:
    """Every module of fxpipe, fxpipe.passes and fxpipe.models (three source folders), but __main__."""
    names = []
    for package in ("fxpipe", "fxpipe.passes", "fxpipe.models"):
        folder = Path(importlib.import_module(package).__path__[0])
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] != "__main__":
                names.append(".".join((package, *(parts[:-1] if parts[-1] == "__init__" else parts))))
    return names


def _defined_errors() -> dict[str, type]:
    """Every exception and warning class the package defines, by name."""
    found: dict[str, type] = {}
    for name in _package_modules():
        module = importlib.import_module(name)
        for attribute, value in vars(module).items():
            if (inspect.isclass(value) and issubclass(value, BaseException | Warning)
                    and value.__module__ == name):
                assert attribute not in found or found[attribute] is value, f"two error classes named {attribute}"
                found[attribute] = value
    return found


def test_every_error_a_user_can_meet_is_exported() -> None:
    defined = _defined_errors()
    exported = {name for name in fxpipe.__all__ if inspect.isclass(getattr(fxpipe, name))
                and issubclass(getattr(fxpipe, name), BaseException | Warning)}
    assert "CheckpointError" in exported and "ShardingError" in exported
    missing = sorted(set(defined) - exported - set(INTERNAL_ERRORS))
    assert not missing, (f"error classes not in fxpipe.__all__: {missing}; export them (fxpipe/__init__.py "
                         "_ERRORS) or, if they never reach the caller, list them in INTERNAL_ERRORS with why")
    for name in exported:
        assert defined[name] is getattr(fxpipe, name), name
    assert not exported & set(INTERNAL_ERRORS)


def _errors_md_rows() -> list[tuple[str, str, str, str]]:
    """(class, base, module column, whole row) of each table row of docs/errors.md."""
    rows = []
    for line in (ROOT / "docs" / "errors.md").read_text(encoding="utf-8").splitlines():
        match = re.match(r"\| `(\w+)`(?: \(a warning\))? \| `?([\w-]+)`? \| ([^|]*) \|", line)
        if match:
            rows.append((match.group(1), match.group(2), match.group(3), line))
    return rows


def test_errors_md_lists_every_exported_error_and_only_those() -> None:
    rows = _errors_md_rows()
    documented = {name for name, *_ in rows}
    exported = {name for name in fxpipe.__all__ if inspect.isclass(getattr(fxpipe, name))
                and issubclass(getattr(fxpipe, name), BaseException | Warning)}
    assert sorted(exported - documented) == [], "exported errors with no row in docs/errors.md"
    builtin = {name for name in documented if hasattr(builtins, name)}
    never_seen = {name for name, _, _, row in rows if "never reaches the caller" in row}
    assert sorted(documented - exported - builtin - never_seen) == [], "docs/errors.md rows for unexported classes"
    for name, base, module_column, row in rows:
        if name not in exported:
            continue
        cls = getattr(fxpipe, name)
        assert base == cls.__bases__[0].__name__, f"docs/errors.md gives {name} the base {base}: {row[:120]}"
        module_name = re.match(r"`([\w.]+)`", module_column.strip())
        assert module_name, row[:120]
        module = importlib.import_module(module_name.group(1))
        assert getattr(module, name, None) is cls, f"docs/errors.md: {module_name.group(1)} has no {name}"


def test_latest_checkpoint_is_public_and_finds_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    from fxpipe.core.checkpoint import (
        DCP_METADATA_NAME,
        FORMAT_NAME,
        FORMAT_VERSION,
        MANIFEST_NAME,
        file_checksum,
        write_manifest,
    )

    def checkpoint(name: str, step: int) -> Path:
        directory = tmp_path / name
        directory.mkdir()
        for file in (DCP_METADATA_NAME, "__0_0.distcp"):
            (directory / file).write_bytes(file.encode())
        manifest = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "step": step, "extra": {},
                    "world_size": 1, "plan": {}, "fingerprint": {}, "state_dict_keys": {}, "optimizer": None,
                    "files": ["__0_0.distcp"],
                    "checksums": {file: file_checksum(directory / file, 0)
                                  for file in (DCP_METADATA_NAME, "__0_0.distcp")}}
        write_manifest(directory, manifest)
        return directory

    assert fxpipe.latest_checkpoint(tmp_path / "absent") is None
    assert fxpipe.latest_checkpoint(tmp_path) is None
    checkpoint("step-000003", 3)
    newest = checkpoint("step-000007", 7)
    checkpoint("step-000005", 5)
    assert fxpipe.latest_checkpoint(tmp_path) == newest
    assert fxpipe.latest_checkpoint(str(tmp_path)) == newest
    interrupted = checkpoint("step-000009.tmp-0123", 9)  # a save still in progress
    lost_file = checkpoint("step-000011", 11)
    (lost_file / "__0_0.distcp").unlink()
    (checkpoint("step-000013", 13) / MANIFEST_NAME).unlink()  # interrupted before the manifest
    edited = checkpoint("step-000015", 15) / MANIFEST_NAME
    edited.write_text(edited.read_text().replace('"step": 15', '"step": 17'))  # no longer its checksum
    assert interrupted.is_dir() and '"step": 17' in edited.read_text()
    assert fxpipe.latest_checkpoint(tmp_path) == newest
    assert fxpipe.latest_checkpoint is importlib.import_module("fxpipe.core.checkpoint").latest_checkpoint
