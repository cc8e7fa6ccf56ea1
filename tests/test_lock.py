"""requirements.lock, the whole environment `make venv` installs, agrees with pyproject.toml (offline).

Every direct requirement of the project and of its `dev` extra is in the lock at a version its specifier admits,
torch is the CPU build and nothing CUDA came along, and every pin carries a hash. Whether the lock is still what
a fresh resolution gives needs the package index: `make lock-check`, which .ci/run calls.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements.lock"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


def locked() -> dict[str, Version]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        if m := PIN.match(line):
            pins[canonicalize_name(m[1])] = Version(m[2])
    return pins


def direct_requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]


@pytest.mark.parametrize("req", direct_requirements(), ids=str)
def test_direct_requirement_is_locked_within_its_specifier(req):
    pins = locked()
    name = canonicalize_name(req.name)
    assert name in pins, f"{req.name} is not in requirements.lock: run `make lock`"
    assert req.specifier.contains(pins[name], prereleases=True), (
        f"requirements.lock has {req.name}=={pins[name]}, pyproject.toml asks {req}: run `make lock`"
    )


def test_cpu_torch_and_no_cuda_packages():
    pins = locked()
    assert str(pins["torch"]).endswith("+cpu"), "the lock must pin the CPU torch wheel"
    cuda = sorted(n for n in pins if n.startswith(("nvidia-", "cuda-")) or n in {"triton", "cupy"})
    assert not cuda, f"CUDA packages in the lock: {cuda}"


def test_every_pin_is_hashed():
    text = LOCK.read_text()
    blocks = re.split(r"\n(?=[A-Za-z0-9])", text)
    unhashed = [b.split()[0] for b in blocks if PIN.match(b) and "--hash=sha256:" not in b]
    assert not unhashed, f"pins without a hash (pip's --require-hashes refuses the lock): {unhashed}"
