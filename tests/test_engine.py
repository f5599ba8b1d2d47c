"""One engine on every machine: megatron-core's DDP, optimizer (distributed too), pipeline schedules (1F1B and
interleaved) and dist_checkpointing, run on CPU over gloo through device.py's shim, in real torchrun jobs.

The runs share one starting point: a plain 2-rank data-parallel run saves at iteration 6 and goes on to 12.
Every other layout resumes from that checkpoint (resharded on load) and must give the same losses."""

import pytest
import torch

from conftest import TINY, log_lines, torchrun

# Four layers so two pipeline stages can each hold two virtual stages; no dropout, so layouts compare exactly.
FLAGS = [*TINY, "--num-layers", "4", "--mock-data", "--global-batch-size", "8", "--train-iters", "12",
         "--log-interval", "1", "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--num-workers", "0"]


def losses(proc) -> dict:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return {it: loss for it, _, _, loss, _, _ in log_lines(proc.stdout)}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The reference: 2 data-parallel ranks, megatron-core's (non-distributed) optimizer, a save at 6."""
    out = tmp_path_factory.mktemp("engine")
    proc = torchrun([*FLAGS, "--save", str(out / "plain"), "--save-interval", "6", "--data-cache-path", str(out / "cache")])
    return dict(dir=out, losses=losses(proc))


@pytest.fixture(scope="module")
def dopt(plain):
    """The same run with --use-distributed-optimizer, saving at 6, and its resume from 6 (one pair of runs for
    the tests below)."""
    out = plain["dir"]
    args = [*FLAGS, "--use-distributed-optimizer", "--data-cache-path", str(out / "cache")]
    straight = losses(torchrun([*args, "--save", str(out / "dopt"), "--save-interval", "6"]))
    # dp_reshardable by default: the optimizer state is saved per data-parallel shard, and read back so.
    resumed_run = torchrun([*args, "--load", str(out / "dopt"), "--ckpt-step", "6"])
    return dict(straight=straight, resumed=losses(resumed_run), resumed_stdout=resumed_run.stdout)


def test_distributed_optimizer_matches_the_plain_optimizer_and_loads_its_weights(plain, dopt):
    straight, resumed = dopt["straight"], dopt["resumed"]
    assert sorted(straight) == list(range(1, 13))
    for it, loss in plain["losses"].items():
        assert straight[it] == pytest.approx(loss, rel=1e-5), it
    assert sorted(resumed) == list(range(7, 13))
    assert resumed[7] == straight[7]  # the loaded weights are the saved ones, bit for bit


def test_memory_report_covers_the_first_two_iterations_after_a_resume(dopt):
    """The memory report, with the theoretical estimate beside it, covers the first two iterations after the
    resume (the second holds the optimizer state), as Bridge's; the estimate shards Adam over the 2 ranks."""
    stdout = dopt["resumed_stdout"]
    reports = [line for line in stdout.splitlines() if "iterations) memory (GB)" in line]
    assert [line.split("(after ")[1].split(" ")[0] for line in reports] == ["7", "8"]
    assert stdout.count("Theoretical memory footprints: weight and optimizer=") == 2
    assert " 12.00 bytes per trainable parameter" in stdout  # fp32: 4 weight + 4 gradient + 8 Adam / 2 ranks


@pytest.mark.xfail(strict=True, reason="known open defect: after a dp_reshardable resume of the distributed optimizer "
                   "the losses drift from iteration 8 (~7e-4 relative): its Adam state does not come back exactly")
def test_distributed_optimizer_resume_is_bitwise(dopt):
    assert all(dopt["resumed"][it] == dopt["straight"][it] for it in dopt["resumed"])


@pytest.mark.parametrize("layout", [
    ["--pipeline-model-parallel-size", "2"],                                                      # 1F1B
    pytest.param(["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
                 marks=pytest.mark.xfail(strict=True, reason="known open defect: the interleaved schedule trains, but "
                                         "its losses differ from PP=1's by ~5e-4 relative from the first resumed step")),
    ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1"],           # uneven: 1 + 3
    # TP: the vocabulary is padded to a multiple of 128 x TP by default; 64 x 2 keeps the saved embedding's rows.
    ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"],
])
def test_other_layouts_resume_the_plain_checkpoint_with_its_losses(plain, layout):
    """A data-parallel checkpoint resharded on load into pipeline stages (1F1B, interleaved) or tensor-parallel
    shards: the same global batches, the same weights, so the same losses."""
    out = plain["dir"]
    resumed = losses(torchrun([*FLAGS, *layout, "--load", str(out / "plain"), "--ckpt-step", "6",
                               "--data-cache-path", str(out / "cache")]))
    assert sorted(resumed) == list(range(7, 13))
    for it, loss in resumed.items():
        assert loss == pytest.approx(plain["losses"][it], rel=1e-5), it


def test_megatron_engine_pieces_are_in_use(single_rank_groups):
    """What setup builds on this machine is megatron-core's own: DDP around Float16Module, the mixed-precision
    optimizer with fp32 main weights, the distributed optimizer's shards; fp16 gets megatron's loss scaler."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import DistributedOptimizer, Float16OptimizerWithFloat16Params
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler
    from megatron.core.transformer.module import Float16Module

    import config
    from model import build_model, build_optimizer, wrap_model

    for flags, optimizer_type, dtype in ((["--bf16"], Float16OptimizerWithFloat16Params, torch.bfloat16),
                                         (["--fp16"], Float16OptimizerWithFloat16Params, torch.float16),
                                         (["--use-distributed-optimizer"], DistributedOptimizer, torch.float32)):
        cfg = config.parse_args([*TINY, *flags], world_size=1, gpu=False)
        model = wrap_model(cfg, build_model(cfg, 100))
        assert isinstance(model[0], DistributedDataParallel)
        assert isinstance(model[0].module, Float16Module) == (dtype != torch.float32)
        assert {p.dtype for p in model[0].parameters()} == {dtype}
        optimizer = build_optimizer(cfg, model)
        inner = optimizer.chained_optimizers[0] if hasattr(optimizer, "chained_optimizers") else optimizer
        assert isinstance(inner, optimizer_type), flags
        assert isinstance(inner.grad_scaler, DynamicGradScaler) == ("--fp16" in flags)
