"""Mini-batch PPO, the reference KL and the entropy bonus on the real Trainer, a real tiny model and real
packed batches (one-rank gloo group: the FSDP2 path every rank count runs)."""

import math

import pytest
import torch

from streamrl.engine.config import Config, ConfigError, LearnerConfig, LossConfig, build
from streamrl.engine.messages import Trajectory
from streamrl.learner import parallel
from streamrl.learner.batching import pack
from streamrl.learner.reference import build_reference
from streamrl.learner.train_step import Trainer


@pytest.fixture(scope="module")
def device():
    device = parallel.init_distributed()
    yield device
    parallel.shutdown()


def make_trainer(tiny_model, device, loss: LossConfig, learner: LearnerConfig, ref=None) -> Trainer:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="sdpa")
    return Trainer(parallel.wrap_model(lm, learner, device), loss, learner, device, ref_model=ref)


def batch(n: int = 8, budget: int = 64, behavior: float = -6.0):
    trajs = [
        Trajectory(
            sample_id=f"s{i}",
            group_id=f"g{i // 4}",
            node_id="n",
            seq=i,
            prompt_ids=[3, 4 + i, 5],
            completion_ids=[10 + i, 11, 12 + 2 * i, 13],
            behavior_logprobs=[behavior] * 4,
            reward=0.0,
            policy_version=0,
        )
        for i in range(n)
    ]
    advantages = [(-1.0) ** i * (1.0 + 0.25 * i) for i in range(n)]
    return pack(trajs, advantages, token_budget=budget)


def test_two_updates_clip_on_the_second(tiny_model, device):
    """mini_batches = 2: pi_prox is the starting weights, so the first update has ratio exactly 1 (no
    clip, ppo_kl 0) and the second, after one AdamW update at lr 0.05, clips and has ppo_kl != 0."""
    learner = LearnerConfig(lr=5e-2, mini_batches=2)
    trainer = make_trainer(tiny_model, device, LossConfig(), learner)
    mbs = batch()
    assert len(mbs) == 1  # one micro-batch of 8 x 6 positions: the split slices it at sequence boundaries
    metrics = trainer.step(mbs)
    assert trainer.version == 1 and metrics["version"] == 1.0 and metrics["updates"] == 2.0
    assert metrics["update/1/ppo_kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["update/1/clip_fraction"] == 0.0
    assert metrics["update/2/clip_fraction"] > 0.0 and abs(metrics["update/2/ppo_kl"]) > 1e-4
    # each update is normalised by its own mini-batch: 4 sequences x 4 loss tokens each
    assert metrics["update/1/normalizer"] == metrics["update/2/normalizer"] == 16.0
    assert metrics["update/1/tokens"] + metrics["update/2/tokens"] == metrics["tokens"] == 32.0
    # the step's clip fraction is over all its tokens: (0 x 16 + c2 x 16) / 32
    assert metrics["clip_fraction"] == pytest.approx(metrics["update/2/clip_fraction"] / 2)
    assert metrics["loss"] == pytest.approx((metrics["update/1/loss"] + metrics["update/2/loss"]) / 2)
    assert metrics["skipped"] == 0.0 and math.isfinite(metrics["grad_norm"])


def test_one_update_saves_the_proximal_forward_and_two_pay_one_per_micro_batch(tiny_model, device):
    counts = {}
    for updates in (1, 2):
        trainer = make_trainer(tiny_model, device, LossConfig(), LearnerConfig(mini_batches=updates))
        calls = []
        handle = trainer.model.register_forward_pre_hook(lambda *_, calls=calls: calls.append(torch.is_grad_enabled()))
        try:
            metrics = trainer.step(batch(budget=12))  # four micro-batches of 2 x 6 positions
        finally:
            handle.remove()
        counts[updates] = calls
        assert ("update/1/loss" in metrics) == (updates == 2)
    assert counts[1] == [True] * 4  # 4 micro-batches, trained once, no extra forward
    assert counts[2] == [False] * 4 + [True] * 4  # the no-grad proximal pass, then 2 updates of 2 micro-batches


def test_epochs_pass_over_the_mini_batches_against_one_proximal_policy(tiny_model, device):
    """mini_batches = 2, epochs = 2: four updates, one proximal pass (the weights the step starts from) for all
    of them; the second pass over mini-batch 1 sees it moved (its ratio clipped, ppo_kl > 0)."""
    trainer = make_trainer(tiny_model, device, LossConfig(), LearnerConfig(lr=5e-2, mini_batches=2, epochs=2))
    calls = []
    handle = trainer.model.register_forward_pre_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    try:
        metrics = trainer.step(batch(budget=12))  # four micro-batches of 2 x 6 positions: two per mini-batch
    finally:
        handle.remove()
    assert calls == [False] * 4 + [True] * 8  # one proximal pass, then 2 epochs x 2 mini-batches x 2 micro-batches
    assert trainer.version == 1 and metrics["updates"] == 4.0 and "update/4/loss" in metrics
    assert metrics["update/1/ppo_kl"] == pytest.approx(0.0, abs=1e-6) and metrics["update/1/clip_fraction"] == 0.0
    assert metrics["update/3/ppo_kl"] > 1e-4 and metrics["update/3/clip_fraction"] > 0.0  # mini-batch 1 again
    assert metrics["update/1/normalizer"] == metrics["update/3/normalizer"] == 16.0
    assert metrics["tokens"] == 32.0  # the batch counted once, however many passes saw it


def test_an_update_without_gradient_is_skipped_and_the_others_train(tiny_model, device):
    """Mini-batch 1 holds only zero advantages: its update is skipped (no momentum step), mini-batch 2's is
    taken, and the step moves the version once."""
    trainer = make_trainer(tiny_model, device, LossConfig(), LearnerConfig(lr=5e-2, mini_batches=2))
    mbs = batch(budget=12)  # four equal micro-batches: dealt 0, 2 to mini-batch 1 and 1, 3 to mini-batch 2
    for mb in mbs[::2]:
        mb.advantages = torch.zeros_like(mb.advantages)
    before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    metrics = trainer.step(mbs)
    assert metrics["update/1/grad_norm"] == 0.0 and metrics["update/1/skipped"] == 1.0
    assert metrics["update/2/skipped"] == 0.0 and metrics["updates"] == 1.0 and metrics["skipped"] == 0.0
    assert metrics["skipped_no_gradient"] == 1.0 and trainer.version == 1
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def test_kl_to_the_reference_is_zero_at_the_start_and_grows(tiny_model, device):
    cfg = build({"model": {"path": tiny_model}, "loss": {"kl_coef": 0.5}, "learner": {"lr": 5e-2}})
    trainer = make_trainer(tiny_model, device, cfg.loss, cfg.learner)
    trainer.ref_model = build_reference(cfg, device, torch.float32, trainer.model)
    ref_before = {k: v.detach().clone() for k, v in trainer.ref_model.state_dict().items()}
    first = trainer.step(batch())
    second = trainer.step(batch())
    assert first["ref_kl"] == pytest.approx(0.0, abs=1e-7)  # the reference is the weights the run starts from
    assert second["ref_kl"] > 1e-4
    assert not trainer.ref_model.training and all(not p.requires_grad for p in trainer.ref_model.parameters())
    assert all(torch.equal(ref_before[k], v) for k, v in trainer.ref_model.state_dict().items())


def test_a_reference_that_cannot_be_built_is_refused_naming_the_fields(tiny_model, device, tmp_path):
    from streamrl.engine.models import make_tiny_model

    assert build_reference(Config(), device, torch.float32, None) is None  # kl_coef = 0: none built
    policy = make_trainer(tiny_model, device, LossConfig(), LearnerConfig()).model
    missing = build({"loss": {"kl_coef": 0.1, "reference_path": str(tmp_path / "nope")}})
    with pytest.raises(ConfigError, match=r"loss.kl_coef = 0.1 needs a reference model, but loss.reference_path = "):
        build_reference(missing, device, torch.float32, policy)
    in_reward = build(
        {"loss": {"preset": "ppo", "reference_path": str(tmp_path / "nope")}, "critic": {"kl_in_reward": 0.2}}
    )
    with pytest.raises(ConfigError, match=r"critic.kl_in_reward = 0.2 needs .* or critic.kl_in_reward = 0$"):
        build_reference(in_reward, device, torch.float32, policy)  # its own field named, and its own fix
    other = make_tiny_model(tmp_path / "other", vocab_size=300)
    wrong = build({"model": {"path": tiny_model}, "loss": {"kl_coef": 0.1, "reference_path": str(other)}})
    with pytest.raises(ConfigError, match="has a vocabulary of 300 tokens, the policy 512"):
        build_reference(wrong, device, torch.float32, policy)


def test_the_entropy_bonus_raises_the_entropy(tiny_model, device):
    """All advantages 0: the only gradient is the entropy bonus's, so three steps raise the policy entropy
    (towards ln 512 = 6.238, the uniform distribution over the tiny vocabulary; lr 1e-3 keeps AdamW's first
    steps from overshooting it)."""
    trainer = make_trainer(tiny_model, device, LossConfig(entropy_coef=1.0), LearnerConfig(lr=1e-3))
    mbs = batch()
    for mb in mbs:
        mb.advantages = torch.zeros_like(mb.advantages)
    entropies = [trainer.step(mbs)["entropy"] for _ in range(3)]
    assert entropies[0] < entropies[1] < entropies[2] < math.log(512)
    plain = make_trainer(tiny_model, device, LossConfig(), LearnerConfig(lr=1e-3))
    assert plain.step(mbs)["grad_norm"] == 0.0  # without the bonus the same batch has no gradient at all


@pytest.fixture(scope="module")
def two_ranks(tiny_model, tmp_path_factory, torchrun) -> dict:
    """One torchrun of minibatch_ranks_worker on two CPU ranks, a step of 2 and one of 3 updates: {updates: out};
    and a PPO step with an adaptive KL in the reward: {"ppo": every rank's metrics and beta}."""
    import pathlib

    worker = pathlib.Path(__file__).with_name("minibatch_ranks_worker.py")
    out = tmp_path_factory.mktemp("two-ranks") / "out.pt"
    output = torchrun(2, worker, tiny_model, out, "2,3")
    assert "terminate called" not in output
    return torch.load(out, weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("updates", [2, 3])
def test_updates_on_two_ranks_with_unequal_shares(two_ranks, updates):
    """Two CPU ranks (torchrun, gloo) whose shares split into mini-batches differently (minibatch_ranks_worker's
    doc): the step ends on both (no rank waits in a collective the other skipped), with the same metrics."""
    out = two_ranks[updates]
    (a, b) = out["ranks"]
    assert (a["micro_batches"], b["micro_batches"]) == (2, 1)
    a_metrics = {k: v for k, v in a["metrics"].items() if k != "step_seconds"}
    assert a_metrics == {k: v for k, v in b["metrics"].items() if k != "step_seconds"}
    m = a_metrics
    assert out["version"] == 1 and m["updates"] == updates and m["skipped"] == 0.0
    # the batch's 8 completions hold 47 loss tokens; each update is normalised by its own share of them
    assert sum(m[f"update/{u}/normalizer"] for u in range(1, updates + 1)) == m["normalizer"] == m["tokens"] == 47
    assert m["update/1/ppo_kl"] == pytest.approx(0.0, abs=1e-6) and m["update/1/ref_kl"] == pytest.approx(0.0, abs=1e-6)
    assert m[f"update/{updates}/clip_fraction"] > 0.0 and m[f"update/{updates}/ref_kl"] > 0.0


@pytest.mark.slow
def test_the_adaptive_kl_coefficient_is_one_over_both_ranks(two_ranks):
    """The PPO step of minibatch_ranks_worker (rank 0: 6 completions, rank 1: 2): the KL in the reward is the mean
    over all 8 completions, reduced once, so both ranks report it alike and move beta the same, by n = 8."""
    (a, b) = two_ranks["ppo"]
    assert a["metrics"]["critic/reward_kl"] == b["metrics"]["critic/reward_kl"]
    assert a["metrics"]["critic/reward_kl_coef"] == b["metrics"]["critic/reward_kl_coef"] == 0.05
    error = min(max(a["metrics"]["critic/reward_kl"] / 0.01 - 1.0, -0.2), 0.2)
    assert a["kl_coef"] == b["kl_coef"] == 0.05 * (1.0 + error * 8 / 40)  # not 6 / 40 or 2 / 40: every rank's
    assert error != 0.0  # it moved (positive control)


@pytest.mark.slow
def test_a_lora_reference_is_the_policys_base_on_two_ranks(two_ranks):
    """minibatch_ranks_worker's LoRA step: sharded over two ranks, the reference is the policy with its adapters
    off (no second model), which after the step still gives a reference built from model.path's logprobs while
    the policy's have moved; the KL is 0 on the first update and grows on the second, alike on both ranks."""
    (a, b) = two_ranks["lora"]
    assert a["reference"] == b["reference"] == "BaseReference"
    assert a["base_gap"] < 1e-5 and b["base_gap"] < 1e-5
    assert a["policy_gap"] > 1e-3 and b["policy_gap"] > 1e-3  # positive control: the adapters moved
    m = {k: v for k, v in a["metrics"].items() if k != "step_seconds"}
    assert m == {k: v for k, v in b["metrics"].items() if k != "step_seconds"}
    assert m["skipped"] == 0.0 and m["update/1/ref_kl"] == pytest.approx(0.0, abs=1e-6) and m["update/2/ref_kl"] > 0.0
