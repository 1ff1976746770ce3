"""``--method diloco``: local SGD with an outer Nesterov step (DiLoCo, arXiv 2311.08105), on
torchft's implementation.

Each worker takes H (``--diloco-steps``) steps of its own momentum SGD (η, μ as every method's
workers), then the workers average their pseudo-gradients θ_outer − θ_local and take one outer
step, SGD with Nesterov momentum (``--diloco-outer-lr``, ``--diloco-outer-momentum``), from
θ_outer; every worker continues from the new θ_outer and keeps its own inner momentum. The
round is torchft's :class:`torchft.local_sgd.DiLoCo` over a torchft :class:`Manager` per
worker (one replica group each, of one rank), its gloo process group and one lighthouse on
rank 0, all started from the MPI world: the lighthouse's address is broadcast over MPI, no
other launcher. The lighthouse asks for every worker in each round's quorum, so a round that
cannot gather them all (a dead or hung worker, --worker-timeout) fails, and the run ends with
a checkpoint as the other synchronous methods' do, instead of going on with fewer workers.

This is the face :class:`gem_mpi.baseline.sync.SyncTrainer` steps through, as it steps
through Horovod's and DDP's: the step loop, metrics, checkpoints and bad-input rules are the
synchronous run's; only the exchange is every H steps.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Iterator

from gem_mpi.config import Config
from gem_mpi.errors import UsageError
from gem_mpi.transport import MPI

ROOT = 0


def check_diloco() -> None:
    """UsageError, with the fix, when torchft is missing or cannot load."""
    try:
        _torchft()
    except ImportError as exc:
        raise UsageError(f"--method diloco needs torchft (pip install torchft; tools/install.sh "
                         f"installs it): {exc}") from None


LOOPBACK = "127.0.0.1"


def _torchft() -> tuple:
    # torchft's Rust side logs every quorum at INFO to stderr: its warnings only, unless asked
    os.environ.setdefault("RUST_LOG", "warn")
    import torchft
    from torchft import Manager, ProcessGroupGloo
    from torchft._torchft import LighthouseServer
    from torchft.local_sgd import DiLoCo

    return torchft, Manager, ProcessGroupGloo, LighthouseServer, DiLoCo


@contextlib.contextmanager
def _manager_on_loopback() -> Iterator[None]:
    """torchft's Manager starts its server on every interface (``bind="[::]:port"``, no
    option to change it): while one is made, its server class is given the loopback bind.
    Only ``bind`` changes; the rest goes to torchft's own class as it was."""
    import torchft.manager as manager_module

    server = manager_module.ManagerServer

    def on_loopback(*args: object, bind: str, **kwargs: object) -> object:
        return server(*args, bind=f"{LOOPBACK}:{bind.rsplit(':', 1)[1]}", **kwargs)

    manager_module.ManagerServer = on_loopback
    try:
        yield
    finally:
        manager_module.ManagerServer = server


def _no_healing() -> object:
    """torchft's checkpoint transport for a replica that fell behind, without the HTTP server
    its default one starts on every interface (serving θ to anyone, and unpickling what it
    fetches): every worker is in every round's quorum from the same θ₀, so no replica is
    healed, and a round that would need it fails as any failed round does."""
    from torchft.checkpointing import CheckpointTransport

    class NoHealing(CheckpointTransport):
        def metadata(self) -> str:
            return "gem_mpi: no checkpoint transport"

        def send_checkpoint(self, dst_ranks: list, step: int, state_dict: object,
                            timeout: object) -> None:
            raise RuntimeError(f"replicas {dst_ranks} are behind at step {step}: gem_mpi's "
                               "DiLoCo heals none (every worker is in every round)")

        def recv_checkpoint(self, src_rank: int, metadata: str, step: int,
                            timeout: object) -> object:
            raise RuntimeError(f"this replica is behind at step {step}: gem_mpi's DiLoCo "
                               "heals none (every worker is in every round)")

    return NoHealing()


class RoundFailed(RuntimeError):
    """A round's quorum or its averaging failed: torchft discarded it and put θ_outer back."""


class Diloco:
    """The exchange every H steps: torchft's DiLoCo hooks the inner optimizer's step, and at
    the H-th one averages the pseudo-gradients and takes the outer step."""

    hint = ""  # torchft says nothing of its own when a round fails

    def __init__(self, cfg: Config, comm: MPI.Intracomm, device: object) -> None:
        import torch

        _, Manager, ProcessGroupGloo, LighthouseServer, self._DiLoCo = _torchft()
        from torch.distributed import TCPStore

        o = cfg.diloco
        self.torch, self.device, self.every = torch, device, o.diloco_steps
        self.outer_lr, self.outer_momentum = o.diloco_outer_lr, o.diloco_outer_momentum
        n = comm.Get_size()
        timeout = datetime.timedelta(seconds=cfg.monitor.worker_timeout or 1800.0)
        # Every socket listens on loopback alone (the job is on one node: session's
        # diloco_check): rank 0 serves the lighthouse, which forms each round's quorum of all
        # n workers; each worker is a replica group of one rank, with its own store (on a
        # socket bound once and handed over: no free port found by releasing one) and its
        # manager; gloo's sockets bind to lo
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self._lighthouse = (LighthouseServer(bind=f"{LOOPBACK}:0", min_replicas=n)
                            if comm.Get_rank() == ROOT else None)
        address = comm.bcast(self._lighthouse.address() if self._lighthouse else None, root=ROOT)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind((LOOPBACK, 0))
        self._listener.listen(128)
        self._store = TCPStore(LOOPBACK, self._listener.getsockname()[1], 1, True,
                               wait_for_workers=False, master_listen_fd=self._listener.fileno())
        with _manager_on_loopback():
            self.manager = Manager(
                pg=ProcessGroupGloo(timeout=timeout), min_replica_size=n,
                use_async_quorum=False, load_state_dict=None, state_dict=None,
                replica_id=f"worker{comm.Get_rank() + 1}", store_addr=LOOPBACK,
                store_port=self._store.port, rank=0, world_size=1, lighthouse_addr=address,
                hostname=LOOPBACK, timeout=timeout, quorum_timeout=timeout,
                connect_timeout=timeout, init_sync=False,  # θ₀ is the same everywhere
                checkpoint_transport=_no_healing())
        self._outer = self._diloco = None
        self._k = 0  # inner steps in this round
        self.rounds = 0  # outer steps taken
        from importlib.metadata import version

        self.name = (f"torchft {version('torchft')} DiLoCo (gloo; H = {self.every}, outer "
                     f"Nesterov lr {self.outer_lr:g}, momentum {self.outer_momentum:g})")

    def failed(self, exc: BaseException) -> bool:
        """Whether a step raised because a round could not complete."""
        return isinstance(exc, RoundFailed)

    def wrap(self, model: object, opt: object) -> tuple[object, object]:
        """(the module, the inner optimizer): θ_outer is θ as it stands now (θ₀ or a
        checkpoint's), so load it first."""
        self._outer = self.torch.optim.SGD(model.parameters(), lr=self.outer_lr,
                                           momentum=self.outer_momentum, nesterov=True)
        self._diloco = self._DiLoCo(self.manager, [model], opt, self._outer,
                                    sync_every=self.every, backup_device=self.device,
                                    pin_memory=False)
        self._diloco.__enter__()  # hooks the inner optimizer's step
        return model, opt

    def broadcast(self, model: object, opt: object) -> None:
        """θ and both momenta are given to every rank alike (θ₀ from --seed, or a
        checkpoint's): nothing to send."""

    def step(self, opt: object, clip: object) -> None:
        """One inner step; at the H-th, the round's exchange and outer step (torchft's hook).
        A round torchft could not commit ends the run (RoundFailed)."""
        if clip is not None:
            clip()
        self._k += 1
        if self._k < self.every:
            opt.step()
            return
        self._k, before = 0, self.manager.current_step()
        try:  # the quorum (its timeout: a worker that never came), the averaging, the step
            opt.step()
        except Exception as exc:
            raise RoundFailed(f"{type(exc).__name__}: {exc}") from exc
        if self.manager.current_step() != before + 1:  # torchft discarded the round
            raise RoundFailed(str(self.manager.errored()))
        self.rounds += 1

    @property
    def outer_state(self) -> dict:
        """The outer optimizer's per-parameter state (its Nesterov momentum buffers)."""
        return self._outer.state

    def close(self) -> None:
        if self._diloco is not None:
            self._diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)
        if self._lighthouse is not None:
            self._lighthouse.shutdown()
