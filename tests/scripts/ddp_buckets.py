"""Run under torchrun: how many gradient buckets megatron-core's DDP lays out for train.py's model.

Usage: torchrun --nproc-per-node N tests/scripts/ddp_buckets.py OUT_DIR [train.py flags]
Each rank writes OUT_DIR/rank{R}.json: for each of its model chunks, the bucket count of each of its buffers.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import config  # noqa: E402
import checks
import device  # noqa: E402
import train  # noqa: E402

device.install_cpu_shim()  # a program that is one run: megatron-core on this machine for all of it

out_dir, flags = sys.argv[1], sys.argv[2:]
state, model, *_ = train.setup(checks.parse_args(flags))
with open(os.path.join(out_dir, f"rank{torch.distributed.get_rank()}.json"), "w") as f:
    json.dump([[len(b.buckets) for b in chunk.buffers + chunk.expert_parallel_buffers] for chunk in model], f)
train._finish_train(state)
