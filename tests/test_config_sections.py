"""The configuration is megatron-core's own: each section an instance of the class the seed page names as its base,
and nothing a user could say before the sections moved onto those classes lost on the way (the flag set and a
run_config.yaml, both recorded before the move in tests/fixtures/config_before/)."""

import os

import checks
import config

BEFORE = os.path.join(os.path.dirname(__file__), "fixtures", "config_before")


def test_every_flag_of_before_the_move_is_still_a_flag():
    before = open(os.path.join(BEFORE, "flags.txt")).read().split()
    now = {o for action in config.build_parser()._actions for o in action.option_strings}
    assert len(before) > 400 and [f for f in before if f not in now] == []


def test_a_run_config_yaml_written_before_the_move_still_loads():
    path = os.path.join(BEFORE, "run_config.yaml")
    cfg = checks.parse_args(["--config-file", path], world_size=1, gpu=False)
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.train.train_iters) == (2, 64, 5)
    assert (cfg.scheduler.lr_warmup_iters, cfg.checkpoint.save_interval, cfg.train.exit_signal_handler) == (2, 3, True)
    # Every setting the file holds is the config's, under its name now (config.FORMER_NAMES), but for the settings that
    # moved: the evaluation settings are the validation section's (train's are Bridge's deprecated spellings, copied
    # there as the file is read, so that --eval-interval given with it wins), megatron-core's post-init makes the async
    # strategy mcore without --async-save, and megatron-core's
    # create_attention_mask is derived off without --reset-attention-mask (the mask that was never built before either).
    import yaml

    written = yaml.safe_load(open(path))
    differ = {}
    for section, values in written.items():
        for key, value in (values or {}).items():
            where, name, convert = section, key, None
            if (section, key) in config.FORMER_NAMES:
                name, convert = config.FORMER_NAMES[section, key]
                where, name = name.split(".") if "." in name else (section, name)
            now = getattr(getattr(cfg, where), name)
            now = config.plain_value(now)
            if now != (convert(value) if convert else value):
                differ[f"{section}.{key}"] = (value, now)
    t = written["train"]
    assert differ == {"validation.eval_iters": (None, t["eval_iters"]), "validation.eval_interval": (None, t["eval_interval"]),
                      "validation.skip_train": (None, t["skip_train"]), "train.eval_iters": (t["eval_iters"], None),
                      "train.eval_interval": (t["eval_interval"], None), "train.skip_train": (t["skip_train"], None),
                      # the default as its flag reads it is the default as the class holds it (an empty list was null)
                      "model.moe_layer_freq": ("1", 1), "train.iterations_to_skip": (None, []), "checkpoint.async_strategy": ("nvrx", "mcore"),
                      "dataset.create_attention_mask_in_dataloader": (True, False)}


def test_a_finetuning_run_config_yaml_written_before_the_move_still_loads(tmp_path):
    """A FinetuningDatasetConfig's run_config.yaml held every pretraining setting of the dataset section too, at its
    default: they are not a FinetuningDatasetConfig's settings now (Bridge's is no megatron-core GPTDatasetConfig)."""
    import yaml

    written = yaml.safe_load(open(os.path.join(BEFORE, "run_config.yaml")))
    for name in ("training", "validation"):
        (tmp_path / f"{name}.jsonl").write_text('{"prompt": "a", "response": "b"}\n')
    written["dataset"].update(sft=True, dataset_root=str(tmp_path), do_test=False)
    (tmp_path / "run_config.yaml").write_text(yaml.safe_dump(written))
    cfg = checks.parse_args(["--config-file", str(tmp_path / "run_config.yaml")], world_size=1, gpu=False)
    assert type(cfg.dataset) is config.FinetuningDatasetConfig
    assert cfg.dataset.train_data_path == [str(tmp_path / "training.jsonl")] and cfg.dataset.split == "969,30,1"


def test_every_section_is_an_instance_of_the_class_the_seed_names_as_its_base():
    """The seed page's `Bases:` of each section (and the container's rng and validation, megatron-core's own)."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.training import config as mcore

    cfg = config.ConfigContainer()
    bases = {"train": mcore.TrainingConfig, "validation": mcore.ValidationConfig, "scheduler": mcore.SchedulerConfig,
             "logger": mcore.LoggerConfig, "checkpoint": mcore.CheckpointConfig, "rng": mcore.RNGConfig,
             "dist": mcore.DistributedInitConfig, "profiling": mcore.ProfilingConfig,
             "straggler": mcore.StragglerDetectionConfig, "rerun_state_machine": mcore.RerunStateMachineConfig,
             "optimizer": OptimizerConfig, "ddp": DistributedDataParallelConfig, "dataset": GPTDatasetConfig}
    assert {s: type(getattr(cfg, s)).__mro__[:3] for s, base in bases.items()
            if not isinstance(getattr(cfg, s), base)} == {}
    assert type(cfg.rng) is mcore.RNGConfig and type(cfg.validation) is mcore.ValidationConfig


def test_megatron_cores_own_refusals_are_one_line():
    """What megatron-core's post-inits refuse (and no check of this trainer says first) stops validation in one line:
    an optimizer setting megatron-core's OptimizerConfig refuses, a model megatron-core's TransformerConfig refuses
    (set after validation, as a script would, where the flags' own checks do not see it)."""
    import copy

    import pytest

    base = checks.parse_args(["--train-iters", "5"], world_size=1, gpu=False)
    cfg = copy.deepcopy(base)
    cfg.model.recompute_granularity = "full"  # without a recompute method
    with pytest.raises(config.ConfigError, match="^megatron-core's TransformerConfig refuses these settings: Using "
                                                 "recompute_granularity: full so recompute_method must be"):
        checks.check_transformer_config(cfg)
    cfg = copy.deepcopy(base)
    cfg.optimizer.use_precision_aware_optimizer = True  # a megatron-core field this trainer does not act on
    with pytest.raises(config.ConfigError, match="^optimizer.use_precision_aware_optimizer True is not supported"):
        checks.check_mcore_fields(cfg)
    cfg = copy.deepcopy(base)
    cfg.optimizer.optimizer = "sgd"
    cfg.optimizer.use_precision_aware_optimizer = True
    with pytest.raises(config.ConfigError, match="^megatron-core's OptimizerConfig refuses these settings: "
                                                 "--use-precision-aware-optimizer only supported with adam"):
        checks.require_finalizes(cfg.optimizer)
