"""Draw the package's parts and their imports as a Mermaid graph (for docs/architecture.md).

``python docs/make_architecture.py`` prints the graph; ``tests/unit/test_architecture.py`` fails
when the picture in docs/architecture.md differs from what the code imports today. The import
graph comes from grimp (the engine of import-linter, which checks the layering contracts).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "lightning_mmpar"


def part(module: str) -> str | None:
    """``lightning_mmpar.parallel.comm`` -> ``parallel``; the package itself -> None."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 and not pieces[1].startswith("_") else None


def label(name: str) -> str:
    """``parallel/`` for a subpackage, ``strategy.py`` for a module."""
    return f"{name}/" if (ROOT / PACKAGE / name).is_dir() else f"{name}.py"


def layers() -> list[list[str]]:
    """The layer contract of pyproject.toml, top first, each layer's parts."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for contract in config["tool"]["importlinter"]["contracts"]:
        if contract["type"] == "layers":
            return [[p.strip() for p in layer.split("|")] for layer in contract["layers"]]
    raise ValueError("pyproject.toml has no layers contract")


def edges() -> list[tuple[str, str]]:
    """Sorted ``(importer part, imported part)`` pairs from every module's direct imports."""
    graph = grimp.build_graph(PACKAGE)
    found = set()
    for module in graph.modules:
        a = part(module)
        for imported in graph.find_modules_directly_imported_by(module):
            b = part(imported)
            if a and b and a != b:
                found.add((a, b))
    return sorted(found)


def mermaid() -> str:
    """The picture: one row per layer (top imports bottom), an arrow per imported part."""
    lines = ["flowchart TD"]
    for i, parts in enumerate(layers()):
        lines.append(f'  subgraph L{i}[" "]')
        lines += [f"    {p}[{label(p)}]" for p in parts]
        lines.append("  end")
    lines += [f"  {a} --> {b}" for a, b in edges()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(mermaid(), end="")
