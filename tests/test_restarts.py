"""A job that survives losing ranks: `torchrun --max-restarts N` stops the worker group when a worker dies (or hangs
past --distributed-timeout-minutes) and starts it again; train.py with --load on its --save directory resumes the
newest published checkpoint, and every iteration's lm loss and grad norm (the last printing of each) are the
uninterrupted run's, bit for bit. Real torchrun jobs, started in a session of their own, killed with SIGKILL (or
stopped with SIGSTOP) at random moments, one of them while a checkpoint is being written."""

import os
import random
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import ROOT, TINY, free_port

# Every iteration printed; Megatron-LM's default dropout and DataLoader workers; a checkpoint every 5 iterations.
FLAGS = [*[f for f in TINY if f != "--no-save"], "--mock-data", "--train-iters", "30", "--log-interval", "1",
         "--eval-iters", "0", "--save-interval", "5"]
STEP = re.compile(r"iteration +(\d+)/ +\d+ \|.*? lm loss: (\S+) \|.*? grad norm: (\S+) \|")


def start(args, nproc, out, max_restarts=5):
    """torchrun in a new session (its workers start sessions of their own: each is killed by pid), output to files."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}",
           f"--max-restarts={max_restarts}", os.path.join(ROOT, "train.py"), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, cwd=out, env=env, stdout=open(out / "stdout", "w"), stderr=open(out / "stderr", "w"),
                            start_new_session=True)


def finish(proc, out, timeout=420):
    """Wait for the job; on a timeout, end it. Returns (exit code, stdout)."""
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        end(proc)
        raise
    return code, (out / "stdout").read_text()


def end(proc) -> None:
    """SIGKILL to the job's session and to every worker (each in a session of its own, which the group's signal
    would not reach), if it is still running."""
    if proc.poll() is None:
        for p in psutil.Process(proc.pid).children(recursive=True):
            p.kill()
        os.killpg(proc.pid, signal.SIGKILL)


def steps(stdout: str) -> dict:
    """{iteration: (lm loss, grad norm)} as last printed: a restart prints again what it computes again."""
    return {int(it): (loss, norm) for it, loss, norm in STEP.findall(stdout)}


def workers(proc) -> list:
    """The job's ranks: the agent's children (their DataLoader workers are theirs)."""
    return [p for p in psutil.Process(proc.pid).children() if "train.py" in " ".join(p.cmdline())]


def wait_for(condition, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, "the job ended before the moment came"
        assert time.monotonic() < deadline, "the moment never came"
        time.sleep(0.02)


def printed(out, pattern) -> int:
    return len(re.findall(pattern, (out / "stdout").read_text()))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, warm_torchrun):
    """The uninterrupted run of `nproc` ranks with `flags`, made once for the module's tests: (its steps, seconds). Two
    ranks run on the session's warm ranks (what a fresh job would compute: their runs seed as a start does; only the
    start-up is saved, so its seconds leave out the ~7 s a start costs); four in a fresh job."""
    made = {}

    def run(nproc, flags):
        if (nproc, *flags) not in made:
            out = tmp_path_factory.mktemp("straight")
            args, began = [*FLAGS, *flags, "--save", "ck", "--load", "ck"], time.monotonic()
            if nproc == 2:
                proc = warm_torchrun(args, cwd=out, timeout=420)
                code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
            else:
                code, stdout = finish(start(args, nproc, out, max_restarts=0), out)
                stderr = (out / "stderr").read_text()
            assert code == 0, stderr[-3000:]
            made[nproc, *flags] = steps(stdout), time.monotonic() - began
        return made[nproc, *flags]
    return run


@pytest.mark.parametrize("nproc, flags", [
    pytest.param(2, [], marks=pytest.mark.full),  # four starts of a job: the first command's kills are test_checkpoint's
    pytest.param(4, ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"],  # TP=2 x DP=2
                 marks=pytest.mark.full),
    # Megatron FSDP's ZeRO-3 (fsdp_dtensor) and torch FSDP2 (torch_dcp): their checkpoints, written through
    # torch.distributed.checkpoint, killed mid-save as well
    pytest.param(2, ["--use-megatron-fsdp"], marks=pytest.mark.full),
    pytest.param(2, ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"], marks=pytest.mark.full),
], ids=["dp2", "tp2_dp2", "megatron_fsdp_dp2", "torch_fsdp2_dp2"])
def test_a_job_whose_ranks_are_killed_three_times_resumes_bitwise(tmp_path, uninterrupted, nproc, flags):
    """A random rank SIGKILLed three times: at a random iteration before the first checkpoint (the restart trains
    from scratch, as the first start did), while the checkpoint of iteration 15 is being written (its directory
    exists, the tracker does not name it yet: the restart resumes the one before), and at a random iteration after
    it. torchrun restarts the group each time; each start says which one it is and where it resumed; the job exits 0
    with the uninterrupted run's losses and grad norms. What the kills cost is printed (iterations computed twice,
    seconds)."""
    reference, straight_seconds = uninterrupted(nproc, flags)
    assert sorted(reference) == list(range(1, 31))
    chance = random.Random(nproc)
    out = tmp_path / "killed"
    out.mkdir()
    began = time.monotonic()
    proc = start([*FLAGS, *flags, "--save", "ck", "--load", "ck"], nproc, out)
    try:
        kills = [("iteration", chance.randint(2, 3)), ("save", 15), ("iteration", chance.randint(19, 26))]
        for restart, (moment, at) in enumerate(kills, 1):
            if moment == "iteration":  # printed for the first time: no start before this one got there
                wait_for(lambda: printed(out, rf" iteration +{at}/") == 1, proc)
            else:  # mid-save: the directory rank 0 makes before the tensors are written, not yet published
                wait_for(lambda: (out / "ck" / f"iter_{at:07d}").is_dir() and
                         (out / "ck" / "latest_checkpointed_iteration.txt").read_text() != str(at), proc)
            chance.choice(workers(proc)).send_signal(signal.SIGKILL)
            wait_for(lambda: printed(out, rf" restart {restart} of torchrun") == 1, proc)
        code, stdout = finish(proc, out)
    finally:
        end(proc)
    assert code == 0, (out / "stderr").read_text()[-3000:]
    starts = re.findall(r" restart (\d) of torchrun --max-restarts 5: (.*)", stdout)
    assert [n for n, _ in starts] == ["1", "2", "3"], starts
    assert starts[0][1] == "no checkpoint published yet: training from scratch"
    resumed_at = [int(re.fullmatch(r"resumed at iteration (\d+) from ck", said)[1]) for _, said in starts[1:]]
    assert resumed_at[0] in (10, 15) and resumed_at[1] in (15, 20, 25) and resumed_at[1] < kills[2][1], resumed_at
    assert steps(stdout) == reference
    twice = len(STEP.findall(stdout)) - 30
    print(f"\n{nproc} ranks, 3 kills: {twice} iterations computed twice, {time.monotonic() - began:.1f} s against "
          f"{straight_seconds:.1f} s uninterrupted (with no start-up on warm ranks); resumed at {resumed_at}")


@pytest.mark.full  # 30 s of torchrun's wait for its SIGKILL; the first command's kills are test_checkpoint's
def test_a_stopped_rank_fails_the_others_at_the_timeout_and_the_job_restarts(tmp_path, uninterrupted):
    """A rank stopped with SIGSTOP (a read that never returns) hangs no one for ever: the other rank's collective
    fails after --distributed-timeout-minutes (here 0.1, six seconds; megatron-core's own groups get it too),
    torchrun stops the group (SIGKILL reaches the stopped one 30 s after the SIGTERM it cannot act on: a restart
    waits torch's default, not --shutdown-timeout, elastic/agent/server/local_elastic_agent.py:393) and restarts
    it, and the job ends with the uninterrupted run's figures (the timeout changes no arithmetic: the 2-rank
    reference of the test above)."""
    reference, _ = uninterrupted(2, [])
    out = tmp_path / "stopped"
    out.mkdir()
    proc = start([*FLAGS, "--distributed-timeout-minutes", "0.1", "--save", "ck", "--load", "ck"], 2, out)
    try:
        wait_for(lambda: printed(out, r" iteration +12/") == 1, proc)
        workers(proc)[-1].send_signal(signal.SIGSTOP)
        wait_for(lambda: printed(out, r" restart 1 of torchrun") == 1, proc, timeout=180)
        code, stdout = finish(proc, out)
    finally:
        end(proc)
    assert code == 0, (out / "stderr").read_text()[-3000:]
    assert " restart 1 of torchrun --max-restarts 5: resumed at iteration 10 from ck" in stdout
    assert steps(stdout) == reference


def test_max_restarts_without_save_and_load_on_one_directory_is_named_at_start(tmp_path, monkeypatch):
    """A restart resumes from --load: with --max-restarts and no --load on the --save directory, rank 0 says so in
    one line at start (a restart would begin from scratch). torchrun tells its workers the job's --max-restarts in
    TORCHELASTIC_MAX_RESTARTS (elastic/agent/server/local_elastic_agent.py), set here for a run in this process."""
    from conftest import train_here

    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    stdout = train_here([*FLAGS, "--train-iters", "1", "--num-workers", "0", "--save", str(tmp_path / "ck")])
    lines = [l for l in stdout.splitlines() if "max-restarts" in l]
    assert lines == ["WARNING: torchrun --max-restarts 3 restarts this job from the newest checkpoint in --load, which "
                     f"must be where --save writes (now --save {tmp_path / 'ck'}, --load None): a restart would train "
                     "from scratch"]
