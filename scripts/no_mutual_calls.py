#!/usr/bin/env python3
"""Dependencies in src/ run one way: no two of the library's files call each
other. Reads the static library's members with nm (a member's defined and
undefined symbols) and fails naming every pair where each uses the other.
    python3 scripts/no_mutual_calls.py build/libfusedgrpo.a
"""
import collections
import subprocess
import sys


def main(archive):
    out = subprocess.run(["nm", "-A", archive], capture_output=True, text=True, check=True).stdout
    defined, used = collections.defaultdict(set), collections.defaultdict(set)
    for line in out.splitlines():
        where, _, rest = line.rpartition(":")  # "lib.a:member.o: ... sym"
        member = where.split(":")[-1]
        parts = rest.split()
        if len(parts) == 3 and parts[1] in "TDBR":
            defined[member].add(parts[2])
        elif len(parts) == 2 and parts[0] == "U":
            used[member].add(parts[1])
    owner = {sym: m for m, syms in defined.items() for sym in syms}
    calls = collections.defaultdict(set)
    for m, syms in used.items():
        calls[m] |= {owner[s] for s in syms if s in owner and owner[s] != m}
    pairs = sorted((a, b) for a in calls for b in calls[a] if a < b and a in calls[b])
    for a, b in pairs:
        print(f"{a} and {b} call each other")
    print(f"{len(defined)} files, {sum(map(len, calls.values()))} one-way dependencies, "
          f"{len(pairs)} mutual")
    return 1 if pairs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
