"""Compile the FP8 kernels for the H200 (sm_90a) on a machine WITHOUT a GPU and print what the code generator
made of them: how the tiles load (16-byte cp.async in a pipeline, or plain loads), whether the dots are
wgmma or mma.sync, the FP8 conversions, shared memory, registers and spills (ptxas from the Triton wheel).

    env -u TRITON_INTERPRET python bench/fp8_compile_check.py [bf16|fp16|fp32]

No GPU time, and it catches what the interpreter cannot: a kernel that does not lower for Hopper, or tiles
that load a byte at a time because Triton cannot prove an offset aligned (linear_fp8's split offsets did,
until tl.multiple_of). Arguments are declared 16-divisible as the JIT specializes them at run time
(pointers, strides, hidden sizes); timings still need the GPU (bench_fp8.py).
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from minakv.ops import fp8_grouped, fp8_linear, fp8_moe

ALIGNED = ("K", "N", "H", "I")  # sizes the JIT sees divisible by 16 at MiniMax-M2's shapes


def compile_sm90(kernel, types: dict[str, str], constexprs: dict[str, object], **options):
    """triton.compile for sm_90a; arguments not in `types` are i32."""
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    aligned = [
        n
        for n in names
        if n not in constexprs and (signature[n][0] == "*" or n.startswith("stride") or n in ALIGNED)
    ]
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(names.index(n),): v for n, v in constexprs.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def ptxas_report(ptx: str) -> str:
    """Registers and spills, from the newest ptxas in the Triton wheel."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas = next(
        (
            os.path.join(bin_dir, n)
            for n in ("ptxas-blackwell", "ptxas")
            if os.path.exists(os.path.join(bin_dir, n))
        ),
        None,
    )
    if ptxas is None:
        return "no ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    proc = subprocess.run(
        [ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], check=False, capture_output=True, text=True
    )
    os.unlink(f.name)
    found = re.findall(r"Used (\d+) registers|(\d+) bytes spill stores", proc.stderr)
    regs = next((r for r, _ in found if r), "?")
    spills = next((s for _, s in found if s), "?")
    return f"{regs} registers, {spills} B spilled" if proc.returncode == 0 else proc.stderr.strip()[:200]


def describe(name: str, kernel) -> None:
    ptx = kernel.asm["ptx"]
    loads = collections.Counter(re.findall(r"(?:ld\.global|cp\.async\.c[ag]\.shared\.global)[a-z0-9.]*", ptx))
    dots = "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "no tensor cores"
    print(f"{name:<44} {dots:<8} shared {kernel.metadata.shared // 1024:>3} KB  {ptxas_report(ptx)}")
    print(f"{'':<44} e4m3 cvts {ptx.count('e4m3')}, loads {dict(loads)}")


def main() -> None:
    act = "*" + {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}[sys.argv[1] if len(sys.argv) > 1 else "bf16"]
    f32 = act == "*fp32"
    common = {
        "x_ptr": act,
        "w_ptr": "*fp8e4nv",
        "s_ptr": "*fp32",
        "b_ptr": act,
        "limit": "fp32",
        "alpha": "fp32",
    }
    for cfg, warps, stages in [
        ((16, 64, 128, True), 4, 4),
        ((64, 64, 128, False), 4, 4),
        ((128, 128, 64, False), 8, 3),
    ]:
        m, n, k, partial = cfg
        types = dict(common, y_ptr="*fp32" if partial else act)
        consts = {
            "HAS_BIAS": True,
            "PARTIAL": partial,
            "BLOCK_M": m,
            "BLOCK_N": n,
            "BLOCK_K": k,
            "F32_DOT": f32,
        }
        kernel = compile_sm90(fp8_linear._linear_kernel, types, consts, num_warps=warps, num_stages=stages)
        describe(f"linear {m}x{n}x{k}{' split-K' if partial else ''}", kernel)
    moe = dict(common, ids_ptr="*i64", h_ptr=act, weights_ptr="*fp32", y_ptr="*fp32", order_ptr="*i64",
               counts_ptr="*i32", starts_ptr="*i32", tile_ends_ptr="*i32")  # fmt: skip
    fused = {
        "HAS_BIAS": False,
        "PAIRS_PAD": 512,
        "BLOCK_M": 16,
        "BLOCK_N": 32,
        "BLOCK_K": 128,
        "F32_DOT": f32,
    }
    grouped = {"HAS_BIAS": False, "E_PAD": 256, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "F32_DOT": f32}
    for name, kernel, consts, warps, stages in [
        ("moe fused gate_up (512 pairs)", fp8_moe._gate_up_kernel, dict(fused, ACT=0), 4, 4),
        ("moe fused down (512 pairs)", fp8_moe._down_kernel, fused, 4, 4),
        ("moe grouped gate_up", fp8_grouped._gate_up_kernel, dict(grouped, ACT=0), 8, 3),
        ("moe grouped down", fp8_grouped._down_kernel, grouped, 8, 3),
    ]:
        describe(name, compile_sm90(kernel, moe, consts, num_warps=warps, num_stages=stages))


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET: this compiles for the GPU")
    main()
