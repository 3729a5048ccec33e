"""Weight init is the same logical function at every TP degree (single process, no comms)."""

import torch

from mpcore.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding


def test_column_shards_concatenate_to_tp1_weight():
    full = ColumnParallelLinear(10, 12, partition_sizes=[8, 4])
    full.reset_parameters(seed=7)
    for tp in (2, 4):
        parts = []
        for rank in range(tp):
            layer = ColumnParallelLinear(10, 12, partition_sizes=[8, 4])
            layer.tp, layer.tp_rank = tp, rank
            layer.weight = torch.nn.Parameter(torch.empty(12 // tp, 10))
            layer.reset_parameters(seed=7)
            parts.append(layer.weight.detach())
        q = torch.cat([p[: 8 // tp] for p in parts])
        k = torch.cat([p[8 // tp:] for p in parts])
        assert torch.equal(torch.cat([q, k]), full.weight.detach())


def test_row_and_embedding_shards_concatenate():
    row = RowParallelLinear(8, 6)
    row.reset_parameters(seed=3)
    emb = VocabParallelEmbedding(10, 4)
    emb.reset_parameters(seed=5)
    for tp in (2, 4):
        rparts, eparts = [], []
        for rank in range(tp):
            r = RowParallelLinear(8, 6)
            r.tp, r.tp_rank = tp, rank
            r.weight = torch.nn.Parameter(torch.empty(6, 8 // tp))
            r.reset_parameters(seed=3)
            rparts.append(r.weight.detach())
            e = VocabParallelEmbedding(10, 4)
            e.tp, e.tp_rank = tp, rank
            e.padded_vocab = -(-10 // tp) * tp
            e.local_vocab = e.padded_vocab // tp
            e.weight = torch.nn.Parameter(torch.empty(e.local_vocab, 4))
            e.reset_parameters(seed=5)
            eparts.append(e.weight.detach())
        assert torch.equal(torch.cat(rparts, dim=1), row.weight.detach())
        assert torch.equal(torch.cat(eparts)[:10], emb.weight.detach())
        assert torch.count_nonzero(torch.cat(eparts)[10:]) == 0
