"""Static sm_90 profiling without a GPU, shared by ``gemv_sass`` and ``mla_decode_sass``: compile the launchers'
kernels through ``compile_check``'s fake Hopper, keep the compiled kernels by name, disassemble each
(``cuobjdump -sass``, the Triton backend's copy) and count the instructions of its longest loop."""
from __future__ import annotations

import collections
import contextlib
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator

from benchmarks import compile_check as cc

REGS_PER_SM, SMEM_PER_SM, WARPS_PER_SM = 65536, 233472, 64


@contextlib.contextmanager
def collect_compiled(kernel_names: tuple[str, ...] | None,
                     ptxas: bool = True) -> Iterator[tuple[cc.CompileLog, list]]:
    """Install the fake Hopper (``ptxas``: with ptxas stats) and, inside the block, append ``(name, launch kwargs,
    compiled kernel)`` for every launch of a @triton.jit function named in ``kernel_names`` (None: of every one).
    Yields (log, that list). Import the launchers inside the block (after the fake Hopper is in place)."""
    log = cc.CompileLog()
    cc.install_fake_hopper(log, ptxas=ptxas)
    from triton.runtime import jit

    compiled = []
    patched = jit.JITFunction.run

    def run(self, *a, **kw):
        kernel = patched(self, *a, **kw)
        if kernel is not None and (kernel_names is None or self.__name__ in kernel_names):
            compiled.append((self.__name__, kw, kernel))
        return kernel

    jit.JITFunction.run = run
    try:
        yield log, compiled
    finally:
        jit.JITFunction.run = patched


def disassemble(kernel) -> str:
    """The SASS of one compiled kernel (``cuobjdump -sass`` next to the ptxas Triton uses for sm_90)."""
    from triton.backends.nvidia.compiler import get_ptxas

    cuobjdump = os.path.join(os.path.dirname(get_ptxas(90).path), "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        return subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout


def dump(folder: str | None, stem: str, kernel, sass: str) -> None:
    """Write the kernel's ``stem``.ttgir / .ptx / .sass into ``folder`` (nothing when folder is None)."""
    if not folder:
        return
    os.makedirs(folder, exist_ok=True)
    for ext, text in (("ttgir", kernel.asm["ttgir"]), ("ptx", kernel.asm["ptx"]), ("sass", sass)):
        with open(os.path.join(folder, f"{stem}.{ext}"), "w") as f:
            f.write(text)


def _loops(sass: str) -> list[list[str]]:
    """The instructions of each loop of a kernel's SASS: the span of each backward branch."""
    ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    spans = []
    for addr, text in ins:
        target = re.search(r"BRA\b.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            spans.append([t for a, t in ins if int(target.group(1), 16) <= a <= addr])
    return spans


def sass_loop(sass: str) -> list[str]:
    """The instructions of the longest loop (the span of the longest backward branch)."""
    return max(_loops(sass), key=len, default=[])


def mma_loop(sass: str, min_len: int = 100) -> list[str]:
    """The instructions of the shortest loop (backward-branch span) of at least ``min_len`` instructions that issues
    tensor-core ops: the tile loop of a warp-specialized kernel, whose longest span covers the other partition's
    waits too."""
    spans = [body for body in _loops(sass)
             if len(body) >= min_len and any(opcode(t) in ("HMMA", "HGMMA", "QMMA", "QGMMA") for t in body)]
    return min(spans, key=len, default=[])


def opcode(text: str) -> str:
    """'@!P0 LDG.E.128 R4, ...' -> 'LDG'."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def programs_per_sm(regs: int, smem: int, warps: int) -> int:
    regs_per_warp = -(-regs // 8) * 8 * 32
    return min(REGS_PER_SM // (regs_per_warp * warps), SMEM_PER_SM // (smem + 1024), WARPS_PER_SM // warps)


def loop_profile(log: cc.CompileLog, kernel, warps: int, folder: str | None = None, stem: str = "k",
                 loop=sass_loop):
    """Disassemble one kernel (dumped to ``folder`` when given) and profile one loop (``loop``: the longest by
    default). Returns (loop instructions, opcode counts (``Counter``), registers, spill bytes, programs per SM;
    ``warps``: the kernel's warps, for the last)."""
    sass = disassemble(kernel)
    dump(folder, stem, kernel, sass)
    body = loop(sass)
    regs, spills = log.ptxas[kernel.metadata.hash]
    return body, collections.Counter(opcode(t) for t in body), regs, spills, programs_per_sm(
        regs or 255, kernel.metadata.shared, warps)
