"""Mixture of Experts: megatron-core's MoELayer, its router's auxiliary losses, and expert parallelism equal to one
process, in real torchrun jobs on the CPU (device.py answers the MoE layers' CUDA calls).

The matrix: a tiny MoE GPT (4 layers, every other one an MoE layer of 4 experts with top-2 routing, a shared expert,
the load-balancing and z losses) trains 6 iterations from scratch on one rank. Every expert-parallel layout starts
from the same weights (SequentialExperts draws each expert at its global index), so each must print the one-rank
lm loss, auxiliary losses, grad norm and params norm at every iteration. Checkpoints cross expert-parallel sizes:
the weights reshard on load; the optimizer state does not (megatron-core keeps the experts a ChainedOptimizer of
their own at EP > 1 only), which is one line naming --no-load-optim."""

import os
import re

import pytest

from conftest import PRINTED, TINY, Launches, assert_bitwise, assert_same, config_error, log_lines, train_here

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "2", "--moe-aux-loss-coeff", "1e-2",
       "--moe-z-loss-coeff", "1e-3", "--moe-shared-expert-intermediate-size", "64", "--disable-bias-linear"]
FLAGS = [*TINY, "--num-layers", "4", *MOE, "--mock-data", "--global-batch-size", "8", "--train-iters", "12",
         "--exit-interval", "6", "--log-interval", "1", "--eval-iters", "0", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--num-workers", "0", "--lr-decay-style", "constant", "--log-params-norm",
         "--moe-per-layer-logging", "--log-l2-norm-grad"]
# The router's z_loss and the load-balancing loss, each averaged over the ranks (megatron-core's tracker, router.py:697
# and :596). With --moe-per-layer-logging and --log-l2-norm-grad: layer 3's (the second MoE layer's) load-balancing
# loss, the gradient norm of expert 3 (on EP rank 1 at EP=2: its norm is gathered; under PP=2 on the second stage,
# named by its layer in the whole model) and the global gradient norm.
EXPERT_3 = "l2_norm/grad/decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"
METRICS = ("lm loss", "load_balancing_loss", "z_loss", "grad-norm", "params-norm", "moe/load_balancing_loss_layer_2",
           EXPERT_3, "l2_norm/grad/global")
EP2 = ["--expert-model-parallel-size", "2"]
A2A = ["--moe-token-dispatcher-type", "alltoall"]
DOPT = ["--use-distributed-optimizer"]

LAYOUTS = {
    "ep2": (2, EP2),                                                  # the allgather dispatcher (the default)
    # Saves at 6 and runs on to 9: the EP=2 checkpoint of the crossing test below.
    "ep2_alltoall": (2, [*EP2, *A2A, "--exit-interval", "9", "--save", "CKPT", "--save-interval", "6"]),
    # Each rank holds all of its experts' Adam state; saves at 6 (dp_reshardable, the default) and runs on to 9.
    "ep2_dopt": (2, [*EP2, *A2A, *DOPT, "--exit-interval", "9", "--save", "CKPT", "--save-interval", "6"]),
    # Each stage one MoE and one dense layer. Pipeline stages draw their weights from streams of their own (as
    # Megatron-LM seeds them), so this layout continues the one-rank checkpoint of 6 (with a fresh optimizer).
    # Saves at 8 (resumed below).
    "ep2_pp2": (4, [*EP2, "--pipeline-model-parallel-size", "2", "--save", "CKPT", "--save-interval", "8"]),
    # Expert data parallelism 2: the experts' Adam state in 2 shards; saves at 6 in the fully_reshardable format.
    "ep2_dp2": (4, [*EP2, *A2A, *DOPT, "--dist-ckpt-optim-fully-reshardable", "--exit-interval", "9", "--save", "CKPT",
                    "--save-interval", "6"]),
    # Tensor parallelism with MoE needs sequence parallelism; the experts themselves are not tensor-split (ETP=1).
    # Saves at 6 and runs on to 9 (resumed below).
    "tp2_sp_ep2": (4, [*EP2, *A2A, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                       "--expert-tensor-parallel-size", "1", "--make-vocab-size-divisible-by", "64",
                       "--exit-interval", "9", "--save", "CKPT", "--save-interval", "6"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, warm_torchrun):
    """Every run of the matrix, made up front: the one-rank references, then each process count's runs in one
    torchrun job (conftest.Launches.together), then the one-rank runs that continue their checkpoints."""
    runs = Launches(tmp_path_factory.mktemp("moe"), FLAGS, METRICS, warm_torchrun)
    with runs.together():
        one_rank(runs), one_fresh(runs), one_bf16(runs)
        for nproc in (2, 4):
            for name in [name for name, (n, _) in LAYOUTS.items() if n == nproc]:
                layout(runs, name)
            if nproc == 2:
                ep2_from_one(runs), ep2_fresh_from_one(runs), ep2_resumed(runs), ep2_bf16(runs)
            for name, step in RESUMED:
                if LAYOUTS[name][0] == nproc:
                    stop_and_resume(runs, name, step)
        one_from_ep2_dp2(runs), one_from_ep2(runs)
    return runs


def one_rank(runs):
    """The reference: one rank from scratch to 12, saved at 6 by the distributed optimizer (on one rank the plain
    optimizer's arithmetic, test_engine checks) in the fully_reshardable format, which crosses EP sizes."""
    return runs("one", 1, *DOPT, "--dist-ckpt-optim-fully-reshardable", "--exit-interval", "12",
                *runs.saving("one", 6))


FRESH = ["--exit-interval", "9", "--no-load-optim"]


def one_fresh(runs):
    """The one-rank checkpoint of 6 continued to 9 with a fresh optimizer: what a run that loads it across the
    EP=1 / EP>1 line (weights only) must give."""
    one_rank(runs)
    return runs.resume("one_fresh", 1, "one", 6, *FRESH)


def layout(runs, name):
    """A layout's run: from scratch, or (pipeline stages) from the one-rank checkpoint of 6 with a fresh optimizer."""
    nproc, flags = LAYOUTS[name]
    flags = [runs.ckpt(name) if f == "CKPT" else f for f in flags]
    if "--pipeline-model-parallel-size" in flags:
        one_rank(runs)
        return runs.resume(name, nproc, "one", 6, *flags, *FRESH)
    return runs(name, nproc, *flags)


# The fast command: all-to-all at EP=2 (whose checkpoint the crossing test continues); the full proof every layout.
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.full) if name != "ep2_alltoall" else name
                                  for name in LAYOUTS])
def test_every_expert_parallel_layout_is_the_one_rank_run(runs, name):
    """The same weights at any EP size, tokens dispatched to the experts' ranks by all-gather or all-to-all, expert
    gradients reduced over the expert data-parallel group, expert parameters counted once in the params norm: the
    one-rank losses, grad norms and params norms at every iteration."""
    nproc, flags = LAYOUTS[name]
    if "--pipeline-model-parallel-size" in flags:
        reference, iterations = one_fresh(runs), [7, 8, 9]
    else:
        reference, iterations = one_rank(runs), list(range(1, 7))
    run = layout(runs, name)
    assert run["iterations"][:len(iterations)] == iterations
    assert_same(run, reference, iterations, METRICS)


# The matrix's model without its shared expert (megatron-core's has no biases: a one-line refusal), with Megatron-LM's
# default biases, which the matrix's lacks.
BIASED = [*TINY, "--num-layers", "4", *MOE[:MOE.index("--moe-shared-expert-intermediate-size")], *FLAGS[len(TINY) + 2 + len(MOE):]]
BIASED_LAYOUTS = {
    # ETP=1 at TP=2: each expert is replicated on both ranks, which see different tokens (SP); its bias gradient,
    # reduced over the expert data-parallel group (the same two ranks), was summed over TP again
    # (model.ExpertRowParallelLinear)
    "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1",
                   "--make-vocab-size-divisible-by", "64"]),
    "tp2_sp_ep2": (4, [*EP2, *A2A, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                       "--expert-tensor-parallel-size", "1", "--make-vocab-size-divisible-by", "64"]),
}


@pytest.fixture(scope="module")
def biased(tmp_path_factory, warm_torchrun):
    runs = Launches(tmp_path_factory.mktemp("moe_biased"), BIASED, METRICS, warm_torchrun)
    with runs.together():
        runs("one", 1)
        for name, (nproc, flags) in BIASED_LAYOUTS.items():
            runs(name, nproc, *flags)
    return runs


@pytest.mark.parametrize("name", [name if BIASED_LAYOUTS[name][0] == 2 else pytest.param(name, marks=pytest.mark.full)
                                  for name in BIASED_LAYOUTS])
def test_experts_with_biases_under_tensor_and_sequence_parallelism_are_the_one_rank_run(biased, name):
    """Every number of the one-rank run at every iteration, the experts' biases included: without the fix their
    gradients are doubled, and the grad norm of iteration 1 differs."""
    nproc, flags = BIASED_LAYOUTS[name]
    run, one = biased(name, nproc, *flags), biased("one", 1)
    assert run["iterations"][:6] == list(range(1, 7))
    assert_same(run, one, range(1, 7), METRICS)


def test_the_log_line_shows_megatron_lms_auxiliary_losses(runs):
    """Megatron-LM's log line: `lm loss: ... | load_balancing_loss: ... | z_loss: ... |`, averaged over the interval;
    TensorBoard holds them by iteration (no "vs samples" twin, as Megatron-LM's track_moe_metrics writes them)."""
    run = one_rank(runs)
    line = next(line for line in run["stdout"].splitlines() if " iteration        3/" in line)
    assert " | lm loss: " in line and " | load_balancing_loss: " in line and " | z_loss: " in line
    aux = float(line.split("load_balancing_loss: ")[1].split(" |")[0])
    assert aux == pytest.approx(run["load_balancing_loss"][3], rel=PRINTED)  # the log line's digits
    assert 0.9 < aux < 1.2  # near 1: the balanced value of Switch's loss for top-2 of 4 experts (coefficient left out)


# The runs that cross the EP=1 / EP>1 line (test_expert_parallel_checkpoints_cross_expert_parallel_sizes).
def ep2_from_one(runs):
    return runs.resume("ep2_from_one", 2, "one", 6, *EP2, *DOPT, "--exit-interval", "9")


def one_from_ep2_dp2(runs):
    return runs.resume("one_from_ep2_dp2", 1, "ep2_dp2", 6, *DOPT, "--exit-interval", "9")


def ep2_fresh_from_one(runs):
    return runs.resume("ep2_fresh_from_one", 2, "one", 6, *EP2, *FRESH)


def one_from_ep2(runs):
    return runs.resume("one_from_ep2", 1, "ep2_alltoall", 6, *FRESH)


def ep2_resumed(runs):
    return runs.resume("ep2_resumed", 2, "ep2_alltoall", 6, *EP2, *A2A, "--exit-interval", "9")


def test_expert_parallel_checkpoints_cross_expert_parallel_sizes(runs):
    """Checkpoints cross the EP=1 / EP>1 line, where megatron-core's optimizers regroup (one for all at EP=1, the
    experts' own beside it at EP>1): with the distributed optimizer's fully_reshardable state, Adam's moments and
    all, both ways (the one-rank checkpoint at EP=2 gives the uninterrupted one-rank run; EP=2 x DP=2's checkpoint
    on one rank gives the EP=2 x DP=2 run); the plain optimizer's weights with a fresh optimizer, both ways (the
    one-rank continuation with a fresh optimizer), its optimizer state one line naming --no-load-optim. EP=2
    resumes its own plain checkpoint bitwise. (EP=2 x DP=2's, on 4 ranks:
    test_the_expert_data_parallel_checkpoint_continues_on_one_rank.)"""
    one, reference = one_rank(runs), one_fresh(runs)
    straight = layout(runs, "ep2_alltoall")
    assert reference["iterations"] == [7, 8, 9]
    assert_same(ep2_from_one(runs), one, [7, 8, 9], METRICS)
    assert_same(ep2_fresh_from_one(runs), reference, [7, 8, 9], METRICS)
    assert_same(one_from_ep2(runs), reference, [7, 8, 9], METRICS)
    assert_bitwise(ep2_resumed(runs), straight, [7, 8, 9], METRICS)
    import checkpoint
    import config
    import checks
    import train

    cfg = checks.parse_args([*FLAGS, "--load", runs.ckpt("ep2_alltoall"), "--ckpt-step", "6", "--data-cache-path",
                             str(runs.out / "cache"), "--no-tensorboard"], world_size=1, gpu=False)
    with pytest.raises(checkpoint.CheckpointError) as e:
        train.pretrain(cfg)
    assert "saved with the experts' optimizer apart (EP 2, TP 1, expert TP 1), which megatron-core cannot load into one " \
        "optimizer for all parameters (EP 1, TP 1, expert TP 1" in str(e.value)
    assert "add --no-load-optim" in str(e.value)


RESUMED = [("ep2_dopt", 6), ("ep2_dp2", 6), ("tp2_sp_ep2", 6), ("ep2_pp2", 8)]


def stop_and_resume(runs, name, step):
    """A layout's run and its resume from its own checkpoint of `step` to 9."""
    nproc, flags = LAYOUTS[name]
    kept = [f for f in flags if f not in ("--save", "CKPT", "--save-interval", str(step))]
    return layout(runs, name), runs.resume(name + "_resumed", nproc, name, step, *kept, "--exit-interval", "9")


@pytest.mark.full  # the fast command: EP=2's own plain checkpoint resumed bitwise (the crossing test)
@pytest.mark.parametrize("name, step", RESUMED)
def test_layouts_stop_and_resume_bitwise(runs, name, step):
    """Each layout's own checkpoint, resumed: the same run bit for bit to 9. The experts' distributed Adam state in
    each format (2 ranks: dp_reshardable; 4 ranks, expert data parallelism 2: fully_reshardable), and the other
    4-rank layouts (TP=2 + SP x EP=2, EP=2 x PP=2), Adam state and all."""
    straight, resumed = stop_and_resume(runs, name, step)
    assert resumed["iterations"] == list(range(step + 1, 10))
    assert_bitwise(resumed, straight, range(step + 1, 10), METRICS)


@pytest.mark.full  # its checkpoint is TP=2 + SP x EP=2's, 4 ranks
def test_generate_splits_the_experts_or_the_matrices_and_samples_as_one_process(runs, warm_torchrun):
    """generate.py on the TP=2 + SP x EP=2 checkpoint, two seeded samples: under torchrun with
    --expert-model-parallel-size 2 (each rank holds 2 of the 4 experts, tokens dispatched all-to-all) and at TP=2
    (each rank half of each matrix, every expert whole; no sequence parallelism, which a one-token decode step cannot
    split), what one process draws."""
    import io

    import generate
    from megatron.core import parallel_state
    import torch

    layout(runs, "tp2_sp_ep2")
    args = ["--load", runs.ckpt("tp2_sp_ep2"), "--ckpt-step", "6", "--prompt", "The", "--num-samples", "2",
            "--max-new-tokens", "40", "--seed", "5"]
    ep2 = warm_torchrun([*args, "--expert-model-parallel-size", "2"], script="generate.py")
    tp2 = warm_torchrun(args, script="generate.py")
    try:
        model, tokenizer, cfg = generate.load_model(runs.ckpt("tp2_sp_ep2"), 6)
        generator = torch.Generator().manual_seed(5)
        samples = [generate.generate(model, tokenizer, tokenizer.tokenize("The"), 40, 0.8, 50, 0.95,
                                     generator=generator) for _ in range(2)]
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
    assert cfg.model.num_moe_experts == 4 and samples[0] != samples[1]
    texts = []
    for sample in samples:
        out = io.StringIO()
        stream = generate.TextStream(tokenizer, out)
        for token in sample:
            stream(token)
        texts.append("The" + out.getvalue() + "\n")
    for proc in (ep2, tp2):
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout == texts[0] + "---------------\n" + texts[1]


def one_bf16(runs):
    return runs("one_bf16", 1, "--bf16")


def ep2_bf16(runs):
    return runs("ep2_bf16", 2, "--bf16", *EP2, *A2A)


@pytest.mark.full  # the fast command: fp32 across EP sizes
def test_bf16_at_expert_parallel_size_2_is_the_one_rank_bf16_run(runs):
    """Mixed precision: bf16 weights, fp32 main weights and gradient reduction. EP=2's experts multiply other
    groupings of tokens (each expert gets both ranks' tokens at once) in bf16, so each expert output, and each
    gradient, may round to the other neighbouring bf16 value: bf16's unit roundoff, 2^-8, relative. The losses (a mean
    of positive per-token losses, each a function of its logits that does not amplify a relative change) and the
    gradient norm (a norm's relative difference is at most its elements' largest) are then within 2^-8 of one rank's,
    and the first step moves the weights as far as one rank's does."""
    one, ep2 = one_bf16(runs), ep2_bf16(runs)
    assert ep2["iterations"] == one["iterations"] == list(range(1, 7))
    # No tolerance argued from fp32 sums holds here: each step's fp32 main weights part in their last bits, their
    # bf16 copies round to neighbouring values, and that compounds; 2^-8 alone passed an update 1% too large.
    assert_same(ep2, one, range(1, 7), ["lm loss", "load_balancing_loss", "grad-norm"], rel=2 ** -8)
    # The update's scale: warm-up starts the learning rate at 0, so iteration 2's step is the first to move the
    # weights. Adam's step m/(sqrt(v)+eps) does not depend on the gradients' scale, and their bf16 roundings change it
    # by about their own relative size, 2^-8; so the params norm (of the fp32 main weights) moves by the one-rank
    # amount within 2^-8 of it, plus each norm's own sum regrouped (log2(n) x 2^-24 ~ 1e-6 relative, REORDERED's
    # figure for one sum). An update 1% too large moves it 2% farther.
    moved = [run["params-norm"][2] - run["params-norm"][1] for run in (ep2, one)]
    assert abs(moved[0] - moved[1]) <= 2 ** -8 * abs(moved[1]) + 2 * 1e-6 * one["params-norm"][1], moved


def test_a_second_moe_run_in_one_process_may_have_more_layers():
    """pretrain() twice from Python (a notebook, a sweep): megatron-core's MoE loss tracker is a module global whose
    per-layer tensors keep the first model's layer count (moe_utils.py:43); a second run with more MoE layers
    failed with an IndexError at its first step (moe_utils.py:897). Each run starts with it empty."""
    from conftest import log_lines, train_here

    for layers in ("2", "4"):
        out = train_here([*TINY, "--num-layers", layers, "--num-experts", "4", "--moe-router-topk", "2",
                          "--moe-aux-loss-coeff", "1e-2", "--mock-data", "--train-iters", "2", "--eval-iters", "0",
                          "--num-workers", "0", "--log-interval", "1"])
        assert [line[0] for line in log_lines(out)] == [1, 2] and "load_balancing_loss: " in out


def test_experts_with_biases_train_at_expert_parallel_size_1(capsys):
    """Megatron-LM's default biases, one rank: megatron-core's MLP adds each expert's bias in place to what its
    output projection returned (mlp.py:247), which at EP=1 is the reduce Function's own input, and autograd refuses
    (ExpertRowParallelLinear leaves it to the dispatcher, as at EP>1). Six iterations that learn: the loss falls."""
    import config
    import checks
    import train
    from conftest import log_lines

    cfg = checks.parse_args([*TINY, "--num-experts", "4", "--mock-data", "--train-iters", "6", "--eval-iters", "0",
                             "--num-workers", "0", "--log-interval", "1"], world_size=1, gpu=False)
    assert cfg.model.add_bias_linear
    state = train.pretrain(cfg)
    out = capsys.readouterr().out
    losses = [loss for _, _, _, loss, _, _ in log_lines(out)]
    assert state.train_state.step == 6 and len(losses) == 6
    # --moe-aux-loss-coeff 0, Megatron-LM's default: no load-balancing loss is computed, and the log line still names
    # it with 0, as Megatron-LM core_v0.19.0's does with the same flags (training.py:2761-2794: the tracker is
    # force-initialised for every name of --moe-router-load-balancing-type).
    assert out.count("| load_balancing_loss: 0.000000E+00 |") == 6
    # From the uniform guess over the 384 rows (ln 384 = 5.95) toward the mock data's structure: past warm-up (2
    # iterations) each step at lr 3e-3 takes it down by ~0.1-0.2 nats; 0.1 in all is far above float noise.
    assert losses[-1] < losses[0] - 0.1, losses


@pytest.mark.parametrize("saved, loading, expected", [
    ([], MOE, "--num-experts 0 (this run: 4)"),       # a dense checkpoint into an MoE model
    (MOE, [], "--num-experts 4 (this run: 0)"),       # and the reverse
    (MOE, [*MOE, "--moe-ffn-hidden-size", "128"], "--moe-ffn-hidden-size 256 (this run: 128)"),
])
def test_a_checkpoint_of_the_other_kind_names_both_shapes(saved, loading, expected, tmp_path):
    """What a checkpoint's `args` say against this run's model, before any weight loads: one line."""
    import checkpoint
    import config
    import checks

    (tmp_path / ".metadata").touch()  # a torch_dist checkpoint: the message names its common state
    args = vars(checkpoint.megatron_lm_args(checks.parse_args([*TINY, *saved], world_size=1, gpu=False),
                                            checkpoint.TrainState()))
    cfg = checks.parse_args([*TINY, *loading], world_size=1, gpu=False)
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.check_saved_model(cfg, str(tmp_path), {"checkpoint_version": checkpoint.CHECKPOINT_VERSION}, args,
                                     "common.pt", finetune=False)
    assert "saved by another model shape: " + expected in str(e.value)


@pytest.mark.parametrize("flags, world_size, expected", [
    (["--num-experts", "6", "--expert-model-parallel-size", "4"], 4, "--expert-model-parallel-size 4 must divide "
                                                                      "--num-experts 6"),
    (["--num-experts", "2", "--moe-router-topk", "3"], 1, "--moe-router-topk 3 routes each token to more experts"),
    (["--num-experts", "-1"], 1, "--num-experts must be positive"),
    # megatron-core's TransformerConfig's own refusals, in its words
    (["--num-experts", "1", "--moe-router-topk", "1"], 1, "Please use --moe-router-pre-softmax when topk is 1"),
    (["--num-experts", "4", "--moe-layer-freq", "([0]*2)"], 1, "makes no layer an MoE layer"),
    (["--num-experts", "4", "--moe-pad-expert-input-to-capacity"], 1,
     "moe_expert_capacity_factor must be set to use moe_pad_expert_input_to_capacity"),
    (["--num-experts", "4", "--moe-router-group-topk", "2"], 1, "moe_router_num_groups must be specified"),
    # each expert padded to 1.5 times the tokens there are (the all-to-all dispatcher's permute failed at the first step)
    (["--num-experts", "4", "--moe-router-topk", "2", "--moe-expert-capacity-factor", "3", "--moe-token-dispatcher-type",
      "alltoall", "--moe-pad-expert-input-to-capacity"], 1, "use a factor of at most 2 (--num-experts / --moe-router-topk)"),
    (["--num-experts", "4", "--moe-expert-capacity-factor", "1.0", "--moe-router-load-balancing-type", "sinkhorn",
      "--moe-router-topk", "1"], 1, "moe_expert_capacity_factor only works with aux_loss"),
    (["--expert-model-parallel-size", "2"], 2, "num_moe_experts must be non None to use expert-parallel."),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"], 2,
     "needs --sequence-parallel"),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel", "--disable-bias-linear"], 2,
     "--expert-tensor-parallel-size 2 needs a GPU"),
    (["--num-experts", "4", "--moe-grouped-gemm"], 1, "--moe-grouped-gemm is a transformer-engine kernel"),
    (["--num-experts", "4", "--moe-token-dispatcher-type", "flex"], 1, "flex is DeepEP's"),
    (["--num-experts", "4", "--moe-router-enable-expert-bias"], 1, "Please set --moe-router-score-function to 'sigmoid'"),
    (["--num-experts", "4", "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss"], 1,
     "--moe-aux-loss-coeff gives 1 values for 2"),
    (["--moe-use-upcycling"], 1, "Mixture-of-Experts machinery beyond megatron-core's MoELayer"),
    (["--num-experts", "4", "--moe-shared-expert-intermediate-size", "64"], 1, "shared experts have no biases"),
    (["--num-experts", "4", "--disable-bias-linear", "--moe-shared-expert-intermediate-size", "64",
      "--moe-shared-expert-overlap", "--moe-token-dispatcher-type", "allgather"], 1,
     "moe_shared_expert_overlap only works with alltoall or flex token dispatcher"),
])
def test_bad_moe_settings_are_one_line(flags, world_size, expected, capsys):
    assert expected in config_error([*TINY, *flags], capsys, world_size=world_size)


def test_experts_padded_to_a_capacity_of_every_token_train():
    """The largest capacity factor the check lets through with padding (--num-experts / --moe-router-topk: each expert
    padded to all of a microbatch's tokens) trains with the all-to-all dispatcher."""
    out = train_here([*TINY, "--mock-data", "--global-batch-size", "2", "--train-iters", "1", "--log-interval", "1",
                      "--eval-iters", "0", "--num-workers", "0", "--num-experts", "4", "--moe-router-topk", "2",
                      "--moe-expert-capacity-factor", "2", "--moe-token-dispatcher-type", "alltoall",
                      "--moe-pad-expert-input-to-capacity"])
    assert [it for it, *_ in log_lines(out)] == [1]


def test_bridges_moe_settings_in_yaml_are_the_flags(tmp_path):
    """A Bridge-style model section (TransformerConfig's names: num_moe_experts, moe_*, expert_*) sets what the
    flags set."""
    import config
    import checks

    (tmp_path / "moe.yaml").write_text("model:\n  num_moe_experts: 8\n  moe_router_topk: 1\n  moe_router_pre_softmax: "
                                       "true\n  expert_model_parallel_size: 2\n  moe_token_dispatcher_type: alltoall\n")
    cfg = checks.parse_args([*TINY, "--config-file", str(tmp_path / "moe.yaml")], world_size=2, gpu=False)
    m = cfg.model
    assert (m.num_moe_experts, m.moe_router_topk, m.expert_model_parallel_size, m.moe_token_dispatcher_type) == \
        (8, 1, 2, "alltoall")
    from model import transformer_config

    assert transformer_config(cfg).num_moe_experts == 8


def test_flops_count_the_routed_and_shared_experts_as_megatron_lm():
    """Megatron-LM's transformer_flops (training.py:520-530), written out: per token 3 x 2 x h x (ffn x dense layers
    + moe-ffn x top-k x MoE layers + shared x MoE layers) x (3 with SwiGLU, else 2), beside the attention and logits
    terms of a dense GPT (test_metrics checks those)."""
    import config
    import checks
    import metrics

    flags = [*TINY, "--num-layers", "4", "--hidden-size", "128", "--swiglu", "--disable-bias-linear"]
    moe = checks.parse_args([*flags, "--num-experts", "8", "--moe-router-topk", "2", "--moe-layer-freq", "2",
                             "--moe-ffn-hidden-size", "96", "--moe-shared-expert-intermediate-size", "64"],
                            world_size=1, gpu=False)
    dense = checks.parse_args(flags, world_size=1, gpu=False)
    b, s, h, ffn = 8, 64, 128, dense.model.ffn_hidden_size
    mlp = lambda width_by_layer: b * s * 3 * 2 * h * sum(width_by_layer) * 3
    difference = metrics.num_floating_point_operations(moe, b, 384) - metrics.num_floating_point_operations(dense, b, 384)
    assert difference == pytest.approx(mlp([2 * 96 + 64, 0, 2 * 96 + 64, 0]) - mlp([ffn, 0, ffn, 0]), rel=1e-12)


def test_memory_estimate_counts_the_built_moe_model_and_shards_experts_over_ep(single_rank_groups):
    """The estimate's parameters are megatron-core's MoE GPT's (no biases, no position table); at EP=2 the experts'
    share of the most loaded shard halves, and the distributed optimizer shards their Adam state over the expert
    data-parallel ranks, the rest over the data-parallel ranks."""
    import config
    import checks
    import metrics
    from model import build_model

    flags = [*TINY, "--num-layers", "4", *MOE, "--position-embedding-type", "rope", "--hidden-size", "128"]
    cfg = checks.parse_args(flags, world_size=1, gpu=False)
    cfg.padded_vocab_size = 384
    model = build_model(cfg, 384)
    n = sum(p.numel() for p in model[0].parameters())
    experts = sum(p.numel() for name, p in model[0].named_parameters() if ".experts." in name)
    assert metrics.compute_weight_and_optimizer_memory(cfg) == pytest.approx(16 * n)
    ep2 = checks.parse_args([*flags, *EP2, *DOPT, "--bf16"], world_size=8, gpu=False)  # DP 8, expert DP 4
    ep2.padded_vocab_size = 384
    assert metrics.compute_weight_and_optimizer_memory(ep2) == pytest.approx(
        (n - experts) * (6 + 12 / 8) + experts / 2 * (6 + 12 / 4))


@pytest.mark.full  # the fast command: fp32 across EP sizes
def test_fp16_loss_scale_crosses_expert_parallel_sizes(runs):
    """The fp16 loss scaler's state (scale, growth tracker, hysteresis) is part of the optimizer state that regroups
    across the EP=1 / EP>1 line: a one-rank --fp16 run saved at 6 and resumed at EP=2 prints the one-rank run's loss
    scale and skipped-iteration count at 7-9 (without it the scale restarts at --initial-loss-scale, 2^32, and the
    next iterations are skipped again)."""
    fp16 = ["--fp16", *DOPT, "--dist-ckpt-optim-fully-reshardable", "--exit-interval", "9"]
    straight = runs("one_fp16", 1, *fp16, *runs.saving("one_fp16", 6))
    resumed = runs.resume("ep2_fp16_from_one", 2, "one_fp16", 6, *EP2, *fp16)
    scale = re.compile(r"iteration +(\d+)/.*? loss scale: ([\d.]+) \|.*?number of skipped iterations: +(\d+)")
    first = {int(it): (s, skipped) for it, s, skipped in scale.findall(straight["stdout"])}
    second = {int(it): (s, skipped) for it, s, skipped in scale.findall(resumed["stdout"])}
    assert sorted(second) == [7, 8, 9]
    assert float(first[6][0]) < 2.0 ** 32  # the scale came down from its start: a restart would show
    assert [second[it] for it in (7, 8, 9)] == [first[it] for it in (7, 8, 9)]


@pytest.mark.full  # 4 ranks
def test_the_expert_data_parallel_checkpoint_continues_on_one_rank(runs):
    """EP=2 x DP=2's fully_reshardable checkpoint (the experts' Adam state in 2 shards) on one rank gives the EP=2 x
    DP=2 run (the crossing of the test above, from 4 ranks)."""
    four = layout(runs, "ep2_dp2")
    assert_same(one_from_ep2_dp2(runs), four, [7, 8, 9], METRICS)


# --ckpt-format torch: Megatron-LM's files, one per tensor, pipeline and expert rank, under each layout it can save.
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1",
          "--make-vocab-size-divisible-by", "64"]
PP2 = ["--pipeline-model-parallel-size", "2"]
TORCH_LAYOUTS = {  # (ranks, flags, the files of a checkpoint: mp_rank_TT, then _PPP with PP > 1, then _EEE with EP > 1)
    "ep2": (2, EP2, ["mp_rank_00_000", "mp_rank_00_001"]),
    "tp2_sp": (2, TP2_SP, ["mp_rank_00", "mp_rank_01"]),
    "pp2": (2, PP2, ["mp_rank_00_000", "mp_rank_00_001"]),
    # tensor rank 0 holds expert rank 0's experts, tensor rank 1 expert rank 1's; ranks 2-3 are their replicas
    "tp2_sp_ep2": (4, [*TP2_SP, *EP2], ["mp_rank_00_000", "mp_rank_01_001"]),
    "ep2_pp2": (4, [*EP2, *PP2], ["mp_rank_00_000_000", "mp_rank_00_000_001", "mp_rank_00_001_000", "mp_rank_00_001_001"]),
}


def torch_format(runs, name):
    """A layout from scratch to 4 saving at 2 in the torch format, and its resume from that checkpoint."""
    nproc, flags, _ = TORCH_LAYOUTS[name]
    return (runs(name, nproc, *flags, *runs.saving(name, 2)),
            runs.resume(name + "_resumed", nproc, name, 2, *flags))


@pytest.fixture(scope="module")
def torch_runs(tmp_path_factory, warm_torchrun):
    runs = Launches(tmp_path_factory.mktemp("moe_torch"), [*FLAGS, "--ckpt-format", "torch", "--exit-interval", "4"],
                    METRICS[:3], warm_torchrun)
    with runs.together():
        for nproc in (2, 4):
            for name in [name for name, (n, _, _) in TORCH_LAYOUTS.items() if n == nproc]:
                torch_format(runs, name)
    return runs


# The fast command: EP=2's files; the full proof every layout's.
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.full) if name != "ep2" else name
                                  for name in TORCH_LAYOUTS])
def test_the_torch_format_saves_every_layout_as_megatron_lm_and_resumes_bitwise(torch_runs, name):
    """Each rank's file named and written as Megatron-LM names and writes it (checkpointing.py:224-239, 733-741): at
    EP=2 each expert rank's experts and their Adam state are in a file of their own (they were in none: rank 1's were
    lost and on resume rank 1 took rank 0's). Resumed from 2, the run is the straight run bit for bit."""
    straight, resumed = torch_format(torch_runs, name)
    assert resumed["iterations"] == [3, 4]
    assert_bitwise(resumed, straight, [3, 4], METRICS[:3])
    saved = torch_runs.ckpt(name) + "/iter_0000002"
    assert sorted(n for n in os.listdir(saved) if n.startswith("mp_rank_")) == TORCH_LAYOUTS[name][2]


@pytest.mark.parametrize("name, saved", [
    ("ep2", "TP 1, PP 1, EP 2, expert TP 1"),  # this rank's file (mp_rank_00) is not there: another's names the sizes
    pytest.param("tp2_sp", "TP 2, PP 1, EP 1, expert TP 1", marks=pytest.mark.full),  # it is there, tensor rank 0's
    # shards of a TP=2 model
])
def test_a_torch_format_checkpoint_at_other_parallel_sizes_is_one_line(torch_runs, name, saved):
    """One rank loading a 2-rank torch-format checkpoint: one line naming both layouts, before any weight."""
    import checkpoint
    import config
    import checks
    import train

    torch_format(torch_runs, name)
    cfg = checks.parse_args([*FLAGS, "--ckpt-format", "torch", "--load", torch_runs.ckpt(name), "--ckpt-step", "2",
                             "--data-cache-path", str(torch_runs.out / "cache"), "--no-tensorboard"],
                            world_size=1, gpu=False)
    with pytest.raises(checkpoint.CheckpointError) as e:
        train.pretrain(cfg)
    assert f"saved in the torch format at {saved}, and this run has TP 1, PP 1, EP 1, expert TP 1; pass the saving " \
        "run's sizes" in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_layout_the_torch_format_cannot_name_is_one_line(capsys):
    """Experts split over more tensor-parallel ranks than the dense layers (a GPU layout): the files' names
    (tensor, pipeline, expert rank) cannot tell the expert shards apart, and Megatron-LM would write two into one."""
    assert "--expert-tensor-parallel-size 2 splits the experts over ranks those names do not tell apart" in config_error(
        [*FLAGS, "--ckpt-format", "torch", "--expert-tensor-parallel-size", "2"], capsys, world_size=2, gpu=True)
