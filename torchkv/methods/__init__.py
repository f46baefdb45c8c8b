"""One file per method; importing this package registers every method's presets exactly once."""

from torchkv.methods import aquakv, frontier, kivi, squat, subkv, svdq, xquant  # noqa: F401
