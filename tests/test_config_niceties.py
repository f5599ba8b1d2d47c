"""Config niceties in real runs: --deterministic-mode repeats a run bitwise, a sample-based schedule
equals its iteration-based twin, --logging-level shows or hides megatron-core's debug logs,
--log-non-default-values prints the short summary, and disabled NVIDIA service sections change nothing.

Two 2-rank runs, shared by every test here."""

import pytest
import torch

from conftest import TINY, log_lines, torchrun

# The same schedule twice: 6 iterations of 8 samples, 2 of them warmup (16 samples), decay over 48 samples.
BY_ITERS = ["--train-iters", "6", "--lr-warmup-iters", "2"]
BY_SAMPLES = ["--train-samples", "48", "--lr-warmup-samples", "16"]
SERVICES_OFF = """\
ft:
  enable_ft_package: false
nvrx_straggler:
  enabled: false
  report_time_interval: 60.0
inprocess_restart:
  enabled: false
  soft_timeout: 30.0
tensor_inspect:
  enabled: false
"""


@pytest.fixture(scope="module")
def twin_runs(tmp_path_factory, warm_torchrun):
    out = tmp_path_factory.mktemp("twins")
    (out / "services_off.yaml").write_text(SERVICES_OFF)
    i = TINY.index("--lr-warmup-iters")  # each run gives its warmup its own way
    common = [*TINY[:i], *TINY[i + 2:], "--mock-data", "--global-batch-size", "8",
              "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1", "--deterministic-mode"]
    runs = {}
    for name, extra in (
        ("iters", [*BY_ITERS, "--logging-level", "10", "--log-non-default-values"]),
        ("samples", [*BY_SAMPLES, "--logging-level", "20", "--config-file", str(out / "services_off.yaml")]),
    ):
        args = [*common, *extra, "--tensorboard-dir", str(out / name / "tb"), "--data-cache-path", str(out / name)]
        proc = warm_torchrun(args)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs[name] = dict(stdout=proc.stdout, stderr=proc.stderr, tb=out / name / "tb")
    return runs


def _scalars(tb_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_deterministic_runs_repeat_bitwise_and_samples_equal_iterations(twin_runs):
    a, b = twin_runs["iters"], twin_runs["samples"]
    for run in (a, b):
        assert " > deterministic mode: torch.use_deterministic_algorithms(True)" in run["stdout"]
        assert "CUBLAS_WORKSPACE_CONFIG=:4096:8" in run["stdout"] and "NCCL_ALGO=Ring" in run["stdout"]
    # The sample-based run: 48 samples are 6 iterations of 8, the scheduler counts the same samples.
    assert [(it, consumed) for it, consumed, *_ in log_lines(b["stdout"])] == [(i, 8 * i) for i in range(1, 7)]
    assert " iteration        6/       6 |" in b["stdout"]
    # Bitwise: TensorBoard keeps each loss and learning rate as the float32 the run computed.
    for tag in ("lm loss", "learning-rate", "lm loss validation"):
        values = _scalars(a["tb"], tag)
        assert values and values == _scalars(b["tb"], tag), tag


def test_logging_level_shows_or_hides_megatron_core_debug_logs(twin_runs):
    debug, info = twin_runs["iters"]["stderr"], twin_runs["samples"]["stderr"]
    assert "DEBUG:megatron.core.datasets" in debug and "INFO:megatron.core.datasets" in debug
    assert "DEBUG:" not in info and "INFO:megatron.core.datasets" in info


def test_non_default_summary_or_full_config(twin_runs):
    summary, full = twin_runs["iters"]["stdout"], twin_runs["samples"]["stdout"]
    assert "Configuration Summary (Non-Default Values)" in summary and "---- arguments ----" not in summary
    assert "  deterministic_mode: True  (default: False)" in summary and "  hidden_size: 64  (default: 256)" in summary
    assert "  scheduler.lr_decay_steps: 48" in summary and "  data_parallel_size: 2" in summary
    assert "num_attention_heads:" not in summary  # left at its default
    assert "---- arguments ----" in full and "Configuration Summary" not in full
    assert "  ft.enable_ft_package ...." in full and "  inprocess_restart.soft_timeout ...." in full


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: the deterministic kernels (SDPA math backend, cuBLAS workspace) are GPU paths")
def test_deterministic_mode_repeats_a_gpu_run_bitwise(tmp_path):
    args = [*TINY, "--mock-data", "--bf16", "--transformer-impl", "local", "--deterministic-mode", "--train-iters", "6",
            "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0", "--data-cache-path", str(tmp_path)]
    for name in ("a", "b"):
        proc = torchrun([*args, "--tensorboard-dir", str(tmp_path / name)], nproc=1)
        assert proc.returncode == 0, proc.stderr[-3000:]
    losses = _scalars(tmp_path / "a", "lm loss")
    assert len(losses) == 6 and losses == _scalars(tmp_path / "b", "lm loss")


def test_the_readmes_flag_list_names_flags_that_exist():
    """docs/flags.md's list of flags by section, kept readable by hand, stays true: every flag it names is one
    `--help` lists (the parser's option strings), one of Megatron-LM's inert flags, or a refused one; and every flag
    of the train, optimizer, scheduler and checkpoint sections is in it. (tests/test_docs.py checks the flags of
    every page against the parsers; this checks the list is complete.)"""
    import os
    import re

    import config
    import megatron_lm_flags

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = open(os.path.join(root, "docs", "flags.md")).read()
    section = text[text.index("## The flags, by section"):text.index("Megatron-LM's own GPT example scripts")]
    named = set(re.findall(r"(--[a-z0-9][a-z0-9_-]*[a-z0-9])", section))
    known = {o for action in config.build_parser()._actions for o in action.option_strings}
    known |= {flag for _, flags in megatron_lm_flags.MEGATRON_LM_INERT_FLAGS for flag, _ in flags}
    known |= {flag for prefixes, _ in megatron_lm_flags.MEGATRON_LM_REFUSED_FLAGS for flag in prefixes}
    families = ("--inprocess", "--fp8")  # named as --inprocess-* and --fp8-*
    assert sorted(f for f in named if f not in known and f not in families) == []
    main = {meta["flag"] for name, f, meta in config._cli_fields()
            if name in ("train", "optimizer", "scheduler", "checkpoint") and meta["flag"] == "--" + f.name.replace("_", "-")}
    assert sorted(main - named) == []
