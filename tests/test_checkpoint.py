"""checkpoint.py and the exit decisions: resume, resharding, pruning, signals, kill -9 mid-save, bad checkpoints."""

import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

import checkpoint
from megatron.core import dist_checkpointing
import config
import checks
from conftest import ROOT, TINY, checkpoint_keys, config_error, free_port, log_lines, torchrun


def _cfg(tmp_path, *extra, world_size=1):
    return checks.parse_args([*TINY, "--mock-data", "--num-workers", "0", "--eval-iters", "0",
                              "--data-cache-path", str(tmp_path / "cache"), *extra], world_size=world_size, gpu=False)


def _copy_ckpt(mock_run, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(mock_run["dir"] / "ckpt", dst)
    return dst


# --- data-parallel resharding ------------------------------------------------------------------------------


def test_sampler_splits_each_global_batch_over_data_parallel_ranks():
    from data import MegatronPretrainingSampler

    def step_samples(dp, consumed, gbs=8, mbs=2):
        per_rank = [iter(MegatronPretrainingSampler(1000, consumed, mbs, r, dp)) for r in range(dp)]
        return sorted(i for it in per_rank for _ in range(gbs // (mbs * dp)) for i in next(it))

    # The next global batch after 240 consumed samples is 240..247, however many DP ranks read it.
    assert step_samples(dp=2, consumed=240) == step_samples(dp=1, consumed=240) == list(range(240, 248))


@pytest.mark.full  # the fast command: SIGTERM to the job, kill -9 mid-save
def test_resume_on_fewer_data_parallel_ranks_reads_the_next_samples(mock_run, tmp_path):
    """Saved by 2 ranks at iteration 30 (240 samples); resumed by 1 rank: the same next samples, in order."""
    import data
    import train

    ckpt = _copy_ckpt(mock_run, tmp_path)
    seen = []

    def recording_forward_step(state, data_iterator, model):
        batch = next(data_iterator)
        seen.append(batch["tokens"].clone())
        return train.forward_step(state, iter([batch]), model)

    cfg = _cfg(tmp_path, "--train-iters", "32", "--global-batch-size", "8", "--load", str(ckpt), "--log-interval", "1",
               "--override-opt-param-scheduler")
    state = train.pretrain(cfg, recording_forward_step)
    assert state.train_state.step == 32 and state.train_state.consumed_train_samples == 256
    assert len(seen) == 8  # 2 steps x 4 microbatches of 2 on one rank

    # The samples megatron-core's dataset holds at indices 240..255 are exactly what was read.
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        train_ds = data.build_datasets(_cfg(tmp_path, "--train-iters", "32", "--global-batch-size", "8"),
                                       data.build_tokenizer(cfg))[0]
    finally:
        torch.distributed.destroy_process_group()
    expected = torch.stack([torch.as_tensor(train_ds[i]["tokens"]) for i in range(240, 256)])
    assert torch.equal(torch.cat(seen), expected)


# --- pruning, skipping, finetuning --------------------------------------------------------------------------


def test_most_recent_k_keeps_the_newest_and_synchronous_saves_start_no_process(tmp_path, capsys):
    """Five synchronous torch_dist saves, the newest two kept. Their writer reported through a queue of this process
    (checkpoint._write_results_queue): no Manager process was started, as megatron-core's own writer starts one."""
    import multiprocessing
    import queue

    import train
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    before, own_queue = set(multiprocessing.active_children()), filesystem_async._results_queue
    seen = []
    write = checkpoint.save_checkpoint

    def save_checkpoint(*args, **kwargs):  # the queue the writer reports through, as the save leaves it set
        directory = write(*args, **kwargs)
        seen.append(filesystem_async._results_queue)
        return directory

    checkpoint.save_checkpoint = save_checkpoint
    try:
        train.pretrain(_cfg(tmp_path, "--train-iters", "5", "--save", str(tmp_path / "ck"), "--save-interval", "1",
                            "--most-recent-k", "2"))
    finally:
        checkpoint.save_checkpoint = write
    assert sorted(os.listdir(tmp_path / "ck")) == ["iter_0000004", "iter_0000005", "latest_checkpointed_iteration.txt",
                                                   "latest_train_state.pt", "progress.txt"]
    assert set(multiprocessing.active_children()) <= before
    assert len(seen) == 5 and all(type(q) is queue.Queue for q in seen)
    assert filesystem_async._results_queue is own_queue  # megatron-core's own, given back when the run ended


def test_iterations_to_skip_consume_their_data(tmp_path, capsys):
    import train

    firsts = []

    def forward_step(state, data_iterator, model):
        batch = next(data_iterator)
        firsts.append((state.train_state.step, batch["tokens"][0, 0].item()))
        return train.forward_step(state, iter([batch]), model)

    state = train.pretrain(_cfg(tmp_path, "--train-iters", "4", "--iterations-to-skip", "2", "--log-interval", "1"),
                           forward_step)
    out = capsys.readouterr().out
    assert "skipped iteration 2 as asked" in out
    assert [s for s, _ in firsts] == [0, 2, 3]  # no forward pass at the step that makes iteration 2
    assert state.train_state.consumed_train_samples == 8 and state.train_state.skipped_train_samples == 2
    assert [l[0] for l in log_lines(out)] == [1, 3, 4]
    assert "consumed samples:            2 | elapsed" in out  # iteration 1: nothing skipped yet, no field
    assert "consumed samples:            6 | skipped samples:            2 | elapsed" in out  # as Megatron-LM prints it


def test_finetune_loads_weights_only_and_starts_at_zero(mock_run, tmp_path, capsys):
    import train

    ckpt = _copy_ckpt(mock_run, tmp_path)
    state = train.finetune(_cfg(tmp_path, "--train-iters", "2", "--global-batch-size", "8", "--log-interval", "1",
                                "--pretrained-checkpoint", str(ckpt)))
    out = capsys.readouterr().out
    assert "iter_0000030 at iteration 0 (weights only)" in out and state.train_state.step == 2
    lines = log_lines(out)
    assert [l[1] for l in lines] == [8, 16]
    assert lines[0][3] < log_lines(mock_run["stdout"])[0][3]  # starts from trained weights


@pytest.mark.parametrize("flag", [None, "--no-load-optim", "--no-load-rng", "--finetune"])
def test_load_flags_mean_what_they_mean_in_megatron_lm(mock_run, tmp_path, flag):
    """Megatron-LM's load_checkpoint: --no-load-optim keeps the weights and progress and starts the optimizer and
    its schedule afresh; --no-load-rng starts the random streams from --seed; --finetune keeps only the weights."""
    import random

    import train

    ckpt = _copy_ckpt(mock_run, tmp_path)
    flags = ["--train-iters", "40", "--global-batch-size", "8", "--use-checkpoint-opt-param-scheduler"]
    state = train.setup(_cfg(tmp_path, *flags))[0]  # no checkpoint: the random streams --seed gives
    fresh = (random.random(), torch.rand(1))
    train._finish_train(state)
    state, model, optimizer, scheduler, _ = train.setup(_cfg(tmp_path, *flags, "--load", str(ckpt), *([flag] if flag else [])))
    try:
        saved = dist_checkpointing.load_common_state_dict(str(ckpt / "iter_0000030"))
        adam = optimizer.optimizer.state
        assert state.train_state.step == (0 if flag == "--finetune" else 30)
        assert state.train_state.consumed_train_samples == (0 if flag == "--finetune" else 240)
        assert scheduler.num_steps == (0 if flag in ("--finetune", "--no-load-optim") else saved["opt_param_scheduler"]["num_steps"])
        assert bool(adam) == (flag not in ("--finetune", "--no-load-optim"))  # Adam's moments: loaded or none yet
        # The python and torch generators: the checkpoint's states, or --seed's.
        now = (random.random(), torch.rand(1))
        assert (now[0] == fresh[0] and torch.equal(now[1], fresh[1])) == (flag in ("--finetune", "--no-load-rng"))
    finally:
        train._finish_train(state)


def test_finetune_without_weights_is_refused(tmp_path):
    import train

    with pytest.raises(config.ConfigError, match="needs --pretrained-checkpoint"):
        train.finetune(_cfg(tmp_path))


# --- bad checkpoints: a clear error naming the path, on every rank, no hang ------------------------------------


def _rewrite_common(directory, **changes):
    """The common state with some keys changed (None: removed), as another program could have written it: in a
    common.pt beside the tensors, the form megatron-core <= 0.16 wrote and every later one reads first."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(directory))
    for key, value in changes.items():
        common.pop(key) if value is None else common.__setitem__(key, value)
    torch.save(common, directory / "common.pt")


def _drop_from_index(directory, prefix: str) -> None:
    """The objects whose names start with `prefix` taken out of a torch_dist index (.metadata), as a program that
    did not write them would have left it."""
    import pickle

    with open(directory / ".metadata", "rb") as fh:
        index = pickle.load(fh)
    index.state_dict_metadata = {k: v for k, v in index.state_dict_metadata.items() if not k.startswith(prefix)}
    index.storage_data = {k: v for k, v in index.storage_data.items() if not k.fqn.startswith(prefix)}
    with open(directory / ".metadata", "wb") as fh:
        pickle.dump(index, fh)


@pytest.mark.parametrize("damage, flags, message", [
    ("tracker", [], "names iteration 30 but"),
    ("tracker_text", [], "expected an iteration number"),
    ("empty_train_state", [], r"train_state.pt: cannot be read \(EOFError\)"),
    ("empty_model", [], r"__0_0.distcp: empty; the checkpoint is damaged"),
    ("truncated_model", [], r"__0_0.distcp: truncated \(\d+ of \d+ bytes\)"),
    ("missing_model", [], r"__0_0.distcp: missing"),
    ("missing_common", [], r"holds no common state \(neither common.pt nor the common_state object\); the "
                           r"checkpoint is incomplete"),
    ("old_version", [], r"common.pt: checkpoint_version 2.0 is not 3.0, .*convert"),
    ("no_version", [], r"common.pt: no checkpoint_version .*--finetune"),
    ("no_rng", [], r"holds no random states \(rng_state\); pass --no-load-rng"),
    ("corrupt_tokenizer", [], r"tokenizer/identity.json: cannot be read"),
    ("none", ["--tokenizer-type", "NullTokenizer", "--vocab-size", "300"],
     r"identity.json: the weights were trained with tokenizer .*ByteTokenizer.* pass the checkpoint's tokenizer flags"),
    ("none", ["--hidden-size", "128"], r"\.metadata \(common_state\): saved by another model shape: --hidden-size 64 "
                                       r"\(this run: 128\)"),
    # every setting that changes a tensor's shape, from one list (checkpoint.SHAPE)
    ("none", ["--num-query-groups", "2"], r"saved by another model shape: --num-query-groups 4 \(this run: 2\);"),
    ("none", ["--kv-channels", "8"], r"saved by another model shape: --kv-channels 16 \(this run: 8\);"),
    # resumed under Megatron FSDP (its weights start one with --pretrained-checkpoint: tests/test_fsdp.py)
    ("none", ["--use-megatron-fsdp"], r"saved in torch_dist format but this run uses --ckpt-format fsdp_dtensor; "
                                      r"--use-megatron-fsdp reads fsdp_dtensor: start from its weights with "
                                      r"--pretrained-checkpoint$"),
    ("none", ["--quick-geglu"], r"saved by another model shape: a gated MLP \(--swiglu, --quick-geglu\) False \(this run: True\)"),
    ("none", ["--normalization", "RMSNorm"], r"--normalization LayerNorm \(this run: RMSNorm\)"),
    ("none", ["--position-embedding-type", "rope"], r"--position-embedding-type learned_absolute \(this run: rope\)"),
    ("none", ["--make-vocab-size-divisible-by", "256"],
     r"the padded vocabulary 384 \(this run: 512\); .*--make-vocab-size-divisible-by"),
    ("none", ["--ckpt-step", "20"], "--ckpt-step 20:"),
    # a save that never published (its tracker still names 15) is not read as complete when named directly
    ("unpublished", ["--ckpt-step", "30"], r"--ckpt-step 30: the save of iteration 30 did not finish \(.*iter_0000030 has "
                                           r"no train_state.pt\); the newest published is iteration 15 \(--ckpt-step 15\)"),
    ("no_index", ["--ckpt-step", "30"], r"the save of iteration 30 did not finish \(.*iter_0000030 has no \.metadata\)"),
    ("no_index", [], r"iter_0000030: no \.metadata \(torch_dist's index of the tensors\); the checkpoint is damaged"),
    ("none", ["--train-iters", "40"], "pass --override-opt-param-scheduler"),
    # intact, and --no-load-optim reads it: not "corrupt" (a KeyError from inside megatron-core's load)
    ("none", ["--use-distributed-optimizer"], r"its optimizer state was saved by the plain optimizer, which megatron-core "
                                              r"cannot load into megatron-core's distributed optimizer; drop "
                                              r"--use-distributed-optimizer to resume it, or add --no-load-optim"),
])
def test_bad_checkpoints_give_clear_errors(mock_run, tmp_path, damage, flags, message):
    """Each is one line naming the file and the way out; the version, shape and tokenizer before any weight loads."""
    import train

    ckpt = _copy_ckpt(mock_run, tmp_path)
    it = ckpt / "iter_0000030"
    if damage == "tracker":
        shutil.rmtree(it)
    elif damage == "tracker_text":
        (ckpt / "latest_checkpointed_iteration.txt").write_text("thirty")
    elif damage == "empty_train_state":
        (it / "train_state.pt").write_bytes(b"")
    elif damage == "empty_model":
        (it / "__0_0.distcp").write_bytes(b"")
    elif damage == "truncated_model":
        target = it / "__0_0.distcp"
        target.write_bytes(target.read_bytes()[:-100])
    elif damage == "missing_model":
        os.remove(it / "__0_0.distcp")
    elif damage == "missing_common":  # neither common.pt (<= 0.16) nor the common_state object (0.17 on)
        _drop_from_index(it, "common_state")
    elif damage == "old_version":
        _rewrite_common(it, checkpoint_version=2.0)
    elif damage == "no_version":
        _rewrite_common(it, checkpoint_version=None)
    elif damage == "no_rng":  # the rng_state object taken out of the index: a program that did not write it
        _drop_from_index(it, "rng_state")
    elif damage == "corrupt_tokenizer":
        (it / "tokenizer" / "identity.json").write_text("{")
    elif damage == "unpublished":  # the tensors of 30 written, its publish step (train_state.pt, the tracker) never run
        os.remove(it / "train_state.pt")
        (ckpt / "latest_checkpointed_iteration.txt").write_text("15")
    elif damage == "no_index":  # killed while torch_dist wrote: no index of the tensors
        os.remove(it / ".metadata")
    cfg = _cfg(tmp_path, "--train-iters", "30", "--global-batch-size", "8", "--load", str(ckpt), *flags)
    with pytest.raises(checkpoint.CheckpointError, match=message) as e:
        train.pretrain(cfg)
    assert str(ckpt) in str(e.value) or "--ckpt-step" in str(e.value)
    assert "\n" not in str(e.value)
    assert not torch.distributed.is_initialized()


def test_the_tracker_is_published_durably(tmp_path, monkeypatch):
    """The tracker's bytes are synced before the rename that publishes it, and its directory after the rename, so a
    power loss after "successfully saved" cannot take the publication back."""
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.isdir(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", os.path.basename(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    checkpoint._atomic_write_text("30", str(tmp_path / checkpoint.TRACKER))
    assert events == [("fsync", False), ("rename", checkpoint.TRACKER), ("fsync", True)]
    assert (tmp_path / checkpoint.TRACKER).read_text() == "30"


@pytest.mark.full  # a fresh job; the first command's damaged checkpoints are the in-process ones above
def test_truncated_file_stops_every_rank_with_one_line(mock_run, tmp_path):
    ckpt = _copy_ckpt(mock_run, tmp_path)
    target = ckpt / "iter_0000030" / "__0_0.distcp"  # the data-parallel run's one file (rank 0 writes every shard)
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    args = [a for a in mock_run["args"]]
    args[args.index("--save") + 1] = str(tmp_path / "new")
    proc = torchrun(args + ["--load", str(ckpt)], timeout=120)
    assert proc.returncode != 0
    errors = [l for l in proc.stderr.splitlines() if l.startswith("train.py: error:")]
    # Every rank raises (whichever prints first, torchrun then stops the other): no rank waits for the rest.
    assert errors and all("__0_0.distcp: truncated" in e or "another rank could not load" in e for e in errors)
    assert not (tmp_path / "new").exists()


# --- signals and kill -9 --------------------------------------------------------------------------------------


def _launch(args, log):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
           os.path.join(ROOT, "train.py"), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # In the test's folder: the run's default TensorBoard files (runs/) land there.
    return subprocess.Popen(cmd, cwd=os.path.dirname(log), env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _kill_9(proc):
    """SIGKILL torchrun and its workers at once (torchrun starts them in sessions of their own)."""
    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return proc.wait()
    for p in reversed(family):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(family, timeout=30)
    proc.wait()


def _continued_here(args, capsys, *more):
    """The 2-rank run of `args` continued by one process (the checkpoint reshards on load), in this one: its stdout.
    A second torchrun would prove no more and start a launcher and two ranks."""
    import train

    dropped = {"--exit-signal-handler": 0, "--exit-signal": 1, "--async-save": 0, "--num-workers": 1}
    kept, skip = [], 0
    for a in args:
        if skip:
            skip -= 1
        elif a in dropped:
            skip = dropped[a]
        else:
            kept.append(a)
    capsys.readouterr()
    train.pretrain(checks.parse_args([*kept, "--num-workers", "0", *more], world_size=1, gpu=False))
    return capsys.readouterr().out


def _wait_for(predicate, timeout=120):
    """Poll every 10 ms: a save in flight lasts longer (its files alone take ~0.2 s), and the poll's own reads of the
    log stay off the job's two cores."""
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return False


@pytest.mark.full  # a fresh job; the first command's SIGTERM is the whole job's
def test_sigterm_on_one_rank_saves_and_stops_all_ranks(tmp_path):
    log = tmp_path / "log"
    args = [*TINY, "--mock-data", "--train-iters", "3000", "--log-interval", "1", "--eval-iters", "0",
            "--num-workers", "0", "--save", str(tmp_path / "ck"), "--exit-signal-handler"]
    proc = _launch(args, log)
    try:
        assert _wait_for(lambda: "iteration        3/" in log.read_text())
        workers = psutil.Process(proc.pid).children()
        assert len(workers) == 2
        workers[1].send_signal(signal.SIGTERM)  # one rank only
        assert proc.wait(timeout=120) == 0
    finally:
        _kill_9(proc)  # never leave workers behind, whatever failed
    out = log.read_text()
    assert "exiting program after receiving SIGTERM" in out
    step = int((tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text())
    assert step >= 3 and f"iteration {step:8d}/" in out
    assert "rng_state/shard_0.0_1.1" in checkpoint_keys(tmp_path / "ck" / f"iter_{step:07d}")


@pytest.mark.full  # a fresh job; the first command's kill -9 is mid-save's
def test_nothing_outlives_a_killed_rank(tmp_path):
    """`kill -9` of one rank (an OOM kill, say), after its first save: within 10 seconds no process it started is
    left (the --async-save writer's Manager, which blocks SIGTERM and SIGINT, dies with it; DataLoader workers
    watch their parent), and torchrun stops the job, naming the lost rank."""
    log = tmp_path / "log"
    args = [*TINY, "--mock-data", "--train-iters", "3000", "--log-interval", "1", "--eval-iters", "0",
            "--num-workers", "2", "--save", str(tmp_path / "ck"), "--save-interval", "2", "--async-save",
            "--distributed-timeout-minutes", "2", "--data-cache-path", str(tmp_path / "cache")]
    proc = _launch(args, log)
    try:
        assert _wait_for(lambda: "successfully saved checkpoint from iteration       2" in log.read_text())
        assert _wait_for(lambda: "iteration        3/" in log.read_text())
        rank = next(p for p in psutil.Process(proc.pid).children() if p.environ().get("RANK") == "1")
        helpers = rank.children(recursive=True)
        # the writer's Manager (forked, Bridge's async_write_results_mp_mode default) blocks SIGTERM and SIGINT
        assert any(_blocks(p, signal.SIGTERM) and _blocks(p, signal.SIGINT) for p in helpers), helpers
        rank.kill()
        # The kernel kills them with the rank (PR_SET_PDEATHSIG: data.die_with_parent, checkpoint.py's writer): a
        # scheduling delay, which 10 s outlasts on a loaded machine; without it the writer's Manager would live on.
        gone, alive = psutil.wait_procs(helpers, timeout=10)
        assert not alive, [" ".join(p.cmdline()) for p in alive]
        assert proc.wait(timeout=150) != 0
    finally:
        _kill_9(proc)
    out = log.read_text()
    assert "local_rank: 1" in out and "Signal 9 (SIGKILL)" in out, out[-3000:]


def _blocks(process, sig) -> bool:
    """Whether a process has `sig` blocked (Linux: the SigBlk mask of /proc/PID/status)."""
    with open(f"/proc/{process.pid}/status") as fh:
        mask = next(int(line.split()[1], 16) for line in fh if line.startswith("SigBlk:"))
    return bool(mask >> (sig - 1) & 1)


def _signal_the_job(args, log, sig, after="iteration        3/"):
    """Start a 2-rank torchrun in a session of its own, signal its whole process group (torchrun, ranks,
    DataLoader workers, checkpoint writers: as SLURM, `timeout` and Ctrl-C do) once `after` is logged."""
    proc = _launch(args, log)
    try:
        assert _wait_for(lambda: after in log.read_text())
        os.killpg(proc.pid, sig)
        proc.wait(timeout=120)
    finally:
        _kill_9(proc)
    return log.read_text()


@pytest.mark.parametrize("sig", ["SIGTERM", pytest.param("SIGINT", marks=pytest.mark.full)])
def test_a_signal_to_the_whole_job_saves_and_the_run_resumes(tmp_path, sig, capsys):
    """SIGTERM with --async-save: a save before the signal started the writer's Manager, which the signal reaches
    too; it blocks the job's signals, so the signal's own save goes through it. SIGINT with synchronous saves."""
    ck = tmp_path / "ck"
    args = [*TINY, "--mock-data", "--train-iters", "3000", "--log-interval", "1", "--eval-iters", "0",
            "--num-workers", "2", "--save", str(ck), "--save-interval", "2",  # a save before: its writer lives on
            "--exit-signal-handler", "--exit-signal", sig, "--data-cache-path", str(tmp_path / "cache"),
            "--global-batch-size", "4", *(["--async-save"] if sig == "SIGTERM" else [])]
    out = _signal_the_job(args, tmp_path / "log", getattr(signal, sig))
    assert f"exiting program after receiving {sig}" in out
    assert "DataLoader worker" not in out and "[rank0]: Traceback" not in out and "[rank1]: Traceback" not in out
    step = int((ck / "latest_checkpointed_iteration.txt").read_text())
    assert step >= 3 and f"iteration {step:8d}/" in out
    assert "rng_state/shard_0.0_1.1" in checkpoint_keys(ck / f"iter_{step:07d}")
    if sig == "SIGTERM":  # the run goes on from the checkpoint the signal left
        resumed = _continued_here(args, capsys, "--load", str(ck), "--exit-interval", str(step + 2))
        assert [line[0] for line in log_lines(resumed)] == [step + 1, step + 2]


@pytest.mark.full  # a fresh job; the first command's signals are SIGTERM's to the job and to one rank
def test_a_signal_without_the_handler_ends_each_rank_with_one_line(tmp_path):
    args = [*TINY, "--mock-data", "--train-iters", "3000", "--log-interval", "1", "--eval-iters", "0",
            "--num-workers", "2", "--data-cache-path", str(tmp_path / "cache")]
    out = _signal_the_job(args, tmp_path / "log", signal.SIGINT)
    stops = [line for line in out.splitlines() if line.startswith("train.py: stopped by SIGINT; nothing saved")]
    assert len(stops) == 2, out[-3000:]
    assert "[rank0]: Traceback" not in out and "[rank1]: Traceback" not in out and "KeyboardInterrupt" not in out, out


@pytest.mark.parametrize("mode", [[], pytest.param(["--async-save"], marks=pytest.mark.full)], ids=["sync", "async"])
def test_kill_9_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path, mode, capsys):
    ck = tmp_path / "ck"
    args = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "64",
            "--micro-batch-size", "1", "--global-batch-size", "2", "--mock-data", "--train-iters", "3000",
            "--eval-iters", "0", "--num-workers", "0", "--save", str(ck), "--save-interval", "1", "--log-interval", "1",
            "--most-recent-k", "2", "--data-cache-path", str(tmp_path / "cache"), *mode]  # a save every step, bounded disk
    proc = _launch(args, tmp_path / "log")

    def saving_past_the_tracker():  # an iter_* directory newer than the published one: a save in flight
        tracker = ck / "latest_checkpointed_iteration.txt"
        if not tracker.exists():
            return False
        dirs = [int(n[5:]) for n in os.listdir(ck) if n.startswith("iter_")]
        try:
            return max(dirs) > int(tracker.read_text() or 0) >= 2
        except ValueError:
            return False

    try:
        caught = _wait_for(saving_past_the_tracker)
    finally:
        _kill_9(proc)
    assert caught, (tmp_path / "log").read_text()[-2000:]
    published = int((ck / "latest_checkpointed_iteration.txt").read_text())
    assert max(int(n[5:]) for n in os.listdir(ck) if n.startswith("iter_")) == published + 1  # the half-written one

    args[args.index("--train-iters") + 1] = str(published + 2)
    resumed = _continued_here(args, capsys, "--load", str(ck), "--override-opt-param-scheduler")
    assert f"at iteration {published}" in resumed
    assert [l[0] for l in log_lines(resumed)] == [published + 1, published + 2]
    assert (ck / "latest_checkpointed_iteration.txt").read_text() == str(published + 2)


@pytest.mark.full  # a fresh job; the first command's damage is kill -9 mid-save's
def test_saving_an_iteration_again_never_leaves_it_missing(tmp_path, capsys):
    """--ckpt-step 2 below the tracker's 3, saving into the same directory: iteration 3, the one the tracker names, is
    saved again. Done, the new one has taken its place and nothing is left aside; killed with -9 in the middle of
    it, --load still finds a whole iteration 3 (the old one was deleted first, and the tracker named nothing)."""
    import train

    ck = tmp_path / "ck"
    args = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "64",
            "--micro-batch-size", "1", "--global-batch-size", "2", "--mock-data", "--eval-iters", "0",
            "--num-workers", "0", "--save", str(ck), "--save-interval", "1", "--log-interval", "1",
            "--data-cache-path", str(tmp_path / "cache")]
    train.pretrain(checks.parse_args([*args, "--train-iters", "3"], world_size=1, gpu=False))
    again = ["--load", str(ck), "--ckpt-step", "2", "--override-opt-param-scheduler"]
    _continued_here([*args, "--train-iters", "3", "--lr", "1e-3"], capsys, *again)
    assert (ck / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert dist_checkpointing.load_common_state_dict(str(ck / "iter_0000003"))["args"].lr == 1e-3  # the new one
    assert sorted(n for n in os.listdir(ck) if n.startswith("iter_")) == [f"iter_000000{i}" for i in (1, 2, 3)]

    def saving_3_again():
        return (ck / "iter_0000003.replacement").exists() or not (ck / "iter_0000003" / "train_state.pt").exists()

    proc = _launch([*args, "--train-iters", "3000", *again], tmp_path / "log")
    try:
        caught = _wait_for(saving_3_again)
    finally:
        _kill_9(proc)
    assert caught, (tmp_path / "log").read_text()[-2000:]
    resumed = _continued_here([*args, "--train-iters", "4"], capsys, "--load", str(ck),
                              "--override-opt-param-scheduler")
    assert "at iteration 3" in resumed and [line[0] for line in log_lines(resumed)] == [4]


# --- --async-save ------------------------------------------------------------------------------------------


def test_async_save_publishes_the_state_of_its_step(tmp_path, warm_torchrun):
    """Training goes on while the writer thread writes: resuming from the async checkpoint of iteration 6
    must still give the straight run's losses for 7-12, bitwise (with dropout on)."""
    ck = tmp_path / "ck"
    args = [*TINY, "--mock-data", "--train-iters", "12", "--global-batch-size", "8", "--eval-iters", "0",
            "--log-interval", "1", "--num-workers", "0", "--data-cache-path", str(tmp_path / "cache"),
            "--save", str(ck), "--save-interval", "6", "--async-save"]
    straight = warm_torchrun(args)
    assert straight.returncode == 0, straight.stderr[-2000:]
    assert "scheduled async save of iteration       6" in straight.stdout
    assert "successfully saved checkpoint from iteration       6" in straight.stdout
    assert "successfully saved checkpoint from iteration      12" in straight.stdout  # the final one, published
    assert (ck / "latest_checkpointed_iteration.txt").read_text() == "12"
    assert torch.load(ck / "iter_0000006" / "train_state.pt")["consumed_train_samples"] == 48

    resumed = warm_torchrun([a for a in args if a != "--async-save"] + ["--load", str(ck), "--ckpt-step", "6",
                                                                   "--save", str(tmp_path / "ck2")])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    first, second = log_lines(straight.stdout), log_lines(resumed.stdout)
    assert [l[0] for l in second] == list(range(7, 13))
    assert [l[3] for l in second] == [l[3] for l in first[6:]]


def test_async_save_failure_is_reported_and_publishes_nothing(tmp_path, single_rank_groups):
    """A writer that fails (here: its directory vanished) is a one-line error at finalize; no tracker."""
    queue = checkpoint.ThreadAsyncQueue()
    published = []
    queue.schedule([({"x": torch.ones(3)}, str(tmp_path / "gone" / "x.pt"))], lambda: published.append(True))
    with pytest.raises(checkpoint.CheckpointError, match="async checkpoint save failed .*previous checkpoint stays"):
        queue.maybe_finalize_async_calls(blocking=True)
    assert not published and queue.get_num_unfinalized_calls() == 0

    queue.schedule([({"x": torch.ones(3)}, str(tmp_path / "x.pt"))], lambda: published.append(True))
    assert queue.maybe_finalize_async_calls(blocking=True) == [0] and published == [True]
    assert torch.equal(torch.load(tmp_path / "x.pt")["x"], torch.ones(3))


def test_snapshot_does_not_share_memory_with_the_live_state():
    live = {"model": {"w": torch.zeros(4)}, "optimizer": {"state": {0: {"exp_avg": torch.zeros(2)}}, "groups": [{"lr": 1.0}]}}
    snap = checkpoint._snapshot(live)
    live["model"]["w"].add_(1)
    live["optimizer"]["state"][0]["exp_avg"].add_(1)
    live["optimizer"]["groups"][0]["lr"] = 2.0
    assert snap["model"]["w"].sum() == 0 and snap["optimizer"]["state"][0]["exp_avg"].sum() == 0
    assert snap["optimizer"]["groups"][0]["lr"] == 1.0


def test_async_save_without_save_dir_is_refused(capsys):
    err = config_error(["--async-save", "--no-save"], capsys)
    assert "--async-save" in err and "drop one" in err, err


def _groups_with(saved, key: str) -> list:
    """Every dict in a checkpoint's common state that holds `key` (the optimizer's param groups)."""
    if isinstance(saved, dict):
        return ([saved] if key in saved else []) + [g for v in saved.values() for g in _groups_with(v, key)]
    return [g for v in saved for g in _groups_with(v, key)] if isinstance(saved, (list, tuple)) else []


def test_a_checkpoint_names_megatron_cores_adam_and_a_load_steps_with_this_machines(mock_run, tmp_path):
    """On a CPU torch's fused Adam steps (device.fused_cpu_adam). A checkpoint's param groups say what megatron-core
    builds, `fused` None, as Megatron-LM's do; a run loading one (ours, or Megatron-LM's) steps with the fused kernel
    again: torch's load_state_dict takes the file's groups, and it took None. Adam only, and torch_dist only: `fused`
    is a setting of torch's Adam alone, and every format saves the groups through the one save_checkpoint that
    device.adam_as_built wraps (and loads them through the one load_checkpoint that sets it again)."""
    import train

    ckpt = _copy_ckpt(mock_run, tmp_path)
    groups = _groups_with(dist_checkpointing.load_common_state_dict(str(ckpt / "iter_0000030")), "fused")
    assert groups and [g["fused"] for g in groups] == [None] * len(groups)
    state, _, optimizer, _, _ = train.setup(_cfg(tmp_path, "--train-iters", "40", "--global-batch-size", "8",
                                                 "--use-checkpoint-opt-param-scheduler", "--load", str(ckpt)))
    try:
        assert [g["fused"] for g in optimizer.param_groups] == [True] * len(optimizer.param_groups)
    finally:
        train._finish_train(state)
