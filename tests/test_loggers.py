"""Weights & Biases, MLflow and Comet: one real 2-rank run logging to all of them offline (and to TensorBoard),
every tracker read back; a missing package or an unusable store is a one-line error before any work."""

import glob
import json
import os
import re
import struct
import subprocess
import sys
import zipfile

import pytest

from conftest import PRINTED, ROOT, TINY, log_lines, tensorboard_scalars, torchrun

# Periodic evaluations, then the final ones on the validation and test sets, all written as "lm loss validation"
# at the iteration (as Megatron does): at iteration 12 the last of the three is what a tracker's step holds.
VALIDATION = re.compile(r" validation loss at iteration (\d+)(?: on \w+ set)? \| lm loss value: ([\d.E+-]+) \|")


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, warm_torchrun):
    """12 iterations on mock data, a log line per iteration, validation at 6 and 12, every tracker offline; on the
    warm ranks, with the trackers' environment set for the run (as a launch with it would pass it on)."""
    out = tmp_path_factory.mktemp("trackers")
    env = {"WANDB_MODE": "offline", "WANDB_CONFIG_DIR": str(out / "wandb_config"), "WANDB_CACHE_DIR": str(out / "wandb_cache"),
           "WANDB_DATA_DIR": str(out / "wandb_data"), "MLFLOW_ALLOW_FILE_STORE": "true", "COMET_START_ONLINE": "0",
           "COMET_OFFLINE_DIRECTORY": str(out / "comet"),
           # No machine probing: W&B's and Comet's system/cloud metadata collectors would look for cloud metadata
           # servers and DNS names; a test reaches nothing outside this machine.
           "WANDB_X_DISABLE_STATS": "true", "WANDB_X_DISABLE_META": "true", "WANDB_X_DISABLE_MACHINE_INFO": "true",
           "COMET_AUTO_LOG_ENV_DETAILS": "false"}
    proc = warm_torchrun([*TINY, "--mock-data", "--train-iters", "12", "--global-batch-size", "8", "--log-interval", "1",
                          "--eval-interval", "6", "--eval-iters", "2", "--data-cache-path", str(out / "cache"),
                          "--tensorboard-dir", str(out / "tb"), "--log-throughput", "--throughput-window-size", "2",
                          "--log-memory-to-tensorboard",
                          "--wandb-project", "proj", "--wandb-exp-name", "run-a", "--wandb-save-dir", str(out / "wandb"),
                          "--mlflow-experiment", "exp", "--mlflow-run-name", "run-a",
                          "--mlflow-tracking-uri", (out / "mlruns").as_uri(), "--mlflow-tags", "team=nlp", "size=tiny",
                          "--comet-project", "proj", "--comet-experiment-name", "run-a", "--comet-tags", "cpu", "tiny"], env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = {it: loss for it, _, _, loss, _, _ in log_lines(proc.stdout)}
    assert sorted(losses) == list(range(1, 13))
    validation = {int(it): float(v) for it, v in VALIDATION.findall(proc.stdout)}
    assert sorted(validation) == [6, 12]
    return dict(dir=out, stdout=proc.stdout, losses=losses, validation=validation)


def wandb_history(run_file) -> dict:
    """{key: {step: value}} from an offline run's .wandb file: W&B's record log (LevelDB's log format behind a
    7-byte header: 32 KiB blocks of checksum, length, type, payload) of protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    data = open(run_file, "rb").read()
    assert data[:4] == b":W&B"
    history, pos, pending = {}, 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack("<HB", data[pos + 4: pos + 7])
        pending += data[pos + 7: pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                for item in record.history.item:
                    key = item.key or "/".join(item.nested_key)
                    if not key.startswith("_"):  # _step, _runtime, _timestamp: W&B's own
                        history.setdefault(key, {})[record.history.step.num] = json.loads(item.value_json)
    return history


def comet_metrics(offline_dir) -> tuple:
    """({name: {step: value}}, experiment.json) of the one offline experiment archive in offline_dir."""
    (archive,) = glob.glob(os.path.join(offline_dir, "*.zip"))
    with zipfile.ZipFile(archive) as z:
        experiment = json.loads(z.read("experiment.json"))
        messages = [json.loads(line) for line in z.read("messages.json").decode().splitlines() if line.strip()]
    metrics = {}
    for m in messages:
        if m["type"] == "metric_msg":
            metric = m["payload"]["metric"]
            metrics.setdefault(metric["metricName"], {})[metric["step"]] = float(metric["metricValue"])
    return metrics, experiment


def expected_from_tensorboard(tracked_run) -> dict:
    """The scalars every tracker must hold: TensorBoard's, without the "vs samples" twins."""
    tb = tensorboard_scalars(tracked_run["dir"] / "tb")
    assert {"lm loss", "lm loss vs samples", "learning-rate", "grad-norm", "throughput/tokens_per_sec",
            "memory/cpu_rss_mem", "iteration-time", "lm loss validation"} <= set(tb)
    return {tag: values for tag, values in tb.items() if not tag.endswith(" vs samples")}


def check_same_losses(series: dict, tracked_run, name: str) -> None:
    """Each tracker's `lm loss` per iteration is the log line's loss, its validation loss the validation block's."""
    assert set(series["lm loss"]) == set(tracked_run["losses"]), name
    for it, loss in tracked_run["losses"].items():
        assert series["lm loss"][it] == pytest.approx(loss, rel=PRINTED), (name, it)
    for it, loss in tracked_run["validation"].items():
        assert series["lm loss validation"][it] == pytest.approx(loss, rel=PRINTED), (name, it)


def test_wandb_offline_run_holds_the_tensorboard_scalars(tracked_run):
    (run_file,) = glob.glob(str(tracked_run["dir"] / "wandb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    history = wandb_history(run_file)
    expected = expected_from_tensorboard(tracked_run)
    assert set(history) == set(expected)
    check_same_losses(history, tracked_run, "wandb")
    for tag, values in expected.items():
        assert history[tag] == pytest.approx(values, rel=PRINTED), tag  # TensorBoard's fp32 copy


def test_mlflow_file_store_run_read_back_with_the_client(tracked_run, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")

    client = MlflowClient(tracking_uri=(tracked_run["dir"] / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
    assert run.info.run_name == "run-a" and run.info.status == "FINISHED"
    assert run.data.tags["team"] == "nlp" and run.data.tags["size"] == "tiny"
    expected = expected_from_tensorboard(tracked_run)
    series = {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)} for key in run.data.metrics}
    assert set(series) == {tag.replace("/", "_") for tag in expected}
    check_same_losses(series, tracked_run, "mlflow")
    for tag, values in expected.items():
        assert series[tag.replace("/", "_")] == pytest.approx(values, rel=PRINTED), tag  # TensorBoard's fp32 copy


def test_comet_offline_experiment_holds_the_tensorboard_scalars(tracked_run):
    metrics, experiment = comet_metrics(tracked_run["dir"] / "comet")
    assert experiment["project_name"] == "proj" and sorted(experiment["tags"]) == ["cpu", "tiny"]
    metrics = {k: v for k, v in metrics.items() if not k.startswith("sys.") and k != "process duration"}  # Comet's own
    expected = expected_from_tensorboard(tracked_run)
    assert set(metrics) == set(expected)
    check_same_losses(metrics, tracked_run, "comet")
    for tag, values in expected.items():
        assert metrics[tag] == pytest.approx(values, rel=PRINTED), tag  # TensorBoard's fp32 copy


@pytest.mark.parametrize("package, flags, pip", [
    ("wandb", ["--wandb-project", "p", "--wandb-exp-name", "e"], "pip install wandb"),
    pytest.param("mlflow", ["--mlflow-experiment", "e", "--mlflow-tracking-uri", "http://127.0.0.1:1"],
                 "pip install mlflow-skinny", marks=pytest.mark.full),  # the fast command: wandb's
    pytest.param("comet_ml", ["--comet-project", "p"], "pip install comet_ml", marks=pytest.mark.full),
])
def test_a_missing_tracker_package_is_a_one_line_error(tmp_path, package, flags, pip):
    """The package is shadowed by one whose import fails, as on a machine without it."""
    shadow = tmp_path / "shadow" / package
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(f"raise ModuleNotFoundError(\"No module named '{package}'\")\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "shadow"))
    proc = subprocess.run([sys.executable, "train.py", *flags], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [f"train.py: error: {flags[0]} needs the {package} package, which does not "
                                        f"import (No module named '{package}'); {pip}"]


@pytest.mark.parametrize("flags, env, message", [
    (["--mlflow-experiment", "e", "--mlflow-tracking-uri", "file:///tmp/mlruns"], {"MLFLOW_ALLOW_FILE_STORE": ""},
     "is a file store, which MLflow opens only with MLFLOW_ALLOW_FILE_STORE=true"),
    pytest.param(["--comet-project", "p"], {"COMET_START_ONLINE": "", "COMET_API_KEY": ""},
                 "--comet-project: no Comet API key", marks=pytest.mark.full),  # the fast command: MLflow's
    pytest.param(["--mlflow-run-name", "r"], {}, "--mlflow-run-name needs --mlflow-experiment", marks=pytest.mark.full),
])
def test_an_unusable_tracker_setting_is_a_one_line_error(tmp_path, flags, env, message):
    env = {k: v for k, v in dict(os.environ, HOME=str(tmp_path), **env).items() if v != ""}
    proc = subprocess.run([sys.executable, "train.py", *flags], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1 and message in proc.stderr, proc.stderr
