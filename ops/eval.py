"""`streamrl eval`: evaluate a model folder, a checkpoint or a run's last version on held-out sources, alone.

The same evaluation a run makes during training (docs/EVALUATION.md): each source's prompts
(rollout/evaluation_prompts.py), `eval.n` samples each with the [eval] sampling settings, scored by the
evaluation's rewards (with an [env]: `eval.n` episodes each of the environment, rewarded by it), summarized
by learner/evaluation/metrics.py; it prints one line per source and writes
`OUT/metrics.jsonl` (`eval/<source>/...`, keyed by the version) and `OUT/eval/<source>/v<N>.jsonl`. The
engine is vLLM where installed, else transformers (`rollout.backend`), on `run.device`.

What is evaluated: a folder with config.json is a model folder (version 0 unless told); a checkpoint
(RUN/checkpoints/step_N) or a run folder (its newest checkpoint) is exported to a temporary model folder
first, its version taken from the checkpoint, and a run folder's config.toml gives the defaults (its model
settings, rewards and [eval]).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import pathlib
import sys
import tempfile

import msgspec

from streamrl.engine.config import Config, ConfigError, build, read
from streamrl.engine.config.eval import DEMO_HELDOUT, EvalSource, reward_config, sampling, source_data
from streamrl.learner.evaluation.report import Evaluation, Sample, line

log = logging.getLogger("streamrl.eval")


class EvalInputError(ValueError):
    """What `streamrl eval` was given cannot be evaluated; the message names it and the fix."""


@dataclasses.dataclass(frozen=True)
class Target:
    """What is evaluated: a model folder (or a checkpoint to export into one), its version, its run's config."""

    path: pathlib.Path
    version: int
    checkpoint: pathlib.Path | None  # exported to a model folder before loading
    run_config: pathlib.Path | None  # the run's config.toml, the defaults


def resolve_target(given: str | pathlib.Path) -> Target:
    """A model folder, a checkpoint step folder or a run folder (its newest checkpoint) → a `Target`."""
    from streamrl.learner import checkpoint

    path = pathlib.Path(given).expanduser()
    if not path.exists():
        raise EvalInputError(f"{path} does not exist: give a model folder, a checkpoint (step_N) or a run folder")
    run = next((p for p in (path, path.parent, path.parent.parent) if (p / "config.toml").is_file()), None)
    if (path / "config.json").is_file():
        return Target(path, 0, None, None)
    try:
        step = checkpoint.resolve(path)
    except checkpoint.CheckpointError as e:
        raise EvalInputError(f"{path} is no model folder (no config.json) and {e}") from None
    version = checkpoint.read_meta(step).state.version
    return Target(step, version, step, run / "config.toml" if run else None)


def eval_config(target: Target, config: pathlib.Path | None, overrides: list[str], data: list[str]) -> Config:
    """The config: the run's (or `config`, or the defaults), the overrides, each `data` path a source of its
    own (named after its file), and the model path set to what is evaluated."""
    cfg = build(read(config or target.run_config), overrides)
    sources = list(cfg.eval.sources) + [EvalSource(name=_name(p), path=p) for p in data]
    if not sources:
        raise EvalInputError("nothing to evaluate on: give --data PATH (or [[eval.sources]] in the config)")
    names = [s.name for s in sources]
    if len(set(names)) < len(names):
        raise EvalInputError(f"two sources share a name in {names}: name each [[eval.sources]] entry apart")
    return msgspec.structs.replace(cfg, eval=msgspec.structs.replace(cfg.eval, sources=sources))


def _name(path: str) -> str:
    """A source's name from its path: `data/gsm8k_test.jsonl` → gsm8k_test, `reasoning_gym:leg_counting:50` →
    leg_counting."""
    if path == DEMO_HELDOUT:
        return "demo-heldout"
    prefix, sep, rest = path.partition(":")
    stem = rest.split(":")[0] if sep and not pathlib.Path(path).exists() else pathlib.Path(path).stem
    return "".join(c if c.isalnum() or c in "_.-" else "-" for c in stem) or "data"


async def evaluate_source(
    cfg: Config, source: EvalSource, prompts: list, engine, tokenizer, scorer, version: int, runner=None
) -> Evaluation:
    """One source at `version`: every prompt's `eval.n` samples generated together, scored in one call (as a
    node scores a chunk: rollout/evaluation.generate_and_score); with an [env] (`runner`), each prompt's
    `eval.n` episodes, rewarded by the environment (rollout/evaluation_episodes.py)."""
    from streamrl.rollout.evaluation import generate_and_score
    from streamrl.rollout.evaluation_episodes import run_episodes

    data = source_data(source, cfg.data)
    if runner is not None:
        records = await run_episodes(runner, tokenizer, prompts, data, cfg.eval.n)
    else:
        records = await generate_and_score(engine, tokenizer, scorer, prompts, data, sampling(cfg.eval, cfg.rollout))
    samples = [Sample.of(r, version, "local") for r in records]
    return Evaluation(source=source.name, version=version, n=cfg.eval.n, asked=len(prompts),
                      threshold=cfg.eval.pass_threshold, samples=samples)  # fmt: skip


async def _evaluate(cfg: Config, model_path: str, version: int, out: pathlib.Path) -> list[Evaluation]:
    from streamrl.engine.models import load_tokenizer
    from streamrl.engine.telemetry import MetricsSink
    from streamrl.rewards import build_scorer
    from streamrl.rollout.backends import build_backend, resolve_device
    from streamrl.rollout.evaluation_episodes import episode_runner
    from streamrl.rollout.evaluation_prompts import eval_prompts

    device = resolve_device(cfg.run.device)
    run_cfg = msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, path=model_path),
                                      rollout=sampling(cfg.eval, cfg.rollout))  # fmt: skip
    tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code)
    prompts = {s.name: eval_prompts(s, cfg, tokenizer) for s in cfg.eval.sources}  # a bad source: before the engine
    scorers = {
        s.name: build_scorer(reward_config(cfg.eval, cfg.reward), source_data(s, cfg.data).answer_column)
        for s in cfg.eval.sources
        if not cfg.env.name
    }  # fmt: skip  (a bad reward fails before the engine loads; an [env] rewards its episodes itself)
    engine = build_backend(run_cfg, device)
    sink = MetricsSink(out, msgspec.structs.replace(cfg.telemetry, prometheus_port=0))
    done, runner = [], None
    try:
        runner = episode_runner(run_cfg, engine, tokenizer) if cfg.env.name else None
        for source in cfg.eval.sources:
            ev = await evaluate_source(
                cfg, source, prompts[source.name], engine, tokenizer, scorers.get(source.name), version, runner
            )
            ev.write_samples(out)
            sink.log(version, ev.metrics())
            print(line(ev), flush=True)
            done.append(ev)
    finally:
        sink.close()
        await engine.close()
        for scorer in scorers.values():
            scorer.close()
        if runner is not None:
            runner.close()
    return done


def main(given: str, out: str, config: pathlib.Path | None, overrides: list[str], data: list[str]) -> int:
    """The command: 0 when every source was evaluated; 2 with one line on bad input."""
    from streamrl.engine.models import ModelLoadError
    from streamrl.learner.checkpoint import CheckpointError
    from streamrl.learner.export import ExportError
    from streamrl.ops.export import export_checkpoint
    from streamrl.rewards import RewardSpecError
    from streamrl.rollout.sources import PromptSourceError

    try:
        target = resolve_target(given)
        cfg = eval_config(target, config, overrides, data)
        folder = pathlib.Path(out or pathlib.Path("evals") / target.path.name)
        with tempfile.TemporaryDirectory(prefix="streamrl-eval-") as tmp:
            model = target.path
            if target.checkpoint is not None:
                model = export_checkpoint(target.checkpoint, pathlib.Path(tmp) / "model", merge=True)
            asyncio.run(_evaluate(cfg, str(model), target.version, folder))
    except (EvalInputError, ConfigError, CheckpointError, ExportError, ModelLoadError, PromptSourceError,
            RewardSpecError) as e:  # fmt: skip
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"samples and metrics in {folder}", flush=True)
    return 0
