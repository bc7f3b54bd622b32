"""The score function of recipes/data_grpo_cpu.yaml: veRL's signature, nothing of hybridrl imported.

    compute_score(solution_str, ground_truth, extra_info) -> {"score": ..., <components>}

`solution_str` is the text of the episode's final assistant turn. The reward (`score`) is 1 for the
right number in the last <answer>...</answer>; `format` (1 for exactly one answer tag holding a
number) is recorded beside it in the run ledger.
"""

import re

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
NUMBER = re.compile(r"-?\d+(\.\d+)?")


def compute_score(solution_str, ground_truth, extra_info=None):
    answers = ANSWER.findall(solution_str)
    last = answers[-1].strip().replace(",", "") if answers else ""
    is_number = NUMBER.fullmatch(last) is not None
    correct = float(is_number and float(last) == float(ground_truth))
    return {"score": correct, "correct": correct, "format": float(len(answers) == 1 and is_number)}
