"""TRL's side of `benchmarks/vs_trl.py`: `GRPOTrainer` on the workload that script writes.

    <trl-venv>/bin/python benchmarks/trl_side.py --workload W.json --json OUT.json

Runs in a virtual environment of its own (TRL and its pins), so it imports nothing of hybridrl:
the workload file carries the model directory, the prompts (rendered with the model's chat
template), their reference answers and the settings both sides share. The reward is the calculator
task's: 1 for `<answer>V</answer>` with V numerically equal to the reference, plus the format
reward's weight for a single well-formed answer; its cost is negligible beside generation and the
update either way. Reports the wall time of every optimizer step (one generation batch each), the
seconds of it spent in `generate` (TRL's own generation, timed around the trainer's single-turn
generation call), and the process's peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import time

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def reward_fn(format_weight: float):
    def calculator(completions, reference, **_) -> list[float]:
        out = []
        for text, ref in zip(completions, reference):
            if not isinstance(text, str):                    # conversational datasets give messages
                text = text[-1]["content"]
            answers = _ANSWER.findall(text)
            value = answers[-1].strip().replace(",", "") if answers else None
            try:
                correct = value is not None and float(value) == float(ref)
            except ValueError:
                correct = False
            out.append(float(correct) + format_weight * float(len(answers) == 1))
        return out
    return calculator


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--json", required=True)
    ap.add_argument("--out-dir", required=True)
    args = ap.parse_args()
    w = json.load(open(args.workload))

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(w["seed"])
    steps: list[float] = []
    generate_s: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.t0 = time.perf_counter()
            generate_s.append(0.0)

        def on_step_end(self, *_, **__):
            steps.append(time.perf_counter() - self.t0)

    batch = w["prompts_per_step"] * w["group_size"]
    micro = w["micro_batch_size"]
    config = GRPOConfig(
        output_dir=args.out_dir, use_cpu=True, bf16=w.get("dtype") == "bfloat16", fp16=False, seed=w["seed"], report_to=[],
        save_strategy="no", logging_steps=1, max_steps=w["steps"], dataloader_num_workers=0,
        per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro,
        num_generations=w["group_size"], max_completion_length=w["max_new_tokens"],
        temperature=w["temperature"], top_p=1.0, learning_rate=w["lr"], lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=w["clip_grad"], beta=0.0, num_iterations=1,
        scale_rewards="none", loss_type=w["trl_loss_type"])
    tokenizer = AutoTokenizer.from_pretrained(w["model"])
    model = AutoModelForCausalLM.from_pretrained(w["model"], dtype=torch.float32)
    data = Dataset.from_list([{"prompt": p, "reference": r} for p, r in zip(w["prompts"], w["references"])])
    trainer = GRPOTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                          reward_funcs=reward_fn(w["format_weight"]), callbacks=[StepClock()])
    generate = trainer._generate_single_turn

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            generate_s[-1] += time.perf_counter() - t0

    trainer._generate_single_turn = timed_generate
    trainer.train()
    logged = trainer.state.log_history
    json.dump({"step_s": steps, "reward": [row["reward"] for row in logged if "reward" in row],
               "completion_tokens": [row["completions/mean_length"] for row in logged if "completions/mean_length" in row],
               "generate_s": generate_s, "torch_threads": torch.get_num_threads(),
               "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024},
              open(args.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
