"""Disaggregated prefill and decode between servers: a prefill instance's prompt KV pulled by a decode instance.

Why this shape (vLLM's `kv_transfer_params` names, its "decode pulls" order): the gateway (or any caller) sends a
request to a prefill instance with `kv_transfer_params: {"do_remote_decode": true}` and `max_tokens: 1`; the prompt's
full blocks stay in that instance's prefix cache as any finished request's do. It then sends the request itself to a
decode instance with `{"do_remote_prefill": true, "remote_url": <the prefill instance>}`: before admitting it, the
decode instance asks the prefill instance for the prompt's blocks by their hashes (`POST /v1/kv/blocks`) and writes
them into its own prefix cache (kv_cache/kv_transfer.py), so its first step computes only the prompt's last partial
block. The bytes come as the answer's body (TCP, between any two hosts), or, when the prefill instance is on this
host (a loopback address), in a shared-memory file the prefill instance writes and the decode instance reads and
removes (`SharedFiles`: one copy each side, no socket). A pull that fails (an instance gone, a block evicted,
another format) is logged and counted, and the prompt is computed here: slower, never wrong, and no block is held
anywhere in between.

`--role` says which half an instance serves: `prefill` answers pulls and refuses to pull, `decode` pulls and answers
none, `both` (the default) does either.
"""

from __future__ import annotations

import asyncio
import collections
import http.client
import ipaddress
import json
import logging
import os
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from llmserve.engine.async_engine import AsyncLLM, EngineDeadError
from llmserve.kv_cache.kv_transfer import KVFormat, KVFormatError
from llmserve.server.errors import APIError
from llmserve.server.metrics import ServerMetrics
from llmserve.server.protocol import KVBlocksRequest, KVTransferParams

FORMAT_HEADER = "x-llmserve-kv-format"  # the blocks' KVFormat, as JSON
BLOCKS_HEADER = "x-llmserve-kv-blocks"  # how many blocks the body holds
SHM_HEADER = "x-llmserve-kv-shm"  # the shared-memory file that holds them instead of the body
SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "llmserve-kv-"
SHM_LIFETIME_S = 60.0  # a file its asker never took (it died) is removed by its writer after this
# instance to instance, never through an HTTP proxy the environment names for outside traffic
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))

logger = logging.getLogger(__name__)


@dataclass
class SharedFiles:
    """The prefill side's shared-memory files: written for an asker on this host, which reads and removes each; one
    it never took (it died between the answer and the read) is removed here once older than `SHM_LIFETIME_S`."""

    written: collections.deque[tuple[float, Path]] = field(default_factory=collections.deque)

    @staticmethod
    def available() -> bool:
        return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)

    def write(self, payload: bytes) -> Path:
        self.sweep()
        with tempfile.NamedTemporaryFile(dir=SHM_DIR, prefix=SHM_PREFIX, delete=False) as f:
            f.write(payload)
        path = Path(f.name)
        self.written.append((time.monotonic(), path))
        return path

    def sweep(self, max_age_s: float = SHM_LIFETIME_S) -> None:
        while self.written and time.monotonic() - self.written[0][0] > max_age_s:
            self.written.popleft()[1].unlink(missing_ok=True)


def take_shared_file(name: str) -> bytes:
    """A shared-memory file's bytes, the file removed: only one of ours (SHM_DIR, SHM_PREFIX), whatever a sender
    names."""
    path = Path(name)
    if path.parent != SHM_DIR or not path.name.startswith(SHM_PREFIX) or path.is_symlink():
        raise KVFormatError(f"{name!r} is not a KV transfer file")
    with open(path, "rb") as f:
        path.unlink()
        return f.read()


def on_this_host(url: str) -> bool:
    """Whether `url` names a loopback address (the sender shares this host's /dev/shm)."""
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class KVTransfer:
    """This server's half of the hand-off: its role, and how it reaches a prefill instance (its own API key, which
    a deployment's instances share; `timeout_s` for one pull)."""

    llm: AsyncLLM
    metrics: ServerMetrics
    role: str = "both"
    api_key: str | None = None
    timeout_s: float = 30.0
    shared: SharedFiles = field(default_factory=SharedFiles)

    def check(self, params: KVTransferParams | None) -> str | None:
        """The prefill instance to pull the prompt from (None: none); 400 for what this role does not do."""
        if params is None or not (params.do_remote_decode or params.do_remote_prefill):
            return None
        self._check_one_process()
        if params.do_remote_decode and self.role == "decode":
            raise APIError(400, "this server's role is decode: it does not prefill for another instance",
                           param="kv_transfer_params")
        if not params.do_remote_prefill:
            return None
        if self.role == "prefill":
            raise APIError(400, "this server's role is prefill: it does not decode from another instance's KV",
                           param="kv_transfer_params")
        url = params.remote_url
        if not url or not url.startswith(("http://", "https://")):
            raise APIError(400, "kv_transfer_params.remote_url: the prefill instance's http(s) URL is required with "
                           "do_remote_prefill", param="kv_transfer_params")
        return url.rstrip("/")

    async def export(self, body: KVBlocksRequest) -> tuple[dict[str, str], bytes]:
        """The leading run of the named blocks this instance holds (`POST /v1/kv/blocks`): the answer's headers and
        body (empty where a shared-memory file holds the bytes)."""
        self._check_one_process()
        try:
            hashes = [bytes.fromhex(h) for h in body.block_hashes]
        except ValueError:
            raise APIError(400, "block_hashes: hexadecimal strings", param="block_hashes") from None
        count, payload = await self.llm.between_steps(lambda engine: engine.export_kv(hashes, body.token_ids))
        self.metrics.kv_blocks("export", count)
        headers = {FORMAT_HEADER: self.llm.engine.kv_format.to_json(), BLOCKS_HEADER: str(count)}
        if body.transport == "shm" and payload and self.shared.available():
            path = await asyncio.to_thread(self.shared.write, payload)
            return {**headers, SHM_HEADER: str(path)}, b""
        return headers, payload

    def _check_one_process(self) -> None:
        if self.llm.engine.config.parallel.world_size > 1:
            raise APIError(400, "KV blocks move to or from one process's cache: this server runs parallel ranks",
                           param="kv_transfer_params")

    async def pull(self, url: str, prompts: list[list[int]], cache_salt: str | None) -> None:
        """Each prompt's blocks this instance lacks, from the prefill instance at `url`, into the prefix cache; a
        failure only logged and counted (the prompt is then computed here)."""
        for ids in {tuple(p): p for p in prompts}.values():
            start = time.perf_counter()
            try:
                await self._pull_one(url, ids, cache_salt)
            except EngineDeadError:
                raise
            except (OSError, http.client.HTTPException, KVFormatError, ValueError) as e:
                reason = "format" if isinstance(e, KVFormatError) else "transfer"
                logger.warning("KV pull from %s failed, the prompt is computed here: %s: %s", url,
                               type(e).__name__, e)
                self.metrics.kv_pull(time.perf_counter() - start, reason)
            else:
                self.metrics.kv_pull(time.perf_counter() - start)

    async def _pull_one(self, url: str, ids: list[int], cache_salt: str | None) -> None:
        engine = self.llm.engine
        hashes = engine.prompt_block_hashes(ids, cache_salt)
        bs = engine.plan.kv_cache.block_size
        pool = engine.kv_cache.pool
        # blocks held here already (read without the engine: a stale answer only moves a block more or less; the
        # import checks again)
        have = next((i for i, h in enumerate(hashes) if pool.lookup(h, tuple(ids[i * bs:(i + 1) * bs])) is None),
                    len(hashes))
        if have == len(hashes):
            return
        wanted, tokens = hashes[have:], ids[have * bs:len(hashes) * bs]
        body = json.dumps({"block_hashes": [h.hex() for h in wanted], "token_ids": tokens,
                           "transport": "shm" if on_this_host(url) else "tcp"}).encode()
        sent, count, payload = await asyncio.to_thread(self._post, url + "/v1/kv/blocks", body)
        written = await self.llm.between_steps(
            lambda engine: engine.import_kv(sent, count, payload, wanted, tokens))
        self.metrics.kv_blocks("import", written)
        if count < len(wanted):
            logger.info("KV pull from %s: %d of the prompt's %d blocks held there, the rest computed here", url,
                        have + count, len(hashes))

    def _post(self, url: str, body: bytes) -> tuple[KVFormat, int, bytes]:
        """One pull's HTTP round trip (a worker thread's: the body is read whole before anything is written)."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")
        with _DIRECT.open(request, timeout=self.timeout_s) as response:
            sent = KVFormat.from_json(response.headers.get(FORMAT_HEADER, ""))
            count = int(response.headers.get(BLOCKS_HEADER, "-1"))
            shared = response.headers.get(SHM_HEADER)
            payload = take_shared_file(shared) if shared else response.read()
        if count < 0:
            raise KVFormatError(f"{url} sent no {BLOCKS_HEADER}")
        return sent, count, payload
