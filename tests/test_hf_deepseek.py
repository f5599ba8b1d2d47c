"""hf.py's DeepSeek-V3 layout against the real `transformers` (CPU, tiny models, nothing downloaded): our
DeepSeek-V3-shaped checkpoint (test_mtp's: multi-latent attention with YaRN, MoE from the second layer with a sigmoid
router, expert bias, group-limited top-k and a shared expert, one MTP layer) exports to a directory whose
DeepseekV3ForCausalLM computes our logits; transformers' own random DeepseekV3 models import with their logits and
export back the same tensors; what the layout cannot express is one line naming it, before any weight loads."""

import json
import os
import re
import shutil

import pytest
import torch
import yaml

import config
import checks
from test_hf import _our_logits, _text_batch, one_process_world  # noqa: F401 (an autouse fixture, used here too)
from test_mtp import V3

transformers = pytest.importorskip("transformers", reason="transformers is in requirements.txt; this checks the HF layouts")

# test_mtp's DeepSeek-V3 shape with transformers' epsilon of the latents' norms (1e-6 whatever rms_norm_eps: hf.py
# refuses the default 1e-5, test_a_model_the_layout_cannot_express_is_refused_by_name).
FLAGS = [*V3, "--norm-epsilon", "1e-6"]

# Tolerance: transformers' and megatron-core's forward of the same fp32 weights, other kernels and summation orders
# (one expert at a time in each; SDPA beside eager attention; F.rms_norm beside transformers' RMSNorm). A sum of n
# terms rounds by up to log2(n) x 2^-24 relative, n <= 128 here (the dense MLP's down projection): 4.2e-7. Along the
# residual stream each layer chains about 10 of them (norm, latent down and up projections, QK^T, softmax, AV, output
# projection, norm, router or up projection, down projection and the weighted sum of the experts): 4e-6 a layer;
# 4 layers, the final norm and the output layer: 2e-5 relative, of logits of magnitude <= ~10: 2e-4 absolute. The
# YaRN tables are the same float32 formulas on both sides. A token routed to another expert on one side moves its
# logits by far more (~1e-1): within the tolerance, the routers chose the same experts.
DEEPSEEK_LOGITS = 2e-4


@pytest.fixture(scope="module")
def v3_ckpt(tmp_path_factory):
    """The DeepSeek-V3-shaped model trained 2 iterations by train.py in this process (one rank): its router biases
    moved off zero, its MTP layer trained beside the decoder."""
    import train

    out = tmp_path_factory.mktemp("deepseek_v3")
    train.pretrain(checks.parse_args([*FLAGS, "--mock-data", "--train-iters", "2", "--eval-iters", "0",
                                      "--num-workers", "0", "--save", str(out / "ckpt"), "--data-cache-path",
                                      str(out / "cache")], world_size=1, gpu=False))
    return str(out / "ckpt")


def test_export_gives_transformers_our_logits(v3_ckpt, tmp_path, capsys):
    """DeepseekV3ForCausalLM on the export: our logits (the decoder's: the MTP layer is left out, saying so), with
    YaRN's frequencies, attention factor and softmax scale, the interleaved rotary rows, the routers' expert biases."""
    import hf
    from data import ByteTokenizer

    tokens = _text_batch(ByteTokenizer())
    ours, tokenizer = _our_logits(v3_ckpt, tokens)
    capsys.readouterr()
    assert hf.export(v3_ckpt, str(tmp_path / "hf")) == "deepseek_v3"
    out = capsys.readouterr().out
    assert "the 1 multi-token prediction layer(s) are not exported" in out
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert type(theirs).__name__ == "DeepseekV3ForCausalLM"
    c = theirs.config
    assert c.rope_parameters["rope_type"] == "yarn" and c.rope_interleave and c.first_k_dense_replace == 1
    assert (c.n_routed_experts, c.n_group, c.topk_group, c.n_shared_experts, c.num_mtp_layers) == (4, 2, 1, 2, 0)
    bias = theirs.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.abs().max() > 0  # trained: transformers chooses its experts with it, as megatron-core does
    with torch.no_grad():
        logits = theirs(tokens).logits
    assert logits.shape == ours.shape == (2, 48, tokenizer.vocab_size)
    assert (logits - ours).abs().max().item() <= DEEPSEEK_LOGITS
    assert ours.std() > 0.1  # trained weights, not a constant


def _random_deepseek(directory, rope_interleave=True, yarn=True, dense=False):
    """transformers' own DeepseekV3ForCausalLM, tiny and random: 3 layers (the first dense), 4 experts in 2 groups
    (top-2 from 1 group), 2 shared experts' width, a routed scaling of 2.5; random norms, router weights and expert
    biases large enough that every layer routes each token by them (a dropped or misplaced bias changes the routes),
    and the layers' projections 10 times transformers' initial scale: sharper attention, which shows a misplaced
    rotary row or softmax scale more, and experts whose outputs weigh in the logits, as their routing weights do."""
    torch.manual_seed(0)
    rope = dict(rope_type="yarn", rope_theta=5000.0, factor=4.0, original_max_position_embeddings=4096,
                beta_fast=32.0, beta_slow=1.0, mscale=0.8, mscale_all_dim=0.8) if yarn else \
        dict(rope_type="default", rope_theta=5000.0)
    c = transformers.DeepseekV3Config(
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=2, num_experts_per_tok=2,
        n_group=2, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=3 if dense else 1, q_lora_rank=32,
        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_parameters=rope, rope_interleave=rope_interleave, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(c)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith("gate.weight"):
                p.normal_(0.0, 0.3)
            elif ".self_attn." in name or ".mlp." in name:
                p.normal_(0.0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    model.eval().save_pretrained(directory)
    return model


@pytest.mark.parametrize("kind", ["yarn_interleaved", "rope_halves", "dense"])
def test_import_gives_the_transformers_logits_and_exports_back_the_same_tensors(kind, tmp_path, capsys):
    """Our logits from the import; the export of the import gives transformers' tensors back bit for bit, and where
    the rotary rows were halves (rope_interleave false, turned into megatron-core's interleaved pairs on import;
    exports write rope_interleave true) a model transformers computes the same logits with. `dense`: no MoE layer
    (first_k_dense_replace = the layers), a dense model with multi-latent attention."""
    import hf
    from safetensors.torch import load_file

    theirs = _random_deepseek(str(tmp_path / "in"), rope_interleave=kind != "rope_halves", yarn=kind != "rope_halves",
                              dense=kind == "dense")
    hf.import_hf(str(tmp_path / "in"), str(tmp_path / "ckpt"))
    tokens = torch.randint(0, 299, (2, 40), generator=torch.Generator().manual_seed(3))
    ours, _ = _our_logits(str(tmp_path / "ckpt"), tokens)
    with torch.no_grad():
        expected = theirs(tokens).logits
    assert ours.shape == expected.shape == (2, 40, 300)
    assert (ours - expected).abs().max().item() <= DEEPSEEK_LOGITS

    assert hf.export(str(tmp_path / "ckpt"), str(tmp_path / "out")) == "deepseek_v3"
    reread = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():
        assert (reread(tokens).logits - expected).abs().max().item() <= DEEPSEEK_LOGITS
    before, after = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("in", "out"))
    assert sorted(before) == sorted(after)
    # bit for bit, but where an import of rotary halves interleaved the rotary rows (other tensors, the same model)
    assert all(torch.equal(before[k], after[k]) for k in before) == (kind != "rope_halves")
    config_in, config_out = (json.load(open(tmp_path / d / "config.json")) for d in ("in", "out"))
    keys = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "first_k_dense_replace",
            "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rms_norm_eps",
            "tie_word_embeddings", "model_type"]
    if kind != "dense":  # (a model without MoE layers has no routing to write)
        keys += ["moe_intermediate_size", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group",
                 "topk_group", "routed_scaling_factor", "norm_topk_prob"]
    for key in keys:
        assert config_in.get(key) == config_out.get(key), key
    rope_in, rope_out = config_in["rope_parameters"], config_out["rope_parameters"]
    assert {k: rope_out.get(k) for k in rope_in} == rope_in  # (the export adds YaRN's attention factor and defaults)
    assert config_out["rope_interleave"] is True

@pytest.mark.parametrize("flags, named", [
    (V3, "--norm-epsilon 1e-6, transformers' epsilon of the latents' norms whatever rms_norm_eps (has 1e-05)"),
    ([*FLAGS, "--moe-layer-freq", "[1,0,1,1]"], "dense layers only before the MoE ones (first_k_dense_replace; has "
                                                "--moe-layer-freq [1,0,1,1])"),
    ([*FLAGS, "--num-experts", "8", "--moe-router-topk", "3"],
     "groups scored by their top 2 experts, as transformers (megatron-core sums the top --moe-router-topk / "
     "--moe-router-group-topk = 3)"),
    ([*FLAGS, "--moe-shared-expert-intermediate-size", "48"], "a shared expert a multiple of --moe-ffn-hidden-size 32 "
                                                              "wide"),
    ([*FLAGS, "--rope-type", "rope"], "no YaRN softmax scale without --rope-type yarn (has --rotary-scaling-factor 4 "
                                      "--mscale-all-dim 1)"),
    ([f for f in FLAGS if f != "--qk-layernorm"], "RMSNorm on the query and key-value latents (--qk-layernorm)"),
], ids=["layernorm_epsilon", "dense_among_moe", "groups_by_top3", "shared_width", "yarn_scale_under_rope",
        "no_latent_norms"])
def test_a_model_the_layout_cannot_express_is_refused_by_name(flags, named):
    """Each is a model megatron-core builds and transformers' DeepSeek-V3 computes otherwise: the latents' norm
    epsilon, dense layers among MoE ones, groups scored by their top 3, a shared expert of 1.5 experts' width, MLA's
    YaRN softmax scale under plain rope (megatron-core applies it there too), no norms on the latents."""
    import hf

    m = checks.parse_args(["--mock-data", *flags], world_size=1, gpu=False).model
    with pytest.raises(config.ConfigError, match=f"^this model fits no transformers layout: DeepSeek-V3 needs .*"
                                                 f"{re.escape(named)}") as e:
        hf.choose_layout(m)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("changes, named", [
    (dict(norm_topk_prob=False), "norm_topk_prob False with num_experts_per_tok 2 (megatron-core's sigmoid router "
                                 "renormalises the top k weights exactly when k > 1)"),
    (dict(n_routed_experts=8, n_group=4, topk_group=2), "n_group 4 with topk_group 2 and num_experts_per_tok 2 "
                                                        "(transformers scores each group by its top 2 experts, "
                                                        "megatron-core by its top num_experts_per_tok / topk_group = 1)"),
    (dict(rms_norm_eps=1e-5), "rms_norm_eps 1e-05 (the latents' norms use 1e-6, ours all one --norm-epsilon)"),
    (dict(q_lora_rank=None), "q_lora_rank null"),
    (dict(rope_parameters=dict(rope_type="yarn", rope_theta=5000.0, factor=4.0, original_max_position_embeddings=8192)),
     "rope_parameters original_max_position_embeddings 8192 (megatron-core's YaRN here keeps 4096)"),
], ids=["norm_topk_prob", "groups_by_top1", "rms_norm_eps", "no_query_latent", "yarn_context"])
def test_a_transformers_deepseek_we_cannot_express_is_one_line_before_any_weight_loads(changes, named, tmp_path,
                                                                                       capsys):
    """The config.json of a saved transformers model, changed: exit code 2, one line naming it, nothing written (and
    the weights never read: they are a valid model's)."""
    import hf

    _random_deepseek(str(tmp_path / "in"))
    path = tmp_path / "in" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    capsys.readouterr()
    assert hf.main(hf.parse_args(["import", "--hf", str(tmp_path / "in"), "--save", str(tmp_path / "x")])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err, err
    assert not os.path.exists(tmp_path / "x")


def test_an_export_the_layout_cannot_express_is_one_line_before_any_weight_loads(v3_ckpt, tmp_path, capsys):
    """The trained checkpoint's run_config.yaml with Megatron-LM's default --norm-epsilon 1e-5: refused from the
    run config alone (the weights are not loaded), one line, exit code 2, nothing written."""
    import checkpoint
    import hf

    load = tmp_path / "ckpt"
    shutil.copytree(v3_ckpt, load)
    run_config = os.path.join(checkpoint.resolve_load_dir(str(load), None), "run_config.yaml")
    saved = yaml.safe_load(open(run_config))
    saved["model"]["layernorm_epsilon"] = 1e-5
    yaml.safe_dump(saved, open(run_config, "w"))
    capsys.readouterr()
    assert hf.main(hf.parse_args(["export", "--load", str(load), "--out", str(tmp_path / "x")])) == 2
    out = capsys.readouterr()
    assert out.err.count("\n") == 1 and "DeepSeek-V3 needs --norm-epsilon 1e-6" in out.err, out.err
    assert "loaded checkpoint" not in out.out and not os.path.exists(tmp_path / "x")
