"""hf.py against the real `transformers` library (CPU, tiny random or trained models, nothing downloaded), for the
GPT-2, LLaMA, Mixtral and Qwen3-MoE layouts: exported checkpoints give transformers' logits and greedy tokens,
imported transformers models give ours, HF -> ours -> HF gives back the same tensors, and a transformers MoE model
trains on in train.py and goes back."""

import json
import os
import re

import pytest
import torch

import config
import checks
from conftest import HF_LOGITS, LLAMA_FLAGS, MIXTRAL_FLAGS, TINY

transformers = pytest.importorskip("transformers", reason="transformers is in requirements.txt; this checks the HF layouts")

TEXT = ("Python is an easy to learn, powerful programming language. It has efficient high-level data structures "
        "and a simple but effective approach to object-oriented programming.")


@pytest.fixture(autouse=True)
def one_process_world():
    """hf.py and generate.py set up a world of one here; each test leaves none behind."""
    yield
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _text_batch(tokenizer, length=48):
    ids = tokenizer.tokenize(TEXT)
    return torch.tensor([ids[:length], ids[length:2 * length]])


def _our_logits(load, tokens):
    import generate

    model, tokenizer, _ = generate.load_model(load)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, positions, attention_mask=None)[..., :tokenizer.vocab_size], tokenizer


LAYOUTS = ["gpt2", "llama", "mixtral", "qwen3_moe"]


def _trained(layout, mock_run, llama_ckpt, moe_ckpts):
    """A trained checkpoint of the layout: the suite's 2-rank GPT-2 run, or a tiny one trained in this process."""
    return {"gpt2": str(mock_run["dir"] / "ckpt"), "llama": llama_ckpt}.get(layout) or moe_ckpts[layout]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_gives_transformers_our_logits(layout, mock_run, llama_ckpt, moe_ckpts, tmp_path):
    """The routers pick the same experts on both sides (a token sent elsewhere would move its logits far past the
    tolerance), with the same weights, the q/k norms and dense layers of Qwen3-MoE where they are."""
    import hf
    from data import ByteTokenizer

    load = _trained(layout, mock_run, llama_ckpt, moe_ckpts)
    tokens = _text_batch(ByteTokenizer())
    ours, tokenizer = _our_logits(load, tokens)
    assert hf.export(load, str(tmp_path / "hf")) == layout
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert type(theirs).__name__ == hf.LAYOUTS[layout][1]
    with torch.no_grad():
        logits = theirs(tokens).logits
    assert logits.shape == ours.shape == (2, 48, tokenizer.vocab_size)
    assert (logits - ours).abs().max().item() <= HF_LOGITS
    assert ours.std() > 0.1  # trained weights, not a constant


@pytest.mark.parametrize("layout", LAYOUTS)
def test_transformers_greedy_generate_gives_our_tokens(layout, mock_run, llama_ckpt, moe_ckpts, tmp_path):
    """Our KV-cached greedy decoding (generate.py's default) and transformers' on the export: the same tokens."""
    import generate
    import hf

    load = _trained(layout, mock_run, llama_ckpt, moe_ckpts)
    hf.export(load, str(tmp_path / "hf"))
    model, tokenizer, _ = generate.load_model(load)
    prompt = tokenizer.tokenize("def main():")
    ours = generate.generate(model, tokenizer, prompt, max_new_tokens=24)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    out = theirs.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=tokenizer.eod,
                          pad_token_id=tokenizer.eod)[0, len(prompt):].tolist()
    if out and out[-1] == tokenizer.eod:
        out = out[:-1]  # transformers keeps the end-of-document token; we stop before it
    assert len(ours) > 0 and out == ours


def _hf_config(kind, **changes):
    """A tiny transformers config of `kind`; Qwen3-MoE's first layer dense, its top-k weights not renormalized."""
    llama = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=5000.0,
                 tie_word_embeddings=False)
    if kind == "mixtral":
        return transformers.MixtralConfig(**llama, num_local_experts=4, num_experts_per_tok=2, **changes)
    return transformers.Qwen3MoeConfig(**llama, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                       mlp_only_layers=[0], norm_topk_prob=False, **changes)


def _random_hf(kind, directory):
    torch.manual_seed(0)
    if kind in ("mixtral", "qwen3_moe"):
        model = transformers.AutoModelForCausalLM.from_config(_hf_config(kind))
    elif kind == "llama":
        c = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                                     rms_norm_eps=1e-5, rope_theta=5000.0, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(c)
    else:
        c = transformers.GPT2Config(vocab_size=300, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                    activation_function="gelu_new", bos_token_id=299, eos_token_id=299)
        model = transformers.GPT2LMHeadModel(c)
    with torch.no_grad():  # random norms and biases too, so a swapped or dropped tensor shows
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
    model.eval().save_pretrained(directory)
    return model


@pytest.mark.parametrize("kind", ["llama", "gpt2", "mixtral", "qwen3_moe"])
def test_import_gives_the_transformers_logits_and_exports_back_the_same_tensors(kind, tmp_path):
    import hf
    from safetensors.torch import load_file

    theirs = _random_hf(kind, str(tmp_path / "in"))
    directory = hf.import_hf(str(tmp_path / "in"), str(tmp_path / "ckpt"))
    assert directory.endswith("iter_0000000") and os.path.isfile(os.path.join(directory, "run_config.yaml"))
    tokens = torch.randint(0, 299, (2, 40), generator=torch.Generator().manual_seed(3))
    ours, tokenizer = _our_logits(str(tmp_path / "ckpt"), tokens)
    with torch.no_grad():
        expected = theirs(tokens).logits
    assert ours.shape == expected.shape == (2, 40, 300)
    assert (ours - expected).abs().max().item() <= HF_LOGITS

    hf.export(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    before, after = load_file(str(tmp_path / "in" / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[k], after[k]) for k in before)
    config_in, config_out = (json.load(open(tmp_path / d / "config.json")) for d in ("in", "out"))
    if kind == "gpt2":
        config_in["n_inner"] = config_in["n_inner"] or 4 * config_in["n_embd"]  # None: GPT-2's 4 x hidden
    for key in ("vocab_size", "num_key_value_heads", "head_dim", "intermediate_size", "n_inner", "activation_function",
                "tie_word_embeddings", "n_positions", "max_position_embeddings", "num_experts_per_tok", "moe_intermediate_size", "mlp_only_layers", "norm_topk_prob", "model_type"):
        assert config_in.get(key) == config_out.get(key), key
    # transformers writes Qwen3-MoE's expert count as num_local_experts (Mixtral's name), the hub's configs and hf.py
    # as num_experts; transformers reads both
    assert hf.hf_experts(config_in) == hf.hf_experts(config_out) == (0 if kind in ("gpt2", "llama") else 4)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_a_transformers_moe_model_trains_on_in_train_py_and_goes_back(kind, tmp_path):
    """transformers' own from_config model, imported, trained 3 iterations by train.py (routers and experts move),
    exported: transformers loads it and computes the trained model's logits."""
    import hf
    import train
    from megatron.core import parallel_state

    _random_hf(kind, str(tmp_path / "in"))
    directory = hf.import_hf(str(tmp_path / "in"), str(tmp_path / "base"))
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    cfg = checks.parse_args(["--config-file", os.path.join(directory, "run_config.yaml"), "--pretrained-checkpoint",
                             str(tmp_path / "base"), "--seq-length", "32", "--micro-batch-size", "2", "--lr", "1e-2",
                             "--train-iters", "3", "--eval-iters", "0", "--num-workers", "0", "--save",
                             str(tmp_path / "trained"), "--data-cache-path", str(tmp_path / "cache")],
                            world_size=1, gpu=False)
    assert cfg.model.num_moe_experts == 4 and cfg.model.moe_router_pre_softmax == (kind == "qwen3_moe")
    assert train.pretrain(cfg).train_state.step == 3
    assert hf.export(str(tmp_path / "trained"), str(tmp_path / "out")) == kind
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    tokens = torch.randint(0, 299, (2, 40), generator=torch.Generator().manual_seed(3))
    ours, _ = _our_logits(str(tmp_path / "trained"), tokens)
    with torch.no_grad():
        assert (theirs(tokens).logits - ours).abs().max().item() <= HF_LOGITS
    from safetensors.torch import load_file

    before, after = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("in", "out"))
    router = "model.layers.1." + ("block_sparse_moe" if kind == "mixtral" else "mlp") + ".gate.weight"
    assert sorted(before) == sorted(after) and not torch.equal(before[router], after[router])


def test_imported_weights_start_a_lora_run(tmp_path, capsys):
    """--pretrained-checkpoint takes an import: a LoRA run on top of a transformers LLaMA trains."""
    import hf
    import train

    _random_hf("llama", str(tmp_path / "in"))
    directory = hf.import_hf(str(tmp_path / "in"), str(tmp_path / "base"))
    torch.distributed.destroy_process_group()
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    cfg = checks.parse_args(["--config-file", os.path.join(directory, "run_config.yaml"), "--pretrained-checkpoint",
                             str(tmp_path / "base"), "--peft", "lora", "--seq-length", "32", "--micro-batch-size", "2",
                             "--train-iters", "2", "--eval-iters", "0", "--num-workers", "0", "--save",
                             str(tmp_path / "lora"), "--data-cache-path", str(tmp_path / "cache"), "--log-interval", "1"],
                            world_size=1, gpu=False)
    state = train.pretrain(cfg)
    out = capsys.readouterr().out
    assert state.train_state.step == 2 and "loaded checkpoint" in out and "lora:" in out


def test_a_model_no_layout_can_express_is_one_line_naming_the_differences():
    import hf

    m = checks.parse_args(["--position-embedding-type", "rope", "--mock-data"], world_size=1, gpu=False).model
    with pytest.raises(config.ConfigError) as e:
        hf.choose_layout(m)
    message = str(e.value)
    assert "\n" not in message
    assert "GPT-2 needs learned_absolute positions (has rope)" in message
    assert "LLaMA needs RMSNorm (has LayerNorm), SwiGLU (has gelu)" in message
    assert hf.choose_layout(checks.parse_args(["--mock-data", *LLAMA_FLAGS], world_size=1, gpu=False).model) == "llama"


@pytest.mark.parametrize("flags, named", [(["--qk-layernorm"], "no --qk-layernorm"),
                                          (["--add-qkv-bias"], "no --add-qkv-bias"),
                                          (["--softmax-type", "off-by-one", "--attention-backend", "local"],
                                           "the plain softmax (has --softmax-type)")])
def test_megatron_lm_variants_no_layout_has_are_refused_by_name(flags, named):
    """A LLaMA-like model with one of Megatron-LM's variants exports to no layout: the error names it."""
    import hf

    m = checks.parse_args(["--mock-data", *LLAMA_FLAGS, *flags], world_size=1, gpu=False).model
    with pytest.raises(config.ConfigError, match=f"LLaMA needs .*{re.escape(named)}"):
        hf.choose_layout(m)


def test_import_refuses_pickled_weights_and_unknown_layouts(tmp_path, capsys):
    import hf

    (tmp_path / "bin").mkdir()
    _random_hf("gpt2", str(tmp_path / "bin"))
    os.replace(tmp_path / "bin" / "model.safetensors", tmp_path / "bin" / "pytorch_model.bin")
    capsys.readouterr()  # transformers' own progress bars
    assert hf.main(hf.parse_args(["import", "--hf", str(tmp_path / "bin"), "--save", str(tmp_path / "x")])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no model.safetensors (pytorch_model.bin is pickled" in err
    (tmp_path / "bert").mkdir()
    json.dump({"model_type": "bert"}, open(tmp_path / "bert" / "config.json", "w"))
    assert hf.main(hf.parse_args(["import", "--hf", str(tmp_path / "bert"), "--save", str(tmp_path / "x")])) == 2
    assert "model_type 'bert'; hf.py reads the gpt2, llama, mixtral, qwen3_moe layouts" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x")


@pytest.mark.parametrize("flags, named", [
    (["--moe-shared-expert-intermediate-size", "64"], "Mixtral needs no shared experts (has "
                                                      "--moe-shared-expert-intermediate-size 64)"),
    (["--moe-router-score-function", "sigmoid"], "Mixtral needs a softmax router (has --moe-router-score-function "
                                                 "sigmoid)"),
    (["--moe-layer-freq", "[1,0]"], "Mixtral needs every layer an MoE layer"),
    (["--moe-layer-freq", "[1,0]"], "Qwen3-MoE needs --qk-layernorm"),
])
def test_moe_models_transformers_cannot_express_are_refused_by_name(flags, named):
    """Shared experts (Qwen2-MoE's, not Mixtral's or Qwen3-MoE's), a sigmoid router (DeepSeek-V3's), dense layers
    without Qwen3's q/k norms: each named."""
    import hf

    m = checks.parse_args(["--mock-data", *TINY, *MIXTRAL_FLAGS, *flags], world_size=1, gpu=False).model
    with pytest.raises(config.ConfigError, match=re.escape(named)) as e:
        hf.choose_layout(m)
    assert "\n" not in str(e.value)


def test_moe_bad_input_is_one_line_before_any_weight_loads(moe_ckpts, tmp_path, capsys):
    """An MoE checkpoint asked for a dense layout; a transformers MoE family hf.py does not read (Qwen2-MoE, with its
    shared expert); a config.json whose expert count is not its weights'. Each one line, exit code 2, no weights
    read and nothing written."""
    import hf

    capsys.readouterr()
    for layout, name in (("llama", "LLaMA"), ("gpt2", "GPT-2")):
        args = hf.parse_args(["export", "--load", moe_ckpts["mixtral"], "--out", str(tmp_path / "x"), "--layout", layout])
        assert hf.main(args) == 2
        out = capsys.readouterr()
        assert out.err.count("\n") == 1 and f"does not fit the {name} layout: {name} needs " in out.err
        assert "no experts (has --num-experts 4)" in out.err and "loaded checkpoint" not in out.out
    transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        vocab_size=300, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, num_experts=4)).save_pretrained(tmp_path / "qwen2")
    _random_hf("mixtral", str(tmp_path / "mixtral"))
    path = tmp_path / "mixtral" / "config.json"
    json.dump(dict(json.load(open(path)), num_local_experts=8), open(path, "w"))
    capsys.readouterr()  # transformers' own progress bars
    for directory, expected in (("qwen2", "model_type 'qwen2_moe'; hf.py reads the gpt2, llama, mixtral, qwen3_moe"),
                                ("mixtral", "num_experts is 8, but layer 0 of the weights has 4 experts (numbered 0 to 3)")):
        assert hf.main(hf.parse_args(["import", "--hf", str(tmp_path / directory), "--save", str(tmp_path / "x")])) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and expected in err, err
    assert not os.path.exists(tmp_path / "x")


@pytest.mark.parametrize("kind", ["llama", "gpt2", "mixtral", "qwen3_moe"])
def test_a_config_without_its_optional_keys_is_read_with_transformers_defaults(kind, tmp_path):
    """A config.json that leaves out every key at its class's default (a hand-written or minimal one) imports as
    transformers reads it: Qwen3-MoE's norm_topk_prob False (no renormalised routing), LLaMA's untied embeddings, ..."""
    import hf

    theirs = _random_hf(kind, str(tmp_path / "in"))
    path = tmp_path / "in" / "config.json"
    saved = json.loads(path.read_text())
    defaults = type(theirs.config)().to_dict()
    minimal = {k: v for k, v in saved.items() if k == "model_type" or k not in defaults or defaults[k] != v}
    assert len(minimal) < len(saved)
    path.write_text(json.dumps(minimal))
    hf.import_hf(str(tmp_path / "in"), str(tmp_path / "ckpt"))
    tokens = torch.randint(0, 299, (2, 40), generator=torch.Generator().manual_seed(3))
    ours, _ = _our_logits(str(tmp_path / "ckpt"), tokens)
    reread = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "in")).eval()
    with torch.no_grad():
        expected = reread(tokens).logits
    assert (ours - expected).abs().max().item() <= HF_LOGITS


@pytest.mark.parametrize("gated", [False, True])
def test_an_activation_of_ones_own_is_refused_by_the_export_never_exported_as_another(monkeypatch, gated):
    """A fork's activation, set in its one place (config.GPTModelProvider.mlp_fields, megatron-core's activation_func
    and gated_linear_unit): the export reads those fields, so GPT-2 (GeLU) and LLaMA (gated SiLU) both refuse it by
    name in one line, where reading Megatron-LM's switches exported it as GPT-2's GeLU."""
    import hf

    def mlp_fields(self):
        return dict(gated_linear_unit=gated, activation_func=torch.tanh)

    monkeypatch.setattr(config.GPTModelProvider, "mlp_fields", mlp_fields)
    m = checks.parse_args(["--mock-data"], world_size=1, gpu=False).model
    with pytest.raises(config.ConfigError) as e:
        hf.choose_layout(m)
    has = "gated tanh" if gated else "tanh"
    assert "\n" not in str(e.value) and f"GeLU (has {has})" in str(e.value) and f"SwiGLU (has {has})" in str(e.value)
