"""A reward's `warm_up` runs when its worker starts, under the boot deadline, not inside the first call's
`reward.timeout_s` (issue 38: importing verifiers in the first call took past 10 s on a loaded machine, every
sample's reward was None and the run stopped with exit 3)."""

from __future__ import annotations

import textwrap

from streamrl.engine.config import RewardConfig
from streamrl.rewards import build_scorer

SLOW_IMPORT = textwrap.dedent("""
    import time

    def _import_a_library():
        time.sleep(3)  # stands in for `import verifiers` on a loaded machine

    def warmed(prompts, completions, completion_ids, **columns):
        return [1.0] * len(completions)

    warmed.warm_up = _import_a_library

    _imported = []

    def cold(prompts, completions, completion_ids, **columns):
        if not _imported:  # the same import, paid in the first call
            _import_a_library()
            _imported.append(True)
        return [1.0] * len(completions)
""")


def test_a_rewards_warm_up_is_not_charged_to_its_first_call(tmp_path):
    file = tmp_path / "slow.py"
    file.write_text(SLOW_IMPORT)
    first = {}
    for fn in ("warmed", "cold"):  # cold: the positive control, the same 3 s inside the 1 s deadline
        with build_scorer(RewardConfig(functions=[f"{file}:{fn}"], workers=1, timeout_s=1.0)) as scorer:
            first[fn] = scorer.score(["p"], ["c"], [[1]], [{}])
    assert first == {"warmed": [1.0], "cold": [None]}
