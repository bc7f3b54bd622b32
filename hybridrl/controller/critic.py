"""The controller's side of algo.advantage=gae: which steps update the actor.

The critic itself runs inside `TrainSide.update_policy` (values before the advantages, GAE, its
optimizer steps beside the actor's; `hybridrl/workers/rl_step.py`). During the first
`critic.warmup_steps` RL steps only the critic trains: the trainer passes `update_actor=False`, the
policy version does not move and the step logs `train/updated=0`.
"""

from __future__ import annotations


def actor_trains(cfg, step: int) -> bool:
    """False during critic.warmup_steps at the start of a gae run (only the critic trains)."""
    return not (cfg.algo.uses_critic and step <= cfg.critic.warmup_steps)
