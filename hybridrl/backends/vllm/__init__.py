"""vLLM rollout backend (`rollout.engine: vllm`; vLLM lives in its own venv: `make vllm-venv`).

`config` is plain Python (recipes validate without vLLM); `engine.VLLMEngine` imports vLLM when
built; `worker` runs inside vLLM's worker process; `transport` delivers flat buckets to it.
"""
