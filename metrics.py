"""metrics.py: every reporting utility — the log line, TensorBoard scalars, timers, FLOPs.

Nothing here holds training state: functions take the state they report on. Each formula is a small
pure function whose docstring says where it comes from.
"""

import math
import time
from datetime import datetime

import torch

# --------------------------------------------------------------------------------------------------
# Printing from the right rank
# --------------------------------------------------------------------------------------------------


def is_rank_0() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def is_last_rank() -> bool:
    """The last rank holds the last pipeline stage, where the loss is known: Megatron logs from there."""
    return not torch.distributed.is_initialized() or (
        torch.distributed.get_rank() == torch.distributed.get_world_size() - 1)


def print_rank_0(*args, **kwargs) -> None:
    if is_rank_0():
        print(*args, **kwargs, flush=True)


def print_rank_last(*args, **kwargs) -> None:
    if is_last_rank():
        print(*args, **kwargs, flush=True)


# --------------------------------------------------------------------------------------------------
# Timers
# --------------------------------------------------------------------------------------------------


class _Timer:
    def __init__(self, sync):
        self._sync, self._elapsed, self._start, self.running = sync, 0.0, None, False

    def start(self, barrier: bool = False):
        self._sync(barrier)
        self._start, self.running = time.perf_counter(), True

    def stop(self, barrier: bool = False):
        self._sync(barrier)
        if self.running:
            self._elapsed += time.perf_counter() - self._start
        self.running = False

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Seconds accumulated since the last reset (a running timer is measured up to now)."""
        was_running = self.running
        if was_running:
            self.stop(barrier)
        value = self._elapsed
        if reset:
            self._elapsed = 0.0
        if was_running:
            self.start(barrier)
        return value


class _NullTimer:
    def start(self, barrier=False):
        pass

    def stop(self, barrier=False):
        pass

    def elapsed(self, reset=True, barrier=False):
        return 0.0


class Timers:
    """Named wall-clock timers, as megatron-core's Timers, minus its unconditional CUDA sync.

    `timers(name, log_level)` returns the timer, or a no-op one when log_level is above
    `--timing-log-level`, so fine-grained timing costs nothing unless asked for. Device work is
    asynchronous on a GPU, so a timer synchronises CUDA at start and stop there (and only there).
    """

    def __init__(self, log_level: int, use_gpu: bool):
        self.log_level, self.use_gpu, self._timers = log_level, use_gpu, {}

    def _sync(self, barrier: bool):
        if barrier and torch.distributed.is_initialized():
            torch.distributed.barrier()
        if self.use_gpu:
            torch.cuda.synchronize()

    def __call__(self, name: str, log_level: int = 0):
        if log_level > self.log_level:
            return _NullTimer()
        if name not in self._timers:
            self._timers[name] = _Timer(self._sync)
        return self._timers[name]


# --------------------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------------------


def num_floating_point_operations(cfg, batch_size: int, padded_vocab_size: int) -> float:
    """Model FLOPs of one training step (forward + backward) of a dense GPT on `batch_size` sequences.

    Megatron-LM `training.py::num_floating_point_operations` (Narayanan et al. 2021, appendix, extended
    for grouped-query attention and gated MLPs): 12 = 3 (forward + 2x backward) x 2 (multiply-add)
    x 2 (the two GEMMs of each block), times the attention, MLP and logit terms.
    """
    m = cfg.model
    s, h, L = m.seq_length, m.hidden_size, m.num_layers
    query_projection_ratio = m.kv_channels * m.num_attention_heads / h
    gated_multiplier = 3 / 2 if m.swiglu else 1
    return 12 * batch_size * s * L * h * h * (
        (1 + m.num_query_groups / m.num_attention_heads + s / h) * query_projection_ratio  # attention
        + (m.ffn_hidden_size / h) * gated_multiplier  # MLP
        + padded_vocab_size / (2 * L * h)  # logits
    )


# --------------------------------------------------------------------------------------------------
# TensorBoard
# --------------------------------------------------------------------------------------------------


def tensorboard_writer(cfg):
    """A SummaryWriter on the last rank when --tensorboard-dir is set (where Megatron writes), else None."""
    if not cfg.logger.tensorboard_dir or not is_last_rank():
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=cfg.logger.tensorboard_dir, max_queue=1000)


# --------------------------------------------------------------------------------------------------
# The training log
# --------------------------------------------------------------------------------------------------

ADVANCED, SKIPPED, NAN = "advanced iterations", "skipped iterations", "nan iterations"


def training_log(loss_dict, total_loss_dict, learning_rate, decoupled_learning_rate, loss_scale,
                 report_memory_flag, skipped_iter, grad_norm, params_norm, num_zeros_in_grad,
                 config, global_state, history_wct, model) -> bool:
    """Accumulate this iteration's losses; every --log-interval print Megatron's log line on the last
    rank; every --tensorboard-log-interval write Megatron's TensorBoard scalars. Returns report_memory_flag.

    Losses are averaged over the iterations of the interval that were not skipped; NaN/Inf losses
    are counted as nan iterations, not averaged in.
    """
    ts, lg = global_state.train_state, config.logger
    iteration = ts.step
    batch_size = config.train.global_batch_size

    # Accumulate. One host sync per iteration for the NaN count, as Megatron-LM does.
    total_loss_dict[ADVANCED] = total_loss_dict.get(ADVANCED, 0) + (0 if skipped_iter else 1)
    total_loss_dict[SKIPPED] = total_loss_dict.get(SKIPPED, 0) + skipped_iter
    got_nan = False
    for key, value in loss_dict.items():
        v = float(value)
        if not math.isfinite(v):
            got_nan = True
        elif not skipped_iter:
            total_loss_dict[key] = total_loss_dict.get(key, 0.0) + v
    total_loss_dict[NAN] = total_loss_dict.get(NAN, 0) + int(got_nan)

    writer = global_state.tensorboard_logger
    if writer is not None and iteration % lg.tensorboard_log_interval == 0:
        samples = ts.consumed_train_samples
        scalars = {"learning-rate": learning_rate, "batch-size": batch_size, "loss-scale": loss_scale,
                   "grad-norm": grad_norm, "num-zeros": num_zeros_in_grad, "params-norm": params_norm}
        scalars.update({k: float(v) for k, v in loss_dict.items()})
        for name, value in scalars.items():
            if value is not None:
                writer.add_scalar(name, value, iteration)
                writer.add_scalar(name + " vs samples", value, samples)

    if iteration % lg.log_interval == 0:
        elapsed = global_state.timers("interval-time").elapsed(barrier=True)
        per_iteration = elapsed / lg.log_interval
        history_wct.append(per_iteration)
        if writer is not None:
            writer.add_scalar("iteration-time", per_iteration, iteration)
        line = f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}]"
        line += f" iteration {iteration:8d}/{config.train.train_iters:8d} |"
        line += f" consumed samples: {ts.consumed_train_samples:12d} |"
        line += f" elapsed time per iteration (ms): {per_iteration * 1000.0:.1f} |"
        if lg.log_throughput:
            flops = num_floating_point_operations(config, batch_size, global_state.padded_vocab_size)
            tflops = flops / (per_iteration * 10**12 * config.world_size)
            line += f" throughput per GPU (TFLOP/s/GPU): {tflops:.1f} |"
            if writer is not None:
                writer.add_scalar("throughput", tflops, iteration)
        line += f" learning rate: {learning_rate:.6E} |"
        line += f" global batch size: {batch_size:5d} |"
        advanced = max(1, total_loss_dict[ADVANCED])
        for key, value in total_loss_dict.items():
            if key not in (ADVANCED, SKIPPED, NAN):
                line += f" {key}: {value / advanced:.6E} |"
        line += f" loss scale: {loss_scale:.1f} |"
        if grad_norm is not None:
            line += f" grad norm: {grad_norm:.3f} |"
        if num_zeros_in_grad is not None:
            line += f" num zeros: {num_zeros_in_grad:.1f} |"
        if params_norm is not None:
            line += f" params norm: {params_norm:.3f} |"
        line += f" number of skipped iterations: {total_loss_dict[SKIPPED]:3d} |"
        line += f" number of nan iterations: {total_loss_dict[NAN]:3d} |"
        total_loss_dict.clear()
        print_rank_last(line)
        if writer is not None:
            writer.flush()
    return report_memory_flag


def log_evaluation(prefix: str, losses: dict, iteration: int, samples: int, writer, log_ppl: bool) -> None:
    """Megatron's validation block: each loss and its perplexity exp(min(20, loss))."""
    line = f" validation loss at {prefix} |"
    for key, value in losses.items():
        ppl = math.exp(min(20.0, value))
        line += f" {key} value: {value:.6E} | {key} PPL: {ppl:.6E} |"
        if writer is not None:
            writer.add_scalar(f"{key} validation", value, iteration)
            writer.add_scalar(f"{key} validation vs samples", value, samples)
            if log_ppl:
                writer.add_scalar(f"{key} validation ppl", ppl, iteration)
                writer.add_scalar(f"{key} validation ppl vs samples", ppl, samples)
    rule = "-" * (len(line) + 1)
    print_rank_last(f"{rule}\n{line}\n{rule}")
    if writer is not None:
        writer.flush()


# --------------------------------------------------------------------------------------------------
# Norms
# --------------------------------------------------------------------------------------------------


def param_is_not_shared(param) -> bool:
    """True unless the parameter is marked `shared` (a tied weight counted on another stage)."""
    return not getattr(param, "shared", False)


def calc_params_l2_norm(model) -> float:
    """L2 norm of all parameters, each counted once: tensor-parallel duplicates (norms, row-parallel
    biases) only on tensor-parallel rank 0, shared weights once; squares summed over model-parallel ranks."""
    from megatron.core import parallel_state, tensor_parallel

    model = model if isinstance(model, list) else [model]
    params = [p for chunk in model for p in chunk.parameters()
              if param_is_not_shared(p) and tensor_parallel.param_is_not_tensor_parallel_duplicate(p)]
    total = torch.stack([p.detach().float().pow(2).sum() for p in params]).sum()
    group = parallel_state.get_model_parallel_group()
    if group.size() > 1:
        torch.distributed.all_reduce(total, group=group)
    return total.sqrt().item()
