"""SGLang rollout backend (GPU extra: `pip install -e .[sglang]`). The only home of sglang imports.

Nothing here imports sglang at module import time: `config` and `convert` are plain Python so
recipes validate and the glue is tested on CPU; `engine.SGLangEngine` imports sglang when built.
"""
