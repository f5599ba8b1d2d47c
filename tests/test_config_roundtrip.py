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


@pytest.mark.full  # the fast command: the base runs' files without `derived:` (issue 73's property, at the end)
def test_every_edit_of_the_yaml_written_before_the_move_is_that_file_with_every_value_given(tmp_path):
    """A file without the `derived:` list (Bridge's, or this trainer's before it) does not say what its run was given:
    its values are the run's settings, which an edit changes only where it names them (checks.rederived): with
    --hidden-size the file's ffn_hidden_size and kv_channels stand, with --weight-decay its schedule's weight decays;
    --eval-interval beats the file's deprecated train.eval_interval. So, for every flag, it reads as the same file with
    every value given (an empty `derived:` list)."""
    import checks
    import config

    cfg = checks.config_from_flags(["--config-file", BEFORE, "--weight-decay", "0.1", "--eval-interval", "50",
                                    "--hidden-size", "128"], world_size=1, gpu=False)
    assert (cfg.scheduler.start_weight_decay, cfg.scheduler.end_weight_decay) == (0.01, 0.01)
    assert (cfg.validation.eval_interval, cfg.model.ffn_hidden_size, cfg.model.kv_channels) == (50, 256, 16)
    (tmp_path / "given.yaml").write_text(yaml.safe_dump({**yaml.safe_load(open(BEFORE)), "derived": []}))
    parser = config.build_parser()
    assert [flag for flag in generated_flags(parser) if not read_as_given(
        file_outcome(parser, BEFORE, flag, 1), file_outcome(parser, tmp_path / "given.yaml", flag, 1))] == []


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
    ("checkpoint", "ckpt_format", "zarr", "argument --ckpt-format: invalid choice: 'zarr'"),  # megatron-core <= 0.14's
    ("model", "hidden_size", "sixty-four", "argument --hidden-size: invalid int value: 'sixty-four'"),
    ("model", "hidden_size", [64, 128], "[64, 128] is a list; --hidden-size takes one value"),
    ("model", "swiglu", 3, "3 is not true or false (--swiglu is a switch)"),
    ("checkpoint", "async_write_results_mp_mode", "thread", "'thread' is not one of ['fork', 'spawn', 'forkserver']"),
    ("checkpoint", "save", {"a": 1}, "{'a': 1} is a map, not --save's words"),  # was a directory named a=1
    ("logger", "tensorboard_dir", True, "True is true/false, not --tensorboard-dir's words"),  # was one named True
    ("model", "hidden_size", None, "null, but it needs a value (default 256)"),  # was a TypeError
    ("dataset", "drop_last", "abc", "'abc' is not of its type, bool (it has no flag)"),  # was kept
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


# Hostile values for every field of a real run's file (issue 73, point 4): YAML's null, a list, a map, a bool, a word,
# two huge numbers, the three non-finite ones.
HOSTILE = [None, [1, 2], {"a": 1}, True, "abc", 1e300, 10**30, float("inf"), float("-inf"), float("nan")]
# The fields a report found ending in a traceback, or in a path made of a map or a bool: the fast command gives each
# every hostile value, the other fields one each, in turn.
REPORTED = {"model.hidden_size", "model.seq_length", "rng.seed", "optimizer.weight_decay", "optimizer.clip_grad",
            "model.init_method_std", "dataset.num_workers", "checkpoint.save", "logger.tensorboard_dir"}


def without_flag(argv: list, parser: argparse.ArgumentParser, dest: str) -> list:
    """A command line without the flags that set `dest`, each with its words."""
    nargs = {s: a.nargs for a in parser._actions if a.dest == dest for s in a.option_strings}
    out, i = [], 0
    while i < len(argv):
        if argv[i] not in nargs:
            out.append(argv[i])
        elif nargs[argv[i]] is None:
            i += 1  # its one word
        elif nargs[argv[i]] in ("+", "*"):
            while i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                i += 1
        i += 1
    return out


def flag_words(action: argparse.Action, value) -> list:
    """The flag given the words a YAML value stands for (checks.flag_value's): a map's KEY=VALUE, a list's members; a
    switch, given or not."""
    if action.nargs == 0:
        return [action.option_strings[0]][:value == action.const]
    words = [f"{k}={v}" for k, v in value.items()] if isinstance(value, dict) else \
        [str(v) for v in value] if isinstance(value, list) else [str(value)]
    flag = action.option_strings[0]
    return [f"{flag}={words[0]}"] if len(words) == 1 else [flag, *words]  # `=`: a word may start with '-' (-inf)


def hostile_outcome(parser, written: dict, run_flags: list, setting: str, value, path) -> tuple:
    """("refused" | "accepted" | "bad", why): the run's file with one field given a hostile value, read as
    `--config-file` reads it, against the run's command line with that field's flag given the same words."""
    import checks
    import config

    section, name = setting.split(".")
    data = {**written, section: {**written[section], name: value}}
    path.write_text(yaml.dump(data, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), sort_keys=False))
    # Where the file's reader puts it (a former name, Bridge's deprecated train.eval_*), and whether it keeps it.
    landed = next((f"{s}.{n}" for s, v in config.yaml_settings({section: {name: 0}}).items() for n in v), setting)
    carried = bool(config.yaml_settings({section: {name: value}}))
    names = {setting, landed, *(s for a in parser._actions if a.dest == landed for s in a.option_strings)}
    action = checks.flag_actions(parser).get(landed)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            cfg = checks.config_from_flags(["--config-file", str(path)], world_size=1, gpu=False, parser=parser)
    except config.ConfigError as e:  # parse_args prints `train.py: error: LINE` and exits with code 2
        line = str(e)  # one line, naming the field, or validation's own (another setting's), as the command line's
        named = any(n in line for n in names) or action is not None and value is not None and \
            outcome(parser, [*run_flags, *flag_words(action, value)], 1) == ("refused", line)
        return ("refused", line) if "\n" not in line and named else ("bad", f"refused: {line}")
    except SystemExit as e:
        return "bad", f"exit {e.code}: {err.getvalue()}"
    except Exception as e:  # noqa: BLE001  the property: nothing else escapes
        return "bad", f"{type(e).__name__}: {e}"
    got = cfg.to_dict()
    if isinstance(value, (dict, bool)) and any(v in ("a=1", "{'a': 1}", "True", "true") for s in got.values()
                                               if isinstance(s, dict) for v in s.values() if isinstance(v, str)):
        return "bad", "a setting made of a map or a bool"
    if not carried or landed in (written.get("derived") or []):  # dropped, or derived again
        if action is not None and value is not None:
            try:
                with contextlib.redirect_stderr(io.StringIO()):
                    parser.parse_args(flag_words(action, value))
            except SystemExit:
                return "bad", "accepted, but its flag refuses those words"
        expected = run_flags
    elif action is None:  # no flag: the field holds the value the file gives, of its type (the run's value's)
        kept, was = got[landed.split(".")[0]][landed.split(".")[1]], written[section][name]
        kinds = {bool: (bool,), int: (int,), float: (int, float)}.get(type(was), (type(was),))
        if was is not None and type(value) not in kinds:
            return "bad", f"accepted {value!r} where the run wrote a {type(was).__name__}"
        if repr(kept) == repr(value):  # repr: a nan equals a nan
            return "accepted", ""
        if landed not in cfg.derived:  # else validation derives it from other settings, whatever the file says
            return "bad", f"accepted as {kept!r}"
        expected = run_flags
    elif value is None:  # unset: its --no-* flag, or the flag left out (its default)
        off = [a.option_strings[0] for a in parser._actions if a.dest == landed and a.nargs == 0 and a.const is None]
        expected = [*run_flags, *off[:1]] if off else without_flag(run_flags, parser, landed)
    elif action.nargs == 0:  # a switch: given, or left out
        expected = [*without_flag(run_flags, parser, landed), *flag_words(action, value)]
    else:
        expected = [*run_flags, *flag_words(action, value)]
    flagged = outcome(parser, expected, 1)
    if flagged[0] != "accepted":
        return "bad", f"accepted, but the command line refuses it: {flagged[1]}"
    # repr: a nan equals a nan
    return ("accepted", "") if repr(flagged[1:]) == repr((got, sorted(cfg.filled_in))) else \
        ("bad", "accepted, but not as the command line")


def hostile_counts(llama_ckpt, tmp_path, every: bool) -> tuple:
    """Every field of a real run's run_config.yaml given hostile values (each of HOSTILE with `every`; otherwise
    REPORTED's fields each, the others one each in turn): {fields, values, refused, accepted, bad}, and the bad ones."""
    import config

    run_flags = trained_in_process_flags(os.path.dirname(llama_ckpt), LLAMA_FLAGS)
    written = yaml.safe_load(open(sorted(glob.glob(os.path.join(llama_ckpt, "iter_*", "run_config.yaml")))[-1]))
    fields = [f"{s}.{n}" for s, v in written.items() if s in config.SECTIONS and isinstance(v, dict) for n in v]
    parser = config.build_parser()
    counts, bad = {"fields": len(fields), "values": 0, "refused": 0, "accepted": 0, "bad": 0}, []
    for i, setting in enumerate(fields):
        for value in HOSTILE if every or setting in REPORTED else [HOSTILE[i % len(HOSTILE)]]:
            kind, why = hostile_outcome(parser, written, run_flags, setting, value, tmp_path / "run.yaml")
            counts["values"] += 1
            counts[kind] += 1
            if kind == "bad":
                bad.append(f"{setting}: {value!r}: {why}")
    print("hostile YAML values:", counts)
    return counts, bad


def test_every_field_of_a_runs_yaml_refuses_a_hostile_value_in_one_line_or_reads_it_as_its_flag(llama_ckpt, tmp_path):
    """A real run's run_config.yaml, each field given null, a list, a map, a bool, a word, a huge number or a
    non-finite one, is refused in one line naming the field (a ConfigError, which parse_args prints and exits with
    code 2), or read as the field's flag reads the same words: the config equals the run's command line with that flag
    given them (null: its --no-* flag, or the flag left out; a field the file lists under `derived:`: derived again,
    its flag reading the words; a field no flag reads: the value, of the field's type). Never another exception, never
    a setting made of a map or a bool. Not covered: the optional sections (mixed_precision, comm_overlap: null in a
    run's file, read by their own classes), two hostile values at once, other values (a nested map, a long string), a
    file that is not a run's, and whether an accepted value can run: as on the command line, a number its flag takes
    (lr: .inf, hidden_size: 10**30) is left to validation's checks and to the run (parse only here, for speed). The
    fast command: a deterministic sample (REPORTED's fields with every value, each other field one, in turn); the full
    proof: every field with every value."""
    counts, bad = hostile_counts(llama_ckpt, tmp_path, every=False)
    assert counts["fields"] > 300 and counts["values"] == counts["fields"] + len(REPORTED) * (len(HOSTILE) - 1)
    assert bad == [] and counts["refused"] > 0 and counts["accepted"] > 0


@pytest.mark.full  # the fast command: a sample of the same
def test_every_field_of_a_runs_yaml_with_every_hostile_value(llama_ckpt, tmp_path):
    counts, bad = hostile_counts(llama_ckpt, tmp_path, every=True)
    assert counts["values"] == counts["fields"] * len(HOSTILE) and bad == []


def test_a_flag_beats_the_files_mixed_precision_recipe(tmp_path):
    """Bridge's mixed_precision section in a file sets --bf16's and --fp16's settings; a precision flag given with the
    file wins over it, as any flag wins over the file."""
    import checks

    (tmp_path / "run.yaml").write_text("mixed_precision: bf16_mixed\n")
    cfg = checks.parse_args(["--config-file", str(tmp_path / "run.yaml"), "--fp16"], world_size=1, gpu=False)
    assert (cfg.model.fp16, cfg.model.bf16) == (True, False)
    cfg = checks.parse_args(["--config-file", str(tmp_path / "run.yaml")], world_size=1, gpu=False)
    assert (cfg.model.fp16, cfg.model.bf16) == (False, True)


# -- The round trip as a property over base runs too (issue 73) ----------------------------------------------------
# Base command lines, each with the flags that validation rewrites, derives or translates from them: {name: (world
# size, flags)}. DATA/ is a folder of empty .bin/.idx files made by the test.
ROUND_TRIP_BASES = {
    "virtual stages by count": (2, ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                                    "--num-virtual-stages-per-pipeline-rank", "2", "--micro-batch-size", "1",
                                    "--global-batch-size", "2"]),
    "virtual stages by layers": (2, ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                                     "--num-layers-per-virtual-pipeline-stage", "1", "--micro-batch-size", "1",
                                     "--global-batch-size", "2", "--overlap-p2p-communication-warmup-flush"]),
    "1F1B with a warmup flush": (2, ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                                     "--overlap-p2p-communication-warmup-flush", "--micro-batch-size", "1"]),
    "first stage's layers": (2, ["--num-layers", "3", "--pipeline-model-parallel-size", "2",
                                 "--decoder-first-pipeline-num-layers", "1", "--micro-batch-size", "1"]),
    "sequence parallel at TP=1": (2, ["--sequence-parallel"]),
    "sequence parallel at TP=2": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "context parallel": (2, ["--context-parallel-size", "2"]),
    "dist_muon": (1, ["--optimizer", "dist_muon", "--bf16"]),
    "distributed optimizer": (1, ["--use-distributed-optimizer", "--bf16"]),
    "global batch equal to its derivation": (1, ["--global-batch-size", "2", "--micro-batch-size", "2"]),
    "global batch derived": (2, ["--micro-batch-size", "2"]),
    "train samples": (1, ["--train-samples", "64", "--micro-batch-size", "2"]),
    "schedule in samples": (1, ["--train-samples", "64", "--lr-decay-samples", "32", "--lr-warmup-samples", "4",
                                "--micro-batch-size", "2"]),
    "schedule in iterations": (1, ["--train-iters", "100", "--lr-decay-iters", "50", "--lr-warmup-iters", "5"]),
    "WSD and a warmup fraction": (1, ["--lr-decay-style", "WSD", "--lr-warmup-fraction", "0.1"]),
    "weight decay": (1, ["--weight-decay", "0.1"]),
    "SwiGLU's MLP": (1, ["--hidden-size", "128", "--num-attention-heads", "4", "--swiglu"]),
    "sizes equal to their derivations": (1, ["--hidden-size", "128", "--ffn-hidden-size", "512", "--kv-channels",
                                             "32"]),
    "query groups": (1, ["--num-query-groups", "2"]),
    "grouped-query attention alone": (1, ["--group-query-attention"]),
    "position table": (1, ["--seq-length", "64"]),
    "MLA": (1, ["--multi-latent-attention"]),
    "recompute activations": (1, ["--recompute-activations"]),
    "full recompute": (1, ["--recompute-granularity", "full", "--recompute-method", "uniform"]),
    "experts": (1, ["--num-experts", "4"]),
    "no experts": (1, ["--num-experts", "0"]),
    "expert parallelism": (2, ["--num-experts", "2", "--expert-model-parallel-size", "2"]),
    "fp16": (1, ["--fp16"]),
    "fp16 with a static loss scale": (1, ["--fp16", "--loss-scale", "4"]),
    "bf16 reducing in bf16": (1, ["--bf16", "--grad-reduce-in-bf16"]),
    "fp32 reduce": (1, ["--accumulate-allreduce-grads-in-fp32"]),
    "no NaN check": (1, ["--no-check-for-nan-in-loss-and-grad"]),
    "mock data": (1, ["--mock-data"]),
    "data path": (1, ["--data-path", "DATA/a"]),
    "per-split data paths": (1, ["--train-data-path", "DATA/a", "--valid-data-path", "DATA/b", "--test-data-path",
                                 "DATA/c", "--split", "90,5,5"]),
    "mlflow tags": (1, ["--mlflow-experiment", "x", "--mlflow-tracking-uri", "http://127.0.0.1:1", "--mlflow-tags",
                        "a=b"]),
    "async save": (1, ["--async-save"]),
    "local layers": (1, ["--transformer-impl", "local"]),
    "exit signal": (1, ["--exit-signal-handler", "--exit-signal", "SIGUSR1"]),
    # Megatron-LM's deprecated spellings, which the parser translates
    "rotary switch": (1, ["--use-rotary-position-embeddings"]),
    "no position embedding": (1, ["--position-embedding-type", "rope", "--no-position-embedding"]),
    "mcore models": (1, ["--use-mcore-models"]),
}
# Edits, each touching the inputs of some derivation above.
ROUND_TRIP_EDITS = [
    [], ["--tensor-model-parallel-size", "2"], ["--tensor-model-parallel-size", "1"],
    ["--pipeline-model-parallel-size", "1"], ["--pipeline-model-parallel-size", "2", "--num-layers", "4"],
    ["--num-layers", "8"], ["--num-virtual-stages-per-pipeline-rank", "2"], ["--num-layers-per-virtual-pipeline-stage",
                                                                            "2"],
    ["--no-overlap-p2p-communication"], ["--overlap-p2p-communication-warmup-flush"], ["--sequence-parallel"],
    ["--context-parallel-size", "1"], ["--context-parallel-size", "2"],
    ["--micro-batch-size", "1"], ["--micro-batch-size", "4"], ["--global-batch-size", "8"],
    ["--train-samples", "256"], ["--train-iters", "20"], ["--lr-decay-style", "WSD"], ["--lr-warmup-fraction", "0.2"],
    ["--hidden-size", "256"], ["--num-attention-heads", "8"], ["--swiglu"], ["--group-query-attention"],
    ["--num-query-groups", "4"], ["--seq-length", "256"], ["--ffn-hidden-size", "1024"],
    ["--multi-latent-attention"], ["--num-experts", "8"], ["--num-experts", "0"],
    ["--optimizer", "adam"], ["--optimizer", "muon"], ["--optimizer", "dist_muon"], ["--use-distributed-optimizer"],
    ["--weight-decay", "0.2"], ["--fp16"], ["--bf16"], ["--loss-scale", "8"], ["--grad-reduce-in-bf16"],
    ["--recompute-granularity", "selective"], ["--recompute-activations"], ["--seed", "3"], ["--mock-data"],
    ["--data-path", "DATA/b"], ["--async-save"], ["--exit-signal", "SIGINT"],
    ["--position-embedding-type", "learned_absolute"],
]


def round_trip_pairs(full: bool) -> list:
    """(base, edit index) pairs: all of them, or a deterministic sample with every base and every edit in it: each base
    unedited, and the pairs whose indices sum to a multiple of 23 (each edit meets 1 or 2 of the 42 bases)."""
    names = list(ROUND_TRIP_BASES)
    return [(name, j) for i, name in enumerate(names) for j in range(len(ROUND_TRIP_EDITS))
            if full or j == 0 or (i + j) % 23 == 0]


def file_outcome(parser, path, edit, world_size) -> tuple:
    """outcome() of a file plus an edit, without what was filled in (a file without `derived:` cannot say it); the
    file's path in a refusal's line written FILE."""
    kind, result = outcome(parser, ["--config-file", str(path), *edit], world_size)[:2]
    return kind, result.replace(str(path), "FILE") if kind == "refused" else result


def read_as_given(read, given) -> bool:
    """A file without `derived:` read (file_outcome) as the same file with every value given: the same, or, where that
    one is refused (a value kept from the file contradicts the edit, or is null where only a derivation may leave it
    so: dataset.split beside per-split paths), what checks.rederived's derivation of it gives: accepted, or refused in
    one line for another reason (outcome() lets nothing else through)."""
    return read == given or given[0] == "refused"


def pairs_that_differ(pairs, tmp_path) -> list:
    """For each pair, its base's run_config.yaml (written as a run writes it, config.to_yaml), and the file plus the
    edit against the base's command line plus the edit (settings and what validation filled in, or the refusal).
    Then the same file as Bridge writes its own, without `derived:` (and `given:`): the settings it gives are read as
    given, so the reference is that file with every value given (an empty `derived:` list) plus the edit; where that
    one is refused (a value kept from the file contradicts the edit), the Bridge-style file may derive it again."""
    import checks
    import config

    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    for name in "abc":
        (data / f"{name}.bin").touch()
        (data / f"{name}.idx").touch()
    parser = config.build_parser()

    def words(flags):
        return [str(data) + w[4:] if w.startswith("DATA/") else w for w in flags]

    files, failing = {}, []
    for name, j in pairs:
        world_size, base = ROUND_TRIP_BASES[name]
        base, edit = words(base), words(ROUND_TRIP_EDITS[j])
        if name not in files:
            with contextlib.redirect_stdout(io.StringIO()):
                cfg = checks.config_from_flags(base, world_size=world_size, gpu=False, parser=parser)
            written = yaml.safe_load(config.to_yaml(cfg))
            slug = "".join(c if c.isalnum() else "_" for c in name)
            files[name] = [tmp_path / f"{slug}.{kind}.yaml" for kind in ("run", "bridge", "explicit")]
            files[name][0].write_text(yaml.safe_dump(written, sort_keys=False))
            bridge = {k: v for k, v in written.items() if k not in ("derived", "given")}
            files[name][1].write_text(yaml.safe_dump(bridge, sort_keys=False))
            files[name][2].write_text(yaml.safe_dump({**bridge, "derived": []}, sort_keys=False))
        run, bridge, explicit = files[name]
        from_flags = outcome(parser, [*base, *edit], world_size)
        if outcome(parser, ["--config-file", str(run), *edit], world_size) != from_flags:
            failing.append((name, edit, "run_config.yaml"))
        if not read_as_given(file_outcome(parser, bridge, edit, world_size),
                             file_outcome(parser, explicit, edit, world_size)):
            failing.append((name, edit, "Bridge-style"))
    return failing


def test_every_base_run_and_edit_round_trip_through_its_run_config_yaml(tmp_path, request):
    """`--config-file <A's run_config.yaml> F` is the run `A F`, as a property over base runs A as well as edits F:
    each base command line sets flags that validation rewrites (virtual stages as a count, sequence parallelism at
    TP=1, dist_muon, a warmup flush without virtual stages, per-split paths' split), derives from (sizes, batch, the
    schedule, precision, the machine) or that the parser translates (Megatron-LM's deprecated spellings), and each edit
    touches the inputs of those derivations. Written as a run writes it (config.to_yaml), without training; compared
    field by field, with what validation filled in (or both refused with the same line). The same file without
    `derived:`, as Bridge writes one, reads as the file with every value given.

    The fast command runs a sample with every base and every edit; --full the whole product. Not covered: the
    settings that only a YAML file sets (Bridge's mixed_precision, comm_overlap and train.eval_* sections,
    dataset.fim_extra_tokens, pin_memory, persistent_workers), which no base command line can give (the tests above
    read them); the GPU's derivations (transformer_engine, nccl), which need a GPU to validate; and the services that
    validation refuses here (tensor_inspect)."""
    full = request.config.getoption("full")
    pairs = round_trip_pairs(full)
    assert {name for name, _ in pairs} == set(ROUND_TRIP_BASES) and {j for _, j in pairs} == set(
        range(len(ROUND_TRIP_EDITS)))
    assert pairs_that_differ(pairs, tmp_path) == []


def test_a_bridge_style_file_keeps_a_given_value_equal_to_its_derivation(tmp_path):
    """Bridge's run_config.yaml does not say which values were given: `global_batch_size: 2` beside
    `micro_batch_size: 2` (one data-parallel rank) is the global batch the run trained with, and `--micro-batch-size 1`
    keeps it (as the command line that gave it does), where it derives values the file does not give."""
    import checks

    (tmp_path / "run.yaml").write_text("train:\n  global_batch_size: 2\n  micro_batch_size: 2\n")
    cfg = checks.config_from_flags(["--config-file", str(tmp_path / "run.yaml"), "--micro-batch-size", "1"],
                                   world_size=1, gpu=False)
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size) == (2, 1)
    (tmp_path / "run.yaml").write_text("train:\n  micro_batch_size: 2\n")
    cfg = checks.config_from_flags(["--config-file", str(tmp_path / "run.yaml"), "--micro-batch-size", "1"],
                                   world_size=1, gpu=False)
    assert cfg.train.global_batch_size == 1


def test_a_value_validation_rewrote_is_written_as_given_and_given_again(tmp_path):
    """The reported cases: virtual stages asked for as a count (said as layers per stage), --sequence-parallel at TP=1
    (turned off) and --optimizer dist_muon (muon with the distributed optimizer). The file's sections hold what
    validation left, as Bridge's do; `given:` the value given, which the file gives again, so the file alone is the
    run and an edit of the inputs derives anew."""
    import checks
    import config

    virtual = ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
               "--micro-batch-size", "1", "--global-batch-size", "2"]
    for world_size, base, edit, given in [
            (2, virtual, [], {"model.num_virtual_stages_per_pipeline_rank": 2}),
            (2, ["--sequence-parallel"], ["--tensor-model-parallel-size", "2"], {"model.sequence_parallel": True}),
            (1, ["--optimizer", "dist_muon", "--bf16"], [], {"optimizer.optimizer": "dist_muon"})]:
        (tmp_path / "run_config.yaml").write_text(config.to_yaml(checks.config_from_flags(base, world_size=world_size,
                                                                                         gpu=False)))
        assert yaml.safe_load((tmp_path / "run_config.yaml").read_text())["given"] == given
        edited = checks.config_from_flags(["--config-file", str(tmp_path / "run_config.yaml"), *edit],
                                          world_size=world_size, gpu=False)
        assert edited.to_dict() == checks.config_from_flags([*base, *edit], world_size=world_size, gpu=False).to_dict()
    assert (edited.optimizer.optimizer, edited.optimizer.use_distributed_optimizer) == ("muon", True)


def test_a_bridge_style_files_value_that_an_edit_contradicts_is_derived_again(tmp_path):
    """train_iters beside train_samples is the run's length in iterations, which validation accepts at its derivation
    only: under another --global-batch-size it is derived again (kept, the run would be refused)."""
    import checks

    (tmp_path / "run.yaml").write_text("train:\n  train_samples: 64\n  train_iters: 32\n  micro_batch_size: 2\n"
                                       "  global_batch_size: 2\n")
    cfg = checks.config_from_flags(["--config-file", str(tmp_path / "run.yaml"), "--global-batch-size", "4"],
                                   world_size=1, gpu=False)
    assert (cfg.train.train_iters, cfg.train.global_batch_size) == (16, 4)
