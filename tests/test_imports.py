"""No import cycles among the project's modules, counting the imports inside functions too: a lazy
import only hides a cycle until the day someone moves it to the top of the file, and a circle makes
it unclear which module is the lower layer."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("pretrain", "parallel", "kernels", "data_tools", "slurm")


def modules(root: str, packages=PACKAGES) -> dict[str, str]:
    """{dotted module name: file} of every .py file of `packages` under `root`."""
    found = {}
    for package in packages:
        for dirpath, _, files in os.walk(os.path.join(root, package)):
            for f in files:
                if f.endswith(".py"):
                    name = os.path.relpath(os.path.join(dirpath, f), root)[:-3].replace(os.sep, ".")
                    found[name.removesuffix(".__init__")] = os.path.join(dirpath, f)
    return found


def import_graph(root: str, packages=PACKAGES) -> dict[str, set[str]]:
    """{module: the project modules it imports anywhere in its file}. `from a import b` counts as an
    import of a.b when that is a module, else of a. Importing a.b.c also runs the package a.b's
    __init__, but that edge is left out: a package importing its own submodules is no cycle."""
    mods = modules(root, packages)

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in mods.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        targets = set()
        for node in ast.walk(tree):  # every level: module, class and function bodies
            if isinstance(node, ast.Import):
                targets.update(known(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package (a package's own __init__ counts as it)
                    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + [base] if base else parts)
                targets.update(known(f"{base}.{a.name}") if f"{base}.{a.name}" in mods else known(base)
                               for a in node.names)
        graph[name] = targets - {None, name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One closed path (first module repeated at the end) per strongly connected group of modules."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(_path_through(graph, group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _path_through(graph, group: set[str]) -> list[str]:
    """A cycle inside `group` (strongly connected), from its first module back to it."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first: the shortest way back to `start`
        v = frontier.pop(0)
        for w in sorted(graph[v] & group):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                frontier.append(w)
    raise AssertionError("not strongly connected")


def test_no_import_cycles():
    found = cycles(import_graph(ROOT))
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_imports_inside_functions_are_counted():
    graph = import_graph(ROOT)
    assert "parallel.zero" in graph["parallel.apply"]  # imported only when deepspeed is chosen
    assert "pretrain.init_from" in graph["pretrain.config"]


def test_a_cycle_through_a_lazy_import_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("def f():\n    from pkg.high import g\n    return g\n")
    (pkg / "high.py").write_text("from . import low\n\ng = low\n")
    (pkg / "alone.py").write_text("import os\nfrom pkg import low\n")
    assert cycles(import_graph(str(tmp_path), ("pkg",))) == [["pkg.high", "pkg.low", "pkg.high"]]
