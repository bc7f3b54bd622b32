"""hybridrl: a colocated single-controller hybrid-engine RL trainer for LLM agents."""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent


def read_version() -> str:
    for line in (ROOT / "hybridrl" / "__init__.py").read_text().splitlines():
        if line.startswith("__version__"):
            return line.split("=")[1].strip().strip('"')
    raise RuntimeError("hybridrl/__init__.py has no __version__")


# Tested with reasoning-gym 0.1.25 (its generators and score_answer) and datasets 5.2.
REASONING_GYM = ["reasoning-gym>=0.1.19,<0.2"]
DATA = ["datasets>=2.14"]
# Tested with verifiers 0.4.0 (its `verifiers.v1` tasksets and rewards), mcp 2.0.0, fastmcp 4.1.1 and
# openenv-core 0.3.0 (its server app and /ws session protocol; uvicorn serves it, websockets speaks to it).
VERIFIERS = ["verifiers>=0.4,<0.5"]
MCP = ["mcp>=2.0,<3", "fastmcp>=2.10"]
OPENENV = ["openenv-core>=0.3,<0.4", "uvicorn>=0.30", "websockets>=13"]
ENVS = [*REASONING_GYM, *DATA, *VERIFIERS, *MCP, *OPENENV]
METRICS = ["prometheus_client>=0.20"]
OTEL = ["opentelemetry-sdk>=1.25", "opentelemetry-exporter-otlp-proto-http>=1.25"]

setup(
    name="hybridrl",
    version=read_version(),
    description="Colocated single-controller hybrid-engine RL for LLM agents (Megatron-core + SGLang/native)",
    long_description=(ROOT / "README.md").read_text(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    # the shipped recipes travel inside the package (hybridrl/recipes/ in a wheel), so a pip-installed
    # user has them too: `hybridrl init recipe NAME` copies one out (hybridrl/shipped.py finds them)
    packages=[*find_packages(include=["hybridrl", "hybridrl.*"]), "hybridrl.recipes"],
    package_dir={"hybridrl.recipes": "recipes"},
    include_package_data=True,
    # the native engine's C kernels are compiled on the user's machine at first use (cpu_kernels.py)
    package_data={"hybridrl": ["py.typed"], "hybridrl.backends.native": ["*.c"],
                  "hybridrl.recipes": ["*.yaml", "slurm/*", "data/*", "envs/*"]},
    install_requires=[
        # CPU installs take torch==2.13.0 first (see Makefile); GPU users keep their own build.
        "torch>=2.4",
        # The Megatron backend is tested against 0.16.1; the CPU compatibility patches in
        # hybridrl/backends/megatron/cpu_compat.py name the call sites they cover in that range.
        "megatron-core>=0.16.1,<0.17",
        "transformers>=5.0,<6",
        "tokenizers>=0.21",
        "safetensors>=0.4",
        "omegaconf>=2.3",
        "numpy>=1.26",
        "tensorboard>=2.15",
        "psutil>=5.9",
        "tqdm>=4.66",
        "pyyaml>=6",
        "xxhash>=3.4",
        "pyarrow>=14",          # the run ledger's data plane (Parquet)
    ],
    extras_require={
        # pytest-xdist: `make test` runs the suite in two worker processes (Makefile: TEST_WORKERS)
        "test": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "matplotlib>=3.8", "pyseccomp>=0.1.2",
                 "peft>=0.17", "openai>=1.40", "starlette>=0.37", "uvicorn>=0.30", *ENVS, *METRICS, *OTEL,
                 # the dead-name check of `make test` (tests/test_dead_code.py)
                 "vulture>=2.14",
                 # the documentation site (mkdocs.yml; `make docs`), built with --strict by tests/docs/test_site.py;
                 # mkdocstrings renders the API reference (docs/reference/api.md) from the docstrings
                 "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26"],
        # environments users already have (docs/tasks.md "Environments you already have"): each a task source
        "reasoning-gym": REASONING_GYM,      # task.name: reasoning_gym
        "data": DATA,                        # task.name: data / sft.data reading a `datasets` dataset saved to disk
        "verifiers": VERIFIERS,              # task.name: verifiers
        "mcp": MCP,                          # tools.mcp: MCP tool servers (fastmcp for the shipped example)
        "openenv": OPENENV,                  # task.name: openenv
        "envs": ENVS,                        # all of them
        # LoRA adapters loaded onto an HF model from a PEFT directory (`export_peft` writes one)
        "lora": ["peft>=0.17"],
        # task.agent: agents written with the OpenAI client, through the gateway (hybridrl/gateway/; the task
        # section names these when missing). Tested with openai 3.57, starlette 1.10, uvicorn 0.54.
        "gateway": ["openai>=1.40", "starlette>=0.37", "uvicorn>=0.30"],
        # `hybridrl plot` (imported only there; the command says how to install it when missing)
        "plot": ["matplotlib>=3.8"],
        # the tool sandbox's syscall filter: libseccomp through a ctypes binding (the system's libseccomp.so.2)
        "sandbox": ["pyseccomp>=0.1.2"],
        # trainer.metrics_port: live Prometheus metrics from rank 0 (hybridrl/telemetry/live.py)
        "metrics": METRICS,
        # telemetry.traces: OpenTelemetry spans per episode and step (hybridrl/telemetry/otel.py)
        "otel": OTEL,
        # GPU rollout backend; never needed on CPU.
        # One exact release, the one hybridrl/backends/sglang is written against (requests.SGLANG_VERSION):
        # 0.5.18-0.5.21 pin torch==2.13.0 and transformers==5.12.1 (inside our transformers>=5,<6); 0.5.4-0.5.9
        # pin transformers 4.57.1 and 0.5.22+ torch 2.14.1, which would replace the user's torch.
        "sglang": ["sglang==0.5.21"],
    },
    entry_points={"console_scripts": ["hybridrl=hybridrl.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
