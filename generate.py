"""generate.py: see what a checkpoint learned, as text.

Names here are this project's own; the KV cache and the model are megatron-core's.

    python generate.py --prompt "The Python"                  # the quick start's checkpoints/, newest iteration
    python generate.py --load CKPT [--ckpt-step N] --prompt "..." [--max-new-tokens 200] [--temperature 0.8]
        [--top-k 50] [--top-p 0.95] [--seed 1] [--greedy]
    torchrun --nproc-per-node 2 generate.py --prompt "..."    # tensor-parallel: each rank holds half of each matrix
    torchrun --nproc-per-node 2 generate.py --expert-model-parallel-size 2 --prompt "..."  # MoE: half the experts each

The checkpoint's run_config.yaml rebuilds the model, so no model flag needs repeating, and its tokenizer
turns the prompt into ids and the ids back into text, printed as they come.

Decoding keeps each layer's keys and values in megatron-core's StaticInferenceContext (a KV cache): one forward
over the prompt (prefill), then one forward per new token over that token alone. `--no-kv-cache` runs the
simplest loop that is right instead, as nanoGPT's sample.py: each new token is one forward over the whole
sequence so far. Both give the same tokens. A sequence longer than the model's context keeps its newest
tokens; the cache, whose positions are fixed, then gives way to that loop. `python bench.py generate` measures
both beside transformers' generate().
"""

# ruff: noqa: E402  (the flags are parsed before the heavy imports, so most imports follow code)

import argparse
import contextlib
import gc
import os
import sys
import types

import config as config_lib  # first: it quiets megatron-core's import-time notices (device.py)
import checks


def build_parser() -> argparse.ArgumentParser:
    parser = config_lib.OneLineParser(prog="generate.py", description="Generate text from a checkpoint.",
                                      allow_abbrev=False)
    parser.add_argument("--load", default="checkpoints",
                        help="A save directory (its newest iteration) or one iter_* directory. Default: checkpoints, "
                             "where train.py saves by default.")
    parser.add_argument("--ckpt-step", type=int, help="Load this iteration instead of the newest.")
    parser.add_argument("--prompt", required=True, help="Text to continue.")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="Tokens to generate (fewer if the end-of-"
                                                                         "document token comes first). Default: 200.")
    parser.add_argument("--temperature", type=float, default=0.8, help="Divide the logits by this before sampling: "
                                                                       "below 1 sharper, above 1 flatter. Default: 0.8.")
    parser.add_argument("--top-k", type=int, default=50, help="Sample among the K likeliest tokens; 0: all. Default: 50.")
    parser.add_argument("--top-p", type=float, default=0.95, help="Sample among the likeliest tokens whose "
                                                                  "probabilities sum to P (nucleus). Default: 0.95.")
    parser.add_argument("--seed", type=int, default=1, help="Seed of the sampling (the same on every rank). Default: 1.")
    parser.add_argument("--greedy", action="store_true", help="Always take the likeliest token (no sampling).")
    parser.add_argument("--num-samples", type=int, default=1, help="Samples to draw from the prompt, one after "
                                                                    "another (as nanoGPT's sample.py). Default: 1.")
    parser.add_argument("--expert-model-parallel-size", type=int, default=1,
                        help="An MoE checkpoint's experts split over this many ranks; the rest of the model is split by "
                             "tensor parallelism over world size / this. Default: 1 (every rank holds every expert).")
    parser.add_argument("--no-kv-cache", dest="kv_cache", action="store_false",
                        help="A full forward over the whole sequence for every new token: the plain loop, the "
                             "reference the cached decoding must equal.")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, checked before torch is imported: a bad value is one line and exit code 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    checks = [(args.max_new_tokens >= 1, f"--max-new-tokens must be at least 1, got {args.max_new_tokens}"),
              (args.temperature > 0, f"--temperature must be positive, got {args.temperature} (use --greedy for "
                                     f"the likeliest token)"),
              (args.top_k >= 0, f"--top-k must be 0 (all tokens) or positive, got {args.top_k}"),
              (0 < args.top_p <= 1, f"--top-p must be in (0, 1], got {args.top_p}"),
              (args.num_samples >= 1, f"--num-samples must be at least 1, got {args.num_samples}"),
              (args.expert_model_parallel_size >= 1, f"--expert-model-parallel-size must be at least 1, got "
                                                     f"{args.expert_model_parallel_size}"),
              (args.ckpt_step is None or args.ckpt_step >= 0, f"--ckpt-step must be non-negative, got {args.ckpt_step}"),
              (os.path.exists(args.load), f"--load {args.load}: no such directory (train first: torchrun "
                                          f"--nproc-per-node 2 train.py saves to checkpoints/)")]
    for ok, message in checks:
        if not ok:
            parser.error(message)
    return args


if __name__ == "__main__":
    ARGS = parse_args(sys.argv[1:])  # before the heavy imports below, as train.py

import torch
import yaml

from model import build_model, set_random_seed  # (first: quiets megatron-core's import warnings)
from megatron.core import parallel_state, tensor_parallel
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.inference.utils import InferenceMode
from megatron.core.transformer import attention as mcore_attention
from megatron.core.utils import unwrap_model

import device

import checkpoint
import data
from checkpoint import TrainState
from model import STOCK_CORE_ATTENTIONS, initialize_distributed  # (the same process groups as training)

# --------------------------------------------------------------------------------------------------
# The model of a checkpoint, for inference
# --------------------------------------------------------------------------------------------------


def inference_config(directory: str, world_size: int, expert_parallel: int = 1) -> config_lib.ConfigContainer:
    """The model and tokenizer of the run that wrote `directory` (its run_config.yaml), laid out for inference:
    split by tensor parallelism over all ranks (no pipeline, no data parallelism), fp32 weights, no dropout.
    An MoE model's experts are split over `expert_parallel` ranks instead, each expert whole on its rank, and the
    rest of the model over world_size / expert_parallel. torch_dist checkpoints reshard to any tensor- and
    expert-parallel size; torch ones need the sizes they were saved at."""
    path = os.path.join(directory, "run_config.yaml")
    if not os.path.isfile(path):
        raise checkpoint.CheckpointError(f"{path}: missing, so the model's shape is unknown")
    with open(path) as fh:
        saved = yaml.safe_load(fh)
    if saved.get("peft", {}).get("peft", "none") != "none":
        raise checkpoint.CheckpointError(f"{directory} holds {saved['peft']['peft']} adapters only; merge them into "
                                         f"their base first: python peft.py merge --load {directory} --save MERGED")
    cfg = config_lib.ConfigContainer()
    # An FSDP's checkpoint (fsdp_dtensor, torch_dcp) holds whole tensors, read into the unsharded model as such
    # (checkpoint.py's _read_dcp_weights); validated as the format of the layout that reads it.
    ckpt_format = saved["checkpoint"]["ckpt_format"]
    config_lib.apply_overrides(cfg, {"model": saved["model"], "tokenizer": saved["tokenizer"], "checkpoint": {
        "ckpt_format": "torch_dist" if ckpt_format in checkpoint.DCP_FORMATS else ckpt_format}}, source=path)
    m = cfg.model
    if expert_parallel > 1 and not m.num_moe_experts:
        raise config_lib.ConfigError(f"--expert-model-parallel-size {expert_parallel}: {directory} holds a dense model "
                                     f"(no experts); drop the flag")
    if world_size % expert_parallel:
        raise config_lib.ConfigError(f"--expert-model-parallel-size {expert_parallel} does not divide the {world_size} "
                                     f"processes; launch a multiple of it")
    tp = world_size // expert_parallel
    saved = (m.tensor_model_parallel_size, m.expert_model_parallel_size)
    if cfg.checkpoint.ckpt_format == "torch" and saved != (tp, expert_parallel):
        raise checkpoint.CheckpointError(f"{directory} is in torch format at tensor-parallel size {saved[0]} and "
                                         f"expert-parallel size {saved[1]}, which loads only at those sizes: run it "
                                         f"with torchrun --nproc-per-node {saved[0] * saved[1]} and "
                                         f"--expert-model-parallel-size {saved[1]}")
    m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size = tp, 1, 1
    m.expert_model_parallel_size, m.expert_tensor_parallel_size = expert_parallel, 1
    m.num_layers_per_virtual_pipeline_stage = m.virtual_pipeline_model_parallel_size = None
    m.num_layers_in_first_pipeline_stage = m.num_layers_in_last_pipeline_stage = None
    # Sequence parallelism splits a sequence over the tensor-parallel ranks, and a decode step's one token cannot be
    # split; megatron-core's own inference turns it off too (text_generation_controller.py).
    m.sequence_parallel, m.bf16, m.fp16 = False, False, False
    m.recompute_granularity = m.recompute_method = m.recompute_num_layers = None
    m.hidden_dropout = m.attention_dropout = 0.0
    # megatron-core's local layers, whose tensor names hf.py maps; torch_dist names a transformer-engine
    # layer's tensors the same way, so its checkpoints load here too.
    m.transformer_impl = "local"
    if cfg.tokenizer.tokenizer_type == "HuggingFaceTokenizer":  # the copy that travels with the weights
        cfg.tokenizer.tokenizer_model = os.path.join(directory, "tokenizer", "tokenizer.json")
    cfg.dataset.mock = True  # no data is read; this only spares the data checks
    cfg.train.train_iters = 0  # nor trained: the memory check counts the weights alone
    cfg.checkpoint.save = cfg.logger.tensorboard_dir = None
    return checks.validate(cfg, world_size=world_size)


@device.in_shim  # megatron-core on this machine, for the call (device.py)
def load_model(load: str, ckpt_step=None, text: bool = False, expert_parallel: int = 1):
    """(model, tokenizer, cfg): the checkpoint's GPTModel on every rank of this process group (one process
    without torchrun), in eval mode, with the tokenizer it was trained with; `text`: one that decodes to text;
    `expert_parallel`: an MoE model's experts split over that many ranks."""
    directory = checkpoint.resolve_load_dir(load, ckpt_step)
    if directory is None:
        raise checkpoint.CheckpointError(f"--load {load}: no {checkpoint.TRACKER} and not an iter_* directory")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = inference_config(directory, world_size, expert_parallel)
    checks.check_fits_in_memory(cfg)  # its weights, on this machine
    if not torch.distributed.is_initialized():
        initialize_distributed(cfg)
    set_random_seed(cfg.rng.seed)
    tokenizer = data.build_tokenizer(cfg)
    if text and isinstance(tokenizer, data.NullTokenizer):
        raise config_lib.ConfigError(f"{directory} was trained with NullTokenizer (token ids, no text): there is "
                                     f"nothing to decode the ids into or to encode text with; train with a text "
                                     f"tokenizer (ByteTokenizer or HuggingFaceTokenizer)")
    model = build_model(cfg, data.embedding_rows(tokenizer))
    state = types.SimpleNamespace(cfg=cfg, tokenizer=tokenizer, train_state=TrainState())
    checkpoint.load_checkpoint(state, model, None, None, directory, finetune=True)  # weights only
    model = unwrap_model(model[0])
    # Inference: dropout off, and frozen weights, which megatron-core's linear layers multiply through their lighter
    # autograd function (linear_with_frozen_weight: 5% of a small model's decode step, measured).
    model.eval().requires_grad_(False)
    return model, tokenizer, cfg


# --------------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------------


@device.in_shim
@torch.inference_mode()
def next_token_logits(model, ids: list) -> torch.Tensor:
    """The logits over the whole vocabulary for the token after `ids`: one forward over the sequence. With
    tensor parallelism each rank computes its slice of the vocabulary; they are gathered so every rank holds
    the same full row (and so samples the same token)."""
    tokens = torch.tensor([ids], dtype=torch.long, device=next(model.parameters()).device)
    positions = torch.arange(len(ids), device=tokens.device).unsqueeze(0)
    logits = model(tokens, positions, attention_mask=None)[0, -1]  # [vocab / TP]; None: causal attention
    return tensor_parallel.gather_from_tensor_model_parallel_region(logits).float()


@device.in_shim
@torch.inference_mode()
def cached_next_token_logits(model, ids: list, cache: StaticInferenceContext) -> torch.Tensor:
    """The same logits, from the tokens of `ids` that the cache has not seen: the whole prompt first (prefill),
    then the one token sampled last (decode), at its position. Each layer appends their keys and values to its
    cache (allocated at the first forward) and attends over everything cached. megatron-core computes the last
    position's logits only and gathers the vocabulary over tensor-parallel ranks (runtime_gather_output)."""
    start = cache.sequence_len_offset
    tokens = torch.tensor([ids[start:]], dtype=torch.long, device=next(model.parameters()).device)
    positions = torch.arange(start, len(ids), device=tokens.device).unsqueeze(0)
    if start > 0:
        cache.enable_decode_mode()
    # InferenceMode: megatron-core (0.18 on) takes its inference paths, flash decoding's among them, only while this
    # process-wide flag is up; with config.flash_decode on and the flag down, attention.py:1478 skips RoPE in the
    # decode steps without a word. Raised for the cached forward alone: next_token_logits' full forward asks for
    # no gathered output, which InferenceMode refuses (gpt_model.py:649).
    with InferenceMode.active():
        logits = model(tokens, positions, attention_mask=None, inference_context=cache, runtime_gather_output=True)
    cache.increment_sequence_len_offset(tokens.shape[1])  # the caller's job: GPTModel does not advance it
    return logits[0, -1].float()


def flash_decoding_applies(model) -> bool:
    """Whether megatron-core's flash decoding computes this model's attention as its plain cached decoding does:
    not with RoPE off in some layers (megatron-core refuses that, transformer_config.py:2814), nor a sliding window,
    an output gate or a softmax scale of one's own, which its decode step does not apply (an off-by-one or learnable
    softmax it does apply, from 0.19: attention.py:790-808), nor a core attention of one's own. And
    whether its kernel takes the weights' precision: flash-attn's own takes fp16 and bf16 only, so with flash-attn
    installed an fp32 model (what load_model builds) decodes the plain way; device.py's takes any."""
    c = model.config
    # its kernel stands in for the core attention: a fork's own (model.core_attention) decodes the plain way, which runs it
    stock = all(type(m.core_attention) in STOCK_CORE_ATTENTIONS for m in model.modules() if hasattr(m, "core_attention"))
    kernel_takes_it = mcore_attention.flash_attn_with_kvcache is device.flash_attn_with_kvcache or \
        c.params_dtype in (torch.float16, torch.bfloat16)
    return c.no_rope_freq is None and c.window_size is None and \
        not c.attention_output_gate and c.softmax_scale is None and not c.multi_latent_attention and kernel_takes_it and stock


@contextlib.contextmanager
def flash_decoding(model, on: bool = True):
    """megatron-core's flash decoding (Megatron-LM's --flash-decode) for the cached steps, where it applies. The
    prefill caches each key already rotated by RoPE, and a decode step rotates its one token's query and key, writes
    the key and value into the cache and attends, in one kernel call (flash-attn's `flash_attn_with_kvcache`, or
    device.py's torch version). Without it megatron-core caches the keys unrotated and rotates every cached key
    again at every step (attention.py:686,696,1517), a cost that grows with the sequence. The tokens are the same."""
    config = model.config
    before = config.flash_decode
    config.flash_decode = on and flash_decoding_applies(model)
    try:
        yield
    finally:
        config.flash_decode = before


def pick(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator=None) -> int:
    """The next token from one row of logits: the argmax when `generator` is None (greedy); else a sample
    at `temperature` among the `top_k` likeliest (0: all), within the smallest set whose probability
    reaches `top_p` (Holtzman et al. 2019, nucleus sampling)."""
    if generator is None:
        return int(torch.argmax(logits))
    logits = logits / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True)
        before = torch.cumsum(torch.softmax(ordered, dim=-1), dim=-1) - torch.softmax(ordered, dim=-1)
        logits = logits.index_fill(0, order[before >= top_p], float("-inf"))  # keep tokens until P is reached
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


def kv_cache_length(prompt_tokens: int, max_new_tokens: int, context: int) -> int:
    """Positions the KV cache holds: the prompt and the new tokens, at most the context. (Sized to the context alone,
    an imported Llama-3.2, 131,072 positions, would ask for ~8.6 GB of fp32 keys and values to write ten tokens.)"""
    return min(context, prompt_tokens + max_new_tokens)


@device.in_shim
def generate(model, tokenizer, prompt_ids: list, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, seed=None, on_token=None, kv_cache: bool = True, generator=None) -> list:
    """The new token ids after `prompt_ids`, stopping early at the end-of-document token. `seed` None (and no
    `generator`) is greedy decoding; `on_token(id)` is called as each token comes. The window is the model's
    context: a longer sequence keeps its newest tokens. `kv_cache` False: a full forward per token."""
    context = model.max_sequence_length
    vocab = tokenizer.vocab_size  # ids past it (the pad, the tensor-parallel padding) are never text
    if generator is None and seed is not None:
        generator = torch.Generator().manual_seed(seed)
    cached = kv_cache_length(len(prompt_ids), max_new_tokens, context)
    cache = StaticInferenceContext(max_batch_size=1, max_sequence_length=cached) if kv_cache else None
    ids, new = list(prompt_ids), []
    with flash_decoding(model, kv_cache):
        for _ in range(max_new_tokens):
            if cache is not None and len(ids) <= cached:
                logits = cached_next_token_logits(model, ids, cache)[:vocab]
            else:  # no cache, or past the context: the cached positions cannot slide
                logits = next_token_logits(model, ids[-context:])[:vocab]
            token = pick(logits.cpu(), temperature, top_k, top_p, generator)
            if token == tokenizer.eod:
                break
            ids.append(token)
            new.append(token)
            if on_token is not None:
                on_token(token)
    return new


class TextStream:
    """Prints the decoded text as tokens come. A byte-level tokenizer splits a character over several tokens,
    so the text is decoded whole each time and a trailing incomplete character waits for the next token."""

    def __init__(self, tokenizer, out=sys.stdout):
        self.tokenizer, self.out, self.ids, self.shown = tokenizer, out, [], 0

    def __call__(self, token: int) -> None:
        self.ids.append(token)
        text = self.tokenizer.detokenize(self.ids)
        if text.endswith("\ufffd"):
            return
        self.out.write(text[self.shown:])
        self.out.flush()
        self.shown = len(text)


@device.in_shim
def main(args) -> int:
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout is the text alone
            model, tokenizer, cfg = load_model(args.load, args.ckpt_step, text=True,
                                               expert_parallel=args.expert_model_parallel_size)
        prompt_ids = tokenizer.tokenize(args.prompt)
        if not prompt_ids:
            raise config_lib.ConfigError("--prompt is empty")
        if len(prompt_ids) >= model.max_sequence_length:
            raise config_lib.ConfigError(f"--prompt is {len(prompt_ids)} tokens but the model's context is "
                                         f"{model.max_sequence_length}; shorten it")
        rank0 = torch.distributed.get_rank() == 0
        # One generator for all samples: each sample draws on from where the previous one stopped.
        generator = None if args.greedy else torch.Generator().manual_seed(args.seed)
        for sample in range(args.num_samples):
            if rank0:
                sys.stdout.write(("---------------\n" if sample else "") + args.prompt)
            generate(model, tokenizer, prompt_ids, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                     on_token=TextStream(tokenizer) if rank0 else None, kv_cache=args.kv_cache, generator=generator)
            if rank0:
                sys.stdout.write("\n")
        return 0
    except (config_lib.ConfigError, checkpoint.CheckpointError) as e:
        sys.stderr.write(f"generate.py: error: {e}\n")
        return 2
    finally:
        parallel_state.destroy_model_parallel()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        # The model holds its process groups in reference cycles, and a destroyed gloo group's I/O thread polls until
        # its object is freed (as at the end of train.pretrain).
        model = None  # noqa: F841
        gc.collect()


if __name__ == "__main__":
    sys.exit(main(ARGS))
