"""Evaluation: suites (`configs/eval/*.yaml`), `hybridrl eval`, pass@k, and in-loop evaluation.

    suite.py     a suite: named, versioned, hashed (tasks, splits, seed ranges, samplings, metrics, budgets)
    metrics.py   accuracy, pass@k (the unbiased estimator), reward, tool calls, length, from episode records
    runner.py    one model on one suite in this process, resumable episode by episode
    models.py    which models: an HF directory, or a run's checkpoints (exported by export.py)
    compare.py   results across a run's steps: a table, a PNG, the run page's curves
    protect.py   suites disjoint from training splits, never in the training stream
    episodes.py  the recipe form (`hybridrl eval RECIPE`): greedy and sampled accuracy and a verdict,
                 and the episode runner SFT's self-validation uses

The command, `hybridrl eval`, is hybridrl/cli/eval.py.
"""

from hybridrl.evaluate.episodes import correct, evaluate, run_episodes, summarize, verdict

__all__ = ["correct", "evaluate", "run_episodes", "summarize", "verdict"]
