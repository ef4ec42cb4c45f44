"""The package's source as trees, for the rules that read the code's shape (test_structure.py: who writes
each concept; test_layout.py: files, imports, parsers, the README's layout). Not a test module: the two
load it by path (tests are not importable under --import-mode=importlib)."""

from __future__ import annotations

import ast
import functools
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository root is the `streamrl` package
SKIP = {".venv", "build", "runs", ".git", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis"}
ROLES = ("learner", "rollout", "rewards", "ops")


def python_files(*under: str) -> list[pathlib.Path]:
    roots = [ROOT / u for u in under] if under else [ROOT]
    found = []
    for root in roots:
        files = [root] if root.is_file() else list(root.rglob("*.py"))
        parts = [f.relative_to(ROOT).parts for f in files]  # a hidden folder (a snapshot, a cache) is no source
        found += [f for f, p in zip(files, parts) if not SKIP & set(p) and not any(x.startswith(".") for x in p)]
    return sorted(found)


def product_files() -> list[pathlib.Path]:
    """The package without its benchmarks and tests."""
    return [f for f in python_files() if rel(f).split("/")[0] not in ("bench", "tests", "examples")]


def package_files() -> list[pathlib.Path]:
    """Every package folder's Python files (the product and its benchmarks), not the tests."""
    return [f for f in python_files() if rel(f).split("/")[0] not in ("tests", "examples")]


def rel(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).as_posix()


@functools.cache
def parse(path: pathlib.Path) -> ast.Module:
    """The file's tree, read once per test run (the rules read every file several times)."""
    return ast.parse(path.read_text(), filename=str(path))


def scopes(tree: ast.AST):
    """(node, enclosing class or "", enclosing function or "") for every node of `tree`."""

    def walk(node, cls, fn):
        for child in ast.iter_child_nodes(node):
            yield child, cls, fn
            if isinstance(child, ast.ClassDef):
                yield from walk(child, child.name, "")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from walk(child, cls, child.name)
            else:
                yield from walk(child, cls, fn)

    yield from walk(tree, "", "")


def assignments(tree: ast.AST):
    """(target, enclosing function and class names) of every assignment, augmented or annotated."""

    def walk(node, where):
        for child in ast.iter_child_nodes(node):
            inner = [*where, child.name] if isinstance(child, (ast.FunctionDef, ast.ClassDef)) else where
            targets = []
            if isinstance(child, ast.Assign):
                targets = list(child.targets)
            elif isinstance(child, (ast.AugAssign, ast.AnnAssign)):
                targets = [child.target]
            while targets:
                target = targets.pop()
                if isinstance(target, (ast.Tuple, ast.List)):
                    targets += target.elts
                elif isinstance(target, ast.Starred):
                    targets.append(target.value)
                elif isinstance(target, ast.Attribute):  # `x[a.b] = ...` assigns an item, not a.b
                    yield target, tuple(where)
            yield from walk(child, inner)

    yield from walk(tree, [])


# ---- containers kept on objects -----------------------------------------------------------------------

# calls that build a container (by the called name's last part), whatever their arguments
BUILDERS = {"dict", "set", "list", "frozenset", "bytearray", "sorted", "defaultdict", "OrderedDict", "Counter",
            "deque", "ChainMap", "Queue", "SimpleQueue", "LifoQueue", "PriorityQueue", "WeakKeyDictionary",
            "WeakValueDictionary", "WeakSet", "fromkeys", "copy"}  # fmt: skip
LITERALS = (ast.Dict, ast.Set, ast.List, ast.DictComp, ast.SetComp, ast.ListComp)


def builds_container(expr: ast.expr | None) -> bool:
    """`{}`, `[...]`, a comprehension, `set(...)`, `collections.deque()`, `x.copy()`, `a or {}`, `[x] + y`,
    `dataclasses.field(default_factory=list)`: an expression whose value is a new container."""
    if expr is None:
        return False
    if isinstance(expr, LITERALS):
        return True
    if isinstance(expr, ast.Call):
        name = ast.unparse(expr.func).rpartition(".")[2]
        factory = next((k.value for k in expr.keywords if k.arg == "default_factory"), None)
        return name in BUILDERS or factory is not None and (builds_container(factory) or _names_builder(factory))
    if isinstance(expr, ast.BoolOp):
        return any(builds_container(v) for v in expr.values)
    if isinstance(expr, ast.BinOp):
        return builds_container(expr.left) or builds_container(expr.right)
    if isinstance(expr, ast.IfExp):
        return builds_container(expr.body) or builds_container(expr.orelse)
    if isinstance(expr, ast.Lambda):
        return builds_container(expr.body)
    return False


def _names_builder(expr: ast.expr) -> bool:
    return isinstance(expr, ast.Name | ast.Attribute) and ast.unparse(expr).rpartition(".")[2] in BUILDERS


def set_attr_call(node: ast.Call) -> tuple[str, ast.expr] | None:
    """(name, value) of `setattr(obj, "name", value)` and `object.__setattr__(obj, "name", value)`."""
    called = ast.unparse(node.func)
    if (called == "setattr" or called.endswith("__setattr__")) and len(node.args) >= 3:
        name = node.args[-2]
        if isinstance(name, ast.Constant) and isinstance(name.value, str):
            return name.value, node.args[-1]
    return None


def container_attributes(tree: ast.AST):
    """(class, attribute, line, field) of every container an object keeps: an attribute assigned a new
    container (`self.x = {}`, `obj.x, self.y = set(a), []`, `setattr` / `object.__setattr__`) in any class
    or function, and a class's container fields (`field`: `x: list = field(default_factory=list)`, `x = {}`
    in its body). `class` is the enclosing class ("" outside any)."""
    for node, cls, fn in scopes(tree):
        pairs: list[tuple[ast.expr, ast.expr | None]] = []
        if isinstance(node, ast.Assign):
            for target in node.targets:
                pairs += _pairs(target, node.value)
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            pairs = _pairs(node.target, node.value)
        elif isinstance(node, ast.Call) and (named := set_attr_call(node)) is not None:
            if builds_container(named[1]):
                yield cls, named[0], node.lineno, False
        for target, value in pairs:
            if not builds_container(value):
                continue
            if isinstance(target, ast.Attribute):
                yield cls, target.attr, node.lineno, False
            elif isinstance(target, ast.Name) and cls and not fn:  # a class body's field
                yield cls, target.id, node.lineno, True


def _pairs(target: ast.expr, value: ast.expr | None) -> list[tuple[ast.expr, ast.expr | None]]:
    """Each single target with the value it gets (`a, b = x, y` pairs them; `a, b = f()` gives both f())."""
    if isinstance(target, ast.Tuple | ast.List):
        values = value.elts if isinstance(value, ast.Tuple | ast.List) and len(value.elts) == len(target.elts) else None
        out = []
        for i, elt in enumerate(target.elts):
            out += _pairs(elt.value if isinstance(elt, ast.Starred) else elt, values[i] if values else value)
        return out
    return [(target, value)]
