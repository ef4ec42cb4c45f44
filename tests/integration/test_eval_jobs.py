"""Evaluation jobs through a real Redis: nodes (EvalWorker) take chunks of a posted version, generate them at
that version, hold their swap until the version's evaluation is done; a node that dies holding a chunk loses
it to the other node once its lease ends; the learner (Evaluations) reports complete or incomplete with its
coverage; the training books are not touched. The engine is a stand-in (FakeEngine) so the protocol runs in
seconds; tests/integration/test_eval_run.py drives it with vLLM nodes in a real run."""

from __future__ import annotations

import asyncio
import json

import pytest

from streamrl.engine.config import build
from streamrl.engine.ledger.eval_jobs import EvalJobs
from streamrl.engine.models import load_tokenizer
from streamrl.engine.redis_server import connect
from streamrl.learner.evaluation.coordinator import Evaluations
from streamrl.ops.eval_status import eval_lines
from streamrl.rollout.backends.protocol import Completion
from streamrl.rollout.evaluation import EvalWorker

LEASE_S = 0.6


class FakeEngine:
    """Replaces a generation backend: each completion is the letter 'a' repeated `version + 1` times (tokens
    stamped with the live version); `update_weights` awaits `before_swap` as the real backends do, after
    staging and before the swap. `hang` makes generation never end (a node that dies mid-chunk)."""

    def __init__(self, tokenizer, hang: bool = False):
        self.policy_version, self.tokenizer, self.hang = 0, tokenizer, hang
        self.before_swap = None
        self.generated_at: list[int] = []

    async def generate(self, prompt_ids, n, max_tokens, sampling=None):
        if self.hang:
            await asyncio.Event().wait()
        version = self.policy_version
        await asyncio.sleep(0.01)
        ids = self.tokenizer.encode("a" * (version + 1), add_special_tokens=False)
        self.generated_at.append(version)
        return [Completion(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop",
                           token_versions=[version] * len(ids)) for _ in range(n)]  # fmt: skip

    async def update_weights(self, version: int) -> None:
        if self.before_swap is not None:
            await self.before_swap()
        self.policy_version = version


def _cfg(run_dir, n_prompts=10):
    return build({}, [f"run.dir='{run_dir}'", "eval.sources=[{name='held', path='demo:heldout'}]",
                      f"eval.max_prompts={n_prompts}", "eval.n=2", "reward.workers=0",
                      "eval.pass_threshold=0.9"])  # fmt: skip


@pytest.fixture
def jobs(redis_url, ledger_run):
    client = connect(redis_url)
    yield EvalJobs(client, ledger_run)
    client.close()


def test_two_nodes_evaluate_a_version_exactly_and_hold_the_swap(jobs, tiny_model, tmp_path):
    cfg = _cfg(tmp_path)
    tok = load_tokenizer(tiny_model)
    engines = [FakeEngine(tok), FakeEngine(tok)]
    workers = [EvalWorker(cfg, f"n{i}", e, tok, jobs, LEASE_S) for i, e in enumerate(engines)]
    for engine, worker in zip(engines, workers):
        engine.before_swap = worker.before_swap
    evaluations = Evaluations(cfg, jobs, cfg.run.path, last_version=1)

    async def scenario():
        evaluations.before_publish(0, 0)
        stopping = asyncio.Event()
        watchers = [asyncio.create_task(w.watch(stopping)) for w in workers]
        await asyncio.sleep(0.05)
        # version 1 arrives while version 0 is evaluated: no node swaps before its evaluation is done
        await asyncio.gather(*(e.update_weights(1) for e in engines))
        assert jobs.finished(0)
        stopping.set()
        await asyncio.gather(*watchers)

    asyncio.run(scenario())
    assert all(v == 0 for e in engines for v in e.generated_at)  # nothing generated at 1: no job for it
    metrics = evaluations.collect()
    (ev,) = evaluations.reported
    # every completion is all 'a': the demo reward (the share of 'a') 1.0, above the threshold 0.9
    assert metrics["eval/held/pass@1"] == 1.0 and metrics["eval/held/version"] == 0.0
    assert ev.version == 0 and ev.summary()["complete"] == 1.0 and ev.summary()["prompts_done"] == 10
    lines = [json.loads(x) for x in (cfg.run.path / "eval" / "held" / "v0.jsonl").read_text().splitlines()]
    assert len(lines) == 20 and all(x["version"] == 0 for x in lines)  # every sample at the version reported
    assert {x["node"] for x in lines} <= {"n0", "n1"} and sum(w.chunks_done for w in workers) == 3  # 4 + 4 + 2
    assert jobs.progress(0).state == "complete" and jobs.open_versions() == set()
    assert not jobs.client.keys("streamrl:*:counts")  # the training books were never written


def test_a_chunk_of_a_dead_node_is_taken_over(jobs, tiny_model, tmp_path):
    cfg = _cfg(tmp_path, n_prompts=8)
    tok = load_tokenizer(tiny_model)
    dead, alive = FakeEngine(tok, hang=True), FakeEngine(tok)
    dying = EvalWorker(cfg, "dead", dead, tok, jobs, LEASE_S)
    living = EvalWorker(cfg, "alive", alive, tok, jobs, LEASE_S)
    evaluations = Evaluations(cfg, jobs, cfg.run.path, last_version=1)

    async def scenario():
        evaluations.before_publish(0, 0)
        stopping = asyncio.Event()
        hung = asyncio.create_task(dying.watch(stopping))
        while jobs.progress(0).chunks < 0 or jobs.client.llen(jobs._key(0, "queue")) == 2:
            await asyncio.sleep(0.02)  # the dying node laid the job out and took its first chunk
        hung.cancel()  # it dies holding the chunk: its lease runs out
        await living.before_swap()  # the other node's swap waits for the evaluation, taking the chunk over
        stopping.set()

    asyncio.run(scenario())
    evaluations.collect()
    (ev,) = evaluations.reported
    assert ev.summary()["complete"] == 1.0 and living.chunks_done == 2


def test_an_evaluation_no_node_can_finish_is_reported_incomplete(jobs, ledger_run, tiny_model, tmp_path):
    cfg = _cfg(tmp_path, n_prompts=8)
    tok = load_tokenizer(tiny_model)
    evaluations = Evaluations(cfg, jobs, cfg.run.path, last_version=1)
    evaluations.before_publish(0, 0)
    worker = EvalWorker(cfg, "n0", FakeEngine(tok), tok, jobs, LEASE_S)
    jobs.lay_out(0, {"held": 8})
    assert eval_lines(jobs.client, ledger_run) == ["eval v0: open, 0/2 chunks in (held 8 prompts)"]  # status
    chunk = jobs.claim(0, "n0", LEASE_S)  # one chunk done, the other never taken (no node left at version 0)
    asyncio.run(worker._chunk(chunk))
    metrics = evaluations.finish(timeout_s=0.3)
    (ev,) = evaluations.reported
    assert ev.summary() == {"prompts_done": 4.0, "prompts_asked": 8.0, "samples": 8.0, "complete": 0.0}
    assert metrics["eval/held/complete"] == 0.0 and "eval/held/pass@1" not in metrics  # no mean over the covered half
    assert jobs.progress(0).state == "incomplete"
    assert eval_lines(jobs.client, ledger_run) == ["eval v0: incomplete, held 4/8 prompts"]
