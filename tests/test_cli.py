"""The `pagoda` CLI: dispatch without importing server code, and `generate` against a real worker."""
import json
import subprocess
import sys

import pytest

from tests.plugins.servers import ROOT, free_port


def pagoda(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "pagoda.clients.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_help_and_unknown_command():
    r = pagoda("--help")
    assert r.returncode == 0 and "generate" in r.stdout and "make-tiny-model" in r.stdout
    r = pagoda("frobnicate")
    assert r.returncode == 2 and "unknown command 'frobnicate'" in r.stderr


def test_worker_dispatches_to_python_m_gpu_worker():
    r = pagoda("worker", "--help")
    assert r.returncode == 0
    for flag in ("--model", "--kv-cache-memory", "--num-kv-blocks", "--gpu-memory-utilization", "--redis-url",
                 "--max-waiting", "--drain-grace-seconds"):
        assert flag in r.stdout
    r = pagoda("worker", "--port", "1")     # --model missing: argparse names it
    assert r.returncode == 2 and "--model" in r.stderr


def test_worker_flag_parsing_is_torch_free():
    code = ("import sys; from pagoda.gpu_worker.serving.args import build_parser, engine_config_kwargs;"
            "a = build_parser().parse_args(['--model', '/m', '--kv-cache-memory', '2GiB', '--no-prefix-caching']);"
            "kw = engine_config_kwargs(a); assert kw['kv_cache_memory'] == '2GiB' and not kw['enable_prefix_caching'];"
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_generate_unreachable_target_fails_cleanly():
    r = pagoda("generate", "--target", f"127.0.0.1:{free_port()}", "hello", "--timeout", "3")
    assert r.returncode == 1 and "UNAVAILABLE" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_generate_text_and_json_against_a_worker(tiny_worker):
    w = tiny_worker
    r = pagoda("generate", "--target", w.address, "Once upon a time", "--max-tokens", "6", "--temperature", "0",
               "--json")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert lines[-1]["finished"] and lines[-1]["usage"]["completion_tokens"] == len(
        [t for x in lines for t in x["token_ids"]])
    assert lines[-1]["finish_reason"] in ("stop", "length")
    text = "".join(x["text"] for x in lines)
    r2 = pagoda("generate", "--target", w.address, "Once upon a time", "--max-tokens", "6", "--temperature", "0")
    assert r2.returncode == 0 and r2.stdout == text + "\n"
    r3 = pagoda("generate", "--target", w.address, "hi", "--system", "Be brief.", "--max-tokens", "0")
    assert r3.returncode == 1 and "INVALID_ARGUMENT" in r3.stderr and "max_tokens" in r3.stderr
    r4 = pagoda("generate", "--target", w.address, "hi", "--adapter", "sql-lora", "--max-tokens", "2")
    assert r4.returncode == 1 and "adapter: this worker serves no adapters" in r4.stderr


@pytest.mark.slow
def test_readme_client_example_runs(tiny_worker):
    readme = (ROOT / "clients" / "README.md").read_text()
    code = readme.split("```python\n", 1)[1].split("```", 1)[0]
    code = code.replace("pagoda-router.internal:50050", tiny_worker.address)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    last = r.stdout.strip().splitlines()[-1].split()
    assert last[-3] in ("stop", "length") and int(last[-2]) > 0 and int(last[-1]) > 0


def test_worker_bad_flags_name_the_field(tiny_model):
    r = pagoda("worker", "--model", "/no/such/dir")
    assert r.returncode == 2 and "--model" in r.stderr and "Traceback" not in r.stderr
    r = pagoda("worker", "--model", tiny_model, "--block-size", "7", "--device", "cpu")
    assert r.returncode == 2 and "block_size" in r.stderr and "Traceback" not in r.stderr
