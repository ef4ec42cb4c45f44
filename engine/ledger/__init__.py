"""The Redis ledger: its moves (`writer.py`), its read side and plumbing (`books.py`), and the Lua
scripts that make every move atomic (`scripts.py`); what a call raises (`errors.py`); where a run's
ledger lives (`opening.py`)."""

from streamrl.engine.ledger.opening import open_ledger
from streamrl.engine.ledger.writer import *  # noqa: F403
from streamrl.engine.ledger.writer import __all__ as _writer_all

__all__ = [*_writer_all, "open_ledger"]
