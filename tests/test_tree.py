"""The repository's tree stays clean: no large binaries slip in through a merge.

A 10 MB wheel once entered the root through a merge that neither parent carried; git keeps such a file in every
clone forever. Anything over `LIMIT` must be named here with the reason it belongs in the repository.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIMIT = 1 << 20  # bytes

# path → why it is tracked although it is large
ALLOWED = {
    "wsidino_dev/sample_slides/data/CMU-1-Small-Region.svs": "the real H&E tissue the sample slides are drawn from "
    "(wsidino_dev/sample_slides/SOURCES.md); nothing may be downloaded at run time",
}


def tracked_sizes(repo: Path) -> dict[str, int]:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=repo, capture_output=True, check=True).stdout
    sizes = {}
    for name in filter(None, names.decode().split("\0")):
        path = repo / name
        if path.is_file() and not path.is_symlink():
            sizes[name] = path.stat().st_size
    return sizes


def test_no_tracked_file_over_a_megabyte_outside_the_allow_list() -> None:
    large = {name: size for name, size in tracked_sizes(REPO).items() if size > LIMIT and name not in ALLOWED}
    assert large == {}, f"tracked files over {LIMIT} bytes: name them in ALLOWED with a reason, or untrack them"


def test_the_check_sees_a_large_tracked_file(tmp_path: Path) -> None:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "big.whl").write_bytes(b"\0" * (LIMIT + 1))
    (tmp_path / "small.txt").write_text("x")
    subprocess.run(["git", "add", "big.whl", "small.txt"], cwd=tmp_path, check=True)
    assert tracked_sizes(tmp_path) == {"big.whl": LIMIT + 1, "small.txt": 1}


def test_the_allow_list_names_only_tracked_files() -> None:
    assert set(ALLOWED) <= set(tracked_sizes(REPO)), "an allow-listed file is no longer tracked: drop it from ALLOWED"
