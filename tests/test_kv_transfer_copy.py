"""The fetch path's pieces without a network (gpu_worker/serving/kv_transfer.py): blocks copied out
of a paged KV pool to bytes and into another pool (the runner's store layout: per layer K then V,
[blocks, heads, block, dim] views of [blocks, block, heads, dim] tensors), on CPU and, where there
is one, on CUDA (bench/gpu_check.sh); and the receiver's check of one message: a pack of several
blocks gives back exactly their bytes in chain order, a pack past PACK_BYTES is refused."""
import pytest
import torch

from pagoda.gpu_worker.serving.kv_transfer import (
    PACK_BYTES,
    FetchError,
    block_digest,
    blocks_within,
    export_blocks,
    import_blocks,
    unpack,
)
from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb

LAYERS, HEADS, BS, DIM, NB = 3, 2, 16, 8, 40


def pool(device: str, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2 * LAYERS):
        t = torch.randn(NB, BS, HEADS, DIM, generator=g).to(dtype).to(device)
        out.append(t.permute(0, 2, 1, 3))
    return out


def transfer(device: str, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    src, dst = pool(device, dtype, 0), pool(device, dtype, 1)
    data = export_blocks(src, [5, 0, 33, 7])
    import_blocks(dst, (10, 11, 2, 39), data)
    return src, dst, data


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_move_between_pools_exactly(dtype):
    before = pool("cpu", dtype, 1)
    src, dst, data = transfer("cpu", dtype)
    assert data.dtype == torch.uint8 and data.shape == (4, 2 * LAYERS * HEADS * BS * DIM * src[0].element_size())
    others = [i for i in range(NB) if i not in (10, 11, 2, 39)]
    for s, d, b in zip(src, dst, before):
        assert torch.equal(d[[10, 11, 2, 39]], s[[5, 0, 33, 7]])
        assert torch.equal(d[others], b[others])           # nothing else written
    assert export_blocks(src, []).numel() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bench/gpu_check.sh)")
def test_cuda_copy_path_matches_the_cpu_twin():
    cpu_src, cpu_dst, cpu_data = transfer("cpu", torch.bfloat16)
    src, dst, data = transfer("cuda", torch.bfloat16)
    assert data.device.type == "cpu" and torch.equal(data, cpu_data)
    for d, c in zip(dst, cpu_dst):
        assert torch.equal(d.cpu(), c)


def message(hashes: list[bytes], kvs: list[bytes]) -> pb.FetchKVBlocksResponse:
    return pb.FetchKVBlocksResponse(blocks=[pb.KVBlock(block_hash=h, kv=kv, digest=block_digest(h, kv))
                                            for h, kv in zip(hashes, kvs)])


def test_a_pack_gives_back_its_blocks_in_chain_order_and_an_oversized_one_is_refused():
    per_block = 64 << 10
    limit = blocks_within(PACK_BYTES, per_block)
    assert limit == 16
    want = [bytes([i]) * 16 for i in range(40)]
    kvs = [bytes([i]) * per_block for i in range(40)]
    # Two messages: 16 then 3 blocks, as the source packs them; each block's own bytes, in order.
    assert unpack(message(want[:16], kvs[:16]), want, 0, per_block) == kvs[:16]
    assert unpack(message(want[16:19], kvs[16:19]), want, 16, per_block) == kvs[16:19]
    # One block in the message's own fields (a source from before packs).
    single = pb.FetchKVBlocksResponse(block_hash=want[0], kv=kvs[0], digest=block_digest(want[0], kvs[0]))
    assert unpack(single, want, 0, per_block) == kvs[:1]
    with pytest.raises(FetchError) as e:
        unpack(message(want[:17], kvs[:17]), want, 0, per_block)
    assert e.value.reason == "pack" and "at most 16" in str(e.value)
    with pytest.raises(FetchError) as e:            # out of order inside a pack
        unpack(message([want[0], want[2]], [kvs[0], kvs[2]]), want, 0, per_block)
    assert e.value.reason == "chain" and "block 1" in str(e.value)
    bad = message(want[:2], kvs[:2])
    bad.blocks[1].kv = kvs[5]
    with pytest.raises(FetchError) as e:
        unpack(bad, want, 0, per_block)
    assert e.value.reason == "digest"
    # A block bigger than the bound still moves, one a message.
    assert unpack(message(want[:1], [b"x" * (2 * PACK_BYTES)]), want, 0, 2 * PACK_BYTES) == [b"x" * (2 * PACK_BYTES)]
