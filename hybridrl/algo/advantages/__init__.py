"""Advantage estimators, one module each, named after the estimator it defines (`ESTIMATOR`, an
`hybridrl.algo.registry.Estimator`): `algo.advantage=<module name>`. See `hybridrl/algo/registry.py`."""
