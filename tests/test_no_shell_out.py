"""The library and its tooling never run a system package manager (issue 18: a former corpus
builder called ``apt-get download`` / ``dpkg-deb`` at run time), and the test/CI commands install
only from PyPI, with the assets pinned by hash."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_PACKAGE_MANAGERS = re.compile(r"\b(apt-get|apt|dpkg|dpkg-deb|yum|dnf|apk|zypper|pacman|brew|port|snap)\s+"
                               r"(install|download|add|-x|-i|update|upgrade|get)\b")


def _sources():
    yield from sorted((ROOT / "src").rglob("*.py"))
    yield ROOT / "Makefile"
    yield ROOT / ".ci" / "run"


def test_no_system_package_manager_anywhere():
    offenders = []
    for path in _sources():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if _PACKAGE_MANAGERS.search(line) or "dpkg-deb" in line or "apt-get" in line:
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert offenders == []


def test_removed_corpus_modules_stay_removed():
    for name in ("corpora.py", "rdata.py"):
        assert not list((ROOT / "src").rglob(name)), name
