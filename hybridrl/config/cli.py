"""One convention for recipes on every command line: `CMD RECIPE [key=value ...]` or
`CMD --config RECIPE [key=value ...]` (or no recipe: the defaults and the overrides)."""

from __future__ import annotations

import argparse
from typing import Sequence

from hybridrl.config.fields import ConfigError
from hybridrl.config.loader import COMMAND_LINE


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe_args", nargs="*", metavar="[RECIPE] key=value",
                        help="the recipe YAML (or --config), then section.key=value overrides")
    parser.add_argument("--config", default=None, metavar="RECIPE", help="the recipe YAML")


def recipe_and_overrides(positional: Sequence[str], config: str | None,
                         extra: Sequence[str] = ()) -> tuple[str | None, list[str]]:
    """(recipe, overrides) from the positional arguments and --config; `extra` overrides go last."""
    items = list(positional)
    recipe = config
    if items and "=" not in items[0]:
        if config is not None:
            raise ConfigError(f"two recipes: --config {config} and {items[0]}; give one", source=COMMAND_LINE)
        recipe = items.pop(0)
    stray = next((i for i, item in enumerate(items) if "=" not in item), None)
    if stray is not None:
        raise ConfigError(not_an_override(items, stray, recipe_given=True), source=COMMAND_LINE)
    return recipe, [*items, *extra]


def not_an_override(items: Sequence[str], i: int, *, recipe_given: bool = False) -> str:
    """One line for `items[i]`, which has no `=`: what it is not, and the override it probably meant."""
    item = items[i]
    what = "neither the recipe (it comes first) nor" if recipe_given else "not"
    following = items[i + 1] if i + 1 < len(items) else None
    if "." in item and not item.startswith("-") and following is not None and "=" not in following:
        hint = f": write {item}={following}"
    elif "." in item and not item.startswith("-"):
        hint = f": write {item}=VALUE"
    else:
        hint = " (overrides are section.key=value, e.g. trainer.total_steps=5)"
    return f"'{item}' is {what} a section.key=value override{hint}"


def show_text(cfg, *, diff: bool = False, sections: Sequence[str] = ()) -> str:
    """What `hybridrl config show` prints: the resolved config as YAML; `sections` (a section or a dotted
    path, e.g. `trainer` or `agent.temperature`) keeps only those; `diff` only what differs from the
    defaults, each with the default beside it."""
    from hybridrl.config.loader import load_config, to_dict

    data = to_dict(cfg)
    if sections:
        data = _select(data, sections)
    if not diff:
        from omegaconf import OmegaConf

        return OmegaConf.to_yaml(OmegaConf.create(data))
    defaults = to_dict(load_config())
    return _emit(data, _select(defaults, sections) if sections else defaults) or "# the same as the defaults\n"


def _select(data: dict, paths: Sequence[str]) -> dict:
    out: dict = {}
    for path in paths:
        node, target, parts = data, out, path.split(".")
        for depth, part in enumerate(parts):
            if not isinstance(node, dict) or part not in node:
                known = sorted(node) if isinstance(node, dict) else []
                where = ".".join(parts[:depth]) or "the config"
                raise ConfigError(f"--section {path}: {where} has no '{part}'"
                                  + (f" (it has: {', '.join(known)})" if known else ""), source=COMMAND_LINE)
            node = node[part]
            if depth == len(parts) - 1:
                target[part] = node
            else:
                target = target.setdefault(part, {})
    return out


def _emit(data: dict, defaults: dict, *, indent: int = 0) -> str:
    import yaml

    def scalar(value) -> str:
        text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
        return text[:-4].strip() if text.endswith("\n...") else text

    lines = []
    for key, value in data.items():
        default = defaults.get(key) if isinstance(defaults, dict) else None
        pad = " " * indent
        if isinstance(value, dict) and value:
            inner = _emit(value, default if isinstance(default, dict) else {}, indent=indent + 2)
            if inner:
                lines.append(f"{pad}{key}:\n{inner}")
        elif not isinstance(defaults, dict) or key not in defaults:
            lines.append(f"{pad}{key}: {scalar(value)}   # not in the defaults\n")
        elif value != default:
            lines.append(f"{pad}{key}: {scalar(value)}   # default: {scalar(default)}\n")
    return "".join(lines)
