"""PEFT (peft.py): LoRA and DoRA adapters on megatron-core's layers, trained by the same engine, saved alone."""

import json
import os

import pytest
import torch

import config
from conftest import TINY, config_error, log_lines, torchrun


def _cfg(*flags, world_size=1):
    return config.parse_args([*TINY, "--hidden-dropout", "0", "--attention-dropout", "0", "--pretrained-checkpoint",
                              "base", *flags], world_size=world_size, gpu=False)


def _loss(model, tokens):
    out = model[0](tokens, torch.arange(tokens.shape[1]).repeat(tokens.shape[0], 1), None, labels=(tokens + 1) % 50)
    return out.float().mean()


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_adapters_start_at_the_base_model_and_only_they_train(single_rank_groups, kind):
    from model import build_model, build_optimizer, get_forward_backward_func, set_random_seed, unwrap, wrap_model
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
    adapters = [p for p in unwrap(model[0]).parameters() if p.requires_grad]
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
    after = dict(unwrap(model[0]).named_parameters())
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
