"""ceiling_ab.sh's log, by build and host state (the core round trip: < 150 ns, a shared L3; else cores on two dies):
medians of the share of the ceiling, step, layers, head and rest ms."""
import collections
import re
import statistics
import sys

rows = collections.defaultdict(list)
build = None
for path in sys.argv[1:]:
    for line in open(path):
        if m := re.match(r"=== (\w+) round", line):
            build = m.group(1)
        elif m := re.match(r"\| ([\d.]+) \| (\d+) \| [^|]* \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| "
                           r"([\d.]+) \| (\d+)% \|", line):
            gb, trip, _, _, step, layers, head, rest, share = m.groups()
            state = "shared L3" if int(trip) < 150 else "two dies"
            rows[(build, state)].append((int(share), float(step), float(layers), float(head), float(rest), float(gb)))
print("| build | state | stretches | share of the ceiling | step ms | layers ms | head ms | rest ms | GB/s |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
for (build, state), values in sorted(rows.items(), key=lambda item: (item[0][1], item[0][0])):
    med = [statistics.median(v[i] for v in values) for i in range(6)]
    print(f"| {build} | {state} | {len(values)} | {med[0]:.0f} % | {med[1]:.2f} | {med[2]:.2f} | {med[3]:.2f} | "
          f"{med[4]:.2f} | {med[5]:.1f} |")
