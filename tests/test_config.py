"""config.py: flags generated from the dataclasses, YAML under flags, and every validation error as one line.

These tests import neither torch nor megatron-core: that is part of what they prove."""

import os
import subprocess
import sys

import pytest

import config
from conftest import ROOT


def parse(argv, world_size=1, gpu=False):
    return config.parse_args(argv, world_size=world_size, gpu=gpu)


def test_defaults_and_derived_values():
    cfg = parse([])
    assert cfg.model.num_layers == 4 and cfg.model.ffn_hidden_size == 4 * cfg.model.hidden_size
    assert cfg.model.num_query_groups == cfg.model.num_attention_heads
    assert cfg.train.global_batch_size == cfg.train.micro_batch_size  # one data-parallel rank
    assert cfg.train.train_iters == 300 and cfg.checkpoint.ckpt_format == "torch"
    assert cfg.model.transformer_impl == "local" and not cfg.use_gpu


def test_megatron_flags_map_to_their_sections():
    cfg = parse(["--num-layers", "6", "--hidden-size", "384", "--num-attention-heads", "6", "--num-query-groups", "2",
                 "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
                 "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--micro-batch-size", "2",
                 "--global-batch-size", "16", "--train-samples", "1600", "--lr", "2e-4", "--min-lr", "2e-5",
                 "--lr-decay-style", "linear", "--lr-warmup-iters", "10", "--no-save-optim", "--bf16",
                 "--tensor-model-parallel-size", "2"], world_size=4)
    assert (cfg.model.num_layers, cfg.model.num_query_groups, cfg.model.swiglu) == (6, 2, True)
    assert cfg.model.add_bias_linear is False and cfg.model.untie_embeddings_and_output_weights
    assert cfg.model.ffn_hidden_size == 1024  # SwiGLU: 2/3 of 4h, rounded down to a multiple of 64
    assert cfg.data_parallel_size == 2 and cfg.num_microbatches == 4
    assert cfg.train.train_iters == 100  # 1600 samples / 16 per step
    assert cfg.checkpoint.save_optim is False and cfg.model.bf16
    # Scheduler lengths are in samples: megatron-core's scheduler is stepped by the global batch size.
    assert cfg.scheduler.lr_warmup_steps == 10 * 16 and cfg.scheduler.lr_decay_steps == 1600


def test_every_field_has_help_and_a_flag():
    parser = config.build_parser()
    text = parser.format_help()
    for section, f, _ in config._cli_fields():
        assert f.metadata["help"], f"{section}.{f.name} is undocumented"
        flag = f.metadata["flag"] or "--" + f.name.replace("_", "-")
        assert flag in text
    for flag in ["--num-layers", "--micro-batch-size", "--global-batch-size", "--train-iters", "--save", "--load",
                 "--data-path", "--mock-data", "--tensorboard-dir", "--exit-signal-handler", "--log-throughput"]:
        assert flag in text


def test_yaml_file_with_flags_overriding(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  num_layers: 8\n  hidden_size: 128\ntrain:\n  train_iters: 50\n")
    cfg = parse(["--config-file", str(path), "--num-layers", "3"])
    assert cfg.model.num_layers == 3 and cfg.model.hidden_size == 128 and cfg.train.train_iters == 50


def test_run_config_yaml_round_trips(tmp_path):
    cfg = parse(["--num-layers", "3", "--swiglu"])
    path = tmp_path / "run_config.yaml"
    path.write_text(config.to_yaml(cfg))
    again = parse(["--config-file", str(path)])
    assert again.to_dict() == cfg.to_dict()


@pytest.mark.parametrize("argv, world_size, gpu, message", [
    (["--global-batch-size", "10", "--micro-batch-size", "4"], 2, False, "not a multiple of --micro-batch-size 4 x data-parallel size 2"),
    (["--hidden-size", "100", "--num-attention-heads", "3"], 1, False, "does not divide --hidden-size"),
    (["--num-query-groups", "3"], 1, False, "must divide --num-attention-heads"),
    (["--tensor-model-parallel-size", "2"], 3, False, "do not divide the world size 3"),
    (["--tensor-model-parallel-size", "8"], 8, False, "must divide --num-attention-heads"),
    (["--pipeline-model-parallel-size", "3"], 3, True, "must divide --num-layers"),
    (["--pipeline-model-parallel-size", "2"], 2, False, "needs a GPU"),
    (["--use-distributed-optimizer"], 1, False, "needs a GPU"),
    (["--sequence-parallel", "--tensor-model-parallel-size", "2"], 2, False, "needs a GPU"),
    (["--context-parallel-size", "2"], 2, True, "needs --transformer-impl transformer_engine"),
    (["--bf16", "--fp16"], 1, True, "exclusive"),
    (["--train-iters", "10", "--train-samples", "100"], 1, False, "exclusive"),
    (["--mock-data", "--data-path", "x"], 1, False, "exclusive"),
    (["--data-path", "/nonexistent/corpus"], 1, False, "/nonexistent/corpus.bin not found"),
    (["--split", "a,b"], 1, False, "--split a,b"),
    (["--min-lr", "1", "--lr", "0.1"], 1, False, "--min-lr 1.0 must be between"),
    (["--exit-signal", "SIGFOO"], 1, False, "not a signal name"),
    (["--seq-length", "512", "--max-position-embeddings", "256"], 1, False, "shorter than --seq-length"),
    (["--tokenizer-type", "NullTokenizer", "--mock-data"], 1, False, "needs --vocab-size"),
    (["--dataloader-type", "batch"], 1, False, "--dataloader-type batch pads variable-length examples: it needs --sft"),
    (["--sft"], 1, False, "--sft needs --data-path"),
    (["--sft", "--data-path", "/nonexistent.jsonl"], 1, False, "/nonexistent.jsonl not found; with --sft"),
    (["--num-layers", "four"], 1, False, "invalid int value"),
    (["--no-such-flag"], 1, False, "unrecognized arguments: --no-such-flag"),
])
def test_validation_errors_are_one_line_with_exit_code_2(argv, world_size, gpu, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse(argv, world_size=world_size, gpu=gpu)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_yaml_unknown_setting_is_named(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  num_layerz: 3\n")
    with pytest.raises(SystemExit):
        parse(["--config-file", str(path)])
    assert "'model' has no setting 'num_layerz'" in capsys.readouterr().err


def _run_cli(argv):
    """train.py as a user runs it, reporting whether torch got imported before it exited."""
    code = ("import runpy, sys; sys.argv = ['train.py'] + %r\n"
            "try:\n    runpy.run_path('train.py', run_name='__main__')\n"
            "except SystemExit as e:\n    print('exit', e.code, 'torch imported:', 'torch' in sys.modules)\n" % (argv,))
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, WORLD_SIZE="1"))


def test_help_and_errors_answer_before_importing_torch():
    help_run = _run_cli(["--help"])
    assert "--num-layers" in help_run.stdout and "exit 0 torch imported: False" in help_run.stdout
    bad = _run_cli(["--num-attention-heads", "3"])
    assert "exit 2 torch imported: False" in bad.stdout
    assert bad.stderr.strip().startswith("train.py: error: --num-attention-heads 3 does not divide")
    assert "Traceback" not in bad.stderr
