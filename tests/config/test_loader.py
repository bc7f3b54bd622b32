"""Config loading: layers, overrides, one-line errors that name the key and the file."""

from __future__ import annotations

import subprocess
import sys
import time

from dataclasses import dataclass

import pytest
from omegaconf import MISSING

from hybridrl.config import Config, ConfigError, knob, load_config, section
from hybridrl.config.loader import CONFIGS_DIR, defaults_yaml
from tests.launch import ROOT

RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


def write(tmp_path, text, name="recipe.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_layers_and_overrides(tmp_path):
    recipe = write(tmp_path, "run:\n  name: exp1\n  seed: 3\ndistributed:\n  nproc_per_node: 2\n")
    cfg = load_config(recipe, ["run.seed=7", "distributed.call_timeout_s=12.5"])
    assert isinstance(cfg, Config)
    assert cfg.run.name == "exp1" and cfg.run.seed == 7
    assert cfg.run.dir == "runs/exp1"           # interpolation resolved after the override layer
    assert cfg.distributed.nproc_per_node == 2 and cfg.distributed.call_timeout_s == 12.5


@pytest.mark.parametrize("text, key, words", [
    ("run:\n  nmae: x\n", "run.nmae", ["unknown key", "did you mean 'name'"]),
    ("distributed:\n  nproc_per_node: two\n", "distributed.nproc_per_node", ["expected int", "'two'"]),
    ("distributed:\n  nproc_per_node: 0\n", "distributed.nproc_per_node", ["must be > 0"]),
    ("runn:\n  name: x\n", "runn", ["unknown key", "did you mean 'run'"]),
    ("run: 3\n", "run", ["is a section", "expected a mapping"]),
    ("run:\n  job: nosuchjob\n", "run.job", ["expected one of"]),
    ("rollout:\n  engine: sglang\npublish:\n  verify: post_copy\n", "publish.verify",
     ["reads its weights back", "publish.verify=structure"]),      # the engine row's reads_back_weights
    ("trainer:\n  validation_size: 9\n", "trainer.validation_size", ["moved", "'task.validation_size'"]),
    ("sft:\n  tool_use_fraction: 0.5\n", "sft.tool_use_fraction", ["moved", "'task.sft_tool_use_fraction'"]),
])
def test_bad_recipe_is_one_line_naming_key_and_file(tmp_path, text, key, words):
    recipe = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(recipe)
    message = str(info.value)
    assert "\n" not in message
    assert info.value.key == key and f"key '{key}'" in message
    assert "recipe.yaml" in message
    for w in words:
        assert w in message


def test_bad_override_names_the_command_line(tmp_path):
    with pytest.raises(ConfigError, match=r"command line: key 'run.seed': expected int"):
        load_config(None, ["run.seed=abc"])
    with pytest.raises(ConfigError, match="not of the form section.key=value"):
        load_config(None, ["run.seed"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml: no such file"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match=r"invalid YAML: line \d+: expected"):
        load_config(write(tmp_path, "run:\n  name: [x\n"))


@dataclass(kw_only=True)
class _Need:
    path: str = knob(MISSING, "a required path")


@dataclass(kw_only=True)
class _Root:
    need: _Need = section(_Need)


def test_required_value_missing(tmp_path):
    Root = _Root
    with pytest.raises(ConfigError, match="key 'need.path': required value missing"):
        load_config(None, [], schema=Root, configs_dir=None)
    assert load_config(None, ["need.path=/x"], schema=Root, configs_dir=None).need.path == "/x"


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.name for r in RECIPES])
def test_every_shipped_recipe_loads(recipe):
    load_config(recipe)


def test_configs_dir_mirrors_the_schema():
    """configs/<section>.yaml is generated from the dataclasses: it documents every key."""
    texts = defaults_yaml()
    on_disk = {p.stem: p.read_text() for p in CONFIGS_DIR.glob("*.yaml")
               if p.name != "prices.yaml"}     # not a config section: the price table of `hybridrl cost`
    assert on_disk == texts, "configs/ is stale: run `hybridrl config defaults --write configs`"


def test_config_keys_are_pinned():
    """Adding or renaming a key is a deliberate change: update this list with it."""
    from hybridrl.config.loader import to_dict

    def keys(d, prefix=""):
        for k, v in d.items():
            yield from keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]

    got = sorted(keys(to_dict(load_config())))
    assert got == sorted(PINNED_KEYS), f"config keys changed: {sorted(set(got) ^ set(PINNED_KEYS))}"


PINNED_KEYS = [
    "run.name", "run.dir", "run.job", "run.seed", "run.log_level",
    "distributed.nproc_per_node", "distributed.device", "distributed.call_timeout_s",
    "distributed.heartbeat_interval_s", "distributed.heartbeat_timeout_s", "distributed.init_timeout_s",
    "distributed.error_grace_s", "distributed.socket_ifname",
    "placement.mode", "placement.rollout_ranks",
    "model.path", "model.family",
    "selfcheck.batch_size", "selfcheck.fail_rank",
    "agent.max_turns", "agent.max_new_tokens_per_turn", "agent.on_turn_limit", "agent.on_agent_error", "agent.max_response_tokens", "agent.max_episode_s",
    "agent.max_concurrent_episodes", "agent.temperature", "agent.top_p", "agent.top_k",
    "agent.max_tool_calls_per_turn", "agent.max_observation_chars", "agent.on_weights_updated", "agent.abort_grace_s",
    "tools.pool_size", "tools.warm", "tools.isolation", "tools.require_isolation", "tools.force_isolation_none",
    "tools.timeout_s", "tools.cpu_s", "tools.memory_mb", "tools.max_processes", "tools.cgroup_parent",
    "tools.max_open_files", "tools.cpu_cores", "tools.max_file_mb", "tools.tmpfs_mb", "tools.tmpfs_inodes", "tools.network",
    "tools.egress_max_connections", "tools.allowed_destinations", "tools.audit_log", "tools.kill_switch",
    "tools.max_output_bytes", "tools.uid_base", "tools.visible_paths", "tools.hidden_paths", "tools.python", "tools.calculator_max_chars", "tools.mcp",
    "task.name", "task.seed", "task.train_size", "task.validation_size", "task.format_weight",
    "task.sft_tool_use_fraction", "task.sft_guess_correct_fraction", "task.agent", "task.front_end",  # task.options: a free mapping
    "task.mixture", "task.sampler", "task.sampler_floor", "task.sampler_window", "task.share_policy",
    "task.share_tolerance", "task.share_max_wait_rounds",
    "gateway.listen", "gateway.host", "gateway.port", "gateway.tool_parser", "gateway.reasoning_parser",
    "gateway.render_tools", "gateway.on_drift", "gateway.check_tokens", "gateway.prefix_affinity_slack",
    "gateway.agent_grace_s", "gateway.model_name", "gateway.http_thread", "gateway.max_body_kb", "gateway.max_request_chars",
    "gateway.max_connections", "gateway.keep_alive_s", "gateway.read_timeout_s", "gateway.special_tokens_in_messages",
    "env.db_path", "env.lease_ttl_s", "env.synchronous", "env.busy_timeout_s", "env.step_timeout_s", "env.max_retries",
    "env.audit_log",
    "train.engine", "train.tp", "train.pp", "train.ep", "train.moe_aux_loss_coef", "train.moe_z_loss_coef", "train.micro_batch_size", "train.max_tokens_per_micro_batch", "train.share_prefix", "train.logprob_chunk_tokens",
    "train.dtype", "train.lr", "train.min_lr",
    "train.lr_warmup_steps", "train.lr_decay_steps", "train.lr_schedule", "train.weight_decay",
    "train.adam_beta1", "train.adam_beta2", "train.adam_eps", "train.clip_grad",
    "train.use_distributed_optimizer", "train.loss_aggregation", "train.attention", "train.recompute_activations",
    "train.make_vocab_size_divisible_by", "train.seed",
    "train.lora.rank", "train.lora.alpha", "train.lora.dropout", "train.lora.target_modules",
    "rollout.engine", "rollout.tp", "rollout.native.block_size", "rollout.native.kv_cache_mb", "rollout.native.num_blocks", "rollout.native.max_num_seqs", "rollout.native.keep_kv_cache", "rollout.native.release_weights", "rollout.native.trainer_weights",
    "rollout.native.max_num_batched_tokens", "rollout.native.max_model_len", "rollout.native.enable_prefix_caching", "rollout.native.dtype",
    "rollout.native.seed", "rollout.native.on_weight_update", "rollout.native.update_after_steps", "rollout.native.watermark_blocks", "rollout.native.driver", "rollout.native.kernels",
    "rollout.native.speculative_tokens", "rollout.native.speculative_ngram_min", "rollout.native.speculative_ngram_max",
    "rollout.sglang.mem_fraction_static", "rollout.sglang.dtype", "rollout.sglang.enable_memory_saver",
    "rollout.sglang.load_format", "rollout.sglang.base_port", "rollout.sglang.context_length", "rollout.sglang.cuda_graph",
    "rollout.sglang.deterministic_inference",
    "rollout.vllm.dtype", "rollout.vllm.kv_cache_mb", "rollout.vllm.max_num_seqs", "rollout.vllm.max_num_batched_tokens",
    "rollout.vllm.max_model_len", "rollout.vllm.enable_prefix_caching", "rollout.vllm.enforce_eager", "rollout.vllm.threads",
    "rollout.vllm.gpu_memory_utilization", "rollout.vllm.enable_sleep_mode", "rollout.vllm.log_level",
    "rollout.replicas.dtype", "rollout.replicas.urls", "rollout.replicas.registry", "rollout.replicas.min_live",
    "rollout.replicas.wait_s", "rollout.replicas.connect_timeout_s", "rollout.replicas.request_timeout_s",
    "publish.bucket_mb", "publish.verify", "publish.parity_prompts", "publish.parity_tokens", "publish.parity_every",
    "publish.parity_tolerance", "hybrid.spill_optimizer", "hybrid.offload_deadline_s", "hybrid.publish_deadline_s",
    "hybrid.wake_deadline_s", "hybrid.sleep_deadline_s", "hybrid.reload_deadline_s", "hybrid.drain_deadline_s",
    "algo.advantage", "algo.router_replay", "algo.norm_adv_by_std", "algo.reinforce_baseline", "algo.gamma", "algo.lam",
    "algo.gae_whiten",
    "critic.path", "critic.lr", "critic.min_lr", "critic.lr_warmup_steps", "critic.lr_decay_steps",
    "critic.lr_schedule", "critic.weight_decay", "critic.clip_grad", "critic.value_clip", "critic.warmup_steps",
    "critic.offload",
    "distill.teacher", "distill.kl_coef", "distill.reward_weight", "distill.discount",
    "reward_model.path", "reward_model.component", "reward_model.weight", "reward_model.batch_size",
    "reward_model.offload",
    "algo.policy_loss", "algo.clip_low", "algo.clip_high", "algo.dual_clip", "algo.kl_estimator", "algo.kl_coef",
    "algo.kl_in", "algo.entropy_coef", "algo.tis_cap", "algo.tis_mode", "algo.mis", "algo.mis_low", "algo.mis_high",
    "algo.drop_truncated", "algo.overlong_buffer", "algo.overlong_penalty", "algo.drop_all_equal_groups",
    "algo.max_policy_lag", "algo.stale", "algo.partial_policy", "algo.ppo_epochs", "algo.ppo_mini_batches",
    "trainer.total_steps", "trainer.prompts_per_step", "trainer.group_size", "trainer.validate_every",
    "trainer.validation_temperature", "trainer.eval_suite", "trainer.eval_every", "trainer.checkpoint_every",
    "trainer.keep_checkpoints", "trainer.resume", "trainer.export_hf", "trainer.log_samples", "trainer.max_restarts",
    "trainer.inject",
    "trainer.rollout_mode", "trainer.oversample", "trainer.quorum", "trainer.rollout_deadline_s", "trainer.collect_poll_s",
    "trainer.dynamic_sampling", "trainer.max_sampling_rounds", "trainer.max_groups_per_step",
    "trainer.queue_max_groups", "trainer.queue_max_tokens", "trainer.queue_policy",
    "trainer.stop_after_dead_steps", "trainer.stop_after_failed_steps", "trainer.peak_flops", "trainer.callbacks",
    "trainer.metrics_port", "trainer.metrics_host",
    "incidents.nan", "incidents.mismatch", "incidents.mismatch_max", "incidents.drop", "incidents.drop_metric",
    "incidents.drop_by", "incidents.drop_window", "incidents.kl", "incidents.kl_max", "incidents.all_failed",
    "incidents.rollback_lr_scale", "incidents.max_rollbacks",
    "sft.data", "sft.num_demonstrations", "sft.steps", "sft.batch_size", "sft.output_dir",
    "sft.log_every", "sft.validate_every",
    "store.enabled", "store.text", "store.keep_steps", "store.max_mb", "store.compression",
    "telemetry.timeline", "telemetry.traces", "telemetry.trace_endpoint", "telemetry.trace_sample",
]


def _cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "hybridrl", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_cli_config_show_resolves():
    proc = _cli("config", "show", "--config", "recipes/selfcheck.yaml", "run.seed=5")
    assert proc.returncode == 0, proc.stderr
    assert "seed: 5" in proc.stdout and "nproc_per_node: 2" in proc.stdout


def test_cli_bad_config_exits_2_before_any_process_group(tmp_path):
    recipe = write(tmp_path, "run:\n  sede: 1\n")
    started = time.monotonic()
    proc = _cli("train", str(recipe))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "key 'run.sede'" in lines[0] and "recipe.yaml" in lines[0], proc.stderr
    assert "launching" not in proc.stderr      # torchrun was never started
    assert time.monotonic() - started < 30
    proc = _cli("config", "show", "--config", str(tmp_path / "missing.yaml"))
    assert proc.returncode == 2 and "missing.yaml: no such file" in proc.stderr
