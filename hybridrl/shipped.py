"""The recipes that ship with hybridrl, found the same way from a source checkout and a pip install.

A wheel carries them as package data (`hybridrl/recipes/`, see setup.py); a source checkout or an
editable install has them in the repository's `recipes/`. `hybridrl init recipe NAME` copies one
into the working directory, where it is the user's to edit.
"""

from __future__ import annotations

import shutil
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def recipes_dir() -> Path:
    for candidate in (_PACKAGE / "recipes", _PACKAGE.parent / "recipes"):   # a wheel; a source checkout
        if candidate.is_dir() and any(candidate.glob("*.yaml")):
            return candidate
    raise FileNotFoundError(f"no shipped recipes next to {_PACKAGE} (a broken install? reinstall hybridrl)")


def recipe_names() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def recipe_path(name: str) -> Path:
    """The shipped recipe `name` (with or without .yaml)."""
    stem = name[:-5] if name.endswith(".yaml") else name
    path = recipes_dir() / f"{stem}.yaml"
    if not path.is_file():
        import difflib

        close = difflib.get_close_matches(stem, recipe_names(), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise FileNotFoundError(f"no shipped recipe {stem!r}: {hint}the recipes are: {', '.join(recipe_names())}")
    return path


def copy_recipe(name: str, out: Path, *, force: bool = False) -> Path:
    """Copy the shipped recipe `name` to `out`: a file when it ends in .yaml / .yml, else a directory
    to put NAME.yaml in."""
    source = recipe_path(name)
    target = out if out.suffix in (".yaml", ".yml") else out / source.name
    if target.exists() and not force:
        raise FileExistsError(f"{target} exists (--force replaces it)")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    return target
