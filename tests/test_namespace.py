"""pagoda installs as one import name, `pagoda`, beside today's Hugging Face stack.

transformers (5.25 on) requires Hugging Face's `kernels` package, whose import name was also
pagoda's top-level `kernels` folder: from the repository root the folder shadowed it and the
workers died at start. Now `pagoda.kernels` is a namespace package linked from pagoda/ (no
`__init__.py` in kernels/), so a regular package of the same bare name, found anywhere on
sys.path, wins over the folder; and a wheel puts nothing but `pagoda` at the top of
site-packages.
"""
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import grpc

from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc
from tests.plugins.servers import launch_worker

ROOT = Path(__file__).resolve().parents[1]

# From the repository root, as `python -c` puts it first on sys.path: Hugging Face's kernels,
# transformers' probe of it, and a pagoda engine serving a request, all in one process.
SAME_PROCESS = r"""
import json, sys
import kernels
import transformers
from transformers.utils import import_utils
from pagoda.gpu_worker import LLM, SamplingParams
import pagoda.kernels
llm = LLM(model=sys.argv[1], device="cpu", num_kv_blocks=32)
out = llm.generate(["Hello there"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
hf = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])
print(json.dumps(dict(hf_kernels=kernels.__file__, has_get_kernel=hasattr(kernels, "get_kernel"),
                      available=import_utils.is_kernels_available(),
                      ours=list(pagoda.kernels.__path__), tokens=len(out.outputs[0].token_ids),
                      hf_loaded=type(hf).__name__)))
"""


def test_hf_kernels_and_a_pagoda_engine_share_one_process_from_the_repo_root(tiny_model):
    proc = subprocess.run([sys.executable, "-c", SAME_PROCESS, tiny_model], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not r["hf_kernels"].startswith(str(ROOT)), r     # the bare name is Hugging Face's...
    assert r["has_get_kernel"] and r["available"] is True
    assert [Path(p).resolve() for p in r["ours"]] == [ROOT / "kernels"]     # ...ours is pagoda.kernels
    assert r["tokens"] == 4 and r["hf_loaded"] == "LlamaForCausalLM"


def test_no_top_level_folder_shadows_a_package_of_its_bare_name():
    """kernels/ must stay a namespace portion: with an __init__.py it beats site-packages again."""
    assert not (ROOT / "kernels" / "__init__.py").exists()
    links = {p.name: p.resolve() for p in (ROOT / "pagoda").iterdir() if p.is_symlink()}
    assert links == {name: ROOT / name for name in ("protos", "runtime", "kernels", "gpu_worker", "router", "clients")}


def test_a_wheel_holds_pagoda_alone_and_serves_a_request(tmp_path, tiny_model):
    # Built from a copy: setuptools leaves build/ in the tree it builds.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", "build", "*.egg-info", "__pycache__", "bench", "tests", "helm", "*.png"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, capture_output=True, timeout=600)
    wheel, = (tmp_path / "dist").glob("pagoda_serve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"pagoda", wheel.name.split("-py3")[0] + ".dist-info"}
    for must in ("pagoda/kernels/csrc/gemm_cpu.c", "pagoda/protos/pagoda/v1/pagoda.proto", "pagoda/gpu_worker/__main__.py"):
        assert must in names, must
    assert "pagoda.clients.cli:main" in zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith("entry_points.txt"))).decode()

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(target)}
    where = subprocess.run([sys.executable, "-c", "import pagoda.gpu_worker as g; print(g.__file__)"], cwd=target,
                           env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(target), where       # the installed copy, not the checkout
    worker = launch_worker(tiny_model, tmp_path, import_root=target, num_kv_blocks=32)
    try:
        with grpc.insecure_channel(worker.address) as ch:
            final = list(pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
                text="Hello there", sampling=pb.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)),
                timeout=120))[-1]
        assert final.finished and final.usage.completion_tokens == 3
    finally:
        assert worker.stop() == 0


def test_no_bench_script_shadows_an_installed_package():
    """`python bench/x.py` puts bench/ first on sys.path: a bench/kernels.py hid Hugging Face's
    kernels from transformers in every bench run."""
    import importlib.metadata
    installed = importlib.metadata.packages_distributions()
    for folder in (ROOT / "bench", ROOT / "bench" / "sim"):
        clash = {p.name: installed[p.stem] for p in folder.glob("*.py") if p.stem in installed}
        assert not clash, f"{folder.relative_to(ROOT)}: {clash} shadow installed packages; rename them"


def test_nothing_imports_or_runs_a_part_by_its_bare_name():
    """Code, code in strings, docs and scripts say pagoda.<part>: a bare `from kernels import ...`
    finds Hugging Face's package, and a bare `import gpu_worker` from the repo root a second copy."""
    import re
    # an import statement (a line's start, or after ; or an opening quote/backtick) or `-m part`
    bare = re.compile(r"(?:(?:^|[;\"'`]\s*)(?:from|import)\s+|-m\s+|\"-m\",\s*\")"
                      r"(protos|runtime|kernels|gpu_worker|router|clients)\b(?!-)")
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    found = []
    for name in files:
        path = ROOT / name
        if path.suffix not in (".py", ".sh", ".md", ".toml", ".yaml", ".tpl") and "Dockerfile" not in name and \
                not name.startswith(".ci/"):
            continue
        if path.is_symlink() or name == "tests/test_namespace.py":   # this file imports HF's kernels on purpose
            continue
        for no, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if bare.search(line):
                found.append(f"{name}:{no}: {line.strip()}")
    assert not found, "bare part names (say pagoda.<part>):\n" + "\n".join(found[:20])
