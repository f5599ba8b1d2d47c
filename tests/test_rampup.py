"""Batch-size ramp-up (--rampup-batch-size START INCR SAMPLES): megatron-core's microbatch calculator
followed each iteration, in real 2-rank runs, with a checkpoint at each change and resumes mid-ramp."""

import os

import pytest

from conftest import TINY, config_error, log_lines, torchrun, train_here

# 2 ranks x micro batch 2: batches grow in steps of 4. From 4 to 16 in 3 increments over 24 samples,
# one increment per 24 / 3 = 8 samples consumed (Megatron-LM's ramp, train.rampup_step_schedule).
RAMP = [*TINY, "--mock-data", "--train-iters", "8", "--global-batch-size", "16", "--rampup-batch-size", "4", "4", "24",
        "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "1", "--num-workers", "0"]
BATCHES = [4, 4, 8, 12, 16, 16, 16, 16]  # consumed before iteration: 0, 4, 8, 16, 28, 44, ... (> 24: full batch)


def test_ramp_up_grows_the_batch_saves_at_each_change_and_resumes_mid_ramp(tmp_path, warm_torchrun):
    common = [*RAMP, "--data-cache-path", str(tmp_path / "cache")]
    ckpt = tmp_path / "ckpt"
    first = warm_torchrun([*common, "--save", str(ckpt), "--save-interval", "3"])
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    lines = log_lines(first.stdout)
    assert [l[0] for l in lines] == list(range(1, 9))
    assert [l[2] for l in lines] == BATCHES  # the log line's global batch size follows the ramp
    consumed = [sum(BATCHES[:i + 1]) for i in range(8)]
    assert [l[1] for l in lines] == consumed == [4, 8, 16, 28, 44, 60, 76, 92]
    assert lines[-1][3] < lines[0][3]
    # The iteration-to-sample map a fork reads (train.samples_of_iteration): each iteration's samples end at the
    # run's consumed samples and start where the one before ended
    import checks
    import train

    cfg = checks.parse_args(common, world_size=2, gpu=False)
    assert [train.samples_of_iteration(cfg, i) for i in range(1, 9)] == [range(a, b) for a, b in
                                                                          zip([0, *consumed], consumed)]

    # A checkpoint before each larger batch (after iterations 2, 3, 4), --save-interval's at 3 and 6, the
    # final one at 8; iteration 3's is written once, though both the ramp and the interval ask for it.
    saved = sorted(int(d.removeprefix("iter_")) for d in os.listdir(ckpt) if d.startswith("iter_"))
    assert saved == [2, 3, 4, 6, 8]
    assert first.stdout.count("successfully saved checkpoint from iteration       3 ") == 1
    assert "ramping up global batch size from 12 to 16 after iteration 4 (28 samples consumed)" in first.stdout

    # Resumed from iteration 3 (12 samples per batch next): the same batches, samples and losses.
    resumed = warm_torchrun([*common, "--load", str(ckpt), "--ckpt-step", "3"])
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert log_lines(resumed.stdout) == lines[3:]


@pytest.mark.parametrize("argv, message", [
    (["--rampup-batch-size", "4", "4"], "takes three numbers, START INCR SAMPLES"),
    (["--rampup-batch-size", "0", "4", "100"], "START and INCR must be positive"),
    (["--rampup-batch-size", "16", "4", "100"], "START 16 must be less than --global-batch-size 16"),
    (["--rampup-batch-size", "4", "8", "100"], "INCR 8 does not divide --global-batch-size 16 - START 4 = 12"),
    (["--rampup-batch-size", "2", "2", "100"], "must be multiples of --micro-batch-size 2 x data-parallel size 2 = 4"),
    (["--rampup-batch-size", "4", "4", "100", "--train-samples", "160"], "use --train-iters instead of --train-samples"),
    (["--rampup-batch-size", "4", "4", "100", "--sft"], "does not work with the batch dataloader"),
])
def test_ramp_up_settings_are_checked_in_one_line(argv, message, capsys):
    argv = ["--micro-batch-size", "2", "--global-batch-size", "16", *argv]
    err = config_error(argv, capsys, world_size=2)
    assert message in err, err


def test_an_fp16_skip_consumes_its_samples_and_holds_the_schedule(tmp_path):
    """fp16's first steps overflow at the default loss scale (2^32, halved at each overflow: 15 skips for these
    gradients) and are skipped: each still reads its batch, so the consumed samples are train.samples_of_iteration's,
    while the scheduler, which counts the updates' samples, starts its warmup only at the first update (the learning
    rate of the skipped ones stays 0; the first update's is the warmup's first: 1 batch of its 4)."""
    import re

    import checks
    import train

    flags = [*TINY, "--mock-data", "--train-iters", "20", "--global-batch-size", "4", "--log-interval", "1", "--fp16",
             "--eval-iters", "0", "--num-workers", "0", "--lr", "1e-3", "--lr-warmup-iters", "4",
             "--data-cache-path", str(tmp_path / "cache")]
    # (a skipped iteration's line has no loss: log_lines takes the stepped ones only)
    lines = [(int(i), int(n), float(lr), int(k)) for i, n, lr, k in re.findall(
        r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) .*?learning rate: (\S+) .*?skipped iterations:\s+(\d+)",
        train_here(flags))]
    assert [l[0] for l in lines] == list(range(1, 21))
    skipped = [i for i, _, _, k in lines if k]
    assert skipped and skipped == list(range(1, len(skipped) + 1)) and len(skipped) < 16  # then it steps
    cfg = checks.parse_args(flags, world_size=1, gpu=False)
    assert [l[1] for l in lines] == [train.samples_of_iteration(cfg, i).stop for i in range(1, 21)] == \
        [4 * i for i in range(1, 21)]
    rates = [lr for _, _, lr, _ in lines]
    assert all(rates[i - 1] == 0 for i in skipped)
    assert rates[len(skipped)] == pytest.approx(1e-3 / 4, rel=1e-6)  # (printed to 7 digits)
