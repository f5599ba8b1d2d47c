"""layouts.py: a run's flags at each parallel layout, against one process.

    python layouts.py [--ranks 4] [--layouts dp2,tp2] [--out DIR] -- FLAGS...

FLAGS train in one process, which saves every `--step` iterations (default 2) and stops at 3 x step. Each layout that
applies continues its checkpoint of `--step` (resharded on load) on its ranks, each in its own `torchrun` job, and this prints,
per layout, the largest relative difference of every number it writes to TensorBoard from the one process's, or the
one line that refuses the layout. A fork runs it with the fork's flags after a change (docs/fork.md).

Every layout starts from the one process's weights: a pipeline stage initialises its own layers, as Megatron-LM's,
so only a run from the same checkpoint can give the same numbers. Dropout changes with the layout (each rank draws
its own masks), so compare with `--hidden-dropout 0 --attention-dropout 0`.
"""

import argparse
import math
import os
import subprocess
import sys

# name: (ranks, flags). Each is one parallelism at 2 ranks, or a product of two at 4.
LAYOUTS = {
    "dp2": (2, []),
    # The distributed optimizer reads only a distributed optimizer's state; fully_reshardable, so another DP reads it.
    "dp2_dopt": (2, ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"]),
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "pp2_vpp2": (2, ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"]),
    "cp2": (2, ["--context-parallel-size", "2"]),
    # The experts' own optimizer (EP > 1) reads only a distributed optimizer's fully_reshardable state (checkpoint.py).
    "ep2": (2, ["--expert-model-parallel-size", "2", "--use-distributed-optimizer",
                "--dist-ckpt-optim-fully-reshardable"]),
    "zero1": (2, ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim"]),
    "zero3": (2, ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]),
    "fsdp2": (2, ["--use-torch-fsdp2"]),
    "zero0": (2, ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "no_shard"]),
    "zero2": (2, ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"]),
    "tp2_dp2": (4, ["--tensor-model-parallel-size", "2"]),
    "tp2_pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    "pp2_dp2_dopt": (4, ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
                         "--dist-ckpt-optim-fully-reshardable"]),
    "tp2_cp2": (4, ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2"]),
    "ep2_tp2_sp": (4, ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                       "--sequence-parallel", "--expert-tensor-parallel-size", "1", "--use-distributed-optimizer",
                       "--dist-ckpt-optim-fully-reshardable"]),
    "zero3_tp2": (4, ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
                      "--tensor-model-parallel-size", "2"]),
    "fsdp2_dp4": (4, ["--use-torch-fsdp2"]),
    "tp2_pp2_dp2": (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
}

# Numbers that are not the model's: the clock's; MTP's cumulative acceptance rates, which megatron-core starts
# afresh at a resume (multi_token_prediction.py:437); and TensorBoard's second copy of each (by samples).
UNCOMPARED = ("iteration-time", "throughput")
RESTARTED = "_cumulative_acceptance_rate"

DOPT = "--use-distributed-optimizer"

# Where a layout gives other numbers than one process by megatron-core's design, and so is not compared:
# (what, the test of the flags and the layout's flags, why). docs/testing.md shows the table.
DEPARTURES = [
    ("MTP under CP", lambda flags, layout: int(flag_value(flags, "--mtp-num-layers", 0)) > 0
     and int(flag_value(layout, "--context-parallel-size", 1)) > 1,
     "megatron-core divides each CP rank's MTP loss and its gradient by the rank's own tokens "
     "(multi_token_prediction.py:851,887), one process by all of them (docs/model.md, MTP)"),
]


def checkpoint_kind(layout: list) -> tuple:
    """What a layout's checkpoint is and reads: Megatron FSDP's fsdp_dtensor (of its strategy), the distributed
    optimizer's torch_dist state, or the plain optimizer's. One kind does not load into another (megatron-core's
    loaders; train.py says which in one line), so a layout continues a one-process run of its own kind."""
    if "--use-megatron-fsdp" in layout:
        return ("--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                flag_value(layout, "--data-parallel-sharding-strategy"))
    return (DOPT, "--dist-ckpt-optim-fully-reshardable") if DOPT in layout else ()


def departure(flags: list, layout: list):
    """Why `flags` at `layout` give other numbers than one process by design, or None."""
    return next((f"{what}: {why}" for what, applies, why in DEPARTURES if applies(flags, layout)), None)


def flag_value(flags: list, name: str, default=None):
    """The last value given to `name` in `flags` (argparse's rule), else `default`."""
    at = [i for i, f in enumerate(flags) if f == name]
    return flags[at[-1] + 1] if at else default


def with_flag(flags: list, name: str, value) -> list:
    """`flags` with `name` set to `value` (every earlier occurrence dropped)."""
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
        elif f == name:
            skip = True
        else:
            out.append(f)
    return [*out, name, str(value)]


def at_layout(flags: list, layout: list) -> list:
    """`flags` run at `layout`, with the same padded vocabulary: Megatron pads it to a multiple of
    --make-vocab-size-divisible-by x TP (megatron/training/tokenizer/tokenizer.py's _vocab_size_with_padding), so the
    divisor is divided by TP; a divisor TP does not divide gives another vocabulary, and None is returned."""
    tp = int(flag_value(layout, "--tensor-model-parallel-size", 1))
    divisor = int(flag_value(flags, "--make-vocab-size-divisible-by", 128))
    if divisor % tp:
        return None
    return [*flags, *layout] if tp == 1 else with_flag([*flags, *layout], "--make-vocab-size-divisible-by", divisor // tp)


def refusal(argv: list, nproc: int):
    """The one line the flags' validation (and train.py's own checks before any process group) gives at `nproc` ranks
    on this machine, or None when it accepts them."""
    import contextlib
    import io

    import checks
    import config

    import model

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            model.check_optimizer_state(checks.config_from_flags(argv, world_size=nproc, gpu=False))
    except config.ConfigError as e:
        return str(e)
    except SystemExit:  # argparse's own error: an unknown flag or value
        return err.getvalue().strip().splitlines()[-1]
    return None


def numbers(tb: dict) -> list:
    """The tags of every number a run writes that the layout must not change."""
    return sorted(t for t in tb if t not in UNCOMPARED and not t.endswith(" vs samples") and RESTARTED not in t)


def differences(run: dict, reference: dict, after: int) -> dict:
    """{tag: the largest relative difference of `run`'s value from `reference`'s at the iterations after `after`}
    (an absolute one where the reference is 0; num-zeros, a count, as a count); a tag one side lacks is inf. A
    parameter's gradient norm (--log-l2-norm-grad) is relative to the whole model's, or its own where larger: one
    whose gradient cancels (a k layernorm's bias, which softmax ignores: it shifts every key alike) holds only the
    rounding of terms the size of the others'."""
    out = {}
    whole = reference.get("l2_norm/grad/global", {})
    for tag in sorted(set(numbers(run)) | set(numbers(reference))):
        if tag not in run or tag not in reference:
            out[tag] = math.inf
            continue
        its = [it for it in reference[tag] if it > after]
        if any(it not in run[tag] for it in its):
            out[tag] = math.inf
            continue
        scale = lambda it: max(abs(reference[tag][it]), whole[it]) if tag.startswith("l2_norm/grad/") else \
            abs(reference[tag][it])
        gap = lambda it: abs(run[tag][it] - reference[tag][it]) / (1 if tag == "num-zeros" or scale(it) == 0 else
                                                                    scale(it))
        out[tag] = max([gap(it) for it in its], default=0.0)
    return out


def tensorboard_scalars(path: str) -> dict:
    """{tag: {step: value}} of every scalar in a TensorBoard directory, read back as TensorBoard reads it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def torchrun(argv: list, nproc: int, timeout: int = 600) -> subprocess.CompletedProcess:
    """train.py's run of `argv` on `nproc` ranks, a `torchrun` job of its own."""
    import socket

    with socket.socket() as s:  # a free port for the job's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={port}",
           os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py"), *argv]
    return subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=timeout)


class Check:
    """The one process's run of `flags` and its continuations at layouts, in folder `out`: each run stops at 3 x
    `step`; a layout continues the one process's checkpoint of `step`, and a second layout (`then`) the first's of
    2 x `step` (and saves none: nothing continues it). `launch(argv, nproc)` runs train.py and returns a CompletedProcess
    (`torchrun` above, or the test suite's warm ranks)."""

    def __init__(self, flags: list, out: str, step: int = 2, launch=torchrun):
        self.flags, self.out, self.step, self.launch = list(flags), out, step, launch
        self.runs = {}  # name: {"argv", "nproc", "tb"} or {"refused", "argv", "nproc"}

    def argv(self, name: str, flags: list, save: bool = True) -> list:
        folder = os.path.join(self.out, name)
        saving = ["--save", os.path.join(folder, "ckpt"), "--save-interval", str(self.step)] if save else []
        return [*flags, "--train-iters", str(3 * self.step), "--log-interval", "1", "--tensorboard-dir",
                os.path.join(folder, "tb"), *saving, "--data-cache-path", os.path.join(self.out, "cache")]

    def run(self, name: str, nproc: int, flags: list, load: str = None, step: int = None, save: bool = True) -> dict:
        """Train `flags` on `nproc` ranks (continuing run `load`'s checkpoint of iteration `step`), once by name;
        `save=False`: a run whose checkpoints nothing continues saves none."""
        if name in self.runs:
            return self.runs[name]
        argv = self.argv(name, flags, save)
        if load is not None:
            argv += ["--load", os.path.join(self.out, load, "ckpt"), "--ckpt-step", str(step)]
        why = refusal(argv, nproc)
        if why is None:
            proc = self.launch(argv, nproc)
            said = [line for line in proc.stderr.splitlines() if line.startswith("train.py: error: ")]
            if proc.returncode == 2 and load is not None and said:  # a checkpoint refused in one line at the load
                why = "at the load: " + said[0][len("train.py: error: "):]
            elif proc.returncode:
                raise RuntimeError(f"{name} failed (exit code {proc.returncode}): {command(argv, nproc)}\n"
                                   f"{proc.stdout[-1500:]}{proc.stderr[-3000:]}")
        self.runs[name] = dict(argv=argv, nproc=nproc, refused=why)
        if why is None:
            self.runs[name]["tb"] = tensorboard_scalars(os.path.join(self.out, name, "tb"))
        return self.runs[name]

    def one(self) -> dict:
        return self.run("one", 1, self.flags)

    def layout(self, name: str, then: str = None) -> dict:
        """Layout `name` continuing the one process's checkpoint (or, with `then`, layout `then` continuing
        `name`'s later one), with its differences from the one process's numbers after the iteration it loaded."""
        if then is not None and self.layout(name)["refused"]:
            return self.layout(name)
        nproc, layout = LAYOUTS[then or name]
        kind = checkpoint_kind(layout)
        if then is not None and checkpoint_kind(LAYOUTS[name][1]) != kind:
            return dict(refused=f"{name}'s checkpoint ({' '.join(checkpoint_kind(LAYOUTS[name][1])) or 'plain optimizer'}) "
                                f"does not load into {then} ({' '.join(kind) or 'plain optimizer'}): megatron-core's "
                                f"loaders, and train.py says so in one line at the load", argv=None, nproc=nproc)
        flags = at_layout(self.flags, layout)
        if flags is None:
            divisor = flag_value(self.flags, "--make-vocab-size-divisible-by", 128)
            return dict(refused=f"--make-vocab-size-divisible-by {divisor} is not a multiple of TP: the layout would "
                                f"pad another vocabulary", argv=None, nproc=nproc)
        loaded = self.step if then is None else 2 * self.step
        source = name if then is not None else "one" if not kind else "one_" + "_".join(k.strip("-") for k in kind)
        if then is None and kind:  # on one rank the same arithmetic as the plain optimizer (tests/test_engine.py)
            if self.run(source, 1, [*self.flags, *kind])["refused"]:
                return self.runs[source]
        run = self.run(name if then is None else f"{name}_then_{then}", nproc, flags, load=source, step=loaded,
                       save=then is None)
        if run["refused"]:
            return run
        return dict(run, differences=differences(run["tb"], self.one()["tb"], loaded),
                    departure=departure(self.flags, layout) or (then and departure(self.flags, LAYOUTS[name][1])))


def command(argv: list, nproc: int) -> str:
    """The shell command that repeats a run."""
    import shlex

    return f"torchrun --nproc-per-node {nproc} train.py {shlex.join(argv)}"


def applicable(flags: list, ranks: int) -> list:
    """The layouts of at most `ranks` ranks that change how `flags` are computed: EP only with experts, virtual stages
    only with layers for them."""
    experts = flag_value(flags, "--num-experts") is not None
    return [name for name, (nproc, layout) in LAYOUTS.items()
            if nproc <= ranks and (experts or "--expert-model-parallel-size" not in layout)]


def report(check: Check, names: list) -> str:
    """One block per layout: its refusal, or each number's largest relative difference from one process."""
    lines = []
    for name in names:
        result = check.layout(name)
        if result["refused"]:
            lines.append(f"{name}: refused: {result['refused']}")
            continue
        worst = max(result["differences"].values(), default=0.0)
        lines.append(f"{name} ({result['nproc']} ranks): largest difference {worst:.3g}"
                     + (f" (by design: {result['departure']})" if result["departure"] else ""))
        lines += [f"    {tag}: {gap:.3g}" for tag, gap in result["differences"].items()]
    return "\n".join(lines)


def main(argv: list) -> int:
    parser = argparse.ArgumentParser(prog="layouts.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="the most ranks a layout may take (2 or 4)")
    parser.add_argument("--layouts", default=None, help="comma-separated names of LAYOUTS (default: all that apply)")
    parser.add_argument("--step", type=int, default=2, help="the iteration the one process saves at")
    parser.add_argument("--out", default="layout-check", help="the folder for the runs' files")
    args, flags = parser.parse_known_args(argv)
    flags = [f for f in flags if f != "--"]
    names = args.layouts.split(",") if args.layouts else applicable(flags, args.ranks)
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layout {unknown[0]}; choose from {', '.join(LAYOUTS)}")
    check = Check(flags, args.out, args.step)
    if check.one()["refused"]:
        parser.exit(2, f"layouts.py: error: the one-process run is refused: {check.one()['refused']}\n")
    print(report(check, names))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
