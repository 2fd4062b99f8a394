"""A small pure-Python reader for R's serialization format and lazy-load databases.

R packages keep their data sets in a *lazy-load database*: ``data/Rdata.rdx`` (an
index, itself a compressed serialized R list) and ``data/Rdata.rdb`` (the objects,
each one serialized and compressed on its own).  This module reads enough of the
format (XDR serialization, versions 2 and 3) to get character, numeric, logical and
list data out of such a database without R, e.g. the Jane Austen novels in the
Debian package ``r-cran-janeaustenr``.

Supported: ``NULL``, logical, integer, double, complex, character, raw and generic
vectors (``list``), pairlists, symbols and references to them, attributes, and the
ALTREP compact sequences and wrappers R writes for ``1:n`` style vectors.  Closures,
environments, byte code and other language objects raise :class:`NotImplementedError`.

Values map to Python as follows: ``NULL`` -> ``None``; atomic vectors -> ``list``
(``NA`` -> ``None``); a generic vector -> ``list``; a pairlist -> ``list`` of
``(tag, value)``; a symbol -> :class:`RSymbol`; any of these with attributes ->
:class:`RObject` wrapping the value (``names`` become ``dict`` keys via
:func:`as_dict`).
"""

from __future__ import annotations

import bz2
import dataclasses
import gzip
import lzma
import os
import struct
import zlib
from pathlib import Path
from typing import Any

__all__ = [
    "RObject",
    "RSymbol",
    "unserialize",
    "as_dict",
    "decompress",
    "read_rds",
    "LazyLoadDB",
]

# SEXP types (R internals, "Serialization Formats" in R Internals).
_NILSXP, _SYMSXP, _LISTSXP, _LANGSXP = 0, 1, 2, 6
_CHARSXP, _LGLSXP, _INTSXP, _REALSXP, _CPLXSXP = 9, 10, 13, 14, 15
_STRSXP, _VECSXP, _EXPRSXP, _RAWSXP, _S4SXP = 16, 19, 20, 24, 25
# Pseudo types that only exist in serialized streams.
_ALTREP_SXP = 238
_ATTRLISTSXP, _ATTRLANGSXP = 239, 240
_SPECIAL_ENVS = {
    242: "<emptyenv>", 241: "<baseenv>", 253: "<globalenv>", 252: "<unbound>",
    251: "<missing>", 250: "<basenamespace>",
}
_NILVALUE_SXP, _REFSXP = 254, 255

_NA_INTEGER = -(2**31)
# CHARSXP "levels" bits giving the string's encoding.
_LATIN1_MASK, _UTF8_MASK, _BYTES_MASK, _ASCII_MASK = 1 << 2, 1 << 3, 1 << 1, 1 << 6


@dataclasses.dataclass(frozen=True)
class RSymbol:
    """An R symbol (the tag of a pairlist cell, an attribute name, ...)."""

    name: str


@dataclasses.dataclass
class RObject:
    """An R value that carries attributes.

    Attributes
    ----------
    value : Any
        The bare value (a ``list`` for vectors).
    attributes : dict of str to Any
        Attribute name -> value, e.g. ``{"names": [...], "class": ["data.frame"]}``.
    """

    value: Any
    attributes: dict[str, Any]


class _Reader:
    """Reads one XDR-serialized R object from ``data`` (recursive descent)."""

    def __init__(self, data: bytes | memoryview):
        self.buf = memoryview(data)
        self.pos = 0
        self.refs: list[Any] = []
        self.native_encoding = "utf-8"

    # ---- primitives (XDR is big-endian)

    def _take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise ValueError(f"truncated R serialization: need {n} bytes at offset {self.pos}")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def int(self) -> int:
        return struct.unpack(">i", self._take(4))[0]

    def length(self) -> int:
        n = self.int()
        if n == -1:  # long vector: two more ints, upper and lower 32 bits
            upper, lower = struct.unpack(">II", self._take(8))
            n = (upper << 32) + lower
        return n

    # ---- header and items

    def header(self) -> None:
        fmt = bytes(self._take(2))
        if fmt != b"X\n":
            raise ValueError(f"unsupported R serialization format {fmt!r} (only XDR 'X\\n')")
        version = self.int()
        self.int()  # version of R that wrote it
        self.int()  # oldest R that can read it
        if version == 3:
            n = self.int()
            enc = bytes(self._take(n)).decode("ascii", "replace")
            self.native_encoding = _python_encoding(enc)
        elif version != 2:
            raise ValueError(f"unsupported R serialization version {version}")

    def item(self) -> Any:
        flags = self.int()
        sxp = flags & 0xFF
        levels = flags >> 12
        has_attr = bool(flags & (1 << 9))
        has_tag = bool(flags & (1 << 10))

        if sxp == _NILVALUE_SXP:
            return None
        if sxp in _SPECIAL_ENVS:
            return _SPECIAL_ENVS[sxp]
        if sxp == _REFSXP:
            index = flags >> 8 or self.int()
            return self.refs[index - 1]
        if sxp == _SYMSXP:
            sym = RSymbol(self.item())  # the name is a CHARSXP
            self.refs.append(sym)
            return sym
        if sxp in (_LISTSXP, _LANGSXP, _ATTRLISTSXP, _ATTRLANGSXP):
            return self._pairlist(has_attr, has_tag)
        if sxp == _CHARSXP:
            return self._charsxp(levels)
        if sxp == _ALTREP_SXP:
            return self._altrep()
        if sxp == _S4SXP:
            return RObject(None, self._attributes()) if has_attr else RObject(None, {})
        value = self._vector(sxp)
        if has_attr:
            return RObject(value, self._attributes())
        return value

    def _pairlist(self, has_attr: bool, has_tag: bool) -> Any:
        # Iterate along the cdr chain instead of recursing: pairlists can be long.
        cells: list[tuple[Any, Any]] = []
        attrs: dict[str, Any] = {}
        while True:
            if has_attr:
                attrs.update(self._attributes())
            tag = self.item() if has_tag else None
            car = self.item()
            cells.append((tag.name if isinstance(tag, RSymbol) else tag, car))
            flags = self.int()
            sxp = flags & 0xFF
            if sxp == _NILVALUE_SXP:
                break
            if sxp not in (_LISTSXP, _LANGSXP, _ATTRLISTSXP, _ATTRLANGSXP):
                # An improper list: the cdr is another kind of object.
                self.pos -= 4
                cells.append((None, self.item()))
                break
            has_attr = bool(flags & (1 << 9))
            has_tag = bool(flags & (1 << 10))
        return RObject(cells, attrs) if attrs else cells

    def _attributes(self) -> dict[str, Any]:
        cells = self.item()
        if not isinstance(cells, list):
            raise ValueError(f"malformed attribute list at offset {self.pos}")
        return {str(tag): value for tag, value in cells}

    def _charsxp(self, levels: int) -> str | None:
        n = self.int()
        if n == -1:
            return None  # NA_character_
        raw = bytes(self._take(n))
        if levels & (_UTF8_MASK | _ASCII_MASK):
            return raw.decode("utf-8", "replace")
        if levels & _LATIN1_MASK:
            return raw.decode("latin-1")
        if levels & _BYTES_MASK:
            return raw.decode("latin-1")  # arbitrary bytes: keep them all, one char each
        return raw.decode(self.native_encoding, "replace")

    def _vector(self, sxp: int) -> list[Any] | bytes:
        if sxp == _NILSXP:
            return []
        n = self.length()
        if sxp in (_LGLSXP, _INTSXP):
            vals = struct.unpack(f">{n}i", self._take(4 * n))
            if sxp == _LGLSXP:
                return [None if v == _NA_INTEGER else bool(v) for v in vals]
            return [None if v == _NA_INTEGER else v for v in vals]
        if sxp == _REALSXP:
            return list(struct.unpack(f">{n}d", self._take(8 * n)))
        if sxp == _CPLXSXP:
            vals = struct.unpack(f">{2 * n}d", self._take(16 * n))
            return [complex(vals[i], vals[i + 1]) for i in range(0, 2 * n, 2)]
        if sxp == _RAWSXP:
            return bytes(self._take(n))
        if sxp in (_STRSXP, _VECSXP, _EXPRSXP):
            return [self.item() for _ in range(n)]
        raise NotImplementedError(f"R object type {sxp} (SEXPTYPE) is not supported")

    def _altrep(self) -> Any:
        info = self.item()  # pairlist: class symbol, package symbol, type
        state = self.item()
        attr = self.item()
        cls = info[0][1].name if isinstance(info, list) and info else str(info)
        value = _expand_altrep(cls, state)
        if isinstance(attr, list) and attr:
            return RObject(value, {str(tag): v for tag, v in attr})
        return value


def _expand_altrep(cls: str, state: Any) -> Any:
    """Materialize the ALTREP classes that R writes for ordinary data."""
    if cls in ("compact_intseq", "compact_realseq"):
        n, start, step = state if isinstance(state, list) else state.value
        conv = int if cls == "compact_intseq" else float
        return [conv(start + i * step) for i in range(int(n))]
    if cls.startswith("wrap_"):  # wrapper around an ordinary vector plus metadata
        payload = state[0]
        return payload.value if isinstance(payload, RObject) else payload
    if cls == "deferred_string":  # as.character() of a number vector, not yet done
        arg = state[0][1] if isinstance(state, list) and state and isinstance(state[0], tuple) else state
        values = arg.value if isinstance(arg, RObject) else arg
        return [None if v is None else _r_number_string(v) for v in values]
    raise NotImplementedError(f"ALTREP class {cls!r} is not supported")


def _r_number_string(v: float | int) -> str:
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return repr(v)


def _python_encoding(r_name: str) -> str:
    name = r_name.strip().lower()
    if name in ("", "native.enc", "utf-8", "utf8"):
        return "utf-8"
    if name in ("latin1", "iso-8859-1", "iso8859-1", "cp1252"):
        return "latin-1"
    return name


def unserialize(data: bytes | memoryview) -> Any:
    """Decode one object in R's XDR serialization format (``serialize(x, NULL)``).

    Parameters
    ----------
    data : bytes
        Uncompressed serialized bytes, starting with ``b"X\\n"``.

    Returns
    -------
    Any
        The object, mapped to Python as described in the module docstring.

    Raises
    ------
    ValueError
        Not XDR format, an unknown version, or truncated data.
    NotImplementedError
        The object contains a type this reader does not handle.
    """
    reader = _Reader(data)
    reader.header()
    return reader.item()


def as_dict(obj: Any) -> dict[str, Any]:
    """Turn a named R list (an :class:`RObject` with ``names``) into a ``dict``.

    Raises
    ------
    ValueError
        ``obj`` has no ``names`` attribute.
    """
    if isinstance(obj, RObject) and "names" in obj.attributes:
        return dict(zip(obj.attributes["names"], obj.value))
    if isinstance(obj, list) and all(isinstance(c, tuple) and len(c) == 2 for c in obj):
        return {str(tag): value for tag, value in obj}  # a tagged pairlist
    raise ValueError(f"not a named R list: {type(obj).__name__}")


_MAGIC = ((b"\x78", zlib.decompress), (b"BZh", bz2.decompress), (b"\xfd7zXZ\x00", lzma.decompress))


def decompress(blob: bytes) -> bytes:
    """Decompress one lazy-load database record (R's ``R_decompress1/2/3``).

    A record is a 4-byte big-endian uncompressed length, then (for the
    bzip2/xz variants) a one-byte method code, then the compressed stream; the
    stream type is recognised by its magic bytes.

    Raises
    ------
    ValueError
        Unknown compression, or the result does not have the announced length.
    """
    if len(blob) < 5:
        raise ValueError(f"lazy-load record too short ({len(blob)} bytes)")
    expected = struct.unpack(">I", blob[:4])[0]
    body = blob[4:]
    out: bytes | None = None
    for start in (0, 1):  # with or without the method byte
        for magic, fn in _MAGIC:
            if body[start:start + len(magic)] == magic:
                out = fn(body[start:])
                break
        if out is not None:
            break
    if out is None and body[:1] == b"0":  # method "0": stored uncompressed
        out = body[1:]
    if out is None:
        raise ValueError(f"unknown compression in lazy-load record (bytes {body[:6].hex()})")
    if len(out) != expected:
        raise ValueError(f"lazy-load record has {len(out)} bytes, expected {expected}")
    return out


def read_rds(path: str | os.PathLike) -> Any:
    """Read an ``.rds`` file (``saveRDS``; gzip, bzip2, xz or uncompressed)."""
    raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    elif raw[:3] == b"BZh":
        raw = bz2.decompress(raw)
    elif raw[:6] == b"\xfd7zXZ\x00":
        raw = lzma.decompress(raw)
    return unserialize(raw)


class LazyLoadDB:
    """An R lazy-load database (``<base>.rdx`` + ``<base>.rdb``), read without R.

    Parameters
    ----------
    base : path-like
        Path without extension, e.g. ``.../janeaustenr/data/Rdata``.

    Examples
    --------
    >>> db = LazyLoadDB("/usr/lib/R/site-library/janeaustenr/data/Rdata")  # doctest: +SKIP
    >>> db.names()                                                         # doctest: +SKIP
    ['emma', 'mansfieldpark', ...]
    >>> lines = db["emma"]                                                 # doctest: +SKIP
    """

    def __init__(self, base: str | os.PathLike):
        self.base = Path(base)
        index = as_dict(read_rds(self.base.with_suffix(".rdx")))
        self._variables = {k: v for k, v in as_dict(index["variables"]).items()}

    def names(self) -> list[str]:
        """Object names in the database, in stored order."""
        return list(self._variables)

    def __contains__(self, name: object) -> bool:
        return name in self._variables

    def __getitem__(self, name: str) -> Any:
        if name not in self._variables:
            raise KeyError(f"{name!r} is not in {self.base}.rdb; it has {self.names()}")
        offset, size = (int(v) for v in self._variables[name])
        with open(self.base.with_suffix(".rdb"), "rb") as f:
            f.seek(offset)
            blob = f.read(size)
        return unserialize(decompress(blob))
