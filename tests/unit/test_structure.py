"""The code's shape, read from the source (no import): one owner per concept, and the owner the only code
that writes it (STYLE.md 13, 15); the rules and their lists are tests/unit/ownership_rules.py's. (Files,
imports and the README's layout: test_layout.py.)"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import textwrap

_spec = importlib.util.spec_from_file_location("rules", pathlib.Path(__file__).with_name("ownership_rules.py"))
rules = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rules)
source, ROOT = rules.source, rules.ROOT
parse, scopes, assignments = source.parse, source.scopes, source.assignments
package_files, product_files, _rel = source.package_files, source.product_files, source.rel


def _check(code: str, rel: str, listed=None) -> list[str]:
    """Every ownership rule on `code` as if it were the file `rel` (`listed`: the containers' list)."""
    tree = ast.parse(textwrap.dedent(code))
    containers = rules.unlisted_containers(
        tree, rel, rules.listed_containers() if listed is None else listed, rules.struct_classes()
    )
    return (
        rules.version_writers(tree, rel)
        + rules.node_rosters(tree, rel, rules.registry_fields())
        + rules.publisher_counts(tree, rel)
        + [f"unlisted: {c.split(':')[0]}" for c in containers]
    )


def test_every_version_attribute_is_assigned_by_its_owner_alone():
    found = [hit for path in package_files() for hit in rules.version_writers(parse(path), _rel(path))]
    assert found == []
    # and the owners do write them (the rule reads the tree it means to)
    owners = {(rel, cls) for owners in rules.VERSION_OWNERS.values() for rel, cls in owners}
    written = set()
    for rel, cls in owners:
        for node, where, _ in scopes(parse(ROOT / rel)):
            if where == cls and isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                written.add((rel, cls, node.attr))
    assert {(r, c) for r, c, a in written if a in rules.VERSION_OWNERS} == owners


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
    fields = rules.registry_fields()
    assert {"nodes", "identities", "departed"} <= fields  # the rule knows the registry's containers
    found = [hit for path in package_files() for hit in rules.node_rosters(parse(path), _rel(path), fields)]
    assert found == []
    # the orchestrator's flows count nodes by asking the registry, never through the publisher
    assert [hit for path in package_files() for hit in rules.publisher_counts(parse(path), _rel(path))] == []
    flows = "".join((ROOT / "learner" / f).read_text() for f in rules.ORCHESTRATOR_FLOWS)
    assert "registry.count" in flows
    readers = {(rel, cls, fn.name) for rel, *_ in rules.PUBLISHER_READERS for fn, cls, _ in scopes(parse(ROOT / rel))
               if isinstance(fn, ast.FunctionDef) and rules.PUBLISHER_STATES.search(ast.unparse(fn))}  # fmt: skip
    assert readers == set(rules.PUBLISHER_READERS)  # each listed reader does read them (the list is not stale)


def test_every_container_an_object_keeps_is_the_registrys_or_listed():
    listed, structs, found, seen = rules.listed_containers(), rules.struct_classes(), [], set()
    for path in package_files():
        if (rel := _rel(path)).split("/")[0] in rules.FLOORS:
            found += rules.unlisted_containers(parse(path), rel, listed, structs)
            seen |= {(rel, cls, attr) for cls, attr, *_ in source.container_attributes(parse(path))}
    assert not found, (
        f"{len(found)} containers kept on objects are neither NodeRegistry's nor listed in "
        f"tests/data/{rules.LISTED_CONTAINERS.name}:\n  "
        + "\n  ".join(found)
        + "\nOne of node ids is a second roster: "
        "ask NodeRegistry (learner/nodes.py) instead. Otherwise add its line to the list, saying what it holds and "
        "why it is no second owner of a concept another object owns (the nodes in the run, a version, a sample's "
        "fate), e.g.\n  learner/intake.py Intake.groups: groups partly received, by group id, until whole and collected"
    )
    stale = sorted(f"{rel} {cls or '-'}.{attr}" for rel, cls, attr in set(listed) - seen)
    assert not stale, (
        f"listed in tests/data/{rules.LISTED_CONTAINERS.name} but kept nowhere (remove the lines): {stale}"
    )


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
