"""What many tests share beside conftest's launchers: the command line of a run on the numpy
quadratic, and the check that every update of a run was applied exactly once."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

QUADRATIC = ("--model", "quadratic", "--dataset", "synthetic")


def quadratic_args(*extra: str, dim: int | None = None, method: str | None = None,
                   steps: int | None = None, **options: object) -> list[str]:
    """``--model quadratic --dataset synthetic``, then ``--method``, ``--quadratic-dim`` and
    ``--max-steps`` when given, then each option (``eval_every=0`` is ``--eval-every 0``),
    then ``extra`` as it is (a later repeat of an option overrides it)."""
    args = list(QUADRATIC)
    named = {"method": method, "quadratic_dim": dim, "max_steps": steps, **options}
    for name, value in named.items():
        if value is not None:
            args += [f"--{name.replace('_', '-')}", str(value)]
    return [*args, *extra]


def assert_exactly_once(workers: Iterable, seqs: Iterable, worker_ids: Iterable[int],
                        steps: int) -> None:
    """Each of ``worker_ids``' updates 0 .. steps − 1 is in the log once: none lost, none
    applied twice (``workers``, ``seqs``: the log's columns)."""
    pairs = Counter(zip((int(w) for w in workers), (int(s) for s in seqs)))
    assert set(pairs) == {(w, s) for w in worker_ids for s in range(steps)}
    assert max(pairs.values()) == 1  # nothing applied twice, nothing missing
