"""push → report (learner/step_outcome.py) without a run: a step's record, from real parts (the registry on
a real control socket, the intake on a real trajectory socket, the publisher, the metrics sink). Other
parts' figures join each record through `add_figures` (the seam evaluation and a critic report through);
a resumed run's figures go into the first record only; the node count is the registry's."""

from __future__ import annotations

import json

import pytest
import torch

from streamrl.engine.config import build
from streamrl.engine.control import ControlServer
from streamrl.engine.messages import Trajectory
from streamrl.engine.telemetry import EventLog, MetricsSink
from streamrl.engine.transport import TrajectoryReceiver
from streamrl.learner.intake import Intake
from streamrl.learner.nodes import NodeRegistry
from streamrl.learner.publisher import Publisher
from streamrl.learner.selection import Selection
from streamrl.learner.step_outcome import StepOutcome

METRICS = {"loss": 0.5, "tokens_per_s": 10.0, "staleness_mean": 0.0, "skipped": 0.0}


def sample(i: int, reward: float) -> Trajectory:
    return Trajectory(sample_id=f"g:{i}", group_id="g", node_id="n", seq=i, prompt_ids=[1, 2],
                      completion_ids=[3, 4, 5], behavior_logprobs=[-1.0] * 3, reward=reward, policy_version=0,
                      group_size=2, finish_reason="stop")  # fmt: skip


@pytest.fixture
def outcome(tmp_path):
    cfg = build({}, [f"run.dir='{tmp_path}'", "run.name='r'", "telemetry.tensorboard=false"])
    registry = NodeRegistry(ControlServer(), welcome=None)
    intake = Intake(TrajectoryReceiver(), ledger=None, alarm=None)  # the report reads no ledger
    publisher = Publisher(cfg, registry, torch.device("cpu"))
    sink = MetricsSink(cfg.run.path, cfg.telemetry)
    made = StepOutcome(cfg, intake, registry, publisher, lambda: 7, sink, EventLog(cfg.run.path, "learner"),
                       first_figures={"resume/rolled_back_samples": 3})  # fmt: skip
    yield made
    sink.close()
    intake.close()
    registry.server.close()


def records(outcome: StepOutcome) -> list[dict]:
    return [json.loads(line) for line in outcome.sink.path.read_text().splitlines()]


def step(outcome: StepOutcome, n: int) -> None:
    group = [sample(0, 0.0), sample(1, 1.0)]
    selection = Selection(groups=[group], rewards=[[0.0, 1.0]], train=group, advantages=[-1.0, 1.0])
    outcome.report(n, 6, dict(METRICS), {"wait_s": 1.0, "train_s": 3.0}, started=0.0, selection=selection)


def test_other_parts_figures_join_every_record_and_a_resumes_only_the_first(outcome):
    calls = []
    outcome.add_figures(lambda: calls.append(1) or {"eval/math/accuracy": 0.25})
    step(outcome, 1)
    step(outcome, 2)
    first, second = records(outcome)
    assert first["eval/math/accuracy"] == second["eval/math/accuracy"] == 0.25 and len(calls) == 2
    assert first["resume/rolled_back_samples"] == 3 and "resume/rolled_back_samples" not in second


def test_the_record_has_the_steps_rewards_time_and_the_registrys_node_count(outcome):
    step(outcome, 1)
    (record,) = records(outcome)
    assert record["nodes"] == 0 and record["evicted"] == 0  # no node registered
    assert record["reward/mean"] == 0.5 and record["loss"] == 0.5
    # idle: 1 s waiting of 4 s; 2 samples of 2 + 3 - 1 = 4 positions trained in 3 s: 8 / 3 tokens/s
    assert record["time/idle_fraction"] == 0.25 and record["train_tokens_per_s"] == pytest.approx(8 / 3)
    assert record["refused"] == 0 and record["gaps"] == 0
