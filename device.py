"""device.py: where a run enters the CPU's differences from a GPU, and leaves them after it.

The patches of megatron-core and torch live here; the places that read the device (a dtype, a backend, a
refusal) are listed in docs/cpu.md.

The training engine is megatron-core's own on every machine: its DistributedDataParallel and grad buffers,
`get_megatron_optimizer` (the distributed optimizer, Float16Module's mixed precision, the loss scalers),
the pipeline schedules, the CUDA RNG tracker, its timers and `dist_checkpointing`. megatron-core 0.19.2
hard-codes CUDA in about a hundred places. Without CUDA, `shim()` answers those calls on the CPU for the length of
a run, so that a laptop and the CI run the very code a GPU runs. With CUDA present it does nothing at all.

docs/cpu.md has the two tables: each call the shim answers (`_cpu_answers`, `_flash_attn_answers`), where
megatron-core 0.19.2 makes it (file:line) and the answer; and what else differs between the machines, each answered
here once (`bind_local_gpu`, `backend`, `to_device`) or where the table names. `torch.cuda.is_available()` stays
False: code that asks it (ours, torch's) still learns the truth. Only the wrapped torch functions (`_takes_a_device`)
and Tensor's `to`, `cuda` and `type` pass through Python on their way to torch (a `TorchFunctionMode` put every op
through Python: 6% of train.py's step at nanoGPT's shape; docs/benchmarks.md).
"""

import contextlib
import functools
import importlib.abc
import importlib.util
import logging
import os
import sys
import warnings

import torch

# megatron-core warns at import that it falls back to torch kernels without apex/transformer-engine; that is the
# intended setup on CPU, so the warnings are noise. Every module imports this one before megatron-core.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed.*")
warnings.filterwarnings("ignore", message=r"full scope is deprecated")  # a TransformerConfig default, not ours
if importlib.util.find_spec("transformer_engine") is None:  # megatron-core reads an absent one's version as 0.0.0
    warnings.filterwarnings("ignore", message=r"Only transformer-engine>=1.7.0 supports MoE experts")

# megatron-core's and torch's notices about calls this project makes on purpose, none of them about the user's run
# (tests/test_generate.py: the quick start's and generate.py's stderr hold no notice of theirs). Python warnings:
NOT_THE_USERS = [
    # get_megatron_optimizer imports MimoModel for an isinstance check (megatron/core/optimizer/__init__.py:1019);
    # no MIMO model is built here.
    (UserWarning, r"MimoModelConfig is experimental"),
    # megatron-core reads a checkpoint without collectives on purpose, each rank its own shards (no_dist=True at
    # megatron/core/dist_checkpointing/serialization.py:229-230 and strategies/torch.py:979-989); torch warns even
    # when asked so (torch/distributed/checkpoint/state_dict_loader.py:158-163), and at the reader passed second by
    # position, as strategies/torch.py:981 does (torch/distributed/checkpoint/utils.py:463-464).
    (UserWarning, r"torch.distributed is disabled, unavailable or uninitialized"),
    (UserWarning, r"The argument order of load has been changed"),
    # megatron-core 0.19.2's collectives (megatron/core/tensor_parallel/mappings.py:12-13,
    # megatron/core/distributed/param_and_grad_buffer.py:50-51), which torch 2.13 renamed
    # (torch/distributed/distributed_c10d.py:4399-4403,4948-4952).
    (FutureWarning, r"`torch.distributed.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"),
    # torch_dist checkpoints are built of torch's ShardedTensor (megatron/core/dist_checkpointing/strategies/torch.py:233).
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor"),
    # Validation runs megatron-core's dataset post-init (checks.check_data) before any process group, and its logging
    # looks the rank up (megatron/core/_rank_utils.py:39), which it then takes as 0: the right rank to log on.
    (UserWarning, r"Could not determine rank from torch.distributed"),
]
if not torch.cuda.is_available():  # a CUDA setting, which a CPU run has nothing to gain from
    NOT_THE_USERS.append((UserWarning, r"When using sequence parallelism it is recommended to set the environment "
                                       r"variable CUDA_DEVICE_MAX_CONNECTIONS"))
for category, message in NOT_THE_USERS:
    warnings.filterwarnings("ignore", message=message, category=category)
# ... and megatron-core's log records, by logger: the start of the message left out.
NOT_THE_USERS_RECORDS = {
    # Megatron-LM's pretrain_gpt.py and Bridge build GPTModel too; docs/model.md says why and what HybridModel changes.
    "megatron.core.models.gpt.gpt_model": "GPTModel IS DEPRECATED",
    # The default mode, in which the machine does nothing; the printed config names the mode.
    "megatron.core.rerun_state_machine": "RerunStateMachine initialized in mode RerunMode.DISABLED",
    # Every synchronous save runs megatron-core's async path as "mcore", asked or not
    # (megatron/core/dist_checkpointing/strategies/torch.py:725-728); an --async-save that falls back to mcore is
    # named in the printed config (checks.py).
    "megatron.core.dist_checkpointing.strategies.torch": "MCore's async save is deprecated",
    # --mock-data without --data-cache-path: synthetic indexes, rebuilt in moments, need no cache.
    "megatron.core.datasets.gpt_dataset": "Unable to save MockGPTDataset indexes because path_to_cache is None",
}
for name, start in NOT_THE_USERS_RECORDS.items():
    logging.getLogger(name).addFilter(lambda record, start=start: not record.getMessage().startswith(start))


def _import_cpp_extension_quietly() -> None:
    """megatron-core imports torch.utils.cpp_extension, which looks for CUDA once, at its import: a CUDA build of
    torch (what the package index serves) on a machine without a CUDA runtime logs "No CUDA runtime is found" then,
    in every process, before any output of ours (a one-line error would be two). Imported here with that one
    record filtered out; the filter is removed after, and the module's later messages pass."""
    log = logging.getLogger("torch.utils.cpp_extension")
    quiet = logging.Filter()
    quiet.filter = lambda record: "No CUDA runtime is found" not in record.getMessage()
    log.addFilter(quiet)
    try:
        import torch.utils.cpp_extension  # noqa: F401
    finally:
        log.removeFilter(quiet)


_import_cpp_extension_quietly()


def _compile_on_first_call(model=None, **kwargs):
    """torch.compile, deferred to the function's first call; in a run on a CPU (the shim installed), no compilation:
    the function as written."""
    if model is None:  # used as @torch.compile(...)
        return functools.partial(_compile_on_first_call, **kwargs)
    compiled = None

    @functools.wraps(model)
    def call(*args, **kw):
        nonlocal compiled
        if _on_cpu:  # in a run on a CPU: as written
            return model(*args, **kw)
        if compiled is None:
            compiled = _torch_compile(model, **kwargs)
        return compiled(*args, **kw)

    return call


_torch_compile = torch.compile


def _import_megatron_core() -> None:
    """megatron-core, imported here first, without what its import costs every process for nothing it trains with
    (1.7 s of the 3.9 s that importing train.py took, measured on a CPU; docs/cpu.md):
    - its fused kernels are `torch.compile`d functions (megatron/core/jit.py), decorated at import: that imports
      torch's compiler stack (dynamo, inductor) although they compile only when called, and they are called only
      with the fusion flags (--bias-gelu-fusion and the like, off on the local layers), and by an MoE router at
      every call (router.py:727, `_apply_expert_bias`, which does nothing without --moe-router-enable-expert-bias).
      Here they are compiled at their first call instead: the same functions, compiled the same way, when used. On
      a CPU they are not compiled at all: they run as written, as a GPU's fused kernels are no CPU's concern, and
      compiling them cost each MoE process 0.9 s at its first MoE layer (measured) and a decode step 5%;
    - its timers import wandb when it is installed (timers.py:13; ~1 s), which training uses only with
      --wandb-project: wandb is hidden during this import, and given to the timers when it is imported later, by
      the W&B writer (metrics.WandbWriter) or by anyone (_GiveWandbWhenImported): `megatron.core.timers.wandb` is
      then the module, as without this."""
    hide = "wandb" not in sys.modules and importlib.util.find_spec("wandb") is not None
    if hide:
        sys.modules["wandb"] = None
    torch.compile = _compile_on_first_call
    try:
        import megatron.core  # noqa: F401
    finally:
        torch.compile = _torch_compile
        if hide and sys.modules.get("wandb", 0) is None:
            del sys.modules["wandb"]
            sys.meta_path.insert(0, _GiveWandbWhenImported())


class _GiveWandbWhenImported(importlib.abc.MetaPathFinder):
    """At wandb's import, once its code ran: megatron-core's timers, which looked for it while it was hidden, get it.
    Then this finder leaves sys.meta_path."""

    def find_spec(self, name, path=None, target=None):
        if name != "wandb":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            timers = sys.modules.get("megatron.core.timers")
            if timers is not None and timers.wandb is None:
                timers.wandb = module

        spec.loader.exec_module = exec_module
        return spec


_import_megatron_core()
_on_cpu = None  # inside shim(): whether it answers CUDA calls on the CPU; None outside


def cuda() -> bool:
    """Whether this process trains on a GPU."""
    return torch.cuda.is_available()


def bind_local_gpu(gpu_visible: bool, external_mapping: bool = False) -> None:
    """Bind this process to its rank's GPU (LOCAL_RANK) when the config saw one (checks.gpu_visible, asked
    without torch), or to device 0 when the launcher gave each process its own GPU (Bridge's
    external_gpu_device_mapping). Nothing on a CPU (model.initialize_distributed refuses a GPU this torch cannot
    use)."""
    if not gpu_visible:
        return
    torch.cuda.set_device(0 if external_mapping else int(os.environ.get("LOCAL_RANK", "0")))


def backend() -> str:
    """The collective backend: NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if cuda() else "gloo"


def to_device(batch: dict) -> dict:
    """A batch's tensors on the local GPU (non-blocking: DataLoader workers pin them); unchanged on CPU."""
    if not cuda():
        return batch
    return {k: v.cuda(non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _is_cuda(device) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):  # an ordinal, as torch.cuda.current_device() gives
        return True
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


_CUDA_TYPE = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
              "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


def _takes_a_device() -> list:
    """(owner, name) of each torch function megatron-core hands a `device=` or `pin_memory=`: torch's functions that
    make a tensor on a device (torch's own list, the one `torch.set_default_device` rewrites: torch/utils/_device.py),
    the `_like` ones and Tensor's `new_*` methods."""
    from torch.utils._device import _device_constructors

    names = sorted(f.__name__ for f in _device_constructors() if getattr(torch, f.__name__, None) is f)
    names += [f"{kind}_like" for kind in ("empty", "zeros", "ones", "full", "rand", "randn", "randint")]
    return [(torch, name) for name in names] + [(torch.Tensor, f"new_{kind}")
                                                for kind in ("empty", "zeros", "ones", "full", "tensor")]


def _on_the_cpu(function):
    """`function` with a CUDA `device=` (a name, a torch.device or an ordinal) answered by the CPU, and
    `pin_memory=True` by pageable memory: page-locked memory is for copies to a GPU, and torch has none without one."""
    @functools.wraps(function)
    def call(*args, **kwargs):
        if kwargs:
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = "cpu"
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False
        return function(*args, **kwargs)

    return call


def _tensor_answers() -> list:
    """(owner, name, answer) for Tensor's `to`, `cuda` and `type`: a move to a CUDA device stays on the CPU, and a
    tensor's type is named as its CUDA type (megatron-core checks for "torch.cuda.FloatTensor")."""
    to, type_ = torch.Tensor.to, torch.Tensor.type

    def to_the_cpu(tensor, *args, **kwargs):
        if args and _is_cuda(args[0]):
            args = ("cpu", *args[1:])
        return to(tensor, *args, **kwargs)

    def cuda_type(tensor, *args, **kwargs):
        name = type_(tensor, *args, **kwargs)
        return name if args or kwargs else _CUDA_TYPE.get(name, name)

    return [(torch.Tensor, "to", _on_the_cpu(to_the_cpu)), (torch.Tensor, "cuda", lambda tensor, *args, **kwargs: tensor),
            (torch.Tensor, "type", cuda_type)]


class _Stream:
    """A CUDA stream on a machine with one in-order stream: waiting and synchronising are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return event or _Event()


class _Event:
    """A CUDA event on a machine with one in-order stream: what it marks has already happened."""

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True


def _split_sizes_on_host(tensor, as_numpy=False, record_stream=False):
    """megatron-core's `maybe_move_tensor_to_cpu` (moe_utils.py:1169) for tensors that are on the CPU already: the
    alltoall dispatcher's split sizes as the numpy arrays it asks for, which `all_to_all_single` takes
    (megatron-core converts CUDA tensors only, and gloo refuses tensors there)."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None):
    """flash-attn's `apply_rotary_emb` (flash_attn/layers/rotary.py), in torch ops: `x` [batch, seq, heads, dim]
    rotated by the angles whose cosines and sines `cos`, `sin` [seq + offset or more, rotary dim / 2] hold, from row
    `seqlen_offsets`; the dimensions past the rotary ones pass through. Pairs are the two halves (GPT-NeoX, LLaMA) or,
    `interleaved`, even and odd dimensions (GPT-J). megatron-core's rope_utils.py:378 calls it where flash-attn is
    installed; megatron-core's own fallback there (rope_utils.py:361) takes the cosines and sines for angles."""
    if inplace or cu_seqlens is not None or not isinstance(seqlen_offsets, int):
        raise NotImplementedError("device.apply_rotary_emb: in-place, packed (cu_seqlens) and per-sequence offsets "
                                  "are flash-attn's own; install flash-attn")
    rows = slice(seqlen_offsets, seqlen_offsets + x.shape[1])
    return _rotated(x, *_rotary_tables(cos[rows], sin[rows], interleaved, x), interleaved)


def _rotary_tables(cos, sin, interleaved, like):
    """cos, sin [seq, rotary dim / 2] as [seq, 1, rotary dim], each angle's value at both dimensions of its pair."""
    def widened(t):
        t = t.repeat_interleave(2, dim=-1) if interleaved else torch.cat((t, t), dim=-1)
        return t.to(device=like.device, dtype=like.dtype).unsqueeze(-2)

    return widened(cos), widened(sin)


def _rotated(x, cos, sin, interleaved):
    """x [..., seq, heads, dim] rotated: megatron-core's unfused formula (rope_utils.py:73-137), x * cos +
    rotate_half(x) * sin over the first rotary dimensions, the rest passed through; bit for bit its values."""
    rotary = cos.shape[-1]
    t = x[..., :rotary]
    if interleaved:
        half = torch.stack((-t[..., 1::2], t[..., ::2]), dim=-1).flatten(-2)
    else:
        first, second = t.chunk(2, dim=-1)
        half = torch.cat((-second, first), dim=-1)
    t = t * cos + half * sin
    return t if rotary == x.shape[-1] else torch.cat((t, x[..., rotary:]), dim=-1)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            softmax_scale=None, causal=False, rotary_interleaved=True, **unsupported):
    """flash-attn's `flash_attn_with_kvcache` (flash_attn/flash_attn_interface.py) for a decode step, in torch ops,
    as megatron-core's flash decoding calls it (attention.py:810): the new keys `k` (rotated at their positions) and
    values `v` [batch, new, kv heads, dim] written into the caches [batch, length, kv heads, dim] in place at
    `cache_seqlens`, then the one new query per sequence (rotated at its position) attending to every cached key.
    Every sequence of a static batch is at the same position. `return_softmax_lse`: also the log-sum-exp of each
    query's scaled scores [batch, heads, 1], which megatron-core asks for to add an off-by-one or learnable softmax's
    extra term afterwards (attention.py:790-808)."""
    inert = {"window_size": (-1, -1), "softcap": 0.0}  # flash-attn's defaults
    return_lse = unsupported.pop("return_softmax_lse", False)
    extra = sorted(name for name, value in unsupported.items()
                   if value is not None and name != "num_splits" and not (name in inert and value == inert[name]))
    if extra or q.shape[1] != 1 or k is None:
        raise NotImplementedError(f"device.flash_attn_with_kvcache: one new token per sequence, without "
                                  f"{', '.join(extra) or 'a query longer than one'}; install flash-attn")
    # megatron-core's static batch: [offset] * batch (gpt_model.py:449). One query sees every key, so `causal`
    # (flash-attn's bottom-right aligned mask) changes nothing. A ragged batch (sequences at different positions)
    # would need a mask per sequence: refused rather than attended at the first one's length.
    lengths = cache_seqlens.reshape(-1)
    if bool((lengths != lengths[0]).any()):
        raise NotImplementedError(f"device.flash_attn_with_kvcache: every sequence of the batch at one position (got "
                                  f"{lengths.tolist()}); install flash-attn for ragged batches")
    start = int(lengths[0])
    end = start + k.shape[1]
    if rotary_cos is not None:
        cos, sin = _rotary_tables(rotary_cos[start:end], rotary_sin[start:end], rotary_interleaved, q)
        k, q = _rotated(k, cos, sin, rotary_interleaved), _rotated(q, cos[:1], sin[:1], rotary_interleaved)
    k_cache[:, start:end] = k
    v_cache[:, start:end] = v
    q, keys, values = q.transpose(1, 2), k_cache[:, :end].transpose(1, 2), v_cache[:, :end].transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, scale=softmax_scale,
                                                           enable_gqa=keys.shape[1] != q.shape[1])
    if not return_lse:
        return out.transpose(1, 2)
    grouped = keys.repeat_interleave(q.shape[1] // keys.shape[1], dim=1)  # each query head's key head
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    lse = torch.logsumexp((q @ grouped.transpose(-1, -2)).float() * scale, dim=-1)  # [batch, heads, 1], as flash-attn's
    return out.transpose(1, 2), lse


def _flash_attn_answers() -> list:
    """Without flash-attn, the two kernels megatron-core's flash decoding calls (`config.flash_decode`, which
    generate.py turns on) are these torch versions: `flash_attn_with_kvcache` (attention.py:116-119, else None, and
    flash decoding asserts) and `apply_rotary_emb` (rope_utils.py:32-35), without which megatron-core rotates the
    prefill's queries and keys by the cosines and sines taken as angles (rope_utils.py:361). None with flash-attn
    installed; training calls neither. As (owner, name, answer) for `shim()`."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import attention

    answers = []
    if attention.flash_attn_with_kvcache is None:
        answers.append((attention, "flash_attn_with_kvcache", flash_attn_with_kvcache))
    if rope_utils.apply_rotary_emb_flash is None:
        answers.append((rope_utils, "apply_rotary_emb_flash", apply_rotary_emb))
    return answers


class _CpuDeviceMesh:
    """torch's DeviceMesh as torch FSDP2's wrapper in megatron-core builds it (from_group), on the CPU."""

    @staticmethod
    def from_group(group, device_type, *args, **kwargs):
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh.from_group(group, "cpu" if device_type == "cuda" else device_type, *args, **kwargs)


def _gathered_before_return(all_gather_params):
    """Megatron FSDP's parameter all-gather (optim_grads_params), waited for before it returns. On a GPU its gathers
    run ahead of the forward on their own stream (prefetched, async_param_gather); over gloo an asynchronous gather
    is a thread still writing into a bucket that the pipeline's recycling may free meanwhile
    (param_and_grad_buffer.py:4701-4712): one run in three of 20 iterations ended in SIGSEGV. Waited for, the bucket
    holds its weights before anything else touches it."""

    @functools.wraps(all_gather_params)
    def gathered(self, *args, **kwargs):
        kwargs["async_param_gather"] = False
        return all_gather_params(self, *args, **kwargs)

    return gathered


def _cpu_answers() -> list:
    """(owner, name, answer) for each callable the shim replaces: the rows of docs/cpu.md's table."""
    from megatron.core.distributed import torch_fully_sharded_data_parallel as torch_fsdp2
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as megatron_fsdp_buffers
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    stream = _Stream()
    cuda_ = torch.cuda
    return [
        (cuda_, "current_device", lambda: 0),
        (cuda_, "synchronize", lambda device=None: None),
        (cuda_, "Stream", _Stream),
        (cuda_, "current_stream", lambda device=None: stream),
        (cuda_, "default_stream", lambda device=None: stream),
        (cuda_, "stream", lambda s: contextlib.nullcontext()),
        # The CUDA generator is the CPU's default generator: the RNG tracker's fork() swaps its named streams
        # (dropout inside tensor-parallel regions) in and out of it, exactly as it does on a GPU.
        (cuda_, "get_rng_state", lambda device="cuda": torch.get_rng_state()),
        (cuda_, "set_rng_state", lambda new_state, device="cuda": torch.set_rng_state(new_state)),
        (cuda_, "manual_seed", lambda seed: torch.manual_seed(seed)),
        (mcore_random, "_get_cuda_rng_state", lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()),
        (mcore_random, "_set_cuda_rng_state",
         lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)),
        (moe_utils, "maybe_move_tensor_to_cpu", _split_sizes_on_host),
        # torch FSDP2's mesh: megatron-core asks for a "cuda" one (torch_fully_sharded_data_parallel.py:81), and
        # fully_shard then wants every parameter on cuda:0; a "cpu" mesh over the same group
        (torch_fsdp2, "DeviceMesh", _CpuDeviceMesh),
        (megatron_fsdp_buffers.AllGatherPipeline, "all_gather_params",
         _gathered_before_return(megatron_fsdp_buffers.AllGatherPipeline.all_gather_params)),
        (token_dispatcher, "maybe_move_tensor_to_cpu", _split_sizes_on_host),
        *((owner, name, _on_the_cpu(getattr(owner, name))) for owner, name in _takes_a_device()),
        *_tensor_answers(),
    ]


@contextlib.contextmanager
def shim():
    """What megatron-core needs on this machine, for the length of a run (train.pretrain, generate.py's and hf.py's
    model loading and generation, peft.py's merge, bench.py), and nothing after it: importing this project leaves
    torch as it was, and a notebook that imports `train` then does its own torch work sees plain torch.

    - Without CUDA, the CPU shim (docs/cpu.md's table): torch's functions that take a device, Tensor's `to`, `cuda` and
      `type`, torch.cuda's stream, device and RNG calls and megatron-core's three answered on the CPU, and any
      function megatron-core decorated with the real torch.compile (when it was imported before this module) run as
      written, as `_compile_on_first_call` runs them: the numbers do not depend on the import order.
    - Without flash-attn, the two kernels of megatron-core's flash decoding (`_flash_attn_answers`).

    Each replaced name is put back on exit (for every thread: the names are torch's). Nested uses are one: the
    outermost installs and removes."""
    global _on_cpu
    if _on_cpu is not None:  # already installed by an enclosing run
        yield
        return
    replaced = [(owner, name, vars(owner).get(name, _INHERITED), answer)
                for owner, name, answer in (_cpu_answers() if not cuda() else []) + _flash_attn_answers()]
    for owner, name, _, answer in replaced:
        setattr(owner, name, answer)
    with contextlib.ExitStack() as stack:
        if not cuda():
            stack.enter_context(_filtered(logging.getLogger("megatron.core.tensor_parallel.random"),
                                          "CPU RNG state changed within GPU RNG context"))
            if "torch._dynamo" in sys.modules:  # something was torch.compile'd: megatron-core's kernels run as written
                stack.enter_context(torch.compiler.set_stance("force_eager"))
        _on_cpu = not cuda()
        try:
            yield
        finally:
            _on_cpu = None
            for owner, name, original, _ in reversed(replaced):
                if original is _INHERITED:  # Tensor's methods are TensorBase's: the class gets its own back
                    delattr(owner, name)
                else:
                    setattr(owner, name, original)


_INHERITED = object()  # a replaced name its owner did not hold itself (Tensor.to is TensorBase's)


@contextlib.contextmanager
def _filtered(logger, message: str):
    """`logger` without its records that contain `message`, for the block. The RNG tracker's fork() warns when the
    CPU generator moved while a CUDA stream was swapped in (random.py:331-333); on a CPU the CUDA generator is the
    CPU's (_cpu_answers), so every fork that draws (dropout in a tensor-parallel region) would warn."""
    quiet = logging.Filter()
    quiet.filter = lambda record: message not in record.getMessage()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def in_shim(function):
    """`function`, run inside `shim()`: an entry point that builds or runs megatron-core's model outside train.py's
    run (generate.py's loading and decoding, hf.py's export and import, peft.py's merge)."""
    @functools.wraps(function)
    def call(*args, **kwargs):
        with shim():
            return function(*args, **kwargs)

    return call


def install_cpu_shim() -> None:
    """The shim for the rest of this process, for a program that is one run from start to end (the launchers of
    Megatron-LM's and Bridge's own scripts, tests/fixtures/interchange/). The project's own entry points use
    `shim()`."""
    global _FOR_GOOD
    if _FOR_GOOD is None:
        _FOR_GOOD = shim()
        _FOR_GOOD.__enter__()  # and kept: a context manager collected would leave the shim


_FOR_GOOD = None  # install_cpu_shim's shim()


def current() -> torch.device:
    """The device this process computes on: its GPU, or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if cuda() else torch.device("cpu")


def any_rank(flag: bool) -> bool:
    """True on every rank if flag is True on any rank: one small all-reduce (data loading, checkpoints and
    the loop use it to fail or stop together)."""
    t = torch.tensor([int(flag)], device=current())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())


def fused_cpu_adam(optimizer) -> None:
    """On a CPU, torch's fused Adam kernel for megatron-core's torch AdamW. Without apex or transformer-engine
    megatron-core builds AdamW with torch's defaults (optimizer/__init__.py:557), a per-tensor loop on a CPU; the fused
    CPU kernel is 3-5x faster (python bench.py hotpath) and computes the same update. Set after the build and again
    after a load: torch's load_state_dict takes the saved groups' `fused` (Megatron-LM's is None)."""
    if cuda():
        return
    for group in _adam_groups(optimizer):
        group["fused"] = True


@contextlib.contextmanager
def adam_as_built(optimizer):
    """The optimizer's groups with `fused` as megatron-core builds them (torch's default, None) while a checkpoint's
    state is made: the file says what Megatron-LM's says, not the kernel this machine steps with."""
    groups = [(group, group.get("fused")) for group in _adam_groups(optimizer)]
    for group, _ in groups:
        group["fused"] = None
    try:
        yield
    finally:
        for group, fused in groups:
            group["fused"] = fused


def _adam_groups(optimizer) -> list:
    """The param groups of each torch Adam (AdamW) inside a megatron-core optimizer (chained or not)."""
    inners = getattr(optimizer, "chained_optimizers", [optimizer]) if optimizer is not None else []
    return [group for inner in inners if isinstance(getattr(inner, "optimizer", None), torch.optim.Adam)
            for group in inner.optimizer.param_groups]
