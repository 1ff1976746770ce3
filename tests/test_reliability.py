"""A diverging run stops itself; a slow worker does not slow the others."""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    PROGS,
    kill_job,
    mpirun,
    quadratic_args,
    rank_pids,
    steps_written,
    train,
    train_background,
)

from gem_mpi.outputs.runfile import load_run

pytestmark = pytest.mark.mpi  # every test here launches mpirun or another process

QUAD = quadratic_args(dim=2000)


def test_divergence_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    # η = 2 on curvatures up to 1.5: every step overshoots, the loss grows geometrically
    res = train(5, *QUAD, "--method", "downpour", "--lr", "2", "--max-steps", "5000",
                "--metrics", str(tmp_path / "run.h5"), "--checkpoint-dir", str(tmp_path),
                "--checkpoint-every", "0", "--eval-every", "0", timeout=120)
    assert res.returncode == 4, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if "diverged" in ln]
    assert len(lines) == 1 and "Lower --lr" in lines[0]
    assert "Traceback" not in res.stderr
    run = load_run(tmp_path / "run.h5")
    assert run.summary["diverged"] == 1.0 and run.summary["finished"] == 0.0
    assert run.summary["updates"] < 4 * 5000  # it stopped early
    assert not list(tmp_path.glob("checkpoint_*.h5"))  # no diverged state saved as good

    # the same run without the guard goes on to the end
    res = train(5, *QUAD, "--method", "downpour", "--lr", "2", "--max-steps", "300",
                "--no-stop-on-divergence", "--eval-every", "0", timeout=120)
    assert res.returncode == 0, res.stderr


def test_a_slow_worker_does_not_slow_the_others(tmp_path):
    """Asynchrony at work: while worker 2 is 50x slower, the others keep their own pace.

    Measured within one run, as counts, not seconds: up to the moment the first fast
    worker has finished, a synchronous system would have let every worker do the same
    number of steps; here the fast ones do clearly more than the straggler. Only the
    compute is slowed (0.3 ms here), not the commit, the pull or the wait for the master
    (a few ms for 200 000 floats on 2 loaded cores), so a factor of 5 left the ratio near
    2 on a quiet machine and at 1.27 in a full-suite run (2026-12-05): 50 makes the
    straggler's sleep the larger part of its cycle, whatever the load. Set by --speeds, one
    factor per worker (--straggler 2:50 is the same case: tests/test_examples.py and
    tests/test_sync.py run it)."""
    steps = 400
    res = train(5, *QUAD, "--quadratic-dim", "200000", "--method", "gem", "--max-steps",
                str(steps), "--speeds", "1,50,1,1", "--metrics", str(tmp_path / "run.h5"),
                "--eval-every", "0", timeout=300)
    assert res.returncode == 0, res.stderr
    u = load_run(tmp_path / "run.h5").updates
    first_done = min(np.flatnonzero((u["worker"] == w) & (u["seq"] == steps - 1))[0]
                     for w in (1, 3, 4))
    counts = Counter(u["worker"][: first_done + 1].tolist())
    fast = np.mean([counts[w] for w in (1, 3, 4)])
    assert fast >= 1.5 * counts[2], counts
    # and the straggler's own updates carry its slowness in their compute time
    slow_compute = np.median(u["compute_s"][u["worker"] == 2])
    fast_compute = np.median(u["compute_s"][u["worker"] != 2])
    assert slow_compute > 10 * fast_compute


def _listening_inodes() -> set[str]:
    """Socket inodes in LISTEN state (TCP) or bound at all (UDP), IPv4 and IPv6."""
    found = set()
    for table, listen_only in (("tcp", True), ("tcp6", True), ("udp", False), ("udp6", False)):
        try:
            lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if not listen_only or fields[3] == "0A":  # 0A: TCP_LISTEN
                found.add(fields[9])
    return found


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def test_no_rank_opens_a_port_of_its_own(tmp_path):
    """The authors' prototype opened an unauthenticated UDP port; gem_mpi opens none.

    With MPI's transports restricted to shared memory (btl self,vader: one node), the
    ranks hold no listening TCP socket and no UDP socket at all while they train."""
    env = {"OMPI_MCA_btl": "self,vader"}
    proc = train_background(3, *QUAD, "--quadratic-dim", "100000", "--max-steps", "100000",
                            "--eval-every", "0", "--metrics", str(tmp_path / "run.h5"),
                            env=env)
    try:
        deadline = time.monotonic() + 60
        ranks: dict[int, int] = {}
        while len(ranks) < 3 or not (tmp_path / "run.h5").exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
            ranks = rank_pids(proc)
        time.sleep(1.0)  # well into training
        listening = _listening_inodes()
        for rank, pid in ranks.items():
            assert not (_socket_inodes(pid) & listening), f"rank {rank} listens"
    finally:
        kill_job(proc)
        proc.communicate(timeout=30)


def test_a_stuck_worker_ends_the_job_with_a_checkpoint(tmp_path):
    """A worker that hangs without dying: the master notices its silence, checkpoints,
    names it, and ends the job long before any time limit."""
    from gem_mpi.outputs import checkpoint

    t0 = time.monotonic()
    res = mpirun(4, [str(PROGS / "stuck_worker.py"), "2", "50", *QUAD, "--method", "downpour",
                     "--max-steps", "100000", "--eval-every", "0", "--worker-timeout", "3",
                     "--checkpoint-dir", str(tmp_path), "--metrics", str(tmp_path / "run.h5")],
                 timeout=120)
    took = time.monotonic() - t0
    assert res.returncode != 0 and took < 60
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("gem_mpi: error")]
    assert len(lines) == 1, res.stderr
    assert "worker 2 (rank 2) has sent nothing for" in lines[0]
    assert "--resume auto continues" in lines[0] and "Traceback" not in res.stderr
    state = checkpoint.load(checkpoint.latest(str(tmp_path)))
    assert state.next_seq[1] == 50  # worker 2's 50 updates are in, the others went on
    run = load_run(tmp_path / "run.h5")
    assert run.summary["finished"] == 0.0
    assert run.updates["clock"].size == state.clock


PROBE = Path(__file__).resolve().parents[1] / "tools" / "ft_probe.py"


def test_the_loss_probe_holds_on_open_mpi_5_with_ulfm():
    """tools/ft_probe.py (docs/RELIABILITY.md, "A lost worker"): with --with-ft ulfm the master
    and the other workers go on after worker 1 is killed mid-commit."""
    import subprocess

    from stacks import stack_command

    cmd, env = stack_command("openmpi5", 4, [str(PROBE)])
    cmd[1:1] = ["--with-ft", "ulfm"]
    try:
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60,
                             check=False, start_new_session=True)
        out, ended = res.stdout, True
    except subprocess.TimeoutExpired as exc:  # MPI_Finalize after a loss may hang (the doc)
        out, ended = (exc.stdout or b"").decode(), False
        subprocess.run(["pkill", "-KILL", "-f", str(PROBE)], check=False)
    verdict = [ln for ln in out.splitlines() if "verdict=" in ln]
    assert len(verdict) == 1 and "verdict=holds" in verdict[0], out
    if ended:  # rank 0 and the two survivors finalized
        assert out.count("finalized") == 3, out


def test_the_loss_probe_ends_the_job_on_open_mpi_4():
    """Without ULFM mpirun ends the whole job at the loss, before the survivors are done."""
    res = mpirun(4, [str(PROBE)], timeout=120)
    assert res.returncode != 0 and "finalized" not in res.stdout, res.stdout


def _address(hex_addr: str) -> str:
    """/proc/net/tcp{,6}'s local address (little-endian words) as text."""
    import ipaddress

    raw = bytes.fromhex(hex_addr)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(raw)
    return str(ip.ipv4_mapped or ip) if ip.version == 6 else str(ip)


def _listening_addresses() -> dict[str, str]:
    """Inode -> "address:port" of every listening TCP socket (IPv4 and IPv6)."""
    found = {}
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":
                hex_addr, hex_port = fields[1].split(":")
                found[fields[9]] = f"{_address(hex_addr)}:{int(hex_port, 16)}"
    return found


SMALL_CNN = ("--model", "mnist-cnn", "--dataset", "synthetic", "--synthetic-size", "4096",
             "--batch-size", "16", "--eval-every", "0", "--threads", "1")


@pytest.mark.parametrize("method, ranks, extra", [
    ("ddp", 3, ()), ("sync", 3, ()), ("diloco", 3, ("--diloco-steps", "5")),
    ("gem", 5, ("--group-size", "2"))])
def test_every_port_a_method_opens_on_one_node_listens_on_loopback_alone(
        tmp_path, method, ranks, extra):
    """torch.distributed's store, gloo, torchft's lighthouse, stores and managers used to
    listen on every interface (anyone who could reach the node could join or kill a rank
    over HTTP); on one node every listening socket of the job binds loopback now."""
    h5 = tmp_path / "run.h5"
    # long enough to be looked at while it trains (one epoch of 4096 samples is not)
    proc = train_background(ranks, *SMALL_CNN, "--method", method, *extra, "--max-steps",
                            "100000", "--epochs", "1000", "--metrics", str(h5),
                            env={"OMPI_MCA_btl": "self,vader"})
    try:
        # looked at once training has begun, until a socket is open: each must bind loopback
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the method opens no socket? then this " \
                "test sees nothing"
            if steps_written(h5) >= 2:
                listening = _listening_addresses()
                opened: dict[int, list[str]] = {}
                for rank, pid in rank_pids(proc).items():
                    for inode in _socket_inodes(pid) & listening.keys():
                        opened.setdefault(rank, []).append(listening[inode])
                wide = {r: a for r, a in opened.items()
                        if any(not x.startswith("127.") for x in a)}
                assert not wide, f"listening beyond loopback: {wide}"
                if opened or method == "sync":  # Horovod's MPI controller opens none at all
                    break
            time.sleep(0.3)
    finally:
        kill_job(proc)
        proc.communicate(timeout=30)
