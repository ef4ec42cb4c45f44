"""The ownership rules, read from the AST (STYLE.md 13, 15): who may write each version, the one roster of
the nodes in the run, the containers objects keep (closed-world: each is the registry's or listed with its
reason), and where the publisher's per-node states may be read. The tests that apply them and their positive
controls are test_structure.py's; this module is not a test module (loaded by path: tests are not importable
under --import-mode=importlib)."""

from __future__ import annotations

import ast
import functools
import importlib.util
import pathlib
import re

_spec = importlib.util.spec_from_file_location("source_tree", pathlib.Path(__file__).with_name("source_tree.py"))
source = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(source)
ROOT, parse, scopes, package_files = source.ROOT, source.parse, source.scopes, source.package_files


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
    "expected from each sender named in a frame, registered or not (gaps and duplicates are counted per sender)",
    ("ops/phases.py", "LearnerWatch", "registered"): "a read-only replica of the registry's roster in the "
    "launcher's process, rebuilt from the registry's own events; it decides nothing (tests/data/containers.txt)",
    ("learner/reachability.py", "Reachability", "unreachable"): "the nodes whose control connection was found "
    "closed: a mark on a node the registry holds, set only by a failed probe and cleared by the registry's word "
    "(registered again, heard, goodbye, left the run resolved); it adds no node to the run and removes none",
    ("learner/reachability.py", "Reachability", "_probed"): "when each of the registry's nodes was last asked "
    "whether its connection is open, to space the probes; dropped as the registry says the node left the run",
}
# Every other container an object keeps in these floors is listed with its reason in LISTED_CONTAINERS.
FLOORS = ("engine", "learner", "rollout", "ops")
LISTED_CONTAINERS = ROOT / "tests" / "data" / "containers.txt"
# Where the publisher's per-node states are read outside the publisher, each with why; a count of them is
# never made anywhere (the nodes in the run are counted by the registry: `registry.count`).
PUBLISHER_READERS = {
    ("learner/step_outcome.py", "StepOutcome", "_node_figures"): "per-node weight figures, keyed by the node ids "
    "the publisher reports; the node count beside them is the registry's"
}
PUBLISHER_STATES = re.compile(r"publisher\.(states|_links|links|_link)\b")
COUNTS = {"len", "sum", "Counter", "count", "__len__"}
# learner rank 0's orchestrator and the modules of its three flows
ORCHESTRATOR_FLOWS = ("orchestrator.py", "admission.py", "node_service.py", "step_outcome.py")
MUTATORS = {"add", "append", "insert", "setdefault", "update", "pop", "popitem", "clear", "discard", "remove"}
NODE_ID = re.compile(r"(^|_)node(_id)?$")


def version_writers(tree: ast.AST, rel: str) -> list[str]:
    """Assignments of a version attribute outside its owner (`x.attr = `, `setattr(x, "attr", )`,
    `object.__setattr__(x, "attr", )`, `x.__dict__["attr"] = `), as 'file:line target'."""
    found = []
    for node, cls, _ in scopes(tree):
        targets = []
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store | ast.Del):
            targets.append((node.attr, node))
        elif isinstance(node, ast.Call) and (named := source.set_attr_call(node)) is not None:
            targets.append((named[0], node))
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.ctx, ast.Store)
            and ast.unparse(node.value).endswith("__dict__")
        ):
            key = node.slice
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                targets.append((key.value, node))
        for attr, where in targets:
            if attr in VERSION_OWNERS and (rel, cls) not in VERSION_OWNERS[attr]:
                found.append(f"{rel}:{where.lineno} {ast.unparse(where)}")
    return found


def _node_id(expr: ast.expr, aliases: frozenset[str] = frozenset()) -> bool:
    """An expression that names a node id: `node_id`, `node`, `msg.node_id`, `new_node_id`, or a local
    name given one (`aliases`: `nid` after `nid = node_id`)."""
    if isinstance(expr, ast.Name):
        return bool(NODE_ID.search(expr.id)) or expr.id in aliases
    if isinstance(expr, ast.Subscript):  # `event["node"]`, `msg["node_id"]`
        key = expr.slice
        return isinstance(key, ast.Constant) and isinstance(key.value, str) and bool(NODE_ID.search(key.value))
    return isinstance(expr, ast.Attribute) and expr.attr == "node_id"


def node_id_aliases(tree: ast.AST) -> dict[tuple[str, str], frozenset[str]]:
    """Per (class, function): the local names assigned a node id, however they are spelled (`nid =
    node_id`, `a = b = msg.node_id`, `key = nid`)."""
    out = {}
    for fn, cls, _ in scopes(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        names: set[str] = set()
        while True:
            grown = {
                t.id
                for node in ast.walk(fn)
                if isinstance(node, ast.Assign | ast.AnnAssign | ast.NamedExpr)
                and _node_id(node.value, frozenset(names))
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                if isinstance(t, ast.Name)
            }
            if grown <= names:
                break
            names |= grown
        out[(cls, fn.name)] = frozenset(names)
    return out


def _container(expr: ast.expr, module_level: set[str]) -> ast.Attribute | ast.Name | None:
    """What a store goes into when it outlives the call: an object's attribute (`self.links` in
    `self.links[k] = v`) or a container the module keeps (`module_level`); None for a local."""
    if isinstance(expr, ast.Attribute) or isinstance(expr, ast.Name) and expr.id in module_level:
        return expr
    return None


def _held(expr: ast.Attribute | ast.Name) -> str:
    return expr.attr if isinstance(expr, ast.Attribute) else expr.id


def module_containers(tree: ast.Module) -> set[str]:
    """The names a module binds to a new container at its top level (`SEEN: set[str] = set()`)."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and source.builds_container(node.value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def node_rosters(tree: ast.AST, rel: str, registry_fields: set[str]) -> list[str]:
    """Outside NodeRegistry: containers kept on an object and keyed by node ids (a second roster), and any
    change made to one of the registry's own containers (`registry_fields`) from another object."""
    found, aliases = [], node_id_aliases(tree)
    module_level = module_containers(tree) if isinstance(tree, ast.Module) else set()
    for node, cls, fn in scopes(tree):
        if (rel, cls) == ROSTER:
            continue
        hit: ast.Attribute | ast.Name | None = None
        named = aliases.get((cls, fn), frozenset())
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store | ast.Del):
            held = _container(node.value, module_level)
            keyed = _node_id(node.slice, named)
            if held is not None and (keyed or _held(held) in registry_fields and not _is_self(held)):
                hit = held
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            held = _container(node.func.value, module_level)
            keyed = _stores_node_id(node.func.attr, node.args, named)
            if held is not None and (keyed or _held(held) in registry_fields and not _is_self(held)):
                hit = held
        elif isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.DictComp | ast.SetComp):
            key = node.value.key if isinstance(node.value, ast.DictComp) else node.value.elt
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            hit = next((t for t in targets if isinstance(t, ast.Attribute)), None) if _node_id(key, named) else None
        if hit is not None and (rel, cls, _held(hit)) not in NOT_A_ROSTER:
            found.append(f"{rel}:{node.lineno} {ast.unparse(node)[:100]}")
    return found


def _stores_node_id(method: str, args: list[ast.expr], aliases: frozenset[str]) -> bool:
    """`x.add(node_id)`, `x.append(node_id)`, `x.insert(i, node_id)`, `x.setdefault(node_id, ...)`."""
    if method in ("add", "append") and len(args) == 1:
        return _node_id(args[0], aliases)
    if method == "insert" and len(args) == 2:
        return _node_id(args[1], aliases)
    return method == "setdefault" and bool(args) and _node_id(args[0], aliases)


def _is_self(expr: ast.Attribute | ast.Name) -> bool:
    return isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id == "self"


@functools.cache
def registry_fields() -> frozenset[str]:
    """The containers NodeRegistry keeps (`self.X = {}`, `dict()`, `defaultdict(...)`, a queue ...)."""
    return frozenset(a for cls, a, _, _ in source.container_attributes(parse(ROOT / ROSTER[0])) if cls == ROSTER[1])


def publisher_counts(tree: ast.AST, rel: str) -> list[str]:
    """Reads of the publisher's per-node states outside `PUBLISHER_READERS`, and anywhere a count made of
    them (`len`, `sum`, ... over the call or a name bound to it): a second way to count the nodes."""
    found = []
    for fn, cls, _ in scopes(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        reads = [n for n in ast.walk(fn) if isinstance(n, ast.Attribute) and PUBLISHER_STATES.search(ast.unparse(n))]
        if reads and (rel, cls, fn.name) not in PUBLISHER_READERS:
            found += [f"{rel}:{n.lineno} {ast.unparse(n)} read in {cls}.{fn.name}" for n in reads]
        tainted = {t.id for n in ast.walk(fn) if isinstance(n, ast.Assign) and _mentions(n.value, reads, set())
                   for t in n.targets if isinstance(t, ast.Name)}  # fmt: skip
        for call in ast.walk(fn):
            named = isinstance(call, ast.Call) and ast.unparse(call.func).rpartition(".")[2] in COUNTS
            if named and any(_mentions(arg, reads, tainted) for arg in [*call.args, call.func]):
                found.append(f"{rel}:{call.lineno} {ast.unparse(call)[:80]} counts the publisher's nodes")
    return found


def _mentions(expr: ast.AST, reads: list[ast.Attribute], names: set[str]) -> bool:
    inside = {id(n) for n in ast.walk(expr)}
    return any(id(r) in inside for r in reads) or any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(expr))


def listed_containers() -> dict[tuple[str, str, str], str]:
    """(file, class, attribute) -> reason, from LISTED_CONTAINERS."""
    out = {}
    for line in LISTED_CONTAINERS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            entry = re.fullmatch(r"(\S+) (\S+)\.(\w+): (\S.*)", line)
            assert entry, f"{LISTED_CONTAINERS.name}: {line!r} is not 'FILE CLASS.ATTRIBUTE: reason'"
            out[(entry[1], "" if entry[2] == "-" else entry[2], entry[3])] = entry[4]
    return out


@functools.cache
def struct_classes() -> frozenset[str]:
    """The package's msgspec Struct classes, by name (their fields are values carried, not holders)."""
    bases: dict[str, set[str]] = {}
    for path in package_files():
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.ClassDef):
                bases.setdefault(node.name, set()).update(ast.unparse(b).rpartition(".")[2] for b in node.bases)
    structs = {"Struct"}
    while grown := {name for name, of in bases.items() if of & structs} - structs:
        structs |= grown
    return frozenset(structs)


def unlisted_containers(tree: ast.AST, rel: str, listed, structs: frozenset[str]) -> list[str]:
    """Containers an object keeps that are neither NodeRegistry's nor listed, as lines to add to the list."""
    found = {}
    for cls, attr, line, field in source.container_attributes(tree):
        if (rel, cls) != ROSTER and not (field and cls in structs) and (rel, cls, attr) not in listed:
            found.setdefault(
                (cls, attr), f"{rel} {cls or '-'}.{attr}: <what it holds; why no second owner> (line {line})"
            )
    return list(found.values())
