"""`skyrl_gym`: run a skyrl-gym environment (SkyRL's `BaseTextEnv`) as a streamrl environment.

Why skyrl-gym of the three libraries the issue names: its environments are text in, chat messages
out (`init(prompt) -> (messages, metadata)`, `step(action: str) -> {observations, reward, done}`),
and leave generation and tokenization to the trainer: exactly the split streamrl needs to keep
token-in/token-out (the node samples, renders the observations turn by turn and keeps the ids).
verifiers environments own the rollout loop and call an OpenAI-style client for generation, so
the trainer sees text or must serve an API; OpenEnv environments are HTTP servers (usually in
containers) behind a client, which cannot be run on this machine's offline CPU setup.

A row is SkyRL's dataset format: `prompt` (chat messages), `env_class` (a skyrl-gym registered id,
e.g. gsm8k_multi_turn), `reward_spec` (e.g. `ground_truth`) and any `extra_info`; the row is passed
as the environment's `extras`. An `env_class` that skyrl-gym has not registered but that is an entry point,
`module:Class` (the form skyrl-gym's `register` takes), is made from that class: your own `BaseTextEnv`,
importable from PYTHONPATH (examples/skyrl/letter_env.py). A data file whose rows look so needs no setting
(libraries.py fills env.name and data.messages_column). `env.args`: optional `env_id` (one id for every row, in place of
the rows' `env_class`) and `env_config` (a dict). The reward is the environment's: its step rewards,
summed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

SHOWN = 5  # ids named in a message at most


class SkyRLGymEnv:
    def __init__(self, env_id: str = "", env_config: dict[str, Any] | None = None):
        try:
            import skyrl_gym
        except ImportError as e:
            raise ImportError(f"env.name = 'skyrl_gym' needs the skyrl-gym package ({e}): pip install skyrl-gym") from e
        from skyrl_gym.envs.registration import EnvSpec, registry

        self._make, self.env_id, self.env_config = skyrl_gym.make, env_id, env_config or {}
        self._spec = lambda i: i if i in registry or ":" not in i else EnvSpec(id=i, entry_point=i)
        self.env = None

    def reset(self, row: dict) -> list[dict]:
        env_id = self.env_id or row.get("env_class")
        if not env_id:
            raise ValueError("skyrl_gym: the row has no env_class; give one per row or env.args.env_id")
        self.env = self._make(self._spec(env_id), env_config=self.env_config, extras=row)
        prompt = row.get("prompt")
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        messages, _ = self.env.init(prompt)
        return messages

    def step(self, completion: str) -> tuple[list[dict], float, bool]:
        out = self.env.step(completion)
        return list(out["observations"] or []), out["reward"], bool(out["done"])

    def close(self) -> None:
        if self.env is not None:
            self.env.close()


def unregistered(env_id: str | None, rows: Iterable[dict]) -> str:
    """Why some episode cannot make its environment ('' when every one can): `env_id` (env.args), else each
    row's `env_class`, must be an id skyrl-gym has registered."""
    try:
        from skyrl_gym.envs.registration import load_env_creator, registry
    except ImportError as e:
        return f"env.name = 'skyrl_gym' needs the skyrl-gym package ({e}): pip install skyrl-gym"
    known = f"registered: {', '.join(sorted(registry))}; or an entry point module:Class"

    def makeable(i: str) -> bool:
        try:
            return i in registry or (":" in i and callable(load_env_creator(i)))
        except Exception:  # noqa: BLE001 - any import failure: the id cannot be made
            return False

    if env_id:
        return "" if makeable(env_id) else f"env.args.env_id = {env_id!r} is not a skyrl-gym id; {known}"
    rows = [r for r in rows if isinstance(r, dict)]
    classes = [r.get("env_class") for r in rows]
    unnamed = sum(not isinstance(c, str) or not c for c in classes)
    missing = sorted(
        {c for c in classes if isinstance(c, str) and c}
        - {c for c in set(classes) if isinstance(c, str) and c and makeable(c)}
    )
    if missing:
        more = f" and {len(missing) - SHOWN} more" if len(missing) > SHOWN else ""
        shown = ", ".join(map(repr, missing[:SHOWN])) + more
        return f"env_class {shown} in data.path is not a skyrl-gym id; {known}"
    if unnamed:
        return f"{unnamed} of {len(rows)} rows in data.path have no env_class; give each one, or env.args.env_id"
    return ""
