"""Policy losses, one module each, named after the loss it defines (`POLICY_LOSS`, an
`hybridrl.algo.registry.PolicyLoss`): `algo.policy_loss=<module name>`. See `hybridrl/algo/registry.py`."""
