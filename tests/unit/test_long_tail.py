"""The long-tailed lengths task (`data.path = "lengths:MIN-MAX"`) and a row's own cap on completion tokens."""

from __future__ import annotations

import json
import math

import pytest

from streamrl.engine.config import DataConfig
from streamrl.rollout.sources import Prompt, PromptSource, PromptSourceError


@pytest.fixture(scope="module")
def tokenizer():
    from streamrl.engine.models import make_tokenizer

    return make_tokenizer(seed=0)


def _source(path: str, tokenizer) -> PromptSource:
    return PromptSource(DataConfig(path=path, loop=False, shuffle=False), tokenizer)


def test_caps_spread_log_uniformly_over_the_range(tokenizer):
    prompts = list(_source("lengths:48-1024:2000:0", tokenizer))
    caps = [p.max_tokens for p in prompts]
    assert len(prompts) == 2000 and min(caps) >= 48 and max(caps) <= 1024
    # log-uniform: a quarter of the log range each, so about 500 rows per quarter (a uniform draw would put
    # (1024 - 48) / 4 = 244 tokens a quarter and ~1500 rows above the geometric midpoint sqrt(48 * 1024) = 222)
    edges = [math.exp(math.log(48) + q * (math.log(1024) - math.log(48)) / 4) for q in range(5)]
    quarters = [sum(edges[q] <= c < edges[q + 1] for c in caps) for q in range(4)]
    assert all(400 < n < 600 for n in quarters), quarters
    assert max(caps) / min(caps) > 15  # tenfold and more within one batch, as in reasoning runs


def test_same_path_same_rows_and_the_seed_changes_them(tokenizer):
    first = [p.max_tokens for p in _source("lengths:48-1024:50:1", tokenizer)]
    again = [p.max_tokens for p in _source("lengths:48-1024:50:1", tokenizer)]
    other = [p.max_tokens for p in _source("lengths:48-1024:50:2", tokenizer)]
    assert first == again and first != other


@pytest.mark.parametrize(
    "path", ["lengths:", "lengths:100", "lengths:9-3", "lengths:0-10", "lengths:1-5:0", "lengths:a-b"]
)
def test_bad_paths_are_refused_with_the_form_to_write(path, tokenizer):
    with pytest.raises(PromptSourceError, match=r"lengths:MIN-MAX\[:ROWS\[:SEED\]\]"):
        _source(path, tokenizer)


def test_a_row_cap_never_exceeds_the_runs():
    # cap = min(row, run): 300 under a run of 160 gives 160; 50 gives 50; no column (0) gives the run's
    assert Prompt([1], {}, 0, max_tokens=300).cap(160) == 160
    assert Prompt([1], {}, 0, max_tokens=50).cap(160) == 50
    assert Prompt([1], {}, 0).cap(160) == 160


def test_a_bad_cap_column_makes_the_row_malformed(tmp_path, tokenizer):
    path = tmp_path / "rows.jsonl"
    rows = [{"prompt": "red cat", "max_tokens": 0}, {"prompt": "red cat", "max_tokens": "9"},
            {"prompt": "red cat", "max_tokens": True}, {"prompt": "red cat", "max_tokens": 12}]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = _source(str(path), tokenizer)
    assert [p.max_tokens for p in source] == [12]
    assert [n for n, _ in source.malformed_rows] == [0, 1, 2]
    assert all("'max_tokens'" in why and "positive integer" in why for _, why in source.malformed_rows)
