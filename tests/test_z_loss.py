"""docs/fork.md's "A loss term of your own on the logits": --z-loss-coeff, through megatron-core's
compute_language_model_loss (model.GPTModelWithZLoss). Its value is the formula on the whole vocabulary's logits; at
TP=2 (the vocabulary split between the ranks) and PP=2 it and the gradients are one process's; it is reported like the
lm loss and resumes with the run; at 0 the model is megatron-core's GPTModel as it is."""

import pytest
import torch

from conftest import REORDERED, TINY, ContinuedLayouts, assert_same, config_error, log_lines

COEFF = "0.05"
FLAGS = [*TINY, "--mock-data", "--global-batch-size", "4", "--train-iters", "6", "--log-interval", "1",
         "--eval-interval", "6", "--eval-iters", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--num-workers", "0", "--z-loss-coeff", COEFF]
METRICS = ("lm loss", "z loss", "grad-norm")
LAYOUTS = {
    # the output layer's 256-entry padded vocabulary split in two halves, one per rank: the trap
    "tp2": ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"],
    "tp2_sp": ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, warm_torchrun):
    """One rank saving at iteration 3, then each two-rank layout continuing it (conftest.ContinuedLayouts)."""
    return ContinuedLayouts(tmp_path_factory.mktemp("z_loss"), FLAGS, METRICS, warm_torchrun, LAYOUTS)


def _model(*flags):
    import checks
    import model

    cfg = checks.parse_args([*FLAGS, *flags], world_size=1, gpu=False)
    model.set_random_seed(cfg.rng.seed)
    return model.build_model(cfg, 200)[0]


def test_the_z_loss_is_the_coefficient_times_the_squared_logsumexp_of_the_logits(single_rank_groups):
    """Per token, the model returns [cross-entropy, coeff x logsumexp(logits)^2]: the second against torch's own
    logsumexp of the same weights' logits (the model's output without labels), the first megatron-core's GPTModel's
    loss bitwise; and the gradient is the formula's. Tolerance: each side sums the V = 256 exponentials of a token in
    its own order, log2(256) x 2^-24 = 5e-7 relative to the sum each, so at most 1e-6 absolute on its log of ~5.5,
    doubled by the square: 1e-6 relative. The gradients: the same two computations, backward through the same output
    layer (REORDERED's reasoning for sums of this model's size)."""
    from megatron.core.models.gpt import GPTModel

    import model

    zl, plain = _model(), _model("--z-loss-coeff", "0")
    assert type(zl) is model.GPTModelWithZLoss and type(plain) is GPTModel
    plain.load_state_dict(zl.state_dict())
    tokens = torch.randint(0, 200, (2, 64), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(64).expand(2, 64)
    per_token = zl(tokens, positions, None, labels=tokens)
    assert per_token.shape == (2, 64, 2)
    assert torch.equal(per_token[..., 0], plain(tokens, positions, None, labels=tokens))

    per_token[..., 1].sum().backward()
    ours = [p.grad.clone() for p in zl.parameters()]
    zl.zero_grad()
    logits = zl(tokens, positions, None)
    direct = float(COEFF) * torch.logsumexp(logits.float(), dim=-1).square()
    assert per_token[..., 1].detach() == pytest.approx(direct.detach(), rel=1e-6)
    direct.sum().backward()
    for mine, theirs in zip(ours, (p.grad for p in zl.parameters())):
        # abs: a gradient entry that cancels to ~0 keeps the rounding of its terms (2^-24 of ~1), not of itself
        assert mine == pytest.approx(theirs, rel=REORDERED, abs=1e-7)


def test_the_z_loss_is_added_to_the_loss_and_reported_like_the_lm_loss(runs):
    """On the log line after the lm loss, in the validation block, and in TensorBoard as "z loss" (per iteration, a
    token-weighted mean like the lm loss); and it moves training: the first step that updates the weights differs
    from the run without it."""
    run = runs.one()
    assert len(log_lines(run["stdout"])) == 6 and "| lm loss: " in run["stdout"]
    assert all(" | z loss: " in line for line in run["stdout"].splitlines() if "| lm loss: " in line)
    assert " z loss value: " in run["stdout"]
    assert sorted(run["z loss"]) == list(range(1, 7)) and 0 < run["z loss"][1] < 10
    without = runs("no_z_loss", 1, "--z-loss-coeff", "0")
    assert without["z loss"] == {} and " z loss" not in without["stdout"]
    # (the first step's learning rate is 0, warm-up's start: iteration 2 starts from the same weights too)
    assert without["lm loss"][2] == run["lm loss"][2] and without["lm loss"][3] != run["lm loss"][3]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_gives_the_one_process_z_loss_and_gradients(runs, name):
    """TP=2 (each rank half the vocabulary: without model.vocab_parallel_logsumexp's reduction over the
    tensor-parallel group each rank's z-loss is its half's, and the grad norm is another), with sequence parallelism,
    and PP=2 (the loss on the last stage), each continuing the one-process run's checkpoint of iteration 3 (the run
    resumed): the one-process lm loss, z loss and grad norm at iterations 4-6, their sums grouped otherwise."""
    assert_same(runs.layout(name), runs.one(), range(4, 7), METRICS, rel=REORDERED)


def test_z_loss_with_multi_token_prediction_is_one_line(capsys):
    err = config_error([*FLAGS, "--mtp-num-layers", "1"], capsys)
    assert "--z-loss-coeff with --mtp-num-layers" in err


def test_a_negative_coefficient_is_one_line(capsys):
    assert "--z-loss-coeff" in config_error([*FLAGS[:-1], "-0.1"], capsys)


def test_a_plain_loss_of_any_shape_is_flattened_and_only_a_declared_pair_is_a_z_loss():
    """Bridge's masked_token_loss flattens the per-token losses whatever their shape; the z-loss pair is taken apart
    only when the caller says it is one (forward_step, from --z-loss-coeff), never guessed from the shape: a plain
    [b, s, 2] loss is summed whole, not read as cross-entropy and z columns."""
    import train

    losses = torch.arange(64, dtype=torch.float32).view(2, 4, 8)
    mask = (torch.arange(64) % 3 != 0).float().view(2, 4, 8)
    for shape in [(64,), (8, 8), (2, 4, 8), (2, 4, 2, 4)]:
        loss, tokens, report = train.masked_token_loss(mask.view(shape), losses.view(shape))
        assert float(loss) == float((losses * mask).sum()) and int(tokens) == int(mask.sum())
        assert list(report) == ["lm loss"] and report["lm loss"].tolist() == [float(loss), float(mask.sum())]

    pair, pair_mask = losses[..., :2], mask[..., 0]  # [b, s, 2] and the [b, s] mask
    loss, tokens, report = train.masked_token_loss(mask[..., :2], pair)
    assert list(report) == ["lm loss"] and float(loss) == float((pair * mask[..., :2]).sum())
    loss, tokens, report = train.masked_token_loss(pair_mask, pair, z_loss=True)
    lm, z = ((pair[..., i] * pair_mask).sum() for i in range(2))
    assert report["lm loss"].tolist() == [float(lm), float(pair_mask.sum())]
    assert report["z loss"].tolist() == [float(z), float(pair_mask.sum())]
    assert float(loss) == float(lm + z) and int(tokens) == int(pair_mask.sum())
