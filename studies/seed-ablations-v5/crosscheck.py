"""Compare mlmlab's report.md with recompute.py's reading, cell by cell where both print the same figure.

    mlmlab report studies/seed-ablations-v5/results.jsonl --out studies/seed-ablations-v5
    python studies/seed-ablations-v5/crosscheck.py [REPORT_MD]

Both print the screen's table in one format (mean loss over seeds 0 and 1; D against adm-entropy and Δ against
dynamic, each with its pooled interval and its two seeds' differences), the pooled sds with their degrees of
freedom, the pick, and the primary contrast (Δ, interval, paired sd, detectable effect, p, Holm p, the calls).
Each shared cell is compared as printed, after rounding the more precise of the two to the other's digits (the
report prints 3 significant digits, recompute.py a fixed number of decimals). Prints every cell compared and
exits 1 if any differs. Reads recompute.py's output by running it; imports neither it nor mlmlab.
"""

import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
NUMBER = re.compile(r"[-+−]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def numbers(cell: str) -> list[str]:
    return NUMBER.findall(cell.replace("−", "-"))


def table_after(text: str, heading: str) -> dict[str, list[str]]:
    """{first cell: cells} of the first markdown table after the line starting with ``heading``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    table = []
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            table.append([cell.strip() for cell in line.strip("|").split("|")])
        elif table:
            break
    return {cells[0]: cells for cells in table[2:]}  # past the header and its rule


def same(a: str, b: str) -> bool:
    """Equal as printed, the more precise figure rounded to the other's decimals or significant digits."""
    x, y = float(a), float(b)
    if x == y:
        return True
    for shown, other in ((a, y), (b, x)):
        decimals = len(shown.split("e")[0].split(".")[1]) if "." in shown else 0
        if "e" not in shown and abs(round(other, decimals) - float(shown)) < 10 ** -(decimals + 3):
            return True
        significant = f"{other:.{max(len(shown.replace('-', '').replace('+', '').replace('.', '').lstrip('0')), 1)}g}"
        if float(significant) == float(shown):
            return True
    return False


def compare_cells(label: str, ours: str, theirs: str, checked: list) -> None:
    a, b = numbers(ours), numbers(theirs)
    ok = len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    checked.append((label, ours, theirs, ok))


def screen_cells(report: str, recomputed: str, checked: list) -> None:
    ours = table_after(report, "## Screen (descriptive)")
    theirs = table_after(recomputed, "## Screen (descriptive)")
    columns = ("mean loss", "D vs adm-entropy", "per seed", "Δ vs dynamic", "per seed")
    for arm, cells in theirs.items():
        if arm not in ours:
            checked.append((f"screen {arm}", "missing in report.md", "", False))
            continue
        for index, column in enumerate(columns, start=1):
            compare_cells(f"screen {arm}: {column}", ours[arm][index], cells[index], checked)


def pooled_cells(report: str, recomputed: str, checked: list) -> None:
    ours = re.search(r"s = ([\d.]+) \((\d+) df\) against adm-entropy, ([\d.]+) \((\d+) df\) against dynamic", report)
    theirs = re.search(r"([\d.]+) \((\d+) df\) against adm-entropy, ([\d.]+) \((\d+) df\) against dynamic", recomputed)
    for index, label in enumerate(("sd vs adm-entropy", "df", "sd vs dynamic", "df"), start=1):
        compare_cells(f"pooled {label}", ours.group(index), theirs.group(index), checked)


def pick_cells(report: str, recomputed: str, checked: list) -> None:
    ours = re.search(r"a tie to the first listed: \*\*([\w.-]+)\*\*", report)
    theirs = re.search(r"among the candidates\): \*\*([\w.-]+)\*\*", recomputed)
    if ours or theirs:
        pair = (ours.group(1) if ours else "none", theirs.group(1) if theirs else "none")
        checked.append(("the pick", *pair, pair[0] == pair[1]))


def primary_cells(report: str, recomputed: str, checked: list) -> None:
    """The primary contrast: report.md's table row against recompute.py's bullet, figure by figure."""
    row = next(
        (cells for name, cells in table_after(report, "## Pre-registered decision").items() if " − " in name), None
    )
    bullet = re.search(r"^- (\S+) − dynamic, six seeds \(the rule\): (.*)$", recomputed, re.M)
    if row is None or bullet is None:
        checked.append(("primary contrast", "in report.md" if row else "not in report.md", bullet and "in", False))
        return
    theirs = bullet.group(2)
    interval = re.match(r"(\S+) \[(\S+), (\S+)\]", theirs)
    figures = {
        "Δ [interval]": (row[2], " ".join(interval.groups())),
        "paired sd": (row[3], re.search(r"paired sd (\S+)", theirs).group(1)),
        "detectable at 5%": (row[4], re.search(r"detectable at 5% (\S+?),", theirs).group(1)),
        "p": (row[6], re.search(r"\bp (\S+?)[:,]", theirs).group(1)),
    }
    for label, (ours, recomputed_figure) in figures.items():
        compare_cells(f"primary {label}", ours, recomputed_figure, checked)
    call = re.search(r"\*\*(\w+)\*\*", theirs).group(1)
    checked.append(("primary call (Holm: the rule)", row[9], call, call in row[9]))


def fresh_seed_cells(report: str, recomputed: str, checked: list) -> None:
    """The pick against dynamic on the seeds that did not choose it (2-5), once two of them are in."""
    ours = re.search(r"alone \(they did not choose it\): \S+ − dynamic (.*) over (\d+) paired seeds", report)
    theirs = re.search(r"fresh seeds 2-5 alone: (\S+ \[\S+, \S+\]) over (\d+) paired seeds", recomputed)
    if ours or theirs:
        pair = (" ".join(ours.groups()) if ours else "not in", " ".join(theirs.groups()) if theirs else "not in")
        compare_cells("the pick on seeds 2-5 alone", *pair, checked)


def main() -> int:
    report_path = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "report.md"
    report = report_path.read_text()
    recomputed = subprocess.run(
        [sys.executable, str(HERE / "recompute.py")], capture_output=True, text=True, check=True
    ).stdout
    checked = []
    for compare in (pick_cells, pooled_cells, primary_cells, fresh_seed_cells, screen_cells):
        compare(report, recomputed, checked)
    for label, ours, theirs, ok in checked:
        print(f"{'ok  ' if ok else 'DIFF'} {label}: report.md {ours!r}; recompute.py {theirs!r}")
    differing = sum(not ok for *_, ok in checked)
    print(f"{len(checked)} cells compared, {differing} differing")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
