"""The resolved layout (ParallelDims) is built once and answers what the layers below ask."""
import torch.distributed as dist

from lmforge.config import ParallelConfig
from lmforge.parallel.mesh import ParallelDims, build_parallel_dims


def test_one_plain_process_has_no_mesh_no_groups_and_no_fsdp():
    dims = ParallelDims()
    assert (dims.dp, dims.mesh, dims.group("pp"), dims.uses_fsdp) == (1, None, None, False)


def test_one_process_mesh_is_fsdp_and_dims_come_from_the_resolved_layout(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        dims = build_parallel_dims(ParallelConfig(dp_shard=-1), 1, "cpu")
        assert (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp) == (1, 1, 1, 1)
        assert dims.uses_fsdp  # the distributed path on one device
        assert dims.mesh["dp"].size() == 1 and dims.group("pp") is not None
    finally:
        dist.destroy_process_group()
