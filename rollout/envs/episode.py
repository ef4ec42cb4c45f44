"""One episode: the model and an environment take turns, token ids in and token ids out.

Each model turn is one `engine.generate(prompt_ids=<the whole episode so far>, n=1, ...)` call;
the sampled ids, their behavior logprobs and versions are appended as they came, then the
environment's answer as ids rendered turn by turn (render.py), so the trajectory holds exactly
the tokens the model sampled, with a loss mask of 1 on them and 0 on the environment's.
Environment tokens carry logprob 0.0 and the version of the model token before them.

An episode ends when the environment says done (`finish_reason` "done"), after `env.max_turns`
model turns ("max_turns"), or when the next observation plus one model token would pass
`env.max_total_tokens` or `model.max_model_len` ("max_total_tokens", "max_model_len"); limits
are counted in `EpisodeRunner.limits`. It fails, to be dropped in the ledger with the reason,
when the environment raises (env_error), misses `env.step_timeout_s` (env_timeout), returns
something that is not an observation/reward/done (env_malformed), or the whole episode misses
`env.episode_timeout_s` (episode_timeout). Engine errors are not episode failures: they propagate.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import inspect
import logging
import threading
import time
import traceback
from collections.abc import Callable

from streamrl.engine.config import Config, ConfigError
from streamrl.rollout.backends.protocol import Completion, GenerationBackend
from streamrl.rollout.envs.protocol import (
    Environment,
    EpisodeFailure,
    Message,
    SpecError,
    load_environment,
    messages,
    step_result,
)
from streamrl.rollout.envs.render import TemplateError, TurnRenderer

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Episode:
    prompt_ids: list[int]
    completion_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)  # 1 model token, 0 environment token
    reward: float = 0.0  # sum of the step rewards
    turns: int = 0
    finish_reason: str = ""  # done, max_turns, max_total_tokens, max_model_len
    failure: str = ""  # the drop reason when the episode failed
    detail: str = ""  # why it failed
    started: float = dataclasses.field(default_factory=time.time)
    generated: float = 0.0  # when the last model turn finished
    tools: dict[str, int] = dataclasses.field(default_factory=dict)  # the environment's `tool_counts`, if any

    @property
    def model_tokens(self) -> int:
        return sum(self.mask)

    def add(self, ids: list[int], logprobs: list[float], versions: list[int], model: bool) -> None:
        self.completion_ids += ids
        self.logprobs += logprobs
        self.versions += versions
        self.mask += [int(model)] * len(ids)


class EpisodeRunner:
    """Runs episodes of `env_factory` environments on `engine` (one instance per episode)."""

    def __init__(
        self, cfg: Config, engine: GenerationBackend, tokenizer, env_factory: Callable[[], Environment], tools=None
    ):
        self.cfg, self.env_cfg, self.engine, self.tokenizer = cfg, cfg.env, engine, tokenizer
        self.env_factory, self.tools = env_factory, tools
        try:
            self.render = TurnRenderer(tokenizer)
        except TemplateError as e:
            raise ValueError(f"env.name = {cfg.env.name!r}: {e}") from None
        self.turn_max_tokens = self.env_cfg.turn_max_tokens or cfg.rollout.max_tokens
        self.limits: collections.Counter[str] = collections.Counter()  # episodes ended by each limit
        self.failures: collections.Counter[str] = collections.Counter()  # episodes failed, by reason
        self.abandoned_calls = 0  # plain env calls still running in their thread past their deadline

    def close(self) -> None:
        if self.tools is not None:
            self.tools.close()

    async def run_group(self, prompt_ids: list[int], row: dict, n: int) -> list[Episode]:
        """`n` episodes of one row at once; an engine error cancels the others and propagates."""
        tasks = [asyncio.ensure_future(self.run(prompt_ids, row)) for _ in range(n)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            raise

    async def run(self, prompt_ids: list[int], row: dict) -> Episode:
        """One episode of one row; never raises for what the environment does (see the module docstring)."""
        episode = Episode(prompt_ids=prompt_ids)
        env = None
        try:
            async with asyncio.timeout(self.env_cfg.episode_timeout_s):
                env = await self._call(self.env_factory, "the environment's constructor")
                await self._play(env, episode, row)
        except EpisodeFailure as e:
            episode.failure, episode.detail = e.reason, e.detail
        except TimeoutError:
            episode.failure = "episode_timeout"
            episode.detail = f"the episode passed env.episode_timeout_s = {self.env_cfg.episode_timeout_s:g} s"
        finally:
            if isinstance(getattr(env, "tool_counts", None), dict):
                episode.tools = dict(env.tool_counts)
            if env is not None and callable(getattr(env, "close", None)):
                await self._close(env)
        if episode.failure:
            self.failures[episode.failure] += 1
            log.warning("episode dropped as %s: %s", episode.failure, episode.detail)
        elif episode.finish_reason != "done":
            self.limits[episode.finish_reason] += 1
        return episode

    async def _play(self, env: Environment, episode: Episode, row: dict) -> None:
        first = await self._call(env.reset, "reset", row)
        if first is not None:
            episode.prompt_ids = self.render.first_prompt(messages(first, "reset"), getattr(env, "tools", None))
        while True:
            completion = await self._turn(episode)
            if completion is None:
                return
            text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            observation, reward, done = step_result(await self._call(env.step, "step", text))
            episode.reward += reward
            if done:
                episode.finish_reason = "done"
                return
            if episode.turns >= self.env_cfg.max_turns:
                episode.finish_reason = "max_turns"
                return
            if not self._observe(episode, observation, completion.token_ids):
                return

    async def _turn(self, episode: Episode) -> Completion | None:
        """One model turn appended to the episode; None (finish reason set) when no token fits."""
        context = len(episode.prompt_ids) + len(episode.completion_ids)
        budget = min(
            self.turn_max_tokens,
            self.env_cfg.max_total_tokens - len(episode.completion_ids),
            self.cfg.model.max_model_len - context,
        )
        if budget < 1 and not episode.turns:
            raise EpisodeFailure("overlong", f"the first prompt ({context} tokens) leaves no room for a model token")
        if budget < 1:
            episode.finish_reason = "max_model_len" if context >= self.cfg.model.max_model_len else "max_total_tokens"
            return None
        (completion,) = await self.engine.generate(episode.prompt_ids + episode.completion_ids, 1, budget)
        episode.add(completion.token_ids, completion.logprobs, completion.token_versions, model=True)
        if completion.finish_reason == "length" and len(completion.token_ids) == self.turn_max_tokens:
            self.limits["turn_max_tokens"] += 1  # a turn cut short; the episode goes on
        episode.turns += 1
        episode.generated = time.time()
        return completion

    def _observe(self, episode: Episode, observation: list[Message], last_ids: list[int]) -> bool:
        """Append the observation's ids; False (finish reason set) when it leaves no room for a model token."""
        try:
            ids = self.render.observation_ids(observation, last_ids)
        except Exception as e:  # noqa: BLE001 - a template error on the environment's content (a role it lacks)
            raise EpisodeFailure("env_malformed", f"the chat template cannot render the observation: {e}") from e
        total = len(episode.completion_ids) + len(ids) + 1
        if total > self.env_cfg.max_total_tokens:
            episode.finish_reason = "max_total_tokens"
            return False
        if len(episode.prompt_ids) + total > self.cfg.model.max_model_len:
            episode.finish_reason = "max_model_len"
            return False
        version = episode.versions[-1] if episode.versions else self.engine.policy_version
        episode.add(ids, [0.0] * len(ids), [version] * len(ids), model=False)
        return True

    async def _call(self, fn: Callable, what: str, *args):
        """`fn(*args)` within env.step_timeout_s; its exceptions become env_error, a miss env_timeout."""
        timeout_s = self.env_cfg.step_timeout_s
        try:
            if inspect.iscoroutinefunction(fn):
                return await asyncio.wait_for(fn(*args), timeout_s)
            result = await asyncio.wait_for(_in_thread(fn, *args), timeout_s)
            return await asyncio.wait_for(result, timeout_s) if inspect.isawaitable(result) else result
        except TimeoutError:
            if not inspect.iscoroutinefunction(fn):
                self.abandoned_calls += 1
            raise EpisodeFailure(
                "env_timeout", f"{what} did not return within env.step_timeout_s = {timeout_s:g} s"
            ) from None
        except (EpisodeFailure, asyncio.CancelledError):
            raise
        except Exception as e:  # noqa: BLE001 - whatever the environment raises ends only its episode
            raise EpisodeFailure("env_error", f"{what} raised {type(e).__name__}: {e}\n{traceback.format_exc()}") from e

    async def _close(self, env) -> None:
        try:
            await self._call(env.close, "close")
        except EpisodeFailure as e:  # the episode's outcome stands; a close that fails is only logged
            log.warning("environment close failed: %s", e.detail)


def _in_thread(fn: Callable, *args) -> asyncio.Future:
    """Run a plain call in a daemon thread of its own: a call that hangs is abandoned at its deadline
    and cannot hold a shared pool's thread (nor stop the process from exiting)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(ok: bool, value) -> None:
        if future.done():  # abandoned at its deadline
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def work() -> None:
        try:
            outcome = (True, fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting episode
            outcome = (False, e)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop closed while this call hung: nobody is waiting
            pass

    threading.Thread(target=work, name="streamrl-env-call", daemon=True).start()
    return future


def build_runner(cfg: Config, engine: GenerationBackend, tokenizer) -> EpisodeRunner:
    """The runner for `cfg.env` (its tool pool started when `env.tools` names tools)."""
    from streamrl.rollout.envs.check import bind
    from streamrl.rollout.envs.tools import ToolPool, ToolPoolError

    try:
        cls = load_environment(cfg.env.name)
        bind(cls, dict(cfg.env.args, **({"toolbox": None} if cfg.env.tools else {})))  # as preflight checks it
        tools = None
        if cfg.env.tools:
            e = cfg.env
            tools = ToolPool(e.tools, e.tool_workers, e.tool_timeout_s, e.tool_start_method)
    except (SpecError, ToolPoolError) as e:
        raise ConfigError(str(e)) from None
    kwargs = dict(cfg.env.args, **({"toolbox": tools} if tools else {}))
    try:
        return EpisodeRunner(cfg, engine, tokenizer, functools.partial(cls, **kwargs), tools)
    except ValueError as e:
        if tools is not None:
            tools.close()
        raise ConfigError(str(e)) from None
