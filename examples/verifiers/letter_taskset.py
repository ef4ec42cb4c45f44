"""A verifiers (0.4, `verifiers.v1`) taskset in the form verifiers packages take: say a letter, scored by
the share of that letter in the reply's non-space characters. Put this folder on PYTHONPATH and run it by its id:

    PYTHONPATH=examples/verifiers streamrl run --data verifiers:letter_taskset --steps 30

One letter, so that the built-in tiny model learns it in 30 steps on 2 CPU cores (bench/RESULTS.md, "The first
hour, as written"); with four letters to tell apart ("abcd", one per prompt) its mean reward went 0.03 -> 0.17
by step 27, then back to 0.04.
"""

import verifiers.v1 as vf

LETTERS = "c"


class LetterData(vf.TaskData):
    letter: str = "a"


class LetterTask(vf.Task[LetterData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def share(self, task: LetterData, trace: vf.Trace) -> float:
        chars = [c for c in trace.last_reply if not c.isspace()]
        return chars.count(task.letter) / max(1, len(chars))


class LetterTaskset(vf.Taskset[LetterTask, vf.TasksetConfig]):
    def load(self):
        for i in range(64):
            letter = LETTERS[i % len(LETTERS)]
            yield LetterTask(LetterData(prompt=f"say {letter}", letter=letter), self.config.task)


__all__ = ["LetterTaskset"]
