"""Dynamic CP in your own training loop (docs/documents.md, "Dynamic CP"), on CPU (gloo) or GPUs:

    torchrun --nproc_per_node 4 scripts/examples/dynamic_cp.py   # dp 2 x cp 2
    torchrun --nproc_per_node 2 scripts/examples/dynamic_cp.py   # 2 data-parallel ranks, each its own rows

Every dp rank loads its own packed rows, and the rows of one rank hold much longer documents than the
other's. ``shard_batch(..., dynamic=True)`` plans the global batch over every rank: the long documents are
cut over several ranks, the short ones stay whole, every rank gets the same number of tokens. The loss is
each rank's summed loss over the global count of valid tokens, the gradients are summed over the grid once;
the script checks the loss and every gradient against the same model on one process, on the global batch.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import cp_dtensor
from cp_dtensor.core.dynamic import plan_report


class Model(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4):
        super().__init__()
        self.heads, self.embed, self.head = heads, nn.Embedding(vocab, dim), nn.Linear(dim, vocab)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, tokens, positions, mask=None):  # tokens, positions: [B, S] -- under CP, this rank's
        x = self.embed(tokens) + torch.sin(positions[..., None].float() / 8)  # the original positions
        b, s, e = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, e // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.head(x + self.out(y.transpose(1, 2).reshape(b, s, e)))


def rows(lengths):  # packed documents -> positions restarting at 0 for each
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])


dist.init_process_group("gloo")
world, rank = dist.get_world_size(), dist.get_rank()
cp = 2 if world % 2 == 0 and world >= 4 else 1
mesh = init_device_mesh("cpu", (world // cp, cp), mesh_dim_names=("dp", "cp"))
torch.manual_seed(0)  # the same model, and the same global batch (for the check), on every rank
model = Model()
dp, N = world // cp, 32
lengths = [[[32], [20, 12]] if d % 2 == 0 else [[3, 5, 8, 16], [2, 6, 4, 20]] for d in range(dp)]
positions = torch.cat([rows(r) for r in lengths])  # [dp * 2, N]: the global batch's rows, dp rank by dp rank
tokens, labels = torch.randint(0, 64, (2 * dp, N)), torch.randint(0, 64, (2 * dp, N))
d = rank // cp  # this rank's dp rank: it loads rows 2d, 2d + 1 (the same on its cp ranks)
mine = slice(2 * d, 2 * d + 2)

dyn = cp_dtensor.shard_batch((tokens[mine], labels[mine], positions[mine]), mesh, layout="documents",
                             dynamic=True, position_ids=positions[mine])
(tok, lab, pos), plan, grid = dyn  # this rank's tokens [1, 2 * N / cp], the plan, the flattened dp x cp mesh
cp_model = cp_dtensor.apply_context_parallel(copy.deepcopy(model), grid, layout="documents", documents="position_ids")
logits = cp_model(tok, positions=pos, cp_layout=plan)  # every attention call uses the plan
loss = F.cross_entropy(logits.flatten(0, 1), lab.flatten(), reduction="sum") / dyn.valid_tokens(lab)
loss.backward()
cp_dtensor.reduce_gradients(cp_model, grid)  # once, over the whole dp x cp grid (FSDP over dp x cp does it)
report = plan_report(plan)  # work max/mean, K/V rows the busiest rank receives, tokens a rank
if rank == 0:
    print(f"dynamic plan over {world} ranks: work max/mean {report['work']:.3f}, {report['tokens']} tokens a rank")

# the check: the same model on one process, on the global batch, with the dense block-causal mask
ids = (positions == 0).cumsum(-1)
i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
want = F.cross_entropy(model(tokens, positions, (ids[:, None, :, None] == ids[:, None, None, :]) & (j <= i))
                       .flatten(0, 1), labels.flatten(), reduction="sum") / labels.numel()
want.backward()
total = loss.detach().clone()
dist.all_reduce(total)
torch.testing.assert_close(total, want.detach(), rtol=2e-5, atol=0)
for p, q in zip(cp_model.parameters(), model.parameters()):
    torch.testing.assert_close(p.grad, q.grad, rtol=2e-5, atol=2e-6)
dist.destroy_process_group()
