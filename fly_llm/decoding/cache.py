"""Batched KV-cache bookkeeping for ragged rows (docs/design.md §3.1).

One batched cache per model. Every forward appends the same number of columns to every row;
columns a row does not keep (rejected draft tokens, padding) stay in the buffers but are zeroed
in that row's 2D attention mask ("holes"), and every forward gets explicit per-row position ids
(the row's true length), so each row computes exactly what it would compute alone. Columns that
no row keeps are cropped from the end at once; when holes pile up the cache is compacted (each
row's kept columns gathered, left-padded). A new request is prefilled on its own and spliced in
left-padded; finished rows are removed by index.

The key/value buffers are preallocated and grow by doubling, so a round writes its new columns
in place instead of re-allocating the whole cache.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

_MIN_CAPACITY = 64


class BufferLayer(DynamicLayer):
    """A cache layer over preallocated `[B, H, capacity, D]` buffers; `keys`/`values` are views."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._k = key_states.new_zeros(_with_len(key_states.shape, _MIN_CAPACITY))
        self._v = value_states.new_zeros(_with_len(value_states.shape, _MIN_CAPACITY))
        self._n = 0
        self._refresh()
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new columns after the used ones; return views of all used columns."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        _, _, start = self.open_columns(key_states.shape[-2])
        self._k[:, :, start:self._n] = key_states
        self._v[:, :, start:self._n] = value_states
        return self.keys, self.values

    def open_columns(self, q: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Count q more columns as used (in `keys`/`values`) without writing them: returns the key and value
        buffers [B, H, capacity, D] and the first new column, for the caller to write in place before
        reading `keys`/`values` (fly_llm.model.fused_layers: rotary and the write in one native call).
        The layer must be initialized."""
        start = self._n
        self._reserve(start + q)
        self._n = start + q
        self._refresh()
        return self._k, self._v, start

    def get_seq_length(self) -> int:
        return self._n if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` columns (transformers' negative convention)."""
        if self.is_initialized and tokens_to_remove < 0:
            self._n = max(0, self._n + tokens_to_remove)
            self._refresh()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            indices = indices.to(self._k.device)  # layers may sit on different devices (device_map)
            self._k, self._v = self._k[indices], self._v[indices]
            self._refresh()

    def gather_columns(self, index: torch.Tensor) -> None:
        """Replace the used columns by `index` [B, n] (per-row column indices into the used ones)."""
        if not self.is_initialized:
            return
        n = index.shape[1]
        b, h, _, d = self._k.shape
        idx = index.to(self.device)[:, None, :, None].expand(b, h, n, d)
        k, v = torch.gather(self.keys, 2, idx), torch.gather(self.values, 2, idx)
        self._n = 0
        self._reserve(n)
        self._k[:, :, :n], self._v[:, :, :n] = k, v
        self._n = n
        self._refresh()

    def set_buffers(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Adopt full key/value tensors `[B, H, n, D]` as the used columns."""
        self.set_parts([keys], [values])

    def set_parts(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Adopt key/value parts `[B, H, n_i, D]`, one after the other, as the used columns (written
        straight into the new buffers: no concatenated copy first)."""
        if not self.is_initialized:
            self.lazy_initialization(keys[0], values[0])
        n = sum(k.shape[-2] for k in keys)
        self._k = keys[0].new_zeros(_with_len(keys[0].shape, _capacity(n)))
        self._v = values[0].new_zeros(_with_len(values[0].shape, _capacity(n)))
        start = 0
        for k, v in zip(keys, values):
            end = start + k.shape[-2]
            self._k[:, :, start:end], self._v[:, :, start:end] = k, v
            start = end
        self._n = n
        self._refresh()

    def _reserve(self, n: int) -> None:
        if n > self._k.shape[2]:
            cap = _capacity(n)
            for name in ("_k", "_v"):
                old = getattr(self, name)
                new = old.new_zeros(_with_len(old.shape, cap))
                new[:, :, :self._n] = old[:, :, :self._n]
                setattr(self, name, new)

    def _refresh(self) -> None:
        self.keys = self._k[:, :, :self._n]
        self.values = self._v[:, :, :self._n]


def _with_len(shape: torch.Size, n: int) -> tuple[int, ...]:
    return (shape[0], shape[1], n, shape[3])


def _capacity(n: int) -> int:
    cap = _MIN_CAPACITY
    while cap < n:
        cap *= 2
    return cap


def new_cache() -> Cache:
    """An empty cache whose layers are BufferLayers (created on the first forward)."""
    return Cache(layer_class_to_replicate=BufferLayer)


class BatchKV:
    """A model's batched cache plus the per-row attention mask and true lengths.

    `mask[b, j]` says whether column j holds a token of row b; `lengths[b]` is the number of such
    columns (the row's next position id). Use: `mask, pos = kv.inputs(q)`, run the model with
    `cache=kv.cache, attention_mask=mask, position_ids=pos`, then `kv.advance(q)` and
    `kv.truncate(lengths)` to keep only what each row accepted.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cache = new_cache()
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=device)
        self.lengths: list[int] = []

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        """Columns in use (the same for every row)."""
        return self.mask.shape[1]

    def check(self) -> None:
        """Assert the invariant: mask is [rows, width] with `lengths` kept columns per row, and every
        initialized layer holds exactly [rows, ·, width, ·] (an empty cache may have none)."""
        rows, width = self.batch_size, self.width
        assert self.mask.shape == (rows, width), (tuple(self.mask.shape), rows, width)
        assert self.mask.sum(1).tolist() == self.lengths, (self.mask.sum(1).tolist(), self.lengths)
        for i, layer in enumerate(self.cache.layers):
            if not layer.is_initialized:
                assert width == 0, f"layer {i} is empty but the cache is {width} columns wide"
                continue
            assert layer._k.shape[0] == rows and tuple(layer.keys.shape[::2]) == (rows, width), (
                f"layer {i}: keys {tuple(layer.keys.shape)}, buffer {tuple(layer._k.shape)}; {rows} rows × {width}")

    def inputs(self, q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention mask [B, width+q] and position ids [B, q] for a forward of q new columns."""
        ones = torch.ones(self.batch_size, q, dtype=torch.long, device=self.device)
        lengths = torch.tensor(self.lengths, dtype=torch.long, device=self.device)
        positions = lengths[:, None] + torch.arange(q, device=self.device)
        return torch.cat([self.mask, ones], dim=1), positions

    def advance(self, q: int) -> None:
        """Record that the forward appended q columns, all counted as kept until truncated."""
        ones = torch.ones(self.batch_size, q, dtype=torch.long, device=self.device)
        self.mask = torch.cat([self.mask, ones], dim=1)
        self.lengths = [n + q for n in self.lengths]

    def truncate(self, lengths: list[int]) -> None:
        """Keep only each row's first `lengths[b]` tokens (later columns become holes)."""
        lengths = [min(a, b) for a, b in zip(lengths, self.lengths)]
        if lengths == self.lengths:
            return
        keep = torch.tensor(lengths, dtype=torch.long, device=self.device)
        self.mask = self.mask * (self.mask.cumsum(1) <= keep[:, None])
        self.lengths = lengths
        self._crop_empty_tail()
        if self._should_compact():
            self.compact()

    def _should_compact(self) -> bool:
        """Holes pile up: the width exceeds the longest row by 32 columns and by half its length."""
        longest = max(self.lengths, default=0)
        return self.width - longest >= max(32, longest // 2)

    def compact(self) -> None:
        """Gather each row's kept columns, right-aligned: the width becomes the longest row."""
        width = max(self.lengths, default=0)
        order = torch.sort(self.mask, dim=1, stable=True).indices[:, self.width - width:]
        for layer in self.cache.layers:
            layer.gather_columns(order)
        self.mask = torch.gather(self.mask, 1, order)

    @classmethod
    def prefill(cls, model, tokens: list[int], device: torch.device) -> "BatchKV":
        """A single-row BatchKV holding `tokens`, computed alone (ready for `add_row`)."""
        kv = cls.single_row([], device)
        kv.extend(model, tokens)
        return kv

    @classmethod
    def single_row(cls, layers: list[tuple[list[torch.Tensor], list[torch.Tensor]]], device: torch.device) -> "BatchKV":
        """A single-row BatchKV holding given keys/values: per layer, the key parts and the value parts
        (`[H, n_i, D]` each, in token order); [] = empty."""
        kv = cls(device)
        n = sum(k.shape[1] for k in layers[0][0]) if layers else 0
        kv.lengths = [n]
        kv.mask = torch.ones(1, n, dtype=torch.long, device=device)
        for keys, values in layers:
            layer = BufferLayer()
            layer.set_parts([k[None] for k in keys], [v[None] for v in values])
            kv.cache.layers.append(layer)
        return kv

    def extend(self, model, tokens: list[int]) -> None:
        """Append `tokens` to a single-row BatchKV (a prefill, or one chunk of it)."""
        if tokens:
            self.forward(model, torch.tensor([tokens], device=self.device), logits_to_keep=1)

    def row_kv(self, b: int, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of row b's keys/values for its tokens start..end-1 (`[H, n, D]` per layer, holes skipped)."""
        columns = self.mask[b].nonzero().squeeze(1)[start:end]
        return [(layer.keys[b][:, columns.to(layer.device)], layer.values[b][:, columns.to(layer.device)])
                for layer in self.cache.layers if layer.is_initialized]

    def forward(self, model, input_ids: torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor:
        """Run `model` on input_ids [B, q] appended to every row; return its logits.

        All q columns count as kept until `truncate`; pad a ragged batch on the right so the
        padding never precedes a real token.
        """
        q = input_ids.shape[1]
        mask, positions = self.inputs(q)
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, cache=self.cache,
                    use_cache=True, logits_to_keep=logits_to_keep)
        self.mask, self.lengths = mask, [n + q for n in self.lengths]  # what advance(q) would do
        return out.logits

    def remove_rows(self, keep: list[int]) -> None:
        """Keep only the rows at the given indices (in that order)."""
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        for layer in self.cache.layers:
            layer.batch_select_indices(index)
        self.mask = self.mask[index]
        self.lengths = [self.lengths[i] for i in keep]
        self._crop_empty_tail()

    def add_row(self, row: "BatchKV") -> None:
        """Append a single-row BatchKV (prefilled alone) as the last row, left-padding as needed."""
        if self.width == 0:  # nothing stored: drop layers still sized for an earlier batch
            self.cache = new_cache()
        width = max(self.width, row.width)
        for i in range(max(len(self.cache.layers), len(row.cache.layers))):
            parts = [_layer_kv(self, i, width), _layer_kv(row, i, width)]
            like = next((p for p in parts if p is not None), None)
            if like is None:
                continue
            parts = [p if p is not None else _zeros_kv(like, src.batch_size, width)
                     for p, src in zip(parts, (self, row))]
            if i >= len(self.cache.layers):
                self.cache.layers.append(BufferLayer())
            self.cache.layers[i].set_buffers(torch.cat([parts[0][0], parts[1][0]]),
                                             torch.cat([parts[0][1], parts[1][1]]))
        self.mask = torch.cat([_left_pad(self.mask, width), _left_pad(row.mask, width)])
        self.lengths = self.lengths + row.lengths

    def _crop_empty_tail(self) -> None:
        if not self.width:
            return
        used = self.mask.any(0) * torch.arange(1, self.width + 1, device=self.device)
        tail = self.width - int(used.max())
        if tail:
            self.cache.crop(-tail)
            self.mask = self.mask[:, :self.width - tail]


def _left_pad(mask: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(mask, (width - mask.shape[1], 0))


def _layer_kv(kv: BatchKV, i: int, width: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Layer i's used keys/values left-padded to `width` columns, or None if it holds nothing."""
    if i >= len(kv.cache.layers) or not kv.cache.layers[i].is_initialized or kv.width == 0:
        return None
    layer, pad = kv.cache.layers[i], width - kv.width
    return (torch.nn.functional.pad(layer.keys, (0, 0, pad, 0)),
            torch.nn.functional.pad(layer.values, (0, 0, pad, 0)))


def _zeros_kv(like: tuple[torch.Tensor, torch.Tensor], rows: int, width: int):
    k, v = like
    return (k.new_zeros(rows, k.shape[1], width, k.shape[3]), v.new_zeros(rows, v.shape[1], width, v.shape[3]))
