"""Encoder-decoder backend: a ModelRunner over a transformers seq2seq model (T5, BART, Marian, ...).

An encoder-decoder model reads its input ("source") with the encoder once and
writes its output with the decoder, one token after the other.  Speculative
decoding only ever concerns the decoder, so the runner *is* the decoder:

- ``set_source(ids)`` runs the encoder over the prompt and keeps its output;
  the cross-attention keys and values over it are computed by the first
  decoder forward and then kept for as long as the source stays.
- ``tokens`` are the decoder tokens cached in the decoder's self-attention;
  ``forward`` appends decoder tokens, ``rollback`` crops the self-attention
  cache only (the cross-attention cache depends on the source alone), and
  ``reset`` empties the self-attention cache but keeps the source.
- ``decoder_prompt()`` is what the decode loop takes as its "prompt": the
  decoder start token.  The tokens the loop generates after it are the model's
  output, exactly what ``model.generate`` would return after its start token.

``hidden()`` gives the decoder's final hidden states of the positions whose
logits the last forward returned, as HFRunner does: the output layer's input,
after the decoder's final norm (and T5's d_model ** -0.5 scaling where its
config says scale_decoder_outputs; BART adds its final_logits_bias after it).
``hidden_tail()`` gives the same rows: the decoder's prompt is its start token
alone, so there is no prompt's end worth keeping (``keep_hidden_rows`` is ignored).

Both caches live in one transformers ``EncoderDecoderCache`` (a DynamicCache
for self-attention, another for cross-attention).  Logits come back as fp32 on
the CPU whatever the model's dtype, as in specdec.backends.hf.

What the runner does not do: the logits processors a model's generation config
may ask ``generate`` for (BART's ``forced_bos_token_id`` / ``forced_eos_token_id``,
``no_repeat_ngram_size``, beam search); specdec decodes the model's own
distribution, greedy or sampled.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import BaseModelOutput

if TYPE_CHECKING:
    from transformers import PreTrainedModel

from specdec.backends.base import Capabilities, Footprint, Refusals, cannot_clone, checked_new_tokens, last_hidden
from specdec.backends.hf import (
    HFRunner,
    head_inputs,
    model_backend,
    model_footprint,
    own_rows,
    watch_head_input,
)
from specdec.errors import SpecdecError
from specdec.native.modelconfig import model_eos_token_ids, model_identity, model_max_context


def is_seq2seq(model: object) -> bool:
    """Whether `model` is a transformers encoder-decoder model (its config says is_encoder_decoder)."""
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def decoder_start_token_id(model: PreTrainedModel) -> int:
    """The token the decoder starts from, looked up as transformers' generate does: the generation
    config's decoder_start_token_id, the model config's, else the BOS token (T5: the pad id 0;
    BART: the EOS id 2)."""
    configs = (getattr(model, "generation_config", None), model.config)
    for name in ("decoder_start_token_id", "bos_token_id"):
        for config in configs:
            value = getattr(config, name, None)
            if value is not None:
                return int(value if isinstance(value, int) else value[0])
    raise SpecdecError(f"{type(model).__name__} names no decoder_start_token_id (nor a bos_token_id) "
                       "in its config: set one in config.json")


class Seq2SeqRunner(Refusals):  # no taps, no trees
    """The decoder of a transformers encoder-decoder model, with its own caches, over a source set once."""

    def __init__(self, model: PreTrainedModel, max_context: int | None = None) -> None:
        if not is_seq2seq(model):
            raise SpecdecError(f"{type(model).__name__} is not an encoder-decoder model (config.is_encoder_decoder)")
        if getattr(model, "main_input_name", "input_ids") != "input_ids":  # Whisper: audio features
            raise SpecdecError(f"{type(model).__name__} reads {model.main_input_name}, not token ids: "
                               "only text-to-text encoder-decoder models are supported")
        self.model = model.eval()
        # fp32 kernels differ between batch shapes
        self.capabilities = Capabilities(batch_invariant=False, hidden_states=watch_head_input(model))
        self._hidden: torch.Tensor | None = None  # [n, d_model]: the output layer's input in the last forward
        self.device = next(model.parameters()).device
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        # The decoder's window.  Models with learned (BART, mBART) or fixed-table (Marian, Pegasus)
        # positions stop at config.max_position_embeddings.  T5's relative positions fall into
        # log-spaced buckets that cover any distance and its config sets no limit, so there the
        # bound is 2**31 - 1 (model_max_context's default): long outputs get worse, they do not break.
        self.max_context = max_context or model_max_context(model)
        self.source_limit = model_max_context(model)  # the encoder's positions have the same limit
        self.start_token_id = decoder_start_token_id(model)
        # BART-style models can skip the lm head on positions nobody reads; T5's forward has no such option
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.source: list[int] | None = None
        self.encoder_outputs: BaseModelOutput | None = None
        self.tokens: list[int] = []
        self.cross_cache = DynamicCache()  # cross-attention keys/values over the source, filled once per source
        self.cache = EncoderDecoderCache(DynamicCache(), self.cross_cache)

    def decoder_prompt(self) -> list[int]:
        """The decode loop's prompt for this model: the decoder start token alone."""
        return [self.start_token_id]

    @torch.inference_mode()
    def set_source(self, source_ids: Sequence[int]) -> None:
        """Run the encoder over `source_ids` (the user's prompt) and start an empty decoder on it."""
        source_ids = [int(t) for t in source_ids]
        if not source_ids:
            raise SpecdecError("the prompt is empty: give at least one token of input")
        if len(source_ids) > self.source_limit:
            raise SpecdecError(f"the prompt has {len(source_ids)} tokens, more than the encoder's "
                               f"{self.source_limit} positions")
        input_ids = torch.tensor([source_ids], dtype=torch.long, device=self.device)  # [1, S]
        hidden = self.model.get_encoder()(input_ids=input_ids, return_dict=True).last_hidden_state  # [1, S, d_model]
        self.encoder_outputs = BaseModelOutput(last_hidden_state=hidden)
        self.source = source_ids
        self.cross_cache = DynamicCache()  # the old source's cross-attention is stale
        self.reset()

    @torch.inference_mode()
    def forward(self, new_tokens: Sequence[int], last_n: int | None = None) -> torch.Tensor:
        """Append decoder tokens; fp32 logits [n, V] for the last n of them (all when last_n is None)."""
        if self.encoder_outputs is None:
            raise SpecdecError("an encoder-decoder model needs its input first: call set_source(prompt ids) "
                               "before decoding")
        new_tokens = checked_new_tokens(new_tokens, len(self.tokens), self.max_context, "decoder tokens")
        decoder_ids = torch.tensor([new_tokens], dtype=torch.long, device=self.device)  # [1, n]
        extra = {"logits_to_keep": last_n or 0} if self._keeps_logits else {}  # 0 = every position
        with head_inputs() as seen:
            out = self.model(
                encoder_outputs=self.encoder_outputs,
                decoder_input_ids=decoder_ids,
                cache=self.cache,
                use_cache=True,
                **extra,
            )
        self.tokens.extend(new_tokens)
        logits = out.logits[0]  # [n or last_n, V]
        hidden = seen[-1][0] if seen else None  # [n or last_n, d_model]
        if last_n is not None:
            logits = logits[-last_n:]
            hidden = None if hidden is None else hidden[-last_n:]
        self._hidden = None if hidden is None else own_rows(hidden)
        return logits.float().cpu()  # [n, V]

    def hidden(self) -> torch.Tensor:
        """The decoder's final hidden states [n, d_model] fp32 of the last forward (see the module doc)."""
        return last_hidden(self._hidden, self)

    def keep_hidden_rows(self, n: int) -> None:
        """Accepted and ignored: this runner's hidden_tail is hidden()'s rows (ModelRunner.keep_hidden_rows)."""

    def hidden_tail(self) -> torch.Tensor:
        """hidden()'s rows: the decoder's prompt is its start token, so no more are worth keeping."""
        return self.hidden()

    # Keep the first n decoder tokens: HFRunner's rollback, as EncoderDecoderCache.crop crops the
    # self-attention cache only (the cross-attention over the source stays) and rollback(0) is reset().
    rollback = HFRunner.rollback
    _tree = None  # what HFRunner.rollback checks: this runner never holds a token tree

    def reset(self) -> None:
        """Empty the decoder's self-attention cache; the source and its cross-attention cache stay."""
        # EncoderDecoderCache marks a layer's cross-attention as computed when the given cache holds it
        self.cache = EncoderDecoderCache(DynamicCache(), self.cross_cache)
        self.tokens = []
        self._hidden = None

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return model_eos_token_ids(self.model)

    def footprint(self) -> Footprint:
        """The decoder's, from the config (ModelRunner.footprint): a cached decoder token costs its self-attention's
        keys and values, a source token its cross-attention's, the same per layer; one forward over the prompt."""
        return model_footprint(self.model, chunked=False, decoder=True)

    def expect(self, tokens: int) -> None:
        """Nothing to make room for: the caches grow by concatenation."""

    def trim(self, tokens: int) -> int:
        """Keep the first `tokens` decoder tokens (ModelRunner.trim); a longer cache is emptied (this runner reuses
        no prefix: the next request sets its own source), its memory freed."""
        if len(self.tokens) <= max(0, int(tokens)):
            return 0
        freed = len(self.tokens) * self.footprint().cache_bytes_per_token
        self.reset()
        return freed

    def clone(self) -> Seq2SeqRunner:
        raise cannot_clone(self)

    def describe(self) -> str:
        return model_backend(self.model)

    def identity(self) -> dict[str, Any]:
        return model_identity(type(self).__name__, self.model)
