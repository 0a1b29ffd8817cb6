"""Checks on a kernel's PTX that catch performance bugs the compiler does not report.

``loop_copies_of_loads(ptx)``: for every loop (a backward branch) that issues global loads, how many ``mov.b32``
in the loop copy a register that a global load of the same loop writes. Such a copy is what an out-of-SSA pass
emits for a loop-carried register ring whose old value is still live when its refill is issued. On the GPU a
copy of a register with a load in flight waits for that load, so a "ring" of depth D then stalls a warp for a
full memory round trip every D steps. ``moe_mxfp4_experts`` v3 had 40-80 per loop; v4 has none (its version log).

Use: ``loop_copies_of_loads(compiled_ptx(lambda: build(options="--enable-tvm-ffi --keep-ptx")))``.

``serial_loads(sass)``: global loads placed behind a conditional branch or a global store in the SASS, the two
patterns that serialised the router's top-k (session 6). ``code_sizes`` records it for every decode kernel.
"""
from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from typing import Any, Callable


def compiled_ptx(compile_fn: Callable[[], Any]) -> str:
    """Run ``compile_fn`` (a cute.compile with ``--keep-ptx``) and return its PTX text. --keep-ptx also writes a
    .ptx file into the DSL's dump directory (fixed when cutlass is imported, the working directory by default);
    for the duration of the call it points at a scratch directory instead, so nothing lands in the tree."""
    from ..kernels._dsl import import_cute
    import_cute()
    from cutlass.cutlass_dsl import CuTeDSL
    env = CuTeDSL._get_dsl().envar
    old = env.dump_dir
    with tempfile.TemporaryDirectory() as d:
        env.dump_dir = d
        try:
            return compile_fn().artifacts.PTX
        finally:
            env.dump_dir = old

_LABEL = re.compile(r"^\$(L__BB\d+_\d+):")
_BRANCH = re.compile(r"bra(?:\.uni)?\s+\$(L__BB\d+_\d+);")
_LOAD = re.compile(r"ld\.global[^\s]*\s+(\{[^}]*\}|%r\d+)")
_COPY = re.compile(r"\s*mov\.b32\s+%r\d+,\s*(%r\d+);")


@dataclass(frozen=True)
class LoopStat:
    label: str
    instructions: int
    global_loads: int
    copies_of_loads: int


def _loops(ptx: str):
    """(label, body lines) of every loop: the lines from a label to a later branch back to it."""
    lines = ptx.split("\n")
    labels = {}
    for i, line in enumerate(lines):
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = i
    for i, line in enumerate(lines):
        m = _BRANCH.search(line)
        if m and labels.get(m.group(1), i + 1) < i:
            yield m.group(1), lines[labels[m.group(1)]:i + 1]


def loop_copies_of_loads(ptx: str) -> list[LoopStat]:
    out = []
    for label, body in _loops(ptx):
        loaded = set()
        n_loads = 0
        for x in body:
            lm = _LOAD.search(x)
            if lm:
                n_loads += 1
                loaded.update(re.findall(r"%r\d+", lm.group(1)))
        if not n_loads:
            continue
        copies = sum(1 for x in body if (cm := _COPY.match(x)) and cm.group(1) in loaded)
        instr = sum(1 for x in body if x.strip() and not x.strip().startswith(("//", "$")))
        out.append(LoopStat(label, instr, n_loads, copies))
    return out


def loop_opcodes(ptx: str, min_loads: int = 8) -> dict[str, dict[str, int]]:
    """{label: {opcode: count}} for every loop with at least ``min_loads`` global loads (the opcode is the
    instruction's first dotted word, predicates stripped): where a loop's instructions go, e.g. how many of the
    experts kernel's FC1 step are decode (prmt, and, shl, or) against loads and MMAs."""
    out = {}
    for label, body in _loops(ptx):
        ops: dict[str, int] = {}
        for x in body:
            t = x.strip()
            if not t or t.startswith(("//", "$", "{", "}", ".")):
                continue
            t = re.sub(r"^@!?%p\d+\s+", "", t)
            op = re.split(r"[\s.;]", t, maxsplit=1)[0]
            ops[op] = ops.get(op, 0) + 1
        if sum(1 for x in body if _LOAD.search(x)) >= min_loads:
            out[label] = dict(sorted(ops.items(), key=lambda kv: -kv[1]))
    return out


def find_sass_tools() -> tuple[str, str] | None:
    """(ptxas, nvdisasm) to turn PTX into SASS on this machine: $K3_PTXAS / $K3_NVDISASM, else the ones on PATH,
    else the pair shipped in an importable Triton wheel (triton/backends/nvidia/bin). None when there is no pair."""
    import importlib.util
    import os
    import shutil
    ptxas, nvdis = os.environ.get("K3_PTXAS"), os.environ.get("K3_NVDISASM")
    if ptxas and nvdis:
        return ptxas, nvdis
    if shutil.which("ptxas") and shutil.which("nvdisasm"):
        return shutil.which("ptxas"), shutil.which("nvdisasm")
    spec = importlib.util.find_spec("triton")
    if spec and spec.submodule_search_locations:
        d = os.path.join(list(spec.submodule_search_locations)[0], "backends", "nvidia", "bin")
        if os.path.exists(os.path.join(d, "ptxas")) and os.path.exists(os.path.join(d, "nvdisasm")):
            return os.path.join(d, "ptxas"), os.path.join(d, "nvdisasm")
    return None


def _ptxas_version(ptxas: str) -> str:
    import subprocess
    return subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout


def _lower_version(ptx: str, ptxas: str, version: str | None = None) -> str:
    m = re.search(r"release (\d+)\.(\d+)", version or _ptxas_version(ptxas))
    # the PTX ISA each ptxas release reads; the DSL emits a newer one (9.4 with cutlass 4.8.1). 13.0 was missing
    # until session 24, when ptxas_resources failed on a machine with CUDA 13.0's ptxas
    isa = {(13, 0): "9.0", (12, 9): "8.8", (12, 8): "8.7"}.get((int(m.group(1)), int(m.group(2))) if m else (0, 0))
    return re.sub(r"^\.version \S+", f".version {isa}", ptx, count=1, flags=re.M) if isa else ptx


def _assemble(ptx: str, ptxas: str, arch: str, nvdisasm: str | None = None, disasm_args: tuple = (),
              version: str | None = None) -> tuple[str, str | None]:
    """ptxas -O3 -v on the PTX (its .version lowered to what this ptxas reads; the code is unchanged): (the -v report,
    the SASS listing from nvdisasm with ``disasm_args`` when ``nvdisasm`` is given, else None)."""
    import subprocess
    with tempfile.TemporaryDirectory() as d:
        src, cub = f"{d}/k.ptx", f"{d}/k.cubin"
        with open(src, "w") as f:
            f.write(_lower_version(ptx, ptxas, version))
        err = subprocess.run([ptxas, f"-arch={arch}", "-O3", "-v", src, "-o", cub],
                             check=True, capture_output=True, text=True).stderr
        sass = None if nvdisasm is None else subprocess.run([nvdisasm, *disasm_args, cub], check=True,
                                                            capture_output=True, text=True).stdout
    return err, sass


def ptxas_resources(ptx: str, ptxas: str, arch: str = "sm_90a") -> dict:
    """Registers and spill bytes that ``ptxas -v`` reports for the PTX's kernel."""
    err, _ = _assemble(ptx, ptxas, arch)
    regs = re.search(r"Used (\d+) registers", err)
    spill = re.search(r"(\d+) bytes spill stores", err)
    return {"registers": int(regs.group(1)) if regs else None, "spill_store_bytes": int(spill.group(1)) if spill else 0}


def sass_loop_opcodes(ptx: str, tools: tuple[str, str], arch: str = "sm_90a", min_loads: int = 4) -> dict:
    """{label: {opcode: count}} of every SASS loop (a backward branch) with at least ``min_loads`` LDG: the
    instructions the GPU issues, after ptxas has fused, rematerialised and scheduled (the PTX counts above are
    before). The PTX's .version is lowered to what this ptxas reads; the code is unchanged. Also returns the ptxas
    version line under the key "ptxas"."""
    ptxas, nvdis = tools
    full = _ptxas_version(ptxas)
    version = full.strip().splitlines()[-1]
    _, sass = _assemble(ptx, ptxas, arch, nvdis, version=full)
    ins, labels = [], {}
    for line in sass.split("\n"):
        lm = re.match(r"^(\.L_x_\d+):", line.strip())
        if lm:
            labels[lm.group(1)] = len(ins)
            continue
        im = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if im:
            ins.append(im.group(1))
    out = {"ptxas": version}
    for i, t in enumerate(ins):
        bm = re.search(r"BRA\s+`\((\.L_x_\d+)\)", t)
        if bm and labels.get(bm.group(1), i + 1) < i:
            ops: dict[str, int] = {}
            for x in ins[labels[bm.group(1)]:i + 1]:
                op = re.sub(r"^@!?U?P[T\d]+\s+", "", x).split()[0].split(".")[0]
                ops[op] = ops.get(op, 0) + 1
            if ops.get("LDG", 0) >= min_loads:
                out[bm.group(1)] = dict(sorted(ops.items(), key=lambda kv: -kv[1]))
    return out


def serial_loads(sass: str) -> dict:
    """Global loads that, in program order, come after a conditional branch or after a global store with no other
    global load in between. ptxas issues a load neither above a branch nor above a store to memory it cannot prove
    disjoint, so in straight-line code each such load waits for what precedes it: one more round trip. Session 6
    found two of these chains by reading the SASS: the router top-k's 28 logit loads, each behind the previous
    sigmoid's division branch (~14 us), and the z copy's load / store / load pairs. A static count: inside a loop
    the same pattern costs one round trip per iteration, and a branch that only guards the last iteration's
    remainder costs little. Read it as a list of places to look, not as time.

    ``loads_behind_use``: loads that come after an instruction reading an earlier load's destination register,
    with no branch or store between. The reading instruction waits for that load's data, so the later load is
    issued a round trip late. This is how ptxas scheduled rms_gemv's FMA loop before its v6: 4 loads, the first
    vector's FMAs, then 3 more loads. In a software-pipelined loop that consumes one register stage while the
    next is in flight (moe_tail's SwapAbGemv), every load counts here by design: the count flags, it does not
    judge."""
    behind_branch = behind_store = behind_use = 0
    saw_branch = saw_store = saw_use = False
    pending: set[int] = set()          # registers written by global loads not yet read
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if not m:
            continue
        ins = m.group(1)
        if re.search(r"@!?U?P\w*\s+BRA\b", ins):
            saw_branch = True
        elif re.search(r"\bSTG\b", ins):
            saw_store = True
        ld = re.match(r"(?:@!?P\w+\s+)?LDG\S*\s+R(\d+),\s*(.*)", ins)
        srcs = {int(r) for r in re.findall(r"\bR(\d+)\b", ld.group(2) if ld else ins.split(",", 1)[-1] if "," in ins else "")}
        if pending & srcs:
            saw_use = True
            pending -= srcs
        if ld:
            behind_branch += saw_branch
            behind_store += saw_store and not saw_branch
            behind_use += saw_use and not (saw_branch or saw_store)
            saw_branch = saw_store = saw_use = False
            width = {"64": 2, "128": 4}.get(re.search(r"LDG\S*?(?:\.(64|128))?\s", ins).group(1), 1)
            pending |= set(range(int(ld.group(1)), int(ld.group(1)) + width))
    return {"loads_behind_branch": behind_branch, "loads_behind_store": behind_store, "loads_behind_use": behind_use}


def sass_size(ptx: str, tools: tuple[str, str], arch: str = "sm_90a") -> dict:
    """SASS instructions (16 B each), registers and local-memory instructions of the PTX's kernel. Straight-line code
    that one warp runs once is fetched from a cold instruction cache (the replays' L2 flush evicts it too), so the
    code size of a latency-bound stage is a cost of its own (router_down_topk v2.4)."""
    err, sass = _assemble(ptx, tools[0], arch, tools[1], ("-c",))
    ins = [line for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line)]
    regs = re.search(r"Used (\d+) registers", err)
    return {"sass_instructions": len(ins), "code_kb": round(len(ins) * 16 / 1024, 1),
            "registers": int(regs.group(1)) if regs else None,
            "local_memory_instructions": sum(1 for line in ins if "LDL" in line or "STL" in line),
            "spill_store_bytes": int(m.group(1)) if (m := re.search(r"(\d+) bytes spill stores", err)) else 0,
            "global_loads": sum(1 for line in ins if re.search(r"\bLDG\b", line)), **serial_loads(sass)}


_ISSUE = (("ld.global", "L"), ("fma", "f"), ("mma", "m"), ("bra", "|"), ("@", "|"))


def code_sizes(tools: tuple[str, str]) -> list[dict]:
    """sass_size of every kernel of the fused KDA+MoE decode step at k3_rank(16), batch 1 (and the router front at
    the b8 bucket and as TopkFromLogits, unrolled and rolled)."""
    from contextlib import contextmanager

    from ..kernels import kda_conv_gate_step as kda
    from ..kernels import moe_mxfp4_experts as mx
    from ..kernels import moe_tail
    from ..kernels import oproj_attnres as oa
    from ..kernels import rms_gemv
    from ..kernels import rms_gemv_ring
    from ..kernels import router_down_topk as rdt
    from ..kernels._dsl import TVM_FFI
    from k3ref import k3_rank
    cfg = k3_rank(16)

    @contextmanager
    def keep_ptx(*mods):
        old = [m.TVM_FFI for m in mods]
        for m in mods:
            m.TVM_FFI = TVM_FFI + " --keep-ptx"
        try:
            yield
        finally:
            for m, o in zip(mods, old):
                m.TVM_FFI = o

    builds = [("attnres_rms_gemv (fused in_proj)", "M=1", lambda: rms_gemv.fused_ptx(3216)),
              ("attnres_rms_gemv (fused in_proj, v3 G=2)", "M=1", lambda: rms_gemv.fused_ptx(3216, G=2)),
              ("attnres_rms_gemv (fused in_proj, v3 G=2)", "M=2", lambda: rms_gemv.fused_ptx(3216, M=2, G=2)),
              ("attnres_rms_gemv (fused in_proj, v6 pinned)", "M=1", lambda: rms_gemv.fused_ptx(3216, pin=True)),
              ("attnres_rms_gemv (fused in_proj, v6 pinned)", "M=2", lambda: rms_gemv.fused_ptx(3216, M=2, pin=True)),
              ("attnres_rms_gemv_ring (the in_proj at M <= 2 since session 16)", "M=1",
               lambda: rms_gemv_ring.ring_ptx(3216)),
              ("attnres_rms_gemv_ring (the in_proj at M <= 2 since session 16)", "M=2",
               lambda: rms_gemv_ring.ring_ptx(3216, M=2))]
    with keep_ptx(kda, oa, moe_tail, rdt):
        kkey = kda.compile_key(cfg.kda_heads, 1, kda.choose_nsplit(1, cfg.kda_heads))
        _, kp, nb, tg = oa.compile_key(768, 1, 1)
        inter = 384
        builds += [
            ("kda_conv_gate_step", "M=1 T=1", lambda: compiled_ptx(lambda: kda._compile(kkey))),
            ("kda_conv_gate_step v3 (proj preloaded)", "M=1 T=1",
             lambda: compiled_ptx(lambda: kda._compile(kkey + ("early_trigger", "preload")))),
            ("kda_conv_gate_step v3 (proj preloaded; nsplit 4, not used)", "M=64 T=1",
             lambda: compiled_ptx(lambda: kda._compile(kda.compile_key(cfg.kda_heads, 1, 4) + ("early_trigger", "preload")))),
            ("kda_conv_gate_step v5 (the default: write-backs after the last cluster barrier)", "M=1 T=1",
             lambda: compiled_ptx(lambda: kda._compile(kkey + ("early_trigger", "preload", "late_stores")))),
            ("kda_conv_gate_step v5 (nsplit 4)", "M=64 T=1",
             lambda: compiled_ptx(lambda: kda._compile(kda.compile_key(cfg.kda_heads, 1, 4) + ("early_trigger", "late_stores")))),
            ("kda_conv_gate_step v6 (st.async exchanges, the default since session 10)", "M=1 T=1",
             lambda: compiled_ptx(lambda: kda._compile(kkey + ("early_trigger", "preload", "late_stores", "dsmem_tx")))),
            ("oproj_attnres", "M=1", lambda: compiled_ptx(lambda: oa._compile(kp, nb, tg))),
            ("oproj_attnres v1.2 (w_post preloaded)", "M=1", lambda: compiled_ptx(lambda: oa._compile(kp, nb, tg, True))),
            ("oproj_attnres", "M=1 n_blocks=8", lambda: compiled_ptx(lambda: oa._compile(kp, 8, tg))),
            ("oproj_attnres v1.2 (w_post preloaded)", "M=1 n_blocks=8",
             lambda: compiled_ptx(lambda: oa._compile(kp, 8, tg, True))),
            ("shared_expert_gate_up", "M=1", lambda: compiled_ptx(lambda: moe_tail._build_gate_up(moe_tail.n_tiles(1), inter))),
            ("moe_mxfp4_experts v7 (the default at M <= 2)", "M=1", lambda: compiled_ptx(lambda: mx._compile(
                mx.compile_key(896, 3584, 256, 1), options=TVM_FFI + " --keep-ptx"))),
            ("moe_mxfp4_experts v4", "M=1", lambda: compiled_ptx(lambda: mx._compile(
                mx.compile_key(896, 3584, 256, 1, version=4), options=TVM_FFI + " --keep-ptx"))),
            ("moe_mxfp4_experts v6", "M=1", lambda: compiled_ptx(lambda: mx._compile(
                mx.compile_key(896, 3584, 256, 1, version=6), options=TVM_FFI + " --keep-ptx"))),
            ("moe_mxfp4_experts v7 with the counting sort (route1 off; the default until session 11)", "M=1",
             lambda: compiled_ptx(lambda: mx._compile(mx.compile_key(896, 3584, 256, 1, route_direct=False),
                                                      options=TVM_FFI + " --keep-ptx"))),
            ("moe_tail v1 (register stages)", "M=1",
             lambda: compiled_ptx(lambda: moe_tail._build_tail(moe_tail.n_tiles(1), inter))),
            ("moe_tail v5 (ring of 2, the default since session 10)", "M=1",
             lambda: compiled_ptx(lambda: moe_tail._build_tail(moe_tail.n_tiles(1), inter, 2))),
            ("moe_tail v5 (ring of 3)", "M=1",
             lambda: compiled_ptx(lambda: moe_tail._build_tail(moe_tail.n_tiles(1), inter, 3))),
        ]
        for rolled in (False, True):
            tag = "rolled" if rolled else "unrolled"
            builds += [
                (f"router_down_topk ({tag} top-k)", "M=1 (FMA)",
                 lambda r=rolled: compiled_ptx(lambda: rdt._build(1, 896, 3584, 7168, 16, rdt.fma_unroll(1), 0, rolled=r))),
                (f"router_down_topk ({tag} top-k)", "M=8 (mma)",
                 lambda r=rolled: compiled_ptx(lambda: rdt._build(8, 896, 3584, 7168, 16, rdt.fma_unroll(8), 0, rolled=r))),
                (f"router_down_topk v2.7 ({tag} top-k, shared gate/up folded)", "M=1 (FMA)",
                 lambda r=rolled: compiled_ptx(lambda: rdt._build(1, 896, 3584, 7168, 16, rdt.fma_unroll(1), 0,
                                                                  shared=384, rolled=r))),
                (f"TopkFromLogits ({tag} top-k)", "any M, shared 384",
                 lambda r=rolled: compiled_ptx(lambda: rdt._build(0, 896, 3584, 7168, 16, rdt.UNROLL, shared=384,
                                                                  rolled=r))),
            ]
        builds.append(("TopkFromLogits v2.8 (top-k split over 4 warps)", "any M, shared 384",
                       lambda: compiled_ptx(lambda: rdt._build(0, 896, 3584, 7168, 16, rdt.UNROLL, shared=384,
                                                               split=True))))
        rows = []
        for name, cfgs, fn in builds:
            rows.append({"kernel": name, "config": f"k3_rank16 {cfgs}", "code_size": True, **sass_size(fn(), tools)})
    return rows


def loop_issue_order(ptx: str, min_loads: int = 1) -> list[tuple[str, str]]:
    """(label, sequence) for every loop with global loads: one character per instruction of interest in program
    order, ``L`` a global load, ``f`` an FMA, ``m`` an MMA, ``|`` a branch. A loop that reads ``LLLLffff...``
    issues its loads together and waits once; ``LffffLffff...`` waits once per load unless ptxas reorders it."""
    out = []
    for label, body in _loops(ptx):
        seq = "".join(next((c for p, c in _ISSUE if x.strip().startswith(p)), "") for x in body)
        if seq.count("L") >= min_loads:
            out.append((label, seq))
    return out


def main(argv=None) -> int:
    """python -m k3fast.measure.ptxcheck [--out traces/cpu]: the loop statistics this module's docstring talks about, for
    the experts kernel (v3, v4) and the fused in_proj GEMV, written to ptxcheck-<commit>.json with the versions."""
    import argparse
    import dataclasses
    import json
    import os

    from ..kernels import moe_mxfp4_experts as mx
    from ..kernels import rms_gemv
    from ..kernels._dsl import TVM_FFI, import_cute
    from .trace import environment
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--out", default="traces/cpu")
    args = ap.parse_args(argv)
    cutlass, _ = import_cute()
    rows = []
    for v, layout in ((3, "nibble"), (4, "nibble"), (4, "rot")):
        for M in (1, 64):
            key = dataclasses.replace(mx.compile_key(896, 3584, 256, M, version=4), version=v, layout=layout)
            ptx = compiled_ptx(lambda: mx._compile(key, options=TVM_FFI + " --keep-ptx"))
            for st in loop_copies_of_loads(ptx):
                if st.global_loads >= 8:
                    rows.append({"kernel": f"moe_mxfp4_experts v{v} ({layout} layout)", "config": "k3_rank16",
                                 "M": M, **dataclasses.asdict(st)})
    # where the loop instructions go (v4, default clusters), at b8 and b64: the default (rot layout) and the
    # nibble layout it replaced
    for layout in ("rot", "nibble"):
        for M in (8, 64):
            key = mx.compile_key(896, 3584, 256, M, layout=layout)
            ptx = compiled_ptx(lambda: mx._compile(key, options=TVM_FFI + " --keep-ptx"))
            for label, ops in loop_opcodes(ptx).items():
                rows.append({"kernel": f"moe_mxfp4_experts v{key.version} ({layout} layout, C={key.C}, D={key.D})",
                             "config": "k3_rank16", "M": M, "label": label, "instructions": sum(ops.values()),
                             "opcodes": ops})
    # the same loops in SASS, where a SASS toolchain is found (module find_sass_tools): what the GPU issues
    tools = find_sass_tools()
    for layout, W in (("rot", 16), ("nibble", 16), ("rot", 8), ("nibble", 8)):
        for M in (8, 64):
            if tools is None:
                break
            key = mx.compile_key(896, 3584, 256, M, layout=layout, W=W)
            ptx = compiled_ptx(lambda: mx._compile(key, options=TVM_FFI + " --keep-ptx"))
            loops = sass_loop_opcodes(ptx, tools)
            ver = loops.pop("ptxas")
            for label, ops in loops.items():
                rows.append({"kernel": f"moe_mxfp4_experts v{key.version} ({layout} layout, C={key.C}, D={key.D}, "
                                       f"W={key.W})", "config": "k3_rank16", "M": M, "label": label, "sass": True,
                             "ptxas": ver, "instructions": sum(ops.values()), "opcodes": ops})
    # ring_fit (experts; the default at versions 4 / 5 since session 13, at 7 since session 14): rank8's loops
    # (I = 384: 28 FC1 steps per unit, 6 FC2 steps per tile) with the full ring of 8 and with the fitted rings
    # (7 / 6); "instructions" is per loop turn of D1 / D2 steps, so per step it is instructions / ring_depth. And
    # v7 at batch buckets 1 / 2, at rank8 and rank16, where FC1 has 14 or 28 steps per unit
    cells = [(384, "k3_rank8", 8), (384, "k3_rank8", 64), (384, "k3_rank8", 1), (384, "k3_rank8", 2),
             (256, "k3_rank16", 1), (256, "k3_rank16", 2)]
    for rf in ((False, True) if tools is not None else ()):
        for I_, shape, M in cells:
            # (alt_parts=0: v5.1's loops alone, as before v5.2 put v7's beside them at buckets 4 / 8)
            key = mx.compile_key(896, 3584, I_, M, ring_fit=rf, alt_parts=0)
            ptx = compiled_ptx(lambda: mx._compile(key, options=TVM_FFI + " --keep-ptx"))
            loops = sass_loop_opcodes(ptx, tools)
            ver = loops.pop("ptxas")
            res = ptxas_resources(ptx, tools[0])
            for label, ops in loops.items():
                rows.append({"kernel": f"moe_mxfp4_experts v{key.version} (ring_fit {'on' if rf else 'off'}, "
                                       f"D1={key.D1}, D2={key.D2})", "config": shape, "M": M, "label": label,
                             "sass": True, "ptxas": ver, "instructions": sum(ops.values()),
                             "mma": ops.get("HMMA", 0), "opcodes": ops, **res})
    # experts v7 at 16 and 8 warps (session 15's fast-xco ran 8): what one CTA takes of an SM, i.e. the room left
    # for the PDL-launched tail's CTAs beside it (registers x threads, shared memory)
    for W, (I_, shape, M) in ([(W, cell) for W in (16, 8) for cell in
                               ((256, "k3_rank16", 1), (256, "k3_rank16", 2), (384, "k3_rank8", 1), (384, "k3_rank8", 2))]
                              if tools is not None else ()):
        key = mx.compile_key(896, 3584, I_, M, W=W)
        ptx = compiled_ptx(lambda: mx._compile(key, options=TVM_FFI + " --keep-ptx"))
        res = ptxas_resources(ptx, tools[0])
        rows.append({"kernel": f"moe_mxfp4_experts v{key.version} ({W} warps)", "config": shape, "M": M,
                     "ctas": key.Q * key.C, "threads": key.threads, "smem_bytes": key.smem_bytes,
                     "registers_per_cta": key.threads * res["registers"], **res})
    # experts v4 beside v5 (v5.1 since session 32) at b64: registers, spills, loop sizes and the shared memory that
    # picks the carve-out (v5 as first written was 32 B over rank8's 196 KB step; version log v5.1)
    def experts_key_row(key, kernel, shape):
        """A default experts key's binary: its shared memory and L1, and the instructions of each SASS loop."""
        ptx = compiled_ptx(lambda: mx._compile(key, options=TVM_FFI + " --keep-ptx"))
        loops = sass_loop_opcodes(ptx, tools)
        row = {"kernel": kernel, "config": shape, "M": key.MB, "smem_bytes": key.smem_bytes, "l1_kb": key.l1_kb,
               "ptxas": loops.pop("ptxas"), "sass_loop_instructions": {k: sum(o.values()) for k, o in loops.items()}}
        return ptx, loops, row

    for I_, shape in (((384, "k3_rank8"), (256, "k3_rank16"), (3072, "full")) if tools is not None else ()):
        for v in (4, 5):
            ptx, _, row = experts_key_row(mx.compile_key(896, 3584, I_, 64, version=v),
                                          f"moe_mxfp4_experts v{v} (b64 default key)", shape)
            rows.append({**row, **ptxas_resources(ptx, tools[0])})
    # experts v5.2 beside v5.1 at buckets 4 / 8 (session 33): what carrying v7's items beside v5's costs the binary
    # (registers, spills, code size, loop sizes) and the shared memory; s108 measured v5.2 +4.3 % at uniform rank16
    # b8 and -0.6 to +1.2 % elsewhere (LOG)
    for I_, shape in (((256, "k3_rank16"), (384, "k3_rank8"), (3072, "full")) if tools is not None else ()):
        for M in (4, 8):
            for alt in (2, 0):
                ptx, loops, row = experts_key_row(mx.compile_key(896, 3584, I_, M, alt_parts=alt),
                                                  f"moe_mxfp4_experts v5.{2 if alt else 1} (b{M} default key)", shape)
                rows.append({**row, "sass_loop_local_memory": {k: o.get("LDL", 0) + o.get("STL", 0)
                                                               for k, o in loops.items()}, **sass_size(ptx, tools)})
    if tools is not None:        # router_down_topk v2.2: the FMA path's occupancy hint and what ptxas made of it
        from ..kernels import router_down_topk as rdt
        old = rdt.TVM_FFI
        rdt.TVM_FFI = TVM_FFI + " --keep-ptx"
        try:
            for mb in (1, 2):
                for minb in sorted({0, rdt.FMA_MIN_BLOCKS_TRIED.get(mb, 0)}):
                    ptx = compiled_ptx(lambda: rdt._build(mb, 896, 3584, 7168, 16, rdt.fma_unroll(mb), minb))
                    rows.append({"kernel": "router_down_topk (FMA path)", "M": mb, "min_blocks": minb,
                                 **ptxas_resources(ptx, tools[0])})
        finally:
            rdt.TVM_FFI = old
    if tools is not None:        # code size per kernel (router_down_topk v2.4: the cold instruction fetch)
        rows += code_sizes(tools)
    # the fused in_proj's weight loops in SASS (the k-batch loop inside the row-group loop): the default (v6, pinned
    # loads, early trigger), at M = 1 and 2. (v8 and v9, removed in session 11, and v10, removed in session 12, are
    # in traces/cpu/ptxcheck-0702749562c3.json.)
    for M in ((1, 2) if tools is not None else ()):
        ptx = rms_gemv.fused_ptx(3216, M=M, pin=True, early_trigger=True)
        loops = sass_loop_opcodes(ptx, tools, min_loads=4)
        ver = loops.pop("ptxas")
        for label, ops in loops.items():
            rows.append({"kernel": "attnres_rms_gemv (fused in_proj, v6 pinned, the default)",
                         "config": "k3_rank16 in_proj N=3216", "M": M, "label": label, "sass": True, "ptxas": ver,
                         "instructions": sum(ops.values()), "opcodes": ops, **ptxas_resources(ptx, tools[0])})
    for label, seq in loop_issue_order(rms_gemv.fused_ptx(3216), min_loads=2):
        rows.append({"kernel": "attnres_rms_gemv (fused)", "config": "k3_rank16 in_proj N=3216", "M": 1,
                     "label": label, "issue_order": seq})
    env = environment()
    env["arch"] = os.environ.get("CUTE_DSL_ARCH")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"ptxcheck-{env['commit']}.json")
    with open(path, "w") as f:
        json.dump({"environment": env, "command": "python -m k3fast.measure.ptxcheck", "records": rows}, f, indent=1)
    for r in rows:
        print(r)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
