"""The seams a fork changes in one place (docs/fork.md): a learning-rate schedule (schedules.py), a new scalar
(metrics.step_report), another core attention (model.core_attention) and what refuses it, an MLP activation (config.GPTModelProvider.mlp_fields), an optimizer of one's own (model.OWN_OPTIMIZERS;
its save and resume and what it refuses: test_optimizer.py), a flag and a default, a data source (a DatasetProvider)
and a layer (a module in megatron-core's ModuleSpec), the last two run from the page's own blocks. The loss term on
the logits: test_z_loss.py."""

import copy
import os
import re

import pytest

import config
import checks
import schedules
from config import ConfigError
from conftest import PRINTED, TINY, log_lines, train_here


def test_a_schedule_of_ones_own_is_one_function_and_one_choice(tmp_path, capsys):
    """schedules.py's example, picked by --lr-decay-style: the learning rate on every log line is its function's,
    at the samples consumed so far (megatron-core's scheduler counts samples)."""
    import train

    gbs, iters, warmup, lr, min_lr = 4, 8, 2, 3e-3, 1e-5
    cfg = checks.parse_args([*TINY, "--mock-data", "--num-workers", "0", "--eval-iters", "0", "--log-interval", "1",
                             "--global-batch-size", str(gbs), "--train-iters", str(iters), "--min-lr", str(min_lr),
                             "--lr-decay-style", "step", "--data-cache-path", str(tmp_path / "cache")],
                            world_size=1, gpu=False)
    train.pretrain(cfg)
    logged = [float(x) for x in re.findall(r"learning rate: (\S+) \|", capsys.readouterr().out)]
    want = [schedules.step_decay(i * gbs, warmup * gbs, iters * gbs, lr, min_lr, 0.0) for i in range(1, iters + 1)]
    assert len(logged) == iters
    assert logged == pytest.approx(want, rel=PRINTED)  # the log line's 7 digits
    # Warmup, then the peak, a tenth and a hundredth: its own shape, not a megatron-core style.
    assert logged[:2] == pytest.approx([lr / 2, lr]) and logged[2] == pytest.approx(lr)
    assert logged[-1] == pytest.approx(lr / 100) and lr / 10 == pytest.approx(logged[4])


@pytest.mark.parametrize("through", ["train.py", "metrics.training_log"])
def test_a_new_scalar_is_one_line_of_the_step_report(tmp_path, capsys, monkeypatch, through):
    """The fork guide's example: one more Scalar in metrics.step_report reaches the log line, TensorBoard (with its
    samples twin) and every tracker; declared as not a loss, a NaN in it is not counted as a NaN iteration. The
    same through Bridge's `training_log` signature (a fork's loop that calls it), which gives the report the
    seconds per iteration the example divides by."""
    import inspect

    import metrics
    import train
    from conftest import tensorboard_scalars

    original = metrics.step_report

    def with_a_rate(*args, **kwargs):
        given = inspect.signature(original).bind(*args, **kwargs).arguments  # the guide's code reads these names
        batch_size, seconds_per_iteration = given["batch_size"], given.get("seconds_per_iteration")
        return [*original(*args, **kwargs), metrics.Scalar("seq len", "seq-len", 64, "d"),
                metrics.Scalar("not a number", "not-a-number", float("nan"), ".1f"),
                # the guide's example: a rate, from the interval's seconds per iteration the report receives
                metrics.Scalar("samples per second", "samples-per-second", batch_size / seconds_per_iteration, ".1f")]

    monkeypatch.setattr(metrics, "step_report", with_a_rate)
    if through == "metrics.training_log":  # train.py's report, given to training_log as Bridge's loop gives it
        log_step = metrics.log_step

        def via_training_log(report, total_loss_dict, report_memory_flag, skipped_iter, global_state, history_wct,
                             model, l2_norm_grad=None):
            if metrics.log_step is log_step:  # training_log's own call
                return log_step(report, total_loss_dict, report_memory_flag, skipped_iter, global_state, history_wct,
                                model, l2_norm_grad)
            monkeypatch.setattr(metrics, "log_step", log_step)
            value = {s.tag: s.value for s in report}
            try:
                return metrics.training_log(
                    {s.label: s.value for s in report if s.is_loss}, total_loss_dict, value["learning-rate"],
                    value["decoupled-learning-rate"], value["loss-scale"], report_memory_flag, skipped_iter,
                    value["grad-norm"], value["params-norm"], value["num-zeros"], global_state.cfg, global_state,
                    history_wct, model, l2_norm_grad)
            finally:
                monkeypatch.setattr(metrics, "log_step", via_training_log)

        monkeypatch.setattr(metrics, "log_step", via_training_log)
    flags = [a for a in TINY if a != "--no-tensorboard"]
    cfg = checks.parse_args([*flags, "--mock-data", "--num-workers", "0", "--eval-iters", "0", "--log-interval", "2",
                             "--global-batch-size", "4", "--train-iters", "4", "--tensorboard-dir", str(tmp_path / "tb"),
                             "--data-cache-path", str(tmp_path / "cache")], world_size=1, gpu=False)
    train.pretrain(cfg)
    lines = [l for l in capsys.readouterr().out.splitlines() if " iteration " in l and "/       4 |" in l]
    assert len(lines) == 2 and all("| seq len: 64 | not a number: nan | samples per second: " in l for l in lines)
    for line in lines:  # the rate agrees with the line's own elapsed time per iteration (both the interval timer's)
        rate = float(re.search(r"samples per second: ([\d.]+) \|", line)[1])
        elapsed = float(re.search(r"elapsed time per iteration \(ms\): ([\d.]+) \|", line)[1]) / 1000
        # The same interval timer, read for the report and then once more for the log line (log_step), so the
        # rate is at least 4 / elapsed, less half a unit of each one-decimal figure; and at most twice it: the work
        # between the two reads (the report's norms over 128k parameters) is less than the two forward and backward
        # passes over them that the interval timed.
        rounding = 0.05 / (elapsed * 1000) + 0.05 / rate
        assert 4 / elapsed * (1 - rounding) <= rate < 2 * 4 / elapsed, line
    assert all("number of nan iterations:   0 |" in l for l in lines)
    tb = tensorboard_scalars(tmp_path / "tb")
    assert sorted(tb["samples-per-second"]) == [1, 2, 3, 4] and min(tb["samples-per-second"].values()) > 0
    assert tb["seq-len"] == {1: 64.0, 2: 64.0, 3: 64.0, 4: 64.0} and tb["seq-len vs samples"] == {4: 64.0, 8: 64.0, 12: 64.0, 16: 64.0}


def test_another_core_attention_is_one_class_and_one_line_that_every_path_runs_or_refuses(single_rank_groups, monkeypatch):
    """The fork guide's third task: a core attention of one's own (here SDPAttention with a temperature on its
    scores) set where model.layer_spec sets SDPAttention is what every layer runs, and its output shows."""
    import torch

    import model

    class HotAttention(model.SDPAttention):
        calls = 0

        def forward(self, query, key, value, *args, **kwargs):
            HotAttention.calls += 1
            return super().forward(query * 2.0, key, value, *args, **kwargs)  # scores twice as sharp

    cfg = checks.parse_args([*TINY, "--mock-data", "--hidden-dropout", "0", "--attention-dropout", "0"], world_size=1,
                            gpu=False)
    tokens = torch.arange(2 * 64).reshape(2, 64) % 200
    positions = torch.arange(64).repeat(2, 1)

    def logits():
        torch.manual_seed(0)
        gpt = model.build_model(cfg, 257)[0].eval()
        with torch.no_grad():
            return gpt(tokens, positions, None)

    plain = logits()
    monkeypatch.setattr(model, "SDPAttention", HotAttention)  # the one line in model.core_attention, as a fork edits it
    hot = logits()
    assert HotAttention.calls == 2  # each of the 2 layers
    assert not torch.allclose(plain, hot)
    # What would not run it says so in one line: transformer-engine's layers (a GPU's; its spec is asked for here as a
    # GPU run would) and the Hugging Face export (transformers' own attention). Decoding: test_generate.py.
    import hf

    te = copy.deepcopy(cfg)
    te.model.transformer_impl = "transformer_engine"
    with pytest.raises(ConfigError, match=r"^the core attention HotAttention \(model.core_attention\) is a local "
                                          r"layer's; transformer-engine layers run their own: add --transformer-impl local$"):
        model.layer_spec(te)
    with pytest.raises(ConfigError, match="needs scaled dot-product attention \\(has model.core_attention's HotAttention\\)"):
        hf.choose_layout(cfg.model)


def test_an_optimizer_of_ones_own_is_sign_sgd_with_a_momentum_buffer():
    """model.SignSGD, the guide's example: the buffer m = beta m + (1 - beta) g, then each weight moves by lr times the
    sign of m, after decoupled weight decay. Powers of two throughout, so every figure is exact in fp32: a weight
    keeps its direction while the buffer outweighs a gradient against it, and stands still where m is 0."""
    import torch

    import model

    w, decayed = torch.tensor([1.0, -2.0, 0.5, 0.0]), torch.tensor([1.0])
    opt = model.SignSGD([dict(params=[w]), dict(params=[decayed], weight_decay=0.5)], lr=2**-4, momentum=0.5)
    for grads in ([3.0, -1.0, 0.0, 1.0], [-1.0, 4.0, 0.0, -2.0]):
        w.grad, decayed.grad = torch.tensor(grads), torch.tensor([1.0])
        opt.step()
    assert opt.state[w]["momentum_buffer"].tolist() == [0.25, 1.75, 0.0, -0.75]  # 0.5 (0.5 g1) + 0.5 g2
    assert w.tolist() == [1.0 - 2 / 16, -2.0, 0.5, 0.0]  # down twice; down then back; still; up then back
    assert decayed.tolist() == [(1.0 * (1 - 1 / 32) - 1 / 16) * (1 - 1 / 32) - 1 / 16]


def test_an_optimizer_of_ones_own_trains_every_parameter(tmp_path):
    """--optimizer signsgd: megatron-core's registry builds it for all 28 tensors (an empty default_param_overrides:
    no Adam beside it, as Muon has), train.py says so, and the loss falls."""
    out = train_here([*TINY, "--mock-data", "--global-batch-size", "4", "--train-iters", "6", "--log-interval", "1",
                      "--eval-iters", "0", "--num-workers", "0", "--optimizer", "signsgd", "--data-cache-path",
                      str(tmp_path / "cache")])
    said = [line for line in out.splitlines() if " updates " in line]
    assert len(said) == 1 and said[0].startswith(" > SignSGD updates 28 tensors (0.13M parameters): "), said
    losses = [loss for _, _, _, loss, _, _ in log_lines(out)]
    # From ln 384 = 5.95 (the uniform guess): every weight moves by lr = 3e-3 a step past warm-up; 0.2 in 6 steps is
    # far above noise.
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.2, losses


FLAG_RECIPE = '''    my_coeff: float = arg(0.0, "My experiment's coefficient.", bounds="[0, 1]")
'''
DEFAULT_RECIPE = '''    "optimizer.weight_decay": (0.1, "my experiments decay more"),
'''
CHECK_IN_THE_COPY = '''
import contextlib, io, os, sys
import checks, config
parser = config.build_parser()
help_text = " ".join(parser.format_help().split())
assert "--my-coeff MY_COEFF My experiment's coefficient. (default: 0.0)" in help_text, "help"
assert "(default: 0.1: my experiments decay more)" in help_text, "the default's reason"
cfg = checks.parse_args(["--my-coeff", "0.5"], world_size=1, gpu=False)
assert cfg.train.my_coeff == 0.5 and cfg.optimizer.weight_decay == 0.1 and cfg.scheduler.start_weight_decay == 0.1
printed = io.StringIO()
checks.print_config(cfg, printed)
assert "train.my_coeff" in printed.getvalue() and "0.5" in printed.getvalue(), "printed"
open("run_config.yaml", "w").write(config.to_yaml(cfg))
assert "my_coeff: 0.5" in open("run_config.yaml").read(), "written"
again = checks.parse_args(["--config-file", "run_config.yaml"], world_size=1, gpu=False)
assert again.to_dict() == cfg.to_dict(), "round trip"
edited = checks.parse_args(["--config-file", "run_config.yaml", "--my-coeff", "0.25"], world_size=1, gpu=False)
assert edited.train.my_coeff == 0.25
err = io.StringIO()
with contextlib.redirect_stderr(err):
    try:
        checks.parse_args(["--my-coeff", "2"], world_size=1, gpu=False)
    except SystemExit as e:
        assert e.code == 2
assert "--my-coeff 2.0 is out of range: it must lie in [0, 1]" in err.getvalue(), err.getvalue()
print("recipe ok")
'''


def test_a_flag_of_ones_own_is_one_declaration_and_a_default_one_line_of_defaults(tmp_path):
    """docs/fork.md's recipe carried out on a copy of the code: one arg() line in a section's class gives the flag,
    its --help, its bounds' one-line error, its line in the printed config and in run_config.yaml, and the round trip
    through --config-file; one line of config.DEFAULTS changes a default, with the reason --help prints."""
    import shutil
    import subprocess
    import sys

    from conftest import ROOT

    for name in os.listdir(ROOT):
        if name.endswith(".py"):
            shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    source = (tmp_path / "config.py").read_text()
    anchor = '''    """Bridge's TrainingConfig: megatron-core's (megatron.training.config), plus Bridge's own fields."""\n'''
    assert source.count(anchor) == 1 and source.count("DEFAULTS = {\n") == 1
    source = source.replace(anchor, anchor + "\n" + FLAG_RECIPE).replace("DEFAULTS = {\n", "DEFAULTS = {\n" + DEFAULT_RECIPE)
    (tmp_path / "config.py").write_text(source)
    proc = subprocess.run([sys.executable, "-c", CHECK_IN_THE_COPY], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "recipe ok" in proc.stdout, proc.stderr[-3000:]


RECORDING = '''
import json, os, runpy, sys
sys.path.insert(0, sys.argv[1])  # the project
import data

def recorded(self, iterate=data.MegatronPretrainingSampler.__iter__):
    for batch in iterate(self):
        with open(f"samples.rank{os.environ['RANK']}", "a") as f:
            f.write(" ".join(map(str, batch)) + "\\n")
        yield batch

data.MegatronPretrainingSampler.__iter__ = recorded  # which samples this rank's loader asks the dataset for
# record.py PROJECT PLAN: each of PLAN's runs ({"cwd", "argv": my_data.py's command line, my_data.py docs.jsonl
# [flags]}) in turn, in this job (one start for both), each as `torchrun my_data.py ...` would run it
for run in json.load(open(sys.argv[2])):
    os.chdir(run["cwd"])
    sys.argv = run["argv"]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code:
            raise
    if os.environ["RANK"] == str(int(os.environ["WORLD_SIZE"]) - 1):  # the rank that prints the log lines
        print("=== run done", flush=True)
'''


def test_a_data_source_of_ones_own_splits_samples_over_data_parallel_ranks_and_resumes_exactly(tmp_path):
    """docs/fork.md's JSON-lines DatasetProvider, the page's block as it is, on two ranks (DP=2, micro-batches of 2, 2
    per rank per step): each rank reads its two of each four consecutive samples, the ranks together every sample
    once; a run resumed from the checkpoint of iteration 3 reads the samples the uninterrupted run read after it and
    prints its losses bit for bit (dropout on, Megatron-LM's default: its random stream resumes too)."""
    import json

    from conftest import ROOT, torchrun

    page = open(os.path.join(ROOT, "docs", "fork.md")).read()
    recipe = page[page.index("## A data source of your own"):]
    (tmp_path / "my_data.py").write_text(re.search(r"```python\n(.*?)```", recipe, re.S)[1])
    (tmp_path / "record.py").write_text(RECORDING)
    paragraphs = [p for p in open(os.path.join(ROOT, "README.md")).read().split("\n\n") if p.strip()]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    flags = [*TINY, "--train-iters", "6", "--global-batch-size", "8", "--log-interval", "1", "--eval-iters", "0"]

    runs = {"straight": ["--save", str(tmp_path / "ckpt"), "--save-interval", "3"],
            "resumed": ["--load", str(tmp_path / "ckpt"), "--ckpt-step", "3"]}
    for name in runs:
        (tmp_path / name).mkdir()
    (tmp_path / "plan.json").write_text(json.dumps([
        dict(cwd=str(tmp_path / name), argv=[str(tmp_path / "my_data.py"), str(tmp_path / "docs.jsonl"), *flags, *more])
        for name, more in runs.items()]))
    proc = torchrun([ROOT, str(tmp_path / "plan.json")], script=os.path.relpath(tmp_path / "record.py", ROOT),
                    cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    printed = proc.stdout.split("=== run done\n")
    assert len(printed) == 3, proc.stdout[-2000:]

    def samples(name):
        return [[[int(i) for i in line.split()] for line in open(tmp_path / name / f"samples.rank{rank}")]
                for rank in range(2)]

    straight, (rank0, rank1) = log_lines(printed[0]), samples("straight")
    assert rank0[:2] == [[0, 1], [4, 5]] and rank1[:2] == [[2, 3], [6, 7]]
    assert sorted(i for batch in rank0[:12] + rank1[:12] for i in batch) == list(range(48))  # 6 steps of 8, once each
    resumed, (again0, again1) = log_lines(printed[1]), samples("resumed")
    assert again0[:6] == rank0[6:12] and again1[:6] == rank1[6:12]  # samples 24-47, as the straight run read them
    assert [line[0] for line in resumed] == [4, 5, 6]
    assert [line[3] for line in resumed] == [line[3] for line in straight[3:]]


@pytest.mark.parametrize("gated", [True, pytest.param(False, marks=pytest.mark.full)], ids=["gated", "plain"])
def test_an_activation_of_ones_own_trains_at_tp2_as_at_tp1(tmp_path, gated):
    """docs/fork.md's Mish, both blocks as the page has them, put in a copy of config.py (gated: its GLU, the
    branch's gated_linear_unit=True): one process saves at iteration 3; TP=2 loads it resharded and gives the
    one-process lm loss and grad norm at iterations 4-6 (REORDERED: the same fp32 sums split over 2 ranks); fc1 is
    saved twice as wide when gated; the first loss is not GeLU's (the stock code's run); the export refuses it.
    Not covered: the other layouts (layouts.py runs them, as the page says), and an activation megatron-core's
    fused kernels take (TE layers, a GPU's)."""
    import shutil
    import subprocess
    import sys

    from conftest import REORDERED, ROOT, tensorboard_scalars, torchrun

    for name in os.listdir(ROOT):
        if name.endswith(".py"):
            shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    the_flag, the_branch = _fork_page_blocks("An MLP activation of your own")
    assert the_flag.startswith("# config.py, class GPTModelProvider") and the_branch.startswith("# config.py, GPTModelProvider.mlp_fields")
    if gated:
        assert the_branch.count("gated_linear_unit=False") == 1
        the_branch = the_branch.replace("gated_linear_unit=False", "gated_linear_unit=True")
    source = (tmp_path / "config.py").read_text()
    flag_anchor = "    swiglu: bool = arg("
    branch_anchor = "        return dict(gated_linear_unit=self.swiglu or self.quick_geglu,\n"
    assert source.count(flag_anchor) == 1 and source.count(branch_anchor) == 1
    source = source.replace(flag_anchor, the_flag.split("\n", 1)[1] + flag_anchor)
    source = source.replace(branch_anchor, the_branch.split("\n", 1)[1] + branch_anchor)
    (tmp_path / "config.py").write_text(source)
    base = [*TINY, "--mock-data", "--global-batch-size", "4", "--train-iters", "6", "--log-interval", "1",
            "--eval-iters", "0", "--num-workers", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--data-cache-path", str(tmp_path / "cache")]  # no dropout: a TP rank draws its own (as the matrix)
    flags = [*base, "--mish"]
    one = subprocess.run([sys.executable, str(tmp_path / "train.py"), *flags, "--save", str(tmp_path / "ckpt"),
                          "--tensorboard-dir", str(tmp_path / "tb_one"), "--save-interval", "3"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert one.returncode == 0, one.stderr[-3000:]
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(tmp_path / "ckpt" / "iter_0000003")).read_metadata().state_dict_metadata
    assert tuple(saved["decoder.layers.mlp.linear_fc1.weight"].size) == (2, 256 * (2 if gated else 1), 64)
    reference = tensorboard_scalars(tmp_path / "tb_one")
    train_here([*base, "--train-iters", "1", "--tensorboard-dir", str(tmp_path / "tb_gelu")])
    assert tensorboard_scalars(tmp_path / "tb_gelu")["lm loss"][1] != reference["lm loss"][1]
    proc = torchrun([*flags, "--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64",
                     "--load", str(tmp_path / "ckpt"), "--ckpt-step", "3", "--tensorboard-dir", str(tmp_path / "tb_tp2")],
                    script=str(tmp_path / "train.py"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert [line[0] for line in log_lines(proc.stdout)] == [4, 5, 6]
    ours = tensorboard_scalars(tmp_path / "tb_tp2")
    for tag in ("lm loss", "grad-norm"):
        for it in (4, 5, 6):
            assert ours[tag][it] == pytest.approx(reference[tag][it], rel=REORDERED), (tag, it)
    export = subprocess.run([sys.executable, str(tmp_path / "hf.py"), "export", "--load", str(tmp_path / "ckpt"),
                             "--out", str(tmp_path / "hf")], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert export.returncode != 0
    assert f"(has {'gated ' if gated else ''}mish)" in export.stderr.strip().splitlines()[-1], export.stderr[-2000:]


COLLECT_TOKEN_LOSSES = {  # a fork's collection of its per-token losses: anchor in train.py -> the lines before it
    "def forward_step(state: GlobalState,": "SEEN = []  # the per-token losses of this step's microbatches\n\n\n",
    "    return output, functools.partial(masked_token_loss,":
        "    SEEN.append(output)  # [micro batch, seq / CP] (the last stage's; one stage here)\n",
    "    return TrainStepResult(loss_dict, skipped_iter, False, False, 0,":
        "    rows = global_token_losses(SEEN)\n"
        "    SEEN.clear()\n"
        "    if torch.distributed.get_rank() == 0:\n"
        "        torch.save(rows, os.path.join(os.environ['TOKEN_LOSSES'], f'{global_state.train_state.step + 1}.pt'))\n",
}


@pytest.mark.parametrize("name, ranks, layout", [
    ("dp2", 2, []),
    pytest.param("cp2", 2, ["--context-parallel-size", "2"], marks=pytest.mark.full),
    pytest.param("dp2_cp2", 4, ["--context-parallel-size", "2"], marks=pytest.mark.full),
])
def test_a_global_batchs_per_token_losses_are_the_one_process_tensor(tmp_path, name, ranks, layout):
    """train.global_token_losses, called where a fork reads its losses (a copy of train.py collects each
    microbatch's output in forward_step and gathers them at the end of train_step): at DP, CP and both, rank 0 holds
    the one process's [global batch, seq] tensor at each of 3 iterations, row for row and position for position.
    Within REORDERED: the same fp32 forward, CP's attention over gathered keys and DP's reduced gradients summing
    the same terms in another order. Not covered: TP (every TP rank holds the whole tensor from megatron-core's
    vocab-parallel cross-entropy, and a TP run starts from other weights) and PP (the last stage alone has them)."""
    import shutil
    import subprocess
    import sys

    import torch

    from conftest import REORDERED, ROOT, torchrun

    for file in os.listdir(ROOT):
        if file.endswith(".py"):
            shutil.copy(os.path.join(ROOT, file), tmp_path / file)
    source = (tmp_path / "train.py").read_text()
    for anchor, lines in COLLECT_TOKEN_LOSSES.items():
        assert source.count(anchor) == 1, anchor
        source = source.replace(anchor, lines + anchor)
    (tmp_path / "train.py").write_text(source)
    flags = [*TINY, "--mock-data", "--global-batch-size", "8", "--train-iters", "3", "--eval-iters", "0",
             "--num-workers", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
             "--data-cache-path", str(tmp_path / "cache")]  # no dropout: each rank draws its own masks
    (tmp_path / "one").mkdir()
    (tmp_path / name).mkdir()
    one = subprocess.run([sys.executable, str(tmp_path / "train.py"), *flags], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1", TOKEN_LOSSES=str(tmp_path / "one")))
    assert one.returncode == 0, one.stderr[-3000:]
    os.environ["TOKEN_LOSSES"] = str(tmp_path / name)  # (torchrun's ranks inherit it)
    try:
        proc = torchrun([*flags, *layout], nproc=ranks, script=str(tmp_path / "train.py"), cwd=tmp_path)
    finally:
        del os.environ["TOKEN_LOSSES"]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for it in (1, 2, 3):
        reference, ours = (torch.load(tmp_path / d / f"{it}.pt") for d in ("one", name))
        assert reference.shape == ours.shape == (8, 64)
        torch.testing.assert_close(ours, reference, rtol=REORDERED, atol=0)


def _fork_page_blocks(section: str) -> list:
    """The python blocks of docs/fork.md's section `section`, in order."""
    from conftest import ROOT

    page = open(os.path.join(ROOT, "docs", "fork.md")).read()
    start = page.index(f"## {section}\n")
    end = page.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", page[start:end if end > 0 else None], re.S)


@pytest.mark.parametrize("name, layout", [
    ("tp2", ["--tensor-model-parallel-size", "2"]),
    pytest.param("tp2_sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"], marks=pytest.mark.full),
])
def test_a_layer_of_ones_own_trains_at_tp2_as_at_tp1_and_saves_split(tmp_path, name, layout):
    """docs/fork.md's ScaledRowParallelLinear, both blocks as the page has them, put in a copy of model.py: one process
    saves at iteration 3 (the scales trained away from 1: lr 3e-3, 3 steps); TP=2 (or TP=2 with sequence parallelism)
    loads it resharded and give the one-process lm loss, grad norm and the scales' own gradient norm at iterations 4-6
    (REORDERED; read back from TensorBoard at full precision); the checkpoint holds each layer's scale as one tensor
    of the MLP's width.""" 
    import shutil
    import subprocess
    import sys

    from conftest import REORDERED, ROOT, tensorboard_scalars, torchrun

    for name in os.listdir(ROOT):
        if name.endswith(".py"):
            shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    the_class, the_line = _fork_page_blocks("A layer of your own")
    source = (tmp_path / "model.py").read_text()
    anchor = "    attention.core_attention = core_attention(m)\n"
    assert source.count(anchor) == 1 and the_class.startswith("# model.py\n") and the_line.startswith("# layer_spec")
    source = source.replace(anchor, anchor + the_line.split("\n", 1)[1])
    source = source.replace("\ndef layer_spec(", "\n" + the_class.split("\n", 1)[1] + "\n\ndef layer_spec(")
    (tmp_path / "model.py").write_text(source)
    flags = [*TINY, "--mock-data", "--global-batch-size", "4", "--train-iters", "6", "--log-interval", "1",
             "--eval-iters", "0", "--num-workers", "0", "--log-l2-norm-grad", "--hidden-dropout", "0", "--attention-dropout", "0",
             "--data-cache-path", str(tmp_path / "cache")]  # no dropout: a TP rank draws its own (as the matrix)
    one = subprocess.run([sys.executable, str(tmp_path / "train.py"), *flags, "--save", str(tmp_path / "ckpt"),
                          "--tensorboard-dir", str(tmp_path / "tb_one"),
                          "--save-interval", "3"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert one.returncode == 0, one.stderr[-3000:]
    assert "ScaledRowParallelLinear" in open(tmp_path / "model.py").read()
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(tmp_path / "ckpt" / "iter_0000003")).read_metadata().state_dict_metadata
    scales = {k: tuple(v.size) for k, v in saved.items() if k.endswith("input_scale") and "optimizer" not in k}
    assert scales == {"decoder.layers.mlp.linear_fc2.input_scale": (2, 256)}, scales  # 2 layers x 4 x 64 hidden units
    scale_grad = "l2_norm/grad/decoder.layers.0.mlp.linear_fc2.input_scale"
    reference = tensorboard_scalars(tmp_path / "tb_one")
    proc = torchrun([*flags, *layout, "--make-vocab-size-divisible-by", "64", "--load", str(tmp_path / "ckpt"),
                     "--ckpt-step", "3", "--tensorboard-dir", str(tmp_path / f"tb_{name}")],
                    script=str(tmp_path / "train.py"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert [line[0] for line in log_lines(proc.stdout)] == [4, 5, 6]
    ours = tensorboard_scalars(tmp_path / f"tb_{name}")
    for tag in ("lm loss", "grad-norm", scale_grad):
        for it in (4, 5, 6):
            assert ours[tag][it] == pytest.approx(reference[tag][it], rel=REORDERED), (name, tag, it)
