"""The GRPO recipe text every scaffold shares (`hybridrl init task`, `init task --from ...`, `init agent`)."""

# From `train:` on: 20 steps of 16 prompts x 8 samples on 2 CPU ranks, the shipped CPU recipes' settings. It
# holds no braces, so a scaffold may append it to a header it formats, or format the two together.
GRPO_BODY = '''\
train:
  micro_batch_size: 32
  max_tokens_per_micro_batch: 2048
  lr: 5.0e-5
  lr_schedule: constant
  weight_decay: 0.0
  clip_grad: 1.0
rollout:
  native:
    kv_cache_mb: 64
agent:
  max_turns: 3
  max_new_tokens_per_turn: 32
  max_response_tokens: 96
  temperature: 1.0
tools:
  pool_size: 1
  warm: 0
algo:
  advantage: grpo
  norm_adv_by_std: false
  kl_coef: 0.0
trainer:
  total_steps: 20
  prompts_per_step: 16
  group_size: 8
  validate_every: 5
  checkpoint_every: 10
  keep_checkpoints: 1
'''
