"""The README table: per category, -k auto over plain and auto / the best fixed gamma, from each folder's results.md.

    python3 summarize.py smollm2-ngram gemma3-ngram gemma3-f16-draft gemma3-q8_0-draft smollm2-f32-ngram gemma3-f32-draft
"""
import re
import sys
from pathlib import Path

cats = ["chat", "code_edit", "json_extract", "multi_turn", "story", "summarize_quote", "all"]
for name in sys.argv[1:]:
    txt = open(str(Path(__file__).parent / name / "results.md")).read()
    for sec in re.split(r"^## temperature ", txt, flags=re.M)[1:]:
        t = sec.split()[0]
        auto, ratio = {}, {}
        for line in sec.splitlines():
            c = [x.strip().strip("*") for x in line.split("|")]
            if len(c) == 7 and c[1] in cats and c[2] not in ("auto speedup",):
                try:
                    auto[c[1]], ratio[c[1]] = float(c[2]), float(c[5])
                except ValueError:
                    pass
        cells = [f"{auto[c]:.2f} ({ratio[c]:.2f})" if c in auto else "" for c in cats]
        cells[-1] = f"**{cells[-1]}**"
        print(f"| {name} | {t} | " + " | ".join(cells) + " |")
