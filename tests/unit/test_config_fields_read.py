"""Every config field is read by some code that acts on it: a knob that does nothing fails this test.

Method (static, over the package's own source, tests excluded): each `.py` file is parsed with `ast`
and an attribute *read* (`ast.Load`) `X.f` counts as reading field `f` of section `s` when X is
- a chain that ends in the section's path: `cfg.learner.lr`, `self.cfg.loss.kl_coef`, `cfg.reward.model.path`
  (the longest matching path wins, so `cfg.reward.model.path` is `reward.model.path`, not `model.path`);
- a name bound to the section in the same function: assigned from such a chain (`learner = self.cfg.learner`)
  or a parameter annotated with the section's class (`cfg: LossConfig`);
- `self.a` where some method of the same class assigned a section to `self.a` (`self.loss_cfg = loss_cfg`);
- `self` inside the section's own class (a property such as `RunConfig.path` reading `self.dir`);
- the first parameter of a lambda in a value annotated `Callable[[<Section>], ...]` (rewards' registry);
- `x or LedgerConfig()` counts as the section, as `x` alone would.
Reads that only check a field do not count: `__post_init__` validation in engine/config/schema.py, the
cross-section rules (engine/config/rules.py) and preflight (ops/preflight.py). Exact about attribute
access; it cannot see a field read by `getattr` with a computed name or by unpacking a whole section
(none does today: such a read would need a line in READ_ELSEWHERE with its reason).
"""

from __future__ import annotations

import ast
import pathlib
import typing

import msgspec

from streamrl.engine.config import Config

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHECK_ONLY = {"engine/config/rules.py", "ops/preflight.py"}
READ_ELSEWHERE: dict[str, str] = {  # "section.field": where and how it is read, when no attribute read shows it
    "ledger.heartbeat_ttl_s": "engine/ledger/writer.py Ledger.heartbeat reads self.config.heartbeat_ttl_s; "
    "self.config is the LedgerConfig that the base class LedgerBooks.__init__ (engine/ledger/books.py) keeps, "
    "which the walk does not follow across classes"
}


def sections() -> dict[tuple[str, ...], type]:
    """Every config section by path (`("reward", "model")` included), from the Config type tree."""
    out: dict[tuple[str, ...], type] = {}

    def walk(struct: type, path: tuple[str, ...]) -> None:
        for name, hint in typing.get_type_hints(struct).items():
            if isinstance(hint, type) and issubclass(hint, msgspec.Struct):
                out[path + (name,)] = hint
                walk(hint, path + (name,))

    walk(Config, ())
    return out


def fields() -> set[tuple[str, ...]]:
    out = set()
    for path, struct in sections().items():
        for name, hint in typing.get_type_hints(struct).items():
            if not (isinstance(hint, type) and issubclass(hint, msgspec.Struct)):
                out.add(path + (name,))
    return out


def chain(node: ast.AST) -> list[str]:
    """`a.b.c` -> ["a", "b", "c"]; [] when the base is not a plain name (a call, a subscript)."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return [node.id, *reversed(names)] if isinstance(node, ast.Name) else []


class Reads(ast.NodeVisitor):
    def __init__(self, by_class: dict[str, tuple[str, ...]], paths: dict[tuple[str, ...], type]):
        self.by_class, self.paths = by_class, paths
        self.found: set[tuple[str, ...]] = set()
        self.names: list[dict[str, tuple[str, ...]]] = [{}]  # per function: name -> section path
        self.selfs: list[dict[str, tuple[str, ...]]] = [{}]  # per class: self attribute -> section path
        self.own: list[tuple[str, ...] | None] = [None]  # the section whose class we are in

    def section_of(self, node: ast.AST) -> tuple[str, ...] | None:
        if isinstance(node, ast.BoolOp):  # `config or LedgerConfig()`
            return next(filter(None, map(self.section_of, node.values)), None)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):  # `LedgerConfig()`
            return self.by_class.get(node.func.id)
        names = chain(node)
        if len(names) == 1:
            return self.names[-1].get(names[0])
        if len(names) == 2 and names[0] == "self":
            return self.selfs[-1].get(names[1]) or None
        for size in range(len(names) - 1, 0, -1):  # longest section path the chain ends in
            if tuple(names[-size:]) in self.paths:
                return tuple(names[-size:])
        return None

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        selfs: dict[str, tuple[str, ...]] = {}
        self.selfs.append(selfs)
        self.own.append(self.by_class.get(node.name))
        for item in ast.walk(node):  # a class's self.x = <section> in any method, before reading its methods
            if isinstance(item, ast.FunctionDef):
                self._bind(item, selfs)
        self.generic_visit(node)
        self.selfs.pop()
        self.own.pop()

    def _bind(self, func: ast.FunctionDef, selfs: dict[str, tuple[str, ...]]) -> None:
        self.names.append(self._params(func))
        for item in ast.walk(func):
            if isinstance(item, ast.Assign):
                for target, value in _pairs(item):
                    section = self.section_of(value)
                    if section and isinstance(target, ast.Attribute) and chain(target)[:1] == ["self"]:
                        selfs[target.attr] = section
        self.names.pop()

    def _params(self, func: ast.FunctionDef) -> dict[str, tuple[str, ...]]:
        out = {}
        for arg in func.args.args + func.args.kwonlyargs:
            annotation = ast.unparse(arg.annotation) if arg.annotation else ""
            for cls, path in self.by_class.items():
                if annotation.split(" | ")[0] == cls:
                    out[arg.arg] = path
        if self.own[-1] and func.args.args and func.args.args[0].arg == "self":
            out["self"] = self.own[-1]
        return out

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        if self.own[-1] and node.name == "__post_init__":
            return  # validation, not use
        self.names.append(self._params(node))
        for item in ast.walk(node):
            if isinstance(item, ast.Assign):
                for target, value in _pairs(item):
                    section = self.section_of(value)
                    if section and isinstance(target, ast.Name):
                        self.names[-1][target.id] = section
        self.generic_visit(node)
        self.names.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.ctx, ast.Load):
            section = self.section_of(node.value)
            if section is not None and section + (node.attr,) not in self.paths:
                self.found.add(section + (node.attr,))
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        """Lambdas in a value annotated `...Callable[[<Section>], ...]...` take the section as first parameter."""
        annotation = ast.unparse(node.annotation)
        section = next((p for cls, p in self.by_class.items() if f"Callable[[{cls}]" in annotation), None)
        if section is None or node.value is None:
            return self.generic_visit(node)
        for item in ast.walk(node.value):
            if isinstance(item, ast.Lambda) and item.args.args:
                self.names.append({item.args.args[0].arg: section})
                self.visit(item.body)
                self.names.pop()


def _pairs(assign: ast.Assign):
    """(target, value) pairs of an assignment, tuple assignments element by element."""
    for target in assign.targets:
        if isinstance(target, ast.Tuple) and isinstance(assign.value, ast.Tuple):
            yield from zip(target.elts, assign.value.elts)
        else:
            yield target, assign.value


def read_fields() -> set[tuple[str, ...]]:
    paths = sections()
    by_class = {struct.__name__: path for path, struct in paths.items()}
    found: set[tuple[str, ...]] = set()
    for file in sorted(ROOT.rglob("*.py")):
        relative = file.relative_to(ROOT).as_posix()
        if relative.startswith(("tests/", ".")) or "/." in relative or relative in CHECK_ONLY:
            continue
        reads = Reads(by_class, paths)
        reads.visit(ast.parse(file.read_text(), filename=relative))
        found |= reads.found
    return found


def test_every_config_field_is_read_by_some_code():
    every = fields()
    assert ("learner", "mini_batches") in every and ("reward", "model", "path") in every
    unread = sorted(".".join(f) for f in every - read_fields() if ".".join(f) not in READ_ELSEWHERE)
    assert unread == [], f"config fields no code reads (remove them, or make them do what they say): {unread}"


def test_the_walk_sees_each_kind_of_read():
    """The method finds a read through a chain, an alias, a typed parameter, self.<attr> and a property, and
    does not count a write or validation: a field read only by `__post_init__` is not read."""
    source = """
class Trainer:
    def __init__(self, loss_cfg: LossConfig, cfg):
        self.loss_cfg = loss_cfg
        learner = cfg.learner
        learner.lr
        cfg.reward.model.index
    def step(self):
        self.loss_cfg.clip_low
def f(cfg):
    cfg.data.shuffle = False
    cfg.run.path
FNS: dict[str, Callable[[RewardConfig], int]] = {"n": lambda cfg: cfg.workers}
def g(config: LedgerConfig | None = None):
    config = config or LedgerConfig()
    config.connect_retries
class RunConfig:
    @property
    def path(self):
        return self.dir
    def __post_init__(self):
        self.seed
"""
    paths = sections()
    reads = Reads({s.__name__: p for p, s in paths.items()}, paths)
    reads.visit(ast.parse(source))
    assert reads.found == {
        ("learner", "lr"),
        ("reward", "model", "index"),
        ("loss", "clip_low"),
        ("run", "path"),
        ("run", "dir"),
        ("reward", "workers"),
        ("ledger", "connect_retries"),
    }
