"""The cold pair, real runs (README.md): per temperature and category, `-k auto` tok/s ÷ its paired plain
run and τ, median over the runs of each side. Run: python3 summarize.py"""
import collections
import glob
import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent
rows = collections.defaultdict(lambda: collections.defaultdict(list))
for f in sorted(glob.glob(str(HERE / '*' / 'results.json'))):
    side = Path(f).parent.name.split('-')[0]
    for r in json.load(open(f))['runs']:
        if r['config'] != 'plain':
            rows[r['temperature'], r['category']][side].append((r['tok_per_s'] / r['plain_tok_per_s'], r['tau']))
sides = ('new', 'cur', 'cur2')
print("| T | category | " + " | ".join(f"{s}: auto÷plain (τ), runs" for s in sides) + " |")
print("|---|---|" + "---|" * len(sides))
for (t, cat), v in sorted(rows.items()):
    cells = [f"{statistics.median(x[0] for x in v[s]):.3f} ({statistics.median(x[1] for x in v[s]):.1f}), {len(v[s]) // 2}"
             if v[s] else "" for s in sides]
    print(f"| {t} | {cat} | " + " | ".join(cells) + " |")
