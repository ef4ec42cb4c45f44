"""What every config section is made of: the section base, field documentation, the error type."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta


class ConfigError(ValueError):
    """A config value or key that is not allowed; the message names the field path."""


def _doc(text: str, **bounds: Any) -> Meta:
    return Meta(description=text, **bounds)


PosInt = Annotated[int, Meta(ge=1)]


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass
