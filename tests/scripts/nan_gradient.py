"""Run under torchrun: train.py's command line, except that at iteration 3 rank 0's gradient is NaN under a finite
loss (an autograd function on the per-token losses); the other ranks' are finite until the data-parallel reduce."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import config  # noqa: E402
import checks
import train  # noqa: E402

default_forward_step = train.forward_step


class NaNGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def forward_step(state, data_iterator, model):
    output, loss_func = default_forward_step(state, data_iterator, model)
    poison = state.train_state.step == 2 and torch.distributed.get_rank() == 0
    return (NaNGradient.apply(output) if poison else output), loss_func


train.forward_step = forward_step  # pretrain's default step, looked up when it runs
sys.exit(train.main(checks.parse_args(sys.argv[1:], run=True)))
