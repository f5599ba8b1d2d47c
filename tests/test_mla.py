"""DeepSeek-V3's multi-latent attention (MLA) on the CPU: megatron-core's MLASelfAttention on the local layers,
with the project's SDPAttention as its core attention (which takes a value head width other than the query's)
and Norm as its latents' norms. It learns on one rank; tensor, context and pipeline parallelism give the one-process
run; its FLOPs and parameters are Megatron-LM's formulas; bad settings are one line."""

import pytest

from conftest import REORDERED, TINY, ContinuedLayouts, assert_same, config_error, log_lines

# DeepSeek-V3's attention, shrunk: a query latent, a key-value latent, rotary and plain parts of each head, YaRN
# (Megatron-LM's default under MLA), norms on the latents, RMSNorm, SwiGLU, no biases.
MLA = ["--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--rotary-scaling-factor", "4", "--mscale", "1",
       "--mscale-all-dim", "1", "--qk-layernorm", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
       "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights"]
FLAGS = [*TINY, *MLA, "--mock-data", "--global-batch-size", "4", "--train-iters", "6", "--log-interval", "1",
         "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0",
         "--log-l2-norm-grad"]
# The query latent's norm's gradient (--log-l2-norm-grad), in the first layer: megatron-core sums it over the TP ranks.
Q_NORM = "l2_norm/grad/decoder.layers.0.self_attention.q_layernorm.weight"
METRICS = ("lm loss", "grad-norm", Q_NORM)
LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"],
    "tp2_sp": ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64", "--sequence-parallel"],
    "cp2": ["--context-parallel-size", "2"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, warm_torchrun):
    """One rank saving at iteration 3, then each two-rank layout continuing it (conftest.ContinuedLayouts)."""
    return ContinuedLayouts(tmp_path_factory.mktemp("mla"), FLAGS, METRICS, warm_torchrun, LAYOUTS)


def test_multi_latent_attention_builds_megatron_cores_mla_and_learns(runs):
    """The loss falls."""
    run = runs.one()
    losses = [line[3] for line in log_lines(run["stdout"])]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.5, losses


def test_mla_model_is_megatron_cores_mla_with_our_core_attention_and_norms(single_rank_groups):
    import config
    import checks
    import model
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    cfg = checks.parse_args(FLAGS, world_size=1, gpu=False)
    assert cfg.model.rope_type == "yarn"  # derived: Megatron-LM's default under --multi-latent-attention
    attention = model.build_model(cfg, 256)[0].decoder.layers[0].self_attention
    assert isinstance(attention, MLASelfAttention) and isinstance(attention.rotary_pos_emb, YarnRotaryEmbedding)
    assert isinstance(attention.core_attention, model.SDPAttention)
    assert isinstance(attention.q_layernorm, model.Norm) and isinstance(attention.kv_layernorm, model.Norm)
    assert attention.q_layernorm.weight.shape == (32,) and attention.kv_layernorm.weight.shape == (16,)
    # The value heads are narrower than the query and key heads (16 + 8 rotary): SDPA takes both.
    assert attention.linear_kv_up_proj.weight.shape == (4 * (16 + 16), 16)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_parallel_layout_of_mla_is_the_one_process_run(runs, name):
    """TP=2 (each rank half the heads; the latents' down-projections whole on each), TP=2 with sequence
    parallelism, CP=2 (each rank two chunks of the sequence, keys and values gathered) and PP=2 give the one-process
    lm loss and grad norm, their sums grouped otherwise (REORDERED)."""
    assert_same(runs.layout(name), runs.one(), range(4, 7), METRICS[:2], rel=REORDERED)


@pytest.mark.parametrize("name", ["tp2", "tp2_sp", "cp2"])
def test_the_query_latents_norm_gets_the_one_process_gradient(runs, name):
    """megatron-core sums the gradient of every parameter named q_layernorm over the TP ranks (meant for dense
    attention's per-head norms), which makes MLA's query-latent norm's gradient TP times too large without
    sequence parallelism; model.finalize_model_grads_of_mla divides it back (without it: 2.000x here). The first
    step from the same weights; rel=0.1 tells 2 from 1 whatever the rounding of a gradient this small (its terms
    cancel to ~1e-5), and the other layouts need nothing undone."""
    run, reference = runs.layout(name), runs.one()
    assert run[Q_NORM][4] == pytest.approx(reference[Q_NORM][4], rel=0.1), (run[Q_NORM][4], reference[Q_NORM][4])


def _cfg(*flags):
    import config
    import checks

    cfg = checks.parse_args([*TINY, "--mock-data", *flags], world_size=1, gpu=False)
    cfg.padded_vocab_size = 384
    return cfg


def _megatron_lm_mla_flops(cfg, batch):
    """Megatron-LM core_v0.19's count for MLA, written out here on its own (megatron/training/training.py,
    num_floating_point_operations, its multi_latent_attention branch): per token, each GEMM 3 (forward, wgrad,
    dgrad) x 2 (multiply-add); core attention per token and key position 3 x 2 x heads x (qk + rope) / 2 for QK^T
    and x v / 2 for the values (the causal half)."""
    m = cfg.model
    h, L, V, a = m.hidden_size, m.num_layers, cfg.padded_vocab_size, m.num_attention_heads
    qk, pos, v = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
    q = h * a * (qk + pos) if m.q_lora_rank is None else m.q_lora_rank * (h + a * (qk + pos) + 1)
    attention_linear = 3 * 2 * (q + m.kv_lora_rank * (h + a * (qk + v) + 1) + h * pos + a * v * h)
    attention_core = 3 * 2 * (a * (qk + pos) / 2 + a * v / 2)
    tokens, seq_squared = batch * m.seq_length, batch * m.seq_length ** 2
    ffn_factor = 3 if m.swiglu else 2
    return (tokens * (3 * 2 * h * m.ffn_hidden_size * ffn_factor * L + attention_linear * L + 3 * 2 * h * V)
            + seq_squared * attention_core * L)


@pytest.mark.parametrize("q_lora", [[], ["--q-lora-rank", "48"]], ids=["full_query", "query_latent"])
def test_mla_flops_and_parameters_are_megatron_lms_formulas(q_lora, single_rank_groups):
    """FLOPs: Megatron-LM's MLA count. Parameters (theoretical memory): with LayerNorm everywhere and no biases,
    exactly what megatron-core builds (Megatron-LM's theoretical_memory_usage.py counts the latents' norms)."""
    import metrics
    from model import build_model

    # LayerNorm; without a query latent, no --qk-layernorm (the local layers have no fused norm-and-linear)
    mla = [f for f in MLA if f not in ("--normalization", "RMSNorm", "--q-lora-rank", "32", "--qk-layernorm")]
    cfg = _cfg(*mla, *q_lora, *(["--qk-layernorm"] if q_lora else []), "--hidden-size", "128", "--seq-length", "256",
               "--num-layers", "3")
    assert metrics.num_floating_point_operations(cfg, 4, 384) == pytest.approx(_megatron_lm_mla_flops(cfg, 4), rel=1e-12)
    n = sum(p.numel() for p in build_model(cfg, 384)[0].parameters())
    assert metrics.compute_weight_and_optimizer_memory(cfg) == pytest.approx(16 * n)  # fp32: weight, grad, Adam


@pytest.mark.parametrize("argv, message", [
    (["--num-query-groups", "2"], "--num-query-groups 2 groups the keys and values of grouped-query attention; "
                                  "multi-latent attention shares one latent"),
    (["--qk-pos-emb-head-dim", "7"], "--qk-pos-emb-head-dim 7 must be even"),
    (["--qk-l2-norm"], "--qk-l2-norm is not built for multi-latent attention"),
    (["--peft", "lora"], "multi-latent attention's projections are not among its targets"),
    (["--cache-mla-latents"], "--cache-mla-latents"),
])
def test_bad_mla_settings_are_one_line(argv, message, capsys):
    mla = [f for f in MLA if f != "--qk-layernorm"] if "--qk-l2-norm" in argv else MLA  # one q/k norm at a time
    assert message in config_error([*TINY, *mla, *argv], capsys)


def test_a_query_norm_without_a_query_latent_is_one_line_on_the_local_layers(capsys):
    """megatron-core puts that norm inside transformer-engine's fused norm-and-linear projection, which the local
    layers do not have (without the check: a ValueError from deep inside the model's construction)."""
    without_latent = [f for f in MLA if f not in ("--q-lora-rank", "32")]
    assert "--qk-layernorm without --q-lora-rank normalizes the queries inside a fused norm-and-linear projection" \
        in config_error([*TINY, *without_latent], capsys)


def test_yarn_without_mla_is_one_line(capsys):
    assert "--rope-type yarn is multi-latent attention's rotary embedding here; add --multi-latent-attention" in \
        config_error([*TINY, "--position-embedding-type", "rope", "--rope-type", "yarn"], capsys)


def test_hf_export_names_mla_as_what_no_layout_has():
    import hf

    cfg = _cfg(*MLA)
    assert "no --multi-latent-attention" in hf.layout_mismatches(cfg.model, "llama")
