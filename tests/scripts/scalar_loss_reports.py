"""Run under torchrun: train.py's command line with a forward step whose loss function returns the legacy scalar
pattern, (loss, {"lm loss": loss, "rank report": R}), where R is 10 x the rank plus the microbatch's place in its
step (0, 1, ...): what the log line and the validation block print of it tells a local mean over microbatches from
a mean over data-parallel ranks."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import config  # noqa: E402
import checks
import train  # noqa: E402

default_forward_step = train.forward_step
calls = []


def forward_step(state, data_iterator, model):
    output, token_loss = default_forward_step(state, data_iterator, model)
    place = len(calls) % state.num_microbatches
    calls.append(place)

    def loss_func(output_tensor):
        loss_sum, num_tokens, _ = token_loss(output_tensor)
        loss = loss_sum / num_tokens
        rank_report = torch.tensor(10.0 * torch.distributed.get_rank() + place)
        return loss, {"lm loss": loss.detach().clone(), "rank report": rank_report}
    return output, loss_func


train.forward_step = forward_step  # pretrain's default step, looked up when it runs
sys.exit(train.main(checks.parse_args(sys.argv[1:], run=True)))
