"""Paired A/B summary of the runs in this folder: per (pair, temperature), old (f4c8fff) against new
(7fe4ba4; the sb and chain07 runs: 68cd688), from alternating `edgespec bench` runs (README.md); then,
for pairs run 4 rounds a side, the A/A spread: each side's category medians of rounds 1-2 against
rounds 3-4. Run: python3 summarize.py"""
import collections
import glob
import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent
def load(path):
    return json.load(open(path))
rows = collections.defaultdict(lambda: collections.defaultdict(list))
for f in sorted(glob.glob(str(HERE / '*' / 'results.json'))):
    name = f.split('/')[-2]
    side, rest = name.split('-', 1)
    pair = rest.rsplit('-r', 1)[0]
    rnd = rest.rsplit('-r', 1)[1]
    for r in load(f)['runs']:
        if r['config'] == 'plain':
            continue
        rows[(pair, r['temperature'])][side].append((rnd, r['task'], r['category'], r['tok_per_s'], r['plain_tok_per_s'], r.get('matches_plain')))
print("| pair | T | runs old/new | old auto÷plain median | new auto÷plain median | new ÷ old spec tok/s (median over tasks) | category medians auto÷plain, new (min) | old (min) |")
print("|---|---|---|---|---|---|---|---|")
for (pair, t), sides in sorted(rows.items()):
    out = []
    sp = {}
    for side in ('old', 'new'):
        xs = sides[side]
        ratios = [s / p for _, _, _, s, p, _ in xs]
        bycat = collections.defaultdict(list)
        for _, _task, cat, s, p, _ in xs:
            bycat[cat].append(s / p)
        catmed = {c: statistics.median(v) for c, v in bycat.items()}
        sp[side] = (statistics.median(ratios), min(catmed.values()), len(set(x[0] for x in xs)))
        pertask = collections.defaultdict(list)
        for _rnd, task, _cat, s, _p, _ in xs:
            pertask[task].append(s)
        sp[side + 'task'] = {k: statistics.median(v) for k, v in pertask.items()}
    rel = statistics.median(sp['newtask'][k] / sp['oldtask'][k] for k in sp['newtask'])
    print(f"| {pair} | {t} | {sp['old'][2]}/{sp['new'][2]} | {sp['old'][0]:.3f} | {sp['new'][0]:.3f} | {rel:.3f} | {sp['new'][1]:.3f} | {sp['old'][1]:.3f} |")

print()
print("| pair | T | category | new | old | A/A new r1-2 / r3-4 | A/A old r1-2 / r3-4 |")
print("|---|---|---|---|---|---|---|")
for (pair, t), sides in sorted(rows.items()):
    if len({x[0] for x in sides['new']}) < 4:
        continue
    med = {}
    for side in ('old', 'new'):
        for part, rounds in (('all', '1234'), ('a', '12'), ('b', '34')):
            by = collections.defaultdict(list)
            for rnd, _, cat, s_, p_, _ in sides[side]:
                if rnd in rounds:
                    by[cat].append(s_ / p_)
            med[side, part] = {c: statistics.median(v) for c, v in by.items()}
    for cat in sorted(med['new', 'all']):
        print(f"| {pair} | {t} | {cat} | {med['new', 'all'][cat]:.3f} | {med['old', 'all'][cat]:.3f} | "
              f"{med['new', 'a'][cat]:.3f} / {med['new', 'b'][cat]:.3f} | {med['old', 'a'][cat]:.3f} / {med['old', 'b'][cat]:.3f} |")
