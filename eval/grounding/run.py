"""Measure the extraction grounding check (``consolidate.llm.extract.ungrounded``) on the
hand-written cases in ``cases.jsonl``. There are two kinds of facts: grounded ones (every
name and number in them is in the turn) and invented ones (each adds a name, place or
number that the turn does not have). The prompt's own worked example is among them.

    python eval/grounding/run.py > eval/grounding/result.txt

Prints the false refusals (grounded facts refused) and the invented facts let through, and
lists each case it got wrong.
"""

from __future__ import annotations

import json
from pathlib import Path

from consolidate.llm.extract import Turn, ungrounded


def main() -> None:
    rows = [json.loads(x) for x in (Path(__file__).parent / "cases.jsonl").read_text().splitlines()]
    wrong = {"grounded": [], "invented": []}
    n = {"grounded": 0, "invented": 0}
    for k, r in enumerate(rows):
        t = Turn(f"case{k}", "u", r["speaker"], r["turn"], 0.0, "user")
        added = ungrounded(r["fact"], t, "1 June 2024")
        n[r["label"]] += 1
        refused = bool(added)
        if refused != (r["label"] == "invented"):
            wrong[r["label"]].append((r["fact"], r["turn"], added))
    g, i = n["grounded"], n["invented"]
    print(f"cases: {g} grounded, {i} invented")
    print(
        f"false refusals (grounded facts refused): {len(wrong['grounded'])}/{g} "
        f"= {100 * len(wrong['grounded']) / g:.1f}%"
    )
    print(
        f"invented facts let through: {len(wrong['invented'])}/{i} "
        f"= {100 * len(wrong['invented']) / i:.1f}%"
    )
    for label, items in wrong.items():
        for fact, turn, added in items:
            print(f"  {label:8} {fact!r} <- {turn!r}: {added}")


if __name__ == "__main__":
    main()
