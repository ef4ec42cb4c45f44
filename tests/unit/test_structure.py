"""The code's shape, read from the source (no import): one writer per concept, one argument parser
library, files under 400 lines, no import loop, and the README's layout section matching the tree."""

from __future__ import annotations

import ast
import pathlib
import re

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


def parse(path: pathlib.Path) -> ast.Module:
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


def test_the_trainers_version_has_one_writer():
    # the value lives in Trainer._version; the only statement that assigns it is in Trainer._advance
    sites = [
        (path.relative_to(ROOT).as_posix(), where)
        for path in python_files("learner")
        for target, where in assignments(parse(path))
        if target.attr == "_version"
    ]
    assert sites == [("learner/train_step.py", ("Trainer", "_advance"))]
    # nothing else assigns a trainer's version (it is a read-only property: restore via load_state_dict)
    outside = [
        f"{path.relative_to(ROOT)}:{target.lineno}"
        for path in python_files()
        for target, _ in assignments(parse(path))
        if target.attr == "version" and ast.unparse(target.value).split(".")[-1] in ("trainer", "self.trainer")
    ]
    assert outside == []


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
    # the orchestrator counts nodes by asking the registry, not the publisher's links
    orchestrator = (ROOT / "learner" / "orchestrator.py").read_text()
    assert "publisher.nodes" not in orchestrator and "publisher.links" not in orchestrator


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
