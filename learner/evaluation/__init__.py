"""Evaluation on held-out prompts: the metrics of a source at a version (`metrics`), and what is written for
them (`report`: metrics lines, the samples a person reads, the closing summary). docs/EVALUATION.md."""
