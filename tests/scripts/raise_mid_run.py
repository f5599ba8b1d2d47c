"""Run under torchrun: train.py's command line, except that rank 0's forward step raises at iteration 4 (an
exception of the user's code, or of the engine). The rank must end with the exception and a non-zero exit code, its
DataLoader workers with it, rather than hang at exit waiting on them (data._shut_down_workers)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import config  # noqa: E402
import checks
import train  # noqa: E402

real_forward_step = train.forward_step


def forward_step(state, data_iterator, model):
    if state.train_state.step == 3 and os.environ["RANK"] == "0":
        raise RuntimeError("injected at iteration 4")
    return real_forward_step(state, data_iterator, model)


train.forward_step = forward_step  # pretrain's default step, looked up when it runs
sys.exit(train.main(checks.parse_args(sys.argv[1:], run=True)))
