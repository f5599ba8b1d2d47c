"""data.py: preprocessing real text into megatron-core indexed datasets, training on a blend, bad input."""

import itertools
import json
import os
import subprocess
import sys

import pytest
import torch

import config
import checks
from conftest import ROOT, TINY, log_lines, torchrun


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Two real corpora present on every machine: CPython's documentation topics (JSONL, a paragraph per
    line) and the docstrings of standard-library modules (a directory of text files)."""
    import importlib

    import pydoc_data.topics

    root = tmp_path_factory.mktemp("corpora")
    with open(root / "topics.jsonl", "w") as fh:
        for key in sorted(pydoc_data.topics.topics):
            for paragraph in pydoc_data.topics.topics[key].split("\n\n"):
                if paragraph.strip():
                    fh.write(json.dumps({"text": paragraph, "topic": key}) + "\n")
    docs = root / "docstrings"
    docs.mkdir()
    for name in ["argparse", "collections", "dataclasses", "email", "functools", "inspect", "json", "logging",
                 "pathlib", "re", "subprocess", "typing", "unittest", "urllib.parse", "zipfile", "asyncio"]:
        (docs / f"{name}.txt").write_text(importlib.import_module(name).__doc__ or "")
    return root


def _preprocess_command(*args):
    """`python data.py preprocess ARGS`, a process of its own (the command line as a user runs it)."""
    return subprocess.run([sys.executable, "data.py", "preprocess", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def _preprocess(*args):
    """The same in this process (data.main, what `python data.py` calls): its exit code and what it printed, without
    a process's import of torch and megatron-core."""
    import contextlib
    import io

    import data

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = data.main(["preprocess", *args])
        except SystemExit as e:
            code = e.code
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def test_preprocess_jsonl_and_read_back_with_megatron_core(corpora, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from data import ByteTokenizer

    proc = _preprocess("--input", str(corpora / "topics.jsonl"), "--output-prefix", str(tmp_path / "topics"),
                       "--json-keys", "text", "topic", "--append-eod", "--workers", "2", "--log-interval", "0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "MB/s" in proc.stdout and "ETA" in proc.stderr  # the summary, and progress lines while running
    lines = [json.loads(l) for l in (corpora / "topics.jsonl").read_text().splitlines()]
    texts = IndexedDataset(str(tmp_path / "topics_text_document"))
    topics = IndexedDataset(str(tmp_path / "topics_topic_document"))
    assert len(texts) == len(topics) == len(lines) > 2000
    tokenizer = ByteTokenizer()
    for i in (0, 1, len(lines) - 1):
        ids = texts[i].tolist()
        assert ids[-1] == tokenizer.eod and tokenizer.detokenize(ids[:-1]) == lines[i]["text"]
        assert tokenizer.detokenize(topics[i].tolist()[:-1]) == lines[i]["topic"]


@pytest.mark.full  # the fast command: its one-process sibling
def test_preprocess_a_directory_of_text_files(corpora, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    proc = _preprocess("--input", str(corpora / "docstrings"), "--output-prefix", str(tmp_path / "doc"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    blocks = [b for f in sorted(os.listdir(corpora / "docstrings"))
              for b in (corpora / "docstrings" / f).read_text().split("\n\n") if b.strip()]
    assert len(IndexedDataset(str(tmp_path / "doc_text_document"))) == len(blocks)


@pytest.mark.parametrize("content, args, message", [
    (None, [], "no such file or directory"),
    ("", [], "the corpus is empty"),
    ('{"text": "a"}\nnot json\n', [], ":2: not a JSON line"),
    ('{"body": "a"}\n', [], "no key 'text' (keys: body); set --json-keys"),
    ('{"text": ["a", 3]}\n', [], "'text' is a list with a non-text element"),
])
def test_preprocess_bad_input_is_one_line(tmp_path, content, args, message, capsys):
    """The first case through the command line (a process of its own), the others through its main()."""
    import data

    path = tmp_path / "in.jsonl"
    if content is not None:
        path.write_text(content)
    argv = ["preprocess", "--input", str(path), "--output-prefix", str(tmp_path / "out"), *args]
    if content is None:
        proc = _preprocess_command(*argv[1:])
        code, err = proc.returncode, proc.stderr
    else:
        code, err = data.main(argv), capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err and err.count("\n") == 1, err
    assert not list(tmp_path.glob("out*"))  # nothing half-written left behind


@pytest.mark.parametrize("append_eod", [False, True])
@pytest.mark.parametrize("tokenizer, flags, fixture", [
    ("tokenizer", [], "megatron_lm"),
    ("tokenizer_bos", [], "megatron_lm_bos"),  # its post-processor prepends <s>: Megatron-LM 0.19 writes it
    ("tokenizer_bos", ["--tokenizer-hf-no-include-special-tokens"], "megatron_lm")])
def test_preprocess_is_byte_identical_to_megatron_lms(tmp_path, append_eod, tokenizer, flags, fixture, capsys):
    """The .bin/.idx that Megatron-LM's own tools/preprocess_data.py wrote (tests/fixtures/preprocess/README.md),
    with a HuggingFace tokenizer, from plain texts, a sentence list with an empty element, an empty text and an
    empty list: data.py preprocess writes the same bytes, the tokens a post-processor adds included unless
    --tokenizer-hf-no-include-special-tokens (then the plain tokenizer's bytes, as Megatron-LM writes them)."""
    import data

    fixtures = os.path.join(ROOT, "tests", "fixtures", "preprocess")
    argv = ["preprocess", "--input", os.path.join(fixtures, "input.jsonl"), "--output-prefix", str(tmp_path / "ours"),
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", os.path.join(fixtures, tokenizer), *flags]
    assert data.main(argv + (["--append-eod"] if append_eod else [])) == 0, capsys.readouterr().err
    theirs = os.path.join(fixtures, fixture + ("_eod" if append_eod else ""))
    for suffix in ("_text_document.bin", "_text_document.idx"):
        with open(str(tmp_path / "ours") + suffix, "rb") as ours, open(theirs + suffix, "rb") as mlm:
            assert ours.read() == mlm.read(), suffix


@pytest.mark.parametrize("flags", [[], ["--tokenizer-hf-no-include-special-tokens"]])
def test_training_tokenizes_text_as_megatron_cores_huggingface_tokenizer(flags):
    """Where text is tokenized at training time (the --sft examples, generate.py's prompt, the built-in corpus), the
    ids are megatron-core 0.19's HuggingFaceTokenizer's, built by its own build_tokenizer from the same flags: the
    post-processor's <s> first unless --tokenizer-hf-no-include-special-tokens."""
    import argparse

    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training.arguments import _add_tokenizer_args

    import data

    model = os.path.join(ROOT, "tests", "fixtures", "preprocess", "tokenizer_bos")
    ours = data.build_tokenizer(checks.parse_args(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", model,
                                                   *flags], world_size=1, gpu=False))
    args = _add_tokenizer_args(argparse.ArgumentParser()).parse_args(
        ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", model, *flags])
    args.rank, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size = 1, 128, 1  # as preprocess_data.py
    theirs = build_tokenizer(args)
    prompt, response = "Python is an easy", " to learn language."
    assert ours.tokenize(prompt) == theirs.tokenize(prompt)
    assert (ours.tokenize(prompt)[0] == 300) == (not flags)  # <s>
    ids, mask = data.sft_example({"prompt": prompt, "response": response}, ours, "x")
    assert ids == theirs.tokenize(prompt) + theirs.tokenize(response) + [ours.eod]


@pytest.mark.parametrize("append_eod", [False, True])
def test_preprocess_list_and_empty_texts_as_megatron_lm(tmp_path, append_eod, capsys):
    """Megatron-LM's tools/preprocess_data.py (Encoder.encode): a "text" that is a list is one document of one
    sequence per non-empty element, the end-of-document token appended to its last; an empty text is a document
    with no sequence, and stays empty with --append-eod."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    import data

    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in (["Hello world. ", "", "Second one."], "", "plain")))
    argv = ["preprocess", "--input", str(path), "--output-prefix", str(tmp_path / "out")]
    assert data.main(argv + (["--append-eod"] if append_eod else [])) == 0, capsys.readouterr().err
    dataset = IndexedDataset(str(tmp_path / "out_text_document"))
    eod = int(append_eod)
    assert dataset.sequence_lengths.tolist() == [13, 11 + eod, 5 + eod]
    assert dataset.document_indices.tolist() == [0, 2, 2, 3]  # the empty text: a document of no sequence
    expected = [list(b"Hello world. "), list(b"Second one.") + [data.ByteTokenizer().eod] * eod,
                list(b"plain") + [data.ByteTokenizer().eod] * eod]
    assert [dataset[i].tolist() for i in range(3)] == expected


@pytest.fixture(scope="module")
def prefixes(corpora, tmp_path_factory):
    out = tmp_path_factory.mktemp("indexed")
    for name, src in (("a", "topics.jsonl"), ("b", "docstrings")):
        assert _preprocess("--input", str(corpora / src), "--output-prefix", str(out / name), "--append-eod").returncode == 0
    return str(out / "a_text_document"), str(out / "b_text_document")


@pytest.mark.full  # the fast command: its one-process sibling
def test_two_rank_training_on_a_weighted_blend(prefixes, tmp_path, warm_torchrun):
    a, b = prefixes
    proc = warm_torchrun([*TINY, "--data-path", "0.7", a, "0.3", b, "--split", "90,8,2", "--train-iters", "20",
                     "--global-batch-size", "8", "--log-interval", "5", "--eval-interval", "10", "--eval-iters", "2",
                     "--data-cache-path", str(tmp_path / "cache"), "--num-workers", "1"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [l[3] for l in log_lines(proc.stdout)]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert "validation loss at iteration 20 on test set" in proc.stdout
    # megatron-core's blended dataset indices were cached where --data-cache-path says.
    assert any(f.endswith("dataset_index.npy") for _, _, fs in os.walk(tmp_path / "cache") for f in fs)


def test_token_ids_outside_the_vocabulary_are_refused_before_training(tmp_path):
    import train
    from data import NullTokenizer, write_indexed_dataset

    prefix = str(tmp_path / "big_ids")
    write_indexed_dataset([" ".join(str(i) for i in range(500, 900))] * 50, NullTokenizer(1000), prefix)
    cfg = checks.parse_args([*TINY, "--data-path", prefix, "--split", "1,0,0", "--eval-iters", "0", "--num-workers", "0",
                             "--data-cache-path", str(tmp_path / "c")], world_size=1, gpu=False)
    # the end-of-document of a NullTokenizer of 1000 ids is id 999, the largest id written
    with pytest.raises(config.ConfigError, match=r"big_ids.bin holds token id 999 but the vocabulary has 257 ids"):
        train.pretrain(cfg)
    assert not torch.distributed.is_initialized()


def test_megatron_cores_builder_is_handed_the_dataset_section(prefixes, tmp_path, single_rank_groups):
    """The dataset section is a megatron-core GPTDatasetConfig, and megatron-core's dataset builder gets it (finalized,
    with the tokenizer), not a config copied from it field by field: --no-mmap-bin-files, megatron-core's
    mmap_bin_files, reaches the indexed dataset, which reads the .bin through file pointers."""
    import data

    a, _ = prefixes
    cfg = checks.parse_args([*TINY, "--data-path", a, "--no-mmap-bin-files", "--data-cache-path", str(tmp_path / "c"),
                             "--train-iters", "2"], world_size=1, gpu=False)
    train_set = data.build_datasets(cfg, data.ByteTokenizer())[0]
    assert type(train_set.config) is config.GPTDatasetConfig and train_set.config.blend == ([a], None)
    assert train_set.dataset.mmap is False and train_set.config.path_to_cache == str(tmp_path / "c")
    assert cfg.dataset.tokenizer is None  # the section itself keeps no tokenizer: its copy was finalized


def test_bin_without_idx_is_refused_at_parse_time(prefixes, tmp_path, capsys):
    a, _ = prefixes
    lone = tmp_path / "lone"
    (tmp_path / "lone.bin").write_bytes(open(a + ".bin", "rb").read()[:64])
    with pytest.raises(SystemExit):
        checks.parse_args(["--data-path", str(lone)], world_size=1, gpu=False)
    assert f"{lone}.idx not found" in capsys.readouterr().err


def test_a_custom_dataset_provider_feeds_pretrain(tmp_path, capsys):
    """A user's DatasetProvider, as in the seed: build_datasets(context) -> (train, valid, test)."""
    import dataclasses

    import train

    @dataclasses.dataclass
    class CountingDataset(config.DatasetProvider):
        seq_length: int = 64
        seen: list = dataclasses.field(default_factory=list)

        def build_datasets(self, context):
            self.seen.append(context)
            self.data_parallel_size = context.pg_collection.dp.size()  # the run's groups, alive while it runs

            class Counting(torch.utils.data.Dataset):  # next token = previous + 1, mod 50
                def __init__(self, n, seq):
                    self.n, self.seq = n, seq

                def __len__(self):
                    return self.n

                def __getitem__(self, i):
                    tokens = (torch.arange(self.seq + 1) + i) % 50
                    return {"tokens": tokens[:-1], "labels": tokens[1:], "loss_mask": torch.ones(self.seq),
                            "position_ids": torch.arange(self.seq)}
            return (Counting(context.train_samples, self.seq_length), Counting(context.valid_samples, self.seq_length),
                    None)

    cfg = checks.parse_args([*TINY, "--train-iters", "30", "--log-interval", "10", "--eval-interval", "30",
                             "--eval-iters", "1"], world_size=1, gpu=False)
    cfg.dataset = CountingDataset()
    state = train.pretrain(cfg)
    out = capsys.readouterr().out
    context = cfg.dataset.seen[0]
    assert (context.train_samples, context.valid_samples, context.test_samples) == (60, 4, 2)
    assert context.tokenizer is not None and state.train_state.step == 30
    # Bridge's DatasetBuildContext.pg_collection: the run's process groups (one rank here: a data-parallel group of 1)
    assert cfg.dataset.data_parallel_size == 1
    losses = [l[3] for l in log_lines(out)]
    assert losses[-1] < 0.7 * losses[0]
    assert "validation loss at iteration 30 on validation set" in out and "on test set" not in out


def test_cyclic_sampler_reshuffles_each_epoch_and_resumes_mid_epoch():
    from data import MegatronPretrainingRandomSampler

    def draw(consumed, n_batches, rank=0, size=1):
        it = iter(MegatronPretrainingRandomSampler(20, consumed, 2, rank, size))
        return [i for _ in range(n_batches) for i in next(it)]

    first_epoch, second_epoch = draw(0, 10), draw(20, 10)
    assert sorted(first_epoch) == sorted(second_epoch) == list(range(20)) and first_epoch != second_epoch
    assert draw(8, 6) == draw(0, 10)[8:]  # resuming after 8 samples continues the same permutation
    two_ranks = draw(0, 5, rank=0, size=2) + draw(0, 5, rank=1, size=2)
    assert sorted(two_ranks) == list(range(20))  # ranks split the epoch without overlap


@pytest.mark.parametrize("sharding", [True, False], ids=["data_sharding", "no_data_sharding"])
def test_cyclic_sampler_shuffles_as_megatron_lm(sharding):
    """The first two epochs' order, on each of 2 data-parallel ranks, from the start and from mid-epoch, is that of
    Megatron-LM's own sampler for the same arguments (its seed is the epoch alone; --seed changes nothing)."""
    from data import MegatronPretrainingRandomSampler
    from megatron.training.datasets.data_samplers import MegatronPretrainingRandomSampler as Theirs

    total, mbs, size = 23, 2, 2  # 23 % (2 x 2) = 3: the dropped tail too
    for rank, consumed in itertools.product(range(size), (0, 8)):
        ours = iter(MegatronPretrainingRandomSampler(total, consumed, mbs, rank, size, sharding))
        theirs = Theirs(None, total, consumed, mbs, rank, size, sharding)
        expected = list(theirs) + list(theirs)  # each pass over theirs is one epoch, from where the last one ended
        assert [next(ours) for _ in expected] == expected, (rank, consumed)


class _Call:
    """What a crafted pickle holds: a call, run when the file is read (here open(path, "w"), which makes the file)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def test_a_packed_sequence_file_is_read_without_running_its_pickle(tmp_path):
    """Bridge's packed-sequence file is np.save of a list of dicts (pickled objects): its lists, dicts and numpy
    numbers read back as saved; a file whose pickle names a callable is one line, and the call never runs."""
    import numpy as np

    import data

    elements = [{"input_ids": [5, 6, 7], "loss_mask": [False, True, True], "seq_start_id": [0]},
                {"input_ids": np.array([8, 9], dtype=np.int64), "loss_mask": [np.int64(0), np.int64(1)],
                 "seq_start_id": np.array([0])}]
    good = tmp_path / "packed.npy"
    np.save(good, elements)
    assert data.read_bridge_packed(str(good), 4) == [([5, 6, 7], [0, 0, 1], [3]), ([8, 9], [0, 0], [2])]

    ran = tmp_path / "ran"
    crafted = tmp_path / "crafted.npy"
    np.save(crafted, [dict(elements[0], note=_Call(str(ran)))])
    with pytest.raises(config.ConfigError) as e:
        data.read_bridge_packed(str(crafted), 4)
    assert not ran.exists()
    assert str(e.value).startswith(f"{crafted}: its pickled objects call ") and "\n" not in str(e.value), e.value


def test_document_resets_reach_megatron_core(prefixes, tmp_path):
    """--reset-position-ids / --reset-attention-mask / --eod-mask-loss shape the samples at each end-of-document."""
    import data

    a, _ = prefixes
    flags = [*TINY, "--data-path", a, "--data-cache-path", str(tmp_path / "c"), "--train-iters", "2",
             "--seq-length", "1024"]  # paragraphs average ~180 bytes: a 1024-token sample spans several
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        cfg = checks.parse_args(flags + ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"],
                                world_size=1, gpu=False)
        sample = data.build_datasets(cfg, data.ByteTokenizer())[0][0]
    finally:
        torch.distributed.destroy_process_group()
    eod = (sample["tokens"] == data.ByteTokenizer().eod).nonzero().flatten().tolist()
    assert eod, "a 1024-token sample of paragraph-sized documents holds an end-of-document token"
    e = next(i for i in eod if i + 1 < 1024)
    assert sample["loss_mask"][e] == 0  # no loss on predicting from the end-of-document token
    assert sample["position_ids"][e + 1] == 0  # positions restart in the next document
    assert bool(sample["attention_mask"][0, e + 1, e])  # and it cannot attend back across the boundary


@pytest.fixture(scope="module")
def hf_tokenizer(corpora, tmp_path_factory):
    """A small byte-level BPE trained here, offline, on the topics corpus, saved as tokenizer.json."""
    tokenizers = pytest.importorskip("tokenizers", reason="HuggingFace tokenizers is optional; requirements.txt installs it")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    texts = [json.loads(l)["text"] for l in (corpora / "topics.jsonl").read_text().splitlines()]
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_huggingface_tokenizer_preprocess_train_and_checkpoint(corpora, hf_tokenizer, tmp_path, capsys):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    import checkpoint
    import train
    from data import HuggingFaceTokenizer

    proc = _preprocess("--input", str(corpora / "topics.jsonl"), "--output-prefix", str(tmp_path / "hf"), "--append-eod",
                       "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(hf_tokenizer.parent),
                       "--workers", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    tok = HuggingFaceTokenizer(str(hf_tokenizer))
    assert tok.eod == tok._tokenizer.token_to_id("<|endoftext|>") and tok.vocab_size == 600
    first = json.loads((corpora / "topics.jsonl").read_text().splitlines()[0])["text"]
    dataset = IndexedDataset(str(tmp_path / "hf_text_document"))  # keep it: its samples are views of its mmap
    ids = dataset[0].tolist()
    assert ids[-1] == tok.eod and tok.detokenize(ids) == first and len(ids) < 0.6 * len(first.encode())

    flags = [*TINY, "--data-path", str(tmp_path / "hf_text_document"), "--train-iters", "4", "--eval-iters", "0",
             "--num-workers", "0", "--data-cache-path", str(tmp_path / "c"), "--save", str(tmp_path / "ck")]
    state = train.pretrain(checks.parse_args(flags + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                                      str(hf_tokenizer)], world_size=1, gpu=False))
    assert state.train_state.step == 4
    saved = tmp_path / "ck" / "iter_0000004"
    assert (saved / "tokenizer" / "tokenizer.json").read_bytes() == hf_tokenizer.read_bytes()
    assert json.loads((saved / "tokenizer" / "identity.json").read_text())["class"] == "HuggingFaceTokenizer"
    # Resuming with another tokenizer is refused, naming both.
    with pytest.raises(checkpoint.CheckpointError, match="were trained with tokenizer .*HuggingFaceTokenizer.* but the flags give"):
        train.pretrain(checks.parse_args(flags + ["--load", str(tmp_path / "ck"), "--train-iters", "4",
                                                  "--data-path", str(tmp_path / "hf_text_document")],
                                         world_size=1, gpu=False))


def test_resume_mid_epoch_on_a_real_blend_reads_what_a_straight_run_reads(prefixes, tmp_path, capsys):
    """A weighted blend of the two preprocessed corpora: 8 iterations straight, or 4 + resume to 8, read the
    same samples and print the same losses, bitwise (dropout on)."""
    import train

    a, b = prefixes
    seen = {}

    def recording(tag):
        def forward_step(state, data_iterator, model):
            batch = next(data_iterator)
            seen.setdefault(tag, []).append((state.train_state.step, batch["tokens"].clone()))
            return train.forward_step(state, iter([batch]), model)
        return forward_step

    def run(tag, *extra):
        cfg = checks.parse_args([*TINY, "--data-path", "0.6", a, "0.4", b, "--split", "99,1,0", "--train-iters", "8",
                                 "--log-interval", "1",
                                 "--eval-iters", "0", "--num-workers", "0", "--data-cache-path", str(tmp_path / "c"),
                                 *extra], world_size=1, gpu=False)
        train.pretrain(cfg, recording(tag))
        return {l[0]: l[3] for l in log_lines(capsys.readouterr().out)}

    straight = run("straight")
    first = run("first", "--exit-interval", "4", "--save", str(tmp_path / "ck"))
    second = run("second", "--load", str(tmp_path / "ck"))
    assert {**first, **second} == straight
    resumed = [t for s, t in seen["second"]]
    assert all(torch.equal(x, y) for x, y in zip(resumed, [t for s, t in seen["straight"] if s >= 4]))


def test_separate_train_and_validation_paths(prefixes, tmp_path, capsys):
    import train

    a, b = prefixes
    cfg = checks.parse_args([*TINY, "--train-data-path", a, "--valid-data-path", b, "--train-iters", "4",
                             "--eval-interval", "2", "--eval-iters", "1", "--num-workers", "0",
                             "--data-cache-path", str(tmp_path / "c")], world_size=1, gpu=False)
    train.pretrain(cfg)
    out = capsys.readouterr().out
    assert "validation loss at iteration 4 on validation set" in out and "on test set" not in out  # no test path


def test_a_rank_that_fails_with_loader_workers_exits(tmp_path):
    """An exception in a rank whose DataLoader has worker processes ends the process with the error. Its iterators
    stay alive in the traceback, so their workers get no end-of-work message, and multiprocessing's exit hook waits
    for them after a SIGTERM they ignore (data_worker_init): without data._shut_down_workers the rank hangs for ever
    and torchrun never sees it fail."""
    script = f"""
import sys
sys.path.insert(0, {ROOT!r})
import checks, config, train

def boom(data_iterator, model):
    next(data_iterator)
    raise RuntimeError("a forward step that fails")

cfg = checks.parse_args([*{TINY!r}, "--mock-data", "--train-iters", "5", "--eval-iters", "0", "--num-workers", "2",
                         "--data-cache-path", {str(tmp_path / "cache")!r}], world_size=1, gpu=False)
train.pretrain(cfg, forward_step_func=boom)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 1 and "RuntimeError: a forward step that fails" in proc.stderr, proc.stderr[-2000:]


class _DeathSignal(torch.utils.data.Dataset):
    """One item: the signal this process gets when its parent ends (Linux's prctl PR_GET_PDEATHSIG; 0: none)."""

    def __len__(self):
        return 1

    def __getitem__(self, index):
        import ctypes

        value = ctypes.c_int()
        ctypes.CDLL(None).prctl(2, ctypes.byref(value), 0, 0, 0)  # PR_GET_PDEATHSIG
        return value.value


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's prctl")
def test_a_data_worker_dies_with_its_rank():
    """A rank's DataLoader worker gets SIGKILL when the rank ends (data.die_with_parent): a rank killed with SIGKILL
    then closes its process groups' connections at once, not when torch's worker next looks for its parent (every
    5 s), and the other ranks fail and restart without waiting for it (README: defects)."""
    import functools
    import signal

    import data

    loader = torch.utils.data.DataLoader(_DeathSignal(), num_workers=1,
                                         worker_init_fn=functools.partial(data.data_worker_init, signal.SIGTERM))
    batches = iter(loader)
    try:
        assert next(batches).tolist() == [signal.SIGKILL]
    finally:
        batches._shutdown_workers()  # the worker ignores SIGTERM (data_worker_init): end it before the exit hooks


def test_a_sigterm_during_the_exit_leaves_no_rank_waiting_on_its_workers():
    """A rank that is ending (another rank failed, its own step raised) gets torchrun's SIGTERM while data.py's exit
    hook shuts its DataLoader workers down: the rank still exits at once. (Without SIG_IGN there, train.py's handler
    raised in the middle of the shutdown, and multiprocessing's exit hook then waited on the workers, which ignore
    SIGTERM, until torchrun's SIGKILL 30 s later.)"""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "scripts", "signal_at_exit.py")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "exiting\n", proc.stderr[-3000:]


@pytest.mark.parametrize("documents, split, empty", [(1, "1,1,1", "train"), (3, "98,2,0", "validation"),
                                                     (3, "1,1,1", None), (1, "100,0,0", None)])
def test_a_split_left_empty_is_refused_as_megatron_core_cuts_it(tmp_path, documents, split, empty):
    """megatron-core 0.19 cuts each split at the rounded bookends of the normalised --split
    (blended_megatron_dataset_builder.py:470-471): one document under 1,1,1 goes to the validation set (its
    bookends 1/3 and 2/3 round to 0 and 1), which leaves the training set with none, where a GPTDataset would look
    for tokens forever. The check refuses exactly the splits megatron-core leaves empty."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    import data
    from config import ConfigError

    builder = IndexedDatasetBuilder(str(tmp_path / "d.bin"), dtype=np.int32)
    for i in range(documents):
        builder.add_document(torch.arange(10, dtype=torch.int32) + i, [10])
    builder.finalize(str(tmp_path / "d.idx"))
    if empty is None:
        data.check_split_not_empty([str(tmp_path / "d")], split)
    else:
        with pytest.raises(ConfigError, match=f"leaves the {empty} set of"):
            data.check_split_not_empty([str(tmp_path / "d")], split)
