"""metrics.py: every reporting utility — the log line, TensorBoard (and W&B, MLflow, Comet) scalars, timers, FLOPs.

Names and signatures follow Megatron Bridge's `training.utils.train_utils` and `.theoretical_memory_utils` (the
progress.txt helpers: `training.train`); the log line, the validation block and progress.txt are Megatron-LM's.

Nothing here holds training state: functions take the state they report on. Each formula is a small
pure function whose docstring says where it comes from.
"""

import dataclasses
import json
import math
import os
import re
import sys
import time
import warnings
from datetime import datetime
from typing import Any, Optional

import torch

import device  # first: it quiets megatron-core's import-time warnings
from config import moe_layers as config_moe_layers
from config import layer_pattern, pipeline_stage_layers
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.module import param_is_not_shared
from megatron.core.utils import unwrap_model

# --------------------------------------------------------------------------------------------------
# Printing from the right rank
# --------------------------------------------------------------------------------------------------


def is_rank_0() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def is_last_rank() -> bool:
    """The last rank holds the last pipeline stage, where the loss is known: Megatron logs from there."""
    return not torch.distributed.is_initialized() or (
        torch.distributed.get_rank() == torch.distributed.get_world_size() - 1)


def _print_whole(message: str) -> None:
    # One write per message: print() writes the text and the newline separately, and ranks sharing a
    # pipe (torchrun) could otherwise interleave their lines.
    sys.stdout.write(f"{message}\n")
    sys.stdout.flush()


def print_rank_0(message: str) -> None:
    if is_rank_0():
        _print_whole(message)


def print_rank_last(message: str) -> None:
    if is_last_rank():
        _print_whole(message)


# --------------------------------------------------------------------------------------------------
# FLOPs, throughput and MFU
# --------------------------------------------------------------------------------------------------


def num_floating_point_operations(cfg, batch_size: int, padded_vocab_size: int) -> float:
    """Model FLOPs of one training step (forward + backward) of a dense GPT on `batch_size` sequences.

    Megatron-LM `training.py::num_floating_point_operations` (Narayanan et al. 2021, appendix, extended
    for grouped-query attention and gated MLPs): 12 = 3 (forward + 2x backward) x 2 (multiply-add)
    x 2 (the two GEMMs of each block), times the attention, MLP and logit terms. The MLP term uses the
    real ffn size times 3/2 for SwiGLU (three matrices, not two), not an assumed 4h. Causal attention
    computes only the unmasked half of the score (QK^T) and context (AV) matmuls: s / 2h, not s / h, as
    Megatron-LM counts it since 2025 and Megatron Bridge's flop_utils.py does.

    With PEFT the frozen weights get no weight gradient: their GEMMs count 2 (forward, input gradient), not 3
    (as Bridge's LoRA count scales frozen work by 2/3), and the adapters add theirs (adapter_flops_per_token).

    Multi-token prediction's modules count as Megatron-LM counts them: each a layer of the decoder's last layer's
    kind, its projection of 2h to h and its three norms (3h), and one more logit computation each.
    """
    m = cfg.model
    mtp = m.mtp_num_layers or 0
    s, h, L = m.seq_length, m.hidden_size, m.num_layers + mtp
    gated_multiplier = 3 / 2 if m.mlp_fields()["gated_linear_unit"] else 1  # Megatron-LM's counts --swiglu only
    if m.multi_latent_attention:  # each 12 h^2 of the formula is 6 x a token's multiply-adds, 2 h^2 of them
        projections = mla_attention_parameters(m, norms=1) / (2 * h * h)
        core_attention = s * m.num_attention_heads * (m.qk_head_dim + m.qk_pos_emb_head_dim + m.v_head_dim) / (4 * h * h)
    else:
        query_projection_ratio = m.kv_channels * m.num_attention_heads / h
        projections = (1 + m.num_query_groups / m.num_attention_heads) * query_projection_ratio
        core_attention = s / h / 2 * query_projection_ratio
    weights = (projections  # attention projections
               + (active_mlp_width(m) / h) * gated_multiplier  # MLP
               + (1 + mtp) * padded_vocab_size / (2 * L * h)  # logits
               + mtp * (3 * h + 2 * h * h) / (2 * L * h * h))  # MTP's norms and projection
    if cfg.peft.peft == "none":
        return 12 * batch_size * s * L * h * h * (weights + core_attention)
    return 12 * batch_size * s * L * h * h * (weights * 2 / 3 + core_attention) + \
        batch_size * s * adapter_flops_per_token(cfg)


def mla_attention_parameters(m, norms: int) -> int:
    """Multi-latent attention's weights in one layer: the query projection (through its latent of --q-lora-rank,
    with that latent's norm), the key-value latent with its norm and the keys' shared rotary part, the per-head
    key and value up-projection, the output projection. `norms`: each latent norm's parameters per channel (1 for
    RMSNorm, 2 for LayerNorm, 0 without --qk-layernorm; the FLOPs count 1 as Megatron-LM's does). Megatron-LM's training.py and theoretical_memory_usage.py
    (core_v0.19), multi_latent_attention branches."""
    h, a, qk, pos, v = m.hidden_size, m.num_attention_heads, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
    q = h * a * (qk + pos) if m.q_lora_rank is None else m.q_lora_rank * (h + a * (qk + pos) + norms)
    return q + m.kv_lora_rank * (h + a * (qk + v) + norms) + h * pos + a * v * h


def active_mlp_width(m) -> float:
    """The MLP width a token passes through, averaged over the layers and the multi-token prediction layers (each of
    the decoder's last layer's kind): --ffn-hidden-size in a dense layer; in an MoE layer --moe-router-topk experts of
    --moe-ffn-hidden-size each and the shared experts (Megatron-LM's transformer_flops, training.py:520-530; the
    router's small matmul is not counted there either)."""
    kinds = config_moe_layers(m)
    kinds = kinds + kinds[-1:] * (m.mtp_num_layers or 0)
    routed = m.moe_router_topk * (m.moe_ffn_hidden_size or 0) + (m.moe_shared_expert_intermediate_size or 0)
    return sum(routed if moe else m.ffn_hidden_size for moe in kinds) / len(kinds)


def adapter_flops_per_token(cfg) -> float:
    """PEFT adapters' forward and backward FLOPs per token: 3 x 2 x dim x (in + out) for each adapted layer,
    for the targets named plainly (linear_qkv, linear_proj, linear_fc1, linear_fc2; a * pattern is not counted)."""
    m, p = cfg.model, cfg.peft
    q, kv = m.kv_channels * m.num_attention_heads, m.kv_channels * m.num_query_groups
    h, ffn = m.hidden_size, m.ffn_hidden_size
    sizes = {"linear_qkv": h + q + 2 * kv, "linear_proj": q + h, "linear_fc1": h + ffn * (2 if m.mlp_fields()["gated_linear_unit"] else 1),
             "linear_fc2": ffn + h}
    per_layer = sum(sizes.get(name, 0) for name in set(p.lora_target_modules) - set(p.lora_exclude_modules))
    return 3 * 2 * p.lora_dim * per_layer * m.num_layers


def throughput_tflops_per_device(flops_per_iteration: float, seconds_per_iteration: float, world_size: int) -> float:
    """Model TFLOP/s per device: what Megatron prints as `throughput per GPU (TFLOP/s/GPU)`."""
    return flops_per_iteration / (seconds_per_iteration * 10**12 * world_size)


def iterations_since_last_log(step: int, start_step: int, log_interval: int) -> int:
    """The iterations a log line at `step` covers: since the previous multiple of --log-interval, or since this
    job's start when it resumed in between (Bridge 0.6's training_log divides the interval's time by these, so a
    resumed job's first line is not diluted)."""
    return step - max(start_step, (step - 1) // log_interval * log_interval)


# Dense (no 2:4 sparsity) peak TFLOP/s by accelerator and dtype, from the vendors' datasheets. Keys are
# lower-case substrings of torch.cuda.get_device_name(); the first match wins (more specific names first).
PEAK_TFLOPS = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5: 989 BF16/FP16, 494 TF32, 67 FP32; the 1979 figure is sparse).
    "h100 80gb hbm3": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9, "tf32": 494.7},
    "h100 sxm": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9, "tf32": 494.7},
    # Same datasheet, PCIe card: 756 BF16/FP16, 378 TF32, 51 FP32.
    "h100 pcie": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.2, "tf32": 378.0},
    # NVIDIA H200 datasheet (SXM): 989 BF16/FP16 dense, 67 FP32.
    "h200": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9, "tf32": 494.7},
    # NVIDIA A100 Tensor Core GPU datasheet: 312 BF16/FP16, 156 TF32, 19.5 FP32 (SXM and PCIe).
    "a100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5, "tf32": 156.0},
    # NVIDIA L40S datasheet: 362 BF16/FP16 dense, 91.6 FP32.
    "l40s": {"bf16": 362.05, "fp16": 362.05, "fp32": 91.6, "tf32": 183.0},
    # NVIDIA V100 datasheet (SXM2): 125 FP16 tensor, 15.7 FP32; no BF16.
    "v100": {"fp16": 125.0, "fp32": 15.7},
}


def peak_tflops(device_name, dtype: str):
    """The datasheet peak for this device and dtype, or None when the device is not in the table
    (a CPU, or an accelerator nobody has looked up): MFU is then `n/a`, never a guess."""
    if not device_name:
        return None
    name = device_name.lower()
    for key, peaks in PEAK_TFLOPS.items():
        if key in name:
            return peaks.get(dtype)
    return None


def mfu(tflops_per_device: float, peak) -> str:
    """Model FLOPs utilisation (PaLM, Chowdhery et al. 2022, appendix B): achieved / peak, as text."""
    return "n/a" if not peak else f"{100.0 * tflops_per_device / peak:.1f}%"


def device_name():
    """The accelerator's name, for its peak FLOP/s; None on a CPU (no peak is guessed)."""
    return torch.cuda.get_device_name() if device.cuda() else None


def report_throughput(train_config, iteration: int, seq_length: int, history_wct: list, window_size: int) -> dict:
    """Rolling throughput over the last `window_size` iterations (the `throughput/*` keys).

    `history_wct` holds, per iteration of this job, the wall-clock seconds since the job started, at
    the end of that iteration. Only this job's iterations are in it, so a resumed run never divides the
    iterations of earlier jobs by this job's time (no spike after a resume). Logged once the window is full.
    """
    if len(history_wct) < window_size or window_size < 2:
        return {}
    window = history_wct[-window_size:]
    elapsed = window[-1] - window[0]
    if elapsed <= 0:

        warnings.warn(f"report_throughput: non-positive elapsed time ({elapsed}) at iteration {iteration}; skipped")
        return {}
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    batches = (len(window) - 1) / elapsed
    samples = batches * train_config.global_batch_size
    tokens = samples * seq_length
    return {"throughput/batches_per_sec": batches, "throughput/samples_per_sec": samples,
            "throughput/tokens_per_sec": tokens, "throughput/device/batches_per_sec": batches / world,
            "throughput/device/samples_per_sec": samples / world, "throughput/device/tokens_per_sec": tokens / world}


_TIME_UNITS = {"seconds": 1, "minutes": 60, "hours": 3600, "days": 86400}


def report_runtime(train_state, start_time: float, seq_length: int, train_iters: int, time_unit: str = "seconds",
                   start_step: int = 0) -> dict:
    """Elapsed time and an estimate of the time left, from this job's rate (iterations since
    `start_step`, the step this job resumed at) (the `time/*` keys)."""
    if time_unit not in _TIME_UNITS:
        raise ValueError(f"time_unit must be one of {', '.join(_TIME_UNITS)}, got {time_unit}")
    divisor = _TIME_UNITS[time_unit]
    elapsed = time.time() - start_time
    done = train_state.step - start_step
    remaining = elapsed / done * (train_iters - train_state.step) if done > 0 else float("nan")
    return {"time/remaining_estimate": remaining / divisor, "time/tokens": train_state.consumed_train_samples * seq_length,
            "time/samples": train_state.consumed_train_samples, "time/batches": train_state.step,
            "time/total": elapsed / divisor}


# --------------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------------

# torch.cuda.memory_stats() key -> reported name (ten statistics).
MEMORY_KEYS = {
    "allocated_bytes.all.current": "current_allocated_mem",
    "active_bytes.all.current": "current_active_mem",
    "inactive_split_bytes.all.current": "current_inactive_mem",
    "reserved_bytes.all.current": "current_reserved_mem",
    "allocated_bytes.all.peak": "peak_allocated_mem",
    "active_bytes.all.peak": "peak_active_mem",
    "inactive_split_bytes.all.peak": "peak_inactive_mem",
    "reserved_bytes.all.peak": "peak_reserved_mem",
    "num_alloc_retries": "alloc_retries",
}
GB = 1024**3


def report_memory(memory_keys=None) -> dict:
    """Memory statistics under `memory/NAME`, in GB (2^30 bytes), max-reduced over pipeline ranks.

    On a GPU: torch.cuda.memory_stats(), the keys above (alloc_retries is a count). On a CPU there are
    no device statistics, so the process's resident memory is reported instead, under different names
    (`memory/cpu_rss_mem`, `memory/cpu_peak_rss_mem`), never as zeros that look like GPU figures.
    """
    if device.cuda() and torch.cuda.is_initialized():
        stats = torch.cuda.memory_stats()
        report = {f"memory/{name}": stats.get(key, 0) / (1 if key == "num_alloc_retries" else GB)
                  for key, name in (memory_keys or MEMORY_KEYS).items()}
    else:
        import resource

        import psutil

        peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux
        rss = psutil.Process().memory_info().rss
        report = {"memory/cpu_rss_mem": rss / GB, "memory/cpu_peak_rss_mem": max(peak_kb * 1024, rss) / GB}

    if parallel_state.model_parallel_is_initialized() and parallel_state.get_pipeline_model_parallel_world_size() > 1:
        values = torch.tensor(list(report.values()), dtype=torch.float64, device=device.current())
        torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX,
                                     group=parallel_state.get_pipeline_model_parallel_group())
        report = dict(zip(report, values.tolist()))
    return report


# --------------------------------------------------------------------------------------------------
# Writers: TensorBoard, Weights & Biases, MLflow and Comet behind one add_scalar
# --------------------------------------------------------------------------------------------------


def tensorboard_writer(cfg):
    """A SummaryWriter on the last rank when --tensorboard-dir is set (where Megatron writes), else None."""
    if not cfg.logger.tensorboard_dir or not is_last_rank():
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=cfg.logger.tensorboard_dir, max_queue=1000)


class StepWriter:
    """A tracker with a single step axis. TensorBoard also gets each scalar against the consumed samples
    ("NAME vs samples"); those twins are not sent here, as Megatron sends W&B, MLflow and Comet only the
    iteration-keyed scalars (Bridge `training_log`)."""

    def add_scalar(self, tag: str, value, step: int) -> None:
        if not tag.endswith(" vs samples"):
            self.log(tag, float(value), int(step))

    def flush(self) -> None:
        pass


class WandbWriter(StepWriter):
    """Weights & Biases (Megatron-LM `global_vars._set_wandb_writer`): a run named --wandb-exp-name in
    --wandb-project, the resolved config as its config, files under --wandb-save-dir (default SAVE/wandb)."""

    def __init__(self, cfg):
        import wandb

        lg = cfg.logger
        save_dir = lg.wandb_save_dir or (os.path.join(cfg.checkpoint.save, "wandb") if cfg.checkpoint.save else None)
        if save_dir:
            os.makedirs(save_dir, exist_ok=True)
        self.run = wandb.init(project=lg.wandb_project, name=lg.wandb_exp_name, entity=lg.wandb_entity, dir=save_dir,
                              config=json.loads(json.dumps(cfg.to_dict(), default=str)))

    def log(self, tag, value, step):
        self.run.log({tag: value}, step=step)  # scalars of one step gather into one row

    def close(self):
        self.run.finish()


class MlflowWriter(StepWriter):
    """MLflow: a run of --mlflow-experiment named --mlflow-run-name with
    --mlflow-tags. Scalars wait for flush() (each log interval) and go as one batch: one request per
    interval to a tracking server, not one per scalar. '/' in names becomes '_'."""

    def __init__(self, cfg):
        from mlflow.tracking import MlflowClient

        lg = cfg.logger
        self.client = MlflowClient(tracking_uri=lg.mlflow_tracking_uri)  # None: MLFLOW_TRACKING_URI or MLflow's default
        experiment = self.client.get_experiment_by_name(lg.mlflow_experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(lg.mlflow_experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=lg.mlflow_run_name, tags=lg.mlflow_tags or {}).info.run_id
        self.pending = []

    def log(self, tag, value, step):
        from mlflow.entities import Metric

        self.pending.append(Metric(tag.replace("/", "_"), value, int(time.time() * 1000), step))

    def flush(self):
        for i in range(0, len(self.pending), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=self.pending[i: i + 1000])
        self.pending = []

    def close(self):
        self.flush()
        self.client.set_terminated(self.run_id)


class CometWriter(StepWriter):
    """Comet: an experiment of --comet-project named --comet-experiment-name
    with --comet-tags and the resolved config as parameters. Online with an API key, or an offline archive
    with COMET_START_ONLINE=0. Comet's own automatic logging (hooks into torch, argv, the console) is off:
    the scalars come from here, once."""

    def __init__(self, cfg):
        import comet_ml

        lg = cfg.logger
        self.experiment = comet_ml.start(
            api_key=lg.comet_api_key, workspace=lg.comet_workspace, project_name=lg.comet_project,
            experiment_config=comet_ml.ExperimentConfig(
                name=lg.comet_experiment_name, tags=lg.comet_tags, auto_metric_logging=False, auto_param_logging=False,
                auto_output_logging=False, parse_args=False, log_code=False, log_graph=False, log_git_metadata=False,
                log_git_patch=False, display_summary_level=0))
        self.experiment.log_parameters(cfg.to_dict())

    def log(self, tag, value, step):
        self.experiment.log_metric(tag, value, step=step)

    def close(self):
        self.experiment.end()


TRACKERS = (("wandb_project", WandbWriter), ("mlflow_experiment", MlflowWriter), ("comet_project", CometWriter))


def writers_configured(logger_config) -> bool:
    """Whether any writer is asked for: then every rank computes the scalars (some are collectives)."""
    return bool(logger_config.tensorboard_dir) or any(getattr(logger_config, switch) for switch, _ in TRACKERS)


class Writers:
    """The run's writers as one SummaryWriter-like object: add_scalar(tag, value, step), flush(), close().
    `tensorboard` is the SummaryWriter itself (or None), for what only TensorBoard takes (images, histograms)."""

    def __init__(self, writers: list, tensorboard=None):
        self.writers, self.tensorboard = writers, tensorboard

    def add_scalar(self, tag: str, value, step: int) -> None:
        for writer in self.writers:
            writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        for writer in self.writers:
            writer.flush()

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


def build_writers(cfg):
    """Writers for --tensorboard-dir, --wandb-project, --mlflow-experiment and --comet-project, on the last
    rank (where Megatron writes, and where the loss is known); None on other ranks or when none is asked for.
    Each tracker's package is imported only here, when asked for (checks.validate checked it imports)."""
    if not writers_configured(cfg.logger) or not is_last_rank():
        return None
    tensorboard = tensorboard_writer(cfg)
    writers = [tensorboard] if tensorboard is not None else []
    writers += [cls(cfg) for switch, cls in TRACKERS if getattr(cfg.logger, switch)]
    return Writers(writers, tensorboard)


# --------------------------------------------------------------------------------------------------
# The training log
# --------------------------------------------------------------------------------------------------

ADVANCED, SKIPPED, NAN = "advanced iterations", "skipped iterations", "nan iterations"
# The log line's timers, in order: ours, then those megatron-core's schedules, DDP and optimizer
# start through config.timers (level 1: forward-backward, optimizer, ...; level 2: the per-microbatch phases).
TIMERS_TO_LOG = [
    "forward-backward", "forward-compute", "backward-compute", "batch-generator", "forward-recv", "forward-send",
    "backward-recv", "backward-send", "forward-send-forward-recv", "forward-send-backward-recv",
    "backward-send-forward-recv", "backward-send-backward-recv", "forward-backward-send-forward-backward-recv",
    "layernorm-grads-all-reduce", "embedding-grads-all-reduce", "all-grads-sync", "params-all-gather",
    "optimizer-copy-to-main-grad", "optimizer-unscale-and-check-inf", "optimizer-clip-main-grad",
    "optimizer-count-zeros", "optimizer-inner-step", "optimizer-copy-main-to-model-params", "optimizer",
    "save-checkpoint",
]


@dataclasses.dataclass
class Scalar:
    """One value of an iteration's report: `label: value` (formatted with `fmt`) on the console line and `tag` in
    TensorBoard and every tracker (with a "<tag> vs samples" twin). An empty label or tag leaves that output out;
    None as the value leaves both out. A loss (`is_loss`) is checked for NaN and averaged over the log interval
    on the console (and gets a perplexity at validation); any other value is shown as of the logged iteration."""

    label: str
    tag: str
    value: Any
    fmt: str = ".6E"
    is_loss: bool = False
    by_samples: bool = True  # the "<tag> vs samples" twin (Megatron-LM writes none for the MoE losses)
    every_iteration: bool = False  # a loss summed on skipped iterations too (the MoE and MTP losses: accumulate_losses)


def step_report(loss_dict: dict, learning_rate, decoupled_learning_rate, batch_size: int, loss_scale: float,
                grad_norm, num_zeros_in_grad, params_norm, seconds_per_iteration: Optional[float] = None,
                moe_losses: Optional[dict] = None, mtp_metrics: Optional[dict] = None) -> list:
    """The iteration's scalars, in the console line's order: Megatron's names on the console, Megatron's
    TensorBoard tags. A new scalar is one more line here. `seconds_per_iteration` is the log interval's so far (the
    log line's elapsed time per iteration, evaluation and saves left out): what a rate divides by. `moe_losses`: the
    MoE layers' auxiliary losses (moe_auxiliary_losses), averaged over the interval on the console as the lm loss;
    the per-layer ones ("moe/...") only in TensorBoard and the trackers. `mtp_metrics`: multi-token prediction's
    (multi_token_prediction_metrics), its losses on the console too, its acceptance rates only in TensorBoard."""
    return [
        Scalar("learning rate", "learning-rate", learning_rate),
        Scalar("", "decoupled-learning-rate", decoupled_learning_rate),
        Scalar("global batch size", "batch-size", batch_size, "5d"),
        *(Scalar(key, key, value, is_loss=True) for key, value in loss_dict.items()),
        *(Scalar("" if key.startswith("moe/") else key, key, value, is_loss=not key.startswith("moe/"),
                 by_samples=False, every_iteration=True) for key, value in (moe_losses or {}).items()),
        *(Scalar(key if key.endswith(" loss") else "", key, value, is_loss=key.endswith(" loss"), by_samples=False,
                 every_iteration=True) for key, value in (mtp_metrics or {}).items()),
        Scalar("loss scale", "loss-scale", loss_scale, ".1f"),
        Scalar("grad norm", "grad-norm", grad_norm, ".3f"),
        Scalar("num zeros", "num-zeros", num_zeros_in_grad, ".1f"),
        Scalar("params norm", "params-norm", params_norm, ".3f"),
    ]


def moe_loss_names(m) -> list:
    """The MoE auxiliary losses Megatron-LM's training_log tracks (megatron/training/training.py:2761-2769): one per
    load-balancing type, and z_loss with --moe-z-loss-coeff. With one type Megatron-LM tests the names as substrings of it, so
    seq_aux_loss also shows load_balancing_loss (0: no layer adds to it); kept, for the same log line."""
    kinds = m.moe_router_load_balancing_type
    kind = kinds if isinstance(kinds, str) else kinds[0] if len(kinds) == 1 else kinds  # a str once finalized
    names = [name for key, name in (("aux_loss", "load_balancing_loss"), ("seq_aux_loss", "seq_load_balancing_loss"),
                                    ("global_aux_loss", "global_load_balancing_loss")) if key in kind]
    return names + (["z_loss"] if m.moe_z_loss_coeff is not None else [])


class _Collected(dict):
    """A writer that keeps what is written: {tag: value}."""

    def add_scalar(self, tag, value, step):
        self[tag] = float(value)


def moe_auxiliary_losses(cfg, num_microbatches: int) -> dict:
    """This iteration's MoE auxiliary losses, {name: value} (and {"moe/<name>_layer_<N>": value} with
    --moe-per-layer-logging), as Megatron-LM logs them: megatron-core's MoE metrics tracker's `report` sums each loss over the
    pipeline stages and its reduce groups, averages it over the data-parallel ranks and the microbatches and divides
    it by the MoE layers (the MTP layers of MoE kind among them); then it clears the layers' tracker for the next iteration. A collective: every rank calls
    it every iteration. {} for a dense model."""
    m = cfg.model
    if not m.num_moe_experts:
        return {}
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker


    collected = _Collected()
    get_moe_metrics_tracker().report(
        loss_scale=1 / num_microbatches, iteration=0, writer=collected, per_layer_logging=m.moe_per_layer_logging,
        force_initialize=True, track_names=moe_loss_names(m), num_layers=m.num_layers,
        moe_layer_freq=layer_pattern(m.moe_layer_freq, "--moe-layer-freq", m.num_layers),
        # the MTP layers are MoE layers when the last decoder layer is: counted in the mean, as Megatron-LM's
        # training.py:2792 (core_v0.19) counts them, and in the tracker's size on every pipeline stage
        mtp_num_layers=m.mtp_num_layers)
    return dict(collected)


def multi_token_prediction_metrics(cfg, num_microbatches: int) -> dict:
    """This iteration's multi-token prediction metrics, as Megatron-LM logs them (training.py:2798-2802, core_v0.19):
    megatron-core's MTPLossLoggingHelper sums each MTP layer's loss over the microbatches, averages it over the
    data-parallel ranks and the microbatches: "mtp_<k> loss"; with the share of positions whose most likely token is
    the label, this iteration's ("mtp_<k>_acceptance_rate", %) and since the run began (the "cumulative" one). Then
    it clears its tracker. A collective among the ranks that hold the MTP layers (the last pipeline stage); {} on
    the others and without --mtp-num-layers."""
    if not cfg.model.mtp_num_layers:
        return {}
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    collected = _Collected()
    MTPLossLoggingHelper.track_mtp_metrics(loss_scale=1 / num_microbatches, iteration=0, writer=collected)
    return dict(collected)


def training_log(loss_dict, total_loss_dict, learning_rate, decoupled_learning_rate, loss_scale,
                 report_memory_flag, skipped_iter, grad_norm, params_norm, num_zeros_in_grad,
                 config, global_state, history_wct, model, l2_norm_grad=None) -> bool:
    """Bridge's signature for log_step: the scalars as separate arguments (and report_l2_norm_grad's, taken before
    the step). Returns report_memory_flag. The report gets what train.py's gives it: the log interval's seconds per
    iteration so far, and the MoE losses."""
    ts, interval = global_state.train_state, config.logger.log_interval
    seconds = global_state.timers("interval-time").elapsed(reset=False) / iterations_since_last_log(
        ts.step, global_state.start_step, interval)
    report = step_report(loss_dict, learning_rate, decoupled_learning_rate, global_state.current_global_batch_size,
                         loss_scale, grad_norm, num_zeros_in_grad, params_norm, seconds,
                         moe_losses=moe_auxiliary_losses(config, global_state.num_microbatches),
                         mtp_metrics=multi_token_prediction_metrics(config, global_state.num_microbatches))
    return log_step(report, total_loss_dict, report_memory_flag, skipped_iter, global_state, history_wct, model,
                    l2_norm_grad)


def log_step(report: list, total_loss_dict: dict, report_memory_flag: bool, skipped_iter: int, global_state,
             history_wct: list, model, l2_norm_grad=None) -> bool:
    """Accumulate the report's losses; every --tensorboard-log-interval write the report (and the extra reports
    that are asked for) to TensorBoard and the trackers; every --log-interval print Megatron's log line on the last
    rank. Returns report_memory_flag (True until the first memory report has been printed).

    Losses are summed over the interval and divided by the iterations that advanced (accumulate_losses). What walks
    all parameters (norms, per-layer gradient norms) runs only when its flag asks."""
    config = global_state.cfg
    ts, lg = global_state.train_state, config.logger
    accumulate_losses(report, total_loss_dict, skipped_iter)
    if writers_configured(lg) and ts.step % lg.tensorboard_log_interval == 0:
        write_report(report, extra_reports(global_state, history_wct, model, l2_norm_grad), global_state)
    if ts.step % lg.log_interval == 0:
        report_memory_flag = print_log_line(report, total_loss_dict, report_memory_flag, global_state)
    return report_memory_flag


def accumulate_losses(report: list, total_loss_dict: dict, skipped_iter: int) -> None:
    """Megatron-LM's interval sums (training.py:2597-2617, 2782-2802): the loss functions' losses over the iterations
    that advanced, and a skipped iteration with a NaN or Inf one counted as a nan iteration; the MoE and MTP losses
    over every iteration, skipped ones too (megatron-core's trackers add them to the sums either way). The log line
    divides every sum by the iterations that advanced. One host sync per iteration."""
    total_loss_dict[ADVANCED] = total_loss_dict.get(ADVANCED, 0) + (0 if skipped_iter else 1)
    total_loss_dict[SKIPPED] = total_loss_dict.get(SKIPPED, 0) + skipped_iter
    got_nan = False
    for scalar in report:
        if not scalar.is_loss:
            continue
        v = float(scalar.value)
        if scalar.every_iteration or not skipped_iter:
            total_loss_dict[scalar.label] = total_loss_dict.get(scalar.label, 0.0) + v
        else:
            got_nan = got_nan or not math.isfinite(v)
    total_loss_dict[NAN] = total_loss_dict.get(NAN, 0) + int(got_nan)


def extra_reports(global_state, history_wct: list, model, l2_norm_grad=None) -> dict:
    """What the --log-*-to-tensorboard flags add, written without a "vs samples" twin. Collectives run on every
    rank (only the last one holds a writer). `l2_norm_grad`: report_l2_norm_grad's, taken before the step."""
    config, ts = global_state.cfg, global_state.train_state
    lg, iteration = config.logger, ts.step
    extra = {}
    if lg.log_memory_to_tensorboard:
        extra.update(report_memory())
    if lg.log_l2_norm_grad:
        extra.update(l2_norm_grad or {})
    if lg.log_runtime_to_tensorboard:
        extra.update(report_runtime(ts, global_state.start_time, config.model.seq_length,
                                    config.train.train_iters, start_step=global_state.start_step))
    if lg.log_throughput:
        extra.update(report_throughput(config.train, iteration, config.model.seq_length, history_wct,
                                       lg.throughput_window_size))
    if lg.log_timers_to_tensorboard:
        # Seconds per iteration, the max over ranks, as megatron-core's Timers.write computes them (timers.py:452; its
        # own write takes a SummaryWriter, not the run's writers): over the iterations since the log line last read
        # (and reset) the timers.
        window = iteration % lg.log_interval or lg.log_interval
        for name, (_, hi) in global_state.timers._get_global_min_max_time(TIMERS_TO_LOG, False, False, window).items():
            extra[f"{name}-time"] = hi
    if ts.skipped_train_samples > 0:
        extra["skipped-train-samples"] = ts.skipped_train_samples
    return extra


def write_report(report: list, extra: dict, global_state) -> None:
    """The report to TensorBoard and every tracker, by iteration and by samples consumed."""
    writer, ts = global_state.writers, global_state.train_state
    if writer is None:
        return
    for scalar in report:
        if scalar.tag and scalar.value is not None:
            writer.add_scalar(scalar.tag, float(scalar.value), ts.step)
            if scalar.by_samples:
                writer.add_scalar(scalar.tag + " vs samples", float(scalar.value), ts.consumed_train_samples)
    for name, value in extra.items():
        writer.add_scalar(name, value, ts.step)


def print_log_line(report: list, total_loss_dict: dict, report_memory_flag: bool, global_state) -> bool:
    """Megatron's log line, on the last rank: the frame (time, iteration, samples, speed), the report's scalars
    (losses averaged over the interval), the skipped and NaN counts. Then the timers, and the first memory report."""
    config, ts, lg = global_state.cfg, global_state.train_state, global_state.cfg.logger
    elapsed = global_state.timers("interval-time").elapsed(barrier=True)
    iterations = iterations_since_last_log(ts.step, global_state.start_step, lg.log_interval)
    per_iteration = elapsed / iterations
    timers = global_state.timers.get_all_timers_string(TIMERS_TO_LOG, normalizer=iterations) \
        if lg.timing_log_level > 0 else None
    # The FLOPs of the interval's own iterations over its time (Bridge 0.6): right under a batch-size ramp-up too.
    flops = ts.floating_point_operations_so_far - global_state.floating_point_operations_at_last_log
    global_state.floating_point_operations_at_last_log = ts.floating_point_operations_so_far
    tflops = throughput_tflops_per_device(flops, elapsed, config.world_size)
    line = f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}]"
    line += f" iteration {ts.step:8d}/{config.train.train_iters:8d} |"
    line += f" consumed samples: {ts.consumed_train_samples:12d} |"
    if ts.skipped_train_samples > 0:  # --iterations-to-skip
        line += f" skipped samples: {ts.skipped_train_samples:12d} |"
    line += f" elapsed time per iteration (ms): {per_iteration * 1000.0:.1f} |"
    if lg.log_throughput:
        dtype = "bf16" if config.model.bf16 else "fp16" if config.model.fp16 else "fp32"
        line += f" throughput per GPU (TFLOP/s/GPU): {tflops:.1f} |"
        line += f" MFU: {mfu(tflops, peak_tflops(device_name(), dtype))} |"
    advanced = max(1, total_loss_dict[ADVANCED])
    for scalar in report:
        value = total_loss_dict.get(scalar.label, 0.0) / advanced if scalar.is_loss else scalar.value
        # a loss's interval average is shown when it is >= 0, as Megatron-LM's (training.py:2881): NaN is left out
        shown = scalar.label in total_loss_dict and value >= 0.0 if scalar.is_loss else value is not None
        if scalar.label and shown:
            line += f" {scalar.label}: {value:{scalar.fmt}} |"
    if global_state.trainable_summary:  # PEFT
        line += f" {global_state.trainable_summary} |"
    line += f" number of skipped iterations: {total_loss_dict[SKIPPED]:3d} |"
    line += f" number of nan iterations: {total_loss_dict[NAN]:3d} |"
    total_loss_dict.clear()
    print_rank_last(line)
    if timers:  # megatron-core's words, as Megatron-LM prints them: "(min, max) time across ranks (ms):" and a row each
        print_rank_last(timers)
    if report_memory_flag:
        # The estimate beside the measurement; kept on through the second iteration
        # after the start or a resume, so the measured peak includes the optimizer state its first step made.
        report_theoretical_memory(config, global_state.num_microbatches, verbose=True)
        memory = report_memory()
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        print_rank_last(f"[Rank {rank}] (after {ts.step} iterations) memory (GB) | " +
                        " | ".join(f"{k.removeprefix('memory/')}: {v:.3f}" for k, v in memory.items()))
        report_memory_flag = ts.step <= global_state.start_step + 1
    writer = global_state.writers
    if writer is not None:
        writer.add_scalar("iteration-time", per_iteration, ts.step)
        if lg.log_throughput:
            writer.add_scalar("throughput", tflops, ts.step)
        writer.flush()
    return report_memory_flag


def log_evaluation(prefix: str, losses: dict, iteration: int, samples: int, writer, log_ppl: bool) -> None:
    """Megatron's validation block: each key's value and exp(min(20, value)) beside it, labelled PPL.

    Megatron-LM and Bridge print that PPL for every key; it is a perplexity for `lm loss` only (for `z loss` or a
    load-balancing loss it is just the exponential), and TensorBoard's `... validation ppl` is the same number."""
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
# Norms and model-parallel reductions
# --------------------------------------------------------------------------------------------------


def _not_tp_duplicate(p) -> bool:
    """Whether this rank counts a parameter that tensor parallelism may copy (norms, row-parallel biases): on rank 0
    of its tensor-parallel group, the expert one for an expert's (Megatron-LM common_utils.py:124-126), so that with
    expert TP 1 every rank's expert linear_fc2 biases count, not only tensor-parallel rank 0's."""
    return tensor_parallel.param_is_not_tensor_parallel_duplicate(
        p, parallel_state.get_tensor_model_parallel_group(check_initialized=False),
        parallel_state.get_expert_tensor_parallel_group(check_initialized=False))


def _counted_params(model):
    """(name, param) of every parameter counted once across the model-parallel group: not shared, and
    tensor-parallel duplicates only once (_not_tp_duplicate)."""

    model = model if isinstance(model, list) else [model]
    for chunk in model:
        for name, p in chunk.named_parameters():
            if param_is_not_shared(p) and _not_tp_duplicate(p):
                yield name, p


def _sum_over(value: torch.Tensor, group) -> torch.Tensor:
    if group is not None and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(value, group=group)
    return value


def _is_expert(param) -> bool:
    """megatron-core marks the MoE experts' parameters `allreduce = False`: their gradients are reduced over the
    expert data-parallel group, and each expert-parallel rank holds other experts."""
    return not getattr(param, "allreduce", True)


def _squares(tensors: list, where) -> torch.Tensor:
    return torch.stack([t.float().pow(2).sum() for t in tensors]).sum() if tensors else torch.zeros((), device=where)


def calc_params_l2_norm(model, model_config=None, use_megatron_fsdp: bool = False,
                        force_create_fp32_copy: bool = False) -> float:
    """L2 norm of all parameters of the model, over every rank's shard.

    Each parameter counted once (see _counted_params); under bf16 the fp32 main copy where the megatron optimizer
    keeps one (`param.main_param`) unless force_create_fp32_copy, and otherwise (fp16 too) the weights as they are,
    as Megatron-LM's _get_param_data (common_utils.py:63-77). Dense parameters: main copies
    sharded by the distributed optimizer (`main_param_sharded`) summed over the data-parallel group, then the squares
    summed over the model-parallel group (tensor and pipeline). MoE experts' parameters: their shards summed over the
    expert data-parallel group (which the distributed optimizer shards them over), then the squares over the expert
    model-parallel group (expert-tensor, expert and pipeline): the same norm for any expert-parallel size.
    """

    model = model if isinstance(model, list) else [model]
    if use_megatron_fsdp:
        return _fsdp_params_l2_norm(model)
    if any(getattr(p, "is_torch_fsdp2_param", False) for chunk in model for p in chunk.parameters()):
        # torch FSDP2: each parameter a DTensor sharded over the data-parallel mesh alone (the seed's DTensor norm
        # sums its shards); tensor-parallel shards and copies as for any parameter, over the model-parallel group
        mains = [p for _, p in _counted_params(model)]
        squares = torch.tensor(calc_dtensor_params_l2_norm(mains) ** 2, dtype=torch.float64)
        return math.sqrt(_sum_over(squares, parallel_state.get_model_parallel_group()).item())
    params = {False: ([], []), True: ([], [])}  # expert? -> (whole, sharded)
    any_sharded = False
    bf16 = getattr(model_config or getattr(unwrap_model(model[0]), "config", None), "bf16", False)
    for _, p in _counted_params(model):
        whole, sharded = params[_is_expert(p)]
        main = getattr(p, "main_param", None)
        if force_create_fp32_copy or not bf16:
            whole.append(p.detach().float())
        elif getattr(p, "main_param_sharded", False):
            # The distributed optimizer's fp32 shard of this parameter on this rank, or None when all of it
            # lives on other data-parallel ranks: they count it, and the data-parallel sum below adds it once.
            any_sharded = True
            if main is not None:
                sharded.append(main)
        else:
            whole.append(main if main is not None else p.detach().float())
    where = device.current()
    # Both kinds on every rank, whatever the model: an `allreduce = False` parameter outside an MoE model (Bridge's
    # unit test has one) is counted too, and a rank that holds no expert still joins the expert groups' reductions.
    groups = {False: (parallel_state.get_data_parallel_group(with_context_parallel=True),
                      parallel_state.get_model_parallel_group()),
              True: (parallel_state.get_expert_data_parallel_group(),
                     parallel_state.get_expert_tensor_model_pipeline_parallel_group())}
    total = torch.zeros((), dtype=torch.float32, device=where)
    for expert, (dp_group, mp_group) in groups.items():
        whole, sharded = params[expert]
        squares = _squares(whole, where)
        if any_sharded:
            squares = squares + _sum_over(_squares(sharded, where), dp_group)
        total += _sum_over(squares, mp_group)
    return total.sqrt().item()


def _fsdp_params_l2_norm(model: list) -> float:
    """Under Megatron FSDP: its fp32 main weights (MegatronFSDP's param_and_grad_buffer.optimizer_named_parameters,
    what its optimizer steps) through the seed's DTensor norm. Each is a DTensor sharded over the data-parallel mesh,
    and a tensor-parallel one over a (data-parallel, tensor-parallel) mesh, so that norm already sums every shard of
    it; a tensor-parallel copy (a norm, a row-parallel bias) lives on a data-parallel mesh alone, the same on every
    tensor-parallel rank, and counts once. Then the squares over the pipeline stages. The module's parameters are no
    source: under optim_grads_params their storage is freed after each forward."""
    mains = [main for chunk in model for name, main in chunk.module.param_and_grad_buffer.optimizer_named_parameters
             if param_is_not_shared(chunk.module.raw_param[name])]
    squares = torch.tensor(calc_dtensor_params_l2_norm(mains) ** 2, dtype=torch.float64)
    return math.sqrt(_sum_over(squares, parallel_state.get_pipeline_model_parallel_group()).item())


def calc_dtensor_params_l2_norm(params) -> float:
    """L2 norm of DTensor parameters (FSDP2-style shards): local squares summed over each mesh."""
    from torch.distributed.tensor import DTensor

    total = torch.zeros((), dtype=torch.float32)
    for p in params:
        if isinstance(p, DTensor):
            local = p.to_local().detach().float().pow(2).sum()
            for dim in range(p.device_mesh.ndim):
                if p.placements[dim].is_shard():
                    local = _sum_over(local, p.device_mesh.get_group(dim))
            total = total.to(local.device) + local
        else:
            total = total.to(p.device) + p.detach().float().pow(2).sum()
    return total.sqrt().item()


def clip_coefficient(grad_norm: float, clip_grad: float) -> float:
    """The factor megatron-core's clipping scales every gradient by (clip_grads.py, clip_grad_by_total_norm_fp32):
    --clip-grad / (grad norm + 1e-6) where that is below 1, else 1 (0: no clipping). A norm of report_l2_norm_grad
    times it is the gradient's norm after clipping, the one the optimizer stepped with."""
    coefficient = clip_grad / (grad_norm + 1.0e-6) if clip_grad > 0 else 1.0
    return min(coefficient, 1.0)


def l2_norm_grad_due(cfg, iteration: int) -> bool:
    """Whether iteration `iteration`'s step takes the per-parameter gradient norms: with --log-l2-norm-grad, where
    TensorBoard or a tracker writes that iteration (log_step)."""
    lg = cfg.logger
    return lg.log_l2_norm_grad and writers_configured(lg) and iteration % lg.tensorboard_log_interval == 0


def report_l2_norm_grad(model, loss_scale: float = 1.0) -> dict:
    """`l2_norm/grad/global` and `l2_norm/grad/NAME` per parameter, after the data-parallel reduction and before
    the optimizer step (train.train_step calls it there), so before clipping at every dtype: `l2_norm/grad/global`
    is the log line's grad norm. Unscaled: divided by `loss_scale`, the one the backward used (fp16's; 1
    otherwise). After the step they would be neither: megatron-core clips and unscales in place only where the
    optimizer's gradient is the model's fp32 main_grad (fp32, bf16), not fp16's gradients of fp16. The clipped
    values are these times clip_coefficient. Each is the one process's: tensor-parallel shards summed, duplicates counted once, a
    distributed optimizer's shards of the reduced gradient summed over the data-parallel ranks, and every parameter
    under its global name (layers by their number in the whole model, not in their pipeline stage or virtual stage;
    MoE experts by their global index: `local_experts.<i>` of expert-parallel rank r is expert r x local experts +
    i), gathered from every pipeline stage and expert-parallel rank. Walks every parameter: only with
    --log-l2-norm-grad."""
    model = model if isinstance(model, list) else [model]
    # Every tensor-parallel rank lists the same names in the same order (so the per-name sums line up);
    # a duplicate counts as zero except on tensor-parallel rank 0.
    named = [(global_name(chunk, n), p) for chunk in model for n, p in _named_parameters(chunk) if param_is_not_shared(p)]
    owned = _owned_grads(model)
    report, total = {}, torch.zeros((), device=device.current())
    for expert in (False, True):
        part = [(n, p) for n, p in named if _is_expert(p) == expert]
        if expert and not getattr(getattr(unwrap_model(model[0]), "config", None), "num_moe_experts", None):
            break
        squares = torch.stack([
            _local(owned.get(p, _grad_of(p))).float().pow(2).sum()
            if _grad_of(p) is not None and _not_tp_duplicate(p)
            else torch.zeros((), device=device.current()) for _, p in part] or [torch.zeros((), device=device.current())])
        if owned or _fully_sharded(model):  # each data-parallel rank holds its shard of every reduced gradient
            squares = _sum_over(squares, parallel_state.get_expert_data_parallel_group() if expert else
                                parallel_state.get_data_parallel_group(with_context_parallel=True))
        if not expert:
            squares = _sum_over(squares, parallel_state.get_tensor_model_parallel_group())
            report.update({f"l2_norm/grad/{n}": v.sqrt().item() for (n, _), v in zip(part, squares)})
            total += _sum_over(squares[:len(part)].sum(), parallel_state.get_pipeline_model_parallel_group())
            continue
        total += _sum_over(squares[:len(part)].sum(), parallel_state.get_expert_tensor_model_pipeline_parallel_group())
        squares = _sum_over(squares, parallel_state.get_expert_tensor_parallel_group())
        ep_group = parallel_state.get_expert_model_parallel_group()
        gathered = [torch.empty_like(squares) for _ in range(torch.distributed.get_world_size(ep_group))]
        torch.distributed.all_gather(gathered, squares, group=ep_group)
        local = 1 + max((int(i) for n, _ in part for i in re.findall(r"local_experts\.(\d+)\.", n)), default=0)
        for rank, values in enumerate(gathered):
            for (n, _), v in zip(part, values):
                name = re.sub(r"local_experts\.(\d+)\.", lambda g: f"local_experts.{rank * local + int(g[1])}.", n)
                report[f"l2_norm/grad/{name}"] = v.sqrt().item()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    if torch.distributed.get_world_size(pp_group) > 1:  # each stage holds its own layers: every stage's names
        stages = [None] * torch.distributed.get_world_size(pp_group)
        torch.distributed.all_gather_object(stages, report, group=pp_group)
        report = {k: v for stage in stages for k, v in stage.items()}
    report["l2_norm/grad/global"] = total.sqrt().item()
    return {k: v / loss_scale for k, v in report.items()}


def global_name(chunk, name: str) -> str:
    """A parameter's name in the whole model: a pipeline stage (or virtual stage) numbers its decoder layers from 0,
    megatron-core's TransformerLayer keeps its number in the whole model (layer_number, from 1)."""
    match = re.match(r"decoder\.layers\.(\d+)\.", name)
    if match is None:
        return name
    gpt = next(m for m in unwrap_model(chunk).modules() if hasattr(m, "decoder"))  # under Megatron FSDP's adapter too
    number = gpt.decoder.layers[int(match[1])].layer_number
    return f"decoder.layers.{number - 1}.{name[match.end():]}"


def _owned_grads(model: list) -> dict:
    """{param: the part of its gradient this data-parallel rank owns}, with the distributed optimizer (else {}): after
    the reduce-scatter, rank r holds the reduced values of shard r of each bucket of megatron DDP's gradient buffer
    (param_and_grad_buffer.py:74, shard_buffer) and the rest of the buffer is its own unreduced gradient."""
    owned = {}
    for chunk in model:
        if not getattr(getattr(chunk, "ddp_config", None), "use_distributed_optimizer", False) or \
                not isinstance(chunk.buffers, list):  # Megatron FSDP (nn.Module's buffers()): DTensor gradients
            continue
        for buffer in [*chunk.buffers, *chunk.expert_parallel_buffers]:
            ranks, rank = buffer.data_parallel_group.size(), buffer.data_parallel_group.rank()
            for bucket in buffer.buckets:
                shard = bucket.grad_data.numel() // ranks
                lo, hi = rank * shard, (rank + 1) * shard
                for p, (start, end) in bucket.param_to_index.items():
                    owned[p] = bucket.grad_data[max(start, lo):max(min(end, hi), max(start, lo))]
    return owned


def _named_parameters(chunk) -> list:
    """(name, parameter) of a model chunk, the name the model's own. Under Megatron FSDP the optimizer's parameters,
    its DTensor shards whose gradients the step read: between steps optim_grads_params holds the whole weights in the
    module instead (megatron_fsdp.py:1396, _replace_param_with_raw_if_needed), whose gradients read as zeros. Its
    adapter names the model `module.`, and Float16Module another."""
    inner = unwrap_model(chunk)
    buffer = getattr(inner, "param_and_grad_buffer", None)
    pairs = buffer.optimizer_named_parameters if buffer is not None else inner.named_parameters()
    return [(re.sub(r"^(module\.)+", "", n), p) for n, p in pairs]


def _fully_sharded(model: list) -> bool:
    """Megatron FSDP or torch FSDP2: each data-parallel rank holds a shard of every reduced gradient, a DTensor."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for chunk in model for _, p in _named_parameters(chunk))


def _local(grad):
    """A gradient's part on this rank: a DTensor's local shard (an FSDP's data-parallel shard), else the tensor."""
    return grad.to_local() if hasattr(grad, "to_local") else grad


def _grad_of(p):
    """A parameter's gradient: megatron DDP keeps it in `main_grad`, torch in `.grad`."""
    return getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad


# --------------------------------------------------------------------------------------------------
# Theoretical memory (Bridge's theoretical_memory_utils, the seed page; Megatron-LM theoretical_memory_usage.py;
# Korthikanti et al. 2022). One count for the report and checks.py's check_fits_in_memory.
# --------------------------------------------------------------------------------------------------

NUM_BYTES_IN_MEGABYTE = 1024 * 1024


def bytes_per_parameter(config, expert: bool = False) -> tuple:
    """(bytes of a trainable parameter, bytes of a frozen one) on its rank.

    Trainable: weight + gradient + optimizer state. Mixed precision: 2 (16-bit weight) + 4 (megatron DDP's
    fp32 gradient buffer) + 4 (fp32 main copy) + 8 (Adam's two moments) = 18, Megatron-LM's figure; fp32
    training has no separate main copy: 4 + 4 + 8 = 16. SGD keeps one moment (4). The distributed optimizer
    shards the main copy and the moments over the data-parallel x context-parallel ranks (Bridge): 6 + 12/N
    with mixed precision; an MoE expert's over the expert data-parallel ranks (world / (expert-TP x EP x PP)),
    as megatron-core's optimizer for the experts does. Frozen (PEFT): the weight alone, no gradient, no optimizer
    state."""
    m, o = config.model, config.optimizer
    weight = 2 if (m.bf16 or m.fp16) else 4
    if config.ddp.use_megatron_fsdp:
        return megatron_fsdp_bytes_per_parameter(config, weight), weight
    if config.dist.use_torch_fsdp2:  # fully_shard shards the frozen weights (PEFT's) too
        return torch_fsdp2_bytes_per_parameter(config, weight), weight / (config.data_parallel_size * m.context_parallel_size)
    gradient = 2 if weight == 2 and config.ddp.grad_reduce_in_fp32 is False else 4
    sharded = (4 if weight == 2 else 0) + (8 if o.optimizer == "adam" else 4)
    if not o.use_distributed_optimizer:
        shards = 1
    elif expert:
        ep_grid = (m.expert_tensor_parallel_size or 1) * m.expert_model_parallel_size * m.pipeline_model_parallel_size
        shards = max(1, config.world_size // ep_grid)
    else:
        shards = config.data_parallel_size * m.context_parallel_size
    return weight + gradient + sharded / shards, weight


def torch_fsdp2_bytes_per_parameter(config, weight: int) -> float:
    """Bytes of a trainable parameter on its rank under torch FSDP2 at the end of a step: fully_shard shards the
    weight, its gradient (reduced in the weight's dtype) and, through the sharded parameters it steps, the optimizer's
    fp32 main copy (under --bf16/--fp16, with the main gradient megatron-core's optimizer copies into it) and moments
    (8 bytes for Adam, 4 for SGD's momentum) over its mesh, N = DP x CP ranks. fp32 with Adam: 16/N."""
    main = 4 + 4 if weight == 2 else 0
    state = 8 if config.optimizer.optimizer == "adam" else 4
    return (weight + weight + main + state) / (config.data_parallel_size * config.model.context_parallel_size)


def megatron_fsdp_bytes_per_parameter(config, weight: int) -> float:
    """Bytes of a trainable parameter on its rank under Megatron FSDP at its peak, the end of a step, by its buffers
    (megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:2644-2720): the model's weights
    (`weight` bytes; sharded under optim_grads_params), the gradients in --megatron-fsdp-main-grads-dtype (auto, the
    weights' dtype, Megatron-LM's default; sharded under optim_grads and optim_grads_params), fp32 main
    weights whatever the model's dtype and the optimizer's moments (8 bytes for Adam, 4 for SGD's momentum; sharded
    under every strategy but no_shard), over N = DP x CP ranks (ZeRO's stages, Rajbhandari et al. 2020). Under
    optim_grads_params the step's end gathers the whole model's weights again for the next forward
    (start_param_sync's all-gather, on in Megatron-LM), which frees them a layer at a time: `weight` bytes more then.
    fp32 with Adam: no_shard 4 + 4 + 12 = 20, optim 8 + 12/N, optim_grads 4 + 16/N, optim_grads_params 4 + 20/N
    (20/N between the forward and the step)."""
    strategy, n = config.ddp.data_parallel_sharding_strategy, config.data_parallel_size * config.model.context_parallel_size
    state = 4 + (8 if config.optimizer.optimizer == "adam" else 4)
    gathered = weight if strategy == "optim_grads_params" else 0
    grads = config.ddp.megatron_fsdp_main_grads_dtype  # --megatron-fsdp-main-grads-dtype; None: auto, the weights'
    gradient = grads.itemsize if isinstance(grads, torch.dtype) else weight
    return (gathered + weight / (n if strategy == "optim_grads_params" else 1)
            + gradient / (n if strategy in ("optim_grads", "optim_grads_params") else 1)
            + state / (1 if strategy == "no_shard" else n))


def attention_parameters(m) -> float:
    """One layer's attention and its two norms, biases left out (layer_parameters' count): what every layer holds,
    dense or MoE."""
    h = m.hidden_size
    if m.multi_latent_attention:  # the latents' norms are built with --qk-layernorm only
        norms = (1 if m.normalization == "RMSNorm" else 2) if m.qk_layernorm else 0
        return mla_attention_parameters(m, norms=norms) + 4 * h
    return 2 * h * h * ((1 + m.num_query_groups / m.num_attention_heads) * m.kv_channels * m.num_attention_heads / h
                        + 2 / h)


def layer_parameters(m) -> list:
    """(non-expert, expert) parameters of each transformer layer, biases left out: 2h^2 x (attention (1 + groups/
    heads) x q-projection/h + 2/h for the two norms; multi-latent attention's own count, mla_attention_parameters,
    under --multi-latent-attention), and the MLP: 2h x ffn (x 3/2 gated: --swiglu, --quick-geglu) in a dense layer; in
    an MoE layer the router (experts x h) and the shared experts beside it, and the experts, 2h x
    moe-ffn x experts (x 3/2), apart (Megatron-LM's theoretical_memory_usage.py, with the router megatron-core
    builds)."""
    h = m.hidden_size
    gated = 3 / 2 if m.mlp_fields()["gated_linear_unit"] else 1
    attention = attention_parameters(m)
    dense = attention + 2 * h * m.ffn_hidden_size * gated
    moe = (attention + (m.num_moe_experts or 0) * h + 2 * h * (m.moe_shared_expert_intermediate_size or 0) * gated,
           2 * h * (m.moe_ffn_hidden_size or 0) * (m.num_moe_experts or 0) * gated)
    return [moe if is_moe else (dense, 0) for is_moe in config_moe_layers(m)]


def parameters_per_stage(config, padded_vocab: int) -> tuple:
    """(parameters in the transformer layers, in the whole model, [(non-expert, expert) parameters of one rank of
    each pipeline stage]): the one parameter count, of the theoretical memory report and of checks.py's fit check.

    Parameters: each layer's (layer_parameters) plus the final norm, plus the h x vocab embedding (twice if
    untied), plus multi-token prediction's modules on the last stage. A stage holds its layers (uneven with
    --decoder-first/last-pipeline-num-layers), the embedding on the first, the output layer on the last; its
    non-expert parameters split over tensor parallelism, its MoE experts over expert x expert-tensor parallelism.
    Biases and a learned position table are left out, as Bridge's theoretical_memory_utils leaves them: a lower bound.
    """
    m = config.model
    h = m.hidden_size
    layers = layer_parameters(m)
    final_norm = 2 * h
    embedding = h * padded_vocab
    untied = m.untie_embeddings_and_output_weights
    in_layers = sum(a + b for a, b in layers) + final_norm
    total = in_layers + (2 if untied else 1) * embedding
    # Each stage's (non-expert, expert) parameters. The final norm is counted in the even split, as Bridge's formula
    # does (it lives on the last stage: 2h parameters, nothing beside a layer's 12h^2).
    counts, stages, first = pipeline_stage_layers(m), [], 0
    for n in counts:
        own = layers[first:first + n]
        stages.append([sum(a for a, _ in own) + final_norm / len(counts), sum(b for _, b in own)])
        first += n
    stages[0][0] += embedding
    stages[-1][0] += embedding if untied or len(stages) > 1 else 0  # the output layer (a tied copy on the last stage)
    if m.mtp_num_layers:  # on the last stage: layers of the last layer's kind, each with its 2h x h projection and
        dense, expert = layers[-1]  # three norms, and (on a stage of its own) the embedding that reads the tokens ahead
        mtp = [m.mtp_num_layers * (dense + 2 * h * h + 3 * final_norm), m.mtp_num_layers * expert]
        if len(stages) > 1:
            mtp[0] += (embedding if untied else 0) + (m.max_position_embeddings * h
                                                      if m.position_embedding_type == "learned_absolute" else 0)
        stages[-1] = [stages[-1][0] + mtp[0], stages[-1][1] + mtp[1]]
        in_layers, total = in_layers + sum(mtp), total + sum(mtp)
    experts_split = m.expert_model_parallel_size * (m.expert_tensor_parallel_size or 1)
    tp = m.tensor_model_parallel_size
    return in_layers, total, [(dense / tp, expert / experts_split) for dense, expert in stages]


def weight_and_optimizer_bytes(config, stages: list, trainable: float) -> list:
    """Bytes of weights, gradients and optimizer state on one rank of each pipeline stage (`stages` from
    parameters_per_stage): bytes_per_parameter() for the `trainable` fraction of the parameters, the weight's bytes
    alone for the frozen rest (PEFT's base weights; all of them in a run that does not train)."""
    trainable_bytes, frozen = bytes_per_parameter(config)
    expert_bytes, _ = bytes_per_parameter(config, expert=True)
    return [dense * (trainable * trainable_bytes + (1 - trainable) * frozen)
            + expert * (trainable * expert_bytes + (1 - trainable) * frozen) for dense, expert in stages]


def compute_weight_and_optimizer_memory(config, verbose: bool = False) -> float:
    """Bytes of weights, gradients and optimizer state on the most loaded shard (Bridge's theoretical_memory_utils,
    the seed page): the pipeline stage with the most bytes (weight_and_optimizer_bytes of parameters_per_stage),
    frozen weights as `config.trainable_fraction` says."""
    in_layers, total, shards = parameters_per_stage(config, config.padded_vocab_size)
    share = config.trainable_fraction
    per_stage = weight_and_optimizer_bytes(config, shards, share)
    most_loaded = sum(shards[per_stage.index(max(per_stage))])
    if verbose:
        trainable, _ = bytes_per_parameter(config)
        print_rank_0(f" > number of parameters in transformer layers: {in_layers / 1e6:.2f}M, in embeddings: "
                     f"{(total - in_layers) / 1e6:.2f}M, total: {total / 1e6:.2f}M; most loaded shard: "
                     f"{most_loaded / 1e6:.2f}M, {trainable:.2f} bytes per trainable parameter"
                     + (f", {100 * share:.1f}% trainable" if share < 1 else ""))
    return max(per_stage)


def activation_bytes_per_layer(config) -> float:
    """Bytes one transformer layer keeps for its backward pass, per microbatch, on one rank: Korthikanti et al.
    2022 ("Reducing Activation Recomputation in Large Transformer Models"), Table 2, for 16-bit activations,
    generalised from 4h to the real ffn size: sbh (10 + (8 + 4 ffn/h) / t) without sequence parallelism,
    sbh (18 + 4 ffn/h) / t with it (34 sbh / t at ffn = 4h), plus 5 a s^2 b / t for the attention scores
    (softmax, dropout mask, dropout output) unless selective recomputation drops them. Context parallelism
    divides the sequence: all of it by CP (Bridge's TP x CP)."""
    m, t = config.model, config.train
    s, b, h, a = m.seq_length, t.micro_batch_size, m.hidden_size, m.num_attention_heads
    tp, cp = m.tensor_model_parallel_size, m.context_parallel_size
    ffn = m.ffn_hidden_size / h
    per_layer = s * b * h * ((18 + 4 * ffn) / tp if m.sequence_parallel else 10 + (8 + 4 * ffn) / tp)
    if m.recompute_granularity != "selective":
        per_layer += 5 * a * s * s * b / tp
    return per_layer / cp


def compute_activation_memory(config, num_microbatches, verbose: bool = False) -> float:
    """Bytes of activations on the first pipeline stage (the most loaded; Korthikanti et al. 2022, as Megatron-LM
    and Bridge). Its layers (per activation_bytes_per_layer) times the microbatches in flight: the 1F1B schedule
    holds pp of them on the first stage (fewer when there are fewer), the interleaved one a further
    1 + (pp - 1) / (pp x vp) (its penalty). Full recomputation keeps only each recomputed group's input (2sbh per
    layer or group) plus one group recomputed at a time. Plus the embedding's input and dropout mask, and with
    one stage the output layer's input, the logits and the loss."""

    m, t = config.model, config.train
    s, b, h = m.seq_length, t.micro_batch_size, m.hidden_size
    pp, tp, cp, vp = m.pipeline_model_parallel_size, m.tensor_model_parallel_size, m.context_parallel_size, \
        m.virtual_pipeline_model_parallel_size
    layer = activation_bytes_per_layer(config)
    layers = pipeline_stage_layers(m)[0]
    if m.recompute_granularity == "full":
        layer_input = 2 * s * b * h / (tp if m.sequence_parallel else 1) / cp
        n = m.recompute_num_layers
        if m.recompute_method == "uniform":  # groups of n layers: each group's input, one group recomputed
            stage = math.ceil(layers / n) * layer_input + n * layer
        else:  # block: the first n layers recomputed one by one, the others kept whole
            recomputed = min(n, layers)
            stage = recomputed * layer_input + (layers - recomputed) * layer + (layer if recomputed else 0)
    else:
        stage = layers * layer
    in_flight = pp if not num_microbatches else min(pp, num_microbatches)
    # The embedding's input ids and dropout mask; sequence parallelism splits them over TP as well (Bridge's).
    embedding = (8 * s * b + s * b * h) / cp / (tp if m.sequence_parallel else 1)
    activation = (stage + embedding) * in_flight
    if vp:
        activation *= 1 + (pp - 1) / (pp * vp)
    if pp == 1:
        activation += s * b * h * 4 * (1 + config.padded_vocab_size / h) / (tp * cp)  # output layer, logits, loss
    if verbose:
        print_rank_0(f" > activation memory per transformer layer: {layer / NUM_BYTES_IN_MEGABYTE:.1f} MB, "
                     f"{in_flight} microbatches in flight" + (f", interleaving penalty {1 + (pp - 1) / (pp * vp):.2f}"
                                                                 if vp else ""))
    return activation


def activation_floor(config, padded_vocab: int) -> float:
    """Bytes of activations a rank surely holds, whatever its attention kernel, recomputation and schedule: one
    microbatch's fp32 logits (its vocabulary share) and, per layer of its stage, 2h values a token. Far below
    compute_activation_memory, which assumes what a kernel keeps: checks.py's fit check refuses only what cannot fit."""
    m, t = config.model, config.train
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    return (m.seq_length // cp) * t.micro_batch_size * (padded_vocab // tp + 2 * m.hidden_size * m.num_layers // pp) * 4


def report_theoretical_memory(config, num_microbatches=None, verbose: bool = False) -> None:
    """Print the estimates in MB (2^20 bytes). Activations assume 16-bit tensors: on a
    CPU, in fp32, the measured figure is about twice the estimate for the same layers."""
    weights = compute_weight_and_optimizer_memory(config, verbose) / NUM_BYTES_IN_MEGABYTE
    activation = compute_activation_memory(config, num_microbatches, verbose) / NUM_BYTES_IN_MEGABYTE
    print_rank_0(f"Theoretical memory footprints: weight and optimizer={weights:.2f} MB, "
                 f"activation={activation:.2f} MB, total={weights + activation:.2f} MB")


# --------------------------------------------------------------------------------------------------
# Progress log: SAVE/progress.txt, one line per job start and per saved checkpoint
# --------------------------------------------------------------------------------------------------


def append_to_progress_log(save: str, line: str, world_size: int) -> None:
    """The progress.txt line: time, job id, number of devices, then the message."""

    if not is_rank_0():
        return
    job_id = os.environ.get("SLURM_JOB_ID", "local")
    os.makedirs(save, exist_ok=True)
    with open(os.path.join(save, "progress.txt"), "a") as fh:
        fh.write(f"{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}\tJob ID: {job_id}\t# GPUs: {world_size}\t{line}\n")


def get_start_time_from_progress_log(cfg):
    """(start time of the earliest job of this world size still running on, FLOPs done before it):
    A line with another world size restarts the search."""

    start_time, start_flops, latest_flops = None, None, 0.0
    with open(os.path.join(cfg.checkpoint.save, "progress.txt")) as fh:
        for line in fh:
            tokens = line.rstrip("\n").split("\t")
            world = int(tokens[2].split(": ")[1])
            if tokens[3] == "Saved checkpoint":
                latest_flops = float(tokens[7].split(": ")[1])
            if world != cfg.world_size:
                start_time, start_flops = None, None
                continue
            if tokens[3] == "Starting job" and start_time is None:
                start_time, start_flops = tokens[0], latest_flops
    if start_time is None:
        raise ValueError(f"{cfg.checkpoint.save}/progress.txt has no 'Starting job' line for world size {cfg.world_size}")
    return datetime.strptime(start_time, "%Y-%m-%d %H:%M:%S"), start_flops


def compute_throughputs_and_append_to_progress_log(state, num_floating_point_operations_so_far: float) -> None:
    """Append a `Saved checkpoint` line: job throughput (FLOPs since this job started / its time),
    cumulative throughput (since the first job of this world size), total FLOPs and tokens."""
    cfg, ts = state.cfg, state.train_state
    job_seconds = time.time() - state.start_time
    job = (num_floating_point_operations_so_far - state.start_floating_point_operations) / (
        max(job_seconds, 1e-9) * 10**12 * cfg.world_size)
    try:
        start_time, start_flops = get_start_time_from_progress_log(cfg)
    except (FileNotFoundError, ValueError):  # no job start logged (setup logs it; a loop of one's own may not): this job
        start_time, start_flops = datetime.fromtimestamp(state.start_time), state.start_floating_point_operations
    elapsed = max((datetime.now() - start_time).total_seconds(), 1e-9)
    cumulative = (num_floating_point_operations_so_far - start_flops) / (elapsed * 10**12 * cfg.world_size)
    tokens = ts.consumed_train_samples * cfg.model.seq_length
    append_to_progress_log(cfg.checkpoint.save,
                           f"Saved checkpoint\tIteration: {ts.step}\tJob throughput: {job:.1f} TFLOP/s/GPU\t"
                           f"Cumulative throughput: {cumulative:.1f} TFLOP/s/GPU\t"
                           f"Floating-point operations: {num_floating_point_operations_so_far:.2e}\t"
                           f"Tokens (in billions): {tokens / 10**9:.2f}", cfg.world_size)


# --------------------------------------------------------------------------------------------------
# Straggler report (--log-straggler)
# --------------------------------------------------------------------------------------------------


class StragglerTimer:
    """Times this rank's training forward steps; every --log-interval, `report` gathers every rank's time so that
    rank 0 can name the slowest and fastest ranks (--log-straggler; megatron-core's StragglerDetector,
    which is CUDA-only, times the same thing: the batch fetch and the forward pass).

    Why not the whole iteration: data-parallel ranks meet at the gradient all-reduce, so one slow rank makes every
    rank's iteration slow. Its own data loading and forward compute, before any collective, tell it apart. On a GPU
    a call counts as the larger of its wall-clock time and its CUDA-event time, as in StragglerDetector.
    """

    def __init__(self, enabled: bool):
        self.enabled, self.use_gpu = enabled, device.cuda()
        self.seconds, self.reported_at = 0.0, 0
        self._events = []  # (start event, stop event, wall seconds) of GPU calls, read at the next report

    def wrap(self, forward_step_func, iteration: int):
        """forward_step_func, timed from `iteration` on. Evaluation runs under no_grad and is not timed: it is not a
        training step."""
        self.reported_at = iteration
        if not self.enabled:
            return forward_step_func

        def timed_forward_step(data_iterator, model, *args, **kwargs):
            if not torch.is_grad_enabled():
                return forward_step_func(data_iterator, model, *args, **kwargs)
            start = time.perf_counter()
            if self.use_gpu:
                events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                events[0].record()
            result = forward_step_func(data_iterator, model, *args, **kwargs)
            if self.use_gpu:
                events[1].record()
                self._events.append((*events, time.perf_counter() - start))
            else:
                self.seconds += time.perf_counter() - start
            return result

        return timed_forward_step

    def report(self, total_flops: float, iteration: int, minmax_count: int) -> list:
        """A collective over all ranks (every rank calls it) at `iteration`. Returns rank 0's report lines (empty
        elsewhere) and starts a new interval. `total_flops`: model FLOPs of the iterations since the last report."""
        if self._events:
            torch.cuda.synchronize()
            self.seconds += sum(max(a.elapsed_time(b) / 1000, wall) for a, b, wall in self._events)
        iterations, self.reported_at = iteration - self.reported_at, iteration
        ms = self.seconds * 1000 / iterations if iterations else 0.0
        flops_per_iteration = total_flops / iterations if iterations else 0.0
        self.seconds, self._events = 0.0, []
        mine = torch.tensor([ms], dtype=torch.float64, device=device.current())
        gathered = [torch.zeros_like(mine) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(gathered, mine)
        if torch.distributed.get_rank() != 0:
            return []
        return straggler_report([t.item() for t in gathered], flops_per_iteration, minmax_count)


def straggler_report(ms_per_rank: list, flops_per_iteration: float, minmax_count: int = 1) -> list:
    """Rank 0's report, in StragglerDetector.report's keys: MnRtt/MxRtt, the shortest and longest forward-step time
    per iteration with its rank; MnEtpt/MxEtpt, the estimated TFLOP/s per rank (the forward pass is a third of the
    model FLOPs, so FLOPs / 3 / world / time); with a minmax count above 1, the slowest and fastest ranks listed."""
    world = len(ms_per_rank)
    by_time = sorted(range(world), key=lambda r: ms_per_rank[r])  # fastest first
    fastest, slowest = by_time[0], by_time[-1]

    def tflops(rank):
        ms = ms_per_rank[rank]
        return flops_per_iteration / 3 / world / (ms / 1000) / 10**12 if ms > 0 else 0.0

    now = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    lines = [f" [{now}] | MnRtt/Rnk: {ms_per_rank[fastest]:.2f}ms/{fastest} | MxRtt/Rnk: {ms_per_rank[slowest]:.2f}ms/"
             f"{slowest} | MnEtpt/Rnk: {tflops(slowest):.2f}TF/{slowest} | MxEtpt/Rnk: {tflops(fastest):.2f}TF/{fastest} |"]
    if 1 < minmax_count < world:
        n = minmax_count
        lines.append(f" ^^^^ Slowest {n} ranks, forward ms/rank: "
                     + ", ".join(f"{ms_per_rank[r]:.2f}/{r}" for r in reversed(by_time[-n:])))
        lines.append(f" ^^^^ Fastest {n} ranks, forward ms/rank: "
                     + ", ".join(f"{ms_per_rank[r]:.2f}/{r}" for r in by_time[:n]))
    return lines
