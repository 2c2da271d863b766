"""Native CPU kernels for the engine's hot path, built once on the machine that runs them.

They are compiled with `torch.utils.cpp_extension` for this CPU (`-march=native`) at setup time
(`python -m llmserve.kernels`, run by `scripts/setup.sh`) and cached, so the engine only loads a
shared library. Where no compiler is available the engine runs the pure-PyTorch path instead, which
the tests keep equal to the kernels on the same inputs.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path

import torch

from llmserve.host import cpu_flags
from llmserve.kernels.fp8_gemv import register_fakes as register_fp8_gemv_fakes
from llmserve.kernels.int8_gemm import register_fakes as register_int8_gemm_fakes
from llmserve.kernels.quantized_gemv import register_fakes as register_quantized_gemv_fakes

logger = logging.getLogger(__name__)

_SOURCES = [
    Path(__file__).with_name(name)
    for name in ("paged_attention.cpp", "paged_attention_quantized.cpp", "quantized_gemv.cpp", "activation_quant.cpp",
                 "int8_gemm.cpp", "fused_elementwise.cpp", "argmax.cpp", "decode_layer.cpp", "grid_levels.cpp",
                 "ggml_decode.cpp", "pack_layouts.cpp", "fp8_gemv.cpp")
]


# included by the sources: torch's build cache versions sources and flags only, so their text goes into a flag
_HEADERS = [Path(__file__).with_name(name) for name in ("simd_exp.h", "attention_common.h", "elementwise.h", "team.h")]


_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
_LIBRARY = "llmserve_cpu_kernels"
_FINISHED = "finished"  # marks a build directory whose library loaded
# A build takes about a minute here (three under load). torch's build lock is a bare file its builder
# removes when done: a build that was killed leaves it, and every later start would wait on it forever.
STALE_BUILD_LOCK_S = 600.0


def build_directory() -> Path:
    """Where the compiled library lives: one per torch version, CPU feature set and kernel sources. A cache
    shared between hosts (a home directory on several machines, an image built on another CPU) must never
    hand a library built with `-march=native` for AMX or AVX-512 to a CPU without them: it would die on
    its first instruction. An upgrade or an edited kernel gets a directory of its own too."""
    root = Path(os.environ.get("LLMSERVE_KERNEL_CACHE", Path.home() / ".cache" / "llmserve" / "kernels"))
    path = root / f"torch-{torch.__version__}-{_build_key()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _build_key() -> str:
    """A digest of what the build depends on beside torch: the CPU's features, the sources, the flags."""
    digest = hashlib.sha256(" ".join(sorted(cpu_flags())).encode())
    for source in (*_SOURCES, *_HEADERS):
        digest.update(source.read_bytes())
    digest.update(" ".join(_CFLAGS).encode())
    return digest.hexdigest()[:16]


@functools.cache
def load_cpu_kernels() -> bool:
    """Build (first call on a machine) and load the kernels, or load a finished build as it is; registers
    `torch.ops.llmserve.*`. Returns False, with the reason logged, where they cannot be built: callers fall
    back to PyTorch."""
    from torch.utils import cpp_extension

    directory = build_directory()
    library = finished_build(directory)
    if library is not None:
        try:
            torch.ops.load_library(str(library))
        except OSError as exc:  # damaged since: build it again
            logger.warning("rebuilding the native CPU kernels: %s did not load: %s", library, exc)
            (directory / _FINISHED).unlink(missing_ok=True)
            library = None
    try:
        if library is None:
            clear_stale_build_lock(directory)
            library = cpp_extension.load(
                name=_LIBRARY,
                sources=[str(s) for s in _SOURCES],
                # the headers' digest: torch's build cache versions sources and flags only
                extra_cflags=[*_CFLAGS, f"-DLLMSERVE_HEADERS={_headers_digest()}"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                is_python_module=False,
                verbose=False,
            )
            mark_finished(directory, Path(library))
    except Exception as exc:  # no compiler, no ninja, a read-only cache: every one means "use PyTorch"
        logger.warning("native CPU kernels unavailable, using PyTorch's attention and quantized kernels: %s", exc)
        return False

    # shapes for torch.compile, which keeps both ops inside its graphs
    @torch.library.register_fake("llmserve::paged_decode_attention")
    def _(q, k_cache, v_cache, block_table, context_lens, scale, window=0):
        return torch.empty_like(q)

    @torch.library.register_fake("llmserve::write_kv")
    def _(k, v, k_cache, v_cache, slots):
        return None

    @torch.library.register_fake("llmserve::quantize_activations_u8")
    def _(x, smooth_inv):
        return x.new_empty(x.shape, dtype=torch.uint8), x.new_empty(x.shape[0], 1, dtype=torch.float32)

    register_quantized_gemv_fakes()
    register_int8_gemm_fakes()
    register_fp8_gemv_fakes()
    return True


def finished_build(directory: Path) -> Path | None:
    """The library a finished build left in `directory`, or None. The directory's name is a digest of all the
    build depends on, so a library there is current; loading it directly skips ninja, which rebuilds whenever
    the sources' files are newer than its objects (a fresh checkout of unchanged sources: a minute at start)."""
    try:
        library = directory / (directory / _FINISHED).read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return library if library.is_file() and library.parent == directory else None


def mark_finished(directory: Path, library: Path) -> None:
    """Record that `directory`'s build finished and which file it made (written after the library loaded, by a
    rename: a killed build leaves no mark, and the next start builds again)."""
    partial = directory / f"{_FINISHED}.{os.getpid()}"
    partial.write_text(f"{library.name}\n")
    partial.replace(directory / _FINISHED)


def clear_stale_build_lock(directory: Path, stale_after_s: float = STALE_BUILD_LOCK_S) -> bool:
    """Remove `directory`'s build lock if it is older than any build takes (a killed build's). Returns
    whether it removed one."""
    lock = directory / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age <= stale_after_s:
        return False
    logger.warning("removing a kernel build lock left %.0f s ago by a build that did not finish: %s", age, lock)
    lock.unlink(missing_ok=True)
    return True


def _headers_digest() -> str:
    return hashlib.sha256(b"".join(h.read_bytes() for h in _HEADERS)).hexdigest()[:16]


def built_cpu_kernels() -> bool:
    """`load_cpu_kernels` where a finished build is on disk (or they are loaded already), else False without
    building: for callers that only save time with them and should not wait a minute for a build (the loader)."""
    if load_cpu_kernels.cache_info().currsize or finished_build(build_directory()) is not None:
        return load_cpu_kernels()
    return False


def native_op(name: str, tensor: torch.Tensor, native: bool | None = None):
    """`torch.ops.llmserve.<name>` for a CPU tensor where a finished build is loaded (`built_cpu_kernels`), else None:
    the caller's PyTorch ops give the same values. `native`: force either way (tests)."""
    if tensor.device.type != "cpu" or not (built_cpu_kernels() if native is None else native):
        return None
    return getattr(torch.ops.llmserve, name)


def native_quantized_kernels() -> bool:
    """Whether small quantized steps should run on the native kernels: built, and vectorized for this CPU
    (AVX-512 VNNI, or AVX2 with FMA and F16C); elsewhere PyTorch's own kernels are faster than the portable loops."""
    return load_cpu_kernels() and torch.ops.llmserve.quantized_gemv_vectorized()


def amx_int8_gemm() -> bool:
    """Whether the int8-activation path's products can run on our AMX kernel: built with AMX for this CPU,
    and the kernel granted the tile state."""
    return load_cpu_kernels() and torch.ops.llmserve.int8_gemm_amx_available()
