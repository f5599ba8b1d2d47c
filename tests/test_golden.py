"""Golden values: a 2-rank run of the default model shape, shrunk, for 50 iterations, must write the lm loss and
grad norm that tests/golden/gpt_tiny_2ranks.json holds (rel <= conftest.REORDERED), read back from its TensorBoard files as
Megatron-LM's functional tests read theirs. It guards every refactor against numeric drift.

The file is in Megatron-LM's golden-values format: {metric: {start_step, end_step, step_interval, values}}.
Regenerate it on purpose only (a change that must change the numbers, said in its commit):

    REGENERATE_GOLDEN=1 python -m pytest tests/test_golden.py
"""

import json
import os

import pytest

from conftest import REORDERED, ROOT, TINY, tensorboard_scalars

GOLDEN = os.path.join(ROOT, "tests", "golden", "gpt_tiny_2ranks.json")
ITERATIONS = 50
# The defaults (LayerNorm, learned positions, GeLU, tied embeddings, dropout 0.1; Megatron-LM's schedule: linear
# decay to 0, no warmup), tiny sizes. Regenerated when the defaults became Megatron-LM's, and when attention dropout
# moved to the tensor-parallel RNG tracker's stream (as megatron-core's DotProductAttention draws it: other masks).
FLAGS = [*TINY, "--mock-data", "--global-batch-size", "8", "--train-iters", str(ITERATIONS), "--log-interval", "10",
         "--eval-iters", "0", "--num-workers", "0"]
METRICS = {"lm loss": "lm loss", "grad norm": "grad-norm"}  # golden name: TensorBoard tag


def golden_values(tb: dict) -> dict:
    """Megatron-LM's golden-values layout of every iteration's value of each metric."""
    return {name: {"start_step": 1, "end_step": ITERATIONS, "step_interval": 1,
                   "values": {str(step): tb[tag][step] for step in range(1, ITERATIONS + 1)}}
            for name, tag in METRICS.items()}


def test_a_two_rank_run_writes_the_golden_values(tmp_path, warm_torchrun):
    proc = warm_torchrun([*FLAGS, "--tensorboard-dir", str(tmp_path / "tb"), "--data-cache-path", str(tmp_path / "cache")])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = golden_values(tensorboard_scalars(tmp_path / "tb"))
    if os.environ.get("REGENERATE_GOLDEN"):
        with open(GOLDEN, "w") as fh:
            json.dump(got, fh, indent=1)
            fh.write("\n")
    with open(GOLDEN) as fh:
        want = json.load(fh)
    assert set(want) == set(METRICS)
    for name in METRICS:
        assert {k: want[name][k] for k in ("start_step", "end_step", "step_interval")} == \
            {"start_step": 1, "end_step": ITERATIONS, "step_interval": 1}
        steps = range(want[name]["start_step"], want[name]["end_step"] + 1, want[name]["step_interval"])
        for step in steps:
            # Written on the project's machine: another CPU's kernels group the fp32 sums otherwise (REORDERED).
            assert got[name]["values"][str(step)] == pytest.approx(want[name]["values"][str(step)], rel=REORDERED), \
                (name, step)
