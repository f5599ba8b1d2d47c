"""Multi-token prediction (MTP), and DeepSeek-V3's block on the CPU: multi-latent attention, MoE from the second layer
with a shared expert and DeepSeek-V3's router (sigmoid scores, expert bias, group-limited top-k), and one MTP layer
(megatron-core's MultiTokenPredictionBlock on the local layers). The MTP loss is on the log line and in TensorBoard
under Megatron-LM's names; every parallel layout gives the one-process run; FLOPs and parameters are Megatron-LM's
counts; what is not built is one line."""

import types

import pytest

import checks

from conftest import REORDERED, TINY, ContinuedLayouts, assert_same, config_error, log_lines, tensorboard_scalars
from test_mla import MLA

# DeepSeek-V3, shrunk to 4 layers: MLA (test_mla's), the first layer dense and the others MoE (4 experts of 32, top-2
# in 1 of 2 groups, sigmoid scores with the expert bias, a shared expert of 64, the per-sequence balancing loss),
# one MTP layer.
MOE = ["--num-experts", "4", "--moe-layer-freq", "([0]+[1]*3)", "--moe-router-topk", "2",
       "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-num-groups", "2",
       "--moe-router-group-topk", "1", "--moe-shared-expert-intermediate-size", "64", "--moe-ffn-hidden-size", "32",
       "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-3"]
V3 = [*TINY, "--num-layers", "4", *MLA, *MOE, "--mtp-num-layers", "1"]
# The distributed optimizer in its fully_reshardable format: the experts' Adam state crosses layouts that group the
# expert optimizers otherwise (test_moe).
FLAGS = [*V3, "--mock-data", "--global-batch-size", "4", "--train-iters", "6", "--log-interval", "1",
         "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0",
         "--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"]
METRICS = ("lm loss", "mtp_1 loss", "seq_load_balancing_loss", "grad-norm")
TP2 = ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"]
LAYOUTS = {
    # MoE under tensor parallelism needs sequence parallelism (megatron-core), and experts whole on each rank (gloo
    # has no uneven all-gather: README, parallelism on a CPU)
    "tp2_sp": [*TP2, "--sequence-parallel", "--expert-tensor-parallel-size", "1"],
    "ep2": ["--expert-model-parallel-size", "2"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "cp2": ["--context-parallel-size", "2"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, warm_torchrun):
    """One rank saving at iteration 3, then each two-rank layout continuing it (conftest.ContinuedLayouts)."""
    return ContinuedLayouts(tmp_path_factory.mktemp("v3"), FLAGS, METRICS, warm_torchrun, LAYOUTS)


def test_the_mtp_loss_is_on_the_log_line_and_in_tensorboard_under_megatron_lms_names(runs):
    """Megatron-LM's log line gains "mtp_1 loss" after the MoE losses, averaged over the interval as the lm loss;
    TensorBoard gets "mtp_1 loss" and the acceptance rates (the share of positions whose most likely token is the one
    two places ahead, this iteration's and the run's). Both losses fall."""
    run = runs.one()
    line = [line for line in run["stdout"].splitlines() if " iteration        6/" in line][0]
    assert line.index("| lm loss:") < line.index("| seq_load_balancing_loss:") < line.index("| mtp_1 loss:") \
        < line.index("| loss scale:"), line
    scalars = tensorboard_scalars(runs.out / "one" / "tb")
    assert {"mtp_1 loss", "mtp_1_acceptance_rate", "mtp_1_cumulative_acceptance_rate"} <= set(scalars)
    assert "mtp_1 loss vs samples" not in scalars  # Megatron-LM writes it by iteration only
    lm = [loss for _, _, _, loss, _, _ in log_lines(run["stdout"])]
    mtp = [scalars["mtp_1 loss"][it] for it in range(1, 7)]
    assert all(0 <= rate <= 100 for rate in scalars["mtp_1_acceptance_rate"].values())
    # From ln 384 = 5.95 (the uniform guess): 6 steps at lr 3e-3 take the lm loss down by ~0.5; the MTP loss (a harder
    # guess, two tokens ahead) by less. 0.2 is far above the noise of either.
    assert lm[-1] < lm[0] - 0.2 and mtp[-1] < mtp[0] - 0.2, (lm, mtp)


def test_the_model_is_megatron_cores_mtp_block_with_the_last_layers_kind(single_rank_groups):
    import config
    import checks
    import model
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

    gpt = model.build_model(checks.parse_args(FLAGS, world_size=1, gpu=False), 256)[0]
    assert isinstance(gpt.mtp, MultiTokenPredictionBlock) and len(gpt.mtp.layers) == 1
    layer = gpt.mtp.layers[0]
    # The decoder's last layer is MoE: so is the MTP layer's (Megatron-LM's gpt_builders); its norms are Norm.
    assert isinstance(layer.mtp_model_layer.mlp, MoELayer)
    assert isinstance(layer.mtp_model_layer.self_attention, MLASelfAttention)
    assert all(isinstance(norm, model.Norm) for norm in (layer.enorm, layer.hnorm, layer.final_layernorm))
    assert layer.eh_proj.weight.shape == (64, 128)  # [embedding; hidden] to the hidden size


# The first command: TP=2 with SP; EP=2 and PP=2 under --full (the first command's drawn runs draw MTP, latent
# attention and experts at every two-rank layout: tests/test_layouts.py).
@pytest.mark.parametrize("name", [name if name == "tp2_sp" else pytest.param(name, marks=pytest.mark.full)
                                  for name in LAYOUTS if name != "cp2"])
def test_every_parallel_layout_of_deepseek_v3_is_the_one_process_run(runs, name):
    """TP=2 with sequence parallelism, EP=2 (two experts a rank) and PP=2 (the MTP layer and the embedding it reads on
    the last stage), each continuing the one-rank checkpoint of iteration 3: the one-process lm loss, MTP loss and
    balancing loss at iterations 4-6, their sums grouped otherwise (REORDERED), and the grad norm of iteration 4,
    the first step from the same weights (after it, Adam turns the reordered rounding of the smallest gradients,
    the latents' norms', into updates of the learning rate's size: 2e-5 apart by iteration 6 under TP=2)."""
    run, one_rank = runs.layout(name), runs.one()
    assert_same(run, one_rank, range(4, 7), METRICS[:3], rel=REORDERED)
    assert_same(run, one_rank, [4], ["grad-norm"], rel=REORDERED)


def test_under_context_parallelism_each_rank_weighs_its_own_mtp_tokens(runs):
    """CP=2: the forward from the checkpoint's weights gives the one-process lm loss and balancing loss. The MTP loss
    is megatron-core's per rank: each CP rank divides its MTP loss (and gradient) by its own tokens
    (multi_token_prediction.py, process_mtp_loss: roll_tensor's count is the rank's), and the ranks' means are
    averaged, where one process divides by all the tokens; the rank that holds the sequence's end has one MTP
    target fewer. So the MTP loss differs from one process's by at most 1/(2n - 1) of it, n the tokens of a
    sequence on a rank (32: 1/63), and the weights after the step differ too."""
    run, one_rank = runs.layout("cp2"), runs.one()
    assert_same(run, one_rank, [4], ["lm loss", "seq_load_balancing_loss"], rel=REORDERED)
    assert run["mtp_1 loss"][4] == pytest.approx(one_rank["mtp_1 loss"][4], rel=1 / 63)


def _cfg(*flags):
    import config
    import checks

    cfg = checks.parse_args([*TINY, "--mock-data", *flags], world_size=1, gpu=False)
    cfg.padded_vocab_size = 384
    return cfg


def _megatron_lm_flops(cfg, batch):
    """Megatron-LM core_v0.19's count, written out here on its own for a dense model with standard attention
    (megatron/training/training.py, transformer_flops): the MTP layers are layers of the last layer's kind; each adds
    its norms and projection, 3 x 2 x (3h + 2h^2) a token, and a logit computation."""
    m = cfg.model
    h, V, mtp = m.hidden_size, cfg.padded_vocab_size, m.mtp_num_layers or 0
    L, tokens = m.num_layers + mtp, batch * m.seq_length
    per_token = 3 * 2 * (L * (4 * h * h + 2 * h * m.ffn_hidden_size) + mtp * (3 * h + 2 * h * h) + h * V * (1 + mtp))
    core = 3 * 2 * L * batch * m.seq_length ** 2 * h / 2 * 2  # QK^T and AV, each over the causal half
    return tokens * per_token + core


@pytest.mark.parametrize("mtp", [[], ["--mtp-num-layers", "2"]], ids=["none", "two"])
def test_mtp_flops_and_parameters_are_megatron_lms_counts(mtp, single_rank_groups):
    """FLOPs: Megatron-LM's count. Parameters: what megatron-core builds (LayerNorm, no biases, untied embeddings, no
    position table, which the memory formula leaves out): the MTP layers, their projections and norms counted in."""
    import metrics
    from model import build_model

    cfg = _cfg(*mtp, "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--hidden-size", "128",
               "--seq-length", "256", "--num-layers", "3", "--position-embedding-type", "rope")
    assert metrics.num_floating_point_operations(cfg, 4, 384) == pytest.approx(_megatron_lm_flops(cfg, 4), rel=1e-12)
    n = sum(p.numel() for p in build_model(cfg, 384)[0].parameters())
    assert metrics.compute_weight_and_optimizer_memory(cfg) == pytest.approx(16 * n)  # fp32: weight, grad, Adam


@pytest.mark.parametrize("argv, message", [
    (["--peft", "lora"], "--peft lora with --mtp-num-layers"),
    (["--mtp-use-repeated-layer"], "--mtp-use-repeated-layer is a variant of multi-token prediction (MTP) that is "
                                   "not yet supported here"),
    (["--mtp-hybrid-override-pattern", "*"], "multi-token prediction in hybrid (Mamba) models"),
    (["--mtp-num-layers", "0"], "--mtp-num-layers"),
    (["--pipeline-model-parallel-size", "2", "--untie-embeddings-and-output-weights", "--position-embedding-type",
      "rope"], None),
    (["--pipeline-model-parallel-size", "2", "--position-embedding-type", "rope"],
     "needs --untie-embeddings-and-output-weights"),
    (["--pipeline-model-parallel-size", "2", "--untie-embeddings-and-output-weights"],
     "needs --position-embedding-type rope or none"),
])
def test_bad_mtp_settings_are_one_line(argv, message, capsys):
    """None: the setting beside a refused one is accepted, so the refusal is of what it names. Two ranks: a
    pipeline of two stages."""
    argv = [*TINY, "--mtp-num-layers", "1", *argv]
    if message is None:
        checks.parse_args(argv, world_size=2)
        return
    assert message in config_error(argv, capsys, world_size=2)


def test_hf_export_names_mtp_as_what_no_layout_has():
    import hf

    assert "no --mtp-num-layers" in hf.layout_mismatches(_cfg("--mtp-num-layers", "1").model, "llama")


def test_generate_samples_from_deepseek_v3_without_running_its_mtp_layer(tmp_path, monkeypatch):
    """generate.py on the DeepSeek-V3-shaped model: the KV-cached decoding gives the --no-kv-cache loop's tokens,
    greedy and sampled, and never runs the MTP layer (megatron-core skips it under an inference context; the plain
    loop's full forward runs it and drops its output, the main head's logits being the first chunk)."""
    import generate
    from conftest import _trained_in_process
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

    from test_generate import one_process_world_ends

    try:
        load = _trained_in_process(tmp_path, [*V3[len(TINY):], "--hidden-dropout", "0", "--attention-dropout", "0"])
        model, tokenizer, cfg = generate.load_model(load)
        assert cfg.model.mtp_num_layers == 1 and cfg.model.multi_latent_attention
        calls = []
        forward = MultiTokenPredictionBlock.forward
        monkeypatch.setattr(MultiTokenPredictionBlock, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
        prompt = tokenizer.tokenize("import os\n")
        never_stops = types.SimpleNamespace(vocab_size=tokenizer.vocab_size, eod=-1)  # all 40 tokens, no early end
        for sampling in (dict(), dict(seed=3, temperature=0.8, top_k=50, top_p=0.95)):
            calls.clear()
            with_cache = generate.generate(model, never_stops, prompt, 40, **sampling)  # within the 64-token context
            assert calls == [] and len(with_cache) == 40, "the cached decoding ran the MTP layer"
            assert with_cache == generate.generate(model, never_stops, prompt, 40, kv_cache=False, **sampling), sampling
        assert calls, "the plain loop's full forward runs the MTP layer (and drops its output)"
    finally:
        one_process_world_ends()
