"""The CUDA codegen's output is byte-identical to tests/data/cuda_snapshot.json (cuda_snapshot.py says
what is in it and how to regenerate it after a deliberate change of the generated code)."""

import importlib.util
import json
from pathlib import Path

spec = importlib.util.spec_from_file_location("tilelang_cuda_snapshot", Path(__file__).with_name("cuda_snapshot.py"))
snap = importlib.util.module_from_spec(spec)
spec.loader.exec_module(snap)


def test_generated_cuda_matches_snapshot():
    want = json.loads(snap.SNAPSHOT.read_text())
    got = {k: snap.digest(src) for k, src in snap.sources(want["property_programs"])}
    assert set(got) == set(want["sha256"]), "the set of snapshot programs changed: run cuda_snapshot.py --update"
    bad = sorted(k for k in got if got[k] != want["sha256"][k])
    assert not bad, (f"{len(bad)} of {len(got)} generated CUDA sources differ from the snapshot (a deliberate change "
                     f"of the codegen: python packages/tilelang/tests/cuda_snapshot.py --update): {bad[:20]}")
