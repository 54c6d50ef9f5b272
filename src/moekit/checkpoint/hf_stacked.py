"""`ExpertWeights` fields assembled from a per-expert checkpoint's tensors, reading only a share's bytes.

Data flow: role -> key template (`{e}` for the expert) and one expert's stored shapes -> `stacked_fields`
-> one `Stacked` per field (w13 = gate rows then up rows, CONCAT; w2 = down; their FP8 scales alike) ->
`read_stacked` (the experts a rank owns, cut along rows or columns as its `Cut` says, piece by piece into
one preallocated tensor) -> `check_codes` (no NaN FP8 code) and `check_scales` (finite, > 0), each naming
the offending key -> `per_row` turns [E, rows, 1] channel scales into ExpertWeights' [E, rows].
A per-tensor scale (`StoredScale.TENSOR`) is one value a projection: `Stacked.broadcast` repeats it over
the projection's rows, so it is read as per-channel scales that hold the same numbers.
Used by `hf_loader.load_hf_moe_layer`.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from moekit.checkpoint.files import Files, open_file
from moekit.checkpoint.hf_quant import ExpertQuantization, StoredScale
from moekit.errors import CheckpointError
from moekit.formats import find_fp8_nan_codes
from moekit.parallel import Cut


@dataclass(frozen=True)
class Stacked:
    """One `ExpertWeights` field assembled from per-expert tensors: for expert e, the rows of each
    piece's key (`template.format(e=e)`) one after the other, `cols` columns, `dtype`; with `broadcast`,
    each key holds one value that fills all of its piece's rows."""

    pieces: tuple[tuple[str, int], ...]  # (key template, rows), in row order
    cols: int
    dtype: torch.dtype
    broadcast: bool = False

    @property
    def rows(self) -> int:
        return sum(rows for _, rows in self.pieces)

    def key_at(self, expert: int, row: int) -> str:
        for template, rows in self.pieces:
            if row < rows:
                return template.format(e=expert)
            row -= rows
        raise IndexError(row)


def stacked_fields(
    templates: dict[str, str],
    weight_shapes: dict[str, tuple[int, int]],
    weight_dtype: torch.dtype,
    quant: ExpertQuantization | None,
) -> dict[str, Stacked]:
    """Each `ExpertWeights` field as the rows of its per-expert pieces (`weight_shapes`: one expert's
    [out, in] of each role): w13 = gate rows then up rows (CONCAT), w2 = down; their scales alike."""

    def stacked(roles: tuple[str, ...], rows_cols: dict[str, tuple[int, int]], dtype: torch.dtype) -> Stacked:
        pieces = tuple((templates[role], rows_cols[role.removesuffix("_scale")][0]) for role in roles)
        broadcast = quant is not None and quant.stored is StoredScale.TENSOR and roles[0].endswith("_scale")
        return Stacked(pieces, rows_cols[roles[0].removesuffix("_scale")][1], dtype, broadcast)

    fields = {
        "w13": stacked(("gate", "up"), weight_shapes, weight_dtype),
        "w2": stacked(("down",), weight_shapes, weight_dtype),
    }
    if quant is not None:
        # rows and columns of each projection's scale as it is read: blocks, or one column of per-row values
        blocks = quant.stored is StoredScale.BLOCK_128
        scale_shapes = {
            role: quant.stored.shapes(out, inp)[0] if blocks else (out, 1)
            for role, (out, inp) in weight_shapes.items()
        }
        fields["w13_scale"] = stacked(("gate_scale", "up_scale"), scale_shapes, torch.float32)
        fields["w2_scale"] = stacked(("down_scale",), scale_shapes, torch.float32)
    return fields


def read_stacked(
    stack: ExitStack, files: Files, field: Stacked, experts: list[int], cut: Cut | None, device: torch.device
) -> torch.Tensor:
    """`field` for `experts`, cut along its rows (dim 1) or columns (dim 2) as `cut` says, read piece by
    piece into one tensor: only the bytes kept are read, and no stacked copy of the whole is made."""
    row_segments = cut.segments if cut is not None and cut.dim == 1 else ((0, field.rows),)
    col_segments = cut.segments if cut is not None and cut.dim == 2 else ((0, field.cols),)
    rows, cols = sum(n for _, n in row_segments), sum(n for _, n in col_segments)
    out = torch.empty((len(experts), rows, cols), dtype=field.dtype, device=device)
    handles: dict[Path, object] = {}
    for slot, expert in enumerate(experts):
        out_row = 0
        for start, length in row_segments:
            offset = 0
            for template, piece_rows in field.pieces:
                lo, hi = max(start, offset), min(start + length, offset + piece_rows)
                if lo < hi:
                    key = template.format(e=expert)
                    file = files.key_to_file[key]
                    if file not in handles:
                        handles[file] = stack.enter_context(open_file(file, device=device))
                    rows_out = slice(out_row + lo - start, out_row + hi - start)
                    if field.broadcast:  # one value ([1] or []) for all the piece's rows
                        out[slot, rows_out, :] = handles[file].get_tensor(key).reshape(())
                    else:
                        view = handles[file].get_slice(key)
                        out_col = 0
                        for col_start, col_length in col_segments:
                            part = view[lo - offset : hi - offset, col_start : col_start + col_length]
                            out[slot, rows_out, out_col : out_col + col_length].copy_(part)
                            out_col += col_length
                offset += piece_rows
            out_row += length
    return out


def check_scales(field: Stacked, scales: torch.Tensor, experts: list[int], cut: Cut | None) -> None:
    """The [E, rows, cols] scales read for `field` are finite and > 0, or the first bad one's key is named."""
    bad = ~(torch.isfinite(scales) & (scales > 0))
    if bad.any():
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise CheckpointError(
            f"{int(bad.sum())} FP8 weight scale(s) read from this layer are not finite and > 0, first in "
            f"{_key_of(field, first, experts, cut)!r}: {scales[first].item()!r}; the checkpoint is damaged, "
            "and those blocks would decode to NaN or inf: restore the file"
        )


def check_codes(field: Stacked, codes: torch.Tensor, experts: list[int], cut: Cut | None) -> None:
    """The [E, rows, cols] FP8 codes read for `field` hold no NaN (E4M3 0x7F / 0xFF), or the first bad
    one's key is named."""
    count, first = find_fp8_nan_codes(codes)
    if count:
        raise CheckpointError(
            f"{count} FP8 weight code(s) read from this layer are NaN (E4M3 0x7F / 0xFF), first in "
            f"{_key_of(field, first, experts, cut)!r}; the checkpoint is damaged, and every token routed "
            "through them would come out NaN: restore the file"
        )


def _key_of(field: Stacked, index: tuple[int, ...], experts: list[int], cut: Cut | None) -> str:
    """The checkpoint key that holds element `index` (slot, row, col) of what was read for `field` (the
    row of a row cut mapped back to the stored tensor's)."""
    slot, row, _ = index
    if cut is not None and cut.dim == 1:  # the row in the stored tensor, not in the share
        for start, length in cut.segments:
            if row < length:
                row += start
                break
            row -= length
    return field.key_at(experts[slot], row)


def per_row(scales: torch.Tensor, quant: ExpertQuantization) -> torch.Tensor:
    """Scales as `ExpertWeights` holds them: blocks as read, channel and tensor ones [E, rows]."""
    return scales if quant.stored is StoredScale.BLOCK_128 else scales.squeeze(-1)
