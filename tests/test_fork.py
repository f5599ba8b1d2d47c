"""The seams a fork changes in one place: a learning-rate schedule of its own (schedules.py)."""

import re

import pytest

import config
import schedules
from conftest import TINY


def test_a_schedule_of_ones_own_is_one_function_and_one_choice(tmp_path, capsys):
    """schedules.py's example, picked by --lr-decay-style: the learning rate on every log line is its function's,
    at the samples consumed so far (megatron-core's scheduler counts samples)."""
    import train

    gbs, iters, warmup, lr, min_lr = 4, 8, 2, 3e-3, 1e-5
    cfg = config.parse_args([*TINY, "--mock-data", "--num-workers", "0", "--eval-iters", "0", "--log-interval", "1",
                             "--global-batch-size", str(gbs), "--train-iters", str(iters), "--min-lr", str(min_lr),
                             "--lr-decay-style", "step", "--data-cache-path", str(tmp_path / "cache")],
                            world_size=1, gpu=False)
    train.pretrain(cfg)
    logged = [float(x) for x in re.findall(r"learning rate: (\S+) \|", capsys.readouterr().out)]
    want = [schedules.step_decay(i * gbs, warmup * gbs, iters * gbs, lr, min_lr, 0.0) for i in range(1, iters + 1)]
    assert len(logged) == iters
    assert logged == pytest.approx(want, rel=1e-6)
    # Warmup, then the peak, a tenth and a hundredth: its own shape, not a megatron-core style.
    assert logged[:2] == pytest.approx([lr / 2, lr]) and logged[2] == pytest.approx(lr)
    assert logged[-1] == pytest.approx(lr / 100) and lr / 10 == pytest.approx(logged[4])
