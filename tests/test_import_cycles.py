"""No import circle between sibling modules, counting imports made only for type annotations.

`lint-imports` leaves type-checking imports out (its forbidden contracts are about what runs: the torch-free
side may name an engine type in an annotation), so its acyclic-siblings contract cannot see a circle that
only annotations close. Such a circle still ties two modules together; this test counts them.
"""

from __future__ import annotations

import grimp
import pytest

PACKAGES = ("fly_llm", "fly_daemon")


def sibling_imports(graph: grimp.ImportGraph, package: str) -> dict[str, set[str]]:
    """Per child of `package`: the children whose subtree its subtree imports directly."""
    children = sorted(graph.find_children(package))
    members = {child: {child, *graph.find_descendants(child)} for child in children}
    owner = {module: child for child, modules in members.items() for module in modules}
    edges: dict[str, set[str]] = {child: set() for child in children}
    for child, modules in members.items():
        for module in modules:
            for imported in graph.find_modules_directly_imported_by(module):
                other = owner.get(imported)
                if other is not None and other != child:
                    edges[child].add(other)
    return edges


def a_circle(edges: dict[str, set[str]]) -> list[str] | None:
    """One circle of the directed graph `edges`, as the modules around it, or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (circle := visit(nxt)):
                return circle
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(edges):
        if node not in state and (circle := visit(node)):
            return circle
    return None


def test_a_circle_is_found() -> None:
    assert a_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert a_circle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


@pytest.mark.parametrize("root", PACKAGES)
def test_no_sibling_circles_counting_type_only_imports(root: str) -> None:
    graph = grimp.build_graph(root, exclude_type_checking_imports=False)
    packages = [module for module in sorted(graph.modules) if graph.find_children(module)]
    circles = {package: circle for package in packages if (circle := a_circle(sibling_imports(graph, package)))}
    assert not circles, f"import circles between siblings (type-only imports counted): {circles}"
