"""--fim-data: Fill-in-the-Middle samples from a real indexed dataset, their structure, and training on them."""

import collections

import pytest
import torch

import config
import checks
from conftest import TINY, log_lines, torchrun


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """CPython's documentation topics, one paragraph per document, byte-tokenized into an indexed dataset."""
    import pydoc_data.topics

    import data

    topics = pydoc_data.topics.topics
    paragraphs = [p for k in sorted(topics) for p in topics[k].split("\n\n") if p.strip()]
    return data.write_indexed_dataset(paragraphs, data.ByteTokenizer(), str(tmp_path_factory.mktemp("fim") / "topics"))


def build(corpus, tmp_path, *flags):
    """(tokenizer, train dataset) as train.py builds them, in a one-process world."""
    import data

    cfg = checks.parse_args([*TINY, "--data-path", corpus, "--data-cache-path", str(tmp_path / "cache"),
                             "--train-iters", "10", "--seq-length", "256", *flags], world_size=1, gpu=False)
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        tokenizer = data.build_tokenizer(cfg)
        return tokenizer, data.build_datasets(cfg, tokenizer)[0]
    finally:
        torch.distributed.destroy_process_group()


def raw_and_fim(ds, i):
    """Sample i before and after the FIM transform (seq_length + 1 tokens each)."""
    from megatron.core.datasets.gpt_dataset import GPTDataset

    return GPTDataset._query_document_sample_shuffle_indices(ds, i)[0], ds._query_document_sample_shuffle_indices(i)[0]


def unpermute(piece, ids, spm):
    """A FIM-reordered document back in document order, and whether all of it is there: PSM is
    <pre> prefix <suf> suffix <mid> middle, SPM <pre> <suf> suffix <mid> prefix middle."""
    P, M, S = ids["prefix"], ids["middle"], ids["suffix"]
    piece = list(piece)
    assert piece[0] == P and piece.count(P) == 1 and piece.count(S) <= 1 and piece.count(M) <= 1, piece[:8]
    assert not spm or len(piece) < 2 or piece[1] == S
    if M not in piece:  # cut short by the end of the sample
        return None, False
    if spm:
        suffix, rest = piece[2: piece.index(M)], piece[piece.index(M) + 1:]
        return rest + suffix, True
    prefix, suffix, middle = piece[1: piece.index(S)], piece[piece.index(S) + 1: piece.index(M)], piece[piece.index(M) + 1:]
    return prefix + middle + suffix, True


def check_fim_structure(raw, fim, ids, eod, spm):
    """Every document of the sample is reordered around the sentinels in the given format, and putting the
    pieces back gives the original tokens: exactly for every document the sample holds whole, and for the
    last one (cut short, since the sentinels lengthen the sample) its first pieces and its suffix."""
    import data

    assert len(fim) == len(raw)
    originals, permuted = data.split_keep(raw, eod), data.split_keep(fim, eod)
    assert len(permuted) <= len(originals)
    for k, (original, piece) in enumerate(zip(originals, permuted)):
        original = original.tolist()
        if not original or (k == len(permuted) - 1 and not len(piece)):  # nothing to reorder, or cut off entirely
            assert not len(piece) or not original
            continue
        rebuilt, whole = unpermute(piece, ids, spm)
        if k < len(permuted) - 1:
            assert whole and rebuilt == original
        elif whole:  # the last document: its middle (PSM) or prefix+middle (SPM) runs past the sample's end
            M, S = ids["middle"], ids["suffix"]
            piece = list(piece)
            suffix = piece[piece.index(S) + 1: piece.index(M)]
            head = piece[piece.index(M) + 1:] if spm else piece[1: piece.index(S)] + piece[piece.index(M) + 1:]
            assert original[: len(head)] == head and original[len(original) - len(suffix):] == suffix
            assert len(head) + len(suffix) <= len(original)
    # Nothing is lost but what the end of the sample cuts: the text tokens are a sub-multiset of the original's.
    text = collections.Counter(t for t in fim.tolist() if t not in ids.values())
    assert not text - collections.Counter(raw.tolist())


def test_fim_rate_1_reorders_every_document_psm_and_spm(corpus, tmp_path):
    for spm in (False, True):
        tokenizer, ds = build(corpus, tmp_path / str(spm), "--fim-data", "--fim-rate", "1", "--fim-spm-rate", str(int(spm)))
        ids = tokenizer.fim_ids
        assert ids == {"prefix": 257, "middle": 258, "suffix": 259, "pad": 260} and tokenizer.vocab_size == 260
        for i in range(40):
            raw, fim = raw_and_fim(ds, i)
            # a sample that starts at a document's end starts with that end (an empty first document stays empty)
            assert fim[0] == (tokenizer.eod if raw[0] == tokenizer.eod else ids["prefix"])
            check_fim_structure(raw, fim, ids, tokenizer.eod, spm)
        sample = ds[0]  # what the DataLoader gets: tokens/labels shifted by one, the loss on every real token
        assert sample["tokens"].shape == (256,) and int(sample["tokens"][0]) == ids["prefix"]
        assert sample["loss_mask"].sum() == (sample["labels"] != 0).sum()


def test_fim_rate_0_leaves_samples_as_gptdataset_gives_them(corpus, tmp_path):
    _, plain = build(corpus, tmp_path / "plain")
    _, fim = build(corpus, tmp_path / "fim", "--fim-data", "--fim-rate", "0")
    for i in range(0, 200, 7):
        a, b = plain[i], fim[i]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_split_sample_fragments_and_no_prefix(corpus, tmp_path):
    """With --fim-split-sample each fragment between split tokens is reordered on its own, and a fragment
    starting with --fim-no-prefix is left as it is."""
    import data

    tokenizer, ds = build(corpus, tmp_path, "--fim-data", "--fim-rate", "1", "--fim-spm-rate", "0",
                          "--fim-split-sample", "\n", "--fim-fragment-rate", "1", "--fim-no-prefix", "The ")
    ids, newline = tokenizer.fim_ids, tokenizer.tokenize("\n")[0]
    reordered = kept = 0
    for i in range(60):
        raw, fim = raw_and_fim(ds, i)
        originals, permuted = data.split_keep(raw, tokenizer.eod), data.split_keep(fim, tokenizer.eod)
        for original, piece in list(zip(originals, permuted))[:-1]:  # documents the sample holds whole
            for frag, out in zip(data.split_keep(original, newline), data.split_keep(piece, newline)):
                if tokenizer.detokenize(frag.tolist()).startswith("The ") or not len(frag):
                    assert out.tolist() == frag.tolist()
                    kept += bool(len(frag))
                else:
                    assert unpermute(out, ids, spm=False) == (frag.tolist(), True)
                    reordered += 1
    assert reordered > 20 and kept > 3


def test_fim_tokens_must_be_in_a_huggingface_vocabulary(tmp_path):
    import tokenizers

    import data

    def tokenizer_json(special):
        tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
        tok.add_special_tokens(special)
        tok.save(str(tmp_path / "tokenizer.json"))
        return data.HuggingFaceTokenizer(str(tmp_path / "tokenizer.json"))

    cfg = checks.parse_args(["--fim-data"], world_size=1, gpu=False)
    with pytest.raises(config.ConfigError, match=r"has no token '<fim_prefix>' \(--fim-prefix-token\)"):
        data.add_fim_tokens(tokenizer_json(["<|endoftext|>"]), cfg.dataset)
    tok = tokenizer_json(["<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"])
    assert data.add_fim_tokens(tok, cfg.dataset) == {"prefix": 4, "middle": 5, "suffix": 6, "pad": 7} and tok.pad == 7
    cfg.dataset.fim_split_sample = "ab"
    with pytest.raises(config.ConfigError, match="--fim-split-sample 'ab' is 2 tokens"):
        data.add_fim_tokens(data.ByteTokenizer(), cfg.dataset)


def test_two_rank_training_on_fim_data_learns(corpus, tmp_path, warm_torchrun):
    proc = warm_torchrun([*TINY, "--fim-data", "--fim-rate", "0.9", "--data-path", corpus, "--split", "98,2,0",
                     "--data-cache-path", str(tmp_path / "cache"), "--train-iters", "30", "--global-batch-size", "8",
                     "--log-interval", "5", "--eval-interval", "30", "--eval-iters", "2"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    losses = [line[3] for line in log_lines(proc.stdout)]
    assert len(losses) == 6 and losses[-1] < losses[0] - 1.0, losses


def test_a_fim_runs_dataset_is_the_seeds_gpt_fim_dataset_config(tmp_path):
    """Bridge's GPTFIMDatasetConfig, a GPTDatasetConfig: --fim-data makes the section one, and its fim_extra_tokens
    names the sentinels (the eod must be the tokenizer's), through a YAML file too."""
    import dataclasses

    import tokenizers
    import yaml

    import data

    assert issubclass(config.GPTFIMDatasetConfig, config.GPTDatasetConfig)
    assert "fim_extra_tokens" in {f.name for f in dataclasses.fields(config.GPTFIMDatasetConfig)}
    assert type(checks.parse_args(["--fim-data"], world_size=1, gpu=False).dataset) is config.GPTFIMDatasetConfig
    assert type(checks.parse_args([], world_size=1, gpu=False).dataset) is config.GPTDatasetConfig
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    tok.add_special_tokens(["<eos>", "<P>", "<M>", "<S>", "<pad>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    extra = {"prefix": "<P>", "middle": "<M>", "suffix": "<S>", "pad": "<pad>", "eod": "<eos>"}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"dataset": {"fim_extra_tokens": extra}}))
    cfg = checks.parse_args(["--config-file", str(tmp_path / "run.yaml")], world_size=1, gpu=False)
    assert type(cfg.dataset) is config.GPTFIMDatasetConfig and cfg.dataset.fim_data
    assert (cfg.dataset.fim_prefix_token, cfg.dataset.fim_pad_token) == ("<P>", "<pad>")
    hf_tokenizer = data.HuggingFaceTokenizer(str(tmp_path / "tokenizer.json"))
    assert data.add_fim_tokens(hf_tokenizer, cfg.dataset) == {"prefix": 3, "middle": 4, "suffix": 5, "pad": 6}
    cfg.dataset.fim_extra_tokens["eod"] = "a"
    with pytest.raises(config.ConfigError, match=r"fim_extra_tokens eod 'a' is not the tokenizer's end-of-document"):
        data.add_fim_tokens(data.HuggingFaceTokenizer(str(tmp_path / "tokenizer.json")), cfg.dataset)
