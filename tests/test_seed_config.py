"""The seed config page (../shared/seeds/002_*.txt), field by field: every setting it documents for a class is a
setting of the matching section here, with the documented default, or a difference named below (and tested where
it acts). The page lists what Bridge's classes add to or change from their megatron.training.config bases."""

import ast
import dataclasses
import glob
import os
import re

import pytest

import checks
import config
from conftest import ROOT

SEEDS = os.path.join(os.path.dirname(ROOT), "shared", "seeds")
PAGE = (glob.glob(os.path.join(SEEDS, "002_*.txt")) or [None])[0]

# The page's class -> this config's class (the ConfigContainer section it is, or the class itself).
CLASSES = {
    "DistributedDataParallelConfig": config.DistributedDataParallelConfig,
    "OptimizerConfig": config.OptimizerConfig,
    "DistributedInitConfig": config.DistributedInitConfig,
    "RerunStateMachineConfig": config.RerunStateMachineConfig,
    "DataloaderConfig": config.DataloaderConfig,
    "DatasetBuildContext": config.DatasetBuildContext,
    "OptimizerConfigOverrideProviderContext": config.OptimizerConfigOverrideProviderContext,
    "GPTDatasetConfig": config.GPTDatasetConfig,
    "FinetuningDatasetConfig": config.FinetuningDatasetConfig,
    "TrainingConfig": config.TrainingConfig,
    "CheckpointConfig": config.CheckpointConfig,
    "LoggerConfig": config.LoggerConfig,
    "TensorInspectConfig": config.TensorInspectConfig,
    "FaultToleranceConfig": config.FaultToleranceConfig,
    "StragglerDetectionConfig": config.StragglerDetectionConfig,
    "NVRxStragglerDetectionConfig": config.NVRxStragglerDetectionConfig,
    "InProcessRestartConfig": config.InProcessRestartConfig,
    "ConfigContainer": config.ConfigContainer,
}

# Where this config differs from the page, and why; each is a choice the README or a test states.
DIFFERENCES = {
    # Settings of the whole run that live in one section here.
    ("FinetuningDatasetConfig", "seq_length"): "model.seq_length (--seq-length) is the one sequence length",
    ("FinetuningDatasetConfig", "seed"): "rng.seed (--seed, default 1234) seeds the data too",
    ("FinetuningDatasetConfig", "dataloader_type"): "None: 'batch' is derived for --sft (checks.derive_data)",
}


def page_fields() -> list:
    """(class, field, type, default text) of each `name: type#` entry under each `class bridge.training.config.X`,
    the default being the entry's next non-empty line."""
    lines = open(PAGE, encoding="utf-8").read().splitlines()
    fields, cls = [], None
    for i, line in enumerate(lines):
        m = re.match(r"^class bridge\.training\.config\.(\w+)", line)
        if m:
            cls = m.group(1)
            continue
        m = re.match(r"^(\w+): (.+)#$", line)
        if m and cls:
            default = next((x.strip() for x in lines[i + 1:i + 4] if x.strip()), "")
            fields.append((cls, m.group(1), m.group(2), default))
    return fields


def page_default(text: str):
    """The page's default as a Python value, or the text when it is not a literal. Its quotes are typographic, and
    the opening one is stored double-encoded (UTF-8 read as another code page: "\u03b2\u20ac\u02dc")."""
    for quote in ("\u03b2\u20ac\u02dc", "\u2018", "\u2019"):
        text = text.replace(quote, "'")
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def our_default(cls, name):
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None  # required: the page's None


@pytest.mark.skipif(PAGE is None, reason="the specification (../shared/seeds) is not beside the checkout")
def test_every_documented_field_is_a_setting_with_its_documented_default():
    fields = page_fields()
    assert len(fields) > 100 and {c for c, *_ in fields} <= set(CLASSES), {c for c, *_ in fields} - set(CLASSES)
    missing, wrong = [], []
    for cls_name, name, _, default_text in fields:
        cls = CLASSES[cls_name]
        if name not in {f.name for f in dataclasses.fields(cls)}:
            if (cls_name, name) not in DIFFERENCES:
                missing.append(f"{cls_name}.{name}")
            continue
        if cls_name == "ConfigContainer" or (cls_name, name) in DIFFERENCES:
            continue  # sections (their classes are checked field by field), and the named differences
        documented, ours = page_default(default_text), our_default(cls, name)
        if isinstance(documented, str) and default_text in ("", "None") or documented is None:
            documented = None
        same = (tuple(ours) == tuple(documented) if isinstance(ours, (list, tuple)) and isinstance(documented, (list, tuple))
                else ours == documented)
        if not same:
            wrong.append(f"{cls_name}.{name}: page {documented!r}, here {ours!r}")
    assert not missing, f"documented fields that are no setting here: {missing}"
    assert not wrong, wrong


@pytest.mark.skipif(PAGE is None, reason="the specification (../shared/seeds) is not beside the checkout")
def test_each_named_difference_is_a_field_of_the_page():
    documented = {(c, n) for c, n, *_ in page_fields()}
    assert set(DIFFERENCES) <= documented, set(DIFFERENCES) - documented


# --- what the page's settings do ------------------------------------------------------------------------------------

import json  # noqa: E402

import torch  # noqa: E402

from conftest import TINY, config_error, log_lines, tensorboard_scalars, train_here  # noqa: E402

RUN = [*TINY, "--mock-data", "--eval-iters", "0", "--num-workers", "0", "--log-interval", "1"]


def yaml_file(tmp_path, text: str) -> str:
    path = tmp_path / "settings.yaml"
    path.write_text(text)
    return str(path)


def test_a_custom_checkpoint_manager_does_the_saves_and_the_loads(tmp_path):
    """checkpoint.custom_manager_class: the example manager (tests/copying_manager.py) saves as the default one does
    and copies each published checkpoint; a run resumed from the copies continues where they stop."""
    manager = yaml_file(tmp_path, "checkpoint:\n  custom_manager_class: copying_manager.CopyingCheckpointManager\n")
    save = tmp_path / "ckpt"
    train_here([*RUN, "--config-file", manager, "--train-iters", "6", "--exit-interval", "4", "--save", str(save),
                "--save-interval", "2",
                "--data-cache-path", str(tmp_path / "cache")])
    copies = tmp_path / "ckpt_copies"
    assert sorted(os.listdir(copies)) == sorted(os.listdir(save)) and (copies / "iter_0000002").is_dir()
    assert (copies / "latest_checkpointed_iteration.txt").read_text() == "4"
    out = train_here([*RUN, "--config-file", manager, "--train-iters", "6", "--load", str(copies), "--save",
                      str(tmp_path / "again"), "--data-cache-path", str(tmp_path / "cache")])
    assert [it for it, *_ in log_lines(out)] == [5, 6]
    assert (tmp_path / "again_copies" / "iter_0000006").is_dir()


@pytest.mark.parametrize("path, message", [
    ("nosuchmodule.Manager", "checkpoint.custom_manager_class nosuchmodule.Manager: cannot import nosuchmodule"),
    ("copying_manager.Missing", "checkpoint.custom_manager_class copying_manager.Missing: module copying_manager has "
                                "no Missing"),
    ("copying_manager.NoLoad", "checkpoint.custom_manager_class copying_manager.NoLoad: the class has no load() "
                               "(Bridge's CheckpointManager protocol: save, load, finalize_async_saves)"),
])
def test_a_manager_that_does_not_import_or_lacks_a_method_is_one_line_before_the_model(path, message, tmp_path, capsys):
    import train

    cfg = checks.parse_args([*RUN, "--train-iters", "2", "--enable-experimental", "--config-file",
                             yaml_file(tmp_path, f"checkpoint:\n  custom_manager_class: {path}\n")], world_size=1, gpu=False)
    assert train.main(cfg) == 2
    from megatron.core import config as mcore_config

    assert mcore_config.is_experimental_enabled() is False  # a run that failed in setup leaves it as it was
    captured = capsys.readouterr()
    assert captured.err.startswith(f"train.py: error: {message}") and captured.err.count("\n") == 1, captured.err
    assert "number of parameters" not in captured.out  # no model was built


def test_writers_per_rank_set_the_number_of_files_of_a_save(tmp_path):
    """storage_writers_per_rank (Megatron-LM's --dist-ckpt-workers): one saving rank, three writers, three files; the
    checkpoint loads as any other (the 4-rank case: test_engine)."""
    train_here([*RUN, "--train-iters", "2", "--save", str(tmp_path / "ckpt"), "--dist-ckpt-workers", "3",
                "--data-cache-path", str(tmp_path / "cache")])
    files = os.listdir(tmp_path / "ckpt" / "iter_0000002")
    assert sorted(f for f in files if f.endswith(".distcp")) == ["__0_0.distcp", "__0_1.distcp", "__0_2.distcp"]
    out = train_here([*RUN, "--train-iters", "3", "--load", str(tmp_path / "ckpt"), "--no-save",
                      "--override-opt-param-scheduler",
                      "--data-cache-path", str(tmp_path / "cache")])
    assert [it for it, *_ in log_lines(out)] == [3]


def test_async_strategy_nvrx_falls_back_to_mcore_without_nvidia_resiliency_ext():
    why = checks.nvrx_async_unusable()
    if why is None:
        pytest.skip("nvidia-resiliency-ext 0.6+ is installed: nvrx is used as given")
    cfg = checks.parse_args(["--mock-data", "--async-save"], world_size=1, gpu=False)
    assert cfg.checkpoint.async_strategy == "mcore"
    assert cfg.derived["checkpoint.async_strategy"] == ("mcore", why)  # named in the printed config
    # Without --async-save megatron-core's own post-init makes it mcore (training_config.py:631-632), named too.
    plain = checks.parse_args(["--mock-data"], world_size=1, gpu=False)
    assert plain.derived["checkpoint.async_strategy"] == ("mcore", "megatron-core's CheckpointConfig post-init")


def test_skip_train_metrics_log_silences_the_log_line_and_the_training_scalars(tmp_path):
    skip = yaml_file(tmp_path, "logger:\n  skip_train_metrics_log: true\n")
    out = train_here([*TINY, "--mock-data", "--num-workers", "0", "--train-iters", "4", "--eval-interval", "2",
                      "--eval-iters", "1", "--config-file", skip, "--tensorboard-dir", str(tmp_path / "tb"),
                      "--data-cache-path", str(tmp_path / "cache")])
    assert log_lines(out) == [] and "validation loss at iteration 2" in out
    tags = set(tensorboard_scalars(tmp_path / "tb"))
    assert "lm loss validation" in tags and not {"lm loss", "learning-rate", "grad-norm", "loss-scale"} & tags


def test_the_loader_settings_reach_the_dataloader(tmp_path, single_rank_groups):
    import data

    cfg = checks.parse_args(["--mock-data", "--num-workers", "1"], world_size=1, gpu=False)
    assert (cfg.dataset.pin_memory, cfg.dataset.persistent_workers) == (False, True)  # derived: no GPU
    loader = data.build_data_loader(list(range(40)), 0, cfg)
    assert (loader.pin_memory, loader.persistent_workers, loader.num_workers) == (False, True, 1)
    cfg = checks.parse_args(["--mock-data", "--num-workers", "0"], world_size=1, gpu=False)
    assert data.build_data_loader(list(range(40)), 0, cfg).persistent_workers is False  # torch's rule: no workers


def test_without_data_sharding_each_rank_strides_one_permutation_of_the_whole_dataset():
    """Megatron-LM's --no-data-sharding (data_samplers.py): the cyclic sampler's ranks take turns through one
    permutation of all samples instead of each shuffling its own contiguous bucket."""
    import data

    def first_epoch(rank, sharding):
        sampler = data.MegatronPretrainingRandomSampler(20, 0, 2, rank, 2, data_sharding=sharding)
        batches = iter(sampler)
        return [i for _ in range(5) for i in next(batches)]

    sharded = [first_epoch(r, True) for r in (0, 1)]
    assert sorted(sharded[0]) == list(range(10)) and sorted(sharded[1]) == list(range(10, 20))
    whole = [first_epoch(r, False) for r in (0, 1)]
    order = torch.randperm(20, generator=torch.Generator().manual_seed(0)).tolist()  # epoch 0's
    assert whole == [order[0::2], order[1::2]]
    assert sorted(whole[0] + whole[1]) == list(range(20))


@pytest.mark.parametrize("yaml_text, message", [
    ("dataset:\n  drop_last: false\n", "dataset.drop_last False would give a short last batch"),
    ("dist:\n  use_decentralized_pg: true\n", "dist.use_decentralized_pg: this trainer builds and reads"),
])
def test_what_the_page_offers_and_this_trainer_cannot_do_is_one_line(yaml_text, message, tmp_path, capsys):
    assert message in config_error(["--mock-data", "--config-file", yaml_file(tmp_path, yaml_text)], capsys)


@pytest.mark.parametrize("flags, message", [
    (["--no-data-sharding"], "--no-data-sharding changes how the cyclic loader shuffles"),
    (["--log-straggler", "--disable-straggler-on-startup"], "--disable-straggler-on-startup waits for Megatron-LM's"),
    (["--ddp-param-name-patterns-for-fp32-local-accumulation", "all"], "it needs --bf16 with --grad-reduce-in-bf16"),
])
def test_megatron_lm_flags_of_the_new_settings_refuse_what_cannot_run(flags, message, capsys):
    assert message in config_error(["--mock-data", *flags], capsys)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_finetuning_dataset_root_in_bridges_layout(tmp_path, capsys):
    """FinetuningDatasetConfig: dataset_root's training.jsonl and validation.jsonl (do_test off), the first
    max_train_samples examples, and the JSONL keys dataset_kwargs names."""
    import data

    root = tmp_path / "root"
    root.mkdir()
    write_jsonl(root / "training.jsonl", [{"q": f"question {i}", "a": f"answer {i}"} for i in range(5)])
    write_jsonl(root / "validation.jsonl", [{"q": "valid q", "a": "valid a"}])
    settings = yaml_file(tmp_path, f"dataset:\n  dataset_root: {root}\n  do_test: false\n  max_train_samples: 3\n"
                                   f"  dataset_kwargs: {{prompt_key: q, response_key: a}}\n")
    cfg = checks.parse_args([*TINY, "--config-file", settings, "--train-iters", "2"], world_size=1, gpu=False)
    assert type(cfg.dataset) is config.FinetuningDatasetConfig and cfg.dataset.sft
    assert (cfg.dataset.train_data_path, cfg.dataset.valid_data_path, cfg.dataset.test_data_path) == (
        [str(root / "training.jsonl")], [str(root / "validation.jsonl")], None)
    tokenizer = data.ByteTokenizer()
    train_set, valid_set, test_set = data.build_sft_datasets(cfg, tokenizer)
    assert (len(train_set), len(valid_set), test_set) == (3, 1, None)
    ids, mask, _ = train_set.items[2]
    prompt = tokenizer.tokenize("question 2")
    assert ids == prompt + tokenizer.tokenize("answer 2") + [tokenizer.eod] and mask == [0] * len(prompt) + [1] * 9
    settings = yaml_file(tmp_path, f"dataset:\n  dataset_root: {root}\n")  # do_test on, and no test.jsonl
    assert "no test.jsonl in it" in config_error([*TINY, "--config-file", settings], capsys)
    settings = yaml_file(tmp_path, f"dataset:\n  dataset_root: {root}\n  do_test: false\n  dataset_kwargs: {{label_key: a}}\n")
    assert "dataset.dataset_kwargs: label_key is not an option" in config_error([*TINY, "--config-file", settings], capsys)


def test_bridges_packed_sequence_file_gives_the_packed_samples(tmp_path):
    """packed_sequence_specs: a file that Bridge 0.6.2's own packer wrote (tests/fixtures/packed/make_bridge_packed.py:
    its create_hist, create_packing_strategy and fill_packing_strategy; the examples end to end, a loss mask rolled
    onto the labels, each example's start) gives the samples that packing the same examples, in the bins Bridge
    chose, gives here, target for target."""
    import data

    tokenizer = data.ByteTokenizer()
    records = [{"prompt": "ab", "response": "cd"}, {"prompt": "efg", "response": "h"}, {"prompt": "ijklm", "response": "no"}]
    examples = [data.sft_example(r, tokenizer, "test") for r in records]
    seq_length = 12  # Bridge's first_fit_shuffle put the third (8 tokens) and the second (5) in one bin, the first alone
    packed = data.SFTDataset([examples[2], examples[1], examples[0]], tokenizer, seq_length, pack=True)
    assert [pieces for _, _, pieces in packed.items] == [[8, 5], [5]]
    path = os.path.join(ROOT, "tests", "fixtures", "packed", "bridge_packed_train.npy")
    settings = yaml_file(tmp_path, f"dataset:\n  sft: true\n  packed_sequence_specs:\n    packed_train_data_path: "
                                   f"{path}\n    packed_sequence_size: {seq_length}\n")
    train_data = tmp_path / "unused.jsonl"
    write_jsonl(train_data, records)
    cfg = checks.parse_args([*TINY, "--seq-length", str(seq_length), "--config-file", settings, "--data-path",
                             str(train_data), "--eval-iters", "0"], world_size=1, gpu=False)
    from_file = data.build_sft_datasets(cfg, tokenizer)[0]
    assert len(from_file) == 2
    for i in range(2):
        ours, theirs = packed[i], from_file[i]
        for key in ("tokens", "labels", "loss_mask", "position_ids", "attention_mask"):
            assert torch.equal(ours[key], theirs[key]), (i, key)


def test_experimental_features_and_fp32_local_accumulation_reach_megatron_core(tmp_path):
    """--enable-experimental sets megatron-core's experimental flag for the run only; the DDP config's
    param_name_patterns_for_fp32_local_accumulation gives the matched parameters fp32 main gradients."""
    import train
    from megatron.core import config as mcore_config

    seen = []

    def forward_step(state, data_iterator, model):
        seen.append((mcore_config.is_experimental_enabled(),
                     {name: p.main_grad.dtype for name, p in model.named_parameters()}))
        return train.forward_step(state, data_iterator, model)

    cfg = checks.parse_args([*RUN, "--train-iters", "2", "--bf16", "--grad-reduce-in-bf16", "--enable-experimental",
                             "--ddp-param-name-patterns-for-fp32-local-accumulation", "*.bias", "--no-save",
                             "--data-cache-path", str(tmp_path / "cache")], world_size=1, gpu=False)
    train.pretrain(cfg, forward_step)
    experimental, grads = seen[0]
    assert experimental and any(name.endswith(".bias") for name in grads)
    assert all(dtype == (torch.float32 if name.endswith(".bias") else torch.bfloat16) for name, dtype in grads.items())
    assert mcore_config.is_experimental_enabled() is False
