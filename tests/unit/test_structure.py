"""The code's shape, read from the source (no import): one writer per concept, one argument parser
library, files under 400 lines, no import loop, and the README's layout section matching the tree."""

from __future__ import annotations

import ast
import functools
import pathlib
import re
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository root is the `streamrl` package
SKIP = {".venv", "build", "runs", ".git", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis"}
ROLES = ("learner", "rollout", "rewards", "ops")


def python_files(*under: str) -> list[pathlib.Path]:
    roots = [ROOT / u for u in under] if under else [ROOT]
    found = []
    for root in roots:
        files = [root] if root.is_file() else root.rglob("*.py")
        found += [f for f in files if not SKIP & set(f.relative_to(ROOT).parts)]
    return sorted(found)


def product_files() -> list[pathlib.Path]:
    """The package without its benchmarks and tests."""
    return [f for f in python_files() if f.relative_to(ROOT).parts[0] not in ("bench", "tests", "examples")]


@functools.cache
def parse(path: pathlib.Path) -> ast.Module:
    """The file's tree, read once per test run (the rules below read every file several times)."""
    return ast.parse(path.read_text(), filename=str(path))


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


# ---- one owner per concept, read from the AST of every package folder ---------------------------

# Who may assign each version attribute: (file, class) of its owner. Anything else that assigns one (a
# trainer's version set from ops/, a second class keeping its own `_version`) is a second writer.
VERSION_OWNERS = {
    "_version": {("learner/train_step.py", "Trainer"), ("rollout/backends/protocol.py", "LiveVersion")},
    "version": {("learner/nodes.py", "NodeRegistry")},  # a node's heartbeat: the version it reports live
    "policy_version": set(),  # a sample's: set on the wire message when it is built, never assigned
}
ROSTER = ("learner/nodes.py", "NodeRegistry")  # the one holder of which nodes are in the run
# Containers keyed by node ids that are not membership, each with why.
NOT_A_ROSTER = {
    ("engine/transport.py", "TrajectoryReceiver", "next_seq"): "the stream's framing: the next sequence number "
    "expected from each sender named in a frame, registered or not (gaps and duplicates are counted per sender)"
}
# learner rank 0's orchestrator and the modules of its three flows
ORCHESTRATOR_FLOWS = ("orchestrator.py", "admission.py", "node_service.py", "step_outcome.py")
MUTATORS = {"add", "append", "insert", "setdefault", "update", "pop", "popitem", "clear", "discard", "remove"}
NODE_ID = re.compile(r"(^|_)node(_id)?$")


def package_files() -> list[pathlib.Path]:
    """Every package folder's Python files (the product and its benchmarks), not the tests."""
    return [f for f in python_files() if f.relative_to(ROOT).parts[0] not in ("tests", "examples")]


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


def version_writers(tree: ast.AST, rel: str) -> list[str]:
    """Assignments (or setattr) of a version attribute outside its owner, as 'file:line target'."""
    found = []
    for node, cls, _ in scopes(tree):
        targets = []
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store | ast.Del):
            targets.append((node.attr, node))
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr" and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                targets.append((name.value, node))
        for attr, where in targets:
            if attr in VERSION_OWNERS and (rel, cls) not in VERSION_OWNERS[attr]:
                found.append(f"{rel}:{where.lineno} {ast.unparse(where)}")
    return found


def _node_id(expr: ast.expr) -> bool:
    """An expression that names a node id: `node_id`, `node`, `msg.node_id`, `new_node_id`."""
    if isinstance(expr, ast.Name):
        return bool(NODE_ID.search(expr.id))
    return isinstance(expr, ast.Attribute) and expr.attr == "node_id"


def _container(expr: ast.expr) -> ast.Attribute | None:
    """The object attribute a store goes into (`self.links` in `self.links[k] = v`), or None for a local."""
    return expr if isinstance(expr, ast.Attribute) else None


def node_rosters(tree: ast.AST, rel: str, registry_fields: set[str]) -> list[str]:
    """Outside NodeRegistry: containers kept on an object and keyed by node ids (a second roster), and any
    change made to one of the registry's own containers (`registry_fields`) from another object."""
    found = []
    for node, cls, _ in scopes(tree):
        if (rel, cls) == ROSTER:
            continue
        hit: ast.Attribute | None = None
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store | ast.Del):
            held = _container(node.value)
            if held is not None and (_node_id(node.slice) or held.attr in registry_fields and not _is_self(held)):
                hit = held
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            held = _container(node.func.value)
            keyed = _stores_node_id(node.func.attr, node.args)
            if held is not None and (keyed or held.attr in registry_fields and not _is_self(held)):
                hit = held
        elif isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.DictComp | ast.SetComp):
            key = node.value.key if isinstance(node.value, ast.DictComp) else node.value.elt
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            hit = next((t for t in targets if isinstance(t, ast.Attribute)), None) if _node_id(key) else None
        if hit is not None and (rel, cls, hit.attr) not in NOT_A_ROSTER:
            found.append(f"{rel}:{node.lineno} {ast.unparse(node)[:100]}")
    return found


def _stores_node_id(method: str, args: list[ast.expr]) -> bool:
    """`x.add(node_id)`, `x.append(node_id)`, `x.insert(i, node_id)`, `x.setdefault(node_id, ...)`."""
    if method in ("add", "append") and len(args) == 1:
        return _node_id(args[0])
    if method == "insert" and len(args) == 2:
        return _node_id(args[1])
    return method == "setdefault" and bool(args) and _node_id(args[0])


def _is_self(expr: ast.Attribute) -> bool:
    return isinstance(expr.value, ast.Name) and expr.value.id == "self"


def registry_fields() -> set[str]:
    """The containers NodeRegistry keeps (`self.X = {}`, `dict()`, `defaultdict(...)`, a queue ...)."""
    tree = parse(ROOT / ROSTER[0])
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == ROSTER[1])
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    fields = set()
    for node in ast.walk(init):
        if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Dict | ast.Set | ast.Call):
            value = node.value
            if isinstance(value, ast.Call) and not re.search(r"dict|set|list|Queue|deque", ast.unparse(value.func)):
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            fields |= {t.attr for t in targets if isinstance(t, ast.Attribute) and _is_self(t)}
    return fields


def _check(source: str, rel: str) -> list[str]:
    tree = ast.parse(textwrap.dedent(source))
    return version_writers(tree, rel) + node_rosters(tree, rel, registry_fields())


def test_every_version_attribute_is_assigned_by_its_owner_alone():
    found = [hit for path in package_files() for hit in version_writers(parse(path), _rel(path))]
    assert found == []
    # and the owners do write them (the rule reads the tree it means to)
    owners = {(rel, cls) for owners in VERSION_OWNERS.values() for rel, cls in owners}
    written = set()
    for rel, cls in owners:
        for node, where, _ in scopes(parse(ROOT / rel)):
            if where == cls and isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                written.add((rel, cls, node.attr))
    assert {(r, c) for r, c, a in written if a in VERSION_OWNERS} == owners


def test_the_version_rule_catches_a_second_writer():
    assert _check("trainer._version = 3", "ops/status.py") == ["ops/status.py:1 trainer._version"]
    assert _check("def f(t):\n    setattr(t, 'version', 2)", "ops/run.py") != []
    second = """
        class Shadow:
            def step(self):
                self._version += 1
    """
    assert _check(second, "learner/train_step.py") == ["learner/train_step.py:4 self._version"]
    owner = """
        class Trainer:
            def _advance(self):
                self._version += 1
    """
    assert _check(owner, "learner/train_step.py") == []  # the positive control: the owner may


def test_no_container_of_node_ids_outside_the_node_registry():
    fields = registry_fields()
    assert {"nodes", "identities", "departed"} <= fields  # the rule knows the registry's containers
    found = [hit for path in package_files() for hit in node_rosters(parse(path), _rel(path), fields)]
    assert found == []
    # the orchestrator's flows count nodes by asking the registry, never through the publisher
    flows = "".join((ROOT / "learner" / f).read_text() for f in ORCHESTRATOR_FLOWS)
    assert "registry.count" in flows and not re.search(r"len\(self\.publisher", flows)


def test_the_roster_rule_catches_a_second_roster_and_a_reach_into_the_registry():
    links = """
        class Publisher:
            def add(self, node_id, link):
                self.links[node_id] = link
    """
    assert _check(links, "learner/publisher.py") == ["learner/publisher.py:4 self.links[node_id]"]
    reach = """
        class Publisher:
            def remove(self, node_id):
                self.registry.nodes.pop(node_id, None)
    """
    assert _check(reach, "learner/publisher.py") == ["learner/publisher.py:4 self.registry.nodes.pop(node_id, None)"]
    assert _check("class S:\n    def f(self, msg):\n        self.seen.add(msg.node_id)", "ops/x.py") != []
    copy = "class S:\n    def f(self, infos):\n        self.known = {node: 1 for node in infos}"
    assert _check(copy, "ops/x.py") != []
    owner = """
        class NodeRegistry:
            def forget(self, node_id):
                self.nodes.pop(node_id, None)
                self.departed[node_id] = 1
    """
    assert _check(owner, "learner/nodes.py") == []  # the positive control: the registry may
    assert _check("def f(node_id):\n    out = {}\n    out[node_id] = 1\n    return out", "ops/x.py") == []


def _rel(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_a_node_sets_its_live_version_in_one_place():
    sites = [
        (path.relative_to(ROOT).as_posix(), target.attr, where)
        for path in product_files()
        for target, where in assignments(parse(path))
        if target.attr in ("policy_version", "_version") and path.relative_to(ROOT).parts[0] == "rollout"
    ]
    assert sites == [("rollout/backends/protocol.py", "_version", ("LiveVersion", "__init__")),
                     ("rollout/backends/protocol.py", "_version", ("LiveVersion", "went_live"))]  # fmt: skip


def test_node_registry_is_the_only_holder_of_membership():
    # membership changes (Stop sent to a node, a node forgotten, the evicted count) happen in learner/nodes.py
    found = []
    for path in product_files():
        name = path.relative_to(ROOT).as_posix()
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.Call):
                called = ast.unparse(node.func)
                if called == "Stop" or called.endswith(".forget") or called.endswith("._forget"):
                    found.append((name, called))
            if isinstance(node, ast.Attribute) and node.attr == "evicted" and isinstance(node.ctx, ast.Store):
                found.append((name, "evicted ="))
    learner_side = [(name, what) for name, what in found if name.startswith("learner/")]
    assert learner_side and {name for name, _ in learner_side} == {"learner/nodes.py"}, learner_side


def test_no_argparse_outside_bench():
    users = [
        path.relative_to(ROOT).as_posix()
        for path in product_files()
        for node in ast.walk(parse(path))
        if (isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names))
        or (isinstance(node, ast.ImportFrom) and node.module == "argparse")
    ]
    assert users == [], "the command line is cli.py's (typer); a benchmark in bench/ may parse its own arguments"


def test_no_file_over_400_lines():
    long = {
        path.relative_to(ROOT).as_posix(): n
        for path in python_files()
        if (n := len(path.read_text().splitlines())) > 400
    }
    assert long == {}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("streamrl", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def _is_module(name: str) -> bool:
    rel = pathlib.Path(*name.split(".")[1:])
    return (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file()


def module_imports(path: pathlib.Path) -> set[str]:
    """The streamrl modules `path` imports when it is imported (module level; not inside functions)."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()

    def visit(body):
        for node in body:
            if isinstance(node, ast.If):  # e.g. TYPE_CHECKING blocks are skipped, other ifs are read
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body + node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body + node.orelse + node.finalbody)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name.startswith("streamrl"))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                if not base.startswith("streamrl"):
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    out.add(sub if _is_module(sub) else base)

    visit(parse(path).body)
    # a module's own packages are imported before it (they are already on the way), never a loop through it
    return {m for m in out if m != me and not me.startswith(m + ".") and _is_module(m)}


def test_no_import_loop():
    graph = {_module_name(path): module_imports(path) for path in python_files() if "tests" not in path.parts}
    loops, state = [], {}

    def visit(module, stack):
        state[module] = "open"
        for nxt in sorted(graph.get(module, ())):
            if state.get(nxt) == "open":
                loops.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert loops == []
    # and the floors hold: engine imports no role; rollout and learner never import each other
    for module, imports in graph.items():
        floor = module.split(".")[1] if module.count(".") else ""
        if floor == "engine":
            assert not [m for m in imports if m.split(".")[1] in ROLES], module
        if floor in ("rollout", "learner"):
            other = {"rollout": "learner", "learner": "rollout"}[floor]
            assert not [m for m in imports if m.split(".")[1] == other], module


def test_the_readme_layout_section_matches_the_tree():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    block = [line for line in section.splitlines() if line.startswith("    ")]
    folder, top, named = ROOT, ROOT, []
    for line in block:
        entry = re.match(r"^( {4,6})(\S+)", line)
        if entry and re.fullmatch(r"[\w.]+/?|[\w.]+\.py", entry.group(2)):
            base = ROOT if len(entry.group(1)) == 4 else top
            folder = base / entry.group(2).rstrip("/")
            if len(entry.group(1)) == 4:
                top = folder
            assert folder.exists(), f"README layout names {folder.relative_to(ROOT)}, which is not in the tree"
        for name in re.findall(r"`([\w/]+\.(?:py|lua))`", line):
            named.append((folder, name))
    for where, name in named:
        hits = list(where.rglob(pathlib.Path(name).name)) if where.is_dir() else []
        assert hits or (ROOT / name).exists(), f"README layout names {name} under {where.relative_to(ROOT)}"
    # every folder of the package and of engine/, rollout/, learner/ has its line
    mentioned = {m.rstrip("/") for m in re.findall(r"^ {4,6}([\w.]+/)", "\n".join(block), re.M)}
    folders = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    for floor in ("engine", "rollout", "learner"):
        folders |= {p.name for p in (ROOT / floor).iterdir() if (p / "__init__.py").is_file()}
    assert folders - mentioned == set()
