"""peft.py: LoRA and DoRA fine-tuning on megatron-core's tensor-parallel layers (Megatron Bridge's `peft`).

    python train.py --peft lora --pretrained-checkpoint ckpt --save lora-ckpt [--lora-dim 32 --lora-alpha 32 ...]
    python peft.py merge --load lora-ckpt --save merged-ckpt      # fold the adapters in: a plain checkpoint

The order is Bridge's (`training/setup.py`): build the bare model, load the pretrained weights into it,
freeze every weight, wrap each targeted linear layer with a low-rank adapter, then megatron DDP and the
optimizer, which see only the adapters (megatron-core skips parameters that do not require grad).

An adapter on a layer computing `y = W x` adds `(alpha / dim) * B (A dropout(x))`. A is initialised
xavier-normal, B to zero, so step 0 is the base model exactly. A and B are megatron-core layers split like
the base layer (Bridge's ParallelLinearAdapter):

    base layer                              A (dim x in)                          B (out x dim)
    column-parallel (linear_qkv, fc1)       column-parallel, output gathered      column-parallel: out/TP, as W's
    row-parallel (linear_proj, fc2)         row-parallel: in/TP, output reduced   column-parallel, output gathered

DoRA (Liu et al. 2024) adds a magnitude vector m per output row: y = m / ||W + s B A||_row * (W x + s B A x),
the norm taken over the whole input (summed over tensor-parallel ranks for a row-parallel layer) and
detached, as in the paper's section 4.3.

Checkpoints of a PEFT run hold the adapters only (`sharded_state_dict` filtered to `.adapter.` keys), with
their optimizer state, the train state and RNG; the base weights come from --pretrained-checkpoint again.
"""

import os
import re
import sys

import torch

import device  # noqa: F401  (first: megatron-core imported the way every module here imports it)
import checkpoint
import checks
import data
from config import ConfigError
from model import build_model, destroy_distributed, initialize_distributed, transformer_config
from megatron.core import parallel_state
from megatron.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                           gather_from_tensor_model_parallel_region)


def module_matches(full_name: str, name: str, pattern: str) -> bool:
    """Whether `pattern` names this module: its own name, or its full dotted name with `*` wildcards
    (`*.layers.0.*.linear_qkv`)."""
    if name == pattern:
        return True
    return re.fullmatch(re.escape(pattern).replace(r"\*", ".*"), full_name) is not None


class LoRALinear(torch.nn.Module):
    """A frozen megatron-core linear layer plus its low-rank adapter. Forward returns (output, bias) as the base."""

    def __init__(self, base, config, dim: int, alpha: float, dropout: float, dora: bool):
        super().__init__()
        self.base, self.scale = base, alpha / dim
        self.row_parallel = isinstance(base, RowParallelLinear)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        out_size = base.weight.shape[0] * (1 if self.row_parallel else tp)
        in_size = base.weight.shape[1] * (tp if self.row_parallel else 1)
        common = dict(config=config, bias=False)
        self.adapter = torch.nn.Module()
        if self.row_parallel:
            self.adapter.linear_in = RowParallelLinear(in_size, dim, init_method=torch.nn.init.xavier_normal_,
                                                       input_is_parallel=True, skip_bias_add=True, **common)
            self.adapter.linear_out = ColumnParallelLinear(dim, out_size, init_method=torch.nn.init.zeros_,
                                                           gather_output=True, **common)
        else:
            self.adapter.linear_in = ColumnParallelLinear(in_size, dim, init_method=torch.nn.init.xavier_normal_,
                                                          gather_output=True, **common)
            self.adapter.linear_out = ColumnParallelLinear(dim, out_size, init_method=torch.nn.init.zeros_,
                                                           gather_output=False, **common)
        self.dropout = torch.nn.Dropout(dropout)
        self.dora = dora
        if dora:  # at init B = 0, so the magnitude is ||W||_row and the output is the base's
            self.adapter.weight_magnitude = torch.nn.Parameter(self._weight_norm())

    def delta_weight(self) -> torch.Tensor:
        """s B A as this rank's slice of W: (out/TP, in) for a column-parallel layer, (out, in/TP) for a row one."""
        a, b = self.adapter.linear_in.weight, self.adapter.linear_out.weight
        if self.row_parallel:  # B is split by rows: gather it to (out, dim); A is (dim, in/TP) already
            b = _gather_rows(b)
        else:  # A is split by rows: gather it to (dim, in); B is (out/TP, dim), W's rows
            a = _gather_rows(a)
        return self.scale * (b @ a)

    def _weight_norm(self) -> torch.Tensor:
        squares = (self.base.weight + self.delta_weight()).float().pow(2).sum(dim=1)
        if self.row_parallel:  # each rank holds in/TP of every row: the row's norm sums over the ranks
            squares = _sum_over_tensor_parallel(squares)
        return squares.sqrt().to(self.base.weight.dtype).detach()

    def forward(self, x, *args, **kwargs):
        out, bias = self.base(x, *args, **kwargs)
        delta = self.adapter.linear_out(self.adapter.linear_in(self.dropout(x))[0])[0] * self.scale
        if not self.dora:
            return out + delta, bias
        in_bias = bias is None and self.base.bias is not None  # the base added its bias itself
        plain = out - self.base.bias if in_bias else out
        gain = self.adapter.weight_magnitude / self._weight_norm()
        merged = gain * (plain + delta)
        return (merged + self.base.bias if in_bias else merged), bias

    def merged_weight(self) -> torch.Tensor:
        """The base weight with the adapter folded in: W + s B A, or for DoRA m / ||W + s B A|| (W + s B A)."""
        weight = self.base.weight + self.delta_weight()
        if self.dora:
            weight = weight * (self.adapter.weight_magnitude / self._weight_norm()).unsqueeze(1)
        return weight

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The base weights under their own names (a pretrained checkpoint's), the adapter under `.adapter.`."""
        state = self.base.sharded_state_dict(prefix, sharded_offsets, metadata)
        for name in ("linear_in", "linear_out"):
            state.update(getattr(self.adapter, name).sharded_state_dict(f"{prefix}adapter.{name}.", sharded_offsets,
                                                                         metadata))
        if self.dora:
            from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

            magnitude = {"weight_magnitude": self.adapter.weight_magnitude}
            split = {} if self.row_parallel else {"weight_magnitude": 0}  # column: out/TP rows per rank
            state.update(make_sharded_tensors_for_checkpoint(magnitude, f"{prefix}adapter.", split, sharded_offsets))
        return state


def _gather_rows(weight: torch.Tensor) -> torch.Tensor:
    """A column-parallel weight split by rows over the tensor-parallel ranks, whole (autograd-aware)."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return weight
    return gather_from_tensor_model_parallel_region(weight.t().contiguous()).t()


def _sum_over_tensor_parallel(value: torch.Tensor) -> torch.Tensor:
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        value = value.clone()
        torch.distributed.all_reduce(value, group=parallel_state.get_tensor_model_parallel_group())
    return value


def apply_peft(cfg, model: list) -> dict:
    """Freeze every weight of the bare model chunks, then wrap each targeted linear layer. Returns
    {pattern: modules matched}. A pattern that matches nothing is a one-line ConfigError."""

    p = cfg.peft
    config = transformer_config(cfg)
    for chunk in model:
        for param in chunk.parameters():
            param.requires_grad = False
    matched = {pattern: 0 for pattern in p.lora_target_modules}
    for chunk in model:
        targets = []
        for full_name, module in chunk.named_modules():
            name = full_name.rsplit(".", 1)[-1]
            if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or ".adapter." in f".{full_name}.":
                continue
            hits = [pattern for pattern in matched if module_matches(full_name, name, pattern)]
            if hits and not any(module_matches(full_name, name, ex) for ex in p.lora_exclude_modules):
                targets.append((full_name, module))
                for pattern in hits:
                    matched[pattern] += 1
        for full_name, module in targets:
            parent_name, _, child = full_name.rpartition(".")
            parent = chunk.get_submodule(parent_name) if parent_name else chunk
            setattr(parent, child, LoRALinear(module, config, p.lora_dim, p.lora_alpha, p.lora_dropout,
                                              dora=p.peft == "dora"))
    unmatched = [pattern for pattern, n in matched.items() if n == 0]
    if unmatched and parallel_state.get_pipeline_model_parallel_world_size() == 1:
        raise ConfigError(f"--lora-target-modules {unmatched[0]} matches no linear layer of the model; targets are "
                          f"names such as linear_qkv, linear_proj, linear_fc1, linear_fc2 or patterns such as "
                          f"'*.layers.0.*.linear_qkv'")
    return matched


def parameter_counts(model: list) -> tuple:
    """(trainable, total) parameters of this rank's model chunks."""
    params = [p for chunk in model for p in chunk.parameters()]
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def trainable_summary(trainable: int, total: int) -> str:
    """`trainable params: 0.29M / 5.3M (5.5%)`."""
    return f"trainable params: {trainable / 1e6:.2f}M / {total / 1e6:.2f}M ({100 * trainable / total:.1f}%)"


def merge_adapters(model: list) -> int:
    """Fold each adapter into its base weight in place and put the base layer back. Returns how many."""
    merged = 0
    for chunk in model:
        wrapped = [(name, module) for name, module in chunk.named_modules() if isinstance(module, LoRALinear)]
        for full_name, module in wrapped:
            with torch.no_grad():
                module.base.weight.copy_(module.merged_weight())
            module.base.weight.requires_grad = True
            parent_name, _, child = full_name.rpartition(".")
            setattr(chunk.get_submodule(parent_name) if parent_name else chunk, child, module.base)
            merged += 1
        for param in chunk.parameters():
            param.requires_grad = True
    return merged


def main(argv) -> int:
    """`python peft.py merge --load PEFT_CKPT --save OUT [--ckpt-step N]`: a plain checkpoint (weights only) of
    the base model with the adapters folded in, loadable without --peft. One process; any parallel layout."""
    import argparse

    parser = argparse.ArgumentParser(prog="peft.py", description="Fold LoRA/DoRA adapters into the base weights.")
    parser.add_argument("command", choices=["merge"])
    parser.add_argument("--load", required=True, help="The PEFT run's checkpoint directory.")
    parser.add_argument("--save", required=True, help="Where to write the merged checkpoint.")
    parser.add_argument("--ckpt-step", type=int, default=None, help="Which iteration (default: the newest).")
    args = parser.parse_args(argv)
    try:
        directory = checkpoint.resolve_load_dir(args.load, args.ckpt_step)
        if directory is None:
            raise ConfigError(f"--load {args.load}: no checkpoint there")
        cfg = checks.parse_args(["--config-file", os.path.join(directory, "run_config.yaml"),
                                     "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                                     "--load", args.load, "--save", args.save, "--no-save-optim", "--no-load-optim",
                                     "--use-checkpoint-opt-param-scheduler", "--eval-iters", "0", "--num-workers", "0"]
                                    + (["--ckpt-step", str(args.ckpt_step)] if args.ckpt_step is not None else []),
                                    world_size=1)
        if cfg.peft.peft == "none":
            raise ConfigError(f"{directory} is not a PEFT run's checkpoint (its run_config.yaml has no peft)")
        return merge_checkpoint(cfg)
    except (ConfigError, RuntimeError) as e:
        sys.stderr.write(f"peft.py: error: {e}\n")
        return 2


def merge_checkpoint(cfg) -> int:
    """Build the PEFT run's model as train.py's setup does (base weights, then the adapters and the progress of its
    checkpoint), fold, and save it plainly: weights only, no optimizer."""
    import types

    from megatron.core.utils import unwrap_model

    with device.shim():  # megatron-core on this machine, for the merge
        initialize_distributed(cfg)
        try:
            tokenizer = data.build_tokenizer(cfg)
            model = build_model(cfg, data.embedding_rows(tokenizer))
            state = types.SimpleNamespace(cfg=cfg, train_state=checkpoint.TrainState(), tokenizer=tokenizer)
            checkpoint.load_checkpoint(state, model, None, None, cfg.checkpoint.pretrained_checkpoint, finetune=True)
            apply_peft(cfg, model)
            checkpoint.load_checkpoint(state, model, None, None, cfg.checkpoint.load)
            n = merge_adapters([unwrap_model(chunk) for chunk in model])
            cfg.peft.peft = "none"  # what run_config.yaml will say: a plain model, standing on its own
            cfg.checkpoint.load = cfg.checkpoint.pretrained_checkpoint = None
            cfg.train.train_iters = state.train_state.step
            directory = checkpoint.save_checkpoint(state, model, None, None)
            print(f" merged {n} adapters into the base weights: {directory}", flush=True)
        finally:
            destroy_distributed()
    return 0


if __name__ == "__main__":
    import peft  # the module train.py imports: its LoRALinear class is the one the model holds

    sys.exit(peft.main(sys.argv[1:]))
