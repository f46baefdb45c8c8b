"""StaticKVStore: one layer's compressed history in fixed-capacity buffers, for a decode step compiled whole.

The same tokens in the same places as a `KVStore` (sinks, encoded chunks, full-precision window), but every
buffer is sized once from `capacity` tokens and every count is a 0-d tensor, so one decode step is pure tensor
code with fixed shapes: the new token is written at its slot, attention reads every slot under a mask of the
live ones, and a window that just filled encodes its oldest chunk into the next chunk slot. Nothing branches
on a count in Python (on the CPU that encoding is a `torch.cond` inside the graph), so
`torch.compile(fullgraph=True)` traces one graph that serves every step, and CUDA graphs can replay it.

A sliding-window layer keeps only the chunk slots its window can reach: when they are full, a flush drops the
oldest chunk (moving the others one slot on, so that slots stay in token order) before it writes the new one, as a
`KVStore` given the window drops what no later query reads. Slots map to token indices through the count of tokens
dropped.

Each buffer has one spare slot at its end (window: one token, encoded: one chunk) that takes the writes a step
does not keep (the new token while it is a sink; the chunk encoded when the window is not full), so that a
write never depends on a branch. Multi-token steps (prompts) run through a `KVStore` (`thaw`, then `freeze`).

A pipeline whose keys are coded around a centre turned to each position (`predict.rotary_center`) keeps the position
id of every sink and window token, and one per encoded chunk: its anchor, the first position of a chunk whose
positions run on (`SharedRope.chunk_tables`). A flush encodes the chunk at the positions its anchor gives, and decode
attention scores it from the anchors' tables, so that encoding and scoring turn the centre the same way.
"""

import torch

from torchkv._compat import materialized
from torchkv.pipeline import KVPipeline
from torchkv.positions import RopeFn, SharedRope, chunk_anchors, run_from, step_tables
from torchkv.store import KVStore


def static_refusal(pipeline: KVPipeline) -> str | None:
    """Why `pipeline`'s decode step cannot run on fixed-shape buffers, or None when it can."""
    if pipeline.window is not None:
        return (f"its window policy ({pipeline.window.spec()['policy']}) keeps a data-dependent number of tokens "
                "in full precision, so the window buffer has no fixed shape")
    if pipeline.selector is not None:
        return f"its {type(pipeline.selector).__name__} reads a data-dependent set of chunks (sparse attention)"
    if pipeline.carries:
        return "it predicts each layer from the previous layer's reconstruction of the whole history"
    if "x" in pipeline.requires:
        return "it caches the layer input X and rebuilds keys and values from it"
    if pipeline.codec.attention_rope == "tokens":
        return "its decode attention rebuilds each held key at its rotary position (pre-RoPE keys)"
    return None


def free_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation can take on `device`: free device memory and what PyTorch's caching allocator holds
    unused; None where that is not known (CPU)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t` viewed as unsigned bytes when it is a float8 tensor (which the CPU's `index_copy_` does not take)."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


class StaticKVStore:
    """Fixed-capacity buffers of one layer, filled from a `KVStore` and advanced one decode step at a time.

    Args:
        pipeline: the layer's pipeline (`KVPipeline.for_layer`); `static_refusal` must be None.
        capacity: the most tokens the layer will hold (sinks, encoded and window together).
        layers_after: layers of the cache after this one on its device (the capacity check).
        rope: the model's rotary embedding, for pipelines whose attention reads positions by chunk.
        sliding_window: the layer's sliding window W (a query at index q reads the tokens after q − W), or None.
            Given, the layer holds ⌈(W − 1) / chunk⌉ + 1 chunk slots at most, whatever the capacity.
    """

    def __init__(self, pipeline: KVPipeline, capacity: int, layers_after: int = 0,
                 rope: RopeFn | SharedRope | None = None, sliding_window: int | None = None):
        reason = static_refusal(pipeline)
        if reason is not None:
            raise ValueError(f"pipeline '{pipeline.name}' cannot use fixed-shape buffers: {reason}")
        #: positions are kept (sinks and window per token, encoded chunks by anchor) and cos/sin computed from them
        self.reads_positions = pipeline.codec.attention_rope == "chunks"
        if self.reads_positions and rope is None:
            raise ValueError(f"pipeline '{pipeline.name}' turns its key centre to each position; its fixed-shape "
                             "buffers need the model's rope function, as torchkv.patch gives it")
        self.rope = rope.rope if isinstance(rope, SharedRope) else rope
        self.pipeline, self.capacity = pipeline, capacity
        #: layers of the cache after this one, whose buffers are allocated after this one's (the capacity check)
        self.layers_after = layers_after
        self.sinks, self.chunk = pipeline.sinks, pipeline.chunk
        self.window = pipeline.residual + pipeline.chunk  # a full window holds this many
        self.chunks = -(-capacity // self.chunk)  # chunk slots, the spare one not counted
        self.sliding_window = sliding_window
        if sliding_window is not None:  # a chunk whose tokens a query can read lies within its last W − 1 tokens
            self.chunks = min(self.chunks, -(-(sliding_window - 1) // self.chunk) + 1)
        self.buffers: dict[str, torch.Tensor] = {}  # allocated by the first `freeze`
        self.rows: dict[str, int] = {}  # rows per chunk of each encoded state tensor
        self.prepared: dict[str, torch.Tensor] = {}
        self.params: dict[str, torch.Tensor] = {}
        #: decode steps leave a full window to `flush_if_full`, called by the host after the step
        #: (`models.step.compile_decode_step`), instead of encoding a chunk inside every step on CUDA
        self.host_flush = False
        #: (sinks, window tokens) as the host counts them for `flush_if_full`; None after steps it did not count
        self._held: tuple[int, int] | None = (0, 0)

    # -- to and from a KVStore (eager) ------------------------------------------------------------------

    def _allocate(self, store: KVStore, batch: int, device: torch.device) -> None:
        """Buffers for `store`'s batch, heads and dtype; the encoded layout is read from one encoded chunk."""
        pipe, c = self.pipeline, self.chunk
        b, h, d = batch, store.kv_heads, store.head_dim
        probe = torch.zeros(b, h, c, d, dtype=store.dtype, device=device)
        rope = self._rope_from(torch.zeros(b, 1, dtype=torch.long, device=device)) if self.reads_positions else ()
        state = pipe.encode_chunk(probe, probe, prepared=store.prepared, params=store.params,
                                  inputs=dict(zip(("cos", "sin"), rope)))
        self._check_fits(sum(t.numel() * t.element_size() for t in state.values()),
                         2 * b * h * (self.sinks + self.window + 1) * d * probe.element_size(), b, device)
        buffers = {}
        for name, t in state.items():
            self.rows[name] = t.shape[2]
            buffers[f"encoded.{name}"] = t.new_zeros(b, t.shape[1], (self.chunks + 1) * t.shape[2], *t.shape[3:])
        kv = {"dtype": store.dtype, "device": device}
        buffers.update({
            "sink_k": torch.zeros(b, h, self.sinks, d, **kv), "sink_v": torch.zeros(b, h, self.sinks, d, **kv),
            "res_k": torch.zeros(b, h, self.window + 1, d, **kv), "res_v": torch.zeros(b, h, self.window + 1, d, **kv),
            "res_valid": torch.zeros(b, self.window + 1, dtype=torch.bool, device=device),
        })
        if self.reads_positions:  # position ids: of each sink and window token, and each chunk slot's anchor
            for name, n in (("sink_pos", self.sinks), ("res_pos", self.window + 1), ("anchors", self.chunks + 1)):
                buffers[name] = torch.zeros(b, n, dtype=torch.long, device=device)
        # length: the next token's index; dropped: tokens of encoded chunks dropped (sliding window)
        for name in ("n_sinks", "n_chunks", "n_residual", "length", "dropped"):
            buffers[name] = torch.zeros((), dtype=torch.long, device=device)
        if not torch.compiler.is_compiling():  # fixed addresses: in-place updates keep CUDA graphs valid
            for t in buffers.values():
                torch._dynamo.mark_static_address(t)
        self.buffers = buffers

    def _check_fits(self, per_chunk: int, fixed: int, batch: int, device: torch.device) -> None:
        """Raise a clear error, before allocating, when this layer's buffers and those of the layers after it
        (taken as the same size) need more than `device` has free: `per_chunk` bytes per encoded chunk slot and
        `fixed` bytes of full-precision slots per layer."""
        free = free_bytes(device)
        layers = 1 + self.layers_after
        need = layers * ((self.chunks + 1) * per_chunk + fixed)
        if free is None or need <= free:
            return
        fit = max(0, (free // layers - fixed) // per_chunk - 1) * self.chunk
        raise ValueError(
            f"max_cache_len={self.capacity} does not fit on {device}: the fixed-capacity buffers of {layers} layers "
            f"need {need / 2**30:.2f} GiB at batch {batch}, and {free / 2**30:.2f} GiB are free. About {fit} tokens "
            f"fit at this batch: pass max_cache_len={fit} or less, or a smaller batch.")

    def freeze(self, store: KVStore) -> None:
        """Copy `store`'s tokens into the buffers (allocated on first use or when the batch changes), then empty it."""
        if store.n_seen > self.capacity:
            raise ValueError(f"the layer holds {store.n_seen} tokens, more than max_cache_len={self.capacity}")
        if store.n_encoded > self.chunks * self.chunk:  # a store given the same window holds no more
            raise ValueError(f"layer {store.layer} holds {store.n_encoded // self.chunk} encoded chunks, more than its "
                             f"{self.chunks} fixed chunk slots: give its KVStore the layer's sliding window")
        held = [t for t in (store.recent.k, store.sink_k, *store.encoded.values()) if t is not None]
        batch, device = held[0].shape[0], held[0].device
        buf = self.buffers
        if not buf or buf["res_k"].shape[0] != batch or buf["res_k"].dtype != store.dtype:
            self._allocate(store, batch, device)
            buf = self.buffers
        s, n_enc, n_res, dropped = store.n_sinks, store.n_encoded, store.n_residual, 0
        if store.dropped:  # its sinks went first: their slots count as filled, and the window passed them
            s, dropped = self.sinks, store.dropped - self.sinks
        for name, held in store.encoded.items():
            buf[f"encoded.{name}"][:, :, : held.shape[2]] = held
        if store.n_sinks:
            buf["sink_k"][:, :, :s], buf["sink_v"][:, :, :s] = store.sink_k, store.sink_v
        if n_res:
            buf["res_k"][:, :, :n_res], buf["res_v"][:, :, :n_res], buf["res_valid"][:, :n_res], _ = store.recent.held()
        if self.reads_positions:
            self._freeze_positions(store)
        counts = {"n_sinks": s, "n_chunks": n_enc // self.chunk, "n_residual": n_res, "length": store.n_seen,
                  "dropped": dropped}
        for name, n in counts.items():
            buf[name].fill_(n)
        self.prepared, self.params, self.dtype = store.prepared, store.params, store.dtype
        self.kv_heads, self.head_dim = store.kv_heads, store.head_dim
        self._held = (s, n_res)
        store.reset()

    def thaw(self, store: KVStore) -> None:
        """Refill the (empty) `store` with the buffers' tokens, as the `KVStore` that held them would hold them."""
        buf = self.buffers
        s, chunks, n_res, length, dropped = (int(buf[n]) for n in ("n_sinks", "n_chunks", "n_residual", "length",
                                                                    "dropped"))
        if self._sinks_passed(length):  # as the store would have dropped them (their slots are not read)
            dropped, s = dropped + s, 0
        store.reset()
        store.prepared, store.params, store.dtype = self.prepared, self.params, self.dtype
        store.kv_heads, store.head_dim = self.kv_heads, self.head_dim
        if s:
            store.sink_k, store.sink_v = buf["sink_k"][:, :, :s].clone(), buf["sink_v"][:, :, :s].clone()
        if chunks:
            store.chunks.extend({n: buf[f"encoded.{n}"][:, :, : chunks * rows].clone() for n, rows in self.rows.items()},
                                chunks * self.chunk)
        store.recent.hold(buf["res_k"][:, :, :n_res], buf["res_v"][:, :, :n_res], buf["res_valid"][:, :n_res], None)
        store.length, store.dropped = length - dropped, dropped
        if self.reads_positions:
            encoded = run_from(buf["anchors"][:, :chunks], self.chunk).flatten(1)
            store.positions.ids = torch.cat([buf["sink_pos"][:, :s], encoded, buf["res_pos"][:, :n_res]], 1)
            store.positions.by_chunk = True

    def _sinks_passed(self, length: int) -> bool:
        """Whether a sliding window has passed every sink once `length` tokens were seen (no query reads them)."""
        return self.sliding_window is not None and self.sinks > 0 and length - self.sliding_window + 1 >= self.sinks

    def _freeze_positions(self, store: KVStore) -> None:
        """Copy the position ids of `store`'s sinks and window, and its chunks' anchors (`SharedRope.chunk_tables`),
        into the buffers; a clear error where its encoded chunks' positions do not run on from their anchors."""
        s, c, n_enc = store.n_sinks, self.chunk, store.n_encoded
        if not store.positions.by_chunk:
            raise ValueError(
                f"pipeline '{self.pipeline.name}': the position ids of the tokens encoded in layer {store.layer} do not "
                f"run on by one within each chunk of {c} tokens, and fixed-capacity buffers (max_cache_len) keep one "
                "position per chunk for its turned key centre; pass consecutive position_ids, or decode without "
                "max_cache_len")
        ids, buf = store.positions.ids, self.buffers
        buf["sink_pos"][:, :s] = ids[:, :s]
        buf["anchors"][:, : n_enc // c] = chunk_anchors(ids[:, s : s + n_enc], c)
        buf["res_pos"][:, : store.n_residual] = ids[:, s + n_enc : store.length]

    # -- one decode step (pure tensor code) ---------------------------------------------------------------

    def _place(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, position: torch.Tensor | None) -> None:
        """Write the new token `[B, H, 1, D]` (and its position id `[B, 1]` where kept) to the next sink slot while
        sinks are missing, else to the window."""
        buf, s = self.buffers, self.sinks
        slot = buf["n_residual"].clone()  # the count moves on below
        if s:
            to_sink = buf["n_sinks"] < s
            put = (torch.arange(s, device=k.device) == buf["n_sinks"]) & to_sink  # [S]
            for side, x in (("sink_k", k), ("sink_v", v)):
                buf[side].copy_(torch.where(put[:, None], x, buf[side]))
            if position is not None:
                buf["sink_pos"].copy_(torch.where(put, position, buf["sink_pos"]))
            slot = torch.where(to_sink, self.window, slot)  # the spare slot
            buf["n_sinks"].add_(to_sink.long())
            buf["n_residual"].add_(1 - to_sink.long())
        else:
            buf["n_residual"].add_(1)
        buf["res_k"].index_copy_(2, slot.view(1), k)
        buf["res_v"].index_copy_(2, slot.view(1), v)
        buf["res_valid"].index_copy_(1, slot.view(1), valid)
        if position is not None:
            buf["res_pos"].index_copy_(1, slot.view(1), position)

    def _live(self, padding: torch.Tensor | None, rule, position: torch.Tensor) -> torch.Tensor:
        """[B or 1, 1, 1, N] bool: the slots the newest query attends to, in attention order (encoded, sinks, window).

        A slot is live when it holds a token, that token is not padding, the model's mask `rule` allows it (None:
        the plain causal rule, under which every held token is visible to the newest one), and the sliding window has
        not passed it (sinks a window passed keep their slots, but not their tokens, after a `KVStore` dropped them)."""
        buf, c, w = self.buffers, self.chunk, self.window
        device = position.device
        enc_idx = torch.arange((self.chunks + 1) * c, device=device)
        sink_idx = torch.arange(self.sinks, device=device)
        res_idx = torch.arange(w, device=device)
        live = torch.cat([enc_idx < buf["n_chunks"] * c, sink_idx < buf["n_sinks"], res_idx < buf["n_residual"]])[None]
        # the token index of each slot: sinks come first, then the dropped tokens, the encoded chunks and the window
        first = buf["n_sinks"] + buf["dropped"]
        index = torch.cat([enc_idx + first, sink_idx, res_idx + first + buf["n_chunks"] * c])
        if self.sliding_window is not None:
            live = live & (index > position - self.sliding_window)
        if padding is not None:
            live = live & padding.index_select(1, index.clamp(max=padding.shape[1] - 1))
        if rule is not None:
            batch = torch.arange(live.shape[0], device=device)[:, None, None, None]
            allowed = rule(batch, torch.zeros_like(batch), position.view(1, 1, 1, 1), index.view(1, 1, 1, -1))
            live = live & allowed[:, 0, 0]
        return live[:, None, None]

    def _encode_window(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, *operands: torch.Tensor):
        """The window's oldest chunk, encoded: one tensor per name of `self.rows` (`valid` as uint8: a bool operand
        of `torch.cond` became a constant of the branch graph, which Inductor then failed to lower). The operands
        after the spare slots: the chunk's cos/sin where positions are kept, then the prepared and fitted tables."""
        tables = operands[len(self.rows):]
        inputs = {}
        if self.reads_positions:
            (cos, sin), tables = tables[:2], tables[2:]
            inputs = {"cos": cos, "sin": sin}
        prepared = dict(zip(self.prepared, tables[: len(self.prepared)]))
        params = dict(zip(self.params, tables[len(self.prepared):]))
        state = self.pipeline.encode_chunk(k, v, prepared=prepared, params=params, valid=valid.bool(), inputs=inputs)
        return tuple(state[name] for name in self.rows)

    def _no_chunk(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, *operands: torch.Tensor):
        """What `_encode_window` returns when the window is not full: the spare chunk slot's content, unchanged."""
        return tuple(spare.clone() for spare in operands[: len(self.rows)])

    def _flush(self, known_full: bool = False) -> None:
        """If the window is full, encode its oldest chunk into the next chunk slot and shift the window. A sliding
        window's layer whose chunk slots are full first drops the oldest chunk, which its window has passed.

        A compiled step on the CPU holds both branches under `torch.cond` and runs one, so a step whose window is
        not full encodes nothing (frontier-2bit's whole step at 1K: 22 tokens/s against 18.6 encoding every step).
        On CUDA the step stays branch-free so that CUDA graphs capture it whole (Inductor runs a `torch.cond` from
        the host): it encodes the chunk every step, and a chunk not kept lands in the spare slot. Eagerly, and when
        the host has counted a full window (`known_full`), the flush reads no count from the device and selects
        nothing."""
        buf, c, w = self.buffers, self.chunk, self.window
        compiling = torch.compiler.is_compiling()
        full = None if known_full else buf["n_residual"] == w  # None: known to be full
        if full is not None and not compiling:
            if not bool(full):
                return
            full = None
        window = (buf["res_k"][:, :, :c], buf["res_v"][:, :, :c], buf["res_valid"][:, :c].to(torch.uint8))
        spares = (buf[f"encoded.{n}"][:, :, self.chunks * rows:] for n, rows in self.rows.items())
        rope, anchor = (), None
        if self.reads_positions:  # the chunk at the positions its anchor gives (its own, where they run on)
            anchor = chunk_anchors(buf["res_pos"][:, :c], c)  # [B, 1]
            rope = self._rope_from(anchor)
        operands = (*window, *spares, *rope, *self.prepared.values(), *self.params.values())
        if full is not None and full.device.type == "cpu":
            encoded = torch.cond(full, self._encode_window, self._no_chunk, operands)
        else:
            encoded = self._encode_window(*operands)
        # the spare chunk slot when not full
        target = buf["n_chunks"] if full is None else torch.where(full, buf["n_chunks"], self.chunks)
        dropped = 0 if self.sliding_window is None else self._drop_oldest(full)
        target = target - dropped
        for (name, rows), t in zip(self.rows.items(), encoded):
            index = target * rows + torch.arange(rows, device=t.device)
            _bits(buf[f"encoded.{name}"]).index_copy_(2, index, _bits(t))
        shifted = (("res_k", 2), ("res_v", 2), ("res_valid", 1))
        if anchor is not None:
            buf["anchors"].index_copy_(1, target.view(1), anchor)
            shifted += (("res_pos", 1),)
        for name, axis in shifted:
            t = buf[name]
            kept, old = t.narrow(axis, c, w - c), t.narrow(axis, 0, w - c)
            # the kept tokens copied out first: where the two ranges overlap (a window longer than two chunks),
            # Inductor's in-place shift read slots it had already written (compiled steps 0.35 off eager in logits)
            kept = materialized(kept)
            old.copy_(kept if full is None else torch.where(full, kept, old))
        buf["n_residual"].sub_(c if full is None else full.long() * c)
        buf["n_chunks"].add_((1 if full is None else full.long()) - dropped)

    def _drop_oldest(self, full: torch.Tensor | None) -> torch.Tensor:
        """Where the window is `full` (None: known to be) and every chunk slot holds a chunk, move the chunks (and
        their anchors) one slot towards the front, over the oldest, and count its tokens as dropped: pure tensor code,
        a copy of the slots at every flush of such a layer. Returns the 0-d count of chunks dropped (0 or 1)."""
        buf, c, n = self.buffers, self.chunk, self.chunks - 1
        drop = buf["n_chunks"] == self.chunks
        if full is not None:
            drop = drop & full
        moved = [(_bits(buf[f"encoded.{name}"]), 2, rows) for name, rows in self.rows.items()]
        if self.reads_positions:
            moved.append((buf["anchors"], 1, 1))
        for t, axis, rows in moved:
            front, after = t.narrow(axis, 0, n * rows), materialized(t.narrow(axis, rows, n * rows))
            front.copy_(torch.where(drop, after, front))
        buf["dropped"].add_(drop.long() * c)
        return drop.long()

    def decode_step(
        self,
        query: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        padding: torch.Tensor | None,
        rule,
        scaling: float,
        softcap: float | None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend one new token over the held ones and itself, then keep it.

        Args:
            query: [B, Hq, 1, D]. k, v: [B, H, 1, D], the new token.
            padding: [B, ≥ capacity] bool over token indices (False at padding), or None.
            rule: the model's mask function `(b, h, q_idx, kv_idx) -> bool`, or None for the plain causal rule.
            positions: [B or 1, 1] the new token's position id (default: its index in the sequence); kept where the
                pipeline reads positions.

        Returns:
            [B, Hq, 1, D] in the query's dtype.
        """
        buf = self.buffers
        position = buf["length"].clone()
        valid = (torch.ones(k.shape[0], 1, dtype=torch.bool, device=k.device) if padding is None
                 else padding.index_select(1, position.view(1)))
        held = None
        if self.reads_positions:
            given = position.view(1, 1) if positions is None else positions[:, -1:]
            held = given.to(device=k.device, dtype=torch.long).expand(k.shape[0], 1)
        self._place(k, v, valid, held)
        mask = materialized(self._live(padding, rule, position))
        encoded = {n: buf[f"encoded.{n}"].unflatten(2, (self.chunks + 1, rows)) for n, rows in self.rows.items()}
        k_fp = torch.cat([buf["sink_k"], buf["res_k"][:, :, : self.window]], 2)
        v_fp = torch.cat([buf["sink_v"], buf["res_v"][:, :, : self.window]], 2)
        out, _, _ = self.pipeline.attend_decode(
            materialized(query), encoded, k_fp, v_fp, mask, scaling, softcap, prepared=self.prepared, params=self.params,
            inputs=self._chunk_tables(), live=buf["n_chunks"] * self.chunk,
        )
        buf["length"].add_(1)
        if not self.host_flush:
            self._flush()
            self._held = None
        return out

    def _rope_from(self, anchor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) `[B, chunk, R]` of the positions `anchor [B, 1]` + 0..chunk−1."""
        return self.rope(run_from(anchor, self.chunk).flatten(1))

    def _chunk_tables(self) -> dict[str, torch.Tensor]:
        """The rotary tables of every chunk slot by its anchor, as `SharedRope.chunk_tables` gives a `KVStore`'s
        (`[B, chunks + 1, R]` and `[1, chunk, R]`); empty where the pipeline reads no position."""
        if not self.reads_positions:
            return {}
        anchors = self.buffers["anchors"]
        anchor_cos, anchor_sin = self.rope(anchors)
        step_cos, step_sin = step_tables(self.rope, self.chunk, anchors.device)
        return {"anchor_cos": anchor_cos, "anchor_sin": anchor_sin, "step_cos": step_cos, "step_sin": step_sin}

    def flush_if_full(self) -> None:
        """After a decode step run with `host_flush`: count its token on the host and, on the steps that fill the
        window, encode the oldest chunk (eagerly; its encoding is the pipeline's compiled `encode_chunk`). The
        host's count equals the buffers' counts, so no step waits for the device to know whether to flush (after
        steps that flushed on their own, it reads the counts once)."""
        if self._held is None:
            sinks, window = int(self.buffers["n_sinks"]), int(self.buffers["n_residual"])
        else:
            sinks, window = self._held
            sinks, window = (sinks + 1, window) if sinks < self.sinks else (sinks, window + 1)
        if window == self.window:
            self._flush(known_full=True)
            window -= self.chunk
        self._held = (sinks, window)

    # -- accounting -------------------------------------------------------------------------------------

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the store holds, by name."""
        held = dict(self.buffers)
        held.update({f"prepared.{n}": t for n, t in self.prepared.items()})
        borrowed = self.pipeline.borrowed_params()
        held.update({f"params.{n}": t for n, t in self.params.items() if n not in borrowed})
        return held

    def nbytes(self) -> int:
        """Bytes of storage of every tensor held (the full capacity of every buffer)."""
        return sum(t.untyped_storage().nbytes() for t in self.tensors().values())

    @property
    def n_encoded(self) -> int:
        return int(self.buffers["n_chunks"]) * self.chunk if self.buffers else 0

    def encoded_bits_per_value(self) -> float:
        """Stored bits per encoded key or value, metadata included, of the encoded tokens only."""
        chunks = self.n_encoded // self.chunk
        if not chunks:
            return float("nan")
        stored = 0
        for name, rows in self.rows.items():
            t = self.buffers[f"encoded.{name}"]
            stored += t[:, :, : chunks * rows].numel() * t.element_size()
        batch = self.buffers["res_k"].shape[0]
        return 8 * stored / (2 * chunks * self.chunk * batch * self.kv_heads * self.head_dim)
