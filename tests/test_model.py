"""model.py on CPU: the SDPA core attention, and the GPT variants the flags select trained by megatron-core's
engine (DDP, get_megatron_optimizer, the schedules) through device.py's shim."""

import math

import pytest
import torch

import config
import checks


def reference_attention(q, k, v):
    """softmax(q k^T / sqrt(d) + causal mask) v, written out, key/value heads repeated for GQA. [s, b, h, d] in."""
    s, b, h, d = q.shape
    k = k.repeat_interleave(h // k.shape[2], dim=2)
    v = v.repeat_interleave(h // v.shape[2], dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), float("-inf"))
    return torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v).reshape(s, b, h * d)


def test_sdpa_attention_is_causal_attention_with_gqa(single_rank_groups):
    from megatron.core.transformer.enums import AttnMaskType

    from model import SDPAttention, transformer_config

    cfg = checks.parse_args(["--attention-dropout", "0", "--num-query-groups", "2"], world_size=1, gpu=False)
    attention = SDPAttention(transformer_config(cfg), 1, AttnMaskType.causal)
    torch.manual_seed(0)
    q, k, v = torch.randn(16, 2, 4, 64), torch.randn(16, 2, 2, 64), torch.randn(16, 2, 2, 64)
    # fp32, SDPA's kernel against a plain softmax(QK^T)V: 64-term dot products of unit normals (magnitude ~8) and
    # 16-term weighted sums, each rounding at log2(n) x 2^-24 of its terms' size: within 1e-5.
    torch.testing.assert_close(attention(q, k, v, None), reference_attention(q, k, v), rtol=1e-5, atol=1e-5)
    # An explicit megatron mask (True = masked out) gives the same result as the implicit causal one.
    mask = torch.triu(torch.ones(16, 16, dtype=torch.bool), 1)[None, None]
    torch.testing.assert_close(attention(q, k, v, mask), reference_attention(q, k, v), rtol=1e-5, atol=1e-5)


def test_one_query_against_cached_keys_is_the_last_row_of_causal_attention(single_rank_groups):
    """A decode step: megatron-core hands the core attention one new query and every cached key, with
    attn_mask_type no_mask (attention.py:511-520). It must see all the keys, as the last row of full causal
    attention does; SDPA's causal mask, aligned top-left, would show it only the first."""
    from megatron.core.transformer.enums import AttnMaskType

    from model import SDPAttention, transformer_config

    cfg = checks.parse_args(["--attention-dropout", "0", "--num-query-groups", "2"], world_size=1, gpu=False)
    attention = SDPAttention(transformer_config(cfg), 1, AttnMaskType.causal)
    torch.manual_seed(0)
    q, k, v = torch.randn(16, 2, 4, 64), torch.randn(16, 2, 2, 64), torch.randn(16, 2, 2, 64)
    last_row = reference_attention(q, k, v)[-1:]
    for mask_type in (AttnMaskType.no_mask, AttnMaskType.causal):  # megatron's rule: causal only when sq > 1
        torch.testing.assert_close(attention(q[-1:], k, v, None, attn_mask_type=mask_type), last_row,
                                   rtol=1e-5, atol=1e-5)  # as in the test above: two fp32 kernels


@pytest.mark.full  # two ranks; the first command's CP is test_engine's and the drawn runs' cp2
def test_sdpa_attention_under_context_parallelism_is_one_process_attention():
    """Two CP ranks, each with its two chunks of the sequence (megatron-core's cut), give the one-process attention's
    output and Q/K/V gradients at their positions, with the causal mask from the chunks' offsets and with an
    explicit mask over the whole sequence; without the offsets the output is another one. And two tensor-parallel
    ranks draw their own attention-dropout masks (tests/scripts/cp_attention.py)."""
    import json

    from conftest import torchrun

    proc = torchrun([], nproc=2, script="tests/scripts/cp_attention.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for r in ranks:
        for mask in ("causal", "explicit"):
            # float64 (2^-53 ~ 1e-16): sums of <= 16 terms grouped otherwise, of values of order 10: within 1e-12
            assert max(r[mask][what] for what in ("out", "dq", "dk", "dv")) < 1e-12, r
            assert r[mask]["unshifted_out"] > 0.1, r
        # Attention dropout on two tensor-parallel ranks fed the same Q, K, V: each rank its own masks (SDPAttention
        # as megatron-core's DotProductAttention); no dropout, the same output to the last bit.
        for core in ("sdpa", "local"):
            assert r[f"tp_{core}_train_rank_difference"] > 0.1, r  # dropout 0.5 rescales kept scores by 2
            assert r[f"tp_{core}_eval_rank_difference"] == 0.0, r


@pytest.mark.parametrize("flags", [
    ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear"],
    ["--num-query-groups", "2", "--untie-embeddings-and-output-weights", "--attention-backend", "local"],
    ["--bf16"],
])
def test_gpt_variants_train_on_cpu(single_rank_groups, flags):
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.module import Float16Module

    from megatron.core.utils import unwrap_model
    from model import build_model, build_optimizer, get_forward_backward_func, set_random_seed, wrap_model

    cfg = checks.parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                             "--seq-length", "32", "--hidden-dropout", "0", "--attention-dropout", "0", *flags],
                            world_size=1, gpu=False)
    set_random_seed(0)
    model = wrap_model(cfg, build_model(cfg, vocab_size=100))
    gpt = unwrap_model(model[0])
    assert isinstance(model[0], DistributedDataParallel)
    assert isinstance(model[0].module, Float16Module) == ("--bf16" in flags)
    assert (gpt.output_layer.weight is None) == (not cfg.model.untie_embeddings_and_output_weights)
    core_attention = gpt.decoder.layers[0].self_attention.core_attention
    assert isinstance(core_attention, DotProductAttention) == ("local" in flags)
    optimizer = build_optimizer(cfg, model)
    assert isinstance(optimizer, MegatronOptimizer)
    tokens = torch.arange(32).repeat(2, 1) % 50
    batch = dict(tokens=tokens, labels=(tokens + 1) % 50, position_ids=torch.arange(32).repeat(2, 1))

    def forward_step(data_iterator, m):
        out = m(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        return out, lambda o: (o.float().mean(), {"lm loss": o.float().mean().detach()})

    fbf = get_forward_backward_func(model, optimizer)
    losses = []
    for _ in range(8):
        model[0].zero_grad_buffer()
        optimizer.zero_grad()
        losses.append(fbf(forward_step_func=forward_step, data_iterator=iter([]), model=model, num_microbatches=1,
                          seq_length=32, micro_batch_size=2)[0]["lm loss"].item())
        ok, grad_norm, _ = optimizer.step()
        assert ok and grad_norm > 0
    assert losses[-1] < losses[0]


def _activations_loss_and_grads(flags):
    """One forward and backward of the bare GPTModel: the bytes autograd keeps for the backward (each storage
    once, the weights included alike), the loss and the gradients."""
    from model import build_model, set_random_seed

    cfg = checks.parse_args(["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
                             "--seq-length", "128", "--hidden-dropout", "0", "--attention-dropout", "0", *flags],
                            world_size=1, gpu=False)
    set_random_seed(0)
    gpt = build_model(cfg, vocab_size=100)[0]
    tokens = torch.arange(2 * 128).reshape(2, 128) % 97
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = gpt(tokens, torch.arange(128).repeat(2, 1), None, labels=(tokens + 1) % 97).float().mean()
    loss.backward()
    return sum(saved.values()), loss.item(), [p.grad.clone() for p in gpt.parameters()]


@pytest.mark.parametrize("flags", [
    ["--recompute-granularity", "full", "--recompute-method", "uniform"],
    ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"],
    # megatron-core's own core attention keeps the s x s scores that selective recomputation drops (the default
    # SDPA kernel keeps none of them on its own).
    ["--recompute-granularity", "selective", "--attention-backend", "local"],
])
def test_recompute_keeps_fewer_activations_for_the_same_loss_and_gradients(single_rank_groups, flags):
    kept, loss, grads = _activations_loss_and_grads([f for f in flags if f in ("--attention-backend", "local")])
    kept_recompute, loss_recompute, grads_recompute = _activations_loss_and_grads(flags)
    assert kept_recompute < kept * (0.8 if "full" in flags else 0.95), (kept_recompute, kept)
    assert loss_recompute == loss
    for g, g_recompute in zip(grads, grads_recompute):
        # The same kernels on the same inputs; autograd accumulates the recomputed segment's gradients in another
        # order: a few fp32 roundings (2^-24 ~ 6e-8) of gradients below 1.
        torch.testing.assert_close(g_recompute, g, rtol=1e-6, atol=1e-7)


def test_no_weight_decay_on_biases_and_norms(single_rank_groups):
    from model import build_model, build_optimizer, wrap_model

    cfg = checks.parse_args(["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4"],
                            world_size=1, gpu=False)
    model = wrap_model(cfg, build_model(cfg, vocab_size=100))
    groups = build_optimizer(cfg, model).param_groups
    decay = [p for g in groups if g["wd_mult"] == 1.0 for p in g["params"]]
    no_decay = [p for g in groups if g["wd_mult"] == 0.0 for p in g["params"]]
    assert decay and no_decay
    assert all(p.ndim >= 2 for p in decay) and all(p.ndim == 1 for p in no_decay)
    assert len(decay) + len(no_decay) == len(list(model[0].parameters()))


def test_norm_is_a_module_of_its_own_with_torchs_arithmetic_and_names():
    """model.Norm is what megatron-core's spec builds (isinstance holds), honours the `normalization` it is given
    over the config's, computes torch's LayerNorm and RMSNorm bit for bit under their parameter names, and refuses
    zero-centred gamma (transformer-engine's)."""
    from model import Norm, transformer_config

    settings = transformer_config(checks.parse_args(["--sequence-parallel", "--tensor-model-parallel-size", "2"],
                                                    world_size=2, gpu=False))
    x = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(0))
    for kind, reference in (("LayerNorm", torch.nn.LayerNorm(16, eps=1e-5)), ("RMSNorm", torch.nn.RMSNorm(16, eps=1e-5))):
        norm = Norm(settings, 16, eps=1e-5, normalization=kind)
        assert isinstance(norm, Norm) and norm.normalization == kind
        with torch.no_grad():
            for p in (*norm.parameters(), *reference.parameters()):
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(p.numel()))
        assert sorted(dict(norm.named_parameters())) == sorted(dict(reference.named_parameters()))
        assert torch.equal(norm(x), reference(x))
        assert all(p.sequence_parallel for p in norm.parameters())
    assert Norm(settings, 16).normalization == settings.normalization == "LayerNorm"
    with pytest.raises(ValueError, match="zero-centred gamma"):
        Norm(settings, 16, zero_centered_gamma=True)
