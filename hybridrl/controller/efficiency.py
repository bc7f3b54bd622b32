"""What a step's time and devices bought, measured where it happened, as per-step metrics:

    perf/mfu                    model FLOP utilisation of the update: the model FLOPs of the admitted
                                tokens' training passes / (time/T_train x train.peak FLOP/s x training devices)
    perf/train_flops            those model FLOPs (6 N + 12 L d T per token and pass: PaLM's count,
                                Chowdhery et al. 2022, appendix B; N the matmul parameters, MoE experts
                                counted as routed, T the row's length)
    perf/peak_flops             the per-device peak it is measured against (`trainer.peak_flops`, or
                                the device's table value, or on a CPU a measured float32 matmul rate)
    time/T_comm                 communication in the step: the gradient reduction of every optimizer
                                step (time/grad_reduce_s, rank 0's) + the weight publication
                                (switch/publish_s)
    time/T_checkpoint           seconds of the checkpoint written at the end of the PREVIOUS step
                                (a step's row is logged before its checkpoint; 0 when none was written)
    perf/prefix_hit_rate        prompt tokens the engines served from their prefix cache / prompt tokens
                                admitted (engine/prefix_hit_tokens / (that + engine/prefill_tokens))
    success/per_hour            verified successes (episodes/succeeded) per hour of the step's wall time
    success/per_device_hour     ... per device-hour (wall time x the job's devices)
    success/per_usd             ... per unit of the price table's money (configs/prices.yaml, the
                                `hybridrl cost` table: device_hour of the run's device kind)
    success/run_per_hour        the run's successes so far over its steps' wall time so far (this process)

Import-light apart from the CPU peak measurement (torch, once per run).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

# dense peak FLOP/s per device at bf16 (tensor cores, no sparsity), from the vendors' data sheets
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP count needs of a model: layers, the attention width (heads x head dim) and the
    parameters a token's forward multiplies by (each linear layer's weights, the LM head included even
    when tied to the embedding; only the routed experts of an MoE layer)."""

    num_layers: int
    attention_width: int
    matmul_params: int


def model_shape(hf_config: dict) -> ModelShape:
    """From an HF config.json of the shipped families (qwen2, llama, qwen3, qwen3_moe: gated MLPs)."""
    c = hf_config
    d, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or d // heads
    kv = c.get("num_key_value_heads") or heads
    attention = d * heads * head_dim * 2 + d * kv * head_dim * 2          # q and o, k and v
    if c.get("num_experts") and c.get("num_experts_per_tok"):
        mlp = 3 * d * c["moe_intermediate_size"] * c["num_experts_per_tok"] + d * c["num_experts"]   # + router
    else:
        mlp = 3 * d * c["intermediate_size"]
    return ModelShape(layers, heads * head_dim, layers * (attention + mlp) + d * vocab)


def train_flops(shape: ModelShape, lengths: Sequence[int], passes: int = 1) -> float:
    """Model FLOPs of `passes` training passes (forward + backward) over rows of `lengths` tokens:
    per row of length l, 6 N l (the matmuls) + 12 L w l^2 (attention scores and values)."""
    n, lw = shape.matmul_params, shape.num_layers * shape.attention_width
    return float(passes * sum(6 * n * l + 12 * lw * l * l for l in lengths))


def mfu(flops: float, seconds: float, peak_per_device: float, devices: int) -> float:
    return flops / (seconds * peak_per_device * devices) if seconds > 0 and peak_per_device > 0 and devices else 0.0


def measured_cpu_flops(n: int = 512, repeats: int = 8) -> float:
    """This process's float32 matmul rate (FLOP/s): the best of `repeats` n x n products."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - started)
    return 2 * n ** 3 / best


def peak_flops(configured: float, device: str) -> tuple[float, str]:
    """(FLOP/s per device, where it came from): the knob when > 0, else the device's table value, else
    (CPU, or a device not in the table) a measured matmul rate."""
    if configured > 0:
        return configured, "trainer.peak_flops"
    if device != "cpu":
        import torch

        name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
        for key, value in PEAK_FLOPS.items():
            if key in name:
                return value, f"table ({name})"
    return measured_cpu_flops(), "measured float32 matmul"


def prefix_hit_rate(m: dict) -> float | None:
    hits, computed = m.get("engine/prefix_hit_tokens"), m.get("engine/prefill_tokens")
    if hits is None or computed is None or hits + computed <= 0:
        return None
    return hits / (hits + computed)


def success_rates(successes: float, seconds: float, devices: int, device_hour: float | None) -> dict[str, float]:
    """Verified successes per hour, per device-hour and (with a price) per unit of money."""
    if seconds <= 0:
        return {}
    hours = seconds / 3600
    out = {"success/per_hour": successes / hours, "success/per_device_hour": successes / (hours * devices)}
    if device_hour:
        out["success/per_usd"] = successes / (hours * devices * device_hour)
    return out


@dataclass
class Efficiency:
    """The run's efficiency metrics, one `step(...)` per step on the controller."""

    shape: ModelShape | None
    peak: float
    train_devices: int
    devices: int
    device_hour: float | None
    passes: int = 1
    checkpoint_s: float = 0.0                  # the last checkpoint's seconds, reported by the next step
    totals: dict = field(default_factory=lambda: {"successes": 0.0, "seconds": 0.0})

    @classmethod
    def of_run(cls, cfg: Any, wg: Any) -> "Efficiency":
        config = Path(cfg.model.path) / "config.json"
        shape = model_shape(json.loads(config.read_text())) if config.exists() else None
        peak, _ = peak_flops(cfg.trainer.peak_flops, cfg.distributed.device)
        return cls(shape, peak, train_devices=len(wg.mesh("train").ranks), devices=wg.world_size,
                   device_hour=device_price(cfg.distributed.device), passes=cfg.algo.ppo_epochs)

    def checkpointed(self, seconds: float) -> None:
        self.checkpoint_s = seconds

    def step(self, m: dict, batch: Any) -> dict[str, float]:
        """This step's metrics from what it measured (`m`) and its admitted batch (None: nothing trained)."""
        lengths = batch["attention_mask"].sum(dim=1).tolist() if batch is not None else []
        return self.measured(m, lengths)

    def measured(self, m: dict, lengths: Sequence[int]) -> dict[str, float]:
        """... from the admitted rows' lengths (prompt + response tokens each)."""
        out = {"time/T_checkpoint": self.checkpoint_s,
               "time/T_comm": m.get("time/grad_reduce_s", 0.0) + m.get("switch/publish_s", 0.0),
               "perf/peak_flops": self.peak}
        self.checkpoint_s = 0.0
        if self.shape is not None and lengths and m.get("train/updated", 1.0):
            flops = train_flops(self.shape, lengths, self.passes)
            out["perf/train_flops"] = flops
            out["perf/mfu"] = mfu(flops, m.get("time/T_train", 0.0), self.peak, self.train_devices)
        rate = prefix_hit_rate(m)
        if rate is not None:
            out["perf/prefix_hit_rate"] = rate
        successes, seconds = m.get("episodes/succeeded", 0.0), m.get("time/step_s", 0.0)
        out.update(success_rates(successes, seconds, self.devices, self.device_hour))
        self.totals["successes"] += successes
        self.totals["seconds"] += seconds
        if self.totals["seconds"] > 0:
            out["success/run_per_hour"] = self.totals["successes"] / (self.totals["seconds"] / 3600)
        return out


def device_price(device: str) -> float | None:
    """The shipped price table's device-hour for this run's device kind (`hybridrl cost`'s table; a CUDA
    device of a listed kind, e.g. h100, by its name), None when the table cannot be read."""
    from hybridrl.cost.prices import PriceError, load_prices

    try:
        prices = load_prices()
    except PriceError:
        return None
    kind = "cpu" if device == "cpu" else "gpu"
    if kind == "gpu":
        import torch

        name = torch.cuda.get_device_name().lower() if torch.cuda.is_available() else ""
        kind = next((k for k in prices.device_hour if k != "gpu" and k in name), "gpu")
    return prices.device_hour.get(kind)
