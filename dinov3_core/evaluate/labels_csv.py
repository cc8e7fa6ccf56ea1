"""Tile labels from a CSV of tile origins: ``slide_id,x,y,label``, x and y a tile's level-0 origin exactly as in
the tile store's ``coords``. Conflicting labels for one tile make it ambiguous; rows naming unknown slides or
coordinates not in the store are errors naming the CSV line numbers.
"""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dinov3_core.evaluate.geojson import LabelError, MalformedAnnotations
from dinov3_core.evaluate.label_report import (
    CSV_COLUMNS,
    LabelReport,
    listed,
    read_slide,
    slide_labels,
)


@dataclass(frozen=True)
class _CsvRow:
    line: int
    slide_id: str
    x: int
    y: int
    label: str


def label_csv(root: Path, path: Path, store_ids: list[str], selected: list[str], min_overlap: float) -> LabelReport:
    records = read_csv(path)
    known = set(store_ids)
    strangers = [r for r in records if r.slide_id not in known]
    if strangers:
        names = sorted({r.slide_id for r in strangers})
        raise LabelError(
            f"{path}: line(s) {listed([r.line for r in strangers])} name slides that are not in the tile store "
            f"{root} ({listed(names)}); use the store's slide ids ({listed(store_ids)}) or remove those rows"
        )
    by_slide: dict[str, list[_CsvRow]] = defaultdict(list)
    for r in records:
        by_slide[r.slide_id].append(r)
    report = LabelReport(annotations=path, min_overlap=min_overlap)
    report.missing = [sid for sid in selected if sid not in by_slide]
    if len(report.missing) == len(selected):
        raise LabelError(f"{path} has no row for the selected slide(s) {listed(selected)} of the tile store {root}")
    strays: list[_CsvRow] = []
    for sid in selected:
        if sid not in by_slide:
            continue
        slide = read_slide(root, sid)
        row_of = {(int(x), int(y)): i for i, (x, y) in enumerate(slide.coords.tolist())}
        rows = by_slide[sid]
        strays += [r for r in rows if (r.x, r.y) not in row_of]
        names = sorted({r.label for r in rows})
        column = {name: k for k, name in enumerate(names)}
        hits = np.zeros((len(names), len(slide.coords)), dtype=bool)
        for r in rows:
            if (r.x, r.y) in row_of:
                hits[column[r.label], row_of[(r.x, r.y)]] = True
        report.slides[sid] = slide_labels(sid, hits, names)
    if strays:
        strays.sort(key=lambda r: r.line)
        first = strays[0]
        raise LabelError(
            f"{path}: line(s) {listed([r.line for r in strays])} give x,y that are no tile of their slide in {root} "
            f"(line {first.line}: slide {first.slide_id!r}, x={first.x}, y={first.y}); x,y must be a tile's level-0 "
            "top-left corner exactly as in the slide's coords array of this store (not a centre, not another µm/px "
            "or tile size): fix or remove those rows"
        )
    return report


def read_csv(path: Path) -> list[_CsvRow]:
    try:
        # utf-8-sig: spreadsheets often start the file with a byte-order mark.
        with path.open(newline="", encoding="utf-8-sig") as handle:
            reader = csv.reader(handle)
            header = next(reader, None)
            if header is None:
                raise MalformedAnnotations(f"{path} is empty; the first line must be the header slide_id,x,y,label")
            columns = [h.strip().lower() for h in header]
            lacking = [c for c in CSV_COLUMNS if c not in columns]
            if lacking:
                raise MalformedAnnotations(
                    f"{path}: the header (line 1) lacks column(s) {', '.join(lacking)}; the first line must name "
                    f"the columns slide_id,x,y,label (got {','.join(header)})"
                )
            at = {c: columns.index(c) for c in CSV_COLUMNS}
            records = []
            for fields in reader:
                line = reader.line_num
                if not any(f.strip() for f in fields):
                    continue
                if len(fields) < len(header):
                    raise MalformedAnnotations(
                        f"{path}: line {line} has {len(fields)} field(s), the header {len(header)}; fix that row"
                    )
                slide_id, label = fields[at["slide_id"]].strip(), fields[at["label"]].strip()
                if not slide_id or not label:
                    raise MalformedAnnotations(
                        f"{path}: line {line} has an empty slide_id or label; fill it or drop it"
                    )
                x = _pixel(fields[at["x"]], path, line, "x")
                y = _pixel(fields[at["y"]], path, line, "y")
                records.append(_CsvRow(line, slide_id, x, y, label))
    except OSError as err:
        raise LabelError(f"cannot read annotation file {path}: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise MalformedAnnotations(f"{path} is not UTF-8 text; save it as UTF-8 CSV") from None
    except csv.Error as err:
        raise MalformedAnnotations(f"{path} is not a readable CSV file ({err}); save it as plain CSV") from None
    return records


def _pixel(value: str, path: Path, line: int, column: str) -> int:
    text = value.strip()
    try:
        return int(text)
    except ValueError:
        pass
    try:
        number = float(text)
    except ValueError:
        number = math.nan
    if number.is_integer():  # spreadsheets write 1024 as 1024.0
        return int(number)
    raise MalformedAnnotations(f"{path}: line {line}: {column}={value!r} is not an integer pixel coordinate")


__all__ = ["label_csv"]
