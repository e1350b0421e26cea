"""The package is layered: a module imports only from its own layer or lower ones, and never in a circle.

Every import counts: top-level, inside functions, under `if TYPE_CHECKING:`. The checker is a function of
{file path: source}, so it is tested on synthetic sources as well as run on the real tree.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (module prefix, layer), lowest first. Longest matching prefix wins; a prefix matches the module itself and
# its submodules (`posttrain.eval` matches `posttrain.eval.cli`, not `posttrain.evaluation`). The root entry
# matches posttrain/__init__.py alone, so a new package has no layer until it is added here.
LAYERS: list[tuple[str, int]] = [
    ("posttrain", 0),  # posttrain/__init__.py: imports nothing from the project
    ("posttrain.errors", 0),
    ("posttrain.outputs", 0),  # output paths checked before work, JSON without NaN, atomic files
    ("posttrain.ops", 1),
    ("posttrain.config", 2),
    ("posttrain.algos", 3),
    ("posttrain.data", 3),
    ("posttrain.models", 4),
    ("posttrain.monitor", 4),
    ("posttrain.judge", 4),
    ("posttrain.rewards", 5),
    ("posttrain.rollout", 5),
    ("posttrain.agentic", 6),
    ("posttrain.plan", 6),
    ("posttrain.eval", 7),
    ("posttrain.systems", 8),
    ("posttrain.training", 9),
    ("posttrain.recipes", 10),
    ("posttrain.cli", 11),
    ("posttrain.__main__", 11),
]


ROOT_PACKAGE = "posttrain"


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for prefix, layer in LAYERS:
        matches = module == prefix or (prefix != ROOT_PACKAGE and module.startswith(prefix + "."))
        if matches and (best is None or len(prefix) > best[0]):
            best = (len(prefix), layer)
    return None if best is None else best[1]


def module_of(path: str) -> tuple[str, bool]:
    """'posttrain/eval/cli.py' -> ('posttrain.eval.cli', False); 'posttrain/eval/__init__.py' -> ('posttrain.eval', True)."""
    parts = list(Path(path).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def project_imports(sources: dict[str, str]) -> list[tuple[str, int, str, str]]:
    """Every import of a project module: (importer file, line, importer module, imported module).

    `import a.b.c` names a.b.c (or its longest existing prefix); `from a.b import c` names a.b.c when c is a
    module, else a.b (its `__init__`). Relative imports are resolved against the importer's package.
    """
    info = {path: module_of(path) for path in sources}
    known = {mod for mod, _ in info.values()}

    def existing(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[tuple[str, int, str, str], None] = {}  # ordered set: `from m import a, b` is one import
    for path, source in sources.items():
        mod, is_pkg = info[path]
        package = mod if is_pkg else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(source, filename=path)):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = package.split(".")
                    if node.level > 1:
                        base_parts = base_parts[: -(node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in known else base)
            for target in targets:
                if target != "posttrain" and not target.startswith("posttrain."):
                    continue
                resolved = existing(target)
                if resolved is not None and resolved != mod:
                    edges[(path, node.lineno, mod, resolved)] = None
    return list(edges)


def upward_imports(sources: dict[str, str]) -> list[str]:
    """One message per import that runs up a layer (or leaves `posttrain/__init__.py`, which imports nothing)."""
    problems = []
    for path, line, importer, imported in project_imports(sources):
        low, high = layer_of(importer), layer_of(imported)
        if low is None or high is None:
            problems.append(f"{path}:{line}: {importer} or {imported} is in no layer; add it to LAYERS")
        elif importer == "posttrain":
            problems.append(f"{path}:{line}: posttrain/__init__.py imports {imported}; it must import nothing from the project")
        elif high > low:
            problems.append(f"{path}:{line}: {importer} (layer {low}) imports {imported} (layer {high})")
    return problems


def import_components(sources: dict[str, str]) -> list[set[str]]:
    """The strongly connected components of the import graph with more than one module (Tarjan)."""
    graph = _graph(sources)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:  # iterative Tarjan: the import graph can be deeper than the recursion limit
        work = [(v, iter(sorted(graph[v])))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.add(w)
                        if w == node:
                            break
                    if len(comp) > 1:
                        components.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def _graph(sources: dict[str, str]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {module_of(p)[0]: set() for p in sources}
    for _, _, importer, imported in project_imports(sources):
        graph[importer].add(imported)
    return graph


def import_cycles(sources: dict[str, str]) -> list[list[str]]:
    """One cycle per strongly connected component, as [a, b, ..., a]."""
    graph = _graph(sources)
    return [_cycle_in(graph, comp) for comp in import_components(sources)]


def cycle_messages(sources: dict[str, str]) -> list[str]:
    """One message per circle: its modules in order, each import's file and line, and the whole component when
    it is larger than the circle shown."""
    graph = _graph(sources)
    where: dict[tuple[str, str], str] = {}
    for path, line, importer, imported in project_imports(sources):
        where.setdefault((importer, imported), f"{path}:{line}")
    messages = []
    for comp in import_components(sources):
        cycle = _cycle_in(graph, comp)
        steps = "; ".join(f"{a} -> {b} ({where[a, b]})" for a, b in zip(cycle, cycle[1:]))
        rest = f" [component: {', '.join(sorted(comp))}]" if len(comp) > len(cycle) - 1 else ""
        messages.append(f"import cycle {' -> '.join(cycle)}: {steps}{rest}")
    return messages


def _cycle_in(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A shortest cycle through the component's smallest module (breadth first), as [a, b, ..., a]."""
    start = min(comp)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & comp):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in parent:
                    parent[child] = node
                    nxt.append(child)
        frontier = nxt
    return sorted(comp)


def check_layers(sources: dict[str, str]) -> list[str]:
    """All problems: circles first, then upward imports."""
    return cycle_messages(sources) + upward_imports(sources)


def tree_sources() -> dict[str, str]:
    return {p.relative_to(ROOT).as_posix(): p.read_text() for p in sorted((ROOT / "posttrain").rglob("*.py"))}


# ---------------------------------------------------------------- the real tree


def test_no_import_cycles():
    cycles = cycle_messages(tree_sources())
    assert not cycles, "\n".join(cycles)


def test_imports_go_downward_only():
    problems = upward_imports(tree_sources())
    assert not problems, f"{len(problems)} imports run up a layer:\n" + "\n".join(problems)


def test_every_module_has_a_layer():
    missing = [mod for mod, _ in map(module_of, tree_sources()) if layer_of(mod) is None]
    assert not missing, f"modules in no layer: {missing}"


# ---------------------------------------------------------------- the checker itself


def test_layer_of_longest_prefix_and_boundaries():
    assert layer_of("posttrain") == 0
    assert layer_of("posttrain.eval.cli") == 7
    assert layer_of("posttrain.errors") == 0
    assert layer_of("posttrain.evaluation") is None  # no `posttrain.eval` match across a name boundary
    assert layer_of("posttrain.newpackage.x") is None  # the root entry is posttrain/__init__.py only
    assert layer_of("posttrain.judge.prompts") == 4
    assert layer_of("numpy") is None


def test_checker_catches_an_upward_import_anywhere():
    sources = {
        "posttrain/__init__.py": '"""pkg"""\n',
        "posttrain/ops/__init__.py": "",
        "posttrain/ops/x.py": "def f():\n    if True:\n        from posttrain.recipes.sft import main\n    return main\n",
        "posttrain/recipes/__init__.py": "",
        "posttrain/recipes/sft.py": "from posttrain.ops import x\n",
    }
    problems = upward_imports(sources)
    assert problems == ["posttrain/ops/x.py:3: posttrain.ops.x (layer 1) imports posttrain.recipes.sft (layer 10)"]


def test_checker_counts_type_checking_and_relative_imports():
    sources = {
        "posttrain/data/__init__.py": "",
        "posttrain/data/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..eval import cli\n",
        "posttrain/data/b.py": "from . import a\nfrom .a import thing\n",
        "posttrain/eval/__init__.py": "",
        "posttrain/eval/cli.py": "import os\nimport posttrain.data.b\n",
    }
    edges = {(imp, dst) for _, _, imp, dst in project_imports(sources)}
    assert edges == {
        ("posttrain.data.a", "posttrain.eval.cli"),
        ("posttrain.data.b", "posttrain.data.a"),
        ("posttrain.eval.cli", "posttrain.data.b"),
    }
    assert upward_imports(sources) == ["posttrain/data/a.py:3: posttrain.data.a (layer 3) imports posttrain.eval.cli (layer 7)"]
    assert import_cycles(sources) == [["posttrain.data.a", "posttrain.eval.cli", "posttrain.data.b", "posttrain.data.a"]]


def test_checker_catches_a_cycle_within_one_layer():
    sources = {
        "posttrain/rewards/__init__.py": "",
        "posttrain/rewards/registry.py": "from posttrain.rewards import math\n",
        "posttrain/rewards/math.py": "def f():\n    from posttrain.rewards.registry import register\n",
        "posttrain/rewards/code.py": "from posttrain.rewards.math import f\n",
    }
    assert upward_imports(sources) == []
    assert check_layers(sources) == [
        "import cycle posttrain.rewards.math -> posttrain.rewards.registry -> posttrain.rewards.math: "
        "posttrain.rewards.math -> posttrain.rewards.registry (posttrain/rewards/math.py:2); "
        "posttrain.rewards.registry -> posttrain.rewards.math (posttrain/rewards/registry.py:1)"
    ]


def test_package_init_imports_nothing():
    sources = {"posttrain/__init__.py": "from posttrain.errors import UserError\n", "posttrain/errors.py": ""}
    assert upward_imports(sources) == [
        "posttrain/__init__.py:1: posttrain/__init__.py imports posttrain.errors; it must import nothing from the project"
    ]


def test_module_of():
    assert module_of("posttrain/x/__init__.py") == ("posttrain.x", True)
    assert module_of("posttrain/x/y.py") == ("posttrain.x.y", False)
