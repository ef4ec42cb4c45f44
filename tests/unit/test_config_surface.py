"""The config surface frozen: every field of every section, its type, its bounds and its default, as
`tests/data/config_surface.txt` lists them. A field added, removed, renamed, retyped or given another default
fails this test until the list is written again, so the change shows in review as a diff of that file.

Write the list again (after deciding that the change is meant):

    .venv/bin/python tests/unit/test_config_surface.py

and commit tests/data/config_surface.txt with the change.
"""

from __future__ import annotations

import difflib
import pathlib
import sys

import msgspec
import msgspec.inspect as mi

FROZEN = pathlib.Path(__file__).resolve().parents[1] / "data" / "config_surface.txt"
BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"), ("min_length", "len >="), ("max_length", "len <="))


def _type(t) -> str:
    """A field's type in a few words: `int (>= 1)`, `'async'|'sync'`, `list[str]`."""
    if isinstance(t, mi.Metadata):
        return _type(t.type)
    if isinstance(t, mi.LiteralType):
        return "|".join(map(repr, t.values))
    if isinstance(t, mi.UnionType):
        return " | ".join(_type(x) for x in t.types)
    if isinstance(t, mi.DictType):
        return f"dict[{_type(t.key_type)}, {_type(t.value_type)}]"
    name = type(t).__name__.removesuffix("Type").lower()
    if hasattr(t, "item_type"):
        return f"{name}[{_type(t.item_type)}]"
    bounds = [f"{word} {getattr(t, a)}" for a, word in BOUNDS if getattr(t, a, None) is not None]
    return name + (f" ({', '.join(bounds)})" if bounds else "")


def surface() -> list[str]:
    """`section.field: type = default`, one line a field, sections recursed (reward.model.path ...)."""
    from streamrl.engine.config import Config

    def walk(struct: mi.StructType, prefix: str):
        for field in struct.fields:
            inner = field.type.type if isinstance(field.type, mi.Metadata) else field.type
            if isinstance(inner, mi.StructType):
                yield from walk(inner, f"{prefix}{field.name}.")
                continue
            if field.default is not msgspec.NODEFAULT:
                default = field.default
            elif field.default_factory is not msgspec.NODEFAULT:
                default = field.default_factory()
            else:
                default = "(required)"
            yield f"{prefix}{field.name}: {_type(field.type)} = {default!r}"

    return list(walk(mi.type_info(Config), ""))


def mismatch(frozen: list[str], now: list[str]) -> str:
    """'' when the surface is the frozen one; else what the test says: the diff and how to write the list."""
    if now == frozen:
        return ""
    diff = "\n".join(difflib.unified_diff(frozen, now, "frozen", "now", lineterm="", n=0))
    return (
        f"the config surface changed (- frozen, + now):\n{diff}\nIf that is meant, write the list again with "
        f"`.venv/bin/python tests/unit/test_config_surface.py` and commit {FROZEN.relative_to(FROZEN.parents[2])} "
        "with the change."
    )


def test_the_config_surface_is_the_frozen_one():
    message = mismatch(FROZEN.read_text().splitlines(), surface())
    assert not message, message


def test_a_changed_default_or_a_new_field_fails_naming_the_way_to_update():
    now = surface()
    frozen = [now[0].rsplit(" = ", 1)[0] + " = 'other'", *now[1:-1]]  # a default changed, the last field new
    message = mismatch(frozen, now)
    assert f"-{frozen[0]}" in message and f"+{now[0]}" in message and f"+{now[-1]}" in message
    assert "`.venv/bin/python tests/unit/test_config_surface.py`" in message
    assert mismatch(now, now) == ""  # the positive control


if __name__ == "__main__":
    FROZEN.write_text("\n".join(surface()) + "\n")
    print(f"wrote {len(surface())} fields to {FROZEN}", file=sys.stderr)
