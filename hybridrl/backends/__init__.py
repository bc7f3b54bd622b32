"""Heavy backends, each the only home of its dependency: megatron/ (training), native/ and sglang/ (rollout)."""
