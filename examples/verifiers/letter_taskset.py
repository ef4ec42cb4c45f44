"""A verifiers (0.4, `verifiers.v1`) taskset in the form verifiers packages take: say a letter, scored by
the share of that letter in the reply. Put this folder on PYTHONPATH and run it by its id:

    PYTHONPATH=examples/verifiers streamrl run --data verifiers:letter_taskset
"""

import verifiers.v1 as vf

LETTERS = "abcd"


class LetterData(vf.TaskData):
    letter: str = "a"


class LetterTask(vf.Task[LetterData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def share(self, task: LetterData, trace: vf.Trace) -> float:
        reply = trace.last_reply
        return reply.count(task.letter) / max(1, len(reply))


class LetterTaskset(vf.Taskset[LetterTask, vf.TasksetConfig]):
    def load(self):
        for i in range(64):
            letter = LETTERS[i % len(LETTERS)]
            yield LetterTask(LetterData(prompt=f"say {letter}", letter=letter), self.config.task)


__all__ = ["LetterTaskset"]
