"""Run under torchrun: ranks that stay up and run train.py's command lines as the suite asks for them.
`warm_ranks.py DIR`: each rank waits for DIR/<n>.json (n = 0, 1, 2, ...: {"script": "train.py" or "generate.py",
"argv": [...], "cwd": "...", "env": {...}}), runs the script's `main` of those flags in that folder, with those
environment variables set for the run, with its stdout and stderr (file descriptors 1 and 2, so C-level
writes too) in DIR/<n>.stdout.rank<R> and DIR/<n>.stderr.rank<R>, and then writes the run's exit code to
DIR/<n>.code.rank<R>. DIR/quit ends the job.

Why: a worker's import of torch and megatron-core and torch's first optimizer (which imports dynamo) cost about 7
CPU seconds a rank, far more than a tiny run: the suite's two-rank runs (and samplings) that are expected to succeed pay them once
(conftest.warm_torchrun). Each run initializes and destroys its process groups as a fresh start does. A run that
fails ends the job (its collectives may be half done): the next request starts a fresh one."""

import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import config  # noqa: E402
import checks
import train  # noqa: E402


def run(request: dict) -> int:
    try:
        if request["script"] == "generate.py":
            import generate

            return generate.main(generate.parse_args(request["argv"])) or 0
        return train.main(checks.parse_args(request["argv"], run=True)) or 0
    except SystemExit as e:  # a command line the parser refuses exits 2, as `python train.py` would
        return e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: B036 -- a traceback, as the rank would print it, and its exit code
        traceback.print_exc()
        return 1


def serve(folder: str) -> None:
    rank, home, n = os.environ["RANK"], os.getcwd(), 0
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    while True:
        path = os.path.join(folder, f"{n}.json")
        while not os.path.exists(path):
            if os.path.exists(os.path.join(folder, "quit")):
                return
            time.sleep(0.02)
        with open(path) as f:
            request = json.load(f)
        outputs = {fd: open(os.path.join(folder, f"{n}.{name}.rank{rank}"), "w") for fd, name in ((1, "stdout"), (2, "stderr"))}
        for fd, out in outputs.items():
            os.dup2(out.fileno(), fd)
        os.chdir(request["cwd"])
        before = {key: os.environ.get(key) for key in request["env"]}
        os.environ.update(request["env"])
        try:
            code = run(request)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.chdir(home)
            for key, value in before.items():  # the environment as it was, for the next run
                if value is None:
                    os.environ.pop(key)
                else:
                    os.environ[key] = value
            for fd, out in outputs.items():
                os.dup2(saved[fd], fd)
                out.close()
        done = os.path.join(folder, f"{n}.code.rank{rank}")
        with open(done + ".tmp", "w") as f:
            f.write(str(code))
        os.replace(done + ".tmp", done)
        if code:
            sys.exit(code)
        n += 1


if __name__ == "__main__":
    serve(sys.argv[1])
