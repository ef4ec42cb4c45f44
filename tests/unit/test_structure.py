"""The code's shape, read from the source (no import): one owner per concept, and the owner the only code
that writes it (STYLE.md 13, 15). (Files, imports and the README's layout: test_layout.py.)"""

from __future__ import annotations

import ast
import functools
import importlib.util
import pathlib
import re
import textwrap

_spec = importlib.util.spec_from_file_location("source_tree", pathlib.Path(__file__).with_name("source_tree.py"))
source = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(source)
ROOT = source.ROOT
parse, scopes, assignments = source.parse, source.scopes, source.assignments
package_files, product_files, _rel = source.package_files, source.product_files, source.rel


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


def _check(code: str, rel: str, listed=None) -> list[str]:
    """Every ownership rule on `code` as if it were the file `rel` (`listed`: the containers' list)."""
    tree = ast.parse(textwrap.dedent(code))
    containers = unlisted_containers(tree, rel, listed_containers() if listed is None else listed, struct_classes())
    return (
        version_writers(tree, rel)
        + node_rosters(tree, rel, registry_fields())
        + publisher_counts(tree, rel)
        + [f"unlisted: {c.split(':')[0]}" for c in containers]
    )


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
    assert [hit for path in package_files() for hit in publisher_counts(parse(path), _rel(path))] == []
    flows = "".join((ROOT / "learner" / f).read_text() for f in ORCHESTRATOR_FLOWS)
    assert "registry.count" in flows
    readers = {(rel, cls, fn.name) for rel, *_ in PUBLISHER_READERS for fn, cls, _ in scopes(parse(ROOT / rel))
               if isinstance(fn, ast.FunctionDef) and PUBLISHER_STATES.search(ast.unparse(fn))}  # fmt: skip
    assert readers == set(PUBLISHER_READERS)  # each listed reader does read them (the list is not stale)


def test_every_container_an_object_keeps_is_the_registrys_or_listed():
    listed, structs, found, seen = listed_containers(), struct_classes(), [], set()
    for path in package_files():
        if (rel := _rel(path)).split("/")[0] in FLOORS:
            found += unlisted_containers(parse(path), rel, listed, structs)
            seen |= {(rel, cls, attr) for cls, attr, *_ in source.container_attributes(parse(path))}
    assert not found, (
        f"{len(found)} containers kept on objects are neither NodeRegistry's nor listed in "
        f"tests/data/{LISTED_CONTAINERS.name}:\n  " + "\n  ".join(found) + "\nOne of node ids is a second roster: "
        "ask NodeRegistry (learner/nodes.py) instead. Otherwise add its line to the list, saying what it holds and "
        "why it is no second owner of a concept another object owns (the nodes in the run, a version, a sample's "
        "fate), e.g.\n  learner/intake.py Intake.groups: groups partly received, by group id, until whole and collected"
    )
    stale = sorted(f"{rel} {cls or '-'}.{attr}" for rel, cls, attr in set(listed) - seen)
    assert not stale, f"listed in tests/data/{LISTED_CONTAINERS.name} but kept nowhere (remove the lines): {stale}"


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
    kept = "SEEN: set[str] = set()\n\ndef joined(node_id):\n    SEEN.add(node_id)"  # a module's own roster
    assert _check(kept, "ops/x.py") == ["ops/x.py:4 SEEN.add(node_id)"]


def test_the_one_edit_evasions_of_issue_48_are_caught():
    # each of these passed the three owner rules when they went by spelling
    alias = """
        class Publisher:
            def add(self, node_id, link):
                nid = node_id
                self.links[nid] = link
    """
    assert _check(alias, "learner/publisher.py") == ["learner/publisher.py:5 self.links[nid]"]
    counted = """
        class Admission:
            def hint(self):
                return f"{sum(1 for _ in self.publisher.states())} nodes"
    """
    assert _check(counted, "learner/admission.py") == [
        "learner/admission.py:4 self.publisher.states read in Admission.hint",
        "learner/admission.py:4 sum((1 for _ in self.publisher.states())) counts the publisher's nodes",
    ]
    forced = "object.__setattr__(trainer, '_version', 3)"
    assert _check(forced, "ops/status.py") == ["ops/status.py:1 object.__setattr__(trainer, '_version', 3)"]
    members = """
        class Publisher:
            def poll(self):
                self.members = set(self._links())
    """
    assert _check(members, "learner/publisher.py") == ["unlisted: learner/publisher.py Publisher.members"]
    # the positive controls: the listed reader reads the states for per-node figures; a listed container
    reader = """
        class StepOutcome:
            def _node_figures(self):
                states = self.publisher.states()
                return {f"node/{node_id}/applied": w.applied for node_id, w in states.items()}
    """
    assert _check(reader, "learner/step_outcome.py") == []
    recount = reader.replace("return {", "return len(states), {")
    assert _check(recount, "learner/step_outcome.py") == [
        "learner/step_outcome.py:5 len(states) counts the publisher's nodes"
    ]
    listed = {("learner/publisher.py", "Publisher", "members"): "a test's reason"}
    assert _check(members, "learner/publisher.py", listed) == []


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
