"""The hf backend's static shapes: one prompt width for a run (data.max_prompt_tokens rounded up), so the
decode step compiled at warm-up is the only one; a longer prompt (a multi-turn episode) gets its own."""

import torch

from streamrl.engine.config import ModelConfig, RolloutConfig
from streamrl.rollout.backends.hf import WIDTH_STEP, HFBackend


def test_static_batches_pad_every_prompt_to_the_runs_width_and_rows_to_max_batch(tiny_model):
    engine = HFBackend(tiny_model, ModelConfig(), RolloutConfig(), static=True, max_batch=4, max_prompt_tokens=100)
    assert engine.width == 2 * WIDTH_STEP
    pad = engine.tokenizer.pad_token_id
    for rows in ([[5, 6, 7]], [[5] * 90, [6] * 3]):
        input_ids, mask = engine._left_pad(engine._bucket_rows(rows))
        assert input_ids.shape == (4, 128) and mask.shape == (4, 128)
        assert input_ids[0, -len(rows[0]) :].tolist() == rows[0] and mask[0].sum() == len(rows[0])
        assert torch.all(input_ids[0, : -len(rows[0])] == pad)
    longer, _ = engine._left_pad([[5] * 130])
    assert longer.shape == (1, 3 * WIDTH_STEP)
    dynamic = HFBackend(tiny_model, ModelConfig(), RolloutConfig(), static=False, max_prompt_tokens=100)
    assert dynamic._left_pad([[5, 6, 7]])[0].shape == (1, 3)
