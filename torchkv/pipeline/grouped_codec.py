"""`GroupedCodec`: encode, decode and decode attention of a layer whose KV heads are in groups with chains of their
own (per-KV-head widths). Heads never mix in attention, so each group, one (key chain, value chain) pair (`paired`),
is encoded and attended by that pair's `Codec` functions (on CUDA its Triton kernel), traced into one graph for the
layer, and the results go back in head order."""

from collections.abc import Mapping

import torch

from torchkv.ops import triton_decode
from torchkv.pipeline.codec import Codec, attention_weights
from torchkv.pipeline.head_groups import HeadGroups
from torchkv.pipeline.state import LayerState, prefixed, substate


class GroupedCodec(Codec):
    """A `Codec` whose encode, decode and attend run each head group's own `Codec` on the group's heads; `run`
    compiles them as one graph per function, as for a pair of chains.

    Args:
        keys, values: the layer's sides in the same head groups (`head_groups.paired`).
        compile: as `Codec.compile`, for the groups' codecs too.

    State names: group i's `Codec` state "k.{name}" / "v.{name}" is the layer's "k.g{i}.{name}" / "v.g{i}.{name}"
    (prepared state too, as `HeadGroups.prepare` names it).
    """

    def __init__(self, keys: HeadGroups, values: HeadGroups, compile: bool | str):
        if keys.heads != values.heads:
            raise ValueError(f"key groups {keys.heads} and value groups {values.heads} differ: pair them first")
        self.heads, self.num_heads = keys.heads, keys.num_heads
        #: each group's codec: its (key chain, value chain) pair
        self.groups = [Codec(k, v, carries=False, compile=compile) for k, v in zip(keys.chains, values.chains)]
        order = [h for heads in self.heads for h in heads]
        #: where each KV head is among the groups' heads, group after group (None: in head order)
        self.inverse = None if order == sorted(order) else sorted(range(len(order)), key=order.__getitem__)
        super().__init__(keys, values, carries=False, compile=compile)

    @property
    def compile(self) -> bool | str:
        return self._compile

    @compile.setter
    def compile(self, when: bool | str) -> None:
        self._compile = when
        for c in self.groups:  # a group's kernel and reads follow the layer's setting
            c.compile = when

    @property
    def carries(self) -> bool:
        return False

    @carries.setter
    def carries(self, carries: bool) -> None:
        if carries:
            raise ValueError("a layer with per-KV-head widths cannot carry its reconstruction to the next layer: "
                             "give per-head widths to pipelines that do not predict across layers")

    # -- a group's view ----------------------------------------------------------------------------

    def _heads(self, x: torch.Tensor, i: int, per: int = 1) -> torch.Tensor:
        """Group i's heads of `x` (dim 1), `per` heads of `x` to a KV head, contiguous."""
        heads = self.heads[i]
        if heads == tuple(range(heads[0], heads[-1] + 1)):
            return x[:, heads[0] * per:(heads[-1] + 1) * per].contiguous()
        return x[:, [h * per + j for h in heads for j in range(per)]]

    def _merge(self, parts: list[torch.Tensor], per: int = 1) -> torch.Tensor:
        """The groups' `parts` (their heads at dim 1) in head order."""
        out = torch.cat(parts, 1)
        return out if self.inverse is None else out[:, [h * per + j for h in self.inverse for j in range(per)]]

    @staticmethod
    def _own(state: Mapping[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
        """Group i's entries of a layer's state, named as its `Codec` names them."""
        return {n: t for side in "kv" for n, t in prefixed(substate(state, f"{side}.g{i}."), f"{side}.").items()}

    @staticmethod
    def _named(state: Mapping[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
        """Group i's `Codec` state named as the layer's (`_own` undone)."""
        return {n: t for side in "kv" for n, t in prefixed(substate(state, f"{side}."), f"{side}.g{i}.").items()}

    def _layer(self, layer: LayerState, i: int) -> LayerState:
        return LayerState({}, self._own(layer.prepared, i), layer.inputs)

    # -- what `Codec.run` runs ---------------------------------------------------------------------

    def encode(self, k: torch.Tensor, v: torch.Tensor, layer: LayerState, valid: torch.Tensor | None):
        """Keys and values `[B, H, T, D]` -> the layer's flat state."""
        return {n: t for i, c in enumerate(self.groups) for n, t in self._named(
            c.encode(self._heads(k, i), self._heads(v, i), self._layer(layer, i), valid), i).items()}

    def decode(self, state: Mapping[str, torch.Tensor], head_dim: int, layer: LayerState):
        """Flat state -> `(k, v)` `[B, H, T, head_dim]` float32."""
        parts = [c.decode(self._own(state, i), head_dim, self._layer(layer, i)) for i, c in enumerate(self.groups)]
        return tuple(self._merge([p[side] for p in parts]) for side in (0, 1))

    def attend(self, q, encoded, k_fp, v_fp, mask, softcap, layer: LayerState, live=None):
        """Decode attention as `Codec.attend`: `(out [B, Hq, 1, D], fp_attention [F], {})`. Each group scores its KV
        heads' codes and sums its values with its own codec; one softmax over all heads' scores, with the window's
        scores and sums, sits between them (per group they made no measurable difference on CPU, stop 102). On
        CUDA, where a group has a Triton kernel, each group runs its own codec's attention instead."""
        b, hq, _, d = q.shape
        per = hq // self.num_heads
        if triton_decode.runs_on(q.device) and any(c.kernel(d)[0] for c in self.groups):
            return self.attend_by_group(q, encoded, k_fp, v_fp, mask, softcap, layer, live)
        qg = q.reshape(b, self.num_heads, per, d).float()  # [B, H, g, D], the softmax scale already applied
        mine = [self._own(encoded, i) for i in range(len(self.groups))]
        flat = [{n: t.flatten(2, 3) for n, t in own.items()} for own in mine]
        s_enc = self._merge([c.encoded_scores(self._heads(qg, i), mine[i], flat[i], self._layer(layer, i), {})
                             for i, c in enumerate(self.groups)])
        p_enc, p_fp = attention_weights(s_enc, qg, k_fp, mask, softcap)
        out = self._merge([c.encoded_sum(self._heads(p_enc, i), mine[i], flat[i], d, self._layer(layer, i), {})
                           for i, c in enumerate(self.groups)])
        out = out + p_fp @ v_fp.float()
        return out.reshape(b, hq, 1, d), p_fp.mean((0, 1, 2)), {}

    def attend_by_group(self, q, encoded, k_fp, v_fp, mask, softcap, layer: LayerState, live=None):
        """`Codec.attend` of each group (its Triton kernel, where it has one) over its KV heads and the query heads
        that read them, merged."""
        per = q.shape[1] // self.num_heads
        outs, fp_attention = [], 0
        for i, c in enumerate(self.groups):
            out, fp, _ = c.attend(self._heads(q, i, per), self._own(encoded, i), self._heads(k_fp, i),
                                  self._heads(v_fp, i), mask, softcap, self._layer(layer, i), live)
            outs.append(out)
            fp_attention = fp_attention + fp * (len(self.heads[i]) / self.num_heads)
        return self._merge(outs, per), fp_attention, {}

    def history_noise(self, q, state, head_dim: int, layer: LayerState):
        """`Codec.history_noise` of each group over its KV heads and the query heads that read them, merged (a group
        without a correction: no noise); None where no group corrects."""
        if not self.corrects_scores:  # no group's heads of the queries copied
            return None
        per = q.shape[1] // self.num_heads
        found = [c.history_noise(self._heads(q, i, per), self._own(state, i), head_dim, self._layer(layer, i))
                 for i, c in enumerate(self.groups)]
        b, tokens = q.shape[0], state["k.g0.out"].shape[2]
        norms = [q.new_zeros(b, len(heads) * per, q.shape[2]) if f is None else f[0]
                 for heads, f in zip(self.heads, found)]
        noise = [q.new_zeros(b, len(heads), tokens) if f is None else f[1] for heads, f in zip(self.heads, found)]
        return self._merge(norms, per), self._merge(noise)

    @property
    def corrects_scores(self) -> bool:
        """Some group's attention corrects its key codes' scores."""
        return any(c.corrects_scores for c in self.groups)

    @property
    def attention_rope(self) -> str | None:
        """`Codec.attention_rope` of the layer: "tokens" where some group reads every token's position."""
        reads = {c.attention_rope for c in self.groups} - {None}
        return "tokens" if "tokens" in reads else "chunks" if reads else None

    def kernel(self, head_dim: int = 128) -> tuple[str | None, str | None]:
        """Each group's `Codec.kernel`: ("grid", None) when every group runs the grid kernel (names joined by "+"
        when groups run different ones), or (None, why some group runs none)."""
        found = [c.kernel(head_dim) for c in self.groups]
        for heads, (name, why) in zip(self.heads, found):
            if name is None:
                return None, f"heads {list(heads)}: {why}"
        return "+".join(sorted({name for name, _ in found})), None
