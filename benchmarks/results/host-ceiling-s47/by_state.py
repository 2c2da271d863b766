"""Groups the stretches of an alternated log (`alternate.sh`) by the build and the host's state that each stretch
read (the round trip between the two CPUs: above 250 ns the cores sit on two dies, below 100 they share an L3) and
prints each group's share of the bandwidth ceiling: the host moves between its states every few minutes, so a pair
of runs is compared only where its stretches saw the same state.

    python benchmarks/results/host-ceiling-s47/by_state.py pairs.log
"""

import re
import statistics
import sys

ROW = re.compile(r"\| ([\d.]+) \| (\d+) \|.*\| (\d+)% \|$")


def main() -> None:
    build, groups = None, {}
    for line in open(sys.argv[1]):
        if line.startswith("== "):
            build = line.split()[1]
            continue
        match = ROW.match(line.strip())
        if match and build:
            trip = int(match[2])
            state = "two dies" if trip > 250 else "shared L3" if trip < 100 else "between"
            groups.setdefault((build, state), []).append(int(match[3]))
    for (build, state), shares in sorted(groups.items()):
        print(f"{build:40s} {state:10s} {len(shares):3d} stretches: median {statistics.median(shares):.1f} %, "
              f"{min(shares)}-{max(shares)}")


if __name__ == "__main__":
    main()
