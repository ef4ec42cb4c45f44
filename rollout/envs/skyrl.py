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
as the environment's `extras`. A data file whose rows look so needs no setting (libraries.py fills
env.name and data.messages_column). `env.args`: optional `env_id` (one id for every row, in place of
the rows' `env_class`) and `env_config` (a dict). The reward is the environment's: its step rewards,
summed.
"""

from __future__ import annotations

from typing import Any


class SkyRLGymEnv:
    def __init__(self, env_id: str = "", env_config: dict[str, Any] | None = None):
        try:
            import skyrl_gym
        except ImportError as e:
            raise ImportError(f"env.name = 'skyrl_gym' needs the skyrl-gym package ({e}): pip install skyrl-gym") from e
        self._make, self.env_id, self.env_config = skyrl_gym.make, env_id, env_config or {}
        self.env = None

    def reset(self, row: dict) -> list[dict]:
        env_id = self.env_id or row.get("env_class")
        if not env_id:
            raise ValueError("skyrl_gym: the row has no env_class; give one per row or env.args.env_id")
        self.env = self._make(env_id, env_config=self.env_config, extras=row)
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
