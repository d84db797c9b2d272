"""transformers must not mistake pagoda's `kernels` package for Hugging Face's `kernels`.

transformers 5 probes `importlib.util.find_spec("kernels")` and, when found, takes the version of
the distribution that provides it (ours resolves to `pagoda`); is_kernels_available() then gates
`from kernels import get_kernel, ...` at import time of its hub-kernel integration. The check
runs in a fresh interpreter from the repository root, where our package is the one found, since
transformers caches the probe per process.
"""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = r"""
import importlib.util, json, sys
import torch
import transformers
from transformers.utils import import_utils
from transformers.integrations import hub_kernels
import kernels
spec = importlib.util.find_spec("kernels")
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])
out = model(torch.tensor([[1, 2, 3]])).logits
print(json.dumps(dict(origin=spec.origin, available=import_utils.is_kernels_available(),
                      probed=list(import_utils._is_package_available("kernels", return_version=True)),
                      has_get_kernel=hasattr(kernels, "get_kernel"),
                      logits_shape=list(out.shape), finite=bool(out.isfinite().all()))))
"""


def test_transformers_does_not_take_our_kernels_for_hf_kernels(tiny_model):
    proc = subprocess.run([sys.executable, "-c", PROBE, tiny_model], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    # The probe really does see our package (otherwise this test would prove nothing)...
    assert r["origin"] == os.path.join(ROOT, "kernels", "__init__.py")
    assert r["probed"][0] is True
    # ...and still reports Hugging Face kernels as unavailable, so nothing imports from ours.
    assert r["available"] is False, f"transformers accepted pagoda's kernels (version {r['probed'][1]})"
    assert r["has_get_kernel"] is False
    assert r["logits_shape"][:2] == [1, 3] and r["finite"]
