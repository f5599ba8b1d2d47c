"""profiling.py: the PyTorch profiler, Nsight Systems capture and CUDA memory history of a run
(Megatron Bridge's `training/profiling.py`), driven by `ProfilingConfig` (--use-pytorch-profiler,
--profile, --profile-step-start/end, --profile-ranks, --record-memory-history).

train.py calls these at the top of each iteration (handle_profiling_step) and after it
(post_training_step_callbacks -> handle_profiling_stop).
"""

import os
from typing import Optional

import torch

import config as config_lib


def should_profile_rank(config: config_lib.ProfilingConfig, rank: int) -> bool:
    """Whether this rank profiles: the ranks in --profile-ranks (an empty list: every rank)."""
    return not config.profile_ranks or rank in config.profile_ranks


def initialize_pytorch_profiler(config: config_lib.ProfilingConfig, tensorboard_dir: str,
                                start_step: int = 0) -> Optional[torch.profiler.profile]:
    """The PyTorch profiler, with Megatron-LM's trace handler: a one-step warm-up, then
    iterations profile_step_start .. profile_step_end - 1 (as the log line numbers them) recorded into
    `tensorboard_dir/rank<N>.<time>.pt.trace.json`, which TensorBoard's profiler plugin and Perfetto open.

    The profiler counts steps from this job's first, so the schedule is shifted by the iteration the job resumed at;
    None if it resumed past the start."""
    first = config.profile_step_start - start_step
    if first < 0:
        print(f" rank {torch.distributed.get_rank()}: not profiling: this job starts at iteration {start_step}, after "
              f"--profile-step-start {config.profile_step_start}", flush=True)
        return None
    schedule = torch.profiler.schedule(wait=max(first - 1, 0), warmup=1 if first > 0 else 0,
                                       active=config.profile_step_end - config.profile_step_start, repeat=1)
    handler = torch.profiler.tensorboard_trace_handler(tensorboard_dir, worker_name=f"rank{torch.distributed.get_rank()}")
    return torch.profiler.profile(schedule=schedule, on_trace_ready=handler,
                                  record_shapes=config.pytorch_profiler_collect_shapes,
                                  with_stack=config.pytorch_profiler_collect_callstack)


def handle_profiling_step(config: config_lib.ProfilingConfig, iteration: int, rank: int,
                          pytorch_prof: Optional[torch.profiler.profile]):
    """At the top of each iteration: advance the PyTorch profiler's
    schedule; with --profile alone, start Nsight Systems' capture at --profile-step-start. Returns the NVTX
    context it opened, if any."""
    if not should_profile_rank(config, rank):
        return None
    if pytorch_prof is not None:
        pytorch_prof.step()
    elif config.use_nsys_profiler and not config.use_pytorch_profiler and iteration == config.profile_step_start:
        # `nsys profile --capture-range=cudaProfilerApi` records from here.
        torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())
        nvtx_context = torch.autograd.profiler.emit_nvtx(record_shapes=config.record_shapes)
        nvtx_context.__enter__()
        return nvtx_context
    return None


def handle_profiling_stop(config: config_lib.ProfilingConfig, iteration: int, rank: int,
                          pytorch_prof: Optional[torch.profiler.profile], nsys_nvtx_context=None) -> None:
    """At --profile-step-end on a profiled rank: stop the PyTorch profiler
    (it writes its trace) or Nsight Systems' capture; with --record-memory-history, dump the CUDA memory snapshot
    (Bridge's training_log) to --memory-snapshot-path with _RANK before the extension."""
    if iteration != config.profile_step_end or not should_profile_rank(config, rank):
        return
    if pytorch_prof is not None:
        pytorch_prof.stop()
    elif config.use_nsys_profiler and not config.use_pytorch_profiler:
        torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())
        if nsys_nvtx_context is not None:
            nsys_nvtx_context.__exit__(None, None, None)
    if config.record_memory_history:
        base, ext = os.path.splitext(config.memory_snapshot_path)
        path = f"{base}_{rank}{ext}"
        torch.cuda.memory._dump_snapshot(path)
        print(f" rank {rank}: saved CUDA memory snapshot to {path} (open it at https://pytorch.org/memory_viz)", flush=True)


def start_memory_history_recording(config: config_lib.ProfilingConfig) -> None:
    """--record-memory-history on a profiled rank: record the CUDA allocator's allocations and frees, with the
    Python stack of each, so the snapshot shows a timeline and call sites."""
    if config.record_memory_history and should_profile_rank(config, torch.distributed.get_rank()):
        torch.cuda.memory._record_memory_history(max_entries=100_000)
