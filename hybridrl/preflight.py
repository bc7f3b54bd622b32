"""Everything a run needs, checked before any process starts: each problem is one line (exit 2).

    model.path  an HF directory: config.json (JSON, with model_type), safetensors weights
                (critic.path, reward_model.path and distill.teacher too, when set; a reward model needs a
                scalar head, a teacher the policy's tokenizer)
                (model.safetensors, or model.safetensors.index.json and every shard it names),
                a tokenizer (tokenizer.json, or tokenizer_config.json with its vocabulary files)
    train.tp/pp a layout the model and the world size allow: pp <= layers, tp dividing the
                attention heads, KV heads and FFN size, tp * pp dividing the world size (the
                training ranks' number with a disaggregated placement, which must leave at least one)
    dtypes      the rollout engine's dtype is train.dtype (an RL run publishes the trained weights
                as they are), publish.parity_tolerance is one that dtype can pass, and a CPU run in
                bfloat16 / float16 has that dtype's matrix instructions (AVX512-BF16 or AMX...)
    engine      the rollout engine can serve the model (vLLM: no mixture-of-experts models)
    task        importable (loading the config did that) and able to give what the run asks of
                it: the train and validation splits at their configured sizes (data files are read
                here, so a missing one is named with its option), SFT demonstrations, and tools that
                exist for the tool calls its demonstrations make
    run.dir     what the launch does with an earlier run there (`hybridrl.store.rundir`)
    network     distributed.socket_ifname, when set, is an interface of this host with an IPv4
                address (every rank checks its own host)

Warnings (returned as notes, the run still starts): more CPU ranks than the CPUs this process may
use, and a group estimator (GRPO, RLOO) with `trainer.group_size=1`, where every advantage is 0.

`hybridrl train` runs these before it starts torchrun, and every rank runs them again before it
joins the process group (for launches by torchrun or srun directly). Import-light: no torch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


class PreflightError(Exception):
    """A run input that is missing or unusable; `str(err)` is one line naming it and the fix."""


def preflight(cfg: Any, *, overwrite: bool = False, world_size: int | None = None) -> list[str]:
    """Check what `cfg.run.job` needs; returns notes for the user (e.g. what happens to run.dir).
    `overwrite`: the earlier run's outputs will be removed, so run.dir is not inspected.
    `world_size`: ranks the run will have (default: $WORLD_SIZE, else distributed.nproc_per_node)."""
    from hybridrl.jobs import owns_run_dir
    from hybridrl.store import rundir

    if not owns_run_dir(cfg.run.job):
        return []
    check_interface(cfg.distributed.socket_ifname)
    check_model(cfg.model.path)
    critic, reward_model = cfg.critic, cfg.reward_model
    if cfg.algo.uses_critic and critic.path:
        check_model(critic.path, key="critic.path")
    if reward_model.path:
        check_model(reward_model.path, key="reward_model.path", supported=False)
        check_scalar_head(reward_model.path)
    teacher = check_teacher(cfg) if cfg.run.job == "rl" else None
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE") or cfg.distributed.nproc_per_node)
    world_key = "world size (distributed.nproc_per_node)"
    placement = cfg.placement
    if placement.disaggregated and cfg.run.job == "rl":
        from hybridrl.distributed.placement import placement_problem

        problem = placement_problem(placement, world_size, world_key=world_key)
        if problem:
            raise PreflightError(problem)
        world_size -= placement.rollout_ranks
        world_key = "training ranks (world size - placement.rollout_ranks)"
    check_layout(cfg.model.path, cfg.train.tp, cfg.train.pp, world_size, world_key=world_key, ep=cfg.train.ep)
    if teacher:                            # the teacher runs in the actor's layout
        check_layout(teacher, cfg.train.tp, cfg.train.pp, world_size, world_key=world_key, ep=cfg.train.ep,
                     training=False)
    if cfg.train.share_prefix:
        check_share_prefix(cfg.model.path)
    kernel_notes = []
    if cfg.run.job == "rl":
        check_dtypes(cfg)
        check_engine_model(cfg)
        kernel_notes = check_native_kernels(cfg)
    train_size = check_task(cfg)
    if cfg.run.job == "rl":
        check_curriculum_and_suite(cfg)
    notes = warnings(cfg, int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or
                              cfg.distributed.nproc_per_node) if world_size is None else world_size)
    notes += check_objective(cfg, train_size) + kernel_notes
    try:
        if overwrite:
            run_dir = Path(cfg.run.dir)
            rundir.check_model_outside(cfg, [run_dir / name for name in rundir.OUTPUTS], "--overwrite removes it")
            return [*notes, f"--overwrite: an earlier run's outputs in {run_dir} are removed before the run starts"]
        plan = rundir.plan(cfg)
    except rundir.RunDirError as err:
        raise PreflightError(str(err)) from None
    return [*notes, plan.note] if plan.note else notes


def check_teacher(cfg: Any) -> str | None:
    """distill.teacher: a model hybridrl can load with the policy's tokenizer; returns its path (None: no teacher)."""
    from hybridrl.algo import distill

    if not distill.enabled(cfg):
        return None
    teacher = cfg.distill.teacher
    check_model(teacher, key="distill.teacher")
    problem = distill.tokenizer_problem(cfg.model.path, teacher)
    if problem:
        raise PreflightError(problem)
    return teacher


def check_interface(ifname: str) -> None:
    """distributed.socket_ifname names an interface of this host that has an IPv4 address."""
    if not ifname:
        return
    from hybridrl.distributed.network import InterfaceError, interface_address

    try:
        interface_address(ifname)
    except InterfaceError as err:
        raise PreflightError(str(err)) from None


def check_curriculum_and_suite(cfg: Any) -> None:
    """task.mixture settings the collection can honour, and trainer.eval_suite: tasks the run holds, the
    run's budgets, no instance shared with the training split (hybridrl.evaluate.protect)."""
    from hybridrl.envs.tasks.mixture import check_mixture
    from hybridrl.evaluate.protect import check_run

    problem = check_mixture(cfg) or check_run(cfg)
    if problem:
        raise PreflightError(problem)


def check_objective(cfg: Any, train_size: int | None) -> list[str]:
    """Combinations that would train something else than the config says (hybridrl/algo/explain.py):
    the first refusal raises, the warnings come back as notes."""
    from hybridrl.algo.explain import REFUSE, findings

    found = findings(cfg, train_size=train_size)
    for f in found:
        if f.level == REFUSE:
            raise PreflightError(f"{f} (hybridrl config show --explain says what the config trains)")
    return [f"warning: {f}" for f in found]



def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask: what a container or taskset allows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                # not Linux
        return os.cpu_count() or 1


def warnings(cfg: Any, ranks_per_node: int) -> list[str]:
    """What is allowed but almost certainly not what the user wants, one line each."""
    out = []
    device = cfg.distributed.device
    cpus = usable_cpus()
    gpu = device == "cuda" or (device == "auto" and _has_cuda())
    if not gpu and ranks_per_node > cpus:
        out.append(f"warning: {ranks_per_node} CPU ranks on {cpus} CPU(s) (distributed.nproc_per_node="
                   f"{cfg.distributed.nproc_per_node}): the ranks share cores and every collective waits for the "
                   f"slowest; a run with distributed.nproc_per_node={cpus} is usually faster")
    return out


def _has_cuda() -> bool:
    """A CUDA device is present, without importing torch (preflight stays light)."""
    return Path("/dev/nvidia0").exists() or bool(os.environ.get("CUDA_VISIBLE_DEVICES", "").strip("-1 "))


def check_model(path: str, *, key: str = "model.path", supported: bool = True) -> None:
    """An HF model directory hybridrl can load (`supported=False`: whatever its architecture)."""
    where = f"{key}={path}"
    d = Path(path)
    if not d.is_dir():
        raise PreflightError(f"{where}: no such directory (an HF model directory: config.json, *.safetensors, "
                             "tokenizer files; `hybridrl assets tiny-model --out DIR` makes a small one)")
    try:
        config = json.loads((d / "config.json").read_text())
    except FileNotFoundError:
        hint = (f"did you mean {key}={d / 'hf'}?" if (d / "hf" / "config.json").exists()
                else "is it the HF model directory itself?")
        raise PreflightError(f"{where}: no config.json there ({hint})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise PreflightError(f"{where}: config.json is not valid JSON ({err})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        if (d / "run.json").exists() or (d / "hf" / "config.json").exists():
            raise PreflightError(f"{where}: that is a run directory, not a model: did you mean {key}={d / 'hf'} "
                                 "(the HF model a finished run exports)?")
        raise PreflightError(f"{where}: config.json has no model_type (not a transformers model config)")
    index = d / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as err:
            raise PreflightError(f"{where}: model.safetensors.index.json has no readable weight_map ({err})") from None
        missing = [s for s in shards if not (d / s).exists()]
        if missing:
            raise PreflightError(f"{where}: {len(missing)} of {len(shards)} weight shards named in "
                                 f"model.safetensors.index.json are missing (first: {missing[0]})")
    elif not (d / "model.safetensors").exists():
        other = sorted(p.name for p in d.glob("*.bin")) + sorted(p.name for p in d.glob("*.pt"))
        hint = f" (found {other[0]}: only safetensors are read; convert with transformers' save_pretrained)" \
            if other else ""
        raise PreflightError(f"{where}: no weights: model.safetensors or model.safetensors.index.json{hint}")
    if not any((d / name).exists() for name in TOKENIZER_FILES):
        raise PreflightError(f"{where}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); the tokenizer is "
                             "loaded from the model directory")
    if supported:
        check_supported(path, key=key)


def check_supported(path: str, *, key: str = "model.path") -> None:
    """The architecture is one hybridrl implements (its Megatron adapters and the native engine)."""
    from hybridrl.backends.model_spec import ModelSpec

    try:
        ModelSpec.from_dir(path)
    except (ValueError, KeyError) as err:
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        detail = detail.split(": ", 1)[1] if detail.startswith(str(Path(path) / "config.json")) else detail
        raise PreflightError(f"{key}={path}: unsupported model: {detail}") from None


def check_scalar_head(path: str) -> None:
    """A reward model needs a scalar head: value_head.safetensors, or a 1-label classifier's score.weight."""
    d = Path(path)
    if (d / "value_head.safetensors").exists():
        return
    for weights in sorted(d.glob("*.safetensors")):
        with weights.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        if "score.weight" in header:
            rows = header["score.weight"]["shape"][0]
            if rows != 1:
                raise PreflightError(f"reward_model.path={path}: a sequence classifier with {rows} labels is not a "
                                     "reward model (needs num_labels=1)")
            return
    raise PreflightError(f"reward_model.path={path}: no scalar head (a 1-label *ForSequenceClassification "
                         "checkpoint with score.weight, or value_head.safetensors beside a causal LM); "
                         "`hybridrl assets tiny-classifier` makes a small one")
def check_layout(path: str, tp: int, pp: int, world_size: int, *, keys: tuple[str, str] = ("train.tp", "train.pp"),
                 world_key: str = "world size (distributed.nproc_per_node)", ep: int = 1,
                 ep_key: str = "train.ep", training: bool = True) -> None:
    """The model's config (one the engines implement: `ModelSpec`) and the parallel layout against
    its shape and the world size, before any process group exists (Megatron would fail on every
    rank after torchrun started)."""
    from hybridrl.backends.megatron.config import layout_problem
    from hybridrl.backends.model_spec import ModelSpec

    try:
        spec = ModelSpec.from_dir(path)
    except KeyError as err:
        raise PreflightError(f"model.path={path}: config.json lacks a usable {err} (needed to check "
                             f"{keys[0]}/{keys[1]})") from None
    except (TypeError, ValueError) as err:             # a model the engines do not implement, named by key
        raise PreflightError(f"model.path: {err}") from None
    problem = layout_problem(tp=tp, pp=pp, world_size=world_size, keys=keys, world_key=world_key,
                             num_layers=spec.num_layers, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                             intermediate_size=spec.intermediate_size, ep=ep, num_experts=spec.num_experts,
                             moe_intermediate_size=spec.moe_intermediate_size or None, ep_key=ep_key,
                             training=training)
    if problem:
        raise PreflightError(problem)


def check_share_prefix(path: str) -> None:
    """train.share_prefix lays shared prefixes out once; a mixture-of-experts model's routing record
    and load-balancing loss are per row token, so it is refused there."""
    from hybridrl.backends.model_spec import ModelSpec

    if ModelSpec.from_dir(path).is_moe:
        raise PreflightError(f"train.share_prefix=true: model.path={path} is a mixture-of-experts model, whose "
                             "routing replay and load-balancing loss count every row's tokens; set "
                             "train.share_prefix=false (packing alone, max_tokens_per_micro_batch, still works)")


def rollout_dtype(cfg: Any) -> tuple[str, str]:
    """(the rollout engine's dtype, the key that sets it). The native engine's `auto` is bfloat16 on
    CUDA and float32 on CPU (backends/native/core.py), decided by `distributed.device`; with
    `auto` there as well, by whether torch sees a CUDA device (only then is torch imported)."""
    engine = cfg.rollout.engine
    dtype = cfg.rollout.engine_section.dtype
    key = f"rollout.{engine}.dtype"
    if dtype != "auto":
        return dtype, key
    device = _device(cfg)
    return ("bfloat16" if device == "cuda" else "float32"), f"{key}=auto on {device}"


# the /proc/cpuinfo flags of the instructions that multiply each reduced dtype natively (one suffices)
CPU_MATRIX_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


def cpu_lacks_matrix_units(dtype: str, flags: set[str] | None = None) -> str | None:
    """Why this CPU cannot multiply `dtype` matrices natively (none of CPU_MATRIX_FLAGS[dtype] among its
    /proc/cpuinfo flags, `flags` when given), or None where it can or the flags cannot be read (not Linux:
    the training rank checks again with oneDNN's own answer)."""
    from hybridrl.host_memory import cpu_flags

    flags = cpu_flags()[1] if flags is None else flags
    if not flags or any(flag in flags for flag in CPU_MATRIX_FLAGS[dtype]):
        return None
    return "no " + " or ".join(CPU_MATRIX_FLAGS[dtype]) + " among /proc/cpuinfo's flags"


def _device(cfg: Any) -> str:
    device = cfg.distributed.device
    return ("cuda" if _torch_sees_cuda() else "cpu") if device == "auto" else device


def _torch_sees_cuda() -> bool:
    """torch.cuda.is_available(), without importing torch for a CPU-only build (its version.py says
    `cuda = None`), so that checks on a CPU machine stay light."""
    import importlib.util
    import re

    spec = importlib.util.find_spec("torch")
    for location in (spec.submodule_search_locations or []) if spec else []:
        version = Path(location) / "version.py"
        if version.exists() and re.search(r"^cuda\b[^=]*=\s*None\s*$", version.read_text(), re.M):
            return False
    import torch

    return torch.cuda.is_available()


def check_dtypes(cfg: Any) -> None:
    """The publication copies the trained tensors into the engine as they are (it does not convert
    dtypes), so an engine in another dtype than `train.dtype` refuses the first publication, after
    every rank started: refuse it here. And a parity tolerance below what those dtypes can meet
    (`publication.config.parity_tolerance_floor`) would fail the first probe."""
    from hybridrl.publication.config import default_parity_tolerance, parity_tolerance_floor

    train = cfg.train.dtype
    engine, key = rollout_dtype(cfg)
    if engine != train:
        setting = key.split("=")[0]
        raise PreflightError(f"train.dtype={train} but the rollout engine runs in {engine} ({key}): the weights are "
                             f"published as they are, without conversion; set {setting}={train} or "
                             f"train.dtype={engine}")
    if train != "float32" and _device(cfg) == "cpu" and (missing := cpu_lacks_matrix_units(train)):
        raise PreflightError(f"train.dtype={train} on this CPU: it has no {train} matrix instructions ({missing}), "
                             f"so {train} products would run emulated, many times slower than float32: set "
                             "train.dtype=float32 (and the rollout engine's dtype with it)")
    tolerance = cfg.publish.parity_tolerance
    if cfg.publish.parity_prompts and tolerance < parity_tolerance_floor(train, engine):
        raise PreflightError(f"publish.parity_tolerance={tolerance:g} cannot pass in {engine} (one {engine} rounding "
                             f"step of a logit of ~3 is 2^-6 nats): set publish.parity_tolerance="
                             f"{default_parity_tolerance(train, engine):g}, or publish.parity_prompts=0")


def check_engine_model(cfg: Any) -> None:
    """The rollout engine can serve model.path (its row's `model_problem`: vLLM refuses mixture-of-experts
    models, the reason in `backends.vllm.config.model_problem`)."""
    problem = cfg.rollout.engine_row.model_problem(cfg.model.path)
    if problem:
        raise PreflightError(problem)


def check_native_kernels(cfg: Any) -> list[str]:
    """The native engine's C kernels (`rollout.native.kernels`) where they apply (CPU, float32): compiled here,
    before any rank starts, so the ranks load them from the cache. `c` refuses a run they cannot serve;
    `auto` notes that decoding will run torch operators instead."""
    if cfg.rollout.engine != "native" or cfg.rollout.native.kernels == "torch":
        return []
    choice = cfg.rollout.native.kernels
    dtype, _ = rollout_dtype(cfg)
    device = cfg.distributed.device
    if device == "auto":
        device = "cuda" if _torch_sees_cuda() else "cpu"
    if device != "cpu" or dtype != "float32":
        if choice == "c":
            raise PreflightError(f"rollout.native.kernels=c: the native engine's C kernels run on the CPU in float32, "
                                 f"this run's engine runs {dtype} on {device}: set rollout.native.kernels=auto")
        return []
    from hybridrl.backends.native.kernel_build import KernelUnavailable, build_library

    try:
        build_library()
    except KernelUnavailable as err:
        if choice == "c":
            raise PreflightError(f"rollout.native.kernels=c: {err}. Install a C compiler (gcc), or set "
                                 f"rollout.native.kernels=auto to decode with torch operators (slower)") from None
        return [f"the native engine's C kernels cannot be built here, so decoding runs torch operators (slower): "
                f"{str(err).splitlines()[0][:300]} (rollout.native.kernels=torch says so and silences this)"]
    return []


def check_task(cfg: Any) -> int | None:
    """Draw what the run will draw from the task, so a task that cannot give it fails here; returns the
    train split's size (None for SFT)."""
    from hybridrl.envs.tasks import get_task

    name = cfg.task.name
    task = _step(name, "construct the task", lambda: get_task(name, cfg.task))
    sample = _step(name, "draw 4 train instances", lambda: task.train_split(4))
    demos = _step(name, "write demonstrations that use the tool",
                  lambda: task.sft_demonstrations(4, tool_use_fraction=1.0))
    allowed = sorted({tool for inst in sample for tool in inst.tools})
    if any(m.get("role") == "tool" for d in demos for m in d) and not allowed:
        raise PreflightError(f"task {name}: its demonstrations call a tool but its instances allow none: give "
                             "each TaskInstance tools=(...) (e.g. tools=(\"calculator\",)), or every tool call "
                             "is refused and earns nothing")
    from hybridrl.agent.tools.registry import tool_factory

    for tool in allowed:
        _step(name, f"find the tool {tool!r} its instances name", lambda: tool_factory(tool))
    if cfg.run.job == "sft":
        _step(name, f"draw sft.num_demonstrations={cfg.sft.num_demonstrations} demonstrations",
              lambda: task.sft_demonstrations(cfg.sft.num_demonstrations))
        return None
    split = _step(name, f"draw the train split (task.train_size={cfg.task.train_size})", task.train_split)
    _step(name, f"draw the validation split (task.validation_size={cfg.task.validation_size})",
          task.validation_split)
    return len(split)


def _step(name: str, what: str, fn):
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - the user's task code: report it in one line
        message = str(err).splitlines()[0] if str(err) else ""
        raise PreflightError(f"task {name}: cannot {what}: {type(err).__name__}: {message}") from None
