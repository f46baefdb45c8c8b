"""Scoring and generation through the cache (`torchkv.eval.through_cache`) and the lm-eval model on top of it, on
the real SmolLM2: the context really goes through the compressed cache, padding changes nothing in full
precision, and bad requests get clear errors."""

import pytest
import torch

from torchkv.corpora import documents
from torchkv.eval.retrieval import cases
from torchkv.eval.rows import Method, method
from torchkv.eval.through_cache import Request, generate, rolling_logprob, score
from torchkv.pipeline import KVPipeline

# the harness is the subject: compile='auto' runs as in a user's short evaluation, eagerly
pytestmark = [pytest.mark.model, pytest.mark.eager_first]


def _eager(name: str) -> Method:
    """A preset's row, eager (these tests read few tokens; compiling would dominate them)."""
    return Method(name, pipeline=KVPipeline.from_preset(name, compile=False))


def _naive(model, row, context: torch.Tensor, continuation: torch.Tensor) -> float:
    """What a harness does with a patched model: context and continuation in one forward pass, no cache read."""
    with row.active(model), torch.no_grad():
        logits = model(torch.cat([context, continuation])[None]).logits[0].float().log_softmax(-1)
    n = context.numel()
    return float(logits[n - 1 : n - 1 + continuation.numel()].gather(1, continuation[:, None]).sum())


def test_the_context_goes_through_the_compressed_cache(smollm2):
    """On pass-key retrieval (the answer is only in the context), kivi-2bit scores differently from fp16 through
    the cache, while the naive single forward pass scores them identically: it never read the cache."""
    model, tokenizer = smollm2
    case = cases(tokenizer, 640, 1, seed=3)[0]
    context, answer = case.prompt[0], case.answer
    request = Request(tuple(context.tolist()), tuple(answer.tolist()))
    fp16, kivi = _eager("fp16"), _eager("kivi-2bit")
    through = {row.name: score(model, row, [request])[0].logprob for row in (fp16, kivi)}
    naive = {row.name: _naive(model, row, context, answer) for row in (fp16, kivi)}
    assert naive["fp16"] == naive["kivi-2bit"]
    assert abs(through["kivi-2bit"] - through["fp16"]) > 0.05, through
    # full precision through the cache is the single forward pass
    dynamic = score(model, method("dynamic"), [request])[0].logprob
    assert dynamic == pytest.approx(naive["fp16"], abs=1e-3)


def test_padded_batches_score_as_requests_alone_in_full_precision(smollm2):
    model, _ = smollm2
    ids = documents(smollm2[1], 500, 2)
    requests = [Request(tuple(ids[0, :480].tolist()), tuple(ids[0, 480:490].tolist())),
                Request(tuple(ids[1, :200].tolist()), tuple(ids[1, 200:203].tolist())),
                Request(tuple(ids[1, :150].tolist()), tuple(ids[1, 160:170].tolist()), asked=tuple(ids[1, 150:160].tolist())),
                Request((ids[1, 0].item(),), tuple(ids[1, 1:5].tolist()))]  # nothing to prefill: scored alone
    row = method("dynamic")
    alone = [score(model, row, [r])[0] for r in requests]
    batched = score(model, row, requests, batch_size=4)
    for a, b in zip(alone, batched):
        assert b.logprob == pytest.approx(a.logprob, abs=2e-3) and a.greedy == b.greedy


def test_generation_through_the_cache(smollm2):
    """Full precision: generating after a prefilled cache is transformers' own generate; batched as alone;
    stop strings cut the text."""
    model, tokenizer = smollm2
    ids = documents(tokenizer, 300, 2)
    contexts = [tuple(ids[0, :300].tolist()), tuple(ids[1, :200].tolist())]
    row = method("dynamic")
    with torch.no_grad():
        plain = model.generate(ids[:1, :300], max_new_tokens=10, do_sample=False)[0, 300:]
    assert generate(model, tokenizer, row, contexts[:1], 10) == [tokenizer.decode(plain, skip_special_tokens=True)]
    alone = [generate(model, tokenizer, row, [c], 10)[0] for c in contexts]
    assert generate(model, tokenizer, row, contexts, 10, batch_size=2) == alone
    cut = generate(model, tokenizer, _eager("kivi-2bit"), contexts[:1], 10, until=[alone[0][3:5]])[0]
    assert cut == alone[0][: alone[0].index(alone[0][3:5])]


def test_rolling_logprob_is_the_single_pass_in_full_precision(smollm2):
    model, tokenizer = smollm2
    ids = documents(tokenizer, 200, 1)[0]
    with torch.no_grad():
        logits = model(ids[None]).logits[0].float().log_softmax(-1)
    expected = float(logits[:-1].gather(1, ids[1:, None]).sum())
    assert rolling_logprob(model, method("dynamic"), ids.tolist(), block=64) == pytest.approx(expected, abs=1e-2)
    # windows overlap by one token: every token after the first is still scored once
    windowed = rolling_logprob(model, method("dynamic"), ids.tolist(), block=64, window=90)
    assert windowed < expected  # less context, worse prediction, same number of scored tokens


def test_requests_need_a_context_and_a_continuation():
    with pytest.raises(ValueError, match="non-empty continuation"):
        Request((1, 2, 3), ())
    with pytest.raises(ValueError, match="non-empty context"):
        Request((), (1,))


@pytest.fixture(scope="module")
def lm_eval_model():
    pytest.importorskip("lm_eval")
    from torchkv.eval.lm_eval_model import TorchKVLM

    return TorchKVLM


def _instance(kind: str, args: tuple, i: int = 0):
    from lm_eval.api.instance import Instance

    return Instance(request_type=kind, doc={}, arguments=args, idx=i, metadata=("task", i, 1))


def test_lm_eval_model_scores_through_the_cache(lm_eval_model, smollm2):
    """The harness's requests (strings) reach the cache: kivi-2bit differs from full precision on a long context,
    each (logprob, is_greedy) pair is returned in order, and a question after `context_split` is asked after
    the cache is filled."""
    _, tokenizer = smollm2
    text = tokenizer.decode(documents(tokenizer, 700, 1)[0])
    context, continuation = text[:2400] + "\nQuestion: what comes next?\nAnswer:", " " + text[2400:2440].strip()
    requests = [_instance("loglikelihood", (context, continuation), 0),
                _instance("loglikelihood", (context[:900], continuation), 1)]
    full = lm_eval_model(preset="dynamic", batch_size=2).loglikelihood(requests, disable_tqdm=True)
    kivi = lm_eval_model(preset="kivi-2bit").loglikelihood(requests, disable_tqdm=True)
    assert len(full) == len(kivi) == 2 and all(isinstance(g, bool) for _, g in full + kivi)
    assert abs(kivi[0][0] - full[0][0]) > 0.01
    split = lm_eval_model(preset="dynamic", context_split="\nQuestion:").loglikelihood(requests[:1], disable_tqdm=True)
    assert split[0][0] == pytest.approx(full[0][0], abs=2e-3)  # full precision: where the split falls is moot


def test_lm_eval_model_bad_input(lm_eval_model):
    model = lm_eval_model(preset="dynamic")
    with pytest.raises(ValueError, match=r"\(context, continuation\) pair"):
        model.loglikelihood([_instance("loglikelihood", ("a whole text with no split",))])
    with pytest.raises(ValueError, match="non-empty continuation"):
        model.loglikelihood([_instance("loglikelihood", ("a context", ""))])
    with pytest.raises(ValueError, match="preset=DIR"):
        lm_eval_model(preset="aquakv-2bit")
    for row in ("quanto-2bit", "tuned:kivi-2bit@2.5", "compiled:kivi-2bit"):
        with pytest.raises(ValueError, match="not a pipeline the lm-eval model can use"):
            lm_eval_model(preset=row)
    with pytest.raises(TypeError, match="presett"):  # a misspelt model argument is not silently ignored
        lm_eval_model(presett="kivi-2bit")
    with pytest.raises(ValueError, match="give true or false"):
        lm_eval_model(preset="dynamic", batch_invariant="yes")
    assert lm_eval_model(preset="kivi-2bit", batch_invariant="True").row.batch_invariant
    with pytest.raises(ValueError, match="context_split"):
        lm_eval_model(preset="dynamic", context_split="Question:").loglikelihood(
            [_instance("loglikelihood", ("no marker here", " x"))], disable_tqdm=True)


def test_torchkv_lm_eval_command_runs_an_offline_task(lm_eval_model, tmp_path, monkeypatch):
    """`torchkv lm-eval` is the harness's command line with the `torchkv` model registered and torchkv's tasks on
    its include path: one cloze document runs end to end, offline, and the harness writes its results."""
    import json

    from torchkv.cli import main

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    main(["lm-eval", "--model", "torchkv", "--model_args", "preset=kivi-2bit", "--tasks", "torchkv_wiki_cloze",
          "--limit", "1", "--metadata", '{"count": 1}', "--output_path", str(tmp_path)])
    (written,) = tmp_path.rglob("results_*.json")
    results = json.loads(written.read_text())
    assert results["config"]["model"] == "torchkv" and "acc,none" in results["results"]["torchkv_wiki_cloze"]
