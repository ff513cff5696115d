"""The one interface through which the models reach kernels that are not PyTorch's own operations. A
backend is chosen once, at load: `PyTorch`, whose every hook declines, or minispec's native CPU kernels
(minispec/native), a subclass. The models compute with PyTorch's operations wherever a hook declines."""


class PyTorch:
    """PyTorch's operations everywhere: no kernel of a backend's own, no huge pages, no fused layers."""

    def float_kernel(self, dtype):
        """Whether CPU products of this dtype run float_product on float_pack'ed weights [N, K]."""
        return False

    def float_pack(self, weight):
        raise NotImplementedError

    def float_product(self, x, packed, bias, features):
        """x [M, K] (contiguous) @ the packed weight's transpose + bias -> [M, features]."""
        raise NotImplementedError

    def attends(self):
        """Whether attention over a KV cache on a CPU runs `attend`."""
        return False

    def attend(self, q, k, v, mask, slots, scale):
        """attend_cache of q [B, H, R, d] float32, every row alone; slots: each position's slot (trees) or None."""
        raise NotImplementedError

    def rms_norm(self, x, weight, eps):
        """RMSNorm of x by weight; None where the backend has no kernel for these tensors."""
        return None

    def keep(self, caches, row, slots, length):
        """CachedLM.keep's move over every cache in one call; False where the backend has none."""
        return False

    def takes_quantized(self, in_features, group, device):
        """Whether quantized_product takes a layer of this width and group size here."""
        return False

    def pack_quantized(self, q, scales, offsets):
        """A stored quantized weight as quantized_product reads it: a layer's (weight, scales, offsets, steps)."""
        raise NotImplementedError

    def quantized_product(self, x, weight, scales, offsets, steps, group):
        """x [M, K] float32 @ a pack_quantized weight's transpose -> [M, N or more] float32."""
        raise NotImplementedError

    def quantized_rows(self, tokens, weight, scales, offsets, steps):
        """Rows `tokens` of a pack_quantized weight in the stored form (q, scales, offsets): an embedding's lookup."""
        raise NotImplementedError

    def fused_llama(self, model, x):
        """A function computing all of a Llama model's layers in one call for this forward, or None."""
        return None

    def in_huge_pages(self, modules):
        """Move the modules' CPU buffers into huge pages; the bytes moved."""
        return 0

    def to_huge_pages(self, tensors, place):
        """Copy `tensors` into huge pages, handing copy i to place(i, copy); the bytes moved."""
        return 0


PYTORCH = PyTorch()
_current = None
_choose = None  # what current() takes when no load chose: minispec.native offers its own choice


def offer(choose):
    """Make `choose()` (-> a backend) the choice current() takes if no backend was chosen yet."""
    global _choose
    _choose = choose


def use(backend):
    """Choose `backend` for every model from now on."""
    global _current
    _current = backend
    return backend


def current():
    """The chosen backend (at first use, where no load chose one: what was offered, else PyTorch's)."""
    return _current if _current is not None else use(_choose() if _choose else PYTORCH)
