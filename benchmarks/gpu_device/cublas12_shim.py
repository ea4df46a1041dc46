"""Build a libcublas.so.12 that forwards to CUDA 13's libcublas.so.13 (x86-64, gcc).

The faiss-gpu wheels on PyPI link CUDA 12's cuBLAS; a machine whose image has only CUDA 13
(the lent H200: torch 2.11+cu130) and no way to fetch nvidia-cublas-cu12 (400+ MB) can
still run them: libfaiss imports eight cuBLAS functions, all with the same signatures in
CUDA 13. Each exported symbol (versioned ``libcublas.so.12``, as libfaiss asks) is a
``jmp`` through a pointer that a constructor fills with ``dlsym`` from libcublas.so.13.
libcublasLt.so.12 is an empty stand-in (listed as needed, no symbols used).

Usage: python cublas12_shim.py OUT_DIR   (check the list with ``nm -D --undefined-only libfaiss.so``)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SYMBOLS = [
    "cublasCreate_v2",
    "cublasDestroy_v2",
    "cublasGemmEx",
    "cublasGemmStridedBatchedEx",
    "cublasGetMathMode",
    "cublasSetMathMode",
    "cublasSetStream_v2",
    "cublasSgemmEx",
]


def build(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    asm = [".text"]
    for s in SYMBOLS:
        asm += [f".globl {s}", f".type {s},@function", f"{s}:", f"  jmp *p_{s}(%rip)", f".size {s}, .-{s}"]
    asm.append('.section .note.GNU-stack,"",@progbits')
    c = ["#include <dlfcn.h>", "#include <stdio.h>", "#include <stdlib.h>"]
    c += [f'__attribute__((visibility("hidden"))) void *p_{s};' for s in SYMBOLS]
    c += [
        "__attribute__((constructor)) static void init(void) {",
        '  void *h = dlopen("libcublas.so.13", RTLD_NOW | RTLD_GLOBAL);',
        '  if (!h) { fprintf(stderr, "cublas12 shim: %s\\n", dlerror()); abort(); }',
    ]
    c += [
        f'  if (!(p_{s} = dlsym(h, "{s}"))) {{ fprintf(stderr, "cublas12 shim: no {s}\\n"); abort(); }}'
        for s in SYMBOLS
    ]
    c.append("}")
    (out / "tramp.S").write_text("\n".join(asm) + "\n")
    (out / "shim.c").write_text("\n".join(c) + "\n")
    (out / "cublas.map").write_text(
        "libcublas.so.12 { global: " + " ".join(s + ";" for s in SYMBOLS) + " local: *; };\n"
    )
    (out / "lt.map").write_text("libcublasLt.so.12 { global: lifemem_shim_marker; local: *; };\n")
    (out / "lt.c").write_text("int lifemem_shim_marker;\n")
    cc = ["gcc", "-shared", "-fPIC", "-O2"]
    subprocess.run(
        [
            *cc,
            "-o",
            str(out / "libcublas.so.12"),
            "-Wl,-soname,libcublas.so.12",
            f"-Wl,--version-script={out / 'cublas.map'}",
            str(out / "shim.c"),
            str(out / "tramp.S"),
            "-ldl",
        ],
        check=True,
    )
    subprocess.run(
        [
            *cc,
            "-o",
            str(out / "libcublasLt.so.12"),
            "-Wl,-soname,libcublasLt.so.12",
            f"-Wl,--version-script={out / 'lt.map'}",
            str(out / "lt.c"),
        ],
        check=True,
    )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    build(Path(sys.argv[1]))
