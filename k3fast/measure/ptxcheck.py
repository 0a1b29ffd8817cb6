"""Checks on a kernel's PTX and SASS that catch performance bugs the compiler does not report.

``loop_copies_of_loads(ptx)``: for every loop (a backward branch) that issues global loads, how many ``mov.b32``
in the loop copy a register that a global load of the same loop writes. Such a copy is what an out-of-SSA pass
emits for a loop-carried register ring whose old value is still live when its refill is issued. On the GPU a
copy of a register with a load in flight waits for that load, so a "ring" of depth D then stalls a warp for a
full memory round trip every D steps (docs/kernels/moe_mxfp4_experts.md tells how the experts kernel lost them).

``serial_loads(sass)``: global loads placed behind a conditional branch or a global store in the SASS, the two
patterns that serialise a top-k's loads (docs/kernels/router_down_topk.md).

``layer_ptx(cfg, batches)`` compiles the kernels the fused layer runs (k3fast.layer.warmup) and returns their PTX;
``python -m k3fast.measure.ptxcheck`` records these statistics for every one of them (traces/cpu/ptxcheck-*.json).
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
    # the PTX ISA each ptxas release reads; the DSL emits a newer one (9.4 with cutlass 4.8.1)
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
    disjoint, so in straight-line code each such load waits for what precedes it: one more round trip. The router's
    top-k once had two such chains (its 28 logit loads, each behind the previous sigmoid's division branch, ~14 us;
    and the z copy's load / store / load pairs; docs/kernels/router_down_topk.md). A static count: inside a loop
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


def layer_ptx(cfg, batches, plan=None) -> list[tuple[str, str]]:
    """(compile key, PTX text) of every kernel the fused layer runs at ``batches`` under ``plan`` (the shipped one by
    default), in compile order: k3fast.layer.warmup with every cute.compile asked to keep its PTX. Kernels already
    compiled in this process are compiled again (the cache is bypassed for the call)."""
    from cutlass.base_dsl.compiler import CompileCallable

    from ..kernels import _dsl
    from ..layer import DEFAULT_PLAN, warmup
    _dsl.import_cute()
    captured: list[tuple[str, str]] = []
    orig_call, orig_cached = CompileCallable.__call__, _dsl.compile_cached

    def call(self, *a, **kw):
        opt = kw.get("options")
        if isinstance(opt, str) and "--keep-ptx" not in opt:
            kw["options"] = opt + " --keep-ptx"
        return orig_call(self, *a, **kw)

    def cached(key, build):
        fn = compiled_ptx(build)
        captured.append((str(key), fn))
        return None

    saved = dict(_dsl._CACHE)
    _dsl._CACHE.clear()
    CompileCallable.__call__ = call
    mods = [m for m in _kernel_modules() if getattr(m, "compile_cached", None) is orig_cached]
    try:
        _dsl.compile_cached = cached
        for m in mods:
            m.compile_cached = cached
        warmup(cfg, [1], batches, plan=plan or DEFAULT_PLAN)
    finally:
        CompileCallable.__call__ = orig_call
        _dsl.compile_cached = orig_cached
        for m in mods:
            m.compile_cached = orig_cached
        _dsl._CACHE.clear()
        _dsl._CACHE.update(saved)
    return captured


def _kernel_modules():
    from ..kernels import (gemm_wgmma_splitk, kda_conv_gate_step, moe_mxfp4_experts, moe_tail, oproj_attnres,
                           rms_gemv, rms_gemv_ring, router_down_topk)
    return [gemm_wgmma_splitk, kda_conv_gate_step, moe_mxfp4_experts, moe_tail, oproj_attnres, rms_gemv,
            rms_gemv_ring, router_down_topk]


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
    """python -m k3fast.measure.ptxcheck [--out traces/cpu] [--batches 1 8 64]: for every kernel the fused layer
    runs at k3_rank16 (and the experts' whole-pass contender at buckets 4 / 8), the loop statistics of this
    module's docstring in PTX, and where a ptxas + nvdisasm pair is found (find_sass_tools) the SASS size,
    registers, spills, serial loads and each loop's opcodes; written to ptxcheck-<commit>.json."""
    import argparse
    import dataclasses
    import json
    import os

    from k3ref import k3_rank
    from ..layer import CONTENDERS
    from .trace import environment
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--out", default="traces/cpu")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    args = ap.parse_args(argv)
    cfg = k3_rank(16)
    tools = find_sass_tools()
    kernels = [("fast", k, p) for k, p in layer_ptx(cfg, args.batches)]
    kernels += [("fast-v51", k, p) for k, p in layer_ptx(cfg, [4, 8], CONTENDERS["fast-v51"][0])
                if "moe_mxfp4_experts" in k]
    rows = []
    for plan, key, ptx in kernels:
        base = {"plan": plan, "key": key, "config": cfg.name}
        for st in loop_copies_of_loads(ptx):
            rows.append({**base, **dataclasses.asdict(st)})
        if tools is not None:
            rows.append({**base, "sass": True, **sass_size(ptx, tools)})
            loops = sass_loop_opcodes(ptx, tools)
            ver = loops.pop("ptxas")
            for label, ops in loops.items():
                rows.append({**base, "label": label, "sass": True, "ptxas": ver, "instructions": sum(ops.values()),
                             "opcodes": ops})
    env = environment()
    env["arch"] = os.environ.get("CUTE_DSL_ARCH")
    env["sass_tools"] = list(tools) if tools else None
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"ptxcheck-{env['commit']}.json")
    with open(path, "w") as f:
        json.dump({"environment": env, "command": "python -m k3fast.measure.ptxcheck " + " ".join(argv or []),
                   "records": rows}, f, indent=1)
    bad = [r for r in rows if r.get("copies_of_loads")]
    print(f"{len(kernels)} kernels, {len(rows)} rows; loops copying in-flight loads: {len(bad)}")
    for r in bad:
        print("  ", r["key"][:100], r["label"], r["copies_of_loads"])
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
