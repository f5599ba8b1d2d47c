"""model.py: the megatron-core GPT and the engine that trains it: megatron-core's own, on every machine.

The config classes are Megatron Bridge's; the rest builds what Megatron-LM's `get_model`,
`core_transformer_config_from_args` and `_set_random_seed` build, and the way they build it.

    piece                     what runs (GPU and CPU alike)
    ------------------------  ----------------------------------------------------------------------------
    model                     megatron-core GPTModel, its tensor-parallel layers, pipeline stages and
                              virtual (interleaved) stages; transformer-engine layers when installed on a GPU
    core attention            SDPAttention (PyTorch SDPA: flash kernels on a GPU), or megatron-core's own
                              DotProductAttention with --attention-backend local; TE's under transformer-engine
    mixed precision           Float16Module (bf16/fp16 weights), fp32 main weights in the optimizer
    data-parallel wrapper     megatron.core DistributedDataParallel (grad buffers, --overlap-grad-reduce)
    optimizer                 megatron.core get_megatron_optimizer (--use-distributed-optimizer, loss scalers)
    forward/backward          megatron.core get_forward_backward_func (no pipelining, 1F1B, interleaved)
    RNG                       megatron.core's CUDA RNG tracker (dropout inside tensor-parallel regions)
    result validation         megatron.core RerunStateMachine

On a machine without CUDA, device.py's shim answers megatron-core's CUDA calls on the CPU (its docstring
lists each one): the CPU runs the GPU's code path, and the tests exercise what a GPU user runs.
"""

import contextlib
import copy
import dataclasses
import functools
import os
import random
import re
import time
import uuid
import warnings
from datetime import timedelta
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

import device  # first: it quiets megatron-core's import-time warnings
from config import (MEGATRON_LM_EMERGING_OPTIMIZERS, ConfigError, OptimizerConfigOverrideProviderContext, backend,
                    moe_layers)
from megatron.core import parallel_state, tensor_parallel
from megatron.core import rerun_state_machine as mcore_rerun
from megatron.core.distributed import DistributedDataParallel, TorchFullyShardedDataParallel, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func as mcore_get_forward_backward_func
from megatron.core.transformer import MegatronModule, TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnBackend, AttnMaskType
from megatron.core.transformer.module import Float16Module
from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.utils import unwrap_model
from megatron.training.vocab_utils import calculate_padded_vocab_size


# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------


class Norm(torch.nn.Module):
    """The local layers' LayerNorm or RMSNorm (torch's arithmetic, `F.layer_norm` / `F.rms_norm`, and torch's
    parameter names, `weight` and LayerNorm's `bias`, as megatron-core's WrappedTorchNorm builds them), which also
    runs under sequence parallelism.

    WrappedTorchNorm asserts that sequence parallelism is off (transformer/torch_norm.py:50), although a norm
    acts on each token alone and needs nothing from the other tokens. What sequence parallelism asks of a norm is
    what megatron-core's TE and apex norms do: mark the weights `sequence_parallel`, so that finalize_model_grads
    sums their gradients, computed on each rank's part of the sequence, over the tensor-parallel group.

    megatron-core's norm arguments: `normalization` (None: the config's) picks the kind; `persist_layer_norm` picks
    apex's persistent kernel, the same arithmetic, which torch's norms have no need of (accepted, as megatron-core's
    torch norm does); `zero_centered_gamma` (and the config's layernorm_zero_centered_gamma) is transformer-engine's
    and refused (config.py refuses --apply-layernorm-1p on the local layers first)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: Optional[str] = None):
        super().__init__()
        if zero_centered_gamma or config.layernorm_zero_centered_gamma:
            raise ValueError("model.Norm: zero-centred gamma needs transformer-engine's norms")
        self.normalization = normalization or config.normalization
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"model.Norm: normalization {self.normalization!r}; LayerNorm or RMSNorm")
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size)) if self.normalization == "LayerNorm" else None
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel

    def forward(self, x):
        if self.normalization == "LayerNorm":
            return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)
        return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)


class SDPAttention(MegatronModule):
    """Core attention through `torch.nn.functional.scaled_dot_product_attention`.

    Drop-in for megatron-core's local `DotProductAttention`, which allocates its buffers on
    `torch.cuda.current_device()` and has no flash kernel: SDPA runs on CPU and picks flash or
    memory-efficient kernels on a GPU. Takes `[s, b, heads, head_dim]` and returns `[s, b, heads*head_dim]`.

    Under context parallelism (megatron-core's `cp_comm_type all_gather` contract; its own DotProductAttention
    refuses CP) each rank holds two chunks of the sequence, `r` and `2 x CP - 1 - r` of `2 x CP` (the batch was cut
    by megatron-core's `get_batch_on_this_cp_rank`): its queries attend to the keys and values of the whole
    sequence, gathered from the CP group (the gather's backward reduce-scatters their gradients back), under a
    causal mask offset by each chunk's position.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type=None, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, k_channels=None, v_channels=None):
        # k_channels, v_channels: multi-latent attention's query/key and value head widths (SDPA reads them off the
        # tensors).
        super().__init__(config=config)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale  # None: 1/sqrt(head_dim), SDPA's default
        self.attn_mask_type = attn_mask_type
        cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        self.cp_group = cp if cp is not None else parallel_state.get_context_parallel_group(check_initialized=False)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        assert packed_seq_params is None and attention_bias is None, "SDPAttention: packed sequences are not supported"
        s, b = query.shape[0], query.shape[1]
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if self.cp_group is not None and self.cp_group.size() > 1:
            key, value = (gather_context_parallel_chunks(x, self.cp_group) for x in (key, value))
            if attention_mask is None and mask_type == AttnMaskType.causal:
                attention_mask = context_parallel_causal_mask(s, self.cp_group, query.device)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # -> [b, heads, s, d]
        kwargs = dict(dropout_p=self.dropout_p if self.training else 0.0, scale=self.softmax_scale,
                      enable_gqa=k.shape[1] != q.shape[1])
        # --deterministic-mode on a GPU: the flash and memory-efficient kernels may accumulate gradients
        # in a varying order; the math kernel is plain matmuls and softmax.
        kernels = contextlib.nullcontext()
        if self.config.deterministic_mode and q.is_cuda:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            kernels = sdpa_kernel(SDPBackend.MATH)
        # Dropout's masks: each tensor-parallel rank holds other heads, so each draws its own, from the RNG tracker's
        # tensor-parallel stream, as megatron-core's DotProductAttention does (dot_product_attention.py:216-218);
        # under sequence parallelism from the default generator, as there. (SDPA draws from the default generator:
        # seeded alike on every TP rank, its heads would all get the same masks.)
        rng = contextlib.nullcontext()
        if kwargs["dropout_p"] > 0 and not self.config.sequence_parallel:
            rng = tensor_parallel.get_cuda_rng_tracker().fork()
        with kernels, rng:
            if attention_mask is None:
                # megatron-core's rule (fused_softmax.py:323): a causal mask only where several query positions
                # attend to each other. A decode step's one new query (megatron passes no_mask then) sees every
                # cached key; SDPA's causal mask, aligned top-left, would show it only the first.
                causal = mask_type == AttnMaskType.causal and s > 1
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, **kwargs)
            else:  # megatron masks mark positions to drop with True; SDPA's boolean masks mark positions to keep
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, **kwargs)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


# The core attentions the project ships: what transformer-engine layers, flash decoding and `hf.py export` stand in for.
STOCK_CORE_ATTENTIONS = (SDPAttention, DotProductAttention)


def context_parallel_chunk_order(cp_size: int) -> list:
    """Which of the sequence's 2 x CP chunks each CP rank holds, rank by rank: r and 2 x CP - 1 - r (megatron-core's
    load-balanced layout, `get_batch_on_this_cp_rank`: causal attention's work is then even over the ranks)."""
    return [chunk for r in range(cp_size) for chunk in (r, 2 * cp_size - 1 - r)]


def gather_context_parallel_chunks(x: torch.Tensor, cp_group) -> torch.Tensor:
    """`[s/CP, b, ...]` on each CP rank -> `[s, b, ...]` in sequence order: megatron-core's all-gather along the
    first dimension (its backward reduce-scatters the gradients to the ranks that hold the chunks), then the
    gathered chunks put back in order."""
    cp = cp_group.size()
    gathered = tensor_parallel.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=cp_group)
    order = torch.tensor(context_parallel_chunk_order(cp), device=x.device).argsort()
    chunks = gathered.view(2 * cp, gathered.shape[0] // (2 * cp), *gathered.shape[1:])
    return chunks.index_select(0, order).view(gathered.shape)


def context_parallel_causal_mask(local_len: int, cp_group, device) -> torch.Tensor:
    """The causal mask of this CP rank's queries (its two chunks) over the whole sequence's keys, in megatron's
    convention (True: masked): a query at sequence position p sees the keys at positions 0..p."""
    cp, rank, chunk = cp_group.size(), cp_group.rank(), local_len // 2
    query_positions = torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device)
                                 for c in (rank, 2 * cp - 1 - rank)])
    key_positions = torch.arange(2 * cp * chunk, device=device)
    return key_positions[None, :] > query_positions[:, None]


def transformer_config(cfg) -> TransformerConfig:
    """megatron-core's TransformerConfig: the model section (config.GPTModelProvider), finalized. A copy: the section
    keeps the settings as given, which run_config.yaml holds (finalize() adds megatron-core's derived fields and this
    machine's answers, such as CPU initialisation without a GPU, which must not travel to another run)."""
    config = copy.deepcopy(cfg.model)
    config.finalize()
    return config


def core_attention(m):
    """The local layers' core attention for the model settings `m`, chosen here only (a fork's own goes here: docs/fork.md): SDPAttention, or
    megatron-core's DotProductAttention where --attention-backend local asks for it. What does not run it refuses a
    class not in STOCK_CORE_ATTENTIONS in one line (transformer-engine layers, `hf.py export`); flash decoding, which
    bypasses it, is left for the plain cached decoding, which runs it (generate.flash_decoding_applies)."""
    return DotProductAttention if backend(m.attention_backend) is AttnBackend.local else SDPAttention


def layer_spec(cfg, num_experts: Optional[int] = None):
    """One transformer layer, its MLP an MoE layer of `num_experts` experts when given. transformer-engine layers when
    asked for (the default on a GPU with TE installed), else megatron-core's local layers, with SDPAttention as the
    core attention unless --attention-backend local asks for megatron-core's own DotProductAttention, Norm
    (sequence parallelism too) as their norms, and SequentialExperts as the MoE layer's experts."""
    m = cfg.model
    if m.transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        own = core_attention(m)  # TE's layers run TE's core attention: a fork's own would be skipped
        if own not in STOCK_CORE_ATTENTIONS:
            raise ConfigError(f"the core attention {own.__name__} (model.core_attention) is a local layer's; "
                              f"transformer-engine layers run their own: add --transformer-impl local")

        return get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, moe_grouped_gemm=m.moe_grouped_gemm,
                                                          qk_layernorm=m.qk_layernorm, qk_l2_norm=m.qk_l2_norm,
                                                          multi_latent_attention=m.multi_latent_attention)
    # --qk-layernorm / --qk-l2-norm: the spec's q/k norms (Megatron-LM's gpt_builders passes the local spec no
    # qk_l2_norm, which leaves it without effect there; here it means on the local layers what it means on TE's).
    spec = get_gpt_layer_local_spec(num_experts=num_experts, normalization=m.normalization, qk_layernorm=m.qk_layernorm,
                                    qk_l2_norm=m.qk_l2_norm, multi_latent_attention=m.multi_latent_attention)
    layer, attention = spec.submodules, spec.submodules.self_attention.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = Norm
    if m.qk_layernorm and not m.qk_l2_norm and m.multi_latent_attention:
        # MLA's are the norms of its latents (config.py refuses a query norm without a query latent on these layers)
        attention.q_layernorm = attention.kv_layernorm = Norm
    elif m.qk_layernorm and not m.qk_l2_norm:
        attention.q_layernorm = attention.k_layernorm = Norm
    attention.core_attention = core_attention(m)
    if num_experts:  # the MLP is a builder, partial(MoELayer, submodules=MoESubmodules(experts=partial(...), ...))
        moe = layer.mlp.keywords["submodules"]
        mlp = dataclasses.replace(moe.experts.keywords["submodules"], linear_fc2=ExpertRowParallelLinear)
        experts = functools.partial(SequentialExperts, submodules=mlp)
        layer.mlp = functools.partial(layer.mlp.func, submodules=dataclasses.replace(moe, experts=experts))
    return spec


def block_spec(cfg, config: TransformerConfig, vp_stage: Optional[int]):
    """The decoder block of one model chunk: one layer spec per layer it builds (an MoE layer where --num-experts and
    --moe-layer-freq put one, as Megatron-LM's get_gpt_decoder_block_spec places them), and the final norm
    (megatron-core picks the block's norm by what is installed; on the local layers it is Norm here)."""
    m = cfg.model
    if m.transformer_impl == "transformer_engine" and not m.num_moe_experts:
        return layer_spec(cfg)
    dense, moe = layer_spec(cfg), layer_spec(cfg, m.num_moe_experts) if m.num_moe_experts else None
    kinds, first = moe_layers(m), get_transformer_layer_offset(config, vp_stage=vp_stage)
    layers = [moe if kinds[first + i] else dense for i in range(get_num_layers_to_build(config, vp_stage=vp_stage))]
    if m.transformer_impl == "transformer_engine":
        from megatron.core.extensions.transformer_engine import TENorm

        return TransformerBlockSubmodules(layer_specs=layers, layer_norm=TENorm)
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=Norm)


def mtp_block_spec(cfg, config: TransformerConfig, vp_stage: Optional[int]):
    """Multi-token prediction's modules (--mtp-num-layers), on the last pipeline stage (None elsewhere): each
    megatron-core's MultiTokenPredictionLayer, its transformer layer of the decoder's last layer's kind (dense or MoE,
    as Megatron-LM's gpt_builders picks it), its projection of [norm(embedding); norm(hidden)] to the hidden size,
    and its norms, Norm here as in the decoder (megatron-core's local choice asserts that sequence parallelism is
    off)."""
    m = cfg.model
    last = layer_spec(cfg, m.num_moe_experts if m.num_moe_experts and moe_layers(m)[-1] else None)
    te = m.transformer_impl == "transformer_engine"
    spec = get_gpt_mtp_block_spec(config, last, use_transformer_engine=te, vp_stage=vp_stage)
    if spec is not None and not te:
        for layer in spec.layer_specs:
            layer.submodules.enorm = layer.submodules.hnorm = layer.submodules.layer_norm = Norm
    return spec


class SequentialExperts(SequentialMLP):
    """megatron-core's SequentialMLP (each local expert an MLP, run one after another), whose experts are the same
    weights for any expert-parallel size.

    With CPU initialisation megatron-core draws each local expert's weights from the one CPU generator, without the
    expert-parallel RNG stream: at EP=2 rank 1's experts are copies of rank 0's, and the draws after them (the next
    layers) depend on the EP size (Megatron-LM behaves the same). Here each MoE layer takes one seed from the model's
    stream, and draws the experts from it in global order: this rank builds the experts before its own too and
    drops them, so its experts are what one process holds at their global index."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None, name=None):
        if not (config.use_cpu_initialization and config.perform_initialization):
            super().__init__(num_local_experts, config, submodules, pg_collection, name)  # each rank its own stream
            return
        seed = int(torch.randint(2 ** 62, ()))  # one draw from the model's stream, whatever the EP size
        super().__init__(0, config, submodules, pg_collection, name)  # the config, the groups; the experts below
        first = self.ep_group.rank() * num_local_experts
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for index in range(first + num_local_experts):
                expert = MLP(self.config, submodules, ffn_hidden_size=self.config.moe_ffn_hidden_size, is_expert=True,
                             tp_group=pg_collection.expt_tp,
                             name=None if name is None else f"{name}.local_experts.{index - first}")
                if index >= first:
                    self.local_experts.append(expert)
        self.num_local_experts = num_local_experts

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        """megatron-core's, except without autograd (generate.py, evaluation): an expert that received no token is
        skipped instead of run on an empty batch. A decode step routes its one token to the top-k experts, so the
        others would run on nothing (with 8 experts and top-2, 6 of 8 calls per layer), and transformers' MoE blocks
        skip them too. Training runs every expert: megatron-core's DDP waits for every parameter's gradient."""
        c = self.config
        if torch.is_grad_enabled() or self.num_local_experts == 1 or c.moe_apply_probs_on_input or c.fp8 or c.fp4:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        outputs, start = [], 0
        for expert, n in zip(self.local_experts, tokens_per_expert.tolist()):  # the tokens come grouped by expert
            if n:
                outputs.append(expert(permuted_local_hidden_states[start:start + n], permuted_probs[start:start + n])[0])
                start += n
        return (torch.cat(outputs) if outputs else permuted_local_hidden_states[:0]), None


class ExpertRowParallelLinear(RowParallelLinear):
    """An expert's output projection that leaves its output to the token dispatcher, as megatron-core's does with
    expert or expert-tensor parallelism, at EP=1 and ETP=1 too; and whose bias gradient is not summed over the
    tensor-parallel group a second time.

    At EP=1 and ETP=1 megatron-core passes the output through `_ReduceFromModelParallelRegion`, which returns its input
    unchanged for a group of one; megatron-core's MLP then adds the expert bias to it in place (mlp.py:354), and
    autograd refuses an in-place change of an autograd Function's returned input. With one rank there is nothing to
    reduce.

    megatron-core marks the bias `sequence_parallel` under --sequence-parallel (tensor_parallel/layers.py:1413), so
    finalize_model_grads sums its gradient over the tensor-parallel group (finalize_model_grads.py:449-460). An expert's
    gradient is complete once DDP has reduced it over the expert data-parallel group, which holds those ranks: the sum
    doubled it at TP=2 (megatron-core defect, README: defects)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.explicit_expert_comm = self.is_expert
        if self.bias is not None and self.is_expert:
            self.bias.sequence_parallel = False


def vocab_parallel_logsumexp(logits: torch.Tensor, tp_group) -> torch.Tensor:
    """log(sum over the vocabulary of exp(logits)), from this rank's slice of the vocabulary: [s, b, v/tp] -> [s, b].

    The trap: tensor parallelism splits the vocabulary (the output layer is a ColumnParallelLinear that does not gather
    its output), so a sum over the vocabulary is a sum over the tensor-parallel group too, as megatron-core's
    vocab-parallel cross-entropy does it (tensor_parallel/cross_entropy.py:130-150). The maximum is a constant shift
    for exp's range (no gradient: log-sum-exp's is the softmax whatever the shift); the sum goes through
    megatron-core's reduce_from_tensor_model_parallel_region, an all-reduce whose backward passes the gradient
    through, since every rank of the group computes the same loss from the sum."""
    top = logits.detach().max(dim=-1).values
    torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=tp_group)
    sum_exp = torch.exp(logits - top.unsqueeze(-1)).sum(dim=-1)
    return torch.log(tensor_parallel.reduce_from_tensor_model_parallel_region(sum_exp, group=tp_group)) + top


class GPTModelWithZLoss(GPTModel):
    """megatron-core's GPTModel with a z-loss term (--z-loss-coeff; PaLM, Chowdhery et al. 2022, section 5: it pulls
    the softmax's log-normaliser towards 0), through megatron-core's seam for a loss on the logits:
    compute_language_model_loss (language_module.py:155), which GPTModel.forward calls with the labels and the output
    layer's logits (gpt_model.py:794). It returns per token [cross-entropy, coeff x logsumexp(logits)^2], stacked on a
    last dimension, for train.masked_token_loss to add and report. Only the main head's: with --mtp-num-layers
    megatron-core calls the same method for each MTP head's logits and wants one loss per token (refused, checks)."""

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        # First: megatron-core's cross-entropy overwrites the logits in place (cross_entropy.py:42 and 62)
        z = self.config.z_loss_coeff * vocab_parallel_logsumexp(logits.float(), self.tp_group).square()
        cross_entropy = super().compute_language_model_loss(labels, logits)  # [b, s]
        return torch.stack([cross_entropy, z.transpose(0, 1)], dim=-1)  # [s, b] -> [b, s]


def build_model(cfg, vocab_size: int) -> list:
    """The GPT, as a list of model chunks: one, or one per virtual pipeline stage (interleaved schedule).

    Pipeline stages build only their layers: the first holds the embedding, the last the output layer.
    """
    m = cfg.model
    config = transformer_config(cfg)
    vpp = m.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = dict(ignore_virtual=False, vp_stage=vp_stage) if vpp else {}
        chunks.append((GPTModelWithZLoss if m.z_loss_coeff else GPTModel)(
            config=config,
            transformer_layer_spec=block_spec(cfg, config, vp_stage if vpp else None),
            vocab_size=calculate_padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by,
                                                   m.tensor_model_parallel_size, logging_enabled=False),
            max_sequence_length=m.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(**stage),
            post_process=parallel_state.is_pipeline_last_stage(**stage),
            share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
            position_embedding_type=m.position_embedding_type,
            rotary_percent=m.rotary_percent,
            rotary_base=m.rotary_base,
            seq_len_interpolation_factor=m.rotary_seq_len_interpolation_factor,
            mtp_block_spec=mtp_block_spec(cfg, config, vp_stage if vpp else None) if m.mtp_num_layers else None,
            vp_stage=vp_stage if vpp else None,
        ))
    if device.cuda():
        for chunk in chunks:
            chunk.cuda(torch.cuda.current_device())
    return chunks


# --------------------------------------------------------------------------------------------------
# Data parallelism
# --------------------------------------------------------------------------------------------------


def wrap_model(cfg, model: list) -> list:
    """Wrap each chunk in Float16Module (--bf16/--fp16: half-precision weights, fp32 outputs) and then in
    megatron-core's DistributedDataParallel, whose contiguous grad buffers the optimizer reads. Every data-parallel
    replica then starts from rank 0's weights."""
    if cfg.model.bf16 or cfg.model.fp16:
        model = [Float16Module(m.config, m) for m in model]
    if cfg.dist.use_torch_fsdp2:
        return [torch_fsdp2(m) for m in model]
    ddp_config = megatron_ddp_config(cfg)
    if ddp_config.use_megatron_fsdp:
        return [megatron_fsdp(m, ddp_config) for m in model]
    layouts = [None] * len(model)  # without a distributed optimizer, none
    if ddp_config.use_distributed_optimizer:
        # What Megatron-LM's wrap_model_chunks_with_ddp does (megatron/training/training.py:1635-1682): the layout of
        # the distributed optimizer's buffers comes from the optimizer's class; megatron-core's DDP asks its callers
        # for it, else computes it with a warning (megatron/core/distributed/distributed_data_parallel.py:132-139).
        # The layer-wise one tags each parameter with its optimizer and lays out its buffers so no matrix straddles
        # two ranks.
        if layer_wise(cfg):
            from megatron.core.optimizer.layer_wise_optimizer import (
                LayerWiseDistributedOptimizer as Optimizer, tag_params_for_buffer_routing)

            tag_params_for_buffer_routing(model)
        else:
            from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as Optimizer
        dp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        # The layout fixes the buckets, so it takes the bucket size megatron-core's DDP would settle on, resolved as
        # Megatron-LM resolves it first (training.py:1552-1567): --ddp-bucket-size or max(40M, 1M x DP x CP)
        # parameters with --overlap-grad-reduce, one bucket without; and one bucket for the chunks after the first
        # and on the pipeline stages after the first (training.py:1857-1866).
        size = (ddp_config.bucket_size or max(40_000_000, 1_000_000 * dp)) if ddp_config.overlap_grad_reduce else None
        later_stage = parallel_state.get_pipeline_model_parallel_rank() > 0
        layouts = [Optimizer.compute_full_param_layout(
            [p for p in m.parameters() if p.requires_grad], None if i > 0 or later_stage else size, dp, ddp_config,
            expert_data_parallel_world_size=parallel_state.get_expert_data_parallel_world_size())
            for i, m in enumerate(model)]
    # Only the first chunk overlaps its reduce in buckets: the others' gradients are ready together at the end.
    model = [DistributedDataParallel(config=unwrap_model(m).config, ddp_config=ddp_config, module=m,
                                     disable_bucketing=i > 0, full_param_layout=layouts[i])
             for i, m in enumerate(model)]
    for m in model:
        m.broadcast_params()
    return model


def megatron_fsdp(module, ddp_config):
    """A chunk in megatron-core's Megatron FSDP (--use-megatron-fsdp), as Megatron-LM's get_model builds it
    (training.py:1695-1702): each data-parallel rank holds a shard of what --data-parallel-sharding-strategy says,
    gathered for the forward and backward where the parameters are sharded (each TransformerLayer a unit). It
    rewrites the overlap settings of the config it is given (megatron_fsdp.py:326-337), so it gets a copy. No
    broadcast of rank 0's weights: every replica draws the same ones from the same seed, and its parameters are
    sharded DTensors that torch's broadcast does not take (Megatron-LM broadcasts only with
    --data-parallel-random-init)."""
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    chunk = FullyShardedDataParallel(config=unwrap_model(module).config, ddp_config=copy.deepcopy(ddp_config),
                                     module=module)
    if chunk.config.fp16:
        for name in ("finish_grad_sync", "scale_gradients"):
            setattr(chunk, name, empty_shard_grads_kept(chunk, getattr(chunk, name)))
    return chunk


def empty_shard_grads_kept(chunk, sets_grads):
    """`sets_grads` (Megatron FSDP's finish_grad_sync or scale_gradients), then an empty gradient, for the loss scaler,
    on each optimizer parameter whose shard on this rank is empty. Megatron FSDP attaches None there
    (megatron_fsdp/param_and_grad_buffer.py:3393-3394), and under --fp16 the distributed optimizer unscales every
    parameter's `.grad.data` (optimizer/distrib_optimizer.py:2602-2606): an AttributeError at the first step
    (megatron-core defect, README: defects)."""
    def wrapped(*args, **kwargs):
        sets_grads(*args, **kwargs)
        for _, param in chunk.param_and_grad_buffer.optimizer_named_parameters:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
    return wrapped


def torch_fsdp2(module):
    """A chunk in torch's FSDP2 through megatron-core's TorchFullyShardedDataParallel (--use-torch-fsdp2), as
    Megatron-LM's get_model builds it (training.py:1980-1982, 1695-1702): `fully_shard` on each TransformerLayer, the
    embedding and the root, over the data-parallel (x context-parallel) ranks, resharding after the forward (its
    default). The parameters become DTensors sharded along their first dimension; megatron-core's ordinary optimizer
    steps them (Megatron-LM refuses its distributed optimizer here)."""
    from megatron.core.distributed.torch_fully_sharded_data_parallel_config import TorchFullyShardedDataParallelConfig

    return TorchFSDP2(config=unwrap_model(module).config, ddp_config=TorchFullyShardedDataParallelConfig(),
                      module=module)


class TorchFSDP2(TorchFullyShardedDataParallel):
    """megatron-core's TorchFullyShardedDataParallel with the scale_gradients it lacks: the base class's does nothing
    (data_parallel_base.py:45-47), so the per-token loss's division by the global token count
    (finalize_model_grads.py:693-696) never happened (megatron-core defect, README: defects). That division wants the
    ranks' gradients summed, as megatron-core's DDP sums them under the per-token loss (distributed_data_parallel.py:179);
    FSDP2 has averaged them over its mesh, so they are multiplied back by its size."""

    def scale_gradients(self, scaling_factor) -> None:
        scaling_factor = scaling_factor * self.device_mesh.size()
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad.mul_(scaling_factor)


# --------------------------------------------------------------------------------------------------
# The optimizer
# --------------------------------------------------------------------------------------------------


def megatron_optimizer_config(cfg, timers=None):
    """The optimizer section, a megatron-core OptimizerConfig, with what the model decides filled in (its precision,
    the DDP's parameter gather, the run's timers, which time the optimizer's inner phases at --timing-log-level 1
    and 2), finalized."""
    m = cfg.model
    config = dataclasses.replace(
        cfg.optimizer, bf16=m.bf16, fp16=m.fp16,
        params_dtype=torch.bfloat16 if m.bf16 else torch.float16 if m.fp16 else torch.float32,
        overlap_param_gather=cfg.ddp.overlap_param_gather, log_num_zeros_in_grad=cfg.logger.log_num_zeros_in_grad,
        timers=timers)
    if layer_wise(cfg):  # Megatron-LM's arguments.py:1679-1681: the distributed optimizer of an emerging one
        config.use_distributed_optimizer, config.use_layer_wise_distributed_optimizer = False, True
    config.finalize()
    return config


def layer_wise(cfg) -> bool:
    """--use-distributed-optimizer with an emerging optimizer (Muon, ...): megatron-core's LayerWiseDistributedOptimizer,
    as Megatron-LM 0.19 builds it. Each data-parallel rank updates whole matrices (Newton-Schulz needs a whole one) and
    the ranks gather them after the step; megatron-core's DistributedOptimizer shards what Adam updates, byte-wise."""

    return cfg.optimizer.optimizer in MEGATRON_LM_EMERGING_OPTIMIZERS and cfg.optimizer.use_distributed_optimizer


def megatron_ddp_config(cfg):
    """The ddp section, a megatron-core DistributedDataParallelConfig, finalized. validate() has derived its gradient
    dtype (grad_reduce_in_fp32), its distributed optimizer and its NaN check (check_for_nan_in_grad: each gradient
    bucket checked for NaN and Inf before the data-parallel reduce, as Megatron-LM sets it from
    --check-for-nan-in-loss-and-grad, training.py:1989; param_and_grad_buffer.py:339-374, 649;
    RerunStateMachine.validate_result says who acts)."""
    m = cfg.model
    config = dataclasses.replace(cfg.ddp, grad_reduce_in_fp32=(m.bf16 or m.fp16) if cfg.ddp.grad_reduce_in_fp32 is None
                                 else cfg.ddp.grad_reduce_in_fp32,
                                 param_name_patterns_for_fp32_local_accumulation=tuple(
                                     cfg.ddp.param_name_patterns_for_fp32_local_accumulation))
    config.finalize()
    return config


def check_emerging_optimizer_installed(cfg) -> None:
    """--optimizer NAME of Megatron-LM's emerging optimizers is built from megatron-core's registry, which holds its
    own muon and adaptive_muon and what the installed emerging-optimizers package registers
    (megatron/core/optimizer/emerging_optimizers.py:463-501), from version 0.2 on (megatron/core/optimizer/__init__.py:45).
    A name it lacks is one line here, before any model is built, not megatron-core's error after it."""

    name = cfg.optimizer.optimizer
    if name not in MEGATRON_LM_EMERGING_OPTIMIZERS:
        return
    from importlib.metadata import version

    from megatron.core.optimizer import HAVE_EMERGING_OPTIMIZERS
    from megatron.core.optimizer.emerging_optimizers import _EMERGING_OPTIMIZERS

    have = sorted(_EMERGING_OPTIMIZERS) if HAVE_EMERGING_OPTIMIZERS else []
    if name.removeprefix("dist_") not in have:
        raise ConfigError(f"--optimizer {name}: the installed emerging-optimizers {version('emerging-optimizers')} "
                          f"does not provide it to megatron-core (it has: {', '.join(have) or 'none'}); "
                          f"pip install --upgrade emerging-optimizers")


@functools.cache
def adaptive_muon_class():
    """megatron-core's TensorParallelAdaptiveMuon as emerging-optimizers 0.3.0's AdaptiveMuon.step expects it.

    Defect (megatron-core 0.19.2, optimizer/emerging_optimizers.py:361-402): the class runs TensorParallelMuon's
    __init__, whose orthogonalization already multiplies by Muon's scale factor, and never sets `scale_mode` and
    `extra_scale_factor`, which AdaptiveMuon.step reads to scale the update *after* the second-moment normalization
    (emerging_optimizers/orthogonalized_optimizers/adaptive_muon.py:122, 324): the first step raises AttributeError.
    Setting the two attributes alone would scale twice, once before the normalization (which, for adamuon,
    divides it out again) and once after by the shard's shape instead of the matrix's.

    Here, as AdaptiveMuon does on one device: the tensor-parallel Newton-Schulz (megatron-core's newton_schulz_tp, the
    same call as TensorParallelMuon's) without a scale, then the second moment, then Muon's scale by the whole
    matrix's shape (the shard's under --muon-tp-mode blockwise, where each shard is its own matrix, as
    TensorParallelMuon scales it)."""
    from emerging_optimizers.orthogonalized_optimizers.muon import get_muon_scale_factor
    from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz_tp
    from megatron.core.optimizer.emerging_optimizers import TensorParallelAdaptiveMuon as MegatronCoresAdaptiveMuon
    from megatron.core.utils import get_pg_size

    class TensorParallelAdaptiveMuon(MegatronCoresAdaptiveMuon):  # megatron-core's name, on the log line
        def __init__(self, params, *, num_ns_steps=5, coefficient_type="quintic", scale_mode="spectral",
                     extra_scale_factor=1.0, tp_mode="duplicated", **kwargs):
            super().__init__(params, num_ns_steps=num_ns_steps, coefficient_type=coefficient_type,
                             scale_mode=scale_mode, extra_scale_factor=extra_scale_factor, tp_mode=tp_mode, **kwargs)
            self.scale_mode, self.extra_scale_factor, self.whole_shape = scale_mode, extra_scale_factor, None

            def orthogonalize_unscaled(grad, tp_group, partition_dim=None):
                return newton_schulz_tp(grad, steps=num_ns_steps, coefficient_type=coefficient_type, tp_group=tp_group,
                                        partition_dim=partition_dim,
                                        tp_mode="duplicated" if tp_mode == "blockwise" else tp_mode)
            self.scaled_orthogonalize_fn = orthogonalize_unscaled

        def orthogonalize(self, p, grad, **kwargs):
            shape, dim = list(p.shape[-2:]), getattr(p, "partition_dim", None)
            if self.tp_mode != "blockwise" and dim in (0, 1) and self.pg_collection is not None:
                shape[dim] *= get_pg_size(self.pg_collection.expt_tp if getattr(p, "expert_tp", False)
                                          else self.pg_collection.tp)
            self.whole_shape = shape  # read by _apply_muon_scale, which step calls next for the same parameter
            return super().orthogonalize(p, grad, **kwargs)

        def _apply_muon_scale(self, update, size_out, size_in):
            return update * get_muon_scale_factor(*self.whole_shape, mode=self.scale_mode) * self.extra_scale_factor

    return TensorParallelAdaptiveMuon


@contextlib.contextmanager
def megatron_cores_adaptive_muon_mended():
    """megatron-core's registry of emerging optimizers builds adaptive_muon_class() for the time of one
    get_megatron_optimizer call, then its own class again."""
    from megatron.core.optimizer.emerging_optimizers import _EMERGING_OPTIMIZERS

    entry = _EMERGING_OPTIMIZERS["adaptive_muon"]
    own, entry.optimizer_cls = entry.optimizer_cls, adaptive_muon_class()
    try:
        yield
    finally:
        entry.optimizer_cls = own


class SignSGD(torch.optim.Optimizer):
    """docs/fork.md's optimizer of one's own: sign-SGD with a momentum buffer (signum). m = beta m + (1 - beta) g,
    then every weight moves by lr, by the sign of m alone, after a decoupled weight decay, as AdamW's."""

    def __init__(self, params, lr=1e-3, momentum=0.9, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:  # lr and weight_decay are set each step by megatron-core's scheduler
            for p in group["params"]:
                if p.grad is not None:
                    m = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                    m.lerp_(p.grad, 1 - group["momentum"])
                    p.mul_(1 - group["lr"] * group["weight_decay"]).add_(m.sign(), alpha=-group["lr"])


def momentum_buffers(optimizer, config=None) -> None:
    """The state a load fills in: megatron-core's sharded_state_dict asks its init_state_fn for every tensor before
    loading (optimizer.py:1362). torch's SGD names its buffer momentum_buffer, and keeps none without momentum."""
    for group in optimizer.param_groups:
        if group["momentum"]:
            for p in group["params"]:
                optimizer.state[p].setdefault("momentum_buffer", torch.zeros_like(p))


# Optimizers of this project's own: each goes into megatron-core's registry of emerging optimizers, whose path
# builds it (optimizer/emerging_optimizers.py:3-9 says how), wrapped for bf16 and checkpointed as Muon is. Its name
# also goes into config.py's --optimizer choices. An empty default_param_overrides: it updates every parameter.
OWN_OPTIMIZERS = {
    "signsgd": dict(optimizer_cls=SignSGD, init_state_fn=momentum_buffers, default_param_overrides={},
                    config_to_kwargs=lambda c, *_: dict(lr=c.lr, momentum=c.sgd_momentum, weight_decay=c.weight_decay)),
}


def check_optimizer_state(cfg) -> None:
    """What megatron-core 0.19.2 does not build or save for the optimizer asked for, one line before any process
    group: its DistributedOptimizer shards Adam's and Lion's state only (distrib_optimizer.py:687-694, 804-815: it
    asserts for SGD); its emerging-optimizer path, which builds this project's own, refuses fp16
    (optimizer/__init__.py:769); torch_dist saves an optimizer's state sharded as its weights, and SOAP's
    preconditioners are square (dist_checkpointing/optimizer.py:100 asserts at the first save)."""

    o, ck, name = cfg.optimizer, cfg.checkpoint, cfg.optimizer.optimizer
    if (name == "sgd" or name in OWN_OPTIMIZERS) and o.use_distributed_optimizer:
        raise ConfigError(f"--optimizer {name} with --use-distributed-optimizer: megatron-core's distributed optimizer "
                          f"shards Adam's and Lion's state only; drop --use-distributed-optimizer")
    if name in OWN_OPTIMIZERS and cfg.model.fp16:
        raise ConfigError(f"--optimizer {name} with --fp16: megatron-core's emerging-optimizer path, which builds it, "
                          f"does not support fp16; use --bf16")
    if name == "soap" and ck.save and ck.save_optim and ck.ckpt_format == "torch_dist":
        raise ConfigError("--optimizer soap with --ckpt-format torch_dist: megatron-core saves an optimizer's state "
                          "shaped as its weights, and SOAP's preconditioners are not; add --ckpt-format torch (or "
                          "--no-save-optim)")


def build_optimizer(cfg, model: list, timers=None):
    """megatron-core's optimizer (`get_megatron_optimizer`): torch AdamW/SGD inside, wrapped for fp32 main
    weights and loss scaling (--bf16/--fp16) or sharded over data-parallel ranks (--use-distributed-optimizer).

    The parameter groups come from megatron-core's grouping of the overrides that
    `cfg.optimizer_config_override_provider` returns (by default: no weight decay on biases and 1-D
    parameters, `wd_mult` 0, as Megatron does).
    """

    config = megatron_optimizer_config(cfg, timers)
    context = OptimizerConfigOverrideProviderContext(scheduler_config=cfg.scheduler, optimizer_config=config, model=model)
    overrides = cfg.optimizer_config_override_provider.build_config_overrides(context)
    from megatron.core.optimizer.emerging_optimizers import _EMERGING_OPTIMIZERS, EmergingOptimizerEntry

    _EMERGING_OPTIMIZERS.update({name: EmergingOptimizerEntry(**entry) for name, entry in OWN_OPTIMIZERS.items()})
    with megatron_cores_adaptive_muon_mended() if config.optimizer == "adaptive_muon" else contextlib.nullcontext():
        optimizer = get_megatron_optimizer(config, model, config_overrides=overrides)
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(inner.optimizer, torch.optim.SGD) and inner.init_state_fn is None:
            # megatron-core 0.19.2 gives SGD none (optimizer/__init__.py:617-624): loading its state raised TypeError
            inner.init_state_fn = momentum_buffers
    device.fused_cpu_adam(optimizer)
    return optimizer


def who_updates_what(model: list, optimizer) -> str:
    """One line per optimizer megatron-core built (an emerging optimizer chains its own with the one of what it does
    not update): its class, how many tensors and parameters, and their names (layer numbers as *)."""
    from megatron.core.optimizer import DistributedOptimizer
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

    names = {id(p): name for chunk in model for name, p in chunk.named_parameters()}
    lines = []
    for outer in getattr(optimizer, "chained_optimizers", [optimizer]):
        # the layer-wise distributed optimizer chains this rank's share of the matrices (a whole matrix each)
        sharded = isinstance(outer, (LayerWiseDistributedOptimizer, DistributedOptimizer))
        for inner in outer.chained_optimizers if isinstance(outer, LayerWiseDistributedOptimizer) else [outer]:
            if hasattr(inner, "model_float16_groups"):  # the distributed optimizer: the model's tensors it shards
                groups = inner.model_float16_groups + inner.model_fp32_groups
            elif hasattr(inner, "float16_groups"):  # --bf16: the model's own tensors beside their fp32 main copies
                groups = inner.float16_groups + inner.fp32_from_fp32_groups
            else:
                groups = [group["params"] for group in inner.optimizer.param_groups]
            params = [p for group in groups for p in group]
            kinds = sorted({re.sub(r"\.\d+\.", ".*.", re.sub(r"^(module\.)+", "", names[id(p)])) for p in params
                            if id(p) in names})  # the names inside the DDP (and Float16Module) wrappers
            lines.append(f" > {type(inner.optimizer).__name__} updates {len(params)} tensors "
                         f"({sum(p.numel() for p in params) / 1e6:.2f}M parameters"
                         f"{', sharded over the data-parallel ranks' if sharded else ''}): {', '.join(kinds)}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Forward and backward over the microbatches of one step
# --------------------------------------------------------------------------------------------------


def get_forward_backward_func(model: list, optimizer, timers=None):
    """megatron-core's schedule for this run: no pipelining, 1F1B across pipeline stages, or the interleaved
    1F1B over virtual stages. The schedule reads its hooks from the model config, set here: gradient sync
    deferred to the last microbatch (no_sync), then finalize_model_grads (data-parallel reduce, tied-embedding
    all-reduce); the fp16 loss scale; the timers. optimizer None: evaluation (no loss scaling, no timers)."""
    config = unwrap_model(model[0]).config
    config.no_sync_func = model[0].no_sync if len(model) == 1 else [m.no_sync for m in model]
    if not isinstance(model[0], DistributedDataParallel) and not overlapped_megatron_fsdp(model[0]):
        # Without --overlap-grad-reduce Megatron FSDP reduces in its backward hooks at the last microbatch under
        # no_sync and again in finish_grad_sync: `optim`'s gradients come out wrong (megatron_fsdp.py:1300-1313).
        # Megatron-LM sets no_sync_func only for it and DDP under --overlap-grad-reduce, and never for torch FSDP2
        # (training.py:3532-3543).
        config.no_sync_func = None
    config.finalize_model_grads_func = finalize_model_grads
    mla_q_norm = config.multi_latent_attention and config.qk_layernorm and not config.sequence_parallel
    if mla_q_norm and parallel_state.get_tensor_model_parallel_world_size() > 1:
        config.finalize_model_grads_func = finalize_model_grads_of_mla  # megatron-core's, then a defect undone
    config.grad_scale_func = optimizer.scale_loss if optimizer is not None else None
    config.timers = timers
    return mcore_get_forward_backward_func()


def overlapped_megatron_fsdp(chunk) -> bool:
    """A Megatron FSDP chunk under --overlap-grad-reduce: its backward hooks reduce at the microbatch no_sync leaves."""
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    return isinstance(chunk, FullyShardedDataParallel) and chunk.ddp_config.overlap_grad_reduce


def finalize_model_grads_of_mla(model: list, *args, **kwargs) -> None:
    """megatron-core's finalize_model_grads, then its over-count of multi-latent attention's query norm undone.

    With --qk-layernorm it sums over the tensor-parallel ranks the gradient of every parameter whose name holds
    "q_layernorm" (distributed/finalize_model_grads.py:451-452): right for dense attention's per-head query norm,
    whose heads are split over the ranks, but MLA's q_layernorm normalizes the whole query latent, whose gradient
    each rank already holds in full (the up-projection all-reduces it): summed, it is TP times the one-process
    gradient. (Under sequence parallelism each rank's norm sees its part of the sequence and the sum is right; on
    transformer-engine's layers that norm is fused into linear_q_up_proj under another name.) The ranks' copies are
    equal, so the division is exact."""
    finalize_model_grads(model, *args, **kwargs)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    for chunk in model:
        for name, param in chunk.named_parameters():
            if name.endswith("self_attention.q_layernorm.weight") and param.requires_grad:
                param.main_grad.div_(tp)


# --------------------------------------------------------------------------------------------------
# The rerun state machine (result validation)
# --------------------------------------------------------------------------------------------------


def build_rerun_state_machine(cfg) -> "RerunStateMachine":
    """megatron-core's RerunStateMachine for this run (Bridge's `init_rerun_state`), also registered as
    megatron-core's instance: its RerunDataIterator and its DDP gradient checks look it up there. A rerun
    rewinds the RNG tracker's streams (dropout in tensor-parallel regions) with the step."""
    r = cfg.rerun_state_machine

    def save():
        return {"rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}

    def restore(state):
        tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])

    machine = RerunStateMachine(
        report_interval=cfg.logger.log_interval, state_save_func=save, state_restore_func=restore,
        mode=mcore_rerun.RerunMode(r.rerun_mode),
        error_injector=mcore_rerun.RerunErrorInjector(r.error_injection_rate,
                                                      mcore_rerun.RerunDiagnostic(r.error_injection_type)))
    machine.spiky_loss_factor = r.spiky_loss_factor  # where Bridge's loss check reads it
    mcore_rerun.destroy_rerun_state_machine()  # one per run: a process may call pretrain() more than once
    mcore_rerun._set_rerun_state_machine(machine)  # initialize_rerun_state_machine() would build the base class
    return machine


class RerunStateMachine(mcore_rerun.RerunStateMachine):
    """megatron-core's RerunStateMachine (the state transitions, the comparisons, error injection, the
    spiky-loss window are all its own), with two changes: report_determinism_stats prints its statistics on the
    log every --log-interval iterations (megatron-core's own report, rerun_state_machine.py:996, goes to its
    logger at INFO, every REPORTING_INTERVAL_ITERATIONS, whatever the run's log interval; it crashed on 0.16.1,
    reading Caller fields its Caller lacked; fixed in 0.17), and a fatal result it
    would not act on is kept for the step to stop on (validate_result).
    """

    def __init__(self, *, report_interval: int, **kwargs):
        super().__init__(**kwargs)
        self.report_interval = report_interval
        self.unhandled_rejection = None  # the message of the step's first fatal result nobody else stops on

    def validate_result(self, result, rejection_func, message, comparison_func=None, tolerance=0.0, fatal=True):
        """A fatal rejection (DDP's NaN/Inf gradient check) that megatron-core would not stop on cleanly is kept in
        `unhandled_rejection`, for train_step to stop every rank before the optimizer step: in disabled mode it
        raises from inside the backward pass (rerun_state_machine.py:519-536), where the other ranks would wait in
        the data-parallel reduce; report_determinism_stats only measures, and validate_results skips a job's first
        iteration (rerun_state_machine.py:591-594). validate_results acts on the others itself: the rerun."""
        acts = self.mode == mcore_rerun.RerunMode.VALIDATE_RESULTS and self.first_iteration_complete
        if fatal and not acts and self.unhandled_rejection is None and rejection_func(result):
            self.unhandled_rejection = message
        if not fatal or self.mode != mcore_rerun.RerunMode.DISABLED:
            super().validate_result(result, rejection_func, message, comparison_func, tolerance, fatal)

    def _maybe_report_stats(self):
        """Relative differences between each validated result and its rerun, over all ranks; rank 0 keeps
        the running totals and the other ranks send theirs and start afresh, as megatron-core's does."""
        if self.current_iteration % self.report_interval:
            return
        rank = torch.distributed.get_rank()
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.gather_object(dict(self.stats), gathered if rank == 0 else None, dst=0)
        if rank != 0:
            for stats in self.stats.values():
                stats.reset()
            return
        for caller in sorted({c for s in gathered for c in s}):
            self.stats[caller].combine([s[caller] for s in gathered[1:] if caller in s])
            print(f" determinism of the {caller.message} up to iteration {self.current_iteration}, initial run vs "
                  f"rerun: {self.stats[caller].print_stats()}", flush=True)


def zero_grad(model: list, optimizer) -> None:
    """Clear gradients before a step: megatron DDP keeps them in its own buffers, the optimizer in `.grad`."""
    for m in model:
        m.zero_grad_buffer()
    with warnings.catch_warnings():
        # megatron-core's distributed optimizer clears `.grad` of its shards too, views that are not leaves, and
        # torch warns at each (megatron/core/optimizer/distrib_optimizer.py:2581 says so); Megatron-LM prints it.
        warnings.filterwarnings("ignore", message=r"The .grad attribute of a Tensor that is not a leaf Tensor")
        optimizer.zero_grad()


def initialize_distributed(cfg) -> None:
    """One process per device. torchrun sets RANK/WORLD_SIZE/MASTER_*; a plain `python train.py` is a
    world of one. Then megatron-core's tensor/pipeline/context/data-parallel groups."""
    if cfg.use_gpu and not device.cuda():
        raise ConfigError("a GPU is visible but this torch cannot use it (a CPU-only build?); install a CUDA build "
                          "of torch, or train on CPU with CUDA_VISIBLE_DEVICES=''")
    device.bind_local_gpu(cfg.use_gpu, cfg.dist.external_gpu_device_mapping)
    backend = cfg.dist.distributed_backend or device.backend()
    timeout = timedelta(minutes=cfg.dist.distributed_timeout_minutes)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's agent, which may have restarted this worker group
        store, rank, world_size = next(torch.distributed.rendezvous("env://", timeout=timeout))  # torch's own store
        store = torch.distributed.PrefixStore(f"attempt/{this_attempt(store, rank, world_size, timeout)}/", store)
        torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    elif "RANK" in os.environ:
        torch.distributed.init_process_group(backend, timeout=timeout)
    else:
        torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1,
                                             timeout=timeout)
    m = cfg.model
    # megatron-core's groups get the run's timeout too (its default is 30 minutes): a rank that hangs (stopped, or in
    # a read that never returns) then fails the others' collectives, and torchrun restarts the job.
    parallel_state.initialize_model_parallel(m.tensor_model_parallel_size, m.pipeline_model_parallel_size,
                                             m.virtual_pipeline_model_parallel_size,
                                             context_parallel_size=m.context_parallel_size,
                                             hierarchical_context_parallel_sizes=m.hierarchical_context_parallel_sizes,
                                             expert_model_parallel_size=m.expert_model_parallel_size,
                                             expert_tensor_parallel_size=m.expert_tensor_parallel_size,
                                             distributed_timeout_minutes=cfg.dist.distributed_timeout_minutes)


def this_attempt(store, rank: int, world_size: int, timeout: timedelta) -> str:
    """A name for this start of the worker group that every rank agrees on, for the keys of its process groups.

    torch defect (README: defects): torchrun's agent keeps one TCPStore for the whole job and hands it to every
    restart of the workers (elastic/rendezvous/dynamic_rendezvous.py:1193-1236), while the workers' env:// store
    assumes a new store per restart and adds no prefix (distributed/rendezvous.py:188-196). A restarted group's
    process groups then read the previous attempt's keys: the addresses of dead ranks (gloo's connectFullMesh:
    "Connection refused") or a group counter that is already there (a hang in new_group). TORCHELASTIC_RESTART_COUNT
    cannot name the attempt: each node's agent counts its own restarts (pytorch/pytorch#108158).

    So the ranks agree through the store, on keys no earlier attempt can have written: each rank announces a fresh
    random token under its rank; rank 0 answers every token it sees with its own (a stale token from a dead
    process gets an answer nobody reads) until every rank has acknowledged the answer under rank 0's token. Rank
    0's token is the attempt's name. A rank that never comes fails the others at `timeout`, and torchrun restarts."""
    token = uuid.uuid4().hex
    store.set(f"restart/hello/{rank}", token)
    if rank != 0:
        attempt = store.get(f"restart/welcome/{token}").decode()  # waits, up to the store's timeout
        store.set(f"restart/ack/{attempt}/{rank}", "")
        return attempt
    answered, acknowledged = {}, {0}
    deadline = time.monotonic() + timeout.total_seconds()
    while len(acknowledged) < world_size:
        for r in set(range(world_size)) - acknowledged:
            if store.check([f"restart/hello/{r}"]):
                seen = store.get(f"restart/hello/{r}").decode()
                if answered.get(r) != seen:
                    store.set(f"restart/welcome/{seen}", token)
                    answered[r] = seen
            if store.check([f"restart/ack/{token}/{r}"]):
                acknowledged.add(r)
        if time.monotonic() > deadline:
            raise RuntimeError(f"ranks {sorted(set(range(world_size)) - acknowledged)} did not join this attempt "
                               f"within {timeout}")
        time.sleep(0.01)
    return token


def destroy_distributed() -> None:
    """Tear down what initialize_distributed set up: the process can start another run."""
    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def set_random_seed(seed: int) -> None:
    """Seed python, numpy and torch, offset by pipeline rank so stages differ, and megatron-core's RNG
    tracker, whose per-tensor-parallel-rank streams drive dropout inside tensor-parallel regions."""
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
