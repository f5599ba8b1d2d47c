"""train.py: pretrain a megatron-core GPT: `torchrun --nproc-per-node 2 train.py [Megatron-LM flags]`.

The training loop of Megatron Bridge (`bridge.training.train`, `.pretrain`, `.utils.train_utils`),
in one file, in the order it runs: the entry points, setup, the loop, the step, then the helpers in the order
they are first called.

    1. entry points        main -> pretrain (setup, train, the final save and evaluation); finetune
    2. setup               setup: distributed groups, seeds, GlobalState, tokenizer, model, optimizer, scheduler,
                           checkpoint, data iterators
    3. the run's state     GlobalState (TrainState, the progress a checkpoint carries, is checkpoint.py's)
    4. the loop            train: per iteration ramp-up, train_step, one report to the log line and the
                           writers (metrics.step_report, metrics.log_step), evaluation, checkpoint_and_decide_exit
    5. around each step    batch-size ramp-up, DDP's forward pre-hooks, garbage collection, profiling
    6. one training step   train_step -> TrainStepResult; 6b. result validation (the rerun state machine)
    7. the forward step    prepare_forward_step_func (the API), forward_step (the default GPT step)
    8. evaluation          evaluate_and_print_results -> evaluate
    9. checkpoint and exit checkpoint_and_decide_exit -> save_checkpoint_and_time

Before any of it, the flags are parsed and validated (a bad flag answers before megatron-core's import).

Where the names come from: every public name, signature and behaviour here is Megatron Bridge's (`training.train`,
`.pretrain`, `.finetune`, `.utils.train_utils`, `.gpt_step`, `.losses`, `.state`, as its API documentation gives
them), in Megatron-LM's order of events; a docstring names Megatron-LM only where the two differ or where this
follows its variant.

The same code runs on a GPU and on a CPU: megatron-core's DDP, optimizer, pipeline schedules, RNG
tracker and dist_checkpointing on both; on a CPU, device.py's shim answers megatron-core's CUDA calls.
"""

# ruff: noqa: E402  (the flags are parsed before the heavy imports, so most imports follow code)

from __future__ import annotations

import os
import sys

import config as config_lib  # first: it quiets megatron-core's import-time notices (device.py)
import checks

if __name__ == "__main__":
    # Parse and validate before the imports below: `--help` and a bad flag answer once the settings' classes
    # (megatron-core's) are imported, before any process group, model or dataset, so no process starts work it
    # cannot finish.
    CLI_CONFIG = checks.parse_args(sys.argv[1:] or config_lib.QUICK_START, run=True)
    if not sys.argv[1:] and os.environ.get("RANK", "0") == "0":
        print("quick start (no flag given): " + " ".join(config_lib.QUICK_START), flush=True)

import contextlib
import functools
import gc
import inspect
import itertools
import logging
import math
import signal
import time
from typing import Callable, NamedTuple, Optional

import torch

from model import (build_model, build_optimizer, build_rerun_state_machine, check_emerging_optimizer_installed,
                   check_optimizer_state, destroy_distributed, get_forward_backward_func, initialize_distributed,
                   gather_context_parallel_chunks, set_random_seed, who_updates_what, wrap_model,
                   zero_grad)  # first: device.py, which model.py imports, quiets megatron-core's import warnings
from megatron.core import config as mcore_config
from megatron.core import parallel_state
from megatron.core import rerun_state_machine as mcore_rerun
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler, get_canonical_lr_for_logging
from megatron.core.timers import Timers
from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
from megatron.core.utils import configure_nvtx_profiling, get_batch_on_this_cp_rank, nvtx_range_pop, nvtx_range_push
from megatron.training.determinism import DETERMINISM_ENV_VAR_DEFAULTS
from megatron.training.dist_signal_handler import DistributedSignalHandler  # records the signal; the loop saves
from megatron.training.training import disable_forward_pre_hook, enable_forward_pre_hook
from megatron.training.utils.common_utils import (logical_and_across_model_parallel_group,
                                                  reduce_max_stat_across_model_parallel_group)
from megatron.training.vocab_utils import calculate_padded_vocab_size

import checkpoint
import data
import device
import downstream
import metrics
import peft
import profiling
import schedules
from checkpoint import TrainState  # (what a checkpoint carries of the run's progress)
from config import ConfigContainer
from device import any_rank
from metrics import print_rank_0

# ==================================================================================================
# 1. Entry points
# ==================================================================================================


def main(cfg: ConfigContainer) -> int:
    """The command line's run: a config or checkpoint error, or a signal the run does not handle, ends it
    with one line per rank instead of a traceback (SLURM, `timeout` and Ctrl-C signal every rank)."""
    handled = {cfg.train.exit_signal} if cfg.train.exit_signal_handler else set()
    for sig in {signal.SIGTERM, signal.SIGINT} - handled:
        signal.signal(sig, _raise_job_signal)
    try:
        state = pretrain(cfg)
    except (config_lib.ConfigError, checkpoint.CheckpointError) as e:
        _say(f"train.py: error: {e}")
        return 2
    except RunStopped as e:  # the loop has said why, in its one line
        return e.exit_code
    except JobSignal as e:
        name = signal.Signals(e.args[0]).name
        _say(f"train.py: stopped by {name}; nothing saved at the signal (--exit-signal-handler --exit-signal {name} "
             f"saves a checkpoint and exits 0)")
        return 128 + e.args[0]
    return state.exit_code or 0


class RunStopped(RuntimeError):
    """pretrain() stopped on a NaN or Inf loss or gradient (exit_code 1, or the rerun state machine's 16 or 17), as
    Bridge's and Megatron-LM's stop with a RuntimeError: a script that calls pretrain() does not end with 0. The
    run's GlobalState is `.state`."""

    def __init__(self, state: "GlobalState"):
        self.state, self.exit_code = state, state.exit_code
        super().__init__(f"training stopped at iteration {state.train_state.step + 1} on a NaN or Inf loss or gradient "
                         f"(exit code {state.exit_code}); nothing of that iteration was saved")


class JobSignal(BaseException):
    """SIGTERM or SIGINT arrived without --exit-signal-handler: the run stops where it is."""


def _raise_job_signal(signum, frame):
    for sig in (signal.SIGTERM, signal.SIGINT):  # once: torchrun passes the signal on again while the rank stops
        signal.signal(sig, signal.SIG_IGN)
    data.quiet_broken_connections()
    raise JobSignal(signum)


def _say(line: str) -> None:
    """One line to stderr in one write, so the ranks' lines do not interleave in a shared log."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def pretrain(config: ConfigContainer, forward_step_func: Optional[Callable] = None,
             process_non_loss_data_func=None, non_loss_data_func=None) -> GlobalState:
    """Set up, train, save the final checkpoint, and evaluate on the validation and test sets.

    `forward_step_func(data_iterator, model)` returns (output, loss_func); it may take the GlobalState
    first (see needs_global_state_injection); None is the default GPT step, `forward_step`. Returns the
    GlobalState (`.exit_code` 0 if it stopped early on purpose: a signal, --exit-interval, --exit-duration-in-mins);
    raises RunStopped if it stopped on a NaN or Inf.
    """
    forward_step_func = forward_step_func or forward_step
    # On a CPU, megatron-core's CUDA calls are answered there (device.py's shim) for this run, and only for it
    with device.shim():
        try:
            state, model, optimizer, scheduler, (train_it, valid_it, test_it) = setup(config)
        except BaseException:  # a bad checkpoint or data path: leave no process group (or experimental flag) behind
            mcore_config.set_experimental_flag(False)
            destroy_distributed()
            raise
        cfg, ts = state.cfg, state.train_state
        state.last_saved_step = ts.step if ts.step else None  # a resumed checkpoint is not saved again
        try:
            if not cfg.validation.skip_train and ts.step < cfg.train.train_iters:
                train(forward_step_func, model, optimizer, scheduler, train_it, valid_it, state,
                      process_non_loss_data_func=process_non_loss_data_func, non_loss_data_func=non_loss_data_func)
            if state.exit_code is None:  # ran to the end: final save (unless just saved) and final evaluation
                if cfg.checkpoint.save and ts.step > 0 and state.last_saved_step != ts.step:
                    save_checkpoint_and_time(state, model, optimizer, scheduler, ts.floating_point_operations_so_far)
                if cfg.validation.eval_iters:
                    for name, iterator in (("validation", valid_it), ("test", test_it)):
                        if iterator is not None:
                            evaluate_and_print_results(state, f"iteration {ts.step} on {name} set", forward_step_func,
                                                       iterator, model, cfg,
                                                       process_non_loss_data_func=process_non_loss_data_func,
                                                       non_loss_data_func=non_loss_data_func)
                if state.downstream_tasks and state.downstream_scored_at != ts.step:
                    score_downstream_tasks(state, model)
            # an async save in flight is published before the run ends
            state.checkpoint_manager.finalize_async_saves(state, blocking=True, terminate=True)
        except BaseException:  # a failed run publishes nothing more, and leaves no writer behind
            checkpoint.abort_async_save(state)
            raise
        finally:
            _finish_train(state)
            empty_modules(model)  # the run's process groups freed now, not at some later full collection
            del model, optimizer, scheduler, train_it, valid_it, test_it
            gc.collect()
        if state.exit_code:
            raise RunStopped(state)
        return state


def finetune(config: ConfigContainer, forward_step_func: Optional[Callable] = None,
             process_non_loss_data_func=None, non_loss_data_func=None) -> GlobalState:
    """pretrain() from a pretrained checkpoint: weights only, iteration 0 (as --finetune), unless
    --load already holds this finetuning run's own checkpoint, which is then resumed."""
    ck = config.checkpoint
    if not ck.load and not ck.pretrained_checkpoint:
        raise config_lib.ConfigError("finetune() needs --pretrained-checkpoint (weights to start from) or --load")
    return pretrain(config, forward_step_func, process_non_loss_data_func, non_loss_data_func)


# ==================================================================================================
# 2. Setup
# ==================================================================================================


def setup(cfg: ConfigContainer):
    """Everything before the first step. Returns (state, model, optimizer, scheduler, iterators)."""
    checks.check_fits_in_memory(cfg)  # a run this machine cannot hold stops here, in one line
    setup_logging(cfg.logger.logging_level)
    apply_deterministic_mode(cfg)
    check_emerging_optimizer_installed(cfg)  # what the installed package lacks, before any process group or model
    check_optimizer_state(cfg)  # and what megatron-core does not build or save for the optimizer asked for
    # megatron-core's experimental features (Megatron-LM's --enable-experimental): a process-wide flag, for this run only
    mcore_config.set_experimental_flag(cfg.dist.enable_megatron_core_experimental)
    initialize_distributed(cfg)
    set_random_seed(cfg.rng.seed)
    # megatron-core's MoE metrics tracker is a module global (moe_logging.py:46) whose per-layer tensors keep the size
    # of the first model that filled them: a second run in this process with more layers would fail (moe_logging.py:
    # 122). A new tracker for each run.
    destroy_moe_metrics_tracker()
    # The same for multi-token prediction's (a class attribute, multi_token_prediction.py:345): its "cumulative"
    # acceptance rate is this run's.
    MTPLossLoggingHelper.tracker.clear()
    state = GlobalState(cfg)
    model = []
    try:  # what setup opens (the metric writers, the signal handler, the model's groups) is closed if it fails
        state.checkpoint_manager  # made now: a custom manager class that cannot be used fails before the model
        # The writers open now, as Megatron's do: a tracker that cannot start fails before the model
        if state.writers is not None:
            print(f"> writing metrics to {', '.join(type(w).__name__ for w in state.writers.writers)}", flush=True)
        tokenizer = state.tokenizer = data.build_tokenizer(cfg)
        if cfg.downstream.eval_tasks:  # their documents read and prepared once, before the model
            state.downstream_tasks = downstream.build_tasks(cfg.downstream.eval_tasks.split(","))
        m = cfg.model
        vocab_size = data.embedding_rows(tokenizer)
        cfg.padded_vocab_size = calculate_padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by,
                                                            m.tensor_model_parallel_size, logging_enabled=False)
        if metrics.is_rank_0():
            checks.print_config(cfg)
        if cfg.train.exit_signal_handler:
            state.signal_handler = DistributedSignalHandler(cfg.train.exit_signal).__enter__()  # released at exit
        profiling.start_memory_history_recording(cfg.profiling)  # before the model: its allocations in the history
        model = build_model(cfg, vocab_size)
        if parallel_state.get_data_parallel_rank() == 0:
            print(f" > number of parameters on (tensor, pipeline) model parallel rank "
                  f"({parallel_state.get_tensor_model_parallel_rank()}, "
                  f"{parallel_state.get_pipeline_model_parallel_rank()}): "
                  f"{sum(p.numel() for chunk in model for p in chunk.parameters())}", flush=True)
        ck = cfg.checkpoint
        # In this order: weights the wrapped model does not read into the bare model (PEFT's base weights, an FSDP
        # run's start from torch_dist), then the adapters (all else frozen), then DDP or FSDP and the optimizer.
        if bare := checkpoint.bare_model_weights(cfg):
            checkpoint.load_checkpoint(state, model, None, None, bare, finetune=True)
        if cfg.peft.peft != "none":
            peft.apply_peft(cfg, model)
            trainable, total = peft.parameter_counts(model)
            cfg.trainable_fraction = trainable / total
            state.trainable_summary = peft.trainable_summary(trainable, total)
            print_rank_0(f" > {cfg.peft.peft}: {state.trainable_summary}, adapters of rank "
                         f"{cfg.peft.lora_dim} on {', '.join(cfg.peft.lora_target_modules)}")
        model = wrap_model(cfg, model)
        optimizer = build_optimizer(cfg, model, state.timers)
        if cfg.optimizer.optimizer not in ("adam", "sgd"):  # megatron-core's split between Muon (say) and Adam
            print_rank_0(who_updates_what(model, optimizer))
        scheduler = build_scheduler(cfg, optimizer)

        # Resume this run's own checkpoint if --load holds one; otherwise start from pretrained weights if given.
        state.checkpoint_manager.load(checkpoint.CheckpointLoadContext(state, model, optimizer, scheduler))
        state.start_step = state.train_state.step
        report_restart(cfg, state.start_step)
        state.num_microbatches_calculator.update(state.train_state.consumed_train_samples, consistency_check=True)
        state.start_floating_point_operations = state.train_state.floating_point_operations_so_far
        state.floating_point_operations_at_last_log = state.start_floating_point_operations
        if ck.save:
            metrics.append_to_progress_log(ck.save, "Starting job", cfg.world_size)
        iterators = data.build_data_iterators(cfg, tokenizer, state.train_state)
        ts = state.train_state
        ts.do_train = iterators[0] is not None and cfg.train.train_iters > 0  # what train_state.pt records
        ts.do_valid, ts.do_test = (it is not None and cfg.validation.eval_iters > 0 for it in iterators[1:])
        iterators = [one_iterator_per_chunk(it, len(model)) for it in iterators]
        iterators[0] = attach_rerun_state_machine(state, iterators[0])
        return state, model, optimizer, scheduler, iterators
    except BaseException:
        _close_what_setup_opened(state)
        empty_modules(model)  # a load that failed (a damaged checkpoint) leaves the model's groups to free
        raise


def empty_modules(model: list) -> None:
    """Every module of the chunks emptied. The model, optimizer and iterators hold the run's process groups in
    reference cycles, and a destroyed gloo group's I/O thread keeps polling until its object is freed (a process that
    runs again, a notebook, would gather polling threads run after run). Some cycles run through autograd's C++
    graph, which the collector cannot see: the distributed optimizer's shard views and the MoE dispatcher's routing
    tensors keep graphs that end in DDP's gradient hooks, and the hooks hold the DDP wrapper; Megatron FSDP's hooks
    hold its inner modules, with their buffers and meshes. An emptied module holds nothing."""
    for sub in [sub for chunk in model for sub in chunk.modules()]:
        sub.__dict__.clear()


def _close_what_setup_opened(state: GlobalState) -> None:
    """The metric writers (flushed) and the signal handler (the previous one back), at the end of a run or of a failed
    setup."""
    if state._writers is not None:
        state._writers.close()
    if state.signal_handler is not None:
        state.signal_handler.release()


def report_restart(cfg: ConfigContainer, step: int) -> None:
    """Under torchrun --max-restarts, one line saying which start of the worker group this is and where it resumed
    (torchrun's TORCHELASTIC_RESTART_COUNT, this node's count); at the first start, a warning when a restart could
    not resume: it continues from the newest checkpoint in --load, so --save and --load must name one directory."""
    restarts, attempt = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")), os.environ.get("TORCHELASTIC_RESTART_COUNT")
    ck = cfg.checkpoint
    if attempt not in (None, "0"):
        print_rank_0(f" restart {attempt} of torchrun --max-restarts {restarts}: "
                     + (f"resumed at iteration {step} from {ck.load}" if step else "no checkpoint published yet: "
                        "training from scratch"))
    elif restarts and not (ck.save and ck.load and os.path.abspath(ck.save) == os.path.abspath(ck.load)):
        print_rank_0(f"WARNING: torchrun --max-restarts {restarts} restarts this job from the newest checkpoint in "
                     f"--load, which must be where --save writes (now --save {ck.save}, --load {ck.load}): a restart "
                     f"would train from scratch")


def setup_logging(logging_level: Optional[int]) -> None:
    """Python logging for this script's and megatron-core's loggers: --logging-level, else
    $MEGATRON_LOGGING_LEVEL; with neither, Python's default stays (warnings only)."""
    env_level = os.environ.get("MEGATRON_LOGGING_LEVEL")
    level = logging_level if logging_level is not None else int(env_level) if env_level else None
    if level is None:
        return
    # megatron-core's loggers have no handler of their own: give the root one, as logging.basicConfig
    # does (a no-op when the application already configured logging), and let them inherit its level.
    logging.basicConfig(format="%(levelname)s:%(name)s:%(message)s")
    logging.getLogger().setLevel(level)
    if os.environ.get("RANK", "0") == "0":
        logging.getLogger(__name__).info(f"Setting logging level to {level}")


def apply_deterministic_mode(cfg: ConfigContainer) -> None:
    """--deterministic-mode (Bridge's `_validate_and_apply_deterministic_mode`; validate() already refused what
    cannot be deterministic).

    The environment defaults must be in place before NCCL builds its communicators, cuBLAS its handle
    and transformer-engine its first attention, so this runs first in setup(); values already set win.
    """
    if not cfg.model.deterministic_mode:
        return
    for name, value in DETERMINISM_ENV_VAR_DEFAULTS.items():
        os.environ.setdefault(name, value)
    torch.use_deterministic_algorithms(True)
    if os.environ.get("RANK", "0") == "0":
        print(" > deterministic mode: torch.use_deterministic_algorithms(True), "
              + ", ".join(f"{k}={os.environ[k]}" for k in DETERMINISM_ENV_VAR_DEFAULTS), flush=True)


class Scheduler(OptimizerParamScheduler):
    """megatron-core's scheduler, whose learning rate comes from schedules.LR_SCHEDULES when --lr-decay-style names
    one there: the seam for a schedule of your own (schedules.py says how)."""

    def get_lr(self, param_group: dict) -> float:
        schedule = schedules.LR_SCHEDULES.get(self.lr_decay_style)
        if schedule is None:
            return super().get_lr(param_group)
        return schedule(self.num_steps, self.lr_warmup_steps, self.lr_decay_steps, param_group.get("max_lr", self.max_lr),
                        param_group.get("min_lr", self.min_lr), self.init_lr)


def build_scheduler(cfg: ConfigContainer, optimizer) -> OptimizerParamScheduler:
    """megatron-core's scheduler; lengths are in samples (validate() converted them), stepped by the global batch."""
    s, o = cfg.scheduler, cfg.optimizer
    return Scheduler(
        optimizer, init_lr=s.lr_warmup_init, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=s.lr_warmup_steps,
        lr_decay_steps=s.lr_decay_steps, lr_decay_style=s.lr_decay_style, start_wd=s.start_weight_decay,
        end_wd=s.end_weight_decay, wd_incr_steps=s.wd_incr_steps, wd_incr_style=s.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=s.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=s.override_opt_param_scheduler, wsd_decay_steps=s.wsd_decay_steps,
        lr_wsd_decay_style=s.lr_wsd_decay_style,
    )


def one_iterator_per_chunk(iterator, num_chunks: int):
    """The interleaved schedule reads one data iterator per model chunk (virtual stage), each the same stream
    of microbatches: Megatron-LM builds one per chunk; here `itertools.tee` gives each chunk its own view of
    the one loader (every chunk reads every microbatch, so little is buffered)."""
    if num_chunks == 1 or iterator is None:
        return iterator
    return list(itertools.tee(iterator, num_chunks))


# ==================================================================================================
# 3. The run's state
# ==================================================================================================


class GlobalState:
    """Everything a run carries, passed explicitly (no process-global state): the config, the progress,
    the timers, the metric writers (created on first use, on the last rank only), the checkpoint manager (created on
    first use), the signal handler. A loop of one's own may make it directly and call the loop's functions on it."""

    def __init__(self, cfg: ConfigContainer):
        self.cfg = cfg
        self.train_state = TrainState()
        self.timers = Timers(cfg.logger.timing_log_level, cfg.logger.timing_log_option)
        self.start_time = time.time()
        self.signal_handler: Optional[DistributedSignalHandler] = None
        self.tokenizer = None  # set at setup; saved with every checkpoint
        self.start_step = 0  # where this job began (after a resume): throughput counts from here
        self.trainable_summary: Optional[str] = None  # PEFT: "trainable params: 0.52M / 3.85M (13.6%)"
        self.start_floating_point_operations = 0.0
        self.floating_point_operations_at_last_log = 0.0  # the log line's throughput: the interval's FLOPs
        self.exit_code: Optional[int] = None  # set when the loop stops early (signal, interval, NaN)
        self.last_saved_step: Optional[int] = None  # the newest checkpoint this job wrote or resumed: not saved twice
        self.async_calls_queue = None  # --async-save: the checkpoint writes in flight (checkpoint.py)
        self._checkpoint_manager = None
        self.straggler_timer = metrics.StragglerTimer(cfg.straggler.log_straggler)
        self.rerun_state_machine = None  # megatron-core's RerunStateMachine, set at setup
        self._writers = None
        self.num_microbatches_calculator = build_num_microbatches_calculator(cfg)  # follows --rampup-batch-size
        self.downstream_tasks = None  # --eval-tasks: lm-eval's tasks, built at setup (downstream.py)
        self.downstream_scored_at: Optional[int] = None  # the step they were last scored at: not twice at the end
        # --log-l2-norm-grad's norms of the last step, taken by train_step before the optimizer step (which clips)
        self.l2_norm_grad: Optional[dict] = None

    @property
    def num_microbatches(self) -> int:
        """Microbatches per rank in this iteration, from megatron-core's calculator: fewer while the batch size
        ramps up. The run's one count: the loop keeps no copy and the config none."""
        return self.num_microbatches_calculator.get()

    @property
    def current_global_batch_size(self) -> int:
        """The global batch size of this iteration: --global-batch-size, or less while it ramps up."""
        return self.num_microbatches_calculator.get_current_global_batch_size()

    @property
    def writers(self):
        """TensorBoard, W&B, MLflow and Comet behind one add_scalar (metrics.Writers), opened on first use on
        the last rank; None on other ranks and when none is configured."""
        if self._writers is None:
            self._writers = metrics.build_writers(self.cfg)
        return self._writers

    @property
    def checkpoint_manager(self):
        """Who saves and loads: checkpoint.py's manager or checkpoint.custom_manager_class's, made on first use (setup
        makes it before the model, so a bad class fails early; a loop of one's own gets it at its first save)."""
        if self._checkpoint_manager is None:
            self._checkpoint_manager = checkpoint.create_checkpoint_manager(self.cfg.checkpoint)
        return self._checkpoint_manager

    @checkpoint_manager.setter
    def checkpoint_manager(self, manager) -> None:
        self._checkpoint_manager = manager

    @property
    def tensorboard_logger(self):
        """The TensorBoard SummaryWriter itself, or None."""
        return self.writers.tensorboard if self.writers is not None else None


# ==================================================================================================
# 4. The loop
# ==================================================================================================


def train(forward_step_func, model, optimizer, scheduler, train_data_iterator, valid_data_iterator,
          global_state: GlobalState, checkpointing_context: Optional[dict] = None, process_non_loss_data_func=None,
          non_loss_data_func=None) -> None:
    """Train until --train-iters, evaluating every --eval-interval, logging every --log-interval,
    saving and exiting as checkpoint_and_decide_exit says. `checkpointing_context` is Bridge's signature (its
    checkpoint managers); nothing here reads it."""
    cfg, ts, timers = global_state.cfg, global_state.train_state, global_state.timers
    forward_step_func = prepare_forward_step_func(forward_step_func, global_state)
    forward_step_func = global_state.straggler_timer.wrap(forward_step_func, ts.step)  # only with --log-straggler
    for m in model:
        m.train()
    total_loss_dict, history_wct, report_memory_flag = {}, [], True
    # --overlap-param-gather: megatron DDP's forward pre-hooks stay off until a step has succeeded, so a bad
    # checkpoint or initialisation is not spread to every rank by the first all-gather (Megatron-LM, Bridge).
    should_toggle_forward_pre_hook = should_disable_forward_pre_hook(
        cfg.ddp.use_megatron_fsdp, cfg.optimizer.use_distributed_optimizer, cfg.ddp.overlap_param_gather)
    if should_toggle_forward_pre_hook:
        disable_forward_pre_hook(model, param_sync=False)
    prof, nsys_nvtx_context, flops_since_last_log = start_manual_gc_and_profiler(global_state), None, 0.0
    rank = torch.distributed.get_rank()
    print_rank_0(f" training from iteration {ts.step} to {cfg.train.train_iters} ...")
    timers("interval-time", log_level=0).start(barrier=True)

    while ts.step < cfg.train.train_iters:
        if cfg.checkpoint.async_save:  # publish a background save once every rank has written it
            global_state.checkpoint_manager.finalize_async_saves(global_state, blocking=False)
        _follow_batch_size_rampup(global_state, model, optimizer, scheduler, train_data_iterator)
        nsys_nvtx_context = profiling.handle_profiling_step(cfg.profiling, ts.step, rank, prof) or nsys_nvtx_context
        if _should_skip_and_handle_iteration(global_state, train_data_iterator):  # consumes a skipped step's data
            continue
        step = train_step(forward_step_func, train_data_iterator, model, optimizer, scheduler, global_state)
        if step.should_exit:  # a NaN: stop before counting the step, so nothing poisoned is saved
            save_before_rerun_exit(step.should_checkpoint, global_state, model, optimizer, scheduler)
            global_state.exit_code = step.exit_code
            break
        if should_toggle_forward_pre_hook and not step.skipped_iter and not forward_pre_hooks_enabled(model):
            enable_forward_pre_hook(model)  # the first step that succeeded (under fp16 the first ones may not)
        ts.step += 1
        batch_size = global_state.current_global_batch_size
        step_flops = metrics.num_floating_point_operations(cfg, batch_size, cfg.padded_vocab_size)
        ts.consumed_train_samples += batch_size
        ts.floating_point_operations_so_far += step_flops
        flops_since_last_log += step_flops
        history_wct.append(time.time() - global_state.start_time)  # this job's wall clock, per iteration

        # One report per iteration: the log line, TensorBoard and the trackers all read it (metrics.step_report).
        # Its time is the log interval's so far, as the log line's: the interval timer over the iterations it ran.
        # skip_train_metrics_log (Bridge's) leaves out all of it.
        if not cfg.logger.skip_train_metrics_log:
            interval = cfg.logger.log_interval
            in_interval = metrics.iterations_since_last_log(ts.step, global_state.start_step, interval)
            report = metrics.step_report(
                step.loss_dict, *logged_learning_rates(cfg, optimizer), batch_size, float(optimizer.get_loss_scale()),
                # (a lone megatron-core mixed-precision optimizer, Megatron FSDP's, returns 0 when it did not count)
                step.grad_norm, step.num_zeros_in_grad if cfg.logger.log_num_zeros_in_grad else None,
                metrics.calc_params_l2_norm(model, use_megatron_fsdp=cfg.ddp.use_megatron_fsdp)
                if cfg.logger.log_params_norm else None,
                timers("interval-time").elapsed(reset=False) / in_interval,
                moe_losses=metrics.moe_auxiliary_losses(cfg, global_state.num_microbatches),
                mtp_metrics=metrics.multi_token_prediction_metrics(cfg, global_state.num_microbatches))
            report_memory_flag = metrics.log_step(report, total_loss_dict, report_memory_flag, step.skipped_iter,
                                                  global_state, history_wct, model, l2_norm_grad=global_state.l2_norm_grad)
        evaluate_at_intervals(global_state, forward_step_func, valid_data_iterator, model, process_non_loss_data_func,
                              non_loss_data_func)
        flops_since_last_log = post_training_step_callbacks(model, flops_since_last_log, global_state.straggler_timer,
                                                            ts.step, prof, cfg, should_toggle_forward_pre_hook,
                                                            nsys_nvtx_context)
        if checkpoint_and_decide_exit(global_state, model, optimizer, scheduler, ts.floating_point_operations_so_far,
                                      None, train_data_iterator):
            break
    if forward_pre_hooks_enabled(model):
        disable_forward_pre_hook(model)  # gather the final parameters for the final save and evaluation
    stop_manual_gc_and_profiler(global_state, prof, nsys_nvtx_context)


def evaluate_at_intervals(global_state: GlobalState, forward_step_func, valid_data_iterator, model,
                          process_non_loss_data_func=None, non_loss_data_func=None) -> None:
    """The validation loss every --eval-interval and the downstream tasks every --eval-tasks-interval: outside
    training's time (the interval timer stops), on the gathered, current parameters (the forward pre-hooks paused)."""
    cfg, ts, timers = global_state.cfg, global_state.train_state, global_state.timers
    validate = cfg.validation.eval_iters and valid_data_iterator is not None and ts.step % cfg.validation.eval_interval == 0
    score = global_state.downstream_tasks and ts.step % downstream_interval(cfg) == 0
    if not (validate or score):
        return
    timers("interval-time").stop()
    with forward_pre_hooks_paused(model):
        if validate:
            collect_garbage_around_eval(cfg, after=False)
            evaluate_and_print_results(global_state, f"iteration {ts.step}", forward_step_func, valid_data_iterator,
                                       model, cfg, process_non_loss_data_func=process_non_loss_data_func,
                                       non_loss_data_func=non_loss_data_func)
            collect_garbage_around_eval(cfg, after=True)
        if score:
            score_downstream_tasks(global_state, model)
    timers("interval-time", log_level=0).start(barrier=True)


def logged_learning_rates(cfg, optimizer) -> tuple:
    """(the learning rate, the --decoupled-lr groups' or None): megatron-core's canonical one is the first group
    of the default schedule (get_canonical_lr_for_logging), whichever order the groups are in."""
    groups = optimizer.param_groups
    canonical = get_canonical_lr_for_logging(groups)
    decoupled = next((g["lr"] for g in groups if not g.get("default_config", True)), None)
    return (groups[0]["lr"] if canonical is None else canonical), (decoupled if cfg.optimizer.decoupled_lr else None)


def _should_skip_and_handle_iteration(global_state: GlobalState, train_data_iterator) -> bool:
    """If the next iteration is in --iterations-to-skip (numbered as in the log line), consume its data
    without a step and count it as skipped, so the samples after it stay where they would have been."""
    cfg, ts = global_state.cfg, global_state.train_state
    if ts.step + 1 not in (cfg.train.iterations_to_skip or ()):
        return False
    _dummy_train_step(global_state, train_data_iterator)
    ts.step += 1
    ts.consumed_train_samples += global_state.current_global_batch_size
    ts.skipped_train_samples += global_state.current_global_batch_size
    print_rank_0(f" skipped iteration {ts.step} as asked (--iterations-to-skip): its data consumed, no step taken")
    return True


def _dummy_train_step(global_state: GlobalState, train_data_iterator) -> None:
    """Draw (and drop) this rank's microbatches of one global batch, inside the rerun state machine's loop
    (a RerunDataIterator still replaying the last step moves on to fresh data)."""
    iterators = train_data_iterator if isinstance(train_data_iterator, list) else [train_data_iterator]
    while global_state.rerun_state_machine.should_run_forward_backward(train_data_iterator):
        for _ in range(global_state.num_microbatches):
            for iterator in iterators:
                next(iterator)


def _finish_train(global_state: GlobalState) -> None:
    """Flush and close what the run opened; leave the process able to start another run."""
    _close_what_setup_opened(global_state)
    mcore_rerun.destroy_rerun_state_machine()
    mcore_config.set_experimental_flag(False)  # megatron-core's default
    checkpoint.restore_write_results_queue()  # megatron-core's async writer's, as it was before the run
    destroy_distributed()


# ==================================================================================================
# 5. Around each step: batch-size ramp-up, forward pre-hooks, garbage collection, profiling
# ==================================================================================================


def build_num_microbatches_calculator(cfg: ConfigContainer):
    """megatron-core's microbatch calculator (`num_microbatches_calculator`): constant, or stepping up with
    --rampup-batch-size START INCR SAMPLES. megatron-core 0.18 dropped its linear ramp-up calculator (a
    `rampup_batch_size` argument is now ignored with a warning) for `StepBatchsizeNumMicroBatchesCalculator`, which
    takes a "THRESHOLD:BS ..." schedule: the ramp is given to it as the steps it always was (see
    `rampup_step_schedule`). The GlobalState holds it; megatron-core's `init_num_microbatches_calculator` would keep
    it in a module global instead."""
    from megatron.core.num_microbatches_calculator import (ConstantNumMicroBatchesCalculator,
                                                           StepBatchsizeNumMicroBatchesCalculator)

    t, dp = cfg.train, cfg.data_parallel_size
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if t.rampup_batch_size is None:
        return ConstantNumMicroBatchesCalculator(t.global_batch_size, t.micro_batch_size, dp, False, rank)
    schedule = rampup_step_schedule(*t.rampup_batch_size, t.global_batch_size)
    return StepBatchsizeNumMicroBatchesCalculator(t.micro_batch_size, dp, False, rank, schedule)  # thresholds: samples


def samples_of_iteration(cfg: ConfigContainer, iteration: int) -> range:
    """The global sample indices iteration `iteration` (from 1) reads: it starts where the iterations before it
    ended, and takes the global batch megatron-core's calculator gives for the samples consumed so far (less than
    --global-batch-size during --rampup-batch-size), so iteration N is not N x the global batch under ramp-up. An
    fp16 overflow skips the update, not the batch: the iteration still consumes its samples (consumed_train_samples
    counts them), and the scheduler, which counts the updates' samples only, is behind by the skipped ones
    (skipped_train_samples). Data-parallel rank r reads its share of each microbatch's rows (megatron-core's
    sampler)."""
    calculator, consumed = build_num_microbatches_calculator(cfg), 0
    for _ in range(iteration):
        calculator.update(consumed, consistency_check=False)
        start, consumed = consumed, consumed + calculator.get_current_global_batch_size()
    return range(start, consumed)


def rampup_step_schedule(start: int, increment: int, samples: int, global_batch_size: int) -> str:
    """Megatron-LM's --rampup-batch-size START INCR SAMPLES as a step schedule ("THRESHOLD:BS ...", in samples).

    The ramp (megatron-core <= 0.17's RampupBatchsizeNumMicroBatchesCalculator, arguments.py's help): the batch
    grows from START by INCR in (GBS - START) / INCR increments spread over SAMPLES consumed samples; after
    `consumed` samples it is START + int(consumed / (SAMPLES / increments)) * INCR, and GBS past SAMPLES. Step k's
    threshold is the first whole sample count at which that float expression reaches k, found as that expression
    computes it (so 10 samples over 3 increments steps at 4, 7 and 11, as the ramp did: 10 / (10 / 3) is 2.999...)."""
    increments = (global_batch_size - start) // increment
    per_increment = samples / increments
    steps = [f"0:{start}"]
    for k in range(1, increments + 1):
        threshold = math.ceil(k * per_increment)
        while int(threshold / per_increment) < k:  # float rounding below k: one sample later
            threshold += 1
        while threshold > 0 and int((threshold - 1) / per_increment) >= k:
            threshold -= 1
        threshold = min(threshold, samples + 1)  # past SAMPLES the ramp is over whatever the division says
        steps.append(f"{threshold}:{start + k * increment}")
    return " ".join(steps)


def _follow_batch_size_rampup(global_state: GlobalState, model, optimizer, scheduler, train_data_iterator) -> None:
    """Before each iteration: set the
    microbatch count for the samples consumed so far; when it grows (a ramp-up step), first save a
    checkpoint (with --save), as they do."""
    calculator, ts, cfg = global_state.num_microbatches_calculator, global_state.train_state, global_state.cfg
    before = calculator.get_current_global_batch_size()
    calculator.update(ts.consumed_train_samples, consistency_check=True)
    after = calculator.get_current_global_batch_size()
    if after != before and ts.step != 0:
        assert after > before, "the batch size only grows during ramp-up"
        print_rank_0(f" ramping up global batch size from {before} to {after} after iteration {ts.step} "
                     f"({ts.consumed_train_samples} samples consumed)")
        if cfg.checkpoint.save and global_state.last_saved_step != ts.step:
            save_checkpoint_and_time(global_state, model, optimizer, scheduler, ts.floating_point_operations_so_far,
                                     train_data_iterator=train_data_iterator)


def should_disable_forward_pre_hook(use_megatron_fsdp: bool, use_distributed_optimizer: bool,
                                    overlap_param_gather: bool) -> bool:
    """Whether megatron DDP's forward pre-hooks are in play and must be switched off for the first
    step, evaluation and saves: with the distributed optimizer and --overlap-param-gather (not under FSDP)."""
    return not use_megatron_fsdp and use_distributed_optimizer and overlap_param_gather


def forward_pre_hooks_enabled(model: list) -> bool:
    """Whether megatron DDP's forward pre-hooks are on (its own record of their handles)."""
    return any(getattr(chunk, "remove_forward_pre_hook_handles", None) for chunk in model)  # (Megatron FSDP: none)


@contextlib.contextmanager
def forward_pre_hooks_paused(model: list):
    """Forward pre-hooks off (parameters gathered) for the duration of an evaluation or save, then back on;
    nothing to do when they are not on (no --overlap-param-gather, before the first step, after train)."""
    paused = forward_pre_hooks_enabled(model)
    if paused:
        disable_forward_pre_hook(model)
    try:
        yield
    finally:
        if paused:
            enable_forward_pre_hook(model)


def post_training_step_callbacks(model: list, num_floating_point_operations_since_last_log_event: float,
                                 straggler_timer: metrics.StragglerTimer, iteration: int,
                                 prof: Optional[torch.profiler.profile], config: ConfigContainer,
                                 should_toggle_forward_pre_hook: bool, nsys_nvtx_context=None) -> float:
    """Run all post-training-step functions, in this order:

    1. every --log-interval with --log-straggler: every rank's forward-step time, gathered; rank 0 prints the report;
    2. at --profile-step-end: stop the profiler (and dump the CUDA memory snapshot of --record-memory-history);
    3. every --manual-gc-interval with --manual-gc: a full garbage collection, at the same iteration on every rank.

    Returns the FLOPs counted since the last straggler report: 0 after a report (as Megatron-LM's version does, so
    the caller keeps the reset). `model` and `should_toggle_forward_pre_hook` are Bridge's signature: they serve
    Bridge's weight-hash check, which this loop does not run.
    """
    if config.straggler.log_straggler and iteration % config.logger.log_interval == 0:
        for line in straggler_timer.report(num_floating_point_operations_since_last_log_event, iteration,
                                           config.straggler.straggler_minmax_count):
            print_rank_0(line)
        num_floating_point_operations_since_last_log_event = 0.0
    profiling.handle_profiling_stop(config.profiling, iteration, torch.distributed.get_rank(), prof, nsys_nvtx_context)
    if config.train.manual_gc and config.train.manual_gc_interval and iteration % config.train.manual_gc_interval == 0:
        gc.collect()
    return num_floating_point_operations_since_last_log_event


def start_manual_gc_and_profiler(state: GlobalState) -> Optional[torch.profiler.profile]:
    """What train() sets up before its first step: with --manual-gc, turn the automatic garbage
    collector off and start clean; with --nvtx-ranges, switch on megatron-core's NVTX ranges (and this file's);
    with --use-pytorch-profiler on a profiled rank, start the profiler (returned)."""
    cfg = state.cfg
    if cfg.train.manual_gc:
        # Python collects when allocation counts cross a threshold: at a different moment on each rank, and a rank
        # paused in a full collection makes all others wait at the next collective. By hand, every rank pauses together.
        gc.disable()
        gc.collect()
    if cfg.profiling.nvtx_ranges:
        configure_nvtx_profiling(True)
    p = cfg.profiling
    if not (p.use_pytorch_profiler and profiling.should_profile_rank(p, torch.distributed.get_rank())):
        return None
    prof = profiling.initialize_pytorch_profiler(p, cfg.logger.tensorboard_dir, state.train_state.step)
    if prof is not None:
        prof.start()
    return prof


def stop_manual_gc_and_profiler(state: GlobalState, prof, nsys_nvtx_context) -> None:
    """After the loop: close a profiling window the run ended inside (its trace is still written), and give the
    process back its automatic garbage collector and NVTX setting (pretrain() may be called again from Python)."""
    cfg = state.cfg
    if state.train_state.step < cfg.profiling.profile_step_end:
        profiling.handle_profiling_stop(cfg.profiling, cfg.profiling.profile_step_end, torch.distributed.get_rank(), prof,
                              nsys_nvtx_context)
    if cfg.profiling.nvtx_ranges:
        configure_nvtx_profiling(False)
    if cfg.profiling.record_memory_history and profiling.should_profile_rank(cfg.profiling, torch.distributed.get_rank()):
        torch.cuda.memory._record_memory_history(enabled=None)
    if cfg.train.manual_gc:
        gc.enable()


def collect_garbage_around_eval(cfg: ConfigContainer, after: bool) -> None:
    """With --manual-gc (and no --no-manual-gc-eval): a full collection before each evaluation, and after it
    a collection of the youngest generation, where what evaluation made lives."""
    if cfg.train.manual_gc and cfg.train.manual_gc_eval:
        gc.collect(generation=0 if after else 2)


# ==================================================================================================
# 6. One training step
# ==================================================================================================


def train_step(forward_step_func, data_iterator, model, optimizer, scheduler, global_state: GlobalState) -> TrainStepResult:
    """One optimizer step over the microbatches of a global batch."""
    cfg, timers = global_state.cfg, global_state.timers
    forward_backward_func = get_forward_backward_func(model, optimizer, timers)
    nvtx_range_push("forward-backward")  # NVTX ranges: no-ops unless --nvtx-ranges
    losses = forward_backward_with_reruns(forward_backward_func, forward_step_func, data_iterator, model, optimizer,
                                          global_state)
    nvtx_range_pop("forward-backward")
    should_checkpoint, should_exit, exit_code = global_state.rerun_state_machine.should_checkpoint_and_exit()
    if should_exit:  # validate_results mode: a rejected result, rerun and attributed; no update
        report_rerun_verdict(global_state, exit_code)
        return TrainStepResult({}, 1, should_checkpoint, should_exit, exit_code, None, None)
    loss_dict = reduce_losses(losses) if parallel_state.is_pipeline_last_stage() else {}
    if cfg.train.check_for_nan_in_loss_and_grad and nonfinite_on_any_rank(global_state, loss_dict):
        return TrainStepResult({}, 1, False, True, 1, None, None)  # no update: nothing poisoned to save
    # --log-l2-norm-grad's norms before the step clips (and, where it is the same tensor, unscales) the gradients
    global_state.l2_norm_grad = metrics.report_l2_norm_grad(model, float(optimizer.get_loss_scale())) if \
        metrics.l2_norm_grad_due(cfg, global_state.train_state.step + 1) else None
    nvtx_range_push("optimizer")
    timers("optimizer", log_level=1).start(barrier=False)
    update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
    timers("optimizer").stop()
    nvtx_range_pop("optimizer")
    # Bridge: model-parallel ranks agree whether the step succeeded (one failing, or frozen, rank makes all skip),
    # and the grad norm is the max over them (ranks without trainable parameters have none).
    if cfg.train.check_optimizer_step_success:
        update_successful = logical_and_across_model_parallel_group(update_successful)
    if not cfg.train.skip_sync_grad_norm_across_mp:
        grad_norm = reduce_max_stat_across_model_parallel_group(grad_norm)
    # The scheduler counts samples: an overflowed (skipped) step does not advance it.
    skipped_iter = 0 if update_successful else 1
    if update_successful:
        scheduler.step(increment=global_state.current_global_batch_size)
    return TrainStepResult(loss_dict, skipped_iter, False, False, 0, grad_norm, num_zeros_in_grad)


def nonfinite_on_any_rank(global_state: GlobalState, loss_dict: dict) -> bool:
    """--check-for-nan-in-loss-and-grad, before the optimizer step: whether any rank has a NaN or Inf reduced loss
    (only the last stage knows the loss, and a scalar report is each rank's own) or gradient (megatron-core DDP's
    bucket check, which the rerun state machine keeps: model.RerunStateMachine.validate_result). Every rank learns
    it; the first rank that saw one says what (the loss first), in one line."""
    machine = global_state.rerun_state_machine
    seen = [f"{key} is NaN or Inf" for key, value in loss_dict.items() if not math.isfinite(float(value))]
    seen += [machine.unhandled_rejection] if machine.unhandled_rejection else []
    machine.unhandled_rejection = None
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    first = torch.tensor([rank if seen else world_size], device=device.current())
    torch.distributed.all_reduce(first, op=torch.distributed.ReduceOp.MIN)
    if first.item() == rank:
        print(f"error: {seen[0]} at iteration {global_state.train_state.step + 1} on rank {rank}; stopping "
              f"before the optimizer step, without saving this iteration: the newest checkpoint is the last good one "
              f"(lower --lr, raise --clip-grad or check the data)", flush=True)
    return first.item() < world_size


class TrainStepResult(NamedTuple):
    """What train_step returns: Bridge's 7-tuple, with names."""

    loss_dict: dict  # reduced losses, on the last pipeline stage ({} elsewhere or when no update was made)
    skipped_iter: int  # 1 when the optimizer skipped the update (fp16 overflow, a failed step on any rank)
    should_checkpoint: bool  # the rerun state machine asks for a checkpoint before exiting
    should_exit: bool
    exit_code: int
    grad_norm: Optional[float]
    num_zeros_in_grad: Optional[int]


def reduce_losses(losses_per_microbatch: list) -> dict:
    """Reduce the loss functions' reports (Bridge train_step, train.py:993-996; Megatron-LM's train_step and evaluate).

    `[sum, count]` pairs: summed over microbatches and data-parallel ranks, then sum / count (token-weighted mean).
    Scalars (the legacy pattern): this rank's mean over its microbatches (the last rank's is what the log prints).
    """
    if not losses_per_microbatch:
        return {}
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    reduced = {}
    for key in losses_per_microbatch[0]:
        values = [torch.as_tensor(x[key], device=device.current()).detach().float().view(-1) for x in losses_per_microbatch]
        if values[0].numel() == 2:
            total = torch.stack(values).sum(dim=0)
            torch.distributed.all_reduce(total, group=group)
            reduced[key] = total[0] / total[1]
        else:
            reduced[key] = torch.cat(values).mean()
    return reduced


# ==================================================================================================
# 6b. Result validation: megatron-core's rerun state machine
# ==================================================================================================


def attach_rerun_state_machine(state: GlobalState, train_data_iterator):
    """Build the run's RerunStateMachine (--rerun-mode) and, unless it is disabled, wrap the training data
    in megatron-core's RerunDataIterator, which keeps a step's microbatches so a rerun reads the same ones."""
    state.rerun_state_machine = build_rerun_state_machine(state.cfg)
    if state.cfg.rerun_state_machine.rerun_mode == "disabled" or train_data_iterator is None:
        return train_data_iterator
    if isinstance(train_data_iterator, list):  # one per virtual pipeline stage
        return [mcore_rerun.RerunDataIterator(it) for it in train_data_iterator]
    return mcore_rerun.RerunDataIterator(train_data_iterator)


def forward_backward_with_reruns(forward_backward_func, forward_step_func, data_iterator, model, optimizer,
                                 global_state: GlobalState) -> list:
    """Bridge train_step's `while rerun_state_machine.should_run_forward_backward(...)`: zero the gradients
    and run forward/backward over the step's microbatches once, and again when the machine asks for a
    rerun (a rejected result under validate_results; every step under report_determinism_stats), with
    the RNG states and the microbatches of the first run. Returns the last run's per-microbatch reports."""
    cfg = global_state.cfg
    machine = global_state.rerun_state_machine
    machine.current_iteration = global_state.train_state.step  # it counts steps itself: keep the log line's numbers
    forward_step_func = validated_forward_step(forward_step_func, machine, cfg.rerun_state_machine)
    losses = []
    while machine.should_run_forward_backward(data_iterator):
        zero_grad(model, optimizer)
        # timed as "forward-backward" by megatron-core's schedule itself (schedules.py:736), through config.timers
        losses = forward_backward_func(
            forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
            num_microbatches=global_state.num_microbatches, seq_length=cfg.model.seq_length,
            micro_batch_size=cfg.train.micro_batch_size, decoder_seq_length=cfg.model.seq_length, forward_only=False,
        )
    return losses


def validated_forward_step(forward_step_func, machine, rerun_config) -> Callable:
    """The forward step with its loss function wrapped to validate each microbatch's loss through the
    machine (Bridge's `validate_local_loss`, for any loss function):
      - validate_results: NaN and Inf (fatal: the step is rerun, then the run stops);
      - any mode but report_determinism_stats, with --check-for-spiky-loss: a spiky loss (a warning);
      - report_determinism_stats: every loss, compared with its rerun's.
    The per-token loss is validated (loss_sum / num_tokens for the token-weighted pattern), so a microbatch
    with more tokens is not taken for a spike. In disabled mode NaN is train_step's per-step check."""
    mode = machine.get_mode()
    compare = mode == mcore_rerun.RerunMode.REPORT_DETERMINISM_STATS
    check_nan = rerun_config.check_for_nan_in_loss and mode == mcore_rerun.RerunMode.VALIDATE_RESULTS
    check_spiky = rerun_config.check_for_spiky_loss and not compare
    if not (compare or check_nan or check_spiky):
        return forward_step_func

    is_spiky = spiky_loss_check(machine, rerun_config.spiky_loss_factor)

    def validate(outputs):
        loss = outputs[0].detach().float()
        if len(outputs) == 3:
            loss = loss / torch.clamp(outputs[1].detach(), min=1)
        if compare:
            machine.validate_result(loss, rejection_func=lambda _: False, message="loss")
        if check_nan:
            for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
                machine.validate_result(loss, rejection_func=reject, message=f"found {what} in local forward loss "
                                        f"calculation", tolerance=0.0, fatal=True)  # forward passes are deterministic
        if check_spiky:
            machine.validate_result(loss, rejection_func=is_spiky, message="Spiky loss", tolerance=0.0, fatal=False)

    def forward_step_with_validation(data_iterator, model):
        output, loss_func = forward_step_func(data_iterator, model)

        def validated_loss_func(output_tensor, *args, **kwargs):
            outputs = loss_func(output_tensor, *args, **kwargs)
            if not kwargs.get("non_loss_data"):
                validate(outputs)
            return outputs
        return output, validated_loss_func
    return forward_step_with_validation


def spiky_loss_check(machine, factor: float) -> Callable:
    """megatron-core's `is_unexpectedly_large` (a loss at least `factor` times the largest of the first 100
    validated) for one step, printing a warning that names the iteration at the step's first spike."""
    warned = False

    def is_spiky(loss: torch.Tensor) -> bool:
        nonlocal warned
        spiky = machine.is_unexpectedly_large(loss, threshold=factor, context="loss")
        if spiky and not warned:
            warned = True
            print(f" warning: spiky loss at iteration {machine.current_iteration} on rank {torch.distributed.get_rank()}: "
                  f"{loss.item():.6E} is at least {factor:g} x {machine.max_values['loss']:.6E}, the largest of the "
                  f"first 100 losses (--spiky-loss-factor); training goes on", flush=True)
        return spiky
    return is_spiky


def report_rerun_verdict(global_state: GlobalState, exit_code: int) -> None:
    """Say, on the rank that saw it, what the rerun found: megatron-core's exit code 16
    (EXIT_CODE_RESUME_TO_DISAMBIGUATE) when the rerun reproduced the result, 17 when it did not."""
    machine, r = global_state.rerun_state_machine, global_state.cfg.rerun_state_machine
    call = machine.failed_validation_call
    if call is None:  # the fault was on another rank, which reports it
        return
    injected = f", injected by --error-injection-rate {r.error_injection_rate}" if r.error_injection_rate else ""
    value = "grad norm" if "grad" in call.caller.message else "loss"  # DDP's gradient check, or the loss function's
    what = (f"error: {call.caller.message} at iteration {machine.current_iteration} on rank "
            f"{torch.distributed.get_rank()} ({value} {float(machine.initial_result):.6g}{injected})")
    if exit_code == mcore_rerun.EXIT_CODE_RESUME_TO_DISAMBIGUATE:
        verdict = ("the rerun of the step reproduced it, so it is no transient hardware fault: look at the data, the "
                   "learning rate or the numerics (lower --lr, raise --clip-grad)")
    else:
        verdict = "the rerun of the step did not reproduce it: a transient fault, suspect the hardware"
    print(f"{what}; {verdict}; stopping with exit code {exit_code}", flush=True)


def save_before_rerun_exit(should_checkpoint: bool, state: GlobalState, model, optimizer, scheduler) -> None:
    """When the rerun state machine stops the run, save the last good iteration (the rejected step made no
    update) unless it is saved already, as Megatron does 'if further examination is needed'."""
    ts = state.train_state
    if should_checkpoint and state.cfg.checkpoint.save and state.last_saved_step != ts.step:
        save_checkpoint_and_time(state, model, optimizer, scheduler, ts.floating_point_operations_so_far)


# ==================================================================================================
# 7. The forward step: the API (Megatron Bridge `train_utils`) and the default, GPT language modelling
# ==================================================================================================


def needs_global_state_injection(forward_step_func: Callable) -> bool:
    """Whether forward_step_func wants the GlobalState as its first argument.

    1. Any parameter annotated `GlobalState` (the class, or the string under postponed annotations).
    2. Otherwise, a first parameter named `state` or `global_state`.
    Functors are inspected through their `__call__` (inspect.signature does that and drops `self`).
    """
    params = list(inspect.signature(forward_step_func).parameters.values())
    for p in params:
        annotation = p.annotation
        name = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
        if annotation is GlobalState or name.split(".")[-1] == "GlobalState":
            return True
    return bool(params) and params[0].name in ("state", "global_state")


def maybe_inject_state(forward_step_func: Callable, state: GlobalState, needs_injection: Optional[bool] = None) -> Callable:
    """`functools.partial(forward_step_func, state)` if it wants the state, else forward_step_func itself.

    The partial keeps a reference to the state, not a copy: later changes (the step count) are seen.
    """
    if needs_injection is None:
        needs_injection = needs_global_state_injection(forward_step_func)
    return functools.partial(forward_step_func, state) if needs_injection else forward_step_func


def prepare_forward_step_func(forward_step_func: Callable, state: GlobalState) -> Callable:
    """Inspect once and inject if needed: call at the start of train() or evaluate(), not per step."""
    return maybe_inject_state(forward_step_func, state, needs_global_state_injection(forward_step_func))


def get_batch(data_iterator):
    """Next microbatch, on this rank's device: tokens, labels, loss mask, attention mask (None: causal), position ids.
    Under context parallelism every rank of a CP group reads the same microbatch, and megatron-core's
    `get_batch_on_this_cp_rank` keeps this rank's two chunks of the sequence (see model.SDPAttention). It is given
    the CP group: from megatron-core 0.19 a `cp_group` of None means the whole world (utils.py:2483), which would cut
    a TP=2 or DP=2 run's sequences in half without a word."""
    batch = device.to_device(next(data_iterator))
    keys = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
    batch = get_batch_on_this_cp_rank({key: batch.get(key) for key in keys}, is_hybrid_cp=False,
                                      cp_group=parallel_state.get_context_parallel_group())
    return tuple(batch[key] for key in keys)


def masked_token_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor, *, z_loss: bool = False):
    """The token-aware loss pattern (loss_sum, num_tokens, report).

    The report is a `[sum, count]` pair, so train_step can average over every token of every
    microbatch and data-parallel rank, weighting each by its number of tokens. The per-token losses are flattened
    whatever their shape, as Bridge's are. `z_loss`: they are model.GPTModelWithZLoss's [b, s, 2], cross-entropy and
    z-loss per token, added for the backward pass and reported apart. The caller says so (forward_step, from
    --z-loss-coeff) rather than the shape: a plain loss tensor can have a last dimension of 2 too.
    """
    # reshape where Bridge has view: the same on contiguous losses, and a slice of a tensor flattens too
    mask = loss_mask.reshape(-1).float()
    num_tokens = mask.sum().to(torch.int)
    count = num_tokens.detach().float().view(1)
    if z_loss:
        lm_loss, z = (torch.sum(terms.reshape(-1) * mask) for terms in output_tensor.float().unbind(-1))
        return (lm_loss + z, num_tokens, {"lm loss": torch.cat([lm_loss.detach().view(1), count]),
                                          "z loss": torch.cat([z.detach().view(1), count])})
    loss = torch.sum(output_tensor.float().reshape(-1) * mask)
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), count])}


def global_token_losses(per_microbatch: list) -> torch.Tensor:
    """A global batch's per-token losses as one process has them, `[global batch, seq]`, from this rank's: its
    microbatches' `[micro batch, seq / CP]` in the order they ran (a loss function's output_tensor, on the last
    pipeline stage, where every rank calls it: it gathers over the CP and DP groups). CP: rank r holds chunks r and
    2 x CP - 1 - r of each sequence (megatron-core's get_batch_on_this_cp_rank), put back in order. DP: of each
    microbatch's micro batch x DP rows, rank r read rows r x micro batch onwards (megatron-core's
    MegatronPretrainingSampler), so the ranks' rows interleave per microbatch. TP: every rank has them whole
    (vocab-parallel cross-entropy)."""
    local = torch.stack([t.detach().reshape(t.shape[0], -1) for t in per_microbatch])  # [M, mbs, s / CP]
    cp_group = parallel_state.get_context_parallel_group()
    if cp_group.size() > 1:
        local = gather_context_parallel_chunks(local.permute(2, 0, 1).contiguous(), cp_group).permute(1, 2, 0)
    dp_group = parallel_state.get_data_parallel_group()
    rows = [torch.empty_like(local) for _ in range(dp_group.size())]
    torch.distributed.all_gather(rows, local.contiguous(), group=dp_group)
    return torch.stack(rows, dim=1).reshape(-1, local.shape[-1])  # [M, DP, mbs, s]: the samples' order


def forward_step(state: GlobalState, data_iterator, model, return_schedule_plan: bool = False):
    """The default GPT step: a batch in, per-token losses out, and the loss function.
    `return_schedule_plan` is Bridge's signature (MoE overlap in Bridge); a dense GPT has no plan."""
    timers = state.timers
    timers("batch-generator", log_level=2).start()
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    timers("batch-generator").stop()
    # GPTModel returns per-token losses given labels; the loss mask is for multi-token prediction's losses
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    # The same setting that makes model.build_model build GPTModelWithZLoss, whose losses are a [b, s, 2] pair
    return output, functools.partial(masked_token_loss, loss_mask, z_loss=bool(state.cfg.model.z_loss_coeff))


# ==================================================================================================
# 8. Evaluation
# ==================================================================================================


def evaluate_and_print_results(state: GlobalState, prefix: str, forward_step_func, data_iterator, model,
                               config: ConfigContainer, verbose: bool = False, write_to_tensorboard: bool = True,
                               process_non_loss_data_func=None, non_loss_data_func=None) -> dict:
    """Evaluate, then print Megatron's validation block (loss and PPL) and write it to TensorBoard."""
    losses, collected = evaluate(state, forward_step_func, data_iterator, model, process_non_loss_data_func,
                                    config, verbose, non_loss_data_func)
    writer = state.writers if write_to_tensorboard else None
    ts = state.train_state
    metrics.log_evaluation(prefix, losses, ts.step, ts.consumed_train_samples, writer,
                           config.logger.log_validation_ppl_to_tensorboard)
    if process_non_loss_data_func is not None and collected is not None and metrics.is_last_rank():
        process_non_loss_data_func(collected, ts.step, state.tensorboard_logger if write_to_tensorboard else None)
    return losses


def downstream_interval(cfg: ConfigContainer) -> int:
    return cfg.downstream.eval_tasks_interval or cfg.validation.eval_interval


def score_downstream_tasks(state: GlobalState, model) -> None:
    """--eval-tasks on the live model: lm-eval's figures (downstream.py), a block beside the validation block and a
    TensorBoard tag each (`hellaswag/acc_norm`), at the step."""
    step, d = state.train_state.step, state.cfg.downstream
    samples = os.path.join(d.eval_tasks_samples_dir, f"iter_{step:07d}") if d.eval_tasks_samples_dir else None
    rows = downstream.evaluate_tasks(model, state.tokenizer, state.cfg, state.downstream_tasks, d.eval_tasks_limit,
                                     samples)
    downstream.log_tasks(f"iteration {step}", rows, step, state.writers)
    state.downstream_scored_at = step


def evaluate(state: GlobalState, forward_step_func, data_iterator, model, process_non_loss_data_func,
             config: ConfigContainer, verbose: bool = False, non_loss_data_func=None):
    """Forward-only over --eval-iters global batches of the full --global-batch-size (also during ramp-up).
    Returns (losses, collected non-loss data)."""
    forward_step_func = prepare_forward_step_func(forward_step_func, state)
    for m in model:
        m.eval()
    reports = []
    forward_backward_func = get_forward_backward_func(model, None)
    t = config.train  # batches of the full global batch size, also during ramp-up
    eval_num_microbatches = t.global_batch_size // (t.micro_batch_size * config.data_parallel_size)
    with torch.no_grad():
        for i in range(config.validation.eval_iters):
            if verbose:
                print_rank_0(f" evaluating iteration {i + 1}/{config.validation.eval_iters}")
            reports += forward_backward_func(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                num_microbatches=eval_num_microbatches, seq_length=config.model.seq_length,
                micro_batch_size=config.train.micro_batch_size, decoder_seq_length=config.model.seq_length,
                forward_only=True,
            )
            state.train_state.consumed_valid_samples += config.train.global_batch_size
        collected = None
        if non_loss_data_func is not None:
            collected = non_loss_data_func(model)
        elif process_non_loss_data_func is not None:
            collected = forward_backward_func(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=model, num_microbatches=1,
                seq_length=config.model.seq_length, micro_batch_size=config.train.micro_batch_size,
                decoder_seq_length=config.model.seq_length, forward_only=True, collect_non_loss_data=True,
            )
    for m in model:
        m.train()
    if config.model.num_moe_experts:  # what the MoE layers tracked in evaluation is not training's (as Megatron-LM)
        clear_aux_losses_tracker()
    losses = reduce_losses(reports) if parallel_state.is_pipeline_last_stage() else {}
    return {k: float(v) for k, v in losses.items()}, collected


# ==================================================================================================
# 9. Checkpoint and exit decisions
# ==================================================================================================


def checkpoint_and_decide_exit(state: GlobalState, model, optimizer, opt_param_scheduler,
                               num_floating_point_operations_so_far: float, checkpointing_context: Optional[dict],
                               train_data_iterator) -> bool:
    """After each step: save and/or stop, in Megatron's order (`checkpointing_context`: Bridge's signature, unused).

    1. a signal (--exit-signal-handler) on any rank: save, stop with exit code 0;
    2. --save-interval: save;
    3. --exit-duration-in-mins elapsed on any rank: save unless just saved, stop;
    4. --exit-interval reached: save unless just saved, stop.
    """
    cfg, ts = state.cfg, state.train_state
    save = cfg.checkpoint.save
    args = (state, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far)

    def save_unless_saved():
        if save and state.last_saved_step != ts.step:
            save_checkpoint_and_time(*args, train_data_iterator=train_data_iterator)

    if state.signal_handler is not None and any(state.signal_handler.signals_received()):  # one flag per rank
        save_unless_saved()
        print_rank_0(f"exiting program after receiving {cfg.train.exit_signal.name} at iteration {ts.step}.")
        state.exit_code = 0
        return True
    if save and cfg.checkpoint.save_interval and ts.step % cfg.checkpoint.save_interval == 0:
        save_unless_saved()
    if cfg.train.exit_duration_in_mins:
        elapsed_minutes = (time.time() - state.start_time) / 60.0
        if any_rank(elapsed_minutes > cfg.train.exit_duration_in_mins):
            save_unless_saved()
            print_rank_0(f"exiting program after {elapsed_minutes:.2f} minutes at iteration {ts.step}.")
            state.exit_code = 0
            return True
    if cfg.train.exit_interval and ts.step % cfg.train.exit_interval == 0:
        save_unless_saved()
        torch.distributed.barrier()
        print_rank_0(f"exiting program at iteration {ts.step}.")
        state.exit_code = 0
        return True
    return False


def save_checkpoint_and_time(state: GlobalState, model, optimizer, opt_param_scheduler,
                             num_floating_point_operations_so_far: float, checkpointing_context: Optional[dict] = None,
                             non_persistent_ckpt: bool = False, train_data_iterator=None) -> None:
    """Save through the run's checkpoint manager, timing the save and keeping it out of the iteration time (and so
    out of throughput). `checkpointing_context` is Bridge's signature (its strategies' cache), unused;
    `non_persistent_ckpt` and `train_data_iterator` reach the manager (a custom one may use them; the default
    manager has no local checkpoints and a stateless data loader)."""
    timers = state.timers
    timers("interval-time").stop(barrier=True)
    timers("save-checkpoint", log_level=0).start(barrier=True)
    with forward_pre_hooks_paused(model):  # --overlap-param-gather: save gathered, current parameters
        state.checkpoint_manager.save(checkpoint.CheckpointSaveContext(
            state, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
            train_data_iterator=train_data_iterator, non_persistent_ckpt=non_persistent_ckpt), None)
    directory = checkpoint.iter_dir(state.cfg.checkpoint.save, state.train_state.step)
    timers("save-checkpoint").stop(barrier=True)
    state.last_saved_step = state.train_state.step
    metrics.compute_throughputs_and_append_to_progress_log(state, num_floating_point_operations_so_far)
    seconds = timers("save-checkpoint").elapsed()
    if state.cfg.checkpoint.async_save:  # published later, when every rank has written it
        print_rank_0(f" scheduled async save of iteration {state.train_state.step:7d} to {directory} "
                     f"[ {seconds * 1000:.1f} ms blocking ]")
    else:
        print_rank_0(f" successfully saved checkpoint from iteration {state.train_state.step:7d} to {directory} "
                     f"[ {seconds * 1000:.1f} ms ]")
    timers("interval-time").start(barrier=True)


if __name__ == "__main__":
    sys.exit(main(CLI_CONFIG))
