"""Mixed precision: --fp16 on CPU (float16 autocast, megatron-core's dynamic loss scaler in the CPU optimizer),
the loss-scaling rule read back from real log lines, its checkpointing, and the precision settings' validation.
The GPU test (megatron-core's own optimizer) is skipped without CUDA."""

import re
import subprocess
import sys

import pytest
import torch

import config
import checks
from conftest import ROOT, TINY, config_error, torchrun

COMMON = [*TINY, "--mock-data", "--num-workers", "0", "--eval-iters", "0", "--log-interval", "1"]

LINE = re.compile(r"iteration +(\d+)/ +\d+ \|.*? learning rate: (\S+) \|.*?(?: lm loss: (\S+) \|)? loss scale: (\S+) \|"
                  r".*? number of skipped iterations: +(\d+) \|")


def parse(stdout: str) -> list:
    """(iteration, learning rate, lm loss or None, loss scale, skipped) of each log line (--log-interval 1)."""
    return [(int(i), float(lr), float(loss) if loss else None, float(scale), int(skipped))
            for i, lr, loss, scale, skipped in LINE.findall(stdout)]


def expected_loss_scales(skipped: list, initial: float, window: int, hysteresis: int, minimum: float = 1.0) -> list:
    """The loss scale after each iteration under Megatron's rule (DynamicGradScaler.update): an overflow
    costs one hysteresis credit and, once they are spent, halves the scale; `window` clean iterations in a
    row double it and restore the credits."""
    scale, credits, clean, scales = initial, hysteresis, 0, []
    for overflow in skipped:
        if overflow:
            clean, credits = 0, credits - 1
            if credits <= 0:
                scale = max(scale / 2, minimum)
        else:
            clean += 1
            if clean == window:
                clean, credits, scale = 0, hysteresis, scale * 2
        scales.append(scale)
    return scales


def _pretrain(tmp_path, *extra):
    import train

    cfg = checks.parse_args([*COMMON, "--data-cache-path", str(tmp_path / "cache"), *extra], world_size=1, gpu=False)
    return train.pretrain(cfg)


def test_fp16_on_cpu_overflows_skip_steps_and_halve_the_loss_scale_then_the_loss_falls(tmp_path, capsys):
    state = _pretrain(tmp_path, "--fp16", "--initial-loss-scale", str(2 ** 26), "--loss-scale-window", "6",
                      "--train-iters", "30")
    lines = parse(capsys.readouterr().out)
    assert state.exit_code is None and [l[0] for l in lines] == list(range(1, 31))
    skipped = [l[4] for l in lines]
    # A scale of 2**26 overflows float16 gradients: the first steps are skipped, each counted in its log line.
    first_ok = skipped.index(0)
    # Their samples count as consumed, not skipped (skipped samples are --iterations-to-skip's), as in Megatron-LM.
    assert first_ok >= 3 and all(skipped[:first_ok]) and state.train_state.skipped_train_samples == 0
    # The logged loss scale follows megatron-core's rule exactly: unchanged at the first overflow (hysteresis 2),
    # halved at each one after, doubled after 6 clean iterations.
    assert [l[3] for l in lines] == expected_loss_scales(skipped, 2.0 ** 26, window=6, hysteresis=2)
    scales = [l[3] for l in lines]
    assert scales[1] == scales[0] / 2 and any(b == 2 * a for a, b in zip(scales, scales[1:]))  # it halves, and grows
    # A skipped step leaves the scheduler alone: the learning rate does not advance until a step is taken.
    assert len({l[1] for l in lines[:first_ok]}) == 1 and lines[first_ok][1] > lines[0][1]
    # Skipped iterations carry no loss into the average; the trained ones learn.
    assert all(l[2] is None for l in lines[:first_ok])
    losses = [l[2] for l in lines if l[2] is not None]
    assert sum(losses[-5:]) / 5 < losses[0] - 0.3, losses


def test_fp16_loss_scale_is_checkpointed_and_resumed(tmp_path, capsys):
    args = ["--fp16", "--initial-loss-scale", str(2 ** 24), "--loss-scale-window", "3", "--train-iters", "10"]
    _pretrain(tmp_path, *args)
    straight = {l[0]: l for l in parse(capsys.readouterr().out)}
    _pretrain(tmp_path, *args, "--exit-interval", "5", "--save", str(tmp_path / "ck"))
    _pretrain(tmp_path, *args, "--save", str(tmp_path / "ck"), "--load", str(tmp_path / "ck"))
    resumed = {l[0]: l for l in parse(capsys.readouterr().out)}
    assert sorted(resumed) == list(range(1, 11))
    assert resumed == straight  # loss scale, skips, learning rate and losses, bitwise


def test_constant_loss_scale(tmp_path, capsys):
    state = _pretrain(tmp_path, "--fp16", "--loss-scale", "1024", "--train-iters", "3")
    lines = parse(capsys.readouterr().out)
    assert state.exit_code is None and [(l[3], l[4]) for l in lines] == [(1024.0, 0)] * 3


def test_dynamic_loss_scaling_turns_off_the_nan_check_as_megatron_does():
    dynamic = checks.parse_args(["--fp16"], world_size=1, gpu=False)
    static = checks.parse_args(["--fp16", "--loss-scale", "128"], world_size=1, gpu=False)
    assert dynamic.train.check_for_nan_in_loss_and_grad is False  # an Inf gradient is the scaler's signal
    assert static.train.check_for_nan_in_loss_and_grad is True
    assert dynamic.optimizer.initial_loss_scale == 2.0 ** 32 and dynamic.optimizer.hysteresis == 2


@pytest.mark.parametrize("argv, message", [
    (["--bf16", "--fp16"], "megatron-core's TransformerConfig refuses these settings: Only one of self.fp16: True and self.bf16 True should be True."),
    (["--loss-scale", "128"], "--loss-scale 128.0 sets fp16 loss scaling, but --fp16 is not set (fp32 training"),
    (["--bf16", "--hysteresis", "4"], "--hysteresis 4 sets fp16 loss scaling, but --fp16 is not set (bf16 training"),
    (["--fp16", "--loss-scale", "0"], "--loss-scale must be positive"),
    (["--fp16", "--initial-loss-scale", "4", "--min-loss-scale", "8"], "--min-loss-scale 8.0 must be positive and at most"),
    (["--fp16", "--loss-scale-window", "0"], "must be at least 1"),
])
def test_precision_consistency_errors_are_one_line_with_exit_code_2(argv, message, capsys):
    err = config_error(argv, capsys)
    assert message in err, err


def test_precision_error_from_the_command_line():
    proc = subprocess.run([sys.executable, "train.py", "--bf16", "--fp16"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("train.py: error: megatron-core's TransformerConfig refuses these settings: Only one of "
                           "self.fp16: True and self.bf16 True should be True.\n")


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: megatron-core's fp16 optimizer (Float16Module, fp32 main weights)")
def test_fp16_on_gpu_uses_megatron_cores_loss_scaler(tmp_path):
    proc = torchrun([*COMMON, "--fp16", "--initial-loss-scale", str(2 ** 40), "--loss-scale-window", "6",
                     "--train-iters", "30", "--data-cache-path", str(tmp_path / "cache")], nproc=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = parse(proc.stdout)
    skipped = [l[4] for l in lines]
    assert [l[0] for l in lines] == list(range(1, 31)) and skipped[0] == 1 and 0 in skipped
    assert [l[3] for l in lines] == expected_loss_scales(skipped, 2.0 ** 40, window=6, hysteresis=2)
