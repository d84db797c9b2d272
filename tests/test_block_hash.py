"""The block-hash chain: committed vectors, namespace separation, and agreement across processes."""
import json
import os
import subprocess
import sys
from pathlib import Path

from pagoda.protos.block_hash import DIGEST_SIZE, block_hashes, hash_block, namespace_root

VECTORS = Path(__file__).parent / "data" / "block_hash_vectors.json"
ROOT = Path(__file__).resolve().parents[1]


def _cases():
    return json.loads(VECTORS.read_text())["cases"]


def test_committed_vectors():
    for c in _cases():
        root = namespace_root(c["model"], c["adapter"], c["cache_salt"])
        assert root.hex() == c["root"], c["model"]
        got = block_hashes(c["token_ids"], c["block_size"], root)
        assert [h.hex() for h in got] == c["hashes"]
        assert len(got) == len(c["token_ids"]) // c["block_size"]   # full blocks only


def test_chain_and_extension():
    root = namespace_root("m")
    ids = list(range(50))
    full = block_hashes(ids, 16, root)
    assert len(full) == 3 and all(len(h) == DIGEST_SIZE for h in full)
    assert full[1] == hash_block(full[0], ids[16:32])
    assert block_hashes(ids, 16, root, start=full[:2]) == full
    # A change in block 0 changes every later hash; a change in the partial tail changes none.
    assert block_hashes([99] + ids[1:], 16, root)[2] != full[2]
    assert block_hashes(ids[:48] + [7, 7], 16, root) == full


def test_namespaces_never_collide():
    roots = {namespace_root(m, a, s) for m in ("m", "n") for a in ("", "x") for s in ("", "salt")}
    assert len(roots) == 8
    assert namespace_root("ab", "c") != namespace_root("a", "bc")


def test_separate_processes_agree():
    code = ("import json,sys;from pagoda.protos.block_hash import namespace_root,block_hashes;"
            "c=json.load(open(sys.argv[1]))['cases'];"
            "print(json.dumps([[h.hex() for h in block_hashes(x['token_ids'],x['block_size'],"
            "namespace_root(x['model'],x['adapter'],x['cache_salt']))] for x in c]))")
    outs = []
    for seed in ("0", "1", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code, str(VECTORS)], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=60, check=True).stdout
        outs.append(json.loads(out))
    assert all(o == outs[0] for o in outs)
    assert outs[0] == [c["hashes"] for c in _cases()]
