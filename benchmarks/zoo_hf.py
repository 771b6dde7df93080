"""Hugging Face transformers in the zoo: architectures built from small configs (nothing downloaded), fed dict
batches as a Trainer feeds them, trained on the model's own loss (`model(**batch).loss`) with AdamW at 1e-3.

Text: 2 layers, hidden 64, 4 heads, a 256-token vocabulary, batch 4 of 32 tokens. Vision: 32 px images.
Audio: Wav2Vec2 on 0.1 s of 16 kHz samples with CTC labels, Whisper on 64 frames of 16 mel bins.
"""

from __future__ import annotations

import torch

from zoo_cases import Case, adamw, dict_own, images, learnable, tokens

VOCAB, T, N = 256, 32, 4
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64)
LLAMA_LIKE = dict(SMALL, num_key_value_heads=2, head_dim=16)
ENC_DEC = dict(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
               pad_token_id=1, decoder_start_token_id=2, eos_token_id=2, bos_token_id=0)
TEXT_KEYS = ("input_ids", "attention_mask", "labels")

# name -> (model class, config class, config kwargs, batch maker)
MODELS = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64)),
    "llama": ("LlamaForCausalLM", "LlamaConfig", LLAMA_LIKE),
    "mistral": ("MistralForCausalLM", "MistralConfig", LLAMA_LIKE),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", LLAMA_LIKE),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", LLAMA_LIKE),
    "phi": ("PhiForCausalLM", "PhiConfig", SMALL),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", SMALL),
    "opt": ("OPTForCausalLM", "OPTConfig", dict(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                                num_attention_heads=4, max_position_embeddings=64,
                                                word_embed_proj_dim=64)),
    "bloom": ("BloomForCausalLM", "BloomConfig", dict(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4)),
    "falcon": ("FalconForCausalLM", "FalconConfig", dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                                         num_attention_heads=4)),
    "bert_mlm": ("BertForMaskedLM", "BertConfig", SMALL),
    "roberta_mlm": ("RobertaForMaskedLM", "RobertaConfig", dict(SMALL, max_position_embeddings=72)),
    "distilbert_mlm": ("DistilBertForMaskedLM", "DistilBertConfig", dict(vocab_size=VOCAB, dim=64, hidden_dim=128,
                                                                         n_layers=2, n_heads=4,
                                                                         max_position_embeddings=64)),
    "albert_mlm": ("AlbertForMaskedLM", "AlbertConfig", dict(SMALL, embedding_size=32)),
    "electra_mlm": ("ElectraForMaskedLM", "ElectraConfig", dict(SMALL, embedding_size=32)),
    "deberta_v2_mlm": ("DebertaV2ForMaskedLM", "DebertaV2Config", SMALL),
    "bert_cls": ("BertForSequenceClassification", "BertConfig", dict(SMALL, num_labels=3)),
    "t5": ("T5ForConditionalGeneration", "T5Config", dict(vocab_size=VOCAB, d_model=64, d_ff=128, d_kv=16,
                                                          num_layers=2, num_heads=4, decoder_start_token_id=0)),
    "bart": ("BartForConditionalGeneration", "BartConfig", ENC_DEC),
    "marian": ("MarianMTModel", "MarianConfig", ENC_DEC),
    "vit": ("ViTForImageClassification", "ViTConfig", dict(image_size=32, patch_size=8, hidden_size=64,
                                                           num_hidden_layers=2, num_attention_heads=4,
                                                           intermediate_size=128, num_labels=10)),
    "convnext": ("ConvNextForImageClassification", "ConvNextConfig", dict(hidden_sizes=[16, 32, 64, 128],
                                                                          depths=[1, 1, 1, 1], num_labels=10)),
    "swin": ("SwinForImageClassification", "SwinConfig", dict(image_size=32, patch_size=4, embed_dim=16,
                                                              depths=[1, 1], num_heads=[2, 2], window_size=4,
                                                              num_labels=10)),
    "wav2vec2_ctc": ("Wav2Vec2ForCTC", "Wav2Vec2Config", dict(vocab_size=32, hidden_size=32, num_hidden_layers=2,
                                                              num_attention_heads=2, intermediate_size=64,
                                                              conv_dim=(16, 16), conv_stride=(5, 2),
                                                              conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                                                              num_conv_pos_embedding_groups=2, pad_token_id=0)),
    "whisper": ("WhisperForConditionalGeneration", "WhisperConfig",
                dict(vocab_size=128, num_mel_bins=16, encoder_layers=1, decoder_layers=1, d_model=32,
                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                     max_source_positions=32, max_target_positions=32, pad_token_id=0, bos_token_id=1,
                     eos_token_id=2, decoder_start_token_id=1)),
}


def _batch(name: str):
    if name == "bert_cls":
        ids = tokens(N, T, VOCAB, keys=("input_ids", "attention_mask"))

        def bert_cls(g):  # the label: the first token's class (of 3), which the sequence's chain carries on
            b = ids(g)
            return {**b, "labels": b["input_ids"][:, 0] % 3}
        return learnable(bert_cls)
    if name in ("vit", "convnext", "swin"):
        xy = images(N, 32)
        return learnable(lambda g: dict(zip(("pixel_values", "labels"), xy(g))))
    if name == "wav2vec2_ctc":
        return lambda g: {"input_values": torch.randn(N, 1600, generator=g),
                          "labels": torch.randint(1, 32, (N, 8), generator=g)}
    if name == "whisper":
        return lambda g: {"input_features": torch.randn(N, 16, 64, generator=g),
                          "labels": torch.randint(3, 128, (N, 8), generator=g)}
    return tokens(N, T, VOCAB, keys=TEXT_KEYS)


def _case(name: str, model_cls: str, config_cls: str, kw: dict) -> Case:
    def build():
        import transformers
        config = getattr(transformers, config_cls)(**kw)
        return getattr(transformers, model_cls)(config)
    return Case(f"hf/{name}", "transformers", build, _batch(name), dict_own, adamw(1e-3), note=model_cls)


def cases() -> list[Case]:
    return [_case(n, *spec) for n, spec in MODELS.items()]
