"""The benchmark's target lines: measured ratios and verdicts from a results table."""

import importlib.util
import sys
from pathlib import Path

import pandas as pd


def load_benchmark():
    path = Path(__file__).resolve().parents[1] / "scripts" / "benchmark.py"
    spec = importlib.util.spec_from_file_location("benchmark_script", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def row(method, family, time_s, **case):
    base = {"kind": "join", "n": 50_000, "d": 384, "dtype": "fp32", "device": "cpu",
            "namespaces": 1, "k": None, "status": "ok"}
    return {**base, **case, "method": method, "family": family, "time_s": time_s}


def test_target_lines_take_the_fastest_of_ours_and_say_by_how_much():
    bm = load_benchmark()
    ns = {"kind": "namespaces", "n": 10**6, "namespaces": 10**4, "dtype": "bf16",
          "device": "cuda"}
    df = pd.DataFrame([
        row("ours (torch)", "ours", 8.0), row("ours (faiss)", "ours", 6.0),
        row("numpy tiles", "baseline", 12.0),
        row("ours (torch)", "ours", 1.0, **ns), row("ours (triton)", "ours", 0.5, **ns),
        row("loop over ours per namespace", "baseline", 5.0, **ns),
        row("ours (torch)", "ours", 2.0, kind="join", n=10**6, d=384, dtype="bf16",
            device="cuda"),
    ])
    lines = bm.target_lines(df)
    assert lines == [
        "threshold join n=10^6 d=384 bf16: ours (torch) 2 s; goal <= 0.7 s -> missed by 2.86x",
        "10^4 namespaces x 100 d=384: ours (triton) 0.5 s; 10x faster than loop over ours "
        "per namespace (goal >= 20x) -> missed by 2.00x",
        "cpu join n=5*10^4 d=384 fp32: ours (faiss) 6 s; 2x faster than numpy tiles "
        "(goal >= 1x) -> met",
    ]
