"""A rank's exit interrupted by a SIGTERM: train.py's handler (it raises) is installed, a DataLoader with two workers
is iterated, and the process ends; as data.py's exit hook starts shutting the workers down, the process gets
SIGTERM (what torchrun sends the surviving ranks when another rank failed). It must exit within seconds: see
data._shut_down_workers."""

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import functools  # noqa: E402

import torch  # noqa: E402

import data  # noqa: E402
import train  # noqa: E402

signal.signal(signal.SIGTERM, train._raise_job_signal)
loader = torch.utils.data.DataLoader(range(8), num_workers=2,
                                     worker_init_fn=functools.partial(data.data_worker_init, signal.SIGTERM))
batches = iter(loader)
next(batches)


class SignalledIterator:
    """The loader's iterator, with the SIGTERM arriving as its workers are being shut down."""

    def _shutdown_workers(self):
        os.kill(os.getpid(), signal.SIGTERM)
        batches._shutdown_workers()


data._LIVE_ITERATORS.add(kept := SignalledIterator())
print("exiting", flush=True)
