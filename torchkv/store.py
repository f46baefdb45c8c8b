"""KVStore: one layer's compressed KV history (DESIGN §4).

Tokens are held in absolute order: the first `sinks` tokens in full precision, then encoded chunks,
then a full-precision residual window. New tokens enter the window; once it holds
`residual + chunk` tokens, the oldest whole chunks are encoded, unless the pipeline's window policy
lets the window grow instead. No full-precision copy of an encoded token is kept. A layer that attends through a
sliding window drops the sinks and the whole encoded chunks that no later query can read.
"""

from collections.abc import Callable, Mapping

import torch

from torchkv.encoded import EncodedChunks, appended, owned
from torchkv.fp_window import FullPrecisionWindow
from torchkv.pipeline import KVPipeline
from torchkv.positions import RopeFn, SharedRope, TrackedPositions



def flushed(held: int, limit: int, chunk: int) -> int:
    """Tokens a window of `held` tokens encodes when it reaches `limit` (`residual + chunk`): its oldest whole chunks,
    so that fewer than `limit` stay; 0 below the limit."""
    return ((held - limit) // chunk + 1) * chunk if held >= limit else 0


def layer_input(pipeline: KVPipeline, inputs: Mapping[str, torch.Tensor] | None, batch: int, tokens: int
                ) -> torch.Tensor | None:
    """`inputs["x"]` [B, T, d], checked, when the pipeline caches the layer input (XQuant); else None."""
    if "x" not in pipeline.requires:
        return None
    x = (inputs or {}).get("x")
    if x is None or x.shape[:2] != (batch, tokens):
        raise ValueError(
            f"pipeline '{pipeline.name}' caches the layer input: the store needs inputs['x'] [batch, tokens, "
            f"hidden] for its {tokens} new tokens (a model patched by torchkv.patch supplies it), got "
            f"{None if x is None else tuple(x.shape)}"
        )
    return x


_HELD = ("sink_k", "sink_v")
#: token axis of each tensor a store keeps until it prepares (`KVStore.unprepared`)
_UNPREPARED_AXES = {"k": 2, "v": 2, "valid": 1, "queries": 2, "x": 1}


class CrossLayer:
    """What each layer's store hands the next one within a forward pass, for pipelines that predict across
    layers (`KVPipeline.carries`): its reconstruction, in projection space, of the tokens it just encoded
    ("encode") or of its whole encoded history ("history"). Only the latest layer's is held (transient).

    Args:
        num_layers: decoder layers; the last one keeps nothing.
    """

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self._held: dict[str, tuple[int, dict[str, torch.Tensor]]] = {}

    def put(self, kind: str, layer: int, carry: Mapping[str, torch.Tensor]) -> None:
        if layer + 1 < self.num_layers:
            self._held[kind] = (layer, dict(carry))
        else:
            self._held.pop(kind, None)

    def take(self, kind: str, layer: int, tokens: int) -> dict[str, torch.Tensor]:
        """Layer `layer - 1`'s carry of `tokens` tokens as inputs "previous.k"/"previous.v"."""
        held_layer, carry = self._held.pop(kind, (None, {}))
        if held_layer != layer - 1 or carry["k"].shape[2] != tokens:
            raise RuntimeError(
                f"layer {layer} predicts from layer {layer - 1}'s reconstruction of its {tokens} {kind} tokens, but "
                f"{'nothing' if held_layer is None else f'layer {held_layer}'} handed them over; cross-layer "
                "pipelines need every layer of one model in one cache, run in layer order"
            )
        return {f"previous.{side}": t for side, t in carry.items()}


class KVStore:
    """The cache of one layer.

    Args:
        pipeline: how chunks are encoded.
        layer: the model layer index (selects per-layer fitted parameters).
        rope: the model's rotary embedding, needed when a transform requires "cos"/"sin"
            (the store then keeps every token's position id): a `SharedRope` that the cache's other layers share,
            or a function.
        cross_layer: shared by the stores of every layer when the pipeline predicts across layers.
        sliding_window: the layer's sliding window W (a query at index q reads the tokens after q − W), or None.
            Given, the store drops the sinks, and then whole encoded chunks, once every token of them is at or
            before `held − W` (as transformers' sliding layers keep W − 1 tokens); pipelines that predict across
            layers or select encoded tokens by per-chunk state keep every token.
    """

    def __init__(
        self, pipeline: KVPipeline, layer: int = 0, rope: RopeFn | SharedRope | None = None,
        cross_layer: CrossLayer | None = None, sliding_window: int | None = None,
    ):
        pipeline = pipeline.for_layer(layer)
        if pipeline.carries and cross_layer is None:
            raise ValueError(f"pipeline '{pipeline.name}' predicts across layers; its stores need a shared CrossLayer")
        self.pipeline, self.layer, self.rope, self.cross_layer = pipeline, layer, rope, cross_layer
        drops = sliding_window is not None and not pipeline.carries and pipeline.selector is None
        self.sliding_window = sliding_window if drops else None
        self.tracks_positions = bool({"cos", "sin"} & pipeline.requires)
        self.tracks_input = "x" in pipeline.requires  # XQuant encodes the window's tokens from their layer input
        self.prepares = pipeline.needs_prepare  # per-sequence state from the first tokens (`_prepare_once_held`)
        if self.tracks_positions and rope is None:
            raise ValueError(f"pipeline '{pipeline.name}' reads the tokens' cos/sin in layer {layer} (pre-RoPE "
                             "keys, or a turned centre); the store needs the model's rope function, as torchkv.patch "
                             "gives it")
        self.reset()

    def reset(self) -> None:
        """Forget every token (the pipeline and layer stay)."""
        self.length = 0  # tokens held
        self.dropped = 0  # tokens dropped from the front (sliding window): the first held one's index
        self.window_limit = self.pipeline.residual + self.pipeline.chunk  # a full window holds this many
        self.sink_k: torch.Tensor | None = None  # [B, H, S, D]
        self.sink_v: torch.Tensor | None = None
        self.chunks = EncodedChunks(self.pipeline.chunk)
        self.prepared: dict[str, torch.Tensor] = {}  # per-sequence state from the prompt
        self.unprepared: dict[str, torch.Tensor] = {}  # the tokens appended while too few to prepare from
        self.params: dict[str, torch.Tensor] | None = None  # the layer's fitted parameters, on its device
        largest = self.window_limit if self.pipeline.window is None else self.pipeline.window.max_window
        self.recent = FullPrecisionWindow(largest, self.tracks_input)  # the residual window
        self.dtype: torch.dtype | None = None  # of the tokens appended
        self.kv_heads = self.head_dim = 0
        self.positions = TrackedPositions(self.rope) if self.tracks_positions else None

    @property
    def n_sinks(self) -> int:
        return 0 if self.sink_k is None else self.sink_k.shape[2]

    @property
    def n_seen(self) -> int:  # tokens appended so far, the dropped ones included: the next token's index
        return self.dropped + self.length

    @property
    def sinks_missing(self) -> int:  # sinks still to take from the next tokens (none once they were dropped)
        return 0 if self.dropped else self.pipeline.sinks - self.n_sinks

    @property
    def n_encoded(self) -> int:  # tokens held in encoded chunks
        return self.chunks.n

    @property
    def encoded(self) -> dict[str, torch.Tensor]:  # their state (`EncodedChunks.state`)
        return self.chunks.state

    @property
    def n_residual(self) -> int:  # tokens held in the residual window
        return self.recent.n

    def _rope_inputs(self, start: int, end: int) -> dict[str, torch.Tensor]:
        """cos/sin of the tokens held at indices [start, end), for transforms that require them."""
        return {} if self.positions is None else self.positions.rope_inputs(start, end)

    def append(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        valid: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        inputs: Mapping[str, torch.Tensor] | None = None,
        attention: torch.Tensor | None = None,
    ) -> None:
        """Add tokens at the end of the sequence.

        Args:
            k, v: [B, H, T, D] in the model's dtype.
            valid: [B, T] bool, False at padding (kept out of quantization statistics).
            positions: [B or 1, T] position ids (default: their index in the sequence).
            inputs: model-side tensors of these T tokens that `prepare` may read (e.g. "queries"), read once
                a chunk of tokens is held (`_prepare_once_held`). Stores that `tracks_input` need "x" `[B, T, d]`,
                the layer input, which they keep for window tokens until those are encoded.
            attention: [T, sinks + window + T] float32, the attention probability each new token's
                query gave each full-precision token (sinks, window, new tokens), averaged over batch
                rows and query heads; what the pipeline's window policy decides on.
        """
        pipe = self.pipeline
        b, _, t, _ = k.shape
        if self.params is None:
            self.params = {n: p.to(k.device) for n, p in pipe.layer_params(self.layer).items()}
        x = layer_input(self.pipeline, inputs, b, t)
        n = self.n_residual
        if self._enters_window(t):
            self.recent.reserve(k, v, n + t, x)
            self.recent.with_new(k, v)
            self._count_in_window(k, valid, x, positions)
            self._prepare_once_held(k, v, valid, inputs)
            return
        if valid is None:
            valid = torch.ones(b, t, dtype=torch.bool, device=k.device)
        if self.positions is not None:
            self.positions.extend(positions, b, t, k.device, self.dropped)
        first = self.length == 0 and not self.prepared
        self.dtype, self.kv_heads, self.head_dim = k.dtype, k.shape[1], k.shape[-1]
        self.length += t
        self._prepare_once_held(k, v, valid, inputs)
        self._settle(k, v, valid, x, attention, first)
        self._drop_unreadable()

    @property
    def awaits_prepare(self) -> bool:
        """The pipeline prepares per-sequence state (`KVPipeline.prepare`) and the store holds too few tokens yet."""
        return self.prepares and not self.prepared

    def _prepare_once_held(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None,
                           inputs: Mapping[str, torch.Tensor] | None) -> None:
        """Prepare the pipeline's per-sequence state from the first tokens, once the store holds at least one chunk
        of them (so before any is encoded): a prompt as long is prepared from alone, as it comes; a shorter one's
        tokens `[B, H, T, D]` (with their `valid`, queries and layer inputs) are kept, and the state prepared from
        all of them with the tokens after. From one token (generation from a lone BOS) frontier-2bit's balance
        scales are degenerate: its perplexity on SmolLM2 rose from 15.7 to 217 on the tokens after the first
        chunk was encoded."""
        if not self.awaits_prepare:
            return
        if valid is None:
            valid = torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device)
        held = {"k": k, "v": v, "valid": valid, **{n: t for n, t in (inputs or {}).items() if n in _UNPREPARED_AXES}}
        if self.unprepared:
            held = {n: torch.cat([self.unprepared[n], t], _UNPREPARED_AXES[n]) for n, t in held.items()}
        if self.length < self.pipeline.chunk:
            self.unprepared = held
            return
        self.unprepared = {}
        k, v, valid = held.pop("k"), held.pop("v"), held.pop("valid")
        own = {**(inputs or {}), **held, **self._rope_inputs(0, k.shape[2])}
        self.prepared = self.pipeline.prepare(k, v, layer=self.layer, valid=valid, inputs=own)

    def _drop_unreadable(self) -> None:
        """Drop the sinks, then whole encoded chunks, that no later query of a sliding-window layer reads: those at
        indices at or before `n_seen − W`."""
        if self.sliding_window is None:
            return
        unreadable = self.length - self.sliding_window + 1  # held tokens no later query reads
        sinks = self.n_sinks
        if unreadable < sinks:  # the sinks go first
            return
        encoded = min(unreadable - sinks, self.n_encoded) // self.pipeline.chunk * self.pipeline.chunk
        if not sinks + encoded:
            return
        if sinks:
            self.sink_k = self.sink_v = None
        if encoded:
            self.chunks.drop_front(encoded)
        self.dropped += sinks + encoded
        self.length -= sinks + encoded
        if self.positions is not None:  # one drop, which the layers dropping the same share
            self.positions.drop_front(sinks + encoded)

    def _settle(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, x: torch.Tensor | None,
                attention: torch.Tensor | None, first: bool) -> None:
        """Place appended tokens `[B, H, T, D]`: the missing sinks first, then after the window, whose oldest whole
        chunks are encoded when the window policy flushes."""
        pipe, n = self.pipeline, self.n_residual
        take = min(self.sinks_missing, k.shape[2])
        if take > 0:
            self.sink_k = appended(self.sink_k, k[:, :, :take], 2)
            self.sink_v = appended(self.sink_v, v[:, :, :take], 2)
            k, v, valid = k[:, :, take:], v[:, :, take:], valid[:, take:]
            x = None if x is None else x[:, take:]

        buf_k, buf_v, buf_valid, buf_x = self.recent.followed_by(k, v, valid, x)
        if pipe.window is not None and not pipe.window.compresses_after_prompt and not first:
            flush = 0
        elif pipe.window is None or attention is None or take > 0:
            flush = flushed(buf_k.shape[2], self.window_limit, pipe.chunk)
        else:
            flush, self.window_limit = pipe.window.flushed(
                attention.tolist(), n, self.n_sinks, self.window_limit, pipe.residual, pipe.chunk)
        if flush:
            self._encode_front(buf_k[:, :, :flush], buf_v[:, :, :flush], buf_valid[:, :flush],
                               None if buf_x is None else buf_x[:, :flush])
        self.recent.hold(buf_k[:, :, flush:], buf_v[:, :, flush:], buf_valid[:, flush:],
                         None if buf_x is None else buf_x[:, flush:])

    def _encode_front(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, x: torch.Tensor | None) -> None:
        """Encode the tokens `[B, H, T, D]` that leave the window (T a multiple of the chunk) and append their state
        to the encoded chunks; cross-layer pipelines take the previous layer's reconstruction and hand on theirs."""
        pipe, t = self.pipeline, k.shape[2]
        start = self.n_sinks + self.n_encoded
        inputs = self._rope_inputs(start, start + t)
        if self.positions is not None and pipe.codec.attention_rope == "chunks":
            self.positions.check_chunks(start, start + t, pipe.chunk, valid)
        if x is not None:
            inputs["x"] = x
        if pipe.carries and self.layer:
            inputs.update(self.cross_layer.take("encode", self.layer, t))
        state = pipe.encode_chunk(k, v, prepared=self.prepared, valid=valid, inputs=inputs, params=self.params)
        if pipe.carries:
            self.cross_layer.put("encode", self.layer, {s: state.pop(f"carry.{s}") for s in ("k", "v")})
        self.chunks.extend(state, t)

    def _enters_window(self, tokens: int) -> bool:
        """Appending `tokens` completes no chunk: they only enter the window (a decode step's token, mostly)."""
        return self.n_residual + tokens < self.window_limit and not self.sinks_missing and self.length > 0

    def _count_in_window(self, k: torch.Tensor, valid: torch.Tensor | None, x: torch.Tensor | None,
                         positions: torch.Tensor | None) -> None:
        """Count the tokens `k: [B, H, T, D]` written after the window as held (their validity, layer inputs and
        position ids with them)."""
        b, _, t, _ = k.shape
        self.recent.count(t, valid, x)
        if self.positions is not None:
            self.positions.extend(positions, b, t, k.device, self.dropped)
        self.length += t
        self._drop_unreadable()

    def attention_order(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """A mask over the held tokens and new ones `[..., length + new]` in sequence order (sinks, encoded, window,
        new), reordered as decode attention reads them: encoded chunks first, then sinks, window and new tokens."""
        if mask is None:
            return None
        s, e = self.n_sinks, self.n_encoded
        return torch.cat([mask[..., s : s + e], mask[..., :s], mask[..., s + e :]], -1)

    def decode_step(
        self,
        query: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
        softcap: float | None = None,
        *,
        valid: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        inputs: Mapping[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Attend one new token per row over the held tokens and itself through the pipeline's compiled decode
        attention, then keep it: one call per layer and step, as `StaticKVStore.decode_step` is for fixed-capacity
        buffers. The token is written once, after the window, where attention reads it; a step that completes a
        chunk encodes the window's oldest one (`append`).

        Args:
            query: [B, Hq, 1, D]. k, v: [B, H, 1, D], the new token.
            mask: [B or 1, 1, 1, length + 1] bool in sequence order (True = attend), or None when every held token
                is visible to the new one.
            valid, positions, inputs: the new token's, as `append` takes them.

        Returns:
            [B, Hq, 1, D] in the query's dtype.
        """
        x = layer_input(self.pipeline, inputs, k.shape[0], 1)
        k_fp, v_fp = self.full_precision(k, v)
        window = self.pipeline.window
        if window is not None:  # a view of a window buffer that grows would put its capacity in guards
            k_fp, v_fp = k_fp.contiguous(), v_fp.contiguous()
        out, fp_attention, carry = self.pipeline.attend_decode(
            query, self.chunks.by_chunk(), k_fp, v_fp, self.attention_order(mask), scale, softcap,
            prepared=self.prepared, params=self.params, inputs=self.attention_inputs(),
        )
        self.hand_over(carry)
        if self._enters_window(1):
            self._count_in_window(k, valid, x, positions)
        else:
            attention = fp_attention[None] if window is not None and window.reads_attention else None
            self.append(k, v, valid=valid, positions=positions, inputs=inputs, attention=attention)
        return out

    def history_inputs(self) -> dict[str, torch.Tensor]:
        """What rebuilding the encoded tokens reads besides their state: cos/sin of their positions and, across
        layers, the previous layer's reconstruction of them (taken: call `hand_over` with this layer's after)."""
        start = self.n_sinks
        inputs = self._rope_inputs(start, start + self.n_encoded)
        if self.pipeline.carries and self.layer:
            inputs.update(self.cross_layer.take("history", self.layer, self.n_encoded))
        return inputs

    def attention_inputs(self) -> dict[str, torch.Tensor]:
        """What decode attention over the encoded tokens reads besides their state: `history_inputs`, or the chunk
        tables of their positions (`TrackedPositions.chunk_inputs`) where the pipeline's attention reads positions
        only through them and every encoded chunk's positions run on (`SharedRope.runs_by_chunk`)."""
        if self.positions is not None and self.positions.by_chunk and self.pipeline.codec.attention_rope == "chunks":
            return self.positions.chunk_inputs(self.n_sinks, self.n_sinks + self.n_encoded, self.pipeline.chunk)
        return self.history_inputs()

    def hand_over(self, carry: Mapping[str, torch.Tensor]) -> None:
        """Give the next layer this layer's reconstruction of the encoded tokens (cross-layer pipelines)."""
        if self.pipeline.carries:
            self.cross_layer.put("history", self.layer, carry)

    def decode_encoded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoded chunks reconstructed, `[B, H, n_encoded, D]` each in the cache dtype (transient)."""
        k, v, *carry = self.pipeline.decode_chunk(
            self.encoded, head_dim=self.head_dim, prepared=self.prepared, inputs=self.history_inputs(),
            params=self.params,
        )
        self.hand_over(carry[0] if carry else {})
        return k.to(self.dtype), v.to(self.dtype)

    def gather_encoded(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoded tokens reconstructed from only their own rows of the encoded state (sparse attention).

        Args:
            tokens: [B, H, N] indices among the encoded tokens, chosen per KV head.

        Returns:
            (k, v) each `[B, H, N, D]` in the cache dtype (transient).
        """
        ks, vs = [], []
        for head in range(tokens.shape[1]):  # the encoded rows of a token may hold every head (SVDq's shared latent)
            idx = tokens[:, head]  # [B, N]
            rows = self.chunks.rows_of(idx)
            inputs = {} if self.positions is None else self.positions.rope_at(self.n_sinks + idx)
            k, v = self.pipeline.codec.decode_rows(rows, self.head_dim, self.params, self.prepared, inputs)
            ks.append(k[:, head])
            vs.append(v[:, head])
        return torch.stack(ks, 1).to(self.dtype), torch.stack(vs, 1).to(self.dtype)

    def history(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token held, in order, reconstructed: `(k, v)` each `[B, H, length, D]` (transient)."""
        ks, vs = [], []
        if self.n_sinks:
            ks.append(self.sink_k)
            vs.append(self.sink_v)
        if self.n_encoded:
            k, v = self.decode_encoded()
            ks.append(k)
            vs.append(v)
        if self.n_residual:
            k, v, *_ = self.recent.held()
            ks.append(k)
            vs.append(v)
        return torch.cat(ks, 2), torch.cat(vs, 2)

    def history_noise(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where the pipeline corrects key scores for their codes' noise (`KVPipeline.history_noise`), for queries
        `[B, Hq, Q, D]` over `history()`: (`‖q'‖²` `[B, Hq, Q]`, each held token's noise `[B, H, length]`, zero for
        the full-precision ones); None otherwise."""
        if not self.n_encoded:
            return None
        found = self.pipeline.history_noise(query, self.encoded, head_dim=self.head_dim, prepared=self.prepared,
                                            params=self.params)
        if found is None:
            return None
        norms, noise = found
        b, h = noise.shape[:2]
        return norms, torch.cat([noise.new_zeros(b, h, self.n_sinks), noise, noise.new_zeros(b, h, self.n_residual)], 2)

    def full_precision(self, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sinks, window and the new tokens, in order: `(k, v)` each `[B, H, sinks + window + new, D]`.

        The new tokens are written after the window (not counted: `append` still owns that), so the
        window and them are one view."""
        k, v = self.recent.with_new(k_new, v_new)
        if self.n_sinks:
            k, v = torch.cat([self.sink_k, k], 2), torch.cat([self.sink_v, v], 2)
        return k, v

    # -- accounting ----------------------------------------------------------------------------------

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the store holds, by name."""
        held = {f"encoded.{n}": t for n, t in self.encoded.items()}
        held.update({f"prepared.{n}": t for n, t in self.prepared.items()})
        held.update({f"unprepared.{n}": t for n, t in self.unprepared.items()})
        borrowed = self.pipeline.borrowed_params()  # views of the model's weights hold no memory of their own
        held.update({f"params.{n}": t for n, t in (self.params or {}).items() if n not in borrowed})  # predictors, bases
        for name in _HELD:
            if getattr(self, name) is not None:
                held[name] = getattr(self, name)
        held.update(self.recent.tensors())
        if self.positions is not None:
            held.update(self.positions.tensors())
        return held

    def nbytes(self) -> int:
        """Bytes of storage of every tensor held (allocated window capacity included)."""
        return sum(t.untyped_storage().nbytes() for t in self.tensors().values())

    def encoded_bits_per_value(self) -> float:
        """Stored bits per encoded key or value, metadata included (sinks, window and prepared state excluded)."""
        return self.chunks.bits_per_value(self.kv_heads, self.head_dim)

    # -- batch and length edits ------------------------------------------------------------------------

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.chunks.map_batch(fn)
        self.prepared = {n: fn(t) for n, t in self.prepared.items()}
        self.unprepared = {n: fn(t) for n, t in self.unprepared.items()}
        for name in _HELD:
            if getattr(self, name) is not None:
                setattr(self, name, fn(getattr(self, name)))
        self.recent.map_batch(fn)
        if self.positions is not None:
            self.positions.map_batch(fn)

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Select batch rows (beam search): every tensor is indexed along dim 0."""
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, tokens: int) -> None:
        """Drop the last `tokens` tokens.

        Within the residual window this is exact. Cropping into encoded chunks drops whole chunks and
        moves the kept tokens of the last partly cropped chunk, reconstructed, back into the window.
        """
        if tokens <= 0 or self.length == 0:
            return
        tokens = min(tokens, self.length)
        if self.dropped and self.dropped > self.n_seen - tokens - self.sliding_window + 1:
            raise ValueError(
                f"layer {self.layer} attends through a sliding window of {self.sliding_window} tokens and has dropped "
                f"its first {self.dropped}, some of which a query after removing {tokens} tokens would read: remove "
                f"at most {self.n_seen - self.sliding_window + 1 - self.dropped} (or crop before the window slides "
                "past them)"
            )
        keep = self.length - tokens
        keep_encoded = min(max(keep - self.n_sinks, 0), self.n_encoded)
        chunk = self.pipeline.chunk
        whole = keep_encoded // chunk * chunk
        if tokens > self.n_residual and keep_encoded > whole and self.tracks_input:
            raise ValueError(
                f"pipeline '{self.pipeline.name}' caches a function of the layer input, which cannot be rebuilt from "
                f"reconstructed keys and values: crop only whole encoded chunks of {chunk} tokens (or within the window)"
            )
        if self.positions is not None:
            self.positions.keep(keep)
        self.unprepared = {n: t.narrow(_UNPREPARED_AXES[n], 0, keep) for n, t in self.unprepared.items()}
        if tokens <= self.n_residual:
            self.recent.n -= tokens
        else:  # the window goes with the dropped chunks; a partly kept chunk's tokens return to it, reconstructed
            k, v = self.decode_encoded() if keep_encoded > whole else (None, None)
            self.chunks.keep(whole)
            if keep < self.n_sinks:
                self.sink_k, self.sink_v = owned(self.sink_k[:, :, :keep]), owned(self.sink_v[:, :, :keep])
            self.recent.n = 0
            if k is not None:
                k, v = k[:, :, whole:keep_encoded], v[:, :, whole:keep_encoded]
                self.recent.hold(k, v, torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device), None)
        self.length = keep

