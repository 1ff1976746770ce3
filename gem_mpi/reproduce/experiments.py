"""The paper's experiments E1–E8, E9 (its proposed global proxy), E10 (GEM against the
synchronous baselines, DDP and DiLoCo) and E11 (the language model under every method users
now compare, each with a tuned η), as lists of training runs, at the full or the quick budget.

One place says what each experiment runs (method, workers, seeds, options), so that the
runner, ``--plan`` and the report agree on run names and on what a missing run means. A run
is one ``mpirun … python -m gem_mpi.train`` job; its name is its file stem under the results
directory. E3 runs nothing of its own: it is another view of E1's runs (E9 reads E1's and
E6's local-proxy runs beside its own).

Defaults are the paper's MNIST setting (η 0.05, μ 0.9, b 64, κ 1, one epoch of the training
set per worker, 3 seeds) on MNIST (``--dataset fashion-mnist``: the same grid on
Fashion-MNIST, the earlier set); docs/results/README.md lists every deviation.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from functools import partial

from gem_mpi.config import synchronous
from gem_mpi.reproduce.imagefolder import FolderSpec

DATASETS = ("mnist", "fashion-mnist")  # the first is the default
TRAIN_SAMPLES = 60_000  # MNIST's training set, as Fashion-MNIST's
EPOCH_STEPS_64 = TRAIN_SAMPLES // 64  # 937 steps of b 64 (the last partial batch is dropped)
# E5 validates on a held-out set: the last 10 000 training images (MNIST: the classic
# pickle's validation set), the workers train on the other 50 000
E5_HOLDOUT = 10_000
E5_TRAIN = TRAIN_SAMPLES - E5_HOLDOUT
# GB per AlexNet rank, measured on this machine (3 ranks, b 128: 8.9 GB PSS in all): a worker
# holds θ, Δθ, m, the payload and the activations; the master θ and one 12-byte-per-parameter
# mailbox slot per worker (0.73 GB each)
ALEXNET_WORKER_GB, ALEXNET_SLOT_GB, ALEXNET_MASTER_GB = 3.0, 0.75, 0.6


@dataclass(frozen=True)
class Run:
    """One training job: what the figures need to group it, and its options."""

    name: str  # file stem under the results directory
    experiment: str
    variant: str  # what a figure's legend says: gem-others, downpour, msgd, ...
    n: int  # the number of workers the figure puts it at (msgd: whose data it matches)
    seed: int
    method: str
    ranks: int
    batch: int
    steps: int  # steps per worker (the budget), for the estimate
    options: tuple[str, ...]  # python -m gem_mpi.train options, besides the harness's own
    model: str = "mnist-cnn"
    kappa: float = 1.0
    lr: float = 0.05
    cpu_env: bool = False  # so many ranks that only the CPU-only torch fits in memory
    memwatch: bool = False  # measure the job's memory (tools/memwatch.py)
    # (run name, η) of the tuning runs whose results choose this run's η (E10's and E11's
    # main runs): until they are done its --lr is PENDING_LR and it waits (runner.tuned)
    tuned_by: tuple[tuple[str, float], ...] = ()

    @property
    def workers(self) -> int:
        """Every rank of a synchronous method (sync, ddp, diloco); all but the master else."""
        return self.ranks if synchronous(self.method) else self.ranks - 1

    @property
    def samples(self) -> int:
        """Training samples of the whole job."""
        return self.workers * self.steps * self.batch

    def with_lr(self, lr: float) -> Run:
        """The run with its --lr set (a tuned main run once its tuning runs chose η)."""
        opts = list(self.options)
        opts[opts.index("--lr") + 1] = _fmt(lr)
        return replace(self, lr=lr, options=tuple(opts))


@dataclass(frozen=True)
class Experiment:
    id: str
    title: str
    claim: str  # what the paper shows
    figure: str  # where
    runs: tuple[Run, ...] = ()
    reads: tuple[str, ...] = ()  # experiments whose runs it shows (E3: E1's)


@dataclass(frozen=True)
class Budget:
    """How much of each experiment runs: the paper's grid, or a tiny one for the tests."""

    name: str
    seeds: tuple[int, ...]
    max_steps: int  # per worker; 0: the epochs decide (the paper: one epoch per worker)
    e1_ns: tuple[int, ...]
    e2_n: int
    e5_n: int
    e5_epochs: int  # data epochs of the 50 000 (the paper's figure 5 spans 30)
    e4_ns: tuple[int, ...]
    e4_batch: int  # the effective batch B split as b = B/n
    e4_epochs: int  # data epochs in all (each worker a disjoint 1/n shard)
    e6_ns: tuple[int, ...]
    e7_ns: tuple[int, ...]
    e7_kappas: tuple[float, ...]
    e8_n: int
    e8_batch: int  # per worker
    e8_epochs: int
    e8_folder: FolderSpec = field(default_factory=FolderSpec)
    e10_ns: tuple[int, ...] = (4, 8)
    e10_steps: int = 200  # steps per worker, every method (in samples: n × steps × 64)
    e10_eval_steps: int = 20  # evaluate every so many steps per worker (DiLoCo's round, H)
    e10_tune_steps: int = 100  # the tuning runs' steps per worker (E10_LRS' rule)
    e10_lrs: tuple[float, ...] = ()  # the tuning grid (): E10_LRS; the quick budget's fewer
    evals: int = 10  # evaluations per run (E2/E5: two per data epoch instead)
    log_every: float = 60.0
    dataset: str = DATASETS[0]


def alexnet_memory_gb(n: int) -> float:
    """Estimated peak memory of an AlexNet GEM job with n workers."""
    return ALEXNET_MASTER_GB + n * (ALEXNET_WORKER_GB + ALEXNET_SLOT_GB)


def machine_memory_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return 0.0


def e8_workers(wanted: int = 8) -> int:
    """The paper's 8 workers if they fit in 80 % of this machine's memory, else fewer."""
    n = wanted
    while n > 2 and alexnet_memory_gb(n) > 0.8 * machine_memory_gb():
        n //= 2
    return n


def full_budget(dataset: str = DATASETS[0]) -> Budget:
    """The paper's grid. E7 runs at n = 20 (our choice: the paper does not say its n) and
    at n = 5 and 10, where its π levels (≈ 0.65 at κ = 1) place it."""
    return Budget(name="full", seeds=(0, 1, 2), max_steps=0, e1_ns=(5, 10, 20, 30), e2_n=100,
                  e5_n=100, e5_epochs=30, e4_ns=(1, 2, 4, 8, 16), e4_batch=256, e4_epochs=3,
                  e6_ns=(5, 10, 20), e7_ns=(5, 10, 20), e7_kappas=(1.0, 2.0, 3.0, 4.0),
                  e8_n=e8_workers(), e8_batch=128, e8_epochs=2, dataset=dataset)


def quick_budget(dataset: str = DATASETS[0]) -> Budget:
    return Budget(name="quick", seeds=(0,), max_steps=20, e1_ns=(2, 3), e2_n=4, e5_n=3,
                  e5_epochs=1, e4_ns=(1, 2), e4_batch=64, e4_epochs=1, e6_ns=(2,), e7_ns=(2,),
                  e7_kappas=(1.0, 4.0), e8_n=2, e8_batch=8, e8_epochs=1, evals=2,
                  log_every=30.0, dataset=dataset, e10_ns=(2,), e10_steps=20,
                  e10_eval_steps=10, e10_tune_steps=20, e10_lrs=(0.05, 0.1),
                  e8_folder=FolderSpec(classes=4, train_per_class=6, val_per_class=4,
                                       size=64))


# --- building runs ------------------------------------------------------------------------

def _fmt(x: float) -> str:
    return f"{x:g}"


def _run(exp: str, variant: str, n: int, seed: int, method: str, b: Budget, *,
         batch: int = 64, epochs: int = 1, steps_per_epoch: int = EPOCH_STEPS_64,
         lr: float = 0.05, kappa: float = 1.0, ranks: int | None = None,
         evals_per_epoch: int = 0, extra: tuple[str, ...] = (), model: str = "mnist-cnn",
         data: tuple[str, ...] | None = None, cpu_env: bool = False,
         memwatch: bool = False, train_samples: int = TRAIN_SAMPLES,
         max_steps: int = 0, eval_steps: int = 0) -> Run:
    """A run of ``n`` workers (or ``ranks`` synchronous ranks: sync, ddp, diloco) at budget
    ``b``; the options say everything that differs from gem_mpi.train's defaults or matters
    to the experiment. ``max_steps``: steps per worker whatever the budget (E10);
    ``eval_steps``: evaluate every so many steps per worker, the same samples for every
    method (E10)."""
    if data is None:
        data = ("--dataset", b.dataset)
    sync = synchronous(method)
    if ranks is None:
        ranks = n if sync else n + 1
    workers = ranks if sync else ranks - 1
    steps = max_steps or steps_per_epoch * epochs
    if b.max_steps and not max_steps:
        steps = min(steps, b.max_steps * (n if method == "sync" and ranks == 1 else 1))
    # evaluations: every so many master updates (async) or steps of all workers (sync)
    units = steps * (workers if not sync else 1)
    eval_every = max(1, units // b.evals)
    if eval_steps:  # a sync step is every worker's: as many samples as `workers` updates
        eval_every = eval_steps * (1 if sync else workers)
    if evals_per_epoch:  # several per data epoch, in units of batch × (sync ranks) samples
        per_unit = batch * (ranks if sync else 1)
        eval_every = max(1, min(train_samples // per_unit // evals_per_epoch, eval_every))
    options = ("--method", method, "--model", model, *data, "--lr", _fmt(lr), "--momentum", "0.9",
               "--kappa", _fmt(kappa), "--batch-size", str(batch), "--epochs", str(epochs),
               *(("--max-steps", str(steps)) if b.max_steps or max_steps else ()),
               "--seed", str(seed), "--eval-every", str(eval_every), *extra)
    k = f"-k{_fmt(kappa)}" if exp == "E7" else f"-lr{_fmt(lr)}" if exp == "E8" and lr != 0.05 \
        else ""
    name = f"{exp.lower()}-{variant}{k}-n{n:03d}-s{seed}"
    return Run(name=name, experiment=exp, variant=variant, n=n, seed=seed, method=method,
               ranks=ranks, batch=batch, steps=steps, options=options, model=model,
               kappa=kappa, lr=lr, cpu_env=cpu_env, memwatch=memwatch)


E1_VARIANTS = (("gem-others", "gem", ("--gem-shift", "others")),
               ("gem-paper", "gem", ("--gem-shift", "paper")),
               ("downpour", "downpour", ()), ("adaptive", "adaptive", ()))


def _e1(b: Budget) -> tuple[Run, ...]:
    return tuple(_run("E1", variant, n, s, method, b, extra=extra)
                 for n in b.e1_ns for variant, method, extra in E1_VARIANTS for s in b.seeds)


def _many(n: int) -> tuple[tuple[str, ...], bool]:
    """(options, CPU-only torch) of a job with n workers: 100 ranks of the CUDA build of torch
    do not fit in this machine's memory, and idle workers should poll less often."""
    big = n + 1 > 40
    return (("--poll-max-ms", "20") if big else ()), big


def _e2(b: Budget) -> tuple[Run, ...]:
    """GEM with n = 100 on the whole training set, each worker one epoch: the paper's figure
    2 and its test accuracy, two evaluations per data epoch."""
    extra, big = _many(b.e2_n)
    return (_run("E2", "gem", b.e2_n, 0, "gem", b, evals_per_epoch=2, extra=extra,
                 cpu_env=big, memwatch=True),)


def _e5(b: Budget) -> tuple[Run, ...]:
    """GEM with n = 100 against momentum SGD (the proxy, one rank, b 64), both over
    ``e5_epochs`` data epochs of the 50 000 training images, validated twice per data epoch
    on the 10 000 held out (``--holdout``), every seed."""
    extra, big = _many(b.e5_n)
    holdout = ("--holdout", str(E5_HOLDOUT))
    epoch_steps = E5_TRAIN // 64
    per_worker = b.e5_epochs * E5_TRAIN // b.e5_n // 64  # GEM: the data shared by n workers
    cap = () if b.max_steps else ("--max-steps", str(per_worker))
    return tuple(r for s in b.seeds for r in (
        _run("E5", "gem", b.e5_n, s, "gem", b, steps_per_epoch=per_worker, evals_per_epoch=2,
             extra=(*holdout, *cap, *extra), cpu_env=big, train_samples=E5_TRAIN),
        _run("E5", "msgd", b.e5_n, s, "sync", b, ranks=1, epochs=b.e5_epochs,
             steps_per_epoch=epoch_steps, evals_per_epoch=2, extra=holdout,
             train_samples=E5_TRAIN)))


def _e4(b: Budget) -> tuple[Run, ...]:
    """B split as b = B/n over n workers, each on its own 1/n shard: every n sees the same
    samples in all and makes the same number of steps per worker. One worker gets every core
    for its torch threads, as n workers share them between them (else n = 1 would compute on
    one core while n ≥ 2 use them all, and the speedup would count the cores)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    runs = []
    for n in b.e4_ns:
        batch = b.e4_batch // n
        steps_per_epoch = TRAIN_SAMPLES // n // batch
        threads = ("--threads", str(cores)) if n == 1 else ()
        runs += [_run("E4", "gem", n, s, "gem", b, batch=batch, epochs=b.e4_epochs,
                      steps_per_epoch=steps_per_epoch, extra=("--shard", *threads))
                 for s in b.seeds]
    return tuple(runs)


# both readings of GEM's shift here too: the default is chosen from E1 and E6
E6_VARIANTS = (*E1_VARIANTS[:2], ("downpour", "downpour", ()), ("sync", "sync", ()))


def _e6(b: Budget) -> tuple[Run, ...]:
    lr = 0.1
    runs = [_run("E6", v, n, s, method, b, lr=lr, extra=extra)
            for n in b.e6_ns for v, method, extra in E6_VARIANTS for s in b.seeds]
    # the paper's figure 6 also draws momentum SGD itself: one worker, one epoch
    runs += [_run("E6", "msgd", 1, s, "sync", b, lr=lr, ranks=1) for s in b.seeds]
    return tuple(runs)


def _e7(b: Budget) -> tuple[Run, ...]:
    return tuple(_run("E7", "gem", n, s, "gem", b, kappa=k)
                 for n in b.e7_ns for k in b.e7_kappas for s in b.seeds)


# E8's learning rates: the MNIST setting's, then AlexNet's own (Krizhevsky et al. 2012), added
# after GEM and momentum SGD both diverged at the first
E8_LRS = (0.05, 0.01)


def _e8(b: Budget, data_dir: str) -> tuple[Run, ...]:
    """GEM with n workers, and the proxy it matches (momentum SGD on one rank, the same η,
    μ and b, as many steps as one worker makes), at each η: whether the setting trains
    AlexNet at all tells a failure of GEM from a failure of the setting."""
    steps_per_epoch = b.e8_folder.train_images // b.e8_batch
    run = partial(_run, batch=b.e8_batch, model="alexnet", epochs=b.e8_epochs,
                  steps_per_epoch=steps_per_epoch,
                  data=("--dataset", "imagenet", "--data-dir", data_dir))
    return tuple(r for lr in E8_LRS for s in b.seeds[:1] for r in (
        run("E8", "gem", b.e8_n, s, "gem", b, lr=lr, memwatch=True),
        run("E8", "msgd", 1, s, "sync", b, lr=lr, ranks=1)))


# E9: GEM with the global proxy (--gem-proxy global, the paper's proposed future work) at E1's
# settings (η 0.05) and E6's (η 0.1), shift `others`; the local proxy's runs to compare with
# are those experiments' own gem-others runs, read, not repeated
E9_SETTINGS = (("E1", 0.05), ("E6", 0.1))  # (the experiment whose settings, η)
E9_OPTIONS = ("--gem-shift", "others", "--gem-proxy", "global")


def _e9(b: Budget) -> tuple[Run, ...]:
    ns = {"E1": b.e1_ns, "E6": b.e6_ns}
    return tuple(_run("E9", f"global-lr{_fmt(lr)}", n, s, "gem", b, lr=lr, extra=E9_OPTIONS)
                 for src, lr in E9_SETTINGS for n in ns[src] for s in b.seeds)


PENDING_LR = "TUNED"  # a tuned main run's --lr until its tuning runs are done (E10, E11)

# E10: GEM against the synchronous baselines a user would otherwise run, PyTorch DDP and DiLoCo
# (torchft), at the same budget in samples (every worker the same steps of b 64, η 0.05, μ 0.9)
# and evaluated at the same numbers of samples, with every worker at its pace or worker 2 five
# times slower; GEM with its defaults (shift `others`, --worker-mode wait), DiLoCo with its own
# (H 20 inner steps, outer η 0.7, Nesterov μ 0.9)
E10_METHODS = (("gem", ("--gem-shift", "others", "--worker-mode", "wait")), ("ddp", ()),
               ("diloco", ("--diloco-steps", "20", "--diloco-outer-lr", "0.7",
                           "--diloco-outer-momentum", "0.9")))
E10_STRAGGLER = "2:5"  # worker 2, five times slower (it sleeps after each step)
# why 200 steps per worker and not the 300 first planned: the slowest run, DDP at n = 8 with
# the straggler, trained 300 steps in 94 s here (2026-12-06), from which the 36 runs at 300
# steps were estimated at about 38 minutes of this shared machine, over the 35 allowed
E10_BUDGET_NOTE = ("Each worker makes 200 steps, not the 300 first planned: the slowest run "
                   "(DDP, n = 8, with the straggler) trained 300 steps in 94 s on this "
                   "machine, from which the 36 runs were estimated at about 38 minutes of it, "
                   "over the 35 allowed them. The estimate was high: at 200 steps their jobs "
                   "took the time under Runs below, so that 300 would have fitted.")
E10_CASES = (("even", ()), ("straggler", ("--straggler", E10_STRAGGLER)))


def e10_case(run: Run) -> str:
    """even or straggler: the variant's suffix."""
    return run.variant.rsplit("-", 1)[1]


def e10_lrs(b: Budget) -> tuple[float, ...]:
    """E10's tuning grid at budget ``b`` (the quick budget tunes on two η only)."""
    return b.e10_lrs or E10_LRS


def pending_lr(run: Run, tuned_by: tuple[tuple[str, float], ...]) -> Run:
    """``run`` waiting for the η its tuning runs ``tuned_by`` choose (:func:`choose_lr`):
    its --lr is PENDING_LR until then (runner.tuned)."""
    opts = list(run.options)
    opts[opts.index("--lr") + 1] = PENDING_LR
    return replace(run, lr=math.nan, options=tuple(opts), tuned_by=tuned_by)


def _e10(b: Budget) -> tuple[Run, ...]:
    """Per n and method: the tuning runs (each η of the grid, no straggler, E10_TUNE_SEED,
    b.e10_tune_steps, validated on the last E10_HOLDOUT training images), then its main runs
    (each case and seed, tested on the test set), whose η the tuning runs choose."""
    runs: list[Run] = []
    for n in b.e10_ns:
        for method, opts in E10_METHODS:
            tune = [_run("E10", f"tune-{method}-lr{_fmt(lr)}", n, E10_TUNE_SEED, method, b,
                         lr=lr, extra=(*opts, "--holdout", str(E10_HOLDOUT)),
                         max_steps=b.e10_tune_steps, eval_steps=b.e10_tune_steps)
                    for lr in e10_lrs(b)]
            runs += tune
            by = tuple((t.name, t.lr) for t in tune)
            for case, slow in E10_CASES:
                for s in b.seeds:
                    run = _run("E10", f"{method}-{case}", n, s, method, b, extra=(*opts, *slow),
                               max_steps=b.e10_steps, eval_steps=b.e10_eval_steps)
                    # named apart from the runs of E10 at η 0.05 before it was tuned
                    runs.append(pending_lr(replace(run, name=f"e10-{method}-{case}-tuned-"
                                                   f"n{n:03d}-s{s}"), by))
    return tuple(runs)


# E11: the language model (--model gpt --dataset text, bytes of the running Python's standard
# library) under the methods users now compare, every one with AdamW workers: GEM-AdamW, delayed
# Nesterov with dynamic local updates (DN + DyLU, Liu et al. 2024), DiLoCo with AdamW as its
# inner optimizer, DDP-AdamW and Gap-Aware-AdamW, at n workers with even speeds and with speeds
# spread evenly from 1× to 4× (--speeds; a synchronous method's ranks are all workers), each
# worker the same steps of the same batch (equal tokens); each method's η tuned by the rule
# below (E11_LRS, e11_choose_lr) before its main runs
@dataclass(frozen=True)
class E11Budget:
    """E11's sizes: the model, every method's steps per worker, the tuning runs' budget."""

    ns: tuple[int, ...]
    steps: int  # optimizer steps per worker, every method (DN: steps // H updates of H)
    tune_steps: int  # the tuning runs' steps per worker (the short budget), even speeds
    batch: int
    context: int
    gpt: tuple[str, ...]  # --gpt-* options
    local_steps: int  # H: DN's local steps and DiLoCo's inner steps per round
    eval_steps: int  # the main runs evaluate every so many steps per worker (a multiple of H)
    eval_bytes: int  # the main runs' --test-bytes, the tuning runs' --holdout
    threads: int = 0  # --threads per rank (0: gem_mpi.train's default)


E11_FULL = E11Budget(ns=(4, 8), steps=300, tune_steps=100, batch=32, context=64,
                     gpt=("--gpt-layers", "2", "--gpt-width", "128", "--gpt-heads", "4"),
                     local_steps=10, eval_steps=30, eval_bytes=131_072)
E11_QUICK = E11Budget(ns=(2,), steps=8, tune_steps=4, batch=8, context=32,
                      gpt=("--gpt-layers", "1", "--gpt-width", "32", "--gpt-heads", "2"),
                      local_steps=2, eval_steps=4, eval_bytes=8192, threads=1)


def e11_budget(b: Budget) -> E11Budget:
    """The full budget's sizes, or the quick budget's tiny ones (the same grid of η)."""
    return E11_QUICK if b.name == "quick" else E11_FULL


# (variant, method, its own options; "H" is replaced by E11Budget.local_steps)
E11_METHODS = (("gem", "gem", ("--gem-shift", "others", "--worker-mode", "wait")),
               ("dn-dylu", "dn", ("--local-steps", "H", "--dylu")),
               ("diloco", "diloco", ("--diloco-steps", "H", "--diloco-outer-lr", "0.7",
                                     "--diloco-outer-momentum", "0.9")),
               ("ddp", "ddp", ()),
               ("gap-aware", "gap-aware", ()))
E11_LABELS = {"gem": "GEM-AdamW", "dn-dylu": "DN + DyLU", "diloco": "DiLoCo (AdamW inner)",
              "ddp": "DDP-AdamW", "gap-aware": "Gap-Aware-AdamW"}
E11_CASES = ("even", "spread")
E11_SPREAD = (1.0, 4.0)  # the slowest worker's factor against the fastest's


def e11_speeds(n: int) -> str:
    """--speeds spread evenly from 1× (worker 1) to 4× (worker n)."""
    lo, hi = E11_SPREAD
    return ",".join(_fmt(round(lo + (hi - lo) * i / max(n - 1, 1), 2)) for i in range(n))


def e11_case(run: Run) -> str:
    """even or spread: the main run's variant's suffix."""
    return run.variant.rsplit("-", 1)[1]


def e11_method(run: Run) -> str:
    """The E11_METHODS variant of a main or tuning run (gem, dn-dylu, …)."""
    v = run.variant.removeprefix("tune-")
    return v if run.variant.startswith("tune-") else v.rsplit("-", 1)[0]


def _e11_run(e: E11Budget, variant: str, method: str, own: tuple[str, ...], n: int,
             seed: int, lr: float | None, steps: int, evaluate: tuple[str, ...],
             name: str, run_variant: str, speeds: tuple[str, ...] = (),
             tuned_by: tuple[tuple[str, float], ...] = ()) -> Run:
    sync = synchronous(method)
    ranks = n if sync else n + 1
    h = e.local_steps
    own = tuple(str(h) if o == "H" else o for o in own)
    local = "--local-steps" in own  # --max-steps and --eval-every count updates of H steps
    options = ("--method", method, "--model", "gpt", "--dataset", "text", "--context",
               str(e.context), *e.gpt, "--optimizer", "adamw",
               "--lr", PENDING_LR if lr is None else _fmt(lr),
               "--batch-size", str(e.batch), "--max-steps", str(steps // h if local else steps),
               "--seed", str(seed), *evaluate, *own, *speeds,
               *(("--threads", str(e.threads)) if e.threads else ()))
    return Run(name=name, experiment="E11", variant=run_variant, n=n, seed=seed, method=method,
               ranks=ranks, batch=e.batch, steps=steps, options=options, model="gpt",
               lr=math.nan if lr is None else lr, tuned_by=tuned_by)


def _e11_eval_every(e: E11Budget, method: str, own: tuple[str, ...], n: int) -> int:
    """Master updates (asynchronous) or steps (synchronous) between evaluations: every
    eval_steps steps per worker, the same tokens for every method."""
    if synchronous(method):
        return e.eval_steps
    per_update = e.local_steps if "--local-steps" in own else 1
    return e.eval_steps // per_update * n


def _e11(b: Budget) -> tuple[Run, ...]:
    """Per n and method: the tuning runs (each η of E11_LRS, even speeds, E11_TUNE_SEED,
    e.tune_steps, validated on the held-apart files), then its main runs (each case and
    seed, e.steps, tested on the test files), whose η the tuning runs choose."""
    e = e11_budget(b)
    assert e.eval_steps % e.local_steps == 0, "evaluations at whole updates of H steps"
    runs: list[Run] = []
    for n in e.ns:
        for variant, method, own in E11_METHODS:
            tune = [_e11_run(e, variant, method, own, n, E11_TUNE_SEED, lr, e.tune_steps,
                             ("--eval-every", "0", "--holdout", str(e.eval_bytes)),
                             f"e11-tune-{variant}-lr{_fmt(lr)}-n{n:03d}", f"tune-{variant}")
                    for lr in E11_LRS]
            runs += tune
            by = tuple((t.name, t.lr) for t in tune)
            every = ("--eval-every", str(_e11_eval_every(e, method, own, n)),
                     "--test-bytes", str(e.eval_bytes))
            for case in E11_CASES:
                speeds = ("--speeds", e11_speeds(n)) if case == "spread" else ()
                runs += [_e11_run(e, variant, method, own, n, s, None, e.steps, every,
                                  f"e11-{variant}-{case}-n{n:03d}-s{s}", f"{variant}-{case}",
                                  speeds, by)
                         for s in b.seeds]
    return tuple(runs)


def imagefolder_dir(results: str) -> str:
    return os.path.join(results, "imagenet_synth")


def experiments(b: Budget, results: str) -> dict[str, Experiment]:
    """Every experiment at budget ``b``, its runs writing under ``results``."""
    e1, e2 = _e1(b), _e2(b)
    n1 = f"n = {', '.join(map(str, b.e1_ns))}"
    return {e.id: e for e in (
        Experiment("E1", "Stability as workers are added",
                   f"GEM stays stable and its loss profile barely changes with n ({n1}); "
                   "DOWNPOUR degrades or diverges; adaptive staleness is slower",
                   "figure 1", e1),
        Experiment("E2", f"GEM with {b.e2_n} workers",
                   f"GEM shows no sign of instability with {b.e2_n} asynchronous workers",
                   "figure 2", e2),
        Experiment("E3", "Median π against n",
                   "the median per-parameter π falls as workers are added, and changes with "
                   "time", "figure 3", reads=("E1",)),
        Experiment("E4", "Wall-clock speedup at a fixed effective batch",
                   f"splitting B = {b.e4_batch} as b = B/n over n workers speeds training up "
                   "in wall-clock time without loss in accuracy", "figure 4", _e4(b)),
        Experiment("E5", "Generalisation: GEM against momentum SGD",
                   "momentum SGD starts to overfit (its validation loss rises) while GEM "
                   "does not", "figure 5", _e5(b)),
        Experiment("E6", "A misspecified learning rate (η = 0.1)",
                   "DOWNPOUR cannot cope with η = 0.1 while GEM and momentum SGD converge",
                   "figure 6", _e6(b)),
        Experiment("E7", "The proxy amplification κ "
                   f"(n = {', '.join(map(str, b.e7_ns))})",
                   "the training loss improves as κ grows, up to a limit: κ = 4 is "
                   "suboptimal or diverges", "figure 8", _e7(b)),
        Experiment("E8", "AlexNet on (generated) ImageNet-like images",
                   "GEM trains AlexNet; the per-tensor median π changes over updates",
                   "figures 7, 9, 10", _e8(b, imagefolder_dir(results))),
        Experiment("E9", "GEM with a global proxy (the paper's proposed future work)",
                   "estimating the proxy's energy globally, at the master, from all workers' "
                   "updates, instead of locally per worker, is proposed as future work; no "
                   "implementation is published. Here: `--gem-proxy global` at E1's and E6's "
                   "settings, against the local proxy's runs of E1 and E6",
                   "conclusion, no figure", _e9(b), reads=("E1", "E6")),
        Experiment("E10", "GEM against DDP and DiLoCo, with and without a straggler",
                   "nothing on this: it compares GEM with other asynchronous rules only. "
                   "Here: who reaches a test accuracy first, and who ends higher at the same "
                   "samples, GEM or the synchronous methods a user would run instead (PyTorch "
                   "DDP; DiLoCo, torchft's), at n = "
                   f"{', '.join(map(str, b.e10_ns))} with every worker at its pace or with worker "
                   f"{E10_STRAGGLER.split(':')[0]} {E10_STRAGGLER.split(':')[1]}× slower",
                   "no figure", _e10(b)),
        Experiment("E11", "The language model under GEM-AdamW, DN + DyLU, DiLoCo, DDP-AdamW "
                   "and Gap-Aware-AdamW, each with a tuned η",
                   "nothing on this: it predates AdamW-trained transformers in distributed "
                   "training. Here: which method reaches a lower test loss at equal tokens, "
                   "and a target loss sooner, on a byte-level transformer over Python's "
                   "standard library, at n = "
                   f"{', '.join(map(str, e11_budget(b).ns))} with even speeds and with speeds "
                   f"spread {_fmt(E11_SPREAD[0])}–{_fmt(E11_SPREAD[1])}×, every method's η "
                   "chosen from the same grid by the same rule", "no figure", _e11(b)),
    )}


def select(exps: dict[str, Experiment], ids: list[str]) -> list[Run]:
    """The runs the named experiments need (E3 needs E1's), each once, in the given order."""
    out: dict[str, Run] = {}
    for i in ids:
        e = exps[i]
        for j in (*e.reads, e.id):
            for r in exps[j].runs:
                out.setdefault(r.name, r)
    return list(out.values())


def runs_shown(exps: dict[str, Experiment], exp_id: str) -> list[Run]:
    """The runs an experiment's page shows."""
    e = exps[exp_id]
    return [r for j in (*e.reads, e.id) for r in exps[j].runs]


# E9's rule, fixed before any run: the global proxy must never diverge, and its mean final
# training loss at each (η, n) must be at most E9_LOSS_RATIO times the local proxy's (E1's and
# E6's gem-others runs, the same settings and seeds). Why 1.25: averaging about n mini-batches
# per proxy step, the global m is expected to be more cautious than a local m where updates
# are mostly noise, so some extra loss is the design, not a failure; a quarter is far beyond
# the spread of E1's and E6's GEM runs over seeds (a few per cent) yet well inside E1's own
# stability rule (2x between the smallest and the largest n), so "yes" means "as stable, and
# about as good", and a proxy that slows training by more than a quarter shows as "partly".
E9_LOSS_RATIO = 1.25

# E10's rule, fixed before any E10 run (gem_mpi/reproduce/results.py: e10_verdict), per cell
# (n, straggler or not) and rival (DDP, DiLoCo), over the seeds:
# - time to target: the seconds (training clock, start-up excluded) until the first evaluation
#   at or above E10_TARGET test accuracy. A method "reaches" it only if every seed does (a
#   diverged run does not); one that reaches against one that does not is faster; when both
#   reach, GEM is faster (slower) if the rival's mean time is over E10_TIME_RATIO times GEM's
#   (GEM's over E10_TIME_RATIO times the rival's) and the gap is beyond two standard errors
#   of the difference (Welch; with one seed a side, the ratio alone decides); else a tie.
#   Why 0.95: every method is expected to pass it well inside the budget (98–99 % after one
#   epoch in E1), after the first few evaluations, so that the time says how fast it gets
#   there and not the evaluation grid; why 10 %: on this shared 2-core machine the same job's
#   wall time varies by 3–6 % (sd) over seeds (E9's master wall s: 32 ± 1, 64 ± 4, 131 ± 8),
#   so a smaller gap is the machine, not the method.
# - final test accuracy at equal samples (every method n × steps × b): GEM is higher (lower)
#   if its mean is over E10_ACC_POINTS points above (below) the rival's and beyond two
#   standard errors of the difference, over the runs that did not diverge; but the side with
#   more diverged runs is lower. Why a quarter of a point: the sd over seeds of GEM's final
#   test accuracy in E1 and E9 is 0.02–0.23 points.
# - the cell: "GEM wins" when it is faster and not lower, or tied in time and higher; "GEM
#   loses" when it is slower and not higher, or tied in time and lower; "mixed" when faster
#   but lower, or slower but higher; "even" when both are ties.
E10_TARGET = 0.95
E10_TIME_RATIO = 1.1
E10_ACC_POINTS = 0.25

# E10's tuning, fixed before any tuned E10 run (the verdict above is unchanged): for each n
# and method, one run at each η of E10_LRS, e10_tune_steps (100) steps per worker, no
# straggler, seed E10_TUNE_SEED (none of the main runs'), with --holdout E10_HOLDOUT: trained
# without the last 10 000 training images and validated on them, never on the test set. The
# main runs of that (n, method) take the η of the lowest final validation loss (choose_lr: a
# diverged or failed run counts as an infinite loss; a tie goes to the smaller η; if every η
# diverged, the smallest). The grid is the same for every method: the paper's 0.05, half of
# it, and doublings up to 0.4, so that it holds the linear-scaling value of the synchronous
# methods, whose step averages n workers' gradients (0.05 · n: 0.2 at n = 4, 0.4 at n = 8).
E10_LRS = (0.025, 0.05, 0.1, 0.2, 0.4)
E10_TUNE_SEED = 100
E10_HOLDOUT = E5_HOLDOUT

# E11's rule, fixed before any E11 run (tuning: e11_choose_lr here; verdict: results.py,
# e11_verdict), in two parts.
# - Tuning, the same budget for every method: for each n and method, one run at each η of
#   E11_LRS (AdamW's η; DN's and DiLoCo's outer steps keep their defaults), E11Budget's
#   tune_steps steps per worker, even speeds, seed E11_TUNE_SEED (none of the main runs'),
#   with --holdout: trained without the validation files (one training file in ten, by name)
#   and validated on their first eval_bytes bytes, never on the test files. The main runs of
#   that (n, method) take the η of the lowest final validation loss; a diverged or failed run
#   counts as an infinite loss; a tie goes to the smaller η; if every η diverged, the smallest.
#   The grid is the same 4 points at every budget (the quick one tunes on a few steps only):
#   half a decade apart around AdamW's usual 1e-3 for a small transformer.
# - Verdict, per cell (n, even or spread speeds) and rival (every other method), over the
#   seeds, as E10's:
#   - time to target: the seconds (training clock) until the first evaluation at or below
#     E11_TARGET_BITS bits per byte on the test files; a method reaches it only if every seed
#     does; one that reaches against one that does not is faster; when both reach, GEM is
#     faster (slower) if the rival's mean time is over E11_TIME_RATIO times GEM's (GEM's over
#     E11_TIME_RATIO times the rival's) and the gap is beyond two standard errors of the
#     difference (Welch; one seed a side: the ratio alone); else a tie. Why 3.5 bits per byte:
#     about 2.4 nats, which plain AdamW passes early on such a model (issue 47: 2.0 nats after
#     300 steps of 4 × 32 samples) while uniform bytes are 8 bits and unigram statistics about
#     5: the time says how fast a method learns more than byte frequencies, not the evaluation
#     grid. Why 10 %: E10's reason, the same job's wall time varies by 3–6 % here.
#   - final test loss at equal tokens (every worker e.steps steps of e.batch × e.context
#     bytes; DyLU's slower workers train fewer per update, so DN + DyLU trains at most that):
#     GEM is lower (higher) if the rival's mean is over E11_LOSS_RATIO times GEM's (GEM's over
#     it times the rival's) and beyond two standard errors, over the runs that did not
#     diverge; the side with more diverged runs is higher. Why 1 %: half the 2 % that issue 47
#     asks of GEM-AdamW against DDP-AdamW, so that a gap within that floor still shows.
#   - the cell: "GEM wins" when faster and not higher, or tied in time and lower; "GEM loses"
#     when slower and not lower, or tied in time and higher; "mixed" when faster but higher,
#     or slower but lower; "even" when both are ties.
E11_LRS = (3e-4, 1e-3, 3e-3, 1e-2)
E11_TUNE_SEED = 100
E11_TARGET_BITS = 3.5
E11_TIME_RATIO = 1.1
E11_LOSS_RATIO = 1.01


def choose_lr(losses: dict[float, float]) -> float:
    """The η of the lowest finite validation loss (ties: the smaller η; none finite: the
    smallest η), from one (n, method)'s tuning runs, one per η of its grid (E10's, E11's)."""
    if not losses:
        raise ValueError("no tuning run to choose η from")
    finite = [(loss, lr) for lr, loss in losses.items() if math.isfinite(loss)]
    return min(finite)[1] if finite else min(losses)


def e11_choose_lr(losses: dict[float, float]) -> float:
    """:func:`choose_lr` over E11's tuning runs, one per η of E11_LRS."""
    if sorted(losses) != sorted(E11_LRS):
        raise ValueError(f"E11 tunes on every η of {E11_LRS}, got {sorted(losses)}")
    return choose_lr(losses)
