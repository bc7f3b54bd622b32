"""A toy advantage estimator and a toy policy loss defined outside the package (what a user's module
holds), named in a config as `algo.advantage=tests.algo.toy_algo:TOY_ESTIMATOR` and
`algo.policy_loss=tests.algo.toy_algo:TOY_LOSS`."""

from __future__ import annotations

import torch

from hybridrl.algo.registry import Estimator, PolicyLoss


def _sign(cfg, x):
    """+1 / -1 per row by the sign of its reward, on every policy token."""
    return torch.sign(x.rewards.float()).unsqueeze(-1) * x.mask.float(), None


def _vanilla(cfg, logprobs, old, adv):
    ratio = torch.exp(logprobs - old)
    return -adv * ratio, {"ratio": ratio.detach()}


TOY_ESTIMATOR = Estimator(name="sign", summary="the sign of the reward", compute=_sign,
                          formula=lambda cfg: "sign(r)", group_baseline=lambda cfg: False)
TOY_LOSS = PolicyLoss(name="vanilla_pg", summary="-A * ratio, unclipped", compute=_vanilla)
