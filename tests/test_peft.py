"""PEFT (peft.py): LoRA and DoRA adapters on megatron-core's layers, trained by the same engine, saved alone."""

import json
import os

import pytest
import torch

import checks
import config
from conftest import REORDERED, TINY, config_error, log_lines


def _cfg(*flags, world_size=1):
    return checks.parse_args([*TINY, "--hidden-dropout", "0", "--attention-dropout", "0", "--pretrained-checkpoint",
                              "base", *flags], world_size=world_size, gpu=False)


def _loss(model, tokens):
    out = model[0](tokens, torch.arange(tokens.shape[1]).repeat(tokens.shape[0], 1), None, labels=(tokens + 1) % 50)
    return out.float().mean()


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_adapters_start_at_the_base_model_and_only_they_train(single_rank_groups, kind):
    from megatron.core.utils import unwrap_model
    from model import build_model, build_optimizer, get_forward_backward_func, set_random_seed, wrap_model
    import peft

    cfg = _cfg("--peft", kind, "--lora-dim", "4")
    set_random_seed(0)
    model = build_model(cfg, vocab_size=100)
    tokens = torch.arange(64).repeat(2, 1) % 50
    with torch.no_grad():
        base_loss = _loss(model, tokens)
    matched = peft.apply_peft(cfg, model)
    assert matched == {"linear_qkv": 2, "linear_proj": 2, "linear_fc1": 2, "linear_fc2": 2}
    with torch.no_grad():
        assert _loss(model, tokens) == base_loss  # B = 0 (and DoRA's magnitude = ||W||): the base model exactly
    trainable, total = peft.parameter_counts(model)
    per_layer = (4 * 64 + 4 * 192) + (4 * 64 + 4 * 64) + (4 * 64 + 4 * 256) + (4 * 256 + 4 * 64)
    magnitudes = (192 + 64 + 256 + 64) if kind == "dora" else 0
    assert trainable == 2 * (per_layer + magnitudes)
    base = {n: p.detach().clone() for n, p in model[0].named_parameters() if not p.requires_grad}

    model = wrap_model(cfg, model)
    optimizer = build_optimizer(cfg, model)
    adapters = [p for p in unwrap_model(model[0]).parameters() if p.requires_grad]
    # megatron-core's DDP and optimizer skip frozen parameters: only the adapters have grad buffers and state.
    assert sum(p.numel() for buffer in model[0].buffers for p in buffer.params) == trainable
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(adapters)
    before = [p.detach().clone() for p in adapters]
    fbf = get_forward_backward_func(model, optimizer)

    def forward_step(data_iterator, m):
        out = m(tokens, torch.arange(64).repeat(2, 1), None, labels=(tokens + 1) % 50)
        return out, lambda o: (o.float().mean(), {"lm loss": o.float().mean().detach()})

    for _ in range(10):
        model[0].zero_grad_buffer()
        optimizer.zero_grad()
        fbf(forward_step_func=forward_step, data_iterator=iter([]), model=model, num_microbatches=1, seq_length=64,
            micro_batch_size=2)
        assert optimizer.step()[0]
    after = dict(unwrap_model(model[0]).named_parameters())
    assert all(torch.equal(after[n], p) for n, p in base.items())  # base weights: bitwise unchanged
    assert all(not torch.equal(p, b) for p, b in zip(adapters, before) if p.dim() == 2)  # every A and B moved


def test_bad_peft_settings_are_one_line(capsys, single_rank_groups):
    from model import build_model
    import peft

    assert "--peft lora trains adapters on base weights: give them with --pretrained-checkpoint" in config_error(
        [*TINY, "--peft", "lora"], capsys)
    assert "--lora-dim 0 is out of range" in config_error([*TINY, "--peft", "lora", "--pretrained-checkpoint", "b",
                                                           "--lora-dim", "0"], capsys)
    assert "saves the adapters only, which needs --ckpt-format torch_dist" in config_error(
        [*TINY, "--peft", "dora", "--pretrained-checkpoint", "b", "--ckpt-format", "torch"], capsys)
    cfg = _cfg("--peft", "lora", "--lora-target-modules", "linear_qkv", "*.layers.7.*")
    with pytest.raises(config.ConfigError, match=r"--lora-target-modules \*.layers.7.\* matches no linear layer"):
        peft.apply_peft(cfg, build_model(cfg, vocab_size=100))
    # Wildcards and exclusions, as Bridge's matching.
    cfg = _cfg("--peft", "lora", "--lora-target-modules", "*.layers.0.*.linear_qkv", "linear_fc1",
               "--lora-exclude-modules", "decoder.layers.1.mlp.linear_fc1")
    assert peft.apply_peft(cfg, build_model(cfg, vocab_size=100)) == {"*.layers.0.*.linear_qkv": 1, "linear_fc1": 1}


# --- real 2-rank runs: LoRA on SFT data from a pretrained checkpoint, resumed, resharded, merged ---------------


def _sft_jsonl(path):
    with open(path, "w") as fh:
        for i in range(64):
            a, b = i % 7, (i * 3) % 5
            fh.write(json.dumps({"prompt": f"Q: {a}+{b}=", "response": f"{a + b}."}) + "\n")
    return path


@pytest.fixture(scope="module")
def lora_run(mock_run, tmp_path_factory, warm_torchrun):
    """LoRA on --sft data over the shared mock run's checkpoint (2 data-parallel ranks), saving at 6 and 12."""
    out = tmp_path_factory.mktemp("lora")
    args = [*TINY, "--peft", "lora", "--lora-dim", "8", "--pretrained-checkpoint", str(mock_run["dir"] / "ckpt"),
            "--sft", "--data-path", str(_sft_jsonl(out / "sft.jsonl")), "--split", "90,10,0", "--train-iters", "12",
            "--global-batch-size", "8", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--data-cache-path", str(out / "cache")]
    proc = warm_torchrun([*args, "--save", str(out / "lora"), "--save-interval", "6"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return dict(dir=out, args=args, stdout=proc.stdout, losses={l[0]: l[3] for l in log_lines(proc.stdout)})


def _dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def test_lora_trains_on_sft_data_and_saves_the_adapters_only(lora_run, mock_run):
    losses = lora_run["losses"]
    assert sorted(losses) == list(range(1, 13)) and losses[12] < losses[1] - 0.5
    assert "lora: trainable params: 0.02M / 0.15M (11.3%)" in lora_run["stdout"]  # the setup summary
    assert "| trainable params: 0.02M / 0.15M (11.3%) | number of skipped" in lora_run["stdout"]  # each log line
    saved = lora_run["dir"] / "lora" / "iter_0000012"
    full = mock_run["dir"] / "ckpt" / "iter_0000030"
    # Adapters and their Adam state only: about the trainable share (11.3%) of the full checkpoint's tensors.
    assert _dir_bytes(saved) < 0.25 * _dir_bytes(full)


def test_lora_resumes_bitwise_and_tensor_parallel_gives_the_same_losses(lora_run, warm_torchrun):
    args, ckpt = lora_run["args"], str(lora_run["dir"] / "lora")
    resumed = warm_torchrun([*args, "--load", ckpt, "--ckpt-step", "6"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert {l[0]: l[3] for l in log_lines(resumed.stdout)} == {i: lora_run["losses"][i] for i in range(7, 13)}
    # TP=2 (the adapters split like their layers; 64 x 2 keeps the checkpoint's padded vocabulary) from the start.
    tp2 = warm_torchrun([*args, "--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"])
    assert tp2.returncode == 0, tp2.stderr[-3000:]
    for it, loss in {l[0]: l[3] for l in log_lines(tp2.stdout)}.items():
        assert loss == pytest.approx(lora_run["losses"][it], rel=REORDERED), it  # TP=2's sums grouped otherwise


def test_merged_checkpoint_loads_without_peft_and_gives_the_adapted_logits(lora_run, tmp_path):
    import subprocess
    import sys

    import train
    from conftest import ROOT

    merged = tmp_path / "merged"
    proc = subprocess.run([sys.executable, "peft.py", "merge", "--load", str(lora_run["dir"] / "lora"), "--save",
                           str(merged)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0 and "merged 8 adapters" in proc.stdout, proc.stderr[-3000:]
    tokens = torch.arange(2 * 64).reshape(2, 64) % 90 + 10

    def logits(*flags):
        cfg = checks.parse_args([*flags, "--num-workers", "0", "--eval-iters", "0", "--use-checkpoint-opt-param-scheduler"],
                                world_size=1, gpu=False)
        state, model, _, _, _ = train.setup(cfg)
        try:
            with torch.no_grad():
                return model[0](tokens, torch.arange(64).repeat(2, 1), None).float()
        finally:
            train._finish_train(state)

    run_config = "iter_0000012/run_config.yaml"
    adapted = logits("--config-file", str(lora_run["dir"] / "lora" / run_config), "--load", str(lora_run["dir"] / "lora"))
    plain = logits("--config-file", str(merged / run_config), "--pretrained-checkpoint", str(merged))
    # W + scale x BA folded once, against x W + scale x (x A) B: the same products summed in another order, each
    # logit within (h + r) sums' log2 x 2^-24 of the largest logit: within 1e-5 of it.
    torch.testing.assert_close(plain, adapted, rtol=1e-5, atol=1e-5 * adapted.abs().max().item())


def test_finetune_from_python_with_a_lora_config(lora_run, mock_run, tmp_path):
    """The README's Python example: Bridge's finetune() with a peft config and a FinetuningDatasetConfig."""
    import train

    cfg = config.ConfigContainer(peft=config.LoRA(dim=4, alpha=8), dataset=config.FinetuningDatasetConfig(
        data_path=[str(lora_run["dir"] / "sft.jsonl")], split="90,10,0", num_workers=0))
    cfg.model.num_layers, cfg.model.hidden_size, cfg.model.seq_length, cfg.train.micro_batch_size = 2, 64, 64, 2
    cfg.train.train_iters, cfg.train.eval_iters = 3, 0
    cfg.checkpoint.pretrained_checkpoint, cfg.checkpoint.save = str(mock_run["dir"] / "ckpt"), str(tmp_path / "lora")
    state = train.finetune(checks.runtime_config_update(cfg, world_size=1, gpu=False))
    assert state.train_state.step == 3 and cfg.trainable_fraction < 0.1
    assert (tmp_path / "lora" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


# FSDP2's model: the untied output layer Megatron-LM requires of it. Mock data, dropout 0 (the layouts compare exactly).
UNTIED = [*TINY, "--untie-embeddings-and-output-weights", "--mock-data", "--global-batch-size", "8", "--log-interval", "1",
          "--eval-iters", "0", "--num-workers", "0", "--hidden-dropout", "0", "--attention-dropout", "0"]


@pytest.mark.full  # the fast command: LoRA at DP=2 and TP=2 without FSDP (above)
def test_lora_under_fsdp2_gives_the_one_process_losses_and_resumes_bitwise(tmp_path, warm_torchrun):
    """LoRA under torch FSDP2 at DP=2: the base weights read into the bare model, the adapters added, then fully_shard
    over both (the frozen weights sharded too). Its losses are the one process's (REORDERED); its adapters-only
    checkpoint of 3 resumes to the bit. Not covered: Megatron FSDP, refused (its fsdp_dtensor save is not filtered to
    the adapters); bf16 and dropout (pinned fp32 and 0, as test_fsdp's layouts: a rank draws its own dropout)."""
    from conftest import train_here

    train_here([*UNTIED, "--train-iters", "6", "--save", str(tmp_path / "base")])
    lora = [*UNTIED, "--peft", "lora", "--lora-dim", "8", "--pretrained-checkpoint", str(tmp_path / "base"),
            "--train-iters", "6"]
    one = {l[0]: l[3] for l in log_lines(train_here(lora))}
    proc = warm_torchrun([*lora, "--use-torch-fsdp2", "--save", str(tmp_path / "lora"), "--save-interval", "3"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    fsdp2 = {l[0]: l[3] for l in log_lines(proc.stdout)}
    assert sorted(fsdp2) == sorted(one) == list(range(1, 7))
    for it, loss in fsdp2.items():
        assert loss == pytest.approx(one[it], rel=REORDERED), it  # the data-parallel sums grouped otherwise
    resumed = warm_torchrun([*lora, "--use-torch-fsdp2", "--load", str(tmp_path / "lora"), "--ckpt-step", "3"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert {l[0]: l[3] for l in log_lines(resumed.stdout)} == {it: fsdp2[it] for it in (4, 5, 6)}


def test_fsdp2_counts_the_frozen_weights_sharded():
    """metrics.bytes_per_parameter under FSDP2 at DP=2, fp32 with Adam: a trainable parameter's 16 bytes and a frozen
    one's 4, each over the two ranks (fully_shard shards every parameter)."""
    import metrics

    cfg = checks.parse_args([*UNTIED, "--peft", "lora", "--pretrained-checkpoint", "base", "--use-torch-fsdp2"],
                            world_size=2, gpu=False)
    assert metrics.bytes_per_parameter(cfg) == (8.0, 2.0)
