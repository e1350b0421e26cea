"""What bubblewrap's filesystem isolation costs per sandboxed program (docs/rewards.md).

    .venv/bin/python benchmarks/sandbox_bwrap_overhead.py [--rounds 5] [--json out.json]

One process, no pool: the same programs run with `filesystem="bwrap"` and `filesystem="none"` (every other layer
identical: netns, uid switch as root, rlimits, audit hook), the two sides alternating program by program so that
machine load hits both alike. Programs: an empty one (`pass`: the start-up cost alone) and each reference solution
of the HumanEval-style corpus (posttrain/data/tasks/code.py) against its tests. Reports, per program, the median
wall time of each side and the median of the paired differences (bwrap − none) in milliseconds, and the same for
the CPU time of the child processes (user + sys from RUSAGE_CHILDREN: bwrap, its init, the interpreter), which
other load on the machine does not inflate the way it inflates wall time.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import time

from posttrain.data.tasks.code import humaneval_mini, reference
from posttrain.rewards.sandbox import Limits, Sandbox


def _child_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5, help="passes over the programs")
    p.add_argument("--json", default="", help="write the numbers here too")
    args = p.parse_args()
    boxes = {"bwrap": Sandbox(Limits(), filesystem="bwrap"), "none": Sandbox(Limits(), filesystem="none")}
    rows = humaneval_mini(None, random.Random(0))
    jobs = [("empty", "pass", ["assert True"])] + [(r["entry_point"], reference(r["entry_point"]), r["tests"]) for r in rows]
    times: dict[str, dict[str, list[float]]] = {k: {"empty": [], "humaneval": []} for k in (*boxes, "diff", "cpu_diff")}
    cpu: dict[str, dict[str, list[float]]] = {k: {"empty": [], "humaneval": []} for k in boxes}
    for _ in range(args.rounds):
        for name, code, tests in jobs:
            kind, pair, pair_cpu = "empty" if name == "empty" else "humaneval", {}, {}
            for side in (("bwrap", "none") if random.random() < 0.5 else ("none", "bwrap")):
                t0, c0 = time.perf_counter(), _child_cpu()
                r = boxes[side].run_tests(code, tests)
                pair[side], pair_cpu[side] = (time.perf_counter() - t0) * 1000, (_child_cpu() - c0) * 1000
                assert r.all_passed, (side, name, r)
                times[side][kind].append(pair[side])
                cpu[side][kind].append(pair_cpu[side])
            times["diff"][kind].append(pair["bwrap"] - pair["none"])
            times["cpu_diff"][kind].append(pair_cpu["bwrap"] - pair_cpu["none"])
    out = {}
    for kind in ("empty", "humaneval"):
        med = {side: statistics.median(times[side][kind]) for side in times}
        c = {side: statistics.median(cpu[side][kind]) for side in boxes}
        out[kind] = {"bwrap_ms": round(med["bwrap"], 1), "none_ms": round(med["none"], 1), "overhead_ms": round(med["diff"], 1),
                     "bwrap_cpu_ms": round(c["bwrap"], 1), "none_cpu_ms": round(c["none"], 1),
                     "cpu_overhead_ms": round(med["cpu_diff"], 1), "programs": len(times["bwrap"][kind])}
        print(f"{kind:9s}  wall: bwrap {med['bwrap']:6.1f} ms  none {med['none']:6.1f} ms  overhead {med['diff']:+5.1f} ms;  "
              f"cpu: bwrap {c['bwrap']:5.1f} ms  none {c['none']:5.1f} ms  overhead {med['cpu_diff']:+5.1f} ms  "
              f"(medians over {len(times['diff'][kind])} programs, paired differences)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
