"""Finetuning (--sft): prompt/response JSONL, the loss on responses only, global-batch padding, packing,
and finetune() from a pretrained checkpoint."""

import json

import pytest

import config
import checks
from conftest import TINY, log_lines


def _write_jsonl(path, n=64):
    with open(path, "w") as fh:
        for i in range(n):
            a, b = i % 7, (i * 3) % 5
            fh.write(json.dumps({"prompt": f"Q: {a}+{b}=" + " " * (i % 5), "response": f"{a + b}."}) + "\n")
        fh.write(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                          {"role": "assistant", "content": "hello"}]}) + "\n")
    return path


def test_loss_mask_covers_the_response_only():
    from data import ByteTokenizer, sft_example

    tok = ByteTokenizer()
    ids, mask = sft_example({"prompt": "Q: 1+1=", "response": "2."}, tok, "x")
    assert tok.detokenize(ids[:-1]) == "Q: 1+1=2." and ids[-1] == tok.eod
    assert mask == [0] * 7 + [1] * 3  # "2", ".", end-of-document
    ids, mask = sft_example({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
                            tok, "x")
    learnt = tok.detokenize([i for i, m in zip(ids, mask) if m and i != tok.eod])
    assert learnt == "<|assistant|>\nyo\n"
    with pytest.raises(config.ConfigError, match="x: expected 'prompt'/'response'"):
        sft_example({"question": "?"}, tok, "x")


def test_batch_dataloader_pads_each_global_batch_to_its_longest():
    from data import ByteTokenizer, MegatronPaddedBatchSampler, SFTDataset

    tok = ByteTokenizer()
    examples = [(list(range(n)), [1] * n) for n in (5, 9, 3, 4, 12, 6, 7, 2)]  # lengths - 1: 4 8 2 3 11 5 6 1
    ds = SFTDataset(examples, tok, seq_length=32)
    steps = []
    for rank in (0, 1):  # 2 data-parallel ranks, micro batch 2, global batch 4
        it = iter(MegatronPaddedBatchSampler(ds.lengths, 0, 2, rank, 2, 4, total_samples=8))
        steps.append([next(it), next(it)])
    assert {pad for step in steps for item in step[0] for _, pad in [item]} == {8}  # global batch 1: longest is 8
    assert {pad for step in steps for item in step[1] for _, pad in [item]} == {11}
    sample = ds[(2, 8)]
    assert sample["tokens"].shape == (8,) and sample["loss_mask"].tolist() == [1, 1] + [0] * 6
    assert (sample["labels"][2:] == tok.pad).all()


def test_packing_restarts_positions_and_attention():
    from data import ByteTokenizer, SFTDataset

    ds = SFTDataset([([1, 2, 3], [0, 1, 1]), ([4, 5, 6, 7], [0, 0, 1, 1]), ([8] * 30, [1] * 30)], ByteTokenizer(), 8,
                    pack=True)
    assert len(ds) == 2  # 3 + 4 tokens share a bin of 9; the long one is cut to 9 in its own
    sample = ds[0]
    assert sample["position_ids"][:7].tolist() == [0, 1, 2, 0, 1, 2, 3]
    blocked = sample["attention_mask"][0]
    assert bool(blocked[3, 2]) and not bool(blocked[2, 1]) and not bool(blocked[4, 3])  # no attending across examples
    assert sample["loss_mask"][:6].tolist() == [1, 1, 0, 0, 1, 1]


def test_finetune_from_a_pretrained_checkpoint(tmp_path, capsys):
    import train

    train.pretrain(checks.parse_args([*TINY, "--train-iters", "6", "--eval-iters", "0", "--num-workers", "0",
                                      "--save", str(tmp_path / "base"), "--data-cache-path", str(tmp_path / "c")],
                                     world_size=1, gpu=False))
    capsys.readouterr()
    data = _write_jsonl(tmp_path / "sft.jsonl")
    masks = []

    def recording_forward_step(state, data_iterator, model):
        batch = next(data_iterator)
        masks.append((batch["tokens"], batch["loss_mask"]))
        return train.forward_step(state, iter([batch]), model)

    cfg = checks.parse_args([*TINY, "--sft", "--data-path", str(data), "--split", "90,10,0", "--train-iters", "30",
                             "--global-batch-size", "4", "--log-interval", "10", "--eval-interval", "30",
                             "--eval-iters", "1", "--num-workers", "0", "--pretrained-checkpoint", str(tmp_path / "base"),
                             "--lr", "1e-3"], world_size=1, gpu=False)
    state = train.finetune(cfg, recording_forward_step)
    out = capsys.readouterr().out
    assert "iter_0000006 at iteration 0 (weights only)" in out and state.train_state.step == 30
    losses = [l[3] for l in log_lines(out)]
    assert losses[-1] < losses[0]
    tokens, mask = masks[0]
    text = bytes(t for t in tokens[0].tolist() if t < 256).decode()
    learnt = bytes(t for t, m in zip(tokens[0].tolist()[1:], mask[0].tolist()) if m and t < 256).decode()
    assert text.startswith("Q: ") and learnt.strip().endswith(".") and "Q:" not in learnt  # prompts out of the loss
    assert tokens.shape[1] < 64  # padded to the global batch's longest, not to --seq-length
