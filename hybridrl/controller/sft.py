"""Supervised warm start: `hybridrl sft RECIPE` trains on the task's demonstrations, writes an HF dir.

Demonstrations are laid out exactly as the agent loop lays out episodes (`ChatFormat.
conversation_ids`): the loss covers the assistant turns' tokens and their EOS, never the prompt
or the tool observations. The same Megatron engine and train step as RL, with the loss -logp.

Validation (`sft.validate_every`; by default once, after the last step): the model is exported as
an HF directory, and every rank runs its share of the task's validation split through the agent
loop on a native engine loaded from it, greedily and at `agent.temperature` (what RL samples at).
Both accuracies go to metrics.jsonl (`val/accuracy`, `val/accuracy_sampled`) and run.json, and a
one-line verdict says whether RL has a signal to learn from (`hybridrl.evaluate.verdict`). The
export must be visible to every rank: one node, or a shared filesystem.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import torch
from tqdm import tqdm

from hybridrl.config.loader import to_dict
from hybridrl.store import rundir
from hybridrl.distributed.dispatch import ONE_TO_ALL, DPSplit
from hybridrl.data.batch import Batch, pad_sequences
from hybridrl.data.stream import ShuffledStream
from hybridrl.telemetry.metrics import MetricsLogger
from hybridrl.telemetry.progress import LineProgress
from hybridrl.workers.base import Worker, register

log = logging.getLogger(__name__)


def nll(logprobs: torch.Tensor, entropy, micro_batch: Batch):
    """Token loss of supervised learning: -log p(token)."""
    return -logprobs, {}


class SFTWorker(Worker):
    def __init__(self, cfg, ctx):
        super().__init__(ctx)
        from hybridrl.training.registry import ACTOR, build

        self.cfg = cfg
        self.actor = build(cfg, ACTOR, ctx.device)          # `train.engine`'s row

    def meshes(self):
        return {**super().meshes(), "train": self.actor.mesh}

    @register(dispatch=DPSplit("train"))
    def train_step(self, batch: Batch) -> dict:
        return self.actor.train_step(batch, nll)

    @register(dispatch=ONE_TO_ALL)
    def export_hf(self, out_dir: str) -> None:
        self.actor.export_hf(out_dir)

    @register(dispatch=DPSplit("world"))
    def validate(self, episodes: Batch, *, model_dir: str, temperature: float, group_id: str) -> Batch:
        """This rank's share of validation instances, one episode each, on a native engine loaded from
        `model_dir` (the exported model) -> per row: correct, reward, tool calls, response tokens."""
        from hybridrl.data.episode import TaskInstance
        from hybridrl.evaluate import correct, run_episodes

        real = episodes.num_valid
        instances = [TaskInstance.from_dict(episodes["instance"][i]) for i in range(real)]
        trajectories = run_episodes(self.cfg, model_dir, instances, temperature=temperature, group_id=group_id,
                                    device=str(self.ctx.device)) if real else []
        columns = {"correct": [correct(t) for t in trajectories], "reward": [t.reward for t in trajectories],
                   "tool_calls": [float(len(t.tool_calls)) for t in trajectories],
                   "response_tokens": [float(len(t.response_ids)) for t in trajectories]}
        pad = len(episodes) - real
        return Batch({k: torch.tensor(v + [0.0] * pad, dtype=torch.float64) for k, v in columns.items()})


def demonstration_rows(cfg, tokenizer) -> list[tuple[list[int], list[int]]]:
    """(ids, loss mask) of every SFT chat: the file's (`sft.data`) or the task's demonstrations."""
    from hybridrl.agent.chat import ChatFormat

    chat = ChatFormat(tokenizer)
    return [chat.conversation_ids(c) for c in demonstration_chats(cfg)]


def demonstration_chats(cfg) -> list[list[dict[str, str]]]:
    from hybridrl.envs.tasks import get_task
    from hybridrl.envs.tasks.data import demonstrations

    if cfg.sft.data:
        return demonstrations(cfg.sft.data, held_out_fraction(cfg), key="sft.data")
    task = get_task(cfg.task.name, cfg.task)
    chats = task.sft_demonstrations(cfg.sft.num_demonstrations)   # task.seed, task.sft_tool_use_fraction
    if not chats:
        raise ValueError(f"task {cfg.task.name} gave no demonstrations to train on (a data file without assistant "
                         "messages?): give SFT a file of solved chats, sft.data=FILE")
    return chats


def held_out_fraction(cfg) -> float:
    """The share of `sft.data`'s prompts that the run's task holds out for validation: the data task's
    `validation_fraction` when it reads the same file (and has no validation_path of its own), else 0."""
    from pathlib import Path

    from hybridrl.envs.tasks.registry import task_options

    if cfg.task.name != "data":
        return 0.0
    options = task_options("data", cfg.task.options)
    same = Path(options.path).resolve() == Path(cfg.sft.data).resolve()
    return options.validation_fraction if same and not options.validation_path else 0.0


def to_training_batch(rows: list[tuple[list[int], list[int]]], pad_id: int) -> Batch:
    ids = pad_sequences([r[0] for r in rows], pad_value=pad_id)
    attention = pad_sequences([[1] * len(r[0]) for r in rows])
    mask = pad_sequences([r[1] for r in rows], dtype=torch.float32)
    return Batch({"input_ids": ids, "attention_mask": attention, "loss_mask": mask})


def run_sft(cfg, wg) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    rows = demonstration_rows(cfg, tokenizer)
    stream = ShuffledStream(rows, seed=cfg.run.seed)
    plan = rundir.prepare(cfg)             # an earlier run there is refused, or moved aside if told
    if plan.note:
        log.info("%s", plan.note)
    # the run's config beside it, as an RL run keeps it (hybridrl eval, compare and export read it)
    (Path(cfg.run.dir) / "config.json").write_text(json.dumps(to_dict(cfg), indent=1))
    logger = MetricsLogger(cfg.run.dir)
    started, last, val = time.perf_counter(), {}, {}
    steps, every = cfg.sft.steps, cfg.sft.validate_every
    out = cfg.sft.output_dir or str(Path(cfg.run.dir) / "hf")
    bar = tqdm(range(1, steps + 1), desc="sft", dynamic_ncols=True, disable=None)
    lines = LineProgress("sft", steps, enabled=bar.disable)          # not a terminal: a line per 10%
    for step in bar:
        batch = to_training_batch(stream.next(cfg.sft.batch_size), tokenizer.pad_token_id or 0)
        last = wg.call(SFTWorker.train_step, batch)[0]
        bar.set_postfix_str(f"loss={last['loss']:.4f} lr={last['lr']:.2e}")
        lines.update(step, loss=f"{last['loss']:.4f}")
        metrics = {}
        if step == steps:
            wg.call(SFTWorker.export_hf, out_dir=out)
        if every >= 0 and (step == steps or (every and step % every == 0)):
            metrics = val = validate(cfg, wg, step, out if step == steps else str(Path(cfg.run.dir) / "val_hf"))
            lines.note(f"sft step {step}: {val['verdict']}")
        if step % cfg.sft.log_every == 0 or step == steps or metrics:
            logger.log(step, {"sft/loss": last["loss"], "sft/grad_norm": last["grad_norm"], "sft/lr": last["lr"],
                              "sft/tokens": last["num_tokens"], "time/elapsed_s": time.perf_counter() - started,
                              **{k: v for k, v in metrics.items() if k != "verdict"}})
    shutil.rmtree(Path(cfg.run.dir) / "val_hf", ignore_errors=True)
    logger.close()
    summary = {k: val[k] for k in ("val/accuracy", "val/accuracy_sampled", "verdict") if k in val}
    # run.json: validation_accuracy, validation_accuracy_sampled, validation_verdict
    rundir.mark_finished(cfg.run.dir, steps, final_loss=last.get("loss"), model=out,
                         **{"validation_" + k.replace("val/", ""): v for k, v in summary.items()})
    log.info("SFT done in %.0fs: final loss %.4f, model written to %s", time.perf_counter() - started,
             last.get("loss", float("nan")), out)
    print(f"sft: {steps} steps, final loss {last.get('loss', float('nan')):.4f}; HF model at {out}")
    if val:
        print(f"sft: validation on {int(val['val/episodes'])} held-out instances: {val['verdict']}", flush=True)
    return {"loss": last.get("loss"), "output_dir": out, **summary}


def validate(cfg, wg, step: int, model_dir: str) -> dict:
    """Greedy and sampled accuracy of the model at this step on the task's validation split (exported to
    `model_dir` first unless it is the final export), spread over the ranks."""
    from hybridrl.controller.metrics import episode_rows
    from hybridrl.envs.tasks import get_task
    from hybridrl.evaluate import verdict

    started = time.perf_counter()
    if step != cfg.sft.steps:
        wg.call(SFTWorker.export_hf, out_dir=model_dir)
    rows = episode_rows(get_task(cfg.task.name, cfg.task).validation_split(), 1, f"sftval{step}")
    temperature = cfg.agent.temperature
    out: dict = {}
    for name, t in (("", 0.0), ("_sampled", temperature)):
        got = wg.call(SFTWorker.validate, rows, model_dir=model_dir, temperature=t, group_id=f"sftval{step}{name}")
        out[f"val/accuracy{name}"] = float(got["correct"].mean())
        out[f"val/successes{name}"] = float((got["correct"] > 0).sum())
        out[f"val/reward{name}"] = float(got["reward"].mean())
        out[f"val/tool_calls{name}"] = float(got["tool_calls"].mean())
        out[f"val/response_tokens{name}"] = float(got["response_tokens"].mean())
    out["val/episodes"] = float(len(rows))
    out["val/temperature_sampled"] = float(temperature)
    out["val/seconds"] = time.perf_counter() - started
    out["verdict"] = verdict(out["val/accuracy"], out["val/accuracy_sampled"], successes=out["val/successes_sampled"],
                             temperature=temperature)
    log.info("SFT validation at step %d: %s (%.1fs)", step, out["verdict"], out["val/seconds"])
    return out
