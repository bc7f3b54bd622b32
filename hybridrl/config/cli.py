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
    stray = next((item for item in items if "=" not in item), None)
    if stray is not None:
        raise ConfigError(f"'{stray}' is neither the recipe (it comes first) nor a section.key=value override",
                          source=COMMAND_LINE)
    return recipe, [*items, *extra]
