"""int8 transformers models for the CPU: fast, and batch-invariant so speculative output stays exact.

Every ``nn.Linear`` of the model (``lm_head`` included) becomes an
:class:`Int8Linear`: weight-and-activation 8-bit quantization ("W8A8" with
per-token activation scales, as in LLM.int8() -- Dettmers et al. 2022 -- and
ZeroQuant -- Yao et al. 2022):

- weights: int8, symmetric, one scale per output channel (max |w| / 127);
- activations: each row (token) x of the input is quantized on its own,
  symmetric over [-s, s] with s = max |x|, to 7 bits (integers in
  [-63, 63]); the products are summed exactly in int32 and turned back into
  floats with the two scales.  The kernel is specdec's own
  (:mod:`specdec.native.kernels.int8`: C, AVX-512 VNNI or AVX2, with a portable
  fallback, all giving the same bits); why 7
  bits: two AVX2 ``vpmaddubsw`` results then add up in 16-bit registers
  without saturating, which makes a multi-token verification a third faster.

**Batch invariance.**  Speculative greedy output equals plain greedy output
only if a token's logits do not depend on how many tokens were evaluated
with it (see the README).  A dynamic int8 linear that picks one
quantization range for the whole input tensor (``torch.ao``'s, fbgemm's)
breaks this: a token's result depends on the other rows of the batch.  Here
each row's scale is its own, integer accumulation is exact (its order does
not matter), and the dequantization is the same elementwise expression for
every output, so an Int8Linear is bitwise invariant to the batch size, the
tiling and the threads (tested).

Attention is the other op that sees several tokens at once.  PyTorch's
scaled-dot-product attention takes other paths for one query than for many
(transformers even reshapes a single grouped query), so :func:`rowwise_attention`
(registered with transformers as ``"specdec_rowwise"``) runs specdec's own
attention kernel (:func:`specdec.native.kernels.attention.causal`), which computes
every query row on its own, in a fixed order of operations: a row's result is
the same bits in a one-token step, a k-token verification and a prefill, on
every CPU path.  (It replaced one PyTorch call per query row, which cost about
70 us a row per layer at 250 tokens of context: a tenth of an 8-token
verification.)  Norms, rotary embeddings, activations and residuals are
per-token operations.  The result is checked bitwise by the tests: logits of
a token evaluated alone == inside a k-token forward, on random
forward/rollback sequences.

**Caching.**  Quantizing a model takes seconds to a minute; :func:`save_int8`
writes the int8 weights, their scales and the remaining fp32 tensors to a
folder (safetensors) that :func:`load_int8` turns back into the same model in
seconds.  The numbers are identical: packing is a pure function of the int8
weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

from specdec.backends.tree import Tree
from specdec.native import kernels
from specdec.vocab import saved_tokenizer

FORMAT = "specdec-int8-v1"  # written into saved folders; bump when the format or the numerics change
ATTENTION = "specdec_rowwise"
WEIGHTS_FILE = "model.safetensors"
_INDEX_FILE = "specdec-int8.json"
# The token tree whose forward runs in this thread (tree_attention), else None: rowwise_attention's rows
_TREE: ContextVar[Tree | None] = ContextVar("specdec_tree", default=None)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (int8 values [N, K], fp32 scales [N]) with w ≈ values * scale."""
    w = weight.detach().float()  # [N, K]
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)  # [N]; an all-zero row gets a harmless scale
    values = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)  # [N, K]
    return values, scale


class Int8Linear(nn.Module):
    """y = x W^T + b with int8 W (per output channel) and per-token int8 x, batch-invariant (see module doc)."""

    scale: torch.Tensor  # buffers: typed here, as nn.Module types an attribute it holds only as Tensor | Module
    bias: torch.Tensor | None

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = (int(d) for d in qweight.shape)
        self.register_buffer("scale", scale.float().contiguous(), persistent=False)  # [N]
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)
        # The int8 values until the kernel's layout replaces them (at the first forward, or pack_all):
        # a linear that is fused into another is never packed.
        self._qweight: torch.Tensor | None = qweight.to(torch.int8).contiguous()  # [N, K]
        self._packed: torch.Tensor | None = None  # the kernel's tiled layout of the same values

    def pack(self) -> None:
        """Lay the weights out for the kernel (its copy replaces the int8 values)."""
        if self._packed is None:
            assert self._qweight is not None  # one of the two is always kept
            self._packed = kernels.int8.pack(self._qweight)
            self._qweight = None

    @property
    def packed(self) -> bool:
        return self._packed is not None

    def packed_weight(self) -> torch.Tensor:
        """The kernel's layout of the weights (packing them first if they are not yet)."""
        self.pack()
        assert self._packed is not None
        return self._packed

    def use_packed(self, packed: torch.Tensor) -> None:
        """Take the kernel's layout of these weights as packed before (a memory-mapped cache: read only)."""
        shape = (-(-self.out_features // kernels.int8.TILE) * kernels.int8.TILE, kernels.int8.padded(self.in_features))
        if packed.dtype != torch.int8 or tuple(packed.shape) != shape:
            raise ValueError(f"packed int8 weights must be int8 {list(shape)}, got {packed.dtype} {list(packed.shape)}")
        self._packed = packed
        self._qweight = None

    @classmethod
    def from_packed(cls, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                    in_features: int) -> Int8Linear:
        """A linear over weights already in the kernel's layout (use_packed): no int8 values needed."""
        linear = cls(torch.empty(out_features, in_features, dtype=torch.int8), scale, bias)  # never read
        linear.use_packed(packed)
        return linear

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        values, scale = quantize_weight(linear.weight)
        return cls(values, scale, linear.bias)

    def int8_weight(self) -> torch.Tensor:
        """The int8 weight values [N, K] (read back from the kernel's layout once packed)."""
        if self._qweight is not None:
            return self._qweight
        assert self._packed is not None  # one of the two is always kept
        return kernels.int8.unpack(self._packed, self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features)  # [M, K]
        if rows.dtype != torch.float32:
            rows = rows.float()
        if self._packed is None:
            self.pack()
        assert self._packed is not None
        y = kernels.int8.linear(rows, self._packed, self.in_features, self.scale, self.bias)  # [M, N]
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    def nbytes(self) -> int:
        """The bytes its kernel reads: the int8 weights (packed once packed), scales and bias."""
        tensors = [self._packed if self._packed is not None else self._qweight, self.scale, self.bias]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def pack_all(linears: Iterable[Int8Linear], threads: int = 2) -> None:
    """Pack many Int8Linears at once, on `threads` threads."""
    # Largest first, so that the longest packing (an lm_head) overlaps the others.
    todo = sorted((lin for lin in linears if not lin.packed), key=lambda lin: -lin.out_features * lin.in_features)
    if threads <= 1 or len(todo) < 2:
        for lin in todo:
            lin.pack()
        return
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(Int8Linear.pack, todo))


@contextmanager
def tree_attention(tree: Tree) -> Iterator[None]:
    """Inside the block, rowwise_attention in this thread computes the new rows as this token tree's nodes
    (kernels.attention.causal's tree mode; the forward's attention mask is ignored, as always)."""
    token = _TREE.set(tree)
    try:
        yield
    finally:
        _TREE.reset(token)


def rowwise_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention, each query row on its own (specdec.native.kernels.attention: exact, batch-invariant).

    query: [1, H, q, D]; key, value: [1, H_kv, L, D] (the cache, the q new positions last).
    Row i sits at position L - q + i and sees keys up to it (the last `sliding_window`
    of them on sliding-window layers); inside tree_attention the q new rows are that
    tree's nodes instead.  Returns [1, q, H, D].  Batch size 1 only: the decode loop
    runs one sequence per runner, with no padding.
    """
    if query.shape[0] != 1:
        raise ValueError("rowwise attention runs one sequence at a time")
    _, heads, q_len, d = query.shape
    scale = scaling if scaling is not None else d ** -0.5
    out = kernels.attention.causal(query[0].float(), key[0].float(), value[0].float(), key.shape[2] - q_len,
                                   scale, sliding_window, tree=_TREE.get())  # [q, H D]
    return out.view(1, q_len, heads, d), None


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, rowwise_attention)


def _linear_names(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _use_rowwise_attention(model: PreTrainedModel) -> None:
    _register_attention()
    model.config._attn_implementation = ATTENTION
    text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else None
    if text_config is not None and text_config is not model.config:
        text_config._attn_implementation = ATTENTION


def quantize_model(model: PreTrainedModel) -> PreTrainedModel:
    """Turn a float transformers causal LM into an int8 one, in place (and return it).

    Every nn.Linear becomes an Int8Linear; attention becomes rowwise_attention.  The
    float weights of the linears are dropped (a tied lm_head keeps the embedding).
    """
    for name in _linear_names(model):
        linear = model.get_submodule(name)
        assert isinstance(linear, nn.Linear)  # what _linear_names names
        _set_module(model, name, Int8Linear.from_linear(linear))
    model.float()  # embeddings and norms in fp32
    _use_rowwise_attention(model)
    model.eval()
    model.requires_grad_(False)
    return model


def is_int8(model: nn.Module) -> bool:
    return any(isinstance(m, Int8Linear) for m in model.modules())


def save_int8(model: PreTrainedModel, tokenizer: Any, out_dir: Path, source: dict | None = None) -> None:
    """Write a quantized model (and its tokenizer) to `out_dir` for :func:`load_int8`."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    linears: dict[str, dict[str, bool]] = {}
    for name, module in model.named_modules():
        if isinstance(module, Int8Linear):
            tensors[f"{name}.qweight"] = module.int8_weight()
            tensors[f"{name}.scale"] = module.scale
            if module.bias is not None:
                tensors[f"{name}.bias"] = module.bias
            linears[name] = {"bias": module.bias is not None}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        if any(name.startswith(f"{linear}.") for linear in linears):
            continue
        if tensor.data_ptr() in seen:  # a tied tensor is stored once (safetensors refuses shared storage)
            continue
        seen.add(tensor.data_ptr())
        tensors[name] = tensor.contiguous()
    save_file(tensors, str(out_dir / WEIGHTS_FILE))
    model.config.save_pretrained(out_dir)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    # Written last: a folder with this file is complete.
    (out_dir / _INDEX_FILE).write_text(json.dumps({"format": FORMAT, "linears": linears, **(source or {})}, indent=1))


def saved_index(folder: Path) -> dict | None:
    """The index of a complete saved int8 folder of the current format, else None."""
    try:
        index = json.loads((Path(folder) / _INDEX_FILE).read_text())
    except (OSError, ValueError):
        return None
    return index if index.get("format") == FORMAT else None


def load_int8(folder: Path) -> tuple[PreTrainedModel, Any]:
    """Load a folder written by :func:`save_int8`: (int8 model, tokenizer)."""
    from accelerate import init_empty_weights
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    folder = Path(folder)
    index = saved_index(folder)
    if index is None:
        raise ValueError(f"{folder} holds no int8 model of format {FORMAT}")
    config = AutoConfig.from_pretrained(folder)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_file(str(folder / WEIGHTS_FILE))
    for name, info in index["linears"].items():
        bias = tensors.pop(f"{name}.bias") if info["bias"] else None
        _set_module(model, name, Int8Linear(tensors.pop(f"{name}.qweight"), tensors.pop(f"{name}.scale"), bias))
    missing, unexpected = model.load_state_dict(tensors, assign=True, strict=False)
    if unexpected:
        raise ValueError(f"{folder}: unexpected tensors {unexpected[:3]}")
    still_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if still_meta and getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
        still_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if still_meta:
        raise ValueError(f"{folder}: no saved values for {still_meta[:3]}")
    try:
        model.generation_config = GenerationConfig.from_pretrained(folder)
    except OSError:
        pass
    _use_rowwise_attention(model)
    model.eval()
    model.requires_grad_(False)
    return model, saved_tokenizer(folder)
