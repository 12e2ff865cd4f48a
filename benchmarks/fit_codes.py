"""Wall and CPU seconds of fitting and measuring each code ``index build --bytes 4,8,16,32`` tries, on an index
version's own vectors (both sides; the first 676 images and their captions as the evaluation set).

    python -m benchmarks.fit_codes demo/index/v000003            # every candidate that fits
    python -m benchmarks.fit_codes demo/index/v000003 pruned     # those budgets.worth_trying keeps
"""
import json
import resource
import sys
import time

import numpy as np

from triclip.index import budgets as bud
from triclip import codecs
from triclip.index.budgets import EvalSet

folder = sys.argv[1]
image = np.load(f"{folder}/vectors.npy", mmap_mode="r")
text = np.load(f"{folder}/text_vectors.npy", mmap_mode="r")
rows = np.load(f"{folder}/text_rows.npy")
meta = [json.loads(l) for l in open(f"{folder}/meta.jsonl")]
n = 676
keep = np.flatnonzero(rows[:, 0] < n)
texts = [meta[int(r)]["captions"][int(c)] for r, c in rows[keep]]
ev = EvalSet.of(np.asarray(image[:n]), np.asarray(text[keep]), rows[keep, 0], texts, "indexed", folder)
sides = {"image": (np.asarray(image), ev), "text": (np.asarray(text), ev.reverse())}
prune = len(sys.argv) > 2 and sys.argv[2] == "pruned"
total_wall, total_cpu = 0.0, 0.0
out = []
for side, (vectors, evaluation) in sides.items():
    train = bud._sample(vectors, 0)
    for b in (4, 8, 16, 32):
        specs = codecs.candidates(b, 256, len(vectors))
        if prune:
            specs = bud.worth_trying(specs, b, len(train))
        best = (None, -1)
        for spec in specs:
            w, c = time.perf_counter(), time.process_time()
            try:
                codec = codecs.fit(spec, train)
                r = bud.measure(codec, evaluation)
            except Exception:  # noqa: BLE001 (a code that cannot be fitted here: no recall)
                r = None
            w, c = time.perf_counter() - w, time.process_time() - c
            total_wall += w; total_cpu += c
            out.append((side, b, spec.label(), r, w, c))
            if r is not None and r > best[1]:
                best = (spec.label(), r)
            print(f"{side:5} {b:3} {spec.label():18} R@10 {r if r is None else round(r,3)}  wall {w:6.2f}  cpu {c:6.2f}", flush=True)
        print(f"{side:5} {b:3} best {best}", flush=True)
print(f"TOTAL wall {total_wall:.1f} s cpu {total_cpu:.1f} s; peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/1e6:.2f} GB")
