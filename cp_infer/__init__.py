"""cp_infer: the context-parallel engine (parallel state, collectives, shard plans, Ulysses and ring attention).

It knows nothing about HTTP or any particular model; models plug in through the interfaces defined here.
"""

from .attention import ExchangeWorkspace, local_attention, padded_heads, ulysses_attention
from .collectives import all_reduce_max_int, all_to_all, broadcast_object, gather_passes, gather_sequence, warmup
from .mesh import MeshLayout, auto_ring, pass_shares, valid_layouts
from .ring import RingGroup
from .shapes import LatentShape, VideoGeometry
from .shard import ShardPlan
from .state import ParallelConfig, ParallelState, destroy_parallel, init_parallel, single_process_state

__all__ = [
    "ExchangeWorkspace",
    "LatentShape",
    "MeshLayout",
    "ParallelConfig",
    "ParallelState",
    "RingGroup",
    "ShardPlan",
    "VideoGeometry",
    "all_reduce_max_int",
    "all_to_all",
    "auto_ring",
    "broadcast_object",
    "destroy_parallel",
    "gather_passes",
    "gather_sequence",
    "init_parallel",
    "local_attention",
    "padded_heads",
    "pass_shares",
    "single_process_state",
    "ulysses_attention",
    "valid_layouts",
    "warmup",
]
