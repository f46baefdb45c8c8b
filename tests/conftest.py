import os

import pytest
import torch
from hypothesis import HealthCheck, settings

if not torch.cuda.is_available():  # Triton kernels run on CPU tensors under its interpreter (read at import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

settings.register_profile(
    "torchkv",
    max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", 30)),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("torchkv")
# under `pytest -n N` (pytest-xdist, as `make test` runs) the N workers share the cores
torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1))))


@pytest.fixture(autouse=True)
def seeded_rng():
    """Every test starts from the same global RNG state, whatever ran before it on its xdist worker."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def compile_auto_at_first_call(request, monkeypatch):
    """`compile="auto"` (the default) compiles at a function's first call in tests, so that they exercise the
    compiled path they were written for, except in tests marked `eager_first`; `tests/test_compile_auto.py` tests
    the deferral itself."""
    import torchkv.pipeline

    if request.node.get_closest_marker("eager_first") is None:
        monkeypatch.setattr(torchkv.pipeline.codec, "EAGER_CALLS_BEFORE_COMPILE", 0)


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer): the real SmolLM2-135M-Instruct in float32, shared by the session (never mutate it
    without undoing: tests patch it inside `torchkv.patched`)."""
    from torchkv import load_model

    return load_model()


@pytest.fixture(scope="session")
def wiki_eval_text():
    from torchkv.corpora import split_text

    return split_text("eval")
