"""Worker processes, one toolkit for every role that starts them.

- `lifeline.py`: the one die-with-parent mechanism (a child watches its parent and kills itself once
  the parent is gone, `kill -9` included).
- `child.py`: a worker's side: the ready handshake, then the serve loop until asked to stop.
- `parent.py`: the pool's side: `WorkerProcess` (a process and its pipe) and `stop_workers`
  (ask, then terminate, then kill, each with a bounded wait).

Used by the reward pool (`rewards/pool.py`, `rewards/worker.py`) and the tool pool
(`rollout/envs/tools.py`, `rollout/envs/tool_worker.py`); the vLLM engine core arms the lifeline.
"""
