"""Fetch hints end to end (issue 36, phase 2): a real redis-server, two CPU workers (tiny Llama) and
a router on loopback. Worker A holds a long prompt's prefix and is busy; the router sends the next
request of that prompt to idle worker B with a hint to fetch the prefix from A, since fetching it
(at the rate B publishes) beats computing it. B's metrics show the fetch, A's that it served it,
the router's that it hinted; the tokens equal A's run of the same prompt without any transfer.
With --kv-fetch-hints off no hint goes out and nothing moves."""
from __future__ import annotations

import random
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc
from tests.test_router import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

BLOCK, PREFIX_BLOCKS = 16, 60
# Two sequences at a time, so that A's busy requests queue: their prompts are prefill A has yet to do.
FLAGS = dict(num_kv_blocks=512, block_size=BLOCK, max_model_len=1024, max_num_seqs=2, snapshot_interval=1.0,
             heartbeat_interval=0.25, metrics=True)
# What keeps A loaded while the request is routed: 2 long decodes run, 20 long prompts wait behind them.
# The router drains a reported queue at the prefill rate until the next report (a heartbeat): 20k
# tokens stay queued in its view for longer than that.
RUN, WAIT = 2, 20
STEP_DELAY_S = 0.004       # A's least step time: its 900-token decodes take 3.6 s at least


def prompt(seed: int) -> list[int]:
    """A 960-token prefix (60 blocks) and a short question after it."""
    rng = random.Random(seed)
    return [rng.randrange(5, 600) for _ in range(PREFIX_BLOCKS * BLOCK + 9)]


def generate(address: str, ids: list[int], max_tokens: int = 16) -> pb.GenerateResponse:
    req = pb.GenerateRequest(token_ids=ids, sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens))
    tokens: list[int] = []
    with grpc.insecure_channel(address) as ch:
        for r in pb_grpc.GenerationStub(ch).Generate(req, timeout=120):
            tokens += r.token_ids
            final = r
    final.token_ids[:] = tokens
    return final


def worker_metrics(w) -> dict[tuple[str, str], float]:
    """(sample name, role) -> value, for the kv_transfer series."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{w.metrics_port}/metrics", timeout=5).read().decode()
    return {(s.name, s.labels.get("role", "")): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if "kv_transfer" in s.name}


class Busy:
    """BUSY long requests sent to a worker directly (not through the router), until stopped."""

    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address)
        stub = pb_grpc.GenerationStub(self.channel)
        self.calls, self.threads = [], []

        def send(ids: list[int], max_tokens: int) -> None:
            call = stub.Generate(pb.GenerateRequest(token_ids=ids, sampling=pb.SamplingParams(
                max_tokens=max_tokens, ignore_eos=True, temperature=0.0)), timeout=300)
            self.calls.append(call)
            self.threads.append(threading.Thread(target=self._drain, args=(call,), daemon=True))
            self.threads[-1].start()

        for i in range(RUN):
            send([7 + i] * 16, 900)
        wait_for(lambda: load(address).running == RUN, 30, "A to run its long decodes")
        for i in range(WAIT):
            send(prompt(100 + i)[:1000], 8)

    @staticmethod
    def _drain(call) -> None:
        try:
            for _ in call:
                pass
        except grpc.RpcError:
            pass

    def stop(self) -> None:
        for c in self.calls:
            c.cancel()
        for t in self.threads:
            t.join(10)
        self.channel.close()


def labelled(proc, name: str) -> float:
    """A router metric summed over its labels (the model's name is the checkpoint's)."""
    return sum(v for k, v in proc.metrics().items() if k.startswith(name + "{"))


def load(address: str) -> pb.LoadReport:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.AdminStub(ch).GetLoad(pb.LoadRequest(), timeout=10)


@pytest.fixture(scope="module")
def cluster(tiny_model, redis_server_module, start_worker_module):
    url = redis_server_module.url
    # A's steps take at least STEP_DELAY_S, so that its 2 long decodes outlast the test's waits
    # however fast a decode step of this tiny model becomes (the C decode step made them 2x faster).
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(lambda w: start_worker_module(
            tiny_model, redis_url=url, worker_id=w, timeout=240, **FLAGS,
            env={"PAGODA_TEST_STEP_DELAY_S": str(STEP_DELAY_S)} if w == "wa" else None), ("wa", "wb"))
    return dict(redis=redis_server_module, a=a, b=b)


def route_while_a_is_busy(cluster, start_router, ids: list[int], **flags):
    """Warm A with `ids` directly (the run without transfer), load A, then send `ids` through a
    router. -> (A's response, the router's, the router)."""
    a = cluster["a"]
    plain = generate(a.address, ids)
    router = start_router(cluster["redis"].url, **flags)
    wait_for(lambda: labelled(router, "pagoda_router_live_workers") == 2, 15, "the router to see both workers")
    time.sleep(2.5)                         # two snapshot periods: the router holds A's blocks of `ids`
    busy = Busy(a.address)
    try:
        wait_for(lambda: load(a.address).waiting == WAIT, 30, "A's busy requests to queue")
        # Four heartbeats: the router has A's load (one, 0.3 s, was too little once in CI: routed to A).
        # A stays loaded meanwhile: its 2 decodes of 900 tokens and 20 queued prompts take far longer.
        time.sleep(1.0)
        routed = generate(router.address, ids)
    finally:
        busy.stop()
    return plain, routed, router


def test_a_busy_holders_prefix_is_fetched_by_the_worker_the_router_picks(cluster, start_router):
    a, b = cluster["a"], cluster["b"]
    before_a, before_b = worker_metrics(a), worker_metrics(b)
    ids = prompt(1)
    plain, routed, router = route_while_a_is_busy(cluster, start_router, ids)
    assert routed.worker_id == "wb"
    assert list(routed.token_ids) == list(plain.token_ids) and len(plain.token_ids) == 16
    # B fetched the 60-block prefix from A and counts it as cached; A computed it (no cache before).
    assert plain.usage.cached_prompt_tokens == 0
    assert routed.usage.cached_prompt_tokens == PREFIX_BLOCKS * BLOCK
    assert labelled(router, "pagoda_router_kv_fetch_hints_total") == 1
    after_a, after_b = worker_metrics(a), worker_metrics(b)
    moved = PREFIX_BLOCKS * BLOCK * 2 * 2 * 2 * 16 * 4      # K and V, 2 layers, 2 KV heads, head dim 16, fp32
    for side, before, after in (("fetcher", before_b, after_b), ("source", before_a, after_a)):
        grew = {k[0]: after[k] - before.get(k, 0.0) for k in after if k[1] == side}
        assert grew["pagoda:kv_transfer_blocks_total"] == PREFIX_BLOCKS, side
        assert grew["pagoda:kv_transfer_bytes_total"] == moved, side
        assert grew["pagoda:kv_transfer_seconds_count"] == 1 and grew["pagoda:kv_transfer_seconds_sum"] > 0, side
    assert not any(k[0] == "pagoda:kv_transfer_failures_total" for k in after_b)
    router.terminate()


def test_with_hints_off_nothing_is_fetched(cluster, start_router):
    b = cluster["b"]
    before = worker_metrics(b)
    ids = prompt(2)
    plain, routed, router = route_while_a_is_busy(cluster, start_router, ids, kv_fetch_hints="off")
    assert list(routed.token_ids) == list(plain.token_ids)
    assert labelled(router, "pagoda_router_kv_fetch_hints_total") == 0
    assert worker_metrics(b) == before
    if routed.worker_id == "wb":
        assert routed.usage.cached_prompt_tokens == 0       # it computed the prefix
    router.terminate()
