"""One engine on every machine, and every parallel layout gives the one-process answer.

megatron-core's DDP, optimizer (distributed too), pipeline schedules (1F1B and interleaved) and
dist_checkpointing run on CPU over gloo through device.py's shim, in real torchrun jobs.

The layout matrix: a 1-rank run saves at iteration 6. Every layout (data, tensor, sequence, pipeline, virtual-pipeline and
context parallelism, the distributed optimizer, and their products on 4 and 8 ranks) continues that checkpoint
(resharded on load) to 12 and must print the 1-rank run's lm loss and grad norm at every iteration, read back from
TensorBoard; CP with rotary positions continues a 1-rank RoPE run's checkpoint.
The 4- and 8-rank layouts also stop at 9 and resume bitwise, and the 8-rank checkpoint goes back to 1 rank.
Every run is planned for 15 iterations (the schedule a checkpoint holds) and most stop at 12 (--exit-interval)."""

import os

import pytest
import torch

from conftest import REORDERED, TINY, Launches

# Four layers so two pipeline stages can each hold two virtual stages; no dropout, so layouts compare exactly. Every
# number a run reports: the z-loss beside the lm loss, the params norm, the zeros in the gradient, the gradient's norm
# per parameter, a validation loss every 3 iterations. The ByteTokenizer's 257 ids padded to 640 rows.
FLAGS = [*TINY, "--num-layers", "4", "--mock-data", "--global-batch-size", "8", "--train-iters", "15", "--exit-interval", "12",
         "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "3", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--num-workers", "0", "--lr-decay-style", "constant", "--z-loss-coeff", "1e-3",
         "--log-params-norm", "--log-num-zeros-in-grad", "--log-l2-norm-grad", "--make-vocab-size-divisible-by", "640"]
DOPT = ["--use-distributed-optimizer"]
# TP pads the vocabulary to a multiple of the divisor x TP: 320 x 2 keeps the 1-rank run's 640 rows, and the second
# tensor-parallel rank's 320 (ids 320-639) are all padding.
TP2 = ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "320"]
SP = ["--sequence-parallel"]
# Context parallelism on the local layers: SDPAttention all-gathers keys and values over the CP group (--cp-comm-type
# all_gather, derived).
CP2 = ["--context-parallel-size", "2"]
ROPE = ["--position-embedding-type", "rope"]
METRICS = ("lm loss", "grad-norm")


class Runs(Launches):
    """The matrix's torchrun jobs (conftest.Launches) and the references they continue."""

    def __init__(self, out, warm):
        super().__init__(out, FLAGS, METRICS, warm)

    def plain(self):
        """The reference: one rank, megatron-core's (non-distributed) optimizer, a save at 6."""
        return self("plain", 1, *self.saving("plain", 6))

    def dopt(self):
        """One rank with the distributed optimizer (the same arithmetic), saved at 6 in the fully_reshardable
        format: the checkpoint that distributed-optimizer layouts continue (a plain fp32 optimizer's state has no
        main weights for them to read)."""
        return self("dopt", 1, *DOPT, "--dist-ckpt-optim-fully-reshardable", "--exit-interval", "6",
                    *self.saving("dopt", 6))

    def rope(self):
        """The reference with rotary positions (under CP each rank rotates its two chunks by their positions)."""
        return self("rope", 1, *ROPE, *self.saving("rope", 6))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, warm_torchrun):
    """Every run of the matrix, made up front: the one-rank references, then each process count's runs in one
    torchrun job (conftest.Launches.together)."""
    runs = Runs(tmp_path_factory.mktemp("engine"), warm_torchrun)
    with runs.together():
        runs.plain(), runs.dopt(), runs.rope()
        for nproc in (2, 4, 8):
            for name in [name for name, (n, _, _) in LAYOUTS.items() if n == nproc]:
                layout(runs, name)
            if nproc == 2:
                dopt_resumed(runs)
            for name in [name for name in RESUMED if LAYOUTS[name][0] == nproc]:
                stop_and_resume(runs, name)
        one_from_eight(runs), one_from_cp2(runs)
    return runs


def numbers(reference) -> list:
    """Every number the reference wrote to TensorBoard but the clock's (iteration-time): the losses, their validation,
    the norms, the zeros, each parameter's gradient norm under its global name. Their "vs samples" twins hold the
    same values by another step."""
    numbers = sorted(tag for tag in reference["tb"] if tag != "iteration-time" and not tag.endswith(" vs samples"))
    assert {"lm loss", "z loss", "lm loss validation", "grad-norm", "params-norm", "num-zeros", "l2_norm/grad/global",
            "l2_norm/grad/decoder.layers.3.mlp.linear_fc1.bias"} <= set(numbers)
    return numbers


# num-zeros counts the gradient's elements that are exactly 0. The keys' biases have a gradient of 0 in exact
# arithmetic (adding the same q . b_k to every score of a query leaves its softmax unchanged), so theirs is rounding
# noise, exactly 0 in one order of summation and not in another: the count may differ by at most their number, 4
# layers x 64 (the other elements' gradients are not 0 in exact arithmetic, so no reordering makes them 0 here).
KEY_BIASES = 4 * 64


def assert_same(run, reference, iterations, rel=REORDERED):
    """Every number of the reference at each of `iterations` where it has one, and the run has the same names."""
    assert set(numbers(run)) == set(numbers(reference))
    for tag in numbers(reference):
        bound = dict(abs=KEY_BIASES) if tag == "num-zeros" else dict(rel=rel)
        for it in [it for it in iterations if it in reference["tb"][tag]]:
            assert run["tb"][tag][it] == pytest.approx(reference["tb"][tag][it], **bound), (tag, it)


def assert_bitwise(run, reference, iterations):
    assert set(numbers(run)) == set(numbers(reference))
    for tag in numbers(reference):
        its = [it for it in iterations if it in reference["tb"][tag]]
        assert [run["tb"][tag][it] for it in its] == [reference["tb"][tag][it] for it in its], tag


LAYOUTS = {
    "dp2": (2, "plain", []),
    "tp2": (2, "plain", TP2),
    "pp2": (2, "plain", ["--pipeline-model-parallel-size", "2"]),                                   # 1F1B
    # Interleaved: Megatron-LM's default --overlap-p2p-communication, one isend/irecv each (README: defects).
    "pp2_vpp2": (2, "plain", ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]),
    # Loads the fully_reshardable checkpoint of 1 rank into 2 shards, saves dp_reshardable at 9 (resumed below).
    "dp2_dopt": (2, "dopt", [*DOPT, "--save-interval", "9"]),
    # Sequence parallelism: each tensor-parallel rank holds half of the sequence outside the tensor-parallel regions.
    "tp2_sp": (2, "plain", [*TP2, *SP]),
    # Context parallelism, learned positions: each rank holds chunks r and 3 - r of 4; runs on to 15 and saves at 12
    # (continued on one rank below).
    "cp2": (2, "plain", [*CP2, "--exit-interval", "15", "--save-interval", "12"]),
    "cp2_rope": (2, "rope", [*CP2, *ROPE]),
    "tp2_cp2": (4, "plain", [*TP2, *CP2]),
    # 4 ranks, with an uneven pipeline split (1 + 3 layers) and sequence parallelism; saves at 9 (resumed below), each
    # rank through two writers (Bridge's storage_writers_per_rank).
    "tp2_pp2": (4, "plain", [*TP2, *SP, "--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1",
                             "--dist-ckpt-workers", "2", "--save-interval", "9"]),
    # 8 ranks: TP 2 (with SP) x PP 2 x DP 2, the distributed optimizer, fully_reshardable so 1 rank can read it back.
    "tp2_pp2_dp2": (8, "dopt", [*TP2, *SP, "--pipeline-model-parallel-size", "2", *DOPT,
                                "--dist-ckpt-optim-fully-reshardable", "--save-interval", "9"]),
}


def layout(runs, name):
    nproc, source, flags = LAYOUTS[name]
    saving = ["--save", runs.ckpt(name)] if "--save-interval" in flags else []
    getattr(runs, source)()
    return runs.resume(name, nproc, source, 6, *flags, *saving)


def test_the_distributed_optimizer_on_one_rank_is_the_plain_optimizer(runs):
    assert runs.plain()["iterations"] == list(range(1, 13))
    assert_same(runs.dopt(), runs.plain(), range(1, 7))


# The full proof: every layout and the 4- and 8-rank products. The first command's layouts are its drawn runs'
# (tests/test_layouts.py: every two-rank layout, each with a drawn model, continued from one process's checkpoint).
@pytest.mark.full
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_continues_the_one_rank_checkpoint_with_its_losses_and_grad_norms(runs, name):
    """The same global batches and the same weights, resharded on load into data-parallel replicas,
    tensor-parallel shards, pipeline stages (1F1B, interleaved, uneven) or distributed-optimizer shards:
    the same lm loss and grad norm at every iteration."""
    run = layout(runs, name)
    assert run["iterations"][:6] == list(range(7, 13))
    assert_same(run, runs.rope() if LAYOUTS[name][1] == "rope" else runs.plain(), range(7, 13))


def test_distributed_optimizer_resumes_bitwise_in_each_checkpoint_format(runs):
    """Each parameter gets back its own Adam step: a fully_reshardable load (the 1-rank checkpoint, 1 shard into
    2) and a dp_reshardable one (2 shards into 2) both continue bit for bit. Without the fix the first fails with
    KeyError 'step' and the second drifts from its second step."""
    straight, resumed = layout(runs, "dp2_dopt"), dopt_resumed(runs)
    assert resumed["iterations"] == [10, 11, 12]
    assert_bitwise(resumed, straight, [10, 11, 12])


def dopt_resumed(runs):
    return runs.resume("dp2_dopt_resumed", 2, "dp2_dopt", 9, *DOPT)


RESUMED = ["tp2_pp2", "tp2_pp2_dp2"]


def stop_and_resume(runs, name):
    """A layout's run from 6 to 12 (saving at 9 and, on exit, at 12) and its resume from 9; the 8-rank resume
    goes on to 15: the losses the 8-rank checkpoint of 12 must give on 1 rank."""
    nproc, _, flags = LAYOUTS[name]
    kept = [f for f in flags if f not in ("--save-interval", "9")]
    more = ["--exit-interval", "15"] if nproc == 8 else []
    return layout(runs, name), runs.resume(name + "_resumed", nproc, name, 9, *kept, *more)


@pytest.mark.full  # 4 and 8 ranks
@pytest.mark.parametrize("name", RESUMED)
def test_four_and_eight_rank_layouts_stop_at_9_and_resume_bitwise(runs, name):
    straight, resumed = stop_and_resume(runs, name)
    assert resumed["iterations"][:3] == [10, 11, 12]
    assert_bitwise(resumed, straight, [10, 11, 12])


@pytest.mark.full  # 4 and 8 ranks
def test_a_save_holds_saving_ranks_times_writers_per_rank_files(runs):
    """storage_writers_per_rank (--dist-ckpt-workers 2): each of the 4 ranks of TP 2 x PP 2, every one holding shards
    of its own, writes 2 files: 8 .distcp files (and the resume from them is bitwise, above)."""
    layout(runs, "tp2_pp2")
    files = os.listdir(os.path.join(runs.ckpt("tp2_pp2"), "iter_0000009"))
    assert sorted(f for f in files if f.endswith(".distcp")) == [f"__{r}_{w}.distcp" for r in range(4) for w in range(2)]


def one_from_eight(runs):
    return runs.resume("one_from_eight", 1, "tp2_pp2_dp2", 12, *DOPT, "--exit-interval", "15")


def one_from_cp2(runs):
    return runs.resume("one_from_cp2", 1, "cp2", 12, "--exit-interval", "15")


@pytest.mark.full  # 4 and 8 ranks
def test_the_eight_rank_checkpoint_continues_on_one_rank(runs):
    """dist_checkpointing's promise: TP 2 x PP 2 x DP 2 shards of weights and distributed Adam state, read by a
    single process, continue with the 8-rank run's losses."""
    _, eight = stop_and_resume(runs, "tp2_pp2_dp2")
    assert eight["iterations"] == list(range(10, 16))
    one = one_from_eight(runs)
    assert one["iterations"] == [13, 14, 15]
    assert_same(one, eight, [13, 14, 15])


def test_the_context_parallel_checkpoint_continues_on_one_rank(runs):
    """The CP=2 run's checkpoint of 12 (each rank saved the same weights: CP ranks are replicas of the model),
    continued by one process, gives the CP run's losses from 13 to 15."""
    cp = layout(runs, "cp2")
    assert cp["iterations"] == list(range(7, 16))
    one = one_from_cp2(runs)
    assert one["iterations"] == [13, 14, 15]
    assert_same(one, cp, [13, 14, 15])


def test_memory_report_covers_the_first_two_iterations_after_a_resume(runs):
    """The memory report, with the theoretical estimate beside it, covers the first two iterations after the
    resume (the second holds the optimizer state), as Bridge's; the estimate shards Adam over the 2 ranks."""
    stdout = layout(runs, "dp2_dopt")["stdout"]
    reports = [line for line in stdout.splitlines() if "iterations) memory (GB)" in line]
    assert [line.split("(after ")[1].split(" ")[0] for line in reports] == ["7", "8"]
    assert stdout.count("Theoretical memory footprints: weight and optimizer=") == 2
    assert " 12.00 bytes per trainable parameter" in stdout  # fp32: 4 weight + 4 gradient + 8 Adam / 2 ranks


def test_megatron_engine_pieces_are_in_use(single_rank_groups):
    """What setup builds on this machine is megatron-core's own: DDP around Float16Module, the mixed-precision
    optimizer with fp32 main weights, the distributed optimizer's shards; fp16 gets megatron's loss scaler."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import DistributedOptimizer, Float16OptimizerWithFloat16Params
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler
    from megatron.core.transformer.module import Float16Module

    import config

    import checks
    from model import build_model, build_optimizer, wrap_model

    for flags, optimizer_type, dtype in ((["--bf16"], Float16OptimizerWithFloat16Params, torch.bfloat16),
                                         (["--fp16"], Float16OptimizerWithFloat16Params, torch.float16),
                                         (["--use-distributed-optimizer"], DistributedOptimizer, torch.float32)):
        cfg = checks.parse_args([*TINY, *flags], world_size=1, gpu=False)
        model = wrap_model(cfg, build_model(cfg, 100))
        assert isinstance(model[0], DistributedDataParallel)
        assert isinstance(model[0].module, Float16Module) == (dtype != torch.float32)
        assert {p.dtype for p in model[0].parameters()} == {dtype}
        optimizer = build_optimizer(cfg, model)
        inner = optimizer.chained_optimizers[0] if hasattr(optimizer, "chained_optimizers") else optimizer
        assert isinstance(inner, optimizer_type), flags
        assert isinstance(inner.grad_scaler, DynamicGradScaler) == ("--fp16" in flags)


def test_the_distributed_optimizers_layout_is_the_one_megatron_core_would_compute_and_nothing_warns(
        single_rank_groups, caplog):
    """wrap_model hands megatron-core's DDP the distributed optimizer's buffer layout, as Megatron-LM does, so DDP does
    not warn that it computes one itself; the layout is the one it would compute (one bucket, and several under
    --overlap-grad-reduce). Clearing the gradients warns nothing either."""
    import warnings

    from megatron.core.distributed import DistributedDataParallel

    import config

    import checks
    from model import build_model, build_optimizer, megatron_ddp_config, wrap_model, zero_grad

    def by_name(layout, module) -> dict:
        names = {p: n for n, p in module.named_parameters()}
        return {key: (sorted((names[p], index) for p, index in part.param_index_map.items()), part.bucket_indices,
                      part.per_bucket_numel_unpadded, part.num_optimizer_shards)
                for key, part in layout.layouts.items()}

    for flags in ([], ["--overlap-grad-reduce", "--ddp-bucket-size", "20000"]):
        cfg = checks.parse_args([*TINY, "--use-distributed-optimizer", *flags], world_size=1, gpu=False)
        caplog.clear()
        model = wrap_model(cfg, build_model(cfg, 100))
        assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
        theirs = DistributedDataParallel(config=model[0].module.config, ddp_config=megatron_ddp_config(cfg),
                                         module=build_model(cfg, 100)[0])
        assert "full_param_layout not provided" in caplog.text  # what it says when left to compute it
        ours = by_name(model[0].full_param_layout, model[0].module)
        assert ours == by_name(theirs.full_param_layout, theirs.module)
        assert (len(next(iter(ours.values()))[1]) > 1) == bool(flags)  # the bucket boundaries: [(start, end), ...]
        optimizer = build_optimizer(cfg, model)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            zero_grad(model, optimizer)
        assert not said, [str(w.message) for w in said]


def _batch_on_rank(rank: int, port: int, tp: int, cp: int, shapes) -> None:
    """One rank of a 2-rank gloo world with TP x CP = 2: the sequence length train.get_batch hands the model."""
    import os

    import train
    from megatron.core import parallel_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
        tokens = torch.arange(16).view(1, 16)
        batch = {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(1, 16), "position_ids": tokens}
        got, *_ = train.get_batch(iter([batch]))
        shapes[rank] = got[0].tolist()
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("tp, cp, expected", [
    (2, 1, [list(range(16))] * 2),  # tensor parallelism: every rank the whole sequence
    pytest.param(1, 2, [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]], marks=pytest.mark.full),  # CP: two
    # chunks each, load-balanced (the fast command: the TP=2 case, the defect's, and the CP=2 layout)
])
def test_each_rank_sees_the_sequence_its_context_parallel_group_gives_it(tp, cp, expected):
    """megatron-core 0.19's get_batch_on_this_cp_rank splits over the world when given no CP group
    (utils.py:2483): without the group train.get_batch passes, TP=2 would train each rank on half a sequence."""
    import multiprocessing

    from conftest import free_port

    with multiprocessing.get_context("spawn").Manager() as manager:
        shapes = manager.dict()
        torch.multiprocessing.spawn(_batch_on_rank, args=(free_port(), tp, cp, shapes), nprocs=2)
        assert [shapes[0], shapes[1]] == expected
