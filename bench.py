"""bench.py: what the machinery costs, measured side by side in one run. Prints one table.

    python bench.py checkpoint [--num-layers 16 --hidden-size 768 ...]   # save/load vs torch.save/torch.load
    python bench.py logging [train.py flags]                             # training_log's share of a step
    python bench.py data                                                 # preprocessing and sample fetch speed

Benchmarks report; the tests never assert on timings.
"""

import os
import shutil
import sys
import tempfile
import time

import config as config_lib


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def bench_checkpoint(argv) -> list:
    """checkpoint.save_checkpoint / load_checkpoint beside a plain torch.save / torch.load of the same
    model and optimizer state, and beside raw file writes and reads of as many bytes, on one process."""
    defaults = ["--num-layers", "16", "--hidden-size", "768", "--num-attention-heads", "12", "--seq-length", "1024",
                "--mock-data"]
    cfg = config_lib.parse_args(defaults + argv, world_size=1)
    import torch

    import checkpoint
    import train
    from model import build_model, build_optimizer

    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    train.parallel_state.initialize_model_parallel(1, 1)
    model = build_model(cfg, 258)
    optimizer = build_optimizer(cfg, model)
    for p in model[0].parameters():  # one step, so the optimizer holds its full state (Adam moments)
        p.grad = torch.zeros_like(p)
    optimizer.step()
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
        train._destroy_distributed()

    gb = size / 1e9
    rows.append(("checkpoint", f"{n_params / 1e6:.1f}M params, {gb:.2f} GB", "save_checkpoint", f"{save_s:.2f} s",
                 f"{gb / save_s:.2f} GB/s"))
    rows.append(("", "", "load_checkpoint", f"{load_s:.2f} s", f"{gb / load_s:.2f} GB/s"))
    rows.append(("", "", "torch.save (same state)", f"{plain_save_s:.2f} s", f"{gb / plain_save_s:.2f} GB/s"))
    rows.append(("", "", "torch.load (same state)", f"{plain_load_s:.2f} s", f"{gb / plain_load_s:.2f} GB/s"))
    rows.append(("", "", "raw write (same bytes)", f"{raw_write_s:.2f} s", f"{raw_size / 1e9 / raw_write_s:.2f} GB/s"))
    rows.append(("", "", "raw read (same bytes)", f"{raw_read_s:.2f} s", f"{raw_size / 1e9 / raw_read_s:.2f} GB/s"))
    return rows


def bench_logging(argv) -> list:
    """Time spent in metrics.training_log (accumulating, TensorBoard, the log line) beside the whole
    iteration, over a real single-process run of the default model at the default --log-interval."""
    cfg = config_lib.parse_args(["--mock-data", "--train-iters", "60", "--eval-iters", "0", "--num-workers", "0"] + argv,
                                world_size=1)
    import contextlib
    import io

    import metrics
    import train

    spent = []
    original = metrics.training_log

    def timed(*args, **kwargs):
        t = time.perf_counter()
        result = original(*args, **kwargs)
        spent.append(time.perf_counter() - t)
        return result

    metrics.training_log = timed  # measured from the outside; train.py is unchanged
    t = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        state = train.pretrain(cfg)
    total = time.perf_counter() - t
    metrics.training_log = original
    iters = state.train_state.step
    log_s = sum(spent)
    per_iter_ms = 1000 * total / iters
    return [("logging", f"default model, --log-interval {cfg.logger.log_interval}, {iters} iterations",
             "training_log per iteration", f"{1000 * log_s / iters:.3f} ms", f"{100 * log_s / total:.2f}% of the run"),
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

        cfg = config_lib.parse_args(["--data-path", stats["text"]["prefix"], "--num-workers", "0", "--eval-iters", "0",
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
            train._destroy_distributed()
        rows.append(("", f"GPTDataset, micro batch {cfg.train.micro_batch_size} x {cfg.model.seq_length}",
                     "fetch one microbatch (no workers)", f"{fetch_ms:.2f} ms", ""))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def print_table(rows) -> None:
    header = ("benchmark", "setup", "what", "time", "rate")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, tuple("-" * w for w in widths), *rows]:
        print(" | ".join(str(c).ljust(w) for c, w in zip(r, widths)))


if __name__ == "__main__":
    benches = {"checkpoint": bench_checkpoint, "logging": bench_logging, "data": bench_data}
    name = sys.argv[1] if len(sys.argv) > 1 else "checkpoint"
    if name not in benches:
        sys.exit(f"bench.py: error: unknown benchmark {name}; choose from {', '.join(benches)}")
    print_table(benches[name](sys.argv[2:]))
