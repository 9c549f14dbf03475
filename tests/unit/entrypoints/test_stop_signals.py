"""Inside a command that starts services, SIGINT, SIGTERM and SIGHUP all unwind to its `finally` (which
stops the services), a signal while stopping is ignored, and the handlers are put back afterwards.
(Each command's real services stopped by a real signal: tests/e2e/test_stalls.py, test_mesh.py.)"""

import os
import signal

import pytest

from rlmesh.processes import Interrupted, stop_signals_interrupt


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_each_stop_signal_interrupts_and_a_second_one_cannot_cut_the_stop_short(signum):
    before = signal.getsignal(signum)
    stopped = []
    with stop_signals_interrupt() as shield:
        try:
            with pytest.raises(Interrupted) as caught:
                os.kill(os.getpid(), signum)
            assert caught.value.signum == signum
        finally:
            shield()
            os.kill(os.getpid(), signum)  # ignored while the services stop
            stopped.append(True)
    assert stopped == [True]
    assert signal.getsignal(signum) == before
