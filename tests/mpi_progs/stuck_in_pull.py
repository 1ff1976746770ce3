"""Run the real launcher with one worker that hangs in the middle of a pull of θ (after its
first Get of the pull completed), as a worker stopped by a debugger, a lost device or a
kill under a launcher that does not end the job would."""

import sys
import time

from gem_mpi import train
from gem_mpi.transport import MPI
from gem_mpi.transport.idioms import VersionedArray

stuck_rank, after = int(sys.argv[1]), int(sys.argv[2])
real_read = VersionedArray.read
calls = {"n": 0}


class _HangAfterGet:
    """The window, except that a Get completes and then never returns."""

    def __init__(self, win):
        self._win = win

    def __getattr__(self, name):
        return getattr(self._win, name)

    def Get(self, *args, **kwargs):
        self._win.Get(*args, **kwargs)
        self._win.Flush(0)
        time.sleep(3600)

    def Rget(self, *args, **kwargs):  # the request-based form the pull uses
        self._win.Rget(*args, **kwargs).Wait()
        time.sleep(3600)


def read(self, into=None):
    if MPI.COMM_WORLD.Get_rank() == stuck_rank:
        calls["n"] += 1
        if calls["n"] > after:
            self.win = _HangAfterGet(self.win)
    return real_read(self, into)


VersionedArray.read = read
sys.exit(train.launch(sys.argv[3:]))
