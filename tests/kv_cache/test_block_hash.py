"""Block hashes are stable: the same tokens and salt hash alike in every process, and differ otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from llmserve.kv_cache.block_hash import extend_block_hashes, hash_block

TOKENS = list(range(100, 164))
PROGRAM = (
    "import json, sys\n"
    "from llmserve.kv_cache.block_hash import extend_block_hashes\n"
    "out = {}\n"
    "for salt in (None, 'tenant-a', 'é\\u2028'):\n"
    "    hashes = []\n"
    "    extend_block_hashes(hashes, list(range(100, 164)), 16, salt)\n"
    "    out[str(salt)] = [h.hex() for h in hashes]\n"
    "print(json.dumps(out))\n"
)


def test_two_processes_compute_identical_hashes() -> None:
    """Different PYTHONHASHSEEDs: Python's own hash() of a str (a salt) would differ between them."""
    runs = []
    for seed in ("1", "2"):
        done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": seed})
        runs.append(json.loads(done.stdout))
    assert runs[0] == runs[1]
    here = []
    extend_block_hashes(here, TOKENS, 16, "tenant-a")
    assert [h.hex() for h in here] == runs[0]["tenant-a"]
    assert len(set(runs[0]["None"]) | set(runs[0]["tenant-a"])) == 8  # salts never share a block


def test_a_hash_covers_the_whole_prefix_and_the_salt() -> None:
    first = hash_block(None, TOKENS[:16])
    assert hash_block(first, TOKENS[16:32]) != hash_block(hash_block(None, TOKENS[:15] + [7]), TOKENS[16:32])
    assert hash_block(None, TOKENS[:16], "a") != hash_block(None, TOKENS[:16])
    assert hash_block(None, TOKENS[:16], "") != hash_block(None, TOKENS[:16])
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])
    assert hash_block(None, TOKENS[:16]) == first and len(first) == 16
