#!/usr/bin/env python
"""Prepare ``.whl/`` for one call on the lent GPU machine (``scripts/gpu_run.sh``), and check that
what travels stays under the call's 64 MiB.

The machine (``nvidia-h200``, /work/.library/device/KINDS.md) has Python 3.12 with torch 2.11,
Triton 3.6 and transformers 5.17, and no registry. This script downloads, for CPython 3.12 on
manylinux x86_64, the wheels that the image lacks: ``transformers==5.23.0`` (pyproject.toml's
floor) and whatever of its requirements (``Requires-Dist``, followed through every carried wheel)
the image's versions do not satisfy, exactly one version of each; torch and Triton are never
carried (the image's are the ones to measure). Then it adds up what the call sends: the repository's
tracked and untracked-not-ignored files (``git ls-files -co --exclude-standard``), ``shared/`` if
there is one, and ``.whl/``, and fails if that is over 64 MiB.

    python scripts/prepare_gpu_wheels.py                # download what is missing, then check the size
    python scripts/prepare_gpu_wheels.py --check-only   # only the size check (no network)
    python scripts/prepare_gpu_wheels.py --verify-env   # on the machine: do the installed versions
                                                        # satisfy transformers' requirements?

Needs ``pip`` and ``packaging`` (both in the dev venv and on the image).
"""

from __future__ import annotations

import argparse
import email.parser
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 64 * 1024 * 1024  # what one device call may carry: working tree plus carried paths
WANTED = ("transformers==5.23.0",)

#: Versions on the image, as KINDS.md's pip list gives them (2026-11).
IMAGE = {
    "accelerate": "1.15.0", "huggingface-hub": "1.33.0", "numpy": "2.5.2", "safetensors": "0.8.0",
    "tokenizers": "0.23.2", "torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0",
    "sentencepiece": "0.2.2", "tiktoken": "0.14.0",
}
#: Packages on the image whose version KINDS.md does not give: pip installed the image's
#: transformers 5.17.0 with them, so they satisfy what 5.17.0 requires of them (its Requires-Dist).
IMAGE_SATISFIES = {
    "packaging": ">=20.0", "pyyaml": ">=5.1", "regex": ">=2025.10.22", "typer": "", "tqdm": ">=4.60",
    # KINDS.md lists it on the image without a version; gguf asks for >=2.25 (2020).
    "requests": ">=2.25",
}
#: Never carried: the image's builds (CUDA 13) are what the GPU run measures.
NEVER_CARRY = {"torch", "triton"}
#: The environment the wheels are for (markers in Requires-Dist are evaluated against it).
TARGET_ENV = {
    "python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
    "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
    "platform_machine": "x86_64", "os_name": "posix", "platform_release": "", "platform_version": "",
    "implementation_version": "3.12.3", "extra": "",
}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")


def _name_version(wheel: Path) -> tuple[str, str]:
    name, version = wheel.name.split("-")[:2]
    return canonicalize_name(name), version


def wheel_requires(wheel: Path) -> list[Requirement]:
    """The wheel's ``Requires-Dist`` that apply on the target (no extras; markers evaluated there)."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        message = email.parser.Parser().parsestr(zf.read(meta).decode())
    out = []
    for line in message.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or Marker(str(req.marker)).evaluate(TARGET_ENV):
            out.append(req)
    return out


def image_satisfies(req: Requirement, image: dict = IMAGE, implied: dict = IMAGE_SATISFIES) -> bool | None:
    """True / False when the image's version of ``req.name`` is known; for a package listed in
    ``implied``, True when ``req``'s specifier is no stricter than what the image is known to
    satisfy (the same specifier, or none); None when the image's version cannot be told."""
    name = canonicalize_name(req.name)
    if name in image:
        return req.specifier.contains(Version(image[name]), prereleases=True)
    if name in implied:
        if str(req.specifier) in ("", str(SpecifierSet(implied[name]))):
            return True
        # A lower bound no higher than one the image is known to meet is met too.
        floors = [Version(s.version) for s in SpecifierSet(implied[name]) if s.operator == ">="]
        if floors and all(s.operator == ">=" and Version(s.version) <= floors[0] for s in req.specifier):
            return True
    return None


def plan(wheels: list[Path], image: dict = IMAGE, implied: dict = IMAGE_SATISFIES) -> tuple[list[str], list[str]]:
    """(requirements to download, lines explaining each requirement) for the given carried wheels."""
    carried = dict(_name_version(w) for w in wheels)
    needed, notes = [], []
    for wheel in wheels:
        for req in wheel_requires(wheel):
            name = canonicalize_name(req.name)
            if name in carried:
                ok = req.specifier.contains(Version(carried[name]), prereleases=True)
                notes.append(f"  {wheel.name}: {req} -> carried {carried[name]} ({'ok' if ok else 'CONFLICT'})")
                if not ok:
                    raise SystemExit(f"carried {name} {carried[name]} does not satisfy {req} of {wheel.name}")
                continue
            verdict = image_satisfies(req, image, implied)
            where = image.get(name) or (f"present, known to satisfy '{implied[name]}'" if name in implied else "?")
            notes.append(f"  {wheel.name}: {req} -> image {where} "
                         f"({ {True: 'ok', False: 'CARRY', None: 'UNKNOWN'}[verdict] })")
            if verdict is None:
                raise SystemExit(f"cannot tell whether the image satisfies {req} (of {wheel.name}): add its version to "
                                 "IMAGE (python3 -m pip show NAME on the machine) or carry it")
            if not verdict:
                if name in NEVER_CARRY:
                    raise SystemExit(f"{wheel.name} needs {req}, but the image's {name} {image[name]} is what is "
                                     "measured: choose a wheel that accepts it")
                needed.append(str(Requirement(f"{req.name}{req.specifier}")))
    return needed, notes


def download(spec: str, dest: Path) -> Path:
    before = set(dest.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(dest), spec]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    new = set(dest.glob("*.whl")) - before
    name = canonicalize_name(Requirement(spec).name)
    found = [w for w in (new or dest.glob("*.whl")) if _name_version(w)[0] == name]
    if not found:
        raise SystemExit(f"pip downloaded no wheel for {spec}")
    return max(found, key=lambda w: Version(_name_version(w)[1]))


def travel_bytes(root: Path = ROOT, carry: tuple[str, ...] = (".whl",)) -> dict[str, int]:
    """Bytes a device call sends from ``root``: git's tracked and untracked-not-ignored files
    (those that exist; links as links), ``shared/`` and each carried path (all files beneath)."""
    listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=root, check=True,
                            capture_output=True).stdout.decode().split("\0")
    seen: set[str] = set()
    sizes = {"tree": 0}
    for rel in filter(None, listed):
        path = root / rel
        if rel not in seen and os.path.lexists(path):
            seen.add(rel)
            sizes["tree"] += path.lstat().st_size
    for extra in ("shared", *carry):
        base, total = root / extra, 0
        if base.is_file():
            total = base.lstat().st_size if extra not in seen else 0
        elif base.is_dir():
            for path in base.rglob("*"):
                rel = path.relative_to(root).as_posix()
                if rel not in seen and (path.is_file() or path.is_symlink()):
                    seen.add(rel)
                    total += path.lstat().st_size
        sizes[extra] = total
    sizes["total"] = sum(sizes.values())
    return sizes


def check_size(root: Path = ROOT, carry: tuple[str, ...] = (".whl",), limit: int = LIMIT) -> int:
    sizes = travel_bytes(root, carry)
    mib = 1024 * 1024
    print("what travels: " + ", ".join(f"{k} {v / mib:.2f} MiB" for k, v in sizes.items()))
    headroom = limit - sizes["total"]
    if headroom < 0:
        print(f"OVER the {limit / mib:.0f} MiB a device call carries, by {-headroom / mib:.2f} MiB: ignore or carry "
              "less (large untracked files? git ls-files -co --exclude-standard lists what travels)", file=sys.stderr)
        return 1
    print(f"under the {limit / mib:.0f} MiB limit: {headroom / mib:.2f} MiB of headroom")
    return 0


def verify_env() -> int:
    """On the machine, after the install: installed versions against transformers' requirements."""
    from importlib import metadata

    bad = 0
    for line in metadata.requires("transformers") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            have = None
        ok = have is not None and req.specifier.contains(Version(have), prereleases=True)
        bad += not ok
        print(f"  transformers {metadata.version('transformers')} needs {req}: {have or 'missing'} "
              f"{'ok' if ok else 'UNSATISFIED'}")
    return 1 if bad else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", type=Path, default=ROOT / ".whl")
    parser.add_argument("--check-only", action="store_true", help="only add up what travels (no download)")
    parser.add_argument("--verify-env", action="store_true", help="check the installed environment instead")
    parser.add_argument("--also", nargs="*", default=[], metavar="SPEC",
                        help="more wheels to carry, e.g. gguf==0.19.0 (their requirements followed too)")
    parser.add_argument("--carry", nargs="*", default=[], metavar="PATH",
                        help="other carried paths to count in the size check, e.g. .gpu_b")
    args = parser.parse_args(argv)
    if args.verify_env:
        return verify_env()
    if not args.check_only:
        args.dest.mkdir(parents=True, exist_ok=True)
        queue, chosen = [*WANTED, *args.also], {}
        while queue:
            spec = queue.pop(0)
            name = canonicalize_name(Requirement(spec).name)
            if name in chosen:
                continue
            have = [w for w in args.dest.glob("*.whl") if _name_version(w)[0] == name
                    and Requirement(spec).specifier.contains(Version(_name_version(w)[1]), prereleases=True)]
            chosen[name] = max(have, key=lambda w: Version(_name_version(w)[1])) if have else download(spec, args.dest)
            needed, notes = plan(list(chosen.values()))
            queue += [n for n in needed if canonicalize_name(Requirement(n).name) not in chosen]
        needed, notes = plan(list(chosen.values()))
        print("requirements of the carried wheels, against the image:", *notes, sep="\n")
        # Exactly one version of each package: anything else in .whl/ would travel and be installed too.
        for wheel in sorted(args.dest.glob("*.whl")):
            if wheel not in chosen.values():
                print(f"removing {wheel.name} (not needed, or another version of a carried package)")
                wheel.unlink()
        for wheel in sorted(chosen.values()):
            print(f"carry {wheel.name}: {wheel.stat().st_size / 1024 / 1024:.2f} MiB")
    dest = args.dest.resolve()
    if not dest.is_relative_to(ROOT):
        raise SystemExit(f"--dest must be inside the repository ({ROOT}): only the repository travels")
    return check_size(ROOT, (dest.relative_to(ROOT).as_posix(), *args.carry))


if __name__ == "__main__":
    sys.exit(main())
