"""PPO's critic: a value model beside the actor, GAE per token, the value loss (docs/ALGORITHMS.md, "Critic").

- gae.py: pure functions of [B, L] tensors: the per-token rewards, GAE(gamma, lambda) advantages and
  lambda-returns, discounted returns (REINFORCE++), whitening across the batch; and the packed <-> rows
  layout the learner's micro-batches need;
- value_loss.py: the (clipped) value loss and its statistics, pure;
- model.py: the value model (the actor's architecture with a scalar head), built and sharded like the actor;
- trainer.py: its optimizer and update, and the step's per-token advantages (token_advantages.py).
"""
