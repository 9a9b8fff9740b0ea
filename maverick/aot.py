"""Compiled graphs as AOTInductor packages on disk: a later run loads a step in a fraction of a second.

`torch.compile` caches what it can, but every process still traces the model with dynamo before it can
look a graph up (and a frozen graph is frozen and packed again): ~4 s a bucket for the 4-bit SmolLM2
engine, ~12 s for the dense one, so an engine took 20-90 s to start even when nothing was new. AOTInductor
does the trace once: `torch.export` captures the step, inductor compiles it with its frozen weights into a
shared library, and `aoti_load_package` maps that library back in ~0.2 s. The call is one C++ function:
no dynamo guards, no Python between kernels.

A package holds the weights it was built with (frozen into its library, or kept in its own files and
replaced by the module's tensors when loaded, `share_tensors`), so its file name is a hash of everything
its code and numbers depend on: the weights' bytes, the step's source files, the shapes, inductor's options, torch's
version, the CPU (its vector ISA and model: the kernels are built for it) and the thread count (inductor
builds it into each kernel's parallel loop). Packages are written under a temporary name and renamed, so
an interrupted build leaves nothing half-written behind; a later engine of the same weights loads them.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import platform
import shutil
import stat
import warnings
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import Tensor, nn

from maverick.cli import UserError

AOT_DIR = Path(__file__).resolve().parent.parent / ".cache" / "aoti"
# inductor's own cache in the repository (maverick.compiled.use_repo_cache points it here)
INDUCTOR_DIR = AOT_DIR.parent / "inductor"
# The CPU engines (compiled.py, eagle3/compiled_draft.py) are built and tested on torch 2.13. On 2.11
# (the lent GPUs' release, tried on this CPU) `torch.export` cannot prove the guards of the steps' dynamic
# key span (ConstraintViolationError on `blocks`), and with torch.compile instead the buckets' graphs gave
# rows different bits: speculative decoding's tokens left plain decoding's. So CPU engines refuse an
# older torch (`require_cpu_engines`); CUDA engines run one bucket and do not depend on it.
MIN_TORCH = (2, 13)


def supported(version: str | None = None) -> bool:
    """Whether this torch (or `version`) runs the compiled CPU engines: 2.13 or later."""
    major, minor = (int(x) for x in (version or torch.__version__).split(".")[:2])
    return (major, minor) >= MIN_TORCH


def require_cpu_engines(what: str) -> None:
    if not supported():
        raise UserError(
            f"{what} on CPU needs torch >= {'.'.join(map(str, MIN_TORCH))} (this is {torch.__version__}: its "
            "graphs do not keep each row's bits); use the eager engine, or the Makefile's torch"
        )


def cpu_name(cpuinfo: str | None = None) -> str:
    """What keys compiled and probed artefacts to this kind of CPU: its model name, and (where
    /proc/cpuinfo has them) its family, model, stepping and a hash of its feature flags. The name alone
    ('AMD EPYC') is one for Zen 4 and Zen 5 machines, and inductor builds with -march=native."""
    try:
        info: dict[str, str] = {}
        text = Path("/proc/cpuinfo").read_text() if cpuinfo is None else cpuinfo
        for line in text.splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
            if not line.strip() and info:
                break  # the first processor's block
    except OSError:
        return platform.processor()
    name = info.get("model name") or platform.processor()
    parts = [info[k] for k in ("cpu family", "model", "stepping") if k in info]
    if "flags" in info:
        parts.append(hashlib.blake2b(info["flags"].encode(), digest_size=4).hexdigest())
    return " ".join([name, *parts])


def weights_digest(module: nn.Module) -> str:
    """A hash of every parameter's and buffer's name, dtype, shape and bytes (~0.3 s for SmolLM2 in bf16)."""
    h = hashlib.blake2b(digest_size=16)
    seen: set[int] = set()
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if id(t) in seen:  # a tied weight once
            continue
        seen.add(id(t))
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def share_tensors(runner, module: nn.Module, path: Path) -> None:
    """Give a package built without its constants (`SHARED` options) the module's own parameters and buffers,
    by name, uncopied, so that every package of one module reads one set of weights; constants the trace
    made (index tensors) come from the package's own weight files. They are kept alive on the runner."""
    # every name of a tied tensor (the trace may name a tied head by its own name, not the embedding's)
    tensors = dict(module.named_parameters(remove_duplicate=False)) | dict(
        module.named_buffers(remove_duplicate=False)
    )
    names = runner.get_constant_fqns()
    consts = {n: tensors[n].detach() for n in names if n in tensors}
    rest = [n for n in names if n not in consts]
    if rest:
        with zipfile.ZipFile(path) as z:
            config = next(f for f in z.namelist() if f.endswith("weights_config.json"))
            where = json.loads(z.read(config))
            files = {f.rsplit("/", 1)[-1]: f for f in z.namelist() if "/data/weights/" in f}
            for n in rest:
                file, shape, stride, offset = where[n]
                t = torch.load(io.BytesIO(z.read(files[file])), weights_only=True)
                consts[n] = t.as_strided(shape, stride, offset)
    runner.load_constants(consts, check_full_update=True, user_managed=True)
    runner.maverick_constants = consts  # user-managed: the runner holds pointers, not references


# inductor options for a package whose weights stay outside its library (`share_tensors`)
SHARED = {
    "aot_inductor.package_constants_in_so": False,
    "aot_inductor.package_constants_on_disk_format": "pickle_weights",
}


def package_key(weights: str, sources: Iterable[str | os.PathLike], **spec) -> str:
    """The name of a package compiled from a module of these weights (`weights_digest`) and source files,
    with this spec (shapes, options: any repr-able values)."""
    h = hashlib.blake2b(digest_size=16)
    for src in sources:
        h.update(Path(src).read_bytes())
    env = {
        "torch": torch.__version__,
        "cpu": (torch.backends.cpu.get_cpu_capability(), cpu_name()),
        "threads": torch.get_num_threads(),
    }
    h.update(repr(sorted((env | spec).items())).encode())
    h.update(weights.encode())
    return h.hexdigest()


def load_or_build(
    module: nn.Module,
    args: tuple[Tensor, ...],
    dynamic_shapes: tuple,
    options: dict,
    key: str,
    directory: Path | None = None,
    prepare: Callable[[Callable, Path], None] | None = None,
) -> tuple[Callable, Path, bool]:
    """(the compiled module, its package, whether it came from disk) for `module(*args)`: the package `key`
    if there is one, else `module` exported, compiled with inductor's `options` and written first; then the
    least recently used packages past the directory's budget (`prune`) are deleted. `prepare(runner, path)`
    runs on the loaded package (`share_tensors`): a package it fails on is damaged too, and built again."""
    directory = directory or AOT_DIR
    path = directory / f"{key}.pt2"
    if path.exists():
        try:
            runner = torch._inductor.aoti_load_package(str(path))
            if prepare is not None:
                prepare(runner, path)
        except Exception as e:  # a damaged package (a disk that filled up, a copy cut short): built again
            warnings.warn(
                f"{path}: not a loadable package ({type(e).__name__}); building it again", stacklevel=2
            )
            path.unlink(missing_ok=True)
        else:
            with contextlib.suppress(OSError):  # recently used (a read-only or shared cache: no matter)
                os.utime(path)
            return runner, path, True
    directory.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{key}.{os.getpid()}.tmp.pt2")
    try:
        # no_grad for both: inductor freezes weights only when gradients are off; a copy of the options,
        # which the call adds to
        with torch.no_grad(), warnings.catch_warnings():
            # torch's own deep copy of the graph trips typing_extensions' deprecation of LeafSpec (torch 2.13):
            # printed twice per build, nothing for a user to act on
            warnings.filterwarnings(
                "ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning
            )
            program = torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=False)
            torch._inductor.aoti_compile_and_package(
                program, package_path=str(tmp), inductor_configs=dict(options)
            )
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    prune(directory, keep=path)
    clear_inductor_cache()
    runner = torch._inductor.aoti_load_package(str(path))
    if prepare is not None:
        prepare(runner, path)
    return runner, path, False


def clear_inductor_cache(directory: Path = INDUCTOR_DIR, budget_gib: float | None = None) -> bool:
    """Delete the repository's inductor cache once it holds more than `budget_gib` ($MAVERICK_INDUCTOR_GIB,
    default 4): every package build leaves its intermediate sources, libraries and frozen weights there,
    which the packages do not need (18 GB had gathered on one machine over many engine builds). A graph
    already loaded keeps running; the cache refills as graphs are compiled again. Returns whether it was
    deleted. Only this directory, never one the user chose (TORCHINDUCTOR_CACHE_DIR elsewhere)."""
    if budget_gib is None:
        budget_gib = float(os.environ.get("MAVERICK_INDUCTOR_GIB", 4))
    if not directory.is_dir():
        return False
    size = sum(  # os.walk skips a folder gone since its parent was listed (Path.rglob raised)
        st.st_size
        for root, _, names in os.walk(directory)
        for f in (Path(root, n) for n in names)
        if not f.is_symlink() and (st := _stat(f)) is not None
    )
    if size <= budget_gib * 2**30:
        return False
    shutil.rmtree(directory, ignore_errors=True)
    return True


def _stat(path: Path) -> os.stat_result | None:
    """A regular file's stat, or None for a folder or a file gone since it was listed (another process's
    prune or build)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def prune(directory: Path, keep: Path, budget_gib: float | None = None) -> list[Path]:
    """Delete the least recently used packages in `directory` (not `keep`) until the rest fit `budget_gib`
    ($MAVERICK_AOT_GIB, default 8: a dense SmolLM2 engine takes 331 MB, a 4-bit one 258): every edit of the
    step's source names new packages. Returns the deleted paths; they are rebuilt when asked for again."""
    if budget_gib is None:
        budget_gib = float(os.environ.get("MAVERICK_AOT_GIB", 8))
    # not a build under way; each stat once, and a package another process deleted meanwhile skipped
    packages = [
        (p, st) for p in directory.glob("*.pt2") if ".tmp." not in p.name and (st := _stat(p)) is not None
    ]
    packages.sort(key=lambda item: item[1].st_mtime, reverse=True)
    total, deleted = 0, []
    for p, st in packages:
        total += st.st_size
        if p != keep and total > budget_gib * 2**30:
            p.unlink(missing_ok=True)
            deleted.append(p)
    return deleted
