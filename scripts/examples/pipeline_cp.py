"""Pipeline parallelism x context parallelism in your own model (docs/own_model.md), on CPU (gloo) or GPUs:

    torchrun --nproc_per_node 4 scripts/examples/pipeline_cp.py

A 2-D mesh ("pp", "cp") = (2, 2): ``torch.distributed.pipelining`` cuts a small decoder into two stages, one
per "pp" coordinate; inside each stage every SDPA call runs the ring over the stage's "cp" ranks
(``apply_context_parallel``). Each CP rank shards the batch *before* the schedule splits it into
microbatches (the schedule splits dim 0, the batch; the ring's shard is along dim 1, the sequence). The
loss and every gradient equal the same model's on one process, on the whole sequence.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import cp_dtensor

VOCAB, DIM, HEADS = 64, 32, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out, self.mlp = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x):  # x: [B, S, E] -- under CP, this rank's tokens
        b, s, e = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, e // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, S, D]: the ring under CP
        x = x + self.out(y.transpose(1, 2).reshape(b, s, e))
        return x + torch.tanh(self.mlp(x))


def build() -> nn.Sequential:
    torch.manual_seed(0)  # the same weights on every rank
    return nn.Sequential(nn.Embedding(VOCAB, DIM), Block(), Block(), Block(), Block(), nn.Linear(DIM, VOCAB))


def main(n_microbatches: int = 2, layout: str = "striped") -> dict[str, float]:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("pp", "cp"))
    pp_rank, cp_mesh = mesh.get_local_rank("pp"), mesh["cp"]
    model = build()
    torch.manual_seed(1)
    tokens = torch.randint(0, VOCAB, (4, 16 * cp_mesh.size()))  # [B, N], the same on every rank
    labels = torch.roll(tokens, -1, dims=1)
    n_tokens = labels.numel()

    # the reference: one process, the whole sequence; loss = mean cross entropy over every token
    want = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), reduction="sum") / n_tokens
    want.backward()

    # stage pp_rank of 2: the embedding and two blocks, or two blocks and the head
    layers = list(copy.deepcopy(model).children())
    stage_module = nn.Sequential(*(layers[:3] if pp_rank == 0 else layers[3:]))
    stage_module = cp_dtensor.apply_context_parallel(stage_module, cp_mesh, layout=layout)
    stage = PipelineStage(stage_module, pp_rank, 2, torch.device("cpu"), group=mesh.get_group("pp"))

    def loss_fn(logits, target):  # this CP rank's tokens of one microbatch, over the global count
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum") / n_tokens

    schedule = ScheduleGPipe(stage, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    # shard the sequence (dim 1) first; the schedule then splits the batch (dim 0) into microbatches
    tok, lab = cp_dtensor.shard_batch((tokens, labels), cp_mesh, layout=layout)  # [B, N / P] each
    losses: list[torch.Tensor] = []
    if pp_rank == 0:
        schedule.step(tok)
    else:
        schedule.step(target=lab, losses=losses)
    cp_dtensor.reduce_gradients(stage_module, cp_mesh)  # each CP rank's gradient is its tokens' share

    reference = dict(zip(["0", "1", "2", "3", "4", "5"], model.children(), strict=True))
    offset = 0 if pp_rank == 0 else 3
    worst = 0.0
    for name, p in stage_module.named_parameters():
        index, rest = name.split(".", 1)
        ref = reference[str(int(index) + offset)].get_parameter(rest).grad
        torch.testing.assert_close(p.grad, ref, rtol=1e-4, atol=1e-6)
        worst = max(worst, float((p.grad - ref).abs().max()))
    loss = torch.stack(losses).sum().detach() if losses else torch.zeros(())
    dist.all_reduce(loss, group=mesh.get_group("cp"))  # the last stage's loss: the sum over its CP ranks
    if pp_rank == 1:
        torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
    return {"loss": float(loss), "want": float(want), "worst_grad_diff": worst}


if __name__ == "__main__":
    result = main()
    if dist.get_rank() == dist.get_world_size() - 1:
        print(f"PP=2 x CP={dist.get_world_size() // 2}: loss {result['loss']:.6f} (one process: {result['want']:.6f}); "
              f"gradients within {result['worst_grad_diff']:.1e} of one process's")
    dist.destroy_process_group()
