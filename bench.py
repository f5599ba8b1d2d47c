"""bench.py: what the machinery costs, measured side by side in one run. Prints one table.

Names here are this project's own.

    python bench.py checkpoint [--num-layers 16 --hidden-size 768 ...]   # save/load vs torch.save/torch.load
    python bench.py logging [train.py flags]                             # log_step's share of a step
    python bench.py data                                                 # preprocessing and sample fetch speed
    python bench.py overhead [train.py flags]                            # train.py's loop vs a bare loop
    python bench.py ladder                                               # tokens/s, TFLOP/s, MFU, memory by size
    python bench.py hotpath                                              # each hot-path choice, off vs on
    python bench.py generate [train.py model flags]                      # generate.py's tokens/s vs transformers
    python bench.py parallel [train.py flags]                            # SP and CP per iteration vs TP=2, 2 processes
    python bench.py moe [train.py flags]                                 # MoE vs dense, EP=2, vs Megatron-LM's
    python bench.py v3 [train.py flags]                                  # MLA+MoE+MTP, Adam vs Muon, vs Megatron-LM's
    python bench.py small [--rounds 3] [--iters N]                       # train.py vs a plain PyTorch loop, small GPTs
    python bench.py profile STACKS --rate HZ --iterations N              # py-spy's stacks of a run, split by part
    python bench.py ops                                                  # torch.profiler's ops: train.py vs the plain loop
    python bench.py ops decode [train.py model flags]                    # torch.profiler's ops of a decoded token

Benchmarks report; the tests never assert on timings.
"""

import json
import os
import shutil
import sys
import tempfile
import time


# --------------------------------------------------------------------------------------------------
# bench.py small's other side: a plain PyTorch loop. It runs in its own process (`bench.py _plain`), before anything
# of the project (and so megatron-core) is imported below.
# --------------------------------------------------------------------------------------------------


def plain_loop(argv, on_iteration=None) -> None:
    """train.py's default GPT (learned positions, LayerNorm, biases, GELU MLP of 4h, tied embeddings, causal SDPA, no
    dropout) in plain PyTorch, trained nanoGPT's way: random windows of the same .bin train.py reads, cross-entropy,
    clipping at 1.0, torch's fused AdamW with no decay on biases and norms (megatron-core's groups), train.py's
    warm-up and cosine schedule. Prints the log lines bench_small times, train.py's markers at the same points."""
    import argparse
    import math

    import numpy as np
    import torch
    from torch import nn
    from torch.nn import functional as F

    p = argparse.ArgumentParser()
    for name in ("layers", "hidden", "heads", "seq", "batch", "vocab", "iters", "warmup", "log_interval"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--min-lr", type=float, required=True)
    p.add_argument("--data", required=True)
    a = p.parse_args(argv)
    torch.manual_seed(1234)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(a.hidden), nn.LayerNorm(a.hidden)
            self.qkv, self.proj = nn.Linear(a.hidden, 3 * a.hidden), nn.Linear(a.hidden, a.hidden)
            self.fc1, self.fc2 = nn.Linear(a.hidden, 4 * a.hidden), nn.Linear(4 * a.hidden, a.hidden)

        def forward(self, x):
            b, s, h = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, a.heads, h // a.heads).permute(2, 0, 3, 1, 4)
            x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(a.vocab, a.hidden), nn.Embedding(a.seq, a.hidden)
            self.blocks, self.ln_f = nn.ModuleList(Block() for _ in range(a.layers)), nn.LayerNorm(a.hidden)
            for name, w in self.named_parameters():
                if w.dim() == 2:
                    scaled = name.endswith(("proj.weight", "fc2.weight"))  # megatron-core's output_layer_init_method
                    nn.init.normal_(w, std=0.02 / math.sqrt(2 * a.layers) if scaled else 0.02)
                elif not name.startswith("ln") and ".ln" not in name:
                    nn.init.zeros_(w)

        def forward(self, tokens, labels):
            x = self.wte(tokens) + self.wpe.weight[: tokens.shape[1]]
            for block in self.blocks:
                x = block(x)
            logits = self.ln_f(x) @ self.wte.weight.t()
            return F.cross_entropy(logits.view(-1, a.vocab), labels.reshape(-1))

    model = GPT()
    params = list(model.parameters())
    groups = [dict(params=[w for w in params if w.dim() > 1], weight_decay=0.01),
              dict(params=[w for w in params if w.dim() == 1], weight_decay=0.0)]
    optimizer = torch.optim.AdamW(groups, lr=a.lr, fused=True)
    tokens = np.memmap(a.data + ".bin", dtype=np.uint16, mode="r")  # megatron-core's dtype for a vocabulary < 65500
    print(f" > number of parameters: {sum(w.numel() for w in params)}", flush=True)
    print(f" training from iteration 0 to {a.iters} ...", flush=True)
    for it in range(1, a.iters + 1):
        if on_iteration:  # bench.py ops
            on_iteration()
        cosine = 0.5 * (1 + math.cos(math.pi * (it - a.warmup) / (a.iters - a.warmup)))
        lr = a.lr * it / a.warmup if it <= a.warmup else a.min_lr + (a.lr - a.min_lr) * cosine
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = np.random.randint(0, len(tokens) - a.seq - 1, a.batch)
        window = torch.from_numpy(np.stack([tokens[s:s + a.seq + 1] for s in starts]).astype(np.int64))
        loss = model(window[:, :-1], window[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if it % a.log_interval == 0:
            print(f" iteration {it:8d}/{a.iters:8d} | lm loss: {loss.item():.6E} |", flush=True)


if __name__ == "__main__" and sys.argv[1:2] == ["_plain"]:
    plain_loop(sys.argv[2:])
    sys.exit(0)

import config as config_lib  # noqa: E402 (after the plain loop, which must not import megatron-core)
import checks


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def bench_checkpoint(argv) -> list:
    """checkpoint.save_checkpoint / load_checkpoint beside a plain torch.save / torch.load of the same
    model and optimizer state, and beside raw file writes and reads of as many bytes, on one process."""
    defaults = ["--num-layers", "16", "--hidden-size", "768", "--num-attention-heads", "12", "--seq-length", "1024",
                "--mock-data"]
    cfg = checks.parse_args(defaults + argv, world_size=1)
    import torch

    import checkpoint
    import train
    from model import build_model, build_optimizer, wrap_model

    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    train.parallel_state.initialize_model_parallel(1, 1)
    model = wrap_model(cfg, build_model(cfg, 258))  # megatron-core's optimizer reads DDP's grad buffers
    optimizer = build_optimizer(cfg, model)
    optimizer.step()  # one step (of zero gradients), so the optimizer holds its full state (Adam moments)
    scheduler = train.build_scheduler(cfg, optimizer)
    n_params = sum(p.numel() for p in model[0].parameters())

    work = tempfile.mkdtemp(prefix="bench_ckpt_", dir=os.environ.get("BENCH_DIR"))
    cfg.checkpoint.save = work
    state = train.GlobalState(cfg)
    state.train_state.step = 1
    rows = []
    try:
        t = time.perf_counter()
        directory = checkpoint.save_checkpoint(state, model, optimizer, scheduler)
        save_s = time.perf_counter() - t
        size = _dir_bytes(directory)
        t = time.perf_counter()
        checkpoint.load_checkpoint(state, model, optimizer, scheduler, work)
        load_s = time.perf_counter() - t

        cfg.checkpoint.async_save, state.train_state.step = True, 2  # --async-save: what training waits for
        t = time.perf_counter()
        checkpoint.save_checkpoint(state, model, optimizer, scheduler)
        async_block_s = time.perf_counter() - t
        checkpoint.close_async_save(state)
        async_total_s = time.perf_counter() - t

        plain = os.path.join(work, "plain.pt")
        t = time.perf_counter()
        torch.save({"model": model[0].state_dict(), "optimizer": optimizer.state_dict()}, plain)
        plain_save_s = time.perf_counter() - t
        t = time.perf_counter()
        torch.load(plain, map_location="cpu", weights_only=True)
        plain_load_s = time.perf_counter() - t

        raw = os.path.join(work, "raw.bin")
        blob = os.urandom(1 << 24)
        t = time.perf_counter()
        with open(raw, "wb") as fh:
            for _ in range(size // len(blob) + 1):
                fh.write(blob)
        raw_write_s = time.perf_counter() - t
        t = time.perf_counter()
        with open(raw, "rb") as fh:
            while fh.read(1 << 24):
                pass
        raw_read_s = time.perf_counter() - t
        raw_size = os.path.getsize(raw)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        train.destroy_distributed()

    gb = size / 1e9
    rows.append(("checkpoint", f"{n_params / 1e6:.1f}M params, {gb:.2f} GB", "save_checkpoint", f"{save_s:.2f} s",
                 f"{gb / save_s:.2f} GB/s"))
    rows.append(("", "", "save_checkpoint --async-save: training blocked", f"{async_block_s:.2f} s", ""))
    rows.append(("", "", "save_checkpoint --async-save: until published", f"{async_total_s:.2f} s",
                 f"{gb / async_total_s:.2f} GB/s"))
    rows.append(("", "", "load_checkpoint", f"{load_s:.2f} s", f"{gb / load_s:.2f} GB/s"))
    rows.append(("", "", "torch.save (same state)", f"{plain_save_s:.2f} s", f"{gb / plain_save_s:.2f} GB/s"))
    rows.append(("", "", "torch.load (same state)", f"{plain_load_s:.2f} s", f"{gb / plain_load_s:.2f} GB/s"))
    rows.append(("", "", "raw write (same bytes)", f"{raw_write_s:.2f} s", f"{raw_size / 1e9 / raw_write_s:.2f} GB/s"))
    rows.append(("", "", "raw read (same bytes)", f"{raw_read_s:.2f} s", f"{raw_size / 1e9 / raw_read_s:.2f} GB/s"))
    return rows


def bench_logging(argv) -> list:
    """Time spent in metrics.log_step (accumulating, TensorBoard, the log line) beside the whole
    iteration, over a real single-process run of the default model at the default --log-interval."""
    cfg = checks.parse_args(["--mock-data", "--train-iters", "60", "--eval-iters", "0", "--num-workers", "0"] + argv,
                                world_size=1)
    import contextlib
    import io

    import metrics
    import train

    spent = []
    original = metrics.log_step

    def timed(*args, **kwargs):
        t = time.perf_counter()
        result = original(*args, **kwargs)
        spent.append(time.perf_counter() - t)
        return result

    metrics.log_step = timed  # measured from the outside; train.py is unchanged
    t = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        state = train.pretrain(cfg)
    total = time.perf_counter() - t
    metrics.log_step = original
    iters = state.train_state.step
    log_s = sum(spent)
    per_iter_ms = 1000 * total / iters
    return [("logging", f"default model, --log-interval {cfg.logger.log_interval}, {iters} iterations",
             "log_step per iteration", f"{1000 * log_s / iters:.3f} ms", f"{100 * log_s / total:.2f}% of the run"),
            ("", "", "whole run per iteration (setup included)", f"{per_iter_ms:.1f} ms", "")]


def bench_data(argv) -> list:
    """Preprocessing throughput (1 and 2 workers) beside a raw read of the same JSONL, and the time to
    fetch a microbatch from megatron-core's GPTDataset beside the default model's step time."""
    import json

    import pydoc_data.topics

    import data

    work = tempfile.mkdtemp(prefix="bench_data_", dir=os.environ.get("BENCH_DIR"))
    rows = []
    try:
        src = os.path.join(work, "corpus.jsonl")
        topics = pydoc_data.topics.topics
        with open(src, "w") as fh:
            for copy in range(40):  # ~19 MB of real text, every paragraph a document
                for key in sorted(topics):
                    for paragraph in topics[key].split("\n\n"):
                        if paragraph.strip():
                            fh.write(json.dumps({"text": f"{copy} {paragraph}"}) + "\n")
        mb = os.path.getsize(src) / 1e6
        t = time.perf_counter()
        with open(src, "rb") as fh:
            while fh.read(1 << 24):
                pass
        raw = time.perf_counter() - t
        rows.append(("data", f"{mb:.1f} MB JSONL", "raw read", f"{raw:.2f} s", f"{mb / raw:.0f} MB/s"))
        for workers in (1, 2):
            t = time.perf_counter()
            stats = data.preprocess(src, os.path.join(work, f"out{workers}"), ["text"], data.ByteTokenizer(), True,
                                    workers, log_interval=1e9)
            seconds = time.perf_counter() - t
            rows.append(("", "", f"preprocess, {workers} worker(s)", f"{seconds:.2f} s", f"{mb / seconds:.2f} MB/s"))

        import torch

        import train

        cfg = checks.parse_args(["--data-path", stats["text"]["prefix"], "--num-workers", "0", "--eval-iters", "0",
                                     "--data-cache-path", os.path.join(work, "cache"), "--train-iters", "50"] + argv,
                                    world_size=1)
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
        train.parallel_state.initialize_model_parallel(1, 1)
        try:
            train_ds = data.build_datasets(cfg, data.ByteTokenizer())[0]
            loader = data.build_data_loader(train_ds, 0, cfg)
            it = iter(loader)
            next(it)
            t = time.perf_counter()
            for _ in range(50):
                next(it)
            fetch_ms = 1000 * (time.perf_counter() - t) / 50
        finally:
            train.destroy_distributed()
        rows.append(("", f"GPTDataset, micro batch {cfg.train.micro_batch_size} x {cfg.model.seq_length}",
                     "fetch one microbatch (no workers)", f"{fetch_ms:.2f} ms", ""))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


# --------------------------------------------------------------------------------------------------
# The training loop: train.py against a bare loop, a ladder of model sizes, the hot-path choices
# --------------------------------------------------------------------------------------------------


def _quiet(fn, *args):
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*args)


def _seconds_per_iteration(stamps: list, warmup: int) -> float:
    """Mean iteration time from per-iteration timestamps, the first `warmup` iterations left out."""
    stamps = stamps[warmup:]
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def train_py_run(cfg, warmup: int = 3) -> dict:
    """train.pretrain as a user runs it. An iteration is timed from one log_step call to the next
    (log_step runs once per iteration, after the step), so everything the loop does is counted.
    Also returns the parameter count and the memory in use right after the first step (weights,
    gradients and optimizer state live; activations freed): CPU resident set, or CUDA allocated."""
    import psutil
    import torch

    import metrics
    import train

    stamps, seen, original_log, original_opt = [], {}, metrics.log_step, train.build_optimizer

    def stamped(*args, **kwargs):
        stamps.append(time.perf_counter())
        if len(stamps) == 1:  # the model is alive here; train.pretrain empties it at the end
            seen["memory"] = torch.cuda.memory_allocated() if cfg.use_gpu else psutil.Process().memory_info().rss
            params = [p for chunk in seen["model"] for p in chunk.parameters()]
            states = [t for st in seen["optimizer"].optimizer.state.values() for t in st.values() if torch.is_tensor(t)]
            seen["weight_bytes"] = (_tensor_bytes(params) + _tensor_bytes([p.grad for p in params])
                                    + _tensor_bytes(states))
        return original_log(*args, **kwargs)

    def counted(cfg_, model, timers=None):
        seen["params"] = sum(p.numel() for chunk in model for p in chunk.parameters())
        seen["model"] = model
        seen["optimizer"] = original_opt(cfg_, model, timers)
        return seen["optimizer"]

    metrics.log_step, train.build_optimizer = stamped, counted
    try:
        _quiet(train.pretrain, cfg)
    finally:
        metrics.log_step, train.build_optimizer = original_log, original_opt
    return dict(seconds=_seconds_per_iteration(stamps, warmup), **seen)


def bare_seconds_per_iteration(cfg, warmup: int = 3) -> float:
    """The plainest loop over the same batches and an identical GPTModel (train.setup builds the data; the model is
    built again, unwrapped): forward, masked mean loss, plain backward per microbatch, then torch's fused AdamW and
    the scheduler. No megatron DDP, megatron optimizer, schedule, timers, loss reduction, NaN check or logging."""
    import torch

    import train
    from model import build_model

    state, _, _, _, (train_it, _, _) = _quiet(train.setup, cfg)
    model = build_model(cfg, cfg.padded_vocab_size)[0]
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay,
                                  fused=not cfg.use_gpu)
    scheduler = train.build_scheduler(cfg, optimizer)
    n_micro, gbs = state.num_microbatches, cfg.train.global_batch_size
    stamps = []
    try:
        for _ in range(cfg.train.train_iters):
            optimizer.zero_grad()
            for _ in range(n_micro):
                batch = next(train_it)
                if cfg.use_gpu:
                    batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
                losses = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
                mask = batch["loss_mask"].float()
                ((losses.float() * mask).sum() / mask.sum() / n_micro).backward()
            optimizer.step()
            scheduler.step(increment=gbs)
            stamps.append(time.perf_counter())
    finally:
        train._finish_train(state)
    return _seconds_per_iteration(stamps, warmup)


def _run_cfg(argv: list, iters: int):
    return checks.parse_args(["--mock-data", "--eval-iters", "0", "--train-iters", str(iters)] + argv, world_size=1)


def bench_overhead(argv) -> list:
    """train.py's time per iteration against the bare loop, alternating, three rounds each, median."""
    import statistics

    import torch

    iters = 30
    ours, bare = [], []
    for _ in range(3):
        ours.append(train_py_run(_run_cfg(argv, iters))["seconds"])
        bare.append(bare_seconds_per_iteration(_run_cfg(argv, iters)))
    cfg = _run_cfg(argv, iters)
    o, b = statistics.median(ours), statistics.median(bare)
    setup = (f"{cfg.model.num_layers}x{cfg.model.hidden_size}, gbs {cfg.train.global_batch_size}, seq "
             f"{cfg.model.seq_length}, log every {cfg.logger.log_interval}, {torch.get_num_threads()} threads")
    return [("overhead", setup, "bare loop per iteration", f"{1000 * b:.1f} ms", ""),
            ("", "", "train.py per iteration", f"{1000 * o:.1f} ms", f"{100 * (o - b) / b:+.2f}% vs bare"),
            ("", "", "rounds (train.py / bare, ms)",
             " ".join(f"{1000 * x:.0f}/{1000 * y:.0f}" for x, y in zip(ours, bare)), "")]


CPU_LADDER = [(6, 256, 4), (8, 384, 6), (8, 512, 8), (12, 576, 9)]  # (layers, hidden, heads): ~5M to ~50M params
GPU_LADDER = [(12, 768, 12), (24, 1024, 16), (24, 1536, 16), (24, 2048, 16)]  # ~125M to ~1.3B params


def bench_ladder(argv) -> list:
    """tokens/s, TFLOP/s per device and MFU of train.py for a ladder of GPT sizes; and each size's
    measured memory beside metrics.py's theoretical estimate. One subprocess per size, so each peak
    is that size's own."""
    import json
    import subprocess

    import torch

    gpu = torch.cuda.is_available()
    ladder = GPU_LADDER if gpu else CPU_LADDER
    extra = ["--bf16", "--use-distributed-optimizer", "--micro-batch-size", "8", "--global-batch-size", "64",
             "--seq-length", "2048"] if gpu else ["--micro-batch-size", "4", "--global-batch-size", "8",
                                                  "--seq-length", "256"]
    rows = []
    for layers, hidden, heads in ladder:
        args = ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
                *extra, *argv]
        out = subprocess.run([sys.executable, __file__, "_one_size", *args], capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-2000:])
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(("ladder" if not rows else "", f"{r['params'] / 1e6:.1f}M ({layers}x{hidden})",
                     f"{r['tokens_per_s']:.0f} tok/s, {r['tflops']:.3f} TFLOP/s/device, MFU {r['mfu']}",
                     f"{1000 * r['seconds']:.0f} ms/it",
                     f"MB measured/estimated: weights+optimizer {r['weights_mb']:.0f}/{r['theory_weights_mb']:.0f}, "
                     f"activations per microbatch {r['activations_mb']:.0f}/{r['theory_activations_mb']:.0f}, "
                     f"peak {r['peak_mb']:.0f}"))
    return rows


def _tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among `tensors` (views of one storage count once)."""
    seen = {}
    for t in tensors:
        if t is not None and t.device.type != "meta":
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def saved_activation_bytes(model, cfg) -> int:
    """Bytes autograd keeps for the backward pass of one microbatch's forward (the activations),
    counted by a saved-tensors hook; parameters it saves (weights of matmuls) are not activations."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved.append(t)
        return t

    b, s = cfg.train.micro_batch_size, cfg.model.seq_length
    device = "cuda" if cfg.use_gpu else "cpu"
    tokens = torch.randint(0, 256, (b, s), device=device)
    positions = torch.arange(s, device=device).expand(b, s)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        losses = model(tokens, positions, None, labels=tokens)
    bytes_ = _tensor_bytes(saved)
    losses.sum().backward()
    return bytes_


def _one_size(argv) -> dict:
    """One ladder size, in its own process: the throughput of train.py, then its memory measured beside
    metrics.py's estimates. Weights+optimizer: the bytes of the parameters, gradients and optimizer
    state tensors after training; activations: what autograd saves for one microbatch's backward."""
    import resource

    import psutil
    import torch

    import metrics
    import train  # noqa: F401  (imported before the baseline: libraries are not the run's memory)

    cfg = _run_cfg(argv, 12)
    baseline = psutil.Process().memory_info().rss
    run = train_py_run(cfg, warmup=3)
    flops = metrics.num_floating_point_operations(cfg, cfg.train.global_batch_size, cfg.padded_vocab_size)
    tflops = metrics.throughput_tflops_per_device(flops, run["seconds"], cfg.world_size)
    mfu = metrics.mfu(tflops, metrics.peak_tflops(metrics.device_name(), "bf16" if cfg.model.bf16 else "fp32"))
    # CUDA allocated after the first step (weights, grads, main params, moments), or the tensors' bytes on a CPU
    weights = run["memory"] if cfg.use_gpu else run["weight_bytes"]
    from megatron.core.transformer.module import Float16Module

    import model as model_py

    # The run's model was emptied when it ended: the activations are measured on a fresh one of the same shape.
    train.initialize_distributed(cfg)
    try:
        model_py.set_random_seed(cfg.rng.seed)  # megatron-core's RNG tracker: weight init and dropout on a GPU
        fresh = model_py.build_model(cfg, cfg.padded_vocab_size)[0]
        if cfg.model.bf16 or cfg.model.fp16:
            fresh = Float16Module(fresh.config, fresh)
        activations = saved_activation_bytes(fresh, cfg)
    finally:
        train.destroy_distributed()
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline  # ru_maxrss: KiB on Linux
    mb = metrics.NUM_BYTES_IN_MEGABYTE
    return dict(params=run["params"], seconds=run["seconds"],
                tokens_per_s=cfg.train.global_batch_size * cfg.model.seq_length / run["seconds"], tflops=tflops, mfu=mfu,
                weights_mb=weights / mb, theory_weights_mb=metrics.compute_weight_and_optimizer_memory(cfg) / mb,
                activations_mb=activations / mb,
                theory_activations_mb=metrics.compute_activation_memory(
                    cfg, cfg.train.global_batch_size // (cfg.train.micro_batch_size * cfg.data_parallel_size)) / mb,
                peak_mb=(torch.cuda.max_memory_allocated() if cfg.use_gpu else rss_peak) / mb)


def _timed(fn, repeat: int) -> float:
    fn()  # warm-up
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t) / repeat


def bench_hotpath(argv) -> list:
    """Each hot-path choice against its alternative, on the default model (or the flags given):
    the optimizer's step (per-tensor loop, foreach, fused), core attention forward+backward (SDPA against
    the unfused softmax(QK^T)V that megatron-core's local DotProductAttention computes), tied against
    untied embeddings, and DataLoader prefetch workers against none, each as train.py's time per iteration."""
    import torch
    import torch.nn.functional as F

    import train
    from model import build_model

    rows = []
    cfg = checks.parse_args(["--mock-data"] + argv, world_size=1)
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    train.parallel_state.initialize_model_parallel(1, 1)
    try:
        params = [p for p in build_model(cfg, 258)[0].parameters()]
        for p in params:
            p.grad = torch.randn_like(p)
        label = f"{sum(p.numel() for p in params) / 1e6:.1f}M params"
        for name, kwargs in (("per-tensor loop", dict(foreach=False)), ("foreach", dict(foreach=True)),
                             ("fused (used)", dict(fused=True))):
            opt = torch.optim.AdamW([dict(params=params)], lr=1e-4, weight_decay=0.1, **kwargs)
            rows.append(("hotpath" if not rows else "", label if not rows else "", f"AdamW step, {name}",
                         f"{1000 * _timed(opt.step, 5):.1f} ms", ""))
    finally:
        train.destroy_distributed()

    m = cfg.model
    b, s, heads, d = cfg.train.micro_batch_size, m.seq_length, m.num_attention_heads, m.hidden_size // m.num_attention_heads
    q, k, v = (torch.randn(b, heads, s, d, requires_grad=True) for _ in range(3))
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)

    def unfused():  # what megatron-core's local DotProductAttention computes, as separate ops
        scores = (q @ k.transpose(-1, -2)) / d ** 0.5
        probs = F.dropout(scores.masked_fill(causal, float("-inf")).softmax(-1), m.attention_dropout)
        (probs @ v).sum().backward()

    def sdpa():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=m.attention_dropout).sum().backward()

    shape = f"attention b{b} h{heads} s{s} d{d}"
    rows.append(("", shape, "unfused softmax(QK^T)V, fwd+bwd", f"{1000 * _timed(unfused, 10):.2f} ms", ""))
    rows.append(("", "", "SDPA (used), fwd+bwd", f"{1000 * _timed(sdpa, 10):.2f} ms", ""))

    base = ["--mock-data", "--eval-iters", "0", "--train-iters", "25", *argv]
    for what, extra in (("untied embeddings", ["--untie-embeddings-and-output-weights"]), ("tied (default)", []),
                        ("no prefetch (--num-workers 0)", ["--num-workers", "0"]), ("2 prefetch workers (default)", [])):
        run = train_py_run(checks.parse_args(base + extra, world_size=1))
        rows.append(("", "train.py" if "untied" in what else "", what, f"{1000 * run['seconds']:.1f} ms/it",
                     f"{run['params'] / 1e6:.2f}M params"))
    return rows


# The MoE row's model: the default model's size as Mixtral (LLaMA's layers, each an MoE layer of 8 experts, top-2).
MIXTRAL = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
           "--untie-embeddings-and-output-weights", "--num-query-groups", "4", "--num-experts", "8",
           "--moe-router-topk", "2", "--moe-ffn-hidden-size", "512"]


def bench_generate(argv) -> list:
    """generate.py's decoding, with its KV cache (the default) and without (--no-kv-cache: a full forward per
    token), beside transformers' generate() with and without its KV cache, on the same weights (the default model,
    random, exported through hf.py), greedy, one process; then the same with the caches alone on a Mixtral-like
    MoE model of that size (MIXTRAL). Three alternating rounds; the best of each path. Prefill is the time to the
    first new token (the prompt's forward and one pick); decode is each token after it: (the time for all new
    tokens - the time for one) / (new - 1)."""
    rows = _generate_rows(argv, caches=(True, False))
    return rows + _generate_rows([*argv, *MIXTRAL], caches=(True,), label="MoE (Mixtral)")


def _generate_rows(argv, caches, label="generate") -> list:
    import torch

    import data
    import generate
    import hf
    from megatron.core import parallel_state
    from model import build_model, set_random_seed
    from model import initialize_distributed
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    cfg = checks.parse_args(["--mock-data", "--no-save", "--no-tensorboard", "--hidden-dropout", "0",
                                 "--attention-dropout", "0", *argv], world_size=1)
    initialize_distributed(cfg)
    set_random_seed(cfg.rng.seed)
    tokenizer = data.ByteTokenizer()
    model = build_model(cfg, data.embedding_rows(tokenizer))[0].eval().requires_grad_(False)  # as generate.load_model
    layout = hf.choose_layout(cfg.model)
    with tempfile.TemporaryDirectory() as exported:  # hf.export's two files, read by from_pretrained (which
        with open(os.path.join(exported, "config.json"), "w") as fh:  # turns Mixtral's experts into its own layout)
            json.dump(hf.hf_config(cfg.model, layout, tokenizer.vocab_size, tokenizer.eod, torch.float32), fh)
        save_file(hf.to_hf(model.state_dict(), cfg.model, layout, tokenizer.vocab_size),
                  os.path.join(exported, "model.safetensors"), metadata={"format": "pt"})
        theirs = AutoModelForCausalLM.from_pretrained(exported).eval()
    prompt, new = tokenizer.tokenize("The Python"), cfg.model.seq_length - 16
    never_stops = type("NeverStops", (), dict(vocab_size=tokenizer.vocab_size, eod=-1))()  # every run makes `new`

    def ours(cache):
        return lambda n: generate.generate(model, never_stops, prompt, n, kv_cache=cache)

    def transformers_generate(cache):
        def run(n):
            with torch.no_grad():
                return theirs.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                       use_cache=cache, pad_token_id=0)[0, len(prompt):].tolist()
        return run

    names = {True: ("generate.py, KV cache", "transformers generate(), KV cache"),
             False: ("generate.py --no-kv-cache", "transformers generate(), no cache")}
    paths = {}
    for cache in caches:
        paths.update({names[cache][0]: ours(cache), names[cache][1]: transformers_generate(cache)})
    best = {what: [float("inf"), float("inf")] for what in paths}  # (prefill, all `new` tokens), seconds
    tokens = {}
    for what, fn in paths.items():
        tokens[what] = fn(new)  # warm-up, and the tokens to compare
    for _ in range(3):  # alternating rounds: a slow moment of the machine hits every path alike
        for what, fn in paths.items():
            for i, n in enumerate((1, new)):
                t = time.perf_counter()
                fn(n)
                best[what][i] = min(best[what][i], time.perf_counter() - t)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    first = tokens["generate.py, KV cache"]
    m, rows = cfg.model, []
    shape = f"{m.num_layers}x{m.hidden_size}" + (f", {m.num_moe_experts} experts top-{m.moe_router_topk}" if m.num_moe_experts
                                                 else "")
    for what, (prefill, total) in best.items():
        decode = (total - prefill) / (new - 1)
        rows.append((label if not rows else "", f"{shape}, {len(prompt)}+{new} tokens, {torch.get_num_threads()} "
                     f"threads" if not rows else "", what,
                     f"prefill {1000 * prefill:.1f} ms, decode {1000 * decode:.2f} ms/token",
                     f"{new / total:.0f} tokens/s, decode {1 / decode:.0f} tokens/s"
                     + ("" if tokens[what] == first else " (other tokens!)")))
    return rows


PARALLEL_LAYOUTS = {  # 2 processes each; the vocabulary padded alike (64 x TP 2 = 128 x 1)
    "TP=2": ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"],
    "TP=2 + SP": ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64", "--sequence-parallel"],
    "CP=2 (all_gather)": ["--context-parallel-size", "2", "--cp-comm-type", "all_gather"],
    "DP=2": [],
}


def bench_parallel(argv) -> list:
    """train.py's time per iteration under sequence and context parallelism beside TP=2 without SP (and DP=2), on
    the same model and global batch, 2 processes under torchrun each. Three alternating rounds; the best round's
    median iteration time (the log line's elapsed time, iterations 6-20) of each layout."""
    import re
    import subprocess

    base = ["--mock-data", "--eval-iters", "0", "--train-iters", "20", "--log-interval", "1", "--no-save",
            "--no-tensorboard", "--num-workers", "0", *argv]
    elapsed = re.compile(r"iteration +(\d+)/ +\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)")
    best = {name: float("inf") for name in PARALLEL_LAYOUTS}
    with tempfile.TemporaryDirectory() as work:
        for _ in range(3):
            for name, flags in PARALLEL_LAYOUTS.items():
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29517",
                       os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py"), *base, *flags,
                       "--data-cache-path", os.path.join(work, "cache")]
                out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
                times = sorted(float(ms) for it, ms in elapsed.findall(out.stdout) if int(it) > 5)
                if out.returncode or not times:
                    sys.exit(f"bench.py parallel: {name} failed:\n{out.stderr[-2000:]}")
                best[name] = min(best[name], times[len(times) // 2])
    cfg = checks.parse_args(base, world_size=2)
    setup = (f"{cfg.model.num_layers}x{cfg.model.hidden_size}, seq {cfg.model.seq_length}, gbs "
             f"{cfg.train.global_batch_size}, 2 processes x 1 thread")
    tp2 = best["TP=2"]
    return [("parallel" if i == 0 else "", setup if i == 0 else "", name, f"{ms:.1f} ms/it",
             f"{100 * (ms - tp2) / tp2:+.1f}% vs TP=2") for i, (name, ms) in enumerate(best.items())]


# bench.py moe: one MoE GPT (8 experts, top-2, experts half the dense MLP's width: the dense model below has the same
# active parameters per token), in Megatron-LM's flags so that its pretrain_gpt.py runs the very same command line.
MOE_FLAGS = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "256",
             "--max-position-embeddings", "256", "--micro-batch-size", "4", "--global-batch-size", "8", "--mock-data",
             "--train-iters", "20", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--lr", "1e-4", "--num-workers", "0",
             "--hidden-dropout", "0", "--attention-dropout", "0", "--ffn-hidden-size", "1024",
             "--disable-bias-linear"]  # Megatron-LM's MoE at EP=1 with biases meets mlp.py:354 (README: defects)
MOE = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "512", "--moe-aux-loss-coeff", "1e-2",
       "--moe-token-dispatcher-type", "alltoall"]
# What Megatron-LM needs on a CPU (tests/fixtures/interchange/megatron_lm_cpu.py's docstring); train.py accepts the
# same line.
MEGATRON_LM_CPU = ["--transformer-impl", "local", "--no-persist-layer-norm", "--use-cpu-initialization",
                   "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
                   "--no-bias-dropout-fusion", "--no-rope-fusion", "--distributed-backend", "gloo"]


def _best_round(runs: dict, bench: str) -> dict:
    """{name: ms per iteration} of each run, `runs` {name: (processes, "train.py" or "mlm", flags)}: three rounds, the
    runs alternating within each; the best round's median iteration time (the log line's, iterations 6-20). "mlm" is
    Megatron-LM core_v0.19.0's pretrain_gpt.py at $MEGATRON_LM, through tests/fixtures/interchange/megatron_lm_cpu.py.
    2 threads in all (1 each for 2 processes)."""
    import re
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    launcher = os.path.join(here, "tests", "fixtures", "interchange", "megatron_lm_cpu.py")
    elapsed = re.compile(r"iteration +(\d+)/ +\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)")
    best = {name: float("inf") for name in runs}
    with tempfile.TemporaryDirectory() as work:
        for _ in range(3):
            for name, (nproc, program, flags) in runs.items():
                script = [os.path.join(here, "train.py")] if program == "train.py" else [launcher, "mlm"]
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
                       "29518", *script, *flags, "--data-cache-path", os.path.join(work, "cache")]
                env = dict(os.environ, OMP_NUM_THREADS=str(2 // nproc), MEGATRON_LM=os.environ.get("MEGATRON_LM", ""),
                           PROJECT=here)
                out = subprocess.run(cmd, capture_output=True, text=True, cwd=work, env=env)
                times = sorted(float(ms) for it, ms in elapsed.findall(out.stdout) if int(it) > 5)
                if out.returncode or not times:
                    sys.exit(f"bench.py {bench}: {name} failed:\n{out.stderr[-2000:]}")
                best[name] = min(best[name], times[len(times) // 2])
    return best


def bench_fsdp(argv) -> list:
    """train.py's time per iteration under each Megatron FSDP sharding strategy and torch FSDP2 beside megatron-core's
    DDP with and without the distributed optimizer, all at DP=2 (2 processes x 1 thread) on the quick start's model
    shape, untied so that FSDP2 runs the same model (_best_round: three alternating rounds, the best round's median)."""
    line = ["--mock-data", "--train-iters", "20", "--log-interval", "1", "--eval-iters", "0", "--no-save",
            "--no-tensorboard", "--num-workers", "0", "--global-batch-size", "16", "--untie-embeddings-and-output-weights",
            *argv]
    runs = {"DDP": (2, "train.py", line), "DDP, distributed optimizer": (2, "train.py", [*line, "--use-distributed-optimizer"]),
            **{f"Megatron FSDP {s}": (2, "train.py", [*line, "--use-megatron-fsdp", "--data-parallel-sharding-strategy", s])
               for s in ("no_shard", "optim", "optim_grads", "optim_grads_params")},
            "torch FSDP2": (2, "train.py", [*line, "--use-torch-fsdp2"])}
    best = _best_round(runs, "fsdp")
    cfg = checks.parse_args(line, world_size=2)
    setup = (f"{cfg.model.num_layers}x{cfg.model.hidden_size}, seq {cfg.model.seq_length}, gbs "
             f"{cfg.train.global_batch_size}, DP=2, 2 processes x 1 thread")
    return [row for row in _rows("fsdp", setup, best, "DDP", "DDP") if row[2] != "Megatron-LM"]


def _megatron_lm() -> bool:
    """Whether $MEGATRON_LM names a Megatron-LM checkout to run beside train.py."""
    return bool(os.environ.get("MEGATRON_LM"))


def bench_moe(argv) -> list:
    """train.py's time per iteration of an MoE GPT beside the dense GPT of the same active parameters (1 process),
    at EP=2 (2 processes), and, with MEGATRON_LM set to a Megatron-LM core_v0.19.0 checkout, Megatron-LM's own
    pretrain_gpt.py on the same command line (_best_round)."""
    line = [*MOE_FLAGS, *MEGATRON_LM_CPU, *argv]
    ours = ["--no-save", "--no-tensorboard"]
    runs = {"dense, 1 process": (1, "train.py", [*line, *ours]),
            "MoE, 1 process": (1, "train.py", [*line, *MOE, *ours]),
            "MoE EP=2, 2 processes": (2, "train.py", [*line, *MOE, "--expert-model-parallel-size", "2", *ours])}
    if _megatron_lm():
        runs["Megatron-LM MoE, 1 process"] = (1, "mlm", [*line, *MOE])
        runs["Megatron-LM MoE EP=2, 2 processes"] = (2, "mlm", [*line, *MOE, "--expert-model-parallel-size", "2"])
    best = _best_round(runs, "moe")
    setup = "4x256, seq 256, gbs 8; MoE: 8 experts of 512, top-2 (dense: ffn 1024); 2 threads in all"
    return _rows("moe", setup, best, "dense, 1 process", "dense")


# bench.py v3: DeepSeek-V3's block on bench moe's model: multi-latent attention (value heads hidden/heads wide, which
# Megatron-LM's local layers need: megatron_lm_cpu.py P5), MoE from the second layer with DeepSeek-V3's router and a
# shared expert, one MTP layer; trained with Adam and with Muon.
V3 = ["--multi-latent-attention", "--q-lora-rank", "128", "--kv-lora-rank", "64", "--qk-head-dim", "64",
      "--qk-pos-emb-head-dim", "32", "--v-head-dim", "64", "--rotary-scaling-factor", "4", "--mscale", "1",
      "--mscale-all-dim", "1", "--qk-layernorm", "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type",
      "rope", "--untie-embeddings-and-output-weights", "--num-experts", "8", "--moe-layer-freq", "([0]+[1]*3)",
      "--moe-router-topk", "2", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
      "--moe-router-num-groups", "2", "--moe-router-group-topk", "1", "--moe-shared-expert-intermediate-size", "512",
      "--moe-ffn-hidden-size", "512", "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff",
      "1e-3", "--moe-token-dispatcher-type", "alltoall", "--mtp-num-layers", "1"]


def bench_v3(argv) -> list:
    """train.py's time per iteration of the DeepSeek-V3-shaped model (V3) with Adam and with Muon, 1 process, and,
    with MEGATRON_LM set, Megatron-LM's pretrain_gpt.py on the same command lines (_best_round)."""
    line = [*MOE_FLAGS, *MEGATRON_LM_CPU, *V3, *argv]
    ours = ["--no-save", "--no-tensorboard"]
    # Muon's Newton-Schulz products in fp32 (--muon-fp32-matmul-prec high): Megatron-LM's default, medium, asks for
    # bf16 matmuls, which a CPU without bf16 instructions emulates, ~20x slower (docs/optimizer.md)
    optimizers = {"Adam": ["--optimizer", "adam"], "Muon": ["--optimizer", "muon", "--muon-fp32-matmul-prec", "high"]}
    runs = {f"{who}MLA+MoE+MTP, {opt}": (1, program, [*line, *optimizers[opt], *extra])
            for who, program, extra in [("", "train.py", ours), ("Megatron-LM ", "mlm", [])][:1 + _megatron_lm()]
            for opt in optimizers}
    best = _best_round(runs, "v3")
    setup = ("bench moe's 4x256 with MLA (q/kv latents 128/64), MoE from layer 2 (8 of 512, top-2, shared 512), "
             "1 MTP layer; 1 process x 2 threads")
    return _rows("v3", setup, best, "MLA+MoE+MTP, Adam", "train.py Adam")


def _rows(bench: str, setup: str, best: dict, reference: str, called: str) -> list:
    """The table's rows of `best` ({name: ms per iteration}), each against the `reference` run's time."""
    rows = [(bench if i == 0 else "", setup if i == 0 else "", name, f"{ms:.1f} ms/it",
             f"{100 * (ms - best[reference]) / best[reference]:+.1f}% vs {called}") for i, (name, ms) in enumerate(best.items())]
    if not _megatron_lm():
        rows.append(("", "", "Megatron-LM", "not run", "set MEGATRON_LM to a core_v0.19.0 checkout"))
    return rows

# bench.py small: (layers, hidden, heads, seq, batch, vocab, iterations). nanoGPT's CPU configuration (its README's
# `--device=cpu` line: shakespeare_char's 65 characters, no dropout) and the 4 x 256 GPT of `overhead` and `parallel`.
SMALL = {"nanoGPT CPU": (4, 128, 4, 64, 12, 65, 200), "4x256": (4, 256, 4, 256, 8, 8192, 40)}


def _small_run(cmd: list) -> tuple:
    """(start-up s, s per iteration, parameter count) of one run of train.py or the plain loop, both read the same way
    from outside: each stdout line stamped as it arrives. Start-up: launch to the line before the first iteration
    (imports, process group, model, optimizer, data); per iteration: between the first log line (the warm-up before
    it) and the last, so logging, a data-loading stall and any per-step sync count as they do for a user."""
    import re
    import subprocess

    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines = [(time.perf_counter(), line) for line in proc.stdout]
    if proc.wait():
        said = [line for _, line in lines if "error" in line.lower()] or [line for _, line in lines[-30:]]
        sys.exit(f"bench.py small: {' '.join(cmd[:3])} failed:\n{''.join(said)}")
    start = next(t for t, line in lines if line.startswith(" training from iteration"))
    iters = [(int(m.group(1)), t) for t, line in lines if (m := re.search(r" iteration +(\d+)/ *\d+ \|", line))]
    (i0, t_first), (i1, t_last) = iters[0], iters[-1]
    params = int(re.search(r" > number of parameters[^:]*: (\d+)\n", "".join(line for _, line in lines)).group(1))
    return start - t0, (t_last - t_first) / (i1 - i0), params


def small_runs(shape: tuple, work: str) -> dict:
    """{"plain PyTorch loop": command, "train.py": command} for one SMALL shape, their tokens written under `work`:
    random ids in a megatron-core indexed dataset, which train.py reads through GPTDataset and the plain loop through
    numpy, as nanoGPT reads its .bin."""
    import numpy as np

    import data

    layers, hidden, heads, seq, batch, vocab, iters = shape
    corpus, rng = os.path.join(work, f"{vocab}.jsonl"), np.random.default_rng(0)
    with open(corpus, "w") as fh:
        for _ in range(200):
            fh.write(json.dumps({"text": " ".join(map(str, rng.integers(0, vocab - 1, 5000).tolist()))}) + "\n")
    prefix = data.preprocess(corpus, os.path.join(work, str(vocab)), ["text"], data.NullTokenizer(vocab), True,
                             log_interval=1e9)["text"]["prefix"]
    log, lr, min_lr, warmup = min(10, iters // 2), 1e-3, 1e-4, min(10, iters // 2)
    ours = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py"), "--num-layers", layers,
            "--hidden-size", hidden, "--num-attention-heads", heads, "--seq-length", seq, "--max-position-embeddings",
            seq, "--micro-batch-size", batch, "--global-batch-size", batch, "--hidden-dropout", 0,
            "--attention-dropout", 0, "--tokenizer-type", "NullTokenizer", "--vocab-size", vocab, "--data-path", prefix,
            "--split", "100,0,0", "--data-cache-path", os.path.join(work, "cache"), "--train-iters", iters,
            "--log-interval", log,
            "--eval-iters", 0, "--no-save", "--no-tensorboard", "--lr", lr, "--min-lr", min_lr, "--lr-decay-style",
            "cosine", "--lr-warmup-iters", warmup]
    plain = [os.path.abspath(__file__), "_plain", "--layers", layers, "--hidden", hidden, "--heads", heads, "--seq",
             seq, "--batch", batch, "--vocab", -(-vocab // 128) * 128,  # train.py's --make-vocab-size-divisible-by 128
             "--iters", iters, "--warmup", warmup, "--log-interval", log, "--lr", lr, "--min-lr", min_lr, "--data",
             prefix]
    return {"plain PyTorch loop": [sys.executable, *map(str, plain)], "train.py": [sys.executable, *map(str, ours)]}


def bench_small(argv) -> list:
    """train.py beside the plain PyTorch loop (plain_loop) on the same GPT, optimizer and tokens (small_runs), at
    nanoGPT's CPU shape and at 4 x 256: 3 alternating rounds of fresh processes (`--rounds N`), the best of each
    side's time per iteration and start-up; `--iters N` for N iterations at both shapes."""
    import argparse

    p = argparse.ArgumentParser(prog="bench.py small")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, help="iterations at both shapes (default: SMALL's)")
    a, rows = p.parse_args(argv), []
    with tempfile.TemporaryDirectory() as work:
        for shape, (*dims, iters) in SMALL.items():
            iters = a.iters or iters
            runs = small_runs((*dims, iters), work)
            seen = {name: [] for name in runs}
            for _ in range(a.rounds):
                for name, cmd in runs.items():
                    seen[name].append(_small_run(cmd))
            if len({params for runs_ in seen.values() for *_, params in runs_}) != 1:
                sys.exit(f"bench.py small: {shape}: the two models differ: {seen}")
            (plain_s, plain_t), (ours_s, ours_t) = ((min(s for s, _, _ in r), min(t for _, t, _ in r))
                                                    for r in seen.values())
            layers, hidden, heads, seq, batch, vocab = dims
            setup = (f"{shape}: {layers}x{hidden}, seq {seq}, batch {batch}, vocab {vocab}, {iters} its, best of "
                     f"{a.rounds}")
            rows += [("small" if not rows else "", setup, "plain PyTorch loop", f"{1000 * plain_t:.1f} ms/it",
                      f"start-up {plain_s:.1f} s"),
                     ("", "", "train.py", f"{1000 * ours_t:.1f} ms/it",
                      f"{ours_t / plain_t:.2f}x the plain loop; start-up {ours_s:.1f} s"),
                     ("", "", "rounds (plain / train.py: ms/it, s to start)",
                      " ".join(f"{1000 * p[1]:.0f}/{1000 * o[1]:.0f}" for p, o in zip(*seen.values())),
                      " ".join(f"{p[0]:.1f}/{o[0]:.1f}" for p, o in zip(*seen.values())))]
    return rows


# bench.py profile: where a run's main-thread time goes, from py-spy's raw stacks (`py-spy record --idle --threads -f
# raw`). A sample goes to the first part one of whose patterns is in one of its frames ("function (file:line)"); the
# loop's parts take the samples under train.py's `train`, the start-up's the others. Order matters: a gradient hook
# runs inside the backward, an import inside the model build. A sample whose innermost frame is one of the shim's
# wrappers (device.py: a factory's or Tensor.to's CUDA device answered) counts where its caller does.
LOOP_PARTS = [("gradient norm and clipping", ["clip_grads.py", "get_grad_norm"]),
              ("optimizer step", ["core/optimizer/", "torch/optim/"]),
              ("DDP hooks and buffers", ["distributed_data_parallel.py", "param_and_grad_buffer.py",
                                         "finalize_model_grads"]),
              ("rerun state machine", ["rerun_state_machine.py"]),
              ("batch path", ["get_batch (", "torch/utils/data/", "(data.py:"]),
              ("logging and timers", ["(metrics.py:", "timers.py"]),
              ("backward", ["backward_step (", "torch/autograd/"]),
              ("forward", ["forward_step ("]),
              ("the rest of the loop", [""])]
STARTUP_PARTS = [("imports", ["_find_and_load ("]), ("configuration", ["parse_args ("]),
                 ("process groups", ["init_process_group (", "initialize_model_parallel (",
                                     "initialize_distributed ("]),
                 ("model build", ["build_model (", "wrap_model ("]), ("optimizer build", ["build_optimizer ("]),
                 ("dataset build", ["build_datasets (", "build_data_loader ("]),
                 ("the rest (checkpoint load, exit)", [""])]


def bench_profile(argv) -> list:
    """python bench.py profile STACKS --rate HZ --iterations N: STACKS from `py-spy record -r HZ --idle --threads -f
    raw -o STACKS -- python train.py ... --train-iters N`. Each part's ms per iteration (the loop) or s (start-up)."""
    import argparse
    import collections

    p = argparse.ArgumentParser(prog="bench.py profile")
    p.add_argument("stacks")
    p.add_argument("--rate", type=float, required=True, help="py-spy's -r")
    p.add_argument("--iterations", type=int, required=True, help="the run's --train-iters")
    a = p.parse_args(argv)
    path, rate, iters = a.stacks, a.rate, a.iterations
    seen = {"loop": collections.Counter(), "start-up": collections.Counter()}
    with open(path) as fh:
        for line in fh:
            stack, count = line.rsplit(" ", 1)
            frames = stack.split(";")
            if len(frames) < 2 or not frames[0].endswith("MainThread"):
                continue  # DataLoader feeders and other threads, mostly idle
            if "(device.py:" in frames[-1]:
                frames.pop()  # a shim's wrapper: the call it passes on
            loop = any(f.startswith("train (train.py:") for f in frames)
            parts = LOOP_PARTS if loop else STARTUP_PARTS
            name = next(name for name, patterns in parts if any(p in f for p in patterns for f in frames))
            seen["loop" if loop else "start-up"][name] += int(count)
    total = {k: sum(c.values()) for k, c in seen.items()}
    rows = [("profile", f"{path}: {iters} iterations, {rate:g} Hz", "one iteration",
             f"{1000 * total['loop'] / rate / iters:.1f} ms", "")]
    rows += [("", "", f"  {name}", f"{1000 * seen['loop'][name] / rate / iters:.1f} ms",
              f"{100 * seen['loop'][name] / total['loop']:.1f}%") for name, _ in LOOP_PARTS]
    rows += [("", "", "start-up and exit", f"{total['start-up'] / rate:.2f} s", "")]
    rows += [("", "", f"  {name}", f"{seen['start-up'][name] / rate:.2f} s",
              f"{100 * seen['start-up'][name] / total['start-up']:.1f}%") for name, _ in STARTUP_PARTS]
    return rows


OPS_ALWAYS_SHOWN = ("aten::mm", "LinearWithGradAccumulationAndAsyncCommunication")


def bench_ops(argv) -> list:
    """torch.profiler's operators over iterations 20-50 of train.py (train.pretrain, in this process) and of the plain
    loop, at nanoGPT's CPU shape (small_runs' two command lines): each side's time per iteration under the profiler,
    its operators' own CPU time, and the operators that take the most, side by side (ms and calls per iteration)."""
    import io
    from contextlib import redirect_stdout

    import torch
    from torch.profiler import ProfilerActivity, profile

    import metrics
    import train

    if argv[:1] == ["decode"]:
        return _decode_ops(argv[1:])
    first, last, seen = 20, 50, {}

    def profiled(name):  # called once per iteration: starts the profiler at `first`, stops it at `last`
        calls = [0]

        def on_iteration():
            calls[0] += 1
            if calls[0] == first:
                seen[name] = [profile(activities=[ProfilerActivity.CPU]), time.perf_counter()]
                seen[name][0].__enter__()
            elif calls[0] == last:
                seen[name][0].__exit__(None, None, None)
                seen[name][1] = (time.perf_counter() - seen[name][1]) / (last - first)
        return on_iteration

    with tempfile.TemporaryDirectory() as work:
        runs = small_runs((*SMALL["nanoGPT CPU"][:-1], last + 2), work)
        log_step, tick = metrics.log_step, profiled("train.py")  # log_step: once per iteration
        metrics.log_step = lambda *a, **k: (tick(), log_step(*a, **k))[1]
        try:
            with redirect_stdout(io.StringIO()):
                train.pretrain(checks.parse_args(runs["train.py"][2:], world_size=1))
        finally:
            metrics.log_step = log_step
        with redirect_stdout(io.StringIO()):
            plain_loop(runs["plain PyTorch loop"][3:], profiled("plain loop"))
    n, ops = last - first, {}
    for name, (prof, _) in seen.items():
        for e in prof.key_averages():
            ops.setdefault(e.key, {})[name] = (e.self_cpu_time_total / n / 1e3, e.count / n)
    rows = [("ops" if i == 0 else "", f"nanoGPT CPU, iterations {first}-{last}, {torch.get_num_threads()} threads"
             if i == 0 else "", name, f"{dt * 1e3:.1f} ms/it under the profiler",
             f"operators' own CPU {sum(v[name][0] for v in ops.values() if name in v):.1f} ms/it")
            for i, (name, (_, dt)) in enumerate(seen.items())]
    ranked = sorted(ops.items(), key=lambda kv: -sum(t for t, _ in kv[1].values()))
    # the 25 that take the most, then the two the sides are compared by, wherever a loaded machine's times rank them
    shown = ranked[:25] + [(key, ops[key]) for key in OPS_ALWAYS_SHOWN if key in ops and key not in dict(ranked[:25])]
    for key, sides in shown:
        rows.append(("", "", key[:60], *(f"{name} {sides.get(name, (0, 0))[0]:.2f} ms ({sides.get(name, (0, 0))[1]:.0f}x)"
                                          for name in seen)))
    return rows


def _decode_ops(argv, new=200) -> list:
    """bench.py ops decode: torch.profiler's operators of generate.py's KV-cached decoding of `new` tokens (the model
    bench.py generate builds, random weights), per token."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import data
    import generate
    from megatron.core import parallel_state
    from model import build_model, initialize_distributed, set_random_seed

    cfg = checks.parse_args(["--mock-data", "--no-save", "--no-tensorboard", "--hidden-dropout", "0",
                                 "--attention-dropout", "0", *argv], world_size=1)
    initialize_distributed(cfg)
    set_random_seed(cfg.rng.seed)
    tokenizer = data.ByteTokenizer()
    model = build_model(cfg, data.embedding_rows(tokenizer))[0].eval().requires_grad_(False)
    never_stops = type("NeverStops", (), dict(vocab_size=tokenizer.vocab_size, eod=-1))()
    decode = lambda: generate.generate(model, never_stops, tokenizer.tokenize("The Python"), new, kv_cache=True)
    decode()  # warm-up
    t = time.perf_counter()
    decode()
    unprofiled = (time.perf_counter() - t) / new
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        decode()
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    rows = [("ops decode", f"{cfg.model.num_layers}x{cfg.model.hidden_size}, {new} tokens, {torch.get_num_threads()} "
             "threads", "generate.py, KV cache", f"{unprofiled * 1e3:.2f} ms/token",
             f"operators' own CPU {sum(e.self_cpu_time_total for e in ops) / new / 1e3:.2f} ms/token")]
    return rows + [("", "", e.key[:60], f"{e.self_cpu_time_total / new / 1e3:.3f} ms", f"{e.count / new:.0f}x a token")
                   for e in ops[:20]]


def print_table(rows) -> None:
    header = ("benchmark", "setup", "what", "time", "rate")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, tuple("-" * w for w in widths), *rows]:
        print(" | ".join(str(c).ljust(w) for c, w in zip(r, widths)))


if __name__ == "__main__":
    benches = {"checkpoint": bench_checkpoint, "logging": bench_logging, "data": bench_data,
               "overhead": bench_overhead, "ladder": bench_ladder, "hotpath": bench_hotpath,
               "generate": bench_generate, "parallel": bench_parallel, "moe": bench_moe, "v3": bench_v3, "fsdp": bench_fsdp,
               "small": bench_small, "profile": bench_profile, "ops": bench_ops}
    name = sys.argv[1] if len(sys.argv) > 1 else "checkpoint"
    import device

    with device.shim():  # megatron-core on this machine, for the benchmark (train.py's runs enter it too)
        if name == "_one_size":  # a ladder size in its own process (bench_ladder runs it)
            print(json.dumps(_one_size(sys.argv[2:])))
            sys.exit(0)
        if name not in benches:
            sys.exit(f"bench.py: error: unknown benchmark {name}; choose from {', '.join(benches)}")
        print_table(benches[name](sys.argv[2:]))
