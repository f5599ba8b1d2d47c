"""config.py: every setting of a run, one dataclass per concern, and the command line made from them.

The shape follows Megatron Bridge's `ConfigContainer` (train, model, optimizer, scheduler, dataset,
logger, checkpoint, dist, rng, ...); the flag names and meanings follow Megatron-LM's `arguments.py`,
so `--num-layers 24 --micro-batch-size 4 ...` means here what it means there.

Each field is declared with `arg(default, help)`: the help text is the field's documentation and
its `--help` line, and the flag is the field name in kebab-case unless `flag=` says otherwise.

This module imports neither torch nor megatron-core: `--help` and every validation error answer
in about a second, before any expensive import or work.
"""

from __future__ import annotations

import abc
import argparse
import dataclasses
import glob
import os
import signal
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Optional


class ConfigError(ValueError):
    """An impossible or inconsistent setting. The message is one line saying what and how to fix it."""


def arg(default: Any, help: str, *, flag: Optional[str] = None, choices=None, cli: bool = True):
    """A config field: its default, its documentation (= its `--help`), and how it appears on the CLI.

    For a bool that defaults to True, `flag` names the Megatron-LM switch that turns it off
    (e.g. `--no-save-optim`); `cli=False` marks a value computed during validation.
    """
    meta = dict(help=help, flag=flag, choices=choices, cli=cli)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


# --------------------------------------------------------------------------------------------------
# One dataclass per concern
# --------------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    """The GPT: sizes, architecture choices, parallelism and precision (Megatron's TransformerConfig)."""

    num_layers: int = arg(4, "Number of transformer layers.")
    hidden_size: int = arg(256, "Transformer hidden size.")
    ffn_hidden_size: Optional[int] = arg(
        None, "MLP hidden size. Default: 4 x hidden size, or 2/3 of that rounded down to a multiple of 64 with --swiglu."
    )
    num_attention_heads: int = arg(4, "Number of attention heads.")
    num_query_groups: Optional[int] = arg(
        None, "Number of key/value head groups for grouped-query attention. Default: one per head (plain multi-head)."
    )
    kv_channels: Optional[int] = arg(None, "Projection size per attention head. Default: hidden size / heads.")
    seq_length: int = arg(256, "Sequence length of a training sample, in tokens.")
    max_position_embeddings: Optional[int] = arg(
        None, "Size of the learned position-embedding table. Default: --seq-length."
    )
    make_vocab_size_divisible_by: int = arg(
        128, "Pad the vocabulary to a multiple of this times the tensor-parallel size (fast matmuls)."
    )
    hidden_dropout: float = arg(0.1, "Dropout probability after the attention and MLP blocks.")
    attention_dropout: float = arg(0.1, "Dropout probability on the attention weights.")
    init_method_std: float = arg(0.02, "Standard deviation of the normal weight initialisation.")
    untie_embeddings_and_output_weights: bool = arg(
        False, "Give the output layer its own weights instead of sharing the input embedding's."
    )
    position_embedding_type: str = arg(
        "learned_absolute", "Position embedding.", choices=["learned_absolute", "rope", "none"]
    )
    rotary_base: int = arg(10000, "Base period of the rotary position embedding.")
    rotary_percent: float = arg(1.0, "Fraction of each head's dimensions that rotary embedding rotates.")
    normalization: str = arg("LayerNorm", "Normalization layer.", choices=["LayerNorm", "RMSNorm"])
    norm_epsilon: float = arg(1e-5, "Epsilon of the normalization layers.")
    swiglu: bool = arg(False, "Use the SwiGLU gated activation in the MLP instead of GeLU.")
    add_bias_linear: bool = arg(True, "Biases in the linear layers.", flag="--disable-bias-linear")
    transformer_impl: Optional[str] = arg(
        None,
        "Layer implementation. Default: transformer_engine when it is installed and a GPU is present, else local.",
        choices=["local", "transformer_engine"],
    )
    tensor_model_parallel_size: int = arg(1, "Tensor model-parallel size (splits each layer's matrices).")
    pipeline_model_parallel_size: int = arg(1, "Pipeline model-parallel size (splits the layers into stages). GPU only.")
    context_parallel_size: int = arg(1, "Context-parallel size (splits the sequence). GPU and transformer-engine only.")
    sequence_parallel: bool = arg(False, "Sequence parallelism inside tensor-parallel regions. GPU only.")
    bf16: bool = arg(False, "bfloat16 mixed precision (fp32 main weights). On CPU: bf16 autocast.")
    fp16: bool = arg(False, "float16 mixed precision with dynamic loss scaling. GPU only.")


@dataclass
class TrainingConfig:
    """The training loop: batch sizes, length, evaluation and exit conditions."""

    micro_batch_size: int = arg(4, "Samples per forward/backward pass on one data-parallel rank.")
    global_batch_size: Optional[int] = arg(
        None, "Samples per optimizer step over all ranks. Default: micro batch size x data-parallel size."
    )
    train_iters: Optional[int] = arg(
        None, "Iterations (optimizer steps) to train for. Default: 300 when --train-samples is not given."
    )
    train_samples: Optional[int] = arg(None, "Samples to train for, instead of --train-iters.")
    eval_interval: int = arg(100, "Run evaluation on the validation set every this many iterations.")
    eval_iters: int = arg(10, "Iterations (global batches) per evaluation. 0 disables evaluation.")
    skip_train: bool = arg(False, "Do not train: evaluate on the validation and test sets only, then exit.")
    exit_interval: Optional[int] = arg(None, "Exit (saving a checkpoint if --save is set) at the first iteration divisible by this.")
    exit_duration_in_mins: Optional[float] = arg(None, "Exit (saving a checkpoint) after this many minutes of training.")
    exit_signal_handler: bool = arg(False, "On --exit-signal (SIGTERM by default) on any rank: save a checkpoint and exit 0.")
    exit_signal: str = arg("SIGTERM", "Signal that --exit-signal-handler catches.")
    iterations_to_skip: Optional[list[int]] = arg(
        None, "Iterations (numbered as in the log line) to skip: their data is consumed, no step is taken.")
    check_for_nan_in_loss_and_grad: bool = arg(
        True, "Stop the run when the loss is NaN or Inf.", flag="--no-check-for-nan-in-loss-and-grad"
    )


@dataclass
class OptimizerConfig:
    """The optimizer (Megatron's OptimizerConfig): Adam or SGD, clipping, loss scaling."""

    optimizer: str = arg("adam", "Optimizer.", choices=["adam", "sgd"])
    lr: float = arg(1e-3, "Peak learning rate.")
    min_lr: float = arg(1e-4, "Learning rate at the end of the decay.")
    weight_decay: float = arg(0.01, "Decoupled weight decay (not applied to biases and 1-D parameters).")
    adam_beta1: float = arg(0.9, "Adam beta1.")
    adam_beta2: float = arg(0.999, "Adam beta2.")
    adam_eps: float = arg(1e-8, "Adam epsilon.")
    sgd_momentum: float = arg(0.9, "SGD momentum.")
    clip_grad: float = arg(1.0, "Clip gradients to this global L2 norm. 0 disables clipping.")
    use_distributed_optimizer: bool = arg(False, "Shard optimizer state over data-parallel ranks (megatron-core). GPU only.")
    loss_scale: Optional[float] = arg(None, "Static loss scale for --fp16. Default: dynamic loss scaling.")
    initial_loss_scale: float = arg(2.0**32, "Initial dynamic loss scale for --fp16.")
    min_loss_scale: float = arg(1.0, "Minimum dynamic loss scale for --fp16.")
    loss_scale_window: float = arg(1000, "Iterations without overflow before the dynamic loss scale grows.")
    hysteresis: int = arg(2, "Overflows tolerated before the dynamic loss scale shrinks.")


@dataclass
class SchedulerConfig:
    """Learning-rate and weight-decay schedules (megatron-core's OptimizerParamScheduler), counted in samples."""

    lr_decay_style: str = arg(
        "cosine", "Learning-rate decay.", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"]
    )
    lr_decay_iters: Optional[int] = arg(None, "Iterations to decay over. Default: --train-iters.")
    lr_decay_samples: Optional[int] = arg(None, "Samples to decay over (sample-based training). Default: --train-samples.")
    lr_warmup_iters: int = arg(20, "Iterations of linear warmup.")
    lr_warmup_samples: int = arg(0, "Samples of linear warmup (sample-based training).")
    lr_warmup_fraction: Optional[float] = arg(None, "Warmup as a fraction of the decay length, instead of --lr-warmup-iters.")
    lr_warmup_init: float = arg(0.0, "Learning rate at the start of warmup.")
    lr_wsd_decay_style: str = arg("exponential", "Decay of the WSD schedule's last phase.", choices=["exponential", "linear", "cosine"])
    lr_wsd_decay_iters: Optional[int] = arg(None, "Iterations of the WSD schedule's decay phase.")
    start_weight_decay: Optional[float] = arg(None, "Weight decay at the start. Default: --weight-decay.")
    end_weight_decay: Optional[float] = arg(None, "Weight decay at the end. Default: --weight-decay.")
    weight_decay_incr_style: str = arg("constant", "Weight-decay schedule.", choices=["constant", "linear", "cosine"])
    override_opt_param_scheduler: bool = arg(False, "Take schedule settings from the flags, not from the checkpoint.")
    use_checkpoint_opt_param_scheduler: bool = arg(False, "Take schedule settings from the checkpoint, not from the flags.")
    # Computed by validate(), all in samples, as megatron-core's scheduler counts steps.
    lr_warmup_steps: int = arg(0, "Warmup length in samples.", cli=False)
    lr_decay_steps: int = arg(0, "Decay length in samples.", cli=False)
    wd_incr_steps: int = arg(0, "Weight-decay schedule length in samples.", cli=False)
    wsd_decay_steps: Optional[int] = arg(None, "WSD decay length in samples.", cli=False)


@dataclass
class DatasetConfig:
    """Where the tokens come from (Megatron's GPTDatasetConfig and DataloaderConfig)."""

    data_path: Optional[list[str]] = arg(
        None, "Indexed dataset prefixes (PREFIX.bin/.idx), optionally weighted: '0.7 A 0.3 B'. Default: a built-in corpus."
    )
    split: str = arg("969,30,1", "Train/validation/test proportions of --data-path.")
    train_data_path: Optional[list[str]] = arg(None, "Indexed dataset prefixes for training only (instead of --split).")
    valid_data_path: Optional[list[str]] = arg(None, "Indexed dataset prefixes for validation only.")
    test_data_path: Optional[list[str]] = arg(None, "Indexed dataset prefixes for testing only.")
    mock_data: bool = arg(False, "Train on megatron-core's synthetic MockGPTDataset.")
    data_cache_path: Optional[str] = arg(None, "Directory for the dataset index caches (and the built-in corpus).")
    dataloader_type: Optional[str] = arg(
        None, "'single': one pass in order; 'cyclic': reshuffled passes; 'batch': in order, each global batch padded "
              "to its longest sequence. Default: batch with --sft, else single.", choices=["single", "cyclic", "batch"])
    num_workers: int = arg(2, "DataLoader worker processes per rank.")
    sft: bool = arg(False, "Finetuning data: the data paths are JSONL files of prompt/response pairs (or a 'messages' "
                           "list); the loss covers the responses only.")
    sft_pack_sequences: bool = arg(False, "With --sft: pack several examples into each sequence (positions and "
                                          "attention restart at each example).")
    reset_position_ids: bool = arg(False, "Restart position ids after each end-of-document token.")
    reset_attention_mask: bool = arg(False, "Do not attend across end-of-document tokens.")
    eod_mask_loss: bool = arg(False, "Exclude end-of-document tokens from the loss.")
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


@dataclass
class DatasetBuildContext:
    """What a DatasetProvider gets to build its datasets: how many samples each split must supply,
    and the tokenizer (Megatron Bridge's DatasetBuildContext)."""

    train_samples: int
    valid_samples: int
    test_samples: int
    tokenizer: Any = None


@dataclass
class DatasetProvider(abc.ABC):
    """Your own datasets (Megatron Bridge's DatasetProvider): subclass it, implement build_datasets, and
    put an instance in `cfg.dataset`. Each dataset yields dicts of tokens, labels, loss_mask and
    position_ids tensors (attention_mask optional), as megatron-core's GPTDataset does."""

    dataloader_type: str = arg("single", "'single': one pass in order; 'cyclic': reshuffled passes.",
                               choices=["single", "cyclic"])
    num_workers: int = arg(0, "DataLoader worker processes per rank.")

    @abc.abstractmethod
    def build_datasets(self, context: DatasetBuildContext) -> tuple:
        """Return (train, validation, test) datasets; any may be None."""


@dataclass
class TokenizerConfig:
    """How text becomes token ids."""

    tokenizer_type: str = arg(
        "ByteTokenizer",
        "ByteTokenizer: UTF-8 bytes, 256 ids + end-of-document. NullTokenizer: ids given as-is, --vocab-size ids + end-of-document.",
        choices=["ByteTokenizer", "NullTokenizer", "HuggingFaceTokenizer"],
    )
    vocab_size: Optional[int] = arg(None, "Vocabulary size of the NullTokenizer.")
    tokenizer_model: Optional[str] = arg(
        None, "HuggingFaceTokenizer: a local tokenizer.json, or a directory holding one (needs `pip install tokenizers`).")


@dataclass
class LoggerConfig:
    """Console and TensorBoard reporting."""

    log_interval: int = arg(10, "Print the log line every this many iterations.")
    tensorboard_dir: Optional[str] = arg(None, "Write TensorBoard event files here.")
    tensorboard_log_interval: int = arg(1, "Write TensorBoard scalars every this many iterations.")
    log_throughput: bool = arg(False, "Add TFLOP/s per GPU and MFU to the log line, throughput/* to TensorBoard.")
    log_params_norm: bool = arg(False, "Compute and log the parameters' L2 norm (walks all parameters).")
    log_num_zeros_in_grad: bool = arg(False, "Count and log the zeros in the gradient (walks all gradients).")
    log_l2_norm_grad: bool = arg(False, "Write each parameter's gradient L2 norm to TensorBoard (walks all gradients).")
    log_memory_to_tensorboard: bool = arg(False, "Write memory statistics (memory/*) to TensorBoard.")
    log_timers_to_tensorboard: bool = arg(False, "Write the timers of --timing-log-level to TensorBoard.")
    log_runtime_to_tensorboard: bool = arg(False, "Write elapsed and estimated remaining time (time/*) to TensorBoard.")
    throughput_window_size: int = arg(100, "Iterations in the rolling window of the throughput/* scalars.")
    log_validation_ppl_to_tensorboard: bool = arg(False, "Also write validation perplexity to TensorBoard.")
    timing_log_level: int = arg(0, "Timer detail: 0 iteration time only, 1 once-per-step phases, 2 everything.", choices=[0, 1, 2])
    # Other experiment trackers, each on when its first setting is given, fed the TensorBoard scalars on the last rank.
    wandb_project: Optional[str] = arg(None, "Weights & Biases project: log to W&B (pip install wandb; WANDB_MODE=offline "
                                             "writes locally).")
    wandb_exp_name: Optional[str] = arg(None, "W&B run name (needed with --wandb-project).")
    wandb_save_dir: Optional[str] = arg(None, "Directory for W&B's local files. Default: SAVE/wandb, else ./wandb.")
    wandb_entity: Optional[str] = arg(None, "W&B entity (user or team). Default: your default entity.")
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
class CheckpointConfig:
    """Saving and loading (Megatron Bridge's CheckpointConfig)."""

    save: Optional[str] = arg(None, "Directory to save checkpoints to.")
    load: Optional[str] = arg(None, "Checkpoint to resume from: a save directory (its newest) or one iter_* directory.")
    save_interval: Optional[int] = arg(None, "Save a checkpoint every this many iterations.")
    save_optim: bool = arg(True, "Save the optimizer state.", flag="--no-save-optim")
    save_rng: bool = arg(True, "Save the random number generator states.", flag="--no-save-rng")
    load_optim: bool = arg(True, "Load the optimizer state.", flag="--no-load-optim")
    load_rng: bool = arg(True, "Load the random number generator states.", flag="--no-load-rng")
    finetune: bool = arg(False, "Load weights only and start at iteration 0 (no optimizer, scheduler, RNG or progress).")
    pretrained_checkpoint: Optional[str] = arg(
        None, "Weights to start from when --load holds no checkpoint of this run: a save directory or an iter_* directory.")
    ckpt_step: Optional[int] = arg(None, "Load this iteration instead of the newest.")
    most_recent_k: int = arg(-1, "Keep only the newest K checkpoints, deleting older ones after each save. -1 keeps all.")
    ckpt_format: Optional[str] = arg(
        None, "On-disk format. Default: torch_dist (megatron-core dist_checkpointing) on GPU, torch on CPU.",
        choices=["torch", "torch_dist"],
    )


@dataclass
class DistributedInitConfig:
    """Process-group setup."""

    distributed_backend: Optional[str] = arg(None, "Collective backend. Default: nccl with a GPU, gloo without.", choices=["nccl", "gloo"])
    distributed_timeout_minutes: int = arg(10, "Timeout of collective operations, in minutes.")


@dataclass
class RNGConfig:
    """Random seeds."""

    seed: int = arg(1234, "Random seed for python, numpy and torch (offset per pipeline rank, as Megatron does).")


@dataclass
class ConfigContainer:
    """Top-level container: one sub-config per concern, plus values derived at validation."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistributedInitConfig = field(default_factory=DistributedInitConfig)
    rng: RNGConfig = field(default_factory=RNGConfig)
    # Derived by validate() from the world size and the machine; not settable from the command line.
    world_size: int = 1
    data_parallel_size: int = 1
    use_gpu: bool = False
    padded_vocab_size: int = 0  # set at setup, from the tokenizer

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
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

    @property
    def num_microbatches(self) -> int:
        """Microbatches per rank per step: global batch / (micro batch x data-parallel size)."""
        return self.train.global_batch_size // (self.train.micro_batch_size * self.data_parallel_size)


SECTIONS = ["model", "train", "optimizer", "scheduler", "dataset", "tokenizer", "logger", "checkpoint", "dist", "rng"]


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


def _cli_fields():
    """Yield (section, dataclass field, resolved type) for every field that has a flag."""
    for section in SECTIONS:
        cls = type(getattr(ConfigContainer(), section))
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.metadata.get("cli", False):
                yield section, f, _base_type(hints[f.name])


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit code 2, no usage dump
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(prog: str = "train.py") -> argparse.ArgumentParser:
    """The argparse parser: one argument group per config section, one flag per field."""
    parser = _Parser(
        prog=prog,
        description="Pretrain a megatron-core GPT. Flags follow Megatron-LM; --config-file takes a YAML file that flags override.",
        argument_default=argparse.SUPPRESS,  # only flags actually given override the defaults/YAML
        allow_abbrev=False,
    )
    parser.add_argument("--config-file", help="YAML file with one mapping per section (model:, train:, ...).")
    groups = {}
    for section, f, tp in _cli_fields():
        group = groups.get(section) or groups.setdefault(section, parser.add_argument_group(section))
        flag = f.metadata["flag"] or "--" + f.name.replace("_", "-")
        dest = f"{section}.{f.name}"
        help_text = f.metadata["help"]
        if tp is bool:
            action = "store_false" if f.default else "store_true"
            group.add_argument(flag, dest=dest, action=action, help=help_text)
        elif isinstance(tp, tuple):  # a list of values
            group.add_argument(flag, dest=dest, nargs="+", type=tp[1], metavar=f.name.upper().split("_")[-1],
                               help=help_text + " (default: %s)" % f.default)
        else:
            group.add_argument(
                flag, dest=dest, type=tp, choices=f.metadata["choices"],
                metavar=None if f.metadata["choices"] else f.name.upper(),
                help=help_text + " (default: %s)" % (f.default,),
            )
    return parser


def apply_overrides(cfg: ConfigContainer, overrides: dict, source: str) -> None:
    """Set `{section: {field: value}}` on cfg, refusing unknown sections and fields by name."""
    for section, values in (overrides or {}).items():
        if section not in SECTIONS:
            raise ConfigError(f"{source}: unknown section '{section}'; sections are {', '.join(SECTIONS)}")
        if values is None:
            continue
        sub = getattr(cfg, section)
        names = {f.name for f in dataclasses.fields(sub)}
        for key, value in values.items():
            key = key.replace("-", "_")
            if key not in names:
                raise ConfigError(f"{source}: '{section}' has no setting '{key}' (see --help for the {section} group)")
            setattr(sub, key, value)


def parse_args(argv: Optional[list] = None, world_size: Optional[int] = None, gpu: Optional[bool] = None) -> ConfigContainer:
    """Parse flags (and an optional YAML file under them) into a validated ConfigContainer.

    A bad flag or an impossible combination prints one line to stderr and exits with code 2.
    `world_size` defaults to $WORLD_SIZE (set by torchrun) and `gpu` to whether a GPU is visible.
    """
    parser = build_parser()
    ns = vars(parser.parse_args(argv))
    cfg = ConfigContainer()
    try:
        if "config_file" in ns:
            apply_overrides(cfg, _load_yaml(ns.pop("config_file")), source="--config-file")
        flags: dict = {}
        for dest, value in ns.items():
            section, name = dest.split(".", 1)
            flags.setdefault(section, {})[name] = value
        apply_overrides(cfg, flags, source="flags")
        validate(cfg, world_size=world_size, gpu=gpu)
    except ConfigError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    return cfg


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


def transformer_engine_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


# --------------------------------------------------------------------------------------------------
# Validation: every impossible setting is one clear line, before any work
# --------------------------------------------------------------------------------------------------


def validate(cfg: ConfigContainer, world_size: Optional[int] = None, gpu: Optional[bool] = None) -> ConfigContainer:
    """Check the settings against each other and the machine, and fill in derived values.

    Raises ConfigError with a one-line message. Mirrors the checks of Megatron-LM's `validate_args`
    and Megatron Bridge's `ConfigContainer.validate`.
    """
    m, t, o, s, c, lg = cfg.model, cfg.train, cfg.optimizer, cfg.scheduler, cfg.checkpoint, cfg.logger
    cfg.world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    cfg.use_gpu = gpu_visible() if gpu is None else gpu

    def need(ok: bool, msg: str):
        if not ok:
            raise ConfigError(msg)

    # --- sizes -----------------------------------------------------------------------------------
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "make_vocab_size_divisible_by"):
        need(getattr(m, name) > 0, f"--{name.replace('_', '-')} must be positive, got {getattr(m, name)}")
    need(t.micro_batch_size > 0, f"--micro-batch-size must be positive, got {t.micro_batch_size}")
    need(m.hidden_size % m.num_attention_heads == 0 or m.kv_channels is not None,
         f"--num-attention-heads {m.num_attention_heads} does not divide --hidden-size {m.hidden_size}; "
         f"pick heads that divide it (or set --kv-channels)")
    if m.kv_channels is None:
        m.kv_channels = m.hidden_size // m.num_attention_heads
    if m.num_query_groups is None:
        m.num_query_groups = m.num_attention_heads
    need(m.num_query_groups > 0 and m.num_attention_heads % m.num_query_groups == 0,
         f"--num-query-groups {m.num_query_groups} must divide --num-attention-heads {m.num_attention_heads}")
    if m.ffn_hidden_size is None:
        # Megatron-LM: SwiGLU keeps the MLP's parameter count of 4h by using 2/3 of it, rounded to 64.
        m.ffn_hidden_size = max(64, int((4 * m.hidden_size * 2 / 3) / 64) * 64) if m.swiglu else 4 * m.hidden_size
    if m.max_position_embeddings is None:
        m.max_position_embeddings = m.seq_length
    need(m.position_embedding_type != "learned_absolute" or m.max_position_embeddings >= m.seq_length,
         f"--max-position-embeddings {m.max_position_embeddings} is shorter than --seq-length {m.seq_length}")
    for name in ("hidden_dropout", "attention_dropout"):
        need(0.0 <= getattr(m, name) < 1.0, f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(m, name)}")

    # --- parallelism -----------------------------------------------------------------------------
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    need(min(tp, pp, cp) >= 1, "parallel sizes must be at least 1")
    mp = tp * pp * cp
    need(cfg.world_size % mp == 0,
         f"tensor ({tp}) x pipeline ({pp}) x context ({cp}) parallel sizes = {mp} do not divide the world size "
         f"{cfg.world_size}; launch a multiple of {mp} processes or reduce the parallel sizes")
    cfg.data_parallel_size = cfg.get_data_parallel_size(cfg.world_size)
    need(m.num_attention_heads % tp == 0,
         f"--tensor-model-parallel-size {tp} must divide --num-attention-heads {m.num_attention_heads}")
    need(m.num_query_groups % tp == 0,
         f"--tensor-model-parallel-size {tp} must divide the number of query groups {m.num_query_groups}")
    need(m.num_layers % pp == 0,
         f"--pipeline-model-parallel-size {pp} must divide --num-layers {m.num_layers}")
    if tp == 1:
        m.sequence_parallel = False  # as Megatron-LM: nothing to parallelise without tensor parallelism

    # --- batch sizes and length ------------------------------------------------------------------
    dp = cfg.data_parallel_size
    if t.global_batch_size is None:
        t.global_batch_size = t.micro_batch_size * dp
    need(t.global_batch_size > 0 and t.global_batch_size % (t.micro_batch_size * dp) == 0,
         f"--global-batch-size {t.global_batch_size} is not a multiple of --micro-batch-size {t.micro_batch_size} "
         f"x data-parallel size {dp} = {t.micro_batch_size * dp}; use a multiple of {t.micro_batch_size * dp}")
    need(t.train_iters is None or t.train_samples is None,
         "--train-iters and --train-samples are exclusive; give one")
    if t.train_samples is not None:
        need(t.train_samples >= t.global_batch_size,
             f"--train-samples {t.train_samples} is less than one global batch ({t.global_batch_size})")
        t.train_iters = t.train_samples // t.global_batch_size
    elif t.train_iters is None:
        t.train_iters = 300
    need(t.train_iters >= 0, f"--train-iters must be non-negative, got {t.train_iters}")
    need(t.eval_interval > 0, f"--eval-interval must be positive, got {t.eval_interval}")
    need(t.eval_iters >= 0, f"--eval-iters must be non-negative, got {t.eval_iters}")
    need(lg.log_interval > 0, f"--log-interval must be positive, got {lg.log_interval}")
    need(lg.tensorboard_log_interval > 0, f"--tensorboard-log-interval must be positive, got {lg.tensorboard_log_interval}")
    need(lg.throughput_window_size >= 2, f"--throughput-window-size must be at least 2, got {lg.throughput_window_size}")
    need(t.exit_interval is None or t.exit_interval > 0, f"--exit-interval must be positive, got {t.exit_interval}")
    need(t.exit_signal in signal.Signals.__members__,
         f"--exit-signal {t.exit_signal} is not a signal name; use e.g. SIGTERM, SIGINT or SIGUSR1")

    # --- precision -------------------------------------------------------------------------------
    need(not (m.bf16 and m.fp16), "--bf16 and --fp16 are exclusive; pick one")

    # --- optimizer and schedule ------------------------------------------------------------------
    need(o.lr > 0, f"--lr must be positive, got {o.lr}")
    need(0 <= o.min_lr <= o.lr, f"--min-lr {o.min_lr} must be between 0 and --lr {o.lr}")
    need(o.clip_grad >= 0, f"--clip-grad must be non-negative, got {o.clip_grad}")
    need(not (s.override_opt_param_scheduler and s.use_checkpoint_opt_param_scheduler),
         "--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler are exclusive")
    _calculate_scheduler_steps(cfg)

    # --- data ------------------------------------------------------------------------------------
    _validate_data(cfg)
    _validate_fim(cfg)
    _validate_loggers(cfg)

    # --- checkpointing ---------------------------------------------------------------------------
    need(c.save_interval is None or c.save_interval > 0, f"--save-interval must be positive, got {c.save_interval}")
    need(c.most_recent_k == -1 or c.most_recent_k > 0, f"--most-recent-k must be positive or -1, got {c.most_recent_k}")
    if c.ckpt_format is None:
        c.ckpt_format = "torch_dist" if cfg.use_gpu else "torch"

    # --- the machine -----------------------------------------------------------------------------
    if m.transformer_impl is None:
        m.transformer_impl = "transformer_engine" if cfg.use_gpu and transformer_engine_installed() else "local"
    if not cfg.use_gpu:
        gpu_only = [
            (m.fp16, "--fp16"),
            (pp > 1, f"--pipeline-model-parallel-size {pp}"),
            (cp > 1, f"--context-parallel-size {cp}"),
            (m.sequence_parallel, "--sequence-parallel"),
            (o.use_distributed_optimizer, "--use-distributed-optimizer"),
            (m.transformer_impl == "transformer_engine", "--transformer-impl transformer_engine"),
            (c.ckpt_format == "torch_dist", "--ckpt-format torch_dist"),
            (cfg.dist.distributed_backend == "nccl", "--distributed-backend nccl"),
        ]
        for bad, what in gpu_only:
            need(not bad, f"{what} needs a GPU and none is visible; drop it to train on CPU "
                          f"(--tensor-model-parallel-size, --bf16 and data parallelism do run on CPU)")
    elif m.transformer_impl == "transformer_engine":
        need(transformer_engine_installed(),
             "--transformer-impl transformer_engine: transformer-engine is not installed; "
             "pip install transformer-engine[pytorch] or use --transformer-impl local")
    need(cp == 1 or m.transformer_impl == "transformer_engine",
         f"--context-parallel-size {cp} needs --transformer-impl transformer_engine")
    return cfg


def _calculate_scheduler_steps(cfg: ConfigContainer) -> None:
    """Scheduler lengths in samples, for iteration- and sample-based training (Bridge's
    `ConfigContainer._calculate_scheduler_steps`): megatron-core's scheduler is stepped by the
    global batch size each iteration, so every length is expressed in samples."""
    t, s, o = cfg.train, cfg.scheduler, cfg.optimizer
    gbs = t.global_batch_size
    if s.lr_warmup_fraction is not None and (s.lr_warmup_iters or s.lr_warmup_samples):
        # An explicit fraction wins over the default iteration count only when the user set both.
        s.lr_warmup_iters, s.lr_warmup_samples = 0, 0
    if t.train_samples is None:
        s.lr_decay_steps = (s.lr_decay_iters or t.train_iters) * gbs
        s.wd_incr_steps = t.train_iters * gbs
        s.wsd_decay_steps = s.lr_wsd_decay_iters * gbs if s.lr_wsd_decay_iters else None
        warmup = s.lr_warmup_iters * gbs
    else:  # sample-based: the *-samples flags, or the *-iters ones converted at the global batch size
        s.lr_decay_steps = s.lr_decay_samples or (s.lr_decay_iters * gbs if s.lr_decay_iters else t.train_samples)
        s.wd_incr_steps = t.train_samples
        s.wsd_decay_steps = s.lr_wsd_decay_iters * gbs if s.lr_wsd_decay_iters else None
        warmup = s.lr_warmup_samples or s.lr_warmup_iters * gbs
    s.lr_warmup_steps = int(s.lr_warmup_fraction * s.lr_decay_steps) if s.lr_warmup_fraction is not None else warmup
    # A run shorter than its warmup would never decay; clamp so megatron-core's asserts hold.
    s.lr_decay_steps = max(s.lr_decay_steps, 1)
    if s.lr_warmup_steps >= s.lr_decay_steps:
        s.lr_warmup_steps = max(s.lr_decay_steps - 1, 0)
    if s.start_weight_decay is None:
        s.start_weight_decay = o.weight_decay
    if s.end_weight_decay is None:
        s.end_weight_decay = o.weight_decay
    if s.weight_decay_incr_style == "constant" and s.start_weight_decay != s.end_weight_decay:
        raise ConfigError("--start-weight-decay and --end-weight-decay differ but --weight-decay-incr-style is "
                          "constant; use linear or cosine")
    if s.lr_decay_style == "WSD" and s.wsd_decay_steps is None:
        raise ConfigError("--lr-decay-style WSD needs --lr-wsd-decay-iters")


def parse_data_path(paths: list) -> tuple:
    """'0.7 A 0.3 B' or 'A B' -> (prefixes, weights or None), as Megatron-LM's --data-path."""
    paths = [str(p) for p in paths for p in str(p).split()]
    if len(paths) == 1:
        return paths, None
    try:
        weights = [float(w) for w in paths[0::2]]
    except ValueError:
        return paths, None
    prefixes = paths[1::2]
    if len(weights) != len(prefixes):
        raise ConfigError(f"--data-path {' '.join(paths)}: weights and prefixes must alternate ('0.7 A 0.3 B')")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"--data-path {' '.join(paths)}: weights must be non-negative and not all zero")
    return prefixes, weights


def _validate_data(cfg: ConfigContainer) -> None:
    d = cfg.dataset
    split_paths = [d.train_data_path, d.valid_data_path, d.test_data_path]
    if d.mock_data and (d.data_path or any(split_paths)):
        raise ConfigError("--mock-data and --data-path/--train-data-path are exclusive; drop one")
    if d.data_path and any(split_paths):
        raise ConfigError("--data-path and --train/valid/test-data-path are exclusive; use --split with --data-path")
    try:
        parts = [float(x) for x in d.split.replace("/", ",").split(",")]
    except ValueError:
        raise ConfigError(f"--split {d.split}: expected comma-separated numbers like 969,30,1")
    if len(parts) > 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ConfigError(f"--split {d.split}: expected up to three non-negative proportions like 969,30,1")
    if d.dataloader_type is None:
        d.dataloader_type = "batch" if d.sft else "single"
    if d.dataloader_type == "batch" and not d.sft:
        raise ConfigError("--dataloader-type batch pads variable-length examples: it needs --sft")
    if d.sft_pack_sequences and not d.sft:
        raise ConfigError("--sft-pack-sequences needs --sft")
    if d.sft and not (d.data_path or d.train_data_path):
        raise ConfigError("--sft needs --data-path (or --train-data-path): JSONL files of prompt/response pairs")
    if d.sft and d.mock_data:
        raise ConfigError("--sft reads JSONL files: give --data-path (or --train-data-path), not --mock-data")
    if d.num_workers < 0:
        raise ConfigError(f"--num-workers must be non-negative, got {d.num_workers}")
    for flag, paths in (("--data-path", d.data_path), ("--train-data-path", d.train_data_path),
                        ("--valid-data-path", d.valid_data_path), ("--test-data-path", d.test_data_path)):
        if not paths:
            continue
        prefixes, _ = parse_data_path(paths)
        for prefix in prefixes:
            if d.sft:
                if not os.path.isfile(prefix):
                    raise ConfigError(f"{flag}: {prefix} not found; with --sft give JSONL files of prompt/response pairs")
                continue
            for ext in (".bin", ".idx"):
                if not os.path.isfile(prefix + ext):
                    raise ConfigError(f"{flag}: {prefix}{ext} not found; give the prefix of an indexed dataset "
                                      f"(PREFIX.bin and PREFIX.idx, e.g. from `python data.py preprocess`)")
    tk = cfg.tokenizer
    if tk.tokenizer_type == "NullTokenizer" and not tk.vocab_size:
        raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size")
    if tk.tokenizer_type != "NullTokenizer" and tk.vocab_size is not None:
        raise ConfigError(f"--vocab-size is only for --tokenizer-type NullTokenizer; {tk.tokenizer_type} has its own vocabulary")
    if tk.tokenizer_type == "HuggingFaceTokenizer":
        if not tk.tokenizer_model:
            raise ConfigError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a tokenizer.json or its directory)")
        model_file = os.path.join(tk.tokenizer_model, "tokenizer.json") if os.path.isdir(tk.tokenizer_model) else tk.tokenizer_model
        if not os.path.isfile(model_file):
            raise ConfigError(f"--tokenizer-model {tk.tokenizer_model}: no tokenizer.json there")
        import importlib.util

        if importlib.util.find_spec("tokenizers") is None:
            raise ConfigError("--tokenizer-type HuggingFaceTokenizer needs the tokenizers package: pip install tokenizers")
    elif tk.tokenizer_model:
        raise ConfigError("--tokenizer-model is only for --tokenizer-type HuggingFaceTokenizer")
    if not (d.mock_data or d.data_path or any(split_paths)) and tk.tokenizer_type != "ByteTokenizer":
        raise ConfigError("the built-in corpus is byte-level text; use --tokenizer-type ByteTokenizer or give --data-path/--mock-data")


def _validate_fim(cfg: ConfigContainer) -> None:
    """--fim-* settings (Megatron-LM's validate_args: FIM needs real data and its sentinel tokens)."""
    d = cfg.dataset
    if not d.fim_data:
        given = [f.name for f in dataclasses.fields(d) if f.name.startswith("fim_") and getattr(d, f.name) != f.default]
        if given:
            raise ConfigError(f"--{given[0].replace('_', '-')} is a Fill-in-the-Middle setting; add --fim-data")
        return
    if d.mock_data or d.sft:
        raise ConfigError(f"--fim-data reorders pretraining documents; it does not apply to {'--mock-data' if d.mock_data else '--sft'}")
    for flag, rate in (("--fim-rate", d.fim_rate), ("--fim-spm-rate", d.fim_spm_rate), ("--fim-fragment-rate", d.fim_fragment_rate)):
        if rate is not None and not 0.0 <= rate <= 1.0:
            raise ConfigError(f"{flag} is a probability; give a value in [0, 1], got {rate}")
    names = [d.fim_prefix_token, d.fim_middle_token, d.fim_suffix_token, d.fim_pad_token]
    if not all(names) or len(set(names)) != 4:
        raise ConfigError(f"--fim-prefix/middle/suffix/pad-token must be four different non-empty names, got {names}")
    if d.fim_split_sample == "" or d.fim_no_prefix == "":
        raise ConfigError("--fim-split-sample and --fim-no-prefix need non-empty text")


def _import_logger(module: str, flag: str, pip: str):
    """The tracker's package, imported now, so a missing one is a one-line error before any work."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"{flag} needs the {module} package, which does not import ({reason}); pip install {pip}")


def _validate_loggers(cfg: ConfigContainer) -> None:
    """W&B, MLflow and Comet settings: each tracker is on when its switch is set (Bridge's LoggerConfig.finalize
    checks the MLflow dependency; here every tracker's package and store are checked before any work)."""
    lg = cfg.logger
    for prefix, switch in (("wandb_", "wandb_project"), ("mlflow_", "mlflow_experiment"), ("comet_", "comet_project")):
        given = [f.name for f in dataclasses.fields(lg) if f.name.startswith(prefix) and getattr(lg, f.name)]
        if given and not getattr(lg, switch):
            raise ConfigError(f"--{given[0].replace('_', '-')} needs --{switch.replace('_', '-')}, which turns that logger on")
    if isinstance(lg.mlflow_tags, list):  # from the command line: KEY=VALUE words
        bad = [t for t in lg.mlflow_tags if "=" not in t]
        if bad:
            raise ConfigError(f"--mlflow-tags {bad[0]}: expected KEY=VALUE pairs, e.g. --mlflow-tags team=nlp size=125m")
        lg.mlflow_tags = dict(t.split("=", 1) for t in lg.mlflow_tags)
    # Comet first: it asks to be imported before the libraries it watches (mlflow among them).
    if lg.comet_project:
        comet_ml = _import_logger("comet_ml", "--comet-project", "comet_ml")
        comet_config = comet_ml.config.get_config()
        online = comet_config["comet.start.online"] is not False and not comet_config["comet.offline"]
        if online and not (lg.comet_api_key or comet_config["comet.api_key"]):
            raise ConfigError("--comet-project: no Comet API key; set COMET_API_KEY (or run `comet login`), or set "
                              "COMET_START_ONLINE=0 to write an offline experiment")
    if lg.wandb_project:
        _import_logger("wandb", "--wandb-project", "wandb")
        if not lg.wandb_exp_name:
            raise ConfigError("--wandb-project needs --wandb-exp-name (the run's name), as in Megatron-LM")
    if lg.mlflow_experiment:
        mlflow = _import_logger("mlflow", "--mlflow-experiment", "mlflow-skinny")
        _check_mlflow_store(lg.mlflow_tracking_uri or mlflow.get_tracking_uri())


def _check_mlflow_store(uri: str) -> None:
    """MLflow 3 opens a file store (a path or file://) only with MLFLOW_ALLOW_FILE_STORE=true, and a database store
    (its default is sqlite:///mlflow.db) only with SQLAlchemy, which mlflow-skinny lacks: say so now, not mid-run."""
    import importlib.util

    scheme = uri.split("://", 1)[0] if "://" in uri else "file"
    if scheme == "file":
        from mlflow import environment_variables

        allow = getattr(environment_variables, "MLFLOW_ALLOW_FILE_STORE", None)  # absent: an MLflow that allows it
        if allow is not None and not allow.get():
            raise ConfigError(f"MLflow tracking store {uri} is a file store, which MLflow opens only with "
                              f"MLFLOW_ALLOW_FILE_STORE=true; set it, or give --mlflow-tracking-uri http://HOST:PORT")
    elif scheme.split("+")[0] in ("sqlite", "postgresql", "mysql", "mssql") and importlib.util.find_spec("sqlalchemy") is None:
        raise ConfigError(f"MLflow tracking store {uri} is a database, which needs the full mlflow package (pip install "
                          f"mlflow); or give --mlflow-tracking-uri http://HOST:PORT, or file:///DIR with MLFLOW_ALLOW_FILE_STORE=true")


def print_config(cfg: ConfigContainer, file=sys.stdout) -> None:
    """The resolved config, Megatron-style: one dotted line per setting, by section."""
    print("------------------------ arguments ------------------------", file=file)
    for section in SECTIONS:
        for f in dataclasses.fields(getattr(cfg, section)):
            name = f"{section}.{f.name}"
            value = getattr(getattr(cfg, section), f.name)
            value = "(hidden)" if value and f.name == "comet_api_key" else value
            print(f"  {name} {'.' * max(3, 48 - len(name))} {value}", file=file)
    for name in ("world_size", "data_parallel_size", "use_gpu", "padded_vocab_size"):
        print(f"  {name} {'.' * max(3, 48 - len(name))} {getattr(cfg, name)}", file=file)
    print("-------------------- end of arguments ---------------------", file=file, flush=True)
