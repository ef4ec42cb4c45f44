"""The critic in the learner step, on the tiny model, one rank: its values make per-token advantages, it trains
toward the returns on the same micro-batches, the actor waits during its warm-up, micro-batching does not
change the value loss, and REINFORCE++ needs no value model. In a checkpoint (the same DCP path as many
ranks) its weights and AdamW state come back bit-exact and training goes on as if never stopped; `streamrl
export --critic` writes a value model that transformers loads as a one-label sequence classifier."""

import random

import pytest
import torch

from streamrl.engine.config import LearnerConfig, LossConfig, build
from streamrl.engine.config.critic import CriticConfig
from streamrl.engine.messages import Trajectory
from streamrl.learner import checkpoint, parallel
from streamrl.learner.batching import pack
from streamrl.learner.critic.model import load_value_net, wrap_value_model
from streamrl.learner.critic.trainer import Shaper, _inputs, build_shaper
from streamrl.learner.train_step import Trainer
from streamrl.ops.export import export_checkpoint

LEARNER = LearnerConfig(lr=1e-3)
LOSS = LossConfig(advantage="gae", aggregation="token")
CRITIC = CriticConfig(lr=1e-2)
WARMING = CriticConfig(lr=1e-2, warmup_steps=1)
CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def process_group():
    parallel.init_distributed()
    yield
    parallel.shutdown()


def trainer(model_dir, critic=CRITIC, loss=LOSS):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    value = wrap_value_model(load_value_net(str(model_dir)), LEARNER, CPU) if loss.advantage == "gae" else None
    return Trainer(parallel.wrap_model(lm, LEARNER, CPU), loss, LEARNER, CPU, shaper=Shaper(value, critic, loss, CPU))


def samples(seed=0, n=4):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = 1 + i  # completions of 1..n tokens: a one-token completion among them
        out.append(
            Trajectory(
                sample_id=f"s{seed}-{i}",
                group_id=f"g{i}",
                node_id="n",
                seq=i,
                prompt_ids=[rng.randrange(3, 500) for _ in range(3)],
                completion_ids=[rng.randrange(3, 500) for _ in range(length)],
                behavior_logprobs=[-6.0] * length,
                reward=float(i % 2),
                policy_version=0,
            )
        )
    return out


def test_new_head_values_start_at_zero_and_gae_is_the_reward(tiny_model):
    t = trainer(tiny_model, critic=CriticConfig(lam_actor=1.0))
    mb = pack(samples(), [0.0, 1.0, 0.0, 1.0], token_budget=64)[0]
    assert torch.count_nonzero(t.shaper.values(mb)) == 0  # a causal LM's folder: the head starts at 0
    [[shaped]] = t.shaper.advantages([[mb]])
    # V = 0 everywhere, gamma = lambda = 1: every loss token's return and advantage is its sequence's reward;
    # the actor's are whitened over the step's 10 loss tokens (1 + 2 + 3 + 4; rewards 0, 1, 0, 1: 6 ones):
    # mean 0.6, unbiased var (6 x 0.4^2 + 4 x 0.6^2) / 9 = 0.26667, so a 1 becomes 0.4 / 0.5164 = 0.7746
    _, returns = t.shaper._targets[0][0]
    assert torch.equal(returns, mb.advantages * mb.loss_mask)
    ones = mb.loss_mask & (mb.advantages == 1)
    mean, std = 0.6, (0.6 * 0.4 * 10 / 9) ** 0.5
    assert torch.allclose(shaped.advantages[ones], torch.tensor((1 - mean) / std), atol=1e-5)
    assert torch.count_nonzero(shaped.advantages[~mb.loss_mask]) == 0


def test_a_value_reads_its_own_sequence_up_to_the_token_it_scores(tiny_model):
    """values[t] is V(prefix through input t), the state targets[t] is sampled in (verl's values[:, :-1]): packed
    neighbours (CPU sdpa, cut by position_ids) and the token scored at t do not move it; the token read at t does."""
    torch.manual_seed(0)
    net = load_value_net(str(tiny_model))
    with torch.no_grad():
        net.score.weight.normal_()  # a head that is not 0, so values depend on the tokens
    model = wrap_value_model(net, LEARNER, CPU)
    mb = pack(samples(), [0.0, 1.0, 0.0, 1.0], token_budget=64)[0]
    with torch.no_grad():
        packed = model(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen)
        cu = mb.cu_seqlens.tolist()
        for start, end in zip(cu[:-1], cu[1:]):
            ids, positions = mb.input_ids[start:end], mb.position_ids[start:end]
            alone = model(ids, positions, torch.tensor([0, end - start]), end - start)
            assert torch.allclose(packed[start:end], alone, atol=1e-4)
        last = end - 1  # the last sequence's last position (it scores the last completion token)
        first_loss = int(mb.loss_mask[start:end].nonzero()[0]) + start  # reads the last prompt token
        changed = mb.input_ids.clone()
        changed[first_loss + 1] = (changed[first_loss + 1] + 1) % 500  # the token scored at first_loss
        moved = model(changed, mb.position_ids, mb.cu_seqlens, mb.max_seqlen)
    assert torch.equal(moved[: first_loss + 1], packed[: first_loss + 1])
    assert not torch.allclose(moved[first_loss + 1 : last + 1], packed[first_loss + 1 : last + 1])


def test_a_step_trains_the_critic_toward_the_returns(tiny_model):
    t = trainer(tiny_model)
    micro = pack(samples(), [0.0, 1.0, 0.0, 1.0], token_budget=64)
    losses = [t.step(pack(samples(), [0.0, 1.0, 0.0, 1.0], token_budget=64))["critic/vf_loss"] for _ in range(8)]
    assert losses[-1] < 0.5 * losses[0], losses
    assert t.version == 8 and t.shaper.steps == 8
    metrics = t.step(micro)
    for key in (
        "critic/vf_clipfrac",
        "critic/value_mean",
        "critic/value_max",
        "critic/returns_mean",
        "critic/vf_explained_var_last",
    ):
        assert key in metrics


def test_the_actor_waits_during_the_critic_warm_up(tiny_model):
    t = trainer(tiny_model, critic=CriticConfig(lr=1e-2, warmup_steps=2))
    before = {k: v.clone() for k, v in parallel.full_state_dict(t.model).items()}
    for _ in range(2):
        metrics = t.step(pack(samples(), [0.0, 1.0, 0.0, 1.0], token_budget=64))
        assert metrics["skipped"] == 1.0 and "critic/vf_loss" in metrics
    after = parallel.full_state_dict(t.model)
    assert all(torch.equal(before[k], after[k]) for k in before) and t.version == 0
    assert t.step(pack(samples(), [0.0, 1.0, 0.0, 1.0], token_budget=64))["skipped"] == 0.0  # step 3: both train
    assert t.version == 1 and t.shaper.steps == 3


def test_micro_batching_does_not_change_the_value_loss(tiny_model):
    one, many = trainer(tiny_model), trainer(tiny_model)
    a = one.step(pack(samples(), [0.0, 1.0, 0.0, 1.0], token_budget=64))
    b = many.step(pack(samples(), [0.0, 1.0, 0.0, 1.0], token_budget=8))  # several micro-batches
    assert a["critic/vf_loss"] == pytest.approx(b["critic/vf_loss"], rel=1e-5)
    va = parallel.full_state_dict(one.shaper.model)
    vb = parallel.full_state_dict(many.shaper.model)
    assert all(torch.allclose(va[k], vb[k], atol=1e-6) for k in va)


def test_reinforce_pp_has_no_value_model(tiny_model):
    t = trainer(tiny_model, loss=LossConfig(advantage="reinforce_pp", aggregation="token"))
    metrics = t.step(pack(samples(), [0.0, 1.0, 0.0, 1.0], token_budget=64))
    assert t.shaper.model is None and not any(k.startswith("critic/") for k in metrics)
    assert metrics["skipped"] == 0.0 and t.version == 1
    cfg = build({"loss": {"advantage": "group_std"}})
    assert build_shaper(cfg, CPU, torch.float32) is None  # group estimators: nothing per token


def batch():
    return pack(samples(), [0.0, 1.0, 0.0, 1.0], token_budget=64)


def critic_state(t):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    weights = {k: v.clone() for k, v in parallel.full_state_dict(t.shaper.model).items()}
    sd = get_optimizer_state_dict(t.shaper.model, t.shaper.optimizer, options=StateDictOptions(full_state_dict=True))
    moments = {f"{n}.{k}": v.clone() for n, st in sd["state"].items() for k, v in st.items()}
    return weights, moments


def same(a, b):
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def saved(tiny_model, tmp_path_factory):
    """A trainer two steps in (the first the critic's warm-up), saved; and the checkpoint's folder."""
    t = trainer(tiny_model, critic=WARMING)
    for _ in range(2):
        t.step(batch())
    state = checkpoint.LearnerState(step=2, **t.state_dict())
    root = tmp_path_factory.mktemp("ckpt") / "checkpoints"
    path = checkpoint.save(root, t.model.lm, t.optimizer, t.scheduler, state, tiny_model, critic=t.shaper)
    saved_values = t.shaper.values(batch()[0])  # the tests after the first see t a step further on
    return t, path, saved_values


def test_resume_restores_the_critic_bit_exact_and_training_goes_on_the_same(saved, tiny_model):
    t, path, _ = saved
    torch.manual_seed(99)
    fresh = trainer(tiny_model, critic=CriticConfig(lr=1e-2, warmup_steps=1, value_clip=0.5))
    with torch.no_grad():  # another start: everything must come from the checkpoint
        for p in fresh.shaper.model.parameters():
            p.add_(0.01)
    before = critic_state(fresh)
    state = checkpoint.load(path, fresh.model.lm, fresh.optimizer, fresh.scheduler, critic=fresh.shaper)
    fresh.load_state_dict(state.trainer_state())
    assert not torch.equal(next(iter(before[0].values())), next(iter(critic_state(fresh)[0].values())))
    for a, b in zip(critic_state(t), critic_state(fresh)):
        same(a, b)
    assert (fresh.shaper.steps, fresh.version) == (2, 1)  # one warm-up step, one step of both
    t.step(batch())
    fresh.step(batch())
    for a, b in zip(critic_state(t), critic_state(fresh)):
        same(a, b)


def test_a_critic_run_refuses_a_checkpoint_without_one(saved, tiny_model, tmp_path):
    t, _, _ = saved
    state = checkpoint.LearnerState(step=1, **t.state_dict())
    path = checkpoint.save(tmp_path, t.model.lm, t.optimizer, t.scheduler, state, tiny_model)  # no critic
    with pytest.raises(checkpoint.CheckpointError, match="has no critic"):
        checkpoint.load(path, t.model.lm, t.optimizer, t.scheduler, critic=t.shaper)


def test_export_critic_writes_a_value_model_transformers_loads(saved, tmp_path):
    from transformers import AutoModelForSequenceClassification

    _, path, values = saved
    out = export_checkpoint(path, tmp_path / "critic", critic=True)
    net = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa")
    mb = batch()[0]
    with torch.no_grad():
        hidden = net.model(input_ids=mb.input_ids[None], position_ids=mb.position_ids[None], use_cache=False)
        hidden = hidden.last_hidden_state[0]
        exported = net.score(hidden).squeeze(-1)
    assert torch.allclose(exported, values, atol=1e-5)
    assert torch.count_nonzero(exported) > 0  # trained away from the zero head it started with


def test_a_kl_in_the_reward_lowers_each_return_by_the_kl_ahead_of_it(tiny_model):
    t = trainer(tiny_model, critic=CriticConfig(kl_in_reward=0.5))
    t.shaper.reference = t.model  # the actor as the reference: KL_t = log mu - log pi_ref(a_t), mu's logprob -6
    mb = pack(samples(), [0.0, 1.0, 0.0, 1.0], token_budget=64)[0]
    t.shaper.advantages([[mb]])
    _, returns = t.shaper._targets[0][0]
    with torch.no_grad():
        kl = torch.where(mb.loss_mask, mb.behavior_logprobs - t.model(*_inputs(mb))[0], 0.0)
    # V = 0 (a new head), gamma = lambda_critic = 1: G_t = R - 0.5 x (KL_t + KL_t+1 + ... to its sequence's end)
    expected = torch.zeros_like(returns)
    for s in range(int(mb.seq_ids.max()) + 1):
        at = (mb.seq_ids == s) & mb.loss_mask
        ahead = kl[at].flip(0).cumsum(0).flip(0)
        expected[at] = mb.advantages[at] - 0.5 * ahead
    assert torch.allclose(returns, expected, atol=1e-5)
    assert not torch.allclose(returns, mb.advantages * mb.loss_mask)  # the KL moved them (positive control)


def test_the_adaptive_coefficient_takes_the_steps_kl_after_its_rewards(tiny_model):
    adaptive = CriticConfig(kl_in_reward=0.5, kl_ctrl="adaptive", kl_target=0.1, kl_horizon=8)
    t = trainer(tiny_model, critic=adaptive)
    t.shaper.reference = t.model  # as above: KL_t = -6 - log pi_ref(a_t)
    mb = batch()[0]
    with torch.no_grad():
        kl = torch.where(mb.loss_mask, mb.behavior_logprobs - t.model(*_inputs(mb))[0], 0.0)
    per_sequence = [kl[(mb.seq_ids == s) & mb.loss_mask].mean() for s in range(4)]  # completions of 1..4 tokens
    current = float(sum(per_sequence)) / 4
    metrics = t.step([mb])
    # the step's rewards took beta = 0.5; then KL / target - 1 is clipped to +-0.2 and beta x= 1 +- 0.2 x 4 / 8
    assert metrics["critic/reward_kl_coef"] == 0.5
    assert metrics["critic/reward_kl"] == pytest.approx(current, rel=1e-5)
    assert current > 0.12  # 0.25 here: KL / target - 1 > 0.2, so the error is clipped to +0.2
    assert t.shaper.kl_ctrl.value == 0.5 * (1 + 0.2 * 4 / 8) == t.state_dict()["kl_coef"]
    assert t.step([mb])["critic/reward_kl_coef"] == 0.55  # the next step's rewards take the moved beta
