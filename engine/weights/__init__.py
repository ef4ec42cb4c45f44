"""Weight transfer from learner rank 0 into running rollout engines: the bucket layout (`layout.py`),
the per-node process groups (`groups.py`) and the transfer over them (`collective.py`: gloo on CPU,
NCCL between GPUs)."""

from streamrl.engine.weights.collective import *  # noqa: F403
from streamrl.engine.weights.collective import __all__  # noqa: F401
