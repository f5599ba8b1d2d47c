"""device.py's shim is megatron-core's for the length of a run, and nothing of it stays: importing the project, and a
run that returned, leave torch as it was (each checked in a fresh interpreter without CUDA)."""

import os
import subprocess
import sys
import textwrap

from conftest import ROOT, TINY

# What plain torch does on a machine without CUDA, asserted after whatever the script did before it.
PLAIN_TORCH = """
import torch

x = torch.ones(3, requires_grad=True)
try:
    (x * 2).backward()
    raise SystemExit("a non-scalar backward without a gradient ran: " + repr(x.grad))
except RuntimeError as e:
    assert "grad can be implicitly created only for scalar outputs" in str(e), e
assert torch.ones(1).type() == "torch.FloatTensor", torch.ones(1).type()
try:
    torch.zeros(1, device="cuda")
    raise SystemExit("device='cuda' landed somewhere")
except (RuntimeError, AssertionError) as e:  # torch: "Torch not compiled with CUDA" / "no NVIDIA driver"
    pass
g = torch.get_rng_state()
try:
    torch.cuda.manual_seed(123)  # torch's: lazy, for a CUDA generator; it must not move the CPU's
except RuntimeError:
    pass
assert torch.equal(torch.get_rng_state(), g), "torch.cuda.manual_seed moved the CPU generator"
"""


def _python(script, plain_after=False, timeout=240):
    """Run `script` (dedented) in a fresh interpreter without CUDA, then, `plain_after`, the PLAIN_TORCH checks."""
    script = textwrap.dedent(script) + (PLAIN_TORCH if plain_after else "")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def test_importing_the_project_leaves_torch_as_it_was():
    _python("import train, model, generate, hf, peft, bench\n", plain_after=True)


def test_a_run_that_returned_leaves_torch_megatron_core_and_wandb_as_they_were(tmp_path):
    flags = [*TINY, "--mock-data", "--train-iters", "2", "--eval-iters", "0", "--num-workers", "0",
             "--save", str(tmp_path / "ckpt"), "--save-interval", "1", "--data-cache-path", str(tmp_path / "cache")]
    flags = [f for f in flags if f != "--no-save"]
    _python(f"""
        import checks, config, train
        from megatron.core.dist_checkpointing.strategies import filesystem_async
        from megatron.core.transformer import attention
        queue, kernel = filesystem_async._results_queue, attention.flash_attn_with_kvcache
        train.pretrain(checks.parse_args({flags!r}, world_size=1, gpu=False))
        assert filesystem_async._results_queue is queue, filesystem_async._results_queue  # the save replaced it
        assert attention.flash_attn_with_kvcache is kernel
        import wandb, megatron.core.timers as timers
        assert timers.wandb is wandb, timers.wandb  # hidden during megatron-core's import, given back at wandb's
    """, plain_after=True)
    assert (tmp_path / "ckpt" / "iter_0000002").is_dir()


def test_inside_the_shim_backward_errors_are_torchs():
    _python("""
        import torch, device
        from torch.overrides import TorchFunctionMode
        with device.shim():
            assert torch.ones(1, device="cuda").type() == "torch.cuda.FloatTensor"  # what megatron-core checks
            x = torch.ones(3, requires_grad=True)
            for call, message in [(lambda: (x * 2).backward(), "only for scalar outputs"),
                                  (lambda: torch.autograd.backward([(x * 2).sum(), (x * 3).sum()], [torch.ones(())]),
                                   "got 2 tensors and 1 gradients")]:
                try:
                    call()
                    raise SystemExit("no error: " + message)
                except RuntimeError as e:
                    assert message in str(e), e
            (x * 2).sum().backward()
            assert x.grad.tolist() == [2.0, 2.0, 2.0]

            class Other(TorchFunctionMode):
                def __torch_function__(self, func, types, args=(), kwargs=None):
                    return func(*args, **(kwargs or {}))

            with Other():  # a mode of the user's, entered over the shim's: both apply
                assert torch.ones(1, device="cuda").type() == "torch.cuda.FloatTensor"
            assert torch.cuda.current_device() == 0  # an int, as torch's
        assert torch._C._len_torch_function_stack() == 0
    """)


def test_the_shim_answers_cuda_calls_without_putting_every_torch_call_through_python():
    """The CUDA calls megatron-core makes land on the CPU, with no TorchFunctionMode on the stack: through one, every
    op and every read of a tensor's attribute would pass through Python (docs/benchmarks.md: 6% of a small GPT's
    step). Outside the shim, torch's names are its own again."""
    _python("""
        import torch, device
        with device.shim():
            assert torch._C._len_torch_function_stack() == 0
            x = torch.ones(2, device="cuda")
            made = [x, torch.zeros(2, device=0), torch.empty_like(x, device=torch.device("cuda", 0)),
                    x.new_zeros(2, device="cuda:0"), x.to("cuda"), x.to(0, torch.float16), x.to(device="cuda"), x.cuda(),
                    torch.tensor([1.0], device="cuda", pin_memory=True)]
            assert [t.device.type for t in made] == ["cpu"] * len(made)
            assert (x.type(), x.to(0, torch.float16).type()) == ("torch.cuda.FloatTensor", "torch.cuda.HalfTensor")
        assert "to" not in vars(torch.Tensor) and torch.zeros is torch._C._VariableFunctions.zeros
    """, plain_after=True)


def test_megatron_cores_fused_kernels_run_as_written_whatever_the_import_order():
    """megatron-core imported before device.py decorates its kernels with the real torch.compile; in a run on a CPU
    they run as written all the same (no graph compiled), so the numbers do not depend on the import order."""
    _python("""
        import torch
        from megatron.core.fusions import fused_bias_gelu  # before device: jit_fuser is torch.compile
        import device
        from torch._dynamo.utils import counters
        x, b = torch.randn(8, 16), torch.randn(16)
        with device.shim():
            y = fused_bias_gelu.bias_gelu(b, x)
        assert not counters["stats"]["unique_graphs"], dict(counters["stats"])
        z = b + x  # bias_gelu as written (fused_bias_gelu.py:16-19)
        assert torch.equal(y, z * 0.5 * (1.0 + torch.tanh(0.79788456 * z * (1 + 0.044715 * z * z))))
    """)
