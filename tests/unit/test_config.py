import pytest

from streamrl.engine import config as c


def test_defaults_build_and_overrides_apply():
    cfg = c.build(
        {},
        [
            "learner.lr=2e-6",
            "run.steps=3",
            "reward.functions=['demo', 'exact_match']",
            "rollout.backend=hf",
            "run.name=exp-1",
        ],
    )
    assert cfg.learner.lr == 2e-6 and cfg.run.steps == 3 and cfg.rollout.backend == "hf"
    assert cfg.reward.functions == ["demo", "exact_match"] and cfg.run.name == "exp-1"


def test_toml_file_then_overrides_win(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[learner]\nlr = 1e-4\ngroups_per_step = 8\n[model]\ndtype = "bfloat16"\n')
    cfg = c.load(f, ["learner.lr=3e-4"])
    assert (cfg.learner.lr, cfg.learner.groups_per_step, cfg.model.dtype) == (3e-4, 8, "bfloat16")


@pytest.mark.parametrize(
    "override, expected",
    [
        ("learner.lr=-1", ["`learner.lr` = -1", "> 0.0"]),
        ("learner.lrr=1", ["`learner.lrr` does not exist", "lr, weight_decay"]),
        ("nope.x=1", ["`nope` does not exist", "run, model"]),
        ("rollout.backend=tgi", ["`rollout.backend` = 'tgi'", "'vllm', 'hf'"]),
        ("rollout.temperature=0", ["`rollout.temperature` = 0", "> 0.0"]),
        ("run.name='a b'", ["`run.name` = 'a b'", "matching regex"]),
        ("loss.kl_estimator=3", ["`loss.kl_estimator` = 3", "Expected `str`"]),
        ("loss.kl_estimator='k4'", ["`loss.kl_estimator` = 'k4'", "'k1', 'k2', 'k3'"]),
        ("loss.kind='grpo'", ["`loss.kind` does not exist", "advantage"]),
        ("learner.betas=[0.9]", ["`learner.betas`", "length 2"]),
        ("reward.weights=[1.0, 2.0]", ["reward.weights has 2 entries", "reward.functions has 1"]),
    ],
)
def test_bad_values_name_the_field_the_value_and_what_is_allowed(override, expected):
    with pytest.raises(c.ConfigError) as err:
        c.build({}, [override])
    for part in expected:
        assert part in str(err.value)


def test_malformed_override_and_missing_file_are_config_errors(tmp_path):
    with pytest.raises(c.ConfigError, match="section.field=value"):
        c.build({}, ["learner.lr"])
    with pytest.raises(c.ConfigError, match="does not exist"):
        c.load(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[learner\n")
    with pytest.raises(c.ConfigError, match="not valid TOML"):
        c.load(bad)


def test_dump_round_trips_through_toml():
    import tomllib

    cfg = c.build({}, ["learner.lr=3e-5", "reward.functions=['demo']"])
    assert c.build(tomllib.loads(c.dump(cfg))) == cfg


def test_every_field_is_documented():
    import typing

    for section in c.Config.__struct_fields__:
        struct = typing.get_type_hints(c.Config)[section]
        for name, hint in typing.get_type_hints(struct, include_extras=True).items():
            metas = [a for a in getattr(hint, "__metadata__", ()) if getattr(a, "description", None)]
            assert metas, f"{section}.{name} has no description"
