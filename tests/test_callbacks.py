"""What train() runs after each step (post_training_step_callbacks): manual garbage collection, the PyTorch
profiler, NVTX ranges and the CUDA memory history (GPU), and the straggler report."""

import gc
import glob
import json
import os
import pickle
import re

import pytest
import torch

import config
import checks
from conftest import TINY, config_error, torchrun

STRAGGLER_LINE = re.compile(r"^ \[[\d :-]+\] \| MnRtt/Rnk: ([\d.]+)ms/(\d+) \| MxRtt/Rnk: ([\d.]+)ms/(\d+) \| "
                            r"MnEtpt/Rnk: [\d.]+TF/\d+ \| MxEtpt/Rnk: [\d.]+TF/\d+ \|$", re.M)


def _cfg(tmp_path, *extra, gpu=False):
    return checks.parse_args([*TINY, "--mock-data", "--num-workers", "0", "--data-cache-path", str(tmp_path / "cache"),
                              *extra], world_size=1, gpu=gpu)


# --- manual garbage collection -------------------------------------------------------------------------------


def test_manual_gc_turns_the_collector_off_and_collects_at_the_interval_and_around_eval(tmp_path, capsys):
    """Every collection the interpreter runs is seen through gc.callbacks, with the iteration it happened at."""
    import train

    live = {}
    collections = []  # (iteration, generation, automatic collector on?) of each collection
    during_steps = []  # (automatic collector on?, objects allocated since the last collection) at each training forward

    def on_gc(phase, info):
        if phase == "start":
            step = live["state"].train_state.step if "state" in live else 0
            collections.append((step, info["generation"], gc.isenabled()))

    def forward_step(state, data_iterator, model):
        live["state"] = state
        if torch.is_grad_enabled():
            during_steps.append((gc.isenabled(), gc.get_count()[0]))
            for _ in range(400):  # garbage only a collection frees (reference cycles), as real code leaves behind
                cycle = []
                cycle.append(cycle)
        return train.forward_step(state, data_iterator, model)

    gc.callbacks.append(on_gc)
    try:
        train.pretrain(_cfg(tmp_path, "--manual-gc", "--manual-gc-interval", "3", "--train-iters", "8",
                            "--eval-interval", "4", "--eval-iters", "1", "--log-interval", "4"), forward_step)
    finally:
        gc.callbacks.remove(on_gc)
    assert gc.isenabled()  # given back after training
    assert during_steps and not any(enabled for enabled, _ in during_steps)
    # Uncollected objects pile up past the threshold at which the automatic collector would have run: it was off.
    assert max(count for _, count in during_steps) > gc.get_threshold()[0]
    manual = [(step, generation) for step, generation, enabled in collections if not enabled]
    # A full collection at the start, every 3 iterations, and before each evaluation; a young one after it.
    assert manual == [(0, 2), (3, 2), (4, 2), (4, 0), (6, 2), (8, 2), (8, 0)]


def test_no_manual_gc_eval_collects_at_the_interval_only(tmp_path, capsys):
    import train

    collections = []

    def on_gc(phase, info):
        if phase == "start" and not gc.isenabled():
            collections.append(info["generation"])

    gc.callbacks.append(on_gc)
    try:
        state = train.pretrain(_cfg(tmp_path, "--manual-gc", "--manual-gc-interval", "2", "--no-manual-gc-eval",
                                    "--train-iters", "4", "--eval-interval", "2", "--eval-iters", "1"))
    finally:
        gc.callbacks.remove(on_gc)
    assert state.train_state.step == 4 and collections == [2, 2, 2]  # at the start, at 2 and at 4; none at eval


# --- the PyTorch profiler and the straggler report: one 2-rank run, rank 1 made slow ---------------------------


@pytest.fixture(scope="module")
def slow_rank_run(tmp_path_factory):
    """2 ranks; rank 1's forward step sleeps 0.2 s per microbatch; the profiler watches rank 1 only."""
    out = tmp_path_factory.mktemp("slow_rank")
    proc = torchrun([*TINY, "--mock-data", "--train-iters", "10", "--global-batch-size", "8", "--log-interval", "5",
                     "--eval-iters", "0", "--num-workers", "0", "--data-cache-path", str(out / "cache"),
                     "--log-straggler", "--profile", "--use-pytorch-profiler", "--profile-step-start", "2",
                     "--profile-step-end", "4", "--profile-ranks", "1", "--tensorboard-dir", str(out / "tb")],
                    script="tests/scripts/slow_rank.py")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return dict(dir=out, stdout=proc.stdout)


@pytest.mark.full  # the slow rank's job (the fixture) is a fresh two-rank run
def test_straggler_report_names_the_slow_rank(slow_rank_run):
    """A timing, with its margin: rank 1 sleeps 0.4 s an iteration (2 microbatches), 2 s over a 5-iteration report,
    about 8 times a step of this model; both ranks run the same work on the same machine, so for rank 0 to report
    slower another job would have to take 2 s more of its CPU than of rank 1's within those 5 iterations."""
    reports = STRAGGLER_LINE.findall(slow_rank_run["stdout"])
    assert len(reports) == 2  # every --log-interval, printed once (by rank 0)
    for fastest_ms, fastest, slowest_ms, slowest in reports:
        assert (fastest, slowest) == ("0", "1") and float(slowest_ms) > float(fastest_ms)


@pytest.mark.full  # the same job as the straggler report's
def test_pytorch_profiler_traces_the_profiled_rank_and_steps(slow_rank_run):
    traces = glob.glob(str(slow_rank_run["dir"] / "tb" / "*.pt.trace.json"))
    assert [os.path.basename(t).split(".")[0] for t in traces] == ["rank1"]  # --profile-ranks 1: no trace for rank 0
    with open(traces[0]) as f:
        trace = json.load(f)
    assert trace["distributedInfo"]["rank"] == 1
    events = trace["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3"}  # iterations 2 and 3: start .. end - 1
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    assert any(e["name"] == "aten::mm" or e["name"] == "aten::addmm" for e in ops)
    assert any(e["name"] == "gloo:all_reduce" for e in events)  # the data-parallel gradient all-reduce


def test_straggler_report_lists_the_slowest_and_fastest_ranks():
    from metrics import straggler_report

    lines = straggler_report([5.0, 40.0, 7.0, 30.0], flops_per_iteration=1.2e12, minmax_count=2)
    (fastest_ms, fastest, slowest_ms, slowest), = STRAGGLER_LINE.findall(lines[0])
    assert (fastest_ms, fastest, slowest_ms, slowest) == ("5.00", "0", "40.00", "1")
    # 1.2 TFLOP per iteration, a third of it forward, over 4 ranks: 0.1 TFLOP per rank in 5 ms = 20 TFLOP/s.
    assert "MxEtpt/Rnk: 20.00TF/0" in lines[0] and "MnEtpt/Rnk: 2.50TF/1" in lines[0]
    assert lines[1].endswith("Slowest 2 ranks, forward ms/rank: 40.00/1, 30.00/3")
    assert lines[2].endswith("Fastest 2 ranks, forward ms/rank: 5.00/0, 7.00/2")


# --- settings that cannot work are refused at parse time --------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--profile"], "--profile alone profiles with Nsight Systems, which needs a GPU"),
    (["--nvtx-ranges"], "--nvtx-ranges marks ranges for Nsight Systems, which needs a GPU"),
    (["--record-memory-history"], "--record-memory-history records the CUDA allocator, which needs a GPU"),
    (["--use-pytorch-profiler", "--no-tensorboard"], "drop --no-tensorboard or give --tensorboard-dir DIR"),
    (["--use-pytorch-profiler", "--tensorboard-dir", "tb", "--profile-step-start", "5", "--profile-step-end", "5"],
     "need 0 <= start < end"),
    (["--use-pytorch-profiler", "--tensorboard-dir", "tb", "--profile-ranks", "2"], "no such rank in a world of 1"),
    (["--log-straggler", "--straggler-minmax-count", "0"], "--straggler-minmax-count must be at least 1"),
    (["--manual-gc", "--manual-gc-interval", "-1"], "--manual-gc-interval must be non-negative"),
])
def test_impossible_settings_are_one_line(argv, message, capsys):
    err = config_error(argv, capsys)
    assert message in err, err


# --- GPU: NVTX ranges, Nsight Systems capture, CUDA memory history -----------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: NVTX ranges, cudaProfilerStart/Stop and the CUDA allocator history are CUDA's")
def test_nvtx_ranges_nsys_capture_and_memory_history_on_gpu(tmp_path, capsys):
    import megatron.core.utils as mcore_utils

    import train

    open_ranges = []

    def forward_step(state, data_iterator, model):
        if torch.is_grad_enabled():
            open_ranges.append(list(mcore_utils._nvtx_range_messages))  # megatron-core's own stack of open ranges
        return train.forward_step(state, data_iterator, model)

    cfg = _cfg(tmp_path, "--train-iters", "4", "--eval-iters", "0", "--log-interval", "2", "--nvtx-ranges", "--profile",
               "--profile-step-start", "1", "--profile-step-end", "3", "--record-memory-history",
               "--memory-snapshot-path", str(tmp_path / "snapshot.pickle"), "--log-straggler", gpu=True)
    state = train.pretrain(cfg, forward_step)
    assert state.train_state.step == 4
    assert open_ranges and all(stack[-1:] == ["forward-backward"] for stack in open_ranges)
    assert not mcore_utils._nvtx_enabled and not mcore_utils._nvtx_range_messages  # balanced, and switched off after
    with open(tmp_path / "snapshot_0.pickle", "rb") as f:
        snapshot = pickle.load(f)
    assert snapshot["segments"] and any(snapshot["device_traces"])
    assert len(STRAGGLER_LINE.findall(capsys.readouterr().out)) == 2
