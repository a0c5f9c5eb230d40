"""Assemble one self-contained Python file from named top-level pieces of the project (the generator of
the Hugging Face remote code: pretrain/hf_remote/generate.py).

A piece is a top-level definition of a project module: a function, a class, or an assignment. Starting
from root pieces (an architecture's config class and model class), `bundle` follows every name a piece
refers to (`from X import a`, `module.attr`, names of its own module) to the piece that defines it, and
emits the closure in an order that Python accepts (a class after its bases, decorators and the names its
body evaluates; function bodies are looked up when called). What runs on several devices or through the
kernel registry is replaced on the way:

- SUBSTITUTES maps a name to another piece (the attention op to its SDPA path, the delta-memory and RT
  ops to their reference or tiled PyTorch paths, the norm ops to their torch formulas);
- names of the modules in SHIMMED are taken from pretrain/hf_remote/single_device.py when it defines
  them (the one-device form of parallel.layers' facades), else from their own module.

A piece may import nothing of the project inside a function, nor megatron, DeepSpeed, apex, Triton or
sentencepiece: the bundle refuses such a piece by name, so a file it writes needs torch (and whatever
the roots' modules import from outside the project) only. References are rewritten in place where the
emitted name differs from the text (a module attribute `schedule.tiles` becomes `tiles`; a name that
two modules define is emitted once under `<name>_<module>` for the second). Comments inside pieces are
kept; each run of pieces is headed by the file it came from.
"""
from __future__ import annotations

import ast
import importlib.util
import os
from dataclasses import dataclass, field

PROJECT = ("pretrain", "parallel", "kernels", "data_tools", "configs", "slurm")
FORBIDDEN = PROJECT + ("megatron", "deepspeed", "apex", "triton", "sentencepiece", "google.protobuf")
SHIM = "pretrain.hf_remote.single_device"
SHIMMED = ("parallel.layers", "parallel.mesh", "parallel.stages", "parallel.recompute")
SUBSTITUTES = {
    ("kernels.attention", "attention"): ("kernels.attention.sdpa", "attention"),
    ("kernels.delta_memory", "memory_step"): ("kernels.delta_memory.reference", "step"),
    ("kernels.delta_memory", "memory_read"): ("kernels.delta_memory.reference", "read"),
    ("kernels.rt_prefill", "rt_prefill"): (SHIM, "rt_prefill"),
    ("kernels.rt_prefill", "rt_decode"): (SHIM, "rt_decode"),
    ("pretrain.models.base", "tokenizer_ids"): (SHIM, "tokenizer_ids"),
    ("kernels.norms", "rms_norm"): ("kernels.norms", "rms_norm_torch"),
    ("kernels.norms", "layer_norm"): ("kernels.norms", "layer_norm_torch"),
}


def _is_project(module: str) -> bool:
    return module.split(".")[0] in PROJECT


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


class _Module:
    """One project module's top-level definitions and what its names are bound to by imports."""

    def __init__(self, name: str):
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise ValueError(f"bundle: no module {name}")
        self.name, self.path = name, spec.origin
        with open(self.path) as f:
            self.text = f.read()
        self.lines = self.text.splitlines(keepends=True)
        tree = ast.parse(self.text)
        self.defs: dict[str, ast.stmt] = {}
        self.imports: dict[str, tuple] = {}  # bound name -> ("name", module, attr) | ("module", module) | ("external", line)
        package = name if os.path.basename(self.path) == "__init__.py" else name.rpartition(".")[0]
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defs[node.name] = node
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    for n in ast.walk(target):
                        if isinstance(n, ast.Name) and n.id != "__all__":
                            self.defs[n.id] = node
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                self.defs[node.target.id] = node
            elif isinstance(node, ast.Import):
                for a in node.names:
                    bound = a.asname or a.name.split(".")[0]
                    target = a.name if a.asname else bound
                    self.imports[bound] = (("module", target) if _is_project(target) else
                                           ("external", f"import {a.name}" + (f" as {a.asname}" if a.asname else "")))
            elif isinstance(node, ast.ImportFrom):
                source = node.module or ""
                if node.level:
                    source = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + [source]).strip(".")
                for a in node.names:
                    bound = a.asname or a.name
                    if source == "__future__":
                        continue
                    if not _is_project(source):
                        self.imports[bound] = ("external", f"from {source} import {a.name}" +
                                               (f" as {a.asname}" if a.asname else ""))
                    elif _is_module(f"{source}.{a.name}"):
                        self.imports[bound] = ("module", f"{source}.{a.name}")
                    else:
                        self.imports[bound] = ("name", source, a.name)

    def source(self, node: ast.stmt) -> str:
        """The statement's text with its decorators and any comment lines directly above it."""
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
        while start > 0 and self.lines[start - 1].lstrip().startswith("#"):
            start -= 1
        return "".join(self.lines[start:node.end_lineno]), start


@dataclass
class _Piece:
    module: str
    name: str
    node: ast.stmt
    deps: set = field(default_factory=set)  # (module, name) this piece refers to anywhere
    early: set = field(default_factory=set)  # ... when it is defined (bases, decorators, defaults, values)
    refs: list = field(default_factory=list)  # (line, col, end_col, (module, name)) spans naming a piece
    externals: set = field(default_factory=set)  # import lines it needs


def _annotation_nodes(node: ast.AST) -> set[int]:
    """ids of the nodes under annotations (never evaluated: the modules use `from __future__ import annotations`)."""
    skip = set()
    for n in ast.walk(node):
        annotations = []
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = n.args
            annotations = [a.annotation for a in args.args + args.posonlyargs + args.kwonlyargs +
                           [args.vararg, args.kwarg] if a is not None] + [n.returns]
        elif isinstance(n, ast.AnnAssign):
            annotations = [n.annotation]
        for a in annotations:
            if a is not None:
                skip.update(id(x) for x in ast.walk(a))
    return skip


def _early_nodes(node: ast.stmt) -> list[ast.AST]:
    """The parts of a top-level statement evaluated when the module runs it."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return [*node.decorator_list, *node.args.defaults, *[d for d in node.args.kw_defaults if d is not None]]
    if isinstance(node, ast.ClassDef):
        parts = [*node.decorator_list, *node.bases, *[k.value for k in node.keywords]]
        for stmt in node.body:
            parts += _early_nodes(stmt) if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                else [x for x in ast.iter_child_nodes(stmt) if not isinstance(x, ast.expr_context)]
        return parts
    return [node]


class Bundle:
    def __init__(self):
        self.modules: dict[str, _Module] = {}
        self.pieces: dict[tuple, _Piece] = {}

    def module(self, name: str) -> _Module:
        if name not in self.modules:
            self.modules[name] = _Module(name)
        return self.modules[name]

    def resolve(self, module: str, name: str, seen=()) -> tuple[str, str]:
        """The (module, name) of the piece that defines `name` as seen from `module`."""
        if (module, name) in SUBSTITUTES:
            module, name = SUBSTITUTES[(module, name)]
        if module in SHIMMED and name in self.module(SHIM).defs:
            module = SHIM
        m = self.module(module)
        if name in m.defs:
            return module, name
        bound = m.imports.get(name)
        if bound is None or bound[0] != "name" or (module, name) in seen:
            raise ValueError(f"bundle: {module} defines no {name}")
        return self.resolve(bound[1], bound[2], seen + ((module, name),))

    def piece(self, key: tuple) -> _Piece:
        if key in self.pieces:
            return self.pieces[key]
        module, name = key
        m = self.module(module)
        node = m.defs[name]
        p = self.pieces[key] = _Piece(module, name, node)
        skip = _annotation_nodes(node)
        early = {id(x) for part in _early_nodes(node) for x in ast.walk(part)}
        for n in ast.walk(node):
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                what = n.module if isinstance(n, ast.ImportFrom) else n.names[0].name
                if what and (what.split(".")[0] in FORBIDDEN or what in FORBIDDEN):
                    raise ValueError(f"bundle: {module}.{name} imports {what} (line {n.lineno} of {m.path}); give it "
                                     f"a torch-only form in {SHIM} or a SUBSTITUTES entry")
            target = None
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and id(n) not in skip:
                bound = m.imports.get(n.value.id)
                if bound is not None and bound[0] == "module" and n.value.id not in m.defs:
                    target = self.resolve(bound[1], n.attr)
            elif isinstance(n, ast.Name) and id(n) in skip:  # an annotation: its imports and type aliases, for readers
                if m.imports.get(n.id, ("",))[0] == "external":
                    p.externals.add(m.imports[n.id][1])
                elif isinstance(m.defs.get(n.id), ast.Assign) and n.id != name:
                    p.deps.add((module, n.id))
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
                if n.id in m.defs:
                    target = self.resolve(module, n.id)
                elif n.id in m.imports:
                    bound = m.imports[n.id]
                    if bound[0] == "external":
                        p.externals.add(bound[1])
                    elif bound[0] == "name":
                        target = self.resolve(bound[1], bound[2])
            if target is not None:
                if target != key:
                    p.deps.add(target)
                if id(n) in early:
                    p.early.add(target)
                p.refs.append((n.lineno, n.col_offset, n.end_col_offset, target))
        return p

    def close(self, roots: list[tuple]) -> list[_Piece]:
        """Every piece the roots need, in an order Python can define them in."""
        todo = [self.resolve(*r) for r in roots]
        while todo:
            key = todo.pop()
            if key not in self.pieces:
                todo.extend(self.piece(key).deps)
        order, state = [], {}
        rank = {key: (i, self.pieces[key].node.lineno) for i, key in enumerate(self.pieces)}

        def visit(key):
            if state.get(key) == "done":
                return
            if state.get(key) == "open":
                raise ValueError(f"bundle: {key[0]}.{key[1]} needs itself to be defined")
            state[key] = "open"
            for dep in sorted(self.pieces[key].early - {key}, key=lambda k: rank[k]):
                visit(dep)
            state[key] = "done"
            order.append(key)

        for key in sorted(self.pieces, key=lambda k: (_module_rank(k[0]), k[0], rank[k][1])):
            visit(key)
        return [self.pieces[k] for k in order]

    def render(self, roots: list[tuple], header: str, tail: str = "") -> str:
        """The file: header, the imports the pieces need, the pieces, and `tail`."""
        pieces = self.close(roots)
        names: dict[tuple, str] = {}
        taken: dict[str, tuple] = {}
        externals = []
        for e in sorted({e for p in pieces for e in p.externals}):
            bound = e.split(" as ")[-1].split()[-1]  # one line per bound name (F: two spellings of one module)
            if bound not in taken:
                taken[bound] = ("external", e)
                externals.append(e)
        for p in pieces:
            out = p.name
            if out in taken:
                out = f"{p.name}_{p.module.rpartition('.')[2]}"
                if out in taken:
                    raise ValueError(f"bundle: two pieces are named {p.name} ({taken[p.name]} and {p.module})")
            taken[out] = (p.module, p.name)
            names[(p.module, p.name)] = out
        chunks, last = [], None
        for p in pieces:
            text, first_line = self.module(p.module).source(p.node)
            lines = text.splitlines(keepends=True)
            for line, col, end, target in sorted(p.refs, key=lambda r: (r[0], r[1]), reverse=True):
                i = line - 1 - first_line
                lines[i] = lines[i][:col] + names[target] + lines[i][end:]
            text = "".join(lines)
            if names[(p.module, p.name)] != p.name:
                text = text.replace(f"def {p.name}(", f"def {names[(p.module, p.name)]}(", 1).replace(
                    f"class {p.name}(", f"class {names[(p.module, p.name)]}(", 1)
            if p.module != last:
                rel = os.path.relpath(self.module(p.module).path, _ROOT)
                chunks.append(f"\n\n# {'-' * 30} {rel} {'-' * max(3, 60 - len(rel))}\n")
                last = p.module
            chunks.append("\n\n" + text)
        imports = "\n".join(["from __future__ import annotations", "", *externals])
        return f"{header.rstrip()}\n{imports}\n{''.join(chunks)}\n{tail}"


_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_ORDER = ("kernels", "parallel", "pretrain.hf_remote.single_device", "pretrain.models.base", "pretrain.models.units",
          "pretrain.models.blocks", "pretrain.models.decoder", "pretrain.models", "pretrain.hf_remote")


def _module_rank(module: str) -> int:
    """Lower-level modules first, so that the file reads from the building blocks up to the model."""
    for i, prefix in enumerate(_ORDER):
        if module == prefix or module.startswith(prefix + "."):
            return i
    return len(_ORDER)
