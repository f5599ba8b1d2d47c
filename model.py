"""model.py: the megatron-core GPT, and the engine seam that trains it on a GPU or a CPU.

The GPT is megatron-core's own `GPTModel` everywhere, tensor-parallel layers included. What differs
between machines is the machinery around it, and every difference lives in this file:

    piece                     GPU (cfg.use_gpu)                          CPU (gloo)
    ------------------------  -----------------------------------------  ------------------------------------------
    layer spec                transformer-engine spec if installed,      local spec
                              else local spec
    core attention            TE's, or SDPAttention (flash kernels)      SDPAttention (PyTorch SDPA)
    data-parallel wrapper     megatron.core DistributedDataParallel      torch.nn.parallel.DistributedDataParallel
    optimizer                 megatron.core get_megatron_optimizer       TorchOptimizer (torch AdamW/SGD, same contract)
                              (mixed precision, distributed optimizer)
    forward/backward          megatron.core get_forward_backward_func    forward_backward_no_pipelining (below)
                              (pipeline schedules)
    mixed precision           Float16Module (bf16/fp16 weights)          bf16/fp16 autocast over fp32 weights,
                                                                         megatron-core's loss scaler for fp16
    rerun state machine       megatron.core RerunStateMachine            the same, its CUDA calls answered on CPU

Why stand-ins rather than patching torch.cuda: megatron-core 0.16.1 hard-codes CUDA in its DDP grad
buffers, optimizer, schedules and RNG tracker (see README, "Running on CPU"). The stand-ins keep the
same interfaces, so train.py above this seam never asks which machine it is on.
"""

import contextlib
import math
import random
import types
import warnings

# megatron-core warns at import that it falls back to torch kernels without apex/transformer-engine;
# that is the intended setup on CPU, so the warnings are noise here.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed.*")
warnings.filterwarnings("ignore", message=r"full scope is deprecated")  # a TransformerConfig default, not ours

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core import rerun_state_machine as mcore_rerun  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.distributed import DistributedDataParallelConfig as MegatronDDPConfig  # noqa: E402
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig  # noqa: E402
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler  # noqa: E402
from megatron.core.transformer import MegatronModule, TransformerConfig  # noqa: E402


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel_size: int) -> int:
    """Round the vocabulary up to a multiple of divisible_by x TP size, as Megatron-LM's
    `_vocab_size_with_padding` does, so the embedding splits evenly and its matmuls stay aligned."""
    multiple = divisible_by * tensor_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------


class SDPAttention(MegatronModule):
    """Core attention through `torch.nn.functional.scaled_dot_product_attention`.

    Drop-in for megatron-core's local `DotProductAttention`, which allocates its buffers on
    `torch.cuda.current_device()` and has no flash kernel: SDPA runs on CPU and picks flash or
    memory-efficient kernels on a GPU. Takes `[s, b, heads, head_dim]` and returns `[s, b, heads*head_dim]`.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type=None, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale  # None: 1/sqrt(head_dim), SDPA's default

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        assert packed_seq_params is None and attention_bias is None, "SDPAttention: packed sequences are not supported"
        s, b = query.shape[0], query.shape[1]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # -> [b, heads, s, d]
        kwargs = dict(dropout_p=self.dropout_p if self.training else 0.0, scale=self.softmax_scale,
                      enable_gqa=k.shape[1] != q.shape[1])
        # --deterministic-mode on a GPU: the flash and memory-efficient kernels may accumulate gradients
        # in a varying order; the math kernel is plain matmuls and softmax.
        kernels = contextlib.nullcontext()
        if self.config.deterministic_mode and q.is_cuda:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            kernels = sdpa_kernel(SDPBackend.MATH)
        with kernels:
            if attention_mask is None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)
            else:  # megatron masks mark positions to drop with True; SDPA's boolean masks mark positions to keep
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, **kwargs)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def transformer_config(cfg) -> TransformerConfig:
    """megatron-core's TransformerConfig from our ModelConfig (Megatron-LM's `core_transformer_config_from_args`)."""
    m = cfg.model
    gpu_half = cfg.use_gpu and (m.bf16 or m.fp16)
    dtype = torch.bfloat16 if m.bf16 else torch.float16 if m.fp16 else torch.float32
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        normalization=m.normalization,
        layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=m.swiglu,
        activation_func=F.silu if m.swiglu else F.gelu,
        add_bias_linear=m.add_bias_linear,
        tensor_model_parallel_size=m.tensor_model_parallel_size,
        pipeline_model_parallel_size=m.pipeline_model_parallel_size,
        context_parallel_size=m.context_parallel_size,
        sequence_parallel=m.sequence_parallel,
        # On CPU the weights stay fp32 and bf16/fp16 is autocast; on GPU they are half precision under
        # Float16Module and the megatron optimizer keeps fp32 main copies.
        bf16=m.bf16 and cfg.use_gpu,
        fp16=m.fp16 and cfg.use_gpu,
        params_dtype=dtype if gpu_half else torch.float32,
        pipeline_dtype=dtype if gpu_half else torch.float32,
        use_cpu_initialization=not cfg.use_gpu,
        deterministic_mode=m.deterministic_mode,  # e.g. an embedding backward without atomics
        cross_entropy_loss_fusion=m.cross_entropy_loss_fusion,
        cp_comm_type=m.cp_comm_type[0] if len(m.cp_comm_type) == 1 else m.cp_comm_type,
    )


def layer_spec(cfg):
    """transformer-engine layers when asked for (the default on a GPU with TE installed), else
    megatron-core's local layers with SDPAttention as the core attention."""
    if cfg.model.transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec()
    spec = get_gpt_layer_local_spec(normalization=cfg.model.normalization)
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def build_model(cfg, vocab_size: int) -> list:
    """The GPT, as a list of model chunks (one per virtual pipeline stage; here always one).

    Pipeline stages build only their layers: the first holds the embedding, the last the output layer.
    """
    m = cfg.model
    config = transformer_config(cfg)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(cfg),
        vocab_size=padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by, m.tensor_model_parallel_size),
        max_sequence_length=m.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
        position_embedding_type=m.position_embedding_type,
        rotary_percent=m.rotary_percent,
        rotary_base=m.rotary_base,
    )
    if not cfg.use_gpu and m.position_embedding_type == "rope":
        model.rotary_pos_emb.get_emb = types.MethodType(_rope_get_emb_in_place, model.rotary_pos_emb)
    if cfg.use_gpu:
        model.cuda(torch.cuda.current_device())
    return [model]


def _rope_get_emb_in_place(self, max_seq_len: int, offset: int = 0):
    """RotaryEmbedding.get_emb without its first-call move of `inv_freq` to `torch.cuda.current_device()`:
    the same angles, computed wherever the frequencies already are (the CPU)."""
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if self.rotary_interleaved:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :]


def unwrap(module):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module


# --------------------------------------------------------------------------------------------------
# Data parallelism
# --------------------------------------------------------------------------------------------------


def wrap_model(cfg, model: list) -> list:
    """Wrap each chunk for data parallelism (and half precision on a GPU)."""
    if cfg.use_gpu:
        from megatron.core.distributed import DistributedDataParallel
        from megatron.core.transformer.module import Float16Module

        if cfg.model.bf16 or cfg.model.fp16:
            model = [Float16Module(m.config, m) for m in model]
        ddp_config = megatron_ddp_config(cfg)
        model = [DistributedDataParallel(config=unwrap(m).config, ddp_config=ddp_config, module=m,
                                         disable_bucketing=i > 0) for i, m in enumerate(model)]
        for m in model:
            m.broadcast_params()  # every data-parallel replica starts from the same weights
        return model
    if cfg.data_parallel_size == 1:
        return model
    # torch DDP averages gradients over the data-parallel group only: tensor-parallel ranks hold
    # different shards and must not be averaged together.
    group = parallel_state.get_data_parallel_group()
    return [torch.nn.parallel.DistributedDataParallel(m, process_group=group) for m in model]


# --------------------------------------------------------------------------------------------------
# The optimizer
# --------------------------------------------------------------------------------------------------


class OptimizerConfig(MegatronOptimizerConfig):
    """megatron-core's OptimizerConfig with its post-init deferred to finalize() (Megatron Bridge's): fields
    can be set one by one after construction, and the checks and derived fields run once, when finalized."""

    def __post_init__(self) -> None:
        pass  # deferred: see finalize()

    def finalize(self) -> None:
        """Run megatron-core's post-init on the current field values (checks, derived fields)."""
        super().__post_init__()


class DistributedDataParallelConfig(MegatronDDPConfig):
    """megatron-core's DistributedDataParallelConfig with its post-init deferred to finalize() (Megatron Bridge's)."""

    def __post_init__(self) -> None:
        pass  # deferred: see finalize()

    def finalize(self) -> None:
        """Run megatron-core's post-init on the current field values."""
        super().__post_init__()


def megatron_optimizer_config(cfg) -> OptimizerConfig:
    """megatron-core's optimizer config from config.py's flags, finalized. Built on CPU too: the CPU optimizer
    groups parameters with it exactly as get_megatron_optimizer does on a GPU."""
    o, m = cfg.optimizer, cfg.model
    config = OptimizerConfig(
        optimizer=o.optimizer, lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, sgd_momentum=o.sgd_momentum,
        clip_grad=o.clip_grad, bf16=m.bf16, fp16=m.fp16,
        params_dtype=torch.bfloat16 if m.bf16 else torch.float16 if m.fp16 else torch.float32,
        loss_scale=o.loss_scale, initial_loss_scale=o.initial_loss_scale, min_loss_scale=o.min_loss_scale,
        loss_scale_window=o.loss_scale_window, hysteresis=o.hysteresis,
        use_distributed_optimizer=o.use_distributed_optimizer, overlap_param_gather=cfg.ddp.overlap_param_gather,
        log_num_zeros_in_grad=cfg.logger.log_num_zeros_in_grad,
    )
    config.finalize()
    return config


def megatron_ddp_config(cfg) -> DistributedDataParallelConfig:
    """megatron-core's DDP config from config.py's flags, finalized (GPU only: megatron-core's DDP)."""
    config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=cfg.model.bf16 or cfg.model.fp16,
        overlap_grad_reduce=cfg.ddp.overlap_grad_reduce,
        overlap_param_gather=cfg.ddp.overlap_param_gather,
        use_distributed_optimizer=cfg.ddp.use_distributed_optimizer,
        check_for_nan_in_grad=cfg.train.check_for_nan_in_loss_and_grad,
    )
    config.finalize()
    return config


def build_optimizer(cfg, model: list):
    """megatron-core's optimizer on a GPU; TorchOptimizer, with the same step() contract, on CPU.

    Either way the parameter groups come from megatron-core's grouping of the overrides that
    `cfg.optimizer_config_override_provider` returns (by default: no weight decay on biases and 1-D
    parameters, `wd_mult` 0, as Megatron does), so CPU and GPU runs group and decay alike.
    """
    from config import OptimizerConfigOverrideProviderContext

    config = megatron_optimizer_config(cfg)
    context = OptimizerConfigOverrideProviderContext(scheduler_config=cfg.scheduler, optimizer_config=config, model=model)
    overrides = cfg.optimizer_config_override_provider.build_config_overrides(context)
    if cfg.use_gpu:
        from megatron.core.optimizer import get_megatron_optimizer

        return get_megatron_optimizer(config, model, config_overrides=overrides)
    return TorchOptimizer(cfg, model, config, overrides)


class TorchOptimizer:
    """CPU stand-in for megatron-core's MegatronOptimizer: torch AdamW/SGD plus global-norm clipping.

    Same contract as MegatronOptimizer: `step()` returns (update_successful, grad_norm, num_zeros_in_grad),
    `param_groups` are megatron-core's (`wd_mult`, `max_lr`, `min_lr`, ... for OptimizerParamScheduler).
    With --fp16, megatron-core's loss scaler: the schedule multiplies each loss by `scale_loss`, `step()`
    unscales the gradients and, if any is Inf/NaN, skips the update and lets the scaler back off
    (MixedPrecisionOptimizer.step's rule). Without --fp16 the loss scale is 1.
    """

    def __init__(self, cfg, model: list, config=None, config_overrides=None):
        # megatron-core's own grouping (what get_megatron_optimizer calls): parameters with the same merged
        # overrides share a group; None overrides mean megatron-core's standard ones (no decay on biases/1-D).
        from megatron.core.optimizer import _get_param_groups

        o = cfg.optimizer
        self.grad_scaler = build_cpu_grad_scaler(o) if cfg.model.fp16 else None
        self.clip_grad = o.clip_grad
        self.log_num_zeros_in_grad = cfg.logger.log_num_zeros_in_grad
        self.params = [p for chunk in model for p in chunk.parameters() if p.requires_grad]
        groups = _get_param_groups(model, config or megatron_optimizer_config(cfg), config_overrides)
        if o.optimizer == "adam":
            # fused: torch's single-kernel CPU Adam, 3-5x faster than per-tensor loops or foreach here
            # (python bench.py hotpath).
            self.optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                                               weight_decay=o.weight_decay, fused=True)
        else:
            self.optimizer = torch.optim.SGD(groups, lr=o.lr, momentum=o.sgd_momentum, weight_decay=o.weight_decay)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def get_loss_scale(self) -> torch.Tensor:
        return self.grad_scaler.scale if self.grad_scaler is not None else torch.tensor(1.0)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss the backward pass starts from (megatron-core's `MegatronOptimizer.scale_loss`)."""
        return self.get_loss_scale() * loss

    @torch.no_grad()
    def step(self):
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.grad_scaler is not None and unscale_and_check_for_inf(grads, self.grad_scaler):
            return False, None, None  # an fp16 overflow: no update, a smaller loss scale next time
        grad_norm = global_grad_norm(self.params)
        # Zeros are counted only when asked: it walks every gradient.
        num_zeros = float(sum((g == 0).sum().item() for g in grads)) if self.log_num_zeros_in_grad else None
        if not math.isfinite(grad_norm):
            return False, grad_norm, num_zeros  # a NaN/Inf gradient: skip the update, as an fp16 overflow would
        if self.clip_grad > 0 and grad_norm > self.clip_grad:
            torch._foreach_mul_(grads, self.clip_grad / (grad_norm + 1e-6))
        self.optimizer.step()
        return True, grad_norm, num_zeros

    def state_dict(self):
        state = self.optimizer.state_dict()
        if self.grad_scaler is not None:  # the loss scale and its trackers resume too, as megatron-core saves them
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        scaler_state = state_dict.pop("grad_scaler", None)
        self.optimizer.load_state_dict(state_dict)
        if self.grad_scaler is not None and scaler_state is not None:
            self.grad_scaler.load_state_dict(scaler_state)


def build_cpu_grad_scaler(o):
    """megatron-core's loss scaler for fp16, as `get_megatron_optimizer` picks it: constant with --loss-scale,
    else dynamic (doubles after --loss-scale-window clean steps, halves after --hysteresis overflows)."""
    if o.loss_scale:
        return CPUConstantGradScaler(o.loss_scale)
    return CPUDynamicGradScaler(initial_scale=o.initial_loss_scale, min_scale=o.min_loss_scale, growth_factor=2.0,
                                backoff_factor=0.5, growth_interval=o.loss_scale_window, hysteresis=o.hysteresis)


class CPUConstantGradScaler(ConstantGradScaler):
    """megatron-core's ConstantGradScaler with its scale on the CPU (its __init__ allocates it on "cuda")."""

    def __init__(self, initial_scale: float):
        assert initial_scale > 0.0
        self._scale = torch.tensor([initial_scale], dtype=torch.float)


class CPUDynamicGradScaler(DynamicGradScaler):
    """megatron-core's DynamicGradScaler with its tensors on the CPU: its __init__ and load_state_dict put
    them on "cuda", so both are restated here; `update()`, the scaling rule itself, is megatron-core's."""

    def __init__(self, initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis):
        assert 0.0 < min_scale <= initial_scale and growth_factor > 1.0 and 0.0 < backoff_factor < 1.0
        assert growth_interval > 0 and hysteresis > 0
        self._scale = torch.tensor([initial_scale], dtype=torch.float)
        self.min_scale = torch.tensor([min_scale], dtype=torch.float)
        self.growth_factor = torch.tensor([growth_factor], dtype=torch.float)
        self.backoff_factor = torch.tensor([backoff_factor], dtype=torch.float)
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self._growth_tracker, self._hysteresis_tracker = 0, hysteresis

    def load_state_dict(self, state_dict):
        self._scale = state_dict["scale"].cpu()
        self._growth_tracker = state_dict["growth_tracker"]
        self._hysteresis_tracker = state_dict["hysteresis_tracker"]


def unscale_and_check_for_inf(grads: list, grad_scaler) -> bool:
    """Divide the gradients by the loss scale in place and say whether any is Inf/NaN, on any model-parallel
    rank; then update the scaler (megatron-core's `_unscale_main_grads_and_check_for_nan` + `prepare_grads`).
    Data-parallel replicas agree already: their gradients were averaged, and an Inf spreads through the average."""
    found_inf = torch.zeros(1)
    if grads:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, grad_scaler.inv_scale)
    if parallel_state.get_model_parallel_group().size() > 1:
        torch.distributed.all_reduce(found_inf, op=torch.distributed.ReduceOp.MAX,
                                     group=parallel_state.get_model_parallel_group())
    overflow = found_inf.item() > 0
    grad_scaler.update(overflow)
    return overflow


def global_grad_norm(params) -> float:
    """L2 norm of all gradients of the model, each counted once across tensor-parallel ranks.

    Like megatron-core's `get_grad_norm_fp32`: parameters replicated on every tensor-parallel rank
    (norms, row-parallel biases) count on rank 0 of the group only, shared embeddings once, and the
    squares are summed over the model-parallel group. Data-parallel replicas hold averaged, equal
    gradients, so they are not summed.
    """
    grads = [p.grad for p in params if p.grad is not None and getattr(p, "shared", False) is False
             and tensor_parallel.param_is_not_tensor_parallel_duplicate(p)]
    total = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
    if parallel_state.get_model_parallel_group().size() > 1:
        torch.distributed.all_reduce(total, group=parallel_state.get_model_parallel_group())
    return total.sqrt().item()


# --------------------------------------------------------------------------------------------------
# Forward and backward over the microbatches of one step
# --------------------------------------------------------------------------------------------------


def get_forward_backward_func(cfg, model: list, optimizer):
    """megatron-core's schedule (no pipelining, or 1F1B across pipeline stages) on a GPU; the
    CPU version of the no-pipelining schedule otherwise. Same call signature either way."""
    if cfg.use_gpu:
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.pipeline_parallel import get_forward_backward_func as mcore_get_forward_backward_func

        # The schedule reads these hooks from the model config, as Megatron-LM's training loop sets them:
        # gradient sync waits until the last microbatch, then finalize_model_grads all-reduces.
        config = unwrap(model[0]).config
        config.no_sync_func = model[0].no_sync if len(model) == 1 else [m.no_sync for m in model]
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = optimizer.scale_loss if optimizer is not None else None  # None: evaluation
        return mcore_get_forward_backward_func()
    half = torch.bfloat16 if cfg.model.bf16 else torch.float16 if cfg.model.fp16 else None
    autocast = (lambda: torch.autocast("cpu", dtype=half)) if half is not None else contextlib.nullcontext
    # fp16 losses are scaled before backward, as megatron-core's schedules do through config.grad_scale_func.
    grad_scale_func = optimizer.scale_loss if cfg.model.fp16 and optimizer is not None else None
    return lambda **kwargs: forward_backward_no_pipelining(autocast=autocast, grad_scale_func=grad_scale_func, **kwargs)


def forward_backward_no_pipelining(*, forward_step_func, data_iterator, model, num_microbatches, seq_length=None,
                                   micro_batch_size=None, forward_only=False, collect_non_loss_data=False,
                                   autocast=contextlib.nullcontext, grad_scale_func=None, **unused):
    """megatron-core's `forward_backward_no_pipelining`, for CPU (its token counter lives on "cuda").

    For each microbatch: run the user's forward step, apply its loss function, scale the loss so the
    gradients accumulated over microbatches are their average, and backpropagate. The loss function
    may return, as megatron-core's `forward_step_calc_loss` accepts:
      (loss, {name: value})               legacy: loss averaged over microbatches
      (loss_sum, num_tokens, {name: ...})  token-weighted: loss divided by the microbatch's tokens
      anything, with collect_non_loss_data: loss_func(output, non_loss_data=True) is collected as-is
    Gradient all-reduce across data-parallel ranks happens once, in the last microbatch's backward.
    `grad_scale_func` (fp16) scales the loss before backward, as megatron-core's `backward_step` does.
    Returns the list of per-microbatch reporting dicts (or collected data).
    """
    model = model[0] if isinstance(model, list) else model
    data_iterator = data_iterator[0] if isinstance(data_iterator, list) else data_iterator
    no_sync = getattr(model, "no_sync", contextlib.nullcontext)
    store = []
    for i in range(num_microbatches):
        last = i == num_microbatches - 1
        with contextlib.nullcontext() if (last or forward_only) else no_sync():
            with autocast():
                output, loss_func = forward_step_func(data_iterator, model)
            if collect_non_loss_data:
                store.append(loss_func(output, non_loss_data=True))
                continue
            outputs = loss_func(output)
            if len(outputs) == 3:
                loss, num_tokens, reported = outputs
                loss = loss / torch.clamp(num_tokens, min=1) / num_microbatches
            else:
                loss, reported = outputs
                loss = loss / num_microbatches
            store.append(reported)
            if not forward_only:
                # Backward under autocast too: megatron-core's linear layers are custom autograd functions
                # whose backward matmuls mix the bf16 output gradient with the fp32 weight otherwise.
                with autocast():
                    (grad_scale_func(loss) if grad_scale_func is not None else loss).backward()
    return store


# --------------------------------------------------------------------------------------------------
# The rerun state machine (result validation)
# --------------------------------------------------------------------------------------------------


def build_rerun_state_machine(cfg) -> "RerunStateMachine":
    """megatron-core's RerunStateMachine for this run (Bridge's `init_rerun_state`), also registered as
    megatron-core's instance: its RerunDataIterator and, on a GPU, its DDP gradient checks look it up there."""
    r = cfg.rerun_state_machine
    save = restore = None
    if cfg.use_gpu:  # the CUDA RNG tracker's streams (dropout in tensor-parallel regions) rewind with the step
        def save():
            return {"rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}

        def restore(state):
            tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])
    machine = RerunStateMachine(
        use_gpu=cfg.use_gpu, report_interval=cfg.logger.log_interval, state_save_func=save, state_restore_func=restore,
        mode=mcore_rerun.RerunMode(r.rerun_mode),
        error_injector=mcore_rerun.RerunErrorInjector(r.error_injection_rate,
                                                      mcore_rerun.RerunDiagnostic(r.error_injection_type)))
    machine.spiky_loss_factor = r.spiky_loss_factor  # where Bridge's loss check reads it
    mcore_rerun.destroy_rerun_state_machine()  # one per run: a process may call pretrain() more than once
    mcore_rerun._set_rerun_state_machine(machine)  # initialize_rerun_state_machine() would build the base class
    return machine


class RerunStateMachine(mcore_rerun.RerunStateMachine):
    """megatron-core's RerunStateMachine (the state transitions, the comparisons, error injection, the
    spiky-loss window are all its own), with two changes:

    - On CPU, its few CUDA calls are answered on the CPU: the all-reduce of its flags (a "cuda" tensor),
      the CUDA RNG state it saves and restores around a rerun, and `torch.cuda.current_device()`, which it
      uses only to name the device in its messages. On a GPU it runs unchanged.
    - report_determinism_stats prints its statistics every --log-interval iterations: megatron-core 0.16.1's
      own report reads `Caller.filename` and `Caller.lineno`, which its Caller does not have.
    """

    def __init__(self, *, use_gpu: bool, report_interval: int, **kwargs):
        super().__init__(**kwargs)
        self.use_gpu, self.report_interval = use_gpu, report_interval

    def _reduce_any(self, value):
        if self.use_gpu:
            return super()._reduce_any(value)
        flags = torch.tensor(value if isinstance(value, list) else [value], dtype=torch.int32)
        torch.distributed.all_reduce(flags)
        return tuple(x > 0 for x in flags.tolist()) if isinstance(value, list) else flags.item() > 0

    def _save_state(self):
        if self.use_gpu:
            return super()._save_state()
        self.saved_state = {"rng_state": {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                                          "torch_rng_state": torch.get_rng_state()},
                            "other_state": self.state_save_func() if self.state_save_func else None}

    def _restore_state(self):
        if self.use_gpu:
            return super()._restore_state()
        rng = self.saved_state["rng_state"]
        random.setstate(rng["random_rng_state"])
        np.random.set_state(rng["np_rng_state"])
        torch.set_rng_state(rng["torch_rng_state"])
        if self.saved_state["other_state"] and self.state_restore_func:
            self.state_restore_func(self.saved_state["other_state"])

    def validate_result(self, *args, **kwargs):
        if self.use_gpu:
            return super().validate_result(*args, **kwargs)
        with _cuda_current_device_named_cpu():
            return super().validate_result(*args, **kwargs)

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


@contextlib.contextmanager
def _cuda_current_device_named_cpu():
    """For the length of one RerunStateMachine.validate_result call on the CPU path, `torch.cuda.current_device()`
    answers "cpu" instead of raising: megatron-core calls it there only to name the device in its messages
    (and to remember which device a fault was seen on). Nothing else runs under it; the GPU path never enters it."""
    current_device = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = current_device


def any_rank(flag: bool, use_gpu: bool) -> bool:
    """True on every rank if flag is True on any rank: one small all-reduce, on the device the backend wants."""
    t = torch.tensor([int(flag)], device="cuda" if use_gpu else "cpu")
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())


def zero_grad(model: list, optimizer) -> None:
    """Clear gradients before a step: megatron DDP keeps them in its own buffers, torch in `.grad`."""
    for m in model:
        if hasattr(m, "zero_grad_buffer"):
            m.zero_grad_buffer()
    optimizer.zero_grad()


def set_random_seed(seed: int, use_gpu: bool) -> None:
    """Seed python, numpy and torch; offset by pipeline rank so stages differ, as Megatron-LM does.

    On a GPU also seed megatron-core's CUDA RNG tracker (dropout inside tensor-parallel regions
    draws per-rank streams from it); it needs CUDA, so on CPU the default generator serves.
    """
    import random

    import numpy as np

    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if use_gpu:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
