"""hf.py: Hugging Face `transformers` model directories out of our checkpoints, and into them.

Names here are this project's own; the other side's (tensor names, config.json keys) are `transformers`'.

    python hf.py export --load CKPT [--ckpt-step N] --out DIR   # config.json + model.safetensors (+ tokenizer)
    python hf.py import --hf DIR --save CKPT                     # a checkpoint for --pretrained-checkpoint
    AutoModelForCausalLM.from_pretrained(DIR)                    # in transformers, on the exported directory

Five layouts, each a megatron-core GPTModel with certain flags:

    layout     transformers class   our flags
    ---------  -------------------  --------------------------------------------------------------------------
    gpt2       GPT2LMHeadModel      the defaults: learned absolute positions, LayerNorm, GeLU (--openai-gelu: HF's
                                    gelu_new), biases, output tied to the embedding; query groups = heads
    llama      LlamaForCausalLM     --position-embedding-type rope --normalization RMSNorm --swiglu
                                    [--num-query-groups G] --disable-bias-linear --untie-embeddings-and-output-weights
                                    (HF's attention_bias/mlp_bias and tie_word_embeddings cover the other two choices)
    mixtral    MixtralForCausalLM   llama's, no biases, and --num-experts E --moe-router-topk K [--moe-ffn-hidden-size]:
                                    every layer an MoE layer, softmax over the chosen experts' logits, no shared expert
    qwen3_moe  Qwen3MoeForCausalLM  mixtral's and --qk-layernorm; dense layers where --moe-layer-freq puts them (HF's
                                    mlp_only_layers); --moe-router-pre-softmax is HF's norm_topk_prob false
    deepseek_v3 DeepseekV3ForCausalLM rope or yarn, RMSNorm, SwiGLU, no biases, --multi-latent-attention
                                    --q-lora-rank --qk-layernorm (the latents' norms) --norm-epsilon 1e-6 (transformers'
                                    fixed epsilon of those norms) [--num-experts: a sigmoid router with the expert bias,
                                    a shared expert, dense layers first]; its MTP layers are not exported (the notes
                                    above yarn_mscale say what maps how)

The tensors are renamed, transposed where GPT-2 stores (in, out), and split or joined where megatron-core
fuses: its linear_qkv holds, per query group, that group's query heads then its key head then its value head;
its SwiGLU linear_fc1 (each expert's too) holds the gate rows then the up rows. The vocabulary written is the tokenizer's (the
rows past it, padding for tensor parallelism, are dropped; an import pads them with zeros). Only safetensors
are read: pickled `.bin` weights can run code when loaded.
"""

# ruff: noqa: E402  (the flags are parsed before the heavy imports, so most imports follow code)

import argparse
import functools
import json
import math
import os
import re
import shutil
import sys
import types

import config as config_lib  # first: it quiets megatron-core's import-time notices (device.py)
import checks


# Our name of each layout, and its transformers model_type and class.
LAYOUTS = {"gpt2": ("GPT-2", "GPT2LMHeadModel"), "llama": ("LLaMA", "LlamaForCausalLM"),
           "mixtral": ("Mixtral", "MixtralForCausalLM"), "qwen3_moe": ("Qwen3-MoE", "Qwen3MoeForCausalLM"),
           "deepseek_v3": ("DeepSeek-V3", "DeepseekV3ForCausalLM")}


def parse_args(argv=None) -> argparse.Namespace:
    parser = config_lib.OneLineParser(prog="hf.py", description="Hugging Face transformers directories out of and "
                                                                "into our checkpoints.", allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="A checkpoint to a transformers directory.")
    export.add_argument("--load", required=True, help="A save directory (its newest iteration) or an iter_* directory.")
    export.add_argument("--ckpt-step", type=int, help="Export this iteration instead of the newest.")
    export.add_argument("--out", required=True, help="The transformers directory to write.")
    export.add_argument("--layout", choices=LAYOUTS, help="The transformers layout to write; default: the one the "
                                                          "model fits. One it does not fit is a one-line error.")
    imp = commands.add_parser("import", help="A transformers directory (safetensors) to a checkpoint.")
    imp.add_argument("--hf", required=True, help="A local transformers directory: config.json and *.safetensors.")
    imp.add_argument("--save", required=True, help="Save directory of the checkpoint (iteration 0) to write.")
    args = parser.parse_args(argv)
    source = args.load if args.command == "export" else args.hf
    if not os.path.isdir(source):
        parser.error(f"{'--load' if args.command == 'export' else '--hf'} {source}: no such directory")
    return args


if __name__ == "__main__":
    ARGS = parse_args(sys.argv[1:])  # before torch loads, as train.py

import generate  # (a checkpoint's model for inference; first: quiets megatron-core's import warnings)
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import checkpoint
import data
import device
from checkpoint import TrainState
from model import STOCK_CORE_ATTENTIONS, build_model, core_attention, initialize_distributed

# --------------------------------------------------------------------------------------------------
# Which layout a model has
# --------------------------------------------------------------------------------------------------


def hf_activation(m):
    """transformers' name of the model's MLP activation ("gelu", "gelu_new", "silu" gated), read from megatron-core's
    own fields (config.GPTModelProvider.mlp_fields, the one place an activation is set); None for any other, which
    no layout here holds (a fork's own activation is refused, never exported as GPT-2's)."""
    import torch.nn.functional as F

    fields = m.mlp_fields()
    act, gated = fields["activation_func"], fields["gated_linear_unit"]
    tanh = isinstance(act, functools.partial) and act.func is F.gelu and act.keywords == {"approximate": "tanh"}
    return ("silu" if act is F.silu else None) if gated else "gelu" if act is F.gelu else "gelu_new" if tanh else None


def activation_name(m) -> str:
    """The MLP's activation in a refusal: its function's name, and whether it is gated."""
    fields = m.mlp_fields()
    act = fields["activation_func"]
    name = getattr(getattr(act, "func", act), "__name__", repr(act))
    return f"gated {name}" if fields["gated_linear_unit"] else name


def layout_mismatches(m, layout: str) -> list:
    """What keeps the model `m` (a GPTModelProvider) out of `layout`: one phrase each, empty if it fits."""
    if layout == "gpt2":
        needs = [(m.position_embedding_type == "learned_absolute", f"learned_absolute positions (has {m.position_embedding_type})"),
                 (m.normalization == "LayerNorm", f"LayerNorm (has {m.normalization})"),
                 (hf_activation(m) in ("gelu", "gelu_new"), f"GeLU (has {activation_name(m)})"),
                 (m.add_bias_linear, "biases (has --disable-bias-linear)"),
                 (m.num_query_groups == m.num_attention_heads, f"one key/value head per head (has {m.num_query_groups} "
                                                               f"query groups for {m.num_attention_heads} heads)"),
                 (m.kv_channels * m.num_attention_heads == m.hidden_size, f"head size x heads = hidden size (has "
                                                                          f"--kv-channels {m.kv_channels})")]
    else:
        needs = [(m.position_embedding_type == "rope", f"rope positions (has {m.position_embedding_type})"),
                 (m.rotary_percent == 1.0, f"rope on whole heads (has --rotary-percent {m.rotary_percent})"),
                 (m.normalization == "RMSNorm", f"RMSNorm (has {m.normalization})"),
                 (hf_activation(m) == "silu", f"SwiGLU (has {activation_name(m)})")]
    # transformers computes scaled dot-product attention: a fork's own core attention would be exported as it
    needs += [(core_attention(m) in STOCK_CORE_ATTENTIONS,
               f"scaled dot-product attention (has model.core_attention's {core_attention(m).__name__})")]
    if layout in ("gpt2", "llama"):
        needs += [(not m.num_moe_experts, f"no experts (has --num-experts {m.num_moe_experts})")]
    elif layout == "deepseek_v3":
        needs += deepseek_v3_needs(m)
    else:  # transformers' MoE blocks: a softmax router over routed experts alone, no biases
        layers = config_lib.moe_layers(m)
        needs += [(m.num_moe_experts, "experts (has no --num-experts)"),
                  (not m.add_bias_linear, "no biases (add --disable-bias-linear)"),
                  (not m.moe_shared_expert_intermediate_size,
                   f"no shared experts (has --moe-shared-expert-intermediate-size {m.moe_shared_expert_intermediate_size})"),
                  (m.moe_router_score_function == "softmax",
                   f"a softmax router (has --moe-router-score-function {m.moe_router_score_function})"),
                  (not m.moe_router_num_groups, "one group of experts (has --moe-router-num-groups)"),
                  (m.moe_router_topk_scaling_factor in (None, 1.0),
                   f"unscaled routing weights (has --moe-router-topk-scaling-factor {m.moe_router_topk_scaling_factor})"),
                  (m.moe_expert_capacity_factor is None, "no token dropping (has --moe-expert-capacity-factor)")]
        if layout == "mixtral":
            needs += [(all(layers) or not m.num_moe_experts, "every layer an MoE layer (has dense layers: --moe-layer-freq)"),
                      (not m.moe_router_pre_softmax, "softmax over the chosen experts (has --moe-router-pre-softmax)")]
        else:
            needs += [(m.qk_layernorm, "--qk-layernorm (RMSNorm on each head's queries and keys)")]
    # The model variants that no transformers layout has: each one named, never exported wrongly. (DeepSeek-V3's
    # MTP layers are training's alone: the export leaves them out, saying so.)
    has = {"qwen3_moe": ("qk_layernorm",), "deepseek_v3": ("qk_layernorm", "multi_latent_attention", "mtp_num_layers")}
    needs += [(not getattr(m, flag, False), f"no --{flag.replace('_', '-')}") for flag in
              ("add_qkv_bias", "qk_l2_norm", "layernorm_zero_centered_gamma",
               "attention_output_gate", "rotary_interleaved", "window_size", "activation_func_clamp_value",
               "no_rope_freq", "multi_latent_attention", "mtp_num_layers", "qk_layernorm",
               "rotary_seq_len_interpolation_factor")
              if flag not in has.get(layout, ())]
    needs += [(not getattr(m, "glu_linear_offset", 0.0), "no --glu-linear-offset"),
              (getattr(m, "softmax_type", "vanilla") == "vanilla", "the plain softmax (has --softmax-type)")]
    return [what for ok, what in needs if not ok]


# transformers' DeepSeek-V3 (models/deepseek_v3/modeling_deepseek_v3.py in transformers 5.23) beside megatron-core
# 0.19's MLA (transformer/multi_latent_attention.py), YaRN (models/common/embeddings/yarn_rotary_pos_embedding.py) and
# router (transformer/moe/moe_utils.py), where they differ:
# - the latents' norms: transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default epsilon, 1e-6, not
#   rms_norm_eps (modeling :380, :392); megatron-core gives them --norm-epsilon (multi_latent_attention.py:619-629);
# - the softmax scale: megatron-core multiplies 1/sqrt(qk_head_dim + qk_pos_emb_head_dim) by
#   yarn_mscale(--rotary-scaling-factor, --mscale-all-dim)^2 under either rope type (:177-178), transformers only
#   under a rescaled rope (modeling :268-274, :405);
# - group-limited routing: megatron-core scores a group by the sum of its top --moe-router-topk /
#   --moe-router-group-topk experts (moe_utils.py:655-657), transformers by its top 2 (modeling :137-142);
# - the routing weights: megatron-core's sigmoid router renormalises the top-k scores when k > 1, never when k = 1
#   (moe_utils.py:868), transformers when norm_topk_prob is true (modeling :154-156);
# - the layers: transformers' first first_k_dense_replace layers are dense, the others MoE (modeling :492-495).
# Equal (so the tensors copy as they are): each head's query rows are its qk_head_dim rows without position, then its
# qk_pos_emb_head_dim rotary rows (multi_latent_attention.py:924-926; modeling :441-442); linear_kv_down_proj's rows
# are the kv_lora_rank latent, then the shared rotary key (:741-750; modeling :444-445 kv_a_proj_with_mqa); each head's
# linear_kv_up_proj rows are its key rows, then its value rows (:930-932; modeling :414-417); megatron-core's MLA
# rotates the rotary dimensions as interleaved pairs (mla_rotary_interleaved=True, :935-952, rope_utils.py:126-136),
# transformers' rope_interleave true (modeling :310-346, :452-453); YaRN's frequencies, attention factor and defaults
# (yarn_rotary_pos_embedding.py; modeling_rope_utils.py _compute_yarn_parameters); the router's expert_bias is
# e_score_correction_bias, added to the scores to choose the experts and not to weigh them (moe_utils.py:862-865;
# modeling :137, :153); --moe-router-topk-scaling-factor is routed_scaling_factor.


def yarn_mscale(scale: float, mscale: float) -> float:
    """YaRN's attention-temperature factor, the same formula on both sides (megatron-core's _yarn_get_mscale,
    transformers' yarn_get_mscale)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_yarn_constants() -> dict:
    """megatron-core's MLATransformerConfig YaRN settings that no flag of ours sets (config.py refuses
    --yarn-original-max-position-embeddings, --yarn-beta-fast, --yarn-beta-slow), as transformers names them."""
    from megatron.core.transformer import MLATransformerConfig

    fields = MLATransformerConfig.__dataclass_fields__
    return {name: fields[name].default for name in ("original_max_position_embeddings", "beta_fast", "beta_slow")}


def first_k_dense(m) -> int:
    """The layers before the first MoE layer: transformers' first_k_dense_replace (all of them: a dense model)."""
    layers = config_lib.moe_layers(m)
    return layers.index(1) if any(layers) else len(layers)


def router_groups(m) -> tuple:
    """(n_group, topk_group) of our router: megatron-core limits the routing to groups only with
    --moe-router-group-topk (moe_utils.py:812), and choosing every group limits nothing."""
    groups, chosen = m.moe_router_num_groups, m.moe_router_group_topk
    return (groups, chosen) if chosen and chosen != groups else (1, 1)


def deepseek_v3_needs(m) -> list:
    """(fits, phrase) of what transformers' DeepSeek-V3 asks of the model beyond rope, RMSNorm and SwiGLU."""
    needs = [(m.multi_latent_attention, "multi-latent attention (--multi-latent-attention)"),
             (m.q_lora_rank is not None, "a query latent (--q-lora-rank)"),
             (m.qk_layernorm, "RMSNorm on the query and key-value latents (--qk-layernorm)"),
             (m.layernorm_epsilon == 1e-6, f"--norm-epsilon 1e-6, transformers' epsilon of the latents' norms whatever "
                                      f"rms_norm_eps (has {m.layernorm_epsilon:g})"),
             (not m.add_bias_linear, "no biases (add --disable-bias-linear)")]
    if m.rope_type != "yarn":
        needs += [(yarn_mscale(m.rotary_scaling_factor, m.mscale_all_dim) == 1.0,
                   f"no YaRN softmax scale without --rope-type yarn (has --rotary-scaling-factor "
                   f"{m.rotary_scaling_factor:g} --mscale-all-dim {m.mscale_all_dim:g})")]
    if not m.num_moe_experts:
        return needs
    shared, width = m.moe_shared_expert_intermediate_size, m.moe_ffn_hidden_size
    k, chosen = first_k_dense(m), m.moe_router_group_topk
    groups = router_groups(m)[0]
    return needs + [
        (config_lib.moe_layers(m)[k:] == [1] * (m.num_layers - k),
         f"dense layers only before the MoE ones (first_k_dense_replace; has --moe-layer-freq {m.moe_layer_freq})"),
        (m.moe_router_score_function == "sigmoid",
         f"a sigmoid router (has --moe-router-score-function {m.moe_router_score_function})"),
        (shared, "a shared expert (--moe-shared-expert-intermediate-size)"),
        (not shared or shared % width == 0, f"a shared expert a multiple of --moe-ffn-hidden-size {width} wide "
                                            f"(n_shared_experts; has --moe-shared-expert-intermediate-size {shared})"),
        (m.num_moe_experts // groups >= 2, "two experts or more in each group (transformers scores a group by its top 2)"),
        (groups == 1 or m.moe_router_topk // chosen == 2,
         f"groups scored by their top 2 experts, as transformers (megatron-core sums the top --moe-router-topk / "
         f"--moe-router-group-topk = {m.moe_router_topk // (chosen or 1)})"),
        (m.moe_expert_capacity_factor is None, "no token dropping (has --moe-expert-capacity-factor)")]


def choose_layout(m, wanted=None) -> str:
    """`wanted`, or else the layout the model fits; a one-line error naming what differs from each."""
    candidates = [wanted] if wanted else ["deepseek_v3"] if m.multi_latent_attention else \
        ["mixtral", "qwen3_moe"] if m.num_moe_experts else ["gpt2", "llama"]
    for layout in candidates:
        if not layout_mismatches(m, layout):
            return layout
    raise config_lib.ConfigError((f"this model does not fit the {LAYOUTS[wanted][0]} layout: " if wanted else
                                  "this model fits no transformers layout: ") + "; ".join(
        f"{LAYOUTS[layout][0]} needs {', '.join(layout_mismatches(m, layout))}" for layout in candidates))


# --------------------------------------------------------------------------------------------------
# Tensors: the fused megatron-core layout and the split transformers one
# --------------------------------------------------------------------------------------------------


def split_qkv(w: torch.Tensor, heads: int, groups: int, head_dim: int) -> tuple:
    """megatron-core's fused query/key/value rows (weight or bias), grouped per query group as
    [q_1 .. q_heads/groups, k, v], into the query rows of all heads, the key rows and the value rows."""
    per_group = heads // groups
    w = w.reshape(groups, per_group + 2, head_dim, *w.shape[1:])
    rest = w.shape[3:]
    return (w[:, :per_group].reshape(heads * head_dim, *rest), w[:, per_group].reshape(groups * head_dim, *rest),
            w[:, per_group + 1].reshape(groups * head_dim, *rest))


def join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int, head_dim: int) -> torch.Tensor:
    """The inverse of split_qkv."""
    rest = q.shape[1:]
    q = q.reshape(groups, heads // groups, head_dim, *rest)
    k, v = (x.reshape(groups, 1, head_dim, *rest) for x in (k, v))
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def moe_block(layout: str, i: int) -> str:
    """The transformers prefix of layer i's MoE block: its router is `gate`, its experts `experts.{j}`."""
    return f"model.layers.{i}.block_sparse_moe." if layout == "mixtral" else f"model.layers.{i}.mlp."


def expert_names(layout: str, i: int, j: int) -> tuple:
    """(gate, up, down) projections of expert j in layer i, as transformers names them (Mixtral: w1, w3, w2)."""
    prefix = f"{moe_block(layout, i)}experts.{j}."
    parts = ("w1", "w3", "w2") if layout == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    return tuple(f"{prefix}{p}.weight" for p in parts)


def tensor_names(layout: str, m) -> tuple:
    """([(transformers name, our name, transposed)] for each tensor copied as-is, besides the fused ones and the
    embedding; the embedding's transformers name; the output layer's, or None when it is tied)."""
    tied = not m.untie_embeddings_and_output_weights
    if layout == "gpt2":
        names = [("transformer.wpe.weight", "embedding.position_embeddings.weight", False),
                 ("transformer.ln_f.weight", "decoder.final_layernorm.weight", False),
                 ("transformer.ln_f.bias", "decoder.final_layernorm.bias", False)]
        for i in range(m.num_layers):
            hf, ours = f"transformer.h.{i}.", f"decoder.layers.{i}."
            for kind in ("weight", "bias"):  # GPT-2's Conv1D stores (in, out): transposed
                names += [(f"{hf}ln_1.{kind}", f"{ours}input_layernorm.{kind}", False),
                          (f"{hf}ln_2.{kind}", f"{ours}pre_mlp_layernorm.{kind}", False),
                          (f"{hf}attn.c_proj.{kind}", f"{ours}self_attention.linear_proj.{kind}", kind == "weight"),
                          (f"{hf}mlp.c_fc.{kind}", f"{ours}mlp.linear_fc1.{kind}", kind == "weight"),
                          (f"{hf}mlp.c_proj.{kind}", f"{ours}mlp.linear_fc2.{kind}", kind == "weight")]
    else:
        names = [("model.norm.weight", "decoder.final_layernorm.weight", False)]
        for i, moe in enumerate(config_lib.moe_layers(m)):
            hf, ours = f"model.layers.{i}.", f"decoder.layers.{i}."
            names += [(f"{hf}input_layernorm.weight", f"{ours}input_layernorm.weight", False),
                      (f"{hf}post_attention_layernorm.weight", f"{ours}pre_mlp_layernorm.weight", False)]
            if layout == "deepseek_v3":
                names += deepseek_v3_layer_names(m, i, moe)
                continue
            if layout == "qwen3_moe":  # RMSNorm over each head's queries and keys
                names += [(f"{hf}self_attn.{p}_norm.weight", f"{ours}self_attention.{p}_layernorm.weight", False)
                          for p in "qk"]
            for kind in ("weight", "bias") if m.add_bias_linear else ("weight",):
                names += [(f"{hf}self_attn.o_proj.{kind}", f"{ours}self_attention.linear_proj.{kind}", False)]
                if not moe:
                    names += [(f"{hf}mlp.down_proj.{kind}", f"{ours}mlp.linear_fc2.{kind}", False)]
            if moe:  # the router, and each expert's output projection
                names += [(f"{moe_block(layout, i)}gate.weight", f"{ours}mlp.router.weight", False)]
                names += [(expert_names(layout, i, j)[2], f"{ours}mlp.experts.local_experts.{j}.linear_fc2.weight", False)
                          for j in range(m.num_moe_experts)]
    embedding = "transformer.wte.weight" if layout == "gpt2" else "model.embed_tokens.weight"
    return names, embedding, None if tied else "lm_head.weight"


def deepseek_v3_layer_names(m, i: int, moe: bool) -> list:
    """tensor_names' rows of layer i of the DeepSeek-V3 layout: MLA's projections and latent norms (one tensor each
    side, in the same row order: see the notes above yarn_mscale), and the MLP's unfused tensors."""
    hf, ours = f"model.layers.{i}.", f"decoder.layers.{i}."
    attention = [("q_a_proj", "linear_q_down_proj"), ("q_a_layernorm", "q_layernorm"), ("q_b_proj", "linear_q_up_proj"),
                 ("kv_a_proj_with_mqa", "linear_kv_down_proj"), ("kv_a_layernorm", "kv_layernorm"),
                 ("kv_b_proj", "linear_kv_up_proj"), ("o_proj", "linear_proj")]
    names = [(f"{hf}self_attn.{theirs}.weight", f"{ours}self_attention.{name}.weight", False)
             for theirs, name in attention]
    if not moe:
        return names + [(f"{hf}mlp.down_proj.weight", f"{ours}mlp.linear_fc2.weight", False)]
    names += [(f"{hf}mlp.gate.weight", f"{ours}mlp.router.weight", False),
              (f"{hf}mlp.gate.e_score_correction_bias", f"{ours}mlp.router.expert_bias", False),
              (f"{hf}mlp.shared_experts.down_proj.weight", f"{ours}mlp.shared_experts.linear_fc2.weight", False)]
    return names + [(expert_names("deepseek_v3", i, j)[2], f"{ours}mlp.experts.local_experts.{j}.linear_fc2.weight",
                     False) for j in range(m.num_moe_experts)]


def fused_names(layout: str, m, i: int) -> list:
    """(our fused name, transformers names it splits into) of layer i: the query/key/value projection (and,
    past GPT-2, SwiGLU's gate and up projections: the dense MLP's, or each expert's)."""
    kinds = ("weight", "bias") if m.add_bias_linear else ("weight",)
    ours = f"decoder.layers.{i}."
    if layout == "gpt2":
        return [(f"{ours}self_attention.linear_qkv.{k}", [f"transformer.h.{i}.attn.c_attn.{k}"]) for k in kinds]
    hf = f"model.layers.{i}."
    names = [] if layout == "deepseek_v3" else \
        [(f"{ours}self_attention.linear_qkv.{k}", [f"{hf}self_attn.{p}_proj.{k}" for p in "qkv"]) for k in kinds]
    if config_lib.moe_layers(m)[i]:
        if layout == "deepseek_v3":  # the shared expert: SwiGLU's gate rows, then its up rows, as the experts'
            names += [(f"{ours}mlp.shared_experts.linear_fc1.weight",
                       [f"{hf}mlp.shared_experts.gate_proj.weight", f"{hf}mlp.shared_experts.up_proj.weight"])]
        return names + [(f"{ours}mlp.experts.local_experts.{j}.linear_fc1.weight", list(expert_names(layout, i, j)[:2]))
                        for j in range(m.num_moe_experts)]
    return names + [(f"{ours}mlp.linear_fc1.{k}", [f"{hf}mlp.gate_proj.{k}", f"{hf}mlp.up_proj.{k}"]) for k in kinds]


def to_hf(ours: dict, m, layout: str, vocab: int) -> dict:
    """Our model's state dict (tensor-parallel size 1) as the transformers model's, over `vocab` ids."""
    names, embedding, lm_head = tensor_names(layout, m)
    if layout == "deepseek_v3" and m.num_moe_experts and not m.moe_router_enable_expert_bias:
        # transformers' router always has its e_score_correction_bias: ours is zero without
        # --moe-router-enable-expert-bias
        zero = torch.zeros(m.num_moe_experts, dtype=torch.float32)
        ours = {**ours, **{name: zero for _, name, _ in names if name.endswith("mlp.router.expert_bias")}}
    out = {hf: (ours[name].t() if transposed else ours[name]) for hf, name, transposed in names}
    out[embedding] = ours["embedding.word_embeddings.weight"][:vocab]
    if lm_head:
        out[lm_head] = ours["output_layer.weight"][:vocab]
    shape = (m.num_attention_heads, m.num_query_groups, m.kv_channels)
    for i in range(m.num_layers):
        for name, hf_names in fused_names(layout, m, i):
            if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
                parts = split_qkv(ours[name], *shape)
                if layout == "gpt2":  # one (in, out) matrix: all queries, then all keys, then all values
                    joined = torch.cat(parts)
                    parts = [joined.t() if name.endswith("weight") else joined]
            else:
                parts = torch.chunk(ours[name], 2)  # SwiGLU: gate rows, then up rows
            out.update(zip(hf_names, parts))
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def from_hf(hf: dict, m, layout: str, rows: int, rope_interleave: bool = True) -> dict:
    """The transformers model's tensors as our model's state dict (tensor-parallel size 1), the embedding
    (and output layer) padded with zero rows to our `rows`. `rope_interleave` false (DeepSeek-V3): its rotary rows
    rotate as halves, which the rows' order turns into megatron-core's interleaved pairs (interleave_rotary_rows)."""
    names, embedding, lm_head = tensor_names(layout, m)
    ours = {name: (hf[key].t() if transposed else hf[key]) for key, name, transposed in names}
    if layout == "deepseek_v3" and not rope_interleave:
        interleave_rotary_rows(ours, m)

    def padded(w):
        return torch.cat([w, w.new_zeros(rows - w.shape[0], w.shape[1])])

    ours["embedding.word_embeddings.weight"] = padded(hf[embedding])
    if lm_head:
        ours["output_layer.weight"] = padded(hf[lm_head])
    shape = (m.num_attention_heads, m.num_query_groups, m.kv_channels)
    for i in range(m.num_layers):
        for name, hf_names in fused_names(layout, m, i):
            parts = [hf[k] for k in hf_names]
            if layout == "gpt2":
                joined = parts[0].t() if name.endswith("weight") else parts[0]
                parts = torch.chunk(joined, 3)
            ours[name] = join_qkv(*parts, *shape) if "linear_qkv" in name else torch.cat(parts)
    return {k: v.contiguous() for k, v in ours.items()}


def interleave_rotary_rows(ours: dict, m) -> None:
    """transformers' DeepSeek-V3 with rope_interleave false rotates each rotary row r (of d) with row r + d/2 at
    frequency r (rotate_half, modeling :277-307); megatron-core's MLA rotates rows 2r and 2r + 1 at frequency r and
    returns them in the order [the pairs' first rows, their second rows] (rope_utils.py:126-136), that of
    rotate_half's output. So the rows interleaved, hf row r to our 2r and hf row r + d/2 to our 2r + 1, give the same
    rotated query and key, in the same order: in each head's query rows (after its qk_head_dim rows without position)
    and in the shared rotary key rows of linear_kv_down_proj (after the kv_lora_rank latent)."""
    d, heads = m.qk_pos_emb_head_dim, m.num_attention_heads

    def interleaved(rotary):  # [d, ...] -> [d, ...]
        return torch.stack([rotary[:d // 2], rotary[d // 2:]], dim=1).reshape(rotary.shape)

    for i in range(m.num_layers):
        name = f"decoder.layers.{i}.self_attention.linear_q_up_proj.weight"
        q = ours[name].reshape(heads, m.qk_head_dim + d, -1)
        ours[name] = torch.cat([q[:, :m.qk_head_dim], torch.stack([interleaved(h) for h in q[:, m.qk_head_dim:]])],
                               dim=1).reshape(ours[name].shape)
        name = f"decoder.layers.{i}.self_attention.linear_kv_down_proj.weight"
        ours[name] = torch.cat([ours[name][:m.kv_lora_rank], interleaved(ours[name][m.kv_lora_rank:])])


# --------------------------------------------------------------------------------------------------
# config.json and our flags
# --------------------------------------------------------------------------------------------------


def hf_config(m, layout: str, vocab: int, eod: int, dtype: torch.dtype) -> dict:
    """config.json for the transformers model of `m` (a GPTModelProvider) with `vocab` ids."""
    common = dict(vocab_size=vocab, bos_token_id=eod, eos_token_id=eod, initializer_range=m.init_method_std,
                  tie_word_embeddings=not m.untie_embeddings_and_output_weights, dtype=str(dtype).split(".")[-1])
    if layout == "deepseek_v3":
        return deepseek_v3_config(m, common)
    if layout == "gpt2":
        return dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", n_positions=m.max_position_embeddings,
                    n_embd=m.hidden_size, n_layer=m.num_layers, n_head=m.num_attention_heads,
                    n_inner=m.ffn_hidden_size, activation_function=hf_activation(m),
                    layer_norm_epsilon=m.layernorm_epsilon, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
    common.update(hidden_size=m.hidden_size, num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
                  num_key_value_heads=m.num_query_groups, head_dim=m.kv_channels, hidden_act="silu",
                  max_position_embeddings=m.max_position_embeddings, rms_norm_eps=m.layernorm_epsilon,
                  rope_theta=float(m.rotary_base),
                  rope_parameters=dict(rope_type="default", rope_theta=float(m.rotary_base)))
    if layout == "llama":
        return dict(architectures=["LlamaForCausalLM"], model_type="llama", intermediate_size=m.ffn_hidden_size,
                    attention_bias=m.add_bias_linear, mlp_bias=m.add_bias_linear, **common)
    common.update(num_experts_per_tok=m.moe_router_topk, output_router_logits=False, sliding_window=None)
    if layout == "mixtral":
        return dict(architectures=["MixtralForCausalLM"], model_type="mixtral", intermediate_size=m.moe_ffn_hidden_size,
                    num_local_experts=m.num_moe_experts, router_jitter_noise=0.0, **common)
    dense = [i for i, moe in enumerate(config_lib.moe_layers(m)) if not moe]
    return dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", intermediate_size=m.ffn_hidden_size,
                moe_intermediate_size=m.moe_ffn_hidden_size, num_experts=m.num_moe_experts, decoder_sparse_step=1,
                mlp_only_layers=dense, norm_topk_prob=not m.moe_router_pre_softmax, attention_bias=False,
                use_sliding_window=False, **common)


def deepseek_v3_config(m, common: dict) -> dict:
    """config.json of the DeepSeek-V3 layout (`common`: hf_config's keys of every layout)."""
    if m.rope_type == "yarn":  # written out whole, the attention factor too: megatron-core's, whatever the mscales
        rope = dict(rope_type="yarn", rope_theta=float(m.rotary_base), factor=float(m.rotary_scaling_factor),
                    mscale=float(m.mscale), mscale_all_dim=float(m.mscale_all_dim), truncate=True,
                    attention_factor=yarn_mscale(m.rotary_scaling_factor, m.mscale) /
                    yarn_mscale(m.rotary_scaling_factor, m.mscale_all_dim), **mla_yarn_constants())
    else:
        rope = dict(rope_type="default", rope_theta=float(m.rotary_base))
    moe = {}
    if m.num_moe_experts:
        groups, chosen = router_groups(m)
        moe = dict(n_routed_experts=m.num_moe_experts, num_experts_per_tok=m.moe_router_topk, n_group=groups,
                   topk_group=chosen, moe_intermediate_size=m.moe_ffn_hidden_size,
                   n_shared_experts=m.moe_shared_expert_intermediate_size // m.moe_ffn_hidden_size,
                   routed_scaling_factor=float(m.moe_router_topk_scaling_factor or 1.0),
                   norm_topk_prob=m.moe_router_topk > 1)  # megatron-core renormalises the top k > 1 sigmoid scores
    return dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=m.hidden_size,
                num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
                num_key_value_heads=m.num_attention_heads, intermediate_size=m.ffn_hidden_size, hidden_act="silu",
                max_position_embeddings=m.max_position_embeddings, rms_norm_eps=m.layernorm_epsilon, rope_parameters=rope,
                rope_interleave=True, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
                qk_nope_head_dim=m.qk_head_dim, qk_rope_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim,
                first_k_dense_replace=first_k_dense(m), attention_bias=False, attention_dropout=0.0,
                num_nextn_predict_layers=0, **moe, **common)


def flags_from_hf(c: dict, where: str) -> tuple:
    """(layout, train.py's model flags) for a transformers config.json `c`; a one-line error for what our
    GPTModel cannot express."""
    def refuse(what):
        raise config_lib.ConfigError(f"{where}: {what}, which this GPTModel cannot express")

    tied = c.get("tie_word_embeddings", True)
    if c.get("model_type") == "gpt2":
        act = c.get("activation_function", "gelu_new")
        if act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            refuse(f"activation_function {act}")
        if c.get("scale_attn_by_inverse_layer_idx") or c.get("reorder_and_upcast_attn"):
            refuse("scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn")
        h, positions = c["n_embd"], c.get("n_positions", 1024)
        flags = ["--num-layers", c["n_layer"], "--hidden-size", h, "--num-attention-heads", c["n_head"],
                 "--ffn-hidden-size", c.get("n_inner") or 4 * h, "--norm-epsilon", c.get("layer_norm_epsilon", 1e-5)]
        flags += ["--openai-gelu"] if act != "gelu" else []
        return "gpt2", flags + ["--max-position-embeddings", positions, "--seq-length", positions] + \
            ([] if tied else ["--untie-embeddings-and-output-weights"])
    kind = c.get("model_type")
    if kind not in LAYOUTS:
        raise config_lib.ConfigError(f"{where}: model_type {kind!r}; hf.py reads the "
                                     f"{', '.join(list(LAYOUTS)[:-1])} layouts and {list(LAYOUTS)[-1]}")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    if rope.get("rope_type", "default") != "default" and not (kind == "deepseek_v3" and rope["rope_type"] == "yarn"):
        refuse(f"rope_type {rope['rope_type']} (a rescaled rope)")
    if c.get("hidden_act", "silu") != "silu":
        refuse(f"hidden_act {c['hidden_act']}")
    if kind == "llama" and c.get("attention_bias", False) != c.get("mlp_bias", False):
        refuse("attention_bias without mlp_bias (or the reverse): --disable-bias-linear covers both")
    if kind != "llama" and c.get("attention_bias"):
        refuse("attention_bias (its experts have no biases, and --disable-bias-linear covers both)")
    if c.get("sliding_window") and c.get("use_sliding_window", kind == "mixtral"):
        refuse(f"sliding_window {c['sliding_window']} (attention over a window)")
    if theta != int(theta):
        refuse(f"rope_theta {theta} (not an integer, as --rotary-base)")
    if kind == "deepseek_v3":
        return kind, deepseek_v3_flags(c, rope, int(theta), tied, refuse)
    heads, positions = c["num_attention_heads"], c.get("max_position_embeddings", 2048)
    flags = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
             "--num-layers", c["num_hidden_layers"], "--hidden-size", c["hidden_size"], "--num-attention-heads", heads,
             "--num-query-groups", c.get("num_key_value_heads") or heads, "--ffn-hidden-size", c["intermediate_size"],
             "--kv-channels", c.get("head_dim") or c["hidden_size"] // heads, "--norm-epsilon", c.get("rms_norm_eps", 1e-6),
             "--rotary-base", int(theta), "--max-position-embeddings", positions, "--seq-length", positions]
    flags += [] if c.get("attention_bias", False) else ["--disable-bias-linear"]
    flags += [] if tied else ["--untie-embeddings-and-output-weights"]
    return kind, flags + (moe_flags_from_hf(c, kind, refuse) if kind != "llama" else [])


def deepseek_v3_flags(c: dict, rope: dict, theta: int, tied: bool, refuse) -> list:
    """train.py's model flags for a DeepSeek-V3 config.json (flags_from_hf has checked the activation, the biases and
    the rope's kind and base); `refuse` for what the notes above yarn_mscale say differs."""
    heads, layers, positions = c["num_attention_heads"], c["num_hidden_layers"], c.get("max_position_embeddings", 4096)
    if c.get("num_key_value_heads", heads) != heads:
        refuse(f"num_key_value_heads {c['num_key_value_heads']} for {heads} heads (MLA's keys and values are per head)")
    if c.get("q_lora_rank") is None:
        refuse("q_lora_rank null (queries without a latent: the local layers build the key-value latent's norm, "
               "--qk-layernorm, only with a query latent)")
    if c.get("rms_norm_eps", 1e-6) != 1e-6:
        refuse(f"rms_norm_eps {c['rms_norm_eps']} (the latents' norms use 1e-6, ours all one --norm-epsilon)")
    flags = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
             "--num-layers", layers, "--hidden-size", c["hidden_size"], "--num-attention-heads", heads,
             "--ffn-hidden-size", c["intermediate_size"], "--norm-epsilon", 1e-6, "--rotary-base", theta,
             "--max-position-embeddings", positions, "--seq-length", positions,
             "--multi-latent-attention", "--q-lora-rank", c["q_lora_rank"], "--kv-lora-rank", c["kv_lora_rank"],
             "--qk-head-dim", c["qk_nope_head_dim"], "--qk-pos-emb-head-dim", c["qk_rope_head_dim"],
             "--v-head-dim", c["v_head_dim"], "--qk-layernorm"]
    flags += [] if tied else ["--untie-embeddings-and-output-weights"]
    if rope.get("rope_type", "default") == "default":
        flags += ["--rope-type", "rope"]
    else:  # transformers' YaRN (modeling_rope_utils.py, _compute_yarn_parameters) as megatron-core's
        constants = mla_yarn_constants()
        given = dict(original_max_position_embeddings=rope.get("original_max_position_embeddings"),
                     beta_fast=rope.get("beta_fast") or 32, beta_slow=rope.get("beta_slow") or 1)
        for key, value in given.items():
            if value != constants[key]:
                refuse(f"rope_parameters {key} {value} (megatron-core's YaRN here keeps {constants[key]})")
        if not rope.get("truncate", True) or rope.get("partial_rotary_factor", 1.0) != 1.0:
            refuse("rope_parameters truncate false or partial_rotary_factor (YaRN's range unrounded, or a partial "
                   "rope)")
        factor = rope.get("factor") or positions / constants["original_max_position_embeddings"]
        mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        theirs = rope.get("attention_factor") or (yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
                                                  if mscale and all_dim else yarn_mscale(factor, 1))
        mscale, all_dim = 1.0 if mscale is None else mscale, all_dim or 0.0
        ours = yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
        if not math.isclose(theirs, ours, rel_tol=1e-12):
            refuse(f"a YaRN attention factor of {theirs:g} (megatron-core's is yarn_mscale(factor, mscale) / "
                   f"yarn_mscale(factor, mscale_all_dim) = {ours:g})")
        flags += ["--rope-type", "yarn", "--rotary-scaling-factor", factor, "--mscale", mscale,
                  "--mscale-all-dim", all_dim]
    dense = c.get("first_k_dense_replace", 0)
    if dense >= layers:  # no MoE layer: a dense model with multi-latent attention
        return flags
    experts, topk = hf_experts(c), c["num_experts_per_tok"]
    groups, chosen = c.get("n_group") or 1, c.get("topk_group") or 1
    if not c.get("n_shared_experts"):
        refuse("n_shared_experts 0 (no shared expert: hf.py's DeepSeek-V3 layout has one, as DeepSeek-V3)")
    if c.get("norm_topk_prob", True) != (topk > 1):
        refuse(f"norm_topk_prob {c.get('norm_topk_prob', True)} with num_experts_per_tok {topk} (megatron-core's "
               f"sigmoid router renormalises the top k weights exactly when k > 1)")
    if chosen < groups and topk // chosen != 2:
        refuse(f"n_group {groups} with topk_group {chosen} and num_experts_per_tok {topk} (transformers scores each "
               f"group by its top 2 experts, megatron-core by its top num_experts_per_tok / topk_group = "
               f"{topk // chosen})")
    flags += ["--num-experts", experts, "--moe-router-topk", topk, "--moe-ffn-hidden-size", c["moe_intermediate_size"],
              "--moe-shared-expert-intermediate-size", c["moe_intermediate_size"] * c["n_shared_experts"],
              "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
              "--moe-layer-freq", "[" + ",".join(["0"] * dense + ["1"] * (layers - dense)) + "]"]
    flags += ["--moe-router-num-groups", groups, "--moe-router-group-topk", chosen] if chosen < groups else []
    scale = c.get("routed_scaling_factor", 1.0)
    return flags + ([] if scale == 1.0 else ["--moe-router-topk-scaling-factor", scale])


def hf_experts(c: dict) -> int:
    """The number of routed experts a transformers MoE config.json gives (Qwen3-MoE's num_experts is saved as
    num_local_experts, Mixtral's name; DeepSeek-V3's is n_routed_experts)."""
    return c.get("num_local_experts") or c.get("num_experts") or c.get("n_routed_experts") or 0


def moe_flags_from_hf(c: dict, kind: str, refuse) -> list:
    """train.py's MoE flags for a Mixtral or Qwen3-MoE config.json: the experts, their size, the routing, and
    (Qwen3-MoE) the q/k norms and which layers are dense."""
    experts, layers = hf_experts(c), c["num_hidden_layers"]
    if c.get("router_jitter_noise"):
        refuse(f"router_jitter_noise {c['router_jitter_noise']} (jitter on the experts' input too)")
    flags = ["--num-experts", experts, "--moe-router-topk", c["num_experts_per_tok"]]
    if kind == "mixtral":
        return flags + ["--moe-ffn-hidden-size", c["intermediate_size"]]
    if c.get("shared_expert_intermediate_size"):
        refuse(f"shared_expert_intermediate_size {c['shared_expert_intermediate_size']}")
    step, dense = c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers") or [])
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    if not any(pattern):
        refuse("no MoE layer (mlp_only_layers / decoder_sparse_step)")
    flags += ["--moe-ffn-hidden-size", c["moe_intermediate_size"], "--qk-layernorm"]
    flags += [] if all(pattern) else ["--moe-layer-freq", "[" + ",".join(map(str, pattern)) + "]"]
    return flags + ([] if c.get("norm_topk_prob", True) else ["--moe-router-pre-softmax"])


# --------------------------------------------------------------------------------------------------
# The commands
# --------------------------------------------------------------------------------------------------


@device.in_shim  # megatron-core on this machine, for the call (device.py)
def export(load: str, out: str, ckpt_step=None, layout=None) -> str:
    """Write the checkpoint as a transformers directory `out` in `layout` (None: the one it fits); returns it."""
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise config_lib.ConfigError("export runs in one process (python hf.py export ...), not under torchrun")
    directory = checkpoint.resolve_load_dir(load, ckpt_step)
    if directory is not None:  # the layout from run_config.yaml, before any weight loads
        layout = choose_layout(generate.inference_config(directory, 1).model, layout)
    model, tokenizer, cfg = generate.load_model(load, ckpt_step)
    vocab = tokenizer.vocab_size  # the ids text can have: the pad row past them and the TP padding are dropped
    tensors = to_hf(model.state_dict(), cfg.model, layout, vocab)
    if cfg.model.mtp_num_layers:  # (only the DeepSeek-V3 layout admits them)
        print(f"hf.py: note: the {cfg.model.mtp_num_layers} multi-token prediction layer(s) are not exported: "
              f"DeepseekV3ForCausalLM has no module for them (num_nextn_predict_layers 0); the decoder is exported "
              f"whole")
    os.makedirs(out, exist_ok=True)
    dtype = model.embedding.word_embeddings.weight.dtype
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(hf_config(cfg.model, layout, vocab, tokenizer.eod, dtype), fh, indent=2)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    if getattr(tokenizer, "file", None):  # a Hugging Face tokenizer: transformers' fast tokenizer reads it as is
        shutil.copyfile(tokenizer.file, os.path.join(out, "tokenizer.json"))
        eos = tokenizer._tokenizer.id_to_token(tokenizer.eod)
        with open(os.path.join(out, "tokenizer_config.json"), "w") as fh:
            json.dump(dict(tokenizer_class="PreTrainedTokenizerFast", eos_token=eos, bos_token=eos,
                           model_max_length=cfg.model.max_position_embeddings), fh, indent=2)
    return layout


def safetensors_files(directory: str) -> list:
    """The safetensors files of a transformers directory: model.safetensors, or the shards its index names."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as fh:
            files = sorted(set(json.load(fh)["weight_map"].values()))
    elif os.path.isfile(os.path.join(directory, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        pickled = [f for f in os.listdir(directory) if f.endswith(".bin")]
        raise config_lib.ConfigError(f"--hf {directory}: no model.safetensors" + (
            f" ({pickled[0]} is pickled, which can run code when read; save it as safetensors with transformers' "
            f"save_pretrained first)" if pickled else ""))
    return [os.path.join(directory, name) for name in files]


def check_experts(files: list, hf: dict, layout: str, where: str) -> None:
    """Each MoE layer's experts in the files (their names, read from the headers: no tensor loads) are the
    config.json's count; a one-line error naming both otherwise."""
    if layout not in ("mixtral", "qwen3_moe", "deepseek_v3") or \
            hf.get("first_k_dense_replace", 0) >= hf["num_hidden_layers"]:  # (a DeepSeek-V3 without MoE layers)
        return
    found = {}
    for path in files:
        with safe_open(path, "pt") as fh:
            for name in fh.keys():
                match = re.match(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.", name)
                if match:
                    found.setdefault(int(match[1]), set()).add(int(match[2]))
    expected = hf_experts(hf)
    for layer, experts in sorted(found.items()):
        if experts != set(range(expected)):
            raise config_lib.ConfigError(f"{where}: num_experts is {expected}, but layer {layer} of the weights has "
                                         f"{len(experts)} experts (numbered {min(experts)} to {max(experts)})")
    if not found:
        raise config_lib.ConfigError(f"{where}: {expected} experts, but the weights hold none")


def transformers_config(directory: str, path: str) -> dict:
    """config.json as transformers reads it: its config class fills every key the file leaves out with that class's
    default (Qwen3-MoE's norm_topk_prob is False, LLaMA's tie_word_embeddings False, ...), and turns older spellings
    into today's (rope_theta into rope_parameters). A model_type transformers does not know: the file as it is, for
    flags_from_hf to name."""
    import transformers

    with open(path) as fh:
        raw = json.load(fh)
    try:
        return transformers.AutoConfig.from_pretrained(directory).to_dict()
    except (ValueError, KeyError):
        return raw


@device.in_shim  # megatron-core on this machine, for the call (device.py)
def import_hf(directory: str, save: str) -> str:
    """A checkpoint (iteration 0, weights only) in `save` from the transformers directory; returns its iter_* path."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise config_lib.ConfigError(f"--hf {directory}: no config.json")
    hf = transformers_config(directory, path)
    layout, flags = flags_from_hf(hf, path)
    if os.path.isfile(os.path.join(directory, "tokenizer.json")):
        flags += ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", directory]
    else:  # ids only: the rows of the model's vocabulary, the last as end-of-document (a NullTokenizer's)
        flags += ["--tokenizer-type", "NullTokenizer", "--vocab-size", hf["vocab_size"]]
    flags += ["--transformer-impl", "local", "--mock-data", "--save", save, "--train-iters", "0"]
    cfg = checks.config_from_flags([str(f) for f in flags], world_size=1)
    checks.check_fits_in_memory(cfg)  # its weights, on this machine
    files = safetensors_files(directory)
    check_experts(files, hf, layout, path)
    if not torch.distributed.is_initialized():
        initialize_distributed(cfg)
    tokenizer = data.build_tokenizer(cfg)
    if tokenizer.vocab_size > hf["vocab_size"]:
        raise config_lib.ConfigError(f"{directory}: its tokenizer has {tokenizer.vocab_size} ids, its model "
                                     f"{hf['vocab_size']}")
    model = build_model(cfg, data.embedding_rows(tokenizer))
    tensors = {}
    for file in files:
        tensors.update(load_file(file))
    ours = from_hf(tensors, cfg.model, layout, model[0].embedding.word_embeddings.weight.shape[0],
                   rope_interleave=hf.get("rope_interleave", True))
    extra = sorted({int(match[1]) for name in tensors if (match := re.match(r"model\.layers\.(\d+)\.", name))
                    and int(match[1]) >= cfg.model.num_layers})
    if extra:  # DeepSeek-V3's multi-token prediction layers, past the decoder's (transformers does not run them either)
        print(f"hf.py: note: layer(s) {', '.join(map(str, extra))} of the weights (DeepSeek-V3's multi-token "
              f"prediction) are not imported: the checkpoint is the {cfg.model.num_layers}-layer decoder without "
              f"--mtp-num-layers")
    missing = model[0].load_state_dict(ours, strict=False).missing_keys
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise config_lib.ConfigError(f"{directory}: no tensor for {missing[0]}")
    state = types.SimpleNamespace(cfg=cfg, train_state=TrainState(), tokenizer=tokenizer)
    return checkpoint.save_checkpoint(state, model, None, None)


def main(args) -> int:
    try:
        if args.command == "export":
            layout = export(args.load, args.out, args.ckpt_step, args.layout)
            print(f"hf.py: wrote {args.out} ({layout} layout): AutoModelForCausalLM.from_pretrained({args.out!r})")
        else:
            directory = import_hf(args.hf, args.save)
            print(f"hf.py: wrote {directory}: train from it with train.py --config-file {directory}/run_config.yaml "
                  f"--pretrained-checkpoint {args.save} --save NEW_DIR --train-iters N [--data-path ...]")
    except (config_lib.ConfigError, checkpoint.CheckpointError) as e:
        sys.stderr.write(f"hf.py: error: {e}\n")
        return 2
    except KeyError as e:  # a config.json without a field its model_type must have
        sys.stderr.write(f"hf.py: error: config.json has no {e}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
