"""Load a run config: schema defaults <- configs/<section>.yaml <- recipe <- key=value overrides.

Every layer is merged into the typed (OmegaConf structured) schema, so an unknown key, a value of
the wrong type or a failed validation raises `ConfigError` with one line naming the key, the
layer it came from and what was expected. Nothing here starts a process group.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigKeyError,
    OmegaConfBaseException,
    ValidationError,
)

from hybridrl.config.fields import ConfigError, ConfigValueError, field_help
from hybridrl.config.schema import root

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"
COMMAND_LINE = "the command line"

# keys that moved: a recipe that still sets the old one is told where it went
MOVED_KEYS = {
    "trainer.validation_size": "task.validation_size",
    "sft.tool_use_fraction": "task.sft_tool_use_fraction",
}


def load_config(
    recipe: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    schema: type | None = None,
    configs_dir: Path | None = CONFIGS_DIR,
) -> Any:
    """Resolve and validate a config; returns an instance of `schema` (dataclasses all the way; by default
    the root `Config` whose `train` section is the class of the training engine the layers select)."""
    layers = _read_layers(recipe, overrides, configs_dir, schema or root())
    if schema is None:
        engine = _train_engine(layers)
        schema = root(engine)
        layers = [(source, layer) for source, layer, section_file in layers
                  if section_file != "train" or _engine_of(layer, source) in (None, engine)]
    else:
        layers = [(source, layer) for source, layer, _ in layers]
    merged, sources = _merge_layers(layers, schema)
    try:
        missing = sorted(OmegaConf.missing_keys(merged))
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        detail = (getattr(err, "msg", None) or str(err)).splitlines()[0]
        raise ConfigError(f"cannot resolve value: {detail}", key=key, source=sources.get(key)) from None
    if missing:
        raise ConfigError(
            f"required value missing: set it in the recipe or pass {missing[0]}=VALUE", key=missing[0]
        )
    return _instantiate(merged, schema, "", sources)


def structured(cls: type, values: Mapping[str, Any]) -> Any:
    """An instance of the dataclass `cls` from plain `values`, typed like a config section: each
    value is coerced to its field's type (as `key=value` overrides are), and a wrong type, a
    failed validation or any error of `cls`'s own checks raises `ConfigValueError` naming the
    field. Unknown keys are the caller's to report (it knows what they belong to)."""
    try:
        node = OmegaConf.merge(OmegaConf.structured(cls), OmegaConf.create(dict(values)))
    except OmegaConfBaseException as err:
        translated = _translate(err, cls, "")
        raise ConfigValueError(translated.key or "", translated.detail) from None
    try:
        return _instantiate(node, cls, "", {})
    except ConfigError as err:
        raise ConfigValueError(err.key or "", err.detail) from None
    except ConfigValueError:
        raise
    except Exception as err:  # noqa: BLE001 - a user's __post_init__ may raise anything
        raise ConfigValueError("", f"{cls.__name__}: {type(err).__name__}: {err}") from None


def to_yaml(cfg: Any) -> str:
    """The resolved config as YAML (what `hybridrl config show` prints)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Any) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def defaults_yaml(schema: type | None = None) -> dict[str, str]:
    """One documented YAML text per top-level section: the content of `configs/<section>.yaml`."""
    schema = schema or root()
    texts = {}
    for f in dataclasses.fields(schema):
        cls = typing.get_type_hints(schema)[f.name]
        lines = [f"# {f.name}: {field_help(f) or cls.__doc__ or ''}".rstrip(),
                 "# Written by `hybridrl config defaults --write configs`; edit the dataclass, not this file.",
                 f"{f.name}:"]
        lines += _documented_lines(cls, indent=2)
        texts[f.name] = "\n".join(lines) + "\n"
    return texts


# ---------------------------------------------------------------------------------------------
# merging


def _read_layers(recipe, overrides, configs_dir, schema) -> list[tuple[str, DictConfig, str | None]]:
    """(source, layer, the section a configs/<section>.yaml holds, else None), lowest first."""
    layers: list[tuple[str, DictConfig, str | None]] = []
    if configs_dir is not None and configs_dir.is_dir():
        for f in dataclasses.fields(schema):
            path = configs_dir / f"{f.name}.yaml"
            if path.exists():
                layer = _read_yaml(path)
                extra = set(layer) - {f.name}
                if extra:
                    raise ConfigError(f"holds section '{sorted(extra)[0]}'; it may only hold '{f.name}'",
                                      source=_display(path))
                layers.append((_display(path), layer, f.name))
    if recipe is not None:
        path = Path(recipe)
        layers.append((_display(path), _read_yaml(path), None))
    if overrides:
        layers.append((COMMAND_LINE, _parse_overrides(overrides), None))
    return layers


def _train_engine(layers: Sequence[tuple[str, DictConfig, str | None]]) -> str | None:
    """The `train.engine` the highest layer that sets it names (None: none does, the default engine), checked
    against the training engines' registry here (through the section table, `root`), so that an unknown one
    names its layer. A configs/train.yaml written for another engine than the selected one is left out (it
    documents that engine's knobs)."""
    chosen = None
    for source, layer, _ in layers:
        engine = _engine_of(layer, source)
        if engine is None:
            continue
        try:
            root(engine)
        except ConfigValueError as err:
            raise ConfigError(str(err), key="train.engine", source=source) from None
        chosen = engine
    return chosen


def _engine_of(layer: DictConfig, source: str) -> str | None:
    try:
        engine = OmegaConf.select(layer, "train.engine", default=None)
    except OmegaConfBaseException:
        raise ConfigError("is a section; expected a mapping", key="train", source=source) from None
    if isinstance(engine, (DictConfig, list)) or OmegaConf.is_list(engine):
        raise ConfigError(f"expected str, got {type(engine).__name__}", key="train.engine", source=source)
    return None if engine is None else str(engine)


def _merge_layers(layers: Sequence[tuple[str, DictConfig]], schema: type):
    merged = OmegaConf.structured(schema)
    sources: dict[str, str] = {}
    for source, layer in layers:
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as err:
            raise _translate(err, schema, source) from None
        for key in _flat_keys(layer):
            sources[key] = source
    return merged, sources


def _read_yaml(path: Path) -> DictConfig:
    if not path.exists():
        raise ConfigError("no such file", source=_display(path))
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"invalid YAML: {where}{problem}", source=_display(path)) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"expected a mapping of sections at the top, got {type(data).__name__}",
                          source=_display(path))
    return OmegaConf.create(data)


def _parse_overrides(overrides: Sequence[str]) -> DictConfig:
    for item in overrides:
        key = item.split("=", 1)[0]
        if "=" not in item or not key or key.startswith("."):
            raise ConfigError(f"override '{item}' is not of the form section.key=value", source=COMMAND_LINE)
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as err:
        raise ConfigError(f"cannot parse overrides: {err.msg if hasattr(err, 'msg') else err}",
                          source=COMMAND_LINE) from None


def _flat_keys(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, DictConfig):
        keys = []
        for k in node.keys():
            child = node._get_node(k)
            full = f"{prefix}{k}"
            keys.append(full)
            if isinstance(child, DictConfig):
                keys += _flat_keys(child, full + ".")
        return keys
    return []


# ---------------------------------------------------------------------------------------------
# errors


def _translate(err: OmegaConfBaseException, schema: type, source: str) -> ConfigError:
    key = getattr(err, "full_key", None) or None
    if isinstance(err, ConfigKeyError) and key in MOVED_KEYS:
        return ConfigError(f"this key moved: set '{MOVED_KEYS[key]}' instead", key=key, source=source)
    if isinstance(err, ConfigKeyError) and key:
        parent, _, leaf = key.rpartition(".")
        cls = _schema_at(schema, parent)
        if dataclasses.is_dataclass(cls):
            known = [f.name for f in dataclasses.fields(cls)]
            hint = difflib.get_close_matches(leaf, known, n=1)
            owner = f"section '{parent}'" if parent else "the config"
            msg = f"unknown key: {owner} has no '{leaf}'"
            msg += f"; did you mean '{hint[0]}'?" if hint else f"; known keys: {', '.join(known)}"
            return ConfigError(msg, key=key, source=source)
        return ConfigError(f"unknown key under '{parent}' (it is not a section)", key=key, source=source)
    if isinstance(err, ValidationError) and key:
        expected = _schema_at(schema, key)
        got = _value_of(err)
        if dataclasses.is_dataclass(expected):
            return ConfigError(f"is a section ({expected.__name__}); expected a mapping, got {got}",
                               key=key, source=source)
        return ConfigError(f"expected {_type_name(expected)}, got {got}", key=key, source=source)
    section = _section_given_scalar(err, schema)
    if section:
        return ConfigError(f"is a section ({_schema_at(schema, section).__name__}); expected a mapping",
                           key=section, source=source)
    detail = getattr(err, "msg", None) or str(err).splitlines()[0]
    return ConfigError(detail.splitlines()[0], key=key, source=source)


def _section_given_scalar(err: OmegaConfBaseException, schema: type) -> str | None:
    """OmegaConf reports `section: 3` as "Merge error: int is not a subclass of X" without a key."""
    msg = getattr(err, "msg", None) or str(err)
    if "is not a subclass of" not in msg:
        return None
    wanted = msg.split("is not a subclass of", 1)[1].split(".")[0].strip()
    return next((f.name for f in dataclasses.fields(schema)
                 if getattr(typing.get_type_hints(schema)[f.name], "__name__", "") == wanted), None)


def _value_of(err: ValidationError) -> str:
    msg = getattr(err, "msg", "") or ""
    # OmegaConf: "Value 'abc' of type 'str' could not be converted to Integer"
    if msg.startswith("Value '"):
        value, _, rest = msg[len("Value '"):].partition("' of type '")
        return f"'{value}' ({rest.split(chr(39))[0]})"
    return msg.splitlines()[0] if msg else "an incompatible value"


def _schema_at(schema: type, dotted: str) -> Any:
    cls: Any = schema
    for part in [p for p in dotted.split(".") if p]:
        if not dataclasses.is_dataclass(cls):
            return None
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return None
        cls = hints[part]
    return cls


def _type_name(tp: Any) -> str:
    if tp is None:
        return "a value"
    origin = typing.get_origin(tp)
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    return getattr(tp, "__name__", str(tp))


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


# ---------------------------------------------------------------------------------------------
# instantiation with validation that names the key


def _instantiate(node: DictConfig, cls: type, prefix: str, sources: dict[str, str]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        full = f"{prefix}{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _instantiate(node[f.name], tp, full + ".", sources)
            continue
        try:
            value = node[f.name]
        except OmegaConfBaseException as err:
            detail = (getattr(err, "msg", None) or str(err)).splitlines()[0]
            raise ConfigError(f"cannot resolve value: {detail}", key=full, source=sources.get(full)) from None
        if isinstance(value, (DictConfig,)) or OmegaConf.is_list(value):
            value = OmegaConf.to_container(value, resolve=True)
        kwargs[f.name] = value
    try:
        return cls(**kwargs)
    except ConfigValueError as err:
        key = f"{prefix}{err.field}"
        raise ConfigError(str(err), key=key, source=sources.get(key)) from None


def _documented_lines(cls: type, indent: int) -> list[str]:
    hints = typing.get_type_hints(cls)
    pad = " " * indent
    lines = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        help_text = field_help(f)
        if dataclasses.is_dataclass(tp):
            if help_text:
                lines.append(f"{pad}# {help_text}")
            lines.append(f"{pad}{f.name}:")
            lines += _documented_lines(tp, indent + 2)
            continue
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            value = f.default_factory()  # type: ignore[misc]
        else:
            value = "???"
        rendered = OmegaConf.to_yaml(OmegaConf.create({f.name: value})).rstrip("\n").splitlines()
        if help_text:
            lines.append(f"{pad}# {help_text}")
        lines += [pad + line for line in rendered]
    return lines
