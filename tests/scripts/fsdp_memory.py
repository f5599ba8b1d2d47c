"""Run under torchrun: the bytes each rank holds per parameter under Megatron FSDP at the end of a step, for each
--data-parallel-sharding-strategy given (and torch FSDP2's, named fsdp2), measured from what is allocated (its buffers, the module's own weights and
the optimizer's state, each storage once) against metrics.bytes_per_parameter. One JSON line per strategy on rank 0:
measured and theoretical bytes per parameter, and what bounds the buffers' padding (buckets, widest row)."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import device  # noqa: E402

with device.shim():
    import checks
    import metrics
    import model as M
    from megatron.core import parallel_state, tensor_parallel

    torch.distributed.init_process_group("gloo")
    world = torch.distributed.get_world_size()
    for strategy in sys.argv[1:]:
        parallel_state.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        # "fsdp2": torch FSDP2 (--use-torch-fsdp2), else a Megatron FSDP strategy
        fsdp = ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"] if strategy == "fsdp2" else \
            ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy]
        cfg = checks.parse_args(["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
                                 "--seq-length", "64", "--micro-batch-size", "2", "--no-save", "--mock-data", *fsdp],
                                world_size=world, gpu=False)
        chunks = M.build_model(cfg, 300)
        n = sum(p.numel() for p in chunks[0].parameters())
        widest = max(p.shape[1:].numel() for p in chunks[0].parameters())
        model = M.wrap_model(cfg, chunks)
        optimizer = M.build_optimizer(cfg, model)
        tokens = torch.randint(0, 257, (2, 64))
        batch = dict(tokens=tokens, labels=tokens, position_ids=torch.arange(64).expand(2, 64),
                     loss_mask=torch.ones(2, 64))

        def step(_, chunk):
            return chunk(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]), \
                lambda out: (out.float().mean(), {})

        M.zero_grad(model, optimizer)
        M.get_forward_backward_func(model, optimizer)(
            forward_step_func=step, data_iterator=iter([batch]), model=model, num_microbatches=1, seq_length=64,
            micro_batch_size=2, decoder_seq_length=64, forward_only=False)
        optimizer.step()
        storages = {}

        def add(t):
            t = t.to_local() if hasattr(t, "to_local") else t
            if t is not None and t.numel():
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

        if strategy == "fsdp2":  # each parameter's local shard and its gradient's
            groups = []
            for p in model[0].parameters():
                add(p)
                add(p.grad)
        else:
            fsdp = model[0].module
            groups = fsdp.param_and_grad_buffer.parameter_groups
            for group in groups:
                for buffer in (group.model_weight_buffer, group.main_weight_buffer, group.main_grad_buffer):
                    if buffer is not None and buffer.data is not None:
                        add(buffer.data)
            for p in fsdp.raw_param.values():
                add(p.data)
        for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
            for state in inner.optimizer.state.values():
                for value in state.values():
                    if torch.is_tensor(value) and value.dim():
                        add(value)
        if torch.distributed.get_rank() == 0:
            print(json.dumps(dict(strategy=strategy, measured=sum(storages.values()) / n, widest=widest,
                                  theory=metrics.bytes_per_parameter(cfg)[0], buckets=len(groups), n=n,
                                  tensors=len(list(model[0].parameters())))), flush=True)
        del model, optimizer, chunks
        parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
