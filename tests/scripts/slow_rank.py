"""Run under torchrun: pretrain() with train.py's flags, where rank 1's forward step sleeps SLOW_RANK_SLEEP seconds
per training microbatch (a real straggler for --log-straggler to find)."""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import config  # noqa: E402
import checks
import train  # noqa: E402

import device  # noqa: E402

device.install_cpu_shim()  # a program that is one run: megatron-core on this machine for all of it

SLEEP = float(os.environ.get("SLOW_RANK_SLEEP", "0.2"))


def forward_step(state: train.GlobalState, data_iterator, model):
    if torch.distributed.get_rank() == 1 and torch.is_grad_enabled():
        time.sleep(SLEEP)
    return train.forward_step(state, data_iterator, model)


if __name__ == "__main__":
    state = train.pretrain(checks.parse_args(sys.argv[1:]), forward_step)
    sys.exit(state.exit_code or 0)
