"""The one place that touches torch internals, and that papers over differences between library versions."""

import contextlib
import functools
import itertools
import types
from collections.abc import Callable, Iterator

import torch

#: graphs one compiled torchkv function may hold across every pipeline of the process (pipelines x layer kinds x
#: batch sizes x dtypes x masks: a benchmark of every preset in one process passed 64 for decode attention); the default of
#: 8 would silently send later pipelines to slow eager code.
RECOMPILE_LIMIT = 256


@contextlib.contextmanager
def recompile_headroom() -> Iterator[None]:
    """Raise dynamo's per-function recompile limits for the duration of a torchkv compiled call only."""
    config = torch._dynamo.config
    previous = config.recompile_limit, config.accumulated_recompile_limit
    config.recompile_limit = max(RECOMPILE_LIMIT, previous[0])
    config.accumulated_recompile_limit = max(4 * RECOMPILE_LIMIT, previous[1])
    try:
        yield
    finally:
        config.recompile_limit, config.accumulated_recompile_limit = previous


def function_copy(fn: types.FunctionType, tag: str) -> types.FunctionType:
    """`fn` with a copy of its code object (named `NAME_TAG`): dynamo keeps compiled graphs, guards and the lengths
    it has seen change per code object, so a copy compiles as if the process had never run `fn`."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}")
    copy = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    functools.update_wrapper(copy, fn)  # `inspect.signature` (which `generate` filters its inputs by) still works
    return copy


#: numbers the copies `own_cache` makes: a model's id can come back once it is freed, and dynamo keeps what it
#: learnt of a function's input shapes by file, line and name
_FORWARD_COPIES = itertools.count()


def own_cache(method: types.MethodType) -> Callable:
    """`method` rebound to a copy of its code object. Dynamo checks a call's guards against each graph of the code
    object in turn: with one code object for every pipeline, a process that has compiled other pipelines pays their
    guard checks on each call (`kivi-2bit` decoded at 0.79x of `DynamicCache` at 4K after seven other presets had
    run in the same process, 1.04x alone), and their graphs count against its recompile limit."""
    return types.MethodType(function_copy(method.__func__, str(next(_FORWARD_COPIES))), method.__self__)



def _follow_live_side_effects() -> None:
    """Work around torch 2.13's Dynamo losing the attribute writes made to an object after a `torch.cond` when the
    same object was written before it: its view of the object's `__dict__` (`SideEffectsProxyDict`) keeps the
    side-effect table it was made with, and the cond replaces that table by a copy, so the later writes land in a
    table the compiled code no longer replays (`A.x = 1; torch.cond(...); A.x = 2` leaves `A.x == 1`). Our decode
    step flushes each layer's window under a `torch.cond` on the CPU, inside transformers' and kernels' context
    variables that are set before a layer and reset after: they stayed set after every compiled step, so the next
    step recompiled, and an eager forward after it read the step's stale output collector. The view is made to
    read the table its output graph holds now."""
    try:
        from torch._dynamo.variables.dicts import SideEffectsProxyDict
    except ImportError:  # a torch without that view
        return
    if isinstance(vars(SideEffectsProxyDict).get("side_effects"), property):
        return

    def live(view):
        graph = view.output_graph() if view.output_graph is not None else None
        return view.bound_side_effects if graph is None else graph.side_effects

    def bind(view, side_effects) -> None:
        # the table it was made with stays the answer where its output graph cannot be reached (other versions)
        view.bound_side_effects = side_effects
        view.output_graph = getattr(side_effects, "output_graph_weakref", None)

    SideEffectsProxyDict.side_effects = property(live, bind)


_follow_live_side_effects()


def mark_dynamic(t: torch.Tensor, dim: int) -> None:
    """`torch._dynamo.maybe_mark_dynamic`, skipped while tracing a graph that calls torchkv (a whole decode step
    compiled at once has static shapes)."""
    if not torch.compiler.is_compiling():
        torch._dynamo.maybe_mark_dynamic(t, dim)


@torch.library.custom_op("torchkv::materialized", mutates_args=())
def materialized(x: torch.Tensor) -> torch.Tensor:
    """A copy of `x` that Inductor cannot fuse into its consumers (an opaque op).

    In a whole decode step compiled at once, Inductor otherwise inlines the query's producers (projection output,
    RoPE with its cos/sin of the position) into the reduction over every packed code, and recomputes them per code:
    measured at 4K tokens on CPU, 2.1 ms per layer for the key scores instead of 0.65 ms. The same holds for the
    live-slot mask (counts, padding gather): fused into one layer's key scores at batch 8 x 4K it took 30 ms, 12 ms
    materialized."""
    return x.clone()


@materialized.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def config_head_dim(config) -> int:
    """A transformers config's attention head size: `head_dim` where the config has it, else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
