"""The wheel users install holds the whole package: every module of fastamp/ and kernels/.

An editable install (what the test suite runs against) finds modules on disk, so a package
folder missing from setup.py's ``packages`` shows only to users of ``pip install .``, as an
ImportError. This builds the wheel (without the C++ extension: ``FASTAMP_NO_EXT=1``) and
compares its modules with the source tree.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _source_modules() -> set[str]:
    found = {f"fastamp/{p.relative_to(ROOT / 'fastamp').as_posix()}" for p in (ROOT / "fastamp").rglob("*.py")}
    found |= {f"fastamp/kernels/{p.relative_to(ROOT / 'kernels').as_posix()}" for p in (ROOT / "kernels").rglob("*.py")}
    # fastamp/kernels in a checkout may be a symlink to kernels/ (a developer's worktree)
    return {m for m in found if "__pycache__" not in m}


def _clean_copy(dest: pathlib.Path) -> None:
    """The files git knows (tracked or not ignored), as ``pip install .`` of a fresh clone sees them.

    Not the checkout itself: setuptools reuses its ``build/`` folder, whose stale modules
    would hide a package left out of ``packages``.
    """
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, files):
        src = ROOT / name.decode()
        if src.is_file() and not src.is_symlink():
            target = dest / name.decode()
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)


def test_wheel_holds_every_module(tmp_path):
    src = tmp_path / "src"
    _clean_copy(src)
    env = dict(os.environ, FASTAMP_NO_EXT="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-build-isolation",
            "--no-deps",
            "-q",
            "-w",
            str(tmp_path),
            str(src),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("fastamp-*.whl")
    in_wheel = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    missing = sorted(_source_modules() - in_wheel)
    assert not missing, f"modules of the source tree missing from the wheel (setup.py packages): {missing}"
