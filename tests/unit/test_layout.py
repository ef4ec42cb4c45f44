"""The code's layout, read from the source (no import): one argument parser library, files under 400
lines, no import loop, and the README's layout section matching the tree. (Who writes each concept:
test_structure.py.)"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import re

_spec = importlib.util.spec_from_file_location("source_tree", pathlib.Path(__file__).with_name("source_tree.py"))
source = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(source)
ROOT, ROLES = source.ROOT, source.ROLES
parse, python_files, product_files = source.parse, source.python_files, source.product_files


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
    folders = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() and not p.name.startswith(".")}
    for floor in ("engine", "rollout", "learner"):
        folders |= {p.name for p in (ROOT / floor).iterdir() if (p / "__init__.py").is_file()}
    assert folders - mentioned == set()
