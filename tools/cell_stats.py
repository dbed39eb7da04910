"""How the notebooks' exported cells read (issue 53's measure, against fastcore's ~10-line cells): their count, the
median of their non-blank lines, the share followed by an example or test cell, those over 40 lines, and their lines
over 120 characters (the peers' sources: 0.2-3.5% of lines).

    python tools/cell_stats.py            # the whole of nbs/
    python tools/cell_stats.py --each     # and one line per notebook"""
import statistics, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from structure import exported_cells

def stats(cells) -> str:
    sizes = [sum(1 for l in lines if l.strip()) for *_, lines, _ in cells]
    tested = sum(t for *_, t in cells)
    lines = [l for *_, ls, _ in cells for l in ls]
    wide = sum(len(l) > 120 for l in lines)
    return (f"{len(cells)} exported cells, median {statistics.median(sizes):g} lines, {tested / len(cells):.0%} followed by "
            f"an example or test, {sum(n > 40 for n in sizes)} over 40 lines; {wide} of {len(lines)} lines "
            f"({wide / len(lines):.1%}) over 120 characters")

if __name__ == '__main__':
    cells = exported_cells()
    print(stats(cells))
    if '--each' in sys.argv[1:]:
        for nb in sorted({c[0] for c in cells}): print(f"{nb}: {stats([c for c in cells if c[0] == nb])}")
