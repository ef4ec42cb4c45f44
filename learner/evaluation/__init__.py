"""Evaluation on held-out prompts: the metrics of a source at a version (`metrics`), what is written for them
(`report`: metrics, the samples a person reads, the closing summary) and the learner's side of evaluations
during training (`coordinator`). docs/EVALUATION.md."""

from streamrl.learner.evaluation.coordinator import Evaluations, start

__all__ = ["Evaluations", "start"]
