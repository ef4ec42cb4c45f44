"""The Redis ledger: its moves (`writer.py`), its read side and plumbing (`books.py`), and the Lua
scripts that make every move atomic (`scripts.py`); what a call raises (`errors.py`)."""

from streamrl.engine.ledger.writer import *  # noqa: F403
from streamrl.engine.ledger.writer import __all__  # noqa: F401
