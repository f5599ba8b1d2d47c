"""Shared helpers: launching real `torchrun` jobs of train.py, and one expensive run shared by many tests."""

import contextlib
import itertools
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# One thread for torch's (and numpy's) operators in the test processes, as torchrun gives each rank, read when torch
# first runs one: `-n 2` puts two workers on two cores, and a worker's second OpenMP thread spins while it waits for
# the first, on the core the other worker or a job's rank needs (docs/testing.md, "What changed", item 11).
os.environ["OMP_NUM_THREADS"] = "1"

# A tiny model, and no default outputs (train.py saves to checkpoints/ and writes TensorBoard files to runs/
# unless told otherwise): a test that wants them names its own --save / --tensorboard-dir after these.
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "2", "--lr", "3e-3", "--lr-warmup-iters", "2", "--no-save", "--no-tensorboard"]

# A LLaMA-like model: RoPE, RMSNorm, SwiGLU, grouped-query attention, untied embeddings, no biases.
LLAMA_FLAGS = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--num-query-groups", "2",
               "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--rotary-base", "5000"]

# Tolerances. A comparison that is not exact says why, and how far apart the two sides can be by that argument,
# never by one machine's measurement (the suite runs on other CPUs, whose kernels round otherwise):
# - PRINTED: a figure read back from the log line, which prints 7 significant digits ("%E", 6 decimals), against the
#   float it printed, or a logger's or TensorBoard's fp32 copy of that float: half a unit of the 7th digit (5e-7
#   relative) plus fp32's 2^-24 (6e-8).
PRINTED = 1e-6
# - REORDERED: the same fp32 training, its sums grouped otherwise (another parallel layout; another CPU's vector
#   width): each sum of n terms rounds by up to log2(n) x 2^-24, about 1e-6 for the n ~ 10^5 terms of these models'
#   largest reductions (torch sums blockwise), and each of a test's <= 15 iterations adds its own differences to the
#   weights the next one starts from: 15 x 1e-6 is within 2e-5.
REORDERED = 2e-5
# - ELSEWHERE: a figure a fixture's program printed on the machine that made the fixture, against ours on this one
#   (Megatron-LM's, Bridge's or an older stack's run, going on from the same checkpoint): the same fp32 arithmetic
#   on another CPU, so REORDERED's argument (another vector width groups the sums otherwise), plus PRINTED's rounding
#   of their digits. Their grad norm is printed with 3 decimals: half a unit of the third decimal more
#   (conftest.same_printed_grad_norm).
ELSEWHERE = REORDERED + PRINTED
# - HF_LOGITS: transformers' and megatron-core's forward of the same fp32 weights, with other kernels (a fused QKV
#   matmul or three, another attention): each of the <= 3 layers' sums of n <= 4h terms rounds by log2(n) x 2^-24
#   relative, of logits of magnitude <= ~10 through residual sums of ~10 terms each: 1e-4 absolute.
HF_LOGITS = 1e-4
# - pytest.approx with no tolerance given (rel 1e-6): closed forms in float64 (memory, FLOPs, throughput figures, a
#   reduced loss) or a scalar held in fp32 (a learning rate in a param group, a loss tensor's .item()): a few
#   roundings of 2^-53, or one of 2^-24 (6e-8), within it.

LOG_LINE = re.compile(
    r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration +(\d+)/ +(\d+) \| consumed samples: +(\d+) \| (?:skipped samples: +\d+ \| )?"
    r"elapsed time per iteration \(ms\): [\d.]+ \|"
    r"(?: throughput per GPU \(TFLOP/s/GPU\): [\d.]+ \| MFU: [^|]+ \|)? learning rate: [\d.E+-]+ \| "
    r"global batch size: +(\d+) \| lm loss: ([\d.E+-]+) \|(?: [a-z0-9_ ]+: [\d.E+-]+ \|)* loss scale: [\d.]+ \| "
    r"grad norm: [\d.]+ \|(?: (?:num zeros|params norm): [\d.]+ \|)*(?: trainable params: [^|]+ \|)? "
    r"number of skipped iterations: +(\d+) \| number of nan iterations: +(\d+) \|$", re.M)


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="the full proof: also the tests marked `full` (every layout against one process, every "
                          "feature across layouts, the interchange fixtures, kills and signals); docs/testing.md")


def pytest_configure(config):
    Launches.lazy = not config.getoption("full")


# With `-n 2`, each worker takes the next whole file in collection order (pytest.ini: `--dist loadfile
# --no-loadscope-reorder`), which is this: test_restarts.py first, as its jobs mostly wait (a stopped rank's timeout,
# then torchrun's 30 s before the SIGKILL that reaches it; three restarts), which the other worker's files fill;
# then the files with the most tests first (xdist's own order, which mixes the many one-process tests with the few
# multi-rank ones; docs/testing.md). Within a file the order is as written.
WAITS_FIRST = "test_restarts.py"


def order_files(items) -> None:
    files = [item.nodeid.split("::")[0] for item in items]
    count = {f: files.count(f) for f in set(files)}
    first = {f: files.index(f) for f in set(files)}
    key = {id(item): (os.path.basename(f) != WAITS_FIRST, -count[f], first[f]) for item, f in zip(items, files)}
    items.sort(key=lambda item: key[id(item)])


def pytest_collection_modifyitems(config, items):
    """Without --full, the tests marked `full` are deselected (pytest says how many when it runs in one process),
    unless named on the command line by their node id: `python -m pytest tests/test_engine.py::test_x` runs test_x
    whatever its mark."""
    if config.getoption("full"):
        order_files(items)
        return
    invoked = config.invocation_params.dir
    named = [os.path.relpath(os.path.join(invoked, arg.split("::")[0]), config.rootpath) + "::" + arg.split("::", 1)[1]
             for arg in config.args if "::" in arg]
    fast = [item for item in items if not item.get_closest_marker("full") or any(
        item.nodeid == name or item.nodeid.startswith(name + "[") or item.nodeid.startswith(name + "::")
        for name in named)]
    if len(fast) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in fast])
        items[:] = fast
    order_files(items)  # by the tests selected, as xdist counts them


def config_error(argv, capsys, world_size=1, gpu=False, run=False) -> str:
    """Parse `argv` expecting a validation error: exit code 2 and a one-line message on stderr, returned. `run`: as
    train.py's command line parses it (the run must also fit this machine)."""
    import config
    import checks

    with pytest.raises(SystemExit) as e:
        checks.parse_args(argv, world_size=world_size, gpu=gpu, run=run)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    return err


def ephemeral_ports() -> range:
    """The kernel's ephemeral range: the local ports it gives outgoing connections and binds to port 0 (Linux's
    default, 32768-60999, where /proc does not say; macOS's and Windows' start higher)."""
    try:
        low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    except OSError:
        low, high = 32768, 60999
    return range(low, high + 1)


def port_block(worker: str, size=1000) -> range:
    """The ports xdist worker `worker` ("gw0", "gw1", ...; "" in a run without xdist) draws from: the blocks of
    `size` below the ephemeral range, one per worker, so no two of the suite's processes draw the same port."""
    n = int(worker[2:]) if worker.startswith("gw") else 0
    top = ephemeral_ports().start - n * size
    assert top - size >= 1024, f"no room below the ephemeral range {ephemeral_ports()} for worker {worker}"
    return range(top - size, top)


def _drawn(block):
    start = random.Random().randrange(len(block))  # not where the run before left its ports in TIME_WAIT
    for i in itertools.count():
        yield block[(start + i) % len(block)]


_PORTS = _drawn(port_block(os.environ.get("PYTEST_XDIST_WORKER", "")))


def free_port() -> int:
    """A port for a job's rendezvous store (torchrun's --master-port) that nothing else takes before torchrun binds it.
    A port the kernel picks (bind to port 0) comes from its ephemeral range, which every outgoing connection draws
    from too: gloo's between the ranks and the store clients of the jobs running beside this one, one of which
    once took it in the gap (EADDRINUSE at torchrun's rendezvous: a module's tests lost in a CI run). Below that
    range only an explicit bind takes a port, and each worker binds only in a block of its own; a port still bound,
    or in TIME_WAIT after an earlier job, fails the bind here (no SO_REUSEADDR) and is passed over."""
    for port in itertools.islice(_PORTS, 1000):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in this worker's block")


def torchrun(args, nproc=2, script="train.py", timeout=300, cwd=None):
    """Run `torchrun --nproc-per-node nproc script args` (script: a path in the repository) in `cwd`, by default
    the suite's scratch folder (see repository_outputs_untouched); return the CompletedProcess."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}",
           os.path.join(ROOT, script), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


class WarmRanks:
    """A two-rank torchrun job of tests/scripts/warm_ranks.py that stays up and runs train.py's (or generate.py's)
    command lines one after another (see there: it saves each run's start-up, ~7 CPU seconds a rank). For runs expected to succeed;
    one that fails ends the job, and the next call starts a fresh one. Calling it as `torchrun(args)` would be called
    returns a CompletedProcess: stdout and stderr are rank 0's then rank 1's."""

    def __init__(self, folder):
        self.folder, self.job, self.n = folder, None, 0

    def __call__(self, args, cwd=None, timeout=300, script="train.py", env=None) -> subprocess.CompletedProcess:
        """`env`: variables set in the ranks' environment for this run only (as a launch with them would pass)."""
        if self.job is None or self.job.poll() is not None:
            self._start()
        request = os.path.join(self.job_dir, f"{self.n}.json")
        with open(request + ".tmp", "w") as f:
            json.dump(dict(script=script, argv=[str(a) for a in args], cwd=str(cwd or os.getcwd()), env=env or {}), f)
        os.replace(request + ".tmp", request)
        codes = [os.path.join(self.job_dir, f"{self.n}.code.rank{rank}") for rank in range(2)]
        deadline = time.monotonic() + timeout
        while not all(os.path.exists(c) for c in codes) and self.job.poll() is None:
            if time.monotonic() > deadline:
                self.kill()
                raise subprocess.TimeoutExpired(args, timeout)
            time.sleep(0.02)
        if not all(os.path.exists(c) for c in codes):  # a rank died without an exit code: the job's, then
            self.job.wait(30)
        read = lambda name: "".join(open(p).read() for rank in range(2)
                                    if os.path.exists(p := os.path.join(self.job_dir, f"{self.n}.{name}.rank{rank}")))
        returned = [int(open(c).read()) for c in codes if os.path.exists(c)]
        code = max(returned) if len(returned) == 2 else self.job.returncode or 1
        out, err = read("stdout"), read("stderr")
        if code:
            err += open(os.path.join(self.job_dir, "stderr")).read()
            self.job.wait(60)
        self.n += 1
        return subprocess.CompletedProcess(args, code, out, err)

    def _start(self) -> None:
        self.job_dir, self.n = os.path.join(self.folder, f"job{time.monotonic_ns()}"), 0
        os.makedirs(self.job_dir)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
               os.path.join(ROOT, "tests", "scripts", "warm_ranks.py"), self.job_dir]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.job = subprocess.Popen(cmd, env=env, stdout=open(os.path.join(self.job_dir, "stdout"), "w"),
                                    stderr=open(os.path.join(self.job_dir, "stderr"), "w"), start_new_session=True)

    def close(self) -> None:
        if self.job is not None and self.job.poll() is None:
            open(os.path.join(self.job_dir, "quit"), "w").close()
            try:
                self.job.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        """SIGKILL to the job and its ranks (torchrun starts each in a session of its own)."""
        import psutil

        for p in psutil.Process(self.job.pid).children(recursive=True):
            p.kill()
        os.killpg(self.job.pid, signal.SIGKILL)
        self.job.wait()


@pytest.fixture(scope="session")
def warm_torchrun(tmp_path_factory):
    """`torchrun(args)` for two-rank train.py (or generate.py) runs expected to succeed, on ranks that stay up (WarmRanks)."""
    ranks = WarmRanks(tmp_path_factory.mktemp("warm_ranks"))
    yield ranks
    ranks.close()


def log_lines(stdout: str) -> list:
    """(iteration, consumed samples, global batch, lm loss, skipped, nan) of each Megatron log line."""
    return [(int(m[0]), int(m[2]), int(m[3]), float(m[4]), int(m[5]), int(m[6])) for m in LOG_LINE.findall(stdout)]


def checkpoint_keys(directory) -> set:
    """The names a torch_dist checkpoint holds (its .metadata): tensors, and objects such as rng_state/shard_0.0_1.1."""
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(directory)).read_metadata().state_dict_metadata)


def tensorboard_scalars(path) -> dict:
    """{tag: {step: value}} of every scalar in a TensorBoard directory (layouts.tensorboard_scalars)."""
    import layouts

    return layouts.tensorboard_scalars(path)


def _listing(folder: str) -> list:
    return sorted((os.path.join(d, f), os.path.getmtime(os.path.join(d, f))) for d, _, fs in os.walk(folder) for f in fs)


def train_here(argv) -> str:
    """train.py's run of `argv` as one process, in this one (train.pretrain, what `python train.py` calls), with one
    thread as torchrun gives each rank: its stdout. No launcher, and torch and megatron-core are already imported."""
    import contextlib
    import io

    import config

    import checks
    import train

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train.pretrain(checks.parse_args(argv, world_size=1, gpu=False))
    return out.getvalue()


class Launches:
    """Jobs of train.py sharing one scratch folder and one dataset cache, each run once by name, with the named
    TensorBoard scalars read back (the layout matrices of test_engine and test_moe): torchrun jobs, and the
    one-rank references in this process (train_here), and two-rank runs on the session's warm ranks when given.

    Inside `together()`, a run asked for is only noted (the call returns None); at its end the noted runs go in
    order, the one-rank ones in this process and each stretch of consecutive runs with the same number of ranks in
    one torchrun job (tests/scripts/runs_in_turn.py), whose processes import torch and megatron-core once for the
    stretch. The tests then ask for the same runs and get what they printed."""

    # Without --full (pytest_configure), `together()` only plans its runs and each is made when a test first asks for
    # it (a run it resumes first): the tests the fast command leaves out never pay for theirs.
    lazy = False

    def __init__(self, out, flags: list, metrics: tuple, warm=None):
        self.out, self.flags, self.metrics, self.done, self.noted = out, flags, metrics, {}, None
        self.warm = warm  # the session's WarmRanks: two-rank runs go to its job
        self.planned = {}  # name: (nproc, argv) of the runs a lazy together() noted

    def __call__(self, name, nproc, *flags):
        argv = [*self.flags, *flags, "--tensorboard-dir", str(self.out / name / "tb"), "--data-cache-path",
                str(self.out / "cache")]
        if name in self.done:
            assert self.done[name]["argv"] == argv, f"run {name} was made with other flags"
        else:
            if self.noted is not None:
                noted = {n: a for n, _, a in self.noted}
                assert noted.get(name, argv) == argv, f"run {name} noted with other flags"
                if name not in noted:
                    self.noted.append((name, nproc, argv))
                return None
            if name in self.planned:
                assert self.planned[name][1] == argv, f"run {name} planned with other flags"
                self._make_planned(name)
            else:
                self._run([(name, nproc, argv)])
        return self.done[name]

    @contextlib.contextmanager
    def together(self):
        self.noted = []
        try:
            yield
            runs = self.noted
        finally:
            self.noted = None
        if self.lazy:
            self.planned.update({name: (nproc, argv) for name, nproc, argv in runs})
            return
        for _, stretch in itertools.groupby(runs, key=lambda run: run[1]):
            self._run(list(stretch))

    def _run(self, runs) -> None:
        """`runs`, (name, nproc, argv) with one nproc: in this process (1) or in one torchrun job."""
        nproc = runs[0][1]
        if nproc == 1:
            printed = {name: train_here(argv) for name, _, argv in runs}
        elif nproc == 2 and self.warm is not None:
            printed = {}
            for name, _, argv in runs:
                proc = self.warm(argv)
                assert proc.returncode == 0, f"{name}: " + proc.stdout[-2000:] + proc.stderr[-3000:]
                printed[name] = proc.stdout
        else:
            for name, _, _ in runs:
                (self.out / name).mkdir(parents=True, exist_ok=True)
            plan = self.out / f"{runs[0][0]}.plan.json"
            plan.write_text(json.dumps([dict(argv=argv, stdout=str(self.out / name / "stdout"))
                                        for name, _, argv in runs]))
            proc = torchrun([str(plan)], nproc=nproc, script="tests/scripts/runs_in_turn.py", timeout=300 * len(runs))
            assert proc.returncode == 0, f"{[name for name, _, _ in runs]}: " + proc.stdout[-2000:] + proc.stderr[-3000:]
            printed = {name: "".join((self.out / name / f"stdout.rank{rank}").read_text() for rank in range(nproc))
                       for name, _, _ in runs}
        for name, _, argv in runs:
            tb = tensorboard_scalars(self.out / name / "tb")
            self.done[name] = dict(argv=argv, stdout=printed[name], **{m: tb.get(m, {}) for m in self.metrics},
                                   iterations=[it for it, *_ in log_lines(printed[name])], tb=tb)

    def ckpt(self, name):
        return str(self.out / name / "ckpt")

    def saving(self, name, every):
        return ["--save", self.ckpt(name), "--save-interval", str(every)]

    def resume(self, name, nproc, source, step, *flags):
        if self.noted is None and source not in self.done and source in self.planned:  # lazy: its checkpoint first
            self._make_planned(source)
        return self(name, nproc, *flags, "--load", self.ckpt(source), "--ckpt-step", str(step))

    def _make_planned(self, name) -> None:
        """A run a lazy together() planned, after the planned run whose checkpoint it loads."""
        nproc, argv = self.planned[name]
        load = argv[argv.index("--load") + 1] if "--load" in argv else None
        for source in [s for s in self.planned if s not in self.done and self.ckpt(s) == load]:
            self._make_planned(source)
        self._run([(name, nproc, argv)])


class ContinuedLayouts(Launches):
    """A one-rank run that saves at iteration `step`, and two-rank layouts that each continue its checkpoint
    (resharded on load), so that both sides start from the same weights (a pipeline stage seeds its own
    initialisation, as Megatron-LM's). All made up front (Launches.together, the layouts on the warm ranks). A
    layout named in `nproc` runs on that many ranks instead."""

    def __init__(self, out, flags: list, metrics: tuple, warm, layouts: dict, step: int = 3, nproc=None):
        super().__init__(out, flags, metrics, warm)
        self.layouts, self.step, self.nproc = layouts, step, nproc or {}
        with self.together():
            self.one()
            for name in layouts:
                self.layout(name)

    def one(self):
        return self("one", 1, *self.saving("one", self.step))

    def layout(self, name):
        return self.resume(name, self.nproc.get(name, 2), "one", self.step, *self.layouts[name])


def same_printed_grad_norm(ours: float, printed: str) -> bool:
    """Our grad norm against one another machine printed as "%.3f" (ELSEWHERE): within half a unit of its third decimal,
    plus the two machines' difference in the arithmetic."""
    return abs(ours - float(printed)) <= 5e-4 + ELSEWHERE * abs(float(printed))


def assert_same(run, reference, iterations, metrics, rel=REORDERED):
    for metric in metrics:
        for it in iterations:
            assert run[metric][it] == pytest.approx(reference[metric][it], rel=rel), (metric, it)


def assert_bitwise(run, reference, iterations, metrics):
    for metric in metrics:
        assert [run[metric][it] for it in iterations] == [reference[metric][it] for it in iterations], metric


@pytest.fixture(scope="session", autouse=True)
def repository_outputs_untouched(tmp_path_factory):
    """The suite never writes into the repository's default output folders, where a user's quick-start run
    keeps its checkpoint and TensorBoard files: in-process runs work in a scratch folder, and each test's
    processes in the repository name their own folders or turn them off."""
    folders = [os.path.join(ROOT, name) for name in ("checkpoints", "runs")]
    before = [_listing(f) for f in folders]
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(ROOT)
    for folder, listing in zip(folders, before):
        assert _listing(folder) == listing, f"the tests wrote into {folder}"


@pytest.fixture(scope="session", autouse=True)
def megatron_core_on_this_machine():
    """This process's tests drive megatron-core's pieces directly (a model built, a forward, an optimizer step), as a
    run does between entering device.py's shim and leaving it: the suite's process is inside it throughout. What
    importing the project and a run leave of torch is tested in fresh interpreters (test_device.py)."""
    import device

    with device.shim():
        yield


ATTENTION_BACKEND_ENVIRONMENT = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


@pytest.fixture(autouse=True)
def attention_backend_environment():
    """megatron-core's LanguageModule writes the model's --attention-backend into these variables of the process
    (language_module.py:107-130) and asserts that a later model's agrees: one backend per process, as one run of
    Megatron-LM or train.py is. Tests build models of several backends in one process: each starts as a fresh one."""
    saved = {name: os.environ.pop(name, None) for name in ATTENTION_BACKEND_ENVIRONMENT}
    yield
    for name, value in saved.items():
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value


@pytest.fixture(scope="session")
def mock_run(tmp_path_factory, warm_torchrun):
    """One 2-rank CPU run on megatron-core's mock data, inspected by several tests."""
    out = tmp_path_factory.mktemp("mock_run")
    args = [*TINY, "--mock-data", "--train-iters", "30", "--global-batch-size", "8", "--log-interval", "5",
            "--eval-interval", "10", "--eval-iters", "2", "--tensorboard-dir", str(out / "tb"),
            "--log-throughput", "--throughput-window-size", "5", "--log-memory-to-tensorboard",
            "--log-runtime-to-tensorboard", "--log-l2-norm-grad", "--timing-log-level", "1", "--log-timers-to-tensorboard",
            "--log-params-norm",
            "--save", str(out / "ckpt"), "--save-interval", "15", "--data-cache-path", str(out / "cache")]
    proc = warm_torchrun(args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return dict(dir=out, stdout=proc.stdout, stderr=proc.stderr, args=args)


@pytest.fixture
def single_rank_groups():
    """A one-process gloo world with megatron-core's parallel groups, in this process; torn down afterwards."""
    import torch
    from megatron.core import parallel_state

    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def trained_in_process_flags(out, flags) -> list:
    """The command line of _trained_in_process's run in folder `out`."""
    return [*TINY, *flags, "--mock-data", "--train-iters", "4", "--eval-iters", "0", "--num-workers", "0",
            "--save", os.path.join(out, "ckpt"), "--data-cache-path", os.path.join(out, "cache")]


def _trained_in_process(out, flags) -> str:
    """A tiny model of `flags` trained for a few steps in this process, saved as torch_dist; its save directory."""
    import checks
    import train

    train.pretrain(checks.parse_args(trained_in_process_flags(str(out), flags), world_size=1, gpu=False))
    return str(out / "ckpt")


@pytest.fixture(scope="session")
def llama_ckpt(tmp_path_factory):
    """A tiny LLaMA-like model trained for a few steps in this process, saved as torch_dist."""
    return _trained_in_process(tmp_path_factory.mktemp("llama"), LLAMA_FLAGS)


# LLaMA's with MoE layers: Mixtral's (every layer, top-2 of 4 experts) and Qwen3-MoE's (q/k norms, a dense first
# layer, the softmax over all experts before the top-k: transformers' norm_topk_prob false).
MIXTRAL_FLAGS = [*LLAMA_FLAGS, "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48"]
QWEN3_MOE_FLAGS = [*MIXTRAL_FLAGS, "--qk-layernorm", "--moe-layer-freq", "[0,1]", "--moe-router-pre-softmax"]


@pytest.fixture(scope="session")
def moe_ckpts(tmp_path_factory):
    """Tiny Mixtral-like and Qwen3-MoE-like models trained for a few steps in this process: {layout: save dir}."""
    return {name: _trained_in_process(tmp_path_factory.mktemp(name), flags)
            for name, flags in (("mixtral", MIXTRAL_FLAGS), ("qwen3_moe", QWEN3_MOE_FLAGS))}
