"""Where models come from and which are refused: local directories, hub ids from the Hugging Face
cache with no network, clear one-line errors, and architectures pagoda cannot serve."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import transformers

from pagoda.gpu_worker.core.config import EngineConfig
from pagoda.gpu_worker.runner.loader import choose_backend
from pagoda.gpu_worker.runner.model_runner import ModelRunner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def offline_env(hf_home) -> dict:
    # HF_HUB_OFFLINE is read when huggingface_hub is imported: only a fresh process sees it.
    return dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", PYTHONPATH=ROOT, OMP_NUM_THREADS="1")


def hub_cache_snapshot(hf_home, repo_id: str, checkpoint: str) -> None:
    """Lay a checkpoint out as huggingface_hub caches a download: refs/main -> snapshots/<commit>."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(checkpoint, repo / "snapshots" / COMMIT)


def test_hub_id_loads_from_the_cache_offline(tiny_model, tmp_path):
    hub_cache_snapshot(tmp_path, "pagoda-test/tiny-llama", tiny_model)
    script = (
        "from pagoda.gpu_worker.engine.llm import LLM\n"
        "from pagoda.gpu_worker.core.sampling_params import SamplingParams\n"
        "import sys\n"
        "for rev in (None, sys.argv[1]):\n"
        "    llm = LLM('pagoda-test/tiny-llama', revision=rev, num_kv_blocks=8)\n"
        "    print(llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, COMMIT], env=offline_env(tmp_path), cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from pagoda.gpu_worker.core.sampling_params import SamplingParams
    from pagoda.gpu_worker.engine.llm import LLM
    local = LLM(tiny_model, num_kv_blocks=8).generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))
    expected = str(local[0].outputs[0].token_ids)
    assert proc.stdout.split("\n")[:2] == [expected, expected]


def test_unknown_hub_id_offline_is_one_line_naming_model(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pagoda.gpu_worker", "--model", "pagoda-test/no-such-model",
                           "--port", "0", "--metrics-port", "0", "--device", "cpu"],
                          env=offline_env(tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line or "Traceback" in line]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "pagoda-test/no-such-model" in errors[0] and "--model" in errors[0]
    assert "offline" in errors[0]


def test_local_path_that_is_missing_is_named():
    with pytest.raises(ValueError, match="not a directory"):
        ModelRunner(EngineConfig(model="/nonexistent/checkpoint", device="cpu"))


@pytest.mark.parametrize("config", [
    transformers.BertConfig(architectures=["BertForMaskedLM"]),                       # encoder-only
    transformers.ViTConfig(architectures=["ViTForImageClassification"]),              # vision-only
    transformers.T5Config(architectures=["T5ForConditionalGeneration"]),              # encoder-decoder
], ids=["bert", "vit", "t5"])
def test_unsupported_architectures_are_refused_by_name(config):
    with pytest.raises(ValueError, match=config.architectures[0]):
        choose_backend(config)


def test_unsupported_architecture_refused_at_start(tiny_model, tmp_path):
    path = tmp_path / "bert"
    shutil.copytree(tiny_model, path)
    (path / "config.json").write_text(json.dumps(transformers.BertConfig(
        architectures=["BertForMaskedLM"], vocab_size=640).to_dict()))
    with pytest.raises(ValueError, match="BertForMaskedLM.*not a decoder-only causal LM"):
        ModelRunner(EngineConfig(model=str(path), device="cpu"))


def test_backend_choice(tiny_model_factory, caplog):
    llama = transformers.AutoConfig.from_pretrained(tiny_model_factory("llama"))
    assert choose_backend(llama)[0] == "native"
    assert choose_backend(llama, "transformers")[0] == "transformers"
    gemma = transformers.AutoConfig.from_pretrained(tiny_model_factory("gemma2"))
    backend, why = choose_backend(gemma)
    assert backend == "transformers" and "Gemma2ForCausalLM" in why
    with pytest.raises(ValueError, match="model_impl: native has no implementation of Gemma2ForCausalLM"):
        choose_backend(gemma, "native")
    with caplog.at_level("INFO", logger="pagoda.gpu_worker.runner.loader"):
        ModelRunner(EngineConfig(model=tiny_model_factory("gemma2"), device="cpu"))
    assert "transformers backend (no native implementation of Gemma2ForCausalLM)" in caplog.text


def test_transformers_backend_never_captures_cuda_graphs(tiny_model_factory):
    """Modeling code may sync with the host mid-forward (MoE routing), which a graph cannot hold:
    a runner that would capture for the native model stays eager for the transformers one."""
    import torch
    for impl, graphed in (("native", True), ("transformers", False)):
        r = ModelRunner(EngineConfig(model=tiny_model_factory("llama"), device="cpu", model_impl=impl))
        r.device, r.backend = torch.device("cuda"), "triton"   # as on a GPU host, without one
        assert r.uses_graphs() == graphed, impl
