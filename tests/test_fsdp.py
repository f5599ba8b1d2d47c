"""Megatron FSDP (--use-megatron-fsdp): megatron-core's FullyShardedDataParallel and its distributed optimizer, each
--data-parallel-sharding-strategy giving the one process's numbers, and torch FSDP2 (--use-torch-fsdp2) through
megatron-core's TorchFullyShardedDataParallel, on CPU over gloo through device.py as every layout.

Each run starts from the seed (every data-parallel replica draws the same weights, as the one process does; there is
no checkpoint of Megatron FSDP here to continue) and trains 6 iterations with a validation every 3: the lm loss, the
grad norm, the params norm (the seed's DTensor norm on the FSDP main weights) and the validation loss at every
iteration, from TensorBoard. Not covered, and refused in one line by checks.check_sharding and check_torch_fsdp2:
checkpoints (fsdp_dtensor; torch_dist or torch_dcp), pipeline and context parallelism, MoE, fp16 (and bf16 under
FSDP2), --log-l2-norm-grad, the overlaps, downstream tasks."""

import pytest

from conftest import TINY, Launches, config_error
from conftest import assert_same as conftest_assert_same

# No dropout, so the layouts compare exactly; the ByteTokenizer's 257 ids padded to 640 rows, so that at TP=2 the
# second tensor-parallel rank's half of the vocabulary (ids 320-639) is all padding.
FLAGS = [*TINY, "--mock-data", "--global-batch-size", "8", "--train-iters", "6", "--log-interval", "1",
         "--eval-iters", "1", "--eval-interval", "3", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--num-workers", "0", "--log-params-norm", "--make-vocab-size-divisible-by", "640"]
METRICS = ("lm loss", "grad-norm", "params-norm", "lm loss validation")
FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy"]
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
TP2 = ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "320"]
# torch FSDP2, with the untied output layer Megatron-LM requires of it (against a one-process run with one too)
UNTIED = ["--untie-embeddings-and-output-weights"]
FSDP2 = [*UNTIED, "--use-torch-fsdp2"]
SGD = ["--optimizer", "sgd", "--lr", "0.1"]
# name: (ranks, flags)
LAYOUTS = {**{f"dp2_{s}": (2, [*FSDP, s]) for s in STRATEGIES},
           **{f"dp4_{s}": (4, [*FSDP, s]) for s in STRATEGIES},
           **{f"tp2_dp2_{s}": (4, [*FSDP, s, *TP2]) for s in STRATEGIES},
           "fsdp2_dp2": (2, FSDP2), "fsdp2_dp4": (4, FSDP2), "fsdp2_tp2_dp2": (4, [*FSDP2, *TP2]),
           # torch FSDP2's other optimizer, SGD with momentum (Megatron FSDP's is refused: below)
           "sgd_fsdp2_dp2": (2, [*SGD, *FSDP2])}


def reference(runs, name):
    """The one-process run a layout gives the numbers of: with the untied output layer for torch FSDP2, with SGD for
    the SGD layouts."""
    sgd = SGD if name.startswith("sgd") else []
    untied = UNTIED if "fsdp2" in name else []
    return runs("one" + "_sgd" * bool(sgd) + "_untied" * bool(untied), 1, *sgd, *untied)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, warm_torchrun):
    """The one-process runs, then every layout (two-rank ones on the warm ranks, four-rank ones in one torchrun
    job)."""
    runs = Launches(tmp_path_factory.mktemp("fsdp"), FLAGS, METRICS, warm_torchrun)
    with runs.together():
        for name, (nproc, flags) in LAYOUTS.items():
            reference(runs, name)
            runs(name, nproc, *flags)
    return runs


# The fast command: ZeRO-3 (Megatron-LM's default strategy) and ZeRO-1 (whose gradients a no_sync hook doubled) at
# DP=2, and torch FSDP2 at DP=2; the full proof every strategy and FSDP2 at DP=2, DP=4 and TP=2 x DP=2.
FAST = ("dp2_optim_grads_params", "dp2_optim", "fsdp2_dp2")


@pytest.mark.parametrize("name", [name if name in FAST else pytest.param(name, marks=pytest.mark.full) for name in LAYOUTS])
def test_every_sharding_strategy_gives_the_one_process_numbers(runs, name):
    """The same weights drawn, the same global batches: each strategy's losses, grad norms, params norms and
    validation losses are the one process's, within the sums' rounding (REORDERED)."""
    nproc, flags = LAYOUTS[name]
    run, one = runs(name, nproc, *flags), reference(runs, name)
    assert one["iterations"] == run["iterations"] == list(range(1, 7))
    assert sorted(one["lm loss validation"]) == [3, 6]
    conftest_assert_same(run, one, range(1, 7), METRICS[:3])
    conftest_assert_same(run, one, [3, 6], METRICS[3:])


@pytest.mark.parametrize("flags, world_size, expected", [
    (["--optimizer", "muon"], 2, "Megatron-FSDP does not support the muon optimizer yet."),
    (["--save", "ck"], 2, "--use-megatron-fsdp saves and loads the fsdp_dtensor format, which is not here yet; give "
                          "--no-save and no --load"),
    (["--pipeline-model-parallel-size", "2"], 4, "--use-megatron-fsdp with --pipeline-model-parallel-size 2 is not "
                                                 "proven equal to one process here yet"),
    (["--log-l2-norm-grad"], 2, "--use-megatron-fsdp with --log-l2-norm-grad is not proven"),
    (["--bf16"], 2, "--use-megatron-fsdp with --bf16 is not proven"),
    (["--optimizer", "sgd"], 2, "--use-megatron-fsdp with --optimizer sgd: Megatron FSDP steps with megatron-core's "
                                "distributed optimizer, which shards Adam's state only here"),  # its gradients reduced in bf16, DDP's in fp32
])
def test_what_megatron_fsdp_does_not_take_is_one_line(flags, world_size, expected, capsys):
    assert expected in config_error([*TINY, "--use-megatron-fsdp", *flags], capsys, world_size=world_size)


@pytest.mark.parametrize("flags, world_size, expected", [
    ([], 2, "--use-torch-fsdp2 requires --untie-embeddings-and-output-weights"),
    ([*UNTIED, "--use-distributed-optimizer"], 2, "--use-torch-fsdp2 is not supported with MCore's distributed "
                                                  "optimizer"),
    ([*UNTIED, "--pipeline-model-parallel-size", "2"], 2, "--use-torch-fsdp2 is not supported with pipeline "
                                                          "parallelism"),
    ([*UNTIED, "--fp16"], 2, "--use-torch-fsdp2 not supported with fp16 yet"),
    ([*UNTIED, "--use-megatron-fsdp"], 2, "Using use_megatron_fsdp and use_torch_fsdp2 at the same time is not "
                                          "supported."),
    ([*UNTIED, "--save", "ck"], 2, "--use-torch-fsdp2 saves and loads its DTensors as torch_dist or torch_dcp, which "
                                   "is not here yet"),
])
def test_what_torch_fsdp2_does_not_take_is_one_line(flags, world_size, expected, capsys):
    """Megatron-LM's refusals (arguments.py:997-1015), in its words."""
    assert expected in config_error([*TINY, "--use-torch-fsdp2", *flags], capsys, world_size=world_size)


def test_megatron_fsdp_turns_on_the_distributed_optimizer_and_takes_megatron_lms_default_strategy():
    """As Megatron-LM's arguments.py: the distributed optimizer on (Megatron FSDP steps its sharded main weights with
    it), optim_grads_params by default; on a CPU the reduction's fused division is off (gloo has no PREMUL_SUM)."""
    import checks

    cfg = checks.parse_args([*TINY, "--use-megatron-fsdp"], world_size=2, gpu=False)
    assert (cfg.optimizer.use_distributed_optimizer, cfg.ddp.use_distributed_optimizer) == (True, True)
    assert cfg.ddp.data_parallel_sharding_strategy == "optim_grads_params"
    assert cfg.ddp.gradient_reduce_div_fusion is False
    assert checks.parse_args(TINY, world_size=1, gpu=True).ddp.gradient_reduce_div_fusion is True


def test_the_memory_estimate_is_what_each_strategy_holds_on_a_rank():
    """metrics.bytes_per_parameter (the theoretical memory report's and the fit check's count) against what Megatron
    FSDP has allocated on a rank at the end of a step at DP=2 (tests/scripts/fsdp_memory.py): fp32 with Adam, 20 bytes
    a parameter unsharded, 8 + 12/2 with the optimizer state sharded, 4 + 16/2 with the gradients too, and 20/2 with
    the weights too plus the 4 of the weights gathered again for the next forward. Above the estimate only by the
    buffers' padding: each bucket is padded to a multiple of DP x its widest row
    (megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:284-287), in at most 4 buffers of
    4-byte elements (the weights, their gathered copy, the main weights, the gradients)."""
    import json

    from conftest import torchrun

    proc = torchrun(["no_shard", "optim", "optim_grads", "optim_grads_params"], nproc=2,
                    script="tests/scripts/fsdp_memory.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["strategy"]: r for r in map(json.loads, [line for line in proc.stdout.splitlines() if line.startswith("{")])}
    assert {s: r["theory"] for s, r in rows.items()} == {"no_shard": 20, "optim": 14, "optim_grads": 12,
                                                          "optim_grads_params": 14}
    for strategy, r in rows.items():
        padding = 4 * 4 * r["buckets"] * 2 * r["widest"] / r["n"]
        assert r["theory"] <= r["measured"] <= r["theory"] + padding, strategy


def test_zero_3_trains_with_megatron_lms_defaults(warm_torchrun):
    """Megatron-LM's defaults (dropout 0.1, the default strategy, optim_grads_params) on the quick start's model shape
    at DP=2 for 20 iterations: every iteration logged and the loss falling. Its parameter gathers ran asynchronously
    over gloo and one such run in three ended in SIGSEGV (device._gathered_before_return); a race, so this run shows
    the defaults train, and fails without that answer only some of the time."""
    from conftest import log_lines

    proc = warm_torchrun(["--mock-data", "--train-iters", "20", "--log-interval", "1", "--eval-iters", "0", "--no-save",
                          "--no-tensorboard", "--num-workers", "0", "--global-batch-size", "16",
                          "--use-megatron-fsdp"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = log_lines(proc.stdout)
    assert [it for it, *_ in lines] == list(range(1, 21))
    losses = [float(line[3]) for line in lines]
    assert sum(losses[-5:]) < sum(losses[:5])
