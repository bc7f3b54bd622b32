"""Supervised warm start: `hybridrl sft RECIPE` trains on the task's demonstrations, writes an HF dir.

Demonstrations are laid out exactly as the agent loop lays out episodes (`ChatFormat.
conversation_ids`): the loss covers the assistant turns' tokens and their EOS, never the prompt
or the tool observations. The same Megatron engine and train step as RL, with the loss -logp.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from hybridrl.store import rundir
from hybridrl.distributed.dispatch import ONE_TO_ALL, DPSplit
from hybridrl.data.batch import Batch, pad_sequences
from hybridrl.data.stream import ShuffledStream
from hybridrl.jobs import Job
from hybridrl.telemetry.metrics import MetricsLogger
from hybridrl.workers.base import Worker, register

log = logging.getLogger(__name__)


def nll(logprobs: torch.Tensor, entropy, micro_batch: Batch):
    """Token loss of supervised learning: -log p(token)."""
    return -logprobs, {}


class SFTWorker(Worker):
    def __init__(self, cfg, ctx):
        super().__init__(ctx)
        from hybridrl.backends.megatron import MegatronEngine

        self.cfg = cfg
        self.actor = MegatronEngine.from_hf(cfg.model.path, cfg.train, training=True, device=ctx.device)

    def meshes(self):
        return {**super().meshes(), "train": self.actor.mesh}

    @register(dispatch=DPSplit("train"))
    def train_step(self, batch: Batch) -> dict:
        return self.actor.train_step(batch, nll)

    @register(dispatch=ONE_TO_ALL)
    def export_hf(self, out_dir: str) -> None:
        self.actor.export_hf(out_dir)


def demonstration_rows(cfg, tokenizer) -> list[tuple[list[int], list[int]]]:
    from hybridrl.agent.chat import ChatFormat
    from hybridrl.envs.tasks import get_task

    task = get_task(cfg.task.name, cfg.task)
    chats = task.sft_demonstrations(cfg.sft.num_demonstrations)   # task.seed, task.sft_tool_use_fraction
    chat = ChatFormat(tokenizer)
    return [chat.conversation_ids(c) for c in chats]


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
    logger = MetricsLogger(cfg.run.dir)
    started, last = time.perf_counter(), {}
    bar = tqdm(range(1, cfg.sft.steps + 1), desc="sft", dynamic_ncols=True, disable=None)
    for step in bar:
        batch = to_training_batch(stream.next(cfg.sft.batch_size), tokenizer.pad_token_id or 0)
        last = wg.call(SFTWorker.train_step, batch)[0]
        bar.set_postfix_str(f"loss={last['loss']:.4f} lr={last['lr']:.2e}")
        if step % cfg.sft.log_every == 0 or step == cfg.sft.steps:
            logger.log(step, {"sft/loss": last["loss"], "sft/grad_norm": last["grad_norm"], "sft/lr": last["lr"],
                              "sft/tokens": last["num_tokens"], "time/elapsed_s": time.perf_counter() - started})
    out = cfg.sft.output_dir or str(Path(cfg.run.dir) / "hf")
    wg.call(SFTWorker.export_hf, out_dir=out)
    logger.close()
    rundir.mark_finished(cfg.run.dir, cfg.sft.steps, final_loss=last.get("loss"), model=out)
    log.info("SFT done in %.0fs: final loss %.4f, model written to %s", time.perf_counter() - started,
             last.get("loss", float("nan")), out)
    print(f"sft: {cfg.sft.steps} steps, final loss {last.get('loss', float('nan')):.4f}; HF model at {out}")
    return {"loss": last.get("loss"), "output_dir": out}


JOB = Job("sft", SFTWorker, run_sft)
