"""Run under torchrun with 2 processes: metrics.calc_params_l2_norm (--log-params-norm) against Megatron-LM's own
calc_params_l2_norm (megatron/training/utils/common_utils.py, in the megatron-core wheel) on the same model.

Every weight, bias and norm is drawn from N(0, 1) through the optimizer's main copies and its own copy into the model
(_copy_main_params_to_model_params), as an optimizer step leaves them: biases that start at zero (an expert's
linear_fc2 bias included) then count, and half-precision weights are their main copy rounded.
"""

import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import config  # noqa: E402
import checks
import device  # noqa: E402
import metrics  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.training import global_vars  # noqa: E402
from megatron.training.utils.common_utils import calc_params_l2_norm as megatron_lm_norm  # noqa: E402
from model import build_model, build_optimizer, wrap_model  # noqa: E402

device.install_cpu_shim()
torch.distributed.init_process_group("gloo")
rank = torch.distributed.get_rank()
SMALL = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "32",
         "--max-position-embeddings", "32"]


def built(flags, tp=1, ep=1):
    parallel_state.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    cfg = checks.parse_args(SMALL + flags, world_size=2, gpu=False)
    torch.manual_seed(0)
    model = wrap_model(cfg, build_model(cfg, 64))
    optimizer = build_optimizer(cfg, model)
    torch.manual_seed(1 + parallel_state.get_model_parallel_group().rank())  # data-parallel replicas alike
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in opt.optimizer.param_groups:
            for main in group["params"]:
                main.data.normal_()
        if hasattr(opt, "_copy_main_params_to_model_params"):
            opt._copy_main_params_to_model_params()
    return cfg, model


def sum_of_squares(tensors):  # metrics._squares' arithmetic, for a bitwise comparison on one data-parallel rank
    return torch.stack([t.float().pow(2).sum() for t in tensors]).sum().sqrt().item()


# TP=2 with EP=2 and expert TP 1: rank 1 is tensor-parallel rank 1 but expert-tensor-parallel rank 0, and holds
# other experts than rank 0, their linear_fc2 biases its own.
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
       "--expert-tensor-parallel-size", "1", "--tensor-model-parallel-size", "2", "--sequence-parallel",
       "--moe-token-dispatcher-type", "alltoall"]
cfg, model = built(MOE, tp=2, ep=2)
global_vars.set_args(SimpleNamespace(bf16=False, use_megatron_fsdp=False))
ours, theirs = metrics.calc_params_l2_norm(model), megatron_lm_norm(model)
# The same fp32 squares summed in other groupings: per parameter then at once here; there each tensor's norm
# (a sum of n <= 2^12 squares, then a square root) then the norm of those. Each sum of n terms rounds by up to
# log2(n) x 2^-24 relative, so about 2 x 12 x 2^-24 and the roundings of a square root each: 2e-6.
sys.stdout.write(f"rank {rank}: moe_tp2_ep2_same={abs(ours - theirs) <= 2e-6 * theirs} ({ours!r} vs {theirs!r})\n")
parallel_state.destroy_model_parallel()

# fp16 on two data-parallel replicas: the fp16 weights (Megatron-LM reads main_param under bf16 only), where the
# main copies differ by fp16's rounding.
cfg, model = built(["--fp16"])
counted = [p for _, p in metrics._counted_params(model)]
ours, weights, mains = (metrics.calc_params_l2_norm(model), sum_of_squares(counted),
                        sum_of_squares([p.main_param for p in counted]))
sys.stdout.write(f"rank {rank}: fp16_weights={ours == weights} mains_differ={weights != mains} "
                 f"({ours!r} vs {weights!r}, mains {mains!r})\n")
sys.stdout.flush()
parallel_state.destroy_model_parallel()
torch.distributed.destroy_process_group()
