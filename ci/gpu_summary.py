"""Render the GPU run (junit XML + the suite's recorded measurements) as markdown."""

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def main(junit: str, results: str) -> None:
    print("| test | outcome | time (s) |\n|---|---|---|")
    if Path(junit).exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            outcome = "passed"
            for tag in ("failure", "error", "skipped"):
                node = case.find(tag)
                if node is not None:
                    outcome = (
                        f"{tag}: {(node.get('message') or '').splitlines()[0][:120] if node.get('message') else ''}"
                    )
            print(
                f"| {case.get('classname').split('.')[-1]}::{case.get('name')} | {outcome} "
                f"| {float(case.get('time', 0)):.1f} |"
            )
    if Path(results).exists():
        print("\n## Measurements\n")
        for name, values in json.loads(Path(results).read_text()).items():
            cells = ", ".join(f"{k} = {v:.4g}" if isinstance(v, float) else f"{k} = {v}" for k, v in values.items())
            print(f"- **{name}**: {cells}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
