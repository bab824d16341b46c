"""Attention for a packed batch of sessions over the server's page pool, in a fixed number of calls per layer.

A round packs the new tokens of several requests side by side (segments: decode steps, prefill chunks,
cache-less forwards), hidden states (1, tokens, hidden). Projections and MLPs run once over all of them;
attention runs per *group* of sequences, never per session:

    decode     sequences with one new query each, keys gathered from the pool    (n, heads, 1, keys)
    prefill    sequences with a chunk of queries, keys gathered from the pool    (n, heads, chunk, keys)
    cacheless  sequences with no cache, keys from the round's own new tokens     (n, heads, length, length)

A round whose one group has n sequences of q queries each, sequence i's being packed tokens i*q .. i*q + q - 1,
needs no reordering of queries or outputs at all: decode steps only (q = 1), verify steps of drafts of one length
(a single session's, always), and a captured round of CUDA graphs (swarm/server/graphs.py, padding slots
included). Such a group is `uniform`.

Everything a group needs (which packed token each query is, which pool slot each key is, the masks) is
computed once per round, as tensors, and shared by every layer. Per layer and group: a gather of the
queries, two of keys and values, one scaled_dot_product_attention (a soft-capped layer's: the few ops of
softcapped_attention, which no fused kernel does), one scatter of the outputs; plus, per layer, two writes
of the new keys and values into the pool. So a layer issues the same number of torch calls for 1 session as
for 64, and the shapes of a decode round depend only on the number of sequences and the longest of them
(what CUDA graphs need).

Padding keys point at the pool's zero page and are masked out; padding queries are computed and dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F

from swarm.protocol import PAGE_TOKENS
from swarm.server.cache import KVPool, SessionCache, pages_for


@dataclass
class Segment:
    """One request's part of a packed batch: `rows` sequences of `length` new tokens each, from absolute
    `position`. In the packed batch its tokens are consecutive, row after row."""

    rows: int
    length: int
    position: int
    cache: Optional[SessionCache]  # None: cache-less sequences, nothing kept (position is then 0)
    adapter: Optional[str] = None  # the LoRA adapter its tokens go through (swarm/server/adapters.py), if any

    @property
    def tokens(self) -> int:
        return self.rows * self.length


@dataclass
class Group:
    """Sequences attended in one call: their queries padded to one length, their keys to another."""

    from_pool: bool  # keys in the pool (cached sessions), or among the round's new tokens (cache-less)
    query_tokens: torch.Tensor  # (n, queries) packed token of each query (padding: token 0)
    key_index: torch.Tensor  # pool groups: (n, pages) page table (padding: the zero page); else (n, keys) tokens
    query_positions: torch.Tensor  # (n, queries) absolute positions
    key_positions: torch.Tensor  # (keys,) absolute positions 0..keys-1
    key_valid: torch.Tensor  # (n, keys) bool: a real key of the sequence
    real_queries: Optional[torch.Tensor]  # (real queries,) flat indices of the unpadded ones; None: all real
    destination: torch.Tensor  # (real queries,) the packed tokens they answer for
    write_slots: Optional[torch.Tensor]  # (real queries,) pool slots their keys/values go to (pool groups)
    uniform: bool = False  # the round's only group, its (n, q) queries are packed tokens 0 .. n*q - 1 in order
    masks: dict = field(default_factory=dict)  # window -> what scaled_dot_product_attention gets as attn_mask
    # a lone sequence whose pages lie one after another in the pool: them, read in place rather than gathered
    consecutive_pages: Optional[slice] = None


class PackedBatch:
    """The new tokens of several requests side by side in one sequence, hidden states (1, tokens, hidden).
    Built once per forward, with its groups' indices; families add positions (rotary cos/sin, ALiBi slopes)
    and the masks are built once for every attention window of the forward's layers."""

    def __init__(self, positions: torch.Tensor, groups: list[Group], pool: Optional[KVPool], first_layer: int):
        self.positions = positions  # (tokens,) absolute position of each new token
        self.groups, self.pool, self.first_layer = groups, pool, first_layer  # pool layer of the range's first block
        self.rotary: dict = {}  # rotary families: layer type (None: every layer) -> cos, sin (1, tokens, rotary dims)
        self.alibi_slopes: Optional[torch.Tensor] = None  # ALiBi families: (heads,) float32
        self.adapter_tokens: dict[str, torch.Tensor] = {}  # LoRA adapter -> (tokens,) its segments' packed tokens

    @classmethod
    def of(cls, segments: list[Segment], pool: Optional[KVPool], first_layer: int, device) -> "PackedBatch":
        batch = cls(token_positions(segments, device), group_sequences(segments, pool, device), pool, first_layer)
        batch.adapter_tokens = adapter_tokens(segments, device)
        return batch

    def build_masks(self, windows: set, dtype: torch.dtype) -> None:
        for group in self.groups:
            group.masks = {window: _mask(group, window, self.alibi_slopes, dtype) for window in windows}

    def attend(self, index: int, queries, keys, values, window: Optional[int], scale: float,
               softcap: Optional[float] = None) -> torch.Tensor:
        """Packed (1, tokens, heads, head_dim) queries/keys/values of layer `index` of the forward's range ->
        (1, tokens, heads * head_dim): the new keys/values go to the pool, each query sees its own past. With
        `softcap`, the scores are capped (tanh(scores / softcap) * softcap) before the mask and softmax."""
        queries, keys, values = queries[0], keys[0], values[0]
        layer = self.first_layer + index
        pool = (*self.pool.layer(layer), *self.pool.paged_layer(layer)) if self.pool is not None else None
        attend = (lambda group: self._attend_group(group, queries, keys, values, pool, window, scale, softcap))
        if len(self.groups) == 1 and self.groups[0].uniform:  # no reordering to do
            return attend(self.groups[0])[None]
        output = queries.new_empty(queries.shape[0], queries.shape[1] * queries.shape[2])  # (tokens, heads*dim)
        for group in self.groups:
            output.index_copy_(0, group.destination, attend(group))
        return output[None]

    @staticmethod
    def _attend_group(group: Group, queries, keys, values, pool: Optional[tuple], window, scale,
                      softcap) -> torch.Tensor:
        """The group's real queries' outputs (real queries, heads * head_dim), in the order of its destination.
        `pool`: the layer's keys and values in the pool by slot, then by page (see KVPool.paged_layer)."""
        if group.from_pool:
            pool_keys, pool_values, paged_keys, paged_values = pool
            new_keys, new_values = (keys, values) if group.uniform else \
                (keys.index_select(0, group.destination), values.index_select(0, group.destination))
            pool_keys.index_copy_(0, group.write_slots, new_keys)
            pool_values.index_copy_(0, group.write_slots, new_values)
            gathered_keys, gathered_values = _gather_pages(paged_keys, group), _gather_pages(paged_values, group)
        else:
            gathered_keys, gathered_values = _gather(keys, group.key_index), _gather(values, group.key_index)
        attention = F.scaled_dot_product_attention if softcap is None else partial(softcapped_attention,
                                                                                  softcap=softcap)
        attended = attention(
            queries.unflatten(0, group.query_tokens.shape).transpose(1, 2) if group.uniform else
            _gather(queries, group.query_tokens),
            gathered_keys,  # (n, kv_heads, keys, head_dim)
            gathered_values,  # queries: (n, heads, queries, head_dim)
            attn_mask=group.masks[window],
            scale=scale,
            enable_gqa=True,
        ).transpose(1, 2).flatten(2).flatten(0, 1)  # (n * queries, heads * head_dim)
        return attended if group.real_queries is None else attended.index_select(0, group.real_queries)


def softcapped_attention(queries, keys, values, attn_mask: torch.Tensor, scale: float, softcap: float,
                         enable_gqa: bool = True) -> torch.Tensor:
    """scaled_dot_product_attention's arguments and result, with the scores capped as Gemma 2's attention caps
    them (transformers' eager attention: scores * scale, tanh(/ softcap) * softcap, mask, softmax in float32),
    which no fused kernel does. Queries (n, heads, queries, head_dim) over keys/values (n, kv heads, keys,
    head_dim): each KV head's group of query heads in one matmul, no repeated keys. `attn_mask`: bool
    (n, 1, queries, keys), True where a key is visible (no ALiBi family caps its scores)."""
    n, query_heads, length, head_dim = queries.shape
    grouped = queries.unflatten(1, (keys.shape[1], query_heads // keys.shape[1]))  # (n, kv, group, queries, dim)
    scores = torch.matmul(grouped, keys[:, :, None].transpose(-1, -2)) * scale  # (n, kv, group, queries, keys)
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~attn_mask[:, :, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(queries.dtype)
    return torch.matmul(weights, values[:, :, None]).flatten(1, 2)  # (n, heads, queries, head_dim)


def _gather(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows (tokens or slots, heads, head_dim) picked by index (n, length) -> (n, heads, length, head_dim).
    index_select, not advanced indexing: on a CPU it is several times faster for these shapes."""
    return rows.index_select(0, index.flatten()).unflatten(0, index.shape).transpose(1, 2)


def _gather_pages(pages: torch.Tensor, group: Group) -> torch.Tensor:
    """Whole pages (pages, PAGE_TOKENS, heads, head_dim) picked by the group's page table (n, pages) -> (n, heads,
    pages * PAGE_TOKENS, head_dim): a few long copies rather than many short ones."""
    if group.consecutive_pages is not None:  # a view of the pool: no copy of every key, every layer
        picked = pages[group.consecutive_pages]
    else:
        picked = pages.index_select(0, group.key_index.reshape(-1))  # (n * pages, PAGE_TOKENS, heads, head_dim)
    return picked.view(group.key_index.shape[0], -1, *pages.shape[2:]).transpose(1, 2)


# ------------------------------------------------------------------------------- built once per round


def token_positions(segments: list[Segment], device) -> torch.Tensor:
    positions = [position for segment in segments for _ in range(segment.rows)
                 for position in range(segment.position, segment.position + segment.length)]
    return torch.tensor(positions, device=device)  # one tensor op whatever the number of sessions


def adapter_tokens(segments: list[Segment], device) -> dict[str, torch.Tensor]:
    """Each LoRA adapter of the round -> the packed tokens of its segments (one tensor per adapter)."""
    tokens: dict[str, list[int]] = {}
    offset = 0
    for segment in segments:
        if segment.adapter is not None:
            tokens.setdefault(segment.adapter, []).extend(range(offset, offset + segment.tokens))
        offset += segment.tokens
    return {name: torch.tensor(indices, device=device) for name, indices in tokens.items()}


def _sequences(segments: list[Segment]):
    """(segment, row, first packed token) of every sequence of the round."""
    offset = 0
    for segment in segments:
        for row in range(segment.rows):
            yield segment, row, offset + row * segment.length
        offset += segment.tokens


def group_sequences(segments: list[Segment], pool: Optional[KVPool], device) -> list[Group]:
    kinds = {"decode": [], "prefill": [], "cacheless": []}
    for sequence in _sequences(segments):
        segment = sequence[0]
        kind = "cacheless" if segment.cache is None else "decode" if segment.length == 1 else "prefill"
        kinds[kind].append(sequence)
    groups = [_pool_group(sequences, pool, device) if kind != "cacheless" else _cacheless_group(sequences, device)
              for kind, sequences in kinds.items() if sequences]
    # the round's only group, its n sequences of q queries each (no padding) packed in order: sequence i's are
    # tokens i*q .. i*q + q - 1 (a decode round; a verify round of drafts of one length, as one session's is)
    if len(groups) == 1 and groups[0].from_pool and groups[0].real_queries is None:
        groups[0].uniform = True
    return groups


def _pool_group(sequences: list, pool: KVPool, device) -> Group:
    """Sequences whose keys are in the pool (decode steps, or prefill chunks and verify steps): which packed token
    each query is, which slot its keys go to, worked out on Python ints and made in a handful of tensor calls
    (as tensor arithmetic, some forty calls: on a round of one session, most of the round's fixed cost)."""
    lengths = [segment.length for segment, _, _ in sequences]
    starts = [segment.position for segment, _, _ in sequences]
    firsts = [first for _, _, first in sequences]
    queries = max(lengths)
    # every sequence's page table (its pages past its length: the zero page); positions past a sequence's length
    # within its last page are masked, and hold zeros or an earlier session's finite values
    tables = [segment.cache.tables[row][: pages_for(segment.position + segment.length)]
              for segment, row, _ in sequences]
    pages = pages_for(max(start + length for start, length in zip(starts, lengths)))
    real = [(index, offset) for index, length in enumerate(lengths) for offset in range(length)]
    positions = [starts[index] + offset for index, offset in real]
    slots = [tables[index][position // PAGE_TOKENS] * PAGE_TOKENS + position % PAGE_TOKENS
             for (index, _), position in zip(real, positions)]
    destination = [firsts[index] + offset for index, offset in real]
    padded = len(real) < len(sequences) * queries
    query_tokens = [[first + offset if offset < length else 0 for offset in range(queries)]
                    for first, length in zip(firsts, lengths)] if padded else None
    key_positions = torch.arange(pages * PAGE_TOKENS, device=device)
    ends = torch.tensor([start + length for start, length in zip(starts, lengths)], device=device)
    destination = torch.tensor(destination, device=device)
    return Group(
        consecutive_pages=_consecutive(tables[0]) if len(tables) == 1 else None,
        from_pool=True,
        query_tokens=torch.tensor(query_tokens, device=device) if padded else destination.view(len(sequences), -1),
        key_index=pool.page_table(tables, pages).to(device),
        query_positions=torch.tensor([[start + offset for offset in range(queries)] for start in starts],
                                     device=device),  # (n, queries), padding queries' positions included
        key_positions=key_positions,
        key_valid=key_positions[None, :] < ends[:, None],  # (n, keys)
        real_queries=torch.tensor([index * queries + offset for index, offset in real], device=device)
        if padded else None,
        destination=destination,
        write_slots=torch.tensor(slots, device=device),
    )


def _consecutive(table: list[int]) -> Optional[slice]:
    """The pages of a page table as one slice of the pool, where they lie one after another (a lone session's
    pages mostly do: the pool hands out its lowest free pages first)."""
    if table and table[-1] - table[0] == len(table) - 1 and all(b == a + 1 for a, b in zip(table, table[1:])):
        return slice(table[0], table[-1] + 1)
    return None


def _cacheless_group(sequences: list, device) -> Group:
    """Sequences with no cache, from position 0: their keys are their own new tokens."""
    lengths = torch.tensor([segment.length for segment, _, _ in sequences])
    starts = torch.tensor([segment.position for segment, _, _ in sequences])
    firsts = torch.tensor([first for _, _, first in sequences])
    max_queries, max_keys = int(lengths.max()), int((starts + lengths).max())
    offsets = torch.arange(max_queries)
    query_valid = offsets[None, :] < lengths[:, None]  # (n, queries)
    query_tokens = torch.where(query_valid, firsts[:, None] + offsets, 0)
    query_positions = starts[:, None] + offsets
    key_positions = torch.arange(max_keys)
    key_valid = key_positions[None, :] < (starts + lengths)[:, None]  # (n, keys)
    flat_valid = query_valid.flatten()
    return Group(
        from_pool=False,
        query_tokens=query_tokens.to(device),
        key_index=torch.where(key_valid, firsts[:, None] + key_positions, 0).to(device),
        query_positions=query_positions.to(device),
        key_positions=key_positions.to(device),
        key_valid=key_valid.to(device),
        real_queries=None if bool(flat_valid.all()) else flat_valid.nonzero().flatten().to(device),
        destination=query_tokens.flatten()[flat_valid].to(device),
        write_slots=None,
    )


def _mask(group: Group, window: Optional[int], slopes: Optional[torch.Tensor], dtype) -> torch.Tensor:
    """(n, 1, queries, keys) bool: which keys each query may see (its own past, within the window, not
    padding); or, for ALiBi, the float bias slope * key position with the rest at -inf: (n, heads, queries, keys).
    Always a mask, even where one sequence sees all its keys: the same kernels for 1 session as for 64."""
    queries, keys = group.query_positions[:, :, None], group.key_positions[None, None, :]
    visible = group.key_valid[:, None, :] & (keys <= queries)
    if window is not None:
        visible &= keys > queries - window
    if slopes is not None:
        bias = (slopes[:, None, None] * group.key_positions.to(slopes.dtype)).to(dtype)  # (heads, 1, keys)
        return bias[None].masked_fill(~visible[:, None], float("-inf"))
    return visible[:, None]
