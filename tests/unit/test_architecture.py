"""The package's shape: public API, one home for collectives, plain-torch models, file sizes,
and the layer picture in docs/architecture.md drawn from the code's imports.

The layering itself (which part may import which, no cycles) is checked by import-linter's
contracts in pyproject.toml (``lint-imports``, part of ``make lint``); torch.distributed in
models/ by ruff's banned-api rule (lightning_mmpar/models/ruff.toml).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lightning_mmpar"
DOCS = ROOT / "docs"

PUBLIC_PACKAGES = (
    "lightning_mmpar",
    "lightning_mmpar.callbacks",
    "lightning_mmpar.data",
    "lightning_mmpar.layout",
    "lightning_mmpar.losses",
    "lightning_mmpar.models",
    "lightning_mmpar.parallel",
    "lightning_mmpar.plans",
    "lightning_mmpar.precision",
    "lightning_mmpar.recipes",
    "lightning_mmpar.strategy",
)

COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "irecv",
    "isend",
    "recv",
    "recv_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "send_object_list",
}
"""torch.distributed functions that communicate; only parallel/comm.py may call them."""

MAX_FUNCTION_LINES = 60
"""Lines a function's body may take (docstring excluded): one idea per function."""

LONG_FUNCTIONS: dict[str, tuple[int, str]] = {
    "layout/comm.py:_count": (
        168,
        "the collective byte table: one add() per collective and its purpose, in order",
    ),
    "callbacks/pipeline_timeline.py:draw_timeline": (68, "one matplotlib figure, drawn top down"),
    "plans/fusion_cost.py:_tp_collectives": (65, "one collective per tensor-parallel style"),
}
"""``path:Class.function`` -> (lines allowed, why it is one unit); may not grow."""


def sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def dist_aliases(tree: ast.Module) -> tuple[set[str], set[str]]:
    """Names bound to the ``torch.distributed`` module, and collectives imported by name."""
    modules, functions = {"torch.distributed"}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed" and a.asname:
                    modules.add(a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            for a in node.names:
                if a.name in COLLECTIVES:
                    functions.add(a.asname or a.name)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and node.names:
            modules.update(a.asname or a.name for a in node.names if a.name == "distributed")
    return modules, functions


def collective_calls(path: Path, root: Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text())
    modules, functions = dist_aliases(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in functions:
            found.append(f"{path.relative_to(root)}:{node.lineno} {f.id}")
        if isinstance(f, ast.Attribute) and f.attr in COLLECTIVES:
            if ast.unparse(f.value) in modules:
                found.append(f"{path.relative_to(root)}:{node.lineno} {ast.unparse(f)}")
    return found


def test_collectives_only_in_comm() -> None:
    comm = PACKAGE / "parallel" / "comm.py"
    calls = [c for p in sources() if p != comm for c in collective_calls(p)]
    assert not calls, "collectives outside parallel/comm.py:\n" + "\n".join(calls)
    assert collective_calls(comm), "the scan must see comm's own collectives"


def test_the_scan_finds_a_collective(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import torch.distributed as d\nfrom torch.distributed import broadcast as b\n"
        "import torch\n\ndef f(t):\n    d.all_reduce(t)\n    b(t, 0)\n"
        "    torch.distributed.barrier()\n"
    )
    calls = [c.split(" ", 1)[1] for c in collective_calls(bad, tmp_path)]
    assert sorted(calls) == ["b", "d.all_reduce", "torch.distributed.barrier"]


@pytest.mark.parametrize(
    "source",
    [
        "import torch.distributed as dist\n",
        "from torch.distributed.tensor import DTensor\n",
        "from torch import distributed\n",
        "import torch\n\n\ndef f() -> int:\n    return torch.distributed.get_rank()\n",
    ],
)
def test_ruff_bans_torch_distributed_in_models(source: str) -> None:
    """models/ is plain torch: ruff's banned-api rule (lightning_mmpar/models/ruff.toml, run by
    ``make lint`` on the whole package) flags every way of reaching torch.distributed."""
    ruff = Path(sys.executable).with_name("ruff")
    proc = subprocess.run(
        [str(ruff), "check", "--stdin-filename", "lightning_mmpar/models/probe.py", "-"],
        input=source,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 1 and "TID251" in proc.stdout, proc.stdout + proc.stderr


def function_lengths(tree: ast.Module) -> dict[str, int]:
    """Lines of every function and method (its docstring not counted), by ``Class.name``."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (child.end_lineno or child.lineno) - child.lineno + 1
                first = child.body[0]
                if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                    n -= (first.end_lineno or first.lineno) - first.lineno + 1
                lengths[f"{prefix}{child.name}"] = n
                visit(child, f"{prefix}{child.name}.")

    visit(tree, "")
    return lengths


def test_functions_are_short() -> None:
    """Functions stay within MAX_FUNCTION_LINES (body, docstring excluded); the exceptions are
    listed in LONG_FUNCTIONS with their reason and may not grow."""
    over, stale = {}, set(LONG_FUNCTIONS)
    for path in sources():
        rel = path.relative_to(PACKAGE).as_posix()
        for name, n in function_lengths(ast.parse(path.read_text())).items():
            key = f"{rel}:{name}"
            stale.discard(key)
            allowed = LONG_FUNCTIONS.get(key, (MAX_FUNCTION_LINES, ""))[0]
            if n > allowed:
                over[key] = n
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines (or their listed budget): {over}"
    assert not stale, f"LONG_FUNCTIONS lists functions that no longer exist: {sorted(stale)}"


SHARED_BASENAMES: dict[str, str] = {
    "comm.py": "layout/ predicts the bytes of the collectives parallel/comm.py runs",
    "fusion.py": "models/ holds the fusion model, plans/ its parallel plan",
    "partition.py": "layout/ cuts blocks into stages; recipes/ is its command line",
    "planner.py": "layout/ ranks layouts; recipes/ is its command line",
    "schedules.py": "layout/ holds the schedule facts, parallel/pipeline/ builds torch's schedules",
    "stages.py": "layout/ tabulates a stage cut, parallel/pipeline/ builds torch's stages",
}
"""Basenames two modules may share, with the reason (a prediction beside its mechanism, a
command line beside its engine). A deprecated alias (docstring starting "Deprecated") may
share its old name until it is removed."""


def _deprecated_alias(path: Path) -> bool:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.startswith("Deprecated")


def test_basenames_are_unique() -> None:
    """No two modules share a basename without a reason listed in SHARED_BASENAMES."""
    seen: dict[str, list[Path]] = {}
    for path in sources():
        if path.name != "__init__.py" and not _deprecated_alias(path):
            seen.setdefault(path.name, []).append(path.relative_to(PACKAGE))
    shared = {name: paths for name, paths in seen.items() if len(paths) > 1}
    unexplained = {name: paths for name, paths in shared.items() if name not in SHARED_BASENAMES}
    assert not unexplained, f"modules sharing a basename, no reason listed: {unexplained}"
    stale = set(SHARED_BASENAMES) - set(shared)
    assert not stale, f"SHARED_BASENAMES lists names no longer shared: {sorted(stale)}"


@pytest.mark.parametrize("name", PUBLIC_PACKAGES)
def test_public_api_imports(name: str) -> None:
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    assert exported, f"{name} has no __all__"
    assert len(set(exported)) == len(exported), f"{name}.__all__ repeats a name"
    for attr in exported:
        assert getattr(module, attr, None) is not None, f"{name}.{attr} is in __all__ but missing"


def test_api_doc_lists_every_public_name() -> None:
    text = (DOCS / "api.md").read_text()
    missing = []
    for name in PUBLIC_PACKAGES:
        module = importlib.import_module(name)
        section = re.search(rf"^## `{re.escape(name)}`$(.*?)(?=^## |\Z)", text, re.M | re.S)
        if section is None:
            missing.append(f"section ## `{name}`")
            continue
        missing += [f"{name}.{a}" for a in module.__all__ if f"`{a}`" not in section.group(1)]
    assert not missing, f"docs/api.md does not list: {missing}"


def test_callbacks_import_as_documented() -> None:
    from lightning_mmpar.callbacks import FP8FallbackCallback, GradientDriftMonitor

    assert GradientDriftMonitor.__module__.startswith("lightning_mmpar.callbacks")
    assert FP8FallbackCallback.__module__.startswith("lightning_mmpar.callbacks")


def test_sources_are_papers_and_peers() -> None:
    """Docstrings, docs and recipe YAMLs cite papers and peers, never a design document that
    users of the package cannot read."""
    roots = (PACKAGE, DOCS, ROOT / "recipes", ROOT / "benchmarks")
    files = [p for r in roots for p in r.rglob("*") if p.suffix in {".py", ".md", ".yaml"}]
    cited = [
        str(p.relative_to(ROOT))
        for p in [*files, ROOT / "README.md", ROOT / "CHANGELOG.md"]
        if "TECHNIQUES" in p.read_text()
    ]
    assert not cited, f"cite the paper or peer instead of TECHNIQUES in: {cited}"


def test_architecture_picture_is_current() -> None:
    spec = importlib.util.spec_from_file_location(
        "make_architecture", DOCS / "make_architecture.py"
    )
    assert spec is not None and spec.loader is not None
    drawing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(drawing)
    text = (DOCS / "architecture.md").read_text()
    block = re.search(r"```mermaid\n(.*?)```", text, re.S)
    assert block is not None, "docs/architecture.md has no mermaid picture"
    assert block.group(1).strip() == drawing.mermaid().strip(), (
        "docs/architecture.md is out of date: run `python docs/make_architecture.py` "
        "and paste its output"
    )
