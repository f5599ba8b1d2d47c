"""bench.py small compares like with like: its plain PyTorch loop trains a GPT of train.py's very shape, and both
runs are read the same way from outside (the benchmark's figures themselves are never asserted on)."""

import pytest

import bench

SHAPE = (2, 64, 4, 32, 2, 100, 4)  # layers, hidden, heads, seq, batch, vocab (train.py pads it to 128), iterations


@pytest.mark.full  # bench.py's own runs; the first command's are train.py's
def test_small_runs_train_py_and_a_plain_loop_of_the_same_gpt(tmp_path):
    runs = bench.small_runs(SHAPE, str(tmp_path))
    seen = {name: bench._small_run(cmd) for name, cmd in runs.items()}
    (plain_start, plain_it, plain_params), (ours_start, ours_it, ours_params) = seen.values()
    # 2 layers x (two norms 4 x 64, QKV 64 x 192 + 192, projection 64 x 64 + 64, MLP 2 x 64 x 256 + 256 + 64), word
    # embeddings 128 x 64 (tied to the output), positions 32 x 64, final norm 2 x 64
    assert plain_params == ours_params == 2 * 49984 + 8192 + 2048 + 128
    assert 0 < plain_start and 0 < ours_start and 0 < plain_it and 0 < ours_it


@pytest.mark.full  # the fast command: bench.py small
def test_ops_profiles_both_sides_over_the_same_iterations():
    """bench.py ops: torch.profiler's operators of train.py and of the plain loop, per iteration, side by side."""
    rows = bench.bench_ops([])
    (_, _, ours, ours_time, _), (_, _, plain, plain_time, _) = rows[:2]
    assert (ours, plain) == ("train.py", "plain loop") and "ms/it" in ours_time and "ms/it" in plain_time
    ops = {row[2]: row[3:] for row in rows[2:]}  # counts, not a ranking by time: a loaded machine reorders those
    # both sides multiply matrices; only train.py runs megatron-core's linear layers (autograd functions of its own)
    assert all(not side.endswith(" (0x)") for side in ops["aten::mm"]), ops["aten::mm"]
    linear = ops["LinearWithGradAccumulationAndAsyncCommunication"]
    assert linear[0].endswith(" (17x)") and linear[1].endswith(" (0x)"), linear  # 4 layers x 4 linears + the output


def test_ops_decode_profiles_generate_per_token(monkeypatch):
    """bench.py ops decode: generate.py's KV-cached decoding, per token: megatron-core's frozen-weight linear layers,
    4 layers x 4 + the output layer, run once for each token."""
    monkeypatch.setattr(bench, "_decode_ops", lambda argv, new=20, f=bench._decode_ops: f(argv, new))
    rows = bench.bench_ops(["decode", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "2"])
    assert rows[0][2] == "generate.py, KV cache" and rows[0][3].endswith(" ms/token")
    ops = {row[2]: row[4] for row in rows[1:]}
    assert ops["LinearWithFrozenWeight"] == "17x a token", ops
