"""Device-code digests of every default cute kernel, built offline (no GPU needed), and their comparison with a
baseline: the proof that a change to the backend's structure left the kernels' code alone.

    python benchmarks/cubins.py --arch sm_90a [--compare BASELINE.json] [--out FILE]

The baseline is this script's ``--out`` at the revision to compare against (``revision_ab.py cubins`` does both
sides from two revisions).

Per kernel two digests and its resources: ``ptx`` (the PTX with the kernel entry names replaced by their order and
the header comments dropped) and ``code`` (the cubin's .text, .nv.info, .nv.constant0 and .nv.shared sections, names
normalised alike), so that a kernel renamed by the restructuring (the DSL names kernels after their class and
method) still compares equal; ``registers`` and ``frame`` (the stack frame in bytes, 0 without spills) are printed
and recorded, not compared. Exit status 1 when a digest differs from or is missing in the baseline.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import struct
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# (ratio, coff, head_dim): the SPEC configurations, odd head_dims, ratios 2 and 8.
CONFIGS = [
    (4, 2, 512),
    (4, 2, 128),
    (128, 1, 512),
    (128, 2, 512),
    (128, 1, 128),
    (128, 2, 128),
    (4, 2, 65),
    (4, 1, 130),
    (128, 2, 130),
    (2, 1, 128),
    (2, 2, 512),
    (8, 1, 128),
    (8, 2, 512),
]
_ENTRY = re.compile(r"\.entry\s+(\w+)")


def _renamed(text: str, names: list[str]) -> str:
    # Longest first, so that no name is replaced inside another.
    for i, name in sorted(enumerate(names), key=lambda x: -len(x[1])):
        text = text.replace(name, f"KERNEL{i}")
    return text


def _elf_sections(blob: bytes):
    """(name, type, contents) of the sections of a 64-bit little-endian ELF file."""
    shoff = struct.unpack_from("<Q", blob, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", blob, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", blob, shoff + i * shentsize) for i in range(shnum)]
    strtab = headers[shstrndx][4]
    for name, typ, _flags, _addr, off, size in headers:
        end = blob.index(b"\0", strtab + name)
        yield blob[strtab + name : end].decode(), typ, (blob[off : off + size] if typ != 8 else b"")


# .nv.info attributes (format EIFMT_SVAL): the kernel's register count and its stack frame (spills land there).
_REGCOUNT, _FRAME_SIZE = 0x2F, 0x11


def resources(cubin: bytes) -> dict:
    """Registers per thread and the largest stack frame in bytes (0 without spills) of the cubin's kernels."""
    found = {_REGCOUNT: [], _FRAME_SIZE: []}
    for name, _typ, data in _elf_sections(bytes(cubin)):
        if not name.startswith(".nv.info"):
            continue
        i = 0
        while i + 4 <= len(data):
            fmt, attr = data[i], data[i + 1]
            size = struct.unpack_from("<H", data, i + 2)[0] if fmt == 0x04 else 0
            if fmt == 0x04 and size == 8 and attr in found:
                found[attr].append(struct.unpack_from("<I", data, i + 8)[0])  # (symbol, value)
            i += 4 + size
    return {"registers": max(found[_REGCOUNT], default=0), "frame": max(found[_FRAME_SIZE], default=0)}


def digests(ptx: str, cubin: bytes) -> dict:
    names = _ENTRY.findall(ptx)
    ptx_text = "\n".join(line for line in _renamed(ptx, names).splitlines() if not line.startswith("//"))
    kept = []
    for name, _typ, data in _elf_sections(bytes(cubin)):
        name = _renamed(name, names)
        if name.startswith((".text.", ".nv.info.", ".nv.constant0.", ".nv.shared.")) or name == ".nv.info":
            kept.append((name, data))
    h = hashlib.sha256()
    for name, data in sorted(kept):
        h.update(name.encode())
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return {
        "ptx": hashlib.sha256(ptx_text.encode()).hexdigest()[:16],
        "code": h.hexdigest()[:16],
        "kernels": len(names),
        **resources(cubin),
    }


def default_kernels(arch: str):
    """(name, kernel instance) of every default kernel of CONFIGS on the architecture's default device."""
    from csa_compressor.backends.cute.configs import ForwardShortConfig
    from csa_compressor.backends.cute.device import offline_spec
    from csa_compressor.backends.cute.select import kernel_for
    from csa_compressor.windows import uses_softmax_stats

    spec = offline_spec(arch)
    for ratio, coff, head_dim in CONFIGS:
        for direction in ("forward", "backward", "forward_stats", "backward_stats"):
            if direction.endswith("_stats") and not uses_softmax_stats(ratio, coff):
                continue
            kernel_class, config = kernel_for(direction, ratio, coff, head_dim, spec)
            name = f"r{ratio}c{coff}d{head_dim}/{direction}"
            yield name, kernel_class(config)
            wide = config.wide() if isinstance(config, ForwardShortConfig) else None
            if wide is not None:
                yield f"{name}_wide", kernel_class(wide)


def build_all(arch: str) -> dict:
    from csa_compressor.backends.cute.build import compile_kernel

    result = {}
    with tempfile.TemporaryDirectory(prefix="csa_cubins_") as dump:
        for name, kernel in default_kernels(arch):
            t0 = time.perf_counter()
            compiled = compile_kernel(kernel, arch, dump_dir=dump)
            result[name] = digests(compiled.artifacts.PTX, compiled.artifacts.CUBIN)
            r = result[name]
            print(f"{name:32s} ptx {r['ptx']} code {r['code']} registers {r['registers']} frame {r['frame']} "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)  # fmt: skip
    return result


def _same(got: dict, want: dict) -> bool:
    return (got["ptx"], got["code"], got["kernels"]) == (want["ptx"], want["code"], want["kernels"])


def compare(result: dict, baseline: dict) -> list[str]:
    """Lines naming every kernel whose digests differ from the baseline's (or that only one side has)."""
    bad = []
    for name in sorted(set(result) | set(baseline)):
        got, want = result.get(name), baseline.get(name)
        if got is None or want is None:
            bad.append(f"{name}: {'missing here' if got is None else 'not in the baseline'}")
        elif not _same(got, want):
            bad.append(f"{name}: {got} != baseline {want}")
    return bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="sm_90a", help="CuTe-DSL architecture, e.g. sm_90a, sm_100a")
    parser.add_argument("--compare", help="a baseline JSON written by --out")
    parser.add_argument("--out", help="write the digests as JSON")
    opts = parser.parse_args()
    os.environ.setdefault("CUTE_DSL_ARCH", opts.arch)  # lets CuTe-DSL compile without a driver
    result = build_all(opts.arch)
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump({"arch": opts.arch, "digests": result}, f, indent=1)
    if not opts.compare:
        return 0
    with open(opts.compare) as f:
        baseline = json.load(f)
    if baseline.get("arch") != opts.arch:
        print(f"baseline is for {baseline.get('arch')}, not {opts.arch}")
        return 1
    want = baseline["digests"]
    bad = compare(result, want)
    matched = sum(1 for name in want if name in result and _same(result[name], want[name]))
    print(f"{opts.arch}: {matched}/{len(want)} kernels match the baseline ({opts.compare})")
    for line in bad:
        print("DIFFERS", line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
