"""A vLLM CUDA probe (run with the vLLM venv's python: `.venv-vllm/bin/python benchmarks/gpu_vllm_probe.py`).

One engine on the GPU through hybridrl's VLLMEngine, each step timed and recorded in OUT/vllm_probe.json:
  start          the engine with sleep mode (its processes on this GPU alone), device memory in use after
  generate       greedy continuations of fixed prompts at version 0 (the checkpoint)
  bucket_load    the checkpoint's tensors in one flat bucket on this GPU, sent as a CUDA IPC handle and
                 read back in vLLM's worker (publish.verify=post_copy): version 1; the same continuations
  sleep_kv       sleep(kv_cache) / wake_up: device memory released and taken back
  sleep_weights  sleep(weights) (vLLM's level 2) / wake_up, then the bucket published again (version 2)
                 and the same continuations
Device memory is the device's, from the driver (torch.cuda.mem_get_info): vLLM's memory lives in its own
processes. Bounded by --budget-s (the caller's timeout is the hard bound; this one stops between steps).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = dict(hidden=512, layers=4, heads=8, kv_heads=2, intermediate=1024, init_std=0.05)   # head size 64
PROMPTS = [[3, 17, 42, 7, 99, 5], [11, 12, 13, 14], [200, 1, 300, 2, 400, 3, 500]]


def used_bytes() -> int:
    import torch

    free, total = torch.cuda.mem_get_info()
    return int(total - free)


async def continuations(engine, tag: str) -> list[list[int]]:
    from hybridrl.rollout.protocol import SamplingParams

    greedy = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    outs = await asyncio.gather(*(engine.generate(p, greedy, f"{tag}-{i}") for i, p in enumerate(PROMPTS)))
    return [o.token_ids for o in outs]


async def publish(engine, model_dir: Path, version: int) -> dict:
    import torch
    from safetensors.torch import load_file

    from hybridrl.backends.vllm.transport import pack_bucket

    spec = engine.weight_spec()
    items = []
    for path in sorted(model_dir.glob("*.safetensors")):
        items += [(n, t.to("cuda", spec[n][1])) for n, t in sorted(load_file(str(path)).items()) if n in spec]
    bucket = pack_bucket(items)
    started = time.perf_counter()
    await engine.load_bucket(bucket, version, digests=bucket.digests())
    torch.cuda.synchronize()
    return {"version": engine.policy_version, "tensors": len(items), "bytes": bucket.plan.nbytes,
            "seconds": round(time.perf_counter() - started, 3)}


async def probe(engine, model_dir: Path, record: dict, deadline: float) -> None:
    def step(name: str, **values) -> None:
        record["steps"][name] = {**values, "used_bytes": used_bytes()}
        if time.monotonic() > deadline:
            raise TimeoutError(f"past the budget after step {name}")

    base = await continuations(engine, "v0")
    step("generate", tokens=sum(map(len, base)))
    loaded = await publish(engine, model_dir, 1)
    step("bucket_load", **loaded, same_continuations=await continuations(engine, "v1") == base)
    before = used_bytes()
    await engine.sleep(["kv_cache"])
    asleep = used_bytes()
    await engine.wake_up(["kv_cache"])
    step("sleep_kv", released_bytes=before - asleep, same_continuations=await continuations(engine, "kv") == base)
    before = used_bytes()
    await engine.sleep(["weights", "kv_cache"])
    asleep = used_bytes()
    await engine.wake_up(["weights", "kv_cache"])
    again = await publish(engine, model_dir, 2)
    step("sleep_weights", released_bytes=before - asleep, republished=again,
         same_continuations=await continuations(engine, "v2") == base)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/first_contact/vllm")
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_vllm_probe: no CUDA device visible to torch", file=sys.stderr)
        return 2
    import vllm

    from hybridrl.assets.tiny_model import TinyModelSpec, build_tiny_model
    from hybridrl.backends.vllm.config import VLLMConfig
    from hybridrl.backends.vllm.engine import VLLMEngine

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    record: dict = {"vllm": vllm.__version__, "torch": torch.__version__, "device": torch.cuda.get_device_name(),
                    "steps": {}, "ok": False}
    model_dir = out / "model"
    if not (model_dir / "config.json").exists():
        build_tiny_model(model_dir, TinyModelSpec(arch="qwen2", **SHAPE))
    idle = used_bytes()
    started = time.perf_counter()
    engine = None
    try:
        engine = VLLMEngine(model_dir, VLLMConfig(enable_sleep_mode=True, max_model_len=1024,
                                                  gpu_memory_utilization=args.gpu_memory_utilization),
                            device="cuda:0")
        record["steps"]["start"] = {"seconds": round(time.perf_counter() - started, 1), "used_bytes": used_bytes(),
                                    "idle_used_bytes": idle}
        asyncio.run(probe(engine, model_dir, record, deadline))
        record["ok"] = all(s.get("same_continuations", True) for s in record["steps"].values())
    except Exception as err:  # noqa: BLE001 - recorded, then reported
        record["error"] = f"{type(err).__name__}: {err}"
    finally:
        if engine is not None:
            engine.close()
    (out / "vllm_probe.json").write_text(json.dumps(record, indent=1))
    print(f"gpu_vllm_probe: {'ok' if record['ok'] else 'FAILED'} {json.dumps(record)}")
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
