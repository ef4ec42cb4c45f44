"""verifiers tasksets (`data.path = "verifiers:TASKSET_ID"`) as prompt rows, scored by the task's own rewards.

verifiers 0.4 (`verifiers.v1`) splits an environment into a taskset (the data: `Taskset.load()` yields
`Task`s, an installed package named by its id, as `vf.load_taskset` finds it) and a harness that runs
the model (an OpenAI-style client, often in a sandbox). streamrl keeps the taskset and its scoring and
is the harness itself, token in and token out:

- `rows(spec)`: one row per task, `{"messages": [system?, prompt...], "prompt", "vf_task": [ID, INDEX]}`;
- `score`: the reward (`data.path = "verifiers:..."` makes it the default of reward.functions): the
  completion becomes the trace's one sampled assistant message, `Task.score(trace)` runs the task's
  `@vf.reward` functions (and plugged ones) without a runtime, and the reward is the trace's weighted
  sum, as verifiers computes it.

A taskset that needs what streamrl does not provide is refused when its rows are read, in one line
naming it: a container or sandbox (`NEEDS_CONTAINER`, an image, rewards or setup that need the
runtime), tools (toolsets: multi-turn tool use belongs to `[env]`), LLM judges, or its own `Env`
class (multi-agent, user simulation).
"""

from __future__ import annotations

import asyncio
import functools
import inspect

PREFIX = "verifiers:"


def parse_spec(spec: str) -> str:
    """`verifiers:TASKSET_ID` -> the taskset id."""
    taskset_id = spec[len(PREFIX) :] if spec.startswith(PREFIX) else ""
    if not taskset_id:
        raise ValueError(f"data.path = {spec!r}: write verifiers:TASKSET_ID, the id of an installed taskset package")
    return taskset_id


def _vf():
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ImportError(f"verifiers tasksets need the verifiers package ({e}): pip install 'verifiers>=0.4'") from e
    return vf


@functools.lru_cache(maxsize=8)
def tasks(taskset_id: str) -> tuple:
    """Every task of the taskset, checked (see `unsupported`); ValueError names what is missing."""
    vf = _vf()
    try:
        taskset = vf.load_taskset(vf.TasksetConfig(id=taskset_id))
    except (ModuleNotFoundError, TypeError, AttributeError, ValueError) as e:
        raise ValueError(f"data.path = 'verifiers:{taskset_id}': {e}") from None
    if vf.environment_class(taskset_id) is not vf.SingleAgentEnv:
        cls = vf.environment_class(taskset_id).__name__
        raise ValueError(_refused(taskset_id, f"it brings its own environment class {cls} (multi-agent or simulated)"))
    if type(taskset).toolsets(taskset.config):
        raise ValueError(_refused(taskset_id, "its tasks call tools (toolsets); give tools through [env] instead"))
    if not taskset.bounded:
        raise ValueError(_refused(taskset_id, "it yields tasks forever"))
    out = tuple(taskset)
    for task in out[:1]:  # one task type per taskset: the first task speaks for all
        why = unsupported(task)
        if why:
            raise ValueError(_refused(taskset_id, why))
    return out


def _refused(taskset_id: str, why: str) -> str:
    return f"data.path = 'verifiers:{taskset_id}' cannot run here: {why}"


def unsupported(task) -> str:
    """Why streamrl cannot run `task` single-turn without a runtime ('' when it can)."""
    needs_runtime = [
        fn.__name__
        for fn in task.hooks("reward")
        if (p := inspect.signature(fn).parameters.get("runtime")) is not None and p.default is p.empty
    ]
    overridden = [m for m in ("setup", "finalize") if getattr(type(task), m) is not getattr(_vf().Task, m)]
    if type(task).NEEDS_CONTAINER or task.data.image:
        return "it needs a container (NEEDS_CONTAINER or an image), which streamrl does not provide"
    if needs_runtime:
        return f"its rewards {needs_runtime} read the sandbox (a runtime), which streamrl does not provide"
    if overridden:
        return f"it prepares a sandbox ({', '.join(overridden)}), which streamrl does not provide"
    if task.toolsets(task.config):
        return "its tasks call tools (toolsets); give tools through [env] instead"
    if task.config.judges:
        return "it scores with LLM judges, which need a model client"
    if not task.hooks("reward"):
        return "its tasks have no @vf.reward function"
    return ""


def _message(message) -> dict:
    from verifiers.v1.types import content_text

    return {"role": message.role, "content": content_text(message.content) or ""}


def _prompt(data) -> list:
    """The task's opening messages as verifiers messages: its system prompt, then its prompt."""
    vf = _vf()
    out = [vf.SystemMessage(content=data.system_prompt)] if data.system_prompt else []
    if isinstance(data.prompt, str):
        return [*out, vf.UserMessage(content=data.prompt)]
    return [*out, *(data.prompt or [])]


def rows(spec: str) -> list[dict]:
    """The rows of the taskset `spec` names (see the module docstring)."""
    taskset_id = parse_spec(spec)
    out = []
    for index, task in enumerate(tasks(taskset_id)):
        messages = [_message(m) for m in _prompt(task.data)]
        out.append({"messages": messages, "prompt": task.data.prompt_text, "vf_task": [taskset_id, index]})
    return out


def score_one(completion: str, task_ref: list) -> float:
    """The task's weighted reward of `completion` as the model's one reply."""
    vf = _vf()
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, Trace, TraceTask

    taskset_id, index = task_ref
    task = tasks(taskset_id)[int(index)]
    said = [*_prompt(task.data), vf.AssistantMessage(content=completion)]
    last = len(said) - 1
    nodes = [MessageNode(parent=i - 1 if i else None, message=m, sampled=i == last) for i, m in enumerate(said)]
    trace = Trace(
        task=TraceTask(type=type(task).__name__, data=task.data), agent=AgentInfo(config=vf.AgentConfig()), nodes=nodes
    )
    asyncio.run(task.score(trace))
    return float(trace.reward)


def score(prompts, completions, completion_ids, vf_task, **_) -> list[float]:
    """Reward function over a batch (the dataset's columns arrive as keyword lists)."""
    return [score_one(c, ref) for c, ref in zip(completions, vf_task, strict=True)]


def _warm_up() -> None:
    """What `score_one` imports, imported when the reward worker starts (seconds on a loaded machine) rather
    than inside the first call's reward.timeout_s."""
    _vf()
    import verifiers.v1.graph  # noqa: F401
    import verifiers.v1.trace  # noqa: F401


score.warm_up = _warm_up
# no trial call in preflight (rewards/trial.py): the library's own scoring, whose worker would import the library
# for it (8 s for reasoning-gym, 40 s for verifiers on a loaded 2-core machine) and find nothing the rows check misses
score.streamrl_trial = False
