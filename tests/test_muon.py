"""Muon and the other emerging optimizers, through megatron-core's own path (optimizer/emerging_optimizers.py, the
`emerging-optimizers` package) on the CPU: megatron-core chains the orthogonalized optimizer of the 2-D weights
with Adam for the rest, and says which is which; under tensor parallelism the duplicated and distributed modes give
the one-process run; a checkpoint resumes bit for bit, at its own layout and at another."""

import re

import pytest

from conftest import REORDERED, TINY, Launches, assert_bitwise, assert_same, config_error, log_lines, train_here

FLAGS = [*TINY, "--mock-data", "--global-batch-size", "4", "--train-iters", "6", "--log-interval", "1",
         "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0",
         "--lr-decay-style", "constant", "--optimizer", "muon", "--muon-fp32-matmul-prec", "high"]
TP2 = ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"]
METRICS = ("lm loss", "grad-norm")
TP_MODES = ["duplicated", "distributed"]


def one(runs):
    return runs("one", 1, *runs.saving("one", 3))


def tp2(runs, mode):
    return runs(f"tp2_{mode}", 2, *TP2, "--muon-tp-mode", mode, *runs.saving(f"tp2_{mode}", 3))


def tp2_resumed(runs):
    return runs.resume("tp2_duplicated_resumed", 2, "tp2_duplicated", 3, *TP2, "--muon-tp-mode", "duplicated")


def one_from_tp2(runs):
    return runs.resume("one_from_tp2", 1, "tp2_duplicated", 3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, warm_torchrun):
    """One rank, then the 2-rank runs in one torchrun job (conftest.Launches.together), then a one-rank resume of
    the TP=2 checkpoint."""
    runs = Launches(tmp_path_factory.mktemp("muon"), FLAGS, METRICS, warm_torchrun)
    with runs.together():
        one(runs)
        for mode in [*TP_MODES, "blockwise"]:
            tp2(runs, mode)
        tp2_resumed(runs)
        one_from_tp2(runs)
    return runs


def test_muon_updates_the_matrices_and_adam_the_rest_as_megatron_core_chooses(runs):
    """megatron-core gives Muon every 2-D weight that is not the word embedding or the output layer (the learned
    position table included: _is_nonlinear_or_embedding), and --muon-scalar-optimizer (Adam) the rest; train.py
    prints the split once, read from the optimizers megatron-core built. The loss falls."""
    run = one(runs)
    said = [line for line in run["stdout"].splitlines() if " updates " in line]
    assert said[0].startswith(" > TensorParallelMuon updates 9 tensors") and said[1].startswith(" > AdamW updates 19 ")
    muon_names = said[0].split(": ", 1)[1].split(", ")
    assert muon_names == ["decoder.layers.*.mlp.linear_fc1.weight", "decoder.layers.*.mlp.linear_fc2.weight",
                          "decoder.layers.*.self_attention.linear_proj.weight",
                          "decoder.layers.*.self_attention.linear_qkv.weight", "embedding.position_embeddings.weight"]
    assert "embedding.word_embeddings.weight" in said[1] and "decoder.final_layernorm.bias" in said[1]
    losses = [loss for _, _, _, loss, _, _ in log_lines(run["stdout"])]
    # From ln 384 = 5.95 (the uniform guess) down by ~0.1-0.2 a step past warm-up; 0.2 in all is far above noise.
    assert losses[-1] < losses[0] - 0.2, losses


@pytest.mark.parametrize("mode", TP_MODES)
def test_tensor_parallel_muon_gathers_or_distributes_to_the_one_process_update(runs, mode):
    """--muon-tp-mode duplicated (each rank orthogonalizes the gathered matrix) and distributed (the Newton-Schulz
    iteration's products summed over the ranks) compute the one-process update: the same lm loss and grad norm at
    every iteration, within REORDERED (fp32 Newton-Schulz, --muon-fp32-matmul-prec high)."""
    # REORDERED's argument: the same fp32 arithmetic with its sums grouped otherwise (a gathered matrix; the Gram
    # products of 5 Newton-Schulz steps summed over 2 ranks, each of <= 256 terms, log2(256) x 2^-24 = 5e-7 a sum),
    # over 6 iterations: within 2e-5.
    assert_same(tp2(runs, mode), one(runs), range(1, 7), METRICS, rel=REORDERED)


def test_blockwise_tensor_parallel_muon_orthogonalizes_each_shard(runs):
    """--muon-tp-mode blockwise, megatron-core's default, orthogonalizes each rank's shard on its own: another update
    than one process's (an orthogonal matrix's halves are not orthogonal matrices), so the runs part after the first
    step; it still learns."""
    blockwise, reference = tp2(runs, "blockwise"), one(runs)
    assert blockwise["lm loss"][1] == pytest.approx(reference["lm loss"][1], rel=REORDERED)  # before any update
    # 1e-3 relative to a loss of ~5.6 is 10x REORDERED: no regrouping of sums explains it, another update does.
    assert abs(blockwise["lm loss"][6] - reference["lm loss"][6]) > 1e-3
    assert blockwise["lm loss"][6] < blockwise["lm loss"][1] - 0.2


def test_muon_resumes_bitwise_and_its_momentum_crosses_to_one_rank(runs):
    """The momentum buffers are in the checkpoint (megatron-core's sharded optimizer state): the TP=2 run resumed at
    3 is the same run bit for bit, and one rank continuing the TP=2 checkpoint gives the TP=2 run's figures."""
    straight = tp2(runs, "duplicated")
    resumed = tp2_resumed(runs)
    assert resumed["iterations"] == [4, 5, 6]
    assert_bitwise(resumed, straight, [4, 5, 6], METRICS)
    assert_same(one_from_tp2(runs), straight, [4, 5, 6], METRICS, rel=REORDERED)


def test_lion_and_soap_train_through_the_same_path():
    """The other emerging optimizers megatron-core builds from the package: the loss falls over 6 steps."""
    for name in ("lion", "soap"):
        out = train_here([*FLAGS, "--optimizer", name])
        assert re.search(rf" > {'Lion' if name == 'lion' else 'SOAP'} updates 9 tensors", out), name
        losses = [loss for _, _, _, loss, _, _ in log_lines(out)]
        assert losses[-1] < losses[0] - 0.1, (name, losses)


@pytest.mark.parametrize("flags, expected", [
    (["--optimizer", "muon", "--use-distributed-optimizer"], "--optimizer muon with --use-distributed-optimizer: "
     "Megatron-LM shards an emerging optimizer with megatron-core's layer-wise distributed optimizer"),
    (["--optimizer", "dist_muon"], "--optimizer dist_muon: Megatron-LM shards an emerging optimizer"),
    (["--optimizer", "muon", "--fp16"], "--optimizer muon with --fp16: megatron-core's emerging optimizers do not "
                                        "support fp16"),
    (["--optimizer", "adaptive_muon"], "--optimizer adaptive_muon: megatron-core 0.19.2's TensorParallelAdaptiveMuon"),
    (["--optimizer", "muon", "--muon-tp-mode", "sideways"], "invalid choice: 'sideways'"),
])
def test_what_muon_refuses_is_one_line(flags, expected, capsys):
    assert expected in config_error([*TINY, *flags], capsys)


def test_muon_without_the_package_names_it(capsys, monkeypatch):
    """Where emerging-optimizers is not installed (it is here, in requirements.txt), one line says what to install."""
    import importlib.util

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "emerging_optimizers"
                        else found(name, *a))
    assert "pip install emerging-optimizers" in config_error([*TINY, "--optimizer", "muon"], capsys)
