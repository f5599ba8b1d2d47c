"""Run under torchrun with 2 processes: SDPAttention under context parallelism against one-process attention.

Both ranks draw the same full-sequence Q, K, V and output weights. The reference is SDPAttention without context
parallelism on the whole sequence. Under CP=2 each rank holds its two chunks of the sequence (cut by megatron-core's
get_batch_on_this_cp_rank), and its output and the gradients of its Q, K and V must be the reference's at the same
positions. That holds for both ways a mask reaches the attention: none (causal, built from the chunks' offsets) and
an explicit mask over the whole sequence (here --reset-attention-mask's, two documents).

Then the same two processes as two tensor-parallel ranks, each holding its half of the heads, fed identical Q, K, V
with attention dropout 0.5: each rank must draw its own dropout masks (megatron-core's DotProductAttention draws them
from the tensor-parallel RNG tracker's stream, dot_product_attention.py:216-218), so the two ranks' outputs differ,
for SDPAttention as for megatron-core's own; without dropout (eval) they are equal.

Prints one JSON line per rank, printed by rank 0: the largest differences."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import model  # noqa: E402
from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.utils import get_batch_on_this_cp_rank  # noqa: E402

import device  # noqa: E402

device.install_cpu_shim()  # a program that is one run: megatron-core on this machine for all of it

torch.distributed.init_process_group("gloo")
s, b, heads, groups, d = 16, 2, 4, 2, 8
config = TransformerConfig(num_layers=1, hidden_size=heads * d, num_attention_heads=heads, num_query_groups=groups,
                           attention_dropout=0.0, use_cpu_initialization=True)


def attention():
    return model.SDPAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal)


parallel_state.initialize_model_parallel(1, 1)
reference = attention()  # its CP group has one rank: the whole sequence, one process
parallel_state.destroy_model_parallel()
parallel_state.initialize_model_parallel(1, 1, context_parallel_size=2)
under_cp = attention()
CP_GROUP = parallel_state.get_context_parallel_group()

torch.manual_seed(0)
q, k, v = (torch.randn(s, b, h, d, dtype=torch.float64) for h in (heads, groups, groups))
weights = torch.randn(s, b, heads * d, dtype=torch.float64)
# Two documents (positions 0-6 and 7-15), each causal: megatron's mask, True where a query must not look.
causal = torch.ones(s, s).tril().bool()
same_document = (torch.arange(s)[:, None] >= 7) == (torch.arange(s)[None, :] >= 7)
explicit = ~(causal & same_document).view(1, 1, s, s).expand(b, 1, s, s)


def run(module, q, k, v, mask, weights):
    """Output and the gradients of q, k, v of sum(attention(q, k, v) * weights)."""
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = module(q, k, v, mask)
    (out * weights).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def this_rank(x):
    """This CP rank's chunks of a [s, ...] tensor, cut as megatron-core cuts a batch ([b, s, ...])."""
    return get_batch_on_this_cp_rank({"x": x.transpose(0, 1)}, is_hybrid_cp=False, cp_group=CP_GROUP)["x"].transpose(0, 1)


result = {}
for name, mask in (("causal", None), ("explicit", explicit)):
    full = run(reference, q, k, v, mask, weights)
    local_mask = None if mask is None else get_batch_on_this_cp_rank({"attention_mask": mask}, is_hybrid_cp=False,
                                                                     cp_group=CP_GROUP)["attention_mask"]
    local = run(under_cp, this_rank(q), this_rank(k), this_rank(v), local_mask, this_rank(weights))
    result[name] = {what: (a - this_rank(f)).abs().max().item()
                    for what, a, f in zip(("out", "dq", "dk", "dv"), local, full)}
    # Without the offsets (each rank's chunks read as if they began the sequence) the output is another one.
    result[name]["unshifted_out"] = (run(reference, this_rank(q), this_rank(k), this_rank(v), None,
                                         this_rank(weights))[0] - this_rank(full[0])).abs().max().item()

parallel_state.destroy_model_parallel()
parallel_state.initialize_model_parallel(2, 1)
tensor_parallel.model_parallel_cuda_manual_seed(1234)  # the tracker: each tensor-parallel rank its own stream
tp_config = TransformerConfig(num_layers=1, hidden_size=heads * d, num_attention_heads=heads, attention_dropout=0.5,
                              tensor_model_parallel_size=2, use_cpu_initialization=True)
tp_q, tp_k, tp_v = (torch.randn(s, b, heads // 2, d, generator=torch.Generator().manual_seed(i)) for i in range(3))
for name, core in (("sdpa", model.SDPAttention), ("local", DotProductAttention)):
    module = core(tp_config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    for mode in ("train", "eval"):
        getattr(module, mode)()
        torch.manual_seed(0)  # the default generator alike on both ranks, as train.py seeds it
        with torch.no_grad():
            out = module(tp_q, tp_k, tp_v, None)
        both = [torch.empty_like(out) for _ in range(2)]
        torch.distributed.all_gather(both, out, group=parallel_state.get_tensor_model_parallel_group())
        result[f"tp_{name}_{mode}_rank_difference"] = (both[0] - both[1]).abs().max().item()

gathered = [None, None]
torch.distributed.all_gather_object(gathered, {"rank": torch.distributed.get_rank(), **result})
if torch.distributed.get_rank() == 0:  # one writer: two ranks' lines would interleave
    print("\n".join(json.dumps(r) for r in gathered), flush=True)
parallel_state.destroy_model_parallel()
torch.distributed.destroy_process_group()
