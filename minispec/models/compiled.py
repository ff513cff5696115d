"""The compiled decode forward (CachedLM.compile): torch.compile's graphs and the feeds they take."""
import torch

from .kernels import native_attention


def compiled_width(n):
    """On a GPU, the token width of n tokens' graph: the next power of two (padding costs less than more graphs)."""
    return 1 << (n - 1).bit_length()


def compile_model(model, mode=None):
    """torch.compile the decode forward (prefill stays eager), static but for the token width; CUDA graphs on CUDA."""
    # one cache entry per (width, cache shape); the default limit of 8 would fall back to eager
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    # marked here, not where it is defined: marking imports the compiler, which the package's import must not
    torch.compiler.assume_constant_result(native_attention)
    mode = mode or ("reduce-overhead" if model.device.type == "cuda" else "default")
    model.compiled_forward = torch.compile(model.forward, fullgraph=True, dynamic=False, mode=mode)
    return model


def graph_feed(model, feed):
    """The feed as the compiled graphs take it: on a CPU one graph, its token width symbolic, for every width
    above 1 (a lone request's chain as the tree it is); on a GPU a graph per compiled_width, padded."""
    rows, n = feed.tokens.shape
    if n > 1 and model.device.type == "cpu":
        if feed.parents is None and rows == 1:
            return feed._replace(parents=[list(range(-1, feed.widths[0] - 1))])
        return feed
    width = compiled_width(n)
    if width == n:
        return feed
    tokens, inputs = (None if x is None else torch.cat([x, x[:, -1:].expand(-1, width - n, *x.shape[2:])], 1)
                      for x in (feed.tokens, feed.inputs))
    return feed._replace(tokens=tokens, inputs=inputs)


def decode_compiled(model, feed, hidden):
    """decode_rows through the compiled forward, from cache row 0."""
    fed = feed.tokens.shape[1]
    feed = graph_feed(model, feed)
    input_pos, layout = feed.input_pos(), feed.layout(model.cache_max_seq_len)
    # graphs guard on strides; a slice of a longer tensor has odd ones
    tokens, inputs = feed.tokens.clone(memory_format=torch.contiguous_format), feed.inputs
    # On a CPU the width is symbolic (a width 1 stays a graph of its own: dynamo specializes 1).
    if fed > 1 and model.device.type == "cpu":
        widthwise = [(tokens, 1), (input_pos, -1), (inputs, 1)]
        if layout is not None:
            widthwise += [(layout.positions, 1), (layout.window, 1)]
        for tensor, dim in widthwise:
            if tensor is not None:
                torch._dynamo.maybe_mark_dynamic(tensor, dim % tensor.dim())
    out = model.compiled_forward(tokens, input_pos, None, layout, None, hidden, inputs)
    return (out[0][:, :fed], out[1][:, :fed]) if hidden else out[:, :fed]
