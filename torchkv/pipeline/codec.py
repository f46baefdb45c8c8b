"""`Codec`: encode, decode and decode attention of one pair of chains over explicit state, and the library's one
compile boundary: `Codec.run` decides whether a call runs eagerly or through `torch.compile` (CPU Inductor, or
Inductor with a Triton kernel of `ops.triton_decode` or `ops.triton_grid_decode` on CUDA)."""

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping

import torch

from torchkv._compat import mark_dynamic, own_cache, recompile_headroom
from torchkv.ops import triton_decode, triton_grid_decode
from torchkv.pipeline.chain import Chain, decode_pair, side_inputs
from torchkv.pipeline.state import LayerState, prefixed, side_of, substate
from torchkv.transforms.quantizers import HiggsQuantize, UniformQuantize

#: compiled code rounds through the stored metadata dtypes exactly as eager does
COMPILE_OPTIONS = {"emulate_precision_casts": True, "cpp_wrapper": True}
#: `compile="auto"`: eager calls of a function before it is compiled (layers that share chains share the count).
#: A count, not a time, so that whether a step runs compiled (which rounds differently) never depends on the machine's
#: speed. 2,048 calls are about 5 s of eager decode attention on 2 CPU cores at 1K-4K tokens (1.3-4 ms a call), about
#: what compiling one function costs with Inductor's disk cache warm: a process stops paying the eager price once it
#: has paid as much as compiling would cost (ski rental); a 30-layer model's first 68 steps never wait for a compile.
EAGER_CALLS_BEFORE_COMPILE = 2048


class Codec:
    """The functions that encode, decode and attend over the stored form of one pair of chains.

    They take per-layer tensors (`params`: the layer's fitted parameters, `prepared`: per-sequence state, `inputs`:
    model-side tensors), never a layer index, so that one compiled graph serves every layer that shares the chains.

    Attributes:
        compile: when `run` compiles: "auto", True or False (see `KVPipeline`).
        carries: each layer hands its reconstruction in projection space to the next (cross-layer prediction).
        compiled, eager_calls: by function name, its compiled form and (`compile="auto"`) its eager calls so far.
    """

    def __init__(self, keys: Chain, values: Chain, carries: bool, compile: bool | str):
        if any(t.corrects_scores for chain in getattr(values, "chains", [values]) for t in chain.transforms):
            raise ValueError("score_correction=True corrects the scores of key codes; values are not scored: drop it "
                             "from the value chain")
        self.keys, self.values, self.carries, self.compile = keys, values, carries, compile
        self.compiled: dict[str, object] = {}
        self.eager_calls: dict[str, int] = {}
        self._row_chains: tuple[Chain, Chain] | None = None  # built by `decode_rows`
        self._kernel_warned = False  # `warn_without_kernel` says it once

    def encode(self, k: torch.Tensor, v: torch.Tensor, layer: LayerState, valid: torch.Tensor | None):
        """Keys and values `[B, H, T, D]` -> one flat state ("k."/"v." entries; "carry.k"/"carry.v" when `carries`)."""
        if not self.carries:
            return {**prefixed(self.keys.encode(k, side_of(layer, "k"), valid), "k."),
                    **prefixed(self.values.encode(v, side_of(layer, "v"), valid), "v.")}
        # closed loop: each chain's reconstruction is what the value chain and the next layer read
        state, carry = {}, {}
        for side, chain, x in (("k", self.keys, k), ("v", self.values, v)):
            own = side_of(layer, side, side_inputs(layer.inputs, side, carry.get("k")))
            encoded = chain.encode(x, own, valid)
            carry[side] = chain.decode_to(encoded, x.shape[-1], own, chain.carry_index)
            state.update(prefixed(encoded, f"{side}."))
        return {**state, **prefixed(carry, "carry.")}

    def decode_side(self, side: str, chain: Chain, state, head_dim: int, layer: LayerState, carry: dict):
        """One chain's `[B, H, T, head_dim]` from its flat encoded state; in a cross-layer pipeline it reads the
        previous layer's reconstruction (and, values, `carry["k"]`) and records its own in `carry[side]`."""
        mine = substate(state, f"{side}.")
        if not self.carries:
            return chain.decode(mine, head_dim, side_of(layer, side))
        own = side_of(layer, side, side_inputs(layer.inputs, side, carry.get("k")))
        carry[side] = chain.decode_to(mine, head_dim, own, chain.carry_index)
        return chain.decode_below(carry[side], chain.carry_index, mine, head_dim, own)

    def decode(self, state: Mapping[str, torch.Tensor], head_dim: int, layer: LayerState):
        """Flat state -> `(k, v)` `[B, H, T, head_dim]` float32, and `carry` when the pipeline `carries`."""
        carry = {}
        k = self.decode_side("k", self.keys, state, head_dim, layer, carry)
        v = self.decode_side("v", self.values, state, head_dim, layer, carry)
        return (k, v, carry) if self.carries else (k, v)

    def attend(self, q, encoded, k_fp, v_fp, mask, softcap, layer: LayerState, live=None):
        """Decode attention of the scaled query `q` [B, Hq, 1, D] float32 over encoded chunks and full-precision
        tokens: `(out [B, Hq, 1, D], fp_attention [F], carry)` (shapes as `attend_decode`)."""
        b, hq, _, d = q.shape
        h = k_fp.shape[1]
        kernel = self.kernel(d)[0] if triton_decode.runs_on(q.device) else None
        if kernel is not None:
            return self.kernel_attend(kernel, q, encoded, k_fp, v_fp, mask, softcap, layer, live)
        qg = q.reshape(b, h, hq // h, d).float()  # [B, H, g, D], the softmax scale already applied
        flat = {n: t.flatten(2, 3) for n, t in encoded.items()}
        carry: dict[str, torch.Tensor] = {}
        p_enc, p_fp = attention_weights(self.encoded_scores(qg, encoded, flat, layer, carry), qg, k_fp, mask, softcap)
        out = self.encoded_sum(p_enc, encoded, flat, d, layer, carry) + p_fp @ v_fp.float()
        return out.reshape(b, hq, 1, d), p_fp.mean((0, 1, 2)), carry

    def encoded_scores(self, qg, encoded, flat, layer: LayerState, carry: dict) -> torch.Tensor:
        """Scores `[B, H, g, NC, C]` of the scaled queries `qg: [B, H, g, D]` against the encoded tokens (`encoded`
        by chunk, `flat` the same flattened), each less half its noise variance where the key chain corrects
        (`Transform.token_noise`). A cross-layer pipeline records its keys' reconstruction in `carry["k"]`."""
        d = qg.shape[-1]
        # run eagerly (compile="auto" before it compiles), a chain whose stored form is one dequantization away from
        # the tokens is faster rebuilt for two matmuls than reduced over op by op (at 4K tokens, best of 5: kivi-2bit
        # 3.5 ms against 4.0 per layer, squat-2bit 2.2 against 3.5); a chain with transforms before its reader
        # (rotations) keeps mapping the query instead
        if self.keys.scores_stored and not self.carries and (torch.compiler.is_compiling() or self.keys.reader > 0):
            s_enc = self.keys.scores(qg, substate(encoded, "k."), d, side_of(layer, "k"))
        else:  # keys rebuilt: run eagerly, rematerialized (RoPE at each position) or predicted across layers
            k_enc = self.decode_side("k", self.keys, flat, d, layer, carry)  # [B, H, T, D]
            chunks = next(iter(substate(encoded, "k.").values())).shape[2]
            s_enc = (qg @ k_enc.transpose(-1, -2)).unflatten(-1, (chunks, -1))
        noise = self.keys.score_noise(qg, substate(encoded, "k."), d, side_of(layer, "k"))
        if noise is not None:
            s_enc = s_enc - 0.5 * noise[0][..., None, None] * noise[1][:, :, None]
        return s_enc

    def encoded_sum(self, p_enc, encoded, flat, head_dim: int, layer: LayerState, carry: dict) -> torch.Tensor:
        """`Σ_t p_t v̂_t` `[B, H, g, head_dim]` over the encoded tokens for weights `p_enc: [B, H, g, NC, C]`, read
        from the stored form where the value chain allows it, else from the values rebuilt (`encoded_scores` for the
        arguments; a cross-layer pipeline records its values' reconstruction in `carry["v"]`)."""
        if self.values.sums_stored and (torch.compiler.is_compiling() or self.values.reader > 0):
            own = side_of(layer, "v", side_inputs(layer.inputs, "v", carry.get("k")) if self.carries else None)
            out = self.values.weighted_sum(p_enc, substate(encoded, "v."), head_dim, own)
            if self.carries:
                carry["v"] = self.values.decode_to(substate(flat, "v."), head_dim, own, self.values.carry_index)
            return out
        v_enc = self.decode_side("v", self.values, flat, head_dim, layer, carry)
        return p_enc.flatten(-2) @ v_enc

    def history_noise(self, q: torch.Tensor, state: Mapping[str, torch.Tensor], head_dim: int, layer: LayerState
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What attention over rebuilt encoded tokens corrects their scores by (`Chain.score_noise`), for queries
        `q: [B, Hq, Q, D]` (unscaled) and the flat encoded state: (`‖q'‖²` `[B, Hq, Q]`, each encoded token's noise
        `[B, H, T]`), or None without a correction. Eager: a prompt's attention runs once per layer and call."""
        if not self.corrects_scores:
            return None
        b, hq, n, d = q.shape
        h = state["k.out"].shape[1]
        norms, noise = self.keys.score_noise(q.reshape(b, h, hq // h * n, d), substate(state, "k."), head_dim,
                                             side_of(layer, "k"))
        return norms.reshape(b, hq, n), noise.expand(b, h, -1)

    def kernel_attend(self, kernel: str, q, encoded, k_fp, v_fp, mask, softcap, layer: LayerState, live):
        """`attend` as one call of the Triton kernel `kernel` ("kivi" or "grid", as `kernel()` chose) over the stored
        form."""
        b, hq, _, d = q.shape
        h = k_fp.shape[1]
        q_fp = q.reshape(b, h, hq // h, d).float()
        q_enc, offset = self.keys.mapped_query(q_fp, d, side_of(layer, "k"))
        bias = None  # one per query head [B, Hq], or per query head and encoded token [B, Hq, TE] (a turned centre)
        if offset is not None:
            bias = offset.float().expand(b, h, hq // h, offset.shape[-1]).reshape(b, hq, -1)
            bias = bias[..., 0] if offset.shape[-1] == 1 else bias
        codes = {n: t.flatten(2, 3) for n, t in encoded.items()}  # [B, H, NC·rows per chunk, ...]
        kr, vr = self.keys.reader, self.values.reader
        keys, values = self.keys.transforms[kr], self.values.transforms[vr]
        own_v = side_of(layer, "v")
        v_stored = self.values.to_reader(v_fp, d, own_v)  # the window's values where the codes' sums are
        common = (None if mask is None else mask.reshape(mask.shape[0], -1), bias, live, softcap or 0.0)
        if kernel == "kivi":
            out, lse, s_fp = triton_decode.kivi_decode(
                q_enc.reshape(b, hq, d).contiguous(), q_fp.reshape(b, hq, d), codes["k.out"], codes[f"k.{kr}.scale"],
                codes[f"k.{kr}.zero"], codes["v.out"], codes[f"v.{vr}.scale"], codes[f"v.{vr}.zero"], k_fp, v_stored,
                *common, keys.config.bits, values.config.bits,
            )
        else:  # with score_correction, each query head's half noise variance per squared multiplier
            noise = 0.5 * keys.mse * q_enc.square().sum(-1).reshape(b, hq) if keys.corrects_scores else None
            out, lse, s_fp = triton_grid_decode.grid_decode(
                keys.rotated_query(q_enc).reshape(b, hq, d).contiguous(), q_fp.reshape(b, hq, d), codes["k.out"],
                codes[f"k.{kr}.scale"][..., 0], keys.grid_on(q.device), codes["v.out"], codes[f"v.{vr}.scale"][..., 0],
                k_fp, v_stored, *common, noise, keys.row_norm(h, d), values.config.bits, keys.code_bits,
            )
        out = self.values.map_sum(out.view(b, h, hq // h, d), out.new_ones(()), d, own_v)
        fp_attention = torch.exp(s_fp - lse[..., None]).mean((0, 1))  # [F]
        return out.reshape(b, hq, 1, d), fp_attention, {}

    def attend_decode(self, q, encoded, k_fp, v_fp, mask, scale: float, softcap, params, prepared, inputs, live):
        """One decode step of attention over encoded chunks and full-precision tokens, run by `run`.

        Keys are scored from their stored form where the key chain allows it (`Chain.scores_stored`), else
        rebuilt first (pre-RoPE keys, XQuant's rematerialization, cross-layer prediction); values are summed
        in their stored form where the value chain allows it (`Chain.sums_stored`: packed codes, XQuant's
        latents), else rebuilt. `fused` pipelines rebuild neither.

        Args:
            q: [B, Hq, 1, D]. encoded: state tensors viewed by chunk, `[B, *, NC, rows per chunk, ...]`.
            k_fp, v_fp: [B, H, F, D], the full-precision tokens, which come after the encoded ones.
            mask: [B or 1, 1, 1, NC·C + F] bool (True = attend), or None.
            params: the layer's fitted parameters (`KVPipeline.layer_params`), to skip looking them up.
            inputs: what rebuilding the encoded tokens reads (`decode_chunk`'s inputs for them).
            live: 0-d tensor, the encoded tokens held (fixed-capacity buffers hold more slots); the GPU kernel
                reads no slot past it. None: every encoded token is held.

        Returns:
            out: [B, Hq, 1, D], q's dtype.
            fp_attention: [F] float32, each full-precision token's attention probability averaged over
                batch rows and query heads (what a window policy reads).
            carry: for pipelines that `carries`, this layer's reconstruction of the encoded tokens as
                `decode_chunk` returns it (the next layer's "previous"); else empty.
        """
        k_fp, v_fp = k_fp.contiguous(), v_fp.contiguous()  # a window's view or a fresh tensor: one graph for both
        for t in (*encoded.values(), k_fp, v_fp):
            mark_dynamic(t, 2)  # one graph for every number of chunks and window size
        for t in (inputs or {}).values():
            mark_dynamic(t, 2 if t.dim() == 4 else 1)
        if mask is not None:
            mark_dynamic(mask, 3)
        scaled = q.float() * scale  # a Python float argument would become a fresh tensor input at every call
        out, fp_attention, carry = self.run(self.attend, scaled, dict(encoded), k_fp, v_fp, mask, softcap,
                                            _fresh(params, prepared, inputs), live)
        return out.to(q.dtype), fp_attention, carry

    def encode_chunk(self, k, v, params, prepared, valid, inputs) -> dict[str, torch.Tensor]:
        """`encode` run by `run`, one graph for any number of chunks (`KVPipeline.encode_chunk` checks the
        arguments)."""
        k, v = k.contiguous(), v.contiguous()  # a prompt's transposed projection or a window's view: one graph
        for t in (k, v, valid, *(inputs or {}).values()):
            if t is not None:
                mark_dynamic(t, 2 if t.dim() == 4 else 1)  # any number of chunks
        return self.run(self.encode, k, v, _fresh(params, prepared, inputs), valid)

    def decode_chunk(self, state, head_dim: int, params, prepared, inputs):
        """`decode` run by `run`, one graph for any number of tokens."""
        for t in (*state.values(), *(inputs or {}).values()):
            mark_dynamic(t, 2 if t.dim() == 4 else 1)  # any number of tokens
        return self.run(self.decode, dict(state), head_dim, _fresh(params, prepared, inputs))

    def decode_rows(self, state, head_dim: int, params, prepared, inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """`decode` of encoded rows gathered from anywhere in the history (eager), their token-grouped metadata
        expanded to one row per token: token-grouped transforms decode with groups of 1."""
        if self._row_chains is None:
            self._row_chains = tuple(
                Chain([type(t)(**{**dataclasses.asdict(t.config), "group": 1}) if t.token_multiple > 1 else t
                       for t in chain.transforms])
                for chain in (self.keys, self.values)
            )
        return decode_pair(*self._row_chains, state, head_dim, LayerState(params, prepared, inputs))

    def warn_without_kernel(self, name: str, head_dim: int) -> None:
        """On CUDA, say once (outside compiled code) when decode attention of pipeline `name` has no GPU kernel."""
        if self._kernel_warned or torch.compiler.is_compiling():
            return
        refusal = self.kernel_refusal(head_dim)
        if refusal is not None:
            warnings.warn(f"pipeline '{name}': decode attention has no GPU kernel for its stored form ({refusal}); it "
                          "runs Inductor's reductions over the stored form, which are slower", stacklevel=3)
        self._kernel_warned = True

    @property
    def corrects_scores(self) -> bool:
        """Attention corrects the key codes' scores for their noise (`Chain.corrects_scores`)."""
        return self.keys.corrects_scores

    @property
    def attention_rope(self) -> str | None:
        """What decode attention over the stored form reads of the encoded tokens' positions: None (nothing),
        "chunks" (only per-token score offsets, which take each chunk's tables: `SharedRope.chunk_tables`) or
        "tokens" (every token's cos/sin: keys rebuilt at their positions)."""
        readers = [(side, i) for side, chain in (("k", self.keys), ("v", self.values))
                   for i, t in enumerate(chain.transforms) if {"cos", "sin"} & t.requires]
        if not readers:
            return None
        scored = self.keys.scores_stored and not self.carries and self.keys.reader > 0
        if scored and all(side == "k" and i < self.keys.reader and self.keys.transforms[i].offset_per_token
                          for side, i in readers):
            return "chunks"
        return "tokens"

    def kernel_refusal(self, head_dim: int = 128) -> str | None:
        """Why decode attention on a GPU runs no Triton kernel for heads of `head_dim`, and runs the Inductor path
        instead; None when it runs one (`kernel`)."""
        return self.kernel(head_dim)[1]

    def kernel(self, head_dim: int = 128) -> tuple[str | None, str | None]:
        """The Triton kernel that decode attention on a GPU runs for heads of `head_dim`, and why none: ("kivi",
        None) for KIVI's layout (`ops.triton_decode`), ("grid", None) for grid-coded keys and per-token symmetric
        values (`ops.triton_grid_decode`), (None, the reason) otherwise."""
        if triton_decode.triton is None:
            return None, "Triton is not installed"
        if not self.compile:
            return None, "compile=False runs decode attention eagerly over rebuilt tokens"
        if self.carries or self.keys.selector is not None:
            return None, "the pipeline predicts across layers or selects chunks"
        if not (self.keys.scores_stored and self.values.sums_stored):
            return None, "decode attention rebuilds its keys or values"
        if any(chain.dims(head_dim)[chain.reader] != head_dim for chain in (self.keys, self.values)):
            return None, "a transform before a quantizer changes the feature size, which no kernel reads"
        k, v = self.keys.transforms[self.keys.reader], self.values.transforms[self.values.reader]
        per_token = isinstance(v, UniformQuantize) and v.config.axis == "token"
        if isinstance(k, UniformQuantize) and k.config.axis == "channel" and not k.config.symmetric:
            if per_token and not v.config.symmetric:
                return "kivi", None
        elif isinstance(k, HiggsQuantize) and k.code_bits in triton_grid_decode.CODE_BITS:
            if per_token and v.config.symmetric and v.config.group in (None, head_dim):
                return "grid", None
        return None, ("the kernels read asymmetric uniform keys per channel with asymmetric uniform values per token "
                      "(KIVI's layout), or keys in 32- to 256-point grid codes with symmetric values, one step per "
                      f"token (frontier's); the keys are stored by {k!r} and the values by {v!r}")

    def run(self, fn: Callable, *args):
        """`fn(*args)` (one of this codec's encode, decode, attend), eagerly or compiled as `compile` says (inside a
        whole-step graph: traced). Each is compiled once, keyed by its name."""
        name = fn.__name__
        if not self.compile or torch.compiler.is_compiling():  # inside a whole-step graph: traced into it
            return fn(*args)
        calls = self.eager_calls.get(name, 0)
        if self.compile == "auto" and name not in self.compiled and calls < EAGER_CALLS_BEFORE_COMPILE:
            self.eager_calls[name] = calls + 1
            return fn(*args)
        if name not in self.compiled:
            # static shapes except the axes callers mark dynamic: automatic dynamic would also generalize
            # axes that differ between pipelines (code widths), which stops Inductor vectorizing
            self.compiled[name] = torch.compile(own_cache(fn), fullgraph=True, dynamic=False, options=COMPILE_OPTIONS)
        with recompile_headroom():
            return self.compiled[name](*args)


def attention_weights(s_enc: torch.Tensor, qg: torch.Tensor, k_fp: torch.Tensor, mask, softcap):
    """One softmax over the encoded tokens' scores `s_enc: [B, H, g, NC, C]` and the full-precision keys' `k_fp:
    [B, H, F, D]` (softcapped and masked as `Codec.attend_decode` says): `(p_enc [B, H, g, NC, C], p_fp [B, H, g,
    F])`."""
    nc, c = s_enc.shape[-2:]
    scores = torch.cat([s_enc.flatten(-2), qg @ k_fp.float().transpose(-1, -2)], -1)  # [B, H, g, N]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    p = torch.softmax(scores, -1)
    return p[..., : nc * c].unflatten(-1, (nc, c)), p[..., nc * c :]


def _fresh(params, prepared, inputs) -> LayerState:
    """A `LayerState` of plain dicts made for this call (None: empty), what the compiled functions take."""
    return LayerState(dict(params), dict(prepared or {}), dict(inputs or {}))
