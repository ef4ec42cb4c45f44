"""The hf node's memory does not grow with rows x new tokens x vocabulary: each step's scores are dropped once
the token drawn from them is known (rollout/backends/hf.py `_SampledLogprobs`). Keeping them all (generate's
`output_scores`) asked 23.2 GiB at 256 rows x 160 tokens x Qwen2's 152k vocabulary on an H100 and ran out of
memory; here 32 rows x 64 tokens x 152k would hold 1.2 GiB of fp32 scores, read as the process's peak RSS."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROWS, TOKENS, VOCAB = 16, 48, 151936

SCRIPT = """
import asyncio, json, resource, sys
from streamrl.engine.config import ModelConfig, RolloutConfig
from streamrl.rollout.backends.hf import HFBackend

backend = HFBackend(sys.argv[1], ModelConfig(max_model_len=256), RolloutConfig(), static=False)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = asyncio.run(backend.generate([5, 6, 7, 8], int(sys.argv[2]), int(sys.argv[3])))
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"grew_mib": (after - before) / 1024, "lengths": [len(c.token_ids) for c in out],
                  "finite": all(lp > -1e30 for c in out for lp in c.logprobs)}))
"""


def test_the_hf_nodes_peak_memory_does_not_hold_every_steps_scores(tmp_path):
    from streamrl.engine.models import make_tiny_model

    model = make_tiny_model(tmp_path / "big-vocab", seed=0, model_vocab_size=VOCAB)
    env_cmd = [sys.executable, "-c", SCRIPT, str(model), str(ROWS), str(TOKENS)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}  # big blocks go back to the OS when freed
    done = subprocess.run(env_cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert max(got["lengths"]) == TOKENS and got["finite"], got  # every step ran; drawn tokens are never filtered
    held = ROWS * TOKENS * VOCAB * 4 / 2**20  # MiB of fp32 scores kept to the end
    assert got["grew_mib"] < held / 2, (got["grew_mib"], held)
