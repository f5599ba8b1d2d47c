"""Editing a run: `--config-file <run A's run_config.yaml> F` is the run `A F`, for any flag F. The config is equal
field by field (or both are refused with the same line), and the run prints the same losses. Tested as a property over
every flag of the parser, each with generated values, on YAML files written by real runs (one rank, and two ranks
with tensor parallelism) and on the file committed from before the sections moved onto megatron-core's classes. Then:
a YAML value is read as its flag reads it, and a value one machine or one process answered never travels."""

import argparse
import contextlib
import glob
import io
import os

import pytest
import yaml

from conftest import LLAMA_FLAGS, TINY, log_lines, train_here, trained_in_process_flags

BEFORE = os.path.join(os.path.dirname(__file__), "fixtures", "config_before", "run_config.yaml")
# The command line that builds what that file holds (its settings that differ from the defaults and were given).
BEFORE_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--seq-length", "32", "--micro-batch-size", "2",
                "--train-iters", "5", "--exit-signal-handler", "--lr", "3e-4", "--lr-warmup-iters", "2",
                "--log-interval", "1", "--save-interval", "3"]


def generated_flags(parser: argparse.ArgumentParser) -> list:
    """Every flag of the parser with values made from its declaration: a switch alone, each of a flag's choices, a
    number (2, 0.5), a word for a string."""
    cases = []
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "config_file"):
            continue
        flag = action.option_strings[0]
        if action.nargs == 0:
            cases.append([flag])
        elif action.choices:
            cases += [[flag, str(choice)] for choice in action.choices]
        elif action.type is int:
            cases.append([flag, "2"])
        elif action.type is float:
            cases.append([flag, "0.5"])
        else:
            cases.append([flag, "x"])
    return cases


def outcome(parser, argv, world_size):
    """The validated config's settings and what validation filled in, or the one line that refuses it."""
    import checks
    import config

    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            cfg = checks.config_from_flags(argv, world_size=world_size, gpu=False, parser=parser)
    except config.ConfigError as e:
        return "refused", str(e)
    except SystemExit:
        return "refused", err.getvalue()
    return "accepted", cfg.to_dict(), sorted(cfg.filled_in)


def edits_that_differ(run_flags, yaml_path, world_size) -> list:
    import config

    parser = config.build_parser()
    cases = generated_flags(parser)
    assert len(cases) > 450  # every flag, not a hand-picked list
    return [flag for flag in cases if outcome(parser, [*run_flags, *flag], world_size) !=
            outcome(parser, ["--config-file", str(yaml_path), *flag], world_size)]


def test_every_edit_of_a_one_rank_runs_yaml_is_that_command_line_edited(llama_ckpt):
    run_flags = trained_in_process_flags(os.path.dirname(llama_ckpt), LLAMA_FLAGS)
    written = sorted(glob.glob(os.path.join(llama_ckpt, "iter_*", "run_config.yaml")))[-1]
    assert edits_that_differ(run_flags, written, 1) == []


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory, warm_torchrun):
    """A two-rank run with tensor parallelism that saves, and its command line."""
    out = tmp_path_factory.mktemp("tp2_yaml")
    flags = [*TINY, "--mock-data", "--tensor-model-parallel-size", "2", "--sequence-parallel", "--train-iters", "2",
             "--eval-iters", "0", "--save", str(out / "ckpt"), "--data-cache-path", str(out / "cache")]
    proc = warm_torchrun(flags)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return flags, out / "ckpt" / "iter_0000002" / "run_config.yaml"


@pytest.mark.full  # the fast command: the one-rank run's file
def test_every_edit_of_a_two_rank_tensor_parallel_runs_yaml_is_that_command_line_edited(tp2_run):
    run_flags, written = tp2_run
    assert edits_that_differ(run_flags, written, 2) == []


@pytest.mark.full  # the fast command: the one-rank run's file
def test_every_edit_of_the_yaml_written_before_the_move_is_its_command_line_edited():
    """A file without the `derived:` list (Bridge's, or this trainer's before it): the values validation puts back when
    each alone is left out are derived again (--weight-decay reaches the schedule's weight decays, --eval-interval
    beats the file's deprecated train.eval_interval)."""
    import checks

    cfg = checks.config_from_flags(["--config-file", BEFORE, "--weight-decay", "0.1", "--eval-interval", "50",
                                    "--hidden-size", "128"], world_size=1, gpu=False)
    assert (cfg.scheduler.start_weight_decay, cfg.scheduler.end_weight_decay) == (0.1, 0.1)
    assert (cfg.validation.eval_interval, cfg.model.ffn_hidden_size, cfg.model.kv_channels) == (50, 512, 32)
    assert edits_that_differ(BEFORE_FLAGS, BEFORE, 1) == []


def test_an_edited_runs_losses_are_the_command_lines(llama_ckpt, tmp_path):
    """The run itself: the file plus two edits trains as the command line plus them, loss for loss."""
    run_flags = trained_in_process_flags(os.path.dirname(llama_ckpt), LLAMA_FLAGS)
    written = sorted(glob.glob(os.path.join(llama_ckpt, "iter_*", "run_config.yaml")))[-1]
    edit = ["--weight-decay", "0.5", "--hidden-size", "32", "--log-interval", "1", "--no-save"]
    from_flags = log_lines(train_here([*run_flags, *edit]))
    from_file = log_lines(train_here(["--config-file", written, *edit]))
    assert len(from_flags) == 4 and from_file == from_flags


def test_the_file_says_what_was_set_and_lists_what_was_derived(llama_ckpt):
    """run_config.yaml holds the settings as given (megatron-core's finalize() runs on the model's copy), not this
    machine's answer (CPU initialisation) nor a process's own (local_rank); what validation filled in is listed."""
    written = yaml.safe_load(open(sorted(glob.glob(os.path.join(llama_ckpt, "iter_*", "run_config.yaml")))[-1]))
    assert written["model"]["use_cpu_initialization"] is False and written["model"]["embedding_init_method_std"] is None
    assert "local_rank" not in written["dist"]
    assert {"model.transformer_impl", "model.ffn_hidden_size", "scheduler.start_weight_decay",
            "scheduler.lr_decay_steps"} <= set(written["derived"])
    assert "model.num_layers" not in written["derived"]


def test_a_machines_answer_is_derived_again_on_the_next_machine(tmp_path):
    """A file written without a GPU says transformer_impl local; read where a GPU and transformer-engine are, the
    run derives transformer-engine again (a flag or a file that asks for local keeps local)."""
    import checks
    import config

    cfg = checks.config_from_flags([], world_size=1, gpu=False)
    (tmp_path / "run_config.yaml").write_text(config.to_yaml(cfg))
    assert cfg.model.transformer_impl == "local" and cfg.dist.distributed_backend is None
    there = checks.settings_from_yaml(str(tmp_path / "run_config.yaml"), config.build_parser(), world_size=1, gpu=True)
    assert "transformer_impl" not in there["model"] and "global_batch_size" not in there["train"]
    asked = checks.config_from_flags(["--transformer-impl", "local"], world_size=1, gpu=False)
    (tmp_path / "local.yaml").write_text(config.to_yaml(asked))
    assert checks.settings_from_yaml(str(tmp_path / "local.yaml"), config.build_parser(), gpu=True)["model"][
        "transformer_impl"] == "local"


@pytest.mark.parametrize("section, name, value, line", [
    ("scheduler", "lr_decay_style", "cosin", "argument --lr-decay-style: invalid choice: 'cosin'"),
    ("optimizer", "optimizer", "adamw", "argument --optimizer: invalid choice: 'adamw'"),
    ("model", "normalization", "rmsnorm", "argument --normalization: invalid choice: 'rmsnorm'"),
    ("logger", "timing_log_option", "everything", "argument --timing-log-option: invalid choice: 'everything'"),
    ("checkpoint", "ckpt_format", "torch_dcp", "argument --ckpt-format: invalid choice: 'torch_dcp'"),
    ("checkpoint", "ckpt_format", "fsdp_dtensor", "argument --ckpt-format: invalid choice: 'fsdp_dtensor'"),
    ("model", "hidden_size", "sixty-four", "argument --hidden-size: invalid int value: 'sixty-four'"),
    ("model", "hidden_size", [64, 128], "[64, 128] is a list; --hidden-size takes one value"),
    ("model", "swiglu", 3, "3 is not true or false (--swiglu is a switch)"),
    ("checkpoint", "async_write_results_mp_mode", "thread", "'thread' is not one of ['fork', 'spawn', 'forkserver']"),
])
def test_a_yaml_value_is_read_as_its_flag_reads_it(tmp_path, capsys, section, name, value, line):
    """A bad value is the flag's one line, exit 2, before anything is built."""
    import checks

    (tmp_path / "run.yaml").write_text(yaml.safe_dump({section: {name: value}}))
    with pytest.raises(SystemExit) as e:
        checks.parse_args(["--config-file", str(tmp_path / "run.yaml")], world_size=1, gpu=False)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith(f"train.py: error: --config-file {tmp_path / 'run.yaml'}: {section}.{name}: ") and line in err


def test_a_yaml_number_as_a_string_is_the_flags_number(tmp_path):
    import checks

    (tmp_path / "run.yaml").write_text('model:\n  hidden_size: "128"\n')
    cfg = checks.parse_args(["--config-file", str(tmp_path / "run.yaml")], world_size=1, gpu=False)
    assert cfg.model.hidden_size == 128 and cfg.model.ffn_hidden_size == 512


def test_a_flag_beats_the_files_mixed_precision_recipe(tmp_path):
    """Bridge's mixed_precision section in a file sets --bf16's and --fp16's settings; a precision flag given with the
    file wins over it, as any flag wins over the file."""
    import checks

    (tmp_path / "run.yaml").write_text("mixed_precision: bf16_mixed\n")
    cfg = checks.parse_args(["--config-file", str(tmp_path / "run.yaml"), "--fp16"], world_size=1, gpu=False)
    assert (cfg.model.fp16, cfg.model.bf16) == (True, False)
    cfg = checks.parse_args(["--config-file", str(tmp_path / "run.yaml")], world_size=1, gpu=False)
    assert (cfg.model.fp16, cfg.model.bf16) == (False, True)
