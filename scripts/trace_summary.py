#!/usr/bin/env python3
"""Sums a PyTorch profiler trace (bench/train_step --profile) by GPU kernel: the step's GPU time by kind
(matrix products, attention, Voodoo's fused kernels, the rest) and the top kernels, as text and as JSON.

Usage: scripts/trace_summary.py TRACE.json [--json OUT.json] [--top N]
"""
import argparse
import json
import re
from collections import defaultdict

KINDS = [
    ("voodoo mixture", re.compile(r"mixture_(tiled_)?kernel|dequantize_kernel")),
    ("voodoo gate gradients", re.compile(r"gate_grad_(tiled_)?kernel")),
    ("matrix products", re.compile(r"gemm|nvjet|cutlass|xmma|sm90_|cublas|splitK", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|efficient", re.I)),
    ("softmax / loss", re.compile(r"softmax|nll|cross_entropy|logsumexp", re.I)),
    ("reductions", re.compile(r"reduce", re.I)),
    ("copies and casts", re.compile(r"copy|cast|Memcpy|Memset|fill", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled", re.I)),
]


def kind_of(name):
    for kind, rx in KINDS:
        if rx.search(name):
            return kind
    return "other"


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("trace")
    ap.add_argument("--json")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    with open(a.trace) as f:
        events = json.load(f)["traceEvents"]
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    launches = sum(1 for e in events if e.get("cat") == "cuda_runtime" and "Launch" in e.get("name", ""))
    if not gpu:
        raise SystemExit(f"{a.trace}: no GPU kernels in the trace (was it a CUDA run with the profiler on?)")
    begin = min(e["ts"] for e in gpu)
    end = max(e["ts"] + e["dur"] for e in gpu)
    # GPU busy time: the union of the kernels' intervals.
    busy, cur_s, cur_e = 0.0, None, None
    for e in sorted(gpu, key=lambda e: e["ts"]):
        s, t = e["ts"], e["ts"] + e["dur"]
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, t
        else:
            cur_e = max(cur_e, t)
    busy += cur_e - cur_s
    by_kind = defaultdict(float)
    by_name = defaultdict(lambda: [0.0, 0])
    for e in gpu:
        n = e["name"]
        by_kind[kind_of(n)] += e["dur"]
        short = re.sub(r"\s+", " ", n)[:110]
        by_name[short][0] += e["dur"]
        by_name[short][1] += 1
    total = sum(by_kind.values())
    print(f"{a.trace}: GPU span {(end - begin) / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms "
          f"({100 * busy / (end - begin):.0f}%), kernel time {total / 1e3:.1f} ms in {len(gpu)} kernels, "
          f"{launches} launches")
    print("| kind | ms | share |\n|---|---:|---:|")
    for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"| {k} | {v / 1e3:.2f} | {100 * v / total:.1f}% |")
    print(f"\n| kernel (top {a.top}) | calls | ms |\n|---|---:|---:|")
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[: a.top]
    for n, (d, c) in top:
        print(f"| `{n}` | {c} | {d / 1e3:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"trace": a.trace, "span_ms": (end - begin) / 1e3, "busy_ms": busy / 1e3,
                       "kernel_ms": total / 1e3, "kernels": len(gpu), "launches": launches,
                       "by_kind_ms": {k: v / 1e3 for k, v in by_kind.items()},
                       "top": [{"name": n, "calls": c, "ms": d / 1e3} for n, (d, c) in top]}, f, indent=1)


if __name__ == "__main__":
    main()
