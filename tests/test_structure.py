"""The house rules a newcomer relies on: spinwheel's import graph has no cycles (every import, also those inside
functions), no module is over 350 lines and no function over 80 (one screen)."""

from __future__ import annotations

import ast
from pathlib import Path

import spinwheel

ROOT = Path(spinwheel.__file__).parent
MAX_LINES = 350
MAX_FUNCTION_LINES = 80


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the spinwheel modules it imports (``from a.b import c`` counts a.b.c when it is a module)."""
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for t in targets:
                if t in modules and t != name and not t == package:  # a package's own __init__ is not an edge
                    graph[name].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state and (c := visit(n)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return None


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    graph = import_graph()
    assert "spinwheel.train.sft.sft" in graph and graph["spinwheel.train.sft.sft"]  # the graph is really read
    # A submodule reading its own package's re-exports runs inside that package's import: not a cycle of files.
    cycle = find_cycle({m: {n for n in edges if not m.startswith(n + ".")} for m, edges in graph.items()})
    assert cycle is None, " -> ".join(cycle)


def test_no_module_over_350_lines():
    long = {module_name(p): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """name -> lines (``def`` to its last line) of every function or method in ``source`` over ``limit`` lines."""
    return {
        node.name: n
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (n := node.end_lineno - node.lineno + 1) > limit
    }


def test_the_function_length_check_finds_long_functions():
    def body(lines: int, indent: str) -> str:
        return "".join(f"{indent}x{i} = {i}\n" for i in range(lines))

    # `def` + 80 body lines = 81 lines: over the limit; a method of exactly 80 lines is not.
    source = f"def long():\n{body(80, '    ')}\n\nclass A:\n    def short(self):\n{body(79, '        ')}"
    assert long_functions(source) == {"long": 81}
    assert long_functions(f"class B:\n    async def f(self):\n{body(80, '        ')}") == {"f": 81}


def test_no_function_over_80_lines():
    over = {
        (path.relative_to(ROOT).as_posix(), name): n
        for path in ROOT.rglob("*.py")
        for name, n in long_functions(path.read_text()).items()
    }
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps): {over}"


def test_slow_and_distributed_markers_are_registered_and_strict(pytestconfig):
    registered = {line.split(":")[0].strip() for line in pytestconfig.getini("markers")}
    assert {"slow", "distributed"} <= registered, registered
    assert pytestconfig.getoption("strict_markers"), "--strict-markers: a misspelt marker must fail, not run as 'fast'"
