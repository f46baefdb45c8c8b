"""How a KV cache is compressed, one job per file:

- `definition.py`: `KVPipeline`, the key and value chains plus the window rules, validated;
- `chain.py`: `Chain`, the transforms of one side in order, and what decode attention can read of its stored form;
- `head_groups.py`: `HeadGroups`, one side of a layer whose KV heads are in groups with chains of their own;
- `codec.py`: `Codec`, encode / decode / decode attention over explicit state, and the library's compile boundary;
- `grouped_codec.py`: `GroupedCodec`, the same for a layer whose KV heads are in groups, each as its pair's `Codec`;
- `io.py`: the on-disk format (JSON + safetensors) and the migration of older folders;
- `presets.py`: presets by name and the `name:key=value` spelling;
- `bits.py`: stored bits per value, measured;
- `state.py`: the flat state dicts' prefixes.
"""

from torchkv.pipeline.bits import BitsPerValue
from torchkv.pipeline.chain import CROSS_INPUTS, Chain
from torchkv.pipeline.codec import COMPILE_OPTIONS, Codec
from torchkv.pipeline.definition import KVPipeline
from torchkv.pipeline.grouped_codec import GroupedCodec
from torchkv.pipeline.head_groups import HeadGroups
from torchkv.pipeline.io import CONFIG_FILE, FORMAT_VERSION, PARAMS_FILE
from torchkv.pipeline.presets import DEFAULT_PRESET, parse_preset, presets
from torchkv.pipeline.state import LayerState, prefixed, side_of, substate

__all__ = [
    "BitsPerValue", "CONFIG_FILE", "COMPILE_OPTIONS", "CROSS_INPUTS", "Chain", "Codec", "DEFAULT_PRESET",
    "FORMAT_VERSION", "GroupedCodec", "HeadGroups", "KVPipeline", "LayerState", "PARAMS_FILE", "parse_preset", "prefixed", "presets", "side_of",
    "substate",
]
