"""checkpoint.py: save and load a run, in Megatron Bridge's layout, with what Megatron-LM reads too: a checkpoint
written here resumes in Megatron-LM's pretrain_gpt.py and Bridge's pretrain(), and theirs resume here.
Names and signatures follow Megatron Bridge's `training.checkpointing` and `training.state` (TrainState).

    SAVE/
      iter_0000100/
        run_config.yaml                the resolved config (readable; `--config-file` takes it back)
        train_state.pt                 Bridge's progress: step, consumed/skipped samples, FLOPs, do_train/valid/test
        tokenizer/                     identity.json (which tokenizer), tokenizer.json for a HuggingFace one
        torch_dist format (default):   megatron-core dist_checkpointing shards (reshardable TP/PP/DP), the
                                       same files on a GPU and a CPU (one __R_0.distcp per rank); the
                                       `common_state` object holds Megatron-LM's `args`, `iteration`,
                                       `checkpoint_version` 3.0 and FLOPs (megatron-core <= 0.16 wrote it to
                                       common.pt, still read); each (PP, TP) rank's RNG states are the
                                       `rng_state` object
        torch format:                  mp_rank_00/model_optim_rng.pt, one per tensor/pipeline/expert rank
                                       (mp_rank_TT[_PPP][_EEE]), with Megatron-LM's names and keys
        fsdp_dtensor, torch_dcp:       --use-megatron-fsdp's and --use-torch-fsdp2's (Megatron-LM's layouts; FSDP2
                                       saves torch_dist by default, as Megatron-LM), through
                                       torch.distributed.checkpoint: `.metadata` and one __R_0.distcp per rank;
                                       `args`, `iteration`, `checkpoint_version`, `model` (DTensors, whole in the
                                       file: any data-parallel size reads them, and one process without FSDP),
                                       `optimizer`, `opt_param_scheduler`, `rng_state` {"(pp, tp)": [states]}
      latest_train_state.pt            copy of the newest train_state.pt
      latest_checkpointed_iteration.txt
      progress.txt                     Megatron-LM's progress log: a line per job start and per save (metrics.py)

Loading reads the progress from train_state.pt, else from the common state (Megatron-LM's), and checks the version, the
model's shape and the tokenizer before any weight.

A checkpoint is complete or invisible: every rank writes its files, all ranks meet at a barrier, and
only then does rank 0 write the two `latest_*` files (each written aside and renamed into place).
A process killed mid-save leaves the tracker pointing at the previous complete checkpoint. An iteration saved again
(--ckpt-step below the tracker) is written beside the old one, which is swapped out only once the new one is
complete. progress.txt is appended afterwards, not atomically: a kill there may leave its last line cut short.

Trust: a torch_dist, fsdp_dtensor or torch_dcp checkpoint's metadata (`.metadata`, the common state, `args`) is read
by PyTorch's and megatron-core's distributed checkpointing with `pickle`, which can run code: load only checkpoints you
trust. Every other
file here is read with `torch.load(weights_only=True)`.
"""

import argparse
import contextlib
import copy
import ctypes
import dataclasses
import functools
import importlib
import json
import multiprocessing
import os
import queue
import random
import shutil
import sys
import threading
import types
from multiprocessing.managers import SyncManager
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import config as config_lib
import device  # first: it quiets megatron-core's import-time warnings
from device import any_rank
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing import optimizer as optimizer_checkpoint
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import preprocess_state_dict_for_uneven_dtensor
from megatron.core.distributed.torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel
from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_fp8_extra_state_case, handle_swiglu_in_state_dict
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import unwrap_model
from metrics import print_rank_0
from model import layer_wise

TRACKER = "latest_checkpointed_iteration.txt"
LATEST_TRAIN_STATE = "latest_train_state.pt"


@dataclasses.dataclass
class TrainState:
    """Progress of the run: what a checkpoint must carry to resume exactly. Saved as Bridge's train_state.pt,
    one 0-d tensor per field (counts as int64 where Bridge writes int32: a count of samples can pass 2**31)."""

    step: int = 0
    consumed_train_samples: int = 0
    skipped_train_samples: int = 0
    consumed_valid_samples: int = 0
    floating_point_operations_so_far: float = 0.0
    do_train: bool = False  # the run has training / validation / test data
    do_valid: bool = False
    do_test: bool = False

    def state_dict(self) -> dict:
        dtypes = {bool: torch.bool, int: torch.int64, float: torch.float64}
        return {f.name: torch.tensor(getattr(self, f.name), dtype=dtypes[type(f.default)]) for f in dataclasses.fields(self)}

    def load_state_dict(self, state: dict) -> None:
        for f in dataclasses.fields(self):
            if f.name in state:
                value = state[f.name]
                setattr(self, f.name, type(f.default)(value.item() if isinstance(value, torch.Tensor) else value))


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the path and the problem."""


def iter_dir(save: str, iteration: int) -> str:
    return os.path.join(save, f"iter_{iteration:07d}")


def _mp_file(directory: str) -> str:
    """This rank's file in Megatron-LM's torch format (checkpointing.py:224-239): mp_rank_TT, plus _PPP with pipeline
    parallelism, plus _EEE with expert parallelism."""
    ps = parallel_state
    name = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
    if ps.get_pipeline_model_parallel_world_size() > 1:
        name += f"_{ps.get_pipeline_model_parallel_rank():03d}"
    if ps.get_expert_model_parallel_world_size() > 1:
        name += f"_{ps.get_expert_model_parallel_rank():03d}"
    return os.path.join(directory, name, "model_optim_rng.pt")


# What a torch-format file's tensors depend on besides the model: the parallel sizes of the ranks that saved it.
TORCH_LAYOUT = {"tensor_model_parallel_size": "TP", "pipeline_model_parallel_size": "PP",
                "expert_model_parallel_size": "EP", "expert_tensor_parallel_size": "expert TP"}


def check_torch_layout(cfg, directory: str, settings: dict) -> None:
    """A torch-format checkpoint holds each rank's shards as that rank held them, so it loads only at the parallel
    sizes that saved it (Megatron-LM compares TP and PP likewise, checkpointing.py:184-186): other ones are one line
    naming both, before any weight. `settings`: the saving run's (saved_settings)."""
    def sizes(get):
        tp = get("tensor_model_parallel_size") or 1
        return ", ".join(f"{name} {get(k) or (tp if name == 'expert TP' else 1)}" for k, name in TORCH_LAYOUT.items())

    saved, ours = sizes(settings.get), sizes(lambda k: getattr(cfg.model, k))
    if saved != ours:
        raise CheckpointError(f"{directory}: saved in the torch format at {saved}, and this run has {ours}; pass the "
                              f"saving run's sizes (the torch format does not reshard; --ckpt-format torch_dist does)")


def _atomic_save(obj, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _atomic_write_text(text: str, path: str) -> None:
    """Write, then rename into place, durably: the file's bytes reach the disk before the rename, and the rename
    (the directory's entry) after it, so a power loss after "successfully saved" keeps the tracker."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    folder = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def _first_line(e: BaseException) -> str:
    """`Type: first line of the message`, or just `Type` for an exception without one (an empty file's EOFError)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0][:120]}" if lines else type(e).__name__


def _load(path: str, what: str):
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing ({what}); the checkpoint is incomplete — load an older iteration with --ckpt-step")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # empty, truncated, corrupt, or not a torch file
        raise CheckpointError(f"{path}: cannot be read ({_first_line(e)}); "
                              f"the file is corrupt — load an older iteration with --ckpt-step") from None


def _index(directory: str):
    """A torch_dist checkpoint's index (.metadata): what it holds, in which file, at which bytes."""
    try:
        return FileSystemReader(directory).read_metadata()
    except Exception as e:
        raise CheckpointError(f"{os.path.join(directory, '.metadata')}: cannot be read ({_first_line(e)}); "
                              f"the checkpoint is corrupt — load an older iteration with --ckpt-step") from None


def _check_distcp_files(directory: str) -> None:
    """Each data file that a torch_dist checkpoint's .metadata names is there and holds the bytes it lists.

    torch's reader would fail later on such a file with a bare EOFError that names no file; this names it."""
    storage = _index(directory).storage_data
    needed: dict = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = os.path.join(directory, name)
        have = os.path.getsize(path) if os.path.isfile(path) else None
        if have is None or have < size:
            what = "missing" if have is None else "empty" if have == 0 else f"truncated ({have} of {size} bytes)"
            raise CheckpointError(f"{path}: {what}; the checkpoint is damaged — load an older iteration with --ckpt-step")


# --------------------------------------------------------------------------------------------------
# What Megatron-LM and Bridge read besides the tensors: the RNG states, `args`, the progress
# --------------------------------------------------------------------------------------------------

CHECKPOINT_VERSION = 3.0  # Megatron-LM's and Bridge's generate_state_dict write 3.0; earlier ones order QKV otherwise


def get_rng_state() -> dict:
    """This rank's generator states under Megatron-LM's keys (checkpointing.py get_rng_state): python, numpy,
    torch, CUDA (on a CPU, device.py's shim answers with the CPU generator) and the RNG tracker's streams."""
    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.cuda.get_rng_state(),
            "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.cuda.set_rng_state(state["cuda_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])  # after: on a CPU the CUDA generator is the CPU's
    tracker = tensor_parallel.get_cuda_rng_tracker()
    graph_safe = tensor_parallel.is_graph_safe_cuda_rng_tracker(tracker)
    tracker.set_states({k: tensor_parallel.convert_cuda_rng_state(v, to_graphable=graph_safe)
                        for k, v in state["rng_tracker_states"].items()})


def sharded_rng_state(per_data_parallel_rank: bool = False) -> ShardedObject:
    """The `rng_state` object of a torch_dist checkpoint, laid out as Megatron-LM lays it out (core_v0.17 on,
    checkpointing.py:445-451): one list per (pipeline, tensor) rank, written by data-parallel rank 0, with or without
    expert parallelism. Data-parallel replicas seed alike (seed + 100 x pipeline rank, set_random_seed), so their
    states are the same; a resume with other TP/PP sizes starts them afresh (load_rng_state).
    `per_data_parallel_rank`: the layout under expert parallelism of megatron-core <= 0.16 and of Bridge (0.6.2's
    checkpointing.py:514-525), one list per (pipeline, tensor, data-parallel) rank, to read a checkpoint written so."""
    pp, tp = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()
    shape = (parallel_state.get_pipeline_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_world_size())
    dp = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    if per_data_parallel_rank:
        dp_size = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        return ShardedObject("rng_state", [get_rng_state()], (*shape, dp_size), (pp, tp, dp), replica_id=0)
    return ShardedObject("rng_state", [get_rng_state()], shape, (pp, tp), replica_id=dp)


def saved_rng_layout(directory: str):
    """How a torch_dist checkpoint's `rng_state` is sharded, read from its index: (TP, PP), or (TP, PP, DP x CP) where
    it keeps one per data-parallel rank too (rng_state/shard_0.0.1_1.1.2: offsets, then the global shape (PP, TP,
    DP)); None when it holds none."""
    for key in _index(directory).state_dict_metadata:
        if key.startswith("rng_state/shard_"):
            shape = [int(n) for n in key.split("_")[-1].split(".")]
            return (shape[1], shape[0], *shape[2:])
    return None


def rng_layout(settings: dict) -> tuple:
    """How a run's `rng_state` is sharded (sharded_rng_state): (TP, PP), from a checkpoint's settings or (as
    Megatron-LM names them) this run's."""
    get = lambda name: settings.get(name) or 1
    return get("tensor_model_parallel_size"), get("pipeline_model_parallel_size")


def _plain(value):
    """A value `args` can hold and torch's weights-only loader (with megatron-core's safe globals) reads back."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)


def megatron_lm_args(cfg, ts) -> argparse.Namespace:
    """The checkpoint's `args`, as Megatron-LM's load_checkpoint reads it (checkpointing.py at core_v0.16.1:
    check_checkpoint_args compares the model sizes, the TP/PP sizes decide whether RNG and optimizer layouts fit,
    the counters are the progress; `--use-checkpoint-args` reads the rest). Every setting is under its flag's
    name, as Megatron-LM's argparse names it (`--no-save-rng` is no_save_rng = not save_rng), plus the sizes it
    derives."""
    args, defaults = {}, config_lib.ConfigContainer()
    for section, f, meta in config_lib._cli_fields(help_texts=False):
        flag = meta["flag"]
        # a FinetuningDatasetConfig (a DataloaderConfig, as Bridge's) has no pretraining data settings: their defaults
        value = getattr(getattr(cfg, section), f.name, getattr(getattr(defaults, section), f.name))
        dest = flag[2:].replace("-", "_")
        if dest.startswith("no_") and not f.name.startswith("no_") and isinstance(value, bool):
            value = not value
        args[dest] = _plain(value)
    m = cfg.model
    args.update(world_size=cfg.world_size, data_parallel_size=cfg.data_parallel_size,
                padded_vocab_size=getattr(cfg, "padded_vocab_size", None),
                # Megatron-LM's --no-position-embedding switch (True unless given; inert under RoPE), which its loader
                # compares with its own command line's (checkpointing.py:171, core_v0.19)
                add_position_embedding=m.add_position_embedding,
                # whether the MLP is gated, megatron-core's field: a fork's own activation sets it as --swiglu does
                gated_linear_unit=m.mlp_fields()["gated_linear_unit"],
                use_dist_ckpt=cfg.checkpoint.ckpt_format == "torch_dist",
                # an emerging optimizer's --use-distributed-optimizer, as Megatron-LM's validation turns it into
                # megatron-core's layer-wise optimizer (arguments.py:1679-1681, core_v0.19)
                use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer and not layer_wise(cfg),
                use_layer_wise_distributed_optimizer=layer_wise(cfg),
                iteration=ts.step, consumed_train_samples=ts.consumed_train_samples,
                skipped_train_samples=ts.skipped_train_samples, consumed_valid_samples=ts.consumed_valid_samples)
    return argparse.Namespace(**args)


def common_state(cfg, ts) -> dict:
    """What Megatron-LM and Bridge keep beside the tensors (torch_dist's common state, or each torch-format file)."""
    return {"args": megatron_lm_args(cfg, ts), "checkpoint_version": CHECKPOINT_VERSION, "iteration": ts.step,
            "num_floating_point_operations_so_far": ts.floating_point_operations_so_far}


# --------------------------------------------------------------------------------------------------
# Save
# --------------------------------------------------------------------------------------------------


_LOCAL_RESULTS = queue.Queue()  # a synchronous save's write results, within this process (_write_results_queue)
_MANAGER_RESULTS = None  # an --async-save's, through the Manager process _shield_write_results_queue starts


def _write_results_queue(async_save: bool, mp_mode: str = "fork", async_strategy: str = "mcore") -> None:
    """The queue megatron-core's torch_dist writer reports its write results through, set before each save (it reads
    filesystem_async._results_queue as it prepares one). Its own is a Manager process's, made at the first save, as
    an --async-save needs: its writer is another process. A synchronous save writes from this process (its forked
    workers report to it through a queue of their own), so a queue of this process serves: no Manager, which would
    import torch to unpickle the first results (1.3 s at each rank's first save, measured) and which a job's
    signals would reach."""
    global _MANAGER_RESULTS
    if async_save and _MANAGER_RESULTS is None:
        _MANAGER_RESULTS = _shield_write_results_queue(mp_mode)
    writer = filesystem_async
    if async_save and async_strategy == "nvrx":  # nvidia-resiliency-ext's writer reads its own module's queue
        from megatron.core.dist_checkpointing.strategies.torch import get_async_strategy

        writer = sys.modules[get_async_strategy("nvrx", "FileSystemWriterAsync")[1].__module__]
    _REPLACED_QUEUES.setdefault(writer, writer._results_queue)
    writer._results_queue = _MANAGER_RESULTS if async_save else _LOCAL_RESULTS


_REPLACED_QUEUES = {}  # writer module: its own _results_queue, before the run's first save replaced it


def restore_write_results_queue() -> None:
    """Give each writer module its own results queue back at the end of a run (train._finish_train): the next user of
    megatron-core's async save in this process must not inherit this run's."""
    while _REPLACED_QUEUES:
        writer, own = _REPLACED_QUEUES.popitem()
        writer._results_queue = own


def _shield_write_results_queue(mp_mode: str = "fork"):
    """The queue of an --async-save's writer, served by a Manager process (megatron-core starts one at the first
    save and keeps it, filesystem_async.py:65). SLURM's scancel, `timeout` and Ctrl-C signal every process of the
    job, that one too: once it is dead, the very save that --exit-signal-handler makes fails with a BrokenPipeError.
    So the queue is made here, by a Manager that blocks SIGTERM and SIGINT; it is shut down with its rank, as
    megatron-core's own would be.

    Blind to the job's signals, it must still end with its rank however the rank ends (an OOM kill, `kill -9`): it
    asks Linux for SIGKILL when its parent dies (prctl PR_SET_PDEATHSIG), and exits at once if the rank is already
    gone. Without that each killed rank leaves one orphan that ignores SIGTERM.

    The Manager is started as `mp_mode` says (Bridge's async_write_results_mp_mode: fork by default, a copy of the
    rank). A spawned one is a new interpreter, which would import the launching script (train.py, with torch and
    megatron-core) before serving a queue: seconds per rank at the first save. It needs none of it, so it is
    started with a bare __main__ and an initializer from the standard library (exec of MANAGER_INIT)."""
    manager = SyncManager(ctx=multiprocessing.get_context(mp_mode))
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        manager.start(initializer=exec, initargs=(MANAGER_INIT, {"RANK_PID": os.getpid()}))
    finally:
        sys.modules["__main__"] = main
    return manager.Queue()


# What the writer's Manager runs first (standard library only): the job's signals blocked, death with its rank.
MANAGER_INIT = """
import ctypes, os, signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
if sys.platform == "linux":
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
if os.getppid() != RANK_PID:  # the rank died before the request took effect
    os._exit(0)
"""


def save_checkpoint(state, model: list, optimizer, scheduler) -> str:
    """Write iter_{step}/ for the current step on every rank, then publish it. Returns its directory.

    With --async-save the tensors are handed to a background writer and this returns at once; the
    checkpoint is published later, by maybe_finalize_async_save, once every rank has finished writing.
    """
    with device.adam_as_built(optimizer):  # the file's param groups as Megatron-LM's, whatever kernel steps here
        return _save_checkpoint(state, model, optimizer, scheduler)


def _save_checkpoint(state, model: list, optimizer, scheduler) -> str:
    cfg, ts = state.cfg, state.train_state
    ck = cfg.checkpoint
    rank = torch.distributed.get_rank()
    final = iter_dir(ck.save, ts.step)
    if ck.async_save:  # one checkpoint in flight at a time: bounded memory, ordered trackers
        maybe_finalize_async_save(state, blocking=True)
    # This step may be saved there already (--ckpt-step below the tracker, or a --save holding a later run): perhaps
    # the very one the tracker names. The new one is then written beside it and swapped in once complete (_publish).
    directory = final + REPLACEMENT if any_rank(rank == 0 and os.path.isdir(final)) else final
    if rank == 0:
        if os.path.isdir(directory):  # left by an earlier, unpublished attempt
            shutil.rmtree(directory)
        os.makedirs(directory)
    torch.distributed.barrier()
    # What the tracker files will say is fixed now: training moves on while an async save is written.
    publish = functools.partial(_publish, cfg, state.tokenizer, ts.state_dict(), directory, final,
                                announce=ck.async_save)
    common = common_state(cfg, ts)

    if ck.ckpt_format == "torch_dist":
        _write_results_queue(ck.async_save, ck.async_write_results_mp_mode, ck.async_strategy)
        # storage_writers_per_rank: each saving rank writes its shards into this many files, one writer thread each
        strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=ck.storage_writers_per_rank)
        metadata = sharded_state_dict_metadata(cfg)
        sharded = {**model_sharded_state_dict(model, adapters_only=cfg.peft.peft != "none"), **common}
        if ck.save_optim and optimizer is not None:  # None: weights only (hf.py's import)
            _create_optimizer_state(optimizer)
            with fsdp2_params_found():
                sharded["optimizer"] = optimizer.sharded_state_dict(dict(sharded), metadata=metadata)
        if scheduler is not None:  # None: weights only (hf.py's import)
            sharded["opt_param_scheduler"] = scheduler.state_dict()
        if ck.save_rng:
            sharded["rng_state"] = sharded_rng_state()
        if ck.async_save:
            # megatron-core copies the shards to host memory now and writes them in a background
            # process; its own finalize step (metadata) runs first, then our publish, on every rank.
            # async_strategy: nvrx (nvidia-resiliency-ext's writer), or mcore, which checks.py derives when that
            # package is missing (the seed's fallback); megatron-core itself would raise instead.
            request = dist_checkpointing.save(sharded, directory, strategy, async_sharded_save=True,
                                              content_metadata=metadata, async_strategy=ck.async_strategy)
            request.add_finalize_fn(publish)
            _async_queue(state).schedule_async_request(request)
            return final
        dist_checkpointing.save(sharded, directory, strategy, content_metadata=metadata)
        files = []
    elif ck.ckpt_format in DCP_FORMATS:
        save_dcp(cfg, model, optimizer, scheduler, common, directory)
        files = []
    else:
        files = []
        # One file per tensor, pipeline and expert rank, with Megatron-LM's keys, written as Megatron-LM writes it
        # (checkpointing.py:733-741): by data-parallel rank 0 or expert-data-parallel rank 0, between them one rank
        # of each such file (replicas hold identical weights, optimizer and RNG states).
        if parallel_state.get_data_parallel_rank() == 0 or parallel_state.get_expert_data_parallel_rank() == 0:
            payload = {**_model_keys(model, lambda chunk: unwrap_model(chunk).state_dict()), **common}
            if scheduler is not None:
                payload["opt_param_scheduler"] = scheduler.state_dict()
            if ck.save_optim and optimizer is not None:
                payload["optimizer"] = optimizer.state_dict()
            if ck.save_rng:
                payload["rng_state"] = [get_rng_state()]
            os.makedirs(os.path.dirname(_mp_file(directory)), exist_ok=True)
            files.append((payload, _mp_file(directory)))
        if ck.async_save:
            # Training will change the weights in place: the writer gets a copy taken now.
            _async_queue(state).schedule([(_snapshot(obj), path) for obj, path in files], publish)
            return final
    for obj, path in files:
        _atomic_save(obj, path)
    torch.distributed.barrier()  # every rank's files are on disk
    publish()
    return final


@contextlib.contextmanager
def fsdp2_params_found():
    """megatron-core's optimizer finds each FSDP2 parameter's sharded tensor by the id of its local tensor: the model's
    sharded state dict holds the DTensor's `_local_tensor` (utils.py:1020), but the optimizer's map takes `to_local()`
    (dist_checkpointing/optimizer.py:39), a new tensor at every call, so no id matches ("Param id 0 does not match any
    model sharded param"; megatron-core defect, README: defects). Here the map takes `_local_tensor` too."""
    original = optimizer_checkpoint.to_local_if_dtensor
    optimizer_checkpoint.to_local_if_dtensor = lambda t: t._local_tensor if isinstance(t, DTensor) else t
    try:
        yield
    finally:
        optimizer_checkpoint.to_local_if_dtensor = original


def _as_fsdp2_state(optimizer) -> None:
    """The moments of FSDP2's DTensor parameters as DTensors again after a torch_dist load, which hands torch's Adam the
    local tensors it read them into (megatron-core defect, README: defects): its next step would mix the two
    ("got mixed torch.Tensor and DTensor")."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(inner, "optimizer", None)
        for p, state in (torch_optimizer.state.items() if torch_optimizer is not None else []):
            for key, value in state.items():
                if isinstance(p, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor) \
                        and value.shape == p._local_tensor.shape and value.dim() > 0:
                    state[key] = DTensor.from_local(value, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())


def _as_fsdp2_main_params(inner, part: dict) -> None:
    """Under --bf16/--fp16, FSDP2's fp32 main weights as DTensors again after a torch_dist load, which read them into
    plain local tensors (megatron-core defect 19, README: defects): megatron-core's copy into the DTensor main weights
    would mix the two (optimizer.py:1223-1229)."""
    for current_group, saved_group in zip(getattr(inner, "fp32_from_float16_groups", []),
                                          part.get("fp32_from_fp16_params", [])):
        for i, (current, saved) in enumerate(zip(current_group, saved_group)):
            if isinstance(current, DTensor) and not isinstance(saved, DTensor):
                saved_group[i] = DTensor.from_local(saved, current.device_mesh, current.placements, shape=current.shape,
                                                    stride=current.stride())


def _model_keys(model: list, state_dict_of) -> dict:
    """Megatron-LM's keys for the model chunks: `model`, or `model0`, `model1`, ... with virtual pipeline stages."""
    if len(model) == 1:
        return {"model": state_dict_of(model[0])}
    return {f"model{i}": state_dict_of(chunk) for i, chunk in enumerate(model)}


ADAPTER_KEY = ".adapter."  # in the name of every LoRA/DoRA adapter tensor (peft.py's LoRALinear.adapter)


def keep_adapters(sharded: dict) -> dict:
    """A model's sharded state dict, keeping the adapters: what a PEFT checkpoint saves and loads."""
    return {key: value for key, value in sharded.items() if ADAPTER_KEY in f".{key}"}


def model_sharded_state_dict(model: list, adapters_only: bool = False) -> dict:
    """The model chunks' sharded state dicts under Megatron-LM's keys: each tensor named by its place in the
    whole model (global layer numbers, full shapes), so any tensor/pipeline layout can read it back. A PEFT
    run's keeps its adapters only (the base weights are the pretrained checkpoint's)."""
    def of(chunk):
        sharded = fsdp2_uneven_shards(unwrap_model(chunk).sharded_state_dict(), chunk)
        return keep_adapters(sharded) if adapters_only else sharded
    return _model_keys(model, of)


def fsdp2_uneven_shards(sharded: dict, chunk) -> dict:
    """FSDP2's shards of a parameter whose first dimension does not divide the data-parallel size, at their true
    place. megatron-core states a shard's global shape as its local rows x DP (utils.py:1142-1147, mapping.py:229), so
    ranks of 33 and 32 rows disagree and the save fails (megatron-core defect, README: defects). Such a shard becomes
    megatron-core's irregular kind (no fragmentation; validation.py:432-434 leaves it to DCP), with the shape and
    offset torch's DTensor gives it. The optimizer's state copies these fields (optimizer.py:104-106)."""
    params = {id(p._local_tensor): p for p in chunk.parameters() if isinstance(p, DTensor)}

    def placed(sh):
        p = params.get(id(sh.data)) if isinstance(sh, ShardedTensor) else None
        if p is None or sh.axis_fragmentations is None or p.shape[0] % p.device_mesh.size() == 0:
            return sh
        dp, axis, rows = p.device_mesh.size(), sh.prepend_axis_num, p.shape[0]
        _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        # TP shards the first dimension too where megatron-core gave it TP x DP fragments (utils.py:1017-1026)
        tp = sh.axis_fragmentations[axis] // dp
        first = tp * rows, (parallel_state.get_tensor_model_parallel_rank() if tp > 1 else 0) * rows + offset[0]
        return dataclasses.replace(
            sh, axis_fragmentations=None,
            global_shape=(*sh.global_shape[:axis], first[0], *sh.global_shape[axis + 1:]),
            global_offset=(*sh.global_offset[:axis], first[1], *sh.global_offset[axis + 1:]))
    return dict_list_map_inplace(placed, sharded)


def sharded_state_dict_metadata(cfg) -> dict:
    """How the distributed optimizer lays its state out in a torch_dist checkpoint: per data-parallel shard
    (`dp_reshardable`, fast) unless --dist-ckpt-optim-fully-reshardable, as Megatron-LM chooses. megatron-core's
    own default, `fully_sharded_model_space`, is marked for deprecation (distrib_optimizer.py:1570-1571). Saved with the
    checkpoint (content metadata), so a load reads it back in the layout it was written in. The plain
    optimizer's state is always per parameter, in model space: no sharding type, as Megatron-LM writes it."""
    layout = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}  # Megatron-LM's, as it saves
    if not cfg.optimizer.use_distributed_optimizer:
        return layout
    sharding = "fully_reshardable" if cfg.checkpoint.dist_ckpt_optim_fully_reshardable else "dp_reshardable"
    return {**layout, "distrib_optim_sharding_type": sharding}


def load_metadata(cfg, directory: str) -> dict:
    """The layout to read a checkpoint's optimizer state in: the one it was saved in; `fully_reshardable` for the
    distributed optimizer where none was saved (megatron-core's plain and distributed optimizers do not read each
    other's: _load_checkpoint refuses that before)."""
    saved = dist_checkpointing.load_content_metadata(directory) or {}
    if cfg.optimizer.use_distributed_optimizer:
        return {**saved, "distrib_optim_sharding_type": saved.get("distrib_optim_sharding_type", "fully_reshardable")}
    return saved


def _create_optimizer_state(optimizer) -> None:
    """Give torch's Adam the state it would have before its first step (step 0, zero moments) if it has none yet,
    which is the same optimizer. megatron-core's checkpoint code describes what it saves and loads from the state
    the optimizer holds (distrib_optimizer.py:838 reads each parameter's `step`), and torch's Adam, which
    megatron-core uses without apex or transformer-engine, creates its state only at its first step: before that
    (a fresh run being loaded into, or an fp16 run whose steps all overflowed) there would be nothing to describe."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(inner, "optimizer", None)
        if not isinstance(torch_optimizer, torch.optim.Adam) or torch_optimizer.state:
            continue
        for group in torch_optimizer.param_groups:
            for p in group["params"]:
                on_device = group.get("fused") or group.get("capturable")
                torch_optimizer.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu"),
                                            "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}


def _restore_step_zero(saved: dict) -> None:
    """megatron-core saves Adam's shared step only when it is non-zero (optimizer.py:1187, `if step:`), so the
    state of an optimizer that has not stepped yet (every fp16 step so far overflowed) comes back without one;
    give it back its step 0, which torch's Adam needs to load it."""
    inner = saved.get("optimizer", saved) if isinstance(saved, dict) else None
    if isinstance(inner, dict) and isinstance(inner.get("state"), dict) and inner["state"] \
            and "common_step" not in inner["state"] and not any("step" in v for v in inner["state"].values()
                                                                if isinstance(v, dict)):
        inner["state"]["common_step"] = torch.zeros((), dtype=torch.float32)


def _regrouped(inners: list, saved: dict) -> dict:
    """A fully_reshardable distributed-optimizer state saved by another grouping of the optimizers: megatron-core
    gives MoE experts an optimizer of their own only at EP > 1 (a ChainedOptimizer of two), one for all at EP = 1.
    Each parameter's tensors were requested by name for this run's grouping and loaded as such (the `int` keys of
    a chained state, or the `param_state` of a single one); what came back in the saver's grouping is the common
    part (param groups, the sharding type, fp16's loss scaler). Each optimizer here gets its own param groups (the
    schedule sets their learning rates) with the saved Adam step, and the saved loss scaler. Unchanged when the
    groupings agree."""
    if not isinstance(saved, dict):  # the torch format's chained state: a list, in this run's grouping
        return saved
    chained = [k for k in saved if isinstance(k, int)]
    flat = [k for k in saved if not isinstance(k, int)]
    if (len(inners) > 1) == bool(chained) and not (chained and flat):
        return saved
    common = [saved[k] for k in sorted(chained)] if len(inners) == 1 else [saved]
    sharding = {part.get("param_state_sharding_type") for part in common} - {None}
    steps = {g["step"] for part in common for g in part.get("optimizer", {}).get("param_groups", []) if "step" in g}
    if sharding != {"fully_reshardable"} or len(steps) != 1:
        raise CheckpointError("the optimizer state was saved by another grouping of optimizers (another expert-"
                              "parallel size) in a format that does not regroup; load it with --no-load-optim")
    step = steps.pop()
    # fp16's loss scaler (scale, growth tracker, hysteresis): one per optimizer, each halved on its own overflows
    # (optimizer.py:764-770). Regrouped, each optimizer takes the smallest saved scale: the one that met the most
    # overflows, as one optimizer over all the parameters would have (it sees every part's).
    scalers = [part["grad_scaler"] for part in common if part.get("grad_scaler") is not None]
    scaler = min(scalers, key=lambda s: float(s["scale"])) if scalers else None

    def own(inner, loaded):
        groups = inner.state_dict()["optimizer"]["param_groups"]
        state = {"optimizer": {"param_groups": [dict(g, step=step) for g in groups]},
                 "param_state": loaded["param_state"], "param_state_sharding_type": "fully_reshardable"}
        return state if scaler is None else dict(state, grad_scaler=scaler)

    if len(inners) == 1:
        return own(inners[0], {k: saved[k] for k in flat})
    return {i: own(inner, saved[i]) for i, inner in enumerate(inners)}


def load_optimizer_state(optimizer, saved) -> None:
    """`optimizer.load_state_dict(saved)`, except that a distributed optimizer over torch's Adam gets back the
    saved step, one tensor per parameter (megatron-core defect, README: defects).

    megatron-core keeps the step in the checkpoint's param groups, and its load hands that value to every
    parameter as one shared tensor (distrib_optimizer.py:1026-1032), which torch's Adam then increments once per
    parameter at each step. Its parameter-state load then overwrites that tensor with the value before the load
    (dp_reshardable: `step` is a LocalNonpersistentObject, :1953-1956) or fails on the key (fully_reshardable
    drops it, :2390-2392: KeyError 'step'). So the step is set aside while the parameter state loads, and each
    parameter gets its own copy afterwards: weights, moments and bias correction all as saved."""
    from megatron.core.optimizer import DistributedOptimizer

    inners = getattr(optimizer, "chained_optimizers", [optimizer])
    saved = _regrouped(inners, saved)
    parts = [saved] if len(inners) == 1 else list(saved) if isinstance(saved, list) else [saved[k] for k in sorted(saved)]
    for inner, part in zip(inners, parts):
        torch_adam = isinstance(getattr(inner, "optimizer", None), torch.optim.Adam)
        if not (isinstance(inner, DistributedOptimizer) and torch_adam and "param_state" in part):
            _as_fsdp2_main_params(inner, part)
            inner.load_state_dict(part)
            continue
        part = dict(part)
        param_state, sharding = part.pop("param_state"), part.pop("param_state_sharding_type")
        steps = {group["step"] for group in part["optimizer"]["param_groups"]}
        if len(steps) != 1:
            raise CheckpointError(f"the optimizer state holds {len(steps)} different Adam steps {sorted(steps)}; "
                                  f"expected one — load it with --no-load-optim")
        inner.load_state_dict(part)  # param groups, loss scaler, and the state tensors to load into
        step = float(steps.pop())
        adam = inner.optimizer
        for per_param in adam.state.values():
            per_param.pop("step", None)
        getattr(inner, f"load_parameter_state_from_{sharding}")(param_state)
        for group in adam.param_groups:
            on_device = group.get("fused") or group.get("capturable")  # where torch's Adam keeps its step
            for p in group["params"]:
                adam.state[p]["step"] = torch.tensor(step, dtype=torch.float32, device=p.device if on_device else "cpu")
    if len(inners) > 1:
        optimizer._synchronize_steps()


def _publish(cfg, tokenizer, train_state: dict, directory: str, final: str, announce: bool = False) -> None:
    """Called on every rank once every rank's files are written: rank 0 adds the run's description, puts the
    checkpoint in its place (`final`; swapped with the one there, which is deleted only after the tracker), then
    writes the two tracker files (the checkpoint becomes visible), prunes, and all ranks meet again."""
    ck = cfg.checkpoint
    if torch.distributed.get_rank() == 0:
        _atomic_write_text(config_lib.to_yaml(cfg), os.path.join(directory, "run_config.yaml"))
        save_tokenizer(tokenizer, directory)
        _atomic_save(train_state, os.path.join(directory, "train_state.pt"))
        if directory != final:
            _exchange(directory, final)  # `final` holds the new checkpoint, `directory` the one it replaces
        _atomic_save(train_state, os.path.join(ck.save, LATEST_TRAIN_STATE))
        step = int(train_state["step"])
        _atomic_write_text(str(step), os.path.join(ck.save, TRACKER))  # published: last write
        if directory != final:
            shutil.rmtree(directory)
        if ck.most_recent_k > 0:
            prune_old_checkpoints(ck.save, step, ck.most_recent_k)
        if announce:  # an async save: its completion is news (a sync save is reported by the caller)
            print(f" successfully saved checkpoint from iteration {step:7d} to {final} (async)",
                  flush=True)
    torch.distributed.barrier()


REPLACEMENT = ".replacement"  # iter_N.replacement: a new checkpoint of step N, written while iter_N stays in place


def _exchange(a: str, b: str) -> None:
    """Swap two directories' names in one step (Linux's renameat2 with RENAME_EXCHANGE), so that a process killed at
    any moment leaves each name holding a whole checkpoint. Where the C library or the filesystem cannot, three
    renames, between which `b` is missing for a moment."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
            return
    except AttributeError:  # no renameat2: not Linux, or glibc before 2.28
        pass
    aside = b + ".replaced"
    os.rename(b, aside)
    os.rename(a, b)
    os.rename(aside, a)


AT_FDCWD, RENAME_EXCHANGE = -100, 2  # linux/fcntl.h, linux/fs.h


# --------------------------------------------------------------------------------------------------
# Async save (--async-save)
# --------------------------------------------------------------------------------------------------


def _snapshot(obj):
    """A copy of a state dict whose tensors no longer share memory with the live model/optimizer."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_snapshot(v) for v in obj)
    return copy.deepcopy(obj)


class ThreadAsyncQueue:
    """--async-save for the torch format: each save's files are written by a background thread, and
    `maybe_finalize_async_calls` (called on every rank at the same points, like megatron-core's
    AsyncCallsQueue whose method names it keeps) publishes the checkpoint once all ranks are done.
    A rank killed before that leaves the tracker on the previous checkpoint."""

    def __init__(self):
        self.active = None  # (thread, errors, publish) of the save in flight

    def schedule(self, files: list, publish) -> None:
        errors: list = []

        def write():
            try:
                for obj, path in files:
                    _atomic_save(obj, path)
            except BaseException as e:  # reported on every rank at finalize
                errors.append(f"{type(e).__name__}: {e}")

        thread = threading.Thread(target=write, name="async-checkpoint-writer", daemon=True)
        thread.start()
        self.active = (thread, errors, publish)

    def get_num_unfinalized_calls(self) -> int:
        return int(self.active is not None)

    def maybe_finalize_async_calls(self, blocking: bool = False) -> list:
        if self.active is None:
            return []
        thread, errors, publish = self.active
        if blocking:
            thread.join()
        if any_rank(thread.is_alive()):  # some rank still writing: try again later
            return []
        self.active = None
        if any_rank(bool(errors)):
            raise CheckpointError(f"async checkpoint save failed ({errors[0] if errors else 'on another rank'}); "
                                  f"the previous checkpoint stays the newest — check free disk space under --save")
        publish()
        return [0]


def _async_queue(state):
    """The run's async save queue, made on first use: megatron-core's for torch_dist, a thread otherwise."""
    if state.async_calls_queue is None:
        ck = state.cfg.checkpoint
        if ck.ckpt_format == "torch_dist":
            from megatron.core.dist_checkpointing.strategies.torch import get_async_strategy

            _, AsyncCallsQueue = get_async_strategy(ck.async_strategy, "AsyncCallsQueue")
            # The persistent worker is a spawned process that selects its CUDA device first (async_utils.py:565);
            # without CUDA the writes go to a process forked per save, which inherits device.py's shim.
            state.async_calls_queue = AsyncCallsQueue(persistent=ck.use_persistent_ckpt_worker and device.cuda())
        else:
            state.async_calls_queue = ThreadAsyncQueue()
    return state.async_calls_queue


def maybe_finalize_async_save(state, blocking: bool = False) -> bool:
    """Publish the async save in flight if every rank has written it (wait for it when `blocking`).
    Must be called on all ranks at the same points. Returns True when a checkpoint was published."""
    queue = state.async_calls_queue
    if queue is None or not queue.get_num_unfinalized_calls():
        return False
    return bool(queue.maybe_finalize_async_calls(blocking=blocking))


def close_async_save(state) -> None:
    """At the end of a run: wait for and publish the save in flight, then stop megatron-core's writer."""
    maybe_finalize_async_save(state, blocking=True)
    if hasattr(state.async_calls_queue, "close"):
        state.async_calls_queue.close()
    state.async_calls_queue = None


def abort_async_save(state) -> None:
    """When the run fails: stop the writers of the save in flight and publish nothing, with no collective (the other
    ranks may be anywhere), as Megatron-LM's in-process restart aborts its worker (training/async_utils.py:157-161).
    The tracker stays on the last published checkpoint. A writer process (megatron-core's, one per save on a CPU,
    or the persistent worker on a GPU) is killed and reaped; a writer thread (the torch format's) cannot be killed,
    and is waited for."""
    queue, state.async_calls_queue = state.async_calls_queue, None
    if isinstance(queue, ThreadAsyncQueue):
        if queue.active is not None:
            queue.active[0].join()
        return
    for call in getattr(queue, "async_calls", ()):
        process = getattr(call.async_caller, "process", None)
        call.async_caller.close(abort=True)  # kills it (async_utils.py:318-343, 490-513)
        if process is not None:
            process.join()
    if queue is not None:
        queue.close(abort=True)


def prune_old_checkpoints(save: str, latest: int, keep: int) -> None:
    """Delete all but the newest `keep` iter_* directories, only after `latest` is published. Each is
    first renamed out of the iter_* namespace, so a kill mid-delete never leaves a half checkpoint that
    --ckpt-step could name."""
    steps = sorted(int(n[5:]) for n in os.listdir(save) if n.startswith("iter_") and n[5:].isdigit())
    for step in [s for s in steps if s <= latest][:-keep]:
        doomed = os.path.join(save, f"deleting_iter_{step:07d}")
        os.replace(iter_dir(save, step), doomed)
        shutil.rmtree(doomed)


TOKENIZER_DIR = "tokenizer"  # iter_N/tokenizer/, Bridge's place for the tokenizer's files
TOKENIZER_IDENTITY = "identity.json"  # which tokenizer (class, vocabulary size, file digest): what a load compares


def save_tokenizer(tokenizer, directory: str) -> None:
    """The tokenizer travels with the weights, in iter_N/tokenizer/: its identity and, for a
    HuggingFace tokenizer, its tokenizer.json, so a checkpoint can be used without the original files."""
    if tokenizer is None:
        return
    out = os.path.join(directory, TOKENIZER_DIR)
    os.makedirs(out, exist_ok=True)
    _atomic_write_text(json.dumps(tokenizer.unique_identifiers, sort_keys=True), os.path.join(out, TOKENIZER_IDENTITY))
    if getattr(tokenizer, "file", None):  # copied aside, then renamed into place, as every file of a save
        tmp = os.path.join(out, f"tokenizer.json.tmp{os.getpid()}")
        shutil.copyfile(tokenizer.file, tmp)
        os.replace(tmp, os.path.join(out, "tokenizer.json"))


def saved_tokenizer(directory: str, common: dict):
    """(what the checkpoint says of its tokenizer, the file that says it), or (None, None) when it says nothing:
    ours and Bridge's name it in tokenizer/; Megatron-LM's only in `args` (type, and the vocabulary size of a
    NullTokenizer, the only one whose ids it fixes)."""
    path = os.path.join(directory, TOKENIZER_DIR, TOKENIZER_IDENTITY)
    if os.path.isfile(path):
        try:
            with open(path) as fh:
                said = json.load(fh)
            if said.get("class") == "NullTokenizer":  # without eod_id: written on megatron-core <= 0.16
                said = null_tokenizer_said(said["vocab_size"], said.get("eod_id"))
            return said, path
        except ValueError as e:
            raise CheckpointError(f"{path}: cannot be read ({_first_line(e)}); copy it from another checkpoint of the "
                                  f"run, or load an older iteration with --ckpt-step") from None
    args = common.get("args")
    if getattr(args, "tokenizer_type", None):
        said = {"class": args.tokenizer_type}
        if args.tokenizer_type == "NullTokenizer":
            # Megatron-LM 0.17 on has --null-tokenizer-eod-id (None: vocab_size - 1); before, the id after them.
            eod = getattr(args, "null_tokenizer_eod_id", "none before 0.17")
            said = null_tokenizer_said(args.vocab_size, None if eod == "none before 0.17" else eod or args.vocab_size - 1)
        return said, common_file(directory)
    return None, None


def null_tokenizer_said(vocab_size: int, eod_id) -> dict:
    """A NullTokenizer's identity as data.NullTokenizer states it. `eod_id` None: written by megatron-core <= 0.16's
    meaning, where --vocab-size V were V ids and the end-of-document the next (V + 1 ids here)."""
    return {"class": "NullTokenizer", "vocab_size": vocab_size + 1, "eod_id": vocab_size} if eod_id is None else \
        {"class": "NullTokenizer", "vocab_size": vocab_size, "eod_id": eod_id}


def check_tokenizer(tokenizer, directory: str, common: dict) -> None:
    """The run's tokenizer is the one the weights were trained with (another one reads other token ids). A
    checkpoint that names none (Bridge's NullTokenizer leaves tokenizer/ empty) is read with the flags' one, said once."""
    if tokenizer is None:
        return
    said, path = saved_tokenizer(directory, common)
    ours = json.loads(json.dumps(tokenizer.unique_identifiers))
    if said is None:
        print_rank_0(f" {directory} names no tokenizer: reading it with the flags' {ours}")
        return
    if {k: ours.get(k) for k in said} != said or ("sha256" in ours) != ("sha256" in said):
        raise CheckpointError(f"{path}: the weights were trained with tokenizer {said} but the flags give {ours}; "
                              f"pass the checkpoint's tokenizer flags (--tokenizer-type, --vocab-size, --tokenizer-model)")


# --------------------------------------------------------------------------------------------------
# FSDP's formats: fsdp_dtensor (Megatron FSDP) and torch_dcp (torch FSDP2)
# --------------------------------------------------------------------------------------------------

DCP_FORMATS = ("fsdp_dtensor", "torch_dcp")  # torch.distributed.checkpoint of the FSDP's DTensors


DCP_FLAG = {"fsdp_dtensor": "--use-megatron-fsdp", "torch_dcp": "--use-torch-fsdp2"}  # the run that reads each


def fsdp_kind(model: list) -> Optional[str]:
    """The flag whose FSDP wraps this model (--use-megatron-fsdp, --use-torch-fsdp2), or None."""
    return ("--use-megatron-fsdp" if isinstance(model[0], FullyShardedDataParallel) else
            "--use-torch-fsdp2" if isinstance(model[0], TorchFullyShardedDataParallel) else None)


def _megatron_fsdp(model: list) -> bool:
    return fsdp_kind(model) == "--use-megatron-fsdp"


def _fill_empty_shards(optimizer) -> None:
    """Give every parameter of the distributed optimizer whose shard on this rank is empty (or that has no Adam state
    yet) a zero state at the step of the others. Under Megatron FSDP a rank's shard of a parameter can be empty: it
    gets no gradient, so torch's Adam makes it no state, and the ranks then describe different state keys to
    `preprocess_state_dict_for_uneven_dtensor`, whose per-tensor collectives pair up wrongly and wait forever
    (megatron-core defect, README: defects; Megatron-LM #4910). Its step is set again at every save: DCP writes one
    rank's copy of a plain tensor, which may be this rank's, and Adam never steps an empty shard (a stale step here
    was the one a resume read, for the ranks that do step it)."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        adam = getattr(inner, "optimizer", None)
        if not isinstance(adam, torch.optim.Adam):
            continue
        steps = [s["step"] for s in adam.state.values() if "step" in s]
        # reduced on the collective's device (NCCL's on a GPU), kept where torch's Adam keeps its steps
        step = torch.tensor(max(map(float, steps), default=0.0), device=device.current())
        torch.distributed.all_reduce(step, op=torch.distributed.ReduceOp.MAX)
        step = step.to(steps[0].device if steps else "cpu")
        for group in adam.param_groups:
            for p in group["params"]:
                if not adam.state.get(p) or p.to_local().numel() == 0:
                    adam.state[p] = {"step": step.clone(), "exp_avg": torch.zeros_like(p),
                                     "exp_avg_sq": torch.zeros_like(p)}


def grad_scalers(optimizer) -> list:
    """The fp16 loss scalers of the optimizer's parts (none at fp32 and bf16)."""
    scalers = (getattr(inner, "grad_scaler", None) for inner in getattr(optimizer, "chained_optimizers", [optimizer]))
    return [s for s in scalers if s is not None]


def dcp_rng_key() -> str:
    """Megatron-LM's key for this rank's RNG states in fsdp_dtensor (checkpointing.py get_rng_state): one list per
    (pipeline, tensor) rank; data-parallel replicas hold the same states, and DCP keeps one copy of each key."""
    return f"({parallel_state.get_pipeline_model_parallel_rank()}, {parallel_state.get_tensor_model_parallel_rank()})"


def dcp_state_dict(cfg, model: list, optimizer, scheduler, common: dict, loading: bool, rng: bool) -> tuple:
    """(what torch.distributed.checkpoint writes or reads, the model's and optimizer's own state dicts) as Megatron-LM's
    generate_state_dict and preprocess_fsdp_dtensor_state_dict make them (checkpointing.py:1296-1397): `args`,
    `iteration`, `checkpoint_version`, the FLOPs, `model` (the FSDP's DTensors, `module.`-prefixed under Megatron
    FSDP), `optimizer` and `opt_param_scheduler` (None: weights only), and `rng_state` {"(pp, tp)": [states]}.
    torch_dcp's optimizer is torch's own state dict of FSDP2's DTensors; fsdp_dtensor's the distributed optimizer's
    `fsdp_dtensor` sharding, each parameter's state a DTensor under its name; SwiGLU's fc1 weight and moments split
    into their `_w` and `_v` halves, so that any tensor-parallel size reads them."""
    raw = {**common, "model": model[0].state_dict()}
    if optimizer is not None:
        if _megatron_fsdp(model):
            _fill_empty_shards(optimizer)
            metadata = {"distrib_optim_sharding_type": "fsdp_dtensor", "singleton_local_shards": False,
                        "chained_optim_avoid_prefix": True}
            # loading: megatron-core makes the state to read into with a step of zero gradients (restored by the load)
            raw["optimizer"] = optimizer.sharded_state_dict(raw, is_loading=loading, metadata=metadata)
            scalers = grad_scalers(optimizer)
            if scalers:
                # fp16's loss scale, which megatron-core's fsdp_dtensor state leaves out (distrib_optimizer.py:1518-1521
                # and :916-925): a resume started from --initial-loss-scale (megatron-core defect, README: defects)
                raw["optimizer"]["grad_scaler"] = {str(i): s.state_dict() for i, s in enumerate(scalers)}
        else:
            # Megatron-LM calls optimizer.state_dict(is_loading=True) (checkpointing.py:2339), which a ChainedOptimizer
            # does not take (TypeError): the state to read into is made here as that call makes it (init_state_fn:
            # SGD's momentum buffers, model.momentum_buffers), Adam's with its step, which torch's Adam loads and
            # megatron-core's init_state_fn leaves out (KeyError 'step').
            if loading:
                _create_optimizer_state(optimizer)
                for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
                    if inner.init_state_fn is not None:
                        inner.init_state_fn(inner.optimizer, inner.config)
            raw["optimizer"] = optimizer.state_dict()
        raw["opt_param_scheduler"] = scheduler.state_dict()
    if rng:
        raw["rng_state"] = {dcp_rng_key(): [get_rng_state()]}
    if not _megatron_fsdp(model):
        return raw, raw
    written = dict(raw)
    handle_fp8_extra_state_case(written["model"])
    if cfg.model.mlp_fields()["gated_linear_unit"]:
        # fc1's weight and its Adam moments as their `_w` and `_v` halves: a TP=2 fc1 holds [w0; v0] and [w1; v1], one
        # process's [w0; w1; v0; v1]. megatron-core's split of the moments looks each parameter up one `module.` short
        # (fsdp_dtensor_checkpoint.py:375-377, AttributeError; megatron-core defect, README: defects; Megatron-LM
        # #5265), so it is handed their keys one `module.` longer, and they are taken back after.
        opt = written.get("optimizer")
        if opt is not None:
            opt = {**opt, "state": {"module." + k: v for k, v in opt["state"].items()}}
        written["model"], opt = handle_swiglu_in_state_dict(model[0], written["model"], opt)
        if opt is not None:
            written["optimizer"] = {**opt, "state": {k.removeprefix("module."): v for k, v in opt["state"].items()}}
    preprocess_state_dict_for_uneven_dtensor(written)
    return written, raw


def save_dcp(cfg, model: list, optimizer, scheduler, common: dict, directory: str) -> None:
    """Write the checkpoint as Megatron-LM's fsdp_dtensor or torch_dcp: `.metadata` and one `__R_0.distcp` per rank,
    through torch.distributed.checkpoint (whose `.metadata`, written last, completes it)."""
    ck = cfg.checkpoint
    written, _ = dcp_state_dict(cfg, model, optimizer if ck.save_optim else None, scheduler, common, loading=False,
                                rng=ck.save_rng)
    dcp.save(written, storage_writer=dcp.FileSystemWriter(directory))


def _dcp_common(directory: str) -> dict:
    """An fsdp_dtensor or torch_dcp checkpoint's `args`, `iteration`, `checkpoint_version` and FLOPs, read by this rank
    alone (as Megatron-LM's rank-0 read, checkpointing.py:1762-1765), before any weight."""
    held = _index(directory).state_dict_metadata
    _check_distcp_files(directory)
    wanted = {k: None for k in ("args", "iteration", "checkpoint_version", "num_floating_point_operations_so_far")
              if k in held}
    try:
        dcp.load(wanted, checkpoint_id=directory, no_dist=True)
    except Exception as e:
        raise CheckpointError(f"{directory}: cannot be read ({_first_line(e)}); the checkpoint is corrupt — load an "
                              f"older iteration with --ckpt-step") from None
    return wanted


def dcp_format(directory: str, common: dict) -> str:
    """fsdp_dtensor or torch_dcp: the saving run's --ckpt-format (its `args`); Megatron-LM, which cannot tell them apart
    by their files, takes fsdp_dtensor under --use-megatron-fsdp (checkpointing.py:1623-1626), as here without `args`."""
    saved = getattr(common.get("args"), "ckpt_format", None)
    if saved in DCP_FORMATS:
        return saved
    return "fsdp_dtensor" if any(k.startswith("model.module.") for k in _index(directory).state_dict_metadata) \
        else "torch_dcp"


def _load_dcp(cfg, directory: str, model: list, optimizer, scheduler, common: dict, load_optim: bool,
              load_rng: bool) -> dict:
    """Read an fsdp_dtensor or torch_dcp checkpoint into the FSDP's own DTensors, at any data-parallel size (DCP
    reshards them), as Megatron-LM's load_checkpoint does: the tensors in place, then the model's and the optimizer's
    load_state_dict with what was read."""
    held = _index(directory).state_dict_metadata
    if load_rng and not any(k.startswith(f"rng_state.{dcp_rng_key()}") for k in held):
        raise CheckpointError(f"{directory}: holds no random states (rng_state) for (pipeline, tensor) rank "
                              f"{dcp_rng_key()}; pass --no-load-rng to start them afresh from --seed")
    if load_optim and not any(k.startswith("optimizer.") for k in held):
        raise CheckpointError(f"{directory}: saved without optimizer state (--no-save-optim); add --no-load-optim")
    _check_distcp_files(directory)
    read, raw = dcp_state_dict(cfg, model, optimizer if load_optim else None, scheduler, {}, loading=True, rng=load_rng)
    if "grad_scaler" in (read.get("optimizer") or {}) and not any(k.startswith("optimizer.grad_scaler.") for k in held):
        # saved by Megatron-LM or at another precision: the loss scale starts afresh, as megatron-core's DDP starts it
        print_rank_0(f" {directory}: holds no fp16 loss scale; it starts from --initial-loss-scale")
        for state in (read, raw):
            state["optimizer"].pop("grad_scaler", None)
    strict = cfg.checkpoint.strict_fsdp_dtensor_load
    lacking = [key for key in _flat_keys(read) if key not in held]
    some = f"{lacking[0]}{f' and {len(lacking) - 1} more' if len(lacking) > 1 else ''}" if lacking else ""
    if lacking and strict:
        raise CheckpointError(f"{directory}: holds no {some} of this run's tensors; check --num-layers/--hidden-size/... "
                              f"against its run_config.yaml, or pass --no-strict-fsdp-dtensor-load to read the rest")
    if lacking:  # named, as Megatron-LM names them (checkpointing.py:1797-1803)
        print_rank_0(f" {directory}: holds no {some} of this run's tensors, which keep the values they have "
                     f"(--no-strict-fsdp-dtensor-load): {', '.join(lacking)}")
    planner = DefaultLoadPlanner(allow_partial_load=not strict)
    try:
        dcp.load(read, storage_reader=dcp.FileSystemReader(directory), planner=planner)
    except (Exception, CheckpointException) as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        why = next((line for line in reversed(lines) if "mismatch" in line or "Missing" in line or "size" in line),
                   lines[-1] if lines else type(e).__name__)
        raise CheckpointError(f"{directory}: cannot be read into this model ({why[:300]}); check --num-layers/"
                              f"--hidden-size/... against its run_config.yaml, or load an older iteration with "
                              f"--ckpt-step") from None
    if _megatron_fsdp(model):
        # The adapter's state dict names the model under one `module.` (Float16Module's, under --bf16/--fp16, hands
        # over its module's), and its load puts one back before torch's own load, which names Float16Module's too.
        half = isinstance(model[0].module.module, Float16Module)
        model[0].load_state_dict({"module." * half + k.removeprefix("module."): v for k, v in raw["model"].items()})
    else:
        model[0].load_state_dict(raw["model"])
    if load_optim:
        scaler_states = read["optimizer"].get("grad_scaler") if _megatron_fsdp(model) else None
        raw["optimizer"].pop("grad_scaler", None)
        with torch.no_grad():
            optimizer.load_state_dict(raw["optimizer"])
        for i, scaler in enumerate(grad_scalers(optimizer) if scaler_states is not None else []):
            scaler.load_state_dict(scaler_states[str(i)])
    return {**common, **{k: v for k, v in read.items() if k in ("opt_param_scheduler",)},
            **({"rng_state": read["rng_state"][dcp_rng_key()]} if load_rng else {})}


def _flat_keys(state: dict, prefix: str = "") -> list:
    """The keys torch.distributed.checkpoint gives the tensors of a nested state dict (dotted paths)."""
    keys = []
    for key, value in state.items():
        if isinstance(value, dict):
            keys += _flat_keys(value, f"{prefix}{key}.")
        elif isinstance(value, torch.Tensor):
            keys.append(f"{prefix}{key}")
    return keys


def _read_dcp_weights(directory: str, saved_format: str, model: list) -> None:
    """Weights only, into a model that is not sharded (generate.py, hf.py export, --pretrained-checkpoint): each saved
    DTensor is a whole tensor in the checkpoint, read whole and cut to this rank's tensor-parallel part. SwiGLU's fc1
    is Megatron FSDP's `_w` and `_v` halves, joined per tensor-parallel rank as megatron-core lays it out."""
    if len(model) > 1 or parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise CheckpointError(f"{directory}: a {saved_format} checkpoint's weights load into one pipeline stage here; "
                              f"drop --pipeline-model-parallel-size")
    held = _index(directory).state_dict_metadata
    prefix = "model.module." if saved_format == "fsdp_dtensor" else "model."
    module = unwrap_model(model[0])
    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    ours = {k: v for k, v in module.state_dict().items() if isinstance(v, torch.Tensor) and "_extra_state" not in k}
    whole, halves = {}, {}
    for name in ours:
        key = prefix + name
        if key in held:
            whole[key] = torch.empty(held[key].size, dtype=held[key].properties.dtype)
        elif key + "_w" in held:
            halves[name] = (key + "_w", key + "_v")
            for part in halves[name]:
                whole[part] = torch.empty(held[part].size, dtype=held[part].properties.dtype)
        else:
            raise CheckpointError(f"{directory}: holds no {name}; check --num-layers/--hidden-size/... against its "
                                  f"run_config.yaml")
    _check_distcp_files(directory)
    dcp.load(whole, checkpoint_id=directory, no_dist=True)  # flat keys: DCP's names for the nested ones
    params = dict(module.named_parameters())
    loaded = {}
    for name, tensor in ours.items():
        p = params.get(name)
        split = getattr(p, "tensor_model_parallel", False) and tp > 1
        dim = getattr(p, "partition_dim", 0)
        if name in halves:  # megatron-core's fc1 on each tensor-parallel rank: [its part of w; its part of v]
            w, v = (whole[k] for k in halves[name])
            loaded[name] = torch.cat([w.chunk(tp, dim)[rank], v.chunk(tp, dim)[rank]] if split else [w, v], dim)
        else:
            loaded[name] = whole[prefix + name].chunk(tp, dim)[rank] if split else whole[prefix + name]
        if loaded[name].shape != tensor.shape:
            raise CheckpointError(f"{directory}: {name} is {tuple(loaded[name].shape)} there and "
                                  f"{tuple(tensor.shape)} here; check --num-layers/--hidden-size/... against its "
                                  f"run_config.yaml")
    module.load_state_dict(loaded, strict=False)


# --------------------------------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------------------------------


def resolve_load_dir(load: str, ckpt_step=None):
    """The iter_* directory that `--load` (and `--ckpt-step`) name, or None when there is none yet.

    `load` may be a save directory (its tracker names the newest iteration) or one iter_* directory.
    A save directory that does not exist or holds no tracker means "nothing to resume": the first
    run of `--save X --load X`.
    """
    if os.path.basename(os.path.normpath(load)).startswith("iter_") and ckpt_step is None:
        if not os.path.isdir(load):
            raise CheckpointError(f"--load {load}: no such directory")
        return check_published(load, f"--load {load}")
    if ckpt_step is not None:
        directory = iter_dir(load, ckpt_step)
        if not os.path.isdir(directory):
            raise CheckpointError(f"--ckpt-step {ckpt_step}: {directory} does not exist")
        return check_published(directory, f"--ckpt-step {ckpt_step}")
    text = tracked_iteration(load)
    if text is None:
        return None
    tracker = os.path.join(load, TRACKER)
    directory = iter_dir(load, int(text))
    if not os.path.isdir(directory):
        raise CheckpointError(f"{tracker} names iteration {text} but {directory} does not exist; "
                              f"pass --ckpt-step with an iteration that exists")
    if _is_torch_dist(directory) and not os.path.isfile(os.path.join(directory, ".metadata")):
        raise CheckpointError(f"{directory}: no .metadata (torch_dist's index of the tensors); the checkpoint is "
                              f"damaged: load an older iteration with --ckpt-step")
    return directory


def _is_torch_dist(directory: str) -> bool:
    """torch_dist's layout, not the torch format's per-rank mp_rank_* folders."""
    return not any(entry.startswith("mp_rank_") for entry in os.listdir(directory))


def tracked_iteration(save: str):
    """The iteration the save directory's tracker publishes (as its text), or None without a tracker."""
    tracker = os.path.join(save, TRACKER)
    if not os.path.isfile(tracker):
        return None
    text = open(tracker).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{tracker}: expected an iteration number, found {text[:40]!r}; "
                              f"fix the file or pass --ckpt-step")
    return text


def check_published(directory: str, named: str) -> str:
    """An iter_* directory named directly (--ckpt-step, --load DIR/iter_N) bypasses the tracker, so it must show that
    its save finished: torch_dist's index (.metadata, written when every rank's tensors are) and the publish step's
    train_state.pt (ours and Bridge's; written after every rank's files), or, in Megatron-LM's form, which has no
    train_state.pt, a tracker that has published this iteration or a later one."""
    directory = os.path.normpath(directory)
    save, name = os.path.split(directory)
    step = int(name[len("iter_"):]) if name[len("iter_"):].isdigit() else None
    torch_dist = _is_torch_dist(directory)
    tracked = tracked_iteration(save)
    published = (not torch_dist or os.path.isfile(os.path.join(directory, ".metadata"))) and (
        os.path.isfile(os.path.join(directory, "train_state.pt"))
        or (tracked is not None and step is not None and int(tracked) >= step))
    if not published:
        missing = ".metadata" if torch_dist and not os.path.isfile(os.path.join(directory, ".metadata")) else \
            "train_state.pt"
        newest = f"the newest published is iteration {int(tracked)} (--ckpt-step {int(tracked)})" if tracked else \
            f"{save} has no published checkpoint ({TRACKER})"
        raise CheckpointError(f"{named}: the save of iteration {step if step is not None else name} did not finish "
                              f"({directory} has no {missing}); {newest}")
    return directory


def load_checkpoint(state, model: list, optimizer, scheduler, path: str, finetune: bool = False) -> bool:
    """Restore a run from `path` (--load, or --pretrained-checkpoint with finetune=True).
    Returns False, changing nothing, when a --load directory holds no checkpoint yet.

    With finetune only the weights are read and the run starts at iteration 0. If any rank cannot
    load its part, every rank raises CheckpointError: no rank goes on to wait for the others forever.
    """
    error = None
    try:
        loaded = _load_checkpoint(state, model, optimizer, scheduler, path, finetune)
    except CheckpointError as e:
        error, loaded = e, False
    if any_rank(error is not None):
        raise error or CheckpointError(f"{path}: another rank could not load its part of the checkpoint (see its error)")
    device.fused_cpu_adam(optimizer)  # the loaded groups' `fused` is the file's
    return loaded


# --------------------------------------------------------------------------------------------------
# The checkpoint manager: who does a run's saves and loads (Bridge's CheckpointManager protocol)
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class CheckpointSaveContext:
    """What a manager's save gets (Bridge's fields; the iteration is state.train_state.step)."""

    state: Any
    model: list
    optimizer: Any
    opt_param_scheduler: Any
    num_floating_point_operations_so_far: float
    train_data_iterator: Any = None
    non_persistent_ckpt: bool = False
    pg_collection: Any = None
    module_name: Optional[str] = None


@dataclasses.dataclass
class CheckpointLoadContext:
    """What a manager's load gets (Bridge's fields): the checkpoint to read is the config's, state.cfg.checkpoint."""

    state: Any
    model: list
    optimizer: Any
    opt_param_scheduler: Any
    strict: bool = True
    skip_load_to_model_and_opt: bool = False
    pg_collection: Any = None
    module_name: Optional[str] = None


CHECKPOINT_MANAGER_METHODS = ("save", "load", "finalize_async_saves")  # the protocol, besides __init__(config)


class DefaultCheckpointManager:
    """This module's saves and loads behind Bridge's CheckpointManager protocol. A `custom_manager_class` implements
    the same four methods and takes its place (create_checkpoint_manager)."""

    def __init__(self, checkpoint_config):
        self.checkpoint_config = checkpoint_config

    def save(self, ctx: CheckpointSaveContext, callback_manager=None) -> None:
        """Write and publish iter_{step}/ (with --async-save: hand it to the writer; published later)."""
        save_checkpoint(ctx.state, ctx.model, ctx.optimizer, ctx.opt_param_scheduler)

    def load(self, ctx: CheckpointLoadContext) -> tuple:
        """Resume this run's own checkpoint if --load holds one; otherwise start from --pretrained-checkpoint's
        weights if given (unless setup read them into the bare model: bare_model_weights). Returns (iteration, FLOPs so
        far): (0, 0) when nothing was resumed."""
        ck, state = self.checkpoint_config, ctx.state
        args = (state, ctx.model, ctx.optimizer, ctx.opt_param_scheduler)
        resumed = bool(ck.load) and load_checkpoint(*args, ck.load, ck.finetune)
        if not resumed and ck.pretrained_checkpoint and bare_model_weights(state.cfg) is None:
            load_checkpoint(*args, ck.pretrained_checkpoint, finetune=True)
        ts = state.train_state
        return ts.step, ts.floating_point_operations_so_far

    def finalize_async_saves(self, state, blocking: bool = False, terminate: bool = False) -> None:
        """Publish the async save in flight once every rank has written it (wait for it when `blocking`); with
        `terminate`, wait and stop the writer (the end of a run). Called on every rank at the same points."""
        if terminate:
            close_async_save(state)
        else:
            maybe_finalize_async_save(state, blocking)


def create_checkpoint_manager(checkpoint_config):
    """The run's checkpoint manager: `custom_manager_class`'s (a dotted path), else DefaultCheckpointManager. A path
    that does not import, or a class without the protocol's methods, is one line, before any model is built."""
    path = checkpoint_config.custom_manager_class
    if path is None:
        return DefaultCheckpointManager(checkpoint_config)
    module_name, _, class_name = path.rpartition(".")
    where = f"checkpoint.custom_manager_class {path}"
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except ImportError as e:
        raise config_lib.ConfigError(f"{where}: cannot import {module_name} ({e})") from None
    except AttributeError:
        raise config_lib.ConfigError(f"{where}: module {module_name} has no {class_name}") from None
    missing = [m for m in CHECKPOINT_MANAGER_METHODS if not callable(getattr(cls, m, None))]
    if missing:
        raise config_lib.ConfigError(f"{where}: the class has no {missing[0]}() (Bridge's CheckpointManager protocol: "
                                     f"{', '.join(CHECKPOINT_MANAGER_METHODS)})")
    return cls(checkpoint_config)


def experts_apart(settings: dict) -> bool:
    """Whether megatron-core gives the experts an optimizer of their own under these parallel sizes (a checkpoint's
    saved settings or this run's): their layers use the expert groups at EP > 1 or an expert-TP size other than TP
    (tensor_parallel/layers.py:961-964; an expert-TP size of None is TP's, Megatron-LM's default)."""
    tp = settings.get("tensor_model_parallel_size") or 1
    return (settings.get("expert_model_parallel_size") or 1) > 1 or (settings.get("expert_tensor_parallel_size") or tp) != tp


def common_file(directory: str) -> str:
    """Where a torch_dist checkpoint keeps its common state, for messages: common.pt (megatron-core <= 0.16, the
    form older checkpoints have), else the `common_state` object inside the torch_dist files (0.17 and later, what
    is written now: dist_checkpointing/serialization.py:439)."""
    legacy = os.path.join(directory, "common.pt")
    if os.path.isfile(legacy):
        return legacy
    dcp = not os.path.isfile(os.path.join(directory, "metadata.json"))  # fsdp_dtensor, torch_dcp: `args` at the top
    return os.path.join(directory, ".metadata") + (" (args)" if dcp else " (common_state)")


def _read_common(directory: str, saved_format: str) -> dict:
    """What the checkpoint keeps beside the tensors, read before any weight: torch_dist's common state (either
    form: megatron-core's `load_common_state_dict` reads both), or this rank's torch-format file (the whole of it:
    it is small next to the model)."""
    if saved_format == "torch":
        return _load(_mp_file(directory), "model and optimizer of this tensor/pipeline/expert rank")
    path = common_file(directory)
    if not os.path.isfile(os.path.join(directory, ".metadata")):
        raise CheckpointError(f"{os.path.join(directory, '.metadata')}: missing; the checkpoint is incomplete — load "
                              f"an older iteration with --ckpt-step")
    if not os.path.isfile(os.path.join(directory, "common.pt")) and not any(
            key.startswith("common_state") for key in _index(directory).state_dict_metadata):
        raise CheckpointError(f"{directory}: holds no common state (neither common.pt nor the common_state object); "
                              f"the checkpoint is incomplete — load an older iteration with --ckpt-step")
    _check_distcp_files(directory)  # the common state is in rank 0's file now: a damaged one is named, not an EOFError
    try:
        return dist_checkpointing.load_common_state_dict(directory)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot be read ({_first_line(e)}); the checkpoint is corrupt — load an older "
                              f"iteration with --ckpt-step") from None


def _run_config(directory: str) -> dict:
    """The saving run's run_config.yaml (ours or Bridge's), or {} (Megatron-LM writes none)."""
    import yaml

    try:
        with open(os.path.join(directory, "run_config.yaml")) as fh:
            saved = yaml.safe_load(fh)
    except (OSError, yaml.YAMLError):
        return {}
    return saved if isinstance(saved, dict) else {}


# What makes another model: every setting that changes a tensor's shape (or whether a tensor exists), under its
# Megatron-LM name (the checkpoint's `args`; Bridge's run_config.yaml shares the names it has), with this run's value.
# check_saved_model compares the ones the checkpoint names, before any weight loads.
SHAPE = {
    "num_layers": lambda cfg: cfg.model.num_layers,
    "hidden_size": lambda cfg: cfg.model.hidden_size,
    "ffn_hidden_size": lambda cfg: cfg.model.ffn_hidden_size,
    "num_attention_heads": lambda cfg: cfg.model.num_attention_heads,
    "num_query_groups": lambda cfg: cfg.model.num_query_groups,
    "kv_channels": lambda cfg: cfg.model.kv_channels,
    "padded_vocab_size": lambda cfg: getattr(cfg, "padded_vocab_size", None) or None,  # 0: not known (generate.py)
    "normalization": lambda cfg: cfg.model.normalization,
    "position_embedding_type": lambda cfg: cfg.model.position_embedding_type,
    "gated_linear_unit": lambda cfg: cfg.model.mlp_fields()["gated_linear_unit"],  # fc1 twice as tall
    "qk_layernorm": lambda cfg: cfg.model.qk_layernorm,
    "untie_embeddings_and_output_weights": lambda cfg: cfg.model.untie_embeddings_and_output_weights,
    "num_experts": lambda cfg: cfg.model.num_moe_experts or 0,  # 0: a dense model (Megatron-LM's None)
    "moe_ffn_hidden_size": lambda cfg: cfg.model.moe_ffn_hidden_size,
    "moe_shared_expert_intermediate_size": lambda cfg: cfg.model.moe_shared_expert_intermediate_size or 0,
}


def saved_shape(settings: dict, name: str):
    """A SHAPE setting as the saving run built it. The key/value groups are the one exception to reading it as
    saved: Megatron-LM keeps --num-query-groups in `args` (default 1) but builds them only with
    --group-query-attention (arguments.py:1348-1351), and Bridge's None means one group per head."""
    if name == "num_query_groups" and (settings.get("group_query_attention") is False
                                       or settings.get("num_query_groups") is None):
        return settings.get("num_attention_heads")
    if name in ("num_experts", "moe_shared_expert_intermediate_size"):  # None there: none (Bridge: num_moe_experts)
        key = "num_moe_experts" if name == "num_experts" and name not in settings else name
        return (settings.get(key) or 0) if key in settings else None
    if name == "gated_linear_unit" and name not in settings:  # Megatron-LM's `args` name its switches (ours, Bridge's: the field)
        switches = [settings[k] for k in ("swiglu", "quick_geglu") if k in settings]
        return any(switches) if switches else None
    if name == "padded_vocab_size":  # 0: not recorded (a merged or imported checkpoint names no tokenizer padding)
        return settings.get(name) or None
    return settings.get(name)


def _shape_flag(name: str) -> str:
    words = {"padded_vocab_size": "the padded vocabulary", "gated_linear_unit": "a gated MLP (--swiglu, --quick-geglu)"}
    return words.get(name, "--" + name.replace("_", "-"))


def saved_settings(directory: str, common: dict) -> tuple:
    """(settings, the file they come from) of the run that saved the checkpoint, under Megatron-LM's names:
    `args` (Megatron-LM's and ours, in the common state), else run_config.yaml's model section (Bridge's, which has no
    `args`), with its save_rng as Megatron-LM's no_save_rng."""
    args = common.get("args")
    if args is not None:
        return vars(args), common_file(directory) if os.path.isfile(os.path.join(directory, ".metadata")) \
            else _mp_file(directory)
    run_config = _run_config(directory)
    settings = dict(run_config.get("model", {}))
    settings["no_save_rng"] = not run_config.get("checkpoint", {}).get("save_rng", True)
    return settings, os.path.join(directory, "run_config.yaml")


def check_saved_model(cfg, directory: str, common: dict, settings: dict, where: str, finetune: bool) -> None:
    """Before any weight loads: the checkpoint is a version this code reads, of this model's shape."""
    torch_dist = os.path.isfile(os.path.join(directory, ".metadata"))
    path = common_file(directory) if torch_dist else _mp_file(directory)  # the torch format keeps it in each file
    version = common.get("checkpoint_version")
    if version is None and not finetune:
        raise CheckpointError(f"{path}: no checkpoint_version (written by an older train.py); load its weights "
                              f"with --finetune, or resume it with that version")
    if version is not None and version != CHECKPOINT_VERSION:
        raise CheckpointError(f"{path}: checkpoint_version {version} is not {CHECKPOINT_VERSION}, the one this code "
                              f"reads; convert it with Megatron-LM's tools/checkpoint/convert.py first")
    differ = [k for k, ours in SHAPE.items()
              if saved_shape(settings, k) is not None and ours(cfg) is not None and saved_shape(settings, k) != ours(cfg)]
    if differ:
        shapes = ", ".join(f"{_shape_flag(k)} {saved_shape(settings, k)} (this run: {SHAPE[k](cfg)})" for k in differ)
        vocab = (" (the padded vocabulary follows the tokenizer, --make-vocab-size-divisible-by and the tensor-parallel "
                 "size)" if "padded_vocab_size" in differ else "")
        raise CheckpointError(f"{where}: saved by another model shape: {shapes}; pass the checkpoint's settings{vocab}")


def progress_from(directory: str, common: dict) -> dict:
    """The run's progress: train_state.pt (ours and Bridge's), else the common state (Megatron-LM keeps it there: the
    iteration, the FLOPs, and the sample counters inside `args`)."""
    path = os.path.join(directory, "train_state.pt")
    if os.path.isfile(path) or "iteration" not in common:
        return _load(path, "training progress")
    args = common.get("args")
    return {"step": common["iteration"],
            "consumed_train_samples": getattr(args, "consumed_train_samples", 0),
            "skipped_train_samples": getattr(args, "skipped_train_samples", 0),
            "consumed_valid_samples": getattr(args, "consumed_valid_samples", 0),
            "floating_point_operations_so_far": common.get("num_floating_point_operations_so_far", 0)}


def check_optimizer_kind(cfg, directory: str, settings: dict, saved_format: str) -> None:
    """That the checkpoint's optimizer state is of a kind this run's optimizer loads; else one line that says
    which kinds met and how to continue (megatron-core's loaders raise from deep inside otherwise)."""
    m = cfg.model
    # megatron-core builds the experts an optimizer of their own (a ChainedOptimizer of two) when their layers use the
    # expert groups, EP > 1 or an expert-TP size other than TP (tensor_parallel/layers.py:961-964, optimizer/
    # __init__.py:817), and none otherwise; its loaders do not move the state between the two (optimizer.py:1578):
    # only the distributed optimizer's fully_reshardable state, kept by parameter name, is regrouped here (_regrouped).
    saved_split, split = experts_apart(settings), experts_apart(dict(
        expert_model_parallel_size=m.expert_model_parallel_size, tensor_model_parallel_size=m.tensor_model_parallel_size,
        expert_tensor_parallel_size=m.expert_tensor_parallel_size))
    crossing = m.num_moe_experts and saved_split != split
    if crossing and load_metadata(cfg, directory).get("distrib_optim_sharding_type") == "fully_reshardable":
        crossing = False  # each parameter's state kept whole, by name: load_optimizer_state regroups it
    if crossing:
        def sizes(d):
            tp = d.get("tensor_model_parallel_size") or 1
            return (f"EP {d.get('expert_model_parallel_size') or 1}, TP {tp}, expert TP "
                    f"{d.get('expert_tensor_parallel_size') or tp}")
        kinds = ("one optimizer for all parameters", "the experts' optimizer apart")
        raise CheckpointError(f"{directory}: its optimizer state was saved with {kinds[saved_split]} ({sizes(settings)}), "
                              f"which megatron-core cannot load into {kinds[split]} ({sizes(vars(m))}; apart at EP > 1 "
                              f"or expert TP != TP); add --no-load-optim to continue its weights with a fresh optimizer")
    # megatron-core's layer-wise distributed optimizer keeps each rank's whole matrices for the data-parallel size
    # that saved them ("for fixed DP usage only", optimizer/layer_wise_optimizer.py:930-931) under keys no other
    # optimizer has: a KeyError from inside the load, otherwise.
    saved_lw, lw = bool(settings.get("use_layer_wise_distributed_optimizer")), layer_wise(cfg)
    saved_dp = settings.get("data_parallel_size")
    if (saved_lw or lw) and (saved_lw != lw or saved_dp != cfg.data_parallel_size):
        kind = lambda layered: "megatron-core's layer-wise distributed optimizer" if layered else "another optimizer"
        raise CheckpointError(f"{directory}: its optimizer state was saved by {kind(saved_lw)} at data-parallel size "
                              f"{saved_dp}, and this run has {kind(lw)} at {cfg.data_parallel_size}: the layer-wise "
                              f"state loads only where it was saved; add --no-load-optim to continue its weights with a "
                              f"fresh optimizer")
    # megatron-core's plain and distributed optimizers keep their torch_dist state under other keys: neither reads
    # the other's (a KeyError from inside the load, which said nothing of the cause)
    saved_dopt, dopt = settings.get("use_distributed_optimizer"), cfg.optimizer.use_distributed_optimizer and not lw
    if saved_format == "torch_dist" and saved_dopt is not None and bool(saved_dopt) != dopt:
        kind = lambda distributed: "megatron-core's distributed optimizer" if distributed else "the plain optimizer"
        same = "add --use-distributed-optimizer" if saved_dopt else "drop --use-distributed-optimizer"
        raise CheckpointError(f"{directory}: its optimizer state was saved by {kind(saved_dopt)}, which megatron-core "
                              f"cannot load into {kind(dopt)}; {same} to resume it, or add --no-load-optim to continue "
                              f"its weights with a fresh optimizer")


def format_on_disk(directory: str) -> tuple:
    """(the format a checkpoint directory was saved in, torch.distributed.checkpoint's common state or None)."""
    if os.path.isfile(os.path.join(directory, "metadata.json")):  # megatron-core's dist_checkpointing
        return "torch_dist", None
    if _is_torch_dist(directory) and os.path.isfile(os.path.join(directory, ".metadata")):
        common = _dcp_common(directory)  # no metadata.json, no mp_rank_*: torch.distributed.checkpoint's own
        return dcp_format(directory, common), common
    return "torch", None


def bare_model_weights(cfg) -> Optional[str]:
    """The checkpoint whose weights go into the model before DDP or FSDP wraps it, or None. A PEFT run's base weights
    (the adapters, the wrapper and the optimizer then see only the adapters). An FSDP run's --pretrained-checkpoint
    in a format its own load does not read (a DDP run's torch_dist under Megatron FSDP, hf.py import's): read as one
    process reads it, then sharded by the wrap. Not when --load resumes the run."""
    ck = cfg.checkpoint
    if cfg.peft.peft != "none":
        return ck.pretrained_checkpoint
    fsdp = cfg.ddp.use_megatron_fsdp or cfg.dist.use_torch_fsdp2
    if not (fsdp and ck.pretrained_checkpoint) or (ck.load and resolve_load_dir(ck.load, ck.ckpt_step)):
        return None
    directory = resolve_load_dir(ck.pretrained_checkpoint)
    return ck.pretrained_checkpoint if directory and format_on_disk(directory)[0] != ck.ckpt_format else None


def saved_format_of(cfg, directory: str, model, finetune: bool) -> tuple:
    """(the checkpoint's format, torch.distributed.checkpoint's common state or None), once it is one this run reads;
    else one line that says how to read it."""
    ck = cfg.checkpoint
    saved_format, dcp_common = format_on_disk(directory)
    sharded_model = fsdp_kind(model)
    if saved_format in DCP_FORMATS and not sharded_model and not finetune:
        raise CheckpointError(f"{directory}: saved in {saved_format} format, which resumes under "
                              f"{DCP_FLAG[saved_format]}; add it, or read only its weights with --pretrained-checkpoint")
    bare_fsdp = finetune and not sharded_model and (cfg.ddp.use_megatron_fsdp or cfg.dist.use_torch_fsdp2)
    if saved_format != ck.ckpt_format and (sharded_model or saved_format not in DCP_FORMATS) and not bare_fsdp:
        fix = (f"pass --ckpt-format {saved_format}" if not sharded_model and saved_format not in DCP_FORMATS else
               f"{sharded_model} reads {ck.ckpt_format}: start from its weights with --pretrained-checkpoint"
               if saved_format not in DCP_FORMATS else
               f"it resumes under {DCP_FLAG[saved_format]}")
        raise CheckpointError(f"{directory}: saved in {saved_format} format but this run uses --ckpt-format "
                              f"{ck.ckpt_format}; {fix}")
    return saved_format, dcp_common


def rng_loads(cfg, directory: str, settings: dict, saved_format: str) -> bool:
    """Whether the checkpoint's random states fit this run (saved, and at its TP and PP); else it says why they
    start afresh from --seed."""
    m = cfg.model
    saved_layout = (saved_format == "torch_dist" and saved_rng_layout(directory)) or rng_layout(settings)
    ours = rng_layout(dict(tensor_model_parallel_size=m.tensor_model_parallel_size,
                           pipeline_model_parallel_size=m.pipeline_model_parallel_size))
    if saved_layout != ours:
        # (so too the per-data-parallel-rank states of megatron-core <= 0.16 and Bridge under expert parallelism)
        print_rank_0(f" {directory} was saved with (TP, PP{', DP x CP' if len(saved_layout) > 2 else ''}) = "
                     f"{saved_layout}: random states start afresh from --seed")
        return False
    if settings.get("no_save_rng", False):
        print_rank_0(f" {directory} was saved without random states (--no-save-rng): they start afresh from --seed")
        return False
    return True


def _load_checkpoint(state, model, optimizer, scheduler, path, finetune):

    cfg, ts = state.cfg, state.train_state
    ck = cfg.checkpoint
    directory = resolve_load_dir(path, None if finetune else ck.ckpt_step)
    if directory is None:
        if finetune:
            raise CheckpointError(f"--pretrained-checkpoint {path}: no {TRACKER} and not an iter_* directory")
        print_rank_0(f" no checkpoint to resume in {path} (no {TRACKER}): training from scratch")
        return False
    saved_format, dcp_common = saved_format_of(cfg, directory, model, finetune)
    sharded_model = fsdp_kind(model)
    if saved_format == "torch" and not os.path.isfile(_mp_file(directory)):  # saved at other sizes? another rank's says
        first = min(n for n in os.listdir(directory) if n.startswith("mp_rank_"))
        other = _load(os.path.join(directory, first, "model_optim_rng.pt"), "a rank's model and optimizer")
        check_torch_layout(cfg, directory, vars(other.get("args", argparse.Namespace())))
    common = dcp_common if dcp_common is not None else _read_common(directory, saved_format)
    settings, where = saved_settings(directory, common)
    if saved_format == "torch":
        check_torch_layout(cfg, directory, settings)
    check_tokenizer(getattr(state, "tokenizer", None), directory, common)  # first: another tokenizer pads another vocabulary
    check_saved_model(cfg, directory, common, settings, where, finetune)
    # --no-load-optim skips the optimizer and its schedule, --finetune everything but the weights.
    load_optim = ck.load_optim and not finetune and optimizer is not None
    load_rng = ck.load_rng and not finetune
    load_rng = load_rng and rng_loads(cfg, directory, settings, saved_format)
    m = cfg.model
    if load_optim:
        check_optimizer_kind(cfg, directory, settings, saved_format)
    peft_run = cfg.peft.peft != "none" and not finetune  # a PEFT run's own checkpoint: adapters only
    if saved_format in DCP_FORMATS and not sharded_model:
        _read_dcp_weights(directory, saved_format, model)
        payload = common
    elif saved_format in DCP_FORMATS:  # the weights and the optimizer, read in place
        payload = _load_dcp(cfg, directory, model, optimizer, scheduler, common, load_optim, load_rng)
    elif saved_format == "torch_dist":
        payload = _load_sharded(cfg, directory, model, optimizer, scheduler, peft_run, load_optim, load_rng)
    else:
        payload = common
    if saved_format not in DCP_FORMATS:
        _load_weights(model, payload, directory, partial=saved_format == "torch_dist" and peft_run)
    if load_optim and saved_format in DCP_FORMATS:
        scheduler_state(scheduler, payload, directory)
    elif load_optim:
        if "optimizer" not in payload:
            raise CheckpointError(f"{directory}: saved without optimizer state (--no-save-optim); add --no-load-optim")
        _restore_step_zero(payload["optimizer"])
        with torch.no_grad():  # copied in place into fp32 main parameters, leaves that require grad
            load_optimizer_state(optimizer, payload["optimizer"])
        _as_fsdp2_state(optimizer)
        scheduler_state(scheduler, payload, directory)
    elif optimizer is not None and (m.fp16 or m.bf16) and not _megatron_fsdp(model):
        # fp16/bf16: the fp32 main copies take the loaded weights, as Megatron-LM's checkpointing.py:2611-2616 (Megatron
        # FSDP has no such update: it raises NotImplementedError, and its load wrote its main weights in place)
        optimizer.reload_model_params()
    if not finetune:
        ts.load_state_dict(progress_from(directory, common))
        if load_rng:
            if "rng_state" not in payload:
                raise CheckpointError(f"{directory}: holds no random states (rng_state); pass --no-load-rng to start "
                                      f"them afresh from --seed")
            set_rng_state(payload["rng_state"][0])
    name = os.path.basename(os.path.normpath(directory))
    trained = f", trained for {int(name[5:])} iterations" if name.startswith("iter_") and name[5:].isdigit() else ""
    print_rank_0(f" loaded checkpoint {directory} at iteration {ts.step}" + (f" (weights only){trained}" if finetune else ""))
    return True


def scheduler_state(scheduler, payload: dict, directory: str) -> None:
    if "opt_param_scheduler" in payload:
        try:
            scheduler.load_state_dict(payload["opt_param_scheduler"])
        except AssertionError as e:  # megatron-core asserts that the flags' schedule matches the saved one
            raise CheckpointError(f"{directory}: {e}; pass --override-opt-param-scheduler to follow the flags, or "
                                  f"--use-checkpoint-opt-param-scheduler to keep the saved schedule") from None


def _load_sharded(cfg, directory, model, optimizer, scheduler, peft_run, load_optim, load_rng) -> dict:
    """The torch_dist checkpoint's tensors and objects that this run reads, in any TP/PP/DP layout."""
    sharded = model_sharded_state_dict(model, adapters_only=peft_run)
    if load_optim:
        # In the layout it was saved in (its content metadata), whatever this run would save.
        metadata = load_metadata(cfg, directory)
        _create_optimizer_state(optimizer)
        with fsdp2_params_found():
            sharded["optimizer"] = optimizer.sharded_state_dict(dict(sharded), is_loading=True, metadata=metadata)
        sharded["opt_param_scheduler"] = scheduler.state_dict()
    if load_rng:
        sharded["rng_state"] = sharded_rng_state()
    _check_distcp_files(directory)
    try:
        return dist_checkpointing.load(sharded, directory)
    except (Exception, CheckpointException) as e:  # torch wraps each rank's failure in a BaseException
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        why = next((line for line in reversed(lines) if "mismatch" in line or "Missing" in line), None)
        if why is None:  # not a shape or key problem: a file megatron-core could not read
            raise CheckpointError(f"{directory}: cannot be read ({lines[-1][:200] if lines else type(e).__name__}); "
                                  f"the checkpoint is corrupt — load an older iteration with --ckpt-step") from None
        if "rng_state" in why:
            raise CheckpointError(f"{directory}: holds no random states (rng_state); pass --no-load-rng to start them "
                                  f"afresh from --seed") from None
        raise CheckpointError(f"{directory}: weights do not fit this model ({why[:300]}); check --num-layers/"
                              f"--hidden-size/... against the checkpoint's run_config.yaml or args") from None


def _load_weights(model, payload, directory, partial: bool) -> None:
    if fsdp_kind(model) == "--use-torch-fsdp2":  # read in place into its DTensors' local shards (the wrapper's no-op)
        return
    try:
        for chunk, key in zip(model, _model_keys(model, lambda chunk: None)):  # "model", or "model0", "model1", ...
            if partial:
                missing = unwrap_model(chunk).load_state_dict(payload[key], strict=False).missing_keys
                if any(".adapter." in name for name in missing):
                    raise RuntimeError(f"adapters missing from the checkpoint:\n{missing[0]}")
            else:
                unwrap_model(chunk).load_state_dict(payload[key], strict=True)
    except RuntimeError as e:
        first = [line.strip() for line in str(e).splitlines() if line.strip()][1:2]
        raise CheckpointError(f"{directory}: weights do not fit this model ({first[0] if first else e}); "
                              f"check --num-layers/--hidden-size/... against the checkpoint's run_config.yaml") from None
