import re, sys, collections
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    m = re.match(r"T=(\d+) (\{.*\}) ([\d.]+) us", line)
    if m:
        d = m.group(2)
        for k in ("'group_m': 1, ", "'max_registers': None, ", "'tail_block_m': None, ", ", 'engine': 'TL_DOT'", "'split_k': 1, "):
            d = d.replace(k, "")
        rows[int(m.group(1))].append((float(m.group(3)), d))
    elif "BEST" in line or "default" in line.lower():
        print(line.strip()[:400])
for t, r in rows.items():
    r.sort()
    print(f"T={t}: {len(r)} timed")
    for us, d in r[:6]:
        print(f"  {us:8.1f} {d}")
