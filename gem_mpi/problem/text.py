"""``--dataset text``: the bytes of the text files under ``--data-dir`` or, with none, of the
running Python's standard-library sources (real text nobody here wrote, on every machine).

Split by file, so that no test byte was ever next to a training byte: a file is in the test
split when the CRC-32 of its path under the root is 0 mod 10, a function of the name alone.
With ``--holdout N`` the training files whose CRC-32 is 1 mod 10 are held apart as a
validation split (the master evaluates on their first N bytes, no worker trains on them), so
that a choice made on it (a tuned learning rate) never sees the test files.
Each split is its files' bytes in path order, concatenated, held as one uint8 array; sample i
is bytes i·T .. i·T + T (T = ``--context``): the input is its first T, the targets its last T
(each byte's next).
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from pathlib import Path

import numpy as np

from gem_mpi.errors import DataError

TEST_EVERY = 10  # one file in ten (by its name's CRC-32) is a test file
VALIDATION = 1  # with --holdout, the training files whose CRC-32 mod TEST_EVERY is this
SPLITS = ("train", "validation", "test")
_PROBE = 8192  # the bytes read to tell text from binary


def default_root() -> Path:
    """The running Python's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is_text(path: Path) -> bool:
    """UTF-8 without NUL bytes, judged on its first bytes."""
    try:
        with open(path, "rb") as f:
            head = f.read(_PROBE)
    except OSError:
        return False
    if b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:  # a multi-byte character cut at the probe's end
        return exc.start >= len(head) - 3
    return True


def files(root: Path, default: bool) -> list[Path]:
    """The text files under ``root`` in path order; the standard library's ``*.py`` (less
    site-packages) when ``default``."""
    found = []
    for directory, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "__pycache__")
                         and not d.startswith("."))
        for name in sorted(names):
            path = Path(directory, name)
            if (name.endswith(".py") if default else _is_text(path)) and path.is_file():
                found.append(path)
    return found


def _remainder(path: Path, root: Path) -> int:
    return zlib.crc32(str(path.relative_to(root)).encode()) % TEST_EVERY


def in_test(path: Path, root: Path) -> bool:
    return _remainder(path, root) == 0


def split_of(path: Path, root: Path, holdout: bool) -> str:
    """train, validation (only with ``holdout``: else those files train) or test."""
    r = _remainder(path, root)
    return "test" if r == 0 else "validation" if holdout and r == VALIDATION else "train"


def read_split(data_dir: str | None, split: str, limit: int = 0,
               holdout: bool = False) -> np.ndarray:
    """The split's bytes as one uint8 array (its first ``limit``, when not 0); DataError when
    the directory holds no text of that split. ``holdout``: the validation files are not in
    the training split (``split`` validation implies it)."""
    if split not in SPLITS:
        raise ValueError(f"unknown text split {split!r}")
    root = Path(data_dir) if data_dir else default_root()
    if not root.is_dir():
        raise DataError(f"--dataset text: --data-dir {str(root)!r} is not a directory")
    held = holdout or split == "validation"
    chosen = [p for p in files(root, default=data_dir is None)
              if split_of(p, root, held) == split]
    if not chosen:
        raise DataError(f"--dataset text: no text files of the {split} split under "
                        f"{str(root)!r} (a file is text when it is UTF-8 without NUL bytes; "
                        f"one in {TEST_EVERY} is a test file, by its name, and with --holdout "
                        "one more in ten a validation file)")
    data = np.frombuffer(b"".join(p.read_bytes() for p in chosen), dtype=np.uint8)
    return data[:limit] if limit else data
