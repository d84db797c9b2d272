"""Offline batch generation: LLM(model=...).generate(prompts, params) -> RequestOutputs."""
from __future__ import annotations

import itertools
from typing import Sequence

from pagoda.gpu_worker.core.config import EngineConfig
from pagoda.gpu_worker.core.outputs import CompletionOutput, RequestOutput
from pagoda.gpu_worker.core.sampling_params import SamplingParams
from pagoda.gpu_worker.engine.llm_engine import LLMEngine
from pagoda.gpu_worker.features.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence, beam_score


class LLM:
    def __init__(self, model: str, **kwargs):
        """Keywords are EngineConfig fields (device, block_size, num_kv_blocks, ...)."""
        config = EngineConfig(model=model, **kwargs)
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora_request=None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order of `prompts`. lora_request: an
        adapter name, or an object with lora_name (and lora_path, loaded on first use, as
        vLLM's LoRARequest), or a list of those per prompt (None: the base model)."""
        batch: list = [prompts] if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) \
            else list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params: list[SamplingParams] = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                                        else [sampling_params] * len(batch))  # type: ignore[list-item]
        if len(params) != len(batch):
            raise ValueError(f"sampling_params: {len(params)} given for {len(batch)} prompts")
        adapters = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(batch)
        if len(adapters) != len(batch):
            raise ValueError(f"lora_request: {len(adapters)} given for {len(batch)} prompts")
        names = [self._adapter_name(a) for a in adapters]
        outputs: dict[str, RequestOutput] = {}
        added = []
        try:
            for prompt, p, adapter in zip(batch, params, names):
                text = prompt if isinstance(prompt, str) else None
                ids: list[int] = self.tokenizer.encode_text(prompt) if text is not None else list(prompt)
                rid = f"llm-{next(self._ids)}"
                self.engine.add_request(rid, ids, p, adapter=adapter)
                added.append(rid)
                outputs[rid] = RequestOutput(
                    request_id=rid, prompt=text, prompt_token_ids=ids, finished=False,
                    outputs=[CompletionOutput(index=i, text="", token_ids=[],
                                              logprobs=[] if p.logprobs is not None else None)
                             for i in range(p.n)])
            self._run(outputs)
        except BaseException:
            # Leave the engine clean for the next call.
            self.engine.abort_request([r for r in added if not outputs[r].finished])
            while self.engine.has_unfinished_requests():
                self.engine.step()
            raise
        return [outputs[r] for r in added]

    def _adapter_name(self, request) -> str:
        if request is None or isinstance(request, str):
            return request or ""
        name = request.lora_name
        path = getattr(request, "lora_path", None)
        if path and name not in self.engine.lora_adapters():
            self.engine.load_lora_adapter(name, path)
        return name

    def beam_search(self, prompts, params: BeamSearchParams, lora_request=None) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: per prompt, the beam_width best beams, best first, each with
        its tokens (prompt included), text, cumulative log-probability and score. The beams of a
        prompt share KV blocks in the engine (gpu_worker/features/beam_search.py). Prompts as generate's,
        or vLLM's prompt dicts ({"prompt": text} / {"prompt_token_ids": ids})."""
        if isinstance(prompts, dict) or (isinstance(prompts, (list, tuple)) and prompts
                                         and isinstance(prompts[0], dict)):
            prompts = [p.get("prompt_token_ids", p.get("prompt")) if isinstance(p, dict) else p
                       for p in ([prompts] if isinstance(prompts, dict) else prompts)]
            if any(p is None for p in prompts):
                raise ValueError("prompts: a prompt dict needs 'prompt' or 'prompt_token_ids'")
        sp = SamplingParams(n=params.beam_width, use_beam_search=True, temperature=params.temperature,
                            max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                            length_penalty=params.length_penalty)
        results = []
        for ro in self.generate(prompts, sp, lora_request):
            seqs = []
            for c in ro.outputs:
                if c.finish_reason == "abort":
                    continue
                cum = c.cumulative_logprob if c.cumulative_logprob is not None else 0.0
                tokens = ro.prompt_token_ids + c.token_ids
                seqs.append(BeamSearchSequence(tokens, list(c.token_ids), cum,
                                               beam_score(len(tokens), tokens[-1] in self.engine.eos_token_ids,
                                                          cum, params.length_penalty),
                                               c.text, c.finish_reason or "length"))
            results.append(BeamSearchOutput(seqs, list(ro.prompt_token_ids)))
        return results

    def _run(self, outputs: dict[str, RequestOutput]) -> None:
        left = sum(len(o.outputs) for o in outputs.values())
        while left:
            deltas = self.engine.step()
            faults = self.engine.take_faults()
            if faults:      # a request of this call failed alone (core/faults.py): the call fails
                for f in faults:
                    outputs[f.request_id].finished = True      # already ended in the engine
                raise faults[0]
            for d in deltas:
                ro = outputs[d.request_id]
                c = ro.outputs[d.index]
                c.token_ids.extend(d.token_ids)
                c.text += d.text
                if d.logprobs and c.logprobs is not None:
                    c.logprobs.extend(d.logprobs)
                if d.cumulative_logprob is not None:
                    c.cumulative_logprob = d.cumulative_logprob
                if d.index == 0:
                    ro.num_cached_tokens = d.num_cached_tokens
                if d.prompt_logprobs is not None:
                    ro.prompt_logprobs = [None, *d.prompt_logprobs]
                if d.finished:
                    c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
                    left -= 1
                    ro.finished = all(x.finish_reason for x in ro.outputs)
