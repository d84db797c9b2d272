"""KV that moves, end to end: real worker processes on loopback (CPU, tiny Llama). Worker A serves a
prompt; worker B serves it with a fetch hint naming A: B reports the fetched blocks as cached prompt
tokens, and its greedy tokens equal the run without transfer, which equal transformers'. A wrong
key is refused; a source that dies, a truncated stream and a block whose bytes do not match fall
back to recompute with the same tokens; no block leaks on either worker. Requests go as a router
sends them (its admin key, acting for tenant acme): a tenant's own key may not set a hint."""
import random
import time

import grpc
import pytest

from pagoda.gpu_worker.serving.kv_transfer import FAULT_ENV, PACK_BYTES, WRITE_BYTES
from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc
from pagoda.runtime.security import TENANT_HEADER

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BLOCK, BLOCKS = 16, 64
FLAGS = dict(num_kv_blocks=BLOCKS, block_size=BLOCK, max_model_len=512)
ADMIN, TENANT, WRONG = "admin-key-0123", "tenant-key-4567", "not-a-key-89ab"
PROMPT = [random.Random(7).randrange(5, 600) for _ in range(100)]     # 6 full blocks before the last token
FETCHABLE = (len(PROMPT) - 1) // BLOCK * BLOCK                            # 96 tokens


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("kv-keys")
    (d / "keys").write_text(f"{ADMIN} ops admin\n{TENANT} acme\n")
    (d / "peer").write_text(ADMIN + "\n")
    (d / "wrong").write_text(WRONG + "\n")
    return d


def start(start_worker, model, keys, peer="peer", **extra):
    return start_worker(model, api_keys_file=str(keys / "keys"), kv_peer_api_key_file=str(keys / peer),
                        **FLAGS, **extra)


def generate(address, key=ADMIN, tenant="acme", source=None, prompt=PROMPT, max_tokens=12, credentials=None):
    """As a router sends a request: its admin key, acting for `tenant` (None: the key's own identity)."""
    req = pb.GenerateRequest(token_ids=prompt, sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens))
    if source is not None:
        req.kv_fetch.CopyFrom(pb.KVFetchHint(source_address=source, num_blocks=len(prompt) // BLOCK))
    tokens, usage = [], None
    metadata = [("authorization", f"Bearer {key}")] + ([(TENANT_HEADER, tenant.encode())] if tenant else [])
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with channel as ch:
        for r in pb_grpc.GenerationStub(ch).Generate(req, metadata=metadata, timeout=60):
            tokens += r.token_ids
            if r.finished:
                usage = r.usage
    return tokens, usage


def wait_all_free(address, timeout=10.0):
    """Every block free (or cached and idle) once requests have ended: nothing leaked."""
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.AdminStub(ch)
        deadline = time.monotonic() + timeout
        while True:
            load = stub.GetLoad(pb.LoadRequest(), metadata=[("authorization", f"Bearer {ADMIN}")])
            if load.free_blocks == load.num_blocks or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert (load.free_blocks, load.running, load.waiting) == (load.num_blocks, 0, 0)


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Transformers' greedy continuation of PROMPT (tests/test_parity.py's way)."""
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    return out[0, len(PROMPT):].tolist()


@pytest.fixture(scope="module")
def source(start_worker_module, tiny_model, keys):
    a = start(start_worker_module, tiny_model, keys)
    generate(a.address)             # PROMPT's blocks now cached on A, in tenant acme's namespace
    return a


def test_fetched_blocks_are_cache_hits_with_the_same_tokens(start_worker, tiny_model, keys, source, reference):
    b = start(start_worker, tiny_model, keys)
    # B holds the first two blocks already (a prompt that shares them): it fetches only the other four.
    _, usage = generate(b.address, prompt=PROMPT[:2 * BLOCK] + [7] * 20)
    assert usage.cached_prompt_tokens == 0
    got, usage = generate(b.address, source=source.address)
    assert usage.cached_prompt_tokens == FETCHABLE
    assert "4 of 4 blocks" in b.log()
    plain, plain_usage = generate(start(start_worker, tiny_model, keys).address)    # no transfer anywhere
    assert plain_usage.cached_prompt_tokens == 0
    assert got == plain == reference
    # The fetched blocks stay named: the next request hits B's own cache, no hint needed.
    again, usage = generate(b.address)
    assert again == reference and usage.cached_prompt_tokens == FETCHABLE
    wait_all_free(b.address)
    wait_all_free(source.address)


def test_another_tenants_namespace_fetches_nothing(start_worker, tiny_model, keys, source, reference):
    """B acting as the admin (no tenant salt) asks for other hashes than acme's: A holds none."""
    b = start(start_worker, tiny_model, keys)
    got, usage = generate(b.address, tenant=None, source=source.address)
    assert usage.cached_prompt_tokens == 0 and got == reference
    wait_all_free(b.address)


def test_a_wrong_key_is_refused_and_the_request_recomputes(start_worker, tiny_model, keys, source, reference):
    b = start(start_worker, tiny_model, keys, peer="wrong")
    got, usage = generate(b.address, source=source.address)
    assert usage.cached_prompt_tokens == 0 and got == reference
    assert "UNAUTHENTICATED" in b.log()
    # A tenant may not name a source itself: the fetch would send B's peer key wherever it points.
    with pytest.raises(grpc.RpcError) as e:
        generate(b.address, key=TENANT, tenant=None, source="127.0.0.1:9")
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "kv_fetch" in e.value.details()
    wait_all_free(b.address)
    with grpc.insecure_channel(source.address) as ch:
        stub = pb_grpc.AdminStub(ch)
        req = pb.FetchKVBlocksRequest(block_hashes=[b"\0" * 16])
        for key, code in ((TENANT, grpc.StatusCode.PERMISSION_DENIED), (WRONG, grpc.StatusCode.UNAUTHENTICATED)):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.FetchKVBlocks(req, metadata=[("authorization", f"Bearer {key}")], timeout=10))
            assert e.value.code() == code


@pytest.mark.parametrize("fault", ["corrupt", "truncate", "die"])
def test_a_broken_transfer_falls_back_to_recompute(start_worker, tiny_model, keys, reference, fault):
    """The source spoils block 3 of 6. A corrupt block or a broken call drops the window being
    received (blocks are written WRITE_BYTES at a time, and the six travel in one pack), so B keeps
    none; a stream that simply ends keeps the three blocks that arrived whole and verified. B
    recomputes the rest and gets the same tokens."""
    assert min(WRITE_BYTES, PACK_BYTES) >= 6 * (8 << 10)     # the tiny Llama's blocks are 8 KiB
    a = start(start_worker, tiny_model, keys, env={FAULT_ENV: f"{fault}:3"})
    generate(a.address)
    b = start(start_worker, tiny_model, keys)
    got, usage = generate(b.address, source=a.address)
    kept = 3 if fault == "truncate" else 0
    assert usage.cached_prompt_tokens == kept * BLOCK and got == reference
    assert f"recomputing from block {kept}" in b.log()
    wait_all_free(b.address)
    if fault == "die":
        assert a.proc.wait(10) == 17
    else:
        wait_all_free(a.address)


def test_workers_serving_tls_fetch_from_each_other_over_tls(start_worker, tiny_model, keys, test_certs, reference):
    """mTLS workers (one CA, as the chart's one Secret): B verifies A with its client CA and shows its
    own certificate; a plaintext fetch would fail and recompute (0 cached)."""
    c = test_certs
    tls = dict(tls_cert=c.server_cert, tls_key=c.server_key, tls_client_ca=c.ca)
    a, b = (start(start_worker, tiny_model, keys, **tls) for _ in range(2))
    creds = grpc.ssl_channel_credentials(*(open(p, "rb").read() for p in (c.ca, c.client_key, c.client_cert)))
    generate(a.address, credentials=creds)
    got, usage = generate(b.address, source=a.address, credentials=creds)
    assert usage.cached_prompt_tokens == FETCHABLE and got == reference
