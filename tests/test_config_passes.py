"""checks.py: validation in two passes: derive (every fill-in and rewrite, each named in the printed config), then
check (conditions that change nothing)."""

import ast
import copy
import dataclasses
import io
import pathlib

import pytest

import checks
import config
from conftest import ROOT

COMMAND_LINES = [
    [],
    ["--fp16", "--recompute-activations", "--num-query-groups", "2", "--swiglu"],
    ["--pipeline-model-parallel-size", "2", "--num-layers", "8", "--num-virtual-stages-per-pipeline-rank", "2",
     "--global-batch-size", "8", "--micro-batch-size", "2"],
    ["--train-samples", "800", "--lr-warmup-fraction", "0.1", "--lr-decay-style", "WSD", "--bf16",
     "--use-distributed-optimizer", "--recompute-granularity", "full", "--recompute-method", "uniform"],
    ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--tensor-model-parallel-size", "2",
     "--grad-reduce-in-bf16", "--bf16"],
]


def unvalidated(argv, monkeypatch):
    """The container as the command line sets it, before validation (config_from_flags with validate held back)."""
    with monkeypatch.context() as m:
        m.setattr(checks, "validate", lambda cfg, world_size=None, gpu=None: cfg)
        return checks.config_from_flags(argv)


def settings(cfg):
    return {f"{section}.{f.name}": getattr(sub, f.name)
            for section, sub in config.section_configs(cfg) for f in dataclasses.fields(sub)}


@pytest.mark.parametrize("argv", COMMAND_LINES)
def test_every_value_validation_changes_is_named_in_the_printed_config(argv, monkeypatch):
    cfg = unvalidated(argv, monkeypatch)
    before = settings(cfg)
    checks.validate(cfg, world_size=2, gpu=False)
    after = settings(cfg)
    changed = {name for name in after if after[name] != before[name] or type(after[name]) is not type(before[name])}
    assert changed and changed == set(cfg.derived)  # nothing changes unnamed, nothing named is unchanged
    out = io.StringIO()
    checks.print_config(cfg, out)
    for setting, (value, why) in cfg.derived.items():
        assert after[setting] == value
        assert f"  derived: {setting} = {value!r} ({why})" in out.getvalue()


@pytest.mark.parametrize("argv", COMMAND_LINES)
def test_check_changes_nothing_and_derive_is_done_once(argv):
    cfg = checks.parse_args(argv, world_size=2, gpu=False)
    validated = copy.deepcopy(cfg)
    checks.check(cfg)
    assert cfg == validated
    checks.derive(cfg)  # a second pass finds everything derived already (run_config.yaml is validated again on load)
    assert cfg == validated


def test_rewrites_of_settings_given_are_named_with_their_reason():
    cfg = checks.parse_args(["--fp16", "--sequence-parallel"], world_size=1, gpu=False)
    assert cfg.derived["train.check_for_nan_in_loss_and_grad"] == (
        False, "--fp16's dynamic loss scaling skips steps with Inf/NaN")
    assert cfg.derived["model.sequence_parallel"] == (False, "no tensor parallelism to split the sequence over")
    assert cfg.derived["model.transformer_impl"] == ("local", "no GPU")
    summary = io.StringIO()
    cfg.log_non_default_values(summary)
    assert "  model.sequence_parallel: False  (no tensor parallelism to split the sequence over)" in summary.getvalue()


def test_a_derived_value_is_not_blamed_on_a_flag_nobody_gave(capsys):
    with pytest.raises(SystemExit):
        checks.parse_args(["--hidden-size", "-8"], world_size=1, gpu=False)  # derives --kv-channels -2
    assert "--hidden-size must be positive, got -8" in capsys.readouterr().err


def _functions(*prefixes):
    tree = ast.parse(pathlib.Path(ROOT, "checks.py").read_text())
    return [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith(prefixes)]


def test_checks_assign_nothing_and_derivations_assign_through_derive_value():
    checks = _functions("check", "_validate_mixed_precision_consistency")  # Bridge's names kept (the seed's)
    derivations = _functions("derive", "_validate_and_sync_distributed_optimizer_settings")
    assert len(checks) > 20 and len(derivations) > 8
    for fn in checks + derivations:
        for node in ast.walk(fn):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            stores = [ast.unparse(t) for t in targets if isinstance(t, (ast.Attribute, ast.Subscript))]
            if fn.name == "derive_value":
                continue
            allowed = {"cfg.data_parallel_size"} if fn.name == "derive_parallelism" else set()
            assert set(stores) <= allowed, f"{fn.name} assigns {stores}"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id != "setattr", f"{fn.name} calls setattr"
    for fn in checks:  # a check says what is wrong through require(), or a parser's error
        raises = [n for n in ast.walk(fn) if isinstance(n, ast.Raise)]
        assert not raises or fn.name in ("check_data",), f"{fn.name} raises instead of require()"


def test_the_printed_config_goes_to_stdout_as_it_is_at_the_call():
    """contextlib.redirect_stdout takes the printed config (bench.py ops runs train.pretrain under it)."""
    import contextlib

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        checks.print_config(checks.parse_args([], world_size=1, gpu=False))
    assert "------------------------ arguments ------------------------" in out.getvalue()
