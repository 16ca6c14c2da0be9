"""The package's import graph has no cycle (issue 47: the model, the fast path, the engines and the interface are
layers, each importing only the ones below it; pyproject.toml's import-linter contracts name the layers). A file
added anywhere in qwen_tts inherits the rule."""

from __future__ import annotations

import grimp


def find_cycle(graph: grimp.ImportGraph) -> list[str] | None:
    """One import cycle among the graph's modules (each module then the one it imports, back to the first), or None
    (a depth-first search; a package is its __init__)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for nxt in sorted(graph.find_modules_directly_imported_by(module)):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph.modules):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_qwen_tts_has_no_import_cycle() -> None:
    graph = grimp.build_graph("qwen_tts")
    assert len(graph.modules) > 20  # the whole package was read
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_cycle_search_finds_one() -> None:
    graph = grimp.ImportGraph()
    for m in ("p", "p.a", "p.b", "p.c"):
        graph.add_module(m)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.c")
    assert find_cycle(graph) is None
    graph.add_import(importer="p.c", imported="p.a")
    assert find_cycle(graph) == ["p.a", "p.b", "p.c", "p.a"]
