"""megatron-core's rerun state machine in the loop (--rerun-mode): spiky-loss warnings, NaN/Inf validation with a
rerun of the step to tell a reproducible fault from a transient one, and determinism statistics. Real runs of
pretrain() with forward steps that poison one iteration, and one 2-rank torchrun run."""

import os
import re

import pytest

import config
import checks
from conftest import TINY, config_error, log_lines, torchrun

# Four microbatches of 2 samples per step: megatron-core's spiky-loss window (the first 100 validated losses)
# fills by iteration 26.
COMMON = [*TINY, "--mock-data", "--num-workers", "0", "--eval-iters", "0", "--global-batch-size", "8"]


def _run(tmp_path, *extra, poison_at=None, factor=1.0):
    """pretrain() with the default forward step, its per-token losses multiplied by `factor` at iteration
    `poison_at` (numbered as in the log line). Returns (state, iterations of each forward-step call), the state
    also of a run that stopped (train.RunStopped)."""
    import train

    calls = []

    def forward_step(state, data_iterator, model):
        calls.append(state.train_state.step + 1)
        output, loss_func = train.forward_step(state, data_iterator, model)
        if state.train_state.step + 1 == poison_at:
            output = output * factor
        return output, loss_func

    cfg = checks.parse_args([*COMMON, "--data-cache-path", str(tmp_path / "cache"), *extra], world_size=1, gpu=False)
    try:
        return train.pretrain(cfg, forward_step), calls
    except train.RunStopped as stopped:  # a NaN stop raises, as Bridge's pretrain; its state tells the rest
        assert stopped.exit_code == stopped.state.exit_code != 0
        return stopped.state, calls


@pytest.mark.parametrize("mode", ["disabled", "validate_results"])
def test_spiky_loss_is_reported_and_training_goes_on(mode, tmp_path, capsys):
    state, calls = _run(tmp_path, "--rerun-mode", mode, "--check-for-spiky-loss", "--train-iters", "31",
                        "--log-interval", "31", poison_at=30, factor=50.0)
    out = capsys.readouterr().out
    assert state.exit_code is None and state.train_state.step == 31  # not fatal
    warnings = re.findall(r"warning: spiky loss at iteration (\d+) on rank 0: (\S+) is at least 10 x (\S+), "
                          r"the largest of the first 100 losses", out)
    assert [w[0] for w in warnings] == ["30"]  # once, at the poisoned iteration, and nowhere else
    assert float(warnings[0][1]) >= 10 * float(warnings[0][2])
    # validate_results reruns the step in place to see whether the spike reproduces (it does: the same
    # data, RNG state and weights), then continues; disabled only reports.
    reruns = 4 if mode == "validate_results" else 0
    assert calls.count(30) == 4 + reruns and len(calls) == 31 * 4 + reruns


def test_nan_under_validate_results_is_rerun_then_stops_with_the_last_good_checkpoint(tmp_path, capsys):
    state, calls = _run(tmp_path, "--rerun-mode", "validate_results", "--train-iters", "6", "--log-interval", "1",
                        "--save", str(tmp_path / "ckpt"), poison_at=3, factor=float("nan"))
    out = capsys.readouterr().out
    # megatron-core's EXIT_CODE_RESUME_TO_DISAMBIGUATE: the rerun reproduced the NaN.
    assert state.exit_code == 16 and state.train_state.step == 2
    assert ("error: found NaN in local forward loss calculation at iteration 3 on rank 0 (loss nan); the rerun of the "
            "step reproduced it, so it is no transient hardware fault") in out
    assert "stopping with exit code 16" in out
    assert calls == [1] * 4 + [2] * 4 + [3] * 8  # the poisoned step ran twice, then no update
    assert [l[0] for l in log_lines(out)] == [1, 2]
    # The rejected step made no update: the checkpoint is of iteration 2, the last good one.
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert sorted(p for p in os.listdir(tmp_path / "ckpt") if p.startswith("iter_")) == ["iter_0000002"]


def test_nan_at_the_first_iteration_falls_back_to_the_per_step_check(tmp_path, capsys):
    """megatron-core validates nothing on a job's first iteration; the loop's own NaN check still stops it."""
    state, _ = _run(tmp_path, "--rerun-mode", "validate_results", "--train-iters", "3", poison_at=1,
                    factor=float("nan"))
    assert state.exit_code == 1 and state.train_state.step == 0
    assert "lm loss is NaN or Inf at iteration 1" in capsys.readouterr().out


@pytest.mark.parametrize("kind, code, verdict", [
    ("transient_error", 17, "the rerun of the step did not reproduce it: a transient fault, suspect the hardware"),
    ("persistent_error", 16, "the rerun of the step reproduced it"),
])
def test_injected_faults_are_told_apart(kind, code, verdict, tmp_path, capsys):
    state, calls = _run(tmp_path, "--rerun-mode", "validate_results", "--error-injection-rate", "1",
                        "--error-injection-type", kind, "--train-iters", "4")
    out = capsys.readouterr().out
    assert state.exit_code == code and state.train_state.step == 1  # the first validated iteration is 2
    assert "at iteration 2 on rank 0" in out and "injected by --error-injection-rate 1" in out and verdict in out
    assert calls == [1] * 4 + [2] * 8


def test_report_determinism_stats_reruns_every_step_and_changes_nothing(tmp_path, capsys):
    args = ["--train-iters", "4", "--log-interval", "1", "--hidden-dropout", "0.1"]
    _, calls = _run(tmp_path, "--rerun-mode", "report_determinism_stats", *args)
    stats_out = capsys.readouterr().out
    _, plain_calls = _run(tmp_path, *args)
    plain_out = capsys.readouterr().out
    assert len(calls) == 2 * len(plain_calls) == 32  # every step twice
    # The rerun restores the RNG states and replays the same microbatches: the same losses, bitwise, dropout on.
    assert [l[3] for l in log_lines(stats_out)] == [l[3] for l in log_lines(plain_out)]
    assert re.findall(r"determinism of the loss up to iteration (\d+), initial run vs rerun: (.*)", stats_out) == [
        (str(i), f"{4 * i} samples, all identical") for i in range(1, 5)]


def test_two_ranks_determinism_stats_are_gathered_from_every_rank(tmp_path, warm_torchrun):
    proc = warm_torchrun([*COMMON, "--data-cache-path", str(tmp_path / "cache"), "--rerun-mode", "report_determinism_stats",
                     "--train-iters", "4", "--log-interval", "2"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    # 2 microbatches per rank per step, 2 ranks, 4 steps: 16 losses compared with their reruns.
    assert re.findall(r"determinism of the loss up to iteration (\d+), initial run vs rerun: (.*)", proc.stdout) == [
        ("2", "8 samples, all identical"), ("4", "16 samples, all identical")]
    assert [l[0] for l in log_lines(proc.stdout)] == [2, 4]


@pytest.mark.parametrize("argv, message", [
    (["--spiky-loss-factor", "1"], "--spiky-loss-factor must be greater than 1"),
    (["--error-injection-rate", "10"], "--error-injection-rate tests the reruns of --rerun-mode validate_results"),
    (["--rerun-mode", "validate_results", "--no-check-for-nan-in-loss-and-grad"], "has nothing to validate"),
    (["--rerun-mode", "sometimes"], "invalid choice: 'sometimes'"),
])
def test_rerun_settings_errors_are_one_line_with_exit_code_2(argv, message, capsys):
    err = config_error(argv, capsys)
    assert message in err, err


def test_rerun_settings_in_the_config():
    cfg = checks.parse_args(["--rerun-mode", "validate_results", "--check-for-spiky-loss", "--spiky-loss-factor", "5"],
                            world_size=1, gpu=False)
    r = cfg.rerun_state_machine
    assert (r.rerun_mode, r.check_for_spiky_loss, r.spiky_loss_factor, r.check_for_nan_in_loss) == \
        ("validate_results", True, 5.0, True)
    assert "rerun_state_machine:" in config.to_yaml(cfg)  # saved with every checkpoint's run_config.yaml
    off = checks.parse_args(["--no-check-for-nan-in-loss-and-grad"], world_size=1, gpu=False)
    assert off.rerun_state_machine.check_for_nan_in_loss is False and off.rerun_state_machine.rerun_mode == "disabled"
