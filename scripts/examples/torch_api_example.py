"""torch's context-parallel API on cp_dtensor's ring (docs/torch_api.md), on CPU (gloo) or GPUs (NCCL):

    torchrun --nproc_per_node 2 scripts/examples/torch_api_example.py

1. torch's tutorial, unchanged but for the import: SDPA on shards of q, k, v inside the context, the output
   and the gradients unsharded after it, checked against SDPA on the full tensors.
2. What torch's API cannot run: packed documents (position ids restarting at 0) and a sliding window.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from cp_dtensor import context_parallel, context_parallel_unshard


def tutorial(mesh, device: str) -> None:
    torch.manual_seed(0)  # the same q, k, v on every rank
    bs, heads, seq_len, dim = 2, 4, 64 * mesh.size(), 32
    qkv = [torch.rand(bs, heads, seq_len, dim, device=device, requires_grad=True) for _ in range(3)]
    out = F.scaled_dot_product_attention(*qkv, is_causal=True)
    out.sum().backward()

    cp_qkv = [t.detach().clone() for t in qkv]
    with context_parallel(mesh, buffers=cp_qkv, buffer_seq_dims=[2, 2, 2]):
        for t in cp_qkv:
            t.requires_grad = True
        cp_out = F.scaled_dot_product_attention(*cp_qkv, is_causal=True)
        cp_out.sum().backward()
        for t in cp_qkv:
            t.requires_grad = False

    (cp_out,) = context_parallel_unshard(mesh, [cp_out], [2])
    cp_grads = context_parallel_unshard(mesh, [t.grad for t in cp_qkv], [2, 2, 2])
    torch.testing.assert_close(cp_out, out.detach(), atol=1e-5, rtol=1e-5)
    for got, t in zip(cp_grads, qkv):
        torch.testing.assert_close(got, t.grad, atol=1e-5, rtol=1e-5)


def packed_documents(mesh, device: str) -> None:
    torch.manual_seed(1)
    seq_len = 64 * mesh.size()
    positions = torch.cat([torch.arange(n) for n in (20, 12, seq_len - 32)]).to(device)[None]  # three documents
    q, k, v = (torch.rand(1, 4, seq_len, 32, device=device) for _ in range(3))
    doc = torch.cumsum(positions == 0, -1)  # [1, N]: the document of each token
    i = torch.arange(seq_len, device=device)
    keep = (doc[0, :, None] == doc[0, None, :]) & (i[None] <= i[:, None]) & (i[None] > i[:, None] - 16)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)  # the dense-mask reference

    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2], no_restore_buffers={q, k, v},
                          position_ids=positions, window_size=(15, 0), layout="headtail"):
        cp_out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # causal, documents, last 16 tokens
    (cp_out,) = context_parallel_unshard(mesh, [cp_out], [2], layout="headtail")
    torch.testing.assert_close(cp_out, out, atol=1e-5, rtol=1e-5)


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    mesh = init_device_mesh(device, (dist.get_world_size(),), mesh_dim_names=("cp",))
    tutorial(mesh, device)
    packed_documents(mesh, device)
    if dist.get_rank() == 0:
        print(f"torch_api_example: CP={mesh.size()} on {device}: outputs and gradients equal SDPA on the full tensors")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
