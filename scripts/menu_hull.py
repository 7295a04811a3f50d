#!/usr/bin/env python3
"""Which menu types a knapsack over measured ΔKL can choose: for each type, on how many tensors of a full probe it is
on the Pareto front of (bits per weight, ΔKL) and on its lower convex hull (the points a Lagrangian / greedy knapsack
takes; an exact knapsack takes points off the hull only at the budget's edge). Input: probe.json files of
`voodoo quantize` (WORK/probe.json) or sensitivity.json files (RUN/sensitivity.json), any number.

    scripts/menu_hull.py docs/bench/ladder/mix30M-tied/probe-full.json [--json=OUT.json]
"""
import json
import sys

# Bits per weight of llama.cpp's types (ggml's type_size · 8 / block size).
BPW = dict(iq1_s=1.5625, iq1_m=1.75, iq2_xxs=2.0625, iq2_xs=2.3125, iq2_s=2.5, q2_K=2.625, iq3_xxs=3.0625,
           iq3_s=3.4375, q3_K=3.4375, iq4_xs=4.25, iq4_nl=4.5, q4_0=4.5, q4_K=4.5, q4_1=5.0, q5_0=5.5, q5_K=5.5,
           q5_1=6.0, q6_K=6.5625, q8_0=8.5, f16=16.0, bf16=16.0)


def fronts(points):
    """points: [(bpw, dkl, type)] of one tensor → (Pareto front, lower convex hull), each a list of types."""
    pts = sorted(points)
    pareto = [p for p in pts if not any((q[0] <= p[0] and q[1] < p[1]) or (q[0] < p[0] and q[1] <= p[1]) for q in pts)]
    hull = []
    for p in pareto:
        while len(hull) >= 2:
            (x1, y1, _), (x2, y2, _) = hull[-2], hull[-1]
            if (y2 - y1) * (p[0] - x1) >= (p[1] - y1) * (x2 - x1):
                hull.pop()
            else:
                break
        hull.append(p)
    return [p[2] for p in pareto], [p[2] for p in hull]


def main(paths):
    report = {}
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        tensors = d["tensors"] if isinstance(d, dict) else d
        count = {t: [0, 0, 0] for t in BPW}  # [tensors with it, on the front, on the hull]
        for t in tensors:
            pts = [(BPW[k], v, k) for k, v in t["delta_kl"].items() if k in BPW]
            pareto, hull = fronts(pts)
            for _, _, k in pts:
                count[k][0] += 1
                count[k][1] += k in pareto
                count[k][2] += k in hull
        report[path] = {k: {"tensors": c[0], "pareto": c[1], "hull": c[2]} for k, c in count.items() if c[0]}
        print(f"{path}: {len(tensors)} tensors; type: on the Pareto front / on the lower convex hull, of the tensors with it")
        print("  " + " · ".join(f"{k} {c[1]}/{c[2]} of {c[0]}" for k, c in count.items() if c[0]))
    return report


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--json=")]
    if not args:
        sys.exit(__doc__)
    result = main(args)
    for a in sys.argv[1:]:
        if a.startswith("--json="):  # the same counts, machine-readable
            with open(a[len("--json="):], "w") as f:
                json.dump(result, f, indent=1)
