"""The loop end to end: real torchrun runs of train.py on CPU, and pretrain() called from Python."""

import contextlib
import math
import os
import re

import pytest
import torch

import config
import checks
from conftest import PRINTED, REORDERED, TINY, checkpoint_keys, log_lines, torchrun, train_here


# --- one shared 2-rank run on mock data (see conftest.mock_run) -----------------------------------------------


def test_two_rank_mock_run_loss_falls_in_megatron_log_lines(mock_run):
    lines = log_lines(mock_run["stdout"])
    assert [l[0] for l in lines] == [5, 10, 15, 20, 25, 30]
    assert [l[1] for l in lines] == [40, 80, 120, 160, 200, 240]  # consumed samples = step x global batch 8
    assert all(l[2] == 8 and l[4] == 0 and l[5] == 0 for l in lines)
    losses = [l[3] for l in lines]
    assert losses[-1] < 0.7 * losses[0], losses
    # Printed once, by the last rank, not once per rank.
    assert mock_run["stdout"].count("iteration       30/      30 |") == 1


def test_evaluation_prints_loss_and_ppl(mock_run):
    blocks = re.findall(r" validation loss at (iteration \d+(?: on \w+ set)?) \| lm loss value: ([\d.E+-]+) \| "
                        r"lm loss PPL: ([\d.E+-]+) \|", mock_run["stdout"])
    prefixes = [b[0] for b in blocks]
    assert prefixes == ["iteration 10", "iteration 20", "iteration 30", "iteration 30 on validation set",
                        "iteration 30 on test set"]
    for _, loss, ppl in blocks:
        # The printed loss's last digit (5e-7 relative of ~5.5, 3e-6 absolute) is exp's relative error, plus the
        # printed perplexity's own 5e-7: within 1e-5.
        assert float(ppl) == pytest.approx(math.exp(float(loss)), rel=1e-5)
    assert float(blocks[2][1]) < float(blocks[0][1])  # validation loss falls too


def test_tensorboard_scalars_under_megatron_names(mock_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(mock_run["dir"] / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for name in ["lm loss", "learning-rate", "batch-size", "loss-scale", "grad-norm"]:
        assert name in tags and f"{name} vs samples" in tags
    assert {"iteration-time", "lm loss validation"} <= tags
    lm = acc.Scalars("lm loss")
    assert [e.step for e in lm] == list(range(1, 31))
    assert [e.step for e in acc.Scalars("lm loss vs samples")][:3] == [8, 16, 24]
    assert lm[-1].value < lm[0].value
    # Same numbers as the console: the mean of iterations 26-30 is what the last log line shows.
    console_last = log_lines(mock_run["stdout"])[-1][3]
    assert sum(e.value for e in lm[25:30]) / 5 == pytest.approx(console_last, rel=PRINTED)


def test_checkpoint_layout(mock_run):
    ckpt = mock_run["dir"] / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "30"
    assert (ckpt / "latest_train_state.pt").is_file()
    for it in (15, 30):
        d = ckpt / f"iter_{it:07d}"
        assert (d / "run_config.yaml").is_file() and (d / "train_state.pt").is_file()
        # torch_dist: megatron-core dist_checkpointing's shards (one per rank) beside its metadata; the common state
        # is an object among the shards (megatron-core 0.17 on), no longer a common.pt
        assert (d / "metadata.json").is_file() and (d / ".metadata").is_file() and not (d / "common.pt").exists()
        assert "common_state" in {k.split("/")[0] for k in checkpoint_keys(d)}
        # One file per saving rank and writer (__RANK_WRITER): data-parallel replicas leave every shard to rank 0,
        # with one writer per rank (megatron-core 0.19's thread_count, Bridge's storage_writers_per_rank default)
        assert sorted(p for p in os.listdir(d) if p.endswith(".distcp")) == ["__0_0.distcp"]
        assert "rng_state/shard_0.0_1.1" in checkpoint_keys(d)  # each (PP, TP) rank's RNG states, as Megatron-LM's
        state = torch.load(d / "train_state.pt", weights_only=True)
        assert state["step"] == it and state["consumed_train_samples"] == it * 8
    # Only the interval saves: the final save at 30 is not written twice.
    assert sorted(p for p in os.listdir(ckpt) if p.startswith("iter_")) == ["iter_0000015", "iter_0000030"]
    # run_config.yaml is a config file the CLI takes back.
    cfg = checks.parse_args(["--config-file", str(ckpt / "iter_0000030" / "run_config.yaml")], world_size=2, gpu=False)
    assert cfg.model.hidden_size == 64 and cfg.train.train_iters == 30 and cfg.dataset.mock


@pytest.mark.full  # the fast command: its one-process or warm-rank sibling
def test_resume_continues_at_the_saved_iteration(mock_run, tmp_path, warm_torchrun):
    args = [a if a != "30" else "40" for a in mock_run["args"]]  # same run, 40 iterations
    args += ["--load", str(mock_run["dir"] / "ckpt")]
    refused = torchrun(args)  # a longer run changes the LR schedule: Megatron refuses unless told which to follow
    assert refused.returncode != 0 and "pass --override-opt-param-scheduler" in refused.stderr
    assert "Traceback" not in refused.stderr.split("train.py: error:")[0][-200:]
    proc = warm_torchrun(args + ["--override-opt-param-scheduler"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loaded checkpoint" in proc.stdout and "iter_0000030 at iteration 30" in proc.stdout
    lines = log_lines(proc.stdout)
    assert [(l[0], l[1]) for l in lines] == [(35, 280), (40, 320)]
    assert lines[0][3] < log_lines(mock_run["stdout"])[0][3]  # picks up the trained weights, not a fresh start


# --- tensor parallelism on CPU --------------------------------------------------------------------------------


def test_tensor_parallel_over_gloo_matches_single_rank(warm_torchrun):
    """megatron-core's column/row-parallel layers over gloo give the losses of the unsplit model."""
    common = [*TINY, "--mock-data", "--train-iters", "6", "--log-interval", "1", "--eval-iters", "0",
              "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0"]
    # The vocabulary is padded to a multiple of 128 x TP: halve the multiple so both pad 258 ids to 384.
    tp2 = warm_torchrun([*common, "--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"])
    tp1 = train_here(common)  # the unsplit model, one process (this one)
    assert tp2.returncode == 0, tp2.stderr[-2000:]
    assert "model parallel rank (1, 0)" in tp2.stdout  # each rank holds half of the split matrices
    l2, l1 = [l[3] for l in log_lines(tp2.stdout)], [l[3] for l in log_lines(tp1)]
    assert len(l1) == 6 and l2 == pytest.approx(l1, rel=REORDERED)  # TP=2's sums grouped otherwise


def test_tensor_parallel_with_the_default_dropout_stops_and_resumes_bitwise(tmp_path, warm_torchrun):
    """TP=2 with Megatron-LM's default dropout (0.1, hidden and attention; each TP rank draws its attention masks from
    its own tracker stream): 6 iterations straight, saving at 3, and a resume from 3 give the same lm loss and grad
    norm at 4-6, bit for bit (the tracker's streams are in the checkpoint's rng_state, one per rank)."""
    common = [*TINY, "--mock-data", "--train-iters", "6", "--log-interval", "1", "--eval-iters", "0",
              "--num-workers", "0", "--tensor-model-parallel-size", "2", "--data-cache-path", str(tmp_path / "cache")]
    common = [f for f in common if f != "--no-save"]
    straight = warm_torchrun([*common, "--save", str(tmp_path / "ckpt"), "--save-interval", "3"])
    assert straight.returncode == 0, straight.stderr[-3000:]
    resumed = warm_torchrun([*common, "--no-save", "--load", str(tmp_path / "ckpt"), "--ckpt-step", "3"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    grad_norm = re.compile(r"iteration +(\d+)/.*? grad norm: ([\d.]+) \|")
    assert re.search(r"model\.attention_dropout \.+ 0\.1\n", straight.stdout), "Megatron-LM's default dropout"
    assert "CPU RNG state changed" not in straight.stderr  # the tracker's check, which a CPU's one generator trips
    first = {it: (loss, norm) for (it, *_, loss, _, _), (_, norm) in
             zip(log_lines(straight.stdout), grad_norm.findall(straight.stdout))}
    second = {it: (loss, norm) for (it, *_, loss, _, _), (_, norm) in
              zip(log_lines(resumed.stdout), grad_norm.findall(resumed.stdout))}
    assert sorted(second) == [4, 5, 6]
    assert [second[it] for it in (4, 5, 6)] == [first[it] for it in (4, 5, 6)]


@pytest.mark.full  # a fresh job; the first command's one-line stop of every rank is the NaN gradient's
def test_an_exception_mid_run_ends_the_rank_and_its_data_workers(tmp_path):
    """Rank 0 raises at iteration 4 with two DataLoader workers per rank: the job ends (torchrun stops rank 1) with
    the exception on stderr and a non-zero code, and no process of it is left (a rank that waited on its workers at
    exit would hang here until the timeout)."""
    import psutil

    marker = str(tmp_path / "cache")  # in every process's command line, workers included (they are forks)
    proc = torchrun([*TINY, "--mock-data", "--train-iters", "8", "--eval-iters", "0", "--num-workers", "2", "--log-interval", "1",
                     "--data-cache-path", marker], script="tests/scripts/raise_mid_run.py", timeout=120)
    assert proc.returncode != 0
    assert "RuntimeError: injected at iteration 4" in proc.stderr, proc.stderr[-3000:]
    assert " iteration        3/" in proc.stdout  # it trained up to the injection
    left = [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]
    assert not left, [p.info["cmdline"][:3] for p in left]


# --- pretrain() from Python -------------------------------------------------------------------------------------


def _cfg(tmp_path, *extra):
    return checks.parse_args([*TINY, "--mock-data", "--num-workers", "0", "--data-cache-path", str(tmp_path / "cache"),
                              *extra], world_size=1, gpu=False)


def test_pretrain_from_python_with_a_custom_forward_step(tmp_path, capsys):
    import train

    seen = {"steps": [], "batches": 0}

    def my_forward_step(state: train.GlobalState, data_iterator, model):
        """Legacy pattern, state injected by annotation: mean loss over the microbatch, an extra metric."""
        seen["steps"].append(state.train_state.step)
        batch = next(data_iterator)
        seen["batches"] += 1
        losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"lm loss": loss.detach(), "tokens seen": torch.tensor(float(output.numel()))}
        return losses, loss_func

    cfg = _cfg(tmp_path, "--train-iters", "4", "--log-interval", "2", "--eval-interval", "2", "--eval-iters", "1",
               "--global-batch-size", "4")
    state = train.pretrain(cfg, my_forward_step)
    out = capsys.readouterr().out
    assert state.exit_code is None and state.train_state.step == 4
    assert seen["steps"][:4] == [0, 0, 1, 1]  # two microbatches per step, the live step count visible
    assert "tokens seen: 1.280000E+02" in out  # the custom metric is logged beside lm loss (2 x 64 tokens)
    assert len(log_lines(out)) == 0 or True
    assert "validation loss at iteration 2 | lm loss value:" in out
    assert not torch.distributed.is_initialized()  # pretrain() cleans up: a second run can start


def test_nan_loss_stops_the_run_without_a_checkpoint(tmp_path, capsys):
    import train

    def poisoned_forward_step(state, data_iterator, model):
        output, loss_func = train.forward_step(state, data_iterator, model)
        if state.train_state.step == 2:
            output = output * float("nan")
        return output, loss_func

    cfg = _cfg(tmp_path, "--train-iters", "6", "--eval-iters", "0", "--save", str(tmp_path / "ckpt"),
               "--save-interval", "2")
    with pytest.raises(train.RunStopped, match=r"^training stopped at iteration 3 on a NaN or Inf loss or gradient "
                                               r"\(exit code 1\)") as stopped:  # as Bridge's: a script does not end 0
        train.pretrain(cfg, poisoned_forward_step)
    state, out = stopped.value.state, capsys.readouterr().out
    assert state.exit_code == 1 and state.train_state.step == 2
    assert "lm loss is NaN or Inf at iteration 3" in out
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["iter_0000002", "latest_checkpointed_iteration.txt",
                                                     "latest_train_state.pt", "progress.txt"]


def test_interrupted_and_resumed_run_matches_an_uninterrupted_one(tmp_path, capsys):
    """8 iterations straight, or 4 + exit + resume to 8: identical losses, bitwise, with dropout on."""
    import train

    def losses_of(*extra):
        train.pretrain(_cfg(tmp_path, "--log-interval", "1", "--eval-iters", "0", *extra))
        return {l[0]: l[3] for l in log_lines(capsys.readouterr().out)}

    straight = losses_of("--train-iters", "8")
    first = losses_of("--train-iters", "8", "--exit-interval", "4", "--save", str(tmp_path / "ck"))
    second = losses_of("--train-iters", "8", "--save", str(tmp_path / "ck"), "--load", str(tmp_path / "ck"))
    assert sorted(first) == [1, 2, 3, 4] and sorted(second) == [5, 6, 7, 8]
    assert {**first, **second} == straight


def test_two_rank_resume_from_the_middle_is_bitwise_identical(mock_run, tmp_path, warm_torchrun):
    """Resume the shared run's iteration-15 checkpoint on 2 ranks: iterations 16-30 give the same logged
    losses (dropout on) and the same validation losses, as the uninterrupted run printed."""
    args = list(mock_run["args"])
    args[args.index("--save") + 1] = str(tmp_path / "ckpt")
    args[args.index("--tensorboard-dir") + 1] = str(tmp_path / "tb")
    proc = warm_torchrun(args + ["--load", str(mock_run["dir"] / "ckpt"), "--ckpt-step", "15"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    straight = {l[0]: l for l in log_lines(mock_run["stdout"])}
    resumed = {l[0]: l for l in log_lines(proc.stdout)}
    assert sorted(resumed) == [20, 25, 30]
    for it in (25, 30):  # whole log intervals after the resume point: averages of identical losses
        assert resumed[it] == straight[it]
    validation = re.compile(r"validation loss at iteration (?:20|30) \| lm loss value: (\S+)")
    assert validation.findall(proc.stdout) == validation.findall(mock_run["stdout"])


def _gloo_io_threads() -> int:
    """This process's gloo I/O threads (one per live gloo device; Linux names them gloo_tcp_loop)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/comm") as f:
            names.append(f.read().strip())
    return names.count("gloo_tcp_loop")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
@pytest.mark.parametrize("extra", [[], ["--use-distributed-optimizer"], ["--num-experts", "2"], ["--use-megatron-fsdp"]],
                         ids=["ddp", "distributed-optimizer", "moe", "megatron-fsdp"])
def test_a_run_leaves_no_polling_gloo_threads_behind(tmp_path, extra):
    """Each process group a run creates has a gloo I/O thread that polls until the group's object is freed, and the
    model and optimizer hold the groups in reference cycles: pretrain frees them when it ends, so a process that
    runs again (a notebook, the suite itself) does not gather polling threads run after run (without the
    collection at its end: +19 threads a run here). The distributed optimizer's shard views and the MoE
    dispatcher's routing tensors close their cycle through autograd's C++ graph, which the collector cannot see:
    pretrain empties the DDP wrappers first (without that, these two cases still gain ~20 threads a run). Megatron
    FSDP's hooks hold its inner modules, with their buffers and meshes: every module is emptied (train.empty_modules;
    emptying the wrapper alone, +19 threads a run). The count after a third run is the count after the second
    (Megatron FSDP's second run keeps one thread more than its first, once: not a thread a run)."""
    counts = []
    for _ in range(3):
        train_here([*TINY, "--mock-data", "--train-iters", "1", "--eval-iters", "0", "--num-workers", "0",
                    "--data-cache-path", str(tmp_path / "cache"), *extra])
        counts.append(_gloo_io_threads())
    assert counts[2] == counts[1], counts


def test_the_seeds_exit_decisions_save_on_a_global_state_made_directly(single_rank_groups, tmp_path, capsys):
    """A loop of one's own: GlobalState(cfg) made outside setup() and the seed's checkpoint_and_decide_exit and
    save_checkpoint_and_time called as its signatures say. The checkpoint manager is made on first use, as the
    metric writers are: each decision saves a loadable checkpoint of its iteration."""
    import signal

    import checkpoint
    import train
    from test_optimizer import build

    save = tmp_path / "ckpt"
    cfg = _cfg(tmp_path, "--save", str(save), "--save-interval", "2", "--exit-interval", "3")
    model, optimizer, scheduler = build(cfg)
    state = train.GlobalState(cfg)
    ts = state.train_state

    def decide(step):
        ts.step = step
        return train.checkpoint_and_decide_exit(state, model, optimizer, scheduler, 0.0, None, None)

    def newest():
        return int((save / "latest_checkpointed_iteration.txt").read_text())

    assert not decide(2) and newest() == 2  # --save-interval: saved, goes on
    assert decide(3) and newest() == 3 and state.exit_code == 0  # --exit-interval: saved, stops
    cfg.train.exit_interval, cfg.train.exit_duration_in_mins = None, 1.0
    state.start_time -= 61  # --exit-duration-in-mins elapsed
    assert decide(5) and newest() == 5
    cfg.train.exit_duration_in_mins = None
    state.signal_handler = train.DistributedSignalHandler(signal.SIGUSR1).__enter__()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)  # --exit-signal-handler's signal
        assert decide(7) and newest() == 7
    finally:
        state.signal_handler.release()
    ts.step = 8
    train.save_checkpoint_and_time(state, model, optimizer, scheduler, 0.0)
    assert newest() == 8 and state.last_saved_step == 8
    out = capsys.readouterr().out
    assert [int(s) for s in re.findall(r"successfully saved checkpoint from iteration +(\d+)", out)] == [2, 3, 5, 7, 8]
    fresh = train.GlobalState(cfg)
    checkpoint.load_checkpoint(fresh, model, optimizer, scheduler, str(save))
    assert fresh.train_state.step == 8


class _NaNGradient(torch.autograd.Function):
    """The identity forward; a NaN gradient backward: a finite loss whose gradient is NaN."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


# MoE layers whose load-balancing loss and a multi-token prediction layer whose loss join the lm loss in the backward
MOE_MTP = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48", "--moe-aux-loss-coeff", "1e-2",
           "--mtp-num-layers", "1"]


@pytest.mark.parametrize("mode, code", [("disabled", 1), ("validate_results", 16)])
def test_a_nan_gradient_under_a_finite_loss_stops_before_the_step_with_the_last_good_checkpoint(mode, code, tmp_path,
                                                                                                capsys):
    """Iteration 3's gradient is NaN, its loss finite, MoE and MTP auxiliary losses in the backward too: megatron-core
    DDP's check of each gradient bucket (on with --check-for-nan-in-loss-and-grad, as Megatron-LM's training.py:1989)
    stops the run before the optimizer step. In disabled mode one line names the iteration and the run ends with code
    1; under validate_results megatron-core reruns the step, finds the NaN again and stops with its code 16. Either way
    nothing of iteration 3 is saved: the newest checkpoint is iteration 2's."""
    import train

    def forward_step(state, data_iterator, model):
        output, loss_func = train.forward_step(state, data_iterator, model)
        return (_NaNGradient.apply(output) if state.train_state.step == 2 else output), loss_func

    save = tmp_path / "ckpt"
    cfg = _cfg(tmp_path, *MOE_MTP, "--train-iters", "5", "--log-interval", "1", "--eval-iters", "0",
               "--save", str(save), "--save-interval", "1", "--rerun-mode", mode)
    with pytest.raises(train.RunStopped) as stopped:
        train.pretrain(cfg, forward_step)
    state, out = stopped.value.state, capsys.readouterr().out
    assert state.exit_code == code and state.train_state.step == 2
    assert [l[0] for l in log_lines(out)] == [1, 2] and "grad norm: nan" not in out
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000001", "iter_0000002"]
    errors = [line for line in out.splitlines() if "error:" in line]
    assert len(errors) == 1 and "found NaN in local grad norm for bucket #0" in errors[0] \
        and "at iteration 3 on rank 0" in errors[0], errors


def test_a_nan_gradient_on_one_rank_stops_every_rank_with_one_line(tmp_path):
    """Two data-parallel ranks, rank 0's gradient NaN at iteration 3 (tests/scripts/nan_gradient.py): rank 0's bucket
    check finds it before the reduce, and both ranks stop before the optimizer step (not rank 0 alone, which would
    leave rank 1 waiting), rank 0 saying so in the only error line; the newest checkpoint is iteration 2's."""
    save = tmp_path / "ckpt"
    proc = torchrun([*TINY, *MOE_MTP, "--mock-data", "--num-workers", "0", "--train-iters", "5", "--eval-iters", "0",
                     "--global-batch-size", "4", "--save", str(save), "--save-interval", "1",
                     "--data-cache-path", str(tmp_path / "cache")], script="tests/scripts/nan_gradient.py", timeout=180)
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("error: found NaN in local grad norm for bucket #0") \
        and "at iteration 3 on rank 0;" in errors[0], errors
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000001", "iter_0000002"]


def _event_writer_threads() -> int:
    """TensorBoard's event-file writer threads alive in this process (one per open SummaryWriter)."""
    import threading

    return sum(type(t).__name__ == "_AsyncWriterThread" for t in threading.enumerate())


def test_a_setup_that_fails_closes_the_metric_writers_it_opened(tmp_path):
    """The writers and the --exit-signal-handler's handler are set up before the model; a checkpoint that cannot be
    loaded fails setup after them: the TensorBoard writer is closed (its thread ended, its events flushed), and the
    signal's previous handler is back, not left to the process."""
    import signal

    import checkpoint
    import train

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("5")  # no iter_0000005
    cfg = _cfg(tmp_path, "--train-iters", "2", "--load", str(tmp_path / "ckpt"), "--tensorboard-dir", str(tmp_path / "tb"),
               "--exit-signal-handler", "--exit-signal", "SIGUSR2")
    threads, handler = _event_writer_threads(), signal.getsignal(signal.SIGUSR2)
    with pytest.raises(checkpoint.CheckpointError, match="names iteration 5"):
        train.pretrain(cfg)
    assert list((tmp_path / "tb").iterdir()), "the writer was opened"
    assert _event_writer_threads() == threads and signal.getsignal(signal.SIGUSR2) is handler


def test_a_run_that_raises_stops_its_async_checkpoint_writer_and_publishes_nothing_more(tmp_path):
    """--async-save (torch_dist: megatron-core writes each save from a process of its own on a CPU), a save every
    iteration, and a forward step that raises at iteration 3, while iteration 2's save is being written (scheduled
    just before; iteration 2's forward step waited for iteration 1's to finish first): pretrain ends with the
    exception, the writer stopped (killed) and reaped rather than left running or as a zombie, and the tracker still
    on iteration 1."""
    import psutil

    import train

    in_flight = []

    def forward_step(state, data_iterator, model):
        if state.train_state.step == 2:
            in_flight.extend(call.async_caller.process for call in state.async_calls_queue.async_calls)
            raise RuntimeError("injected at iteration 3")
        return train.forward_step(state, data_iterator, model)

    save = tmp_path / "ckpt"
    cfg = _cfg(tmp_path, "--train-iters", "4", "--eval-iters", "0", "--save", str(save), "--save-interval", "1",
               "--async-save")
    with pytest.raises(RuntimeError, match="injected at iteration 3"):
        train.pretrain(cfg, forward_step)
    assert len(in_flight) == 1 and not psutil.pid_exists(in_flight[0].pid)  # read before anything waits for it
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "1"
