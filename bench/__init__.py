"""Benchmarks: each module is one `streamrl bench NAME` and prints one JSON line per figure."""

from __future__ import annotations

import ast
import pathlib
import re


def names() -> list[str]:
    """Every module of this folder but the private ones: each is a benchmark."""
    return [p.stem for p in sorted(pathlib.Path(__file__).parent.glob("*.py")) if not p.stem.startswith("_")]


def catalogue() -> dict[str, str]:
    """Each benchmark with what it measures: its docstring's first sentence."""
    out = {}
    for name in names():
        source = (pathlib.Path(__file__).parent / f"{name}.py").read_text()
        first = " ".join((ast.get_docstring(ast.parse(source)) or "").split("\n\n")[0].split())
        out[name] = re.split(r"(?<=\.)\s", first, maxsplit=1)[0].rstrip(".;")
    return out
