"""Run under torchrun: several train.py runs one after another in the same worker processes. `runs_in_turn.py PLAN`,
where PLAN is a JSON list of {"argv": [...], "stdout": "path"}: for each, train.py's command line (`main` of the
parsed flags, what `python train.py ...` calls), with this rank's stdout (file descriptor 1, so C-level writes
too) going to `path` + `.rank<N>`. A run that fails ends the job with its exit code.

Why: a worker's import of torch and megatron-core and torch's first optimizer (which imports dynamo) cost about 7
CPU seconds a rank, far more than a tiny run; the layout matrices (test_engine, test_moe) pay them once per process
count instead of once per run. Each run initializes and destroys its process groups as a fresh start does."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import config  # noqa: E402
import checks
import train  # noqa: E402

with open(sys.argv[1]) as f:
    plan = json.load(f)
saved = os.dup(1)
for run in plan:
    sys.stdout.flush()
    with open(f"{run['stdout']}.rank{os.environ['RANK']}", "w") as out:
        os.dup2(out.fileno(), 1)
        try:
            code = train.main(checks.parse_args(run["argv"], run=True))
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
    if code:
        sys.exit(code)
