"""The packages depend in one direction only: maverick <- eagle3 <- train <- eval.

The model package must not need the draft package (plain decoding, sampling rules and the model are
usable alone), the draft package must not need training or evaluation, and no two modules import each
other, not even lazily inside a function: an import cycle hidden in a function still means neither
module can be read, tested or moved without the other. Read from the source with `ast`, so the check
costs no imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ["maverick", "eagle3", "train", "eval"]  # each may import only the ones before it


def imports() -> dict[str, set[str]]:
    """module name -> the project modules it imports anywhere in its source (top level or in functions)."""
    graph: dict[str, set[str]] = {}
    for pkg in LAYERS:
        for path in sorted((ROOT / pkg).glob("*.py")):
            name = f"{pkg}.{path.stem}"
            found = set()
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                found |= {
                    n
                    for n in names
                    if n.split(".")[0] in LAYERS and (ROOT / (n.replace(".", "/") + ".py")).is_file()
                }
            graph[name] = found - {name}
    return graph


def test_packages_import_only_down_the_stack():
    graph = imports()
    assert "maverick.generate" in graph and "eval.report" in graph  # the walk saw the packages
    upward = [
        f"{m} imports {d}"
        for m, deps in graph.items()
        for d in deps
        if LAYERS.index(d.split(".")[0]) > LAYERS.index(m.split(".")[0])
    ]
    assert upward == []


def test_no_two_modules_import_each_other():
    graph = imports()
    assert "eval.summary" in graph["eval.plots"] and "eval.summary" in graph["eval.report"]
    pairs = sorted(
        {tuple(sorted((m, d))) for m, deps in graph.items() for d in deps if m in graph.get(d, ())}
    )
    assert pairs == []
