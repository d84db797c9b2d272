"""Runs one scheduled step on the device: flat batch in, one sampled token per sampling request out.

Owns the model, the tokenizer, the per-layer KV caches, the persistent input batch and the
sampler. A SchedulerOutput updates the batch's rows (only what changed); the batch flattens
the step into token ids, positions, slot mapping, block tables, seq lens and query_start_loc;
logits are computed only for rows that end a request's known tokens.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional, cast

import numpy as np
import torch

from pagoda.gpu_worker.core.config import EngineConfig
from pagoda.gpu_worker.core.host_tier import KVCopy
from pagoda.gpu_worker.core.outputs import Logprob, ModelRunnerOutput, NewRequest, ScheduledRequest, SchedulerOutput, TokenLogprobs
from pagoda.gpu_worker.features.lora import LoRAManager
from pagoda.gpu_worker.features.quantization import parse_quantization
from pagoda.gpu_worker.features.spec_decode import Verified, rejection_sample
from pagoda.gpu_worker.models.attention import AttentionMetadata, resolve_backend, select_backend
from pagoda.gpu_worker.models.llama import LlamaForCausalLM, use_fused_ops
from pagoda.gpu_worker.models.parallel import Shard
from pagoda.gpu_worker.models.registry import check_tensor_parallel
from pagoda.gpu_worker.runner import distributed
from pagoda.gpu_worker.runner.cuda_graphs import DecodeGraphs, capture_sizes
from pagoda.gpu_worker.runner.draft_model import DraftModel
from pagoda.gpu_worker.runner.input_batch import InputBatch, PromptScores, StepInputs
from pagoda.gpu_worker.runner.loader import load_hf_config, load_model, resolve_dtype, resolve_model
from pagoda.gpu_worker.runner.memory import cuda_graph_bytes, kv_budget_bytes, module_bytes, sampler_workspace_bytes
from pagoda.gpu_worker.runner.sampler import Sampled, Sampler, uniforms
from pagoda.gpu_worker.runner.warmup import WarmupStep, warmup_plan
from pagoda.kernels.fp8 import kv_cache_dtype
from pagoda.kernels.reference import new_kv_cache
from pagoda.runtime.tokenization import PromptTokenizer

log = logging.getLogger(__name__)


@dataclass
class InFlight:
    """A launched step: its sampling requests, their placeholders' positions, and the draw on
    its way."""
    req_ids: list[str]
    positions: np.ndarray
    sampled: Optional[Sampled]            # None: nothing in the step samples
    # Prompt tokens scored (prompt_logprobs): what they are, and their scores on the device,
    # float64 [P, 1 + 2k] (the token's own log-probability, k top values, k top ids).
    prompt: Optional[tuple[PromptScores, torch.Tensor, int]] = None
    # Speculating requests of the step (speculative decoding), already verified: their emitted
    # tokens and accepted drafts.
    spec_req_ids: Optional[list[str]] = None
    spec: Optional[Verified] = None
    # Requests whose own parameters or data made the draw raise (core/faults.py): no token.
    faults: dict[str, BaseException] = field(default_factory=dict)


def _runs(copies: list[KVCopy]):
    """The copies as (to_host, device ids, host ids) runs of one direction that each write a
    block at most once, in order: within a run the batched index copies are then exact."""
    run: tuple[bool, list[int], list[int]] | None = None
    written: set[int] = set()
    for c in copies:
        dst = c.host_block if c.to_host else c.device_block
        if run is None or run[0] != c.to_host or dst in written:
            if run is not None:
                yield run
            run, written = (c.to_host, [], []), set()
        run[1].append(c.device_block)
        run[2].append(c.host_block)
        written.add(dst)
    if run is not None:
        yield run


def load_tokenizer(model_path: str) -> PromptTokenizer:
    if not os.path.exists(os.path.join(model_path, "tokenizer.json")):
        raise ValueError(f"model: {model_path} has no tokenizer.json (the worker reads the tokenizer "
                         "from it, as the router does)")
    return PromptTokenizer.from_dir(model_path)


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0, hf_config=None):
        """rank > 0: a tensor-parallel rank's runner (pagoda.gpu_worker.runner.distributed.rank_main); it only
        runs the model, on the commands rank 0 sends (distributed.Command), with rank 0's hf_config."""
        self.config = config
        self.shard = Shard(rank, config.tensor_parallel_size)
        self.device = distributed.local_device(config.resolved_device(), rank, self.shard.size)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        # A hub id resolves to its snapshot in the HF cache (downloaded once, by rank 0 first).
        self.model_path = resolve_model(config.model, config.revision)
        self.hf_config = hf_config or load_hf_config(self.model_path)
        check_tensor_parallel(self.hf_config, self.shard.size, self.device.type)
        self.tp: distributed.TensorParallel | None = None
        if rank == 0 and self.shard.size > 1:
            # Started first: the other ranks start while this one reads the tokenizer.
            self.tp = distributed.TensorParallel(config, self.hf_config, ModelRunner)
            weakref.finalize(self, self.tp.close)
        if rank == 0:    # other ranks never tokenize
            # The worker process's one tokenizer: the engine detokenizes with it, the server
            # encodes prompts, serves its texts and compiles grammars with it.
            self.tokenizer: PromptTokenizer = load_tokenizer(self.model_path)
        self.vocab_size = int(self.hf_config.vocab_size)
        # Sliding windows are applied exactly by the attention layers: the limit is the model's.
        limit = int(self.hf_config.max_position_embeddings)
        if config.max_model_len is not None and not 0 < config.max_model_len <= limit:
            raise ValueError(f"max_model_len: must be in [1, {limit}] for this checkpoint "
                             f"(max_position_embeddings), got {config.max_model_len}")
        self.max_model_len = config.max_model_len or limit
        self.eos_token_ids = self._eos_token_ids() if rank == 0 else []
        self.block_size = config.block_size
        if self.tp is not None:
            self.tp.join_group()
        # Quantized weights: the flag and the checkpoint's quantization_config, checked together.
        self.quant = parse_quantization(config.quantization, self.hf_config)
        # Any: nn.Module's attribute typing cannot see the model's own methods.
        self.model: Any = cast(Any, load_model(self.model_path, self.hf_config, self.device, self.dtype,
                                               self.shard, model_impl=config.model_impl, quant=self.quant))
        self.weight_bytes = module_bytes(self.model)
        log.info("weights: %.3f GiB on %s%s", self.weight_bytes / 2**30, self.device,
                 f", {self.quant.describe()}" if self.quant is not None else "")
        self.write_fn, self.attend_fn = select_backend(config.attention_backend, self.device)
        self.backend = resolve_backend(config.attention_backend, self.device)
        use_fused_ops(self.model, self.backend)
        self.lora = self._lora_manager() if config.enable_lora else None
        attn = self.model.attention_layers()[0]
        self.num_layers = len(self.model.attention_layers())
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # The host tier's pool (allocate_host_cache) and the stream its copies run on (CUDA).
        self.host_pool: Optional[torch.Tensor] = None
        self.copy_stream: Any = None
        self.copy_chunk = 1
        # Cumulative, for the copy rate the worker reports: blocks copied and the time their copies
        # took (on CUDA timed by events on the copy stream, read once they have completed).
        self.copy_seconds, self.copied_blocks = 0.0, 0
        self._timed: list[tuple[Any, Any, int]] = []
        self.sampler = Sampler()
        self.last_draw: torch.Tensor | None = None     # token ids of the last launched step, on the device
        self.graphs: DecodeGraphs | None = None  # captured by warm_up on CUDA
        spec = config.speculative_config
        self.batch = InputBatch(config.max_num_seqs, self.max_model_len,
                                config.token_budget(self.max_model_len), self.block_size,
                                self.vocab_size, self.eos_token_ids, self.device,
                                spec.num_speculative_tokens if spec is not None else 0)
        if self.lora is not None:
            self.batch.lora_slot_for = self.lora.slot_for
        # Speculative decoding with a draft model: its KV pool shares the target's block ids.
        self.draft: DraftModel | None = None
        if spec is not None and spec.method == "draft_model":
            self.draft = DraftModel(spec.model, self.vocab_size, self.device, self.dtype, self.block_size,
                                    self.write_fn, self.attend_fn, config.model_impl)
        # Test hook: every step also sleeps this long (the GIL is released, as in a real
        # forward), so tests can show that the event loop never waits on a step.
        self.step_delay_s = float(os.environ.get("PAGODA_TEST_STEP_DELAY_S", "0") or 0)

    def _lora_manager(self) -> LoRAManager:
        """Device slots for --max-loras adapters, and the --lora-modules adapters registered."""
        if not isinstance(self.model, LlamaForCausalLM):
            raise ValueError(f"enable_lora: needs a native Llama-family model; {type(self.model).__name__} "
                             "is served through transformers")
        c = self.config
        manager = LoRAManager(self.model, self.hf_config, c.max_loras, c.max_lora_rank, self.device, self.dtype,
                              "triton" if self.backend == "triton" else "torch")
        for name, path in c.lora_modules.items():
            manager.load(name, path)
        return manager

    def _eos_token_ids(self) -> list[int]:
        ids: list[int] = []
        if self.tokenizer.eos_token_id is not None:
            ids.append(int(self.tokenizer.eos_token_id))
        try:
            from transformers import GenerationConfig  # lazy: transformers takes seconds to import; rank 0 alone
            gen_eos = GenerationConfig.from_pretrained(self.model_path).eos_token_id
        except OSError:
            gen_eos = None
        if gen_eos is None:
            gen_eos = self.hf_config.eos_token_id
        for t in gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]:
            if t is not None and int(t) not in ids:
                ids.append(int(t))
        return ids

    # ---- memory -------------------------------------------------------------------------

    def bytes_per_block(self) -> int:
        elem = torch.empty(0, dtype=self.kv_dtype).element_size()
        draft_model = getattr(self, "draft", None)
        draft = draft_model.bytes_per_block(self.kv_dtype) if draft_model is not None else 0
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem + draft

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do without them)."""
        if self.tp is not None:
            self.tp.close()

    def num_blocks_for(self) -> int:
        if self.tp is not None:
            self.tp.send(distributed.AgreeNumBlocks())
        return self.agreed_num_blocks()

    def agreed_num_blocks(self) -> int:
        """This rank's pool size, lowered to what the tightest rank can hold (same block ids everywhere)."""
        return distributed.min_over_ranks(self._local_num_blocks(), self.shard.size)

    def _local_num_blocks(self) -> int:
        c = self.config
        if c.num_kv_blocks is not None:
            return int(c.num_kv_blocks)
        if c.kv_cache_memory is not None:
            return int(c.kv_cache_memory) // self.bytes_per_block()
        if self.device.type == "cuda":
            return self._profile_num_blocks()
        return math.ceil(8 * self.max_model_len / self.block_size)

    def _profile_num_blocks(self) -> int:
        """Blocks that fit in gpu_memory_utilization after weights and a dummy full step's peak."""
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        # Memory outside this process's torch allocator (CUDA context, other processes).
        outside = total - free - torch.cuda.memory_reserved(self.device)
        # The worst step: max_num_batched_tokens of prefill, cut into sequences of at most
        # max_model_len tokens, each with its own blocks.
        seq_len = min(self.config.token_budget(self.max_model_len), self.max_model_len)
        lens: list[int] = []
        left = self.config.token_budget(self.max_model_len)
        while left > 0 and len(lens) < self.config.max_num_seqs:
            lens.append(min(left, seq_len))
            left -= lens[-1]
        reqs, first = [], 0
        for n in lens:
            nblocks = math.ceil(n / self.block_size)
            reqs.append((list(range(first, first + nblocks)), n))
            first += nblocks
        self._bind_kv_cache(first)
        temp_kv = first * self.bytes_per_block()
        with torch.inference_mode():
            # This rank alone (each rank profiles its own memory): no broadcast.
            inputs = self.batch.prepare(self._dummy_step(reqs))
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
            rows = min(self.config.max_num_seqs, hidden.shape[0])
            torch.softmax(self.model.compute_logits(hidden[:rows]), dim=-1)
        self.batch.update(SchedulerOutput([], finished_req_ids={f"profile-{i}" for i in range(len(reqs))}))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - temp_kv
        self.kv_caches = []
        for layer in self.model.attention_layers():
            layer.k_cache = layer.v_cache = None
        torch.cuda.empty_cache()
        attn = self.model.attention_layers()[0]
        sampler = sampler_workspace_bytes(self.config.max_num_seqs, self.vocab_size)
        graphs = 0 if not self.uses_graphs() else cuda_graph_bytes(
            len(capture_sizes(self.config.max_num_seqs)), self.config.max_num_seqs, self.hf_config.hidden_size,
            self.hf_config.intermediate_size, (attn.num_heads + 2 * attn.num_kv_heads) * attn.head_dim,
            torch.empty(0, dtype=self.dtype).element_size())
        budget = kv_budget_bytes(total, self.config.gpu_memory_utilization, outside, peak, sampler, graphs)
        blocks = int(budget // self.bytes_per_block())
        log.info("profiled peak %.2f GiB (weights %.2f GiB + activations), sampler %.2f GiB, outside torch "
                 "%.2f GiB, KV budget %.2f GiB", peak / 2**30, self.weight_bytes / 2**30, sampler / 2**30,
                 outside / 2**30, max(budget, 0) / 2**30)
        if blocks < 1:
            raise ValueError("gpu_memory_utilization: no memory left for the KV cache (budget "
                             f"{budget / 2**30:.2f} GiB after weights, activations and the sampler)")
        return blocks

    def _dummy_step(self, reqs: list[tuple[list[int], int]]) -> list[ScheduledRequest]:
        new = [NewRequest(f"profile-{i}", [0] * n, n, None, blocks) for i, (blocks, n) in enumerate(reqs)]
        self.batch.update(SchedulerOutput([], new=new))
        return [ScheduledRequest(r.req_id, len(r.token_ids), 0, True, []) for r in new]

    def warm_up(self) -> None:
        """Compile every Triton kernel variant serving will use, before the worker reports
        SERVING (gpu_worker/runner/warmup.py); CUDA only: on CPU nothing compiles."""
        if self.device.type != "cuda" or self.backend != "triton":
            return
        from pagoda.kernels.triton_attention import _num_sms, launch_config  # lazy: triton, only with its backend
        start = time.perf_counter()
        attn = self.model.attention_layers()[0]
        block_n = launch_config(1, 1, attn.num_heads, attn.num_kv_heads, attn.head_dim, self.block_size,
                                self.kv_dtype, True)["BLOCK_N"]
        plan = warmup_plan(self.config.max_num_seqs, self.max_model_len,
                           self.config.token_budget(self.max_model_len),
                           attn.num_kv_heads, _num_sms(self.device.index or 0), block_n)
        for step in plan:
            self.forward(self.warmup_batch(step))
        if self.lora is not None and plan:
            # The LoRA kernels' variants depend on the projections' shapes only: one step with
            # every row on an adapter slot compiles them all.
            self.lora.warm = True
            try:
                self.forward(self.warmup_batch(plan[0]))
            finally:
                self.lora.warm = False
        self.batch.update(SchedulerOutput([], finished_req_ids=set(self.batch.req_ids)))
        torch.cuda.synchronize(self.device)
        log.info("warm-up: %d steps compiled in %.1f s", len(plan), time.perf_counter() - start)
        if self.uses_graphs():
            before = torch.cuda.memory_reserved(self.device)
            graphs = DecodeGraphs(self.model, self.config.max_num_seqs, self.max_model_len, self.block_size,
                                  self.device)
            graphs.capture()
            self.graphs = graphs
            log.info("CUDA graphs: %d decode sizes captured, pool %.2f GiB", len(graphs.sizes),
                     (torch.cuda.memory_reserved(self.device) - before) / 2**30)

    def uses_graphs(self) -> bool:
        # Not with tensor parallelism (yet): every rank would have to capture its collectives too.
        # Nor with LoRA: a step's adapter grouping is host data that a replay would not see.
        return (self.device.type == "cuda" and self.backend == "triton" and not self.config.enforce_eager
                and self.shard.size == 1 and getattr(self.model, "cuda_graphs_ok", True)
                and not self.config.enable_lora)

    def warmup_batch(self, step: WarmupStep) -> SchedulerOutput:
        """A dummy step of this shape over the pool's first blocks (shared by every sequence;
        nothing is cached before serving, so what it writes there is never read). Its rows
        replace whatever the batch holds."""
        seq_len = min(step.seq_len, len(self.kv_caches[0][0]) * self.block_size)
        blocks = list(range(math.ceil(seq_len / self.block_size)))
        first = seq_len - 1 if step.decode else 0
        ids = [f"warmup-{i}" for i in range(step.num_seqs)]
        return SchedulerOutput([ScheduledRequest(rid, seq_len - first, first, True, []) for rid in ids],
                               new=[NewRequest(rid, [0] * seq_len, seq_len, None, blocks) for rid in ids],
                               finished_req_ids=set(self.batch.req_ids))

    def allocate_kv_cache(self, num_blocks: int) -> None:
        if self.tp is not None:
            self.tp.send(distributed.AllocateKVCache(num_blocks))
        self._bind_kv_cache(num_blocks)

    def _bind_kv_cache(self, num_blocks: int) -> None:
        if self.draft is not None:
            self.draft.bind(num_blocks, self.kv_dtype)
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = []
        for layer in self.model.attention_layers():
            k = new_kv_cache(*shape, dtype=self.kv_dtype, device=self.device)
            v = new_kv_cache(*shape, dtype=self.kv_dtype, device=self.device)
            layer.bind(k, v, self.write_fn, self.attend_fn)
            self.kv_caches.append((k, v))

    # ---- host tier ------------------------------------------------------------------------

    def num_host_blocks(self) -> int:
        """Blocks of the host tier that kv_offloading_size (GiB) buys; 0 when it is off."""
        size = self.config.kv_offloading_size
        if not size:
            return 0
        n = int(size * 2**30 // self.bytes_per_block())
        if n < 1:
            raise ValueError(f"kv_offloading_size: {size} GiB holds no block of "
                             f"{self.bytes_per_block()} bytes")
        return n

    def allocate_host_cache(self, num_blocks: int) -> None:
        """The host tier's pool, block-major: [blocks, 2 * layers, heads, block, dim] (K and V of
        every layer, in the device pool's storage layout), so that one block is one contiguous
        copy. Pinned on CUDA (copies run on their own stream); a second plain pool on CPU."""
        pin = self.device.type == "cuda"
        shape = (num_blocks, 2 * self.num_layers, self.num_kv_heads, self.block_size, self.head_dim)
        self.host_pool = torch.zeros(shape, dtype=self.kv_dtype, pin_memory=pin) if num_blocks else None
        self.copy_stream = torch.cuda.Stream(self.device) if pin and num_blocks else None
        # Blocks per batched copy: bounds the device staging buffer (outside the KV budget).
        per_block = 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * \
            torch.empty(0, dtype=self.kv_dtype).element_size()
        self.copy_chunk = max(1, (64 << 20) // per_block)

    def _device_stores(self) -> list[torch.Tensor]:
        """Every layer's K then V pool as [blocks, heads, block, dim] (new_kv_cache's storage
        under its [blocks, block, heads, dim] view), as bytes for fp8, which has no index_copy."""
        out = []
        for k, v in self.kv_caches:
            for t in (k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)):
                out.append(t.view(torch.uint8) if t.element_size() == 1 else t)
        return out

    @torch.inference_mode()
    def copy_tier_blocks(self, copies: list[KVCopy]) -> None:
        """Run the queued copies between the pools, in order, before anything later on the
        device reads or writes those blocks. Per run of one direction, at most copy_chunk
        blocks at a time: out, every layer's blocks are gathered on the device into a block-major
        staging buffer, then each block goes to its host slot in one copy; back, each slot comes
        into the staging buffer in one copy, then every layer's blocks are scattered from it.
        CPU: done on return. CUDA: the same on the copy stream, after the work already queued (a
        block copied out may be written by a step still running), the host pool pinned and the
        host copies non-blocking; the step's forward waits for them through an event, the host
        never does."""
        if not copies or self.host_pool is None:
            return
        start = time.perf_counter()
        stores = self._device_stores()
        host = self.host_pool.view(torch.uint8) if self.host_pool.element_size() == 1 else self.host_pool
        cuda = self.copy_stream is not None
        main: Any = torch.cuda.current_stream(self.device) if cuda else None
        ctx: Any = contextlib.nullcontext()
        if cuda:
            self.copy_stream.wait_stream(main)
            began = torch.cuda.Event(enable_timing=True)
            began.record(self.copy_stream)
            ctx = torch.cuda.stream(self.copy_stream)
        # Staging buffers are made on the copy stream: the allocator reuses their memory only in
        # that stream's order, after the copies that read them.
        with ctx:
            for to_host, dev, slots in _runs(copies):
                for at in range(0, len(dev), self.copy_chunk):
                    d = torch.tensor(dev[at:at + self.copy_chunk], dtype=torch.int64, device=self.device)
                    part = slots[at:at + self.copy_chunk]
                    if to_host:
                        staging = torch.stack([t.index_select(0, d) for t in stores], dim=1)
                        for i, h in enumerate(part):
                            host[h].copy_(staging[i], non_blocking=cuda)
                    else:
                        staging = torch.empty((len(part), *host.shape[1:]), dtype=host.dtype, device=self.device)
                        for i, h in enumerate(part):
                            staging[i].copy_(host[h], non_blocking=cuda)
                        for j, t in enumerate(stores):
                            t.index_copy_(0, d, staging[:, j])
        if cuda:
            done = torch.cuda.Event(enable_timing=True)
            done.record(self.copy_stream)
            main.wait_event(done)
            self._timed.append((began, done, len(copies)))
            return
        self.copy_seconds += time.perf_counter() - start
        self.copied_blocks += len(copies)

    def copy_rate(self) -> tuple[int, float]:
        """(blocks copied, seconds their copies took) so far; on CUDA, copies not yet done are
        counted once they are."""
        while self._timed and self._timed[0][1].query():
            began, done, n = self._timed.pop(0)
            self.copy_seconds += began.elapsed_time(done) / 1000
            self.copied_blocks += n
        return self.copied_blocks, self.copy_seconds

    # ---- one step ---------------------------------------------------------------------

    def _run_model(self, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor, StepInputs]:
        """Build the step's inputs and run it: (logits of the sampling rows, the inputs)."""
        inputs = self.batch.prepare(scheduled)
        if inputs.in_flight is not None:
            # Tokens the previous step sampled, still on the device: filled in after that step
            # in stream order (on CUDA nothing waits for it here).
            if self.last_draw is None or self.tp is not None:
                raise RuntimeError("a step with tokens in flight needs the previous draw on this rank")
            dst, src = inputs.in_flight
            inputs.input_ids[dst] = self.last_draw[src]
        if self.lora is not None:
            self.lora.set_step(inputs.lora_slots, self._upload_async, int(inputs.input_ids.shape[0]))
        indices = inputs.logits_indices
        if inputs.prompt_scores is not None:     # their logits come after the sampling rows'
            indices = torch.cat([indices, inputs.prompt_scores.token_rows])
        args = (inputs.input_ids, inputs.positions, inputs.meta, indices)
        if self.tp is None:
            return self.run_model(*args), inputs
        # Every rank runs the same step on its shard: one broadcast of the step's inputs.
        self.tp.send(distributed.RunModel(*args))
        try:
            return self.run_model(*args), inputs
        except distributed.RankFailure:
            raise
        except RuntimeError as e:    # a collective failed: the group is unusable from here on
            raise self.tp.fail(f"step failed: {e}") from e

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput) -> torch.Tensor:
        """Apply a step to the batch and run the model over it (writing its KV); fp32 logits
        [sampling requests, V]. The sampled tokens are not appended: execute does that."""
        self.batch.update(out)
        if out.block_copies:
            self.copy_blocks(out.block_copies)
        if not out.scheduled:
            return torch.empty(0, self.vocab_size, device=self.device)
        return self._run_model(out.scheduled)[0]

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer's K and V (copy-on-write of blocks forked
        beams shared), before the step's forward writes into dst. One gather and one scatter per
        tensor; on CUDA they queue in stream order, after the step that wrote src."""
        if self.tp is not None:
            self.tp.send(distributed.CopyBlocks(copies))
        src = torch.tensor([a for a, _ in copies], dtype=torch.int64, device=self.device)
        dst = torch.tensor([b for _, b in copies], dtype=torch.int64, device=self.device)
        for cache in self.kv_caches:
            for t in cache:
                # fp8 has no index_copy kernel: its bytes are copied as they are.
                t = t.view(torch.uint8) if t.element_size() == 1 else t
                t.index_copy_(0, dst, t.index_select(0, src))

    @torch.inference_mode()
    def run_model(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata,
                  logits_indices: torch.Tensor) -> torch.Tensor:
        """The model on this rank's shard; on rank 0, fp32 logits of the sampling rows."""
        hidden = self.graphs.run(ids, pos, meta) if self.graphs is not None else None
        if hidden is None:  # prefill, mixed, or no graphs
            hidden = self.model(ids, pos, meta)
        return self.model.compute_logits(hidden[logits_indices])

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """One whole step: launch, then wait for its tokens."""
        return self.finish(self.launch(out))

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> Optional[InFlight]:
        """Start a step: update the batch, run the model and the sampler, start the tokens'
        copy to the host. On CUDA this returns while the GPU still works, so the engine can
        process the previous step's outputs meanwhile; finish() waits. None: nothing samples."""
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self.batch.update(out)
        # The tier's copies first: a copy-on-write target may be a block whose old KV goes out.
        self.copy_tier_blocks(out.kv_copies)
        if out.block_copies:
            self.copy_blocks(out.block_copies)
        if self.draft is not None:
            self.draft.forget(out.finished_req_ids)
        if not out.scheduled:
            return None
        spec_index = [i for i, x in enumerate(out.scheduled) if x.spec_token_ids]
        proposed = None
        if spec_index and self.draft is not None:
            rows = np.array([self.batch.row_of[out.scheduled[i].req_id] for i in spec_index], np.int64)
            proposed = self.draft.propose(self.batch, out.scheduled, spec_index,
                                          self.batch.sampling_batch(rows, staged=False), self._draft_probs)
        elif self.draft is not None:
            self.draft.propose(self.batch, out.scheduled, [], None, self._draft_probs)  # keeps its KV up
        logits, inputs = self._run_model(out.scheduled)
        b = len(inputs.req_ids)
        nl = int(inputs.logits_indices.shape[0])    # sampling rows' logits (more with drafts)
        prompt = None
        if inputs.prompt_scores is not None:
            prompt = (inputs.prompt_scores, *self._score_prompt(logits[nl:], inputs.prompt_scores))
        if not b:
            return InFlight([], np.empty(0, np.int64), None, prompt) if prompt is not None else None
        if inputs.num_drafts is not None:
            return self._verify(logits[:nl], inputs, out.scheduled, spec_index, proposed, prompt)
        sampled, faults = self._draw(logits[:b], inputs.sample_rows, inputs.req_ids)
        self.last_draw = sampled.tokens
        return InFlight(inputs.req_ids, self.batch.mark_sampled(inputs.sample_rows), sampled, prompt, faults=faults)

    def _draw(self, logits: torch.Tensor, rows: np.ndarray, req_ids: list[str]
              ) -> tuple[Sampled, dict[str, BaseException]]:
        """The sampler over the rows, all at once: the sampling transforms, logits processors and
        grammar masks are per-request stages, so an error there is attributed (core/faults.py)."""
        try:
            return self.sampler.draw(logits, self.batch.sampling_batch(rows, self.last_draw)), {}
        except Exception as error:
            return self._draw_isolating(logits, rows, req_ids, error)

    def _draw_isolating(self, logits: torch.Tensor, rows: np.ndarray, req_ids: list[str], error: Exception
                        ) -> tuple[Sampled, dict[str, BaseException]]:
        """The batched draw raised and cannot say which row made it: draw row by row to find
        the rows that raise alone (their requests fail alone), then draw the others together.
        The culprits' rows hold token 0, which nobody reads: their requests end when the step
        is collected. A row that never raises alone leaves the error the engine's. Relies on
        the sampler's stages raising before they write the logits (the grammar's Python work
        comes first; the torch transforms check their arguments before writing)."""
        bad: dict[int, BaseException] = {}
        for i in range(len(rows)):
            try:
                self.sampler.draw(logits[i:i + 1].clone(),
                                  self.batch.sampling_batch(rows[i:i + 1], self.last_draw, staged=False))
            except Exception as e:
                bad[i] = e
        if not bad:
            raise error
        log.warning("sampling raised for %d of %d rows (%r); those requests fail alone",
                       len(bad), len(rows), error)
        n = len(rows)
        good = np.array([i for i in range(n) if i not in bad], np.int64)
        tokens = torch.zeros(n, dtype=torch.int64, device=self.device)
        faults = {req_ids[i]: e for i, e in bad.items()}
        if not len(good):
            return Sampled(tokens.cpu(), None, None, 0, tokens), faults
        s = self.sampler.draw(logits[self._upload(good)],
                              self.batch.sampling_batch(rows[good], self.last_draw, staged=False))
        if s.ready is not None:
            s.ready.synchronize()
        tokens[self._upload(good)] = s.tokens
        host = torch.zeros((n, *s.host.shape[1:]), dtype=s.host.dtype)
        host[torch.from_numpy(good)] = s.host
        want = None
        if s.num_logprobs is not None:
            want = [-1] * n
            for i, k in zip(good.tolist(), s.num_logprobs):
                want[i] = k
        return Sampled(host, None, want, s.k, tokens), faults

    @staticmethod
    def _score_prompt(logits: torch.Tensor, scores: PromptScores) -> tuple[torch.Tensor, int]:
        """Raw log-probabilities (as vLLM's prompt_logprobs: no sampling transform) of each scored
        prompt token and the k best there, packed for one copy to the host."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        k = max(span[3] for span in scores.spans)
        parts = [lp.gather(1, scores.targets_dev[:, None]).double()]
        if k > 0:
            top_vals, top_ids = lp.topk(k, dim=-1)
            parts += [top_vals.double(), top_ids.double()]
        return torch.cat(parts, dim=1), k

    @staticmethod
    def _draft_probs(logits: torch.Tensor, batch) -> torch.Tensor:
        return Sampler.probs(Sampler.process(logits, batch), batch)

    def _verify(self, logits: torch.Tensor, inputs, scheduled: list[ScheduledRequest], spec_index: list[int],
                proposed: Optional[tuple[torch.Tensor, torch.Tensor]], prompt=None) -> InFlight:
        """A step with drafts: plain rows sample as usual; speculating rows (1 + k logits rows
        each) go through the rejection sampler against the drafts."""
        k = inputs.num_drafts
        assert k is not None
        first = np.cumsum(k + 1) - (k + 1)
        plain, spec = np.flatnonzero(k == 0), np.flatnonzero(k > 0)
        sampled = None
        faults: dict[str, BaseException] = {}
        if len(plain):
            sampled, faults = self._draw(logits[self._upload(first[plain])], inputs.sample_rows[plain],
                                         [inputs.req_ids[i] for i in plain])
            self.last_draw = sampled.tokens
        ks = k[spec]
        spec_rows = np.repeat(first[spec], ks + 1) + (np.arange(int((ks + 1).sum()))
                                                      - np.repeat(np.cumsum(ks + 1) - (ks + 1), ks + 1))
        expanded = np.repeat(inputs.sample_rows[spec], ks + 1)
        sb = self.batch.sampling_batch(expanded, staged=False)
        target = Sampler.probs(Sampler.process(logits[self._upload(spec_rows)], sb), sb)
        u = uniforms(len(expanded), sb.generators, self.device)
        if proposed is not None:
            draft_ids, draft_probs = proposed
        else:
            draft_ids = self._upload(np.array([t for i in spec_index for t in scheduled[i].spec_token_ids], np.int64))
            draft_probs = None
        verified = rejection_sample(target, ks, draft_ids, draft_probs, u)
        req_ids = [inputs.req_ids[i] for i in plain]
        positions = self.batch.mark_sampled(inputs.sample_rows[plain]) if len(plain) else np.zeros(0, np.int64)
        return InFlight(req_ids, positions, sampled, prompt, [inputs.req_ids[i] for i in spec], verified, faults)

    def _upload_async(self, a: np.ndarray) -> torch.Tensor:
        return self.batch._upload(a)

    def _upload(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def finish(self, step: Optional[InFlight]) -> ModelRunnerOutput:
        """Wait for a launched step's tokens; they land in the batch, and the stop-token and
        length checks run for all of them at once."""
        if step is None:
            return ModelRunnerOutput(sampled_token_ids={})
        result = ModelRunnerOutput(sampled_token_ids={})
        if step.sampled is not None:
            tokens, logprobs = self.sampler.to_host(step.sampled)
            flags = self.batch.fill_sampled(step.req_ids, step.positions, tokens)
            ends = np.flatnonzero(flags)
            result.sampled_token_ids = dict(zip(step.req_ids, tokens))
            result.finish_flags = {step.req_ids[i]: int(flags[i]) for i in ends}
            for rid, lp in zip(step.req_ids, logprobs):
                if lp is not None:
                    result.logprobs[rid] = lp
            if step.faults:     # no token for them: the engine ends them (core/faults.py)
                result.failed = step.faults
                for rid in step.faults:
                    result.sampled_token_ids.pop(rid, None)
                    result.finish_flags.pop(rid, None)
        if step.prompt is not None:
            result.prompt_logprobs = self._prompt_logprobs(*step.prompt)
        if step.spec is not None and step.spec_req_ids is not None:
            emitted, spec_flags = self.batch.fill_speculated(step.spec_req_ids, step.spec.tokens)
            for rid, toks, f, acc in zip(step.spec_req_ids, emitted, spec_flags, step.spec.num_accepted):
                result.spec_token_ids[rid] = toks
                result.spec_num_accepted[rid] = acc
                if f:
                    result.finish_flags[rid] = f
                if self.draft is not None:
                    self.draft.rollback(rid, int(self.batch.num_computed[self.batch.row_of[rid]]))
        return result

    @staticmethod
    def _prompt_logprobs(scores: PromptScores, packed: torch.Tensor, k: int
                         ) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        rows, targets = packed.cpu().tolist(), scores.targets.tolist()
        out, at = {}, 0
        for rid, first, count, want in scores.spans:
            out[rid] = (first, [TokenLogprobs(Logprob(targets[j], rows[j][0]),
                                              [Logprob(int(t), v) for v, t in zip(rows[j][1:1 + want],
                                                                                  rows[j][1 + k:1 + k + want])])
                                for j in range(at, at + count)])
            at += count
        return out
