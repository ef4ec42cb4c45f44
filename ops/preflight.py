"""Preflight: the mistakes that can be found before any process starts, found in seconds.

    report = preflight(cfg, roles=("learner", "rollout"))
    for problem in report.problems: print(problem)       # "error: data: data.path = ... does not exist; ..."
    exit(2 if report.errors else 0)

Each check reuses the code the roles themselves run (the model checks of engine/models.py, the row
judging of rollout/sources.py, reward resolution and signature checks of rewards/registry.py, the
vLLM rules of rollout/backends/vllm_support.py), so preflight and the node never disagree. Nothing here
starts an engine, loads weights or opens a socket; each reward is called once, on a few rows in a worker with the
run's deadline (rewards/trial.py). A check that needs what an
earlier one failed to load (the tokenizer, the model config) is skipped, not reported twice.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any, Literal

from streamrl.engine.config import Config
from streamrl.engine.config import rules as config_rules

ROLES = ("learner", "rollout")
SCAN_ROWS = 10_000  # rows judged (tokenized, ~60 us each on 2 cores) at most; the summary says when there are more


@dataclasses.dataclass(frozen=True, kw_only=True)
class Problem:
    """One finding: `message` is one line naming the problem and the fix."""

    check: str  # config, model, engine, data, reward, telemetry, gpu
    message: str
    level: Literal["error", "warning", "info"] = "error"  # only errors stop a command
    detail: str = ""  # a traceback, for --debug; empty when the message says it all

    def __str__(self) -> str:
        return f"{self.level}: {self.check}: {self.message}"


@dataclasses.dataclass
class Preflight:
    problems: list[Problem]
    seconds: dict[str, float]  # wall time of each check that ran
    mode: str = ""  # what run.mode = 'auto' comes to where the GPU check chose ('' elsewhere: async)

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.level == "error"]


@dataclasses.dataclass
class _Context:
    cfg: Config
    roles: frozenset[str]
    model_path: str = ""
    hf_config: Any = None  # set by the model check when the config loads
    tokenizer: Any = None  # likewise
    columns: list[str] | None = None  # reward column keywords, set by the data check
    rewards_resolve: bool = False  # set by the reward check: every reward resolved, so the trial can call them
    nodes: int = 1  # rollout nodes `streamrl run` starts (the GPU placement)
    mode: str = ""  # set by the GPU check: the mode run.mode = 'auto' comes to on a shared GPU


def _one_line(text: str) -> str:
    return " / ".join(line.strip() for line in str(text).strip().splitlines() if line.strip())


def _problem(check: str, message: str, level: str = "error", detail: str = "") -> Problem:
    return Problem(check=check, message=_one_line(message), level=level, detail=detail)


def check_config(ctx: _Context) -> list[Problem]:
    """Cross-section mistakes the typed config cannot see field by field: engine/config/rules.py, the rules
    the learner itself refuses to start on."""
    cfg = ctx.cfg
    found = config_rules.check(cfg, ctx.roles)
    out = [_problem("config", f.message, level=f.level) for f in found]
    return out


def check_model(ctx: _Context) -> list[Problem]:
    """The model folder: config.json, a known architecture, a tokenizer with eos; no weights are read."""
    from transformers import AutoConfig

    from streamrl.engine.models import ModelLoadError, default_tiny_model, load_tokenizer

    model = ctx.cfg.model
    ctx.model_path = model.path or str(default_tiny_model())
    try:
        ctx.tokenizer = load_tokenizer(ctx.model_path, model.trust_remote_code)  # checks the folder first
        ctx.hf_config = AutoConfig.from_pretrained(ctx.model_path, trust_remote_code=model.trust_remote_code)
    except ModelLoadError as e:
        return [_problem("model", f"model.path = {model.path or '<built-in tiny model>'}: {e}")]
    except (OSError, ValueError) as e:
        return [
            _problem(
                "model",
                f"model.path = {ctx.model_path}: transformers cannot load its config or tokenizer "
                f"({type(e).__name__}: {e}); re-save it with save_pretrained",
                detail=traceback.format_exc(),
            )
        ]
    return []


def check_engine(ctx: _Context) -> list[Problem]:
    """The rollout engine can serve this architecture and shape (vLLM's rules, without vLLM)."""
    cfg = ctx.cfg
    if cfg.rollout.backend != "vllm":
        return []
    if importlib.util.find_spec("vllm") is None:
        return [
            _problem(
                "engine",
                "rollout.backend = 'vllm' but vllm is not installed: install it (CPU: pip install "
                "'streamrl[cpu]'; GPU: pip install vllm) or set rollout.backend = 'hf'",
            )
        ]
    if ctx.hf_config is None:
        return []
    from streamrl.rollout.backends import resolve_device
    from streamrl.rollout.backends.vllm_support import support_problems

    device = resolve_device(cfg.run.device)
    problems = support_problems(ctx.hf_config, cfg.model.max_model_len, device)
    return [_problem("engine", f"vLLM cannot serve {ctx.model_path} on {device}: {p}") for p in problems]


def check_lora(ctx: _Context) -> list[Problem]:
    """[lora] against the model (targets it has, a rank that fits: a meta-device model, no weights read) and
    the engines: PEFT for the learner and hf nodes, LoRA support in vLLM for its architecture."""
    cfg = ctx.cfg
    if not cfg.lora.enabled:
        return []
    out = []
    if importlib.util.find_spec("peft") is None and ("learner" in ctx.roles or cfg.rollout.backend == "hf"):
        out.append(_problem("lora", "lora.enabled = true needs peft, which is not installed: pip install peft"))
    if ctx.hf_config is not None:
        from streamrl.engine.lora import LoraError, spec_for

        try:
            spec_for(cfg.lora, ctx.hf_config)
        except LoraError as e:
            out.append(_problem("lora", str(e)))
    if "rollout" in ctx.roles and cfg.rollout.backend == "vllm" and ctx.hf_config is not None:
        from streamrl.rollout.backends.vllm_support import lora_problem

        why = lora_problem(ctx.hf_config)
        if why:
            out.append(_problem("lora", f"lora.enabled = true with rollout.backend = 'vllm': {why}; use "
                                "rollout.backend = 'hf' (PEFT adapters) or set lora.enabled = false"))  # fmt: skip
    return out


def check_data(ctx: _Context) -> list[Problem]:
    """The prompt source exists, reads, and has usable rows (as the node judges them); counts the rest."""
    from streamrl.rewards.call import column_names
    from streamrl.rollout.sources import PromptSourceError, scan

    if ctx.tokenizer is None:
        return []
    data = ctx.cfg.data
    try:
        tally = scan(data, ctx.tokenizer, limit=SCAN_ROWS, seed=ctx.cfg.run.seed)
    except PromptSourceError as e:
        return [_problem("data", str(e))]
    except Exception as e:  # noqa: BLE001 - a reader's own error (pyarrow, datasets): name it
        return [
            _problem(
                "data",
                f"data.path = {data.path} cannot be read: {type(e).__name__}: {e}",
                detail=traceback.format_exc(),
            )
        ]
    if tally.usable == 0:  # the rewards' columns stay unknown: this is the one mistake to report
        return [_problem("data", f"no usable prompt: {tally.summary()}; fix: {tally.fix()}")]
    ctx.columns = column_names(tally.columns, data.answer_column)
    level = "warning" if tally.usable < tally.judged else "info"
    return [_problem("data", tally.summary(), level=level)]


def check_rewards(ctx: _Context) -> list[Problem]:
    """Every reward resolves (imports) and accepts the keywords it will be called with."""
    from streamrl.engine.models import ModelLoadError, check_model_folder
    from streamrl.rewards.registry import REWARD_MODEL, RewardSpecError, check_signature, resolve

    reward, out = ctx.cfg.reward, []
    if ctx.cfg.env.name:  # the environment's step rewards replace reward.functions: none is called
        return []
    for spec in reward.functions:
        if spec == REWARD_MODEL:
            if not reward.model.path:
                out.append(f"reward {REWARD_MODEL!r} needs reward.model.path = '<HF folder of the reward model>'")
                continue
            try:
                check_model_folder(reward.model.path)
            except ModelLoadError as e:
                out.append(f"reward.model.path = {reward.model.path}: {e}")
            continue
        try:
            check_signature(resolve(spec, reward), spec, ctx.columns)
        except RewardSpecError as e:
            out.append(str(e))
    ctx.rewards_resolve = not out and ctx.columns is not None
    return [_problem("reward", m) for m in out]


def check_reward_trial(ctx: _Context) -> list[Problem]:
    """Each reward called once on the first prompts with dummy completions, in a worker with the run's deadline
    (rewards/trial.py): one that raises, breaks the contract or times out stops the run before it starts."""
    from streamrl.rewards.trial import trial, trial_batch

    if ctx.cfg.env.name or not ctx.rewards_resolve:
        return []  # no reward.functions called (an environment's rewards), or the reward check said why not
    cfg = ctx.cfg
    batch = trial_batch(cfg.data, ctx.tokenizer, cfg.run.seed)
    found = trial(cfg.reward, batch, f"data.path = {cfg.data.path}" if cfg.data.path else "the demo task")
    return [_problem("reward", message, level=level) for level, message in found]


def check_env(ctx: _Context) -> list[Problem]:
    """[env]: what a node resolves before its first episode (rollout/envs/check.py): the environment class,
    its tools, its constructor's arguments, skyrl-gym's environment ids."""
    from streamrl.rollout.envs.check import problems
    from streamrl.rollout.sources import read_rows

    path = ctx.cfg.data.path if ctx.columns is not None else ""  # unreadable data: the data check said so

    def rows() -> list:
        return read_rows(path)[:SCAN_ROWS] if path else []

    return [_problem("env", m) for m in problems(ctx.cfg.env, rows)]


def check_telemetry(ctx: _Context) -> list[Problem]:
    """Optional sinks that are on but cannot work (the run goes on without them: a warning)."""
    problem = tensorboard_problem(ctx.cfg.telemetry.tensorboard)
    return [_problem("telemetry", problem, level="warning")] if problem else []


def check_disk(ctx: _Context) -> list[Problem]:
    """The run folder's disk has room for what the run will write (ops/disk.py): a warning when it does not."""
    from streamrl.ops import disk

    if ctx.hf_config is None:
        return []
    problem = disk.check(ctx.cfg, ctx.hf_config, ctx.model_path)
    return [_problem("disk", problem, level="warning")] if problem else []


def tensorboard_problem(enabled: bool = True) -> str:
    """Why TensorBoard events would not be written ('' when they would); also a `doctor` row."""
    if enabled and importlib.util.find_spec("tensorboard") is None:
        return (
            "telemetry.tensorboard = true but tensorboard is not installed, so no events are written: "
            "pip install tensorboard, or set telemetry.tensorboard = false"
        )
    return ""


def check_gpu_placement(ctx: _Context) -> list[Problem]:
    """`streamrl run` on GPUs: the placement can be honoured and a GPU's shares fit (ops/preflight_gpu.py)."""
    from streamrl.ops.preflight_gpu import check_gpu_placement as check

    return check(ctx)


def check_eval(ctx: _Context) -> list[Problem]:
    """[eval]: its sources read and hold prompts, its rewards resolve, its prompts are not training prompts
    (rollout/evaluation_prompts.check)."""
    from streamrl.rollout.evaluation_prompts import check, training_texts

    if ctx.tokenizer is None or not ctx.cfg.eval.enabled:
        return []
    texts = training_texts(ctx.cfg, ctx.tokenizer, SCAN_ROWS)
    return [_problem("eval", message, level=level) for level, message in check(ctx.cfg, ctx.tokenizer, texts)]


# (name, roles that need it, check); in order: later checks read what earlier ones loaded
CHECKS: list[tuple[str, frozenset[str], Callable[[_Context], list[Problem]]]] = [
    ("config", frozenset(ROLES), check_config),
    ("model", frozenset(ROLES), check_model),
    ("engine", frozenset({"rollout"}), check_engine),
    ("lora", frozenset(ROLES), check_lora),
    ("data", frozenset({"rollout"}), check_data),
    ("reward", frozenset({"rollout"}), check_rewards),
    ("reward trial", frozenset({"rollout"}), check_reward_trial),
    ("env", frozenset({"rollout"}), check_env),
    ("eval", frozenset({"rollout"}), check_eval),
    ("telemetry", frozenset({"learner"}), check_telemetry),
    ("disk", frozenset({"learner"}), check_disk),
    ("gpu", frozenset(ROLES), check_gpu_placement),
]


def preflight(cfg: Config, roles: Iterable[str] = ROLES, nodes: int = 1) -> Preflight:
    """Run every check the `roles` need (a subset of ROLES) and return what they found, with timings;
    `nodes`: the rollout nodes `streamrl run` starts (their GPUs are checked)."""
    roles = frozenset(roles)
    if not roles or roles - set(ROLES):
        raise ValueError(f"preflight roles {sorted(roles)}; give a non-empty subset of {list(ROLES)}")
    ctx = _Context(cfg=cfg, roles=roles, nodes=nodes)
    problems: list[Problem] = []
    seconds: dict[str, float] = {}
    for name, needed_by, check in CHECKS:
        if not roles & needed_by:
            continue
        start = time.perf_counter()
        try:
            problems += check(ctx)
        except Exception as e:  # noqa: BLE001 - a check's own failure is a finding, never a crash
            problems.append(_problem(name, f"{type(e).__name__}: {e}", detail=traceback.format_exc()))
        seconds[name] = time.perf_counter() - start
    return Preflight(problems=problems, seconds=seconds, mode=ctx.mode)


def report(found: Preflight, debug: bool = False, err=None) -> int:
    """Print what preflight found, one line per problem (and each one's traceback under `debug`);
    the command's exit status: 2 when there was an error (nothing was started), else 0."""
    import sys

    from rich.console import Console
    from rich.markup import escape

    console = Console(file=err or sys.stderr, highlight=False, soft_wrap=True, emoji=False)  # `:zzz:` in a path is text
    colours = {"error": "red", "warning": "yellow", "info": "dim"}
    for problem in found.problems:
        console.print(f"[{colours[problem.level]}]{problem.level}:[/] {problem.check}: {escape(problem.message)}")
        if debug and problem.detail:
            console.print(escape(problem.detail.rstrip()), style="dim")
    if not found.errors:
        return 0
    seconds = sum(found.seconds.values())
    more = "" if debug or not any(p.detail for p in found.errors) else "; --debug shows the tracebacks"
    errors = f"{len(found.errors)} error" + ("s" if len(found.errors) > 1 else "")
    console.print(f"preflight: {errors} in {seconds:.1f} s; nothing was started{more}")
    return 2
