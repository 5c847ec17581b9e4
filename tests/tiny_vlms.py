"""Tiny vision–language models for the VLM tests: random weights, a word-level tokenizer written here (offline)."""

from __future__ import annotations

import torch

WORDS = ["[PAD]", "[UNK]", "[BOS]", "[EOS]", "a", "photo", "of", "cat", "dog", "ring", "triangle", "square", "disc"]


def tokenizer():
    """A transformers fast tokenizer over :data:`WORDS` (a ``tokenizers`` WordLevel model; no files, no network)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(WORDS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.post_processor = processors.TemplateProcessing(single="[BOS] $A [EOS]",
                                                      special_tokens=[("[BOS]", 2), ("[EOS]", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]",
                                   eos_token="[EOS]")


_TEXT = dict(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             max_position_embeddings=16, bos_token_id=2, eos_token_id=3, pad_token_id=0)
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
               patch_size=8)


def hf_model(kind: str, seed: int = 0):
    """A random transformers ``CLIPModel`` / ``SiglipModel`` / ``Siglip2Model`` (32×32 images, patch 8, 2 layers)."""
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "clip":
        model = tf.CLIPModel(tf.CLIPConfig(text_config=_TEXT, vision_config=_VISION, projection_dim=24))
    elif kind == "siglip":
        model = tf.SiglipModel(tf.SiglipConfig(text_config=_TEXT, vision_config=_VISION))
        with torch.no_grad():  # the published checkpoints' values (log 10, -10) scaled to this tiny model
            model.logit_scale.fill_(2.3)
            model.logit_bias.fill_(-1.5)
    elif kind == "siglip2":
        model = tf.Siglip2Model(tf.Siglip2Config(text_config=_TEXT, vision_config=dict(_VISION, num_patches=16)))
        with torch.no_grad():
            model.logit_scale.fill_(2.3)
            model.logit_bias.fill_(-1.5)
    else:
        raise ValueError(kind)
    return model.eval()


def vlm(kind: str, seed: int = 0):
    import vitlens

    return vitlens.VisionLanguageModel(hf_model(kind, seed), tokenizer())
