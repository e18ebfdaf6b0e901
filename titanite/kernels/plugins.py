"""Kernel plugins: modules that register implementations when imported.

Two ways in: the `kernels.plugins` list (a dotted module name on the Python path, or a path to a
`.py` file or package folder, whose parent folder then goes on the path), and packages that
advertise a module in the `titanite.kernels` entry-point group (loaded whenever the registry
is first used by a command). Each plugin is imported once per process.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import sys
from pathlib import Path

from titanite.core.errors import UserError

log = logging.getLogger("titanite")

ENTRY_POINT_GROUP = "titanite.kernels"
_loaded_entry_points = False


def _import_path(entry: str) -> str:
    """A .py file or package folder -> its module name, with its parent folder on sys.path."""
    path = Path(entry)
    if not path.exists():
        raise UserError(f"config key 'kernels.plugins': {entry} does not exist")
    if path.is_dir() and not (path / "__init__.py").is_file():
        raise UserError(f"config key 'kernels.plugins': {entry} is a folder without __init__.py")
    parent = str(path.resolve().parent)
    if parent not in sys.path:
        sys.path.insert(0, parent)
    return path.stem if path.suffix == ".py" else path.name


def load_plugins(entries: list[str]) -> list[str]:
    """Import every `kernels.plugins` entry and every `titanite.kernels` entry point.

    Returns the module names imported. A missing module is a UserError naming the entry; an
    error raised inside a plugin propagates with its own traceback (it is the plugin's bug).
    """
    names = load_entry_points()
    for entry in entries:
        is_path = entry.endswith(".py") or "/" in entry or "\\" in entry
        module = _import_path(entry) if is_path else entry
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is not None and module.startswith(e.name):
                raise UserError(f"config key 'kernels.plugins': cannot import '{entry}' ({e}); install the "
                                f"package, put it on PYTHONPATH, or give a path to its .py file or folder") from None
            raise
        names.append(module)
    if names:
        log.info("kernel plugins: %s", ", ".join(names))
    return names


def load_entry_points() -> list[str]:
    """Import the modules advertised in the `titanite.kernels` entry-point group (once)."""
    global _loaded_entry_points
    if _loaded_entry_points:
        return []
    _loaded_entry_points = True
    names = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        ep.load()
        names.append(ep.value)
    return names
