"""Typed configuration, one Struct per component: the run-wide sections and loading (`schema.py`), the
rollout and learner sections (`rollout.py`, `learner.py`), the ledger, stream and push sections (`wire.py`),
their shared base (`base.py`) and the cross-section rules that preflight and the learner both check
(`rules.py`)."""

from streamrl.engine.config.schema import *  # noqa: F403
from streamrl.engine.config.schema import __all__  # noqa: F401
