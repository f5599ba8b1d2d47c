"""Run under torchrun with 2 processes: the model-parallel reductions train.py uses (metrics.py's norm, megatron-core's
agreement on the step and the grad norm) over a tensor-parallel pair."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import config  # noqa: E402
import checks
import metrics  # noqa: E402
from model import build_model, build_optimizer, wrap_model  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.training.utils.common_utils import (logical_and_across_model_parallel_group,  # noqa: E402
                                                  reduce_max_stat_across_model_parallel_group)

import device  # noqa: E402

device.install_cpu_shim()  # a program that is one run: megatron-core on this machine for all of it

torch.distributed.init_process_group("gloo")
rank = torch.distributed.get_rank()
flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
# Tensor-parallel pair: each rank holds half of each split matrix.
parallel_state.initialize_model_parallel(2, 1)
cfg = checks.parse_args(flags + ["--tensor-model-parallel-size", "2"], world_size=2, gpu=False)
torch.manual_seed(0)
tp2_norm = metrics.calc_params_l2_norm(build_model(cfg, 256))
largest = reduce_max_stat_across_model_parallel_group(None if rank == 0 else 3.0)
none = reduce_max_stat_across_model_parallel_group(None)
both = logical_and_across_model_parallel_group(rank == 0)
parallel_state.destroy_model_parallel()
# The same model unsplit (use_cpu_initialization draws the full matrices, then splits them).
parallel_state.initialize_model_parallel(1, 1)
torch.manual_seed(0)
tp1_norm = metrics.calc_params_l2_norm(build_model(checks.parse_args(flags, world_size=2, gpu=False), 256))
parallel_state.destroy_model_parallel()
# Data-parallel pair, bf16 with the distributed optimizer: each rank holds the fp32 main copy of half of the
# parameters only. The norm must not count a parameter whose main copy lives on the other rank from its local
# bf16 copy. Before any step the main copies equal the bf16 weights, so a plain norm of the weights is exact.
parallel_state.initialize_model_parallel(1, 1)
dist_cfg = checks.parse_args(flags + ["--bf16", "--use-distributed-optimizer"], world_size=2, gpu=False)
torch.manual_seed(0)
dist_model = wrap_model(dist_cfg, build_model(dist_cfg, 256))
build_optimizer(dist_cfg, dist_model)
dist_norm = metrics.calc_params_l2_norm(dist_model)
plain = torch.stack([p.detach().float().pow(2).sum() for _, p in metrics._counted_params(dist_model)]).sum().sqrt().item()
# One write per line: print() writes the text and its newline separately, and two ranks share the pipe.
sys.stdout.write(f"rank {rank}: max={largest} none={none} and={both} "
                 f"norm_tp2_equals_tp1={abs(tp2_norm - tp1_norm) < 1e-4 * tp1_norm} "
                 f"dist_opt_norm_equals_plain={abs(dist_norm - plain) < 1e-5 * plain} ({dist_norm:.6f} vs {plain:.6f})\n")
sys.stdout.flush()
parallel_state.destroy_model_parallel()
torch.distributed.destroy_process_group()
