"""Weight transfer from learner rank 0 into running rollout engines: the bucket layout (`layout.py`), the
path each node's weights take (`paths.py`: picked from where the node runs), the paths themselves
(`collective.py`: a broadcast over the node's own gloo or NCCL group, `groups.py` its process groups;
`ipc.py`: a copy from buffers the learner shares on its machine, CUDA IPC or shared memory), and the
two ends every path shares (`staging.py`: `new_sender` on the learner, `Stager` on the node), and the learner's
one order of steps for a push (`push.py`: `pack`, then `push`)."""

from streamrl.engine.weights.collective import *  # noqa: F403
from streamrl.engine.weights.collective import __all__ as _collective
from streamrl.engine.weights.ipc import IpcSender, shared_empty
from streamrl.engine.weights.paths import Location, WeightTransferError, choose, here
from streamrl.engine.weights.push import pack, push, push_in_process
from streamrl.engine.weights.staging import Staged, Stager, new_sender

__all__ = [
    *_collective,
    "IpcSender",
    "Location",
    "Staged",
    "Stager",
    "WeightTransferError",
    "choose",
    "here",
    "new_sender",
    "pack",
    "push",
    "push_in_process",
    "shared_empty",
]
