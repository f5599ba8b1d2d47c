"""config.py: every setting of a run, one dataclass per concern, and the command line made from them.

The shape follows Megatron Bridge's `ConfigContainer` (train, model, optimizer, scheduler, dataset,
logger, checkpoint, dist, rng, ...); the flag names and meanings follow Megatron-LM's `arguments.py`,
so `--num-layers 24 --micro-batch-size 4 ...` means here what it means there.

Each field is declared with `arg(default, help)`: the help text is the field's documentation and
its `--help` line, and the flag is the field name in kebab-case unless `flag=` says otherwise.

The module reads top to bottom as a setting's life: declared (one dataclass per concern), parsed (the
command line generated from the declarations), derived (`derive`: every fill-in and rewrite, each one
named in the printed config), checked (`check`: `require(condition, message)`, changing nothing), and
printed. The settings with no machinery here (NVIDIA services, Bridge's thin sections, Megatron-LM flags
that are inert or refused) sit at the end of the declarations and at the end of the module.

This module imports neither torch nor megatron-core: `--help` and every validation error answer
in about a second, before any expensive import or work.
"""

from __future__ import annotations

import abc
import argparse
import ast
import copy
import dataclasses
import enum
import functools
import glob
import importlib
import importlib.util
import math
import os
import signal
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_lm_flags import MEGATRON_LM_INERT_FLAGS, unsupported_flag
import schedules  # the learning-rate schedules of your own: their names are --lr-decay-style choices

# megatron-core 0.19.2 ships for Python 3.12 and 3.13 only (requirements.txt skips it on older Pythons, so that the
# install succeeds and this line, not pip's resolver, says what is missing). Every entry point imports this module
# first.
if sys.version_info < (3, 12):
    sys.exit(f"error: Python {sys.version_info[0]}.{sys.version_info[1]} is too old: megatron-core 0.19.2 needs "
             f"Python 3.12 or 3.13; make the environment with `python3.12 -m venv .venv` and install again")


import device  # noqa: E402,F401  first: it quiets megatron-core's import-time notices of its CPU fallbacks
from megatron.training import config as mcore_training  # noqa: E402  megatron-core's training sections: Bridge's bases
from megatron.training.argument_utils import ArgumentGroupFactory, TypeInferenceError  # noqa: E402
from megatron.core import distributed as mcore_distributed, optimizer as mcore_optimizer  # noqa: E402
from megatron.core.datasets import gpt_dataset as mcore_gpt_dataset  # noqa: E402
from megatron.core.datasets.utils import get_blend_from_list  # noqa: E402
from megatron.core.transformer import MLATransformerConfig, TransformerConfig  # noqa: E402
from megatron.core.transformer.enums import AttnBackend  # noqa: E402

MCORE_BASES = (mcore_training.TrainingConfig, mcore_training.ValidationConfig, mcore_training.SchedulerConfig,
               mcore_training.LoggerConfig, mcore_training.CheckpointConfig, mcore_training.DistributedInitConfig,
               mcore_training.RNGConfig, mcore_training.ProfilingConfig, mcore_training.StragglerDetectionConfig,
               mcore_training.RerunStateMachineConfig, mcore_training.TokenizerConfig, mcore_optimizer.OptimizerConfig,
               mcore_distributed.DistributedDataParallelConfig, mcore_gpt_dataset.GPTDatasetConfig, TransformerConfig)


class ConfigError(ValueError):
    """An impossible or inconsistent setting. The message is one line saying what and how to fix it."""


def arg(default: Any, help: str, *, flag: Optional[str] = None, choices=None, cli: bool = True, derived: bool = False,
        bounds: Optional[str] = None, off: Optional[str] = None):
    """A config field: its default, its documentation (= its `--help`), and how it appears on the CLI.

    For a bool that defaults to True, `flag` names the Megatron-LM switch that turns it off
    (e.g. `--no-save-optim`); `cli=False` marks a setting that Megatron-LM has no flag for (YAML only);
    `derived=True` a value computed during validation (not settable from the command line);
    `bounds` the interval a number must lie in, as torch or megatron-core would demand it, e.g. "[0, 1)"
    (checked first by validate(), so an out-of-range value is a one-line error before torch loads);
    `off` a second flag that sets an optional setting with a default to None (e.g. `--no-save`).
    """
    meta = dict(help=help, flag=flag, choices=choices, cli=cli and not derived, derived=derived, bounds=bounds, off=off)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


# Megatron-LM's --optimizer choices of its emerging optimizers (arguments.py, core_v0.19.0), built by megatron-core's
# own path (optimizer/emerging_optimizers.py) from the `emerging-optimizers` package. dist_muon is Megatron-LM's
# deprecated name for muon with --use-distributed-optimizer (megatron-core's layer-wise distributed optimizer).
MEGATRON_LM_EMERGING_OPTIMIZERS = ["muon", "dist_muon", "lion", "soap", "adaptive_muon"]

# Megatron-LM's --tokenizer-type choices with no tokenizer here: accepted by the parser, refused by validation.
MEGATRON_LM_TOKENIZERS = ["GPT2BPETokenizer", "BertWordPieceLowerCase", "BertWordPieceCase", "SentencePieceTokenizer",
                          "GPTSentencePieceTokenizer", "Llama2Tokenizer", "TikTokenizer", "MultimodalTokenizer",
                          "NullMultimodalTokenizer", "SFTTokenizer"]


# megatron-core's fields this trainer acts on, by section, each with a flag generated from megatron-core's dataclass:
# its name, type, default and docstring, by megatron-core's own ArgumentGroupFactory, as Megatron-LM 0.19's
# arguments.py makes its flags. Every other field of megatron-core's classes keeps its default (check_mcore_fields
# refuses a YAML that sets one; their Megatron-LM flags are megatron_lm_flags.py's).
MCORE_FLAGS = {
    "train": "micro_batch_size global_batch_size rampup_batch_size train_iters train_samples exit_interval "
             "exit_duration_in_mins exit_signal_handler exit_signal iterations_to_skip manual_gc manual_gc_interval "
             "manual_gc_eval empty_unused_memory_level",
    "validation": "eval_iters eval_interval skip_train",
    "scheduler": "lr_decay_style lr_decay_iters lr_decay_samples lr_warmup_iters lr_warmup_samples lr_warmup_fraction "
                 "lr_warmup_init lr_wsd_decay_style lr_wsd_decay_iters lr_wsd_decay_samples start_weight_decay "
                 "end_weight_decay weight_decay_incr_style override_opt_param_scheduler use_checkpoint_opt_param_scheduler",
    "logger": "log_interval tensorboard_dir tensorboard_log_interval log_throughput log_params_norm log_num_zeros_in_grad "
              "log_memory_to_tensorboard log_timers_to_tensorboard log_runtime_to_tensorboard throughput_window_size "
              "log_validation_ppl_to_tensorboard timing_log_level logging_level wandb_project wandb_exp_name "
              "wandb_save_dir wandb_entity",
    "checkpoint": "save load save_interval save_optim save_rng load_optim load_rng finetune pretrained_checkpoint "
                  "ckpt_step most_recent_k ckpt_format dist_ckpt_optim_fully_reshardable async_save async_strategy",
    "dist": "distributed_backend distributed_timeout_minutes",
    "rng": "seed",
    "profiling": "use_nsys_profiler use_pytorch_profiler profile_step_start profile_step_end profile_ranks "
                 "pytorch_profiler_collect_shapes pytorch_profiler_collect_callstack record_shapes "
                 "record_memory_history memory_snapshot_path nvtx_ranges",
    "straggler": "log_straggler straggler_minmax_count",
    "rerun_state_machine": "error_injection_rate error_injection_type check_for_spiky_loss",
    "tokenizer": "tokenizer_type vocab_size tokenizer_model vocab_file merge_file tokenizer_hf_no_include_special_tokens "
                 "tiktoken_pattern",
    "optimizer": "optimizer lr min_lr decoupled_lr decoupled_min_lr weight_decay adam_beta1 adam_beta2 adam_eps "
                 "sgd_momentum clip_grad use_distributed_optimizer loss_scale initial_loss_scale min_loss_scale "
                 "loss_scale_window hysteresis muon_momentum muon_split_qkv muon_nesterov muon_scale_mode "
                 "muon_fp32_matmul_prec muon_coefficient_type muon_num_ns_steps muon_tp_mode muon_extra_scale_factor "
                 "muon_scalar_optimizer lion_beta1 lion_beta2",
    "model": "num_layers hidden_size ffn_hidden_size num_attention_heads num_query_groups kv_channels hidden_dropout "
             "attention_dropout init_method_std rotary_base rotary_percent normalization layernorm_epsilon "
             "add_bias_linear transformer_impl attention_backend tensor_model_parallel_size "
             "pipeline_model_parallel_size num_layers_in_first_pipeline_stage num_layers_in_last_pipeline_stage "
             "overlap_p2p_comm overlap_p2p_comm_warmup_flush context_parallel_size sequence_parallel bf16 fp16 "
             "recompute_granularity recompute_method recompute_num_layers deterministic_mode cross_entropy_loss_fusion "
             "cp_comm_type hierarchical_context_parallel_sizes use_cpu_initialization calculate_per_token_loss "
             "layernorm_zero_centered_gamma add_qkv_bias qk_layernorm qk_l2_norm attention_softmax_in_fp32 "
             "apply_query_key_layer_scaling fp32_residual_connection glu_linear_offset activation_func_clamp_value "
             "rotary_interleaved no_rope_freq rope_type multi_latent_attention q_lora_rank kv_lora_rank qk_head_dim "
             "qk_pos_emb_head_dim v_head_dim rotary_scaling_factor mscale mscale_all_dim mtp_num_layers "
             "mtp_loss_scaling_factor embedding_init_method_std perform_initialization window_size "
             "window_attn_skip_freq softmax_type attention_output_gate disable_bf16_reduced_precision_matmul fp8 "
             "fp8_recipe fp8_margin fp8_amax_history_len fp8_amax_compute_algo num_moe_experts moe_layer_freq "
             "moe_ffn_hidden_size moe_router_topk moe_router_load_balancing_type moe_aux_loss_coeff moe_z_loss_coeff "
             "moe_router_score_function moe_router_enable_expert_bias moe_router_bias_update_rate "
             "moe_router_pre_softmax moe_router_topk_scaling_factor moe_router_num_groups moe_router_group_topk "
             "moe_router_dtype moe_input_jitter_eps moe_token_dispatcher_type moe_expert_capacity_factor "
             "moe_pad_expert_input_to_capacity moe_token_drop_policy moe_shared_expert_intermediate_size "
             "moe_shared_expert_overlap moe_per_layer_logging moe_grouped_gemm moe_permute_fusion moe_router_fusion "
             "expert_model_parallel_size expert_tensor_parallel_size",
    "ddp": "overlap_grad_reduce overlap_param_gather bucket_size pad_buckets_for_high_nccl_busbw average_in_collective "
           "check_for_large_grads num_distributed_optimizer_instances param_name_patterns_for_fp32_local_accumulation",
    "dataset": "split path_to_cache mock reset_position_ids reset_attention_mask eod_mask_loss mmap_bin_files "
               "create_attention_mask",
}
# megatron-core's fields this trainer acts on without a flag (Megatron-LM has none either): YAML only.
MCORE_YAML_ONLY = {"rerun_state_machine": "check_for_nan_in_loss",
                   # derived by validate() from the other settings (the distributed optimizer's, the NaN check's)
                   "ddp": "use_distributed_optimizer grad_reduce_in_fp32 check_for_nan_in_grad",
                   "validation": "eval_global_batch_size eval_micro_batch_size",
                   "scheduler": "lr_decay_steps lr_warmup_steps wd_incr_steps wsd_decay_steps",  # in samples
                   "dataset": "blend blend_per_split random_seed sequence_length",  # paths, --seed, --seq-length
                   "dist": "local_rank",  # megatron-core's default reads $LOCAL_RANK, which differs between ranks
                   # derived by validate(): the virtual stages and the p2p mode (the model section's finalize() sets
                   # the fields megatron-core takes as objects: the activation, the dtypes, the initialisation)
                   "model": "virtual_pipeline_model_parallel_size batch_p2p_comm"}
# Where this trainer's flag for a megatron-core field differs from the generated one, and why. `bounds`: the interval
# a number must lie in (validate checks it first); `off`: a second flag that unsets the setting.
MCORE_FLAG_CHANGES = {
    "scheduler.lr_decay_style": dict(choices=["constant", "linear", "cosine", "inverse-square-root", "WSD",
                                              *schedules.LR_SCHEDULES]),  # schedules of your own (schedules.py)
    "scheduler.lr_warmup_init": dict(bounds="[0, inf)"),
    "checkpoint.ckpt_format": dict(choices=["torch", "torch_dist"]),  # the two formats this trainer writes
    "checkpoint.save": dict(off="--no-save"),  # the default saves (DEFAULTS): --no-save saves nothing
    "logger.tensorboard_dir": dict(off="--no-tensorboard"),
    # Fractions of a minute, where Megatron-LM takes whole ones: a hung rank's test, a short run's deadline.
    "dist.distributed_timeout_minutes": dict(type=float, bounds="(0, inf)"),
    "train.exit_duration_in_mins": dict(type=float, bounds="(0, inf)"),
    # A signal's name (SIGTERM), made a signal.Signals by validate; megatron-core's enum parser raises a KeyError
    # (a traceback) on a wrong name.
    "train.exit_signal": dict(type=str, choices=None),
    "rng.seed": dict(bounds="[0, 2147483647]"),  # numpy refuses negative seeds and seeds from 2**32
    "train.rampup_batch_size": dict(nargs="+"),  # any count, so that check_rampup's one line names the three numbers
    # This trainer's ByteTokenizer beside megatron-core's HuggingFace and Null ones; Megatron-LM's other types are
    # accepted and refused with what to use instead (check_tokenizer).
    "tokenizer.tokenizer_type": dict(choices=["ByteTokenizer", "NullTokenizer", "HuggingFaceTokenizer",
                                              *MEGATRON_LM_TOKENIZERS]),
    # Megatron-LM's choices and names (arguments.py, core_v0.19.0), where megatron-core's field is a plain str or its
    # name is not the flag's; the bounds are what torch's optimizers assert.
    "optimizer.optimizer": dict(choices=["adam", "sgd", "signsgd", *MEGATRON_LM_EMERGING_OPTIMIZERS]),
    "optimizer.weight_decay": dict(bounds="[0, inf)"),
    "optimizer.adam_beta1": dict(bounds="[0, 1)"),
    "optimizer.adam_beta2": dict(bounds="[0, 1)"),
    "optimizer.adam_eps": dict(bounds="[0, inf)"),
    "optimizer.sgd_momentum": dict(bounds="[0, inf)"),
    "optimizer.decoupled_lr": dict(bounds="(0, inf)"),
    "optimizer.decoupled_min_lr": dict(bounds="[0, inf)"),
    "optimizer.muon_momentum": dict(bounds="[0, 1)"),
    "optimizer.muon_split_qkv": dict(flags=["--muon-no-split-qkv"]),
    "optimizer.muon_scale_mode": dict(choices=["spectral", "unit_rms_norm", "shape_scaling"]),
    "optimizer.muon_fp32_matmul_prec": dict(choices=["low", "medium", "high"]),
    "optimizer.muon_coefficient_type": dict(choices=["simple", "quintic", "polar_express", "cans", "aol", "deepseekv4"]),
    "optimizer.muon_num_ns_steps": dict(bounds="(0, inf)"),
    "optimizer.muon_tp_mode": dict(choices=["blockwise", "duplicated", "distributed"]),
    "optimizer.muon_scalar_optimizer": dict(choices=["adam", "lion"]),
    "optimizer.lion_beta1": dict(bounds="[0, 1)"),
    "optimizer.lion_beta2": dict(bounds="[0, 1)"),
    # The model: Megatron-LM's spellings, choices and types (arguments.py, core_v0.19.0) where the dataclass's differ,
    # the intervals megatron-core or torch demand; per-layer patterns and lists are read as Megatron-LM writes them and
    # made megatron-core's types by derive_transformer_config.
    "model.ffn_hidden_size": dict(bounds="(0, inf)"),
    "model.kv_channels": dict(bounds="(0, inf)"),
    "model.init_method_std": dict(bounds="[0, inf)"),
    "model.rotary_base": dict(type=int, bounds="(0, inf)"),
    "model.rotary_percent": dict(bounds="(0, 1]"),
    "model.normalization": dict(choices=["LayerNorm", "RMSNorm"]),
    "model.layernorm_epsilon": dict(bounds="[0, inf)"),
    "model.transformer_impl": dict(choices=["local", "transformer_engine"]),
    "model.attention_backend": dict(type=str, choices=[b.name for b in AttnBackend]),
    "model.num_layers_in_first_pipeline_stage": dict(flags=["--decoder-first-pipeline-num-layers"], bounds="[0, inf)"),
    "model.num_layers_in_last_pipeline_stage": dict(flags=["--decoder-last-pipeline-num-layers"], bounds="[0, inf)"),
    "model.overlap_p2p_comm": dict(flags=["--no-overlap-p2p-communication"]),
    "model.overlap_p2p_comm_warmup_flush": dict(flags=["--overlap-p2p-communication-warmup-flush"]),
    "model.recompute_num_layers": dict(bounds="(0, inf)"),
    "model.cp_comm_type": dict(type=str, nargs="+"),
    "model.activation_func_clamp_value": dict(bounds="(0, inf)"),
    "model.no_rope_freq": dict(type=str),
    "model.rope_type": dict(choices=["rope", "yarn"]),
    # switches whose default here (DEFAULTS) is the dataclass's opposite: Megatron-LM's switch on
    "model.attention_softmax_in_fp32": dict(flags=["--attention-softmax-in-fp32"]),
    "model.multi_latent_attention": dict(flags=["--multi-latent-attention"]),
    "model.q_lora_rank": dict(bounds="[1, inf)"),
    "model.kv_lora_rank": dict(bounds="[1, inf)"),
    "model.qk_head_dim": dict(bounds="[1, inf)"),
    "model.qk_pos_emb_head_dim": dict(bounds="[2, inf)"),
    "model.v_head_dim": dict(bounds="[1, inf)"),
    "model.rotary_scaling_factor": dict(bounds="(0, inf)"),
    "model.mtp_num_layers": dict(bounds="[1, inf)"),
    "model.mtp_loss_scaling_factor": dict(bounds="[0, inf)"),
    "model.embedding_init_method_std": dict(bounds="[0, inf)"),
    "model.window_size": dict(type=str),
    "model.window_attn_skip_freq": dict(type=str),
    "model.softmax_type": dict(choices=["vanilla", "off-by-one", "learnable"]),
    "model.fp8_recipe": dict(choices=["delayed", "tensorwise", "mxfp8", "blockwise", "custom"]),
    "model.fp8_amax_compute_algo": dict(choices=["most_recent", "max"]),
    "model.num_moe_experts": dict(flags=["--num-experts"]),
    "model.moe_layer_freq": dict(type=str),
    "model.moe_ffn_hidden_size": dict(bounds="(0, inf)"),
    "model.moe_router_topk": dict(bounds="(0, inf)"),
    "model.moe_router_load_balancing_type": dict(type=str, nargs="+"),
    "model.moe_aux_loss_coeff": dict(type=float, nargs="+"),
    "model.moe_z_loss_coeff": dict(bounds="[0, inf)"),
    "model.moe_router_score_function": dict(choices=["softmax", "sigmoid"]),
    "model.moe_router_bias_update_rate": dict(bounds="[0, inf)"),
    "model.moe_router_topk_scaling_factor": dict(bounds="(0, inf)"),
    "model.moe_router_num_groups": dict(bounds="(0, inf)"),
    "model.moe_router_group_topk": dict(bounds="(0, inf)"),
    "model.moe_input_jitter_eps": dict(bounds="[0, inf)"),
    "model.moe_token_dispatcher_type": dict(choices=["allgather", "alltoall", "flex"]),
    "model.moe_expert_capacity_factor": dict(bounds="(0, inf)"),
    "model.moe_token_drop_policy": dict(choices=["probs", "position"]),
    "model.moe_shared_expert_intermediate_size": dict(bounds="(0, inf)"),
    "ddp.bucket_size": dict(flags=["--ddp-bucket-size"], bounds="(0, inf)"),
    "ddp.pad_buckets_for_high_nccl_busbw": dict(flags=["--ddp-pad-buckets-for-high-nccl-busbw"]),
    "ddp.average_in_collective": dict(flags=["--ddp-average-in-collective"]),
    "ddp.param_name_patterns_for_fp32_local_accumulation": dict(
        flags=["--ddp-param-name-patterns-for-fp32-local-accumulation"], type=str, nargs="+"),
    "dataset.path_to_cache": dict(flags=["--data-cache-path"]),
    "dataset.mock": dict(flags=["--mock-data"], help="Train on megatron-core's synthetic MockGPTDataset."),
    "dataset.create_attention_mask": dict(flags=["--no-create-attention-mask-in-dataloader"]),
    # megatron-core's None defaults would make them --no-* switches
    **{f"dataset.{name}": dict(flags=["--" + name.replace("_", "-")])
       for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")},
}
# This trainer's defaults where they differ from megatron-core's dataclass, on purpose, each with its reason.
DEFAULTS = {
    "model.num_layers": (4, "megatron-core has none (Megatron-LM asks for it); a model a laptop trains in minutes"),
    "model.hidden_size": (256, "megatron-core has none (Megatron-LM asks for it); a model a laptop trains"),
    "model.num_attention_heads": (4, "megatron-core has none (Megatron-LM asks for it); 64-wide heads"),
    "model.normalization": ("LayerNorm", "Megatron-LM's default (MLATransformerConfig's is RMSNorm)"),
    "model.transformer_impl": (None, "derived from the machine: transformer_engine with a GPU and it installed, else "
                                     "megatron-core's local layers"),
    "model.overlap_p2p_comm": (True, "Megatron-LM's default (with virtual stages; derived off without them)"),
    "model.attention_softmax_in_fp32": (False, "Megatron-LM's default (a store_true flag); megatron-core's is on"),
    "model.rope_type": (None, "Megatron-LM's default: derived, yarn under --multi-latent-attention, else rope"),
    "model.multi_latent_attention": (False, "a plain GPT (MLATransformerConfig's default is MLA)"),
    "model.q_lora_rank": (None, "Megatron-LM's default: the queries are one full projection"),
    "model.kv_lora_rank": (32, "Megatron-LM's default (MLATransformerConfig's is 512)"),
    "model.rotary_scaling_factor": (1.0, "Megatron-LM's default (MLATransformerConfig's is 40)"),
    "model.moe_router_load_balancing_type": (["aux_loss"], "Megatron-LM's: a list, one type per coefficient "
                                                            "(finalize() gives megatron-core a list of one as its item)"),
    "model.moe_aux_loss_coeff": ([0.0], "Megatron-LM's: a list, one coefficient per load-balancing type"),
    "model.rotary_base": (10000, "Megatron-LM's integer default (MLATransformerConfig's float)"),
    "train.micro_batch_size": (4, "megatron-core has none (Megatron-LM asks for it); a batch a laptop trains"),
    "validation.eval_iters": (10, "a short evaluation of the small models this trainer runs first (Megatron-LM: 100)"),
    "validation.eval_interval": (100, "an evaluation within the quick start's 300 iterations (Megatron-LM: 1000)"),
    "logger.log_interval": (10, "a log line every few seconds for a small model (Megatron-LM: 100)"),
    "logger.tensorboard_dir": ("runs", "TensorBoard files by default, git-ignored (`tensorboard --logdir runs`)"),
    "checkpoint.save": ("checkpoints", "a run leaves a checkpoint by default; generate.py reads it by default"),
    "dist.distributed_backend": (None, "derived from the machine: nccl with a GPU, gloo without"),
    "tokenizer.tokenizer_type": ("ByteTokenizer", "UTF-8 bytes: a model trains on any text with no tokenizer file"),
    "optimizer.lr": (1e-3, "megatron-core has none (Megatron-LM asks for it); AdamW's customary rate"),
    "optimizer.min_lr": (0.0, "Megatron-LM's default; megatron-core has none"),
    "optimizer.muon_momentum": (0.9, "Megatron-LM's default (arguments.py, core_v0.19.0); megatron-core's is 0.95"),
    "ddp.grad_reduce_in_fp32": (None, "derived from the precision, as Megatron-LM: fp32 with --bf16, else the "
                                      "parameters' dtype"),
    "dataset.split": ("969,30,1", "Megatron-LM's when --data-path comes without --split (arguments.py validate_args)"),
    "dataset.reset_position_ids": (False, "Megatron-LM's; megatron-core's None must be set"),
    "dataset.reset_attention_mask": (False, "Megatron-LM's; megatron-core's None must be set"),
    "dataset.eod_mask_loss": (False, "Megatron-LM's; megatron-core's None must be set"),
}


def settings_of(section: str, sub) -> list:
    """The fields of a section that are settings of this trainer: its own, and megatron-core's that it acts on (with
    the ones validate() derives)."""
    acted_on = set(_names(MCORE_FLAGS, section) + _names(MCORE_YAML_ONLY, section))
    return [f.name for f in dataclasses.fields(sub) if "help" in f.metadata or f.name in acted_on
            or not isinstance(sub, MCORE_BASES)]


def flag_of(section: str, f) -> str:
    """A field's (first) flag, the field given by itself or by name: arg()'s, MCORE_FLAG_CHANGES', megatron-core's
    own (argparse_meta), or its name's."""
    if isinstance(f, str):
        f = next(x for x in dataclasses.fields(type(getattr(ConfigContainer(), section))) if x.name == f)
    changed = MCORE_FLAG_CHANGES.get(f"{section}.{f.name}", {}).get("flags")
    names = f.metadata.get("argparse_meta", {}).get("arg_names")
    return f.metadata.get("flag") or (changed or names or ["--" + f.name.replace("_", "-")])[0]


def section_default(cls, section: str):
    """A section's defaults: its class's, with DEFAULTS applied."""
    return cls(**{k.split(".")[1]: v for k, (v, _) in DEFAULTS.items() if k.split(".")[0] == section})


def _names(table: dict, section: str) -> list:
    return table.get(section, "").split()



# --------------------------------------------------------------------------------------------------
# One dataclass per concern
# --------------------------------------------------------------------------------------------------


def backend(value) -> AttnBackend:
    """--attention-backend's value (a name from a flag or YAML) as megatron-core's AttnBackend."""
    return AttnBackend[value] if isinstance(value, str) else value


@dataclass
class GPTModelProvider(MLATransformerConfig):
    """The model section: megatron-core's TransformerConfig itself, which model.py hands megatron-core as it is, with
    the GPT's own settings beside it, as Bridge's GPTModelProvider. Its base is MLATransformerConfig, the
    TransformerConfig that also holds multi-latent attention's sizes, so that one section holds every model setting
    (off by default: a plain GPT). megatron-core's post-init (its checks and derived fields) is deferred to
    finalize(), run once validation has derived the rest, as Bridge's `finalize()`."""

    def __post_init__(self) -> None:
        pass  # deferred: see finalize()

    def finalize(self) -> None:
        """What megatron-core's fields take from this trainer's settings, as Megatron-LM's
        core_transformer_config_from_args: the MLP's activation, the dtypes, the initialisation, the per-layer
        patterns and lists as megatron-core types them; then megatron-core's checks and derived fields,
        MLATransformerConfig's with --multi-latent-attention, else TransformerConfig's (MLATransformerConfig's own
        refuse what only MLA has). Once, when the model is built (model.transformer_config): validation tries it on a
        copy (check_transformer_config), so that the settings stay as given until then."""
        if getattr(self, "finalized", False):  # set below: an attribute, not a setting (run_config.yaml has none)
            return
        import torch
        import torch.nn.functional as F
        from megatron.core.activations import squared_relu
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        self.gated_linear_unit = self.swiglu or self.quick_geglu
        self.activation_func = (F.silu if self.swiglu else squared_relu if self.squared_relu else quick_gelu if
                                self.quick_geglu else functools.partial(F.gelu, approximate="tanh") if self.openai_gelu
                                else F.gelu)
        # Half-precision weights under Float16Module; the optimizer keeps fp32 main copies.
        self.params_dtype = self.pipeline_dtype = (torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else
                                                   torch.float32)
        if self.init_method_xavier_uniform:  # Megatron-LM's init_method and scaled_init_method
            self.init_method = self.output_layer_init_method = torch.nn.init.xavier_uniform_
        # Without CUDA each full weight is built on the CPU and each tensor-parallel rank takes its slice: the same
        # weights for any TP size. On a GPU each rank initialises its slice in place from the RNG tracker.
        self.use_cpu_initialization = self.use_cpu_initialization or not device.cuda()
        # Megatron-LM passes a list of one as its item (a load-balancing type, a coefficient, a CP communication)
        one = lambda values: values[0] if isinstance(values, list) and len(values) == 1 else values  # noqa: E731
        self.cp_comm_type = one(self.cp_comm_type)
        self.moe_router_load_balancing_type = one(self.moe_router_load_balancing_type)
        self.moe_aux_loss_coeff = one(self.moe_aux_loss_coeff)
        for name in ("moe_layer_freq", "no_rope_freq", "window_attn_skip_freq"):
            if getattr(self, name) is not None:
                setattr(self, name, layer_pattern(getattr(self, name), flag_of("model", name), self.num_layers))
        if self.window_size is not None:
            self.window_size = parse_window_size(self.window_size)
        self.attention_backend = backend(self.attention_backend)
        (MLATransformerConfig if self.multi_latent_attention else TransformerConfig).__post_init__(self)
        self.finalized = True

    seq_length: int = arg(256, "Sequence length of a training sample, in tokens.")
    max_position_embeddings: Optional[int] = arg(
        None, "Size of the learned position-embedding table. Default: --seq-length.")
    make_vocab_size_divisible_by: int = arg(
        128, "Pad the vocabulary to a multiple of this times the tensor-parallel size (fast matmuls).")
    untie_embeddings_and_output_weights: bool = arg(
        False, "Give the output layer its own weights instead of sharing the input embedding's.")
    position_embedding_type: str = arg(
        "learned_absolute", "Position embedding.", choices=["learned_absolute", "rope", "none"])
    # The MLP's activation, Megatron-LM's switches: megatron-core's activation_func and gated_linear_unit (derived).
    swiglu: bool = arg(False, "Use the SwiGLU gated activation in the MLP instead of GeLU.")
    openai_gelu: bool = arg(False, "GeLU's tanh approximation, as OpenAI's GPT-2 (Hugging Face's gelu_new) and "
                                   "Megatron-LM's --openai-gelu, instead of the exact erf form.")
    squared_relu: bool = arg(False, "Squared ReLU, relu(x)^2, as the MLP activation instead of GeLU.")
    quick_geglu: bool = arg(False, "Quick-GeGLU MLP: gated, with x * sigmoid(1.702 x) as the gate's activation.")
    init_method_xavier_uniform: bool = arg(
        False, "Xavier-uniform initialisation of every weight matrix (the output projections included) instead of "
               "the normal one: megatron-core's init_method and output_layer_init_method (derived).")
    # Megatron-LM's two ways to ask for virtual pipeline stages: megatron-core's virtual_pipeline_model_parallel_size.
    num_layers_per_virtual_pipeline_stage: Optional[int] = arg(
        None, "Layers per virtual pipeline stage: each pipeline rank holds several non-adjacent chunks of layers and "
              "runs megatron-core's interleaved 1F1B schedule (smaller pipeline bubble).")
    num_virtual_stages_per_pipeline_rank: Optional[int] = arg(
        None, "Virtual pipeline stages per pipeline rank, instead of --num-layers-per-virtual-pipeline-stage (the "
              "layers split evenly over them).", bounds="(0, inf)")
    recompute_activations: bool = arg(False, "Megatron-LM's shorthand for --recompute-granularity selective.")
    group_query_attention: bool = arg(
        False, "Grouped-query attention, as Megatron-LM's switch: --num-query-groups key/value groups, one group "
               "(Megatron-LM's default for --num-query-groups) when that is not given. Megatron-LM ignores "
               "--num-query-groups without it; here fewer groups than heads turn it on, named in the printed config.")
    add_position_embedding: bool = arg(
        True, "Megatron-LM's deprecated switch off the position embedding: with --position-embedding-type rope it "
              "changes nothing (inert); otherwise Megatron-LM refuses it, and so does this trainer (use "
              "--position-embedding-type none).", flag="--no-position-embedding")
    fp8_param_gather: bool = arg(False, "Keep the compute weights in FP8 and all-gather them so (with --fp8-format).")
    use_mcore_models: bool = arg(False, "Megatron-LM's deprecated switch for megatron-core models: megatron-core's "
                                        "GPTModel is the only model here, so it is inert.")
    # Megatron-LM's switches that turn off a fused GPU kernel (apex / transformer-engine / megatron's CUDA
    # extensions). The local layers built here never use these kernels, so the switches change nothing: a CPU or
    # no-TE Megatron-LM command line carries them, and they are accepted and named once as inert.
    no_persist_layer_norm: bool = arg(False, "Megatron-LM's switch off apex's persistent LayerNorm kernel: inert here.")
    no_gradient_accumulation_fusion: bool = arg(
        False, "Megatron-LM's switch off the fused weight-gradient accumulation (an apex/TE kernel): inert here.")
    no_masked_softmax_fusion: bool = arg(False, "Megatron-LM's switch off the fused masked softmax: inert here.")
    no_bias_gelu_fusion: bool = arg(False, "Megatron-LM's switch off the fused bias + GeLU: inert here.")
    no_bias_swiglu_fusion: bool = arg(False, "Megatron-LM's switch off the fused bias + SwiGLU: inert here.")
    no_bias_dropout_fusion: bool = arg(False, "Megatron-LM's switch off the fused bias + dropout + add: inert here.")
    no_rope_fusion: bool = arg(False, "Megatron-LM's switch off the fused rotary embedding kernel: inert here.")



@dataclass
class TrainingConfig(mcore_training.TrainingConfig):
    """Bridge's TrainingConfig: megatron-core's (megatron.training.config), plus Bridge's own fields."""

    check_for_nan_in_loss_and_grad: bool = arg(
        True, "Stop the run before the optimizer step when the loss or a gradient (megatron-core DDP checks each bucket "
              "before the data-parallel reduce) is NaN or Inf, saving nothing of that iteration. Off: the step applies "
              "it, the weights turn NaN and training and saving go on (--fp16's dynamic loss scaling skips such steps "
              "instead, and turns the check off).", flag="--no-check-for-nan-in-loss-and-grad"
    )
    check_optimizer_step_success: bool = arg(
        True, "After each optimizer step, agree across model-parallel ranks whether it succeeded (a step that "
              "failed on any rank is skipped on all).", flag="--no-check-optimizer-step-success")
    skip_sync_grad_norm_across_mp: bool = arg(
        False, "Do not take the max of the reported grad norm over model-parallel ranks (saves one small all-reduce "
               "per step; ranks without trainable parameters then report none).")
    # Bridge's deprecated spellings of the validation section's settings: when set, they are copied there.
    eval_iters: Optional[int] = arg(None, "Deprecated in favor of validation.eval_iters (--eval-iters).", cli=False)
    eval_interval: Optional[int] = arg(None, "Deprecated in favor of validation.eval_interval (--eval-interval).",
                                       cli=False)
    skip_train: Optional[bool] = arg(None, "Deprecated in favor of validation.skip_train (--skip-train).", cli=False)


@dataclass
class LoggerConfig(mcore_training.LoggerConfig):
    """Bridge's LoggerConfig: megatron-core's (megatron.training.config), plus Bridge's trackers and switches."""

    log_l2_norm_grad: bool = arg(False, "Write each parameter's gradient L2 norm to TensorBoard (walks all gradients).")
    log_non_default_values: bool = arg(
        False, "At start print only the settings that differ from their defaults, and the values derived from them, "
               "instead of every setting.")
    skip_train_metrics_log: bool = arg(
        False, "Print no training log line and write no training scalars to TensorBoard or any tracker (validation is "
               "still reported).", cli=False)
    # Other experiment trackers, each on when its first setting is given, fed the TensorBoard scalars on the last rank.
    mlflow_experiment: Optional[str] = arg(None, "MLflow experiment name: log to MLflow (pip install mlflow-skinny).")
    mlflow_run_name: Optional[str] = arg(None, "MLflow run name.")
    mlflow_tracking_uri: Optional[str] = arg(
        None, "MLflow tracking URI: a server (http://HOST:5000), or file:///DIR with MLFLOW_ALLOW_FILE_STORE=true. "
              "Default: MLFLOW_TRACKING_URI, else MLflow's default.")
    mlflow_tags: Optional[dict[str, str]] = arg(None, "Tags of the MLflow run, as KEY=VALUE pairs.")
    comet_project: Optional[str] = arg(None, "Comet project: log to Comet (pip install comet_ml; COMET_START_ONLINE=0 "
                                             "writes an offline archive).")
    comet_experiment_name: Optional[str] = arg(None, "Comet experiment name.")
    comet_workspace: Optional[str] = arg(None, "Comet workspace. Default: the API key's default workspace.")
    comet_api_key: Optional[str] = arg(None, "Comet API key. Prefer the COMET_API_KEY environment variable: a key given "
                                             "here is kept out of saved configs.")
    comet_tags: Optional[list[str]] = arg(None, "Tags of the Comet experiment.")


@dataclass
class CheckpointConfig(mcore_training.CheckpointConfig):
    """Bridge's CheckpointConfig: megatron-core's (megatron.training.config), with Bridge's defaults and fields, and
    megatron-core's post-init deferred to finalize() (as Bridge), so that settings may change after construction."""

    use_persistent_ckpt_worker: bool = arg(
        True, "--async-save with torch_dist: one long-lived writer process instead of a fork per save (GPU).",
        flag="--no-use-persistent-ckpt-worker")
    storage_writers_per_rank: int = arg(
        1, "torch_dist: files each saving rank writes in parallel (megatron-core's writer threads); a save holds "
           "saving ranks x this many .distcp files. (Megatron-LM's --dist-ckpt-workers, which it applies to async saves "
           "only.)", flag="--dist-ckpt-workers", bounds="[1, inf)")
    async_write_results_mp_mode: str = arg(
        "fork", "--async-save with torch_dist: how the process serving the writer's results queue is started.",
        choices=["fork", "spawn", "forkserver"], cli=False)
    strict_fsdp_dtensor_load: bool = arg(
        False, "Bridge's strict loading of FSDP DTensor checkpoints. Only False here: there is no FSDP and no "
               "fsdp_dtensor format.", cli=False)
    custom_manager_class: Optional[str] = arg(
        None, "Dotted path of your own checkpoint manager class (Bridge's CheckpointManager protocol: __init__(checkpoint "
              "config), save(ctx, callback_manager), load(ctx) -> (iteration, FLOPs so far), finalize_async_saves(state, "
              "blocking, terminate)), which then does every save and load of the run. Default: "
              "checkpoint.DefaultCheckpointManager.", cli=False)

    def __post_init__(self) -> None:
        pass  # deferred: see finalize()

    def finalize(self) -> None:
        """megatron-core's post-init on the current values (its checks; async_strategy mcore without --async-save)."""
        super().__post_init__()


@dataclass
class DistributedInitConfig(mcore_training.DistributedInitConfig):
    """Bridge's DistributedInitConfig: megatron-core's (megatron.training.config), plus Bridge's own fields."""

    external_gpu_device_mapping: bool = arg(
        False, "The launcher has given each process one GPU (CUDA_VISIBLE_DEVICES): use device 0 instead of the local "
               "rank's.", cli=False)
    enable_megatron_core_experimental: bool = arg(
        False, "Turn on megatron-core's experimental features (megatron.core.config's experimental flag) for the run.",
        flag="--enable-experimental")
    use_decentralized_pg: bool = arg(
        False, "Bridge's process groups passed through every call instead of megatron-core's global parallel_state. "
               "Only False here: the global groups are what this trainer builds and reads.", cli=False)


@dataclass
class RerunStateMachineConfig(mcore_training.RerunStateMachineConfig):
    """Bridge's RerunStateMachineConfig: megatron-core's (megatron.training.config), with Bridge's default mode and its
    spiky-loss factor."""

    rerun_mode: str = arg(
        "disabled", "disabled: the loss is checked once per step (see --no-check-for-nan-in-loss-and-grad). "
                    "validate_results: check each microbatch's loss and, on a NaN/Inf, rerun the step to tell a "
                    "transient fault from a reproducible one, then stop. report_determinism_stats: run every step "
                    "twice and report how much the losses differ.",
        choices=["disabled", "validate_results", "report_determinism_stats"])
    spiky_loss_factor: float = arg(
        10.0, "Factor for detecting spiky loss: a loss this many times the largest observed over the sample window.")


@dataclass
class StragglerDetectionConfig(mcore_training.StragglerDetectionConfig):
    """Bridge's StragglerDetectionConfig: megatron-core's (megatron.training.config), plus Bridge's switch."""

    enable_straggler_on_startup: bool = arg(
        True, "With --log-straggler: report from the first iteration. Megatron-LM's --disable-straggler-on-startup waits "
              "for its controller port (--straggler-ctrlr-port) to turn the report on; there is no such port here, so "
              "only True.", flag="--disable-straggler-on-startup")


# megatron-core's sections that Bridge takes as they are.
SchedulerConfig = mcore_training.SchedulerConfig  # validate() fills in its step counts (in samples)
RNGConfig = mcore_training.RNGConfig
ProfilingConfig = mcore_training.ProfilingConfig
ValidationConfig = mcore_training.ValidationConfig


@dataclass
class OptimizerConfig(mcore_optimizer.OptimizerConfig):
    """Bridge's OptimizerConfig: megatron-core's, with its post-init (checks, derived fields) deferred to finalize(), so
    that settings may change after construction. model.py hands megatron-core a copy with what the model decides
    (precision, timers) filled in."""

    def __post_init__(self) -> None:
        pass  # deferred: see finalize()

    def finalize(self) -> None:
        super().__post_init__()


@dataclass
class DistributedDataParallelConfig(mcore_distributed.DistributedDataParallelConfig):
    """Bridge's DistributedDataParallelConfig: megatron-core's, with its post-init deferred to finalize() (as the
    optimizer's), plus Megatron-LM's two flags that decide grad_reduce_in_fp32."""

    def __post_init__(self) -> None:
        pass  # deferred: see finalize()

    def finalize(self) -> None:
        super().__post_init__()

    accumulate_allreduce_grads_in_fp32: bool = arg(
        False, "Accumulate and reduce gradients in fp32 (megatron-core DDP's grad_reduce_in_fp32), e.g. with --fp16. "
               "Implied by --bf16.")
    grad_reduce_in_bf16: bool = arg(False, "With --bf16: accumulate and reduce gradients in bf16 instead of fp32.")


@dataclass(frozen=True)
class OptimizerConfigOverrideProviderContext:
    """What an OptimizerConfigOverrideProvider sees: the scheduler config, megatron-core's
    optimizer config (the optimizer section, a megatron-core OptimizerConfig) and the model chunks, as the optimizer will group them."""

    scheduler_config: Any
    optimizer_config: Any
    model: Any


@dataclass
class OptimizerConfigOverrideProvider:
    """Per-parameter optimizer settings: `build_config_overrides` maps megatron-core
    `ParamKey`s to `ParamGroupOverride`s (lr: `max_lr`/`min_lr`, weight decay: `wd_mult`/`start_wd`/`end_wd`).
    Parameters with the same overrides share a parameter group, on CPU and GPU alike.

    The default skips weight decay on biases and 1-D parameters (norms), as Megatron does, and with
    --decoupled-lr gives the input embedding and the output layer their own peak and final learning rates
    (megatron-core's `get_standard_config_overrides`). Subclass it and put an instance in
    `cfg.optimizer_config_override_provider` to change that; return {} for no overrides at all (weight decay
    on everything)."""

    def build_config_overrides(self, context: OptimizerConfigOverrideProviderContext) -> Optional[dict]:
        from megatron.core.optimizer import ParamGroupOverride, ParamKey

        chunks = context.model if isinstance(context.model, list) else [context.model]
        no_wd = [name for chunk in chunks for name, p in chunk.named_parameters()
                 if name.endswith(".bias") or p.ndim == 1]
        overrides = {ParamKey(name=tuple(no_wd)): ParamGroupOverride(wd_mult=0.0)} if no_wd else {}
        s = context.optimizer_config
        if s.decoupled_lr is not None:
            # megatron-core marks the word embeddings and the output layer with is_embedding_or_output_parameter.
            decoupled = ParamGroupOverride(max_lr=s.decoupled_lr)
            if s.decoupled_min_lr is not None:
                decoupled["min_lr"] = s.decoupled_min_lr
            overrides[ParamKey(attr="is_embedding_or_output_parameter")] = decoupled
        return overrides or None


@dataclass(kw_only=True)
class DataloaderConfig:
    """How batches are drawn: the base of the dataset configs."""

    dataloader_type: Optional[str] = arg(
        None, "'single': one pass in order; 'cyclic': reshuffled passes; 'batch': in order, each global batch padded "
              "to its longest sequence. Default: batch with --sft, else single.", choices=["single", "cyclic", "batch"])
    num_workers: int = arg(2, "DataLoader worker processes per rank.")
    data_sharding: bool = arg(
        True, "cyclic loader: each data-parallel rank draws from its own contiguous bucket of the dataset (off: every "
              "rank strides through one permutation of the whole of it).", flag="--no-data-sharding")
    pin_memory: bool = arg(True, "Page-locked batches, for faster copies to a GPU (without a GPU: off, derived).",
                           cli=False)
    drop_last: bool = arg(True, "Drop the last, incomplete global batch of an epoch instead of a short one (Megatron's "
                                "samplers). Only True here: every step takes a whole global batch.", cli=False)
    persistent_workers: bool = arg(True, "Keep the DataLoader's workers between passes (off without workers).",
                                   cli=False)
    trust_remote_code: Optional[bool] = arg(
        None, "Whether a Hugging Face path may run its own code. Inert: the tokenizers here read a tokenizer.json and run "
              "no code of the model's.")


@dataclass(kw_only=True)
class DataSourceConfig(DataloaderConfig):
    """Where the tokens come from, in Megatron-LM's data flags that megatron-core's GPTDatasetConfig has no field for:
    the data paths (validation makes them its blend) and finetuning's JSONL."""

    data_path: Optional[list[str]] = arg(
        None, "CLI-friendly alternative to blend: indexed dataset prefixes (PREFIX.bin/.idx), optionally weighted "
              "('0.7 A 0.3 B'), as Megatron-LM's --data-path. Default: a built-in corpus.")
    train_data_path: Optional[list[str]] = arg(None, "Indexed dataset prefixes for training only (instead of --split).")
    valid_data_path: Optional[list[str]] = arg(None, "Indexed dataset prefixes for validation only.")
    test_data_path: Optional[list[str]] = arg(None, "Indexed dataset prefixes for testing only.")
    sft: bool = arg(False, "Finetuning data: the data paths are JSONL files of prompt/response pairs (or a 'messages' "
                           "list); the loss covers the responses only.")
    sft_pack_sequences: bool = arg(False, "With --sft: pack several examples into each sequence (positions and "
                                          "attention restart at each example).")


@dataclass
class GPTDatasetConfig(mcore_gpt_dataset.GPTDatasetConfig, DataSourceConfig):
    """Megatron Core GPTDatasetConfig with deferred post-init (Bridge's), so that validation derives blend (from the
    data paths), sequence_length and random_seed first; data.py hands megatron-core's dataset builder a finalized copy
    with the tokenizer (and the built-in corpus's blend)."""

    random_seed: Optional[int] = None  # megatron-core requires both; derived from --seed and --seq-length
    sequence_length: Optional[int] = None
    # Fill-in-the-Middle (Megatron-LM's GPTFIMDataset flags; Bridge's GPTFIMDatasetConfig).
    fim_data: bool = arg(False, "Fill-in-the-Middle samples: cut documents into prefix/middle/suffix and reorder them "
                                "around sentinel tokens (PSM or SPM), so the model learns to infill.")
    fim_rate: float = arg(0.5, "With --fim-data: probability that a document (or fragment) of a sample is FIM-reordered.")
    fim_spm_rate: float = arg(0.5, "With --fim-data: probability that a reordered piece uses SPM (suffix first) over PSM.")
    fim_split_sample: Optional[str] = arg(
        None, "With --fim-data: a one-token string (e.g. a file separator) splitting documents into fragments, each "
              "reordered on its own with --fim-fragment-rate.")
    fim_fragment_rate: Optional[float] = arg(None, "With --fim-split-sample: FIM probability of each fragment. Default: --fim-rate.")
    fim_no_prefix: Optional[str] = arg(None, "With --fim-data: leave fragments that start with this text as they are.")
    fim_prefix_token: str = arg("<fim_prefix>", "FIM prefix sentinel (a new id for Byte/NullTokenizer; must be in a HuggingFace vocabulary).")
    fim_middle_token: str = arg("<fim_middle>", "FIM middle sentinel.")
    fim_suffix_token: str = arg("<fim_suffix>", "FIM suffix sentinel.")
    fim_pad_token: str = arg("<fim_pad>", "FIM padding token, masked from the loss (Byte/NullTokenizer: their pad id).")

    def __post_init__(self) -> None:
        pass  # deferred: see finalize()

    def finalize(self) -> None:
        """megatron-core's post-init, as Bridge's finalize: its checks, the split matrix, mock without a blend; not
        GPTDatasetConfig's own, whose token dtype (from the tokenizer) only per-dataset sequence counts would read."""
        super(mcore_gpt_dataset.GPTDatasetConfig, self).__post_init__()


@dataclass
class MockGPTDatasetConfig(GPTDatasetConfig):
    """Modifies GPTDatasetConfig to enforce necessary options for creating a mock dataset: megatron-core's MockGPTDataset."""

    mock: bool = field(default=True, init=False)


@dataclass(kw_only=True)
class FinetuningDatasetConfig(DataSourceConfig):
    """Configuration specific to finetuning datasets, inheriting from DataloaderConfig: JSONL prompt/response pairs."""

    split: str = arg("969,30,1", "Train/validation/test proportions of --data-path.")
    sft: bool = arg(True, "Finetuning data: JSONL files of prompt/response pairs; the loss covers the responses only.")
    dataset_root: Optional[str] = arg(
        None, "A directory laid out as Bridge's: training.jsonl, validation.jsonl, test.jsonl (instead of the data "
              "paths).", cli=False)
    memmap_workers: int = arg(1, "Bridge's workers building its memory-mapped JSONL index. Inert: the JSONL here is "
                                 "read once into memory.", cli=False)
    max_train_samples: Optional[int] = arg(None, "Use only the first this many training examples.", cli=False,
                                           bounds="(0, inf)")
    packed_sequence_specs: Optional[dict] = arg(
        None, "Bridge's PackedSequenceSpecs, as a mapping: packed_train_data_path / packed_val_data_path name "
              ".npy files of packed sequences (Bridge's prepare_packed_sequence_data output) to train / validate "
              "on; packed_sequence_size, when given, must be --seq-length.", cli=False)
    dataset_kwargs: Optional[dict] = arg(
        None, "Options of the finetuning dataset: prompt_key / response_key name the JSONL fields (defaults "
              "prompt/input and response/output).", cli=False)
    do_validation: bool = arg(True, "Build the validation split.", cli=False)
    do_test: bool = arg(True, "Build the test split.", cli=False)


FINETUNING_ONLY = {f.name for f in dataclasses.fields(FinetuningDatasetConfig)} - {f.name for f in dataclasses.fields(GPTDatasetConfig)}


@dataclass
class DatasetBuildContext:
    """What a DatasetProvider gets to build its datasets: how many samples each split must supply,
    and the tokenizer."""

    train_samples: int
    valid_samples: int
    test_samples: int
    tokenizer: Any = None
    pg_collection: Any = None  # megatron-core's ProcessGroupCollection of the run's groups


@dataclass
class DatasetProvider(abc.ABC):
    """Your own datasets: subclass it, implement build_datasets, and
    put an instance in `cfg.dataset`. Each dataset yields dicts of tokens, labels, loss_mask and
    position_ids tensors (attention_mask optional), as megatron-core's GPTDataset does."""

    dataloader_type: str = arg("single", "'single': one pass in order; 'cyclic': reshuffled passes.",
                               choices=["single", "cyclic"])
    num_workers: int = arg(0, "DataLoader worker processes per rank.")

    @abc.abstractmethod
    def build_datasets(self, context: DatasetBuildContext) -> tuple:
        """Return (train, validation, test) datasets; any may be None."""


TokenizerConfig = mcore_training.TokenizerConfig  # megatron-core's, as it is; the types this trainer reads below


@dataclass
class PEFTConfig:
    """Parameter-efficient fine-tuning: low-rank adapters on the frozen base weights (peft.py)."""

    peft: str = arg("none", "Fine-tune low-rank adapters instead of the weights: lora, dora (LoRA with a per-row "
                            "magnitude), or none. Needs --pretrained-checkpoint (the base weights).",
                    choices=["none", "lora", "dora"])
    lora_dim: int = arg(32, "Rank of each adapter.", bounds="(0, inf)")
    lora_alpha: float = arg(32, "Adapter output scale numerator: the output is scaled by alpha / dim.",
                            bounds="(0, inf)")
    lora_dropout: float = arg(0.0, "Dropout on the adapter's input.", bounds="[0, 1)")
    lora_target_modules: list[str] = arg(
        ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
        "Linear layers to adapt: names, or dotted paths with * wildcards such as '*.layers.0.*.linear_qkv'.")
    lora_exclude_modules: list[str] = arg([], "Layers (names or * patterns) to leave out of --lora-target-modules.")


def LoRA(**fields) -> PEFTConfig:
    """Bridge's `LoRA(dim=..., alpha=..., target_modules=[...])` as this trainer's peft section."""
    return PEFTConfig(peft="lora", **{f"lora_{k}": v for k, v in fields.items()})


def DoRA(**fields) -> PEFTConfig:
    """Bridge's `DoRA(...)`: LoRA plus a learned magnitude per output row."""
    return PEFTConfig(peft="dora", **{f"lora_{k}": v for k, v in fields.items()})


# --------------------------------------------------------------------------------------------------
# Settings with no machinery of their own here: the NVIDIA service configs, then Bridge's sections kept for
# compatibility (thin names over the settings above). Their checks and derivations are at the end of the module.
# --------------------------------------------------------------------------------------------------


# NVIDIA service configs (Bridge's FaultToleranceConfig, NVRxStragglerDetectionConfig, InProcessRestartConfig,
# TensorInspectConfig). The services come from separate packages and this training loop does not run them:
# the sections are here so Bridge configs load and validate, and enabling one says what is missing
# (docs/flags.md, "NVIDIA service configs"). All are off by default. Flags only where Megatron-LM has them.


@dataclass
class FaultToleranceConfig:
    """Fault tolerance through nvidia-resiliency-ext's rank monitors (NVIDIA internal use)."""

    enable_ft_package: bool = arg(False, "Enable the fault-tolerance package (nvidia-resiliency-ext; run under ft_launcher).")
    calc_ft_timeouts: bool = arg(False, "Let the fault-tolerance package compute its timeouts from observed intervals.")
    simulate_fault: bool = arg(False, "Inject a simulated fault (to test fault tolerance).", cli=False)
    simulated_fault_type: str = arg("random", "rank_hung, rank_killed or random.", cli=False)
    simulated_fault_rank: Optional[int] = arg(None, "Rank of the simulated fault. Default: a random one.", cli=False)
    simulated_fault_base_delay: int = arg(0, "Seconds before the simulated fault (plus a small random delay).", cli=False)


@dataclass
class NVRxStragglerDetectionConfig:
    """Straggler detection through nvidia-resiliency-ext: per-GPU performance scores from kernel timings."""

    enabled: bool = arg(False, "Enable NVRx straggler detection.", cli=False)
    report_time_interval: float = arg(300.0, "Seconds between straggler checks.", cli=False)
    calc_relative_gpu_perf: bool = arg(True, "Compute relative GPU performance scores.", cli=False)
    calc_individual_gpu_perf: bool = arg(True, "Compute individual GPU performance scores.", cli=False)
    num_gpu_perf_scores_to_print: int = arg(5, "Best and worst scores printed per check (0: only on stragglers).", cli=False)
    gpu_relative_perf_threshold: float = arg(0.7, "Relative score under which a GPU is a straggler.", cli=False)
    gpu_individual_perf_threshold: float = arg(0.7, "Individual score under which a GPU is a straggler.", cli=False)
    stop_if_detected: bool = arg(False, "Stop the run when stragglers are detected.", cli=False)
    enable_logging: bool = arg(True, "Log the GPU performance scores.", cli=False)
    profiling_interval: int = arg(1, "Profiling interval of the straggler detector.", cli=False)
    logger_name: str = arg("megatron.bridge.NVRxStragglerDetection", "Logger of the straggler reports.", cli=False)


@dataclass
class InProcessRestartConfig:
    """In-process restart through nvidia-resiliency-ext: after a fault, training restarts inside the same processes.
    Times in seconds; flags are Megatron-LM's --inprocess-*."""

    enabled: bool = arg(False, "Enable in-process restart.", flag="--inprocess-restart")
    max_iterations: Optional[int] = arg(None, "Maximum number of restarts.", flag="--inprocess-max-iterations")
    monitor_thread_interval: float = arg(1.0, "Monitoring thread interval.", flag="--inprocess-monitor-thread-interval")
    monitor_process_interval: float = arg(1.0, "Monitoring process interval.", flag="--inprocess-monitor-process-interval")
    progress_watchdog_interval: float = arg(1.0, "Progress watchdog interval.", flag="--inprocess-progress-watchdog-interval")
    heartbeat_interval: float = arg(30.0, "Heartbeat interval (unresponsive ranks).", flag="--inprocess-heartbeat-interval")
    soft_timeout: float = arg(60.0, "Soft progress timeout.", flag="--inprocess-soft-timeout")
    hard_timeout: float = arg(90.0, "Hard progress timeout.", flag="--inprocess-hard-timeout")
    heartbeat_timeout: float = arg(60.0, "Missing-heartbeat timeout.", flag="--inprocess-heartbeat-timeout")
    barrier_timeout: float = arg(120.0, "Internal distributed barrier timeout.", flag="--inprocess-barrier-timeout")
    completion_timeout: float = arg(120.0, "Completion barrier timeout.", flag="--inprocess-completion-timeout")
    last_call_wait: float = arg(1.0, "Time for other ranks to report concurrent failures.", flag="--inprocess-last-call-wait")
    termination_grace_time: float = arg(1.0, "SIGTERM to SIGKILL on a hard timeout.",
                                        flag="--inprocess-termination-grace-time")
    granularity: str = arg("node", "Restart granularity.", choices=["node", "rank"], flag="--inprocess-granularity")
    active_world_size: Optional[int] = arg(None, "Ranks that run the workload (the rest: warm reserve). Default: all.",
                                           flag="--inprocess-active-world-size")
    empty_cuda_cache: bool = arg(True, "Empty the CUDA cache after a restart.", cli=False)
    max_rank_faults: Optional[int] = arg(None, "Rank faults allowed before the job stops.", cli=False)
    monitor_process_logdir: Optional[str] = arg(None, "Directory of the monitor process's logs.", cli=False)


@dataclass
class TensorInspectConfig:
    """Tensor statistics through NVIDIA DL Framework Inspect (nvdlfw-inspect) on transformer-engine layers."""

    enabled: bool = arg(False, "Enable tensor inspection and statistics collection.", cli=False)
    features: Any = arg(None, "Feature configuration: a mapping, or the path of its YAML file.", cli=False)
    feature_dirs: Optional[list[str]] = arg(None, "Feature implementations. Default: transformer-engine's.", cli=False)
    log_dir: Optional[str] = arg(None, "Directory of the statistics. Default: --save, else here.", cli=False)
    init_training_step: int = arg(0, "Initial step of the inspector. Default: --ckpt-step.", cli=False)


@dataclass
class MixedPrecisionConfig:
    """Bridge's MixedPrecisionConfig: in YAML a recipe name (`bf16_mixed`, `fp16_mixed`) or these fields. Thin:
    they set --bf16/--fp16, the loss-scaling flags and the gradient-reduction dtype; fp8/fp4 need
    transformer-engine on a GPU and are refused."""

    fp32: bool = arg(False, "fp32 training (no --bf16/--fp16).", cli=False)
    fp16: bool = arg(False, "--fp16.", cli=False)
    bf16: bool = arg(False, "--bf16.", cli=False)
    params_dtype: Optional[str] = arg(None, "Must name the precision chosen (bfloat16, float16, float32) when set.",
                                      cli=False)
    pipeline_dtype: Optional[str] = arg(None, "As params_dtype.", cli=False)
    autocast_enabled: bool = arg(False, "Not supported here: must stay off.", cli=False)
    grad_reduce_in_fp32: bool = arg(True, "Gradients accumulated and reduced in fp32 (megatron DDP's buffer).", cli=False)
    loss_scale: Optional[float] = arg(None, "--loss-scale.", cli=False)
    initial_loss_scale: Optional[float] = arg(2.0**32, "--initial-loss-scale.", cli=False)
    min_loss_scale: float = arg(1.0, "--min-loss-scale.", cli=False)
    loss_scale_window: float = arg(1000, "--loss-scale-window.", cli=False)
    hysteresis: int = arg(2, "--hysteresis.", cli=False)
    fp8: Optional[str] = arg(None, "fp8 training: needs transformer-engine on a GPU; refused here.", cli=False)
    fp8_recipe: str = arg("tensorwise", "fp8 scaling recipe (with fp8 only).", cli=False)
    fp8_param_gather: bool = arg(False, "fp8 parameter all-gather (with fp8 only).", cli=False)
    fp4: Optional[str] = arg(None, "fp4 training: needs transformer-engine on a GPU; refused here.", cli=False)


def get_mixed_precision_config(name) -> MixedPrecisionConfig:
    """A recipe by Bridge's name (`bf16_mixed`, `bf16-mixed`, `fp16_mixed`), or the config itself."""
    if isinstance(name, MixedPrecisionConfig):
        return name
    recipes = {"bf16_mixed": dict(bf16=True, params_dtype="bfloat16", pipeline_dtype="bfloat16"),
               "fp16_mixed": dict(fp16=True, params_dtype="float16", pipeline_dtype="float16", grad_reduce_in_fp32=False)}
    key = str(name).replace("-", "_")
    if key not in recipes:
        low_bits = "fp8" in key or "fp4" in key
        raise ConfigError(f"mixed_precision: {name!r} " + ("needs transformer-engine's fp8/fp4 on a GPU, which this "
                          "trainer does not drive; use bf16_mixed or fp16_mixed" if low_bits else
                          f"is not a recipe; use one of {', '.join(recipes)}"))
    return MixedPrecisionConfig(**recipes[key])


@dataclass
class CommOverlapConfig:
    """Bridge's CommOverlapConfig. Thin: overlap_grad_reduce and overlap_param_gather are the ddp section's;
    tensor-parallel communication overlap (tp_comm_overlap) needs transformer-engine's userbuffers on GPUs."""

    tp_comm_overlap: bool = arg(False, "Overlap tensor-parallel communication with GEMMs (transformer-engine).", cli=False)
    tp_comm_overlap_cfg: Optional[dict] = arg(None, "transformer-engine's userbuffer settings (with tp_comm_overlap).",
                                              cli=False)
    tp_comm_bootstrap_backend: Optional[str] = arg("nccl", "Userbuffer bootstrap backend (with tp_comm_overlap).",
                                                   cli=False)
    overlap_grad_reduce: Optional[bool] = arg(None, "ddp.overlap_grad_reduce (--overlap-grad-reduce).", cli=False)
    overlap_param_gather: Optional[bool] = arg(None, "ddp.overlap_param_gather (--overlap-param-gather).", cli=False)
    overlap_p2p_comm: Optional[bool] = arg(None, "model.overlap_p2p_comm (--no-overlap-p2p-communication).", cli=False)
    batch_p2p_comm: Optional[bool] = arg(None, "Derived here from overlap_p2p_comm, as Megatron-LM: must stay unset.",
                                         cli=False)
    overlap_param_gather_with_optimizer_step: Optional[bool] = arg(None, "Not supported here: must stay unset.",
                                                                   cli=False)
    align_param_gather: Optional[bool] = arg(None, "Not supported here: must stay unset.", cli=False)
    bucket_size: Optional[int] = arg(None, "Not supported here: must stay unset.", cli=False)
    defer_embedding_wgrad_compute: Optional[bool] = arg(None, "Not supported here: must stay unset.", cli=False)
    wgrad_deferral_limit: Optional[int] = arg(None, "Not supported here: must stay unset.", cli=False)
    data_parallel_size: Optional[int] = arg(None, "Set from the world size (as Bridge does).", cli=False)


# --------------------------------------------------------------------------------------------------
# The container: one field per section above
# --------------------------------------------------------------------------------------------------


@dataclass
class ConfigContainer:
    """Top-level container: one sub-config per concern, plus values derived at validation."""

    model: GPTModelProvider = field(default_factory=lambda: section_default(GPTModelProvider, "model"))
    train: TrainingConfig = field(default_factory=lambda: section_default(TrainingConfig, "train"))
    validation: ValidationConfig = field(default_factory=lambda: section_default(ValidationConfig, "validation"))
    optimizer: OptimizerConfig = field(default_factory=lambda: section_default(OptimizerConfig, "optimizer"))
    scheduler: SchedulerConfig = field(default_factory=lambda: section_default(SchedulerConfig, "scheduler"))
    dataset: GPTDatasetConfig = field(default_factory=lambda: section_default(GPTDatasetConfig, "dataset"))
    tokenizer: TokenizerConfig = field(default_factory=lambda: section_default(TokenizerConfig, "tokenizer"))
    logger: LoggerConfig = field(default_factory=lambda: section_default(LoggerConfig, "logger"))
    checkpoint: CheckpointConfig = field(default_factory=lambda: section_default(CheckpointConfig, "checkpoint"))
    dist: DistributedInitConfig = field(default_factory=lambda: section_default(DistributedInitConfig, "dist"))
    rng: RNGConfig = field(default_factory=RNGConfig)
    ddp: DistributedDataParallelConfig = field(default_factory=lambda: section_default(DistributedDataParallelConfig,
                                                                                        "ddp"))
    optimizer_config_override_provider: OptimizerConfigOverrideProvider = field(
        default_factory=OptimizerConfigOverrideProvider, metadata={"section": False})  # code, not settings
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    straggler: StragglerDetectionConfig = field(default_factory=StragglerDetectionConfig)
    rerun_state_machine: RerunStateMachineConfig = field(default_factory=RerunStateMachineConfig)
    ft: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    nvrx_straggler: NVRxStragglerDetectionConfig = field(default_factory=NVRxStragglerDetectionConfig)
    inprocess_restart: InProcessRestartConfig = field(default_factory=InProcessRestartConfig)
    tensor_inspect: TensorInspectConfig = field(default_factory=TensorInspectConfig)
    peft: PEFTConfig = field(default_factory=PEFTConfig)
    # Bridge's sections, thin names over the ones above (applied by validate(), as Bridge's runtime_config_update).
    mixed_precision: Optional[Any] = None  # a recipe name or a MixedPrecisionConfig
    comm_overlap: Optional[CommOverlapConfig] = None
    # Derived by validate() from the world size and the machine; not settable from the command line.
    world_size: int = 1
    data_parallel_size: int = 1
    use_gpu: bool = False
    padded_vocab_size: int = 0  # set at setup, from the tokenizer
    trainable_fraction: float = 1.0  # of the parameters; below 1 with PEFT's frozen weights (memory estimate)
    # The flags of MEGATRON_LM_INERT_FLAGS given on the command line, as given (set by config_from_flags).
    megatron_lm_inert: Optional[list] = None
    # What validation filled in or rewrote (derive_value): {"section.name": (value, why)}, printed with the config.
    derived: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The settings, section by section: of megatron-core's classes, the fields this trainer acts on (the others
        hold their defaults, which check_mcore_fields ensures); a signal by its name."""
        def plain(value):
            return value.name if isinstance(value, enum.Enum) else dataclasses.asdict(value) if \
                dataclasses.is_dataclass(value) else [plain(v) for v in value] if isinstance(value, (tuple, list)) else value
        d = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in SECTIONS and dataclasses.is_dataclass(value):
                d[f.name] = {name: plain(getattr(value, name)) for name in settings_of(f.name, value)}
            elif f.name != "derived":  # said in the sections themselves
                d[f.name] = plain(value)
        d["logger"]["comet_api_key"] = None  # a secret: kept out of run_config.yaml and the trackers' copies
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ConfigContainer":
        cfg = cls()
        apply_overrides(cfg, d, source="dict")
        return cfg

    def get_data_parallel_size(self, world_size: int) -> int:
        """Data-parallel size: the ranks left after tensor, pipeline and context parallelism."""
        m = self.model
        return world_size // (m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size)

    def log_non_default_values(self, file=sys.stdout) -> None:
        """Bridge's `ConfigContainer.log_non_default_values`: the settings that differ from their defaults
        (the defaults `--help` shows), then the values validation derived for this run (sizes, the
        scheduler's lengths in samples). What a reader needs to spot an unintended deviation, without
        every setting of the full config."""
        lines = ["", "=" * 70, "Configuration Summary (Non-Default Values)", "=" * 70]
        derived = _get_key_config_values(self)
        derived.pop("derived", None)  # listed with their reasons below
        derived["num_microbatches"] = self.train.global_batch_size // (self.train.micro_batch_size * self.data_parallel_size)
        defaults = ConfigContainer()
        for section, sub in section_configs(self):
            default = getattr(defaults, section)
            changed = _get_non_default_values(sub, default if type(default) is type(sub) else type(sub)())
            if changed:
                lines.append(f"\n[{section}] Non-default values:")
                lines += [f"  {k}: {v!r}  (default: {d!r})" for k, (v, d) in sorted(changed.items())]
            for f in dataclasses.fields(sub):
                if (f.metadata.get("derived") or not f.init) and getattr(sub, f.name) is not None:
                    derived[f"{section}.{f.name}"] = getattr(sub, f.name)
        lines += ["\n" + "-" * 70, "Other Configuration Values:", "-" * 70]
        lines += [f"  {k}: {v!r}" for k, v in derived.items()]
        lines += ["\n" + "-" * 70, "Derived by validation (setting: value, from what):", "-" * 70]
        lines += [f"  {setting}: {value!r}  ({why})" for setting, (value, why) in self.derived.items()]
        lines.append("=" * 70)
        print("\n".join(lines), file=file, flush=True)


OPTIONAL_SECTIONS = {"mixed_precision": MixedPrecisionConfig, "comm_overlap": CommOverlapConfig}  # None by default
# The container's sections, in its field order (the YAML's and --help's order): each field holding settings.
SECTIONS = [f.name for f in dataclasses.fields(ConfigContainer) if f.name in OPTIONAL_SECTIONS
            or (f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory())
                and f.metadata.get("section", True))]


def section_configs(cfg: ConfigContainer):
    """(name, dataclass) of each section that holds one (mixed_precision may be a recipe name, or unset)."""
    for section in SECTIONS:
        if dataclasses.is_dataclass(getattr(cfg, section)):
            yield section, getattr(cfg, section)


# --------------------------------------------------------------------------------------------------
# The command line, generated from the dataclasses
# --------------------------------------------------------------------------------------------------


def _base_type(tp):
    """int for Optional[int]; (list, str) for Optional[list[str]]."""
    if typing.get_origin(tp) is typing.Union:
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) is list:
        return (list, typing.get_args(tp)[0])
    if typing.get_origin(tp) is dict:  # KEY=VALUE words on the command line, made a dict by validate()
        return (list, str)
    return tp


def _field_meta(section: str, f, hints: dict, factory) -> Optional[dict]:
    """How a field appears on the command line: {flags, help, type, choices, bounds, off, ...}; None without a flag."""
    if "help" in f.metadata:  # declared here with arg()
        meta = dict(f.metadata)
        meta["flag"] = meta["flag"] or "--" + f.name.replace("_", "-")
        meta["flags"] = [meta["flag"]]
        meta["type"] = _base_type(hints[f.name])
        return meta if meta["cli"] else None
    if f.name not in _names(MCORE_FLAGS, section):
        return None
    try:
        kwargs = factory._build_argparse_kwargs_from_field(f)
    except TypeInferenceError:  # a type argparse has no form for (a tuple): MCORE_FLAG_CHANGES gives it
        kwargs = dict(arg_names=[factory._format_arg_name(f.name)], help=factory.field_docstrings.get(f.name, ""))
    meta = dict(flags=kwargs.pop("arg_names"), help=kwargs.get("help", ""), choices=kwargs.get("choices"),
                bounds=None, off=None, derived=False, cli=True, nargs=kwargs.get("nargs"), action=kwargs.get("action"),
                type=kwargs.get("type"))
    meta.update(MCORE_FLAG_CHANGES.get(f"{section}.{f.name}", {}))
    meta["flag"] = meta["flags"][0]
    return meta


def _cli_fields():
    """Yield (section, dataclass field, how it appears on the command line) for every field that has a flag."""
    defaults = ConfigContainer()
    for section in SECTIONS:
        if section in OPTIONAL_SECTIONS:
            continue
        cls = type(getattr(defaults, section))
        hints = typing.get_type_hints(cls)
        factory = ArgumentGroupFactory(cls) if section in MCORE_FLAGS else None
        for f in dataclasses.fields(cls):
            meta = _field_meta(section, f, hints, factory)
            if meta is not None:
                yield section, f, meta


class OneLineParser(argparse.ArgumentParser):
    """argparse, whose errors are one line and exit code 2 (no usage dump)."""

    def error(self, message):  # one line, exit code 2, no usage dump
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


# Megatron-LM switches that set one of those settings to one value: (switch, section, field, value, help).
FLAG_SWITCHES = [
    ("--use-rotary-position-embeddings", "model", "position_embedding_type", "rope",
     "Megatron-LM's deprecated switch for --position-embedding-type rope."),
    ("--use-persistent-ckpt-worker", "checkpoint", "use_persistent_ckpt_worker", True,
     "Megatron-LM's switch on for the persistent checkpoint writer, which is on by default here."),
]

INERT_DEST = "megatron_lm_inert."  # argparse dest prefix of MEGATRON_LM_INERT_FLAGS


def build_parser(prog: str = "train.py") -> argparse.ArgumentParser:
    """The argparse parser: one argument group per config section, one flag per field."""
    parser = OneLineParser(
        prog=prog,
        description="Pretrain a megatron-core GPT. Flags follow Megatron-LM; --config-file takes a YAML file that flags override.",
        argument_default=argparse.SUPPRESS,  # only flags actually given override the defaults/YAML
        allow_abbrev=False,
    )
    parser.add_argument("--config-file", help="YAML file with one mapping per section (model:, train:, ...).")
    groups = {}
    defaults = ConfigContainer()
    for section, f, meta in _cli_fields():
        group = groups.get(section) or groups.setdefault(section, parser.add_argument_group(section))
        dest = f"{section}.{f.name}"
        default = getattr(getattr(defaults, section), f.name)
        flags = meta["flags"]  # megatron-core's fields: Megatron-LM's spellings too (argparse_meta's arg_names)
        tp = meta["type"]
        if tp is bool or meta.get("action") in ("store_true", "store_false"):
            action = "store_false" if default else "store_true"
            group.add_argument(*flags, dest=dest, action=action, help=meta["help"])
        elif isinstance(tp, tuple) or meta.get("nargs"):  # a list of values
            nargs = meta.get("nargs") or "+"
            group.add_argument(*flags, dest=dest, nargs=nargs, type=tp[1] if isinstance(tp, tuple) else tp,
                               metavar=f.name.upper().split("_")[-1], help=meta["help"] + " (default: %s)" % (default,))
        else:
            group.add_argument(*flags, dest=dest, type=tp, choices=meta["choices"],
                               metavar=None if meta["choices"] else f.name.upper(),
                               help=meta["help"] + " (default: %s)" % (default,))
        if meta["off"]:
            group.add_argument(meta["off"], dest=dest, action="store_const", const=None,
                               help=f"Unset {meta['flag']} (the last of the two given wins).")
    for switch, section, name, value, help_text in FLAG_SWITCHES:
        groups[section].add_argument(switch, dest=f"{section}.{name}", action="store_const", const=value, help=help_text)
    inert = parser.add_argument_group("Megatron-LM flags with no effect here (accepted, named once in the printed config)")
    for why, flags in MEGATRON_LM_INERT_FLAGS:
        for flag, takes in flags:
            kwargs = (dict(action="store_true") if takes is None else dict(nargs="*") if takes == "*" else
                      dict(choices=takes) if isinstance(takes, list) else dict(type=takes, metavar=takes.__name__.upper()))
            inert.add_argument(flag, dest=INERT_DEST + flag, help=f"Megatron-LM's; inert here: {why}.", **kwargs)
    return parser


# Bridge's names (its GPTModelProvider's TransformerConfig fields) for settings this config names as Megatron-LM's flag.
# Settings of a run_config.yaml written before the sections were megatron-core's, under their names now.
FORMER_NAMES = {("ddp", "ddp_bucket_size"): ("bucket_size", None),
               ("ddp", "ddp_pad_buckets_for_high_nccl_busbw"): ("pad_buckets_for_high_nccl_busbw", None),
               ("ddp", "ddp_average_in_collective"): ("average_in_collective", None),
               ("model", "num_experts"): ("num_moe_experts", None),
               ("model", "norm_epsilon"): ("layernorm_epsilon", None),
               ("model", "decoder_first_pipeline_num_layers"): ("num_layers_in_first_pipeline_stage", None),
               ("model", "decoder_last_pipeline_num_layers"): ("num_layers_in_last_pipeline_stage", None),
               ("model", "fp8_format"): ("fp8", None),
               ("model", "apply_layernorm_1p"): ("layernorm_zero_centered_gamma", None),
               ("scheduler", "decoupled_lr"): ("optimizer.decoupled_lr", None),
               ("scheduler", "decoupled_min_lr"): ("optimizer.decoupled_min_lr", None),
               ("dataset", "mock_data"): ("mock", None), ("dataset", "data_cache_path"): ("path_to_cache", None),
               ("dataset", "create_attention_mask_in_dataloader"): ("create_attention_mask", None)}


def apply_overrides(cfg: ConfigContainer, overrides: dict, source: str) -> None:
    """Set `{section: {field: value}}` on cfg, refusing unknown sections and fields by name."""
    for section, values in (overrides or {}).items():
        if section not in SECTIONS:
            raise ConfigError(f"{source}: unknown section '{section}'; sections are {', '.join(SECTIONS)}")
        if values is None:
            continue
        if section == "mixed_precision" and isinstance(values, str):  # a recipe name
            cfg.mixed_precision = values
            continue
        if section in OPTIONAL_SECTIONS and not dataclasses.is_dataclass(getattr(cfg, section)):
            setattr(cfg, section, OPTIONAL_SECTIONS[section]())
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: section '{section}' must be a mapping of settings")
        sub = getattr(cfg, section)
        if section == "dataset" and type(sub) is GPTDatasetConfig and set(values) & FINETUNING_ONLY:
            # A finetuning dataset's own settings (dataset_root, ...) make it one, keeping what was set before.
            sub = cfg.dataset = FinetuningDatasetConfig(**{f.name: getattr(sub, f.name) for f in dataclasses.fields(
                FinetuningDatasetConfig) if f.name != "sft" and hasattr(sub, f.name)})
        names = {f.name for f in dataclasses.fields(sub)}
        for key, value in values.items():
            key = key.replace("-", "_")
            if (section, key) in FORMER_NAMES:
                key, convert = FORMER_NAMES[section, key]
                value = convert(value) if convert else value
                if "." in key:  # a setting that moved to another section
                    other, key = key.split(".")
                    setattr(getattr(cfg, other), key, value)
                    continue
            if key not in names and isinstance(sub, FinetuningDatasetConfig) and \
                    value == getattr(section_default(GPTDatasetConfig, "dataset"), key, object()):
                continue  # a pretraining setting at its default: a FinetuningDatasetConfig's YAML held them all before
            if key not in names:
                raise ConfigError(f"{source}: '{section}' has no setting '{key}' (see --help for the {section} group)")
            setattr(sub, key, value)


def parse_args(argv: Optional[list] = None, world_size: Optional[int] = None, gpu: Optional[bool] = None,
               run: bool = False) -> ConfigContainer:
    """Parse flags (and an optional YAML file under them) into a validated ConfigContainer.

    A bad flag or an impossible combination prints one line to stderr and exits with code 2.
    `world_size` defaults to $WORLD_SIZE (set by torchrun) and `gpu` to whether a GPU is visible. `run`: the config
    is this machine's run (train.py's command line), which must also fit in its memory (check_fits_in_memory); a
    config alone may describe any model (its FLOPs and memory can be computed for a model no laptop holds).
    """
    parser = build_parser()
    try:
        cfg = config_from_flags(argv, world_size, gpu, parser)
        if run:
            check_fits_in_memory(cfg)
        return cfg
    except ConfigError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")


def config_from_flags(argv: list, world_size: Optional[int] = None, gpu: Optional[bool] = None,
                      parser: Optional[argparse.ArgumentParser] = None) -> ConfigContainer:
    """parse_args without the exit: an impossible combination raises ConfigError (for callers that are not the
    command line, such as hf.py's import)."""
    parser = parser or build_parser()
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        reasons = [unsupported_flag(t) for t in unknown if t.startswith("--")]
        if any(reasons):
            raise ConfigError(next(r for r in reasons if r))
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    ns = vars(ns)
    cfg = ConfigContainer()
    if "config_file" in ns:
        apply_overrides(cfg, _load_yaml(ns.pop("config_file")), source="--config-file")
    inert = [(dest[len(INERT_DEST):], ns.pop(dest)) for dest in list(ns) if dest.startswith(INERT_DEST)]
    cfg.megatron_lm_inert = [flag if value is True else " ".join([flag, *map(str, value)]) if isinstance(value, list)
                             else f"{flag} {value}" for flag, value in inert] or None
    flags: dict = {}
    for dest, value in ns.items():
        section, name = dest.split(".", 1)
        flags.setdefault(section, {})[name] = value
    apply_overrides(cfg, flags, source="flags")
    return validate(cfg, world_size=world_size, gpu=gpu)


def _load_yaml(path: str) -> dict:
    import yaml

    if not os.path.isfile(path):
        raise ConfigError(f"--config-file {path}: no such file")
    try:
        with open(path) as fh:
            data = yaml.safe_load(fh) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--config-file {path}: not valid YAML ({str(e).splitlines()[0]})")
    if not isinstance(data, dict):
        raise ConfigError(f"--config-file {path}: expected a mapping of sections (model:, train:, ...)")
    return data


def to_yaml(cfg: ConfigContainer) -> str:
    """The resolved config as YAML: what `run_config.yaml` holds and `--config-file` reads back."""
    import yaml

    d = cfg.to_dict()
    return yaml.safe_dump({s: d[s] for s in SECTIONS}, sort_keys=False)


def gpu_visible() -> bool:
    """Whether an NVIDIA GPU is visible, answered without importing torch (train.py re-checks with torch)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def package_installed(module: str) -> bool:
    """Whether a package can be imported (e.g. transformer_engine), answered without importing it."""
    return importlib.util.find_spec(module) is not None


# --------------------------------------------------------------------------------------------------
# Validation, in two passes: derive, then check
#
#   derive: every value validation fills in or rewrites, set through derive_value(), which names it (with its reason)
#           in the printed config. A derivation that cannot be made (its inputs are wrong) is left undone, for the
#           check that says why.
#   check:  pure conditions on the result, each `require(condition, one-line message)`: nothing is changed.
#
# Each concern has a derive_* and a check_* function of the same name, in the same order, so grepping a setting finds
# its declaration above, its derivation and its checks. The Bridge sections and the NVIDIA service configs, which have
# no machinery here, come last in the module.
# --------------------------------------------------------------------------------------------------


def validate(cfg: ConfigContainer, world_size: Optional[int] = None, gpu: Optional[bool] = None) -> ConfigContainer:
    """Fill in the derived values, then check every setting against the others and the machine (Megatron-LM's
    `validate_args`, Bridge's `ConfigContainer.validate`). Raises ConfigError with a one-line message."""
    cfg.world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    cfg.use_gpu = gpu_visible() if gpu is None else gpu
    derive(cfg)
    check(cfg)
    return cfg


def runtime_config_update(cfg: ConfigContainer, world_size: Optional[int] = None, gpu: Optional[bool] = None):
    """Bridge's runtime_config_update: resolve the Bridge sections (mixed_precision, comm_overlap,
    validation), set the data-parallel size, and validate. Call it on a ConfigContainer built in Python
    before pretrain()/finetune(); parse_args() does it for the command line."""
    return validate(cfg, world_size=world_size, gpu=gpu)


def derive_value(cfg: ConfigContainer, setting: str, value: Any, why: str) -> None:
    """One derivation: set `setting` ("section.name") to value and note it, with why, for the printed config
    (cfg.derived). A setting that already holds the value is left alone and not noted."""
    section, name = setting.split(".")
    sub = getattr(cfg, section)
    if getattr(sub, name) == value and type(getattr(sub, name)) is type(value):
        return
    setattr(sub, name, value)
    cfg.derived[setting] = (value, why)


def require_finalizes(section) -> None:
    """megatron-core's post-init of a section (its finalize()), whose refusal (an assertion or a ValueError) becomes
    the run's one line."""
    refusal = None
    try:
        section.finalize()
    except (AssertionError, ValueError) as e:
        refusal = str(e).splitlines()[0] if str(e) else repr(e)
    require(refusal is None, f"megatron-core's {type(section).__name__} refuses these settings: {refusal}")


def require(condition: Any, message: str) -> None:
    """A check: when the condition does not hold, the run stops before any work with this one-line message."""
    if not condition:
        raise ConfigError(message)


def derive(cfg: ConfigContainer) -> None:
    """Every fill-in and rewrite, in the order they depend on each other."""
    derive_bridge_sections(cfg)  # first: they set settings of the other sections (at the end of the module)
    derive_model_sizes(cfg)
    derive_parallelism(cfg)
    derive_moe(cfg)
    derive_batch_sizes_and_length(cfg)
    derive_precision(cfg)
    derive_optimizer_and_schedule(cfg)
    derive_data(cfg)
    derive_loggers(cfg)
    derive_checkpointing(cfg)
    derive_machine(cfg)
    derive_services(cfg)  # the NVIDIA service configs (at the end of the module)


def check(cfg: ConfigContainer) -> None:
    """Every check, one concern after another; the first that fails is the run's one-line error."""
    check_bridge_sections(cfg)
    check_bounds(cfg)
    check_model_sizes(cfg)
    check_architecture(cfg)
    check_parallelism(cfg)
    check_moe(cfg)
    check_multi_token_prediction(cfg)
    check_batch_sizes_and_length(cfg)
    check_precision(cfg)
    check_rerun_state_machine(cfg)
    check_optimizer_and_schedule(cfg)
    check_data(cfg)
    check_fim(cfg)
    check_loggers(cfg)
    check_checkpointing(cfg)
    check_machine(cfg)
    check_peft(cfg)
    check_deterministic_mode(cfg)
    check_callbacks(cfg)
    check_services(cfg)
    check_transformer_config(cfg)  # last: megatron-core's own refusals of what passed the checks above


def check_transformer_config(cfg: ConfigContainer) -> None:
    """megatron-core's own checks of the model section (its finalize(), tried on a copy so that the settings stay as
    given until the model is built): what they refuse, and the checks above do not say first in this trainer's words,
    is the run's one line, before any process group."""
    refusal = None
    try:
        copy.deepcopy(cfg.model).finalize()
    except (AssertionError, ValueError, NotImplementedError) as e:
        refusal = str(e).splitlines()[0] if str(e) else repr(e)
    require(refusal is None, f"megatron-core's TransformerConfig refuses these settings: {refusal}")


def _interval(spec: str) -> tuple:
    """"[0, 1)" -> (0.0, 1.0, True, False): low, high, and whether each end is included."""
    low, high = (x.strip() for x in spec[1:-1].split(","))
    return float(low), float(high), spec[0] == "[", spec[-1] == "]"


def check_bounds(cfg: ConfigContainer) -> None:
    """Every number given with declared `bounds` lies in its interval (None means unset; NaN is never in one).
    A derived value is left to the checks of what it was derived from."""
    for section, sub in section_configs(cfg):
        for f in dataclasses.fields(sub):
            value = getattr(sub, f.name)
            spec = f.metadata.get("bounds") or MCORE_FLAG_CHANGES.get(f"{section}.{f.name}", {}).get("bounds")
            if spec is None or value is None or isinstance(value, bool) or f"{section}.{f.name}" in cfg.derived:
                continue
            low, high, low_in, high_in = _interval(spec)
            inside = isinstance(value, (int, float)) and (low <= value if low_in else low < value) and (
                value <= high if high_in else value < high)
            flag = flag_of(section, f)
            require(inside, f"{flag} {value!r} is out of range: it must lie in {spec}")


# -- the model's sizes and architecture ------------------------------------------------------------


def derive_model_sizes(cfg: ConfigContainer) -> None:
    """kv-channels, query groups, the MLP size and the position table, from the sizes given."""
    m = cfg.model
    # A run_config.yaml saved once the model was built holds megatron-core's types (finalize()): a list of one as its item
    for name in ("cp_comm_type", "moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        if getattr(m, name) is not None and not isinstance(getattr(m, name), list):
            derive_value(cfg, f"model.{name}", [getattr(m, name)], "a list, as its flag gives it")
    if m.kv_channels is None and m.num_attention_heads > 0 and m.hidden_size % m.num_attention_heads == 0:
        derive_value(cfg, "model.kv_channels", m.hidden_size // m.num_attention_heads,
                     "--hidden-size / --num-attention-heads")
    if m.num_query_groups is None:
        # Megatron-LM: --group-query-attention alone means its --num-query-groups default, 1 (multi-query attention).
        derive_value(cfg, "model.num_query_groups", 1 if m.group_query_attention else m.num_attention_heads,
                     "--group-query-attention alone: one group" if m.group_query_attention else
                     "--num-attention-heads: no grouping")
    elif m.num_query_groups != m.num_attention_heads and not m.group_query_attention:
        # Megatron-LM passes --num-query-groups to megatron-core only with --group-query-attention (arguments.py:
        # 1348-1351) and builds multi-head attention without it. Here fewer groups than heads mean what they say, and
        # the switch is set so the checkpoint's args tell Megatron-LM's loader to build the same grouped attention.
        derive_value(cfg, "model.group_query_attention", True,
                     f"--num-query-groups {m.num_query_groups}: grouped-query attention (Megatron-LM reads it only with "
                     f"--group-query-attention, which the checkpoint's args now carry)")
    if m.ffn_hidden_size is None:
        # Megatron-LM: SwiGLU keeps the MLP's parameter count of 4h by using 2/3 of it, rounded to 64.
        derive_value(cfg, "model.ffn_hidden_size",
                     max(64, int((4 * m.hidden_size * 2 / 3) / 64) * 64) if m.swiglu else 4 * m.hidden_size,
                     "2/3 of 4 x --hidden-size, to 64 (--swiglu)" if m.swiglu else "4 x --hidden-size")
    if m.max_position_embeddings is None:
        derive_value(cfg, "model.max_position_embeddings", m.seq_length, "--seq-length")
    if m.multi_latent_attention and m.rope_type is None:  # megatron-core's MLATransformerConfig default
        derive_value(cfg, "model.rope_type", "yarn", "--multi-latent-attention: Megatron-LM's default for MLA")


def check_model_sizes(cfg: ConfigContainer) -> None:
    m, t = cfg.model, cfg.train
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "make_vocab_size_divisible_by"):
        require(getattr(m, name) > 0, f"--{name.replace('_', '-')} must be positive, got {getattr(m, name)}")
    require(t.micro_batch_size > 0, f"--micro-batch-size must be positive, got {t.micro_batch_size}")
    require(m.kv_channels is not None,  # derived only where the heads divide the hidden size
            f"--num-attention-heads {m.num_attention_heads} does not divide --hidden-size {m.hidden_size}; pick heads "
            f"that divide it (or set --kv-channels)")
    require(m.num_query_groups > 0 and m.num_attention_heads % m.num_query_groups == 0,
            f"--num-query-groups {m.num_query_groups} must divide --num-attention-heads {m.num_attention_heads}")
    require(not (m.swiglu and m.openai_gelu), "--openai-gelu is a GeLU, --swiglu replaces GeLU: give one")
    require(m.position_embedding_type != "learned_absolute" or m.max_position_embeddings >= m.seq_length,
            f"--max-position-embeddings {m.max_position_embeddings} is shorter than --seq-length {m.seq_length}")
    for name in ("hidden_dropout", "attention_dropout"):
        require(0.0 <= getattr(m, name) < 1.0, f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(m, name)}")


def layer_pattern(spec: str, flag: str, num_layers: int):
    """Megatron-LM's per-layer pattern (--no-rope-freq, --window-attn-skip-freq) as megatron-core's TransformerConfig
    takes it: an integer N as it is, or a list expression of 0/1 entries joined by + and repeated by *, such as
    '([0]*3+[1])*2', read without eval (Megatron-LM evals it), as a list with one entry per layer."""
    text = str(spec).strip()
    if text.isdigit() and int(text) > 0:
        return int(text)

    def value(node):
        if isinstance(node, ast.List) and all(isinstance(e, ast.Constant) and e.value in (0, 1) and type(e.value) is int
                                              for e in node.elts):
            return [e.value for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = value(node.left), value(node.right)
            if isinstance(left, list) and isinstance(right, list):
                return left + right
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            left = node.left if isinstance(node.left, ast.Constant) else node.right
            pattern = value(node.right if left is node.left else node.left)
            if isinstance(left, ast.Constant) and type(left.value) is int and isinstance(pattern, list) and \
                    0 <= left.value and len(pattern) * left.value <= 100000:
                return pattern * left.value
        raise ValueError

    try:
        pattern = value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, RecursionError):
        raise ConfigError(f"{flag} {text!r} is neither a positive integer nor a list of 0s and 1s such as "
                          f"'([0]*3+[1])*2'") from None
    require(len(pattern) == num_layers,
            f"{flag} {text!r} has {len(pattern)} entries for {num_layers} layers (--num-layers); give one per layer")
    return pattern


def parse_window_size(spec: str) -> tuple:
    """--window-size 'LEFT,RIGHT' as megatron-core's (left, right) tuple (Megatron-LM's tuple_type)."""
    try:
        left, right = (int(x) for x in str(spec).strip("()[] ").split(","))
    except ValueError:
        raise ConfigError(f"--window-size {spec!r} must be two integers LEFT,RIGHT (-1: unlimited), e.g. 4096,0") from None
    require(min(left, right) >= -1, f"--window-size {spec!r}: each side is a number of tokens, or -1 for all of them")
    return left, right


def check_architecture(cfg: ConfigContainer) -> None:
    """Megatron-LM's architecture flags that megatron-core's TransformerConfig takes (transformer_config_extras):
    what Megatron-LM's validate_args and TransformerConfig refuse, and what would change nothing, is one line here."""
    m = cfg.model
    activations = [flag for flag, on in (("--swiglu", m.swiglu), ("--squared-relu", m.squared_relu),
                                         ("--quick-geglu", m.quick_geglu), ("--openai-gelu", m.openai_gelu)) if on]
    require(len(activations) <= 1, f"{' and '.join(activations)} each choose the MLP's activation; give one")
    require(not m.glu_linear_offset or m.swiglu or m.quick_geglu,
            "--glu-linear-offset shifts the linear half of a gated MLP; add --swiglu or --quick-geglu, or drop it")
    require(m.activation_func_clamp_value is None or m.quick_geglu,
            "--activation-func-clamp-value clamps the halves of --quick-geglu's MLP; add --quick-geglu or drop it")
    require(not (m.qk_layernorm and m.qk_l2_norm), "--qk-layernorm and --qk-l2-norm each normalize the queries and "
                                                   "keys; give one")
    if m.multi_latent_attention:
        require(m.num_query_groups == m.num_attention_heads, f"--num-query-groups {m.num_query_groups} groups the keys "
                "and values of grouped-query attention; multi-latent attention shares one latent among all heads "
                "instead: drop --num-query-groups and --group-query-attention")
        require(not m.qk_l2_norm, "--qk-l2-norm is not built for multi-latent attention (megatron-core refuses it); "
                                  "use --qk-layernorm (the latents' norms) or drop it")
        require(cfg.peft.peft == "none", f"--peft {cfg.peft.peft} adapts linear_qkv, linear_proj and the MLP here; "
                                         f"multi-latent attention's projections are not among its targets yet: drop "
                                         f"--peft or --multi-latent-attention")
        require(not (m.qk_layernorm and m.q_lora_rank is None and m.transformer_impl != "transformer_engine"),
                "--qk-layernorm without --q-lora-rank normalizes the queries inside a fused norm-and-linear "
                "projection, which only transformer-engine has (megatron-core, mla_qk_norm_config.py:240-245); on the "
                "local layers add --q-lora-rank or drop --qk-layernorm")
        require(m.qk_pos_emb_head_dim % 2 == 0, f"--qk-pos-emb-head-dim {m.qk_pos_emb_head_dim} must be even: rotary "
                                                f"embedding rotates pairs of dimensions")
    require(m.rope_type != "yarn" or m.multi_latent_attention, "--rope-type yarn is multi-latent attention's rotary "
                                                               "embedding here; add --multi-latent-attention or drop it")
    require(m.add_position_embedding or m.position_embedding_type == "rope",
            f"--no-position-embedding is deprecated, and Megatron-LM refuses it without rope too "
            f"(--position-embedding-type {m.position_embedding_type}); use --position-embedding-type none for no "
            f"position embedding")
    for on, flag in ((m.rotary_interleaved, "--rotary-interleaved"), (m.no_rope_freq is not None, "--no-rope-freq")):
        require(not on or m.position_embedding_type == "rope",
                f"{flag} changes the rotary embedding, but --position-embedding-type is {m.position_embedding_type}; "
                f"add --position-embedding-type rope or drop it")
    if m.no_rope_freq is not None:
        pattern = layer_pattern(m.no_rope_freq, "--no-rope-freq", m.num_layers)
        require(not isinstance(pattern, int) or m.num_layers % pattern == 0,
                f"--no-rope-freq {pattern} must divide --num-layers {m.num_layers} (megatron-core repeats its pattern "
                f"over the layers)")
    if m.window_attn_skip_freq is not None:
        require(m.window_size is not None, "--window-attn-skip-freq picks the layers of --window-size's sliding "
                                           "window; add --window-size or drop it")
        layer_pattern(m.window_attn_skip_freq, "--window-attn-skip-freq", m.num_layers)
    if m.window_size is not None:
        parse_window_size(m.window_size)


# -- parallelism: tensor, pipeline (virtual stages, recomputation), context --------------------------


def pipeline_stage_layers(m: GPTModelProvider) -> list:
    """Layers per pipeline stage: --decoder-first/last-pipeline-num-layers where given, the rest evenly
    (megatron-core's num_layers_in_first/last_pipeline_stage). Uneven leftovers are for the caller to refuse."""
    pp, first, last = m.pipeline_model_parallel_size, m.num_layers_in_first_pipeline_stage, m.num_layers_in_last_pipeline_stage
    if pp == 1:
        return [m.num_layers]
    fixed = {0: first, pp - 1: last}
    middle = [i for i in range(pp) if fixed.get(i) is None]
    rest = m.num_layers - sum(v for v in fixed.values() if v is not None)
    even = rest // len(middle) if middle else 0
    return [fixed[i] if fixed.get(i) is not None else even for i in range(pp)]


def _virtual_stages_split(m: GPTModelProvider) -> bool:
    """Whether --num-virtual-stages-per-pipeline-rank splits the layers evenly (2 or more pipeline stages)."""
    v, pp = m.num_virtual_stages_per_pipeline_rank, m.pipeline_model_parallel_size
    return pp > 1 and m.num_layers % pp == 0 and (m.num_layers // pp) % v == 0


def derive_parallelism(cfg: ConfigContainer) -> None:
    """The data-parallel size; virtual stages as layers per stage; the p2p mode and the recompute settings
    each implies; sequence parallelism off without tensor parallelism ."""
    m = cfg.model
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    if min(tp, pp, cp) >= 1:
        cfg.data_parallel_size = cfg.get_data_parallel_size(cfg.world_size)
    v = m.num_virtual_stages_per_pipeline_rank
    # Megatron-LM's other way to ask for virtual stages, their number: said once, as layers per stage (what
    # run_config.yaml and generate.py read). One virtual stage per rank is no interleaving.
    if v is not None and v >= 1 and m.num_layers_per_virtual_pipeline_stage is None and (v == 1 or _virtual_stages_split(m)):
        if v > 1:
            derive_value(cfg, "model.num_layers_per_virtual_pipeline_stage", m.num_layers // pp // v,
                         "--num-layers / --pipeline-model-parallel-size / --num-virtual-stages-per-pipeline-rank")
        derive_value(cfg, "model.num_virtual_stages_per_pipeline_rank", None,
                     "said as --num-layers-per-virtual-pipeline-stage")
    n = m.num_layers_per_virtual_pipeline_stage
    if n is None:
        # As Megatron-LM: 1F1B has no p2p to overlap; its sends and receives go in batches.
        derive_value(cfg, "model.virtual_pipeline_model_parallel_size", None, "no virtual stages")
        for name, value in (("overlap_p2p_comm", False), ("overlap_p2p_comm_warmup_flush", False), ("batch_p2p_comm", True)):
            derive_value(cfg, f"model.{name}", value, "no virtual stages: 1F1B has no p2p to overlap")
    elif n > 0 and pp > 1 and (m.num_layers // pp) % n == 0:
        derive_value(cfg, "model.virtual_pipeline_model_parallel_size", (m.num_layers // pp) // n,
                     "--num-layers / --pipeline-model-parallel-size / --num-layers-per-virtual-pipeline-stage")
        derive_value(cfg, "model.batch_p2p_comm", not m.overlap_p2p_comm, "not --overlap-p2p-communication")
    if m.recompute_activations and m.recompute_granularity is None:
        derive_value(cfg, "model.recompute_granularity", "selective", "--recompute-activations")
    if m.recompute_granularity == "full" and m.recompute_num_layers is None:
        derive_value(cfg, "model.recompute_num_layers", 1, "--recompute-granularity full: one layer at a time")
    if tp == 1:
        derive_value(cfg, "model.sequence_parallel", False, "no tensor parallelism to split the sequence over")


def check_parallelism(cfg: ConfigContainer) -> None:
    """Tensor, pipeline and context sizes against the world and the model."""
    m = cfg.model
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    require(min(tp, pp, cp) >= 1, "parallel sizes must be at least 1")
    mp = tp * pp * cp
    require(cfg.world_size % mp == 0,
            f"tensor ({tp}) x pipeline ({pp}) x context ({cp}) parallel sizes = {mp} do not divide the world size "
            f"{cfg.world_size}; launch a multiple of {mp} processes or reduce the parallel sizes")
    require(m.num_attention_heads % tp == 0,
            f"--tensor-model-parallel-size {tp} must divide --num-attention-heads {m.num_attention_heads}")
    require(m.num_query_groups % tp == 0,
            f"--tensor-model-parallel-size {tp} must divide the number of query groups {m.num_query_groups}")
    check_pipeline_split(cfg)
    check_virtual_pipeline(cfg)
    check_recompute(cfg)
    check_context_parallel(cfg)


def check_pipeline_split(cfg: ConfigContainer) -> None:
    m = cfg.model
    v, pp = m.num_virtual_stages_per_pipeline_rank, m.pipeline_model_parallel_size
    if v is not None:  # left by derive_parallelism: it could not be said as layers per stage
        require(m.num_layers_per_virtual_pipeline_stage is None,
                "--num-virtual-stages-per-pipeline-rank and --num-layers-per-virtual-pipeline-stage both set the "
                "virtual stages; give one")
        require(v <= 1 or _virtual_stages_split(m),
                f"--num-virtual-stages-per-pipeline-rank {v} needs --pipeline-model-parallel-size 2 or more and "
                f"layers that split evenly: {m.num_layers} layers over {pp} stages of {v} virtual stages each")
    uneven = any(n is not None for n in (m.num_layers_in_first_pipeline_stage, m.num_layers_in_last_pipeline_stage))
    require(pp > 1 or not uneven, "--decoder-first/last-pipeline-num-layers set a pipeline stage's layers; add "
                                  "--pipeline-model-parallel-size 2 or more")
    for flag, n in (("first", m.num_layers_in_first_pipeline_stage), ("last", m.num_layers_in_last_pipeline_stage)):
        # megatron-core's TransformerConfig raises on every rank (transformer_config.py:1998, 2017); a multi-token
        # prediction layer does not make the last stage (megatron-core puts it after the decoder's last layer there)
        require(n is None or n > 0, f"--decoder-{flag}-pipeline-num-layers {n}: the {flag} pipeline stage needs a "
                                    f"decoder layer; give it 1 or more")
    stages = pipeline_stage_layers(m)
    split = "the layers the first/last stages leave" if uneven else "--num-layers"
    require(sum(stages) == m.num_layers and min(stages) >= 0,
            f"--pipeline-model-parallel-size {pp} must divide {split} evenly ({m.num_layers} layers); change "
            f"--num-layers, --decoder-first-pipeline-num-layers or --decoder-last-pipeline-num-layers")
    require(m.num_layers_per_virtual_pipeline_stage is None or not uneven,
            "--num-layers-per-virtual-pipeline-stage needs evenly split pipeline stages; drop "
            "--decoder-first/last-pipeline-num-layers")


def check_virtual_pipeline(cfg: ConfigContainer) -> None:
    """--num-layers-per-virtual-pipeline-stage: each pipeline rank holds
    (layers / pipeline size) / (layers per virtual stage) chunks and runs the interleaved schedule."""
    m = cfg.model
    n, pp = m.num_layers_per_virtual_pipeline_stage, m.pipeline_model_parallel_size
    if n is None:
        return
    require(pp > 1, "--num-layers-per-virtual-pipeline-stage interleaves pipeline stages; add "
                    "--pipeline-model-parallel-size 2 or more")
    require(n > 0 and (m.num_layers // pp) % n == 0,
            f"--num-layers-per-virtual-pipeline-stage {n} must divide the {m.num_layers // pp} layers of each pipeline "
            f"stage (--num-layers {m.num_layers} / --pipeline-model-parallel-size {pp})")
    require(m.overlap_p2p_comm or not m.overlap_p2p_comm_warmup_flush,
            "--overlap-p2p-communication-warmup-flush overlaps p2p communication; drop it or "
            "--no-overlap-p2p-communication")
    # megatron-core defect (README: defects): with 2 pipeline ranks the previous and the next rank are one
    # peer, and a batch of sends and receives to it pairs them in posting order, so activations land in gradient
    # buffers (p2p_communication.py:17-52). Megatron-LM asks for more than 2 ranks here too.
    require(not (pp == 2 and m.batch_p2p_comm),
            "--no-overlap-p2p-communication with --pipeline-model-parallel-size 2 and virtual stages swaps activations "
            "and gradients (megatron-core batches both directions to the one peer); drop "
            "--no-overlap-p2p-communication or use 3 or more pipeline stages")


def check_recompute(cfg: ConfigContainer) -> None:
    """The recompute settings, as megatron-core's TransformerConfig would assert them."""
    m = cfg.model
    require(not m.recompute_activations or m.recompute_granularity == "selective",
            "--recompute-activations means --recompute-granularity selective, not full; give one")
    require(m.recompute_granularity != "selective" or m.recompute_method is None,
            "--recompute-method applies to --recompute-granularity full; selective recomputation recomputes the core "
            "attention of every layer")
    require(m.recompute_granularity == "full" or not (m.recompute_method or m.recompute_num_layers),
            "--recompute-method and --recompute-num-layers need --recompute-granularity full")
    if m.recompute_granularity == "full":
        require(m.recompute_method is not None, "--recompute-granularity full needs --recompute-method uniform or block")
        most = max(pipeline_stage_layers(m)) if m.recompute_method == "block" else m.num_layers
        require(m.recompute_num_layers <= most,
                f"--recompute-num-layers {m.recompute_num_layers} is more than the {most} layers "
                f"{'of a pipeline stage' if m.recompute_method == 'block' else 'of the model'}")


def check_context_parallel(cfg: ConfigContainer) -> None:
    """Context parallelism: each rank holds two chunks of the sequence (to balance causal attention), and
    a2a+p2p needs the hierarchy of context-parallel groups it communicates over."""
    m = cfg.model
    cp, kinds, sizes = m.context_parallel_size, m.cp_comm_type, m.hierarchical_context_parallel_sizes
    known = ("p2p", "all_gather", "a2a", "a2a+p2p")
    bad = [k for k in kinds if k not in known]
    require(kinds and not bad, f"--cp-comm-type {' '.join(bad or kinds)}: expected {', '.join(known)}")
    require(len(kinds) in (1, m.num_layers), f"--cp-comm-type gives {len(kinds)} types; give one for all layers or "
                                             f"one per layer (--num-layers {m.num_layers})")
    require(cp == 1 or m.seq_length % (2 * cp) == 0,
            f"--seq-length {m.seq_length} must be a multiple of 2 x --context-parallel-size = {2 * cp} (each rank "
            f"holds two chunks)")
    require(cp == 1 or "a2a+p2p" not in kinds or sizes,
            "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes (e.g. 8 2 for 16 ranks over 2 nodes); "
            "without it context parallelism would not communicate")
    require(not sizes or math.prod(sizes) == cp,
            f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes or []))} multiply to "
            f"{math.prod(sizes or [])}, not --context-parallel-size {cp}")


# -- Mixture of Experts ----------------------------------------------------------------------------


def moe_layers(m: GPTModelProvider) -> list:
    """1 for each MoE layer, 0 for each dense one: --moe-layer-freq as Megatron-LM reads it (an integer N: layers 0, N,
    2N, ...), all 0 without --num-experts."""
    if not m.num_moe_experts:
        return [0] * m.num_layers
    pattern = layer_pattern(m.moe_layer_freq, "--moe-layer-freq", m.num_layers)
    return [int(i % pattern == 0) for i in range(m.num_layers)] if isinstance(pattern, int) else pattern


def derive_moe(cfg: ConfigContainer) -> None:
    """Megatron-LM's fill-ins: --num-experts 0 is no MoE; the experts' MLP size; the experts' tensor parallelism."""
    m = cfg.model
    if m.num_moe_experts == 0:
        derive_value(cfg, "model.num_moe_experts", None, "--num-experts 0: no MoE, as in Megatron-LM")
    if m.num_moe_experts and m.moe_ffn_hidden_size is None and m.ffn_hidden_size is not None:
        derive_value(cfg, "model.moe_ffn_hidden_size", m.ffn_hidden_size, "--ffn-hidden-size")
    if m.expert_tensor_parallel_size is None:
        derive_value(cfg, "model.expert_tensor_parallel_size", m.tensor_model_parallel_size,
                     "--tensor-model-parallel-size")


def check_multi_token_prediction(cfg: ConfigContainer) -> None:
    """--mtp-num-layers: what is not built for it here. (Megatron-LM's own refusal, position embeddings without
    position ids, cannot arise: every --position-embedding-type here takes them.)"""
    m = cfg.model
    if not m.mtp_num_layers:
        return
    require(cfg.peft.peft == "none", f"--peft {cfg.peft.peft} with --mtp-num-layers: the adapters' targets in the MTP "
                                     f"layers are not defined here yet; drop one")


def check_moe(cfg: ConfigContainer) -> None:
    """The MoE settings megatron-core's TransformerConfig does not check (check_transformer_config runs its checks: the
    router's score function, groups and capacity) and that its MoE layers would refuse later, and what needs a GPU:
    each a one-line error before anything is built."""
    m = cfg.model
    ep, etp, tp, pp = (m.expert_model_parallel_size, m.expert_tensor_parallel_size, m.tensor_model_parallel_size,
                       m.pipeline_model_parallel_size)
    require(ep >= 1 and etp >= 1, "--expert-model-parallel-size and --expert-tensor-parallel-size must be at least 1")
    # megatron-core builds the expert groups for every model, dense too: sizes that do not divide the world fail
    # in its initialize_model_parallel with a traceback
    require(cfg.world_size % (etp * ep * pp) == 0,
            f"expert tensor ({etp}) x expert ({ep}) x pipeline ({pp}) parallel sizes = {etp * ep * pp} do not divide "
            f"the world size {cfg.world_size}; launch a multiple of {etp * ep * pp} processes")
    if not m.num_moe_experts:
        require(ep == 1, f"--expert-model-parallel-size {ep} splits experts over ranks; add --num-experts (a multiple "
                         f"of {ep})")
        return
    n, k = m.num_moe_experts, m.moe_router_topk
    require(n > 0, f"--num-experts must be positive (0: no MoE), got {n}")
    require(n % ep == 0, f"--expert-model-parallel-size {ep} must divide --num-experts {n} (each rank holds "
                         f"num-experts / EP experts)")
    require(k <= n, f"--moe-router-topk {k} routes each token to more experts than --num-experts {n}; lower it")
    layers = moe_layers(m)
    require(any(layers), f"--moe-layer-freq {m.moe_layer_freq!r} makes no layer an MoE layer; mark at least one with "
                         f"a 1, or drop --num-experts")
    kinds, coeffs = m.moe_router_load_balancing_type, m.moe_aux_loss_coeff
    known = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
    bad = [t for t in kinds if t not in known]
    require(kinds and not bad, f"--moe-router-load-balancing-type {' '.join(bad or kinds)}: expected {', '.join(known)}")
    require(len(coeffs) == len(kinds), f"--moe-aux-loss-coeff gives {len(coeffs)} values for {len(kinds)} "
                                       f"--moe-router-load-balancing-type types; give one per type")
    g, gk = m.moe_router_num_groups, m.moe_router_group_topk
    require(not g or (n % g == 0 and (gk or 0) <= g),
            f"--moe-router-num-groups {g} must divide --num-experts {n}, and --moe-router-group-topk {gk} be at most it")
    require(not m.moe_shared_expert_overlap or m.moe_shared_expert_intermediate_size,
            "--moe-shared-expert-overlap overlaps the shared experts: add --moe-shared-expert-intermediate-size")
    require(not m.moe_shared_expert_overlap or m.moe_token_dispatcher_type in ("alltoall", "allgather"),
            "--moe-shared-expert-overlap works with the alltoall or allgather dispatcher")
    require(not (m.add_bias_linear and m.moe_shared_expert_intermediate_size),
            "megatron-core's shared experts have no biases (shared_experts.py); add --disable-bias-linear, or drop "
            "--moe-shared-expert-intermediate-size")
    require(not m.add_bias_linear or etp == 1,
            f"biases in MoE experts need --expert-tensor-parallel-size 1 (megatron-core); add "
            f"--disable-bias-linear or --expert-tensor-parallel-size 1")
    # megatron-core's MoELayer raises in training with tensor parallelism and no sequence parallelism (moe_layer.py:629);
    # inference (generate.py: --train-iters 0) runs without it, as megatron-core's own.
    require(tp == 1 or m.sequence_parallel or cfg.train.train_iters == 0,
            f"MoE with --tensor-model-parallel-size {tp} needs --sequence-parallel (megatron-core's MoE layer refuses "
            f"tensor parallelism without it)")
    te = m.transformer_impl == "transformer_engine"
    for flag, on in (("--moe-grouped-gemm", m.moe_grouped_gemm), ("--moe-permute-fusion", m.moe_permute_fusion),
                     ("--moe-router-fusion", m.moe_router_fusion)):
        require(not on or te, f"{flag} is a transformer-engine kernel (GPU, --transformer-impl transformer_engine); "
                              f"drop it")
    require(m.moe_token_dispatcher_type != "flex" or (cfg.use_gpu and te),
            "--moe-token-dispatcher-type flex is DeepEP's (GPU with transformer-engine); use alltoall or allgather")
    # gloo has no all-gather of unequal sizes, which the experts' tensor parallelism needs (token_dispatcher.py:739).
    require(etp == 1 or cfg.use_gpu,
            f"--expert-tensor-parallel-size {etp} needs a GPU (gloo has no uneven all-gather); add "
            f"--expert-tensor-parallel-size 1 (the default is --tensor-model-parallel-size)")


# -- batch sizes and the run's length --------------------------------------------------------------


def derive_batch_sizes_and_length(cfg: ConfigContainer) -> None:
    """The global batch (one micro batch per data-parallel rank) and --train-iters (from --train-samples, else the
    quick start's 300)."""
    t = cfg.train
    if t.global_batch_size is None:
        derive_value(cfg, "train.global_batch_size", t.micro_batch_size * cfg.data_parallel_size,
                     "--micro-batch-size x data-parallel size")
    gbs = t.global_batch_size
    if t.train_samples is not None and gbs > 0 and t.train_iters is None:
        derive_value(cfg, "train.train_iters", t.train_samples // gbs, "--train-samples / --global-batch-size")
    elif t.train_samples is None and t.train_iters is None:
        derive_value(cfg, "train.train_iters", 300, "neither --train-iters nor --train-samples: the quick start's")


def check_batch_sizes_and_length(cfg: ConfigContainer) -> None:
    """Batch sizes, the run's length, ramp-up and the reporting intervals."""
    m, t, lg = cfg.model, cfg.train, cfg.logger
    pp, dp, unit = m.pipeline_model_parallel_size, cfg.data_parallel_size, t.micro_batch_size * cfg.data_parallel_size
    require(t.global_batch_size > 0 and t.global_batch_size % unit == 0,
            f"--global-batch-size {t.global_batch_size} is not a multiple of --micro-batch-size {t.micro_batch_size} x "
            f"data-parallel size {dp} = {unit}; use a multiple of {unit}")
    microbatches = t.global_batch_size // unit  # at the full batch (ramp-up only grows to it)
    require(not m.virtual_pipeline_model_parallel_size or microbatches % pp == 0,
            f"the interleaved schedule runs microbatches in groups of --pipeline-model-parallel-size {pp}, but there "
            f"are {microbatches} per step; make --global-batch-size / (--micro-batch-size x data-parallel size) a "
            f"multiple of {pp}")
    # --train-iters equal to --train-samples / batch: a sample-based run_config.yaml, both written by derivation
    require(t.train_samples is None or t.train_iters == t.train_samples // t.global_batch_size,
            "--train-iters and --train-samples are exclusive; give one")
    require(t.train_samples is None or t.train_samples >= t.global_batch_size,
            f"--train-samples {t.train_samples} is less than one global batch ({t.global_batch_size})")
    check_rampup(cfg)
    require(t.train_iters >= 0, f"--train-iters must be non-negative, got {t.train_iters}")
    v = cfg.validation
    require(v.eval_interval is not None and v.eval_interval > 0, f"--eval-interval must be positive, got {v.eval_interval}")
    require(v.eval_iters is not None and v.eval_iters >= 0, f"--eval-iters must be non-negative, got {v.eval_iters}")
    require(lg.log_interval > 0, f"--log-interval must be positive, got {lg.log_interval}")
    require(lg.tensorboard_log_interval > 0,
            f"--tensorboard-log-interval must be positive, got {lg.tensorboard_log_interval}")
    require(lg.throughput_window_size >= 2, f"--throughput-window-size must be at least 2, got {lg.throughput_window_size}")
    require(lg.logging_level is None or lg.logging_level >= 0,
            f"--logging-level must be a logging level like 10 (DEBUG), 20 (INFO) or 30 (WARNING), got {lg.logging_level}")
    require(t.exit_interval is None or t.exit_interval > 0, f"--exit-interval must be positive, got {t.exit_interval}")
    require(isinstance(t.exit_signal, signal.Signals),
            f"--exit-signal {t.exit_signal} is not a signal name; use e.g. SIGTERM, SIGINT or SIGUSR1")


def check_rampup(cfg: ConfigContainer) -> None:
    """--rampup-batch-size START INCR SAMPLES, checked so megatron-core's RampupBatchsizeNumMicroBatchesCalculator
    never fails mid-run: every batch size on the way (START, START + INCR, ..., --global-batch-size) must split
    into microbatches on each data-parallel rank. Iteration-based only."""
    t, dp = cfg.train, cfg.data_parallel_size
    if t.rampup_batch_size is None:
        return
    unit, gbs = t.micro_batch_size * dp, t.global_batch_size
    require(len(t.rampup_batch_size) == 3, "--rampup-batch-size takes three numbers, START INCR SAMPLES (e.g. "
                                           "--rampup-batch-size 8 8 10000)")
    start, incr, samples = t.rampup_batch_size
    require(start > 0 and incr > 0 and samples >= 0,
            f"--rampup-batch-size {start} {incr} {samples}: START and INCR must be positive, SAMPLES non-negative")
    require(start < gbs, f"--rampup-batch-size START {start} must be less than --global-batch-size {gbs}, the batch it "
                         f"ramps up to; drop --rampup-batch-size for a constant batch")
    require((gbs - start) % incr == 0, f"--rampup-batch-size INCR {incr} does not divide --global-batch-size {gbs} - "
                                       f"START {start} = {gbs - start}; pick an INCR that does")
    require(start % unit == 0 and incr % unit == 0,
            f"--rampup-batch-size START {start} and INCR {incr} must be multiples of --micro-batch-size "
            f"{t.micro_batch_size} x data-parallel size {dp} = {unit}")
    require(t.train_samples is None, "--rampup-batch-size counts --train-iters iterations (as Megatron Bridge); use "
                                     "--train-iters instead of --train-samples")
    require(not (getattr(cfg.dataset, "sft", False) or getattr(cfg.dataset, "dataloader_type", None) == "batch"),
            "--rampup-batch-size does not work with the batch dataloader (--sft pads each fixed-size global batch); "
            "drop one")


# -- precision -------------------------------------------------------------------------------------


FP8_FIELDS = ("fp8", "fp8_recipe", "fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_param_gather")
LOSS_SCALING = ("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")


def derive_precision(cfg: ConfigContainer) -> None:
    """The NaN check off under fp16's dynamic loss scaling, and the dtype of megatron-core DDP's gradient buffer."""
    m, d, t, r = cfg.model, cfg.ddp, cfg.train, cfg.rerun_state_machine
    if m.fp16 and cfg.optimizer.loss_scale is None:
        # Megatron-LM: under dynamic loss scaling an Inf/NaN gradient is the scaler's signal to back off (the step
        # is skipped), not an error.
        derive_value(cfg, "train.check_for_nan_in_loss_and_grad", False,
                     "--fp16's dynamic loss scaling skips steps with Inf/NaN")
    if r.check_for_nan_in_loss and not t.check_for_nan_in_loss_and_grad:
        derive_value(cfg, "rerun_state_machine.check_for_nan_in_loss", False,
                     "train.check_for_nan_in_loss_and_grad is off")
    # The gradient buffer, as Megatron-LM's accumulate_allreduce_grads_in_fp32: fp32 with --bf16 (unless
    # --grad-reduce-in-bf16), the parameters' dtype otherwise (fp16 gradients under --fp16) unless
    # --accumulate-allreduce-grads-in-fp32. A value set in YAML or by a mixed_precision recipe stands unless one of
    # the two flags says otherwise; None lets model.megatron_ddp_config reduce in fp32 exactly when the weights are
    # bf16 (or fp16, when set so after validation).
    if d.grad_reduce_in_bf16 and not d.accumulate_allreduce_grads_in_fp32:
        derive_value(cfg, "ddp.grad_reduce_in_fp32", False, "--grad-reduce-in-bf16")
    elif d.accumulate_allreduce_grads_in_fp32 and not d.grad_reduce_in_bf16:
        derive_value(cfg, "ddp.grad_reduce_in_fp32", True, "--accumulate-allreduce-grads-in-fp32")
    elif d.grad_reduce_in_fp32 is None and m.fp16:
        derive_value(cfg, "ddp.grad_reduce_in_fp32", False, "--fp16: gradients reduced in fp16, as Megatron-LM")


def check_precision(cfg: ConfigContainer) -> None:
    """Precision settings that agree with each other: Bridge's checks, then FP8's and the gradient reduction's."""
    _validate_mixed_precision_consistency(cfg)
    check_fp8(cfg)
    d, m = cfg.ddp, cfg.model
    require(not (d.accumulate_allreduce_grads_in_fp32 and d.grad_reduce_in_bf16),
            "--accumulate-allreduce-grads-in-fp32 and --grad-reduce-in-bf16 are exclusive; pick one")
    require(m.bf16 or not d.grad_reduce_in_bf16,
            "--grad-reduce-in-bf16 reduces the gradients of --bf16 training in bf16; add --bf16 or drop it")


def _validate_mixed_precision_consistency(config: ConfigContainer) -> None:
    """Bridge's name, with Megatron-LM's `validate_args` for the loss-scaling flags: one half-precision type at
    most, loss-scaling settings only under --fp16 and within megatron-core's DynamicGradScaler's bounds."""
    m, o = config.model, config.optimizer
    require(not (m.bf16 and m.fp16), "--bf16 and --fp16 are exclusive; pick one")
    defaults = OptimizerConfig()
    changed = [name for name in LOSS_SCALING if getattr(o, name) != getattr(defaults, name)]
    if changed:
        flag = "--" + changed[0].replace("_", "-")
        require(m.fp16, f"{flag} {getattr(o, changed[0])} sets fp16 loss scaling, but --fp16 is not set "
                        f"({'bf16' if m.bf16 else 'fp32'} training needs no loss scale); add --fp16 or drop it")
    require(o.loss_scale is None or o.loss_scale > 0,
            f"--loss-scale must be positive, got {o.loss_scale}; omit it for dynamic loss scaling")
    require(0 < o.min_loss_scale <= o.initial_loss_scale,
            f"--min-loss-scale {o.min_loss_scale} must be positive and at most --initial-loss-scale {o.initial_loss_scale}")
    require(o.loss_scale_window >= 1 and o.hysteresis >= 1,
            f"--loss-scale-window ({o.loss_scale_window}) and --hysteresis ({o.hysteresis}) must be at least 1")


def check_fp8(cfg: ConfigContainer) -> None:
    """Megatron-LM's --fp8-* flags: FP8 runs inside transformer-engine's layers under megatron-core's fp8 contexts,
    which this trainer does not set up; without transformer-engine there is nothing to run it at all. Refused by
    name, before any work (--bf16 runs the same command line without them)."""
    m, defaults = cfg.model, GPTModelProvider()
    given = [name for name in FP8_FIELDS if getattr(m, name) != getattr(defaults, name)]
    if not given:
        return
    flag = flag_of("model", given[0])
    require(m.fp8 is not None, f"{flag} {_flag_value(getattr(m, given[0]))}sets FP8 training, but --fp8-format "
                                      f"is not set; drop it")
    what = f"--fp8-format {m.fp8}"
    require(package_installed("transformer_engine"),
            f"{what}: FP8 runs in transformer-engine's layers, and transformer-engine is not installed; drop the "
            f"--fp8-* flags (--bf16 trains without them)")
    require(False, f"{what}: this trainer does not drive transformer-engine's FP8 (megatron-core's fp8 contexts and "
                   f"FP8 weights); drop the --fp8-* flags (--bf16 trains without them)")


def _flag_value(value) -> str:
    """A flag's value as it follows the flag in a message: nothing for a switch."""
    return "" if isinstance(value, bool) else f"{value} "


def check_rerun_state_machine(cfg: ConfigContainer) -> None:
    """Settings of the rerun state machine that can do what they say (megatron-core's RerunStateMachine)."""
    r = cfg.rerun_state_machine
    require(r.spiky_loss_factor > 1, f"--spiky-loss-factor must be greater than 1 (a loss that many times the largest "
                                     f"seen), got {r.spiky_loss_factor}")
    require(r.error_injection_rate >= 0, f"--error-injection-rate must be non-negative, got {r.error_injection_rate}")
    require(not r.error_injection_rate or r.rerun_mode == "validate_results",
            f"--error-injection-rate tests the reruns of --rerun-mode validate_results, not {r.rerun_mode}; add "
            f"--rerun-mode validate_results")
    require(r.rerun_mode != "validate_results" or r.check_for_nan_in_loss or r.check_for_spiky_loss,
            "--rerun-mode validate_results has nothing to validate: the NaN check is off "
            "(--no-check-for-nan-in-loss-and-grad, or --fp16's dynamic loss scaling); add --check-for-spiky-loss or "
            "use --rerun-mode disabled")


# -- the optimizer and the learning-rate schedule --------------------------------------------------


def derive_optimizer_and_schedule(cfg: ConfigContainer) -> None:
    """Scheduler lengths in samples (Bridge's `ConfigContainer._calculate_scheduler_steps`, Megatron-LM's
    `get_optimizer_param_scheduler`): megatron-core's scheduler is stepped by the global batch size each iteration,
    so iteration counts are multiplied by it and sample counts are taken as they are.

    iteration-based: decay = (--lr-decay-iters or --train-iters) x batch, weight decay over --train-iters x batch,
                     warmup = --lr-warmup-fraction x decay, else --lr-warmup-iters x batch
    sample-based:    decay = --lr-decay-samples or --train-samples, weight decay over --train-samples,
                     warmup = --lr-warmup-fraction x decay, else --lr-warmup-samples
    WSD: the decay phase is --lr-wsd-decay-iters x batch / --lr-wsd-decay-samples, by default the whole decay
    (as Bridge; megatron-core needs a length).
    Also: the weight-decay schedule's ends from --weight-decay, and the distributed optimizer in both configs
    (_validate_and_sync_distributed_optimizer_settings).
    """
    # Each gradient bucket checked for NaN and Inf before the data-parallel reduce, as Megatron-LM sets it
    derive_value(cfg, "ddp.check_for_nan_in_grad", cfg.train.check_for_nan_in_loss_and_grad,
                 "--check-for-nan-in-loss-and-grad, as Megatron-LM's training.py:1989")
    t, s, o = cfg.train, cfg.scheduler, cfg.optimizer
    gbs = t.global_batch_size
    if t.train_samples is None:
        decay, why = (s.lr_decay_iters or t.train_iters) * gbs, "--lr-decay-iters or --train-iters, x batch"
        wd_incr, wsd = t.train_iters * gbs, s.lr_wsd_decay_iters * gbs if s.lr_wsd_decay_iters else None
        warmup, warmup_why = (s.lr_warmup_iters or 0) * gbs, "--lr-warmup-iters x batch"  # None: an old run_config.yaml
    else:
        decay, why = s.lr_decay_samples or t.train_samples, "--lr-decay-samples or --train-samples"
        wd_incr, wsd = t.train_samples, s.lr_wsd_decay_samples
        warmup, warmup_why = s.lr_warmup_samples, "--lr-warmup-samples"
    if s.lr_warmup_fraction is not None:
        warmup, warmup_why = s.lr_warmup_fraction * decay, "--lr-warmup-fraction x decay"
    # A run of no iterations (--skip-train, --train-iters 0) has nothing to schedule, but megatron-core's scheduler
    # still asserts a positive decay; and a run shorter than its warmup would never decay, so the warmup is capped
    # below the decay, as Bridge does.
    if decay < 1:
        decay, why = 1, "at least 1: megatron-core's scheduler asserts a positive decay"
    if warmup >= decay:
        warmup, warmup_why = decay - 1, "capped below the decay, as Bridge"
    derive_value(cfg, "scheduler.lr_decay_steps", decay, why + ", in samples")
    derive_value(cfg, "scheduler.lr_warmup_steps", warmup, warmup_why + ", in samples")
    derive_value(cfg, "scheduler.wd_incr_steps", wd_incr, "the run's samples")
    wsd_why = "--lr-wsd-decay-iters x batch or --lr-wsd-decay-samples"
    if s.lr_decay_style == "WSD" and wsd is None:
        wsd, wsd_why = decay, "WSD: the whole decay, as Bridge"
    derive_value(cfg, "scheduler.wsd_decay_steps", wsd, wsd_why)
    for name in ("start_weight_decay", "end_weight_decay"):
        if getattr(s, name) is None:
            derive_value(cfg, f"scheduler.{name}", o.weight_decay, "--weight-decay")
    if o.optimizer == "dist_muon":  # Megatron-LM 0.19's deprecated name (arguments.py:1672-1678)
        derive_value(cfg, "optimizer.optimizer", "muon", "--optimizer dist_muon, Megatron-LM's deprecated name for "
                                                         "--optimizer muon --use-distributed-optimizer")
        derive_value(cfg, "optimizer.use_distributed_optimizer", True, "--optimizer dist_muon")
    _validate_and_sync_distributed_optimizer_settings(cfg)


def _validate_and_sync_distributed_optimizer_settings(config: ConfigContainer) -> None:
    """Bridge's name, a derivation here: the distributed-optimizer setting lives in both the DDP and the optimizer
    config (megatron-core reads it from each); if either asks for it, both get it. --use-distributed-optimizer sets
    the optimizer's; the DDP's, settable from YAML or Python only, is said when it alone asks."""
    ddp_setting, optimizer_setting = config.ddp.use_distributed_optimizer, config.optimizer.use_distributed_optimizer
    if ddp_setting and not optimizer_setting and os.environ.get("RANK", "0") == "0":
        print(f"train.py: note: ddp.use_distributed_optimizer={ddp_setting} and optimizer.use_distributed_optimizer="
              f"{optimizer_setting} disagreed; using the distributed optimizer for both", file=sys.stderr)
    if ddp_setting or optimizer_setting:
        for setting in ("ddp.use_distributed_optimizer", "optimizer.use_distributed_optimizer"):
            derive_value(config, setting, True, "the distributed optimizer in both configs")


def check_emerging_optimizer(cfg: ConfigContainer) -> None:
    """What megatron-core's emerging-optimizer path (optimizer/__init__.py:725-985) and Megatron-LM's validation
    (arguments.py:1669-1687) refuse, and what this trainer does not build yet, one line each."""
    o = cfg.optimizer
    require(importlib.util.find_spec("emerging_optimizers") is not None,
            f"--optimizer {o.optimizer} is built from the emerging-optimizers package, which is not installed: "
            f"pip install emerging-optimizers")
    if o.use_distributed_optimizer:  # megatron-core's layer-wise distributed optimizer (model.wrap_model)
        # its base optimizers get megatron-core's wrappers only under bf16 (layer_wise_optimizer.py:503-516); in fp32
        # the chain of optimizers asserts at construction (optimizer.py:1440)
        require(cfg.model.bf16, f"--optimizer {o.optimizer} with --use-distributed-optimizer: megatron-core 0.19.2's "
                                f"layer-wise distributed optimizer is built for bf16 only; add --bf16")
        require(not cfg.ddp.overlap_param_gather,
                f"--optimizer {o.optimizer} with --use-distributed-optimizer and --overlap-param-gather: the layer-wise "
                f"optimizer's overlapped gather is not built here; drop --overlap-param-gather")
        require(not (cfg.model.num_moe_experts and cfg.model.add_bias_linear),
                f"--optimizer {o.optimizer} with --use-distributed-optimizer: megatron-core 0.19.2 does not shard the "
                f"experts' biases beside the layer-wise optimizer (optimizer/__init__.py:913-921); add "
                f"--disable-bias-linear")
    require(not cfg.model.fp16, f"--optimizer {o.optimizer} with --fp16: megatron-core's emerging optimizers do not "
                                f"support fp16 (optimizer/__init__.py:769); use --bf16")
    require(cfg.checkpoint.ckpt_format in ("torch", "torch_dist"),
            f"--optimizer {o.optimizer} with --ckpt-format {cfg.checkpoint.ckpt_format}: Megatron-LM saves an emerging "
            f"optimizer in torch or torch_dist only")


def check_optimizer_and_schedule(cfg: ConfigContainer) -> None:
    """The optimizer's numbers, the learning-rate schedule and megatron-core DDP's settings."""
    o, s, d = cfg.optimizer, cfg.scheduler, cfg.ddp
    # What megatron-core's own post-init refuses, in one line.
    require_finalizes(dataclasses.replace(o, bf16=cfg.model.bf16, fp16=cfg.model.fp16))
    require_finalizes(dataclasses.replace(d, grad_reduce_in_fp32=bool(d.grad_reduce_in_fp32)))
    if o.optimizer in MEGATRON_LM_EMERGING_OPTIMIZERS:
        check_emerging_optimizer(cfg)
    require(o.lr > 0, f"--lr must be positive, got {o.lr}")
    require(0 <= o.min_lr <= o.lr, f"--min-lr {o.min_lr} must be between 0 and --lr {o.lr}")
    require(o.clip_grad >= 0, f"--clip-grad must be non-negative, got {o.clip_grad}")
    require(o.decoupled_min_lr is None or o.decoupled_lr is not None,
            "--decoupled-min-lr ends the schedule of --decoupled-lr; add --decoupled-lr or drop it")
    if o.decoupled_lr is not None:
        low = o.min_lr if o.decoupled_min_lr is None else o.decoupled_min_lr
        require(low <= o.decoupled_lr, f"--decoupled-lr {o.decoupled_lr} is below its minimum {low} "
                                       f"({'--min-lr' if o.decoupled_min_lr is None else '--decoupled-min-lr'}); give "
                                       f"--decoupled-min-lr at most --decoupled-lr")
    require(not (s.override_opt_param_scheduler and s.use_checkpoint_opt_param_scheduler),
            "--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler are exclusive")
    check_schedule_lengths(cfg)
    require(s.weight_decay_incr_style != "constant" or s.start_weight_decay == s.end_weight_decay,
            "--start-weight-decay and --end-weight-decay differ but --weight-decay-incr-style is constant; use linear "
            "or cosine")
    # megatron-core's OptimizerParamScheduler asserts these; say so before its import.
    require(0 <= s.start_weight_decay <= s.end_weight_decay,
            f"--start-weight-decay {s.start_weight_decay} must be non-negative and at most --end-weight-decay "
            f"{s.end_weight_decay} (weight decay can only grow)")
    require(s.lr_warmup_init <= o.lr, f"--lr-warmup-init {s.lr_warmup_init} is above --lr {o.lr}; warmup rises to --lr")
    require(not d.overlap_param_gather or d.use_distributed_optimizer,
            "--overlap-param-gather needs --use-distributed-optimizer (it overlaps gathering that optimizer's "
            "parameter shards with the forward pass)")
    require(not d.overlap_param_gather or d.overlap_grad_reduce, "--overlap-param-gather needs --overlap-grad-reduce; "
                                                                 "add it")
    require(d.num_distributed_optimizer_instances == 1,
            f"--num-distributed-optimizer-instances {d.num_distributed_optimizer_instances}: partial distributed "
            f"optimizers need process groups this trainer does not create; use 1 (or drop it)")
    require(not (d.average_in_collective and cfg.model.calculate_per_token_loss),
            "--ddp-average-in-collective averages over data-parallel ranks, but --calculate-per-token-loss sums and "
            "divides by the tokens (megatron-core refuses both); drop one")


def check_schedule_lengths(cfg: ConfigContainer) -> None:
    """Iteration-based training takes the *-iters schedule flags, sample-based training the
    *-samples ones; --lr-warmup-fraction replaces either warmup length."""
    t, s = cfg.train, cfg.scheduler
    iters = [(s.lr_decay_iters, "--lr-decay-iters"), (s.lr_warmup_iters, "--lr-warmup-iters"),
             (s.lr_wsd_decay_iters, "--lr-wsd-decay-iters")]
    samples = [(s.lr_decay_samples, "--lr-decay-samples"), (s.lr_warmup_samples or None, "--lr-warmup-samples"),
               (s.lr_wsd_decay_samples, "--lr-wsd-decay-samples")]
    for value, flag in iters + samples:  # a warmup may be 0 (none), a decay may not
        require(value is None or value > 0 or (value == 0 and "warmup" in flag), f"{flag} must be positive, got {value}")
    for value, flag in iters if t.train_samples is not None else ():
        require(not value, f"{flag} is for iteration-based training; with --train-samples use "
                           f"{flag.replace('-iters', '-samples')}")
    for value, flag in samples if t.train_samples is None else ():
        require(value is None, f"{flag} is for sample-based training (--train-samples); with --train-iters use "
                               f"{flag.replace('-samples', '-iters')}")
    if s.lr_warmup_fraction is not None:
        require(0 <= s.lr_warmup_fraction <= 1, f"--lr-warmup-fraction must be between 0 and 1, got "
                                                f"{s.lr_warmup_fraction}")
        require(not (s.lr_warmup_iters or s.lr_warmup_samples),
                "--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples are exclusive; give one")


# -- data and the tokenizer ------------------------------------------------------------------------


def blend_of(paths) -> Optional[tuple]:
    """A data path ('0.7 A 0.3 B', or prefixes; one string or many) as megatron-core's blend: get_blend_from_list."""
    words = [word for path in ([paths] if isinstance(paths, str) else paths or []) for word in str(path).split()]
    return get_blend_from_list(words) if words else None


def derive_data(cfg: ConfigContainer) -> None:
    d, tk = cfg.dataset, cfg.tokenizer
    if getattr(d, "dataset_root", None):  # Bridge's finetuning layout: one file per split
        for setting, name, wanted in (("train_data_path", "training", True), ("valid_data_path", "validation",
                                      d.do_validation), ("test_data_path", "test", d.do_test)):
            if wanted and not getattr(d, setting):
                derive_value(cfg, f"dataset.{setting}", [os.path.join(str(d.dataset_root), f"{name}.jsonl")],
                             "dataset.dataset_root")
    if isinstance(d, GPTDatasetConfig):  # megatron-core's settings that Megatron-LM's flags imply
        split_paths = [d.train_data_path, d.valid_data_path, d.test_data_path]
        if any(split_paths) and not d.sft:
            derive_value(cfg, "dataset.blend_per_split", [blend_of(p) for p in split_paths], "--train/valid/test-data-path")
            derive_value(cfg, "dataset.split", None, "megatron-core takes no split with per-split paths")
        elif d.data_path and not d.sft:
            derive_value(cfg, "dataset.blend", blend_of(d.data_path), "--data-path")
        derive_value(cfg, "dataset.sequence_length", cfg.model.seq_length, "--seq-length")
        derive_value(cfg, "dataset.random_seed", cfg.rng.seed, "--seed")
        if d.create_attention_mask and not d.reset_attention_mask:
            derive_value(cfg, "dataset.create_attention_mask", False, "causal attention needs none")
    if d.pin_memory and not cfg.use_gpu:
        derive_value(cfg, "dataset.pin_memory", False, "no GPU: page-locked memory speeds up copies to one")
    if d.persistent_workers and d.num_workers == 0:
        derive_value(cfg, "dataset.persistent_workers", False, "--num-workers 0: no workers to keep")
    if d.dataloader_type is None:
        derive_value(cfg, "dataset.dataloader_type", "batch" if d.sft else "single",
                     "--sft pads each global batch" if d.sft else "one pass in order")
    if tk.tokenizer_type == "HuggingFaceTokenizer" and not tk.tokenizer_model and uses_builtin_corpus(cfg):
        derive_value(cfg, "tokenizer.tokenizer_model", builtin_bpe_path(cfg),
                     f"the built-in corpus's byte-level BPE tokenizer ({BUILTIN_BPE_VOCAB:,} tokens), trained on it on "
                     f"first use")


# `train.py` with no flag at all is the quick start (README: Quick start). Every flag keeps its default, Megatron-LM's
# where it has one; these are the quick start's own settings on top, for a model that visibly learns the built-in
# corpus in about 3 minutes on 2 CPU processes: a BPE tokenizer trained on the corpus (3.7 bytes a token against
# the bytes' 1), shorter sequences and a larger batch, a higher peak rate reached by warmup and left by cosine decay,
# no dropout (a small model on a small corpus underfits), and 400 iterations. Any flag given leaves them all out.
QUICK_START = ["--tokenizer-type", "HuggingFaceTokenizer", "--seq-length", "128", "--micro-batch-size", "8",
               "--global-batch-size", "16", "--lr", "3e-3", "--lr-warmup-iters", "30", "--lr-decay-style", "cosine",
               "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "400"]
BUILTIN_BPE_VOCAB = 2048


def uses_builtin_corpus(cfg: ConfigContainer) -> bool:
    """No data given: the run trains on the built-in corpus (data.builtin_corpus_prefix)."""
    d = cfg.dataset
    return isinstance(d, GPTDatasetConfig) and not (d.mock or d.sft or d.blend or d.blend_per_split)  # once derived


def builtin_corpus_cache(cfg: ConfigContainer) -> str:
    """Where the built-in corpus's datasets and tokenizer are kept: --data-cache-path, else ~/.cache/train-py."""
    return getattr(cfg.dataset, "path_to_cache", None) or os.path.join(os.path.expanduser("~"), ".cache", "train-py")


def builtin_bpe_path(cfg: ConfigContainer) -> str:
    """Where the built-in corpus's BPE tokenizer is kept (trained by data.build_tokenizer on first use)."""
    return os.path.join(builtin_corpus_cache(cfg), f"pydoc_topics_bpe{BUILTIN_BPE_VOCAB}", "tokenizer.json")


def check_data(cfg: ConfigContainer) -> None:
    d = cfg.dataset
    split_paths, mock = [d.train_data_path, d.valid_data_path, d.test_data_path], getattr(d, "mock", False)
    require(not (mock and (d.data_path or any(split_paths))),
            "--mock-data and --data-path/--train-data-path are exclusive; drop one")
    require(not (d.data_path and any(split_paths)),
            "--data-path and --train/valid/test-data-path are exclusive; use --split with --data-path")
    try:
        parts = [float(x) for x in (d.split or "1").replace("/", ",").split(",")]  # None: the per-split paths'
    except ValueError:
        raise ConfigError(f"--split {d.split}: expected comma-separated numbers like 969,30,1") from None
    require(len(parts) <= 3 and all(p >= 0 for p in parts) and sum(parts) > 0,
            f"--split {d.split}: expected up to three non-negative proportions like 969,30,1")
    require(d.dataloader_type != "batch" or d.sft, "--dataloader-type batch pads variable-length examples: it needs --sft")
    require(not d.sft_pack_sequences or d.sft, "--sft-pack-sequences needs --sft")
    require(not d.sft or d.data_path or d.train_data_path,
            "--sft needs --data-path (or --train-data-path): JSONL files of prompt/response pairs")
    require(not (d.sft and mock), "--sft reads JSONL files: give --data-path (or --train-data-path), not --mock-data")
    require(d.num_workers >= 0, f"--num-workers must be non-negative, got {d.num_workers}")
    check_finetuning_dataset(cfg)
    require(d.drop_last, "dataset.drop_last False would give a short last batch; every step here takes a whole "
                         "global batch (Megatron's samplers drop it): drop the setting")
    require(d.data_sharding or d.dataloader_type == "cyclic",
            "--no-data-sharding changes how the cyclic loader shuffles; give --dataloader-type cyclic, or drop it")
    most = max(8, 4 * (os.cpu_count() or 1))  # each worker a forked process: thousands would exhaust the machine
    require(d.num_workers <= most, f"--num-workers {d.num_workers} would fork more DataLoader processes per rank than 4 "
                                   f"per CPU core here; use at most {most}")
    for flag, paths in (("--data-path", d.data_path), ("--train-data-path", d.train_data_path),
                        ("--valid-data-path", d.valid_data_path), ("--test-data-path", d.test_data_path)):
        prefixes, weights = blend_of(paths) or ([], None)
        require(not weights or (min(weights) >= 0 and sum(weights) > 0),
                f"{flag}: the weights {weights} must be non-negative and not all zero")
        for prefix in prefixes:
            if d.sft:
                require(os.path.isfile(prefix),
                        f"{flag}: {prefix} not found; with --sft give JSONL files of prompt/response pairs")
                continue
            for ext in (".bin", ".idx"):
                require(os.path.isfile(prefix + ext),
                        f"{flag}: {prefix}{ext} not found; give the prefix of an indexed dataset (PREFIX.bin and "
                        f"PREFIX.idx, e.g. from `python data.py preprocess`)")
    if isinstance(d, GPTDatasetConfig):
        require(d.create_attention_mask or not d.reset_attention_mask, "--reset-attention-mask is an attention mask "
                "the dataloader builds, and --no-create-attention-mask-in-dataloader builds none; drop one")
        require_finalizes(dataclasses.replace(d))  # on a copy: data.py finalizes the section's, with the tokenizer
    check_tokenizer(cfg)
    require(not uses_builtin_corpus(cfg) or cfg.tokenizer.tokenizer_type in ("ByteTokenizer", "HuggingFaceTokenizer"),
            "the built-in corpus is text; use --tokenizer-type ByteTokenizer or HuggingFaceTokenizer, or give "
            "--data-path/--mock-data")


PACKED_SPECS = {"packed_sequence_size", "max_single_sequence_length", "tokenizer_model_name", "num_tokenizer_workers",
                "packed_train_data_path", "packed_val_data_path", "packed_metadata_path", "pad_cu_seqlens",
                "pad_seq_to_mult"}  # Bridge's PackedSequenceSpecs (data/packing/config.py)


def check_finetuning_dataset(cfg: ConfigContainer) -> None:
    """A FinetuningDatasetConfig's own settings: Bridge's dataset_root layout, its packed-sequence files, the
    JSONL keys."""
    d = cfg.dataset
    if not isinstance(d, FinetuningDatasetConfig):
        return
    if d.dataset_root:
        require(os.path.isdir(d.dataset_root), f"dataset.dataset_root {d.dataset_root}: no such directory")
        for path, name in ((d.train_data_path, "training"), (d.valid_data_path, "validation"), (d.test_data_path, "test")):
            for p in path or ():
                require(os.path.isfile(p), f"dataset.dataset_root {d.dataset_root}: no {os.path.basename(p)} in it "
                                           f"(Bridge's layout: training.jsonl, validation.jsonl, test.jsonl; set "
                                           f"do_validation / do_test false for a split you do not have)")
    specs = d.packed_sequence_specs or {}
    require(isinstance(specs, dict), "dataset.packed_sequence_specs: expected a mapping of Bridge's "
                                     "PackedSequenceSpecs fields")
    unknown = sorted(set(specs) - PACKED_SPECS)
    require(not unknown, f"dataset.packed_sequence_specs: unknown field {', '.join(unknown)}; Bridge's fields are "
                         f"{', '.join(sorted(PACKED_SPECS))}")
    size = specs.get("packed_sequence_size", -1)
    require(size in (-1, None, cfg.model.seq_length), f"dataset.packed_sequence_specs.packed_sequence_size {size} "
                                                      f"must be --seq-length {cfg.model.seq_length}")
    for key in ("packed_train_data_path", "packed_val_data_path"):
        require(not specs.get(key) or os.path.isfile(specs[key]),
                f"dataset.packed_sequence_specs.{key}: {specs.get(key)} not found (a .npy file from Bridge's "
                f"prepare_packed_sequence_data)")
    unknown = sorted(set(d.dataset_kwargs or {}) - {"prompt_key", "response_key"})
    require(not unknown, f"dataset.dataset_kwargs: {', '.join(unknown)} is not an option of the finetuning dataset "
                         f"here (prompt_key, response_key)")


def check_tokenizer(cfg: ConfigContainer) -> None:
    tk = cfg.tokenizer
    check_megatron_lm_tokenizer(tk)
    require(tk.tokenizer_type != "NullTokenizer" or tk.vocab_size, "--tokenizer-type NullTokenizer needs --vocab-size")
    require(tk.tokenizer_type == "NullTokenizer" or tk.vocab_size is None,
            f"--vocab-size is only for --tokenizer-type NullTokenizer; {tk.tokenizer_type} has its own vocabulary")
    if tk.tokenizer_type == "HuggingFaceTokenizer":
        require(tk.tokenizer_model, "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a tokenizer.json "
                                    "or its directory)")
        model_file = (os.path.join(tk.tokenizer_model, "tokenizer.json") if os.path.isdir(tk.tokenizer_model)
                      else tk.tokenizer_model)
        require(os.path.isfile(model_file) or tk.tokenizer_model == builtin_bpe_path(cfg),  # else trained at setup
                f"--tokenizer-model {tk.tokenizer_model}: no tokenizer.json there")
        require(package_installed("tokenizers"),
                "--tokenizer-type HuggingFaceTokenizer needs the tokenizers package: pip install tokenizers")
    require(tk.tokenizer_type == "HuggingFaceTokenizer" or not tk.tokenizer_model,
            "--tokenizer-model is only for --tokenizer-type HuggingFaceTokenizer")


def check_megatron_lm_tokenizer(tk: TokenizerConfig) -> None:
    """Megatron-LM's tokenizer types that have no tokenizer here, and their files: one line saying what to use."""
    require(tk.tokenizer_type not in MEGATRON_LM_TOKENIZERS or tk.tokenizer_type == "GPT2BPETokenizer",
            f"--tokenizer-type {tk.tokenizer_type} is Megatron-LM's and not built in here; use HuggingFaceTokenizer "
            f"with the model's tokenizer.json, NullTokenizer or ByteTokenizer")
    vocab, merges = tk.vocab_file or "gpt2-vocab.json", tk.merge_file or "gpt2-merges.txt"
    require(not (tk.tokenizer_type == "GPT2BPETokenizer" or tk.vocab_file or tk.merge_file),  # GPT-2's files, any type
            f"--tokenizer-type GPT2BPETokenizer (--vocab-file, --merge-file) is not built in here; convert the two "
            f"files once with python -c \"from tokenizers import ByteLevelBPETokenizer as T; T('{vocab}', "
            f"'{merges}').save('tokenizer.json')\" and give --tokenizer-type HuggingFaceTokenizer --tokenizer-model "
            f"tokenizer.json")


def check_fim(cfg: ConfigContainer) -> None:
    """--fim-* settings: FIM needs real data and its sentinel tokens."""
    d = cfg.dataset
    if not getattr(d, "fim_data", False):  # a FinetuningDatasetConfig has no FIM settings
        given = [f.name for f in dataclasses.fields(d) if f.name.startswith("fim_") and getattr(d, f.name) != f.default]
        require(not given, f"--{given[0].replace('_', '-') if given else ''} is a Fill-in-the-Middle setting; add "
                           f"--fim-data")
        return
    require(not (d.mock or d.sft), f"--fim-data reorders pretraining documents; it does not apply to "
                                   f"{'--mock-data' if d.mock else '--sft'}")
    for flag, rate in (("--fim-rate", d.fim_rate), ("--fim-spm-rate", d.fim_spm_rate),
                       ("--fim-fragment-rate", d.fim_fragment_rate)):
        require(rate is None or 0.0 <= rate <= 1.0, f"{flag} is a probability; give a value in [0, 1], got {rate}")
    names = [d.fim_prefix_token, d.fim_middle_token, d.fim_suffix_token, d.fim_pad_token]
    require(all(names) and len(set(names)) == 4,
            f"--fim-prefix/middle/suffix/pad-token must be four different non-empty names, got {names}")
    require(d.fim_split_sample != "" and d.fim_no_prefix != "", "--fim-split-sample and --fim-no-prefix need non-empty "
                                                                "text")


# -- the trackers ----------------------------------------------------------------------------------


def derive_loggers(cfg: ConfigContainer) -> None:
    lg = cfg.logger
    if isinstance(lg.mlflow_tags, list) and all("=" in tag for tag in lg.mlflow_tags):
        derive_value(cfg, "logger.mlflow_tags", dict(tag.split("=", 1) for tag in lg.mlflow_tags),
                     "--mlflow-tags KEY=VALUE words")


def _import_logger(module: str, flag: str, pip: str):
    """The tracker's package, imported now, so a missing one is a one-line error before any work."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"{flag} needs the {module} package, which does not import ({reason}); pip install {pip}")


def check_loggers(cfg: ConfigContainer) -> None:
    """W&B, MLflow and Comet settings: each tracker is on when its switch is set (Bridge's LoggerConfig.finalize
    checks the MLflow dependency; here every tracker's package and store are checked before any work)."""
    lg = cfg.logger
    for prefix, switch in (("wandb_", "wandb_project"), ("mlflow_", "mlflow_experiment"), ("comet_", "comet_project")):
        given = [f.name for f in dataclasses.fields(lg) if f.name.startswith(prefix) and getattr(lg, f.name)]
        require(not given or getattr(lg, switch), f"--{given[0].replace('_', '-') if given else ''} needs "
                                                  f"--{switch.replace('_', '-')}, which turns that logger on")
    bad = [tag for tag in lg.mlflow_tags if "=" not in tag] if isinstance(lg.mlflow_tags, list) else []
    require(not bad, f"--mlflow-tags {bad[0] if bad else ''}: expected KEY=VALUE pairs, e.g. --mlflow-tags team=nlp "
                     f"size=125m")
    # Comet first: it asks to be imported before the libraries it watches (mlflow among them).
    if lg.comet_project:
        comet_ml = _import_logger("comet_ml", "--comet-project", "comet_ml")
        comet_config = comet_ml.config.get_config()
        online = comet_config["comet.start.online"] is not False and not comet_config["comet.offline"]
        require(not online or lg.comet_api_key or comet_config["comet.api_key"],
                "--comet-project: no Comet API key; set COMET_API_KEY (or run `comet login`), or set "
                "COMET_START_ONLINE=0 to write an offline experiment")
    if lg.wandb_project:
        _import_logger("wandb", "--wandb-project", "wandb")
        require(lg.wandb_exp_name, "--wandb-project needs --wandb-exp-name (the run's name), as in Megatron-LM")
    if lg.mlflow_experiment:
        mlflow = _import_logger("mlflow", "--mlflow-experiment", "mlflow-skinny")
        check_mlflow_store(lg.mlflow_tracking_uri or mlflow.get_tracking_uri())


def check_mlflow_store(uri: str) -> None:
    """MLflow 3 opens a file store (a path or file://) only with MLFLOW_ALLOW_FILE_STORE=true, and a database store
    (its default is sqlite:///mlflow.db) only with SQLAlchemy, which mlflow-skinny lacks: say so now, not mid-run."""
    scheme = uri.split("://", 1)[0] if "://" in uri else "file"
    if scheme == "file":
        from mlflow import environment_variables

        allow = getattr(environment_variables, "MLFLOW_ALLOW_FILE_STORE", None)  # absent: an MLflow that allows it
        require(allow is None or allow.get(),
                f"MLflow tracking store {uri} is a file store, which MLflow opens only with MLFLOW_ALLOW_FILE_STORE=true; "
                f"set it, or give --mlflow-tracking-uri http://HOST:PORT")
    elif scheme.split("+")[0] in ("sqlite", "postgresql", "mysql", "mssql"):
        require(package_installed("sqlalchemy"),
                f"MLflow tracking store {uri} is a database, which needs the full mlflow package (pip install mlflow); "
                f"or give --mlflow-tracking-uri http://HOST:PORT, or file:///DIR with MLFLOW_ALLOW_FILE_STORE=true")


# -- checkpoints, the machine, fine-tuning, determinism, profiling ----------------------------------


def check_checkpointing(cfg: ConfigContainer) -> None:
    """Save intervals and formats."""
    c, o = cfg.checkpoint, cfg.optimizer
    require(c.save_interval is None or c.save_interval > 0, f"--save-interval must be positive, got {c.save_interval}")
    require(c.most_recent_k == -1 or c.most_recent_k > 0, f"--most-recent-k must be positive or -1, got {c.most_recent_k}")
    require(c.ckpt_format == "torch_dist" or not o.use_distributed_optimizer,
            "--ckpt-format torch keeps one copy of the optimizer per tensor/pipeline rank, but --use-distributed-optimizer "
            "shards it over data-parallel ranks; use --ckpt-format torch_dist")
    # Megatron-LM's torch format names its files by tensor, pipeline and expert rank (mp_rank_TT_PPP_EEE): the experts'
    # tensor-parallel rank must follow from the tensor-parallel one
    tp, etp = cfg.model.tensor_model_parallel_size, cfg.model.expert_tensor_parallel_size
    require(c.ckpt_format != "torch" or not cfg.model.num_moe_experts or tp % etp == 0,
            f"--ckpt-format torch names its files by tensor, pipeline and expert rank, but --expert-tensor-parallel-size "
            f"{etp} splits the experts over ranks those names do not tell apart (it must divide "
            f"--tensor-model-parallel-size {tp}); use --ckpt-format torch_dist")
    require(not c.async_save or c.save, "--async-save writes checkpoints in the background but --no-save saves nothing; "
                                        "drop one")
    require(not c.strict_fsdp_dtensor_load, "checkpoint.strict_fsdp_dtensor_load: there is no FSDP and no fsdp_dtensor "
                                            "checkpoint format here; drop the setting")
    require(c.custom_manager_class is None or "." in c.custom_manager_class,
            f"checkpoint.custom_manager_class {c.custom_manager_class}: expected a dotted path like "
            f"mypackage.module.MyCheckpointManager")


def nvrx_async_unusable() -> Optional[str]:
    """Why nvidia-resiliency-ext cannot write --async-save's checkpoints (megatron-core 0.19.2's nvrx.py needs 0.6.0 or
    later), or None when it can."""
    import importlib.metadata

    try:
        version = importlib.metadata.version("nvidia-resiliency-ext")
    except importlib.metadata.PackageNotFoundError:
        return "nvidia-resiliency-ext is not installed"
    if tuple(int(x) for x in version.split(".")[:2] if x.isdigit()) < (0, 6):
        return f"nvidia-resiliency-ext {version} is older than the 0.6.0 megatron-core needs"
    return None


def derive_checkpointing(cfg: ConfigContainer) -> None:
    c = cfg.checkpoint
    done = dataclasses.replace(c)
    require_finalizes(done)  # megatron-core's post-init: its checks, and async_strategy mcore without --async-save
    for f in dataclasses.fields(c):
        derive_value(cfg, f"checkpoint.{f.name}", getattr(done, f.name), "megatron-core's CheckpointConfig post-init")
    if c.async_save and c.async_strategy == "nvrx":
        why = nvrx_async_unusable()
        if why:  # the seed's fallback
            derive_value(cfg, "checkpoint.async_strategy", "mcore", why)


def derive_machine(cfg: ConfigContainer) -> None:
    m = cfg.model
    if m.transformer_impl is None:
        te = cfg.use_gpu and package_installed("transformer_engine")
        derive_value(cfg, "model.transformer_impl", "transformer_engine" if te else "local",
                     "a GPU and transformer-engine" if te else "no GPU" if not cfg.use_gpu else
                     "transformer-engine is not installed")
    if m.cp_comm_type is None:
        # Megatron-LM's default, p2p, is transformer-engine's ring attention; the local layers' context parallelism
        # is SDPAttention's all-gather of keys and values. Only a p2p or a2a asked for is refused (check_machine).
        if m.context_parallel_size > 1 and m.transformer_impl == "local":
            derive_value(cfg, "model.cp_comm_type", ["all_gather"],
                         f"--context-parallel-size {m.context_parallel_size} on the local layers: SDPAttention gathers "
                         f"keys and values (Megatron-LM's default p2p is transformer-engine's ring)")
        else:
            derive_value(cfg, "model.cp_comm_type", ["p2p"], "not given: Megatron-LM's default")


def check_machine(cfg: ConfigContainer) -> None:
    """What this machine can run: the layer implementation, and the GPU-only features refused on CPU."""
    m = cfg.model
    cp, te = m.context_parallel_size, m.transformer_impl == "transformer_engine"
    require(not (te and backend(m.attention_backend) is AttnBackend.local),
            "--attention-backend local picks the core attention of megatron-core's local layers, and transformer-engine "
            "layers use TE's own; add --transformer-impl local to use it")
    if not cfg.use_gpu:
        for gpu_only, what in ((te, "--transformer-impl transformer_engine"),
                               (cfg.dist.distributed_backend == "nccl", "--distributed-backend nccl")):
            require(not gpu_only, f"{what} needs a GPU and none is visible; drop it to train on CPU (every parallelism, "
                                  f"the distributed optimizer, --bf16 and --fp16 run on CPU)")
    elif te:
        require(package_installed("transformer_engine"),
                "--transformer-impl transformer_engine: transformer-engine is not installed; pip install "
                "transformer-engine[pytorch] or use --transformer-impl local")
    if cp > 1 and not te:
        # The local layers' context parallelism is SDPAttention's (model.py): keys and values all-gathered over the
        # CP group. megatron-core's own DotProductAttention refuses CP, and the ring (p2p) and all-to-all exchanges
        # are transformer-engine's.
        needs_dpa = ("--window-size" if m.window_size is not None else f"--softmax-type {m.softmax_type}"
                     if m.softmax_type != "vanilla" else "--attention-backend local" if backend(m.attention_backend) is AttnBackend.local
                     else None)
        require(needs_dpa is None, f"{needs_dpa} runs in megatron-core's DotProductAttention, which refuses "
                                   f"--context-parallel-size {cp}; the local layers' context parallelism is SDPAttention's: "
                                   f"drop {needs_dpa.split()[0] if needs_dpa else ''}, or use transformer-engine layers on a GPU")
        kinds = sorted(set(m.cp_comm_type) - {"all_gather"})
        require(not kinds, f"--cp-comm-type {' '.join(kinds)} is transformer-engine's context-parallel attention; the "
                           f"local layers gather keys and values: add --cp-comm-type all_gather (or use "
                           f"--transformer-impl transformer_engine on a GPU)")
    require(not m.layernorm_zero_centered_gamma or te,
            "--apply-layernorm-1p (zero-centred gamma) needs transformer-engine layers: megatron-core's local layers "
            "build a torch LayerNorm, which has none (as in Megatron-LM without apex); add --transformer-impl "
            "transformer_engine on a GPU with transformer-engine, or drop it")
    require(not (m.fp32_residual_connection and (m.bf16 or m.fp16)) or te,
            "--fp32-residual-connection needs transformer-engine layers: the local layers' torch norms take no fp32 "
            "input with half-precision weights; add --transformer-impl transformer_engine on a GPU with "
            "transformer-engine, or drop it")
    if not te and backend(m.attention_backend) is not AttnBackend.local:
        for on, what in ((m.window_size is not None, f"--window-size {m.window_size}"),
                         (m.softmax_type != "vanilla", f"--softmax-type {m.softmax_type}")):
            require(not on, f"{what} runs in megatron-core's own core attention, and the local layers use PyTorch's "
                            f"SDPA unless asked; add --attention-backend local")
    if te:
        # transformer-engine takes query-key layer scaling from the environment only; megatron-core checks they agree.
        env = os.environ.get("NVTE_APPLY_QK_LAYER_SCALING", "0").strip() not in ("", "0")
        require(env or not m.apply_query_key_layer_scaling,
                "--apply-query-key-layer-scaling with transformer-engine layers needs NVTE_APPLY_QK_LAYER_SCALING=1 in "
                "the environment (transformer-engine reads it there); set it")
        require(m.apply_query_key_layer_scaling or not env,
                "NVTE_APPLY_QK_LAYER_SCALING asks transformer-engine for query-key layer scaling; add "
                "--apply-query-key-layer-scaling or unset it")


def machine_memory_bytes(cfg: ConfigContainer) -> Optional[int]:
    """What the run must fit in: one GPU's memory per rank, or this machine's RAM, shared by its ranks. None when
    it cannot be told (a GPU visible to a torch that cannot use it: that is its own error)."""
    if cfg.use_gpu:
        import torch

        return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB"


def check_fits_in_memory(cfg: ConfigContainer) -> None:
    """A run whose model or dataset index cannot fit is refused before anything is built (else the allocator or
    megatron-core's dataset builder dies with a traceback): by train.py's command line before its imports, and by
    every run's setup (train.setup, generate.load_model, hf.py's import); not by validation, as a config may
    describe a model larger than this machine. Lower bounds, so a run that fits is never refused: the weights,
    gradients and optimizer state of the theoretical memory report (metrics.parameters_per_stage and
    weight_and_optimizer_bytes, after Bridge's theoretical_memory_utils: 16 bytes a parameter in fp32, 18 in mixed
    precision, the optimizer's part sharded by --use-distributed-optimizer), one microbatch's logits and layer inputs
    (metrics.activation_floor); and megatron-core's sample index, 16 bytes per sample (its sample-to-document pairs
    and its shuffle)."""
    import metrics  # the theoretical memory's own count (imported here: metrics imports this module)

    m, t = cfg.model, cfg.train
    total = machine_memory_bytes(cfg)
    if total is None or None in (m.kv_channels, m.num_query_groups, m.ffn_hidden_size, m.max_position_embeddings):
        return
    divisible = m.make_vocab_size_divisible_by * m.tensor_model_parallel_size
    vocab = {"ByteTokenizer": 257, "NullTokenizer": (cfg.tokenizer.vocab_size or 0) + 1}.get(cfg.tokenizer.tokenizer_type, 1)
    padded_vocab = -(-vocab // divisible) * divisible
    # A run that trains holds weights, gradients and the optimizer's state; one that does not (generate.py, hf.py's
    # import: --train-iters 0) only the weights.
    trains = t.train_iters != 0 and not cfg.validation.skip_train
    _, params, stages = metrics.parameters_per_stage(cfg, padded_vocab)
    per_stage = metrics.weight_and_optimizer_bytes(cfg, stages, cfg.trainable_fraction if trains else 0)
    ranks = 1 if cfg.use_gpu else int(os.environ.get("LOCAL_WORLD_SIZE", cfg.world_size))
    # One GPU holds the most loaded stage (the report's figure); a CPU's RAM every rank here, of every stage.
    weights = max(per_stage) if cfg.use_gpu else ranks * sum(per_stage) / len(per_stage)
    need = weights + ranks * metrics.activation_floor(cfg, padded_vocab)
    require(need <= total,
            f"the model needs at least {_gb(need)} for its weights"
            + (", gradients, optimizer state" if trains else "") + f" and one microbatch's activations ({params:,.0f} "
            f"parameters: --num-layers {m.num_layers}, --hidden-size {m.hidden_size}, --ffn-hidden-size {m.ffn_hidden_size}, " + (f"--num-experts {m.num_moe_experts} x --moe-ffn-hidden-size "
            f"{m.moe_ffn_hidden_size} over --expert-model-parallel-size {m.expert_model_parallel_size}, "
            if m.num_moe_experts else "") + f"a vocabulary padded to {padded_vocab:,} rows by "
            f"--make-vocab-size-divisible-by {m.make_vocab_size_divisible_by}, --seq-length {m.seq_length}, "
            f"--micro-batch-size {t.micro_batch_size}; {ranks} rank(s) here), more than the "
            f"{_gb(total)} of {'its GPU' if cfg.use_gpu else 'RAM on this machine'}; make it smaller or split it "
            f"over more devices")
    if t.train_iters is None or t.global_batch_size is None:
        return
    v = cfg.validation
    evaluations = t.train_iters // v.eval_interval + 2 if v.eval_interval > 0 else 2  # validation, and the test set
    training = t.train_samples or t.train_iters * t.global_batch_size
    samples = training + evaluations * v.eval_iters * t.global_batch_size
    require(16 * samples <= total,
            f"{samples:,} samples ({training:,} to train: " + (f"--train-samples {t.train_samples}" if t.train_samples
            else f"--train-iters {t.train_iters} x --global-batch-size {t.global_batch_size}") + f"; --eval-iters "
            f"{v.eval_iters} x --global-batch-size at each of {evaluations} evaluations) need a dataset index of at "
            f"least {_gb(16 * samples)}, more than the {_gb(total)} of RAM on this machine; train or evaluate on fewer "
            f"samples")


def check_peft(cfg: ConfigContainer) -> None:
    p, c = cfg.peft, cfg.checkpoint
    if p.peft == "none":
        return
    require(c.pretrained_checkpoint, f"--peft {p.peft} trains adapters on base weights: give them with "
                                     f"--pretrained-checkpoint (a checkpoint of train.py; --load then resumes the "
                                     f"{p.peft} run itself)")
    require(c.ckpt_format == "torch_dist", f"--peft {p.peft} saves the adapters only, which needs --ckpt-format torch_dist")
    require(p.lora_target_modules, "--lora-target-modules is empty: name at least one linear layer (e.g. linear_qkv)")


# Megatron-LM `megatron/training/determinism.py`: the environment a bitwise-reproducible run needs.
DETERMINISM_ENV_DEFAULTS = {"NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
                            "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
DETERMINISM_ENV_ACCEPTED = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": ("0",), "CUBLAS_WORKSPACE_CONFIG": (":4096:8", ":16:8")}
DETERMINISTIC_NCCL_ALGOS = ("Ring", "CollnetDirect", "CollnetChain", "^NVLS")  # Tree's reduction order can vary


def check_deterministic_mode(cfg: ConfigContainer, env=None) -> None:
    """Bridge's `_validate_and_apply_deterministic_mode`, Megatron-LM's `apply_determinism_to_args`: refuse
    what cannot be deterministic rather than silently change it. Applying the mode (environment defaults,
    `torch.use_deterministic_algorithms`) is `train.apply_deterministic_mode`."""
    if not cfg.model.deterministic_mode:
        return
    env = os.environ if env is None else env
    require(not cfg.model.cross_entropy_loss_fusion,
            "--deterministic-mode: --cross-entropy-loss-fusion is not deterministic; drop it")
    algo = env.get("NCCL_ALGO")
    require(algo is None or all(a.strip() in DETERMINISTIC_NCCL_ALGOS for a in algo.split(",") if a.strip()),
            f"--deterministic-mode: NCCL_ALGO={algo} may reduce in a varying order; unset it or use one of "
            f"{', '.join(DETERMINISTIC_NCCL_ALGOS)}")
    for name, accepted in DETERMINISM_ENV_ACCEPTED.items():
        require(env.get(name) is None or env[name] in accepted,
                f"--deterministic-mode: {name}={env.get(name)} is not deterministic; unset it or use "
                f"{' or '.join(accepted)}")


def check_callbacks(cfg: ConfigContainer) -> None:
    """Manual GC, profiling and straggler settings."""
    t, p, st = cfg.train, cfg.profiling, cfg.straggler
    require(t.manual_gc_interval >= 0, f"--manual-gc-interval must be non-negative, got {t.manual_gc_interval}")
    require(st.straggler_minmax_count >= 1, f"--straggler-minmax-count must be at least 1, got "
                                            f"{st.straggler_minmax_count}")
    require(st.enable_straggler_on_startup or not st.log_straggler,
            "--disable-straggler-on-startup waits for Megatron-LM's straggler controller (--straggler-ctrlr-port) to "
            "turn the report on, and there is none here: drop it (or --log-straggler)")
    dist = cfg.dist
    require(not dist.use_decentralized_pg, "dist.use_decentralized_pg: this trainer builds and reads megatron-core's "
                                           "global parallel groups; drop the setting")
    require(not cfg.ddp.param_name_patterns_for_fp32_local_accumulation or cfg.ddp.grad_reduce_in_fp32 is False,
            "--ddp-param-name-patterns-for-fp32-local-accumulation accumulates some gradients in fp32 when the others "
            "are not: it needs --bf16 with --grad-reduce-in-bf16, or --fp16")
    if p.use_pytorch_profiler or p.use_nsys_profiler or p.record_memory_history:
        require(0 <= p.profile_step_start < p.profile_step_end,
                f"--profile-step-start {p.profile_step_start} and --profile-step-end {p.profile_step_end}: need "
                f"0 <= start < end")
        bad = [r for r in p.profile_ranks if not 0 <= r < cfg.world_size]
        require(not bad, f"--profile-ranks {' '.join(map(str, bad))}: no such rank in a world of {cfg.world_size}")
    require(not p.use_pytorch_profiler or cfg.logger.tensorboard_dir,
            "--use-pytorch-profiler writes its trace to the TensorBoard directory, which --no-tensorboard turned off; "
            "drop --no-tensorboard or give --tensorboard-dir DIR")
    if not cfg.use_gpu:
        for gpu_only, what in ((p.use_nsys_profiler and not p.use_pytorch_profiler,
                                "--profile alone profiles with Nsight Systems, which"),
                               (p.nvtx_ranges, "--nvtx-ranges marks ranges for Nsight Systems, which"),
                               (p.record_memory_history, "--record-memory-history records the CUDA allocator, which")):
            require(not gpu_only, f"{what} needs a GPU and none is visible; on CPU, profile with --use-pytorch-profiler "
                                  f"--tensorboard-dir DIR")


# --------------------------------------------------------------------------------------------------
# Printing the config: Megatron's argument list, or Bridge's summary of non-default values
# --------------------------------------------------------------------------------------------------


def _get_non_default_values(config_obj: Any, default_obj: Any) -> dict:
    """{field: (value, default)} for the fields of config_obj whose value differs from default_obj's (the section as
    the container makes it). Callables, private fields and values derived during validation (they have no default to
    differ from) are left out."""
    changed = {}
    for f in dataclasses.fields(config_obj):
        if f.name.startswith("_") or f.metadata.get("derived") or not f.init:
            continue
        value, default = getattr(config_obj, f.name), getattr(default_obj, f.name)
        if callable(value) or callable(default):
            continue
        if value != default:
            changed[f.name] = (value, default)
    return changed


def _get_key_config_values(config_obj: Any) -> dict:
    """{field: value} of a config object, leaving out None values,
    callables, private fields and nested configs (the container's sub-configs)."""
    if not dataclasses.is_dataclass(config_obj):
        return {}
    values = {}
    for f in dataclasses.fields(config_obj):
        value = getattr(config_obj, f.name)
        if f.name.startswith("_") or value is None or callable(value) or dataclasses.is_dataclass(value):
            continue
        values[f.name] = value
    return values


def print_config(cfg: ConfigContainer, file=sys.stdout) -> None:
    """The resolved config, Megatron-style: one dotted line per setting, by section; with
    --log-non-default-values, Bridge's summary of the settings that differ from their defaults."""
    fused = inert_flags(cfg, fused_only=True)
    if fused:
        print(f" inert here (fused GPU kernels the local layers never use): {' '.join(fused)}", file=file)
    other = inert_flags(cfg)[len(fused):]
    if other:
        print(f" inert here (Megatron-LM placement, memory, logging and deprecated switches with no effect in this "
              f"trainer): "
              f"{' '.join(other)}", file=file)
    if cfg.logger.log_non_default_values:
        cfg.log_non_default_values(file)
        return
    print("------------------------ arguments ------------------------", file=file)
    for section in SECTIONS:
        if not dataclasses.is_dataclass(getattr(cfg, section)):  # an optional section left unset, or a recipe name
            print(f"  {section} {'.' * max(3, 48 - len(section))} {getattr(cfg, section)}", file=file)
            continue
        for f in dataclasses.fields(getattr(cfg, section)):
            name = f"{section}.{f.name}"
            value = getattr(getattr(cfg, section), f.name)
            value = "(hidden)" if value and f.name == "comet_api_key" else value
            print(f"  {name} {'.' * max(3, 48 - len(name))} {value}", file=file)
    for name in ("world_size", "data_parallel_size", "use_gpu", "padded_vocab_size"):
        print(f"  {name} {'.' * max(3, 48 - len(name))} {getattr(cfg, name)}", file=file)
    for setting, (value, why) in cfg.derived.items():  # validation's fill-ins and rewrites, each with its source
        print(f"  derived: {setting} = {value!r} ({why})", file=file)
    print("-------------------- end of arguments ---------------------", file=file, flush=True)


def _own_core_attention(cfg: ConfigContainer) -> bool:
    """Whether the layers run megatron-core's local DotProductAttention (--attention-backend local), whose softmax
    --attention-softmax-in-fp32 and --apply-query-key-layer-scaling set (SDPA and transformer-engine pick their own)."""
    return cfg.model.transformer_impl != "transformer_engine" and backend(cfg.model.attention_backend) is AttnBackend.local


def _setting_flag(cfg: ConfigContainer, section: str, name: str) -> Optional[str]:
    """The flag (with its value, for a non-switch) of a setting that differs from its default; None if it does not."""
    sub = getattr(cfg, section)
    f = next((f for f in dataclasses.fields(sub) if f.name == name), None)
    if f is None or getattr(sub, name) == getattr(section_default(type(sub), section), name):  # DEFAULTS' or the class's
        return None
    value = getattr(sub, name)
    flag = flag_of(section, f)
    return flag if isinstance(value, bool) else f"{flag} {value}"


def inert_flags(cfg: ConfigContainer, fused_only: bool = False) -> list:
    """The Megatron-LM flags given that change nothing here, as flags: the kernel-fusion switches and the first group
    of MEGATRON_LM_INERT_FLAGS, then (unless fused_only) INERT_SETTINGS and the other MEGATRON_LM_INERT_FLAGS given."""
    given = cfg.megatron_lm_inert or []
    kernels = {flag for flag, _ in MEGATRON_LM_INERT_FLAGS[0][1]}
    flags = ["--" + name.replace("_", "-") for name in INERT if getattr(cfg.model, name)]
    flags += [flag for flag in given if flag.split(" ", 1)[0] in kernels]
    for (section, name), when in ([] if fused_only else INERT_SETTINGS.items()):
        flag = _setting_flag(cfg, section, name)
        if flag and (when is None or when(cfg)):
            flags.append(flag)
    return flags + ([] if fused_only else [flag for flag in given if flag.split(" ", 1)[0] not in kernels])


# --------------------------------------------------------------------------------------------------
# Settings with no machinery of their own here, last: Bridge's sections kept for compatibility (validation,
# mixed_precision, comm_overlap: thin names over the settings above), and the NVIDIA service configs (accepted at
# their defaults, one line when enabled)
# --------------------------------------------------------------------------------------------------


def derive_bridge_sections(cfg: ConfigContainer) -> None:
    """Bridge's sections onto the settings they name (the part of Bridge's runtime_config_update that resolves
    mixed_precision and comm_overlap), so the rest of the code reads one place for each."""
    t = cfg.train
    for name in ("eval_iters", "eval_interval", "skip_train"):  # Bridge's deprecated spellings, as its finalize
        if getattr(t, name) is not None:
            derive_value(cfg, f"validation.{name}", getattr(t, name), f"train.{name} (deprecated)")
    if isinstance(t.exit_signal, str) and t.exit_signal in signal.Signals.__members__:  # a name from a flag or YAML
        derive_value(cfg, "train.exit_signal", signal.Signals[t.exit_signal], "its name")
    if cfg.mixed_precision is not None:
        mp = get_mixed_precision_config(cfg.mixed_precision)
        why = f"mixed_precision {cfg.mixed_precision if isinstance(cfg.mixed_precision, str) else ''}".strip()
        derive_value(cfg, "model.bf16", mp.bf16, why)
        derive_value(cfg, "model.fp16", mp.fp16, why)
        derive_value(cfg, "ddp.grad_reduce_in_fp32", mp.grad_reduce_in_fp32 if (mp.bf16 or mp.fp16) else None, why)
        if mp.fp16:
            for name in LOSS_SCALING:
                derive_value(cfg, f"optimizer.{name}", getattr(mp, name), why)
    co = cfg.comm_overlap
    if co is not None:
        if co.overlap_p2p_comm is not None:
            derive_value(cfg, "model.overlap_p2p_comm", co.overlap_p2p_comm, "comm_overlap.overlap_p2p_comm")
        for name in ("overlap_grad_reduce", "overlap_param_gather"):
            if getattr(co, name) is not None:
                derive_value(cfg, f"ddp.{name}", getattr(co, name), f"comm_overlap.{name}")


def check_bridge_sections(cfg: ConfigContainer) -> None:
    """What Bridge's sections ask for that this trainer cannot do."""
    t = cfg.train
    check_mcore_fields(cfg)
    for name, train_value in (("eval_global_batch_size", t.global_batch_size), ("eval_micro_batch_size", t.micro_batch_size)):
        value = getattr(cfg.validation, name)
        require(value is None or value == train_value, f"validation.{name} {value} differs from the training batch "
                                                       f"({train_value}); evaluation here uses the training batch "
                                                       f"sizes: drop it")
    if cfg.mixed_precision is not None:
        mp = get_mixed_precision_config(cfg.mixed_precision)
        require(not (mp.fp8 or mp.fp4), "mixed_precision: fp8/fp4 need transformer-engine on a GPU, which this trainer "
                                        "does not drive; use bf16_mixed or fp16_mixed")
        check_unset(cfg, "mixed_precision", ["autocast_enabled"], mp)
        require(sum((mp.bf16, mp.fp16, mp.fp32)) <= 1, "mixed_precision: set one of bf16, fp16 and fp32")
        dtype = "bfloat16" if mp.bf16 else "float16" if mp.fp16 else "float32"
        for name in ("params_dtype", "pipeline_dtype"):
            require(getattr(mp, name) in (None, dtype),
                    f"mixed_precision.{name} {getattr(mp, name)} is not {dtype}, the precision it sets")
    co = cfg.comm_overlap
    if co is not None:
        require(not co.tp_comm_overlap,
                "comm_overlap.tp_comm_overlap needs transformer-engine's userbuffers on GPUs "
                + ("(none visible here)" if not cfg.use_gpu else
                   "(transformer-engine is not installed)" if not package_installed("transformer_engine") else
                   "(this trainer does not set them up)") + "; set it to false")
        check_unset(cfg, "comm_overlap", ["batch_p2p_comm", "overlap_param_gather_with_optimizer_step",
                                          "align_param_gather", "bucket_size", "defer_embedding_wgrad_compute",
                                          "wgrad_deferral_limit"])


def check_mcore_fields(cfg: ConfigContainer) -> None:
    """megatron-core's fields this trainer does not act on (neither MCORE_FLAGS nor MCORE_YAML_ONLY) keep their
    defaults: a YAML or a script that sets one is one line, not a setting silently ignored."""
    defaults = ConfigContainer()
    for section, sub in section_configs(cfg):
        acted_on = _names(MCORE_FLAGS, section) + _names(MCORE_YAML_ONLY, section)
        default = getattr(defaults, section)
        fields = [f.name for f in dataclasses.fields(sub) if f.init and "help" not in f.metadata and f.name not in acted_on]
        if type(default) is type(sub) and not getattr(sub, "finalized", False):  # megatron-core's post-init sets more
            check_unset(cfg, section, fields, default=default)


def check_unset(cfg: ConfigContainer, section: str, names: list, sub=None, default=None) -> None:
    """Bridge settings this trainer has no machinery for: accepted at their defaults, a one-line error when set."""
    sub = sub if sub is not None else getattr(cfg, section)
    defaults = default if default is not None else type(sub)()
    for name in names:
        require(getattr(sub, name) == getattr(defaults, name),
                f"{section}.{name} {getattr(sub, name)!r} is not supported by this trainer; drop it (see "
                f"docs/interchange.md, Compared with Megatron-LM)")


def derive_services(cfg: ConfigContainer) -> None:
    """Bridge's defaults of tensor_inspect (the run is then refused by check_services: no service runs here)."""
    ti = cfg.tensor_inspect
    if ti.enabled and ti.log_dir is None:
        derive_value(cfg, "tensor_inspect.log_dir", cfg.checkpoint.save or ".", "--save, else here")
    if ti.enabled and ti.init_training_step == 0 and cfg.checkpoint.ckpt_step is not None:
        derive_value(cfg, "tensor_inspect.init_training_step", int(cfg.checkpoint.ckpt_step), "--ckpt-step")


def check_services(cfg: ConfigContainer) -> None:
    """The NVIDIA service configs: their documented constraints, then the service's package. Disabled sections are only checked for consistency."""
    ft, nv, ipr, ti = cfg.ft, cfg.nvrx_straggler, cfg.inprocess_restart, cfg.tensor_inspect
    require(ft.enable_ft_package or not (ft.calc_ft_timeouts or ft.simulate_fault),  # they act inside the FT package
            "ft.calc_ft_timeouts and ft.simulate_fault need --enable-ft-package")
    require(ft.simulated_fault_type in ("rank_hung", "rank_killed", "random"),
            f"ft.simulated_fault_type {ft.simulated_fault_type}: expected rank_hung, rank_killed or random")
    require(ft.simulated_fault_rank is None or 0 <= ft.simulated_fault_rank < cfg.world_size,
            f"ft.simulated_fault_rank {ft.simulated_fault_rank} is not a rank of this world (size {cfg.world_size})")
    require(ft.simulated_fault_base_delay >= 0, "ft.simulated_fault_base_delay must be non-negative")
    if ft.enable_ft_package:
        require_service("--enable-ft-package", "fault tolerance", "nvidia-resiliency-ext")
    if nv.enabled:
        require(nv.calc_relative_gpu_perf or nv.calc_individual_gpu_perf,
                "nvrx_straggler: set calc_relative_gpu_perf or calc_individual_gpu_perf (or both)")
        require(nv.report_time_interval > 0,
                f"nvrx_straggler.report_time_interval must be positive, got {nv.report_time_interval}")
        for name in ("gpu_relative_perf_threshold", "gpu_individual_perf_threshold"):
            require(0 <= getattr(nv, name) <= 1, f"nvrx_straggler.{name} must be between 0 and 1, got {getattr(nv, name)}")
        require(nv.profiling_interval >= 1 and nv.num_gpu_perf_scores_to_print >= 0,
                "nvrx_straggler.profiling_interval must be at least 1 and num_gpu_perf_scores_to_print non-negative")
        require_service("nvrx_straggler.enabled", "NVRx straggler detection", "nvidia-resiliency-ext")
    if ipr.enabled:
        for f in dataclasses.fields(ipr):
            if f.type == "float":  # the intervals and timeouts
                require(getattr(ipr, f.name) > 0, f"{f.metadata['flag']} must be positive, got {getattr(ipr, f.name)}")
        require(ipr.soft_timeout < ipr.hard_timeout, f"--inprocess-soft-timeout {ipr.soft_timeout} must be below "
                                                     f"--inprocess-hard-timeout {ipr.hard_timeout}")
        require(ipr.granularity in ("node", "rank"), f"--inprocess-granularity {ipr.granularity}: expected node or rank")
        require(ipr.active_world_size is None or 1 <= ipr.active_world_size <= cfg.world_size,
                f"--inprocess-active-world-size {ipr.active_world_size} must be between 1 and the world size "
                f"{cfg.world_size}")
        require(ipr.max_iterations is None or ipr.max_iterations >= 1, "--inprocess-max-iterations must be positive")
        require_service("--inprocess-restart", "in-process restart", "nvidia-resiliency-ext")
    if ti.enabled:
        require(not isinstance(ti.features, str) or os.path.isfile(ti.features),
                f"tensor_inspect.features {ti.features}: no such file; give a YAML file or a mapping")
        require(ti.init_training_step >= 0, "tensor_inspect.init_training_step must be non-negative")
        require_service("tensor_inspect.enabled", "tensor inspection", "nvdlfw-inspect")


def require_service(setting: str, service: str, package: str) -> None:
    """An enabled NVIDIA service: name the package it needs; this training loop does not run it either way."""
    require(package_installed(package.replace("-", "_")),
            f"{setting}: {service} needs the {package} package, which is not installed (pip install {package}); "
            f"this training loop does not run it either, so drop the setting")
    require(False, f"{setting}: {package} is installed, but this training loop does not run {service} "
                   f"(see docs/flags.md, 'NVIDIA service configs'); drop the setting")


INERT = ("no_persist_layer_norm", "no_gradient_accumulation_fusion", "no_masked_softmax_fusion", "no_bias_gelu_fusion",
         "no_bias_swiglu_fusion", "no_bias_dropout_fusion", "no_rope_fusion")
# Megatron-LM's other settings accepted with no effect here (placement, memory and deprecated switches), by section:
# each is inert when it differs from its default, or when `when(cfg)` says so.
INERT_SETTINGS = {
    ("model", "use_mcore_models"): None,
    ("model", "attention_backend"): lambda cfg: (backend(cfg.model.attention_backend).name in ("flash", "fused", "unfused")
                                                 and cfg.model.transformer_impl != "transformer_engine"),
    ("train", "empty_unused_memory_level"): None,
    ("dataset", "create_attention_mask"): lambda cfg: "dataset.create_attention_mask" not in cfg.derived,
    ("tokenizer", "tiktoken_pattern"): None,
    # rope without multi-latent attention: what dense attention uses (yarn is refused there)
    ("model", "rope_type"): lambda cfg: not cfg.model.multi_latent_attention,
    ("model", "add_position_embedding"): None,  # --no-position-embedding with rope (refused without)
    ("model", "disable_bf16_reduced_precision_matmul"): lambda cfg: not (cfg.use_gpu and cfg.model.bf16),
    # fp32 training: the residual stream is fp32 already (Megatron-LM asks for --bf16/--fp16; generate.py runs in fp32)
    ("model", "fp32_residual_connection"): lambda cfg: not (cfg.model.bf16 or cfg.model.fp16),
    ("model", "attention_softmax_in_fp32"): lambda cfg: not (_own_core_attention(cfg) and (cfg.model.bf16 or cfg.model.fp16)),
    ("model", "apply_query_key_layer_scaling"): lambda cfg: cfg.model.transformer_impl != "transformer_engine" and not _own_core_attention(cfg),
    ("ddp", "bucket_size"): lambda cfg: not cfg.ddp.overlap_grad_reduce,  # megatron-core: one bucket without overlap
}
