"""Shards of layout-free tensors, and the DCP planners that save and load exactly those slices.

A :class:`Shard` says: this rank holds ``local``, the block of the global (canonical) tensor that
starts at ``offsets``. Tensor parallelism cuts q/k/v, gate/up and the vocabulary into row blocks;
replicated tensors are one block covering everything; kv heads replicated over several tp ranks
are the same block on each of them (DCP's plan deduplication writes it once). The planners turn
shards into DCP write/read items, so a checkpoint written under one layout loads under any other:
each rank reads only the rows it needs, from whichever files hold them.

We use DCP's public planner interface rather than DTensor placements because our shards are not
all expressible as placements over one mesh (GQA kv heads replicated within tp, vocabularies
padded to a multiple of tp whose padding must never reach the checkpoint).
"""

from __future__ import annotations

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from mpformer.core.shards import Shard, stored_name


def _chunk(sh: Shard) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(sh.offsets), sizes=sh.local.shape)


def _by_index(shards: dict[str, Shard]) -> dict[tuple[str, tuple[int, ...]], Shard]:
    return {(stored_name(k, sh), tuple(sh.offsets)): sh for k, sh in shards.items()}


class ShardSavePlanner(DefaultSavePlanner):
    """Write each shard as a chunk of its global tensor (identical chunks on several ranks are
    written once: DefaultSavePlanner deduplicates by (name, offsets))."""

    def __init__(self, shards: dict[str, Shard]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.shards = shards
        self.index = _by_index(shards)

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, sh in self.shards.items():
            if sh.local.numel() == 0:
                continue  # a rank whose vocabulary block is all padding holds nothing to save
            items.append(WriteItem(
                index=MetadataIndex(stored_name(key, sh), torch.Size(sh.offsets)), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=_chunk(sh), properties=TensorProperties.create_from_tensor(sh.local),
                                            size=torch.Size(sh.global_shape))))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self.index[(write_item.index.fqn, tuple(write_item.index.offset))].local.detach()


class ShardLoadPlanner(DefaultLoadPlanner):
    """Read, for each shard, exactly its block of the stored global tensor, straight into ``local``
    (DCP copies into the view we return, casting dtypes when the stored dtype differs)."""

    def __init__(self, shards: dict[str, Shard]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.shards = shards
        self.index = _by_index(shards)

    def create_local_plan(self) -> LoadPlan:
        requests: list[ReadItem] = []
        for key, sh in self.shards.items():
            if sh.local.numel() == 0:
                continue
            fqn = stored_name(key, sh)
            requests += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], [_chunk(sh)])
        return LoadPlan(requests)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        # detach: single-device canonical tensors are autograd views (split of a fused weight), and
        # autograd forbids narrowing such a view again after an in-place copy into it.
        local = self.index[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))].local.detach()
        return narrow_tensor_by_index(local, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # the data went straight into the shard's view
