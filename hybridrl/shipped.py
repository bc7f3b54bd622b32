"""The recipes that ship with hybridrl, found the same way from a source checkout and a pip install.

A wheel carries them as package data (`hybridrl/recipes/`, see setup.py); a source checkout or an
editable install has them in the repository's `recipes/`. `hybridrl init recipe NAME` copies one
into the working directory, where it is the user's to edit. A recipe's relative input paths (e.g.
`model.path: runs/demo/sft/hf`) mean a directory relative to where hybridrl runs, so the copy
writes the ones that exist now (here, or in the checkout the recipe came from) as absolute paths,
and names the ones that do not; its comments' `recipes/NAME.yaml` become what works from the copy.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

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


def copy_recipe(name: str, out: Path, *, force: bool = False) -> tuple[Path, list[str]]:
    """Copy the shipped recipe `name` to `out` (a file when it ends in .yaml / .yml, else a directory to
    put NAME.yaml in), its paths made to work from anywhere (`portable`); returns (the copy, the notes)."""
    source = recipe_path(name)
    target = out if out.suffix in (".yaml", ".yml") else out / source.name
    if target.exists() and not force:
        raise FileExistsError(f"{target} exists (--force replaces it)")
    text, notes = portable(source.read_text(), Path.cwd(), source.parent.parent, source.stem, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    return target, notes


OUTPUT_KEYS = ("run.dir", "output_dir")      # where a run writes: relative to where it runs, as the user chose


def portable(text: str, cwd: Path, origin: Path, stem: str, target: Path) -> tuple[str, list[str]]:
    """`text` of a recipe with every relative input path that exists under `cwd` (else under `origin`, the
    directory the shipped recipes' paths are relative to) made absolute, and the mentions of
    `recipes/X.yaml` in its comments replaced by what works beside `target`; with a note for each input
    path that exists in neither place."""
    import yaml

    notes = []
    for key, value in _path_values(yaml.safe_load(text) or {}):
        found = next((base / value for base in (cwd, origin) if (base / value).exists()), None)
        if found is None:
            notes.append(f"{key}: {value} does not exist here yet (a path relative to where you run hybridrl): make "
                         f"it (the recipe's comments say how) or pass {key}=PATH")
            continue
        leaf = re.escape(key.rsplit(".", 1)[-1])
        text = re.sub(rf"^(\s*{leaf}:\s*){re.escape(value)}(?=\s*(#.*)?$)",
                      lambda m: m.group(1) + str(found.resolve()), text, flags=re.M)
    copy = target if not target.is_absolute() else Path(target.name) if target.parent == cwd else target
    text = re.sub(r"\brecipes/([\w.-]+)\.yaml\b", lambda m: str(copy) if m.group(1) == stem else
                  f"{m.group(1)}.yaml (hybridrl init recipe {m.group(1)})", text)
    return text, notes


def _path_values(node: Any, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted key, value) of every relative input path in a parsed recipe: a string under a key named path,
    dir or *_path / *_dir / *_file, not an output directory (OUTPUT_KEYS)."""
    out = []
    for key, value in (node.items() if isinstance(node, dict) else ()):
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            out += _path_values(value, dotted + ".")
        elif (isinstance(value, str) and value and not value.startswith(("/", "~", "$"))
              and (key in ("path", "dir") or str(key).endswith(("_path", "_dir", "_file")))
              and not any(dotted == k or dotted.endswith("." + k) for k in OUTPUT_KEYS)):
            out.append((dotted, value))
    return out
