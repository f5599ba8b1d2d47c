"""generate.py: greedy decoding is an argmax loop over the full forward, KV-cached decoding gives the full
forward's tokens (greedy and sampled, GPT-2-like, LLaMA-like and Mixtral-like, both core attentions, past the
context, TP=2; test_moe has MoE under TP=2 and EP=2), its flash decoding gives megatron-core's plain cached
decoding's logits through device.py's kernels and is left off where it would not, sampling follows its seed and limits, bad input is one line, and the quick start's default folders feed it with
no flag under tensor parallelism."""

import io
import os
import shutil
import types

import pytest
import torch

import yaml

from conftest import ATTENTION_BACKEND_ENVIRONMENT, LLAMA_FLAGS, TINY, torchrun


def one_process_world_ends():
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture(autouse=True)
def one_process_world():
    """generate.load_model sets up a world of one here; each test leaves none behind."""
    yield
    one_process_world_ends()


def test_greedy_is_deterministic_and_an_argmax_loop_over_the_full_forward(mock_run):
    import generate

    model, tokenizer, _ = generate.load_model(str(mock_run["dir"] / "ckpt"))
    prompt = tokenizer.tokenize("import os\n")
    first = generate.generate(model, tokenizer, prompt, max_new_tokens=70)  # past the 64-token context
    assert first == generate.generate(model, tokenizer, prompt, max_new_tokens=70)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(len(first)):
            window = torch.tensor([ids[-64:]])
            logits = model(window, torch.arange(window.shape[1])[None], attention_mask=None)[0, -1, :tokenizer.vocab_size]
            ids.append(int(logits.argmax()))
    assert len(first) == 70 and ids[len(prompt):] == first


def with_attention_backend(load: str, backend: str, tmp_path) -> str:
    """A copy of a checkpoint whose run_config.yaml asks for another core attention (the weights are the same)."""
    if backend == "auto":
        return load
    copy = str(tmp_path / f"ckpt_{backend}")
    shutil.copytree(load, copy)
    for path in (tmp_path / f"ckpt_{backend}").glob("iter_*/run_config.yaml"):
        saved = yaml.safe_load(path.read_text())
        saved["model"]["attention_backend"] = backend
        path.write_text(yaml.safe_dump(saved))
    return copy


def full_forward_tokens(model, prompt: list, new: list, vocab: int, sampling: dict) -> list:
    """The tokens the --no-kv-cache loop picks at each step given the tokens before it (`prompt + new`), its full
    forwards batched: one over the first context's worth (causal: position t's logits see tokens 0..t only) and one
    over every later window, the newest `context` tokens before each. The same picks in the same order (the sampled
    ones from the same seeded generator), so the result is the loop's tokens where `new` is."""
    context, ids = model.max_sequence_length, [*prompt, *new]
    targets = range(len(prompt), len(ids))  # the position each row of logits predicts
    with torch.no_grad():
        head = torch.tensor([ids[:context]])
        rows = list(model(head, torch.arange(head.shape[1])[None], attention_mask=None)[0, [j - 1 for j in targets
                                                                                               if j <= context]])
        later = [ids[j - context:j] for j in targets if j > context]
        if later:
            windows = torch.tensor(later)
            rows += list(model(windows, torch.arange(context).expand(len(later), -1), attention_mask=None)[:, -1])
    import generate

    generator = torch.Generator().manual_seed(sampling["seed"]) if "seed" in sampling else None
    knobs = [sampling.get("temperature", 1.0), sampling.get("top_k", 0), sampling.get("top_p", 1.0)]
    return [generate.pick(row[:vocab].float(), *knobs, generator) for row in rows]


# The fast command: the GPT-2-like and the Mixtral-like model (RoPE, grouped-query attention, a router at every
# step), each on SDPA; the full proof every pair, megatron-core's local attention too.
@pytest.mark.parametrize("kind, backend", [("gpt2", "auto"), pytest.param("gpt2", "local", marks=pytest.mark.full),
                                           pytest.param("llama", "auto", marks=pytest.mark.full),
                                           pytest.param("llama", "local", marks=pytest.mark.full), ("mixtral", "auto")])
def test_kv_cached_decoding_gives_the_full_forward_tokens_past_the_context(kind, backend, mock_run, llama_ckpt,
                                                                          moe_ckpts, tmp_path, monkeypatch):
    """300 tokens from a 64-token context, greedy and sampled: the cache serves every token while the sequence
    fits, the full-forward loop the rest, and the tokens are the --no-kv-cache loop's (full_forward_tokens, its
    forwards batched). Mixtral-like: a router picks 2 of 4 experts for each token, in the prefill and at every
    cached step."""
    import generate

    load = {"gpt2": str(mock_run["dir"] / "ckpt"), "llama": llama_ckpt}.get(kind) or moe_ckpts[kind]
    load = with_attention_backend(load, backend, tmp_path)
    model, tokenizer, cfg = generate.load_model(load)
    assert model.config.attention_backend.name == backend and model.max_sequence_length == 64  # megatron-core's AttnBackend
    assert (cfg.model.position_embedding_type, cfg.model.num_query_groups, cfg.model.num_moe_experts) == \
        {"gpt2": ("learned_absolute", 4, None), "llama": ("rope", 2, None), "mixtral": ("rope", 2, 4)}[kind]
    never_stops = types.SimpleNamespace(vocab_size=tokenizer.vocab_size, eod=-1)  # all 300 tokens, no early end
    prompt = tokenizer.tokenize("import os\n")
    cached_calls = []
    cached = generate.cached_next_token_logits
    monkeypatch.setattr(generate, "cached_next_token_logits", lambda *a: cached_calls.append(1) or cached(*a))
    with_cache = {}
    for name, sampling in (("greedy", dict()), ("sampled", dict(seed=3, temperature=0.8, top_k=50, top_p=0.95))):
        cached_calls.clear()
        with_cache[name] = generate.generate(model, never_stops, prompt, 300, **sampling)
        assert len(cached_calls) == 64 - len(prompt) + 1  # prefill, then one token each until the window is full
        assert len(with_cache[name]) == 300
        assert with_cache[name] == full_forward_tokens(model, prompt, with_cache[name], tokenizer.vocab_size, sampling)
    # The batched reference stands for the loop: the loop itself gives its first 70 tokens (past the context).
    assert generate.generate(model, never_stops, prompt, 70, kv_cache=False) == with_cache["greedy"][:70]


def test_the_cache_holds_the_prompt_and_the_new_tokens_and_decodes_as_the_plain_loop(llama_ckpt, monkeypatch):
    """A short generation sizes the KV cache to the prompt plus --max-new-tokens, not the context, and a cache of
    that size gives the plain loop's tokens."""
    import generate

    assert generate.kv_cache_length(8, 10, 131072) == 18 and generate.kv_cache_length(60, 300, 64) == 64
    model, tokenizer, _ = generate.load_model(llama_ckpt)
    never_stops = types.SimpleNamespace(vocab_size=tokenizer.vocab_size, eod=-1)
    prompt = tokenizer.tokenize("def f")
    sizes = []
    made = generate.StaticInferenceContext
    monkeypatch.setattr(generate, "StaticInferenceContext",
                        lambda **kw: sizes.append(kw["max_sequence_length"]) or made(**kw))
    with_cache = generate.generate(model, never_stops, prompt, 10)
    assert sizes == [len(prompt) + 10]
    assert with_cache == generate.generate(model, never_stops, prompt, 10, kv_cache=False)


def random_model(flags, gpu: bool = False):
    """A tiny GPT of `flags`, randomly initialised in this process (a world of one), for inference."""
    import config
    import checks
    import data
    from model import build_model, initialize_distributed, set_random_seed

    cfg = checks.parse_args(["--mock-data", *TINY, "--hidden-dropout", "0", "--attention-dropout", "0", *flags],
                            world_size=1, gpu=gpu)
    if not torch.distributed.is_initialized():
        initialize_distributed(cfg)
    set_random_seed(cfg.rng.seed)
    for name in ATTENTION_BACKEND_ENVIRONMENT:  # one backend per process in megatron-core: each model as a fresh one's
        os.environ.pop(name, None)
    return build_model(cfg, data.embedding_rows(data.ByteTokenizer()))[0].eval().requires_grad_(False)


def cached_steps(model, flash: bool, steps: int = 24, engaged=None) -> torch.Tensor:
    """The logits of a prefill and of `steps` cached decode steps (the same tokens whatever the logits), with
    megatron-core's flash decoding or its plain static decoding. What ran is checked, not assumed: flash decoding's
    kernel (the one megatron-core calls, attention.py:810) must run once per layer and decode step when it is asked
    for (`engaged`: unless the caller expects it left off), and never on the plain path."""
    import generate
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.transformer import attention

    kernel, calls = attention.flash_attn_with_kvcache, []

    def counted(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    ids, rows = list(range(70, 80)), []
    cache = StaticInferenceContext(max_batch_size=1, max_sequence_length=model.max_sequence_length)
    with generate.flash_decoding(model, flash):  # (which asks whether the kernel is device.py's: counted after)
        attention.flash_attn_with_kvcache = counted
        try:
            for step in range(steps + 1):
                rows.append(generate.cached_next_token_logits(model, ids, cache))
                ids.append(32 + 7 * step % 90)
        finally:
            attention.flash_attn_with_kvcache = kernel
    assert not model.config.flash_decode  # off again after
    engaged = flash if engaged is None else engaged
    assert len(calls) == (steps * model.config.num_layers if engaged else 0), (flash, engaged, len(calls))
    return torch.stack(rows)


@pytest.mark.parametrize("what, flags", [
    ("GPT-2-like", []),
    ("LLaMA-like", LLAMA_FLAGS),
    ("GPT-J-like RoPE on half of each head", ["--position-embedding-type", "rope", "--rotary-interleaved",
                                              "--rotary-percent", "0.5"]),
    ("q/k norms, megatron-core's own core attention", [*LLAMA_FLAGS, "--qk-layernorm", "--attention-backend", "local"]),
    # megatron-core 0.19 adds the softmax's extra term from the kernel's log-sum-exp (attention.py:790-808)
    ("off-by-one softmax", [*LLAMA_FLAGS, "--attention-backend", "local", "--softmax-type", "off-by-one"]),
    ("learnable softmax", [*LLAMA_FLAGS, "--attention-backend", "local", "--softmax-type", "learnable"]),
])
def test_flash_decoding_gives_the_plain_cached_decodings_logits(what, flags):
    """generate.py decodes with megatron-core's flash decoding (keys cached once rotated; a step rotates its own
    token only) through device.py's torch versions of flash-attn's kernels: the prefill and every step give the
    logits of megatron-core's plain static decoding (which rotates every cached key again at each step), bit for
    bit on SDPA; within float rounding beside megatron-core's own DotProductAttention. Without device.py's
    apply_rotary_emb, megatron-core's fallback (rope_utils.py:326) rotates the prefill by the cosines and sines
    taken as angles, and the RoPE models here differ from the first logits on."""
    model = random_model(flags)
    plain, flash = cached_steps(model, False), cached_steps(model, True)
    if "local" in flags:
        # Two fp32 attention kernels (device.py's torch flash decoding, megatron-core's softmax and matmuls) sum the
        # same <= 35 scores and 16-wide dot products otherwise: each rounds at log2(n) x 2^-24 of values of order
        # 1-10, through 2 layers and the 25 steps' caches: within 1e-5.
        torch.testing.assert_close(flash, plain, rtol=1e-5, atol=1e-5)
        assert torch.equal(flash[0], plain[0])  # the prefill runs the same core attention
    else:
        assert torch.equal(flash, plain), (flash - plain).abs().max()


def test_device_kernels_keep_flash_attns_contract_and_refuse_the_rest():
    """device.apply_rotary_emb is megatron-core's unfused RoPE bit for bit (halves or interleaved pairs, part of
    each head or all of it); megatron-core's apply_rotary_pos_emb_with_cos_sin, which calls it, now agrees with
    its unfused path; device.flash_attn_with_kvcache writes the new key and value into the cache in place and
    attends as SDPA over the sequence; what flash-attn's kernels take and these do not is one line."""
    import device
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    generator = torch.Generator().manual_seed(0)
    t = torch.randn(7, 2, 3, 16, generator=generator)  # [seq, batch, heads, dim], megatron-core's layout
    for interleaved in (False, True):
        for percent in (1.0, 0.5):
            rope = RotaryEmbedding(16, percent, rotary_interleaved=interleaved, use_cpu_initialization=True)
            cos, sin = rope.get_cos_sin(9)
            unfused = rope_utils._apply_rotary_pos_emb_bshd(t, rope.get_emb(7), rotary_interleaved=interleaved)
            ours = device.apply_rotary_emb(t.transpose(0, 1), cos, sin, interleaved).transpose(0, 1)
            assert torch.equal(ours, unfused) and not torch.equal(ours, t)
            assert torch.equal(rope_utils.apply_rotary_pos_emb_with_cos_sin(t, cos, sin, interleaved), unfused)

    k_cache, v_cache = torch.zeros(2, 9, 1, 16), torch.zeros(2, 9, 1, 16)  # [batch, length, kv heads, dim]
    k_cache[:, :4], v_cache[:, :4] = torch.randn(2, 2, 4, 1, 16, generator=generator)
    q = torch.randn(2, 1, 3, 16, generator=generator)  # three query heads share the one key head
    k, v = torch.randn(2, 2, 1, 1, 16, generator=generator)
    expected_k = torch.cat((k_cache[:, :4], k), dim=1)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), expected_k.transpose(1, 2), torch.cat((v_cache[:, :4], v), 1).transpose(1, 2),
        enable_gqa=True).transpose(1, 2)
    out = device.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor([4, 4]))
    assert torch.equal(out, expected) and torch.equal(k_cache[:, :5], expected_k) and not k_cache[:, 5:].any()
    for kwargs, named in ((dict(block_table=torch.zeros(2, 1)), "without block_table"),
                          (dict(q=torch.randn(2, 2, 3, 16)), "without a query longer than one")):
        with pytest.raises(NotImplementedError, match=named + "; install flash-attn") as e:
            device.flash_attn_with_kvcache(**{**dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v,
                                                     cache_seqlens=torch.tensor([5, 5])), **kwargs})
        assert "\n" not in str(e.value)
    # a ragged batch (sequences at different positions) is refused, not attended at the first one's length
    with pytest.raises(NotImplementedError, match=r"every sequence of the batch at one position \(got \[4, 2\]\)"):
        device.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor([4, 2]))


@pytest.mark.parametrize("flags", [
    ["--no-rope-freq", "[0,1]"],  # flash decoding would rotate the layers without RoPE too
    ["--attention-backend", "local", "--window-size", "4,0"],  # it sees past the window
    ["--attention-output-gate"],  # its decode step returns before the gate
], ids=["no-rope-freq", "window-size", "attention-output-gate"])
def test_flash_decoding_is_left_off_where_it_would_change_the_attention(flags, monkeypatch):
    """A model whose attention megatron-core's flash decoding does not compute as written decodes with its plain
    cached decoding when flash decoding is asked for; forced on, the logits differ."""
    import generate

    model = random_model([*LLAMA_FLAGS, *flags])
    assert generate.flash_decoding_applies(random_model(LLAMA_FLAGS))  # the same model without the flag
    plain = cached_steps(model, False, steps=4)
    assert torch.equal(cached_steps(model, True, steps=4, engaged=False), plain)  # asked for, and left off
    assert not generate.flash_decoding_applies(model)
    monkeypatch.setattr(generate, "flash_decoding_applies", lambda model: True)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        torch.testing.assert_close(cached_steps(model, True, steps=4), plain)


def test_a_core_attention_of_ones_own_decodes_the_plain_cached_way(monkeypatch):
    """A fork's core attention (model.core_attention's, docs/fork.md) runs in the prefill and in every cached step:
    flash decoding, whose kernel stands in for it, is left off when asked for, and the logits show the change."""
    import generate
    import model as model_lib

    class HotAttention(model_lib.SDPAttention):
        calls = 0

        def forward(self, query, key, value, *args, **kwargs):
            HotAttention.calls += 1
            return super().forward(query * 2.0, key, value, *args, **kwargs)

    stock = cached_steps(random_model(LLAMA_FLAGS), False, steps=4)
    monkeypatch.setattr(model_lib, "SDPAttention", HotAttention)  # the fork's one line in model.core_attention
    hot = random_model(LLAMA_FLAGS)
    assert not generate.flash_decoding_applies(hot)
    plain = cached_steps(hot, False, steps=4)
    assert torch.equal(cached_steps(hot, True, steps=4, engaged=False), plain)  # asked for, and left off
    assert HotAttention.calls == 2 * 5 * hot.config.num_layers  # both decodings: the prefill and 4 steps, each layer
    assert not torch.allclose(plain, stock)


def test_flash_attns_own_kernel_is_left_to_the_precisions_it_takes(monkeypatch):
    """With flash-attn installed, megatron-core calls its flash_attn_with_kvcache, which takes fp16 and bf16 only:
    an fp32 model (generate.load_model's) then decodes the plain way; a bf16 one with flash decoding."""
    import generate
    from megatron.core.transformer import attention

    model = random_model(LLAMA_FLAGS)
    assert generate.flash_decoding_applies(model)  # device.py's kernel takes fp32
    monkeypatch.setattr(attention, "flash_attn_with_kvcache", lambda *args, **kwargs: None)  # as if installed
    assert not generate.flash_decoding_applies(model)
    monkeypatch.setattr(model.config, "params_dtype", torch.bfloat16)
    assert generate.flash_decoding_applies(model)


def test_tensor_parallel_samples_are_the_one_process_samples(llama_ckpt, warm_torchrun):
    """torchrun --nproc-per-node 2 generate.py --num-samples 2: each rank holds half of each matrix (and half
    of the query groups), the gathered logits give every rank the same draws, and the two samples are what one
    process draws from one seeded generator."""
    import generate

    proc = warm_torchrun(["--load", llama_ckpt, "--prompt", "The", "--num-samples", "2", "--max-new-tokens", "30",
                     "--seed", "5"], script="generate.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    model, tokenizer, _ = generate.load_model(llama_ckpt)
    generator = torch.Generator().manual_seed(5)
    samples = [generate.generate(model, tokenizer, tokenizer.tokenize("The"), 30, 0.8, 50, 0.95, generator=generator)
               for _ in range(2)]
    assert samples[0] != samples[1]
    texts = []
    for sample in samples:  # as generate.py streams them (an incomplete trailing character is held back)
        out = io.StringIO()
        stream = generate.TextStream(tokenizer, out)
        for token in sample:
            stream(token)
        texts.append("The" + out.getvalue() + "\n")
    assert proc.stdout == texts[0] + "---------------\n" + texts[1]


def test_sampling_follows_its_seed_temperature_top_k_and_top_p():
    import generate

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])

    def draws(seed, **kw):
        g = torch.Generator().manual_seed(seed)
        return [generate.pick(logits, kw.get("temperature", 1.0), kw.get("top_k", 0), kw.get("top_p", 1.0), g)
                for _ in range(200)]

    assert generate.pick(logits, 1.0, 0, 1.0, None) == 0  # greedy
    assert draws(1) == draws(1) and draws(1) != draws(2)
    assert set(draws(1)) == {0, 1, 2, 3, 4}
    assert set(draws(1, top_k=2)) == {0, 1}
    # softmax: 0.563 0.207 0.126 0.076 0.028; 0.563 + 0.207 < 0.8 <= + 0.126: three tokens reach P = 0.8
    assert set(draws(1, top_p=0.8)) == {0, 1, 2}
    assert set(draws(1, top_p=0.5)) == {0}
    assert set(draws(1, temperature=0.01)) == {0}


def test_text_streams_as_tokens_come_and_waits_for_a_whole_character():
    from data import ByteTokenizer

    import generate

    out = io.StringIO()
    stream = generate.TextStream(ByteTokenizer(), out)
    written = []
    for token in "a€b".encode():  # the euro sign is three bytes
        stream(token)
        written.append(out.getvalue())
    assert written == ["a", "a", "a", "a€", "a€b"]


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "0"], "--temperature must be positive, got 0.0 (use --greedy"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    (["--top-k", "-1"], "--top-k must be 0 (all tokens) or positive, got -1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1, got 0"),
    (["--num-samples", "0"], "--num-samples must be at least 1, got 0"),
    (["--expert-model-parallel-size", "0"], "--expert-model-parallel-size must be at least 1, got 0"),
    (["--load", "/nonexistent"], "--load /nonexistent: no such directory (train first"),
])
def test_bad_values_are_one_line_before_torch(flags, message, capsys, tmp_path):
    import generate

    with pytest.raises(SystemExit) as e:
        generate.parse_args(["--prompt", "x", "--load", str(tmp_path), *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and message in err


def test_a_prompt_past_the_context_or_a_tokenizer_without_text_is_one_line(mock_run, tmp_path, capsys):
    import generate
    import hf

    transformers = pytest.importorskip("transformers", reason="a NullTokenizer checkpoint comes from an HF import")
    args = generate.parse_args(["--load", str(mock_run["dir"] / "ckpt"), "--prompt", "x" * 64])
    assert generate.main(args) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "generate.py: error: --prompt is 64 tokens but the model's context is 64; shorten it"

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=1,
                                                                 n_head=2))
    model.save_pretrained(str(tmp_path / "hf"))
    hf.import_hf(str(tmp_path / "hf"), str(tmp_path / "ids"))  # no tokenizer.json: NullTokenizer
    one_process_world_ends()
    capsys.readouterr()
    assert generate.main(generate.parse_args(["--load", str(tmp_path / "ids"), "--prompt", "1 2"])) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("generate.py: error: ") and "NullTokenizer (token ids, no text)" in err[-1]


def test_expert_parallelism_a_checkpoint_or_the_ranks_cannot_take_is_one_line(llama_ckpt, moe_ckpts):
    """--expert-model-parallel-size on a dense checkpoint, or not dividing the processes: one line, before anything
    is built (inference_config reads run_config.yaml only)."""
    import checkpoint
    import config
    import checks
    import generate

    dense, moe = (checkpoint.resolve_load_dir(d, None) for d in (llama_ckpt, moe_ckpts["mixtral"]))
    for directory, world, expected in ((dense, 2, "holds a dense model (no experts); drop the flag"),
                                       (moe, 3, "--expert-model-parallel-size 2 does not divide the 3 processes")):
        with pytest.raises(config.ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")) as e:
            generate.inference_config(directory, world, 2)
        assert "\n" not in str(e.value)
    m = generate.inference_config(moe, 2, 2).model  # TP 1 x EP 2, experts whole; no sequence parallelism
    assert (m.tensor_model_parallel_size, m.expert_model_parallel_size, m.expert_tensor_parallel_size,
            m.sequence_parallel) == (1, 2, 1, False)


@pytest.mark.full  # fresh jobs; the first command's TP decoding is test_generate's in-process layouts
def test_quick_start_outputs_feed_generate_with_no_flag_under_tensor_parallelism(tmp_path, monkeypatch):
    """The quick start's configuration (config.QUICK_START: its own BPE tokenizer of the built-in corpus), shrunk, in
    an empty folder and with no output flag: the tokenizer is trained on first use and reads the corpus back exactly;
    a checkpoint in checkpoints/ that carries it, TensorBoard files in runs/; then `generate.py --prompt` (2 ranks,
    tensor-parallel) there reads it and writes what a one-process greedy loop writes. Another tokenizer file is one
    line naming both vocabularies. Both are fresh torchrun jobs, as a user starts them: their stderr holds no notice
    of megatron-core's or torch's (device.NOT_THE_USERS), the training's nothing, generate.py's its one line."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    import checkpoint
    import config
    import checks
    import data
    import generate
    import train

    monkeypatch.chdir(tmp_path)
    shrunk = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--train-iters", "20",
              "--eval-iters", "0", "--num-workers", "0", "--data-cache-path", str(tmp_path / "cache")]
    cfg = checks.parse_args([*config.QUICK_START, *shrunk], world_size=1, gpu=False)
    assert (cfg.checkpoint.save, cfg.logger.tensorboard_dir) == ("checkpoints", "runs")
    bpe = tmp_path / "cache" / "pydoc_topics_bpe2048" / "tokenizer.json"
    assert cfg.tokenizer.tokenizer_model == str(bpe) and not bpe.exists()  # derived, trained at setup
    proc = torchrun([*config.QUICK_START, *shrunk], cwd=tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    tokenizer = data.HuggingFaceTokenizer(str(bpe))
    assert tokenizer.vocab_size == 2048 and tokenizer.eod == tokenizer._tokenizer.token_to_id("<|endoftext|>")
    paragraphs = data.builtin_corpus_paragraphs()[:200]
    assert all(tokenizer.detokenize(tokenizer.tokenize(p)) == p for p in paragraphs)  # the round trip, exact
    text = "".join(paragraphs)
    assert len(text.encode()) / len(tokenizer.tokenize(text)) > 3  # bytes per token: the point of it
    saved = tmp_path / "checkpoints" / "iter_0000020" / "tokenizer" / "tokenizer.json"
    assert saved.read_bytes() == bpe.read_bytes()
    assert open(tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").read() == "20"
    tb = EventAccumulator(str(tmp_path / "runs"), size_guidance={"scalars": 0})
    tb.Reload()
    assert [e.step for e in tb.Scalars("lm loss")] == list(range(1, 21))

    other = Tokenizer(models.BPE())
    other.pre_tokenizer = pre_tokenizers.ByteLevel()
    other.train_from_iterator(paragraphs, trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"],
                                                              show_progress=False))
    other.save(str(tmp_path / "other.json"))
    wrong = checks.parse_args([*config.QUICK_START, *shrunk, "--tokenizer-model", str(tmp_path / "other.json"),
                               "--load", "checkpoints", "--no-save", "--train-iters", "21"], world_size=1, gpu=False)
    with pytest.raises(checkpoint.CheckpointError, match=r"trained with tokenizer .*'vocab_size': 2048.* but the flags "
                                                         r"give .*'vocab_size': 600") as e:
        train.pretrain(wrong)
    assert "\n" not in str(e.value)

    proc = torchrun(["--prompt", "The Python", "--greedy", "--max-new-tokens", "40"], script="generate.py", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [" loaded checkpoint checkpoints/iter_0000020 at iteration 0 (weights only), "
                                        "trained for 20 iterations"]
    model, tokenizer, cfg = generate.load_model("checkpoints")
    assert cfg.model.tensor_model_parallel_size == 1 and os.path.samefile(tokenizer.file, saved)  # the checkpoint's copy
    new = generate.generate(model, tokenizer, tokenizer.tokenize("The Python"), max_new_tokens=40)
    assert proc.stdout == "The Python" + tokenizer.detokenize(new) + "\n"
    assert len(new) > 0



def test_the_default_folders_can_be_turned_off():
    import config
    import checks

    cfg = checks.parse_args(["--no-save", "--no-tensorboard"], world_size=1, gpu=False)
    assert cfg.checkpoint.save is None and cfg.logger.tensorboard_dir is None
    cfg = checks.parse_args(["--no-save", "--save", "elsewhere", "--tensorboard-dir", "tb"], world_size=1, gpu=False)
    assert (cfg.checkpoint.save, cfg.logger.tensorboard_dir) == ("elsewhere", "tb")  # the last of the two wins
