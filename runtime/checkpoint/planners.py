"""DCP planners that understand Slices (a tensor-parallel shard of a fused weight is several chunks)."""
from __future__ import annotations

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import _create_read_items, _create_write_items, create_read_items_for_chunk_list
from typing import Any

from .geometry import Slices

# -- DCP planners that understand Slices ----------------------------------------------------------

class _SavePlanner(DefaultSavePlanner):
    """DCP's default planner (duplicate chunks kept once, on the least loaded rank), with each
    Slices entry written as one chunk per piece at its global offsets."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, obj in self.state_dict.items():
            if isinstance(obj, Slices):
                for offsets, t in obj.pieces:
                    items.append(WriteItem(
                        index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets=offsets, sizes=t.size()),
                            properties=TensorProperties.create_from_tensor(t), size=obj.shape)))
            else:
                items += _create_write_items(fqn, obj)
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, Slices):
            return obj.piece(index.offset)
        return super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    """Each rank reads, for every Slices piece, the parts of the saved chunks that overlap it."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # not the default's: its _init_state_dict turns values it does not know (Slices) to None
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        requests = []
        for fqn, obj in self.state_dict.items():
            md = self.metadata.state_dict_metadata[fqn]
            if isinstance(obj, Slices):
                requests += create_read_items_for_chunk_list(fqn, md, obj.chunks())
            else:
                requests += _create_read_items(fqn, md, obj)
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, Slices):
            return obj.piece(index.offset)
        return super().lookup_tensor(index)
