"""The compiled decode forward (CachedLM.compile): torch.compile's graphs and the feeds they take. Only a
model loaded with compile=True reads this module."""
import torch

from .kernels import native_attention


def compiled_width(n):
    """On a GPU, the token width of the compiled graph that decodes n tokens: the next power of two. A
    graph per width met (gamma="auto" meets every width up to 17, trees more) would be captured in the
    middle of requests; padded rows repeat the last token (decode_rows), which costs less. (A CPU
    compiles one graph for every width above 1 instead: CachedLM.decode_rows.)"""
    return 1 << (n - 1).bit_length()


def graphs_compiled():
    """How many graphs torch.compile has made in this process (dynamo's count)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def compile_model(model, mode=None):
    """torch.compile the decode forward: static shapes (the caches are preallocated) but for the token
    width, one graph for 1 token (plain decoding) and one for any more on a CPU (decode_rows), a graph
    per width bucket on a GPU (`compiled_width`: γ+1 rounded up for a verify), each compiled on first
    use; the families mark each layer's parts as compile regions, traced and compiled once for all
    the layers of a graph.
    Prefill stays eager, as prompt lengths change from request to request. On CUDA the default
    mode captures CUDA graphs, which removes the per-kernel launch overhead of small decode steps."""
    # one cache entry per (width, cache shape); the default limit of 8 would fall back to eager
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    # marked here, not where it is defined: marking imports the compiler, which the package's import must not
    torch.compiler.assume_constant_result(native_attention)
    mode = mode or ("reduce-overhead" if model.device.type == "cuda" else "default")
    model.compiled_forward = torch.compile(model.forward, fullgraph=True, dynamic=False, mode=mode)
    model.graphs = 0
    return model


def graph_feed(model, feed):
    """The feed as the compiled forward's graphs take it. On a CPU one graph serves every width above
    1, its token dimension symbolic, since a graph per power of two of widths is slow to compile and
    feeds the padding's arithmetic too; there a lone request's chain goes as the tree it is, so that
    one graph serves its chains and trees (the tree path costs a CPU what a chain's does). On a GPU a
    graph per width bucket, not per width (compiled_width): the rest padded as decode_rows pads a row."""
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
    before = graphs_compiled()  # a forward that compiles is counted: decoding does not time its step
    if hidden or inputs is not None:
        out = model.compiled_forward(tokens, input_pos, None, layout, None, hidden, inputs)
        out = (out[0][:, :fed], out[1][:, :fed]) if hidden else out[:, :fed]
    elif layout is None:
        out = model.compiled_forward(tokens, input_pos)[:, :fed]
    else:
        out = model.compiled_forward(tokens, input_pos, None, layout)[:, :fed]
    model.graphs += graphs_compiled() - before
    return out
