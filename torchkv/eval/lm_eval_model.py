"""The lm-evaluation-harness model `torchkv`: every scored or generated token reads the compressed cache.

    torchkv lm-eval --model torchkv --model_args preset=kivi-2bit --tasks torchkv_offline --limit 8

(`torchkv lm-eval` is the harness's own command line with this model registered and torchkv's offline tasks on
its include path; in Python, importing this module registers the model for `lm_eval.simple_evaluate`.) Needs
the optional extra: `pip install torchkv[lm-eval]`.

Model arguments: `pretrained` (a name `torchkv.load_model` knows, or a local model folder; default SmolLM2),
`preset` (a preset with overrides after colons, a saved pipeline folder, or `dynamic` for transformers'
full-precision cache), `context_split` (a marker: the context is cached up to its last occurrence, and the rest,
e.g. the question, is asked after the cache is filled), `max_gen_toks`, `batch_invariant` (true: the model's linear
layers in fixed blocks of rows, so that a batch's scores equal its requests' scores alone bit for bit in float32,
with prompts about 2.5x slower on CPU; see `torchkv.models.batch_invariant`).
"""

import warnings

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

from torchkv.eval import through_cache
from torchkv.eval.rows import method
from torchkv.models.loader import load_model


@register_model("torchkv")
class TorchKVLM(TemplateLM):
    def __init__(self, pretrained: str = "smollm2-135m", preset: str = "kivi-2bit", context_split: str | None = None,
                 batch_size: int | str = 1, max_gen_toks: int = 256, device: str | None = None,
                 max_batch_size: int | None = None, batch_invariant: bool = False):
        super().__init__()
        if str(batch_size).startswith("auto"):  # (the harness passes max_batch_size for "auto" alone)
            raise ValueError("batch_size=auto is not supported: give a number (1 scores each request alone)")
        flag = str(batch_invariant).lower()  # the harness passes model arguments as strings
        if flag not in ("true", "false", "1", "0"):
            raise ValueError(f"batch_invariant={batch_invariant!r}: give true or false")
        self.model, self.tokenizer = load_model(pretrained)
        if device and device.startswith("cuda") and not torch.cuda.is_available():
            warnings.warn(f"device={device!r} but no CUDA device is present: running on the CPU")
        elif device:
            self.model.to(device)
        self.row = method(str(preset))
        self.row.batch_invariant = flag in ("true", "1")
        if self.row.kind not in ("torchkv", "dynamic") or self.row.tuning is not None or self.row.compiled:
            raise ValueError(f"preset={preset!r} is not a pipeline the lm-eval model can use: give a torchkv preset, "
                             "a saved pipeline folder (`torchkv tune ... --out DIR` for a tuned one), or 'dynamic' "
                             "(full precision)")
        if self.row.pipeline is not None:
            try:  # an uncalibrated pipeline fails here, before any request
                self.row.new_cache(self.model)
            except ValueError as err:
                raise ValueError(f"{err}; then pass that folder: --model_args preset=DIR") from err
        self.context_split = context_split
        self.batch_size = int(batch_size)
        self.max_gen_toks = int(max_gen_toks)
        self.max_length = self.model.config.get_text_config(decoder=True).max_position_embeddings

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    def tok_decode(self, tokens, **kwargs) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        for request in requests:
            args = request.args
            if len(args) != 2 or not all(isinstance(a, str) for a in args) or not args[1]:
                raise ValueError(
                    f"task {request.task_name!r}, document {request.doc_id}: a log-likelihood request must be a "
                    f"(context, continuation) pair of strings with a non-empty continuation, got {args!r}. torchkv "
                    "prefills the context into the compressed cache and scores the continuation through it, so the "
                    "task must split its prompt (doc_to_text / doc_to_target); to score whole texts use a "
                    "loglikelihood_rolling task")
        return super().loglikelihood(requests, disable_tqdm)

    def _request(self, context: str, context_enc: list[int], continuation_enc: list[int]) -> through_cache.Request:
        """What is cached and what is asked: the whole context, or with `context_split` only what precedes the
        marker's last occurrence. Contexts longer than the model's positions keep their last tokens."""
        cached, asked = context_enc, []
        if self.context_split:
            at = context.rfind(self.context_split)
            if at <= 0:
                raise ValueError(f"context_split={self.context_split!r} does not occur after the start of the "
                                 f"context {context[:80]!r}...; give a marker every prompt of the task contains")
            cached, asked = self.tok_encode(context[:at]), self.tok_encode(context[at:])
        room = self.max_length - len(continuation_enc) - len(asked)
        if room < 1:
            raise ValueError(f"a continuation of {len(continuation_enc)} tokens after a question of {len(asked)} "
                             f"leaves no room for context in the model's {self.max_length} positions")
        return through_cache.Request(tuple(cached[-room:]), tuple(continuation_enc), tuple(asked))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        todo = [self._request(context, context_enc, cont_enc) for (context, _), context_enc, cont_enc in requests]
        scored = through_cache.score(self.model, self.row, todo, self.batch_size, progress=not disable_tqdm)
        results = []
        for (pair, _, _), s in zip(requests, scored):
            self.cache_hook.add_partial("loglikelihood", pair, (s.logprob, s.greedy))
            results.append((s.logprob, s.greedy))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        results = []
        for request in tqdm(requests, desc=f"rolling {self.row.name}", disable=disable_tqdm):
            (text,) = request.args
            ids = [self.prefix_token_id, *self.tok_encode(text)]
            results.append(through_cache.rolling_logprob(self.model, self.row, ids, window=self.max_length))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), results[-1])
        return results

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or as `gen_kwargs` ask) generation through the cache; requests with the same generation
        arguments are batched."""
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(i)
        results: list[str | None] = [None] * len(requests)
        with tqdm(total=len(requests), desc=f"generate {self.row.name}", disable=disable_tqdm) as bar:
            for indices in groups.values():
                kwargs = dict(requests[indices[0]].args[1])
                until = kwargs.pop("until", None) or [self.tok_decode([self.eot_token_id])]
                until = [until] if isinstance(until, str) else list(until)
                new_tokens = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
                if not kwargs.get("do_sample", False):
                    kwargs.pop("temperature", None)
                contexts = []
                for i in indices:
                    ids = self.tok_encode(requests[i].args[0])[-(self.max_length - new_tokens):]
                    contexts.append(tuple(ids) if len(ids) >= 2 else (self.prefix_token_id, *ids))
                texts = through_cache.generate(self.model, self.tokenizer, self.row, contexts, new_tokens, until,
                                               self.batch_size, **kwargs)
                for i, text in zip(indices, texts):
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                    results[i] = text
                bar.update(len(indices))
        return results
