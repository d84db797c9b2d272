"""One tokenizer per worker process: the engine's runner loads a PromptTokenizer once, and the
server (prompts, served texts, lease digest, grammars), the detokenizers and the offline LLM all
use that object. No transformers tokenizer is built at all."""
import asyncio

import pytest

from pagoda.gpu_worker.core.sampling_params import SamplingParams
from pagoda.runtime.tokenization import PromptTokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def tokenizers_built(monkeypatch):
    """The PromptTokenizers built during the test; building a transformers tokenizer fails it."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    built: list[PromptTokenizer] = []
    init = PromptTokenizer.__init__

    def counting(self, *args, **kwargs):
        built.append(self)
        init(self, *args, **kwargs)

    def refuse(self, *args, **kwargs):
        raise AssertionError(f"a transformers tokenizer ({type(self).__name__}) was built in a worker")

    monkeypatch.setattr(PromptTokenizer, "__init__", counting)
    monkeypatch.setattr(PreTrainedTokenizerBase, "__init__", refuse)
    return built


def test_a_worker_process_loads_one_tokenizer_and_shares_it(tiny_model, tokenizers_built):
    from pagoda.gpu_worker.serving.args import build_parser
    from pagoda.gpu_worker.serving.server import Worker
    args = build_parser().parse_args(["--model", tiny_model, "--host", "127.0.0.1", "--port", "0",
                                      "--metrics-port", "0", "--device", "cpu", "--num-kv-blocks", "32"])

    async def start_and_stop():
        worker = Worker(args)
        await worker.start()
        try:
            return worker, worker.service.tokenizer
        finally:
            await worker.shutdown(0)

    worker, served = asyncio.run(start_and_stop())
    engine = worker.engine.engine            # the AsyncLLM's LLMEngine
    assert tokenizers_built == [served]
    assert served is worker.engine.tokenizer is engine.tokenizer is engine.runner.tokenizer


def test_the_offline_engine_detokenizes_with_its_one_tokenizer(tiny_model, tokenizers_built):
    from pagoda.gpu_worker.engine.llm import LLM
    llm = LLM(tiny_model, device="cpu", num_kv_blocks=32)
    assert tokenizers_built == [llm.tokenizer] and llm.engine.tokenizer is llm.tokenizer
    llm.engine.add_request("r", llm.tokenizer.encode_text("hello"), SamplingParams(max_tokens=2, n=2))
    assert [d.tokenizer for d in llm.engine.detokenizers.values()] == [llm.tokenizer] * 2
    llm.engine.abort_request("r")
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
