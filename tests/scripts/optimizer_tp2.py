"""Run under torchrun with 2 processes: real train_step()s of a tensor-parallel pair (TP=2 over gloo).

Usage: torchrun --nproc-per-node 2 tests/scripts/optimizer_tp2.py OUT_DIR [train.py flags]
Each rank writes OUT_DIR/rank{R}.json with what its train_step returned:
  synced:   a step with the grad norm synced over model-parallel ranks (the default)
  skipped:  a step with --skip-sync-grad-norm-across-mp: each rank reports its own optimizer's norm
  nan:      a step whose loss is NaN on rank 1 only: did each rank skip it, and are its parameters unchanged?
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import config  # noqa: E402
import checks
import train  # noqa: E402

import device  # noqa: E402

device.install_cpu_shim()  # a program that is one run: megatron-core on this machine for all of it

out_dir, flags = sys.argv[1], sys.argv[2:]
cfg = checks.parse_args(flags)
state, model, optimizer, scheduler, (train_it, _, _) = train.setup(cfg)
rank = torch.distributed.get_rank()
forward_step = train.prepare_forward_step_func(train.forward_step, state)


def nan_on_rank_1(data_iterator, model):
    """The default forward step, but on rank 1 the loss is NaN: the step cannot succeed there."""
    output, loss_func = forward_step(data_iterator, model)

    def poisoned(output_tensor):
        loss, num_tokens, report = loss_func(output_tensor)
        return (loss * float("nan") if rank == 1 else loss), num_tokens, report

    return output, poisoned


def step(forward_step_func):
    _, skipped_iter, _, _, _, grad_norm, _ = train.train_step(forward_step_func, train_it, model, optimizer, scheduler,
                                                              state)
    return dict(skipped_iter=skipped_iter, grad_norm=grad_norm, scheduler_steps=scheduler.num_steps)


def params_checksum():
    return float(sum(p.detach().double().sum() for chunk in model for p in chunk.parameters()))


result = {"synced": step(forward_step)}
cfg.train.skip_sync_grad_norm_across_mp = True
result["skipped"] = step(forward_step)
before = params_checksum()
result["nan"] = step(nan_on_rank_1)
result["nan"]["params_unchanged"] = params_checksum() == before
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
train._finish_train(state)
