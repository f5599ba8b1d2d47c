"""data.py: tokenizers, the built-in corpus, megatron-core datasets, samplers and data iterators.

Names with an upstream are Megatron-LM's (its tokenizers, samplers, GPTFIMDataset, tools/preprocess_data.py).

Datasets are megatron-core's own: `GPTDataset` over indexed `.bin/.idx` files, or `MockGPTDataset`,
built by `BlendedMegatronDatasetBuilder` for the train/validation/test splits. A sampler turns the
number of samples already consumed into the next microbatch of this data-parallel rank, so a resumed
run reads exactly what an uninterrupted one would have.
"""

import atexit
import dataclasses
import functools
import json
import multiprocessing.util  # its exit hook registered before this module's (see _shut_down_workers)
import os
import pickle
import signal
import sys
import threading
import time
import weakref

import numpy as np
import torch

import device  # first: it quiets megatron-core's import-time warnings
from config import (BUILTIN_BPE_VOCAB, ConfigError, DatasetBuildContext, DatasetProvider, blend_of, builtin_bpe_path,
                    builtin_corpus_cache, uses_builtin_corpus)
from device import any_rank
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import (convert_split_vector_to_split_matrix,
                                                                   parse_and_normalize_split)
from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.training.datasets import data_samplers

# --------------------------------------------------------------------------------------------------
# Tokenizers: what megatron-core's datasets need of one is vocab_size, eod, pad and unique_identifiers.
# The model's embedding table has a row for every id up to and including pad (see embedding_rows).
# --------------------------------------------------------------------------------------------------


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0-255, then end-of-document. Nothing to download, any text encodes."""

    def __init__(self):
        self.eod = 256
        self.vocab_size = 257
        # The pad id sits just past the vocabulary, so no text (and no MockGPTDataset token, drawn from
        # 0..vocab_size-1) ever equals it: GPTDataset zeroes the loss where labels == pad, and megatron-core
        # does that in place on its cached loss mask the first time, which would otherwise make the
        # mask depend on which sample a run happened to read first (and break exact resume).
        self.pad = self.vocab_size
        self.unique_identifiers = {"class": "ByteTokenizer", "vocab_size": self.vocab_size}

    def tokenize(self, text: str) -> list:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class NullTokenizer:
    """Token ids given as-is: `vocab_size` ids, the last of them the end-of-document, and no pad token (id -1), as
    Megatron-LM's from core_v0.17 (megatron/core/tokenizers/text/libraries/null_tokenizer.py). Megatron-LM <= 0.16's
    counted the end-of-document apart: its --vocab-size V is V + 1 here (see `null_tokenizer_said`)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1
        self.pad = -1  # none: GPTDataset masks nothing as padding, and the embedding needs no row for it
        self.unique_identifiers = {"class": "NullTokenizer", "vocab_size": vocab_size, "eod_id": self.eod}

    def tokenize(self, text: str) -> list:
        return [int(x) for x in text.split()]

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


class HuggingFaceTokenizer:
    """A HuggingFace `tokenizers` tokenizer from a local tokenizer.json (nothing is downloaded). Its
    end-of-document token is the first of the usual names it knows, or a new id past its vocabulary.

    A text's ids include what its post-processor adds (LLaMA's <s>) unless include_special_tokens is False, as
    megatron-core 0.19's HuggingFaceTokenizer.text_to_ids (tokenizers/text/libraries/huggingface_tokenizer.py:41,
    262-268) and so Megatron-LM's preprocess_data.py, training and generation (--tokenizer-hf-no-include-special-tokens,
    megatron/core/tokenizers/utils/build_tokenizer.py:76)."""

    EOD_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")

    def __init__(self, path: str, include_special_tokens: bool = True):
        import hashlib

        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError("--tokenizer-type HuggingFaceTokenizer needs the tokenizers package: pip install tokenizers")
        self.file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(self.file):
            raise ConfigError(f"--tokenizer-model {path}: no tokenizer.json there")
        self._tokenizer = Tokenizer.from_file(self.file)
        size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        known = [self._tokenizer.token_to_id(n) for n in self.EOD_NAMES if self._tokenizer.token_to_id(n) is not None]
        self.eod = known[0] if known else size
        self.vocab_size = max(size, self.eod + 1)
        self.pad = self.vocab_size
        digest = hashlib.sha256(open(self.file, "rb").read()).hexdigest()[:16]
        self.unique_identifiers = {"class": "HuggingFaceTokenizer", "sha256": digest, "vocab_size": self.vocab_size}
        self.include_special_tokens = include_special_tokens
        if self._tokenizer.post_processor is not None:  # only there does the choice change a text's ids
            self.unique_identifiers["include_special_tokens"] = include_special_tokens

    def tokenize(self, text: str) -> list:
        return self._tokenizer.encode(text, add_special_tokens=self.include_special_tokens).ids

    def detokenize(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids if int(i) != self.eod and int(i) < self.vocab_size])


def embedding_rows(tokenizer) -> int:
    """Ids the embedding table must hold: the vocabulary and the pad id just past it."""
    return max(tokenizer.vocab_size, tokenizer.pad + 1)


def build_tokenizer(cfg):
    tk = cfg.tokenizer
    if tk.tokenizer_type == "HuggingFaceTokenizer":
        if tk.tokenizer_model == builtin_bpe_path(cfg):
            train_builtin_bpe(tk.tokenizer_model)
        tokenizer = HuggingFaceTokenizer(tk.tokenizer_model, not tk.tokenizer_hf_no_include_special_tokens)
    else:
        tokenizer = NullTokenizer(tk.vocab_size) if tk.tokenizer_type == "NullTokenizer" else ByteTokenizer()
    if getattr(cfg.dataset, "fim_data", False):
        add_fim_tokens(tokenizer, cfg.dataset)
    return tokenizer


# --------------------------------------------------------------------------------------------------
# The built-in corpus: CPython's own documentation, present offline on every machine
# --------------------------------------------------------------------------------------------------


def write_indexed_dataset(documents, tokenizer, prefix: str) -> str:
    """Tokenize documents (strings) into PREFIX.bin/.idx, megatron-core's indexed format, one
    end-of-document token after each. Files appear atomically (written aside, then renamed)."""
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    tmp = f"{prefix}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(tmp + ".bin", dtype=np.int32 if tokenizer.vocab_size > 65500 else np.uint16)
    for text in documents:
        builder.add_item(torch.tensor(tokenizer.tokenize(text) + [tokenizer.eod]))
        builder.end_document()
    builder.finalize(tmp + ".idx")
    os.replace(tmp + ".bin", prefix + ".bin")
    os.replace(tmp + ".idx", prefix + ".idx")
    return prefix


def builtin_corpus_paragraphs() -> list:
    """The default training text: the topic pages of CPython's bundled documentation (`pydoc_data`, ~465 kB of English
    prose and code), one document per paragraph: ~2,600 of them, enough that a 969,30,1 split leaves every set
    non-empty."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return [p for k in sorted(topics) for p in topics[k].split("\n\n") if p.strip()]


def builtin_corpus_prefix(cfg, tokenizer) -> str:
    """The built-in corpus, tokenized into an indexed dataset on first use: by bytes, or by the run's BPE tokenizer
    (one dataset per tokenizer file)."""
    cache = builtin_corpus_cache(cfg)
    name = "pydoc_topics" if isinstance(tokenizer, ByteTokenizer) else \
        f"pydoc_topics_{tokenizer.unique_identifiers['sha256']}" + \
        ("_special" if tokenizer.unique_identifiers.get("include_special_tokens") else "")  # caches of before had none
    prefix = os.path.join(cache, f"{name}_text_document")
    if torch.distributed.get_rank() == 0 and not os.path.exists(prefix + ".idx"):
        write_indexed_dataset(builtin_corpus_paragraphs(), tokenizer, prefix)
    torch.distributed.barrier()
    return prefix


def train_builtin_bpe(path: str) -> None:
    """The quick start's tokenizer: a byte-level BPE of BUILTIN_BPE_VOCAB tokens (GPT-2's kind, with its
    <|endoftext|>) trained on the built-in corpus with `tokenizers`, by rank 0 on first use (under a second), then
    read by every rank. Saved with each checkpoint (iter_N/tokenizer/), where generate.py and hf.py read it."""
    if torch.distributed.get_rank() == 0 and not os.path.isfile(path):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=BUILTIN_BPE_VOCAB, special_tokens=["<|endoftext|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        bpe.train_from_iterator(builtin_corpus_paragraphs(), trainer)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        bpe.save(f"{path}.tmp{os.getpid()}")
        os.replace(f"{path}.tmp{os.getpid()}", path)
    torch.distributed.barrier()


# --------------------------------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------------------------------


def train_valid_test_num_samples(cfg) -> list:
    """Samples each split must supply: every training step, every evaluation, one final test."""
    t, v = cfg.train, cfg.validation
    evals = (t.train_iters // v.eval_interval + 1) * v.eval_iters
    return [t.train_iters * t.global_batch_size, evals * t.global_batch_size, v.eval_iters * t.global_batch_size]


def build_datasets(cfg, tokenizer) -> list:
    """Train, validation and test datasets through megatron-core's BlendedMegatronDatasetBuilder, handed the dataset
    section (a megatron-core GPTDatasetConfig, as validation derived it) finalized, with what setup makes: the
    tokenizer, and without data the built-in corpus's blend."""
    d = cfg.dataset
    builtin = ([builtin_corpus_prefix(cfg, tokenizer)], None) if uses_builtin_corpus(cfg) else None
    config = dataclasses.replace(d, tokenizer=tokenizer, blend=d.blend or builtin)
    config.finalize()
    blend, blend_per_split = config.blend, config.blend_per_split
    if blend is not None:
        check_split_not_empty(blend[0], d.split)
    prefixes = (blend[0] if blend else []) + [p for b in (blend_per_split or []) if b for p in b[0]]
    error = None
    if torch.distributed.get_rank() == 0:  # one pass over the data, before the first step; others wait for the verdict
        try:
            check_token_ids(prefixes, tokenizer.vocab_size)
        except ConfigError as e:
            error = e
    if any_rank(error is not None):
        raise error or ConfigError("the data holds token ids outside the vocabulary (see rank 0's error)")
    cls = MockGPTDataset if config.mock else GPTFIMDataset if getattr(d, "fim_data", False) else GPTDataset
    # Tensor-parallel ranks of one data-parallel rank read the same samples; megatron-core builds the
    # index caches on global rank 0 first, then everywhere else.
    return BlendedMegatronDatasetBuilder(cls, train_valid_test_num_samples(cfg), lambda: True, config).build()


def split_document_ranges(num_documents: int, split: str) -> list:
    """Document index ranges of the train/validation/test splits as megatron-core's builder cuts them
    (blended_megatron_dataset_builder.py:470-471): the bookends of the normalised --split
    (blended_megatron_dataset_config.py:155,175) times the document count, rounded; None for a share of 0."""
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    return [None if m is None else (int(round(m[0] * num_documents)), int(round(m[1] * num_documents)))
            for m in matrix]


def check_split_not_empty(prefixes: list, split: str) -> None:
    """megatron-core builds every split with a non-zero share, and a split that gets no documents makes
    its GPTDataset loop forever looking for tokens: refuse it with a clear message instead."""

    for prefix in prefixes:
        n = len(IndexedDataset(prefix).document_indices) - 1
        for name, bounds in zip(("train", "validation", "test"), split_document_ranges(n, split)):
            if bounds is not None and bounds[1] <= bounds[0]:  # a zero share (None) means "no such set"
                raise ConfigError(f"--split {split} leaves the {name} set of {prefix} empty ({n} documents); "
                                  f"give it a larger share, or a share of 0 to build no {name} set")


# --------------------------------------------------------------------------------------------------
# Fill-in-the-Middle (--fim-data): Megatron-LM's GPTFIMDataset (megatron/training/datasets/fim_dataset.py, in
# megatron-core's wheel too) cuts between characters, re-tokenizes and draws from one stream per dataset, so a resumed
# run sees other samples; this one cuts between tokens and seeds each sample on its own (GPTFIMDataset below)
# --------------------------------------------------------------------------------------------------


def add_fim_tokens(tokenizer, d) -> dict:
    """Give the tokenizer the FIM sentinels named by --fim-prefix/middle/suffix/pad-token; returns {role: id}.

    ByteTokenizer and NullTokenizer have no named tokens: prefix, middle and suffix become new ids after the
    vocabulary, and the pad is their pad id just past it (so GPTDataset masks it from the loss). A HuggingFace
    tokenizer must hold all four already (code tokenizers do: <fim_prefix>, <|fim_prefix|>, ...).
    """
    names = {"prefix": d.fim_prefix_token, "middle": d.fim_middle_token, "suffix": d.fim_suffix_token,
             "pad": d.fim_pad_token}
    if isinstance(tokenizer, HuggingFaceTokenizer):
        ids = {role: tokenizer._tokenizer.token_to_id(name) for role, name in names.items()}
        missing = [role for role, i in ids.items() if i is None]
        if missing:
            raise ConfigError(f"--fim-data: {tokenizer.file} has no token '{names[missing[0]]}' (--fim-{missing[0]}-token); "
                              f"give the names its vocabulary uses for the FIM tokens (e.g. <|fim_{missing[0]}|>)")
        tokenizer.pad = ids["pad"]  # the FIM padding is masked from the loss as padding
    else:
        ids = {role: tokenizer.vocab_size + k for k, role in enumerate(("prefix", "middle", "suffix"))}
        tokenizer.vocab_size += 3
        tokenizer.pad = ids["pad"] = tokenizer.vocab_size
    if d.fim_split_sample:
        token_id_of(tokenizer, d.fim_split_sample, "--fim-split-sample")  # one token, or a one-line error now
    eod = (getattr(d, "fim_extra_tokens", None) or {}).get("eod")
    if eod is not None and token_id_of(tokenizer, eod, "dataset.fim_extra_tokens eod") != tokenizer.eod:
        raise ConfigError(f"dataset.fim_extra_tokens eod {eod!r} is not the tokenizer's end-of-document (id "
                          f"{tokenizer.eod}), which ends each FIM sample; drop it or name that token")
    tokenizer.fim_ids = ids
    tokenizer.unique_identifiers = {**tokenizer.unique_identifiers, "fim_tokens": names}
    return ids


def token_id_of(tokenizer, text: str, flag: str) -> int:
    """The id of a text that must be one token: a named token of a HuggingFace vocabulary, or one that tokenizes alone."""
    named = getattr(tokenizer, "_tokenizer", None)
    if named is not None and named.token_to_id(text) is not None:
        return named.token_to_id(text)
    # Without the post-processor's tokens: Megatron-LM looks a sentinel up as a token (fim_dataset.py:76).
    ids = named.encode(text, add_special_tokens=False).ids if named is not None else tokenizer.tokenize(text)
    if len(ids) != 1:
        raise ConfigError(f"{flag} {text!r} is {len(ids)} tokens for this tokenizer; it must be exactly one token")
    return ids[0]


def split_keep(tokens: np.ndarray, separator: int) -> list:
    """The runs of tokens between separators (the separators themselves dropped): [run, run, ...]."""
    runs = np.split(tokens, np.flatnonzero(tokens == separator))  # every run but the first starts with a separator
    return [runs[0]] + [run[1:] for run in runs[1:]]


def join_keep(runs: list, separator: int) -> np.ndarray:
    """split_keep undone: the runs with a separator between each two."""
    parts = []
    for k, run in enumerate(runs):
        if k:
            parts.append(np.array([separator], dtype=np.int64))
        parts.append(np.asarray(run, dtype=np.int64))
    return np.concatenate(parts)


def fim_permute(tokens: np.ndarray, rng, rate: float, spm_rate: float, ids: dict, skip=None) -> np.ndarray:
    """With probability `rate`, cut `tokens` at two random points into prefix, middle and suffix and reorder them
    (Megatron-LM fim_dataset.py `_permute`; Bavarian et al. 2022, "Efficient Training of Language Models to Fill
    in the Middle"):

        PSM:  <prefix> prefix <suffix> suffix <middle> middle
        SPM:  <prefix> <suffix> suffix <middle> prefix middle        (with probability spm_rate)

    Megatron-LM cuts between characters of the detokenized text and re-tokenizes the three pieces; here the cuts
    fall between tokens, so nothing is re-tokenized and the pieces are exactly the original tokens, reordered.
    `skip(tokens)` True leaves them as they are (--fim-no-prefix).
    """
    if not len(tokens) or not rng.binomial(1, rate) or (skip is not None and skip(tokens)):
        return tokens
    lo, hi = np.sort(rng.integers(0, len(tokens) + 1, size=2))
    prefix, middle, suffix = tokens[:lo], tokens[lo:hi], tokens[hi:]
    if rng.binomial(1, spm_rate):
        order = [[ids["prefix"], ids["suffix"]], suffix, [ids["middle"]], prefix, middle]
    else:
        order = [[ids["prefix"]], prefix, [ids["suffix"]], suffix, [ids["middle"]], middle]
    return np.concatenate([np.asarray(p, dtype=np.int64) for p in order])


def fim_document(tokens: np.ndarray, rng, c, ids: dict, split_id=None, skip=None) -> np.ndarray:
    """FIM on one document's tokens (Megatron-LM `_fim_split_and_permute_sequence`): the whole of it at fim_rate,
    or, when it holds the --fim-split-sample token, with probability fim_rate each fragment between those
    tokens at fim_fragment_rate (a repository split into files, each file reordered on its own)."""
    if split_id is None or not (tokens == split_id).any():
        return fim_permute(tokens, rng, c.fim_rate, c.fim_spm_rate, ids, skip)
    if not rng.binomial(1, c.fim_rate):
        return tokens
    rate = c.fim_rate if c.fim_fragment_rate is None else c.fim_fragment_rate  # --fim-fragment-rate's default
    fragments = [fim_permute(f, rng, rate, c.fim_spm_rate, ids, skip) for f in split_keep(tokens, split_id)]
    return join_keep(fragments, split_id)


def fim_sample(sample: np.ndarray, rng, c, ids: dict, eod: int, split_id=None, skip=None) -> np.ndarray:
    """A GPTDataset sample (seq_length + 1 tokens) with each document in it FIM-reordered on its own (the
    end-of-document tokens stay where they separate), then cut or padded back to its length with the pad
    token (Megatron-LM `GPTFIMDataset._query_document_sample_shuffle_indices`). The sentinels add 3 tokens
    per reordered piece, so the sample's last tokens are dropped; padding GPTDataset added at the end of the
    data is set aside first, so it never lands inside a piece."""
    n = end = len(sample)
    while end and sample[end - 1] == ids["pad"]:
        end -= 1
    out = join_keep([fim_document(doc, rng, c, ids, split_id, skip) for doc in split_keep(sample[:end], eod)], eod)
    if len(out) >= n:
        return out[:n]
    return np.concatenate([out, np.full(n - len(out), ids["pad"], dtype=np.int64)])


class GPTFIMDataset(GPTDataset):
    """megatron-core's GPTDataset whose samples are FIM-reordered.

    Each sample draws from its own random stream, seeded by (seed, dataset, sample index), where Megatron-LM
    keeps one stream per dataset: the draws then do not depend on the order samples are read in, the
    DataLoader worker that reads them, or where a run resumed, so a resumed run sees the same samples.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # FIM pads with the pad id, and megatron-core zeroes the loss at pad labels in place on its
        # cached loss mask (see ByteTokenizer): compute the masks per sample instead.
        self.masks_and_position_ids_are_cacheable = False
        c, tokenizer = self.config, self.config.tokenizer
        self.fim_ids = dict(tokenizer.fim_ids)
        self.split_id = token_id_of(tokenizer, c.fim_split_sample, "--fim-split-sample") if c.fim_split_sample else None
        self.stream = int(self.unique_description_hash[:8], 16)

    def starts_with_no_prefix(self, tokens: np.ndarray) -> bool:
        """Whether a fragment's text starts with --fim-no-prefix. Every token decodes to at least one byte, so
        the first len(bytes) tokens hold that text if it is there: only those are decoded."""
        text = self.config.fim_no_prefix
        return self.config.tokenizer.detokenize(tokens[: len(text.encode("utf-8"))].tolist()).startswith(text)

    def _query_document_sample_shuffle_indices(self, idx):
        sample, document_ids, document_lengths = super()._query_document_sample_shuffle_indices(idx)
        rng = np.random.default_rng((self.config.random_seed, self.stream, int(idx)))
        skip = self.starts_with_no_prefix if self.config.fim_no_prefix else None
        return fim_sample(sample, rng, self.config, self.fim_ids, self.config.tokenizer.eod, self.split_id,
                          skip), document_ids, document_lengths


# --------------------------------------------------------------------------------------------------
# Finetuning data (--sft): prompt/response pairs, loss on the responses only
# --------------------------------------------------------------------------------------------------


def sft_example(record: dict, tokenizer, where: str, prompt_key: str = None, response_key: str = None):
    """(token ids, loss mask) of one JSONL record, the response and its end-of-document token in the loss.

    {"prompt": ..., "response": ...} (or "input"/"output", or the keys a FinetuningDatasetConfig's
    dataset_kwargs name), or {"messages": [{"role", "content"}, ...]} where the assistant's messages are
    learnt and everything else is context."""
    if "messages" in record:
        ids, mask = [], []
        for message in record["messages"]:
            text = f"<|{message['role']}|>\n{message['content']}\n"
            learn = message["role"] == "assistant"
            piece = tokenizer.tokenize(text)
            ids += piece
            mask += [int(learn)] * len(piece)
        return ids + [tokenizer.eod], mask + [1]
    prompt = record.get(prompt_key) if prompt_key else record.get("prompt", record.get("input"))
    response = record.get(response_key) if response_key else record.get("response", record.get("output"))
    if prompt is None or response is None:
        expected = f"'{prompt_key or 'prompt'}'/'{response_key or 'response'}'" + (
            "" if prompt_key or response_key else " (or 'input'/'output', or 'messages')")
        raise ConfigError(f"{where}: expected {expected}; found keys {', '.join(record)}")
    p, r = tokenizer.tokenize(prompt), tokenizer.tokenize(response) + [tokenizer.eod]
    return p + r, [0] * len(p) + [1] * len(r)


class SFTDataset(torch.utils.data.Dataset):
    """Finetuning examples as GPT samples: tokens, labels (shifted by one), a loss mask that is zero on
    prompts and padding, position ids; with `pack`, several examples per sequence, positions and
    attention restarting at each. Items are indices, or (index, pad_to) from the `batch` sampler,
    which pads a whole global batch to its longest example."""

    def __init__(self, examples: list, tokenizer, seq_length: int, pack: bool = False, packed: list = None):
        self.seq_length, self.pad, self.pack = seq_length, tokenizer.pad, pack or packed is not None
        examples = [(ids[: seq_length + 1], mask[: seq_length + 1]) for ids, mask in examples]
        if packed is not None:  # packed already (Bridge's packed-sequence file): (ids, mask, example lengths) each
            self.items = packed
        elif pack:  # greedy first fit, in order: each bin holds whole examples up to seq_length + 1 tokens
            bins = []
            for ids, mask in examples:
                if bins and len(bins[-1][0]) + len(ids) <= seq_length + 1:
                    bins[-1][0].extend(ids), bins[-1][1].extend(mask), bins[-1][2].append(len(ids))
                else:
                    bins.append((list(ids), list(mask), [len(ids)]))
            self.items = bins
        else:
            self.items = [(ids, mask, [len(ids)]) for ids, mask in examples]
        self.lengths = [len(ids) - 1 for ids, _, _ in self.items]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, item):
        index, pad_to = item if isinstance(item, tuple) else (item, self.seq_length)
        ids, mask, pieces = self.items[index % len(self.items)]
        n = len(ids) - 1
        tokens = torch.full((pad_to,), self.pad, dtype=torch.long)
        labels = torch.full((pad_to,), self.pad, dtype=torch.long)
        loss_mask = torch.zeros(pad_to)
        tokens[:n], labels[:n] = torch.tensor(ids[:-1]), torch.tensor(ids[1:])
        loss_mask[:n] = torch.tensor(mask[1:], dtype=torch.float)
        position_ids = torch.arange(pad_to)
        sample = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
        if self.pack:
            # Megatron masks: True = may not attend. Block-diagonal causal over the packed examples.
            doc = torch.full((pad_to,), len(pieces), dtype=torch.long)
            start = 0
            for d, length in enumerate(pieces):
                doc[start:start + length] = d
                position_ids[start:start + length] = torch.arange(length)[: max(0, min(length, pad_to - start))]
                start += length
            causal = torch.ones(pad_to, pad_to, dtype=torch.bool).tril()
            sample["attention_mask"] = ~(causal & (doc[:, None] == doc[None, :]))[None]
            sample["position_ids"] = position_ids
        return sample


def build_sft_datasets(cfg, tokenizer) -> list:
    """Train/validation/test SFTDatasets from JSONL: per-split paths (a FinetuningDatasetConfig's dataset_root
    names them, checks.derive_data), or one set of paths cut by --split; a split from Bridge's packed-sequence
    files when packed_sequence_specs names them."""
    d, m = cfg.dataset, cfg.model
    keys = getattr(d, "dataset_kwargs", None) or {}

    def load(paths):
        examples = []
        for path in blend_of(paths)[0]:
            with open(path) as fh:
                for n, line in enumerate(fh, 1):
                    if line.strip():
                        try:
                            examples.append(sft_example(json.loads(line), tokenizer, f"{path}:{n}",
                                                        keys.get("prompt_key"), keys.get("response_key")))
                        except json.JSONDecodeError as e:
                            raise ConfigError(f"{path}:{n}: not a JSON line ({e.msg})")
        return examples

    if d.train_data_path:
        splits = [load(p) if p else None for p in (d.train_data_path, d.valid_data_path, d.test_data_path)]
    else:
        examples = load(d.data_path)
        splits = [None if bounds is None else examples[slice(*bounds)]
                  for bounds in split_document_ranges(len(examples), d.split)]
    if not getattr(d, "do_validation", True):
        splits[1] = None
    if not getattr(d, "do_test", True):
        splits[2] = None
    if getattr(d, "max_train_samples", None) and splits[0]:
        splits[0] = splits[0][: d.max_train_samples]
    needed = [True, bool(cfg.validation.eval_iters), bool(cfg.validation.eval_iters)]
    for name, split, need in zip(("train", "validation", "test"), splits, needed):
        if need and split is not None and not split:
            raise ConfigError(f"--split {d.split} leaves the {name} set of the finetuning data empty; "
                              f"give it a larger share, or --eval-iters 0")
    datasets = [SFTDataset(s, tokenizer, m.seq_length, d.sft_pack_sequences) if s else None for s in splits]
    specs = getattr(d, "packed_sequence_specs", None) or {}
    for i, key in ((0, "packed_train_data_path"), (1, "packed_val_data_path")):
        if specs.get(key):
            datasets[i] = SFTDataset([], tokenizer, m.seq_length, packed=read_bridge_packed(specs[key], m.seq_length))
    return datasets


# What np.save of lists, dicts and numbers pickles into an object array: numpy's array, dtype and scalar rebuilders
# (numpy 2 names its module numpy._core). Anything else in such a file is code, not data.
NPY_DATA_GLOBALS = {(core, name) for core in ("numpy._core.multiarray", "numpy.core.multiarray")
                    for name in ("_reconstruct", "scalar")} | {("numpy", "ndarray"), ("numpy", "dtype")}


class _DataOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in NPY_DATA_GLOBALS:
            raise pickle.UnpicklingError(f"{module}.{name}")
        return super().find_class(module, name)


def load_npy_data(path: str) -> np.ndarray:
    """np.load of a .npy file, where an object array (Bridge's packed sequences: np.save of a list of dicts) is
    unpickled with numpy's rebuilders only. np.load(allow_pickle=True) would call whatever a crafted file names, on
    every rank; such a file is one line here instead."""
    fmt = np.lib.format
    with open(path, "rb") as fh:
        try:
            version = fmt.read_magic(fh)
            _, _, dtype = (fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0)(fh)
        except ValueError as e:
            raise ConfigError(f"{path}: not a .npy file ({e})") from None
        if not dtype.hasobject:
            return np.load(path, allow_pickle=False)
        try:
            return _DataOnlyUnpickler(fh).load()
        except pickle.UnpicklingError as e:
            raise ConfigError(f"{path}: its pickled objects call {e}, which is not numpy data: a file crafted so runs "
                              f"code when read; write it again with Bridge's packing, from data you trust") from None


def read_bridge_packed(path: str, seq_length: int) -> list:
    """Bridge's packed-sequence file (`np.save` of a list of {"input_ids", "loss_mask", "seq_start_id"}, its
    packing/algorithms.py fill_packing_strategy) as SFTDataset items: (ids, mask, example lengths).

    Bridge's loss_mask is aligned to the inputs (position i: is the token after it learnt?); SFTDataset's to the
    tokens (is token i learnt?): shifted by one within each example, so every target is the one Bridge trains."""
    items = []
    for n, element in enumerate(load_npy_data(path)):
        ids, bridge_mask, starts = list(element["input_ids"]), list(element["loss_mask"]), list(element["seq_start_id"])
        if len(ids) > seq_length + 1:
            raise ConfigError(f"{path}: packed sequence {n} holds {len(ids)} tokens, more than --seq-length "
                              f"{seq_length} + 1; pack it with packed_sequence_size {seq_length}")
        mask = [0] * len(ids)
        bounds = starts + [len(ids)]
        for lo, hi in zip(bounds, bounds[1:]):
            mask[lo + 1:hi] = [int(bool(x)) for x in bridge_mask[lo:hi - 1]]
        items.append((ids, mask, [hi - lo for lo, hi in zip(bounds, bounds[1:])]))
    return items


# --------------------------------------------------------------------------------------------------
# Samplers and iterators
# --------------------------------------------------------------------------------------------------


class MegatronPretrainingSampler:
    """The pretraining sampler: walks the dataset in order from `consumed_samples`, each
    global batch of micro_batch_size x data_parallel_size samples split evenly over DP ranks."""

    def __init__(self, total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size):
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.rank, self.size = data_parallel_rank, data_parallel_size

    def __len__(self):
        return self.total_samples

    def __iter__(self):
        step = self.micro_batch_size * self.size
        start = self.rank * self.micro_batch_size
        for first in range(self.consumed_samples, self.total_samples - step + 1, step):
            yield list(range(first + start, first + start + self.micro_batch_size))


class MegatronPaddedBatchSampler(MegatronPretrainingSampler):
    """The `batch` dataloader: samples in order, as the pretraining sampler, each item tagged with the
    length of the longest example of its whole global batch (over all data-parallel ranks), so every
    microbatch of a step is padded to the same, shortest possible length. Cycles through epochs."""

    def __init__(self, lengths, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size,
                 global_batch_size, total_samples):
        super().__init__(total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        self.lengths, self.global_batch_size = lengths, global_batch_size

    def __iter__(self):
        n = len(self.lengths)
        for micro in super().__iter__():
            first = micro[0] - (micro[0] - self.consumed_samples) % self.global_batch_size  # its global batch
            longest = max(self.lengths[i % n] for i in range(first, first + self.global_batch_size))
            yield [(i % n, longest) for i in micro]


class MegatronPretrainingRandomSampler(data_samplers.MegatronPretrainingRandomSampler):
    """The cyclic sampler, Megatron-LM's own (megatron/training/datasets/data_samplers.py:314, Bridge's
    data/samplers.py alike): each epoch a fresh permutation seeded by the epoch number alone, the same order whatever
    --seed, each DP rank drawing from its own contiguous bucket (`data_sharding`) or its stride of one permutation;
    resumes mid-epoch from `consumed_samples`. Its iterator gives one epoch (Megatron-LM iterates the DataLoader
    anew); this one runs on, epoch after epoch."""

    def __init__(self, total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size,
                 data_sharding: bool = True):
        super().__init__(None, total_samples, consumed_samples, micro_batch_size, data_parallel_rank,
                         data_parallel_size, data_sharding)

    def __iter__(self):
        while True:
            yield from super().__iter__()


def quiet_broken_connections() -> None:
    """From now on an exception of a broken connection prints nothing: the job is stopping, and a batch still
    being handed between a rank and its DataLoader workers breaks off. (multiprocessing's resource_sharer
    thread would print a traceback for it through sys.excepthook, in the rank or the worker.)"""
    report, report_thread = sys.excepthook, threading.excepthook

    def quiet(exc_type, value, traceback):
        if not issubclass(exc_type, (ConnectionError, EOFError)):
            report(exc_type, value, traceback)

    def quiet_thread(args):
        if not issubclass(args.exc_type, (ConnectionError, EOFError)):
            report_thread(args)

    sys.excepthook, threading.excepthook = quiet, quiet_thread


def data_worker_init(exit_signal: signal.Signals, worker_id: int) -> None:
    """A DataLoader worker's init: note and otherwise ignore SIGINT, SIGTERM and the --exit-signal, and end
    quietly with its rank.

    SLURM's scancel, `timeout` and Ctrl-C signal every process of the job, workers included. A worker that
    died of it would make its rank raise "DataLoader worker ... is killed by signal" in the middle of the
    step, before the checkpoint that --exit-signal-handler promises. The rank decides what a signal means;
    its workers end with it (torch's workers exit when their parent does). As Megatron-LM and Bridge do, the
    worker gets a handler that only takes note (their DistributedSignalHandler)."""
    for sig in {signal.SIGINT, signal.SIGTERM, exit_signal}:
        signal.signal(sig, _noted)
    quiet_broken_connections()
    die_with_parent()


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the thread that forked it ends (the rank's main thread).

    torch defect (README: defects): a DataLoader worker is forked from its rank and inherits the rank's sockets,
    the process groups' TCP connections among them; torch's worker looks for its parent only every 5 seconds
    (utils/data/_utils/worker.py, MP_STATUS_CHECK_INTERVAL). A rank killed with SIGKILL then keeps its connections
    open in its workers for up to 5 s, and the other ranks' collectives wait for it that long before they fail
    and torchrun can restart the job. Dying with the parent closes them with the rank."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _noted(signum, frame) -> None:
    """A signal a DataLoader worker leaves to its rank."""


def build_data_loader(dataset, consumed_samples: int, cfg, seed_offset: int = 0):
    if dataset is None:
        return None
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    mbs = cfg.train.micro_batch_size
    if cfg.dataset.dataloader_type == "cyclic":
        sampler = MegatronPretrainingRandomSampler(len(dataset), consumed_samples, mbs, dp_rank, dp_size,
                                                   getattr(cfg.dataset, "data_sharding", True))
    elif cfg.dataset.dataloader_type == "batch":
        total = max(train_valid_test_num_samples(cfg)) + consumed_samples  # examples repeat as epochs
        sampler = MegatronPaddedBatchSampler(dataset.lengths, consumed_samples, mbs, dp_rank, dp_size,
                                             cfg.train.global_batch_size, total)
    else:
        sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, mbs, dp_rank, dp_size)
    workers = cfg.dataset.num_workers
    # Its own generator: a DataLoader otherwise draws its worker seed from the global torch RNG when
    # iterated, which would shift the dropout stream of a resumed run by one draw (Megatron Bridge #5257).
    generator = torch.Generator().manual_seed(cfg.rng.seed + seed_offset)
    # pin_memory: derived False without a GPU (checks.py); persistent_workers: torch refuses it without workers.
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=workers, generator=generator,
                                       pin_memory=getattr(cfg.dataset, "pin_memory", device.cuda()),
                                       persistent_workers=getattr(cfg.dataset, "persistent_workers", True) and workers > 0,
                                       worker_init_fn=functools.partial(data_worker_init, cfg.train.exit_signal))


def build_data_iterators(cfg, tokenizer, train_state):
    """(train, validation, test) iterators, resuming at the consumed sample counts of train_state.
    The datasets are megatron-core's, or a DatasetProvider's in `cfg.dataset`."""
    if isinstance(cfg.dataset, DatasetProvider):
        train_ds, valid_ds, test_ds = cfg.dataset.build_datasets(
            DatasetBuildContext(*train_valid_test_num_samples(cfg), tokenizer=tokenizer,
                                pg_collection=ProcessGroupCollection.use_mpu_process_groups()))
    elif cfg.dataset.sft:
        train_ds, valid_ds, test_ds = build_sft_datasets(cfg, tokenizer)
    else:
        train_ds, valid_ds, test_ds = build_datasets(cfg, tokenizer)
    loaders = [
        build_data_loader(train_ds, train_state.consumed_train_samples, cfg),
        build_data_loader(valid_ds, train_state.consumed_valid_samples, cfg, seed_offset=1),
        build_data_loader(test_ds, 0, cfg, seed_offset=2),
    ]
    iterators = [iter(dl) if dl is not None else None for dl in loaders]
    _LIVE_ITERATORS.update(it for it in iterators if it is not None and hasattr(it, "_shutdown_workers"))
    return iterators


# The worker processes' iterators, shut down at exit before multiprocessing's own exit hook runs. A rank that dies of
# an exception keeps its iterators alive in the traceback, so their workers get no end-of-work message; that hook
# then sends them SIGTERM, which data_worker_init has them ignore (a job's signal is the rank's to decide), and waits
# for them for ever: the rank would hang instead of exiting, and torchrun would never see it fail. (atexit runs its
# hooks last-registered first: this module's runs first, multiprocessing.util being imported above it.)
_LIVE_ITERATORS = weakref.WeakSet()


@atexit.register
def _shut_down_workers() -> None:
    # The rank is ending: a SIGTERM now (torchrun stopping the group after another rank failed) must not raise in
    # the middle of the shutdown (train.py's handler raises JobSignal), or multiprocessing's hook would be left
    # waiting on workers that ignore SIGTERM, until torchrun's SIGKILL 30 s later.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    for iterator in list(_LIVE_ITERATORS):
        iterator._shutdown_workers()


# --------------------------------------------------------------------------------------------------
# Preprocessing: `python data.py preprocess` (Megatron-LM's tools/preprocess_data.py, for this project)
# --------------------------------------------------------------------------------------------------


def iter_documents(path: str, json_keys: list):
    """(key, text) of every document under path: a JSONL file (one document per line, one text per
    --json-keys key), a plain text file (one document per blank-line-separated block), or a directory
    of them (files in sorted order, recursively)."""

    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(d, f) for d, _, names in os.walk(path) for f in names
        if f.endswith((".jsonl", ".json", ".txt", ".md", ".rst")))
    for file in files:
        with open(file, encoding="utf-8", errors="replace") as fh:
            if file.endswith((".jsonl", ".json")):
                for n, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ConfigError(f"{file}:{n}: not a JSON line ({e.msg}); JSONL holds one JSON object per line")
                    for key in json_keys:
                        if key not in record:
                            raise ConfigError(f"{file}:{n}: no key '{key}' (keys: {', '.join(record)}); set --json-keys")
                        text = record[key]
                        if isinstance(text, list) and not all(isinstance(t, str) for t in text):
                            raise ConfigError(f"{file}:{n}: '{key}' is a list with a non-text element; a list holds "
                                              f"one document's sentences, as strings")
                        yield key, text if isinstance(text, list) else str(text)
            else:
                for block in fh.read().split("\n\n"):
                    if block.strip():
                        yield json_keys[0], block


def _tokenize_batch(args):
    """(key, bytes, token ids, sequence lengths) of each (key, text) of a batch: the work a preprocessing worker
    does. A text that is a list (Megatron-LM's sentence-split form) is one document of one sequence per non-empty
    element, as tools/preprocess_data.py writes it; an empty text is a document with no sequence."""
    tokenizer, batch = args
    out = []
    for key, text in batch:
        sentences = text if isinstance(text, list) else [text]
        pieces = [ids for ids in (tokenizer.tokenize(t) for t in sentences) if len(ids)]
        # Arrays, not lists: cheaper to send back from a worker and to hand to the builder.
        ids = np.asarray([i for piece in pieces for i in piece], dtype=np.int64)
        out.append((key, sum(len(t.encode("utf-8")) for t in sentences), ids, [len(piece) for piece in pieces]))
    return out


def preprocess(input_path: str, output_prefix: str, json_keys=("text",), tokenizer=None, append_eod=False,
               workers: int = 1, log_interval: float = 5.0) -> dict:
    """Tokenize a corpus into megatron-core indexed datasets, one per key: OUTPUT_PREFIX_KEY_document.bin/.idx.

    Reports documents, MB/s and an ETA on stderr every `log_interval` seconds. Returns per-key statistics.
    """
    import multiprocessing

    if not os.path.exists(input_path):
        raise ConfigError(f"--input {input_path}: no such file or directory")
    tokenizer = tokenizer or ByteTokenizer()
    total_bytes = os.path.getsize(input_path) if os.path.isfile(input_path) else sum(
        os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(input_path) for f in names)
    dtype = np.int32 if tokenizer.vocab_size > 65500 else np.uint16
    prefixes = {k: f"{output_prefix}_{k}_document" for k in json_keys}
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    builders = {k: IndexedDatasetBuilder(p + f".bin.tmp{os.getpid()}", dtype=dtype) for k, p in prefixes.items()}
    stats = {k: {"documents": 0, "tokens": 0} for k in json_keys}
    start = time.time()

    def batches(size=256):
        batch = []
        for item in iter_documents(input_path, list(json_keys)):
            batch.append(item)
            if len(batch) == size:
                yield batch
                batch = []
        if batch:
            yield batch

    pool = multiprocessing.get_context("fork").Pool(workers) if workers > 1 else None
    try:
        _fill(builders, stats, batches(), tokenizer, append_eod, pool, total_bytes, start, log_interval)
    except BaseException:  # bad input mid-way: leave nothing half-written behind
        for prefix in prefixes.values():
            if os.path.exists(prefix + f".bin.tmp{os.getpid()}"):
                os.remove(prefix + f".bin.tmp{os.getpid()}")
        raise
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    for key, prefix in prefixes.items():
        tmp = prefix + f".bin.tmp{os.getpid()}"
        if stats[key]["tokens"] == 0:
            os.remove(tmp)
            raise ConfigError(f"--input {input_path}: no documents with text under key '{key}'; the corpus is empty")
        builders[key].finalize(prefix + f".idx.tmp{os.getpid()}")
        os.replace(tmp, prefix + ".bin")
        os.replace(prefix + f".idx.tmp{os.getpid()}", prefix + ".idx")
        stats[key].update(prefix=prefix, seconds=time.time() - start, mb=total_bytes / 1e6)
    return stats


def _fill(builders, stats, batches, tokenizer, append_eod, pool, total_bytes, start, log_interval):
    """Tokenize batches of (key, text) (in worker processes when there is a pool) into the builders."""

    last_report, done_bytes = time.time(), 0
    jobs = ((tokenizer, batch) for batch in batches)
    for items in (pool.imap(_tokenize_batch, jobs, chunksize=4) if pool else map(_tokenize_batch, jobs)):
        for key, num_bytes, ids, lengths in items:
            if append_eod and len(ids):  # an empty document stays empty, as in Megatron-LM
                ids = np.append(ids, tokenizer.eod)
                lengths[-1] += 1
            builders[key].add_document(torch.from_numpy(ids), lengths)
            stats[key]["documents"] += 1
            stats[key]["tokens"] += len(ids)
            done_bytes += num_bytes
        if time.time() - last_report > log_interval:
            last_report = time.time()
            rate = done_bytes / max(last_report - start, 1e-9)
            eta = max(total_bytes - done_bytes, 0) / max(rate, 1e-9)
            print(f"processed {sum(s['documents'] for s in stats.values())} documents "
                  f"({done_bytes / 1e6:.1f} MB, {rate / 1e6:.2f} MB/s, ETA {eta:.0f} s)", file=sys.stderr, flush=True)


def check_token_ids(prefixes: list, vocab_size: int) -> None:
    """Every token id of the indexed datasets must have an embedding row: one pass over the .bin files
    (memory-mapped, ~GB/s), before the model is built."""
    for prefix in prefixes:
        data = np.memmap(prefix + ".bin", mode="r", dtype=_index_dtype(prefix))
        if data.size and int(data.max()) >= vocab_size:
            raise ConfigError(f"{prefix}.bin holds token id {int(data.max())} but the vocabulary has {vocab_size} ids; "
                              f"preprocess it with this run's tokenizer (or set --tokenizer-type/--vocab-size to match)")


def _index_dtype(prefix: str):

    return IndexedDataset(prefix).index.dtype


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="data.py", description="Data tools. `preprocess`: text -> indexed dataset.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("preprocess", help="tokenize JSONL / text files into PREFIX_KEY_document.bin/.idx")
    p.add_argument("--input", required=True, help="a JSONL file, a text file, or a directory of them")
    p.add_argument("--output-prefix", required=True, help="output path prefix; writes PREFIX_KEY_document.bin/.idx")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="JSONL keys to take text from (default: text)")
    p.add_argument("--tokenizer-type", default="ByteTokenizer", choices=["ByteTokenizer", "HuggingFaceTokenizer"],
                   help="tokenizer (default: ByteTokenizer)")
    p.add_argument("--tokenizer-model", help="HuggingFaceTokenizer: a local tokenizer.json or its directory")
    p.add_argument("--tokenizer-hf-no-include-special-tokens", action="store_true",
                   help="HuggingFaceTokenizer: leave out the tokens its post-processor adds (LLaMA's <s>), which "
                        "Megatron-LM 0.19 writes by default")
    p.add_argument("--append-eod", action="store_true", help="end each document with the end-of-document token")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    p.add_argument("--log-interval", type=float, default=5.0, help="seconds between progress lines")
    args = parser.parse_args(argv)
    try:
        tokenizer = HuggingFaceTokenizer(args.tokenizer_model or "", not args.tokenizer_hf_no_include_special_tokens) \
            if args.tokenizer_type == "HuggingFaceTokenizer" else ByteTokenizer()
        stats = preprocess(args.input, args.output_prefix, args.json_keys, tokenizer, args.append_eod,
                           args.workers, args.log_interval)
    except ConfigError as e:
        print(f"data.py: error: {e}", file=sys.stderr)
        return 2
    for key, s in stats.items():
        print(f"{s['prefix']}: {s['documents']} documents, {s['tokens']} tokens, {s['mb']:.1f} MB in "
              f"{s['seconds']:.1f} s ({s['mb'] / max(s['seconds'], 1e-9):.2f} MB/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
