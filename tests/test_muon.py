"""Muon and the other emerging optimizers, through megatron-core's own path (optimizer/emerging_optimizers.py, the
`emerging-optimizers` package) on the CPU: megatron-core chains the orthogonalized optimizer of the 2-D weights
with Adam for the rest, and says which is which; under tensor parallelism the duplicated and distributed modes give
the one-process run; a checkpoint resumes bit for bit, at its own layout and at another."""

import re

import pytest

from conftest import (REORDERED, TINY, ContinuedLayouts, Launches, assert_bitwise, assert_same, config_error, log_lines,
                      train_here)
from test_mtp import V3

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


def adaptive(runs, mode=None):
    """--optimizer adaptive_muon on one rank, or at TP=2 in --muon-tp-mode `mode`."""
    if mode is None:
        return runs("adaptive_one", 1, "--optimizer", "adaptive_muon")
    return runs(f"adaptive_tp2_{mode}", 2, *TP2, "--optimizer", "adaptive_muon", "--muon-tp-mode", mode,
                *runs.saving(f"adaptive_tp2_{mode}", 3))


def adaptive_resumed(runs):
    return runs.resume("adaptive_tp2_duplicated_resumed", 2, "adaptive_tp2_duplicated", 3, *TP2, "--optimizer",
                       "adaptive_muon", "--muon-tp-mode", "duplicated")


# megatron-core builds its layer-wise distributed optimizer for bf16 only (config.py says so). Without gradient
# clipping: its coefficient (megatron-core's clip_grads.py:179) divides by the gradient norm, whose sum of squares the
# layer-wise optimizer groups by rank (layer_wise_optimizer.py:807-813), so a last-bit difference in it rescales
# every gradient, the fp32 main weights part in their last bits, and a bf16 copy rounds to its neighbour (2^-8
# relative), which compounds: no tolerance argued from the sums holds, and 2^-8 passed an update 0.5% too large.
DP2_BF16 = ["--bf16", "--clip-grad", "0"]


def dp2(runs, *flags, name="dp2_bf16"):
    """Muon at DP=2 in bf16: plainly, or with `flags` (the distributed optimizer, saving at 3)."""
    return runs(name, 2, *DP2_BF16, *flags)


def layer_wise(runs):
    return dp2(runs, "--use-distributed-optimizer", *runs.saving("dp2_layer_wise", 3), name="dp2_layer_wise")


def layer_wise_resumed(runs):
    return runs.resume("dp2_layer_wise_resumed", 2, "dp2_layer_wise", 3, *DP2_BF16, "--use-distributed-optimizer")


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
        adaptive(runs)
        for mode in [*TP_MODES, "blockwise"]:
            tp2(runs, mode)
        for mode in TP_MODES:
            adaptive(runs, mode)
        adaptive_resumed(runs)
        dp2(runs)
        layer_wise(runs)
        layer_wise_resumed(runs)
        dp2(runs, "--optimizer", "dist_muon", name="dp2_dist_muon")
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


@pytest.mark.parametrize("mode", [TP_MODES[0], pytest.param(TP_MODES[1], marks=pytest.mark.full)])
def test_tensor_parallel_muon_gathers_or_distributes_to_the_one_process_update(runs, mode):
    """--muon-tp-mode duplicated (each rank orthogonalizes the gathered matrix) and distributed (the Newton-Schulz
    iteration's products summed over the ranks) compute the one-process update: the same lm loss and grad norm at
    every iteration, within REORDERED (fp32 Newton-Schulz, --muon-fp32-matmul-prec high)."""
    # REORDERED's argument: the same fp32 arithmetic with its sums grouped otherwise (a gathered matrix; the Gram
    # products of 5 Newton-Schulz steps summed over 2 ranks, each of <= 256 terms, log2(256) x 2^-24 = 5e-7 a sum),
    # over 6 iterations: within 2e-5.
    assert_same(tp2(runs, mode), one(runs), range(1, 7), METRICS, rel=REORDERED)


@pytest.mark.full  # the fast command: Muon at TP=2 duplicated, resumed, layer-wise at DP=2
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


@pytest.mark.parametrize("method", ["adamuon", "normuon", "namo"])
def test_adaptive_muon_is_emerging_optimizers_own_on_one_device(method):
    """--optimizer adaptive_muon builds megatron-core's TensorParallelAdaptiveMuon, which fails at its first step with
    emerging-optimizers 0.3.0 (no scale_mode; and its orthogonalization scales before the second moment, where
    AdaptiveMuon scales after it). As train.py builds it (model.megatron_cores_adaptive_muon_mended, what
    get_megatron_optimizer runs inside) it takes the package's own one-device AdaptiveMuon's steps on a matrix,
    for each second-moment method: the same arithmetic in the same order, so bit for bit."""
    import torch
    from emerging_optimizers.orthogonalized_optimizers import AdaptiveMuon
    from megatron.core.optimizer.emerging_optimizers import _EMERGING_OPTIMIZERS

    import model

    torch.manual_seed(0)
    start, grads = torch.randn(48, 16), [torch.randn(48, 16) for _ in range(3)]
    settings = dict(lr=1e-2, momentum=0.9, weight_decay=0.01, nesterov=True, fp32_matmul_prec="high",
                    coefficient_type="quintic", num_ns_steps=5, scale_mode="spectral", extra_scale_factor=0.5,
                    moment2_method=method, beta2=0.95, eps=1e-8)
    with model.megatron_cores_adaptive_muon_mended():
        ours = _EMERGING_OPTIMIZERS["adaptive_muon"].optimizer_cls
    weights = {}
    for name, cls, extra in (("ours", ours, dict(use_decoupled_weight_decay=True, tp_mode="duplicated")),
                             ("theirs", AdaptiveMuon, dict(weight_decay_method="decoupled"))):
        w = torch.nn.Parameter(start.clone())
        opt = cls([w], **settings, **extra)
        for g in grads:
            w.grad = g.clone()
            opt.step()
        weights[name] = w.detach()
    assert not torch.equal(weights["ours"], start)
    assert torch.equal(weights["ours"], weights["theirs"])


@pytest.mark.full  # the fast command: Muon at TP=2 duplicated, resumed, layer-wise at DP=2
def test_adaptive_muon_learns_and_tensor_parallel_gives_the_one_process_update(runs):
    """The run: the loss falls, TP=2 in --muon-tp-mode duplicated and distributed gives the one-process run (the
    Newton-Schulz of the whole matrix as Muon's, and Muon's scale by the whole matrix's shape: a shard's shape would
    scale linear_fc1 by sqrt(128) instead of sqrt(256)), and a TP=2 run resumes bit for bit."""
    reference = adaptive(runs)
    assert " > TensorParallelAdaptiveMuon updates 9 tensors" in reference["stdout"]
    losses = [loss for _, _, _, loss, _, _ in log_lines(reference["stdout"])]
    # 5.97 at the first step; 0.05 is far above any machine's rounding (REORDERED of it is 1e-4)
    assert losses[-1] < losses[0] - 0.05, losses
    for mode in TP_MODES:
        # REORDERED, as Muon's TP test above: the second moment's division is elementwise and adds no sum.
        assert_same(adaptive(runs, mode), reference, range(1, 7), METRICS, rel=REORDERED)
    # Its momentum and second moment are in the checkpoint: the TP=2 run resumed at 3 is the same run, bit for bit.
    resumed = adaptive_resumed(runs)
    assert resumed["iterations"] == [4, 5, 6]
    assert_bitwise(resumed, adaptive(runs, "duplicated"), [4, 5, 6], METRICS)


def test_muons_distributed_optimizer_is_megatron_cores_layer_wise_one(runs):
    """--use-distributed-optimizer with Muon (or Megatron-LM's deprecated --optimizer dist_muon, the same run bit for
    bit) is megatron-core's LayerWiseDistributedOptimizer, as Megatron-LM 0.19 builds it: each data-parallel rank
    updates whole matrices and the ranks gather them, and megatron-core's distributed optimizer shards Adam's part. It
    gives the plain DP=2 run's figures and resumes bit for bit."""
    plain, sharded = dp2(runs), layer_wise(runs)
    said = [line for line in sharded["stdout"].splitlines() if " updates " in line]
    assert said[0].startswith(" > TensorParallelMuon updates ") and said[1].startswith(" > AdamW updates ")
    assert all("sharded over the data-parallel ranks" in line for line in said), said
    # The same arithmetic: at DP=2 the all-reduce and the reduce-scatter each add the same two addends (the gradient
    # bits are the same), each matrix's Muon step runs whole on one rank as on each rank of the plain run, and Adam's
    # step is elementwise on a shard as on the whole tensor; so the losses are the same bit for bit. The gradient
    # norm is printed from the same gradients, its sum of squares grouped by rank: REORDERED.
    assert_bitwise(sharded, plain, range(1, 7), ["lm loss"])
    assert_same(sharded, plain, range(1, 7), ["grad-norm"], rel=REORDERED)
    resumed = layer_wise_resumed(runs)
    assert resumed["iterations"] == [4, 5, 6]
    assert_bitwise(resumed, sharded, [4, 5, 6], METRICS)
    dist_muon = dp2(runs, "--optimizer", "dist_muon", name="dp2_dist_muon")
    assert "derived: optimizer.use_distributed_optimizer = True (--optimizer dist_muon)" in dist_muon["stdout"]
    assert_bitwise(dist_muon, sharded, range(1, 7), METRICS)


# Kimi K2's recipe, shrunk: DeepSeek-V3's block (test_mtp's V3: multi-latent attention, MoE from the second layer with
# DeepSeek-V3's router and a shared expert, one MTP layer) trained with Muon.
V3_FLAGS = [*V3, *FLAGS[len(TINY):]]
V3_METRICS = ("lm loss", "mtp_1 loss", "seq_load_balancing_loss", "grad-norm")
# MoE under tensor parallelism needs sequence parallelism, and experts whole on each rank (as test_mtp's layouts)
TP2_SP = [*TP2, "--sequence-parallel", "--expert-tensor-parallel-size", "1"]


@pytest.fixture(scope="module")
def v3(tmp_path_factory, warm_torchrun):
    """One rank saving at iteration 3, then, from its weights with a fresh optimizer (--no-load-optim: megatron-core
    gives the experts an optimizer of their own under tensor or expert parallelism, and cannot load one rank's state
    there), one rank again, TP=2 under each exact --muon-tp-mode and EP=2. The duplicated TP=2 run also saves at 5;
    a TP=2 run resumes that, and EP=2 continues it (the momentum resharded)."""
    out = tmp_path_factory.mktemp("muon_v3")
    layouts = {"one_fresh": []}
    layouts.update({f"tp2_sp_{mode}": [*TP2_SP, "--muon-tp-mode", mode] for mode in TP_MODES})
    layouts["tp2_sp_duplicated"] += ["--save", str(out / "tp2_sp_duplicated" / "ckpt"), "--save-interval", "5"]
    layouts["ep2"] = ["--expert-model-parallel-size", "2"]
    layouts = {name: [*flags, "--no-load-optim"] for name, flags in layouts.items()}
    runs = ContinuedLayouts(out, V3_FLAGS, V3_METRICS, warm_torchrun, layouts, nproc={"one_fresh": 1})
    with runs.together():
        tp2_sp_resumed(runs), ep2_from_tp2(runs)
    return runs


def tp2_sp_resumed(runs):
    return runs.resume("tp2_sp_resumed", 2, "tp2_sp_duplicated", 5, *TP2_SP, "--muon-tp-mode", "duplicated")


def ep2_from_tp2(runs):
    return runs.resume("ep2_from_tp2", 2, "tp2_sp_duplicated", 5, "--expert-model-parallel-size", "2")


@pytest.mark.full  # the fast command: Muon at TP=2 duplicated, resumed, layer-wise at DP=2
def test_deepseek_v3_with_muon_updates_its_latent_projections_experts_and_mtp_layer_with_muon(v3):
    """megatron-core's choice on DeepSeek-V3's block: every 2-D weight but the embedding and the output layer, the
    latent attention's down- and up-projections, the experts, the router and the MTP layer's projection included;
    the norms go to Adam. Both losses fall."""
    run = v3.one()
    said = [line for line in run["stdout"].splitlines() if " updates " in line]
    muon = said[0].split(": ", 1)[1].split(", ")
    for name in ("decoder.layers.*.self_attention.linear_q_down_proj.weight",
                 "decoder.layers.*.self_attention.linear_kv_up_proj.weight",
                 "decoder.layers.*.mlp.experts.local_experts.*.linear_fc1.weight",
                 "decoder.layers.*.mlp.shared_experts.linear_fc2.weight", "decoder.layers.*.mlp.router.weight",
                 "mtp.layers.*.eh_proj.weight"):
        assert name in muon, name
    adam = said[1].split(": ", 1)[1].split(", ")
    assert "embedding.word_embeddings.weight" in adam and "mtp.layers.*.enorm.weight" in adam
    lm = [run["lm loss"][it] for it in range(1, 4)] + [v3.layout("one_fresh")["lm loss"][it] for it in range(4, 7)]
    mtp = [run["mtp_1 loss"][it] for it in range(1, 4)] + [v3.layout("one_fresh")["mtp_1 loss"][it] for it in range(4, 7)]
    # From ln 384 = 5.95 (the uniform guess): Muon takes the lm loss down by ~0.9 in 6 steps, the MTP loss by ~0.4
    assert lm[-1] < lm[0] - 0.2 and mtp[-1] < mtp[0] - 0.2, (lm, mtp)


@pytest.mark.full  # the fast command: Muon at TP=2 duplicated, resumed, layer-wise at DP=2
@pytest.mark.parametrize("name", ["tp2_sp_duplicated", "tp2_sp_distributed", "ep2"])
def test_deepseek_v3_with_muon_on_two_ranks_is_the_one_process_run(v3, name):
    """TP=2 with sequence parallelism under each --muon-tp-mode that computes the one-process update, and EP=2 (two
    experts a rank, each orthogonalized whole), from the one-rank checkpoint's weights: the one-process losses at
    iterations 4-6 and grad norm at 4 (REORDERED, as test_mtp's layouts: after the first step, the smallest
    gradients' reordered rounding moves the updates)."""
    run, one_rank = v3.layout(name), v3.layout("one_fresh")
    assert run["iterations"] == [4, 5, 6]
    assert_same(run, one_rank, range(4, 7), V3_METRICS[:3], rel=REORDERED)
    assert_same(run, one_rank, [4], ["grad-norm"], rel=REORDERED)


@pytest.mark.full  # the fast command: Muon at TP=2 duplicated, resumed, layer-wise at DP=2
def test_deepseek_v3_with_muon_resumes_bitwise_and_its_momentum_crosses_to_expert_parallelism(v3):
    """TP=2 stopped at 5 and resumed: iteration 6 is the straight run's, bit for bit (momentum and expert bias in the
    checkpoint); EP=2 continuing the same checkpoint, the dense momentum gathered from its TP shards and the experts'
    split over the EP ranks, gives the TP=2 run's iteration 6 (REORDERED)."""
    straight = v3.layout("tp2_sp_duplicated")
    resumed = tp2_sp_resumed(v3)
    assert resumed["iterations"] == [6]
    assert_bitwise(resumed, straight, [6], V3_METRICS)
    assert_same(ep2_from_tp2(v3), straight, [6], V3_METRICS, rel=REORDERED)


def test_a_layer_wise_optimizer_state_on_another_data_parallel_size_is_one_line(runs, tmp_path):
    """megatron-core's layer-wise distributed optimizer keeps each rank's whole matrices for the data-parallel size
    that saved them: one rank loading the DP=2 checkpoint's optimizer is one line naming --no-load-optim (it was a
    KeyError from inside megatron-core's load, "the checkpoint is corrupt"), and with it the weights continue."""
    import checkpoint
    import config
    import checks
    import train

    layer_wise(runs)
    flags = [*FLAGS, *DP2_BF16, "--load", runs.ckpt("dp2_layer_wise"), "--ckpt-step", "3", "--no-save"]
    with pytest.raises(checkpoint.CheckpointError) as e:
        train.pretrain(checks.parse_args(flags, world_size=1, gpu=False))
    assert "its optimizer state was saved by megatron-core's layer-wise distributed optimizer at data-parallel size " \
           "2, and this run has another optimizer at 1" in str(e.value) and "--no-load-optim" in str(e.value)
    out = train_here([*flags, "--no-load-optim"])
    assert [it for it, *_ in log_lines(out)] == [4, 5, 6]


@pytest.mark.full  # the fast command: Muon at TP=2 duplicated, resumed, layer-wise at DP=2
def test_a_tensor_parallel_moe_checkpoints_optimizer_on_one_rank_is_one_line(v3, tmp_path):
    """At TP=2 with expert TP 1 megatron-core sets the experts' optimizer apart (their layers use the expert groups:
    tensor_parallel/layers.py:961-964), at one rank it does not, and it cannot load the one into the other: one line
    before any state is read, naming --no-load-optim (the one-rank run with it is test_muon's "one_fresh")."""
    import checkpoint
    import config
    import checks
    import train

    cfg = checks.parse_args([*V3_FLAGS, "--load", v3.ckpt("tp2_sp_duplicated"), "--ckpt-step", "5", "--no-tensorboard",
                             "--data-cache-path", str(tmp_path)], world_size=1, gpu=False)
    with pytest.raises(checkpoint.CheckpointError) as e:
        train.pretrain(cfg)
    assert "saved with the experts' optimizer apart (EP 1, TP 2, expert TP 1), which megatron-core cannot load into " \
           "one optimizer for all parameters (EP 1, TP 1, expert TP 1" in str(e.value) and "--no-load-optim" in str(e.value)


LAYER_WISE = [*FLAGS, *DP2_BF16, "--use-distributed-optimizer"]


@pytest.mark.parametrize("flags, buckets", [
    (["--ddp-bucket-size", "20000"], [1, 1]),  # no --overlap-grad-reduce: one bucket, whatever the size
    (["--overlap-grad-reduce", "--ddp-bucket-size", "20000"], [1, 4]),  # 102,400 matrix parameters in 20,000s
    (["--overlap-grad-reduce", "--hidden-size", "1024", "--num-layers", "4"], [1, 2]),  # 50.4M in 40M and the rest
], ids=["no_overlap", "overlap_20000", "overlap_default_40M"])
def test_the_layer_wise_optimizers_buckets_are_sized_as_megatron_lm_sizes_them(single_rank_groups, flags, buckets):
    """The layer-wise optimizer's DDP layout fixes the gradient buckets, so it takes the bucket size Megatron-LM
    resolves (training.py:1552-1567): --ddp-bucket-size, or at least 40M parameters, with --overlap-grad-reduce, and
    none without. Buckets of megatron-core's DDP on one rank: [Adam's buffer, Muon's matrices]."""
    import config
    import checks
    from model import build_model, set_random_seed, wrap_model

    cfg = checks.parse_args([*LAYER_WISE, *flags], world_size=1, gpu=False)
    set_random_seed(0)
    model = wrap_model(cfg, build_model(cfg, vocab_size=128))
    assert [len(b.buckets) for b in model[0].buffers] == buckets


@pytest.mark.full  # the fast command: Muon at TP=2 duplicated, resumed, layer-wise at DP=2
def test_the_layer_wise_optimizer_buckets_the_first_chunk_of_the_first_stage_only(tmp_path):
    """Pipeline stages after the first, and the model chunks after the first, reduce their gradients in one bucket
    (Megatron-LM's training.py:1857-1866): PP=2 with two virtual stages a rank, overlapped 20,000-parameter buckets.
    (Untied embeddings: tied ones would put the shared embedding in a bucket of its own on both stages.)"""
    import json

    from conftest import torchrun

    proc = torchrun([str(tmp_path), *LAYER_WISE, "--num-layers", "4", "--pipeline-model-parallel-size", "2",
                     "--num-layers-per-virtual-pipeline-stage", "1", "--overlap-grad-reduce", "--ddp-bucket-size",
                     "20000", "--untie-embeddings-and-output-weights", "--data-cache-path", str(tmp_path / "cache")],
                    script="tests/scripts/ddp_buckets.py")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # each rank: [chunk 0's buffers' bucket counts, chunk 1's]; a buffer is Adam's, then Muon's matrices
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)] == [[[1, 2], [1, 1]], [[1, 1], [1, 1]]]


def test_lion_and_soap_train_through_the_same_path():
    """The other emerging optimizers megatron-core builds from the package: the loss falls over 6 steps."""
    for name in ("lion", "soap"):
        out = train_here([*FLAGS, "--optimizer", name])
        assert re.search(rf" > {'Lion' if name == 'lion' else 'SOAP'} updates 9 tensors", out), name
        losses = [loss for _, _, _, loss, _, _ in log_lines(out)]
        assert losses[-1] < losses[0] - 0.1, (name, losses)


@pytest.mark.parametrize("flags, expected", [
    (["--optimizer", "muon", "--use-distributed-optimizer"], "--optimizer muon with --use-distributed-optimizer: "
     "megatron-core 0.19.2's layer-wise distributed optimizer is built for bf16 only; add --bf16"),
    (["--optimizer", "dist_muon"], "--optimizer muon with --use-distributed-optimizer: megatron-core 0.19.2's "
     "layer-wise distributed optimizer is built for bf16 only"),
    (["--optimizer", "muon", "--use-distributed-optimizer", "--bf16", "--num-experts", "2"], "does not shard the "
     "experts' biases beside the layer-wise optimizer"),
    (["--optimizer", "muon", "--use-distributed-optimizer", "--bf16", "--overlap-param-gather"], "the layer-wise "
     "optimizer's overlapped gather is not built here"),
    (["--optimizer", "muon", "--fp16"], "--optimizer muon with --fp16: megatron-core's emerging optimizers do not "
                                        "support fp16"),
    (["--optimizer", "muon", "--muon-tp-mode", "sideways"], "invalid choice: 'sideways'"),
])
def test_what_muon_refuses_is_one_line(flags, expected, capsys):
    assert expected in config_error([*TINY, *flags], capsys)


def test_an_optimizer_the_installed_package_lacks_is_one_line_before_any_model(tmp_path, monkeypatch, capsys):
    """megatron-core builds what the installed emerging-optimizers registers: an older package without Lion (here, the
    registry without its entry) is one line through train.py's command line, exit 2, before any model is built."""
    import config
    import checks
    import train
    from megatron.core.optimizer.emerging_optimizers import _EMERGING_OPTIMIZERS

    monkeypatch.delitem(_EMERGING_OPTIMIZERS, "lion")
    cfg = checks.parse_args([*FLAGS, "--optimizer", "lion", "--save", str(tmp_path / "ck")], world_size=1, gpu=False)
    assert train.main(cfg) == 2
    out, err = capsys.readouterr()
    assert err.startswith("train.py: error: --optimizer lion: the installed emerging-optimizers 0.3.0 does not "
                          "provide it to megatron-core (it has: ") and err.count("\n") == 1, err
    assert "number of parameters" not in out and not (tmp_path / "ck").exists()


def test_muon_without_the_package_names_it(capsys, monkeypatch):
    """Where emerging-optimizers is not installed (it is here, in requirements.txt), one line says what to install."""
    import importlib.util

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "emerging_optimizers"
                        else found(name, *a))
    assert "pip install emerging-optimizers" in config_error([*TINY, "--optimizer", "muon"], capsys)
