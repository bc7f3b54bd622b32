"""Plug-in points from outside the package: a toy rollout engine, a toy training engine (with its own `train`
section), a toy model family and a toy front end (tests/plugins/toy_plugins.py, one row or class each) run a
real RL job together, one torchrun rank."""

from __future__ import annotations

import json

import pytest

from hybridrl.telemetry.metrics import read_metrics
from tests.controller.test_rl_e2e import RECIPE, hybridrl_train

TOY = "tests.plugins.toy_plugins"


def _toy_model(source, out):
    """A copy of a tiny Llama whose config.json names only the toy family's architecture."""
    out.mkdir()
    for path in source.iterdir():
        (out / path.name).write_bytes(path.read_bytes())
    config = json.loads((out / "config.json").read_text())
    config.update(architectures=["ToyLlamaForCausalLM"], model_type="toyllama")
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory, tiny_models):
    base = tmp_path_factory.mktemp("toy")
    model = _toy_model(tiny_models("llama", init_std=0.05), base / "model")
    run_dir = base / "run"
    proc = hybridrl_train(RECIPE, f"model.path={model}", f"run.dir={run_dir}", "distributed.nproc_per_node=1",
                          "trainer.total_steps=1", "trainer.prompts_per_step=2", f"rollout.engine={TOY}:ENGINE",
                          f"train.engine={TOY}:TRAIN", "train.toy_mark=7", f"model.family={TOY}:FAMILY",
                          f"task.front_end={TOY}:ToyLoop")
    assert proc.returncode == 0, proc.stderr[-6000:]
    return run_dir


@pytest.mark.slow             # one 1-rank RL job: ~15 s alone, a minute on a busy 2-core machine
def test_a_toy_engine_family_and_front_end_run_an_rl_job(toy_run):
    import pyarrow.parquet as pq

    rows = read_metrics(toy_run)
    assert [r["step"] for r in rows] == [0, 1] and rows[1]["train/updated"] == 1 and rows[1]["episodes"] == 8
    assert rows[1]["train/toy_mark"] == 7.0                 # the toy training engine ran, reading its own section
    (shard,) = (toy_run / "ledger" / "data").glob("step_*1.parquet")
    trajs = pq.read_table(shard).to_pylist()
    assert len(trajs) == 8
    for t in trajs:
        assert json.loads(t["metadata"])["toy"] == {"front_end": "ToyLoop", "engine": "ToyEngine",
                                                    "family": "toyllama"}


def test_the_toy_family_is_one_row_found_by_its_architecture():
    from hybridrl.backends.families import FAMILIES, family_of, register_family
    from hybridrl.config.fields import ConfigValueError

    config = {"architectures": ["ToyLlamaForCausalLM"], "model_type": "toyllama"}
    row = register_family(f"{TOY}:FAMILY")
    assert family_of(config) is row and FAMILIES.get("toyllama") is row
    with pytest.raises(ValueError, match=r"architectures=\['NopeForCausalLM'\].*model.family=module:ATTR"):
        family_of({"architectures": ["NopeForCausalLM"]})
    with pytest.raises(ConfigValueError, match="not an hybridrl.backends.families.ModelFamily"):
        register_family(f"{TOY}:ToyLoop")


def test_the_train_section_is_the_selected_training_engines_own(tmp_path):
    from hybridrl.backends.megatron.config import MegatronConfig
    from hybridrl.config import ConfigError, load_config
    from tests.plugins.toy_plugins import ToyTrainConfig

    model = f"model.path={tmp_path}"
    assert type(load_config(RECIPE, [model]).train) is MegatronConfig
    cfg = load_config(RECIPE, [model, f"train.engine={TOY}:TRAIN", "train.toy_mark=3", "train.lr=2e-5"])
    assert type(cfg.train) is ToyTrainConfig and cfg.train.toy_mark == 3.0 and cfg.train.lr == 2e-5
    recipe = tmp_path / "recipe.yaml"                      # the engine named in a recipe, its knob overridden
    recipe.write_text(RECIPE.read_text() + f"\ntrain:\n  engine: {TOY}:TRAIN\n")
    assert load_config(recipe, [model, "train.toy_mark=4"]).train.toy_mark == 4.0
    with pytest.raises(ConfigError, match=r"section 'train' has no 'toy_mark'"):
        load_config(RECIPE, [model, "train.toy_mark=3"])            # Megatron's section has no such knob
    with pytest.raises(ConfigError, match=r"train.engine.*unknown training engine 'megatrn'.*did you mean 'megatron'"):
        load_config(RECIPE, [model, "train.engine=megatrn"])
